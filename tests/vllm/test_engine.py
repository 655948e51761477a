"""``vllm.LLM`` on tiny checkpoints: greedy generation against ``transformers``, the CPU
backend's repacking of weights after loading, and sparse patches sent through
``collective_rpc`` to the worker extension."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

pytest.importorskip("vllm")

from tests.vllm.support.checkpoints import read_checkpoint, write_checkpoint_tensors
from tests.vllm.support.engine import (
    assert_same_generations,
    differ,
    hf_greedy,
    running_engine,
    vllm_greedy,
)
from tests.vllm.support.extension import encode
from tests.vllm.support.patches import Patch, apply_to_checkpoint, sparse, vllm_load
from tests.vllm.support.repack import transformed_weights

LINEAR_WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def patched_checkpoint(source: Path, patches: list[Patch], directory: Path) -> Path:
    """The checkpoint at `source` with `patches` applied, written to `directory`."""
    return write_checkpoint_tensors(
        source, apply_to_checkpoint(read_checkpoint(source), patches), directory
    )


def parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def expected_repacked(name: str, tied: bool) -> str | None:
    """What the CPU backend does to a weight after loading (see FINDINGS.md), by name."""
    if name.endswith(LINEAR_WEIGHTS) or name.endswith("mlp.gate.weight"):
        return "transformed after loading: shape"  # replaced by an empty Parameter
    if name.endswith(("experts.w13_weight", "experts.w2_weight")):
        return "transformed after loading: attributes"  # permuted into the kernel's layout
    if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
        return "read through a kernel-owned copy"  # oneDNN keeps its own packed copy
    return None


@pytest.mark.parametrize(
    ("arch", "hazard"),
    [
        ("qwen2", "model.embed_tokens.weight"),  # tied: lookups change, logits do not
        ("qwen3_moe", "model.layers.0.mlp.experts.1.up_proj.weight"),  # lands in kernel layout
    ],
)
def test_default_cpu_engine_repacks_weights_after_loading(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, hazard: str
) -> None:
    model_dir = checkpoints[arch]
    shape = tuple(read_checkpoint(model_dir)[hazard].shape)
    patch = sparse(hazard, shape, density=0.3, seed=7)
    with running_engine(model_dir) as llm:
        assert_same_generations(vllm_greedy(llm), hf_greedy(model_dir))

        found = llm.apply_model(transformed_weights)[0]
        for name in llm.apply_model(parameter_names)[0]:
            expected = expected_repacked(name, tied=arch == "qwen2")
            if expected is None:
                assert name not in found, f"{name}: {found.get(name)}"
            else:
                assert found.get(name, "").startswith(expected), f"{name}: {found.get(name)}"

        # What a checkpoint-layout patch does to such a weight without patchctx's refusal:
        # vLLM's own function loads it, and the engine then disagrees with the patched model.
        llm.apply_model(lambda m: vllm_load(m, [patch]))
        after = vllm_greedy(llm)
    truth = hf_greedy(patched_checkpoint(model_dir, [patch], tmp_path / "patched"))
    assert differ(truth, hf_greedy(model_dir)), "the hazard patch should change the model"
    assert differ(after, truth), "the CPU engine now follows checkpoint-layout patches"


def non_expert_patches(model_dir: Path, seed: int) -> list[Patch]:
    """Sparse patches on every checkpoint tensor that the CPU engine keeps in checkpoint layout
    once `keep_layout` is on (MoE experts stay repacked)."""
    checkpoint = read_checkpoint(model_dir)
    return [
        sparse(name, tuple(tensor.shape), density=0.05, seed=seed + i)
        for i, (name, tensor) in enumerate(sorted(checkpoint.items()))
        if ".experts." not in name
    ]


@pytest.mark.parametrize(
    ("arch", "multiprocess"),
    [("qwen2", False), ("qwen3_moe", False), ("qwen2", True)],
    ids=["qwen2-in-process", "qwen3_moe-in-process", "qwen2-multiprocess"],
)
def test_sparse_patches_through_collective_rpc_match_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, multiprocess: bool
) -> None:
    model_dir = checkpoints[arch]
    patches = non_expert_patches(model_dir, seed=11)
    with running_engine(model_dir, multiprocess=multiprocess, keep_layout=True) as llm:
        assert llm.collective_rpc("patchctx_test_layout_kept") == [True]
        before = vllm_greedy(llm)
        loaded = llm.collective_rpc("patchctx_test_apply", args=(encode(patches),))
        after = vllm_greedy(llm)
        if not multiprocess:
            still_transformed = set(llm.apply_model(transformed_weights)[0])
    assert len(loaded) == 1 and loaded[0]
    assert_same_generations(before, hf_greedy(model_dir))
    truth = hf_greedy(patched_checkpoint(model_dir, patches, tmp_path / "patched"))
    assert differ(before, truth)
    assert_same_generations(after, truth)
    if not multiprocess:
        assert all(".experts." in name for name in still_transformed), still_transformed
