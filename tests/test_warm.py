"""RouteCache.warm: routes learnt by a dry run equal recorded ones, nothing written or staged.

The zoo (`tests/support/zoo.py`) is the attack surface: for every loader, a warm-up changes no
weight (bit for bit, storages, structure), learns exactly the route the first real sparse patch
records (never one it would not), and a patch replayed along a learnt route gives the dense
truth. Loaders a dry run cannot follow are listed by name here, so that a change is seen.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    RouteCache,
    WarmReport,
    WarmRow,
    load_checkpoint_weight_patches,
    masked_copy,
)
from tests.support.builders import Sparse, sparse_patch
from tests.support.models import (
    Spec,
    assert_same_state,
    packed_tp_model,
    random_checkpoint,
    random_tensor,
    same_bits,
    state,
)
from tests.support.zoo import (
    SHAPE,
    ZOO,
    Entry,
    ZooLayer,
    _random,
    dense_load,
    full_state,
    patched,
    same_state,
    sparse,
)
from tests.test_routes import (
    FILLING_SHAPES,
    ChainModel,
    DenseTruth,
    Filling,
    ViewChain,
    filling_patch,
    view_chains,
)

ROOT = Path(__file__).resolve().parent.parent

# The zoo loaders a dry run cannot follow (it stops, and the name is "deferred"): a boolean
# mask index, nonzero and masked_select have data-dependent shapes and torch.equal a value,
# none of which a meta tensor has; an out= write into a weight is not skipped.
DEFERRED = {
    "setitem-bool-mask",
    "zeros-out-resizing",
    "branch-on-torch.equal",
    "branch-on-nonzero-count",
    "branch-on-masked_select-size",
    # read the scale back with a plain operation (`scale > 0`, `diag`) after `scale.mul_(2)`
    "state-where-a-scale-changed-in-the-call",
    "state-matmul-a-scale-changed-in-the-call",
}

DTYPES = [torch.float32, torch.bfloat16, torch.int32]


def _patches(dtype: torch.dtype, seed: int) -> list[CheckpointWeightPatch]:
    """Three sparse patches of the zoo's [4, 6] tensor: sorted, unsorted, a single element."""
    generator = torch.Generator().manual_seed(seed)
    numel = SHAPE[0] * SHAPE[1]
    result = []
    for count, ordered in ((7, True), (12, False), (1, True)):
        indices = torch.randperm(numel, generator=generator)[:count]
        if ordered:
            indices = indices.sort().values
        values = (torch.randn(count, generator=generator) * 3).tolist()
        result.append(sparse(indices.tolist(), values, dtype))
    return result


def _fresh(entry: Entry, dtype: torch.dtype) -> tuple[ZooLayer, bool]:
    """The zoo layer after a dense load of a checkpoint, or as built if the loader fails or
    changes the model's structure; and whether the dense load failed."""
    model = ZooLayer(entry.write, dtype)
    loaded = copy.deepcopy(model)
    if dense_load(loaded, _random(SHAPE, dtype, 10)) is not None:
        return model, True
    if same_state(full_state(loaded), full_state(model), storages=False, values=False):
        return model, False
    return loaded, False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.id)
def test_warm_writes_nothing_and_learns_exactly_the_recorded_route(
    entry: Entry, dtype: torch.dtype
) -> None:
    model, fails = _fresh(entry, dtype)
    before = full_state(model)
    warmed = RouteCache()
    report = warmed.warm(model, [("w", SHAPE, dtype)])
    model.cache.clear()
    assert not same_state(full_state(model), before), "warm changed the model"
    (row,) = report.rows
    if not fails:  # (a loader that fails for this dtype may fail or stop in the dry run)
        assert (row.status == "deferred") == (entry.id in DEFERRED), row
    assert (row.status == "learned") == ("w" in warmed)
    assert row.status == "learned" or row.reason
    # What the first real sparse patch records, on the same model (same storages).
    recorded = RouteCache()
    with contextlib.suppress(Exception):  # refused, or the loader fails for this dtype
        load_checkpoint_weight_patches(model, _patches(dtype, 0)[:1], routes=recorded)
    model.cache.clear()
    if row.status == "learned":
        assert warmed._route("w") == recorded._route("w")
    else:
        assert row.status == "deferred" or "w" not in recorded, row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.id)
def test_patches_replayed_along_warm_routes_are_the_dense_truth(
    entry: Entry, dtype: torch.dtype
) -> None:
    model, fails = _fresh(entry, dtype)
    routes = RouteCache()
    if routes.warm(model, [("w", SHAPE, dtype)]).rows[0].status != "learned" or fails:
        return  # no dense truth to compare with
    assert routes.verify(model) == []  # the loader records the same route again
    truth = copy.deepcopy(model)
    checkpoint = _random(SHAPE, dtype, 10)
    for patch in _patches(dtype, 1):
        checkpoint = patched(checkpoint, patch)
        assert dense_load(truth, checkpoint) is None
        load_checkpoint_weight_patches(model, [patch], routes=routes)
        assert not same_state(full_state(model), full_state(truth), storages=False)
    assert routes.stats.replayed == 3 and routes.stats.loader_calls == 1  # verify's call


@given(chain=view_chains(), data=st.data())
def test_random_view_loaders_are_learnt_and_replay_the_loader_path(
    chain: ViewChain, data: st.DataObject
) -> None:
    model = ChainModel(chain)
    spec = Spec(chain.shape, chain.checkpoint_dtype)
    full = random_tensor(chain.shape, chain.checkpoint_dtype, torch.Generator().manual_seed(1))
    model.load_weights([("w", full)])
    before = state(model)
    warmed = RouteCache()
    assert warmed.warm(model, [("w", chain.shape, chain.checkpoint_dtype)]).names("learned") == [
        "w"
    ]
    assert_same_state(state(model), before)

    def as_patch(drawn: Sparse) -> CheckpointWeightPatch:
        return CheckpointWeightPatch(
            "w", chain.shape, chain.checkpoint_dtype, drawn.values, drawn.indices
        )

    first = as_patch(data.draw(sparse_patch("w", spec)))
    reference = copy.deepcopy(model)
    recorded = RouteCache()
    load_checkpoint_weight_patches(reference, [first], routes=recorded)
    route, learnt = recorded._route("w"), warmed._route("w")
    assert route is not None and learnt is not None
    assert [s.source for s in learnt.segments] == [s.source for s in route.segments]
    assert [s.target for s in learnt.segments] == [s.target for s in route.segments]
    load_checkpoint_weight_patches(model, [first], routes=warmed)
    assert warmed.stats.replayed == 1 and warmed.stats.loader_calls == 0
    assert_same_state(state(model), state(reference))


def test_every_name_of_a_packed_tp_model_is_learnt_in_one_dry_call() -> None:
    model = packed_tp_model(tp_size=4, tp_rank=3, kv_heads=1)
    specs = model.checkpoint_specs()
    model.load_weights(random_checkpoint(specs).items())
    before = state(model)
    warmed = RouteCache()
    report = warmed.warm(model, [(name, s.shape, s.dtype) for name, s in specs.items()])
    assert report.counts() == {"learned": len(specs), "unlearnable": 0, "deferred": 0}
    assert_same_state(state(model), before)
    recorded = RouteCache()
    patches = [
        CheckpointWeightPatch(
            name, s.shape, s.dtype, torch.ones(1, dtype=s.dtype), torch.tensor([0])
        )
        for name, s in specs.items()
    ]
    load_checkpoint_weight_patches(copy.deepcopy(model), patches, routes=recorded)
    for name in specs:  # the copy has other storages: compare the geometry
        ours, theirs = warmed._route(name), recorded._route(name)
        assert ours is not None and theirs is not None
        assert [(s.source, s.target, s.tensor_name) for s in ours.segments] == [
            (s.source, s.target, s.tensor_name) for s in theirs.segments
        ]
    assert warmed.verify(model) == []
    assert_same_state(state(model), before)


# ------------------------------------------------------------------------ the attacker's loaders


class Loader(nn.Module):
    """A [4, 6] weight and a scalar, loaded by a function given at construction."""

    def __init__(self, load: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(24.0).view(4, 6), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.load = load
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        for name, tensor in weights:
            self.load(self, name, tensor)  # type: ignore[operator]
        return {"weight"}


def _warm_one(load: object, name: str = "w") -> tuple[Loader, RouteCache, WarmRow]:
    model = Loader(load)
    before = state(model)
    routes = RouteCache()
    (row,) = routes.warm(model, [(name, (4, 6), torch.float32)]).rows
    assert_same_state(state(model), before)
    return model, routes, row


def _branch_on_values(m: Loader, name: str, w: torch.Tensor) -> None:
    if w.sum() > 0:
        m.weight.data.copy_(w)
    else:
        m.weight.data.copy_(w.flip(0))


def _swallow_item(m: Loader, name: str, w: torch.Tensor) -> None:
    with contextlib.suppress(BaseException):  # the attack: a loader that swallows everything
        m.scale.data.fill_(w[0, 0].item())
    m.weight.data.copy_(w)


def _raise_half_way(m: Loader, name: str, w: torch.Tensor) -> None:
    m.weight.data[:2].copy_(w[:2])
    raise KeyError(name)


def _temporary_then_copy(m: Loader, name: str, w: torch.Tensor) -> None:
    scratch = torch.empty(4, 6)
    scratch.copy_(w)
    m.weight.data.copy_(scratch)


def _write_then_read_back(m: Loader, name: str, w: torch.Tensor) -> None:
    m.scale.data.fill_(2.0)  # skipped by the dry run...
    if m.scale.item() == 2.0:  # ...so this would read the old value
        m.weight.data.copy_(w)
    else:
        m.weight.data.copy_(w.t().contiguous().t())


def _chunks(m: Loader, name: str, w: torch.Tensor) -> None:
    for target, source in zip(m.weight.data.chunk(2, dim=1), w.chunk(2, dim=1), strict=True):
        target.copy_(source)


def _cast_then_copy(m: Loader, name: str, w: torch.Tensor) -> None:
    m.weight.data.copy_(w.to(torch.float64).to(torch.float32))


def _through_data_attribute(m: Loader, name: str, w: torch.Tensor) -> None:
    m.weight.data[...] = w.data.t().t()


@pytest.mark.parametrize(
    ("load", "status", "reason"),
    [
        (_branch_on_values, "unlearnable", "reads its values (.item())"),
        (_swallow_item, "unlearnable", "reads its values (.item())"),
        (_raise_half_way, "deferred", "the loader raised KeyError"),
        (_temporary_then_copy, "unlearnable", "not a parameter or buffer of the model"),
        (_write_then_read_back, "deferred", "after its own write (aten.fill_.Scalar)"),
        (_chunks, "learned", ""),
        (_cast_then_copy, "unlearnable", "a computed copy, not a view"),
        (_through_data_attribute, "learned", ""),
    ],
)
def test_loaders_a_dry_run_must_not_guess(load: object, status: str, reason: str) -> None:
    _, routes, row = _warm_one(load)
    assert row.status == status, row
    assert reason in row.reason
    assert ("w" in routes) == (status == "learned")


def test_a_loader_that_raises_for_one_name_does_not_stop_the_others() -> None:
    def load(m: Loader, name: str, w: torch.Tensor) -> None:
        if name == "unknown":
            raise KeyError(name)
        m.weight.data[int(name[-1]) * 2 :][:2].copy_(w[:2])

    model = Loader(load)
    before = state(model)
    routes = RouteCache()
    specs = [("w0", (4, 6), torch.float32), ("unknown", (4, 6), torch.float32)]
    report = routes.warm(model, [*specs, ("w1", (4, 6), torch.float32)])
    assert_same_state(state(model), before)
    assert report.names("learned") == ["w0", "w1"]
    assert report.names("deferred") == ["unknown"]
    assert "KeyError" in report.rows[1].reason
    # one call with all, one per name, then the learnt ones together
    assert model.calls == 1 + 3 + 1


def test_two_names_writing_the_same_bytes_in_one_call_are_not_learnt() -> None:
    def load(m: Loader, name: str, w: torch.Tensor) -> None:
        m.weight.data.copy_(w)

    model = Loader(load)
    routes = RouteCache()
    report = routes.warm(model, [("a", (4, 6), torch.float32), ("b", (4, 6), torch.float32)])
    assert report.names("unlearnable") == ["a", "b"]
    assert "two names write the same bytes" in report.rows[0].reason


@pytest.mark.parametrize("gather", [False, True], ids=["streaming", "gathering"])
@pytest.mark.parametrize("stopped", [False, True], ids=["one-call", "after-a-stop"])
def test_warm_learns_the_constant_fills_of_each_name_as_it_makes_them(
    gather: bool, stopped: bool
) -> None:
    """Fills seen in a dry call of several names are told apart by a dry call of each alone.

    `stopped`: an unknown name stops the dry call of all names, so the others are learnt alone,
    then checked together.
    """
    model = Filling(gather=gather)
    truth = DenseTruth(model)
    before = state(model)
    # (Not ``added``: it loads into the padding ``embed`` fills, so no call has both.)
    names = ["other", "embed"]
    specs: list[tuple[str, tuple[int, ...], torch.dtype]]
    specs = [(name, FILLING_SHAPES[name], torch.float32) for name in names]
    if stopped:
        specs.append(("unknown", (1,), torch.float32))
    warmed = RouteCache()
    report = warmed.warm(model, specs)
    assert_same_state(state(model), before)
    assert report.names("learned") == names, report
    embed, other = warmed._route("embed"), warmed._route("other")
    assert embed is not None and [f.tensor_name for f in embed.fills] == ["weight", "stale"]
    assert other is not None and other.fills == ()
    recorded = RouteCache()  # what a patch of each name alone records
    for name in names:
        copied = copy.deepcopy(model)  # other storages: compare all but the pointers
        load_checkpoint_weight_patches(copied, [filling_patch(name, [0], [0.5])], routes=recorded)
        ours, theirs = warmed._route(name), recorded._route(name)
        assert ours is not None and theirs is not None
        assert [(f.target, f.tensor_name, f._constant) for f in ours.fills] == [
            (f.target, f.tensor_name, f._constant) for f in theirs.fills
        ]
    model.refresh()
    truth.model.refresh()
    for patch in [filling_patch("other", [1], [2.0]), filling_patch("embed", [2], [3.0])]:
        load_checkpoint_weight_patches(model, [patch], routes=warmed)
        truth.load([patch])
        assert_same_state(state(model), state(truth.model))
    assert warmed.stats.replayed == 2 and warmed.stats.loader_calls == 0


def test_a_route_cached_before_is_replaced_or_dropped() -> None:
    rank = {"row": 0}

    def load(m: Loader, name: str, w: torch.Tensor) -> None:
        if rank["row"] < 0:
            m.weight.data.copy_(w.to(torch.float64))
        else:
            m.weight.data[0].copy_(w[rank["row"]])

    model = Loader(load)
    routes = RouteCache()
    routes.warm(model, [("w", (4, 6), torch.float32)])
    first = routes._route("w")
    rank["row"] = 2
    assert routes.warm(model, [("w", (4, 6), torch.float32)]).names("learned") == ["w"]
    assert routes._route("w") != first
    rank["row"] = -1
    assert routes.warm(model, [("w", (4, 6), torch.float32)]).names("unlearnable") == ["w"]
    assert "w" not in routes


def test_protected_tensors_and_masked_regions() -> None:
    model, routes, _ = _warm_one(_chunks)
    report = routes.warm(model, [("w", (4, 6), torch.float32)], protect={"weight": "repacked"})
    assert report.rows[0].status == "unlearnable" and "repacked" in report.rows[0].reason
    with masked_copy():  # an open region of this thread is suspended, as in a patch load
        assert routes.warm(model, [("w", (4, 6), torch.float32)]).names("learned") == ["w"]


def test_a_submodule_replaced_under_its_own_name_is_put_back() -> None:
    def load(m: Loader, name: str, w: torch.Tensor) -> None:
        m.sub = nn.Linear(6, 4)  # replaces the existing submodule
        m.weight.data.copy_(w)

    model = Loader(load)
    model.sub = nn.Linear(6, 4)
    sub, before = model.sub, state(model)
    (row,) = RouteCache().warm(model, [("w", (4, 6), torch.float32)]).rows
    assert model.sub is sub and row.status == "unlearnable" and "'sub'" in row.reason
    assert_same_state(state(model), before)


def test_specs_are_checked() -> None:
    model = Loader(_chunks)
    with pytest.raises(InvalidPatchError, match="listed twice"):
        RouteCache().warm(model, [("w", (4, 6), torch.float32)] * 2)
    with pytest.raises(InvalidPatchError, match=r"torch\.dtype"):
        RouteCache().warm(model, [("w", (4, 6), "float32")])  # type: ignore[list-item]
    with pytest.raises(InvalidPatchError, match=r"\(name, shape, dtype\)"):
        RouteCache().warm(model, [("w", 4)])  # type: ignore[list-item]
    assert RouteCache().warm(model, []).rows == ()


def test_report_table() -> None:
    report = WarmReport((WarmRow("a.weight", "learned"), WarmRow("b", "deferred", "why")))
    assert str(report).splitlines() == [
        "name      status       reason",
        "--------  -----------  ------",
        "a.weight  learned",
        "b         deferred     why",
        "1 learned, 0 unlearnable, 1 deferred",
    ]


# ---------------------------------------------------------------------------------- memory

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    ROWS, COLS, RANK, RANKS = 16384, 8192, 7, 8
    class Slice(nn.Module):  # rank 7 of 8: a row slice of a 256 MiB bf16 checkpoint tensor
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(
                torch.zeros(ROWS // RANKS, COLS, dtype=torch.bfloat16), requires_grad=False)
        def load_weights(self, weights):
            for _, w in weights:
                self.weight.data.copy_(w.narrow(0, RANK * ROWS // RANKS, ROWS // RANKS))
            return {"weight"}

    class Tiny(nn.Module):  # loads every lazily imported module before the measurement
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        def load_weights(self, weights):
            for _, w in weights:
                self.weight.data.copy_(w.narrow(0, 0, 2))
            return {"weight"}

    tiny = CheckpointWeightPatch("t", (4, 2), torch.float32, torch.ones(1), torch.tensor([1]))
    RouteCache().warm(Tiny(), [("t", (4, 2), torch.float32)])
    load_checkpoint_weight_patches(Tiny(), [tiny], routes=RouteCache())
    model, routes = Slice(), RouteCache()
    patch = CheckpointWeightPatch(
        "w", (ROWS, COLS), torch.bfloat16, torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([0, (ROWS - 1) * COLS, ROWS * COLS - 1]))
    start = peak_kib()
    if sys.argv[1] == "warm":
        report = routes.warm(model, [("w", (ROWS, COLS), torch.bfloat16)])
        assert report.names("learned") == ["w"], str(report)
    warmed = peak_kib()
    load_checkpoint_weight_patches(model, [patch], routes=routes)
    print(json.dumps({"warm": warmed - start, "first": peak_kib() - warmed,
                      "replayed": routes.stats.replayed}))
    """
)


def _probe(mode: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    found: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def test_warm_and_the_first_patch_after_it_allocate_nothing_checkpoint_sized() -> None:
    """Peak RSS, in a fresh process: a 256 MiB bf16 checkpoint tensor, sliced by rank 7 of 8.

    Without warm, the first sparse patch stages the whole checkpoint tensor (the probe sees
    the 256 MiB); with warm, neither the warm-up nor the first patch comes near it.
    """
    cold, warm = _probe("cold"), _probe("warm")
    mib = 1024
    assert cold["replayed"] == 0 and cold["first"] > 200 * mib, cold
    assert warm["replayed"] == 1, warm
    assert warm["warm"] < 8 * mib and warm["first"] < 8 * mib, warm


def _point(name: str, indices: list[int], value: float = 5.0) -> CheckpointWeightPatch:
    """A sparse patch of a [4, 6] float32 tensor setting `indices` to `value` and on."""
    values = torch.arange(len(indices), dtype=torch.float32) + value
    return CheckpointWeightPatch(name, (4, 6), torch.float32, values, torch.tensor(indices))


class LazyLoader(nn.Module):
    """`Loader`'s weight, loaded by a ``load_weights`` written as a generator."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(24.0).view(4, 6), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        for name, tensor in weights:
            self.weight.data[1:].copy_(tensor[:3])  # a view: a route of one segment
            yield name


def test_a_generator_loader_is_learnt_from_its_body_and_replays_the_dense_truth() -> None:
    model, routes = LazyLoader(), RouteCache()
    before = state(model)
    report = routes.warm(model, [("w", (4, 6), torch.float32)])
    assert report.names("learned") == ["w"]
    assert_same_state(state(model), before)
    ours = routes._route("w")
    assert ours is not None and len(ours.segments) == 1  # the body ran: one copy_ of a view
    recorded = RouteCache()
    load_checkpoint_weight_patches(LazyLoader(), [_point("w", [0])], routes=recorded)
    theirs = recorded._route("w")
    assert theirs is not None
    assert [(s.source, s.target) for s in ours.segments] == [
        (s.source, s.target) for s in theirs.segments
    ]
    patch = _point("w", [7, 8])
    truth = LazyLoader()
    checkpoint = torch.zeros(4, 6)
    checkpoint[:3] = truth.weight[1:]  # the checkpoint the weights were loaded from
    assert patch.indices is not None
    checkpoint.view(-1)[patch.indices] = patch.values
    with torch.no_grad():
        assert list(truth.load_weights([("w", checkpoint)])) == ["w"]
    assert load_checkpoint_weight_patches(model, [patch], routes=routes) == {"w"}
    assert routes.stats.loader_calls == 0 and routes.stats.replayed == 1
    assert same_bits(model.weight, truth.weight)


def test_a_name_the_loader_copies_nothing_of_is_deferred_not_learnt() -> None:
    model, routes, row = _warm_one(lambda m, name, w: None, "elsewhere")
    assert row.status == "deferred", row
    assert "copied nothing" in row.reason
    assert "elsewhere" not in routes
    # A route recorded before, when the loader still copied it, is dropped.
    model.load = lambda m, name, w: m.weight.data.copy_(w)
    load_checkpoint_weight_patches(model, [_point("elsewhere", [3])], routes=routes)
    assert "elsewhere" in routes
    model.load = lambda m, name, w: None
    (row,) = routes.warm(model, [("elsewhere", (4, 6), torch.float32)]).rows
    assert row.status == "deferred" and "elsewhere" not in routes
    # The first patch goes through the loader, which writes nothing here: refused (strict),
    # nothing changed; with strict=False it changes nothing, and "writes nothing" is never
    # kept as a route.
    before = state(model)
    patch = _point("elsewhere", [3])
    with pytest.raises(InvalidPatchError, match="no loader call consumed it"):
        load_checkpoint_weight_patches(model, [patch], routes=routes)
    load_checkpoint_weight_patches(model, [patch], routes=routes, strict=False)
    assert routes.stats.loader_calls == 3 and model.calls == 5
    assert_same_state(state(model), before)
    assert "elsewhere" not in routes
