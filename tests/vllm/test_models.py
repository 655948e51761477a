"""Whole vLLM models (tiny Qwen2, Llama, Qwen3-MoE, Mixtral checkpoints from ``transformers``)
at TP=1 and TP=2: rounds of mixed dense and sparse patches through ``patchctx.vllm``'s worker
extension give the same parameters as a fresh vLLM model loaded from the patched checkpoint
(and as vLLM's own function); `audit_model` counts per model, in checkpoint layout and as the
default CPU engine holds the model; patches into transformed weights are refused."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from patchctx.vllm import tied_aliases
from tests.vllm.support.checkpoints import (
    ARCHITECTURES,
    TIED,
    load_model,
    model_job,
    read_checkpoint,
)
from tests.vllm.support.dist import Results, run_tp
from tests.vllm.support.patches import (
    ModelWorker,
    apply_to_checkpoint,
    patchctx_load,
    sparse,
    vllm_load,
)

ModelResults = Callable[[int], list[Results]]

# (replayable, masked, unsupported) per architecture, from `audit_model`:
# in checkpoint layout every name is replayable (each loader writes views with copy_);
CHECKPOINT_LAYOUT = {
    "qwen2": (26, 0, 0),
    "llama": (21, 0, 0),
    "qwen3_moe": (45, 0, 0),
    "mixtral": (41, 0, 0),
}
# as the default CPU engine holds the model, every name that reaches a prepacked linear
# weight, a repacked expert or a prepacked LM head (and the embedding tied to it) is refused.
ENGINE_LAYOUT = {
    "qwen2": (11, 0, 15),  # 14 linear, the tied embedding
    "llama": (6, 0, 15),  # 14 linear, lm_head
    "qwen3_moe": (10, 0, 35),  # 10 linear incl. the router, 24 experts, lm_head
    "mixtral": (6, 0, 35),  # 10 linear incl. the router, 24 experts, lm_head
}


@pytest.fixture(scope="module")
def model_results(checkpoints: dict[str, Path]) -> ModelResults:
    """Every architecture's results at one TP size, computed once (TP=2: one launch)."""
    dirs = {arch: str(path) for arch, path in checkpoints.items()}

    @functools.cache
    def at(tp: int) -> list[Results]:
        return run_tp(model_job, tp, {"model_dirs": dirs})

    return at


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_patch_rounds_equal_a_model_loaded_from_the_patched_checkpoint(
    model_results: ModelResults, tp: int, arch: str
) -> None:
    for rank, rank_results in enumerate(model_results(tp)):
        truth = {
            k.split("/", 2)[2]: v for k, v in rank_results.items() if k.startswith(f"{arch}/truth/")
        }
        assert truth
        for variant in ("patchctx", "vllm", "masked"):
            for name, expected in truth.items():
                got = rank_results[f"{arch}/{variant}/{name}"]
                assert torch.equal(got, expected), f"rank {rank} {variant}: {name}"
        counts = rank_results[f"{arch}/routes"].tolist()
        held, sparse_names, sparse_held, patched, replayed, loader_calls = counts
        # Every name patched sparsely recorded its route; later rounds replay (a name patched
        # densely in between keeps its route: the storage is the same). Names only ever
        # patched densely may hold one too, learnt by a dry run.
        assert sparse_held == sparse_names <= held <= patched, counts
        assert replayed >= held // 2 and loader_calls > 0, counts


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_audit_counts_in_checkpoint_layout_and_on_the_default_cpu_engine(
    model_results: ModelResults, tp: int, arch: str
) -> None:
    for rank, rank_results in enumerate(model_results(tp)):
        checkpoint_layout = tuple(rank_results[f"{arch}/counts"].tolist())
        engine_layout = tuple(rank_results[f"{arch}/engine_counts"].tolist())
        print(
            f"{arch} TP={tp} rank {rank}: replayable/masked/unsupported "
            f"{checkpoint_layout} in checkpoint layout, {engine_layout} on the CPU engine"
        )
        assert checkpoint_layout == CHECKPOINT_LAYOUT[arch]
        assert engine_layout == ENGINE_LAYOUT[arch]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_patches_into_transformed_weights_are_refused_and_change_nothing(
    model_results: ModelResults, tp: int, arch: str
) -> None:
    for rank, rank_results in enumerate(model_results(tp)):
        refusals = rank_results[f"{arch}/engine_refusals"]
        assert refusals.numel() == ENGINE_LAYOUT[arch][2]
        assert bool(refusals.all()), f"rank {rank}: {refusals.tolist()}"
        patched, protected = rank_results[f"{arch}/engine_patchable"].tolist()
        assert patched and protected, "weights the engine keeps as loaded still take patches"


def test_tied_lm_head_patch_without_its_embedding_is_refused_by_vllm(
    checkpoints: dict[str, Path], single_rank: None
) -> None:
    """vLLM skips ``lm_head.weight`` of a tied model and raises when the embedding is absent:
    patches named after the head need patchctx's aliases."""
    model = load_model(checkpoints["qwen2"])
    embed = read_checkpoint(checkpoints["qwen2"])["model.embed_tokens.weight"]
    patch = sparse("lm_head.weight", tuple(embed.shape), density=0.01, seed=0)
    with pytest.raises(ValueError, match=r"tied to 'model\.embed_tokens\.weight'"):
        vllm_load(model, [patch])


def test_tied_aliases_come_from_parameter_identity(
    checkpoints: dict[str, Path], single_rank: None
) -> None:
    assert tied_aliases(load_model(checkpoints["qwen2"])) == TIED
    assert tied_aliases(load_model(checkpoints["llama"])) == {}


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_tied_embedding_patch_reaches_the_lm_head_under_either_name(
    checkpoints: dict[str, Path], single_rank: None, name: str
) -> None:
    model = load_model(checkpoints["qwen2"])
    checkpoint = read_checkpoint(checkpoints["qwen2"])
    embed = "model.embed_tokens.weight"
    patch = sparse(name, tuple(checkpoint[embed].shape), density=0.01, seed=0)
    result = patchctx_load(ModelWorker(model), [patch])
    assert result["ok"] and result["names"] == [name]
    expected = apply_to_checkpoint(checkpoint, [patch], TIED)[embed]
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params["lm_head.weight"] is params[embed]
    assert torch.equal(params["lm_head.weight"][: expected.shape[0]], expected)
