"""`RouteCache.warm`: routes learnt by a dry run of the loader, with nothing written or staged.

A route records where a loader's ``copy_`` of a *view* of the checkpoint tensor lands (see
`patchctx._routes`). Recording one needs no values, only the views' sizes, strides and offsets.
So a warm-up hands the loader, for each checkpoint name, a *dry* tensor: it has the checkpoint
shape and dtype and claims the model's device, but what it wraps is a meta tensor (no memory).
It follows the loader only as far as a dry run can follow it exactly:

- views of it (narrow, select, slices, transpose, view, ``.data``...) are taken of the meta
  tensor, so their sizes, strides and offsets are those the loader's views would have;
- a ``copy_`` of it into a parameter or buffer goes to the `Recorder` a patch load uses, after
  the same admission checks (`WriteLedger`), and is not performed;
- layout copies, casts and pointwise computations are computed on meta; as in a patch load,
  their results can never be a route;
- what needs values (``item()``, ``tolist()``, a data-dependent shape, raw storage) or what a
  dry run cannot mirror exactly stops the run.

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
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch
from torch.utils._pytree import tree_map

from patchctx import _ops, _swap
from patchctx._arguments import name_map
from patchctx._dispatch_mode import DispatchMode
from patchctx._errors import (
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    PatchProblem,
)
from patchctx._frame import Frame
from patchctx._geometry import Route, Segment
from patchctx._grad import without_grad
from patchctx._guard import constant_of
from patchctx._model import SupportsLoadWeights, as_module, check_model, model_tensors, read_names
from patchctx._recording import LOADED_WITH_OTHERS, Recorder
from patchctx._report import status_counts, status_table
from patchctx._snapshot import Snapshot
from patchctx._staged import Provenance, Root, StagedTensor, reads_own_output
from patchctx._undo import UndoLog
from patchctx._writes import MaskedWrite, ModelIndex, WriteLedger, span_of, storage_key

if TYPE_CHECKING:
    from patchctx._routes import RouteStore

__all__ = ["WarmReport", "WarmRow", "warm"]

aten = torch.ops.aten

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
    """Ends a dry run that can no longer follow the loader exactly.

    A `BaseException`, so that a loader's ``except Exception`` does not swallow it; one that
    swallows it anyway changes nothing, since the reason was recorded before it was raised.
    """


class _DryLedger(WriteLedger):
    """The `WriteLedger` of a dry run: the same admission and overlap checks, no undo log.

    It also keeps the run's verdicts: names settled without a route, and why the run stopped.
    """

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
        """End the run (`halt`); outside one, refuse the use of its dry data instead.

        A loader that kept a dry tensor (in a cache, an attribute) may use it in a later call,
        a real load included: the run's internal stop must not escape it, so that use is
        refused with a `LoaderContractError`, before the operation runs.
        """
        if not self.open:
            raise LoaderContractError(
                f"the loader used the dry tensor of {_label(frozenset(names) or self.loading)} "
                "that a dry run of it handed it before (RouteCache.warm, or a dense patch with "
                "routes= learning its route) after that run ended: it kept it (a cache, an "
                f"attribute) and it holds no values ({reason}). Reset the loader's state; a "
                "loader that keeps checkpoint tensors across calls cannot be dry-run"
            )
        self.halt(status, reason, names)
        raise _Stop(reason)

    def log_masked(
        self,
        destination: torch.Tensor,
        update: torch.Tensor | None,
        source: StagedTensor | None,
        names: frozenset[str],
        *,
        dense: bool = False,
    ) -> None:
        """A write of dry data into a model tensor: remembered and recorded, not performed."""
        with self._lock:
            owner = self.index.owner(destination)
            key = storage_key(destination)
            if owner is None or key is None:  # admitted writes always have both
                self.stop("deferred", "a write of it reached no model tensor", names)
            span = span_of(destination, key)
            self.masked.append(MaskedWrite(span, owner.name, names))
            if threading.get_ident() != self.thread:
                self.recorder.unprovable(names, "the loader wrote it from another thread")
            elif source is None:
                self.recorder.unprovable(names, "the loader wrote it with an indexed write")
            else:
                holders = self.index.holders(destination)
                self.recorder.segment(
                    source, destination, owner.name, key, owner.tensor, span, holders
                )


def _label(names: frozenset[str]) -> str:
    return ", ".join(map(repr, sorted(names)))


class DryTensor(StagedTensor):
    """A checkpoint tensor with a shape, a dtype and a device but no values (see module doc).

    It wraps a meta tensor; its provenance (`Provenance.root`) makes a ``copy_`` of a view of
    it a route segment, exactly as for staged data.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, prov: Provenance, device: torch.device) -> DryTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=device,
            layout=data.layout,
            requires_grad=False,
        )
        wrapper._data = data
        wrapper._update = data  # a dry tensor has no mask: nothing is ever merged
        wrapper._prov = prov
        if prov.ledger is not None:
            prov.ledger.born.add(wrapper)
        return wrapper

    def __init__(self, data: torch.Tensor, prov: Provenance, device: torch.device) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"DryTensor({_label(self._prov.names)}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def _ledger(self) -> _DryLedger:
        ledger = self._prov.ledger
        assert isinstance(ledger, _DryLedger)
        return ledger

    def _refuse_read(self, what: str) -> NoReturn:
        self._ledger().stop(
            "unlearnable",
            f"the loader reads its values ({what}); a route exists only for a loader that "
            "copies views",
            self._prov.names,
        )

    def tolist(self) -> NoReturn:
        self._refuse_read(".tolist()")

    def numpy(self, *, force: bool = False) -> NoReturn:
        self._refuse_read(".numpy()")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse_read("pickling")

    def _no_storage(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse_read("raw memory access: storage, data_ptr, DLPack")

    untyped_storage = _no_storage
    storage = _no_storage
    _typed_storage = _no_storage
    data_ptr = _no_storage
    __dlpack__ = _no_storage

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        was_inside = _swap.is_bypassed()
        # Our own work on meta tensors is never a masked region's business.
        try:
            _swap.bypass()
            result = _dispatch(func, args, kwargs or {})
            _swap.end_bypass(was_inside)
            return result
        finally:
            _swap.end_bypass(was_inside)  # a second reset, for an exception that cut the first


def _twin(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `tensor`'s sizes, strides and dtype (no storage offset)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _meta(value: Any) -> Any:
    if isinstance(value, DryTensor):
        return value._data
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return _twin(value)
    return value


def _on_meta(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, torch.device | None]:
    """Run `func` on the meta counterparts of its arguments; also the device it asked for."""
    meta_args, meta_kwargs = tree_map(_meta, args), tree_map(_meta, kwargs)
    asked = meta_kwargs.get("device")
    if asked is not None:
        meta_kwargs["device"] = torch.device("meta")
    return func(*meta_args, **meta_kwargs), None if asked is None else torch.device(asked)


def _dispatch(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = _ops.tensors_in((args, kwargs))
    dry = [t for t in tensors if isinstance(t, DryTensor)]
    ledger = dry[0]._ledger()
    names = frozenset().union(*(t._prov.names for t in dry))
    if not ledger.open:  # kept by the loader past its run: never computed on
        ledger.stop("unlearnable", f"{func} on it", names)
    if any(isinstance(t, StagedTensor) and not isinstance(t, DryTensor) for t in tensors) or any(
        t._ledger() is not ledger for t in dry
    ):
        ledger.stop("deferred", f"the loader mixes it with data of another load ({func})", names)
    rule = _ops.rule(func)
    if rule.writes:
        targets = _ops.targets_of(func, args, kwargs)
        if any(isinstance(t, DryTensor) for t in targets):
            return _write_into_dry(func, args, kwargs, targets, ledger, names)
        return _write_into_plain(func, args, kwargs, targets, ledger, names)
    if rule.said == ".item()":
        dry[0]._refuse_read(".item()")
    if rule.kind == "view":
        return _view(func, args, kwargs, dry[0], ledger, names)
    return _compute(func, args, kwargs, dry[0], ledger, names)


def _meta_result(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ledger: _DryLedger,
    names: frozenset[str],
) -> tuple[Any, torch.device | None]:
    try:
        return _on_meta(func, args, kwargs)
    except _Stop:
        raise
    except Exception as error:
        ledger.stop(
            "deferred", f"a dry run cannot follow {func} on it ({type(error).__name__})", names
        )


def _wrap(result: Any, wrap: Callable[[torch.Tensor], DryTensor]) -> Any:
    if isinstance(result, torch.Tensor):
        return wrap(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_wrap(item, wrap) for item in result)
    return result


def _only_tensors(result: Any) -> bool:
    if isinstance(result, torch.Tensor):
        return True
    return isinstance(result, (list, tuple)) and all(_only_tensors(item) for item in result)


def _view(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    source: DryTensor,
    ledger: _DryLedger,
    names: frozenset[str],
) -> Any:
    """A view: taken of the meta tensor, so its geometry is the real one; the root goes along."""
    prov = source._prov
    if _ops.rule(func).reinterprets:
        dtype = args[1] if len(args) > 1 else kwargs["dtype"]
        if dtype.itemsize != source.dtype.itemsize:
            ledger.unprovable(names, f"the loader reinterpreted it as {dtype}")
            prov = prov.derived()
    result, _ = _meta_result(func, args, kwargs, ledger, names)
    return _wrap(result, lambda data: DryTensor(data, prov, source.device))


def _compute(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    source: DryTensor,
    ledger: _DryLedger,
    names: frozenset[str],
) -> Any:
    """A computation on dry data: computed on meta, never a route (as in a patch load)."""
    result, device = _meta_result(func, args, kwargs, ledger, names)
    if not _only_tensors(result):
        source._refuse_read(f"{func} returns {type(result).__name__}")
    if _ops.rule(func).kind == "opaque":
        ledger.unprovable(names, f"the loader computed {func} from it")
    prov = Provenance(names, ledger)
    return _wrap(result, lambda data: DryTensor(data, prov, device or source.device))


def _write_into_dry(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: list[torch.Tensor],
    ledger: _DryLedger,
    names: frozenset[str],
) -> Any:
    """The loader changes dry data itself: it may go on, but no route of it can be proven."""
    for target in targets:
        if isinstance(target, DryTensor) and target._prov.root is not None:
            target._prov.root.tampered = True
    ledger.unprovable(names, f"the loader modified it with {func}")
    if any(not isinstance(t, DryTensor) for t in targets):
        ledger.stop("unlearnable", f"the loader writes it and a plain tensor with {func}", names)
    back = {id(t._data): t for t in targets if isinstance(t, DryTensor)}
    result, _ = _meta_result(func, args, kwargs, ledger, names)
    prov = Provenance(names, ledger)
    device = targets[0].device

    def wrap(data: torch.Tensor) -> torch.Tensor:
        same = back.get(id(data))  # an in-place result is the dry tensor written into
        return DryTensor(data, prov, device) if same is None else same

    if isinstance(result, torch.Tensor):
        return wrap(result)
    if isinstance(result, (list, tuple)):
        return type(result)(wrap(r) if isinstance(r, torch.Tensor) else r for r in result)
    return result


def _write_into_plain(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: list[torch.Tensor],
    ledger: _DryLedger,
    names: frozenset[str],
) -> Any:
    """Dry data written into a plain tensor: checked and recorded as in a patch load, skipped."""
    rule = _ops.rule(func)
    if len(targets) != 1:
        ledger.stop("unlearnable", f"the loader writes it with {func}", names)
    target = targets[0]
    in_place = bool(args) and args[0] is target
    how = "copy_" if rule.whole else str(func)
    if ledger.index.owner(target) is None:
        ledger.stop(
            "unlearnable",
            f"the loader writes it with {how} into a tensor that is not a parameter or buffer "
            "of the model (a temporary): a patch load refuses that",
            names,
        )
    try:
        ledger.admit(target, names, how, dense=False)
    except LoaderContractError as error:
        ledger.stop("unlearnable", str(error), names)
    if rule.whole and in_place:
        source = args[1]
        if not isinstance(source, DryTensor):
            ledger.stop("unlearnable", f"the loader copies with dry arguments ({func})", names)
        try:
            fits = torch.broadcast_shapes(source.shape, target.shape) == target.shape  # type: ignore[no-untyped-call]
        except RuntimeError:
            fits = False
        if not fits:
            ledger.stop(
                "unlearnable",
                f"the loader copies it ({tuple(source.shape)}) into a tensor of shape "
                f"{tuple(target.shape)}, which it does not broadcast to",
                names,
            )
        ledger.log_masked(target, None, source, names)
        return target
    moved = rule.moves
    if moved is not None and in_place and not _ops.accumulates(func, args, kwargs):
        if any(isinstance(a, DryTensor) for i, a in enumerate(args) if i and i not in moved):
            ledger.stop("unlearnable", f"the loader indexes with it ({func})", names)
        _meta_result(func, args, kwargs, ledger, names)  # raises where the real write would
        ledger.log_masked(target, None, None, names)
        return target
    if not in_place and rule.kind == "pointwise" and not reads_own_output(target, args, kwargs):
        fresh = torch.empty(0, dtype=target.dtype, device="meta")
        fresh_args, fresh_kwargs = list(args), dict(kwargs)
        for position, name in rule.writes:
            if position < len(fresh_args):
                fresh_args[position] = fresh
            else:
                fresh_kwargs[name] = fresh
        _meta_result(func, tuple(fresh_args), fresh_kwargs, ledger, names)
        if fresh.shape != target.shape:
            ledger.stop(
                "unlearnable",
                f"the loader writes {tuple(fresh.shape)} values with {func} into a tensor of "
                f"shape {tuple(target.shape)} (it would be resized)",
                names,
            )
        ledger.log_masked(target, None, None, names)
        return target
    return ledger.stop(
        "unlearnable",
        f"the loader writes it into a tensor with {func}, which reads or accumulates what the "
        "tensor held: a patch load refuses that (or, for a patch that changes every element, "
        "writes it without a route)",
        names,
    )


class _DryGuard(DispatchMode):
    """The loader's plain operations in a dry run (its thread): model writes checked, skipped."""

    def __init__(self, ledger: _DryLedger) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ledger = ledger

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _ops.tensors_in((args, kwargs))
        if any(isinstance(t, StagedTensor) for t in tensors):
            return func(*args, **kwargs)  # the dry data handles it
        ledger = self.ledger
        for tensor in _ops.host_reads(func, args, kwargs):  # the loader may decide on it
            ledger.host_read(tensor)
        rule = _ops.rule(func)
        targets = _ops.targets_of(func, args, kwargs)
        owned = [(t, ledger.index.owner(t)) for t in targets]
        model_targets = [(t, owner) for t, owner in owned if owner is not None]
        if rule.kind != "view":
            # A model tensor written here is checked as a write (`plain_write` refuses what a
            # patch load refuses), and the write is skipped: what it reads does not matter.
            skip = targets if rule.pure_write else [t for t, _ in model_targets]
            for tensor in tensors:
                if all(tensor is not t for t in skip):
                    self._read(tensor, func)
        if len(model_targets) < len(targets):
            for target, owner in owned:
                if owner is None:
                    try:
                        ledger.index.refuse_aliased(target, f"the loader, with {func},")
                    except LoaderContractError as error:
                        ledger.stop("unlearnable", str(error), ledger.loading)
        if not model_targets:
            result = func(*args, **kwargs)
            ledger.derive(tensors, result)
            ledger.constancy(rule.lifts, tensors, targets, result)
            return result
        labels = ", ".join(repr(owner.name) for _, owner in model_targets)
        if rule.reshaping:
            ledger.stop(
                "unlearnable",
                f"the loader calls {func} on {labels}, changing its shape, strides or storage: "
                "a patch load refuses that",
            )
        if rule.out or len(targets) != 1 or rule.writes[0][0] != 0:
            ledger.stop("deferred", f"a dry run does not skip the loader's {func} into {labels}")
        try:
            func(*tree_map(_meta, args), **tree_map(_meta, kwargs))  # raises where it would
        except Exception as error:
            ledger.stop(
                "deferred", f"a dry run cannot follow {func} into {labels} ({type(error).__name__})"
            )
        try:
            ledger.plain_write(targets[0], str(func), constant=constant_of(func, args))
        except LoaderContractError as error:
            ledger.stop("unlearnable", str(error), ledger.loading)
        return args[0]  # the write is skipped

    def _read(self, tensor: torch.Tensor, func: torch._ops.OpOverload) -> None:
        """The loader reads `tensor`: bytes a dry run did not write would read differently."""
        ledger = self.ledger
        key = storage_key(tensor)
        if key is None or not (ledger.masked or ledger.plain):
            return
        span = span_of(tensor, key)
        for earlier in ledger.masked:
            if earlier.span.overlaps(span):
                ledger.settle(
                    earlier.names,
                    "unlearnable",
                    "the loader reads the weight back after writing it (a tied or derived copy "
                    "that replay would not update)",
                )
                ledger.stop(
                    "deferred",
                    f"the loader reads {earlier.owner!r} back with {func} after writing it",
                )
        for write in ledger.plain:
            if write.span.overlaps(span):
                ledger.stop(
                    "deferred",
                    f"the loader reads {write.owner!r} back with {func} after its own write "
                    f"({write.how}), which a dry run skips",
                )


def _kept(ledger: _DryLedger) -> set[str]:
    """The names of the dry tensors still alive (the loader kept them)."""
    kept: set[str] = set()
    for tensor in list(ledger.born):
        kept |= tensor._prov.names
    return kept


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
        data = torch.empty(shape, dtype=dtype, device="meta")
        weights.append(
            (name, DryTensor(data, Provenance(frozenset({name}), ledger, Root(data)), device))
        )
        ledger.recorder.expect(name)
    reported: set[str] = set()
    frame = Frame(_DryGuard(ledger))
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
    except LoaderContractError as error:  # refused by the loader itself (a transformed weight)
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
            f"the loader kept {_label(frozenset(kept))} after returning (a cache, an "
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
    if route.segments != segments:
        return (
            "deferred",
            "the loader copies it differently alone than together with the other names",
        )
    return route


@without_grad
def learn(
    module: torch.nn.Module, index: ModelIndex, specs: list[Spec]
) -> dict[str, Route | tuple[_Status, str]]:
    """Every spec's route, or why it has none, by dry runs of the loader (see `_learn`)."""
    device = next((t.device for t in index.tensors.values()), torch.device("cpu"))
    return _learn(module, index, specs, device)


def learn_alone(
    module: torch.nn.Module, index: ModelIndex, spec: Spec, segments: Sequence[Segment]
) -> Route | None:
    """The route of a name of a patch load that only the call's constant fills kept from one.

    Learnt by a dry run of the name alone (see `_alone`); `None` if it has none.
    """
    device = next((t.device for t in index.tensors.values()), torch.device("cpu"))
    found = _alone(module, index, spec, device, tuple(segments))
    return found if isinstance(found, Route) else None


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
                found[name] = (
                    route
                    if isinstance(route, Route) and route.segments == segments
                    else (
                        "deferred",
                        "the loader copies it differently alone than together with the other names",
                    )
                )
    return found


def _checked_specs(specs: object) -> list[Spec]:
    checked: list[Spec] = []
    problems = []
    if not isinstance(specs, Iterable) or isinstance(specs, (str, bytes)):
        raise InvalidPatchTypeError(
            [
                PatchProblem(
                    None,
                    "",
                    f"RouteCache.warm takes (name, shape, dtype) specs; you supplied {specs!r:.80}",
                    is_type_error=True,
                )
            ]
        )
    for position, spec in enumerate(specs):
        try:
            name, shape, dtype = spec
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            problems.append(
                PatchProblem(position, "", f"is not a (name, shape, dtype) spec: {spec!r:.80}")
            )
            continue
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            problems.append(
                PatchProblem(
                    position, str(name), f"needs a str name and a torch.dtype: {spec!r:.80}"
                )
            )
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
    cache._bind(model)
    found = learn(module, index, checked) if checked else {}
    rows = []
    for name, _, _ in checked:
        verdict = found[name]
        if isinstance(verdict, Route):
            cache._store(verdict)
            rows.append(WarmRow(name, "learned"))
            continue
        status, reason = verdict
        if status == "unlearnable" or reason == _COPIED_NOTHING:
            cache.invalidate(name)  # a route cached before is not what the loader does now
        rows.append(WarmRow(name, status, reason))
    return WarmReport(tuple(rows))
