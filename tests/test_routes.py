"""Route replay: bit-identical to the loader path, recorded only when provable, safely dropped."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from patchctx import (
    BoolMask,
    CheckpointWeightPatch,
    ChunkState,
    InvalidPatchError,
    LoaderContractError,
    RouteCache,
    SingleCall,
    _load,
    load_checkpoint_weight_patches,
)
from patchctx._geometry import Geometry, Segment
from patchctx._routes import replay_bounds
from tests.support.builders import Sparse, patch_sequences, sparse_patch
from tests.support.models import (
    PaddedEmbedding,
    Spec,
    ToyModel,
    assert_same_state,
    packed_tp_model,
    random_checkpoint,
    random_tensor,
    state,
)
from tests.support.reference import reference_after

# ------------------------------------------------------------------ random view loaders


@dataclass(frozen=True)
class ViewChain:
    """A loader described as data: view ops on the checkpoint tensor, then a packed target."""

    shape: tuple[int, ...]
    ops: tuple[tuple[str, tuple[int, ...]], ...]
    slots: int
    slot: int
    target_perm: tuple[int, ...]
    replicas: int
    checkpoint_dtype: torch.dtype
    param_dtype: torch.dtype

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        for op, a in self.ops:
            if op == "narrow":
                tensor = tensor.narrow(a[0], a[1], a[2])
            elif op == "select":
                tensor = tensor.select(a[0], a[1])
            elif op == "transpose":
                tensor = tensor.transpose(a[0], a[1])
            elif op == "permute":
                tensor = tensor.permute(*a)
            elif op == "unsqueeze":
                tensor = tensor.unsqueeze(a[0])
            elif op == "step":
                tensor = tensor[(slice(None),) * a[0] + (slice(None, None, a[1]),)]
        return tensor

    def view_shape(self) -> tuple[int, ...]:
        return tuple(self.apply(torch.empty(self.shape)).shape)


@st.composite
def view_chains(draw: st.DrawFn) -> ViewChain:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    current = list(shape)
    ops: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(draw(st.integers(0, 3))):
        kinds = ["narrow", "transpose", "permute", "unsqueeze", "step"]
        if len(current) > 1:
            kinds.append("select")
        kind = draw(st.sampled_from(kinds))
        ndim = len(current)
        if kind == "narrow":
            d = draw(st.integers(0, ndim - 1))
            start = draw(st.integers(0, current[d] - 1))
            length = draw(st.integers(1, current[d] - start))
            ops.append((kind, (d, start, length)))
            current[d] = length
        elif kind == "select":
            d = draw(st.integers(0, ndim - 1))
            ops.append((kind, (d, draw(st.integers(0, current[d] - 1)))))
            current.pop(d)
        elif kind == "transpose":
            a, b = draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))
            ops.append((kind, (a, b)))
            current[a], current[b] = current[b], current[a]
        elif kind == "permute":
            perm = tuple(draw(st.permutations(range(ndim))))
            ops.append((kind, perm))
            current = [current[p] for p in perm]
        elif kind == "unsqueeze":
            d = draw(st.integers(0, ndim))
            ops.append((kind, (d,)))
            current.insert(d, 1)
        else:
            d = draw(st.integers(0, ndim - 1))
            step = draw(st.integers(1, 3))
            ops.append((kind, (d, step)))
            current[d] = -(-current[d] // step)
    floats = [torch.float32, torch.bfloat16, torch.float16]
    return ViewChain(
        shape=shape,
        ops=tuple(ops),
        slots=(slots := draw(st.integers(1, 3))),
        slot=draw(st.integers(0, slots - 1)),
        target_perm=tuple(draw(st.permutations(range(len(current))))),
        replicas=draw(st.integers(1, 2)),
        checkpoint_dtype=draw(st.sampled_from(floats)),
        param_dtype=draw(st.sampled_from(floats)),
    )


class ChainModel(nn.Module):
    """Loads one checkpoint tensor "w" through a `ViewChain` into packed, permuted parameters."""

    def __init__(self, chain: ViewChain) -> None:
        super().__init__()
        self.chain = chain
        view = chain.view_shape()
        stored = tuple(view[p] for p in chain.target_perm)
        self.packs = nn.ParameterList(
            nn.Parameter(
                torch.zeros(chain.slots, *stored, dtype=chain.param_dtype), requires_grad=False
            )
            for _ in range(chain.replicas)
        )

    def target(self, replica: int) -> torch.Tensor:
        inverse = [0] * len(self.chain.target_perm)
        for i, p in enumerate(self.chain.target_perm):
            inverse[p] = i
        pack: torch.Tensor = self.packs[replica]
        return pack.data[self.chain.slot].permute(*inverse)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            source = self.chain.apply(tensor)
            for replica in range(self.chain.replicas):
                self.target(replica).copy_(source)
        return {"packs"}


@given(chain=view_chains(), data=st.data())
def test_replay_equals_the_loader_path_for_random_view_loaders(
    chain: ViewChain, data: st.DataObject
) -> None:
    model = ChainModel(chain)
    spec = Spec(chain.shape, chain.checkpoint_dtype)
    full = random_tensor(chain.shape, chain.checkpoint_dtype, torch.Generator().manual_seed(1))
    model.load_weights([("w", full)])
    routes = RouteCache()

    def as_patch(drawn: Sparse) -> CheckpointWeightPatch:
        return CheckpointWeightPatch(
            "w", chain.shape, chain.checkpoint_dtype, drawn.values, drawn.indices
        )

    first = data.draw(sparse_patch("w", spec))
    load_checkpoint_weight_patches(model, [as_patch(first)], routes=routes)
    assert "w" in routes, "a pure view loader must be replayable"

    second = data.draw(sparse_patch("w", spec))
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(reference, [as_patch(second)])  # the loader path
    load_checkpoint_weight_patches(model, [as_patch(second)], routes=routes)
    assert routes.stats.replayed == 1
    assert_same_state(state(model), state(reference))


@given(chain=view_chains(), data=st.data(), atomic=st.booleans())
def test_a_dense_patch_replays_along_the_route_as_the_loader_would_write_it(
    chain: ViewChain, data: st.DataObject, atomic: bool
) -> None:
    model = ChainModel(chain)
    spec = Spec(chain.shape, chain.checkpoint_dtype)
    generator = torch.Generator().manual_seed(2)
    model.load_weights([("w", random_tensor(chain.shape, chain.checkpoint_dtype, generator))])
    routes = RouteCache()
    first = data.draw(sparse_patch("w", spec))
    load_checkpoint_weight_patches(
        model,
        [
            CheckpointWeightPatch(
                "w", chain.shape, chain.checkpoint_dtype, first.values, first.indices
            )
        ],
        routes=routes,
    )
    numel = math.prod(chain.shape)
    # The values are a view into a larger buffer, not at its start (as a received payload's).
    buffer = random_tensor((numel + 5,), chain.checkpoint_dtype, generator)
    dense = CheckpointWeightPatch("w", chain.shape, chain.checkpoint_dtype, buffer[5:])
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(reference, [dense])  # the loader path
    calls = routes.stats.loader_calls
    load_checkpoint_weight_patches(model, [dense], routes=routes, atomic=atomic)
    assert routes.stats.loader_calls == calls  # no loader call: the route's copies
    assert_same_state(state(model), state(reference))


# ------------------------------------------------------------------ whole toy models


@given(
    data=st.data(),
    tp=st.sampled_from([(1, 0), (2, 1), (4, 3)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_rounds_of_mixed_patches_with_routes_match_the_reference(
    data: st.DataObject, tp: tuple[int, int], dtype: torch.dtype
) -> None:
    model = packed_tp_model(tp_size=tp[0], tp_rank=tp[1], dtype=dtype)
    checkpoint = random_checkpoint(model.checkpoint_specs())
    model.load_weights(checkpoint.items())
    reference = copy.deepcopy(model)
    routes = RouteCache()
    for _ in range(3):
        patches = data.draw(patch_sequences(model.checkpoint_specs(), max_size=5))
        load_checkpoint_weight_patches(model, patches, routes=routes)
        load_checkpoint_weight_patches(reference, patches)
        assert_same_state(state(model), state(reference))
    # Every layer of the packed model loads by view copies: every sparse name is replayable.
    sparse_names = set(routes)
    assert all(name in model.checkpoint_specs() for name in sparse_names)


def test_every_name_of_the_packed_model_records_a_route_and_then_replays() -> None:
    model = packed_tp_model(tp_size=2, tp_rank=1)
    checkpoint = random_checkpoint(model.checkpoint_specs())
    model.load_weights(checkpoint.items())
    routes = RouteCache()
    specs = model.checkpoint_specs()

    def patch(name: str, seed: int) -> CheckpointWeightPatch:
        numel = math.prod(specs[name].shape)
        g = torch.Generator().manual_seed(seed)
        indices = torch.randperm(numel, generator=g)[: max(1, numel // 10)].sort().values
        return CheckpointWeightPatch(
            name,
            specs[name].shape,
            specs[name].dtype,
            torch.randn(indices.numel(), generator=g),
            indices,
        )

    first = [patch(name, 1) for name in sorted(specs)]
    load_checkpoint_weight_patches(model, first, routes=routes, chunking=SingleCall())
    assert set(routes) == set(specs), "mixed chunks attribute writes by staged tensor"
    calls = len(model.load_calls)
    assert routes.stats.loader_calls == 1  # SingleCall: one load_weights call
    second = [patch(name, 2) for name in sorted(specs)]
    reference = reference_after(model, dict(checkpoint), [])
    load_checkpoint_weight_patches(reference, first + second)
    load_checkpoint_weight_patches(model, second, routes=routes)
    assert len(model.load_calls) == calls, "replay makes no loader call"
    assert routes.stats.replayed == len(specs) and routes.stats.loader_calls == 1
    assert_same_state(state(model), state(reference))


@pytest.mark.parametrize("vocab", [13, 16], ids=["padded", "no-padding"])
def test_vocabulary_padding_zero_fill_does_not_prevent_a_route(vocab: int) -> None:
    """The route makes the fill again; vLLM's fill of no rows (nothing to pad) is not kept."""
    model = ToyModel({"emb": PaddedEmbedding(vocab, 4)})
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    routes = RouteCache()
    patch = CheckpointWeightPatch(
        "emb.embed.weight", (vocab, 4), torch.float32, torch.tensor([1.0]), torch.tensor([51])
    )
    load_checkpoint_weight_patches(model, [patch], routes=routes)
    route = routes._route("emb.embed.weight")
    assert route is not None and len(route.fills) == (vocab < 16)
    load_checkpoint_weight_patches(
        model, [patch._replace(values=torch.tensor([2.0]))], routes=routes
    )
    assert routes.stats.replayed == 1 and routes.stats.invalidated == 0
    assert model.layer("emb").weight[12, 3] == 2.0
    assert not model.layer("emb").weight[vocab:].any()


# ------------------------------------------------------------------ never cached


class Layer(nn.Module):
    def __init__(self, loader: str) -> None:
        super().__init__()
        self.loader = loader
        self.weight = nn.Parameter(torch.zeros(4, 6), requires_grad=False)
        self.other = nn.Parameter(torch.zeros(4, 6), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            if self.loader == "contiguous":
                self.weight.data.copy_(tensor.t().contiguous().t())
            elif self.loader == "cast":
                self.weight.data.copy_(tensor.to(torch.float64))
            elif self.loader == "cat":
                both = torch.cat([tensor[:2], tensor[2:]])
                self.weight.data.copy_(both)
            elif self.loader == "temporary":
                scratch = torch.empty_like(tensor)
                scratch.copy_(tensor)
                self.weight.data.copy_(scratch)
            elif self.loader == "touch-after":
                self.weight.data.copy_(tensor)
                self.weight.data[1].mul_(1.0)
            elif self.loader == "twice-other-positions":
                self.weight.data.copy_(tensor)
                self.other.data.fill_(3.0)
        return {"weight"}


def test_a_loader_that_changes_a_weight_after_the_masked_copy_is_refused() -> None:
    model = Layer("touch-after")
    before = model.weight.detach().clone()
    patch = CheckpointWeightPatch("w", (4, 6), torch.float32, torch.ones(2), torch.tensor([1, 9]))
    with pytest.raises(LoaderContractError, match=r"changes 'weight' with aten\.mul_"):
        load_checkpoint_weight_patches(model, [patch], routes=RouteCache())
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("loader", ["contiguous", "cast", "cat", "temporary"])
def test_loaders_that_are_not_pure_views_are_never_cached_and_stay_correct(loader: str) -> None:
    model = Layer(loader)
    routes = RouteCache()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    patches = []
    for _ in range(3):
        indices = torch.randperm(24, generator=generator)[:5].sort().values
        patches.append(
            CheckpointWeightPatch(
                "w", (4, 6), torch.float32, torch.randn(5, generator=generator), indices
            )
        )
    for patch in patches:
        load_checkpoint_weight_patches(model, [patch], routes=routes)
    assert "w" not in routes and routes.stats.replayed == 0
    full = torch.zeros(4, 6)
    for patch in patches:
        full.view(-1)[patch.indices] = patch.values
    expected = torch.zeros(4, 6)
    mask = torch.zeros(24, dtype=torch.bool)
    for patch in patches:
        mask[patch.indices] = True
    expected.view(-1)[mask] = full.view(-1)[mask]
    assert torch.equal(model.weight.to(torch.float32), expected)
    del reference


def test_writes_elsewhere_in_the_model_do_not_prevent_a_route() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    patch = CheckpointWeightPatch(
        "w", (4, 6), torch.float32, torch.tensor([1.0]), torch.tensor([7])
    )
    load_checkpoint_weight_patches(model, [patch], routes=routes)
    assert "w" in routes


# ------------------------------------------------------------------ constant fills


class Filling(nn.Module):
    """A padded embedding whose loader makes constant fills, like vLLM's at TP=1.

    Loading ``embed`` copies the 4 vocabulary rows of `weight`, fills its 2 padding rows (with
    zeros, as vLLM does, unless `pad` says otherwise), into which ``added`` (extra tokens)
    loads, and raises the `stale` flag that `refresh` lowers. ``other`` is a plain weight.
    `gather`: the loader takes every tensor before writing any, so the order it is handed the
    names in says nothing about whose a fill is.
    """

    stale: torch.Tensor

    def __init__(self, *, gather: bool = False, pad: float = 0.0) -> None:
        super().__init__()
        self.gather, self.pad = gather, pad
        self.weight = nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.other = nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        self.register_buffer("stale", torch.zeros(1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in list(weights) if self.gather else weights:
            if name == "embed":
                self.weight.data[:4].copy_(tensor)
                self.weight.data[4:].fill_(self.pad)
                self.stale.fill_(1.0)  # what it derives must be recomputed
            elif name == "added":
                self.weight.data[4:].copy_(tensor)
            elif name == "other":
                self.other.data.copy_(tensor)
            else:
                raise KeyError(name)
        return {"weight", "other"}

    def refresh(self) -> None:
        """What the model does after a load: recompute what it derives, lower the flag."""
        self.stale.zero_()


FILLING_SHAPES = {"embed": (4, 4), "added": (2, 4), "other": (3, 2)}


def filling_patch(name: str, indices: list[int], values: list[float]) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name,
        FILLING_SHAPES[name],
        torch.float32,
        torch.tensor(values, dtype=torch.float32),
        torch.tensor(indices, dtype=torch.long),
    )


class DenseTruth:
    """The loader fed the full patched checkpoint tensors: what every call must give."""

    def __init__(self, model: Filling) -> None:
        self.checkpoint = {
            name: torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + 1
            for name, shape in FILLING_SHAPES.items()
        }
        model.load_weights(list(self.checkpoint.items()))
        self.model = copy.deepcopy(model)

    def load(self, patches: list[CheckpointWeightPatch]) -> None:
        weights = []
        for patch in patches:
            full = self.checkpoint[patch.name].clone()
            if patch.indices is None:
                full = patch.values.view(patch.shape).clone()
            else:
                full.view(-1)[patch.indices.long()] = patch.values
            self.checkpoint[patch.name] = full
            weights.append((patch.name, full))
        self.model.load_weights(weights)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_a_replay_makes_the_loaders_constant_fills_again(dense: bool) -> None:
    """The loader raises a flag the model lowers since: a replay raises it again."""
    model, routes = Filling(), RouteCache()
    truth = DenseTruth(model)
    first = filling_patch("embed", [5], [-1.0])
    load_checkpoint_weight_patches(model, [first], routes=routes)
    truth.load([first])
    assert "embed" in routes
    model.refresh()
    truth.model.refresh()
    second = filling_patch("embed", [6], [-2.0])
    if dense:
        second = second._replace(values=truth.checkpoint["embed"].flatten(), indices=None)
        second.values[6] = -2.0
    load_checkpoint_weight_patches(model, [second], routes=routes)
    truth.load([second])
    assert routes.stats.replayed == 1 and routes.stats.loader_calls == 1
    assert model.stale.item() == 1.0
    assert_same_state(state(model), state(truth.model))


@pytest.mark.parametrize("atomic", [False, True])
def test_a_replay_zeroes_padding_rows_that_another_name_wrote(atomic: bool) -> None:
    """vLLM's padded embedding: the loader path zeroes the padding each time, so replay does."""
    model, routes = Filling(), RouteCache()
    truth = DenseTruth(model)
    # (``added`` goes dense: every load of ``embed`` zeroes its rows, so the model no longer
    # holds its checkpoint values, which a sparse patch keeps where it changes nothing.)
    added = CheckpointWeightPatch("added", (2, 4), torch.float32, torch.arange(8.0) + 5, None)
    for patch in [
        filling_patch("embed", [1], [1.0]),  # records the route of embed
        added,  # writes the padding rows
        filling_patch("embed", [3], [2.0]),  # replayed: the padding rows zeroed again
    ]:
        load_checkpoint_weight_patches(model, [patch], routes=routes, atomic=atomic)
        truth.load([patch])
        assert_same_state(state(model), state(truth.model))
    assert routes.stats.replayed == 1  # the second patch to embed
    assert not model.weight[4:].any()


@pytest.mark.parametrize("gather", [False, True], ids=["streaming", "gathering"])
def test_fills_in_a_call_of_several_names_belong_to_the_name_that_makes_them(
    gather: bool,
) -> None:
    """Only ``embed`` raises the flag: replaying ``other`` must not, whatever the call order."""
    model, routes = Filling(gather=gather), RouteCache()
    truth = DenseTruth(model)
    calls = [
        [filling_patch("other", [0], [7.0]), filling_patch("embed", [0], [8.0])],
        [filling_patch("other", [1], [9.0])],
        [filling_patch("embed", [2], [3.0]), filling_patch("other", [2], [4.0])],
    ]
    for patches in calls:
        model.refresh()
        truth.model.refresh()
        load_checkpoint_weight_patches(model, patches, routes=routes, chunking=SingleCall())
        truth.load(patches)
        assert_same_state(state(model), state(truth.model))
    assert set(routes) == {"embed", "other"}  # learnt alone, after the call of both
    assert routes.stats.loader_calls == 1 and routes.stats.replayed == 3
    (embed,) = [routes._route("embed")]
    (other,) = [routes._route("other")]
    assert embed is not None and [f.tensor_name for f in embed.fills] == ["weight", "stale"]
    assert other is not None and other.fills == ()


def test_verify_finds_a_constant_fill_the_loader_no_longer_makes() -> None:
    model, routes = Filling(), RouteCache(verify_every=2)
    load_checkpoint_weight_patches(model, [filling_patch("embed", [0], [1.0])], routes=routes)
    assert routes.verify(model) == []
    model.pad = -0.0  # another constant: the route must follow the loader
    assert routes.verify(model) == ["embed"]
    load_checkpoint_weight_patches(model, [filling_patch("embed", [1], [2.0])], routes=routes)
    assert routes.stats.replayed == 1
    assert torch.equal(model.weight[4:].view(torch.int32), torch.full((2, 4), -(2**31)))


def test_a_filled_tensor_rebound_or_protected_stops_its_replay() -> None:
    model, routes = Filling(), RouteCache()
    load_checkpoint_weight_patches(model, [filling_patch("embed", [0], [1.0])], routes=routes)
    model.stale = torch.zeros(1)  # a new buffer: the fill must reach it, not the old one
    load_checkpoint_weight_patches(model, [filling_patch("embed", [1], [2.0])], routes=routes)
    assert routes.stats.invalidated == 1 and routes.stats.replayed == 0
    assert model.stale.item() == 1.0 and "embed" in routes  # recorded again
    model.refresh()
    before = state(model)
    with pytest.raises(LoaderContractError, match="protected"):
        load_checkpoint_weight_patches(
            model,
            [filling_patch("embed", [2], [3.0])],
            routes=routes,
            protect={"stale": "read by the scheduler"},
        )
    assert_same_state(state(model), before)


@st.composite
def filling_steps(draw: st.DrawFn) -> list[list[CheckpointWeightPatch] | str]:
    """Calls of sparse and dense patches, and writes of the model's own in between."""
    steps: list[list[CheckpointWeightPatch] | str] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["call", "call", "refresh", "scribble"]))
        if kind != "call":
            steps.append(kind)
            continue
        patches = []
        for name in draw(st.lists(st.sampled_from(sorted(FILLING_SHAPES)), min_size=1, max_size=3)):
            numel = math.prod(FILLING_SHAPES[name])
            # Sparse patches assume the model holds the checkpoint; ``added``'s rows are
            # zeroed by every load of ``embed``, so it is sent dense.
            if name == "added" or draw(st.booleans()) is False:
                values = draw(st.lists(st.floats(-4, 4, width=32), min_size=numel, max_size=numel))
                patches.append(
                    CheckpointWeightPatch(
                        name, FILLING_SHAPES[name], torch.float32, torch.tensor(values), None
                    )
                )
                continue
            indices = draw(st.lists(st.integers(0, numel - 1), min_size=0, max_size=4, unique=True))
            values = [draw(st.floats(-4, 4, width=32)) for _ in indices]
            patches.append(filling_patch(name, sorted(indices), values))
        steps.append(patches)
    return steps


@given(
    steps=filling_steps(),
    gather=st.booleans(),
    warm=st.booleans(),
    atomic=st.booleans(),
    single_call=st.booleans(),
)
def test_replays_with_constant_fills_equal_the_dense_truth_whatever_wrote_since(
    steps: list[list[CheckpointWeightPatch] | str],
    gather: bool,
    warm: bool,
    atomic: bool,
    single_call: bool,
) -> None:
    model, routes = Filling(gather=gather), RouteCache()
    truth = DenseTruth(model)
    if warm:
        routes.warm(model, [(name, shape, torch.float32) for name, shape in FILLING_SHAPES.items()])
    for step in steps:
        if step == "refresh":
            model.refresh()
            truth.model.refresh()
        elif step == "scribble":  # the model writes the padding rows itself
            model.weight.data[4:].fill_(9.0)
            truth.model.weight.data[4:].fill_(9.0)
        else:
            assert not isinstance(step, str)
            load_checkpoint_weight_patches(
                model,
                step,
                routes=routes,
                atomic=atomic,
                chunking=SingleCall() if single_call else None,
            )
            truth.load(step)
        assert_same_state(state(model), state(truth.model))


# ------------------------------------------------------------------ invalidation


def one_element(name: str, shape: tuple[int, ...], value: float, at: int) -> CheckpointWeightPatch:
    """A float32 patch changing one element of `name`: `value` at flat index `at`."""
    return CheckpointWeightPatch(
        name, shape, torch.float32, torch.tensor([value]), torch.tensor([at])
    )


def sparse_w(value: float, index: int = 7) -> CheckpointWeightPatch:
    return one_element("w", (4, 6), value, index)


def test_rebound_parameter_invalidates_its_route() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [sparse_w(1.0)], routes=routes)
    model.weight.data = model.weight.data.clone()  # reallocated between calls
    load_checkpoint_weight_patches(model, [sparse_w(2.0, 8)], routes=routes)
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1
    assert model.weight.view(-1)[8] == 2.0 and model.weight.view(-1)[7] == 1.0
    assert "w" in routes  # re-recorded against the new storage
    load_checkpoint_weight_patches(model, [sparse_w(3.0, 9)], routes=routes)
    assert routes.stats.replayed == 1 and model.weight.view(-1)[9] == 3.0


def test_replaced_parameter_object_invalidates_its_route() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [sparse_w(1.0)], routes=routes)
    model.weight = nn.Parameter(torch.zeros(4, 6), requires_grad=False)
    load_checkpoint_weight_patches(model, [sparse_w(2.0)], routes=routes)
    assert routes.stats.replayed == 0
    assert model.weight.view(-1)[7] == 2.0


class SharedBytes(nn.Module):
    """`b` shares its bytes with `a`: tied to it, or both views of one flat storage (as flat
    parameters are), and `slots` a view of one flat buffer with `spare` before it; the loader
    writes `b`, at the slot it reads from `slots` (as vLLM's expert map decides)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        if how == "tied":
            self.a = nn.Parameter(torch.zeros(2, 4), requires_grad=False)
            self.b = self.a
        else:
            flat = torch.zeros(20)
            self.a = nn.Parameter(flat[:8].view(2, 4), requires_grad=False)
            self.b = nn.Parameter(flat[8:16].view(2, 4), requires_grad=False)
        buffer = torch.tensor([1, 0, 1])
        self.spare = nn.Buffer(buffer[:1])
        self.slots = nn.Buffer(buffer[1:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.b.data[int(self.slots[0].item())].copy_(tensor)
        return {"b"}


@pytest.mark.parametrize("how", ["untied", "flat rebound", "read rebound"])
def test_a_tensor_sharing_bytes_with_the_one_a_route_names_is_followed(how: str) -> None:
    """The route names the first tensor found on a storage; the loader reaches the bytes
    through another name of them (a tied name, a view of a flat storage): once that one is
    untied or rebound, the route must not write the old bytes."""
    model, routes = SharedBytes("tied" if how == "untied" else "flat"), RouteCache()

    patch = partial(one_element, "b", (4,))
    # "b" is a tied name of "a": pinned to itself, so that it is loaded (and routed) as "b".
    pin = {"b": "b"}

    load_checkpoint_weight_patches(model, [patch(1.0, 1)], routes=routes, aliases=pin)
    load_checkpoint_weight_patches(model, [patch(2.0, 2)], routes=routes, aliases=pin)
    assert routes.stats.replayed == 1
    if how == "untied":
        model.b = nn.Parameter(model.b.detach().clone(), requires_grad=False)
    elif how == "flat rebound":
        model.b.data = model.b.data.clone()
    else:  # the loader now reads another slot
        model.slots.data = torch.tensor([1, 1])
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(reference, [patch(3.0, 3)])  # the loader path
    load_checkpoint_weight_patches(model, [patch(3.0, 3)], routes=routes, aliases=pin)
    assert_same_state(state(model), state(reference))
    assert routes.stats.replayed == 1 and routes.stats.invalidated == 1


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8), requires_grad=False)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()


class _Outer(nn.Module):
    """`w` (checkpoint) is loaded into `block.inner.w`, two submodules down."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.block.inner.w.copy_(tensor)
        return {"block.inner.w"}


@pytest.mark.parametrize("replaced", ["leaf", "parent", "leaf-keeping-the-tensor"])
def test_a_submodule_replaced_between_calls_is_followed_never_its_detached_tensors(
    replaced: str,
) -> None:
    """A module the model dropped keeps its tensors, and a route's live check would pass on
    them: replay must write the model's tensors, whatever object now holds them."""
    model, routes = _Outer(), RouteCache()

    patch = partial(one_element, "w", (8,))

    load_checkpoint_weight_patches(model, [patch(1.0, 2)], routes=routes)
    load_checkpoint_weight_patches(model, [patch(2.0, 3)], routes=routes)
    assert routes.stats.replayed == 1
    detached = model.block.inner
    if replaced == "leaf":
        model.block.inner = _Inner()
    elif replaced == "parent":
        model.block = _Block()
    else:  # a new module around the same parameter: the route still holds
        fresh = _Inner()
        fresh.w = detached.w
        model.block.inner = fresh
    before = detached.w.detach().clone()
    truth = model.block.inner.w.detach().clone()
    truth[5] = 3.0
    load_checkpoint_weight_patches(model, [patch(3.0, 5)], routes=routes)
    assert torch.equal(model.block.inner.w.detach(), truth)
    if replaced == "leaf-keeping-the-tensor":
        assert routes.stats.replayed == 2  # replayed into the model's (same) tensor
    else:
        assert torch.equal(detached.w.detach(), before)  # the dropped module is untouched
        assert routes.stats.replayed == 1 and routes.stats.invalidated == 1


def test_a_parameter_rebound_to_another_layout_of_its_storage_invalidates_its_route() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [sparse_w(1.0)], routes=routes)
    model.weight.data = model.weight.data.view(6, 4).t()  # same storage and shape, transposed
    reference = copy.deepcopy(model)
    assert reference.weight.stride() == model.weight.stride() == (1, 4)
    load_checkpoint_weight_patches(reference, [sparse_w(2.0, 8)])  # the loader path
    load_checkpoint_weight_patches(model, [sparse_w(2.0, 8)], routes=routes)
    assert_same_state(state(model), state(reference))
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1


def test_route_cache_api_and_dense_patches_invalidate_nothing() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    assert len(routes) == 0 and "w" not in routes and repr(routes) == "RouteCache(0 routes)"
    load_checkpoint_weight_patches(model, [sparse_w(1.0)], routes=routes)
    assert len(routes) == 1 and list(routes) == ["w"] and routes._route("w") is not None
    dense = CheckpointWeightPatch("w", (4, 6), torch.float32, torch.arange(24.0))
    load_checkpoint_weight_patches(model, [dense], routes=routes)
    assert "w" in routes and torch.equal(model.weight.view(-1), torch.arange(24.0))
    load_checkpoint_weight_patches(model, [sparse_w(-1.0, 0)], routes=routes)
    # The dense patch followed the route too: two replays, one loader call (the recording).
    assert routes.stats.replayed == 2 and routes.stats.loader_calls == 1
    assert model.weight.view(-1)[0] == -1.0
    routes.invalidate("w")
    routes.invalidate("never-seen")
    assert "w" not in routes
    load_checkpoint_weight_patches(model, [sparse_w(5.0)], routes=routes)
    routes.clear()
    assert len(routes) == 0


class Counted(Layer):
    """`Layer`, counting its loader's real calls and its dry runs (`warm`'s, on dry tensors)."""

    def __init__(self, loader: str) -> None:
        super().__init__(loader)
        self.real = 0
        self.dry = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        if any("dry" in repr(tensor) for _, tensor in weights):
            self.dry += 1
        else:
            self.real += 1
        return super().load_weights(weights)


def dense_w(start: float) -> CheckpointWeightPatch:
    return CheckpointWeightPatch("w", (4, 6), torch.float32, torch.arange(24.0) + start)


@pytest.mark.parametrize("atomic", [False, True])
def test_a_name_only_ever_sent_dense_learns_its_route_and_never_calls_the_loader(
    atomic: bool,
) -> None:
    # Only sparse loads record routes: without a dry run, a name that is always dense (a norm,
    # an embedding that changes everywhere) would go through the guarded loader every time.
    model, routes = Counted("twice-other-positions"), RouteCache(learn_dense=True)
    truth = copy.deepcopy(model)
    for step in range(3):
        patch = dense_w(10.0 * step)
        load_checkpoint_weight_patches(model, [patch], routes=routes, atomic=atomic)
        load_checkpoint_weight_patches(truth, [patch])  # the loader path, no routes
        assert_same_state(state(model), state(truth))
    assert (model.dry, model.real) == (1, 0)  # one dry run, before the first write
    assert routes.stats.replayed == 3 and routes.stats.loader_calls == 0 and "w" in routes


@pytest.mark.parametrize("loader", ["contiguous", "cast", "cat", "temporary"])
def test_a_dense_name_without_a_route_is_dry_run_once_then_loaded(loader: str) -> None:
    model, routes = Counted(loader), RouteCache(learn_dense=True)
    truth = copy.deepcopy(model)
    for step in range(3):
        patch = dense_w(10.0 * step)
        load_checkpoint_weight_patches(model, [patch], routes=routes)
        load_checkpoint_weight_patches(truth, [patch])
        assert_same_state(state(model), state(truth))
    # The dry run found no route; it is remembered, so it is not repeated.
    assert (model.dry, model.real) == (1, 3) and "w" not in routes
    routes.invalidate("w")  # forgets that too: the next dense patch tries again
    load_checkpoint_weight_patches(model, [dense_w(7.0)], routes=routes)
    assert (model.dry, model.real) == (2, 4)
    routes.clear()
    load_checkpoint_weight_patches(model, [dense_w(8.0)], routes=routes)
    assert (model.dry, model.real) == (3, 5)
    other = Counted(loader)  # another model starts over
    load_checkpoint_weight_patches(other, [dense_w(9.0)], routes=routes)
    assert (other.dry, other.real) == (1, 1)


class KeepsLast(nn.Module):
    """Loads the checkpoint tensor of the call before, keeping each one across calls."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6), requires_grad=False)
        self.last: torch.Tensor | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            if self.last is not None:
                self.w.copy_(self.last)
            self.last = tensor
        return {"w"}


@pytest.mark.parametrize("atomic", [False, True])
def test_a_dry_tensor_the_loader_kept_is_refused_clearly_in_a_later_load(atomic: bool) -> None:
    # The dry run that learns a dense name's route hands the loader a dry tensor, which this
    # loader keeps and copies in its next call: a real load. That copy must be refused as a
    # loader contract error, before it writes, not end the call with the dry run's own stop.
    model, routes = KeepsLast(), RouteCache(learn_dense=True)
    before = state(model)
    with pytest.raises(LoaderContractError, match="dry tensor"):
        load_checkpoint_weight_patches(model, [dense_w(1.0)], routes=routes, atomic=atomic)
    assert_same_state(state(model), before)


def test_a_dense_route_into_a_protected_tensor_is_refused_before_any_write() -> None:
    model, routes = Counted("twice-other-positions"), RouteCache(learn_dense=True)
    before = state(model)
    for _ in range(2):
        with pytest.raises(LoaderContractError, match="protected"):
            load_checkpoint_weight_patches(
                model, [dense_w(1.0)], routes=routes, protect={"weight": "frozen by the test"}
            )
        assert_same_state(state(model), before)
    assert (model.dry, model.real) == (1, 0)  # refused by the route the dry run learnt
    load_checkpoint_weight_patches(model, [dense_w(1.0)], routes=routes)  # not protected now
    assert torch.equal(model.weight.view(-1), torch.arange(24.0) + 1)
    assert (model.dry, model.real) == (1, 0) and routes.stats.replayed == 1


class Seen(nn.Module):
    """A loader with Python state: a name's first load goes to row 0, later ones to row 1 (a
    set of names seen, as loaders that act once every shard has arrived keep). The float64
    round trip makes its writes computations, so no route is ever learnt."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.seen: set[str] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            row = 1 if name in self.seen else 0
            self.seen.add(name)
            self.weight.data[row].copy_(tensor.to(torch.float64).to(torch.float32))
        return {"weight"}


def test_a_default_cache_never_dry_runs_a_loader_for_dense_patches() -> None:
    # The dry run is an extra call of load_weights, which a loader with Python state notices:
    # it is learn_dense=True's, never the default's.
    counted, routes = Counted("twice-other-positions"), RouteCache()
    for step in range(3):
        load_checkpoint_weight_patches(counted, [dense_w(10.0 * step)], routes=routes)
    assert (counted.dry, counted.real) == (0, 3)
    assert torch.equal(counted.weight.view(-1), torch.arange(24.0) + 20)
    seen, truth, routes = Seen(), Seen(), RouteCache()
    for step in range(2):
        patch = CheckpointWeightPatch("w", (4,), torch.float32, torch.full((4,), 1.0 + step))
        load_checkpoint_weight_patches(seen, [patch], routes=routes)
        load_checkpoint_weight_patches(truth, [patch])  # no cache at all
        assert_same_state(state(seen), state(truth))
    assert seen.weight.tolist() == [[1.0] * 4, [2.0] * 4]
    with pytest.raises(InvalidPatchError, match="learn_dense"):
        RouteCache(learn_dense=1)  # type: ignore[arg-type]


def test_a_route_cache_used_with_another_model_starts_over() -> None:
    a, b = Layer("twice-other-positions"), Layer("twice-other-positions")
    routes = RouteCache()
    load_checkpoint_weight_patches(a, [sparse_w(1.0)], routes=routes)
    load_checkpoint_weight_patches(b, [sparse_w(2.0)], routes=routes)
    assert routes.stats.replayed == 0
    assert a.weight.view(-1)[7] == 1.0 and b.weight.view(-1)[7] == 2.0


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.x = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.y = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            getattr(self, name).copy_(tensor)
        return {name for name, _ in weights}


def test_a_cache_another_thread_binds_to_another_model_mid_call_writes_only_this_model() -> None:
    """Two threads share one cache, each with its own model: the other thread's calls land
    in the middle of this one's (here, while a chunk is gathered). This call's patches go to
    its own model, never along the routes the other thread recorded on its model."""
    a, b, routes = _Three(), _Three(), RouteCache()

    def patch(name: str, value: float, at: int) -> CheckpointWeightPatch:
        return CheckpointWeightPatch(
            name, (4,), torch.float32, torch.tensor([value]), torch.tensor([at])
        )

    class OtherThreadMidway:
        def split_before(self, chunk: ChunkState, /) -> bool:
            def other() -> None:  # records the route of "w" on b, then replays it
                load_checkpoint_weight_patches(b, [patch("w", 1.0, 0)], routes=routes)
                load_checkpoint_weight_patches(b, [patch("w", 2.0, 1)], routes=routes)

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            return False

    load_checkpoint_weight_patches(
        a,
        [patch("x", 1.0, 0), patch("y", 2.0, 1), patch("w", 3.0, 2)],
        routes=routes,
        chunking=OtherThreadMidway(),
    )
    assert [a.w.tolist(), a.x.tolist(), a.y.tolist()] == [[0, 0, 3, 0], [1, 0, 0, 0], [0, 2, 0, 0]]
    assert [b.w.tolist(), b.x.tolist(), b.y.tolist()] == [[1, 2, 0, 0], [0] * 4, [0] * 4]


def test_a_different_shape_or_dtype_for_the_name_goes_through_the_loader() -> None:
    model = Layer("twice-other-positions")
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [sparse_w(1.0)], routes=routes)
    bf16 = CheckpointWeightPatch(
        "w", (4, 6), torch.bfloat16, torch.tensor([2.0]), torch.tensor([3])
    )
    load_checkpoint_weight_patches(model, [bf16], routes=routes)
    assert routes.stats.replayed == 0 and model.weight.view(-1)[3] == 2.0


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sort", [True, False])
def test_replay_with_unsorted_and_sorted_indices(index_dtype: torch.dtype, sort: bool) -> None:
    model = packed_tp_model(tp_size=2, tp_rank=1)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    routes = RouteCache()
    spec = model.checkpoint_specs()["down.down_proj.weight"]  # row-parallel: strided source
    generator = torch.Generator().manual_seed(3)

    def patch() -> CheckpointWeightPatch:
        indices = torch.randperm(math.prod(spec.shape), generator=generator)[:50]
        if sort:
            indices = indices.sort().values
        return CheckpointWeightPatch(
            "down.down_proj.weight",
            spec.shape,
            spec.dtype,
            torch.randn(50, generator=generator),
            indices.to(index_dtype),
        )

    load_checkpoint_weight_patches(model, [patch()], routes=routes)
    second = patch()
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(reference, [second])
    load_checkpoint_weight_patches(model, [second], routes=routes)
    assert routes.stats.replayed == 1
    assert_same_state(state(model), state(reference))


def _positions_by_geometry(segment: Segment, indices: list[int]) -> list[int]:
    """Storage positions of the checkpoint `indices` a segment covers, in Python integers."""
    source, target = segment.source, segment.target
    found = []
    for index in indices:
        rest, position = index - source.offset, target.offset
        for d in source.dims():
            coordinate, rest = divmod(rest, source.stride[d])
            if not 0 <= coordinate < source.size[d]:
                break
            position += coordinate * target.stride[d]
        else:
            if rest == 0:
                found.append(position)
    return found


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize(
    ("source", "target"),
    [
        # A small checkpoint tensor into a slice of a huge fused weight (an expert at element
        # 2**31 and beyond): positions above int32 from int32 indices.
        (Geometry((1024,), (1,), 0), Geometry((1024,), (1,), 2**31 + 100)),
        (Geometry((1024,), (1,), 0), Geometry((1024,), (1,), 2**32 + 100)),
        (Geometry((32, 32), (32, 1), 0), Geometry((32, 32), (1, 32), 2**31 + 7)),
        # A slice of a checkpoint tensor of more than 2**31 elements that straddles 2**31.
        (Geometry((1024,), (1,), 2**31 - 512), Geometry((1024,), (1,), 0)),
        (Geometry((64, 16), (2**25, 1), 2**31 - 2**25 * 8), Geometry((64, 16), (16, 1), 0)),
    ],
    ids=["fused-2**31", "fused-2**32", "fused-transposed", "straddling", "straddling-rows"],
)
def test_positions_beyond_int32_are_exact_from_int32_indices(
    source: Geometry, target: Geometry, index_dtype: torch.dtype, sort: bool
) -> None:
    """Replay's positions are int64 arithmetic on any index dtype: a bound or a shift beyond
    int32 does not wrap with int32 indices (metadata only: nothing of that size exists)."""
    layout = Geometry((2**33,), (1,), 0)
    segment = Segment(source, target, "w", 0, torch.float32, layout)
    low, high = source.span()
    top = min(high, 2**31 - 1)
    candidates = sorted({low, low + 1, (low + top) // 2, top - 1, top, low + source.stride[-1]})
    indices = torch.tensor(candidates if sort else candidates[::-1], dtype=index_dtype)
    found, picked = segment.positions(indices, sorted_unique=sort)
    expected = _positions_by_geometry(segment, indices.tolist())
    assert found.dtype == torch.long
    assert found.tolist() == expected
    assert torch.arange(indices.shape[0])[picked].tolist() == [
        k for k, i in enumerate(indices.tolist()) if _positions_by_geometry(segment, [i])
    ]


@pytest.mark.parametrize("first", [4, 5, 6])
@pytest.mark.parametrize("last", [13, 14, 15])
def test_a_segment_writes_through_its_tensor_exactly_when_it_lies_within_it(
    first: int, last: int
) -> None:
    """`Segment.inside`: replay writes a direct segment through the live tensor itself (no
    flat view of the storage) only when the tensor is contiguous and the segment's run lies
    within its elements; checkpoint index i is then the tensor's element ``i - _inside``,
    the storage position ``i - _shift``."""
    storage = torch.zeros(40)
    weight = storage[5:15]  # elements 5 to 14 of the storage
    layout = Geometry.of(weight)
    count = last - first + 1
    source = Geometry((count,), (1,), 3)  # checkpoint indices 3 .. 3 + count - 1
    segment = Segment(source, Geometry((count,), (1,), first), "w", 0, torch.float32, layout)
    within = first >= 5 and last <= 14
    assert (segment.inside is not None) is within
    assert segment.shift is not None
    if within:
        assert segment.inside is not None
        flat = weight.view(-1)
        for index in range(3, 3 + count):
            assert (
                flat[index - segment.inside].data_ptr() == storage[index - segment.shift].data_ptr()
            )
    strided = Geometry.of(storage[5:25:2])  # not contiguous: the storage's flat view always
    spread = Segment(source, Geometry((count,), (1,), first), "w", 0, torch.float32, strided)
    assert spread.inside is None
    stepped = Segment(source, Geometry((count,), (2,), first), "w", 0, torch.float32, layout)
    assert stepped.inside is None  # not a contiguous run: not direct


# ------------------------------------------------------------------ verification
# ------------------------------------------------------------------ verification


class Ranked(nn.Module):
    """Loads this rank's half of the checkpoint tensor: the mapping depends on an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 6), requires_grad=False)
        self.rank = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.data.copy_(tensor.view(2, 2, 6)[self.rank])
        return {"weight"}


def ranked_patch(index: int, value: float) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        "w", (4, 6), torch.float32, torch.tensor([value]), torch.tensor([index])
    )


def test_verify_finds_a_route_the_loader_no_longer_follows_and_changes_nothing() -> None:
    model, routes = Ranked(), RouteCache()
    load_checkpoint_weight_patches(model, [ranked_patch(1, 1.0)], routes=routes)
    before = model.weight.detach().clone()
    assert routes.verify(model) == []
    model.rank = 1  # the mapping changed; the tensors did not
    assert routes.verify(model) == ["w"]
    assert torch.equal(model.weight, before), "verify writes nothing"
    assert routes.stats.mismatched == 1
    load_checkpoint_weight_patches(model, [ranked_patch(13, 2.0)], routes=routes)
    assert model.weight[0, 1] == 2.0, "the corrected route is replayed"
    assert routes.stats.replayed == 1


def test_verify_every_k_sends_every_kth_patch_through_the_loader() -> None:
    model, routes = Ranked(), RouteCache(verify_every=2)
    for i in range(4):
        load_checkpoint_weight_patches(model, [ranked_patch(i, float(i))], routes=routes)
    # The first records the route; of its 3 uses, the 2nd went through the loader.
    assert routes.stats.verified == 1 and routes.stats.mismatched == 0
    assert routes.stats.replayed == 2
    model.rank = 1
    load_checkpoint_weight_patches(model, [ranked_patch(12, 5.0)], routes=routes)  # 4th use
    assert routes.stats.verified == 2 and routes.stats.mismatched == 1
    assert model.weight[0, 0] == 5.0, "the loader path applied it, and its route replaces"
    load_checkpoint_weight_patches(model, [ranked_patch(13, 6.0)], routes=routes)
    assert model.weight[0, 1] == 6.0 and routes.stats.replayed == 3
    with pytest.raises(InvalidPatchError, match="verify_every"):
        RouteCache(verify_every=0)


def test_overlaps_are_compared_in_storage_bytes() -> None:
    """A constant fill through a byte view of the weight overlaps the element spans it hits."""

    class Bytes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 6), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.weight.data[:2].copy_(tensor[:2])
                # bytes 48..95 of the storage are elements 12..23 (rows 2-3): disjoint from rows
                # 0-1 in bytes, though not in "positions" of a uint8 view (0..47 vs 12..23)
                self.weight.data.view(-1).view(torch.uint8)[48:].fill_(0)
            return {"weight"}

    model, routes = Bytes(), RouteCache()
    load_checkpoint_weight_patches(model, [ranked_patch(1, 1.0)], routes=routes)
    assert "w" in routes, "disjoint in bytes: replayable"
    model.weight.data[2:] = 5.0  # written since: the replay fills the same bytes again
    load_checkpoint_weight_patches(model, [ranked_patch(2, 2.0)], routes=routes)
    assert routes.stats.replayed == 1 and not model.weight[2:].any()
    assert model.weight[0, 1:3].tolist() == [1.0, 2.0]

    class Overlapping(Bytes):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.weight.data[2:].copy_(tensor[2:])
                self.weight.data.view(-1).view(torch.uint8)[:8].fill_(0)  # elements 0 and 1
                self.weight.data[:2].copy_(tensor[:2])
            return {"weight"}

    model, routes = Overlapping(), RouteCache()
    with pytest.raises(LoaderContractError, match="before writing staged data"):
        load_checkpoint_weight_patches(model, [ranked_patch(1, 1.0)], routes=routes)


class Whole(nn.Module):
    """One weight loaded whole by ``copy_``, in a layout chosen by the test."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        storage = torch.zeros(40)
        if layout == "offset":  # a contiguous parameter that starts inside a larger storage
            weight = storage[7:31].view(4, 6)
        elif layout == "transposed":  # the same shape, column-major
            weight = torch.zeros(6, 4).t()
        elif layout == "cast":  # float32 checkpoint, float64 parameter
            weight = torch.zeros(4, 6, dtype=torch.float64)
        else:
            weight = torch.zeros(4, 6)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.copy_(tensor)
        return {"weight"}


@pytest.mark.parametrize(
    ("layout", "whole"),
    [("plain", True), ("offset", True), ("transposed", False), ("cast", False)],
)
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
def test_whole_tensor_routes_write_in_one_step_only_where_positions_are_element_indices(
    layout: str, whole: bool, values_dtype: torch.dtype, atomic: bool
) -> None:
    """The one-write replay (checkpoint index = element of the parameter's flat view) is taken
    only for a contiguous parameter in the checkpoint dtype, wherever its storage starts; every
    other layout, cast or option takes the general path, and all agree with the loader."""
    model, reference = Whole(layout), Whole(layout)
    routes = RouteCache()
    generator = torch.Generator().manual_seed(3)

    def patch(count: int) -> CheckpointWeightPatch:
        indices = torch.randperm(24, generator=generator)[:count].sort().values
        values = torch.randn(count, generator=generator, dtype=torch.float64).to(values_dtype)
        return CheckpointWeightPatch("w", (4, 6), torch.float32, values, indices.int())

    for count in (5, 1, 24, 0, 9):
        update = [patch(count)]
        load_checkpoint_weight_patches(model, update, routes=routes, atomic=atomic)
        load_checkpoint_weight_patches(reference, update)
        assert_same_state(state(model), state(reference))
    route = routes._route("w")
    assert route is not None and route.whole is whole
    assert routes.stats.replayed == 4
    if layout == "offset":  # the storage around the parameter is untouched
        storage = model.weight.untyped_storage()
        around = torch.tensor([], dtype=torch.float32).set_(storage)
        assert not around[:7].any() and not around[31:].any()


def test_verify_checks_every_route_when_some_hold_bool_or_complex_data() -> None:
    """Routes learnt with BoolMask for a bool buffer and a complex weight: `verify` still
    probes all of them (the default strategy stages neither) and finds the stale one."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rank = 0
            self.w = nn.Parameter(torch.zeros(2), requires_grad=False)
            self.mask = nn.Buffer(torch.zeros(3, dtype=torch.bool))
            self.z = nn.Parameter(torch.zeros(2, dtype=torch.complex64), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                if name == "w":
                    self.w.copy_(tensor.view(2, 2)[self.rank])
                else:
                    getattr(self, name).copy_(tensor)
            return {"w", "mask", "z"}

    model, routes = Mixed(), RouteCache()
    patches = [
        CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(1), torch.tensor([0])),
        CheckpointWeightPatch(
            "mask", (3,), torch.bool, torch.ones(1, dtype=torch.bool), torch.tensor([1])
        ),
        CheckpointWeightPatch(
            "z", (2,), torch.complex64, torch.ones(1, dtype=torch.complex64), torch.tensor([0])
        ),
    ]
    load_checkpoint_weight_patches(model, patches, routes=routes, strategy=BoolMask())
    assert set(routes) == {"w", "mask", "z"}
    assert routes.verify(model) == []
    model.rank = 1  # the mapping of "w" changed: its route is stale
    assert routes.verify(model) == ["w"]


class Experts(nn.Module):
    """Two local expert slots; the loader looks up each expert's slot in a model buffer, as
    vLLM's expert-parallel MoE loader does with its expert map."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.expert_map = nn.Buffer(torch.tensor([0, 1]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if name == "expert_map":
                self.expert_map.copy_(tensor)
            else:  # "experts.E.w"
                slot = int(self.expert_map[int(name.split(".")[1])].item())
                self.w.data[slot].copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("how", ["warm", "first patch"])
@pytest.mark.parametrize("change", ["dense patch", "in place"])
def test_a_route_follows_the_model_state_its_loader_read_out_of_torch(
    how: str, change: str
) -> None:
    """The loader decided where to write on a value it read with ``.item()``: once that
    tensor changes (a rebalance of the expert map), the route is not replayed."""
    model, routes = Experts(), RouteCache()
    if how == "warm":
        specs = [("experts.0.w", (4,), torch.float32), ("experts.1.w", (4,), torch.float32)]
        routes.warm(model, specs)
    else:
        first = CheckpointWeightPatch(
            "experts.0.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
        )
        load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "experts.0.w" in routes
    patch = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.tensor([5.0]), torch.tensor([2])
    )
    load_checkpoint_weight_patches(model, [patch], routes=routes)  # unchanged: replayed
    assert routes.stats.replayed == 1 and model.w[0, 2] == 5.0
    swapped = torch.tensor([1, 0])  # the experts swap slots
    if change == "dense patch":
        load_checkpoint_weight_patches(
            model, [CheckpointWeightPatch("expert_map", (2,), torch.int64, swapped)]
        )
    else:
        model.expert_map.copy_(swapped)
    truth = copy.deepcopy(model)
    full = torch.zeros(4)
    full[2] = 7.0
    truth.load_weights([("experts.0.w", full)])
    moved = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2])
    )
    load_checkpoint_weight_patches(model, [moved], routes=routes)
    assert torch.equal(model.w, truth.w)
    assert routes.stats.invalidated == 1


def patch_where_the_loader_now_writes(
    model: Experts | CountedSlots, routes: RouteCache, name: str, slot: int
) -> None:
    """Patch position 2 of expert `name`, whose loader now writes it into row `slot` of
    ``model.w``: the model ends as a copy of it loaded with the full tensor does."""
    truth = copy.deepcopy(model)
    full = truth.w[slot].clone()
    full[2] = 7.0
    truth.load_weights([(name, full)])
    moved = CheckpointWeightPatch(name, (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2]))
    load_checkpoint_weight_patches(model, [moved], routes=routes)
    assert_same_state(state(model), state(truth))


class ComputedSlots(Experts):
    """`Experts` whose loader reads the slot out of a tensor computed from the expert map."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            expert = int(name.split(".")[1])
            if self.read == "comparison":
                slot = 0 if self.expert_map[expert] == 0 else 1
            elif self.read == "cast":
                slot = int(self.expert_map[expert].to(torch.int32).item())
            elif self.read == "arithmetic":
                slot = int(self.expert_map[expert] + 0)
            else:  # "nonzero": where the expert sits
                slot = int((self.expert_map == expert).nonzero()[0, 0])
            self.w.data[slot].copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("how", ["warm", "first patch"])
@pytest.mark.parametrize("read", ["comparison", "cast", "arithmetic", "nonzero"])
def test_a_route_follows_model_values_read_through_a_computed_tensor(how: str, read: str) -> None:
    """The loader reads a value of a tensor it computed from the expert map (a comparison, a
    cast, arithmetic, ``nonzero``): after a rebalance, the route is not replayed."""
    model, routes = ComputedSlots(read), RouteCache()
    if how == "warm":
        routes.warm(model, [("experts.0.w", (4,), torch.float32)])
    else:
        first = CheckpointWeightPatch(
            "experts.0.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
        )
        load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "experts.0.w" in routes
    model.expert_map.copy_(torch.tensor([1, 0]))  # the experts swap slots
    patch_where_the_loader_now_writes(model, routes, "experts.0.w", 1)
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1


@pytest.mark.parametrize("map_patch", ["dense, through the loader", "sparse, replayed"])
def test_a_route_follows_model_values_an_earlier_patch_of_the_same_call_changes(
    map_patch: str,
) -> None:
    """A rebalance sent in the same call as an expert's patch, before it: the expert's route
    (which read the old map) is not replayed, whether the map goes through the loader or
    along its own route."""
    model, routes = Experts(), RouteCache()
    first = CheckpointWeightPatch(
        "expert_map", (2,), torch.int64, torch.tensor([0]), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [first], routes=routes)
    expert = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [expert], routes=routes)
    assert {"expert_map", "experts.0.w"} <= set(routes)
    swapped = torch.tensor([1, 0])  # the experts swap slots
    if map_patch == "sparse, replayed":
        rebalance = CheckpointWeightPatch(
            "expert_map", (2,), torch.int64, swapped, torch.tensor([0, 1])
        )
    else:
        rebalance = CheckpointWeightPatch("expert_map", (2,), torch.int64, swapped)
    truth = copy.deepcopy(model)
    truth.expert_map.copy_(swapped)
    full = truth.w[1].clone()
    full[2] = 7.0
    truth.load_weights([("experts.0.w", full)])
    moved = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2])
    )
    load_checkpoint_weight_patches(model, [rebalance, moved], routes=routes)
    assert_same_state(state(model), state(truth))


def test_a_map_rebuilt_at_the_same_address_is_another_tensor() -> None:
    """The expert map is replaced by another tensor at the address of the one the loader read,
    unwritten since its creation (as an allocator hands a freed block out again): the route
    that read the old map is not replayed."""
    model, routes = Experts(), RouteCache()
    held = numpy.array([0, 1])
    model.expert_map = nn.Buffer(torch.from_numpy(held))
    first = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "experts.0.w" in routes
    read = model.expert_map
    held[:] = [1, 0]  # the experts swap slots, in a new map at the same address
    model.expert_map = nn.Buffer(torch.from_numpy(held))
    assert model.expert_map.data_ptr() == read.data_ptr()
    assert model.expert_map._version == read._version
    patch_where_the_loader_now_writes(model, routes, "experts.0.w", 1)
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1


class CountedSlots(nn.Module):
    """A flag per expert says whether it is local; an expert's slot is the number of local
    experts before it, counted from the shape of a data-dependent result."""

    def __init__(self, count: str) -> None:
        super().__init__()
        self.count = count
        self.w = nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.local = nn.Buffer(torch.tensor([False, True, True]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            before = self.local[: int(name.split(".")[1])]
            nonzero = self.count == "nonzero"  # else a boolean mask
            slot = before.nonzero().shape[0] if nonzero else before[before].numel()
            self.w.data[slot].copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("how", ["warm", "first patch"])
@pytest.mark.parametrize("count", ["nonzero", "boolean mask"])
def test_a_route_follows_model_values_that_decided_a_shape(how: str, count: str) -> None:
    """The loader decides on the shape of a result that depends on model values (``nonzero``,
    a boolean-mask index), never reading a value itself: after the flags change, the route
    is not replayed."""
    model, routes = CountedSlots(count), RouteCache()
    if how == "warm":
        routes.warm(model, [("experts.2.w", (4,), torch.float32)])
    else:
        first = CheckpointWeightPatch(
            "experts.2.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
        )
        load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "experts.2.w" in routes
    model.local.copy_(torch.tensor([False, False, True]))  # expert 1 left: 2 moves to slot 0
    patch_where_the_loader_now_writes(model, routes, "experts.2.w", 0)
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1


class Skipping(nn.Module):
    """A loader that skips the names this model does not hold (as vLLM's loaders skip the
    layers another pipeline stage holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name in params:
                params[name].copy_(tensor)
        return {name for name, _ in weights if name in params}


def test_writes_nothing_is_refused_by_default_and_never_kept_as_a_route() -> None:
    """A name the loader writes nothing for is refused (strict), with nothing changed. With
    ``strict=False`` it changes nothing and is never replayed: once the model holds a tensor
    of that name (registered between calls), its patch goes through the loader, which
    writes it."""
    model, routes = Skipping(), RouteCache()
    patch = partial(one_element, "bias", (4,))
    before = state(model)
    with pytest.raises(InvalidPatchError, match=r"patches\[0\] 'bias': no loader call consumed"):
        load_checkpoint_weight_patches(model, [patch(1.0, 0)], routes=routes)
    assert_same_state(state(model), before)
    load_checkpoint_weight_patches(model, [patch(1.0, 0)], routes=routes, strict=False)
    load_checkpoint_weight_patches(model, [patch(2.0, 1)], routes=routes, strict=False)
    assert "bias" not in routes and routes.stats.replayed == 0  # asked the loader each time
    model.bias = nn.Parameter(torch.zeros(4), requires_grad=False)
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(reference, [patch(3.0, 2)])  # the loader path
    load_checkpoint_weight_patches(model, [patch(3.0, 2)], routes=routes)
    assert_same_state(state(model), state(reference))
    assert model.bias.tolist() == [0.0, 0.0, 3.0, 0.0]


class FlaggedSlots(Experts):
    """`Experts` whose loader reads the slot with ``.item()``, ``bool()`` or ``allclose``."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            entry = self.expert_map[int(name.split(".")[1])]
            if self.read == "item":
                slot = int(entry.item())
            elif self.read == "bool":
                slot = 1 if entry else 0
            else:  # "allclose"
                slot = 0 if torch.allclose(entry, torch.zeros_like(entry)) else 1
            self.w.data[slot].copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("created", ["outside", "inside"])
@pytest.mark.parametrize("read", ["item", "bool", "allclose"])
def test_a_route_follows_model_values_read_under_inference_mode(read: str, created: str) -> None:
    """Under ``torch.inference_mode()`` a read reaches patchctx as ``aten.item`` (or another
    operation that returns a Python value), not as the ``_local_scalar_dense`` it decomposes
    into elsewhere: the route still follows the expert map. A model created inside inference
    mode holds inference tensors, which keep no version counter: no route hangs on them."""
    with torch.inference_mode(created == "inside"):
        model, routes = FlaggedSlots(read), RouteCache()
    first = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
    )
    with torch.inference_mode():
        load_checkpoint_weight_patches(model, [first], routes=routes)
        assert ("experts.0.w" in routes) == (created == "outside")
        model.expert_map.copy_(torch.tensor([1, 0]))  # the experts swap slots
        patch_where_the_loader_now_writes(model, routes, "experts.0.w", 1)
    assert routes.stats.replayed == 0


def test_a_map_rebuilt_at_the_same_address_as_an_inference_tensor_is_another_tensor() -> None:
    """The same, with the new map an inference tensor (which keeps no version counter): the
    live check drops the route, and does not raise."""
    model, routes = Experts(), RouteCache()
    held = numpy.array([0, 1])
    model.expert_map = nn.Buffer(torch.from_numpy(held))
    first = CheckpointWeightPatch(
        "experts.0.w", (4,), torch.float32, torch.zeros(1), torch.tensor([0])
    )
    load_checkpoint_weight_patches(model, [first], routes=routes)
    assert "experts.0.w" in routes
    held[:] = [1, 0]
    with torch.inference_mode():
        model.expert_map = nn.Buffer(torch.from_numpy(held))
        assert model.expert_map.is_inference()
        moved = CheckpointWeightPatch(
            "experts.0.w", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2])
        )
        load_checkpoint_weight_patches(model, [moved], routes=routes)
    assert model.w.tolist() == [[0.0] * 4, [0.0, 0.0, 7.0, 0.0]]
    assert routes.stats.replayed == 0 and routes.stats.invalidated == 1


def test_replays_that_do_not_write_what_a_route_read_stay_batched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routes that read the expert map are checked after what is gathered before them only
    when that may write the map: the experts' replays of one call still run together (one
    search of their covered slices, one host read on an accelerator)."""
    model, routes = Experts(), RouteCache()
    names = ["experts.0.w", "experts.1.w"]

    def patch(name: str, value: float) -> CheckpointWeightPatch:
        return CheckpointWeightPatch(
            name, (4,), torch.float32, torch.tensor([value]), torch.tensor([1])
        )

    load_checkpoint_weight_patches(model, [patch(n, 1.0) for n in names], routes=routes)
    assert set(names) <= set(routes)
    searches: list[int] = []
    original = replay_bounds

    def counted(*args: Any, **kwargs: Any) -> Any:
        searches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_load, "replay_bounds", counted)
    load_checkpoint_weight_patches(model, [patch(n, 2.0) for n in names], routes=routes)
    assert routes.stats.replayed == 2 and len(searches) == 1
    assert model.w[:, 1].tolist() == [2.0, 2.0]
