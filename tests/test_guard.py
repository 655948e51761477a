"""Fail closed: every loader of the zoo gives the dense truth or is refused with nothing changed.

The zoo (`tests/support/zoo.py`) holds ordinary-looking loaders, one write pattern each. Every
one runs across dtypes (floats, bf16, fp8, ints), strategies, ``atomic`` and routes (record,
then replay), against the oracle "bit-identical to a dense load of the patched checkpoint
through the same loader, or a `PatchError` with the model exactly as before". Its float32
outcome is the catalogue the docs' write-path table lists.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from patchctx import (
    Auto,
    BoolMask,
    CheckpointWeightPatch,
    CopyStrategy,
    IntSentinel,
    LoaderContractError,
    LoaderError,
    NaNMask,
    RouteCache,
    _swap,
    load_checkpoint_weight_patches,
    masked_copy,
)
from tests.support.zoo import (
    SHAPE,
    ZOO,
    Entry,
    Write,
    ZooLayer,
    check,
    full_state,
    same_state,
    sparse,
)

__all__ = ["MASKED", "REFUSED", "Write"]

MASKED: list[tuple[str, Write]] = [(e.id, e.write) for e in ZOO if e.outcome == "masked"]
REFUSED: list[tuple[str, Write]] = [(e.id, e.write) for e in ZOO if e.outcome == "refused"]

# Position 1 changes in both rounds, 0 in neither (the item() entries read one of each).
PATCHES = [[1, 8, 23], [1, 5, 6, 7, 20]]
VALUES = [[1.5, -2.0, 3.25], [0.5, 4.0, -1.0, 2.0, -3.5]]

FLOAT_STRATEGIES: list[CopyStrategy | None] = [None, NaNMask(), BoolMask()]
INT_STRATEGIES: list[CopyStrategy | None] = [None, IntSentinel(), BoolMask()]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.int32]


def _patches(dtype: torch.dtype) -> list[CheckpointWeightPatch]:
    return [sparse(i, v, dtype) for i, v in zip(PATCHES, VALUES, strict=True)]


def test_the_zoo_is_large_and_unique() -> None:
    ids = [e.id for e in ZOO]
    assert len(ids) == len(set(ids))
    assert len(ZOO) >= 80
    assert MASKED and REFUSED


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.id) for e in ZOO])
@pytest.mark.parametrize("strategy", FLOAT_STRATEGIES, ids=repr)
def test_float32_outcome_is_the_catalogued_one(entry: Entry, strategy: CopyStrategy | None) -> None:
    for atomic in (False, True):
        for routes in (False, True):
            verdict = check(
                entry.write,
                torch.float32,
                _patches(torch.float32),
                strategy=strategy,
                atomic=atomic,
                routes=routes,
            )
            expected = ["masked", "masked"] if entry.outcome == "masked" else ["refused"]
            assert verdict.outcomes == expected, (atomic, routes, verdict.messages)


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.id) for e in ZOO])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_gives_the_dense_truth_or_refuses_cleanly(
    entry: Entry, dtype: torch.dtype
) -> None:
    strategies = FLOAT_STRATEGIES if dtype.is_floating_point else INT_STRATEGIES
    for strategy in strategies:
        if isinstance(strategy, NaNMask) and dtype == torch.float8_e4m3fn:
            continue  # no NaN detection for this dtype on CPU: validation refuses it
        for atomic, routes in ((False, True), (True, False)):
            check(
                entry.write, dtype, _patches(dtype), strategy=strategy, atomic=atomic, routes=routes
            )


@settings(max_examples=150, deadline=None)
@given(
    entry=st.sampled_from(ZOO),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
    rounds=st.lists(
        st.lists(st.integers(0, 23), min_size=0, max_size=24, unique=True).map(sorted),
        min_size=1,
        max_size=3,
    ),
    atomic=st.booleans(),
    routes=st.booleans(),
    seed=st.integers(0, 100),
)
def test_random_patches_through_random_zoo_loaders(
    entry: Entry,
    dtype: torch.dtype,
    rounds: list[list[int]],
    atomic: bool,
    routes: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    patches = [
        sparse(indices, (torch.randn(len(indices), generator=generator) * 4).tolist(), dtype)
        for indices in rounds
    ]
    check(entry.write, dtype, patches, strategy=None, atomic=atomic, routes=routes, seed=seed)


# ------------------------------------------------------------------ what the zoo does not show


def test_a_refusal_names_the_patch_the_operation_and_the_way_out() -> None:
    verdict = check(
        dict(REFUSED)["add_"],
        torch.float32,
        _patches(torch.float32),
        strategy=None,
        atomic=False,
        routes=False,
    )
    (message,) = verdict.messages
    assert "'w'" in message and "aten.add_" in message and "nothing was written" in message


def test_zero_then_copy_is_refused_naming_the_earlier_write() -> None:
    verdict = check(
        dict(REFUSED)["zero-then-copy"],
        torch.float32,
        _patches(torch.float32),
        strategy=None,
        atomic=False,
        routes=False,
    )
    assert "zero_" in verdict.messages[0] and "dense patch" in verdict.messages[0]


def test_item_of_a_scalar_scale_is_exact_once_and_never_recorded_as_writing_nothing() -> None:
    """vLLM's default_weight_loader fills a one-element parameter with ``w.item()``."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.scale.data.fill_(tensor.item())
            return {"scale"}

    model, routes = Scaled(), RouteCache()
    for value in (2.0, 3.0, 4.0):
        patch = CheckpointWeightPatch(
            "s", (1,), torch.float32, torch.tensor([value]), torch.tensor([0])
        )
        load_checkpoint_weight_patches(model, [patch], routes=routes)
        assert model.scale.item() == value
    assert "s" not in routes and routes.stats.replayed == 0


def test_staged_data_kept_after_the_load_is_inert_and_the_load_is_refused() -> None:
    entry = dict(REFUSED)["stash-a-view"]
    model = ZooLayer(entry, torch.float32)
    before = model.weight.detach().clone()
    with pytest.raises(LoaderContractError, match="kept staged data of 'w'"):
        load_checkpoint_weight_patches(model, [sparse([1], [5.0], torch.float32)])
    assert torch.equal(model.weight.detach(), before)
    (stashed,) = model.cache
    target = torch.zeros(3, 6)
    with pytest.raises(LoaderContractError, match="after its load finished"):
        model.weight.data[1:].copy_(stashed)  # a write of it later is refused too
    with pytest.raises(LoaderContractError):
        stashed.tolist()
    assert not target.any()


def test_a_loader_thread_still_running_after_the_load_cannot_write() -> None:
    started, release, errors = threading.Event(), threading.Event(), []

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(SHAPE), requires_grad=False)

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            tensor = weights[0][1]

            def late() -> None:
                started.set()
                release.wait(10)
                try:
                    self.weight.data.copy_(tensor)
                except LoaderContractError as error:
                    errors.append(error)

            self.thread = threading.Thread(target=late)
            self.thread.start()
            started.wait(10)
            return {"weight"}

    model = Late()
    with pytest.raises(LoaderContractError, match="kept staged data"):
        load_checkpoint_weight_patches(model, [sparse([1], [5.0], torch.float32)])
    release.set()
    model.thread.join()
    assert len(errors) == 1 and not model.weight.any()


def test_other_threads_outside_the_load_are_untouched() -> None:
    started, finish = threading.Event(), threading.Event()

    def slow(m: ZooLayer, w: torch.Tensor) -> None:
        started.set()
        assert finish.wait(10)
        m.weight.data.copy_(w)

    model = ZooLayer(slow, torch.float32)
    worker = threading.Thread(
        target=load_checkpoint_weight_patches, args=(model, [sparse([1], [2.0], torch.float32)])
    )
    worker.start()
    assert started.wait(10)
    other = torch.zeros(4, 6)
    other.index_copy_(0, torch.arange(4), torch.full((4, 6), float("nan")))  # not guarded
    finish.set()
    worker.join()
    assert torch.isnan(other).all()
    assert model.weight.view(-1)[1] == 2.0


# -------------------------------------------------------------------------------- protect


class TwoWeights(nn.Module):
    """'a' and 'b' load into their own parameter; 'b' stands for a weight an engine repacked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(2, 3), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)
        return {name for name, _ in weights}


def two(name: str, value: float) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name, (2, 3), torch.float32, torch.tensor([value]), torch.tensor([4])
    )


@pytest.mark.parametrize("atomic", [False, True])
def test_protected_tensors_are_refused_before_the_write(atomic: bool) -> None:
    model = TwoWeights()
    protect = {"b": "repacked by the engine"}
    with pytest.raises(
        LoaderContractError, match=r"protected tensor 'b' \(repacked by the engine\)"
    ):
        load_checkpoint_weight_patches(
            model, [two("a", 1.0), two("b", 2.0)], protect=protect, atomic=atomic
        )
    assert not model.a.any() and not model.b.any()  # one loader call: rolled back whole
    load_checkpoint_weight_patches(model, [two("a", 1.0)], protect=protect)
    assert model.a.view(-1)[4] == 1.0


def test_known_routes_into_protected_tensors_are_refused_before_any_write() -> None:
    model = TwoWeights()
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [two("a", 1.0), two("b", 1.0)], routes=routes)
    before = (model.a.detach().clone(), model.b.detach().clone())
    with pytest.raises(LoaderContractError, match=r"nothing was written: 'b' -> 'b'"):
        load_checkpoint_weight_patches(
            model, [two("a", 5.0), two("b", 5.0)], routes=routes, protect={"b": "repacked"}
        )
    assert torch.equal(model.a, before[0]) and torch.equal(model.b, before[1])
    assert routes.stats.replayed == 0


def test_a_dense_patch_into_a_protected_tensor_is_refused_naming_the_patch() -> None:
    model = TwoWeights()
    dense = CheckpointWeightPatch("b", (2, 3), torch.float32, torch.ones(6))
    with pytest.raises(
        LoaderContractError,
        match=r"loading 'b'.*would write into the protected tensor 'b' \(repacked\)",
    ):
        load_checkpoint_weight_patches(model, [dense], protect={"b": "repacked"})
    assert not model.b.any()


def test_strategies_only_decide_validation_for_staged_data() -> None:
    """BoolMask-staged data in a NaNMask region, IntSentinel data cast first: exact."""
    from patchctx import masked_copy

    weight = torch.arange(6.0)
    staged = BoolMask().stage((6,), torch.float32, torch.tensor([2]), torch.tensor([float("nan")]))
    with masked_copy(strategy=NaNMask()):
        weight.copy_(staged)
    assert torch.isnan(weight[2]) and weight[[0, 1, 3, 4, 5]].tolist() == [0, 1, 3, 4, 5]
    ints = torch.arange(6, dtype=torch.int32)
    staged = IntSentinel().stage(
        (6,), torch.int8, torch.tensor([1]), torch.tensor([9], dtype=torch.int8)
    )
    with masked_copy(strategy=Auto()):
        ints.copy_(staged.to(torch.int32))  # the cast keeps the mask, not a sentinel value
    assert ints.tolist() == [0, 9, 2, 3, 4, 5]


def test_a_sparse_patch_covering_every_element_loads_as_dense() -> None:
    """Even through a loader no partial patch could go through (it accumulates)."""
    every = list(range(24))
    values = [float(i) for i in every]
    verdict = check(
        dict(REFUSED)["add_"],
        torch.float32,
        [sparse(every, values, torch.float32)],
        strategy=None,
        atomic=True,
        routes=False,
    )
    assert verdict.outcomes == ["masked"]


# Loaders that use the checkpoint tensor as an index (codes of a codebook) or write at positions
# it gives: exact only where the patch changes every code they use.
INDEXING = [
    "dequantize-index_select",
    "dequantize-take",
    "dequantize-gather",
    "setitem-at-staged-positions",
    "staged-index_fill_-at-staged-positions",
]


def test_staged_codes_used_as_an_index_are_refused_naming_the_patch_and_the_argument() -> None:
    verdict = check(
        dict(REFUSED)["dequantize-index_select"],
        torch.float32,
        _patches(torch.float32),
        strategy=None,
        atomic=False,
        routes=False,
    )
    (message,) = verdict.messages
    assert "'w'" in message and "aten.index_select" in message and "'index' argument" in message
    assert "dense patch" in message and "nothing was written" in message


@pytest.mark.parametrize("path", INDEXING)
@pytest.mark.parametrize("atomic", [False, True])
def test_codes_the_patch_changes_everywhere_index_exactly(path: str, atomic: bool) -> None:
    """A sparse patch naming every code, then a dense patch: no code is a placeholder."""
    every = list(range(24))
    codes = [float((7 * i) % 24) for i in every]
    verdict = check(
        dict(REFUSED)[path],
        torch.float32,
        [sparse(every, codes, torch.float32)],
        strategy=None,
        atomic=atomic,
        routes=False,
    )
    assert verdict.outcomes == ["masked"], verdict.messages
    model = ZooLayer(dict(REFUSED)[path], torch.float32)
    truth = copy.deepcopy(model)
    values = torch.tensor(codes[::-1])
    truth.load_weights([("w", values.view(SHAPE).clone())])
    dense = CheckpointWeightPatch("w", SHAPE, torch.float32, values)
    load_checkpoint_weight_patches(model, [dense], atomic=atomic)
    assert not same_state(full_state(model), full_state(truth), storages=False)


class QR(nn.Module):
    """Keeps Q of its weight in a buffer; R goes to a temporary whose diagonal is kept too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.q: torch.Tensor
        self.r_diagonal: torch.Tensor
        self.register_buffer("q", torch.zeros(4, 4))
        self.register_buffer("r_diagonal", torch.zeros(4))

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.w.copy_(tensor)
            r = torch.empty(0)
            torch.linalg.qr(self.w, out=(self.q, r))
            self.r_diagonal.copy_(r.diagonal())
        return {"w"}


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
@pytest.mark.parametrize("atomic", [False, True])
def test_each_output_of_an_out_operation_lands_where_the_loader_put_it(
    dense: bool, atomic: bool
) -> None:
    values = torch.randn(16, generator=torch.Generator().manual_seed(0))
    if dense:
        patch = CheckpointWeightPatch("w", (4, 4), torch.float32, values)
        checkpoint = values.view(4, 4).clone()
    else:
        patch = CheckpointWeightPatch(
            "w", (4, 4), torch.float32, values[:3], torch.tensor([0, 5, 10])
        )
        checkpoint = torch.zeros(16).index_copy_(0, torch.tensor([0, 5, 10]), values[:3])
    model = QR()
    truth = copy.deepcopy(model)
    truth.load_weights([("w", checkpoint.view(4, 4))])
    load_checkpoint_weight_patches(model, [patch], atomic=atomic)
    assert not same_state(full_state(model), full_state(truth), storages=False)
    assert bool(truth.r_diagonal.any())  # R was computed aside, and part of it kept


def test_an_empty_sparse_patch_changes_nothing_and_reports_the_same_names() -> None:
    model, routes = ZooLayer(dict(MASKED)["copy_"], torch.float32), RouteCache()
    before = model.weight.detach().clone()
    empty = sparse([], [], torch.float32)
    first = load_checkpoint_weight_patches(model, [empty], routes=routes)  # loader path
    second = load_checkpoint_weight_patches(model, [empty], routes=routes)  # replayed
    assert routes.stats.replayed == 1
    assert first == second == {"weight"}, "the names do not depend on replay"
    assert torch.equal(model.weight, before)
    dense = CheckpointWeightPatch("w", SHAPE, torch.float32, torch.ones(24))
    load_checkpoint_weight_patches(model, [dense])  # indices=None is still dense
    assert bool((model.weight == 1).all())


_ORIGINAL_COPY = torch.Tensor.copy_


class _Watching(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that only counts what it sees."""

    seen = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        _Watching.seen += 1
        return func(*args, **(kwargs or {}))


class LeavesItOpen(nn.Module):
    """A loader that enters a dispatch mode, or opens a masked region, and never leaves it
    (after or before its copy)."""

    def __init__(self, what: str, first: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.what, self.first = what, first

    def _open(self) -> None:
        if self.what == "mode":
            _Watching().__enter__()  # type: ignore[no-untyped-call]
        elif self.what == "infrastructure mode":  # (a slot of its own, below user modes)
            FakeTensorMode().__enter__()
        else:
            masked_copy(strategy=NaNMask()).__enter__()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.first:
            self._open()
        for _, tensor in weights:
            self.w.copy_(tensor)
        if not self.first:
            self._open()
        return {"w"}


@pytest.mark.parametrize("what", ["mode", "infrastructure mode", "region"])
@pytest.mark.parametrize("first", [False, True], ids=["after its copy", "before its copy"])
@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_a_loader_that_leaves_a_mode_or_region_open_is_refused_and_the_thread_left_clean(
    what: str, first: bool, atomic: bool, dense: bool
) -> None:
    """patchctx's guard sits below the loader's dispatch mode: left there, it would see every
    later operation of the thread; a masked region left open holds the region lock and the
    ``copy_`` swap for good. The call is refused, naming what was left, its writes rolled
    back as for any refusal, and the thread is as before (the loader's mode or region taken
    off too); a dry run of `RouteCache.warm` says so per name and leaves the thread as
    clean."""
    model = LeavesItOpen(what, first)
    values, indices = (
        (torch.arange(4.0), None) if dense else (torch.tensor([3.0]), torch.tensor([1]))
    )
    # (What a refused loader call wrote is rolled back, but for dense writes without atomic.)
    kept = dense and not atomic
    named = {"mode": "_Watching", "infrastructure mode": "FakeTensorMode"}.get(what, "masked_copy")
    patch = CheckpointWeightPatch("w", (4,), torch.float32, values, indices)
    # (Under a FakeTensorMode the loader's own copy raises: its error, as a LoaderError.)
    raised = LoaderError if what == "infrastructure mode" and first else LoaderContractError
    with pytest.raises(raised, match=named if raised is LoaderContractError else "FakeTensor"):
        load_checkpoint_weight_patches(model, [patch], atomic=atomic)
    _assert_thread_clean()
    assert model.w.tolist() == ([0.0, 1.0, 2.0, 3.0] if kept else [0.0] * 4)
    seen = _Watching.seen
    assert torch.ones(2).add(1).tolist() == [2.0, 2.0]
    assert _Watching.seen == seen, "the loader's mode still sees the thread's operations"
    report = RouteCache().warm(model, [("w", (4,), torch.float32)])
    assert [row.status for row in report.rows] == ["unlearnable"]
    assert named in report.rows[0].reason
    _assert_thread_clean()


def _assert_thread_clean() -> None:
    assert _get_current_dispatch_mode_stack() == []
    assert _swap.holder() is None, "the region lock is held"
    assert _swap.active_interceptor() is None, "a region is open on this thread"
    assert torch.Tensor.copy_ is _ORIGINAL_COPY, "copy_ is still swapped"
