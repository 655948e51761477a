"""Whole vLLM models (tiny Qwen2, Llama, Qwen3-MoE, Mixtral checkpoints from ``transformers``)
at TP=1 and TP=2: rounds of mixed dense and sparse patches give the same parameters as a fresh
vLLM model loaded from the patched checkpoint."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from tests.vllm.support.checkpoints import (
    ARCHITECTURES,
    load_model,
    model_job,
    read_checkpoint,
)
from tests.vllm.support.dist import Results, run_tp
from tests.vllm.support.patches import apply_to_checkpoint, load_patches, sparse

ModelResults = Callable[[int], list[Results]]


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
        for variant in ("applied", "masked"):
            for name, expected in truth.items():
                got = rank_results[f"{arch}/{variant}/{name}"]
                assert torch.equal(got, expected), f"rank {rank} {variant}: {name}"


def test_tied_lm_head_patch_without_its_embedding_is_refused_by_vllm(
    checkpoints: dict[str, Path], single_rank: None
) -> None:
    """vLLM skips ``lm_head.weight`` of a tied model and raises when the embedding is absent:
    patches named after the head need patchctx's aliases."""
    model = load_model(checkpoints["qwen2"])
    embed = read_checkpoint(checkpoints["qwen2"])["model.embed_tokens.weight"]
    patch = sparse("lm_head.weight", tuple(embed.shape), density=0.01, seed=0)
    with pytest.raises(ValueError, match=r"tied to 'model\.embed_tokens\.weight'"):
        load_patches(model, [patch])


def test_tied_embedding_patch_reaches_the_lm_head(
    checkpoints: dict[str, Path], single_rank: None
) -> None:
    name = "model.embed_tokens.weight"
    model = load_model(checkpoints["qwen2"])
    checkpoint = read_checkpoint(checkpoints["qwen2"])
    patch = sparse(name, tuple(checkpoint[name].shape), density=0.01, seed=0)
    load_patches(model, [patch])
    expected = apply_to_checkpoint(checkpoint, [patch])[name]
    head = dict(model.named_parameters(remove_duplicate=False))["lm_head.weight"]
    assert torch.equal(head[: expected.shape[0]], expected)
