"""The blocked fast paths agree with the exact ones: validation's common case, replay, writes.

Validation first asks, at a fixed cost, whether every sparse patch is in the producer format
(in range, strictly increasing, no reserved value); only when not do the exact per-patch checks
run. These tests shrink the block and batch sizes so that small tensors cross many blocks, and
check as an attacker would that the common case never accepts what the exact checks refuse:
indices that wrap int32 or int64 differences, a step back exactly at a block boundary, a NaN in
any block, huge declared shapes.
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchctx import (
    Auto,
    BoolMask,
    CheckpointWeightPatch,
    IntSentinel,
    InvalidPatchError,
    NaNMask,
    RouteCache,
    _bits,
    _cpu_passes,
    _geometry,
    _patch,
    _routes,
    _tuning,
    load_checkpoint_weight_patches,
    validate_patches,
)
from patchctx._cpu_passes import (
    each_increasing_below,
    has_nan_bits,
    has_value,
    increasing_below,
)
from patchctx._patch import check_patches
from patchctx._strategies import reserved_on_host
from tests.support.models import assert_same_state, packed_tp_model, random_checkpoint, state


@contextmanager
def small_blocks(
    block: int = 7,
    batched: int = 5,
    few: int = 2,
    joined: int = 2,
    listed: int = 3,
    *,
    host: bool = True,
) -> Iterator[None]:
    """Blocks of `block` positions, batches of patches up to `batched` indices (on CPU, from
    `joined` such patches in a call), the CPU ``scatter_`` write from `few` positions on,
    numpy's CPU passes from `block` // 2, and Python lists for patches of up to `listed`.
    Without `host`, CPU tensors go the accelerators' way (`_cpu_passes.HOST`): the code that
    runs on a GPU, run here."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(_cpu_passes, "HOST", host)
        patcher.setattr(_tuning, "LISTED_UP_TO", listed)
        patcher.setattr(_tuning, "BLOCK", block)
        patcher.setattr(_tuning, "BATCHED_UP_TO", batched)
        patcher.setattr(_tuning, "CPU_BATCHED_UP_TO", batched)
        patcher.setattr(_tuning, "CPU_JOINED_FROM", joined)
        patcher.setattr(_tuning, "FEW", few)
        # The CPU passes numpy makes from torch's grain size up, on small tensors too.
        patcher.setattr(_tuning, "HOST_FROM", block // 2)
        yield


def exact(patches: list[CheckpointWeightPatch], strategy: object) -> tuple[list[bool], str]:
    """The exact checks alone: per patch whether indices are sorted-unique, and the report."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(_patch, "_all_valid", lambda checked, strategy: None)
        try:
            checked = check_patches(patches, strategy=strategy)  # type: ignore[arg-type]
        except InvalidPatchError as error:
            return [], str(error)
    return [c.sorted_unique for c in checked], ""


def fast(
    patches: list[CheckpointWeightPatch], strategy: object, *, one_by_one: bool = False
) -> tuple[list[bool], str]:
    """The common case's verdict; `one_by_one`: every CPU patch was checked by itself."""
    try:
        checked = check_patches(patches, strategy=strategy)  # type: ignore[arg-type]
    except InvalidPatchError as error:
        return [], str(error)
    # Every sparse patch increasing: the common case decided them (no exact checks ran).
    common = all(c.sorted_unique for c in checked if c.sparse)
    for item in checked:
        if item._positions is not None:  # int64 copies of the indices, for replay
            assert item.patch.indices is not None
            assert item._positions.dtype == torch.long
            assert torch.equal(item._positions, item.patch.indices.long())
        indices = item.patch.indices
        if item._listed is not None:  # a short patch checked as a list keeps it for replay
            assert indices is not None and indices.shape[0] <= _tuning.LISTED_UP_TO
            assert item._listed == indices.tolist()
        elif one_by_one and common and indices is not None:
            assert indices.shape[0] > _tuning.LISTED_UP_TO, "a short patch kept no list"
    return [c.sorted_unique for c in checked], ""


# Index values that break naive checks: int32 wrap-arounds, int64 extremes, the bounds.
NASTY = [-1, 2**31 - 1, -(2**31), 2**31 - 5, 2**62, 2**63 - 1, -(2**63), -(2**62)]


@st.composite
def patch_sets(draw: st.DrawFn) -> list[CheckpointWeightPatch]:
    patches = []
    for k in range(draw(st.integers(1, 6))):
        numel = draw(st.integers(1, 60))
        nnz = draw(st.integers(0, numel))
        chosen = sorted(draw(st.sets(st.integers(0, numel - 1), min_size=nnz, max_size=nnz)))
        index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16]))
        indices = list(chosen)
        values = [float(draw(st.integers(-3, 3))) for _ in indices]
        attack = draw(
            st.sampled_from(["none", "none", "range", "nasty", "swap", "repeat", "reserved"])
        )
        if indices and attack == "range":
            at = draw(st.integers(0, len(indices) - 1))
            indices[at] = draw(st.sampled_from([-1, numel, numel + 1]))
        elif indices and attack == "nasty":
            at = draw(st.integers(0, len(indices) - 1))
            nasty = draw(st.sampled_from(NASTY))
            if index_dtype == torch.int32 and not -(2**31) <= nasty < 2**31:
                nasty = 2**31 - 1
            indices[at] = nasty
        elif len(indices) > 1 and attack in ("swap", "repeat"):
            at = draw(st.integers(1, len(indices) - 1))
            if attack == "swap":
                indices[at - 1], indices[at] = indices[at], indices[at - 1]
            else:
                indices[at] = indices[at - 1]
        elif values and attack == "reserved":
            at = draw(st.integers(0, len(values) - 1))
            values[at] = float("nan") if dtype.is_floating_point else -32768.0
        patches.append(
            CheckpointWeightPatch(
                f"p{k}",
                (numel,),
                dtype,
                torch.tensor(values, dtype=torch.float64).to(dtype),
                torch.tensor(indices, dtype=index_dtype),
            )
        )
    return patches


@given(patches=patch_sets(), strategy=st.sampled_from([Auto(), BoolMask()]))
def test_the_common_case_accepts_exactly_what_the_exact_checks_accept_as_sorted(
    patches: list[CheckpointWeightPatch], strategy: object
) -> None:
    expected = exact(patches, strategy)
    with small_blocks():  # short patches checked together, long ones block by block
        assert fast(patches, strategy) == expected
    with small_blocks(joined=2**30):  # on CPU, every patch by itself
        assert fast(patches, strategy, one_by_one=True) == expected
    with small_blocks(host=False):  # the accelerators' way: batched flags, blocked reductions
        assert fast(patches, strategy) == expected
    # And with the real sizes (up to 6 patches: on CPU, one by one, in one block each; those
    # of up to `_tuning.LISTED_UP_TO` indices as Python lists: all of them here, while
    # the small blocks above take the others through numpy).
    assert fast(patches, strategy, one_by_one=True) == expected


def test_a_step_back_exactly_at_a_block_boundary_is_seen() -> None:
    indices = torch.arange(0, 40, dtype=torch.int32)
    indices[14] = indices[13]  # block 2 starts at 14 with block=7: the boundary step
    patch = CheckpointWeightPatch("w", (64,), torch.float32, torch.ones(40), indices)
    with small_blocks():
        with pytest.raises(InvalidPatchError, match="duplicate indices"):
            validate_patches([patch])
        back = indices.clone()
        back[14], back[13] = 12, 13
        assert (
            check_patches(
                [patch._replace(indices=back)], strategy=Auto(), validate_unique_indices=False
            )[0].sorted_unique
            is False
        )


def test_int32_differences_that_wrap_do_not_pass_for_increasing() -> None:
    # Every difference of this sequence, computed in int32, is positive.
    wraps = torch.tensor([5, 2**31 - 1, -(2**31) + 2, 10], dtype=torch.int32)
    patch = CheckpointWeightPatch("w", (20,), torch.float32, torch.ones(4), wraps)
    sizes: dict[str, Any]
    for sizes in ({}, {"block": 2, "batched": 1}, {"host": False}, {"block": 2, "host": False}):
        with small_blocks(**sizes), pytest.raises(InvalidPatchError, match="out of range"):
            validate_patches([patch])


def test_int64_differences_that_wrap_do_not_pass_for_increasing() -> None:
    wraps = torch.tensor([-1 + 1, 3 * 2**61, -3 * 2**61, 5], dtype=torch.int64)
    patch = CheckpointWeightPatch("w", (10,), torch.float32, torch.ones(4), wraps)
    other = CheckpointWeightPatch("v", (10,), torch.float32, torch.ones(1), torch.tensor([2]))
    for batch in ([patch], [patch, other], [other, patch]):
        with pytest.raises(InvalidPatchError, match="out of range"):
            validate_patches(batch)
        with small_blocks(host=False), pytest.raises(InvalidPatchError, match="out of range"):
            validate_patches(batch)  # the accelerators' way


@st.composite
def index_windows(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """Index windows and bounds near every edge: 0, the int32 and int64 sign bits, wraps."""
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    bits = 32 if dtype == torch.int32 else 64
    top = 1 << (bits - 1)
    edges = st.sampled_from([0, 1, top - 2, top - 1, -top, -top + 1, -1, -2, top // 2])
    value = st.one_of(st.integers(-top, top - 1), edges, st.integers(-4, 40))
    values = draw(st.lists(value, max_size=12))
    if draw(st.booleans()):
        values.sort()
    bound = draw(st.one_of(st.integers(1, 60), st.sampled_from([top - 1, top, top + 1, 2 * top])))
    return torch.tensor(values, dtype=dtype), bound


@given(case=index_windows(), start=st.integers(0, 3))
def test_the_numpy_order_check_is_exact_for_every_value_and_bound(
    case: tuple[torch.Tensor, int], start: int
) -> None:
    window, bound = case
    window = window[start:]  # views that do not start their storage, too
    listed = window.tolist()
    truth = all(0 <= v < bound for v in listed) and all(a < b for a, b in pairwise(listed))
    assert increasing_below(window, bound) is truth


@given(cases=st.lists(index_windows(), min_size=1, max_size=5), data=st.data())
def test_the_batched_numpy_order_check_is_exact_for_every_window(
    cases: list[tuple[torch.Tensor, int]], data: st.DataObject
) -> None:
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    windows = [w.to(dtype) for w, _ in cases if w.numel()]  # int64 values wrap into int32
    if not windows:
        return
    bounds = [bound for w, bound in cases if w.numel()]
    lasts = list(itertools.accumulate(w.numel() for w in windows))
    truth = all(increasing_below(w, bound) for w, bound in zip(windows, bounds, strict=True))
    flat = torch.cat(windows)
    assert each_increasing_below(flat, [last - 1 for last in lasts], bounds) is truth


def test_a_declared_shape_beyond_int64_arithmetic_takes_the_exact_checks() -> None:
    big = CheckpointWeightPatch(
        "w", (2**31, 2**31 + 1), torch.float32, torch.ones(2), torch.tensor([0, 2**62 + 7])
    )
    assert _patch._all_valid(check_structural([big]), Auto()) is None
    assert validate_patches([big])[0] == big


def test_a_shape_no_tensor_can_hold_is_refused_with_its_reason() -> None:
    huge = CheckpointWeightPatch(
        "w", (2**40, 2**40), torch.float32, torch.ones(2), torch.tensor([0, 2**62])
    )
    with pytest.raises(InvalidPatchError, match=r"'w'.*more than a tensor can hold"):
        validate_patches([huge])
    dense = huge._replace(shape=(2**32, 2**32), indices=None)
    with pytest.raises(InvalidPatchError, match="more than a tensor can hold"):
        validate_patches([dense])


def check_structural(patches: list[CheckpointWeightPatch]) -> list[_patch.CheckedPatch]:
    return [_patch.CheckedPatch._make(k, p, math.prod(p.shape)) for k, p in enumerate(patches)]


@pytest.mark.parametrize("block", [0, 3, 7])
def test_a_nan_in_any_block_is_refused(block: int) -> None:
    values = torch.ones(21)
    values[block * 3 % 21] = float("nan")
    patch = CheckpointWeightPatch("w", (30,), torch.float32, values, torch.arange(21))
    with small_blocks(block=3, batched=4), pytest.raises(InvalidPatchError, match="NaN"):
        validate_patches([patch])


# ----------------------------------------------------------------------------------- replay


@pytest.mark.parametrize("host", [True, False], ids=["host", "accelerators' way"])
@given(data=st.data(), tp=st.sampled_from([(1, 0), (2, 1)]))
def test_replay_across_many_blocks_equals_the_loader_path(
    data: st.DataObject, tp: tuple[int, int], host: bool
) -> None:
    from tests.support.builders import patch_sequences

    with small_blocks(block=5, batched=3, few=1, host=host):
        model = packed_tp_model(tp_size=tp[0], tp_rank=tp[1], dtype=torch.bfloat16)
        model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
        reference = copy.deepcopy(model)
        routes = RouteCache()
        for _ in range(3):
            patches = data.draw(patch_sequences(model.checkpoint_specs(), max_size=4))
            load_checkpoint_weight_patches(model, patches, routes=routes)
            load_checkpoint_weight_patches(reference, patches)
            assert_same_state(state(model), state(reference))


WIDTHS = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.int16,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.float32,
    torch.uint32,
    torch.int64,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", WIDTHS, ids=str)
@pytest.mark.parametrize("count", [3, _tuning.FEW, _tuning.FEW + 1, 5000])
@pytest.mark.parametrize("shape", ["flat", "2-D", "2-D at an offset"])
@pytest.mark.parametrize("host", [True, False], ids=["host", "accelerators' way"])
def test_write_at_moves_exact_bits_for_every_dtype(
    dtype: torch.dtype, count: int, shape: str, host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``put_`` for a few positions, ``scatter_``/``index_copy_`` for more (the accelerators'
    ``index_copy_`` for all, through an integer view where torch has no kernel): the same
    bits, into a flat tensor or a contiguous one of any shape (positions in row-major order)."""
    monkeypatch.setattr(_cpu_passes, "HOST", host)
    generator = torch.Generator().manual_seed(count)
    raw = torch.randint(0, 256, (16 * 10_000 * 2,), dtype=torch.uint8, generator=generator)
    width = torch.empty((), dtype=dtype).element_size()
    flat = raw[: 10_000 * width].view(dtype).clone()
    source = raw[10_000 * width : 20_000 * width].view(dtype)[:count].clone()
    positions = torch.randperm(10_000, generator=generator)[:count]
    expected = flat.view(torch.uint8).view(-1, width).clone()
    expected[positions] = source.view(torch.uint8).view(-1, width)
    if shape == "flat":
        target = flat
    elif shape == "2-D":
        target = flat.view(100, 100)
    else:  # a contiguous view that does not start its storage
        storage = torch.cat([flat[:7], flat])
        target = storage[7:].view(100, 100)
        flat = storage[7:]
    _bits.write_at(target, positions, source)
    assert torch.equal(flat.view(torch.uint8).view(-1, width), expected)
    other = torch.float64 if dtype != torch.float64 else torch.float32
    with pytest.raises(TypeError, match="destination"):  # a bit view would write garbage
        _bits.write_at(flat, positions, torch.zeros(count, dtype=other))


@pytest.mark.parametrize("host", [True, False], ids=["host", "accelerators' way"])
def test_threads_replaying_at_once_keep_their_own_scratch(host: bool) -> None:
    """Each thread's block buffers are its own (numpy's on the host, torch's the accelerators'
    way): concurrent replays never mix positions."""
    models = [packed_tp_model(tp_size=2, tp_rank=1, dtype=torch.float32) for _ in range(4)]
    checkpoint = random_checkpoint(models[0].checkpoint_specs())
    for model in models:
        model.load_weights(checkpoint.items())
    references = [copy.deepcopy(m) for m in models]
    specs = models[0].checkpoint_specs()
    name, spec = next((n, s) for n, s in specs.items() if len(s.shape) == 2)
    numel = spec.shape[0] * spec.shape[1]

    def patch_for(thread: int, round_: int) -> CheckpointWeightPatch:
        generator = torch.Generator().manual_seed(thread * 100 + round_)
        indices = torch.randperm(numel, generator=generator)[: numel // 2].sort().values
        values = torch.randn(indices.numel(), generator=generator).to(spec.dtype)
        return CheckpointWeightPatch(name, spec.shape, spec.dtype, values, indices)

    errors: list[BaseException] = []
    start = threading.Barrier(len(models))

    def work(thread: int) -> None:
        try:
            routes = RouteCache()
            start.wait()
            for round_ in range(20):
                load_checkpoint_weight_patches(
                    models[thread], [patch_for(thread, round_)], routes=routes
                )
        except BaseException as error:  # reported below
            errors.append(error)

    with small_blocks(block=64, batched=16, few=1, host=host):
        workers = [threading.Thread(target=work, args=(t,)) for t in range(len(models))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert not errors
    for thread, reference in enumerate(references):
        for round_ in range(20):
            load_checkpoint_weight_patches(reference, [patch_for(thread, round_)])
        assert_same_state(state(models[thread]), state(reference))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_16_bit_nan_check_by_bits_agrees_with_isnan_on_every_bit_pattern(
    dtype: torch.dtype,
) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    strategy = NaNMask()
    found = [bool(strategy.reserved_values(every[i : i + 1], dtype)) for i in range(2**16)]
    assert found == torch.isnan(every).tolist()
    assert bool(strategy.reserved_values(every, dtype))
    assert not bool(strategy.reserved_values(every[~torch.isnan(every)], dtype))
    assert not bool(strategy.reserved_values(every[:0], dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_host_nan_check_agrees_with_isnan_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    expected = torch.isnan(every).tolist()
    assert [has_nan_bits(every[i : i + 1]) for i in range(2**16)] == expected
    # Validation's host read, by torch's amax for a few values: every pattern alone too.
    assert [reserved_on_host(Auto(), every[i : i + 1], dtype) for i in range(2**16)] == expected


_INTEGER_OF = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@given(
    dtype=st.sampled_from(list(_INTEGER_OF)),
    at=st.integers(0, 40_000),
    data=st.data(),
)
def test_the_host_nan_check_finds_one_nan_of_any_payload_among_many_values(
    dtype: torch.dtype, at: int, data: st.DataObject
) -> None:
    integer = _INTEGER_OF[dtype]
    info = torch.iinfo(integer)
    float_info = torch.finfo(dtype)
    width = float_info.bits
    exponent = {16: 8 if dtype == torch.bfloat16 else 5, 32: 8, 64: 11}[width]
    infinity = ((1 << exponent) - 1) << (width - 1 - exponent)  # the bits of +inf
    edges = [infinity, infinity + 1, (1 << (width - 1)) - 1, 0, -1, info.min, info.min + 1]
    edges += [infinity - (1 << (width - 1)), infinity + 1 - (1 << (width - 1))]  # -inf, -NaN
    bits = data.draw(st.one_of(st.sampled_from(edges), st.integers(info.min, info.max)))
    # Around each way `reserved_on_host` reads: Python floats up to `LISTED_UP_TO`, torch's amax
    # up to `_tuning.AMAX_UP_TO`, then the bits.
    listed = _tuning.LISTED_UP_TO
    count = data.draw(
        st.sampled_from([1, listed - 1, listed, listed + 1, 8191, 8192, 8193, 40_001])
    )
    values = torch.linspace(-3, 3, count).to(dtype)
    values.view(integer)[at % count] = bits
    if data.draw(st.booleans()):  # a strided view: every other element of a longer tensor
        spaced = torch.zeros(2 * count, dtype=dtype)
        spaced[::2] = values
        values = spaced[::2]
    expected = bool(torch.isnan(values).any())
    assert has_nan_bits(values) is expected
    assert bool(NaNMask().reserved_values(values, dtype)) is expected
    for strategy in (NaNMask(), Auto()):
        assert reserved_on_host(strategy, values, dtype) is expected
    assert reserved_on_host(BoolMask(), values, dtype) is False  # BoolMask reserves nothing
    with small_blocks(host=False):  # the accelerators' reductions (bf16/fp16: of the bits)
        assert bool(NaNMask().reserved_values(values, dtype)) is expected
        many = values.repeat(
            40_001 // count + 1
        )  # beyond `_tuning.INTEGER_NAN_FROM`, whatever count
        assert bool(NaNMask().reserved_values(many, dtype)) is expected


@given(
    dtype=st.sampled_from([torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]),
    at=st.integers(0, 40_000),
    data=st.data(),
)
def test_the_host_sentinel_check_finds_the_sentinel_among_many_values(
    dtype: torch.dtype, at: int, data: st.DataObject
) -> None:
    info = torch.iinfo(dtype)
    value = data.draw(st.sampled_from([info.min, info.max, 0, 7]))
    planted = data.draw(st.sampled_from([value, info.min, info.max, 3]))
    values = torch.full((40_001,), 5, dtype=dtype)
    values[at] = planted
    strategy = IntSentinel(value=value)
    expected = bool((values == value).any())
    assert has_value(values, value) is expected
    assert bool(strategy.reserved_values(values, dtype)) is expected
    assert reserved_on_host(strategy, values, dtype) is expected
    assert reserved_on_host(Auto(), values, dtype) is bool(Auto().reserved_values(values, dtype))
    with small_blocks(host=False):  # the accelerators' reduction
        assert bool(strategy.reserved_values(values, dtype)) is expected


@given(
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_shifted_positions_are_exact_near_every_integer_edge(
    index_dtype: torch.dtype, data: st.DataObject
) -> None:
    """``indices[begin:end] - shift`` in int64, the way replay makes a segment's positions:
    no int32 wrap (int32 indices near 2**31 with a negative shift), int64 extremes exact."""
    info = torch.iinfo(index_dtype)
    edge = st.sampled_from([0, 1, info.max, info.max - 1, 2**31 - 1, 2**31, 2**40])
    values = data.draw(st.lists(st.one_of(edge, st.integers(0, info.max)), max_size=40))
    values = sorted({min(v, info.max) for v in values})
    indices = torch.tensor(values, dtype=index_dtype)
    begin = data.draw(st.integers(0, len(values)))
    end = data.draw(st.integers(begin, len(values)))
    # A segment's positions are storage offsets: from 0 up to below 2**63. Any shift that
    # keeps the covered indices there.
    low, high = (values[begin], values[end - 1]) if begin < end else (0, 0)
    least = high - (2**63 - 1)
    shift = data.draw(st.one_of(st.integers(least, low), st.sampled_from([least, 0, low])))
    got = _cpu_passes.shifted_positions(indices, begin, end, shift)
    assert got.dtype == torch.long
    assert got.tolist() == [v - shift for v in values[begin:end]]
    assert _cpu_passes.shifted_positions(indices, begin, end, shift).tolist() == got.tolist()
    # The same from validation's list of a short patch: a tensor of its own.
    listed = _cpu_passes.listed_positions(values, begin, end, shift)
    assert listed.dtype == torch.long and listed.is_contiguous()
    assert listed.tolist() == [v - shift for v in values[begin:end]]
    assert _cpu_passes.listed_positions(values, begin, end, shift).data_ptr() != (
        listed.data_ptr() if listed.numel() else -1
    )


def test_the_host_buffers_are_per_thread_and_grow() -> None:
    """`host_scratch` hands each thread its own buffer, reused while large enough."""
    first = _cpu_passes.host_scratch(np.int64, 10)
    assert _cpu_passes.host_scratch(np.int64, 5).ctypes.data == first.ctypes.data  # reused
    grown = _cpu_passes.host_scratch(np.int64, 1000)
    assert grown.shape == (1000,)
    seen: list[int] = []
    worker = threading.Thread(
        target=lambda: seen.append(_cpu_passes.host_scratch(np.int64, 1000).ctypes.data)
    )
    worker.start()
    worker.join()
    assert seen and seen[0] != grown.ctypes.data  # another thread, another buffer


@pytest.mark.host_only
def test_a_call_of_many_replays_reads_the_host_once_whatever_their_number() -> None:
    """Validation reads once; on CPU the covered slice of every partly covered segment is
    searched on the host (on an accelerator they are read together, once: see the next test);
    the replays themselves never read (on CUDA, a read is a sync)."""
    model = packed_tp_model(tp_size=2, tp_rank=1, dtype=torch.float32)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    routes = RouteCache()
    specs = model.checkpoint_specs()

    def patches(seed: int) -> list[CheckpointWeightPatch]:
        made = []
        for name, spec in specs.items():
            numel = math.prod(spec.shape)
            generator = torch.Generator().manual_seed(seed)
            indices = torch.randperm(numel, generator=generator)[: numel // 3].sort().values
            values = torch.randn(indices.numel(), generator=generator).to(spec.dtype)
            made.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, values, indices))
        return made

    load_checkpoint_weight_patches(model, patches(0), routes=routes)
    assert len(routes) == len(specs)
    reads: list[str] = []
    original_tolist, original_item = torch.Tensor.tolist, torch.Tensor.item
    original_flags = _patch._read_flags
    inside: list[bool] = []  # validation's one read of its flags (on CPU, flag by flag)

    def tolist(self: torch.Tensor) -> Any:
        if not inside:
            reads.append("tolist")
        return original_tolist(self)

    def item(self: torch.Tensor) -> Any:
        if not inside:
            reads.append("item")
        return original_item(self)

    def read_flags(flags: list[torch.Tensor | int], device: torch.device) -> list[int]:
        reads.append("flags")
        inside.append(True)
        try:
            return original_flags(flags, device)
        finally:
            inside.pop()

    reference = copy.deepcopy(model)
    for seed in (1, 2):
        with pytest.MonkeyPatch.context() as patcher:
            patcher.setattr(torch.Tensor, "tolist", tolist)
            patcher.setattr(torch.Tensor, "item", item)
            patcher.setattr(_patch, "_read_flags", read_flags)
            load_checkpoint_weight_patches(model, patches(seed), routes=routes)
        # On CPU the covered slices are found by numpy as the replays are gathered: no read.
        assert reads == ["flags"], reads
        reads.clear()
        load_checkpoint_weight_patches(reference, patches(seed))
    assert routes.stats.replayed == 2 * len(specs)
    assert_same_state(state(model), state(reference))


@given(data=st.data())
def test_the_accelerators_batched_search_finds_the_slices_the_host_search_finds(
    data: st.DataObject,
) -> None:
    """`replay_bounds` the accelerators' way (one stacked read) agrees with numpy's search."""
    model = packed_tp_model(tp_size=2, tp_rank=data.draw(st.integers(0, 1)), dtype=torch.float32)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    routes = RouteCache()
    specs = model.checkpoint_specs()
    first = [
        CheckpointWeightPatch(n, s.shape, s.dtype, torch.zeros(1, dtype=s.dtype), torch.tensor([0]))
        for n, s in specs.items()
    ]
    load_checkpoint_weight_patches(model, first, routes=routes)
    replays = []
    for name, spec in specs.items():
        numel = math.prod(spec.shape)
        chosen = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=40)))
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        route = routes._route(name)
        assert route is not None
        replays.append((route, torch.tensor(chosen, dtype=dtype), data.draw(st.booleans())))
    found = _routes.replay_bounds(replays)
    assert _routes.replay_bounds(replays, host=False) == found
    # And validation's list of a short patch, searched by bisect.
    listed: list[tuple[_geometry.Route, torch.Tensor | list[int], bool]] = [
        (route, indices.tolist(), ordered) for route, indices, ordered in replays
    ]
    assert _routes.replay_bounds(listed) == found


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_the_accelerators_replay_run_on_cpu_equals_the_loader_path(
    index_dtype: torch.dtype, atomic: bool, tp_rank: int
) -> None:
    """What a GPU runs, run here (`_cpu_passes.HOST` off): validation's batched and blocked
    flags, read together; replay's positions shifted into a reused device buffer, block by
    block (int64 indices by one subtraction, int32 ones by a copy and a subtraction); the
    ``index_copy_`` write; an atomic call's undo of it. Patches of every size around the block
    and batch sizes, three calls in a row, against the loader path on the host's ways."""
    model = packed_tp_model(tp_size=2, tp_rank=tp_rank, dtype=torch.bfloat16)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    reference = copy.deepcopy(model)
    specs = model.checkpoint_specs()
    generator = torch.Generator().manual_seed(tp_rank)
    routes = RouteCache()
    for call in range(3):
        patches = []
        for k, (name, spec) in enumerate(specs.items()):
            numel = math.prod(spec.shape)
            count = min(numel, [1, 3, 4, 11, 40][(k + call) % 5])
            chosen = torch.randperm(numel, generator=generator)[:count].sort().values
            values = torch.randn(count, generator=generator).to(spec.dtype)
            patches.append(
                CheckpointWeightPatch(name, spec.shape, spec.dtype, values, chosen.to(index_dtype))
            )
        with small_blocks(block=5, batched=3, few=1, host=False):
            load_checkpoint_weight_patches(model, patches, routes=routes, atomic=atomic)
        load_checkpoint_weight_patches(reference, patches)
        assert_same_state(state(model), state(reference))
    assert routes.stats.replayed == 2 * len(specs)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_the_accelerators_search_settles_spans_beyond_the_index_dtype(
    index_dtype: torch.dtype,
) -> None:
    """`Segment.covered` the accelerators' way agrees with numpy's search where a span starts
    beyond what the index dtype holds (no index reaches it) or ends at or beyond it (every
    index from the start is in it), and in between."""
    top = torch.iinfo(index_dtype).max
    indices = torch.tensor([0, 5, 2**20, top - 1, top], dtype=index_dtype)
    for span in [(0, 4), (5, 2**20), (6, top - 1), (top, top), (top + 1, 2 * top), (3, 2 * top)]:
        segment = object.__new__(_geometry.Segment)  # (all `covered` reads of a segment)
        object.__setattr__(segment, "span", span)
        assert segment.covered(indices) == _geometry.host_covered(indices, span), span
        with small_blocks(host=False):
            assert segment.covered(indices) == _geometry.host_covered(indices, span), span
