"""Patches whose tensors lie where they should not: indices on another device than their values,
values that view the very storage a route writes. Each loads as the dense truth."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from patchctx import (
    CheckedPatch,
    CheckpointWeightPatch,
    PerTensor,
    RouteCache,
    _routes,
    _tuning,
    load_checkpoint_weight_patches,
    validate_patches,
)
from tests.support.models import (
    Spec,
    ToyLayer,
    ToyModel,
    assert_same_state,
    packed_tp_model,
    random_checkpoint,
    state,
)


class Elsewhere(torch.Tensor):
    """CPU indices that say they lie elsewhere: numpy refuses them as it refuses CUDA ones,
    and ``.cpu()`` gives their data. A stand-in for CUDA indices on a machine without CUDA (a
    plain subclass: one with a dispatch of its own is refused outright)."""

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError("can't convert cuda:0 device type tensor to numpy (Elsewhere)")

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


def _patches(count: int, index_device: str) -> tuple[list[CheckpointWeightPatch], Any]:
    model = packed_tp_model()
    specs = model.checkpoint_specs()
    checkpoint = random_checkpoint(specs)
    model.load_weights(checkpoint.items())
    patches = []
    for name in list(specs)[:count]:
        spec = specs[name]
        indices = torch.arange(1, checkpoint[name].numel(), 5)
        values = torch.randn(indices.shape[0]).to(spec.dtype)
        checkpoint[name].view(-1)[indices] = values
        moved = (
            indices.as_subclass(Elsewhere) if index_device == "fake" else indices.to(index_device)
        )
        patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, values, moved))
    return patches, (model, checkpoint)


@pytest.mark.parametrize("count", [1, 3])
def test_cpu_values_with_indices_on_another_device_are_validated(count: int) -> None:
    """Values on the CPU, indices elsewhere: the CPU paths that read indices by numpy (one
    patch, a few one by one) bring them to the host first (they once handed them to numpy as
    they were: "can't convert cuda:0 device type tensor to numpy"). Many patches are joined
    on the values' device by ``.to``, which only a real device exercises (the next test)."""
    patches, _ = _patches(count, "fake")
    checked = validate_patches(patches)
    assert [p.name for p in checked] == [p.name for p in patches]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("count", [1, 3, 9])
def test_cpu_values_with_cuda_indices_load_as_the_dense_reload(count: int) -> None:
    patches, (model, checkpoint) = _patches(count, "cuda")
    load_checkpoint_weight_patches(model, patches)
    reference = packed_tp_model()
    reference.load_weights(checkpoint.items())
    assert_same_state(state(model), state(reference))


H = 8


class Aliased(ToyLayer):
    """A weight over the first 2H elements of a 3H buffer, loaded by one copy or by halves,
    the second half first."""

    def __init__(self, halves: bool) -> None:
        super().__init__()
        self.halves = halves
        self.buffer = torch.zeros(3 * H)
        self.buffer[2 * H :] = torch.arange(100.0, 100.0 + H)  # a spare tail, never loaded
        self.weight = nn.Parameter(self.buffer[: 2 * H], requires_grad=False)
        self.specs = {"w": Spec((2 * H,), torch.float32)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        if self.halves:
            self.weight.data[H:].copy_(loaded[H:])
            self.weight.data[:H].copy_(loaded[:H])
        else:
            self.weight.data.copy_(loaded)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("halves", [True, False], ids=["two-segments", "whole"])
@pytest.mark.parametrize("routes", [True, False], ids=["replay", "loader"])
def test_values_that_view_the_written_storage_replay_as_the_loader_stages_them(
    routes: bool, halves: bool, sparse: bool
) -> None:
    """Values read from the storage a route writes: the loader path stages them (a copy)
    before any write, so replay must read them as they were too.

    Two segments (second half first), values viewing the weight's second half and the spare
    tail: through a flat view up to the segment's last position, torch's overlap check does
    not see the values, and the second segment read values the first had just written
    (silently wrong). A whole-tensor route refused the call with torch's "some elements of the
    input tensor and the written-to tensor refer to a single memory location". A dense patch
    along its route did both, with its strided copies.
    """
    layer = Aliased(halves)
    model = ToyModel({"h": layer})
    name, shape = "h.w.weight", (2 * H,)
    model.load_weights([(name, torch.arange(2.0 * H))])
    cache = RouteCache() if routes else None
    learn = CheckpointWeightPatch(
        name, shape, torch.float32, torch.tensor([0.5]), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [learn], routes=cache)
    values = layer.buffer[H : 3 * H] if halves else layer.buffer[1 : 2 * H + 1]
    expected = values.clone()
    indices = torch.arange(2 * H) if sparse else None
    patch = CheckpointWeightPatch(name, shape, torch.float32, values, indices)
    load_checkpoint_weight_patches(model, [patch], routes=cache)
    if cache is not None:
        assert cache.stats.replayed == 1
    assert torch.equal(layer.weight.detach(), expected)


class Many(nn.Module):
    """Nine weights of 64 elements, each loaded whole by a plain ``copy_``."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(torch.arange(64.0) + 100 * k, requires_grad=False) for k in range(9)
        )

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            self.ws[int(name[1:])].copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
def test_many_short_patches_read_values_that_view_their_own_weight_as_they_were(
    atomic: bool,
) -> None:
    """A call of many short patches (validated together: their int64 positions come from
    validation, and each is one write along a whole-tensor route) whose first patch's values
    view the weight it writes, one element behind: written in order without a copy, each
    element would receive the one just written before it (the first value, everywhere)."""
    model = Many()
    cache = RouteCache()
    names = [f"w{k}" for k in range(9)]
    learn = [
        CheckpointWeightPatch(n, (64,), torch.float32, torch.tensor([0.0]), torch.tensor([0]))
        for n in names
    ]
    load_checkpoint_weight_patches(model, learn, routes=cache)
    first = model.ws[0]
    expected = [w.detach().clone() for w in model.ws]
    expected[0][1:41] = first[0:40]
    patches = [
        CheckpointWeightPatch(names[0], (64,), torch.float32, first[0:40], torch.arange(1, 41))
    ]
    for k, name in enumerate(names[1:], start=1):
        values = torch.full((40,), -float(k))
        patches.append(CheckpointWeightPatch(name, (64,), torch.float32, values, torch.arange(40)))
        expected[k][:40] = values
    load_checkpoint_weight_patches(model, patches, routes=cache, atomic=atomic)
    assert cache.stats.replayed == len(names) and cache.stats.loader_calls == 1
    for weight, want in zip(model.ws, expected, strict=True):
        assert torch.equal(weight.detach(), want)


def test_only_values_whose_bytes_meet_the_written_storage_are_copied() -> None:
    """`_apart` copies exactly the tensors that overlap what a segment writes: its bytes up
    to the segment's last, counted with the tensor's stride; neighbours are left as they are."""
    layer = Aliased(halves=True)
    model = ToyModel({"h": layer})
    name = "h.w.weight"
    cache = RouteCache()
    learn = CheckpointWeightPatch(
        name, (2 * H,), torch.float32, torch.tensor([0.5]), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [learn], routes=cache)
    route = cache._route(name)
    assert route is not None
    buffer = layer.buffer
    apart = [
        torch.ones(4),  # elsewhere
        buffer[2 * H :],  # the spare tail: right after the last byte written
    ]
    for tensor in apart:
        assert _routes._apart(tensor, route.spans) is tensor
    meeting = [
        buffer[2 * H - 1 :],  # the last written element, then the tail
        buffer[H : 2 * H],  # the second half itself
        buffer[:1],  # the first element
        buffer.as_strided((3,), (H,), 0),  # strided: elements 0, H and 2H
        buffer.as_strided((2,), (0,), H),  # expanded over one written element
    ]
    for tensor in meeting:
        copied = _routes._apart(tensor, route.spans)
        assert copied is not tensor and torch.equal(copied, tensor)
        assert copied.data_ptr() != tensor.data_ptr()


# ----------------------------------------------------------------- across patches of one call


N = _tuning.LISTED_UP_TO + 8  # more indices than validation keeps as a list
M = 2 * N  # the weights' size


class Weights(nn.Module):
    """Three weights and an int64 buffer of positions, each loaded by a plain ``copy_``."""

    a: nn.Parameter
    b: nn.Parameter
    c: nn.Parameter
    where: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        for k, name in enumerate("abc"):
            start = float(k * M)
            setattr(self, name, nn.Parameter(torch.arange(start, start + M), requires_grad=False))
        self.register_buffer("where", torch.arange(N, dtype=torch.int64))

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            getattr(self, name).copy_(tensor)
            loaded.add(name)
        return loaded


def _learnt(routes: bool) -> tuple[Weights, RouteCache | None]:
    """The model, with the route of each name recorded when `routes` (values unchanged)."""
    model = Weights()
    cache = RouteCache() if routes else None
    if cache is not None:  # a sparse patch of each name's first element, as it is
        first = [
            CheckpointWeightPatch(
                n, tuple(t.shape), t.dtype, t.view(-1)[:1].clone(), torch.tensor([0])
            )
            for n, t in model.state_dict().items()
        ]
        load_checkpoint_weight_patches(model, first, routes=cache)
    return model, cache


def _reading_the_model(case: str, count: int, model: Weights) -> list[CheckpointWeightPatch]:
    """Two patches: the first writes a model tensor that the second's values or indices view.

    Every element of the second patch's tensors, as they are when the call begins, is valid;
    after the first patch's write, they are not what validation checked (NaN values that the
    NaN strategy reserves, indices elsewhere).
    """
    a, where = model.a.view(-1), model.where.view(-1)
    nan = torch.full((M,), float("nan"))
    first_a = CheckpointWeightPatch("a", (M,), torch.float32, nan)  # dense: NaN is a value
    if case == "sparse values":  # b[:count] = a[:count] as it was
        second = CheckpointWeightPatch("b", (M,), torch.float32, a[:count], torch.arange(count))
        return [first_a, second]
    if case == "dense values":  # b = a as it was
        return [first_a, CheckpointWeightPatch("b", (M,), torch.float32, a)]
    # "sparse indices": b[where[:count]] = 1, where as it was (0 .. count - 1), not N on
    moved = torch.arange(N, 2 * N, dtype=torch.int64)
    return [
        CheckpointWeightPatch("where", (N,), torch.int64, moved),
        CheckpointWeightPatch("b", (M,), torch.float32, torch.ones(count), where[:count]),
    ]


def _as_they_were(patches: list[CheckpointWeightPatch]) -> list[CheckpointWeightPatch]:
    return [
        p._replace(
            values=p.values.clone(), indices=None if p.indices is None else p.indices.clone()
        )
        for p in patches
    ]


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("chunking", ["one call", "per tensor"])
@pytest.mark.parametrize("routes", [True, False], ids=["replay", "loader"])
@pytest.mark.parametrize("count", [4, N], ids=["short", "long"])
@pytest.mark.parametrize("case", ["sparse values", "dense values", "sparse indices"])
def test_a_patch_reads_its_tensors_as_they_were_when_the_call_began(
    case: str, count: int, routes: bool, chunking: str, atomic: bool
) -> None:
    """A patch whose values or indices view a model tensor that an earlier patch of the same
    call writes reads them as they were when the call began, on every path.

    The loader path stages a chunk's sparse patches before writing any; a replay read its
    patch when it wrote it, and a dense load when the loader copied it. So the result depended
    on routes and chunking: a sparse replay wrote NaN that validation never saw (the loader
    path, in one chunk, the values as they were), a dense load copied the new values, and
    indices read after the write put the values elsewhere (or out of range).
    """
    model, cache = _learnt(routes)
    reference = copy.deepcopy(model)
    expected_patches = _as_they_were(_reading_the_model(case, count, reference))
    load_checkpoint_weight_patches(reference, expected_patches)
    patches = _reading_the_model(case, count, model)
    policy = PerTensor() if chunking == "per tensor" else None
    load_checkpoint_weight_patches(model, patches, routes=cache, chunking=policy, atomic=atomic)
    if cache is not None:
        assert cache.stats.replayed == 2 and cache.stats.invalidated == 0
    assert_same_state(state(model), state(reference))
    assert not torch.isnan(model.b).any()


def test_only_patches_reading_a_written_storage_are_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copies cost nothing in the common case: a patch is copied only when an earlier
    write of its call reaches the storage its values or indices lie in."""
    copied: list[str] = []
    original = CheckedPatch._copied

    def counted(self: CheckedPatch) -> CheckedPatch:
        copied.append(self.name)
        return original(self)

    monkeypatch.setattr(CheckedPatch, "_copied", counted)
    for routes in (True, False):
        model, cache = _learnt(routes)
        fresh = [
            CheckpointWeightPatch("a", (M,), torch.float32, torch.ones(3), torch.arange(3)),
            CheckpointWeightPatch("b", (M,), torch.float32, torch.ones(M)),
            CheckpointWeightPatch("where", (N,), torch.int64, torch.arange(N)),
        ]
        load_checkpoint_weight_patches(model, fresh, routes=cache)
        assert copied == []
        # A view of a model tensor the call does not write: left where it is by replays (they
        # know what they write), copied before a loader call (it may write any).
        unwritten = [CheckpointWeightPatch("b", (M,), torch.float32, model.a.view(-1))]
        load_checkpoint_weight_patches(model, unwritten, routes=cache)
        assert copied == ([] if routes else ["b"])
        copied.clear()
        # Sparse values and indices never are: validation made them copies of its own.
        load_checkpoint_weight_patches(model, _reading_the_model("sparse values", 4, model))
        assert copied == []
        load_checkpoint_weight_patches(model, _reading_the_model("dense values", 4, model))
        assert copied == ["b"]
        copied.clear()


def _some_positions(seed: int, count: int) -> torch.Tensor:
    """`count` distinct positions below `M`, sorted (int64): a seeded draw (a set of a hundred
    or more integers is costly for hypothesis to draw one by one)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(M, generator=generator)[:count].sort().values


@st.composite
def reading_calls(draw: st.DrawFn, model: Weights) -> list[CheckpointWeightPatch]:
    """A call of 2 to 16 patches whose values and indices are fresh or views of the model.

    From 8 sparse patches on, validation checks them together and keeps their int64 positions,
    and each replays in one write (`_routes.replay_whole`); fewer take the other paths.
    """
    tensors = {name: getattr(model, name).view(-1) for name in "abc"}
    patches = []
    for _ in range(draw(st.integers(2, 16))):
        name = draw(st.sampled_from("abcabcabcw"))  # (the buffer of positions now and then)
        if name == "w":  # new positions, still strictly increasing and below M
            moved = _some_positions(draw(st.integers(0, 2**32 - 1)), N)
            patches.append(CheckpointWeightPatch("where", (N,), torch.int64, moved))
            continue
        source = draw(st.sampled_from(["fresh", "a", "b", "c"]))
        if draw(st.integers(0, 3)) == 0:  # dense, one patch in four
            values = torch.randn(M) if source == "fresh" else tensors[source]
            patches.append(CheckpointWeightPatch(name, (M,), torch.float32, values))
            continue
        count = draw(st.integers(1, N))
        at = draw(st.integers(0, N - count))
        values = torch.randn(count) if source == "fresh" else tensors[source][at : at + count]
        if draw(st.booleans()):
            indices = model.where.view(-1)[at : at + count]
        else:
            indices = _some_positions(draw(st.integers(0, 2**32 - 1)), count)
        patches.append(CheckpointWeightPatch(name, (M,), torch.float32, values, indices))
    return patches


@given(
    data=st.data(),
    routes=st.booleans(),
    chunking=st.sampled_from(["one call", "per tensor"]),
    atomic=st.booleans(),
)
def test_any_call_reading_the_model_equals_its_patches_applied_as_they_were(
    data: st.DataObject, routes: bool, chunking: str, atomic: bool
) -> None:
    """Property: whatever model tensors a call's patches view, and whichever of them it
    writes first, the weights equal the patches' values and indices as they were when the
    call began, applied one by one in order."""
    model, cache = _learnt(routes)
    reference = copy.deepcopy(model)
    patches = data.draw(reading_calls(model))
    as_they_were = _as_they_were(patches)
    for patch in as_they_were:
        load_checkpoint_weight_patches(reference, [patch])
    policy = PerTensor() if chunking == "per tensor" else None
    load_checkpoint_weight_patches(model, patches, routes=cache, chunking=policy, atomic=atomic)
    assert_same_state(state(model), state(reference))
