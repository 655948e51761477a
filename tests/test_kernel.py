"""patchctx's C kernel (`patchctx/_ckernel.c` through `patchctx/_kernel.py`) against the passes it
replaces: the same verdicts and the same bytes written, for every width, alignment and
nasty value; where it does not apply it writes nothing and says so; and no caller's mistake
or other thread can make it write outside its destination.

The rest of the suite runs with the kernel where it is built (and again without it in the test
command's third pass, `--without-kernel`), each time against the loader path.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from patchctx import (
    CheckpointWeightPatch,
    RouteCache,
    _cpu_passes,
    _kernel,
    _routes,
    load_checkpoint_weight_patches,
)
from patchctx._bits import bit_view, write_at
from patchctx._cpu_passes import has_nan_bits, increasing_below
from tests.support.models import assert_same_state, packed_tp_model, random_checkpoint, state

pytestmark = pytest.mark.skipif(not _kernel.BUILT, reason="patchctx's C kernel is not built")


@pytest.fixture(autouse=True)
def _kernel_on() -> Iterator[None]:
    """The kernel in use here, whatever pass of the suite this is (`--without-kernel`)."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(_kernel, "USE", True)
        patcher.setattr(_cpu_passes, "HOST", True)
        yield


def test_the_test_command_runs_with_the_kernel_built_from_this_source() -> None:
    """`./dev test` sets PATCHCTX_REQUIRE_KERNEL=1 where a C compiler is found: the kernel must
    then have been built, from the source next to it (a stale build is not used)."""
    if os.environ.get("PATCHCTX_REQUIRE_KERNEL") == "1":
        assert _kernel.BUILT
        assert _kernel._load() is not None


def test_a_module_built_from_another_version_of_the_source_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from patchctx import _ckernel

    assert _kernel._load() is _ckernel
    monkeypatch.setattr(_ckernel, "SOURCE", "0" * 64)
    assert _kernel._load() is None


def misaligned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of 1-D `tensor` whose first element's address is not a multiple of its size."""
    if not tensor.numel():
        return tensor
    size = tensor.element_size()
    buffer = bytearray(tensor.numel() * size + 1)
    moved = torch.frombuffer(buffer, dtype=tensor.dtype, offset=1, count=tensor.numel())
    moved.copy_(tensor)
    return moved


NASTY_INDICES = [0, 1, 2**31 - 1, -1, -(2**31), 2**32 - 1, 2**62, 2**63 - 1, -(2**63)]


@st.composite
def index_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    info = torch.iinfo(dtype)
    element = st.one_of(
        st.integers(0, 300),
        st.sampled_from([v for v in NASTY_INDICES if info.min <= v <= info.max]),
    )
    listed = draw(st.lists(element, max_size=40))
    if draw(st.booleans()):
        listed = sorted(set(listed))
    return torch.tensor(listed, dtype=dtype)


@given(
    indices=index_tensors(),
    bound=st.sampled_from([0, 1, 100, 301, 2**31, 2**33, 2**63 - 1, 2**70]),
    aligned=st.booleans(),
)
def test_the_order_and_range_verdict_is_the_reference_passes(
    indices: torch.Tensor, bound: int, aligned: bool
) -> None:
    if not aligned:
        indices = misaligned(indices)
    expected = increasing_below(indices, bound)
    assert _kernel.check(indices, bound, indices, 0) is expected
    listed = indices.tolist()  # and against the definition itself
    assert expected == (
        all(0 <= v < bound for v in listed) and all(a < b for a, b in itertools.pairwise(listed))
    )


FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# Bits per width: +-0, +-inf, the NaN nearest infinity (both signs), quiet and signalling
# NaNs with payloads, the largest finite values, a subnormal.
SPECIAL_BITS = {
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7C00, 0xFC00, 0x7F81, 0xFF81, 0x7C01, 0xFC01, 0x7FFF,
        0xFFFF, 0x7F7F, 0x7BFF, 0x0001],
    4: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF,
        0x7F7FFFFF, 0x00000001],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF0000000000001,
        0xFFF0000000000001, 0x7FF8000000000000, (1 << 64) - 1, 0x7FEFFFFFFFFFFFFF, 1],
}  # fmt: skip


@st.composite
def float_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOATS))
    size = dtype.itemsize
    bits = draw(
        st.lists(
            st.one_of(st.sampled_from(SPECIAL_BITS[size]), st.integers(0, 2 ** (8 * size) - 1)),
            max_size=40,
        )
    )
    signed = [b - 2 ** (8 * size) if b >= 2 ** (8 * size - 1) else b for b in bits]
    integers = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return torch.tensor(signed, dtype=integers).view(dtype)


@given(values=float_tensors(), aligned=st.booleans())
def test_the_nan_verdict_is_the_reference_passes(values: torch.Tensor, aligned: bool) -> None:
    if not aligned:
        values = misaligned(values)
    expected = has_nan_bits(values)
    assert _kernel.has_nan(values) is expected
    indices = torch.arange(values.numel(), dtype=torch.int64)
    kind = _kernel.NAN_KIND[values.dtype]
    assert _kernel.check(indices, values.numel(), values, kind) is (not expected)
    assert expected == bool(torch.isnan(values.float()).any())  # and torch's own view of them


WIDTHS = [torch.uint8, torch.bool, torch.float8_e4m3fn, torch.bfloat16, torch.int16,
          torch.float32, torch.int32, torch.uint32, torch.float64, torch.int64,
          torch.complex64]  # fmt: skip


@given(
    dtype=st.sampled_from(WIDTHS),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_the_write_is_the_reference_write(
    dtype: torch.dtype, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    numel = data.draw(st.integers(1, 200))
    shift = data.draw(st.integers(-5, 5))
    chosen = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
    begin = data.draw(st.integers(0, len(chosen)))
    end = data.draw(st.integers(begin, len(chosen)))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    top = 2 if dtype == torch.bool else 256  # (bools hold 0 or 1: torch may rewrite others)
    raw = torch.randint(0, top, (numel * dtype.itemsize,), generator=generator).to(torch.uint8)
    target = raw.view(dtype)
    new = torch.randint(0, top, (len(chosen) * dtype.itemsize,), generator=generator)
    values = new.to(torch.uint8).view(dtype)
    indices = torch.tensor([c + shift for c in chosen], dtype=index_dtype)
    if data.draw(st.booleans()):
        indices, values = misaligned(indices), misaligned(values)
    expected = raw.clone().view(dtype)
    positions = torch.tensor(chosen[begin:end], dtype=torch.long)
    write_at(expected, positions, values[begin:end])
    version = target._version
    assert _kernel.scatter(target, indices, values, begin, end, shift)
    assert torch.equal(bit_view(target), bit_view(expected))
    assert target._version > version or begin == end


def test_the_write_bumps_the_version_autograd_checks() -> None:
    weight = torch.zeros(8, requires_grad=True)
    with torch.no_grad():
        view = weight.view(2, 4)
    output = (weight * weight).sum()  # saves weight for the backward
    with torch.no_grad():
        assert _kernel.scatter(view, torch.tensor([3]), torch.tensor([1.0]), 0, 1, 0)
    assert weight[3].item() == 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        output.backward()  # type: ignore[no-untyped-call]


class Watching(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class OwnDispatch(torch.Tensor):
    """A subclass with a dispatch of its own (its bytes may not be its values)."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


def refused_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]]:
    """target, values, a mode to write under, and a plain tensor over the target's bytes, for
    each case the kernel must refuse."""
    plain = torch.zeros(6)
    with torch.inference_mode():
        inferred = torch.zeros(6)
    negated = torch.zeros(6)
    conjugated = torch.zeros(6, dtype=torch.complex64)
    wide = torch.zeros(6, dtype=torch.complex128)
    strided = torch.zeros(6, 2)
    owned = torch.zeros(6)
    return {
        "values of another dtype": (plain, torch.ones(2, dtype=torch.float64), None, plain),
        "a target that is not contiguous": (strided[:, 0], torch.ones(2), None, strided),
        "values that are not contiguous": (plain, torch.ones(4)[::2], None, plain),
        "a lazily negated target": (torch._neg_view(negated), torch.ones(2), None, negated),
        "a lazily conjugated target": (
            conjugated.conj(),
            torch.ones(2, dtype=torch.complex64),
            None,
            conjugated,
        ),
        "an inference tensor": (inferred, torch.ones(2), None, inferred),
        "a class with a dispatch of its own": (
            owned.as_subclass(OwnDispatch),
            torch.ones(2),
            None,
            owned,
        ),
        "a dispatch mode that would see the write": (plain, torch.ones(2), Watching, plain),
        "a function mode that would see the write": (plain, torch.ones(2), Calls, plain),
        "a 16-byte element": (wide, torch.ones(2, dtype=torch.complex128), None, wide),
    }


@pytest.mark.parametrize("case", list(refused_cases()))
def test_where_the_kernel_does_not_apply_it_writes_nothing(case: str) -> None:
    target, values, mode, underlying = refused_cases()[case]
    before = bit_view(underlying).clone()
    indices = torch.tensor([1, 4])
    if mode is None:
        assert not _kernel.scatter(target, indices, values, 0, 2, 0)
    else:
        with mode() as watching:
            assert not _kernel.scatter(target, indices, values, 0, 2, 0)
        if mode is Watching:  # no operation at all (a function mode sees the checks' reads)
            assert watching.seen == []
    assert torch.equal(bit_view(underlying), before)


@pytest.mark.parametrize("reads", ["indices", "values"])
def test_indices_or_values_in_the_targets_own_bytes_are_refused_whole(reads: str) -> None:
    """A write would change what later entries read: nothing written, the caller copies."""
    storage = torch.arange(16, dtype=torch.int64)
    target = storage[:12]
    indices = storage[12:14] if reads == "values" else storage[2:4]  # 12, 13 or 2, 3
    values = storage[4:6] if reads == "values" else torch.tensor([7, 7])
    shift = 10 if reads == "values" else 0
    before = storage.clone()
    assert not _kernel.scatter(target, indices, values, 0, 2, shift)
    assert torch.equal(storage, before)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_position_outside_the_target_is_never_written_and_the_call_raises(
    index_dtype: torch.dtype,
) -> None:
    """What validation rules out, the write checks again: outside the target, nothing."""
    storage = torch.full((30,), -1.0)
    target = storage[10:20]
    indices = torch.tensor([-11, -1, 0, 5, 9, 10, 19, 2**31 - 1], dtype=index_dtype)
    values = torch.arange(8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="5 of 8 positions lay outside the destination"):
        _kernel.scatter(target, indices, values, 0, 8, 0)
    assert (storage[:10] == -1).all() and (storage[20:] == -1).all()
    assert storage[10:20].tolist() == [2, -1, -1, -1, -1, 3, -1, -1, -1, 4]


def test_another_thread_changing_the_indices_mid_write_cannot_make_it_write_outside() -> None:
    """The kernel releases the GIL on long writes; a thread that rewrites the indices then
    (after validation) gets the call refused, and nothing outside the target is written."""
    count = 1 << 18
    storage = torch.full((3 * count,), 7, dtype=torch.int16)
    target = storage[count : 2 * count]
    values = torch.ones(count, dtype=torch.int16)
    indices = torch.arange(count, dtype=torch.int64)
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set():
            indices[::997] = 3 * count  # far outside
            indices[::997] = -count - 1

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        refused = 0
        for _ in range(20):
            try:
                _kernel.scatter(target, indices, values, 0, count, 0)
            except RuntimeError:
                refused += 1
    finally:
        stop.set()
        attacker.join()
    assert (storage[:count] == 7).all() and (storage[2 * count :] == 7).all()
    assert refused  # it raced and said so


def test_threads_write_their_own_targets_at_once() -> None:
    """Long writes run without the GIL: threads writing different targets meanwhile get
    exactly their own bytes."""
    count = 1 << 17
    targets = [torch.zeros(count, dtype=torch.float32) for _ in range(4)]
    indices = torch.arange(0, count, 2, dtype=torch.int32)
    errors: list[BaseException] = []

    def write(k: int) -> None:
        try:
            values = torch.full((indices.numel(),), float(k + 1))
            for _ in range(10):
                assert _kernel.scatter(targets[k], indices, values, 0, indices.numel(), 0)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for k, target in enumerate(targets):
        assert (target[0::2] == k + 1).all() and (target[1::2] == 0).all()


class Counting:
    """The compiled module, counting its calls by function name."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        function = getattr(self.module, name)

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)

        return counted


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_replay_by_the_kernel_equals_the_loader_path_and_uses_it(
    index_dtype: torch.dtype, atomic: bool, tp_rank: int
) -> None:
    """A packed tensor-parallel layer (Q/K/V slices packed into one weight, a row-parallel
    slice, a transposed weight, a whole weight), three calls of patches from one index to a
    third of each tensor: the kernel validates every patch, and writes those replayed (whole
    tensors, packed slices and strided views; in an atomic call, after keeping what it
    overwrites), bit for bit as the loader path writes them."""
    model = packed_tp_model(tp_size=2, tp_rank=tp_rank, dtype=torch.bfloat16)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    reference = copy.deepcopy(model)
    specs = model.checkpoint_specs()
    generator = torch.Generator().manual_seed(tp_rank)
    routes = RouteCache()
    counting = Counting(_kernel._module)
    for call in range(3):
        patches = []
        for k, (name, spec) in enumerate(specs.items()):
            numel = math.prod(spec.shape)
            count = max(1, numel // [1000, 30, 3, 7, 100][(k + call) % 5])
            chosen = torch.randperm(numel, generator=generator)[:count].sort().values
            values = torch.randn(count, generator=generator).to(spec.dtype)
            patches.append(
                CheckpointWeightPatch(name, spec.shape, spec.dtype, values, chosen.to(index_dtype))
            )
        with pytest.MonkeyPatch.context() as patcher:
            patcher.setattr(_kernel, "_module", counting)
            load_checkpoint_weight_patches(model, patches, routes=routes, atomic=atomic)
        load_checkpoint_weight_patches(reference, patches)
        assert_same_state(state(model), state(reference))
    assert routes.stats.replayed == 2 * len(specs)
    assert counting.calls.get("check") == 3 * len(specs)
    # The kernel writes the direct segments in the checkpoint dtype (packed Q/K/V and
    # gate/up slices, the padded embedding), an atomic call's after reading the values they
    # overwrite for its undo log; torch the cast ones.
    written = counting.calls.get("scatter", 0)
    assert written >= 6
    assert counting.calls.get("gather", 0) == (written if atomic else 0)
    # ... and through a strided view (the row-parallel slice, the transposed weight), an
    # atomic call's after reading the positions and the values there.
    strided = counting.calls.get("scatter_strided", 0)
    assert strided >= 4
    assert counting.calls.get("gather_strided", 0) == (strided if atomic else 0)


class Whole(torch.nn.Module):
    """Five 8x8 weights, each loaded whole by a plain ``copy_``."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(8, 8), requires_grad=False) for _ in range(5)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.weights[int(name[1:])].copy_(tensor)
            names.add(name)
        return names


def test_a_whole_weight_is_written_by_one_call_of_the_kernel_per_patch() -> None:
    model = Whole()
    routes = RouteCache()
    counting = Counting(_kernel._module)
    for call in range(2):
        patches = [
            CheckpointWeightPatch(
                f"w{k}",
                (8, 8),
                torch.float32,
                torch.full((3,), float(call + k)),
                torch.tensor([k, 9 + k, 63 - k], dtype=torch.int32),
            )
            for k in range(5)
        ]
        with pytest.MonkeyPatch.context() as patcher:
            patcher.setattr(_kernel, "_module", counting)
            load_checkpoint_weight_patches(model, patches, routes=routes)
        for k, weight in enumerate(model.weights):
            assert weight.view(-1)[[k, 9 + k, 63 - k]].tolist() == [float(call + k)] * 3
            assert weight.count_nonzero() == (3 if call + k else 0)
    assert routes.stats.replayed == 5
    assert counting.calls == {"check": 10, "scatter": 5}


@st.composite
def strided_views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A view of a checkpoint-shaped tensor of element numbers, and a target view of the same
    sizes into a storage of its own: what a loader narrows, transposes, steps and copies."""
    dims = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 7)) for _ in range(dims)]
    source = torch.arange(math.prod(shape)).reshape(shape)
    for d in range(dims):  # narrow, then maybe step along, each dimension
        start = draw(st.integers(0, shape[d] - 1))
        length = draw(st.integers(1, shape[d] - start))
        source = source.narrow(d, start, length)
        step = draw(st.integers(1, 3))
        source = source[(slice(None),) * d + (slice(None, None, step),)]
    order = draw(st.permutations(range(dims)))
    source = source.permute(*order)
    # The target: the same sizes, contiguous or a strided window into a larger storage.
    if draw(st.booleans()):
        target = torch.zeros(source.shape, dtype=torch.long)
    else:
        outer = torch.zeros([s + 2 for s in source.shape], dtype=torch.long)
        target = outer[tuple(slice(1, 1 + s) for s in source.shape)]
    return source, target


@given(
    views=strided_views(),
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.int64]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_the_strided_write_is_the_view_copy_and_an_atomic_one_is_undone(
    views: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    data: st.DataObject,
) -> None:
    """Property: for sorted indices of the whole checkpoint tensor, each index the source
    view holds lands where the view's copy puts that element, the others (another rank's)
    nowhere, as the loader's ``copy_`` of the staged tensor would; an atomic call's write
    lands the same, and restoring its undo log gives every old byte back."""
    source, target = views
    numel = source.untyped_storage().nbytes() // source.element_size()
    chosen = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
    begin = data.draw(st.integers(0, len(chosen)))
    end = data.draw(st.integers(begin, len(chosen)))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    top = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, top, (len(chosen) * dtype.itemsize,), generator=generator)
    values = raw.to(torch.uint8).view(dtype)
    indices = torch.tensor(chosen, dtype=index_dtype)
    # Where each checkpoint element goes: the staged tensor's element numbers copied through
    # the two views, as the loader copies them.
    storage = target.untyped_storage().nbytes() // target.element_size()
    flat = torch.zeros(storage, dtype=dtype)
    landing = torch.full((storage,), -1, dtype=torch.long)
    torch.as_strided(landing, target.shape, target.stride(), target.storage_offset()).copy_(source)
    expected = flat.clone()
    for k in range(begin, end):
        where = (landing == chosen[k]).nonzero()
        if where.numel():
            expected.view(torch.uint8 if dtype.itemsize == 1 else dtype)[where[0, 0]] = values[k]
    geometry = _routes.Geometry.of(source)
    there = _routes.Geometry.of(target)
    plan = tuple((geometry.stride[d], geometry.size[d], there.stride[d]) for d in geometry.dims())
    before = flat.clone()
    assert _kernel.scatter_strided(
        flat, indices, values, begin, end, (geometry.offset, there.offset, plan)
    )
    assert torch.equal(bit_view(flat), bit_view(expected))
    # An atomic call's: the same bytes, and its undo log gives the old ones back.
    from patchctx._undo import UndoLog

    again, undo = before.clone(), UndoLog()
    view = (geometry.offset, there.offset, plan)
    assert _kernel.exchange_strided(again, indices, values, begin, end, view, undo.gathered(again))
    assert torch.equal(bit_view(again), bit_view(expected))
    undo.restore()
    assert torch.equal(bit_view(again), bit_view(before))


@given(
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.int64]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_an_atomic_write_keeps_what_it_overwrites_and_the_undo_log_puts_it_back(
    dtype: torch.dtype, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    """Property: `exchange` writes what `scatter` writes, hands the undo log a copy of the
    indices and the old values before writing, and restoring the log gives the bytes back."""
    from patchctx._undo import UndoLog

    numel = data.draw(st.integers(1, 120))
    shift = data.draw(st.integers(-4, 4))
    chosen = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
    begin = data.draw(st.integers(0, len(chosen)))
    end = data.draw(st.integers(begin, len(chosen)))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=generator).to(torch.uint8)
    target = raw.view(dtype)
    new = torch.randint(0, 256, (len(chosen) * dtype.itemsize,), generator=generator)
    values = new.to(torch.uint8).view(dtype)
    indices = torch.tensor([c + shift for c in chosen], dtype=index_dtype)
    before = raw.clone()
    expected = raw.clone().view(dtype)
    assert _kernel.scatter(expected, indices, values, begin, end, shift)
    undo = UndoLog()
    assert _kernel.exchange(target, indices, values, begin, end, shift, undo.keeper(target, shift))
    assert torch.equal(bit_view(target), bit_view(expected))
    indices.fill_(-1)  # the caller's indices change after: the log kept its own copy
    undo.restore()
    assert torch.equal(raw, before)


def test_an_atomic_write_keeps_the_old_values_before_it_writes_any() -> None:
    """An interrupt where the undo log takes the old values finds nothing written; one
    after finds them kept."""
    target = torch.arange(8, dtype=torch.float32)
    values = torch.tensor([10.0, 20.0])
    indices = torch.tensor([1, 6], dtype=torch.int32)
    seen: list[list[float]] = []

    def interrupted(taken: torch.Tensor, old: torch.Tensor) -> None:
        seen.append(target.tolist())
        assert taken.tolist() == [1, 6] and old.tolist() == [1.0, 6.0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _kernel.exchange(target, indices, values, 0, 2, 0, interrupted)
    assert seen == [list(map(float, range(8)))]
    assert target.tolist() == list(map(float, range(8)))  # nothing written
    with pytest.raises(RuntimeError, match="1 of 2 positions lay outside the destination"):
        _kernel.exchange(target, torch.tensor([3, 8]), values, 0, 2, 0, interrupted)
    assert target.tolist() == list(map(float, range(8)))  # refused before any write
