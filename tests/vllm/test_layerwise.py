"""Dense patches inside vLLM's layerwise reload (``initialize_layerwise_reload`` ...
``finalize_layerwise_reload``, what vLLM requires for dense online updates): the worker hands
them to vLLM's buffering loaders as the checkpoint tensors they are, and the finalized model
equals one freshly loaded from the patched checkpoint; sparse patches are refused before
anything is written, instead of leaving meta parameters behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from patchctx import InvalidPatchError
from patchctx.vllm import keep_checkpoint_layout
from patchctx.vllm._apply import WorkerPatcher, layerwise_reload_active
from tests.vllm.support.checkpoints import (
    checkpoint_aliases,
    load_model,
    model_state,
    read_checkpoint,
    vllm_config,
    write_checkpoint_tensors,
)
from tests.vllm.support.patches import apply_to_checkpoint, dense, sparse


@pytest.mark.usefixtures("single_rank")
def test_dense_patches_inside_vllms_layerwise_reload(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.utils import initialize_model

    model_dir = checkpoints["qwen2"]
    checkpoint = read_checkpoint(model_dir)
    aliases = checkpoint_aliases(checkpoint)
    # A full dense update (every tensor; the embedding under its tied LM-head name).
    patches = [
        dense(aliases.get(n, "lm_head.weight" if "embed" in n else n), tuple(t.shape), seed=i)
        for i, (n, t) in enumerate(sorted(checkpoint.items()))
    ]
    config = vllm_config(model_dir)
    patcher = WorkerPatcher(version=0)
    # Post-processing (re-run by finalization) keeps checkpoint layout, as in a patchable
    # CPU engine; the model was loaded without it, like a GPU model without repacking.
    with set_current_vllm_config(config), keep_checkpoint_layout():
        model: Any = initialize_model(config)
        model.load_weights(checkpoint.items())
        initialize_layerwise_reload(model)
        assert layerwise_reload_active(model)
        one = sparse("model.norm.weight", (64,), density=0.1, seed=1)
        with pytest.raises(InvalidPatchError, match="layerwise reload holds them as meta"):
            patcher.apply(model, [patches[0], one], base_version=0, target_version=1)
        stats = patcher.apply(model, patches, base_version=0, target_version=1)
        finalize_layerwise_reload(model, config.model_config)
    assert not layerwise_reload_active(model)
    assert stats["version"] == patcher.version == 1
    state = model_state(model)
    assert not [name for name, p in state.items() if p.is_meta]
    patched = apply_to_checkpoint(checkpoint, patches, aliases)
    expected = model_state(load_model(write_checkpoint_tensors(model_dir, patched, tmp_path)))
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
