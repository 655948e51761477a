"""patchctx's own copies ignore a caller's open `masked_copy` region.

A caller may call patchctx from inside their own region (a loader decorated with
``@masked_copy``, say). There, ``copy_`` keeps the destination wherever the source holds the
region's sentinel: NaN for `NaNMask`, the reserved integer for `IntSentinel`. patchctx copies
its own data too (route replays, the diff's buffers, rollbacks, wire encodings), and that data
may hold those very values: a dense patch carries NaN as a value, an index can equal an
integer sentinel. Each test runs one of those paths inside a region and outside it, and the
results must agree bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    IntSentinel,
    LoaderContractError,
    MaskedCopy,
    NaNMask,
    RouteCache,
    _tuning,
    diff_state_dicts,
    load_checkpoint_weight_patches,
    masked_copy,
)
from tests.support.models import assert_same_state, state


class Weight(nn.Module):
    """One weight of 8 elements, loaded whole; a second call for a name 'bad' fails."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(8, dtype=torch.float32), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if name == "bad":
                raise RuntimeError("the loader fails")
            self.w.copy_(tensor)
        return {"w"}


def warmed() -> tuple[Weight, RouteCache]:
    model, routes = Weight(), RouteCache()
    first = CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "w" in routes
    return model, routes


def both_ways(patch: CheckpointWeightPatch, region: MaskedCopy) -> tuple[Weight, Weight]:
    """The same replay outside any region and inside `region`."""
    outside, routes = warmed()
    inside, inside_routes = warmed()
    load_checkpoint_weight_patches(outside, [patch], routes=routes)
    with region:
        load_checkpoint_weight_patches(inside, [patch], routes=inside_routes)
    assert routes.stats.replayed == inside_routes.stats.replayed == 1
    return outside, inside


def test_a_dense_replay_writes_nan_values_inside_a_nanmask_region() -> None:
    values = torch.full((8,), 5.0)
    values[0] = float("nan")
    outside, inside = both_ways(
        CheckpointWeightPatch("w", (8,), torch.float32, values), masked_copy(strategy=NaNMask())
    )
    assert torch.isnan(inside.w[0])
    assert_same_state(state(inside), state(outside))


@pytest.mark.parametrize("sentinel", [0, 3, 7])
def test_a_sparse_replay_writes_indices_equal_to_an_int_sentinel(
    sentinel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long patches convert their int32 indices to int64 positions during replay, by a copy.
    monkeypatch.setattr(_tuning, "BATCHED_UP_TO", 1)
    monkeypatch.setattr(_tuning, "CPU_BATCHED_UP_TO", 1)
    indices = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    patch = CheckpointWeightPatch("w", (8,), torch.float32, torch.full((4,), -1.0), indices)
    outside, inside = both_ways(patch, masked_copy(strategy=IntSentinel(value=sentinel)))
    assert inside.w[sentinel] == -1.0
    assert_same_state(state(inside), state(outside))


def test_a_rollback_inside_a_nanmask_region_puts_back_nan_weights() -> None:
    model = Weight()
    model.w.data[2] = float("nan")  # a weight that is NaN before the call
    before = copy.deepcopy(model)
    patches = [
        CheckpointWeightPatch(
            "w", (8,), torch.float32, torch.tensor([9.0, 9.0]), torch.tensor([1, 2])
        ),
        CheckpointWeightPatch("bad", (1,), torch.float32, torch.ones(1)),
    ]
    with masked_copy(strategy=NaNMask()), pytest.raises((RuntimeError, LoaderContractError)):
        load_checkpoint_weight_patches(model, patches, atomic=True, max_chunk_bytes=1)
    assert_same_state(state(model), state(before))


@pytest.mark.parametrize("receiver", [torch.bfloat16, torch.float16])
def test_the_diff_sees_a_weight_that_became_nan_inside_a_nanmask_region(
    receiver: torch.dtype,
) -> None:
    # fp32 weights compared in a 16-bit receiver dtype go through the diff's cast buffer.
    old = {"w": torch.linspace(-1, 1, 4096)}
    new = {"w": old["w"].clone()}
    new["w"][[5, 700, 4000]] = float("nan")
    expected = diff_state_dicts(old, new, dtype=receiver)
    with masked_copy(strategy=NaNMask()):
        found = diff_state_dicts(old, new, dtype=receiver)
    assert len(found) == len(expected) == 1
    (patch,), (truth,) = found, expected
    assert patch.shape == truth.shape and patch.dtype == truth.dtype == receiver
    assert (patch.indices is None) == (truth.indices is None)
    if truth.indices is not None:
        assert patch.indices is not None and torch.equal(patch.indices, truth.indices)
    assert torch.equal(patch.values.view(torch.int16), truth.values.view(torch.int16))
    assert int(torch.isnan(patch.values).sum()) == 3
