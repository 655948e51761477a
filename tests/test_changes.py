"""The blocked change kernel against the whole-tensor comparison it replaced, bit for bit.

Every dtype family, 0-d and strided inputs, blocks of a few elements (so that small tensors
cross many blocks), NaN payloads and signed zeros, reserved values in any block, densities
from 0 to 1, the CPU word path and the accelerators' plain path (run here on CPU tensors).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import patchctx._changes as changes
import patchctx._tuning as _tuning
from patchctx import (
    Auto,
    BoolMask,
    CheckpointWeightPatch,
    CopyStrategy,
    IntSentinel,
    NaNMask,
    diff_state_dicts,
)
from patchctx._changes import ChangeScan, reserved_test
from patchctx._strategies import indexable
from tests.support.builders import state_dict_pairs
from tests.support.memory import AllocationTracker, HostReads
from tests.support.models import bits, mixed_dtype_model, same_bits

RECEIVERS = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@dataclass(frozen=True)
class NotBuiltIn:
    """A strategy patchctx does not know: reserves NaN and +inf, asked through the protocol."""

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        return None if dtype.is_floating_point else "floats only"

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        wide = values.to(dtype).to(torch.float64)
        return (torch.isnan(wide) | (wide == math.inf)).any()

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return "NaN and +inf"

    def stage(self, *args: object) -> torch.Tensor:  # pragma: no cover - never staged here
        raise NotImplementedError

    def merge(self, *args: object, **kwargs: object) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def update_mask(self, source: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


STRATEGIES: list[object] = [
    Auto(),
    NaNMask(),
    BoolMask(),
    IntSentinel(),
    IntSentinel(value=5),
    NotBuiltIn(),
]


def random_bits(count: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """`count` elements of `dtype` with uniformly random bits (NaN payloads included)."""
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool)
    return raw.view(dtype)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """Values people forget: signed zeros, NaNs with payloads and signs, extremes, sentinels."""
    if dtype == torch.bool:
        return torch.tensor([True, False])
    if dtype.is_complex:
        return torch.tensor(
            [complex(-0.0, 0.0), complex(0.0, -0.0), complex(math.nan, 1)], dtype=dtype
        )
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.tensor([info.min, info.max, 0, 5, -1 if info.min else 1]).to(dtype)
    values = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0]).to(dtype)
    if dtype.itemsize > 1:
        nan = int_view(values[4:5])
        payloads = torch.cat([nan ^ 1, nan ^ 2, nan ^ sign_bit(nan.dtype)]).view(dtype)
        values = torch.cat([values, payloads])
    return values


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element width (complex: of each half)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    width = tensor.element_size()
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])


def sign_bit(dtype: torch.dtype) -> int:
    return 0x80 if dtype == torch.uint8 else torch.iinfo(dtype).min


@st.composite
def pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(old, new, receiver dtype): random shapes and layouts, a drawn density of changes."""
    receiver = draw(st.sampled_from(RECEIVERS))
    source = receiver
    if receiver.is_floating_point and draw(st.booleans()):
        source = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    numel = math.prod(shape)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = random_bits(numel, source, generator)
    pool = specials(source)
    sprinkled = draw(st.lists(st.integers(0, numel - 1), max_size=4))
    for position in sprinkled:  # specials at unchanged positions too
        old[position] = pool[draw(st.integers(0, pool.numel() - 1))]
    new = old.clone()
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    changed = (torch.rand(numel, generator=generator) < density).nonzero().view(-1).tolist()
    for position in changed:
        how = draw(st.sampled_from(["random", "special", "flip"]))
        if how == "random":
            new[position] = random_bits(1, source, generator)[0]
        elif how == "special":
            new[position] = pool[draw(st.integers(0, pool.numel() - 1))]
        elif source != torch.bool:  # the sign bit only: -0.0, a NaN's sign, ...
            raw = int_view(new[position : position + 1])
            raw.bitwise_xor_(sign_bit(raw.dtype))
    return shaped(old, shape, layout), shaped(new, shape, layout), receiver


def shaped(flat: torch.Tensor, shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """`flat` (row-major elements) as a tensor of `shape` in the given memory layout."""
    if layout == "transposed" and len(shape) >= 2:
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return flat.reshape(shape).transpose(-1, -2).contiguous().view(swapped).transpose(-1, -2)
    if layout == "strided" and shape:
        wide = torch.zeros(shape[0] * 2, *shape[1:], dtype=flat.dtype)
        view = wide[::2]
        view.copy_(flat.reshape(shape))
        return view
    return flat.reshape(shape)


def element_bits(tensor: torch.Tensor) -> torch.Tensor:
    raw = bits(tensor.reshape(-1))
    return raw.reshape(tensor.numel(), -1)


def reference(
    old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward whole-tensor comparison: (changed positions, their new values)."""
    after = new.to(dtype)
    changed = (element_bits(old.to(dtype)) != element_bits(after)).any(dim=1)
    positions = changed.nonzero().view(-1)
    flat = after.reshape(-1)
    values = indexable(flat).index_select(0, positions).view(dtype)
    return positions, values


def expected_reserved(strategy: CopyStrategy, values: torch.Tensor, dtype: torch.dtype) -> bool:
    """What the strategy itself says of the changed values."""
    return bool(values.numel()) and bool(strategy.reserved_values(values, dtype))


@given(
    pair=pairs(),
    block=st.integers(1, 11),
    single_pass=st.booleans(),
    strategy=st.sampled_from(STRATEGIES),
    wide_indices=st.booleans(),
    limit=st.none() | st.integers(0, 40),
)
def test_blocked_scan_matches_the_whole_tensor_comparison(
    pair: tuple[torch.Tensor, torch.Tensor, torch.dtype],
    block: int,
    single_pass: bool,
    strategy: CopyStrategy,
    wide_indices: bool,
    limit: int | None,
) -> None:
    """Both ways of scanning, every dtype family and layout; `limit` rules sparse out above it."""
    old, new, dtype = pair
    positions, values = reference(old, new, dtype)
    scan = ChangeScan(old, new, dtype, block=block, single_pass=single_pass)
    index_dtype = torch.int64 if wide_indices else torch.int32
    everything = scan.find(None, index_dtype, lambda changed: True)
    total = positions.numel()
    assert everything.changed == total
    if total == 0:
        assert everything.positions is None and everything.values is None
        return
    found, found_values = everything.positions, everything.values
    assert found is not None and found_values is not None
    assert found.dtype == index_dtype
    assert found_values.dtype == dtype
    assert found.numel() == found_values.numel() == total
    if found.numel() > 1:
        assert bool((found[1:] > found[:-1]).all())  # sorted and unique
    if old.dtype == dtype:
        assert torch.equal(found.long(), positions)
        assert same_bits(found_values, values)
    else:
        assert_same_modulo_cast_nans(old, new, dtype, found, found_values)
    assert found_values.untyped_storage().data_ptr() != new.untyped_storage().data_ptr()

    supported = strategy.unsupported_reason(dtype) is None
    reserved = supported and expected_reserved(strategy, found_values, dtype)
    asked: list[int] = []

    def could_be_sparse(changed: int) -> bool:
        asked.append(changed)
        return limit is None or changed <= limit

    chosen = scan.find(
        reserved_test(strategy, dtype) if supported else None, index_dtype, could_be_sparse
    )
    assert all(changed > 0 for changed in asked)  # (one pass also asks of its extrapolations)
    if limit is not None and total > limit and (single_pass or not reserved):
        # ruled out: one pass stops at the first running count above the limit
        assert chosen.positions is None and chosen.values is None
        assert limit < chosen.changed <= total
        assert asked[-1] == chosen.changed
    elif reserved:
        assert (chosen.changed, chosen.positions, chosen.values) == (total, None, None)
    else:
        assert chosen.changed == total
        assert chosen.positions is not None and chosen.values is not None
        assert torch.equal(chosen.positions, found)
        assert same_bits(chosen.values, found_values)


def assert_same_modulo_cast_nans(
    old: torch.Tensor,
    new: torch.Tensor,
    dtype: torch.dtype,
    found: torch.Tensor,
    found_values: torch.Tensor,
) -> None:
    """The comparison after a cast to another dtype, where torch decides NaN payloads.

    Which NaN bits a narrowing cast produces depends on torch's kernel, even on an element's
    position (fp64 to bf16: its vector loop keeps sign and payload bits, its scalar tail
    returns the canonical NaN), so a whole-tensor cast and a cast per block may disagree on
    NaNs, and only on them. Elements whose casts are not NaN must match exactly; an element
    cast to NaN on one side counts as changed when the other side is not NaN, may count as
    changed when its source bits differ, and never when they are the same.
    """
    before, after = old.to(dtype).reshape(-1), new.to(dtype).reshape(-1)
    nan_before = torch.isnan(before.to(torch.float64))
    nan_after = torch.isnan(after.to(torch.float64))
    involved = nan_before | nan_after
    reported = torch.zeros(after.numel(), dtype=torch.bool)
    reported[found.long()] = True
    differs = (element_bits(before) != element_bits(after)).any(dim=1)
    source_differs = (element_bits(old) != element_bits(new)).any(dim=1)
    assert torch.equal(reported[~involved], differs[~involved])
    assert not bool((reported & ~source_differs).any())
    assert bool(reported[nan_before != nan_after].all())
    expected_values = indexable(after).index_select(0, found.long()).view(dtype)
    is_nan = torch.isnan(found_values.to(torch.float64))
    assert torch.equal(is_nan, torch.isnan(expected_values.to(torch.float64)))
    assert same_bits(found_values[~is_nan], expected_values[~is_nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_bit_test_is_isnan_for_every_16_bit_pattern(dtype: torch.dtype) -> None:
    test = reserved_test(NaNMask(), dtype)
    assert isinstance(test, changes._NaNBits)
    raw = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    assert torch.equal((raw & test.magnitude) > test.infinity, torch.isnan(raw.view(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_bit_test_is_isnan_for_wide_floats(dtype: torch.dtype) -> None:
    test = reserved_test(Auto(), dtype)
    assert isinstance(test, changes._NaNBits)
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([random_bits(100_000, dtype, generator), specials(dtype)])
    raw = int_view(values)
    assert torch.equal((raw & test.magnitude) > test.infinity, torch.isnan(values))


def test_two_passes_read_the_host_once_per_tensor_however_many_blocks() -> None:
    """The accelerators' way: counts and flags stay on the device until one read."""
    old = torch.zeros(1000)
    new = old.clone()
    new[[3, 500, 999]] = torch.tensor([1.0, float("nan"), -0.0])
    scan = ChangeScan(old, new, torch.bfloat16, block=64, single_pass=False)
    with HostReads() as watch:
        counted = scan.count(reserved_test(Auto(), torch.bfloat16))
    assert watch.reads == ["tolist"]
    assert (counted.changed, counted.reserved, len(counted.per_block)) == (3, True, 16)
    with HostReads() as watch:
        positions, values = scan.gather(counted, torch.int32)
    assert watch.reads == []
    assert positions.tolist() == [3, 500, 999]
    assert same_bits(values, new.to(torch.bfloat16)[[3, 500, 999]])
    with HostReads() as watch:
        found = scan.find(reserved_test(Auto(), torch.bfloat16), torch.int32, lambda n: True)
    assert watch.reads == ["tolist"]  # the NaN sends it dense: no gathering
    assert (found.changed, found.positions) == (3, None)


@contextlib.contextmanager
def spy_on_positions() -> Iterator[list[int]]:
    """The length of each mask whose positions the scan looks for."""
    lengths: list[int] = []
    real, real_unless = changes.set_positions, changes.positions_unless

    def spy(mask: Any) -> Any:
        lengths.append(int(mask.shape[0]))
        return real(mask)

    def spy_unless(mask: Any, fits: Any) -> Any:
        count, found = real_unless(mask, fits)
        if found is not None:
            lengths.append(int(mask.shape[0]))
        return count, found

    with (
        mock.patch.object(changes, "set_positions", spy),
        mock.patch.object(changes, "positions_unless", spy_unless),
    ):
        yield lengths


def test_one_pass_reads_each_mask_once_and_stops_when_sparse_is_ruled_out() -> None:
    """The CPU's way: a mask read per block, the changed values tested once, at the end."""
    old = torch.zeros(1000)
    new = old.clone()
    new[[3, 500, 501, 999]] = 1.0
    scan = ChangeScan(old, new, torch.bfloat16, block=64)
    assert scan.single_pass
    with HostReads() as watch:
        found = scan.find(reserved_test(Auto(), torch.bfloat16), torch.int32, lambda n: True)
    # Per block, its two sides and its mask seen as numpy arrays (no copy, no sync on the CPU)
    assert watch.reads == ["numpy"] * 3 * 16 + ["__bool__"]
    assert found.positions is not None and found.positions.tolist() == [3, 500, 501, 999]
    asked: list[int] = []

    def below_two(changed: int) -> bool:
        asked.append(changed)
        return changed < 2

    with HostReads() as watch, spy_on_positions() as positions_found:
        found = scan.find(None, torch.int32, below_two)
    # Block 0 holds 1 to 8 changes (its one nonzero group of 8): at that density the tensor
    # would hold 16 to 125, too many, so no block's positions are found; all are only counted,
    # and block 7 brings two more: the scan stops there.
    assert (asked, found.changed, found.positions) == ([125, 16, 1, 16, 3], 3, None)
    assert watch.reads == ["numpy"] * 3 * 8
    assert positions_found == []


def test_one_pass_reads_again_the_blocks_it_only_counted_when_sparse_wins() -> None:
    """Changes that come early make the tensor look dense; the result is the same."""
    old = torch.zeros(1000)
    new = old.clone()
    new[[3, 5, 999]] = 1.0
    asked: list[int] = []

    def up_to_three(changed: int) -> bool:
        asked.append(changed)
        return changed <= 3

    scan = ChangeScan(old, new, torch.bfloat16, block=64)
    with HostReads() as watch, spy_on_positions() as positions_found:
        found = scan.find(reserved_test(Auto(), torch.bfloat16), torch.int32, up_to_three)
    # block 0: one group of 8 holds a change: 1 to 8 changes, 16 to 125 at that density: it
    # is only counted (2 changes, 32 at that density), and so are blocks 1-15; 3 in all:
    # blocks 0 and 15, the counted blocks with a change, are read again
    assert asked == [125, 16, 1, 2, 32, 3, 3]
    assert watch.reads == ["numpy"] * 3 * 18 + ["__bool__"]  # 3 a block: its sides, its mask
    assert positions_found == [64, 40]  # block 0, then block 15 (elements 960 to 999)
    assert found.changed == 3
    assert found.positions is not None and found.values is not None
    assert found.positions.tolist() == [3, 5, 999]
    assert same_bits(found.values, torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("single_pass", [True, False], ids=["one-pass", "two-passes"])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_memory_is_a_few_blocks_beyond_the_result(source: torch.dtype, single_pass: bool) -> None:
    numel, block = 1 << 20, 1 << 12
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(numel, generator=generator).to(source)
    new = old.clone()
    new[torch.randperm(numel, generator=generator)[:5000]] += 1.0
    with AllocationTracker(preexisting=[old, new]) as tracker:
        scan = ChangeScan(old, new, torch.bfloat16, block=block, single_pass=single_pass)
        found = scan.find(reserved_test(Auto(), torch.bfloat16), torch.int32, lambda n: True)
        assert found.positions is not None and found.values is not None
        result = found.positions.numel() * 4 + found.values.numel() * 2
        del scan
    assert found.changed == 5000
    # casts of both sides, the XOR (in one of them) and the mask: 5 bytes per block element;
    # one pass also holds the blocks' results until it joins them: the result once more
    joined = result if single_pass else 0
    assert tracker.peak - result - joined <= 8 * block * 4, (tracker.peak, result)


@given(data=st.data(), strategy=st.sampled_from([Auto(), BoolMask()]))
def test_diff_state_dicts_is_the_same_whatever_the_block(
    data: st.DataObject, strategy: CopyStrategy
) -> None:
    """Every dtype and shape of the mixed model, fp32 masters for the narrow floats."""
    specs = mixed_dtype_model().checkpoint_specs()
    masters = {
        name: torch.float32
        for name, spec in specs.items()
        if spec.dtype.is_floating_point and spec.dtype.itemsize <= 2
    }
    old, new = data.draw(state_dict_pairs(specs, trainer_dtypes=masters))
    dtypes = {name: spec.dtype for name, spec in specs.items()}
    expected = diff_state_dicts(old, new, dtype=dtypes, strategy=strategy)
    passes = frozenset({"cpu"}) if data.draw(st.booleans(), label="one pass") else frozenset()
    with (
        mock.patch.dict(_tuning.DIFF_BLOCK, {"cpu": data.draw(st.integers(1, 7))}),
        mock.patch.object(changes, "SINGLE_PASS_DEVICES", passes),
    ):
        blocked = diff_state_dicts(old, new, dtype=dtypes, strategy=strategy)
    assert_same_patches(blocked, expected)


def assert_same_patches(
    actual: list[CheckpointWeightPatch], expected: list[CheckpointWeightPatch]
) -> None:
    assert [(p.name, p.shape, p.dtype) for p in actual] == [
        (p.name, p.shape, p.dtype) for p in expected
    ]
    for got, want in zip(actual, expected, strict=True):
        assert (got.indices is None) == (want.indices is None)
        if got.indices is not None and want.indices is not None:
            assert torch.equal(got.indices, want.indices)
        assert same_bits(got.values, want.values)


@given(
    groups=st.integers(0, 300),
    density=st.sampled_from([0.0, 0.01, 0.2, 0.7, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_counting_eight_mask_entries_at_a_time_is_count_nonzero(
    groups: int, density: float, seed: int
) -> None:
    """Lengths that are multiples of 128, of 8 only, and of neither; full and empty masks."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups * 8, generator=generator) < density
    assert int(changes.count_set(mask)) == int(mask.sum())
    shorter = mask[: max(mask.numel() - 1, 0)]  # a length that is no multiple of 8
    assert int(changes.count_set(shorter)) == int(shorter.sum())


@given(
    length=st.integers(0, 3000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.4, 0.7, 1.0]),
    clustered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_set_positions_by_groups_of_eight_are_nonzero(
    length: int, density: float, clustered: bool, seed: int
) -> None:
    """Both ways (groups first, or the whole mask above 60% of groups held), lengths that are
    no multiple of 8 (a tail read alone), set entries spread out or in runs."""
    generator = torch.Generator().manual_seed(seed)
    if clustered:  # runs of 16: few groups held, each full
        mask = (torch.rand((length + 15) // 16, generator=generator) < density).repeat_interleave(
            16
        )[:length]
    else:
        mask = torch.rand(length, generator=generator) < density
    found = changes.set_positions(mask.numpy())
    assert found.dtype == np.intp
    assert found.tolist() == mask.nonzero().view(-1).tolist()


@given(
    length=st.integers(0, 3000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.4, 0.7, 1.0]),
    clustered=st.booleans(),
    limit=st.integers(0, 3000),
    seed=st.integers(0, 2**16),
)
def test_positions_unless_a_count_rules_them_out(
    length: int, density: float, clustered: bool, limit: int, seed: int
) -> None:
    """The positions when the count fits; else no positions and a count that does not fit,
    at most the true one (the scan may stop on it). Asked only of counts it may hold."""
    generator = torch.Generator().manual_seed(seed)
    if clustered:
        mask = (torch.rand((length + 15) // 16, generator=generator) < density).repeat_interleave(
            16
        )[:length]
    else:
        mask = torch.rand(length, generator=generator) < density
    total = int(mask.sum())
    asked: list[int] = []

    def fits(count: int) -> bool:
        asked.append(count)
        return count <= limit

    count, found = changes.positions_unless(mask.numpy(), fits)
    assert all(0 < n <= length for n in asked)
    if total <= limit:
        assert count == total
        assert found is not None and found.tolist() == mask.nonzero().view(-1).tolist()
    else:
        assert found is None
        assert limit < count <= total
