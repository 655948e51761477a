"""`RouteCache.warm`: routes learnt by a dry run of the loader, with nothing written or staged.

A route records where a loader's ``copy_`` of a *view* of the checkpoint tensor lands (see
`patchctx._routes`). Recording one needs no values, only the views' sizes, strides and offsets.
So a warm-up hands the loader, for each checkpoint name, the staged type of a patch load over
meta: a `StagedTensor` whose values and mask are meta tensors (no memory), claiming the model's
device, under the same guard. What differs is its ledger (`_DryLedger`), which both consult:

- views and computations run on meta as in a patch load (a view's geometry is the loader's; a
  computed result is never a route); refusals by which positions a patch changes do not apply;
- a write into a parameter or buffer is admitted and recorded (`Recorder`), not performed; a
  refusal, or a value read out of torch (``item()``, ``tolist()``), rules the route out; an
  operation needing values fails on meta, which, like all a dry run cannot mirror, stops it.

The loader's own plain writes into the model (a constant fill of padding, say) are checked
and logged as a patch load logs them, then skipped (a constant fill goes into the route, which
makes it again on replay; a run of several names that fills anything tells whose fill it is
by a run of each name alone). A run that reads back bytes it skipped writing could behave
differently from a real load: it stops too.

Every name ends up in one of three states: ``learned`` (a route, exactly the one the first
sparse patch would record), ``unlearnable`` (the dry run saw the loader do something that
rules a route out, so a patch load would not record one either) or ``deferred`` (the dry run
could not follow the loader, or saw it copy nothing of the name; nothing is learnt, and the
first sparse patch records the route through the loader as before, when the loader allows
one).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import torch
from torch.utils._pytree import tree_map

from patchctx import _ops
from patchctx._arguments import name_map
from patchctx._errors import (
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    PatchProblem,
)
from patchctx._frame import Frame
from patchctx._geometry import Route, Segment
from patchctx._grad import without_grad
from patchctx._guard import Guard, constant_of
from patchctx._model import SupportsLoadWeights, as_module, check_model, model_tensors, read_names
from patchctx._recording import LOADED_WITH_OTHERS, Recorder
from patchctx._report import status_counts, status_table
from patchctx._routes import RouteStore, book_of
from patchctx._snapshot import Snapshot
from patchctx._staged import Provenance, Root, StagedTensor, label, on_meta, provenance_of
from patchctx._undo import UndoLog
from patchctx._writes import ModelIndex, WriteLedger, span_of, storage_key

__all__ = ["WarmReport", "WarmRow", "warm"]

_Status = Literal["learned", "unlearnable", "deferred"]
# A checkpoint tensor to learn: its name, full shape and dtype.
Spec = tuple[str, tuple[int, ...], torch.dtype]

_STATUSES: tuple[_Status, ...] = ("learned", "unlearnable", "deferred")


@dataclass(frozen=True, slots=True)
class WarmRow:
    """What `RouteCache.warm` did for one checkpoint name.

    Attributes:
        name: The checkpoint name.
        status: ``"learned"`` (the cache holds its route now: the first sparse patch to it
            replays in O(nnz)), ``"unlearnable"`` (the loader does something that rules a
            route out, such as a cast before ``copy_`` or an indexed write: sparse patches
            to it always go through the loader, or are refused; `audit` says which) or
            ``"deferred"`` (a dry run cannot follow the loader for it, or the loader copied
            nothing of it; the first sparse patch goes through the loader and records the
            route there, if there is one).
        reason: Why the name was not learnt; empty when it was.

    Examples:
        >>> from patchctx import WarmRow
        >>> WarmRow("lm_head.weight", "deferred", "the loader reads a value with .item()")
        WarmRow(name='lm_head.weight', status='deferred', reason='the loader reads a value \
with .item()')
    """

    name: str
    status: Literal["learned", "unlearnable", "deferred"]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WarmReport:
    """The result of `RouteCache.warm`: one row per checkpoint name, in the order given.

    Printing it shows a table.

    Examples:
        >>> from patchctx import WarmReport, WarmRow
        >>> report = WarmReport((WarmRow("a", "learned"), WarmRow("b", "deferred", "why")))
        >>> report.counts()
        {'learned': 1, 'unlearnable': 0, 'deferred': 1}
        >>> report.names("deferred")
        ['b']
    """

    rows: tuple[WarmRow, ...]

    def counts(self) -> dict[str, int]:
        """How many names have each status (all three keys present)."""
        return status_counts(self.rows, _STATUSES)

    def names(self, status: Literal["learned", "unlearnable", "deferred"]) -> list[str]:
        """The names with `status`."""
        return [row.name for row in self.rows if row.status == status]

    def __str__(self) -> str:
        return status_table(self.rows, self.counts())


# ------------------------------------------------------------------------------ the dry run


class _Stop(BaseException):
    """Ends a dry run that cannot follow the loader (not `Exception`; its reason noted first)."""


class _DryLedger(WriteLedger):
    """The `WriteLedger` of a dry run, which the staged type and the guard consult as a load's.

    Nothing is written (`performs`: the staged data's values are on meta, the loader's own
    writes into the model are skipped), nothing is undone; what needs values stops the run.
    It also keeps the run's verdicts: names settled without a route, and why the run stopped.
    """

    performs = False

    def __init__(self, index: ModelIndex, names: frozenset[str]) -> None:
        super().__init__(index, UndoLog(), Recorder(), log_plain=False, loading=names)
        self.settled: dict[str, tuple[_Status, str]] = {}
        self.stopped: tuple[_Status, str] | None = None

    def settle(self, names: Iterable[str], status: _Status, reason: str) -> None:
        for name in names:
            self.settled.setdefault(name, (status, reason))

    def halt(self, status: _Status, reason: str, names: Iterable[str] = ()) -> None:
        """Record why the run cannot go on: `names` get the verdict, the run is stopped."""
        self.settle(names, status, reason)
        if self.stopped is None:
            self.stopped = (status, reason)

    def stop(self, status: _Status, reason: str, names: Iterable[str] = ()) -> NoReturn:
        """End the run (`halt`); after it, refuse a use of its dry data (a loader kept it)."""
        if not self.open:
            raise LoaderContractError(
                f"the loader used the dry tensor of {label(frozenset(names) or self.loading)} "
                "a dry run (RouteCache.warm, or routes= learning a route) handed it, after that "
                f"run: it kept it (a cache, an attribute), and it holds no values ({reason}). "
                "A loader that keeps checkpoint tensors across calls cannot be dry-run"
            )
        self.halt(status, reason, names)
        raise _Stop(reason)

    def admit(
        self, destination: torch.Tensor, names: frozenset[str], how: str, *, dense: bool
    ) -> bool:
        if not self.open:
            self.stop("unlearnable", f"{how} of it", names)
        return super().admit(destination, names, how, dense=dense)

    def values_read(self, names: frozenset[str], what: str) -> None:
        self.stop(
            "unlearnable",
            f"the loader reads its values ({what}); a route exists only for a loader that "
            "copies views",
            names,
        )

    def cannot_follow(self, func: object, error: Exception, names: frozenset[str]) -> None:
        self.stop(
            "deferred", f"a dry run cannot follow {func} on it ({type(error).__name__})", names
        )

    def skip(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[Any]
    ) -> Any:
        """The loader's own write into the model: checked as a write (`plain_write`), skipped."""
        labels = ", ".join(repr(owner.name) for t in targets if (owner := self.index.owner(t)))
        if _ops.rule(func).out or len(targets) != 1 or args[0] is not targets[0]:
            self.stop("deferred", f"a dry run does not skip the loader's {func} into {labels}")
        try:
            func(*tree_map(on_meta, args), **tree_map(on_meta, kwargs))  # raises where it would
        except Exception as error:
            self.stop(
                "deferred", f"a dry run cannot follow {func} into {labels} ({type(error).__name__})"
            )
        self.plain_write(targets[0], str(func), constant=constant_of(func, args))
        return args[0]

    def read(self, tensor: torch.Tensor, how: object) -> None:
        """The loader reads `tensor`: bytes a dry run did not write would read differently."""
        key = storage_key(tensor)
        if key is None or not (self.masked or self.plain):
            return
        span = span_of(tensor, key)
        for earlier in self.masked:
            if earlier.span.overlaps(span):
                self.settle(
                    earlier.names,
                    "unlearnable",
                    "the loader reads the weight back after writing it (a tied or derived copy "
                    "that replay would not update)",
                )
                self.stop(
                    "deferred",
                    f"the loader reads {earlier.owner!r} back with {how} after writing it",
                )
        for write in self.plain:
            if write.span.overlaps(span):
                self.stop(
                    "deferred",
                    f"the loader reads {write.owner!r} back with {how} after its own write "
                    f"({write.how}), which a dry run skips",
                )


def _kept(ledger: _DryLedger) -> set[str]:
    """The names of the dry tensors still alive (the loader kept them)."""
    kept: set[str] = set()
    for tensor in list(ledger.born):
        kept |= provenance_of(tensor).names
    return kept


_DIFFERENT: tuple[_Status, str] = (
    "deferred",
    "the loader copies it differently alone than together with the other names",
)
_COPIED_NOTHING = (
    "the loader copied nothing of it: a dry run does not learn that a name writes nothing "
    "here (one another rank holds, or one the loader skips); its first sparse patch goes "
    "through the loader"
)


@dataclass(frozen=True, slots=True)
class _Outcome:
    routes: dict[str, Route]
    verdicts: dict[str, tuple[_Status, str]]  # the names without a route, and why
    stopped: tuple[_Status, str] | None  # why the run ended early (then: no routes)
    # Names kept from a route only by constant fills in a run of several names, with the
    # segments the run recorded for them (`Recorder.alone`): a run of their own settles them.
    alone: dict[str, tuple[Segment, ...]] = field(default_factory=dict)


def _dry_run(
    module: torch.nn.Module, index: ModelIndex, specs: list[Spec], device: torch.device
) -> _Outcome:
    """One dry call of ``module.load_weights`` with every spec; no model tensor is written."""
    ledger = _DryLedger(index, frozenset(name for name, _, _ in specs))
    snapshot = Snapshot(module)
    weights: list[tuple[str, torch.Tensor]] = []
    for name, shape, dtype in specs:
        # The staged type over meta: values and mask with the checkpoint's geometry, no memory.
        data = torch.empty(shape, dtype=dtype, device="meta")
        mask = torch.empty(shape, dtype=torch.uint8, device="meta")
        prov = Provenance(frozenset({name}), ledger, Root(data), device=device)
        weights.append((name, StagedTensor(data, mask, prov)))
        ledger.recorder.expect(name)
    reported: set[str] = set()
    frame = Frame(Guard(ledger))
    try:
        # Not a ``with`` block: an exception raised as its exit starts would leave the guard
        # on this thread's mode stack, skipping (or refusing) every later write. Every step
        # that undoes something runs twice (see `patchctx._session`).
        try:
            frame.enter()
            # Read to the end here, under the guard and before `weights` is cleared: a
            # generator's body runs only now.
            reported = read_names(module.load_weights(weights))  # type: ignore[operator]
            frame.leave()
        finally:
            frame.leave()
    except _Stop:
        pass
    except LoaderContractError as error:  # ours, or the loader's own (a transformed weight)
        if all(error is not ours for ours in ledger.refusals):
            ledger.halt("unlearnable", f"the loader refused it: {error}")
    except Exception as error:
        ledger.halt("deferred", f"the loader raised {type(error).__name__}: {error}")
    finally:
        try:
            frame.leave()
            ledger.open = False
        finally:
            frame.leave()
            ledger.open = False
    if ledger.refusals:  # what a patch load refuses (even if the loader caught it)
        ledger.halt("unlearnable", str(ledger.refusals[0]))
        ledger.refusals.clear()  # (their tracebacks hold the loader's frames, dry data too)
    left_open = frame.left_open()
    if left_open is not None:
        ledger.halt("unlearnable", f"{left_open}: a patch load refuses that")
    try:
        changed = snapshot.restore()
    finally:
        snapshot.restore()  # idempotent: redone only when an exception cut the first
    if changed:
        ledger.halt(
            "unlearnable",
            f"the loader replaced, reshaped or added {', '.join(map(repr, changed))}: a patch "
            "load refuses that",
        )
    weights.clear()
    kept = _kept(ledger)
    if kept:
        gc.collect()  # a reference cycle may be all that keeps a dry tensor alive
        kept = _kept(ledger)
    if kept:
        ledger.halt(
            "unlearnable",
            f"the loader kept {label(frozenset(kept))} after returning (a cache, an "
            "attribute): a patch load refuses that",
            kept,
        )
    return _outcome_of(ledger, specs, reported)


def _outcome_of(ledger: _DryLedger, specs: list[Spec], reported: set[str]) -> _Outcome:
    """What a finished dry run learnt: its routes, and a verdict for each name without one."""
    names = [name for name, _, _ in specs]
    if ledger.stopped is not None:
        verdicts = {name: ledger.settled.get(name, ledger.stopped) for name in names}
        return _Outcome({}, verdicts, ledger.stopped)
    routes = ledger.recorder.routes(
        {name: (shape, dtype) for name, shape, dtype in specs},
        other_writes=[write.how for write in ledger.other_writes()],
        constants=ledger.constants(),
        loading=ledger.loading,
        reported=reported,
    )
    verdicts = {
        name: ledger.settled.get(name, ("unlearnable", ledger.recorder.reasons.get(name, "")))
        for name in names
        if name not in routes
    }
    for name in [name for name, route in routes.items() if not route.segments]:
        # Never learnt: a route of no segments replays every patch as a no-op, and only the
        # real loader, handed the data, can show that this is what it does with the name.
        del routes[name]
        verdicts[name] = ("deferred", _COPIED_NOTHING)
    recorder = ledger.recorder
    alone = {
        name: tuple(recorder.segments.get(name, ()))
        for name in recorder.alone
        if name not in ledger.settled
    }
    return _Outcome(routes, verdicts, None, alone)


def _alone(
    module: torch.nn.Module,
    index: ModelIndex,
    spec: Spec,
    device: torch.device,
    segments: tuple[Segment, ...],
) -> Route | tuple[_Status, str]:
    """The route of a name kept from one only by constant fills in a run of several names.

    A dry run of the name alone shows which fills are its own. Its route is taken only when
    its segments are those the run with the others recorded (that run checked them against
    the other names).
    """
    name = spec[0]
    one = _dry_run(module, index, [spec], device)
    route = one.routes.get(name)
    if route is None:
        return one.verdicts.get(name, ("deferred", LOADED_WITH_OTHERS))
    return route if route.segments == segments else _DIFFERENT


@without_grad
def learn(
    module: torch.nn.Module, index: ModelIndex, specs: list[Spec]
) -> dict[str, Route | tuple[_Status, str]]:
    """Every spec's route, or why it has none, by dry runs of the loader (see `_learn`)."""
    return _learn(module, index, specs, _device(index))


def learn_alone(
    module: torch.nn.Module, index: ModelIndex, spec: Spec, segments: Sequence[Segment]
) -> Route | None:
    """The route of a name of a patch load that only the call's constant fills kept from one.

    Learnt by a dry run of the name alone (see `_alone`); `None` if it has none.
    """
    found = _alone(module, index, spec, _device(index), tuple(segments))
    return found if isinstance(found, Route) else None


def _device(index: ModelIndex) -> torch.device:
    """The device a dry tensor claims: the model's."""
    return next((t.device for t in index.tensors.values()), torch.device("cpu"))


def _learn(
    module: torch.nn.Module, index: ModelIndex, specs: list[Spec], device: torch.device
) -> dict[str, Route | tuple[_Status, str]]:
    """Every name's route or verdict: one dry call for all, else one per name, then together.

    A dry call with every name is what the first real update does (the checks between names,
    such as two names writing the same bytes, need them in one call). When it stops, each
    name runs alone to say which one stops it, and the names learnt alone run together again.
    """
    by_name = {spec[0]: spec for spec in specs}
    whole = _dry_run(module, index, specs, device)
    if whole.stopped is None or len(specs) == 1:
        found: dict[str, Route | tuple[_Status, str]] = {**whole.verdicts, **whole.routes}
        for name, segments in whole.alone.items():  # constant fills: whose they are
            found[name] = _alone(module, index, by_name[name], device, segments)
        return found
    found = {}
    alone: list[Spec] = []
    for spec in specs:
        one = _dry_run(module, index, [spec], device)
        found.update(one.verdicts)
        if spec[0] in one.routes:
            found[spec[0]] = one.routes[spec[0]]
            alone.append(spec)
    if len(alone) > 1:
        together = _dry_run(module, index, alone, device)
        if together.stopped is not None:
            reason = f"learnt alone, but not together with the others: {together.stopped[1]}"
            found.update({name: ("deferred", reason) for name, _, _ in alone})
        else:
            learnt = {name: found[name] for name in together.alone}
            found.update({**together.verdicts, **together.routes})
            for name, segments in together.alone.items():  # the fills of its run alone
                route = learnt[name]
                same = isinstance(route, Route) and route.segments == segments
                found[name] = route if same else _DIFFERENT
    return found


def _checked_specs(specs: object) -> list[Spec]:
    checked: list[Spec] = []
    problems = []
    if not isinstance(specs, Iterable) or isinstance(specs, (str, bytes)):
        said = f"RouteCache.warm takes (name, shape, dtype) specs; you supplied {specs!r:.80}"
        raise InvalidPatchTypeError([PatchProblem(None, "", said, is_type_error=True)])
    for position, spec in enumerate(specs):
        try:
            name, shape, dtype = spec
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            said = f"is not a (name, shape, dtype) spec: {spec!r:.80}"
            problems.append(PatchProblem(position, "", said))
            continue
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            said = f"needs a str name and a torch.dtype: {spec!r:.80}"
            problems.append(PatchProblem(position, str(name), said))
        elif any(d < 0 for d in dims):
            problems.append(PatchProblem(position, name, f"has a negative dimension {dims}"))
        elif any(name == other for other, _, _ in checked):
            problems.append(PatchProblem(position, name, "is listed twice"))
        else:
            checked.append((name, dims, dtype))
    if problems:
        raise InvalidPatchError(problems)
    return checked


def warm(
    cache: RouteStore,
    model: SupportsLoadWeights,
    specs: Iterable[tuple[str, Sequence[int], torch.dtype]],
    *,
    protect: Mapping[str, str] | None = None,
) -> WarmReport:
    """`RouteCache.warm` (documented there)."""
    check_model(model, "RouteCache.warm")
    protected = name_map(protect, "protect= maps tensor names to the reason they are protected")
    checked = _checked_specs(specs)
    index = ModelIndex(model_tensors(model), protected)
    module = as_module(model)
    book = book_of(cache)
    book.bind(model)
    found = learn(module, index, checked) if checked else {}
    rows = []
    for name, _, _ in checked:
        verdict = found[name]
        if isinstance(verdict, Route):
            book.store(verdict)
            rows.append(WarmRow(name, "learned"))
            continue
        status, reason = verdict
        if status == "unlearnable" or reason == _COPIED_NOTHING:
            cache.invalidate(name)  # a route cached before is not what the loader does now
        rows.append(WarmRow(name, status, reason))
    return WarmReport(tuple(rows))
