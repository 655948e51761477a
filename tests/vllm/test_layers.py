"""vLLM's parallel layers at TP=1 and TP=2: sparse and dense patches through patchctx's
``load_checkpoint_weight_patches`` (with a `RouteCache`: later rounds replay), through vLLM's
own function and through ``masked_copy`` equal loading the patched full checkpoint tensor
through the layer's own loader, bit for bit, on every rank."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

import torch

from tests.vllm.support import layers
from tests.vllm.support.dist import Results, run_tp

DTYPES = ("float32", "bfloat16")  # parameter dtypes; the checkpoint is float32 (cast in copy_)


@functools.cache
def results(tp: int) -> list[Results]:
    """Every case and dtype, computed once per TP size (TP=2: one process per rank)."""
    return run_tp(layers.layer_job, tp, {"dtypes": DTYPES})


def params(rank_results: Results, case: str, dtype: str, variant: str) -> dict[str, torch.Tensor]:
    prefix = f"{case}/{dtype}/{variant}/"
    return {k.removeprefix(prefix): v for k, v in rank_results.items() if k.startswith(prefix)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(layers.CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_patches_equal_loading_the_patched_checkpoint(tp: int, case: str, dtype: str) -> None:
    by_rank = results(tp)
    assert len(by_rank) == tp
    changed: dict[str, bool] = {}
    for rank, rank_results in enumerate(by_rank):
        truth = params(rank_results, case, dtype, "truth")
        base = params(rank_results, case, dtype, "base")
        assert truth, f"no parameters recorded for {case}"
        for variant in ("patchctx", "vllm", "masked"):
            got = params(rank_results, case, dtype, variant)
            assert got.keys() == truth.keys()
            for name, value in got.items():
                assert value.dtype == getattr(torch, dtype)
                assert torch.equal(value, truth[name]), (
                    f"rank {rank}: {variant} {name} differs from the patched checkpoint at "
                    f"{int((value != truth[name]).sum())} of {value.numel()} positions"
                )
        for name in truth:
            changed[name] = changed.get(name, False) or not torch.equal(truth[name], base[name])
    assert all(changed.values()), f"patches changed nothing in {changed}"
    for rank_results in by_rank:
        recorded, replayed, loader_calls = rank_results[f"{case}/{dtype}/routes"].tolist()
        # Every name of round 1 records its route; round 2 replays its three patches (the
        # first name's sparse one, the last name's dense one along its route, then its sparse
        # one): no loader call after round 1's.
        assert recorded == len(layers.CASES[case].tensors), (recorded, replayed)
        assert replayed == 3 and loader_calls >= 1, (recorded, replayed, loader_calls)


@pytest.mark.parametrize("case", ["embedding", "lm_head"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vocabulary_padding_rows_stay_zero(tp: int, case: str) -> None:
    for rank, rank_results in enumerate(results(tp)):
        for variant in ("truth", "patchctx", "vllm", "masked"):
            weight = params(rank_results, case, "float32", variant)["weight"]
            rows = weight.shape[0]
            owned = min(max(layers.VOCAB - rank * rows, 0), rows)
            assert torch.count_nonzero(weight[owned:]) == 0, f"rank {rank} {variant}"
            assert torch.count_nonzero(weight[:owned]) == owned * layers.HIDDEN


@pytest.mark.parametrize(
    ("case", "param", "dim"),
    [
        ("column", "weight", 0),
        ("column", "bias", 0),
        ("row", "weight", 1),
        ("embedding", "weight", 0),
        ("lm_head", "weight", 0),
        ("lm_head", "bias", 0),
    ],
)
def test_tp2_shards_reassemble_the_tp1_parameter(case: str, param: str, dim: int) -> None:
    for variant in ("truth", "patchctx"):
        whole = params(results(1)[0], case, "float32", variant)[param]
        shards = [params(r, case, "float32", variant)[param] for r in results(2)]
        assert torch.equal(torch.cat(shards, dim=dim), whole)
