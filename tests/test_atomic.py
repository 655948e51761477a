"""atomic=True: any failure mid-call restores every element the call wrote, bit for bit."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    LoaderContractError,
    PatchError,
    PerTensor,
    RouteCache,
    SingleCall,
    _load,
    _routes,
    _tuning,
    load_checkpoint_weight_patches,
)
from patchctx._bits import write_at
from patchctx._undo import UndoLog
from tests.support.models import assert_same_state, same_bits, state
from tests.test_guard import MASKED, REFUSED, Write

NAMES = [f"w{i}" for i in range(5)]


class Holder(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class Model(nn.Module):
    """Five [3, 4] weights; each name is loaded by its own write path."""

    def __init__(self, paths: dict[str, Write] | None = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ModuleDict(
            {n: Holder(torch.randn(3, 4, generator=generator)) for n in NAMES}
        )
        self.paths = paths or {}
        self.fail_after: int | None = None  # raise after this many tensors were written
        self.interrupt = False
        self.written = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if self.fail_after is not None and self.written >= self.fail_after:
                if self.interrupt:
                    raise KeyboardInterrupt
                raise RuntimeError(f"loader failed at {name}")
            holder = self.weights[name]
            assert isinstance(holder, Holder)
            path = self.paths.get(name)
            if path is None:
                holder.weight.data.copy_(tensor)
            else:
                path(holder, tensor)  # type: ignore[arg-type]
            self.written += 1
        return {f"weights.{name}.weight" for name, _ in weights}


def sparse(name: str, seed: int, count: int = 4) -> CheckpointWeightPatch:
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(12, generator=generator)[:count].sort().values
    return CheckpointWeightPatch(
        name, (3, 4), torch.float32, torch.randn(count, generator=generator), indices
    )


def dense(name: str, seed: int) -> CheckpointWeightPatch:
    generator = torch.Generator().manual_seed(seed)
    return CheckpointWeightPatch(name, (3, 4), torch.float32, torch.randn(12, generator=generator))


def test_a_loader_that_raises_after_writing_half_its_weights() -> None:
    model = Model()
    model.fail_after = 2
    before = state(model)
    patches = [sparse(n, i) for i, n in enumerate(NAMES[:4])]
    with pytest.raises(RuntimeError, match="loader failed at w2"):
        load_checkpoint_weight_patches(model, patches, atomic=True, chunking=SingleCall())
    assert_same_state(state(model), before)

    model.written = 0
    with pytest.raises(RuntimeError):
        load_checkpoint_weight_patches(model, patches, chunking=SingleCall())
    assert_same_state(state(model), before)  # the failing loader call is undone, even so

    model.written = 0
    with pytest.raises(RuntimeError):
        load_checkpoint_weight_patches(model, patches, chunking=PerTensor())
    after = state(model)
    assert not same_bits(after["weights.w0.weight"], before["weights.w0.weight"]), (
        "without atomic, the loader calls before the failing one stand"
    )
    assert same_bits(after["weights.w2.weight"], before["weights.w2.weight"])


def test_a_contract_violation_in_chunk_3_of_5() -> None:
    model = Model({"w2": dict(REFUSED)["add_"]})
    before = state(model)
    patches = [sparse(n, i) for i, n in enumerate(NAMES)]
    patches[1] = dense("w1", 9)  # a dense patch in chunk 2: O(N) undo
    with pytest.raises(LoaderContractError, match="add_"):
        load_checkpoint_weight_patches(model, patches, atomic=True, chunking=PerTensor())
    assert_same_state(state(model), before)


@pytest.mark.parametrize("interrupt", [False, True])
def test_an_exception_inside_route_replay(monkeypatch: pytest.MonkeyPatch, interrupt: bool) -> None:
    model = Model()
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [sparse(n, 1) for n in NAMES], routes=routes)
    assert len(routes) == 5
    before = state(model)
    calls = 0
    real = write_at

    def failing(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:  # inside the fourth replay, after three were written
            raise KeyboardInterrupt if interrupt else RuntimeError("replay failed")
        real(target, positions, values)

    monkeypatch.setattr(_routes, "write_at", failing)
    # Any failure is a PatchError, the exception as its cause; an interrupt stays itself.
    with pytest.raises(KeyboardInterrupt if interrupt else PatchError) as raised:
        load_checkpoint_weight_patches(
            model, [sparse(n, 2) for n in NAMES], routes=routes, atomic=True
        )
    if not interrupt:
        assert isinstance(raised.value.__cause__, RuntimeError), raised.value
    monkeypatch.undo()
    assert calls == 4 and routes.stats.replayed == 3
    assert_same_state(state(model), before)


def test_keyboard_interrupt_from_the_loader() -> None:
    model = Model()
    model.fail_after, model.interrupt = 3, True
    before = state(model)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint_weight_patches(
            model, [sparse(n, 3) for n in NAMES], atomic=True, chunking=PerTensor()
        )
    assert_same_state(state(model), before)


def test_undo_memory_is_o_nnz_for_sparse_and_o_n_for_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    logs: list[UndoLog] = []

    class Recording(UndoLog):
        def restore(self, mark: int = 0) -> None:
            logs.append(self)
            self.seen = max(getattr(self, "seen", 0), self.nbytes)
            super().restore(mark)

    monkeypatch.setattr(_load, "UndoLog", Recording)

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1000, 1000), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.w.data.copy_(tensor)
            raise RuntimeError("fail after writing")

    nnz = 100
    patch = CheckpointWeightPatch(
        "w", (1000, 1000), torch.float32, torch.ones(nnz), torch.arange(nnz) * 7
    )
    with pytest.raises(RuntimeError):
        load_checkpoint_weight_patches(Big(), [patch], atomic=True)
    sparse_bytes = logs[-1].seen  # type: ignore[attr-defined]
    assert sparse_bytes <= nnz * (8 + 4), sparse_bytes  # positions + old values
    dense_patch = CheckpointWeightPatch("w", (1000, 1000), torch.float32, torch.ones(10**6))
    with pytest.raises(RuntimeError):
        load_checkpoint_weight_patches(Big(), [dense_patch], atomic=True)
    assert logs[-1].seen >= 10**6 * 4  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------- fuzzing

# Zoo loaders that touch only the holder's weight: the identities the reference below can
# predict, and refused ones.
IDENTITIES = (
    "copy_",
    "setitem-basic-slice",
    "setitem-advanced-index",
    "copy-of-cat",
    "copy-via-empty_like",
    "index_copy_",
    "view-as-bytes",
    "copy-in-a-thread",
)
REFUSALS = (
    "add_",
    "mul_0-then-add_",
    "param.data-rebind",
    "zero-then-copy",
    "copy-into-a-plain-temporary",
    "copy-of-tolist",
    "index_add_",
)
PATHS: dict[str, Write | None] = {
    "plain-copy": None,
    **{i: dict(MASKED)[i] for i in IDENTITIES},
    **{i: dict(REFUSED)[i] for i in REFUSALS},
}
REFUSED_PATHS = set(REFUSALS)


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[dict[str, str], list[CheckpointWeightPatch], int | None, Any]:
    paths = {n: draw(st.sampled_from(sorted(PATHS))) for n in NAMES}
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6))
    patches = []
    for name in names:
        seed = draw(st.integers(0, 10**6))
        if draw(st.booleans()):
            patches.append(sparse(name, seed, count=draw(st.integers(0, 12))))
        else:
            patches.append(dense(name, seed))
    fail_after = draw(st.one_of(st.none(), st.integers(0, len(patches))))
    chunking = draw(st.sampled_from([PerTensor(), SingleCall(), None]))
    return paths, patches, fail_after, chunking


@given(scenario=scenarios(), use_routes=st.booleans())
def test_fuzz_no_sentinel_reaches_a_weight_and_failures_leave_nothing(
    scenario: tuple[dict[str, str], list[CheckpointWeightPatch], int | None, Any], use_routes: bool
) -> None:
    paths, patches, fail_after, chunking = scenario
    model = Model({n: p for n, path in paths.items() if (p := PATHS[path]) is not None})
    routes = RouteCache() if use_routes else None
    if routes is not None:  # a first round records whatever routes are provable
        with contextlib.suppress(LoaderContractError, RuntimeError):
            load_checkpoint_weight_patches(
                model, [sparse(n, 0, 1) for n in NAMES], routes=routes, atomic=True
            )
    model.fail_after, model.written = fail_after, 0
    before = state(model)
    try:
        load_checkpoint_weight_patches(
            model, patches, atomic=True, chunking=chunking, routes=routes
        )
    except (PatchError, RuntimeError):  # (strict: a path that writes nothing is refused too)
        assert_same_state(state(model), before)
    else:
        # Staged sparse data through a refused path never gets written. (A sparse patch that
        # names every element keeps nothing: it is dense data, and loads as such.)
        assert not any(
            p.indices is not None
            and p.indices.numel() < math.prod(p.shape)
            and paths[p.name] in REFUSED_PATHS
            for p in patches
        )
        if all(paths[p.name] not in REFUSED_PATHS for p in patches):
            # Only exact paths: the weights are the patches applied in input order. (Refused
            # paths applied to dense data are the loader's own transformations.)
            assert_same_state(state(model), _reference_for(before, patches))
    for tensor in model.state_dict().values():
        assert not torch.isnan(tensor).any(), "a sentinel reached a weight"


def _reference_for(
    before: dict[str, torch.Tensor], patches: list[CheckpointWeightPatch]
) -> dict[str, torch.Tensor]:
    expected = {k: v.clone() for k, v in before.items()}
    for patch in patches:
        flat = expected[f"weights.{patch.name}.weight"].view(-1)
        if patch.indices is None:
            flat.copy_(patch.values)
        else:
            flat[patch.indices] = patch.values
    return expected


def test_a_failure_after_a_large_replay_restores_every_old_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More positions than one replay block: the undo log must own its positions (the block
    buffer is reused by the next block)."""
    monkeypatch.setattr(_tuning, "BLOCK", 1 << 15)

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(400, 400), requires_grad=False)
            self.b = nn.Parameter(torch.zeros(4), requires_grad=False)
            self.fail = False

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                if name == "b" and self.fail:
                    raise RuntimeError("the second weight fails")
                getattr(self, name).data.copy_(tensor)
            return {name for name, _ in weights}

    model, routes = Big(), RouteCache()
    n = 400 * 400
    first = torch.arange(0, n, 2, dtype=torch.int32)  # 80,000 int32 positions: three blocks
    patch_a = CheckpointWeightPatch("a", (400, 400), torch.float32, torch.ones(len(first)), first)
    load_checkpoint_weight_patches(model, [patch_a], routes=routes)
    before = state(model)
    second = torch.arange(1, n, 2, dtype=torch.int32)
    patch_a2 = CheckpointWeightPatch(
        "a", (400, 400), torch.float32, torch.full((n // 2,), 2.0), second
    )
    patch_b = CheckpointWeightPatch("b", (4,), torch.float32, torch.ones(1), torch.tensor([0]))
    model.fail = True
    with pytest.raises(RuntimeError, match="second weight"):
        load_checkpoint_weight_patches(model, [patch_a2, patch_b], routes=routes, atomic=True)
    assert routes.stats.replayed == 1
    assert_same_state(state(model), before)


# ------------------------------------------------------------- loaders written as generators


class Lazy(nn.Module):
    """A [4, 6] weight and a load counter, loaded by a ``load_weights`` that is a generator.

    Its body runs only when the names it yields are read: patchctx must read them inside the
    load, where the loader's writes are guarded and logged.
    """

    def __init__(self, *, count: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(24.0).view(4, 6), requires_grad=False)
        self.loads: torch.Tensor
        self.register_buffer("loads", torch.zeros((), dtype=torch.int64))
        self.count = count
        self.fail = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        for name, tensor in weights:
            if self.count:
                self.loads.add_(1)  # the loader's own bookkeeping: a plain write
            self.weight.data.copy_(tensor)
            if self.fail:
                raise RuntimeError("the generator fails after writing")
            yield name


def _lazy_patch(kind: str, seed: int) -> CheckpointWeightPatch:
    generator = torch.Generator().manual_seed(seed)
    if kind == "dense":
        return CheckpointWeightPatch(
            "w", (4, 6), torch.float32, torch.randn(24, generator=generator)
        )
    indices = torch.randperm(24, generator=generator)[:5].sort().values
    return CheckpointWeightPatch(
        "w", (4, 6), torch.float32, torch.randn(5, generator=generator), indices
    )


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("routes", [False, True])
def test_a_generator_loader_runs_inside_the_load_and_gives_the_dense_truth(
    kind: str, atomic: bool, routes: bool
) -> None:
    model, truth = Lazy(), Lazy()
    cache = RouteCache() if routes else None
    checkpoint = truth.weight.detach().clone().view(-1)
    for seed in (1, 2):
        patch = _lazy_patch(kind, seed)
        if patch.indices is None:
            checkpoint = patch.values.clone()
        else:
            checkpoint[patch.indices] = patch.values
        with torch.no_grad():
            assert list(truth.load_weights([("w", checkpoint.view(4, 6).clone())])) == ["w"]
        loaded = load_checkpoint_weight_patches(model, [patch], atomic=atomic, routes=cache)
        assert loaded == {"w"}
        assert_same_state(state(model), state(truth))
    assert model.loads.item() == 2  # the body ran once per call, inside it


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_a_generator_loader_that_raises_part_way_leaves_nothing_with_atomic(kind: str) -> None:
    model = Lazy()
    model.fail = True
    before = state(model)
    with pytest.raises(RuntimeError, match="the generator fails after writing"):
        load_checkpoint_weight_patches(model, [_lazy_patch(kind, 3)], atomic=True)
    assert_same_state(state(model), before)


# ----------------------------------------------------------- every slot of the model put back


class Slots(nn.Module):
    """Slots a rollback must put back exactly: ``None`` ones, persistence, requires_grad."""

    def __init__(self, change: Callable[[Slots], object]) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4, bias=False)  # _parameters["bias"] is None
        self.lin.weight.requires_grad_(False)
        self.running: torch.Tensor | None
        self.register_buffer("running", None)
        self.kept: torch.Tensor
        self.register_buffer("kept", torch.zeros(4))
        self.scratch: torch.Tensor
        self.register_buffer("scratch", torch.zeros(4), persistent=False)
        self.change = change
        self.fail = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.lin.weight.data.copy_(tensor)
            self.change(self)
            if self.fail:
                raise RuntimeError("the loader fails after changing a slot")
        return {"lin.weight"}


def _shadow(model: Slots) -> None:
    del model.lin.weight
    model.lin.weight = torch.zeros(4, 6)  # not a Parameter: a plain attribute now


SLOT_CHANGES: dict[str, Callable[[Slots], object]] = {
    "none-parameter-filled": lambda m: setattr(
        m.lin, "bias", nn.Parameter(torch.zeros(4), requires_grad=False)
    ),
    "none-buffer-filled": lambda m: setattr(m, "running", torch.zeros(4)),
    "buffer-made-non-persistent": lambda m: m.register_buffer("kept", m.kept, persistent=False),
    "buffer-made-persistent": lambda m: m.register_buffer("scratch", m.scratch),
    "parameter-moved-to-the-buffers": lambda m: m.lin._buffers.update(
        weight=m.lin._parameters.pop("weight")
    ),
    "requires_grad-flipped": lambda m: m.lin.weight.requires_grad_(True),
    "parameter-replaced": lambda m: setattr(
        m.lin, "weight", nn.Parameter(torch.zeros(4, 6), requires_grad=False)
    ),
    "parameter-shadowed-by-a-plain-attribute": _shadow,
}


class _Same:
    """An object compared by identity (a tensor's ``==`` compares values)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __repr__(self) -> str:
        return f"{type(self.value).__name__} at {id(self.value):#x}"


def _slots(model: nn.Module) -> list[tuple[object, ...]]:
    """Every slot of every module in order: its kind, name, object, what the attribute reads,
    persistence and requires_grad."""
    found: list[tuple[object, ...]] = []
    for prefix, module in model.named_modules():
        kinds = (module._parameters, module._buffers, module._modules)
        for kind, slots in zip(("parameter", "buffer", "module"), kinds, strict=True):
            for name, value in slots.items():
                found.append(
                    (
                        prefix,
                        kind,
                        name,
                        _Same(value),
                        _Same(getattr(module, name)),
                        name in module._non_persistent_buffers_set,
                        getattr(value, "requires_grad", None),
                    )
                )
    return found


@pytest.mark.parametrize(
    ("kind", "atomic", "fail"),
    [
        ("sparse", False, False),
        ("dense", True, False),
        ("dense", True, True),
        ("sparse", True, True),
    ],
)
@pytest.mark.parametrize("change", SLOT_CHANGES)
def test_a_refused_or_failed_load_puts_back_every_slot_exactly(
    change: str, kind: str, atomic: bool, fail: bool
) -> None:
    model = Slots(SLOT_CHANGES[change])
    model.fail = fail
    slots, before = _slots(model), state(model)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(24 if kind == "dense" else 3, generator=generator)
    indices = None if kind == "dense" else torch.tensor([1, 7, 20])
    patch = CheckpointWeightPatch("lin.weight", (4, 6), torch.float32, values, indices)
    error = PatchError if not fail else RuntimeError
    with pytest.raises(error):
        load_checkpoint_weight_patches(model, [patch], atomic=atomic)
    assert _slots(model) == slots
    assert_same_state(state(model), before)


class ScalesItsInput(nn.Module):
    """A loader that folds a scale into its checkpoint tensor in place, then copies it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.fail = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if name == "w":
                tensor.mul_(2)
                self.w.copy_(tensor)
            elif self.fail:
                raise RuntimeError("a transient failure")
        return {name for name, _ in weights}


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("fails", [False, True])
def test_a_loader_writing_its_input_in_place_leaves_the_callers_dense_patch_as_sent(
    atomic: bool, fails: bool
) -> None:
    """The caller's values are handed to the loader without a copy: whatever it writes into
    them in place is undone when the call ends, so a retry, or the same patches applied to a
    second replica, gives the dense truth again."""
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sent = values.clone()
    patches = [
        CheckpointWeightPatch("w", (4,), torch.float32, values),
        CheckpointWeightPatch("other", (1,), torch.float32, torch.zeros(1)),
    ]
    model = ScalesItsInput()
    model.fail = fails
    raised = pytest.raises(RuntimeError) if fails else contextlib.nullcontext()
    with raised:
        # (strict=False: the loader skips "other" unless it fails on it)
        load_checkpoint_weight_patches(
            model, patches, atomic=atomic, max_chunk_bytes=16, strict=False
        )
    assert same_bits(values, sent)
    if not fails or atomic:
        expected = sent * 2 if not fails else torch.zeros(4)
        assert same_bits(model.w.detach(), expected)
    replica = ScalesItsInput()
    load_checkpoint_weight_patches(
        replica, patches, atomic=atomic, max_chunk_bytes=16, strict=False
    )
    assert same_bits(replica.w.detach(), sent * 2)
    assert same_bits(values, sent)


class _Aliased(nn.Module):
    """A weight `w` the patches go to, and a neighbour `o` the loader also writes."""

    def __init__(self, write: Callable[[_Aliased, torch.Tensor], None]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(8.0), requires_grad=False)
        self.o = nn.Parameter(-torch.arange(8.0), requires_grad=False)
        self.write = write

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.w.copy_(tensor)
            self.write(self, tensor)
        return {"w"}


def _alias_of(tensor: torch.Tensor, how: str) -> torch.Tensor:
    import ctypes

    if how == "numpy":
        return torch.from_numpy(tensor.detach().numpy())
    if how == "ctypes":
        size = tensor.numel() * tensor.element_size()
        raw = (ctypes.c_char * size).from_address(tensor.data_ptr())
        return torch.frombuffer(raw, dtype=tensor.dtype)
    return torch.utils.dlpack.from_dlpack(tensor.detach())


@pytest.mark.parametrize("how", ["numpy", "ctypes", "dlpack"])
@pytest.mark.parametrize("where", ["a slice of the neighbour", "the neighbour's tail byte"])
@pytest.mark.parametrize("protect", [False, True])
@pytest.mark.parametrize("atomic", [False, True])
def test_writes_through_an_alias_of_a_slice_are_refused_by_byte_range(
    how: str, where: str, protect: bool, atomic: bool
) -> None:
    """Ownership is by byte range, not by the storage's start: an alias of part of a model
    tensor made around torch (its storage starts inside the tensor's) is refused as a write
    into that tensor, before it happens, so neither atomic=True nor protect= misses it."""

    def write(m: _Aliased, w: torch.Tensor) -> None:
        part = m.o.data[2:6] if where == "a slice of the neighbour" else m.o.data[7:]
        _alias_of(part, how).fill_(100.0)

    model = _Aliased(write)
    before = state(model)
    patch = CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([9.0]), torch.tensor([3]))
    with pytest.raises(LoaderContractError, match=r"bytes of 'o' through a tensor of another"):
        load_checkpoint_weight_patches(
            model, [patch], atomic=atomic, protect={"o": "repacked"} if protect else None
        )
    assert_same_state(state(model), before)


def test_a_storage_resized_in_place_is_refused_and_left_exactly_as_the_error_says() -> None:
    """``untyped_storage().resize_()`` shows no torch operation, so no undo log can keep what
    it frees: the call is refused naming the weight, whose size is put back and contents
    zeroed (never uninitialised memory), with atomic=True too; the other tensors are as
    before."""

    def shrink(m: _Aliased, w: torch.Tensor) -> None:
        m.o.untyped_storage().resize_(8)

    for atomic in (False, True):
        model = _Aliased(shrink)
        patch = CheckpointWeightPatch(
            "w", (8,), torch.float32, torch.tensor([9.0]), torch.tensor([3])
        )
        with pytest.raises(LoaderContractError, match=r"'o'.*size was put back and it was zeroed"):
            load_checkpoint_weight_patches(model, [patch], atomic=atomic)
        assert model.o.untyped_storage().nbytes() == 32
        assert model.o.tolist() == [0.0] * 8
        assert torch.equal(model.w, torch.arange(8.0))
