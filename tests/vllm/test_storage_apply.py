"""The storage path's apply on a real ``vllm.LLM``: what it checks is read from the model as it
is in the pause, not as it was when the update was prepared, and reading it costs one walk."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from patchctx import StoragePublisher
from tests.vllm.support.checkpoints import read_checkpoint
from tests.vllm.support.engine import running_engine

pytestmark = pytest.mark.vllm

EXTENSION = "patchctx.vllm.StorageWorkerExtension"
LAYER = "model.layers.0.mlp.down_proj"  # a checkpoint tensor loaded as it is (not fused)


def prepare(llm: Any, store: Path) -> None:
    llm.collective_rpc("patchctx_storage_prepare", args=(str(store),))
    deadline = time.monotonic() + 120
    while llm.collective_rpc("patchctx_storage_status")[0]["state"] == "preparing":
        assert time.monotonic() < deadline, "the prepare did not end"
        time.sleep(0.01)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def relayout(model: nn.Module) -> None:
    """What a kernel's post-load step does: the weight replaced by a column-major copy."""
    from vllm.model_executor.utils import replace_parameter

    layer: Any = model.get_submodule(LAYER)
    layer.test_original = layer.weight
    replace_parameter(layer, "weight", layer.weight.detach().t().contiguous().t())


def restore(model: nn.Module) -> None:
    layer: Any = model.get_submodule(LAYER)
    layer.weight = layer.test_original


def test_a_weight_transformed_between_prepare_and_apply_is_refused_then_applies(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = checkpoints["qwen2"]
    checkpoint = read_checkpoint(model_dir)
    store = tmp_path / "store"
    publisher = StoragePublisher(store)
    publisher.publish(checkpoint)  # version 1: the checkpoint the engine loads
    with running_engine(model_dir, keep_layout=True, worker_extension_cls=EXTENSION) as llm:
        prepare(llm, store)
        assert llm.collective_rpc("patchctx_storage_apply")[0]["version"] == 1
        state = dict(checkpoint)
        name = f"{LAYER}.weight"
        changed = state[name].clone()
        changed.view(-1)[::97] += 1.0
        state[name] = changed
        assert publisher.publish(state).base_version == 1  # version 2: a delta

        # Prepared while the weight is as loaded; transformed before the apply.
        prepare(llm, store)
        before = llm.apply_model(weights)[0]
        llm.apply_model(relayout)
        [refused] = llm.collective_rpc("patchctx_storage_apply")
        assert not refused["ok"] and refused["version"] == 1
        message = refused["error"]["message"]
        assert name in message and "replaced after loading (strides" in message, message
        llm.apply_model(restore)
        after = llm.apply_model(weights)[0]
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before), "a weight changed"

        # The same update, prepared again, applies to the weight as loaded: the dense truth.
        prepare(llm, store)
        [applied] = llm.collective_rpc("patchctx_storage_apply")
        assert applied["ok"] and applied["version"] == 2 and applied["replayed"] >= 1
        now = llm.apply_model(weights)[0]
        assert torch.equal(now[name], changed)
        assert all(torch.equal(now[k], before[k]) for k in before if k != name)


def test_attribute_reads_what_getattr_reads_on_every_module_of_a_vllm_model(
    checkpoints: dict[str, Path],
) -> None:
    from patchctx.vllm._walk import ModelWalk, attribute

    names = ("weight", "bias", "quant_method", "cpu_linear", "_patchctx_repack", "training")

    def compare(model: nn.Module) -> list[str]:
        wrong = []
        walk = ModelWalk.of(model)
        if [n for n, _ in walk.unique_modules()] != [n for n, _ in model.named_modules()]:
            wrong.append("unique_modules")
        for prefix, module in walk.modules:
            own = [*vars(module), *dict(module.named_parameters(recurse=False))]
            for local in (*names, *own, *dict(module.named_children())):
                if attribute(module, local) is not getattr(module, local, None):
                    wrong.append(f"{prefix}.{local}")
        return wrong

    with running_engine(checkpoints["qwen2"], worker_extension_cls=EXTENSION) as llm:
        assert llm.apply_model(compare)[0] == []
