"""Staged data: a tensor subclass whose provenance travels with the data, in every thread.

A sparse patch reaches the model's ``load_weights`` as a `StagedTensor`: a checkpoint-shaped
wrapper around two plain tensors, the values (``_data``) and a boolean mask of the positions the
patch changes (``_update``, see `KEEP`). Unchanged positions mean "keep what the model holds".

Every ATen operation that touches a staged tensor, in any thread, lands in
`StagedTensor.__torch_dispatch__`, which either carries the mask through it exactly or refuses
it with `LoaderContractError` before anything is written:

- views (``narrow``, ``t``, ``view``, ``detach``, ``.data``, ``nn.Parameter(w)``...) are applied
  to values and mask alike; a view that reinterprets bytes (``view(torch.int32)``) regroups the
  mask, and refuses when an element would mix changed and unchanged bytes;
- layout copies and casts (``clone``, ``contiguous``, ``to``, ``cat``, ``stack``, indexing) copy
  the mask along; pointwise computations give a position the "changed" mark only when every
  staged input is changed there (and refuse when staged inputs disagree);
- any other computation is allowed only when its staged inputs are entirely changed or entirely
  unchanged, since its results mix positions;
- staged data that chooses elements rather than being carried (the index of ``index_select``,
  ``take``, ``gather`` or an indexed write, the mask of ``masked_fill_``) is refused unless the
  patch changes every element of it: a kept element holds a placeholder, not the checkpoint's
  value, so it would choose wrong, and no mask of the result can say where;
- a write of staged data into a plain tensor is the masked merge (positions marked "keep" keep
  the destination), done for ``copy_``, indexed assignment, ``index_copy_``, ``masked_scatter_``,
  ``scatter_``, ``fill_`` and the ``out=`` form of pointwise operations; every other in-place
  operation with staged inputs is refused. When the staged data belongs to a load, its ledger
  (`Ledger`) must first admit the destination (a model tensor that existed before the call);
- reading values out of torch (``item()``, ``tolist()``, ``numpy()``, pickling, storage access)
  is allowed only when the patch changes every element (a value out of torch can steer how the
  loader writes the kept ones).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch
from torch.utils._pytree import tree_map

from patchctx import _ops
from patchctx._bits import scatter_flat
from patchctx._errors import LoaderContractError
from patchctx._swap import bypass, end_bypass, is_bypassed

__all__ = [
    "Ledger",
    "Provenance",
    "Root",
    "StagedTensor",
    "UnchangedValueRead",
    "data_of",
    "label",
    "mask_of",
    "on_meta",
    "provenance_of",
    "stage",
    "stage_dense",
]


class Ledger(Protocol):
    """What a load session does with the writes of its staged data (see `patchctx._writes`)."""

    # Refusals raised for this load, kept even when the loader catches them.
    refusals: list[LoaderContractError]

    def admit(
        self, destination: torch.Tensor, names: frozenset[str], how: str, *, dense: bool
    ) -> bool:
        """Raise `LoaderContractError` unless staged data of `names` may be written there.

        Returns whether the destination is a model tensor (whose writes are logged).
        """
        ...

    def log_masked(
        self,
        destination: torch.Tensor,
        update: torch.Tensor | None,
        source: StagedTensor | None,
        names: frozenset[str],
        *,
        dense: bool = False,
    ) -> None:
        """Called right before a write of `names` into `destination`.

        `update` says which positions change (`None`: all of them); `source` is the staged
        tensor copied as a whole by ``copy_`` (a candidate route segment), or `None` for any
        other kind of write; `dense` marks a dense patch's data.
        """
        ...

    def unprovable(self, names: frozenset[str], reason: str) -> None:
        """Routes of `names` cannot be proven equal to the loader path, for `reason`."""
        ...

    def values_read(self, names: frozenset[str], what: str) -> None:
        """The loader takes values of `names` out of torch with `what` (a dry run stops)."""
        ...

    def cannot_follow(self, func: object, error: Exception, names: frozenset[str]) -> None:
        """`func` on data of `names` raised `error`: a load lets it go up, a dry run stops."""
        ...

    def is_constant(self, tensor: torch.Tensor) -> bool:
        """Whether the loader made the plain `tensor` from constants alone, in this load."""
        ...

    @property
    def born(self) -> weakref.WeakSet[StagedTensor]:
        """Every staged tensor of the load (to find the ones the loader kept)."""
        ...


@dataclass(eq=False, slots=True)
class Root:
    """The staged tensor a load handed to the loader: the origin of every view of it."""

    data: torch.Tensor  # contiguous, checkpoint-shaped, storage offset 0
    tampered: bool = False  # the loader wrote into the staged data itself


@dataclass(slots=True)
class Provenance:
    """Where a staged tensor's data comes from and whom its writes are reported to.

    Attributes:
        names: The checkpoint names whose staged data it carries.
        ledger: The load session of that data (`None`: staged outside a load, for
            `masked_copy`, whose merges need no admission).
        root: Set when the values are a view of one root's storage in its dtype, so a
            ``copy_`` of it is an affine map from checkpoint positions (a route segment).
    """

    names: frozenset[str]
    ledger: Ledger | None
    root: Root | None = None
    # The mask aliases the data the way the values do (False after a reinterpreting view,
    # whose mask is regrouped into a tensor of its own): in-place writes are exact only then.
    mask_is_view: bool = field(default=True)
    # A dense patch (every position CHANGED), wrapped only so that its writes are logged in
    # whatever thread they happen (``atomic``): it may also go into temporaries.
    dense: bool = False
    # The mask holds KEEP and CHANGED only (no CONST), so it reads as a boolean "write here"
    # mask without a pass over it. Shared by every view of the tensor (they share this
    # object), and cleared by any write into the staged data or a result that may hold CONST.
    binary: bool = True
    # The patch leaves some position unchanged. Then no value may leave torch, changed or not:
    # what the loader does with it (a branch, a computed offset) could change how it writes
    # the positions the patch keeps, which the masked merge cannot follow.
    partial: bool = True
    # The device a dry run's tensor claims (its values and mask are on meta: see `_warm`).
    device: torch.device | None = None

    def derived(self, *, mask_is_view: bool = True, binary: bool = True) -> Provenance:
        return Provenance(
            self.names,
            self.ledger,
            None,
            mask_is_view,
            self.dense,
            binary and self.binary,
            self.partial,
            self.device,
        )


class UnchangedValueRead(LoaderContractError):
    """The loader read a value out of torch from a patch that does not change every element.

    A value that leaves torch can steer what the loader does next (a branch, an offset) with
    the elements the patch keeps, which no mask follows, so it is refused whether or not the
    element read is one the patch changes. A patch that changes every element (a dense one)
    may be read: `audit` reports such names as masked, not unsupported.
    """


def _refuse(message: str) -> NoReturn:
    raise LoaderContractError(message + "; nothing was written")


def label(names: frozenset[str]) -> str:
    """Checkpoint names as messages list them."""
    return ", ".join(map(repr, sorted(names)))


# What a position of staged data holds, in its mask (uint8): the model's value must be kept
# there (the patch does not change it; the staged value means nothing), the patch's new value,
# or a value that does not depend on the patch at all (a constant the loader made).
KEEP, CHANGED, CONST = 0, 1, 2
# A value that came from a plain tensor (cat with one, a copy of one into staged data): written
# like CONST, but it may be model state, so a position the patch keeps may not meet it.
OUTSIDE = 3


def data_of(value: Any) -> Any:
    return value._data if isinstance(value, StagedTensor) else value


def mask_of(value: Any) -> Any:
    return value._update if isinstance(value, StagedTensor) else value


def provenance_of(value: StagedTensor) -> Provenance:
    return value._prov


def _known(value: torch.Tensor) -> torch.Tensor:
    """The mask of `value`: its own, or OUTSIDE everywhere for plain data."""
    return value._update if isinstance(value, StagedTensor) else _codes(value, OUTSIDE)


def _codes(like: torch.Tensor, code: int) -> torch.Tensor:
    """A mask shaped and strided like `like`, holding `code` everywhere."""
    mask = torch.empty_strided(like.shape, like.stride(), dtype=torch.uint8, device=like.device)
    return mask.fill_(code)


def _moved_mask(value: Any, device: torch.device | None = None) -> Any:
    """The mask standing in for a data argument of a move: known unless staged."""
    if not isinstance(value, torch.Tensor):
        return CONST  # a Python number
    mask = _known(value)
    return mask if device is None else mask.to(device)


class StagedTensor(torch.Tensor):
    """A checkpoint-shaped tensor of a sparse patch: values plus the mask of changed positions.

    Not public: the loader sees an ordinary-looking tensor. `patchctx`'s strategies return one
    from ``stage`` and the high-level call hands them to ``load_weights``.
    """

    _data: torch.Tensor
    _update: torch.Tensor
    _prov: Provenance

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: torch.Tensor, update: torch.Tensor, prov: Provenance) -> StagedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=prov.device or data.device,
            layout=data.layout,
            requires_grad=False,
        )
        wrapper._data = data
        wrapper._update = update
        wrapper._prov = prov
        if prov.ledger is not None:
            prov.ledger.born.add(wrapper)
        return wrapper

    def __init__(self, data: torch.Tensor, update: torch.Tensor, prov: Provenance) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        meta = self._update.is_meta  # a dry run's: values and mask on meta
        changed = "dry" if meta else f"changed={int((self._update == CHANGED).sum())}"
        return (
            f"StagedTensor({label(self._prov.names)}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, {changed}/{self.numel()})"
        )

    # -- reading values out of torch --------------------------------------------------------

    def _require_all_changed(self, what: str) -> None:
        if self._prov.ledger is not None:  # (a dry run stops here)
            self._prov.ledger.values_read(self._prov.names, what)
        if self._prov.partial and not self._prov.dense:
            raise self._noted(
                UnchangedValueRead(
                    f"{what} of staged data of {label(self._prov.names)}: the patch does not "
                    "change every element, and a value read out of torch could decide how the "
                    "loader writes the ones it keeps (a branch), which the masked merge cannot "
                    "follow; send this tensor dense, or one that changes every element"
                )
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> StagedTensor:
        result = self.clone()
        memo[id(self)] = result
        return result  # type: ignore[return-value]

    def tolist(self) -> Any:
        self._require_all_changed(".tolist()")
        return self._data.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        self._require_all_changed(".numpy()")
        return self._data.detach().clone().numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise self._noted(
            LoaderContractError(
                f"pickling staged data of {label(self._prov.names)} (pickle, torch.save, "
                "multiprocessing): it would turn the 'keep' marks into plain numbers"
            )
        )

    def _no_storage(self, *args: object, **kwargs: object) -> NoReturn:
        raise self._noted(
            LoaderContractError(
                f"raw memory access to staged data of {label(self._prov.names)} (storage, "
                "data_ptr, DLPack): the bytes alone do not say which positions the patch changes"
            )
        )

    untyped_storage = _no_storage
    storage = _no_storage
    _typed_storage = _no_storage
    data_ptr = _no_storage
    __dlpack__ = _no_storage

    # -- every operation ---------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        was_inside = is_bypassed()
        # Our own copies of values and masks are never a region's business.
        try:
            bypass()
            result = _dispatch(func, args, kwargs or {})
            end_bypass(was_inside)
            return result
        except LoaderContractError as error:
            for tensor in _ops.tensors_in((args, kwargs or {})):
                if isinstance(tensor, StagedTensor):
                    tensor._noted(error)
            raise
        except Exception as error:  # a dry run stops where its meta values cannot go on
            staged = [t for t in _ops.tensors_in((args, kwargs)) if isinstance(t, StagedTensor)]
            if staged and staged[0]._prov.ledger is not None:
                staged[0]._prov.ledger.cannot_follow(func, error, staged[0]._prov.names)
            raise
        finally:
            end_bypass(was_inside)  # a second reset, for an exception that cut the first

    def _noted(self, error: LoaderContractError) -> LoaderContractError:
        """`error`, remembered by the load this staged data belongs to (see `WriteLedger`)."""
        ledger = self._prov.ledger
        if ledger is not None and all(error is not known for known in ledger.refusals):
            ledger.refusals.append(error)
        return error


def _provenance(staged: list[StagedTensor]) -> Provenance:
    """The combined provenance of several staged inputs (one load at most)."""
    first = staged[0]._prov
    if len(staged) == 1:
        return first
    ledgers = {id(s._prov.ledger): s._prov.ledger for s in staged if s._prov.ledger is not None}
    if len(ledgers) > 1:
        _refuse("an operation combines staged data of two different loads")
    names = frozenset().union(*(s._prov.names for s in staged))
    dense = all(s._prov.dense for s in staged)
    binary = all(s._prov.binary for s in staged)
    partial = any(s._prov.partial for s in staged)
    ledger = next(iter(ledgers.values()), None)
    return Provenance(names, ledger, None, True, dense, binary, partial, first.device)


def _leaking(rule: _ops.Rule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[StagedTensor]:
    """The staged inputs whose values leave torch through the op's result (`Rule.leak`).

    Through a Python number or bool (``equal``, ``allclose``, ``is_nonzero``, ``item``), or
    through a result whose shape depends on them (``nonzero``, ``unique``, a boolean-mask
    index, ``masked_select``): a loader can branch on either. For indexing, only the index
    tensors decide the shape; for ``masked_select``, only the mask.
    """
    kind = rule.leak
    if kind is None:
        return []
    deciding: Any = (args, kwargs) if kind == "all" else _ops.argument(args, kwargs, 1, kind)
    return [t for t in _ops.tensors_in(deciding) if isinstance(t, StagedTensor)]


# The data argument of a view, a factory shaped like its input or a layout copy: ``self``, or
# the tensor list of cat/stack (position 0 either way).
_SELF = frozenset({0})


def _refuse_kept_operands(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    data: frozenset[int],
) -> None:
    """Refuse staged data with kept positions in any argument of `func` but its `data` ones.

    The data arguments of a view, a layout copy or a move are carried element by element, and
    their masks along with them. Any other tensor argument (an index, a mask, a source of
    shape) decides *which* elements are read or written; at a position the patch keeps, staged
    data holds a placeholder, not the checkpoint's value, so what it decides there is wrong,
    and no mask of the result can say so. Exact only when the patch keeps none of its
    positions (a dense patch, or a part of a sparse one that the patch changes entirely).
    """
    for position, name in _ops.rule(func).tensors:
        if position in data:
            continue
        for tensor in _ops.tensors_in(_ops.argument(args, kwargs, position, name)):
            if not isinstance(tensor, StagedTensor) or tensor._prov.dense:
                continue
            if _any(tensor._update == KEEP):
                _refuse(
                    f"the loader passes staged data of {label(tensor._prov.names)} to {func} "
                    f"as its {name!r} argument, which decides which elements are read or "
                    "written (an index, a mask): the patch does not change every element of it, "
                    "and where it does not, the staged data holds a placeholder instead of the "
                    "checkpoint's value, so the result would be wrong there. Send this tensor "
                    "as a dense patch"
                )


def _dispatch(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rule = _ops.rule(func)
    staged = [t for t in _ops.tensors_in((args, kwargs)) if isinstance(t, StagedTensor)]
    # A dry run's data (values and mask on meta): an operation needing values fails on meta
    # and stops the run, but for a value read out (.item()), which rules a route out.
    dry = staged[0]._data.is_meta
    if not dry or rule.item:
        for leaking in _leaking(rule, args, kwargs):
            leaking._require_all_changed(rule.said)
    targets = _ops.targets_of(func, args, kwargs) if rule.writes else []
    if dry:  # the other tensors stand in on meta (the written ones are the ledger's)
        args, kwargs = tree_map(lambda value: on_meta(value, targets), (args, kwargs))
    if rule.writes:
        if any(isinstance(t, StagedTensor) for t in targets):
            return _write_into_staged(func, rule, args, kwargs, targets, staged)
        return _write_into_plain(func, rule, args, kwargs, targets, staged)
    kind = rule.kind
    if kind == "pointwise":
        return _pointwise(func, args, kwargs, staged)
    if kind == "opaque":
        return _opaque(func, args, kwargs, staged)
    _refuse_kept_operands(func, args, kwargs, _SELF)
    if kind == "view":
        if rule.reinterprets:
            return _reinterpret(staged[0], _ops.argument(args, kwargs, 1, "dtype"))
        return _view(func, args, kwargs, staged)
    if kind == "like":
        return _like(func, args, kwargs, staged, known=rule.known)
    return _layout(func, rule, args, kwargs, staged)


def on_meta(value: Any, keep: Sequence[torch.Tensor] = ()) -> Any:
    """A plain tensor's stand-in on meta in a dry run (not `keep`), and ``device=`` meta."""
    if isinstance(value, torch.device):
        return torch.device("meta")
    plain = isinstance(value, torch.Tensor) and not isinstance(value, StagedTensor)
    if not plain or value.is_meta or any(value is k for k in keep):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _any(flags: torch.Tensor) -> bool:
    """Whether a boolean tensor holds True: never on meta (a dry run knows no mask)."""
    return not flags.is_meta and bool(flags.any())


def _wrap(result: Any, update: Callable[[torch.Tensor], torch.Tensor], prov: Provenance) -> Any:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, StagedTensor):
            return StagedTensor(value, update(value), prov)
        return value

    if isinstance(result, (list, tuple)):
        return type(result)(one(value) for value in result)
    return one(result)


def _unwrap(args: Any, kwargs: Any, into: Callable[[Any], Any]) -> tuple[Any, Any]:
    return tree_map(into, args), tree_map(into, kwargs)


def _view(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staged: list[StagedTensor],
) -> Any:
    source = staged[0]
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    mask_args, mask_kwargs = _unwrap(args, kwargs, mask_of)
    data = func(*data_args, **data_kwargs)
    masks = func(*mask_args, **mask_kwargs)
    prov = source._prov
    if isinstance(data, (list, tuple)):
        return type(data)(StagedTensor(d, m, prov) for d, m in zip(data, masks, strict=True))
    return StagedTensor(data, masks, prov)


def _reinterpret(source: StagedTensor, dtype: torch.dtype) -> StagedTensor:
    """``view(dtype)``: the same bytes read as another dtype; the mask is regrouped by bytes."""
    old, new = source.dtype.itemsize, dtype.itemsize
    data = source._data.view(dtype)
    update = source._update
    if new < old:  # each element becomes old // new elements
        update = update.unsqueeze(-1).expand(*update.shape, old // new).reshape(data.shape)
    elif new > old:  # new // old elements become one: all of them kept, or none
        grouped = update.reshape(*update.shape[:-1], -1, new // old)
        first = grouped.select(-1, 0)
        if _any(grouped != first.unsqueeze(-1)):
            _refuse(
                f"the loader reads staged data of {label(source._prov.names)} as {dtype}, "
                "joining changed and unchanged elements into one; a masked write cannot keep "
                "part of an element"
            )
        update = first.contiguous()
    else:
        return StagedTensor(data, update, source._prov)
    names = source._prov.names
    if source._prov.ledger is not None:
        source._prov.ledger.unprovable(names, f"the loader reinterpreted it as {dtype}")
    return StagedTensor(data, update, source._prov.derived(mask_is_view=False))


def _like(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staged: list[StagedTensor],
    *,
    known: bool,
) -> Any:
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    result = func(*data_args, **data_kwargs)
    return _wrap(
        result,
        lambda value: _codes(value, CONST if known else KEEP),
        staged[0]._prov.derived(binary=not known),
    )


def _layout(
    func: torch._ops.OpOverload,
    rule: _ops.Rule,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staged: list[StagedTensor],
) -> Any:
    prov = _provenance(staged).derived()
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    result = func(*data_args, **data_kwargs)
    if rule.cast:
        device = data_kwargs.get("device")
        mask = staged[0]._update
        update = mask if device is None else mask.to(device=device)
        return StagedTensor(result, update.clone(), prov)
    mask_args = list(args)
    data = list(args[0]) if rule.lists else [args[0]]
    if not all(isinstance(t, StagedTensor) for t in data):
        prov.binary = False  # plain data joins as OUTSIDE
    if rule.lists:
        mask_args[0] = [_known(t) for t in args[0]]
    else:
        mask_args[0] = _known(args[0])
    # The other arguments (indices...) hold no kept position here (`_refuse_kept_operands`):
    # their values are the data's, for the mask as for the data.
    mask_kwargs = tree_map(data_of, kwargs)
    masks = func(mask_args[0], *tree_map(data_of, mask_args[1:]), **mask_kwargs)
    if isinstance(result, (list, tuple)):
        return type(result)(StagedTensor(d, m, prov) for d, m in zip(result, masks, strict=True))
    return StagedTensor(result, masks, prov)


def _combined(staged: list[StagedTensor], shape: Sequence[int], what: str) -> torch.Tensor:
    """The mask of a pointwise result, refused where the inputs disagree.

    KEEP where an input keeps, else CHANGED where one changes, else OUTSIDE where one came
    from a plain tensor, else CONST; refused where one input keeps and another changes, or
    came from a plain tensor (`_refuse_mixed_with_outside`).
    """
    masks = [s._update.expand(shape) for s in staged]
    if len(masks) == 1:
        return masks[0]
    keep = torch.zeros(shape, dtype=torch.bool, device=masks[0].device)
    changed = torch.zeros_like(keep)
    outside = torch.zeros_like(keep)
    for mask in masks:
        keep |= mask == KEEP
        changed |= mask == CHANGED
        outside |= mask == OUTSIDE
    if _any(keep & changed):
        _refuse(
            f"the loader computes {what} from staged data of {label(_provenance(staged).names)}"
            " where one input is changed by the patch and another is not; the result there "
            "depends on values patchctx does not know"
        )
    if _any(keep & outside):
        _refuse(
            f"the loader computes {what} from staged data of {label(_provenance(staged).names)}"
            " where one input is kept by the patch and another holds values of a plain tensor "
            "(joined with torch.cat, or copied into staged data): a dense load would combine "
            "the checkpoint's value with that tensor as it is now. Send this tensor as a dense "
            "patch"
        )
    result = torch.full(shape, CONST, dtype=torch.uint8, device=keep.device)
    result.masked_fill_(outside, OUTSIDE)
    return result.masked_fill_(changed, CHANGED).masked_fill_(keep, KEEP)


def _outside(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    ledger: Ledger | None,
    skip: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The plain tensors among an operation's arguments but `skip` (its ``out=`` target).

    Constants the loader made in this load (`Ledger.is_constant`) are not among them.
    """
    return [
        t
        for t in _ops.tensors_in((args, kwargs))
        if not isinstance(t, StagedTensor)
        and t is not skip
        and (ledger is None or not ledger.is_constant(t))
    ]


def _refuse_mixed_with_outside(
    func: object, names: frozenset[str], mask: torch.Tensor, outside: list[torch.Tensor]
) -> None:
    """Refuse a result whose kept positions were computed with a plain tensor.

    At a position the patch keeps, staged data holds a placeholder: the masked merge keeps
    what the model holds there, which a dense load equals only if every other input of the
    computation is what it was at the load that wrote it. A plain tensor (model state, a
    buffer, a clone or reduction of either, a tensor from outside the call, a scale changed
    since) gives no such promise, so the combination has no exact masked result. Python
    numbers and data of the patch itself may meet kept positions; plain tensors may meet
    changed ones only.
    """
    if outside and _any(mask == KEEP):
        _refuse(
            f"the loader computes {func} from staged data of {label(names)} and a plain "
            f"tensor ({', '.join(f'{tuple(t.shape)} {t.dtype}' for t in outside[:3])}) at "
            "positions the patch does not change: there a dense load would combine the "
            "checkpoint's value with that tensor as it is now (model state, a buffer, a scale, "
            "a tensor from outside), which the masked merge cannot follow. Combine staged data "
            "with Python numbers only, or send this tensor as a dense patch"
        )


def _pointwise(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staged: list[StagedTensor],
) -> Any:
    prov = _provenance(staged).derived()
    outside = _outside(args, kwargs, prov.ledger)
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    result = func(*data_args, **data_kwargs)

    def update(value: torch.Tensor) -> torch.Tensor:
        mask = _combined(staged, value.shape, str(func))
        _refuse_mixed_with_outside(func, prov.names, mask, outside)
        return _codes(value, KEEP).copy_(mask)

    return _wrap(result, update, prov)


def _uniform(staged: list[StagedTensor]) -> int | None:
    """The one code a result mixing every position of the inputs gets, or None if mixed."""
    keep = changed = outside = False
    for tensor in staged:
        keep = keep or _any(tensor._update == KEEP)
        changed = changed or _any(tensor._update == CHANGED)
        outside = outside or _any(tensor._update == OUTSIDE)
    if keep and (changed or outside):
        return None  # (kept positions with model state: as mixed, see `_combined`)
    return KEEP if keep else CHANGED if changed else OUTSIDE if outside else CONST


def _opaque(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staged: list[StagedTensor],
) -> Any:
    """A computation that may combine positions: exact only on uniform inputs."""
    state = _uniform(staged)
    prov = _provenance(staged)
    if state is None:
        _refuse(
            f"the loader computes {func} over staged data of {label(prov.names)} that mixes "
            "changed and unchanged positions; its result depends on values patchctx does not "
            "know. Send this tensor as a dense patch"
        )
    if state == KEEP:
        outside = _outside(args, kwargs, prov.ledger)
        _refuse_mixed_with_outside(func, prov.names, staged[0]._update, outside)
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    result = func(*data_args, **data_kwargs)
    if prov.ledger is not None:
        prov.ledger.unprovable(prov.names, f"the loader computed {func} from it")
    if not isinstance(result, (torch.Tensor, list, tuple)):
        if state == KEEP:
            _refuse(f"{func} reads staged data of {label(prov.names)} the patch does not change")
        return result
    return _wrap(
        result, lambda value: _codes(value, state), prov.derived(binary=state in (KEEP, CHANGED))
    )


# ------------------------------------------------------------------------------------- writes


def _write_into_staged(
    func: torch._ops.OpOverload,
    rule: _ops.Rule,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: list[torch.Tensor],
    staged: list[StagedTensor],
) -> Any:
    """An in-place operation on staged data itself: values and mask change together."""
    target = targets[0]
    assert isinstance(target, StagedTensor)
    prov = target._prov
    if len(targets) != 1 or target is not args[0] or not prov.mask_is_view:
        _refuse(f"the loader writes into staged data of {label(prov.names)} with {func}")
    moved = rule.moves
    moves = moved is not None and not _ops.accumulates(func, args, kwargs)
    if moved is not None and moves:
        _refuse_kept_operands(func, args, kwargs, frozenset({0, *moved}))
    if prov.root is not None:
        prov.root.tampered = True
    prov.binary = False  # the write may bring CONST positions in
    if prov.ledger is not None:
        prov.ledger.unprovable(prov.names, f"the loader modified it with {func}")
    data_args, data_kwargs = _unwrap(args, kwargs, data_of)
    if moved is not None and moves:
        mask_args = [target._update] + [
            _moved_mask(a) if i in moved else tree_map(data_of, a) for i, a in enumerate(args) if i
        ]
        func(*data_args, **data_kwargs)
        func(*mask_args, **tree_map(data_of, kwargs))
        return target
    if rule.fill:  # (zero_: fill_ moves its value)
        func(*data_args, **data_kwargs)
        target._update.fill_(CONST)
        return target
    if rule.kind == "pointwise":
        others = [s for s in staged if s is not target]
        combined = _combined([target, *others], target.shape, str(func)) if others else None
        mask = target._update if combined is None else combined
        _refuse_mixed_with_outside(func, prov.names, mask, _outside(args, kwargs, prov.ledger))
        func(*data_args, **data_kwargs)
        if combined is not None:
            target._update.copy_(combined)
        return target
    if not any(_any(s._update == KEEP) for s in staged):
        func(*data_args, **data_kwargs)  # nothing to keep: exact as it is
        target._update.fill_(CHANGED)
        return target
    _refuse(f"the loader changes staged data of {label(prov.names)} in place with {func}")


def _write_into_plain(
    func: torch._ops.OpOverload,
    rule: _ops.Rule,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: list[torch.Tensor],
    staged: list[StagedTensor],
) -> Any:
    """Staged data written into plain tensors: the masked merge, or a refusal before writing."""
    prov = _provenance(staged)
    names = prov.names
    dry = staged[0]._data.is_meta  # (a dry run's writes are checked and logged, not done)
    if len(targets) != 1:
        _refuse(f"the loader writes staged data of {label(names)} with {func}")
    target = targets[0]
    in_place = bool(args) and args[0] is target
    if rule.whole and in_place:
        source = args[1]
        if not isinstance(source, StagedTensor):
            _refuse(f"the loader copies into a plain tensor with staged arguments ({func})")
        _admit(prov, target, names, "copy_")
        _merge(target, source._data, source._update, source, names, prov, binary=prov.binary)
        return target
    moved = rule.moves
    if moved is not None and in_place and not _ops.accumulates(func, args, kwargs):
        _refuse_kept_operands(func, args, kwargs, frozenset({0, *moved}))
        _admit(prov, target, names, str(func))
        scratch = on_meta(target, []) if dry else target.clone()
        data_args, data_kwargs = _unwrap(args, kwargs, data_of)
        func(scratch, *data_args[1:], **data_kwargs)
        update = torch.zeros(target.shape, dtype=torch.uint8, device=scratch.device)  # KEEP
        mask_args = [
            _moved_mask(a, scratch.device) if i in moved else tree_map(data_of, a)
            for i, a in enumerate(args)
        ]
        func(update, *mask_args[1:], **data_kwargs)
        _merge(target, scratch, update, None, names, prov)
        return target
    if not in_place and rule.kind == "pointwise" and not _reads_own_output(target, args, kwargs):
        # The out= form of a pointwise operation: compute, then merge.
        _admit(prov, target, names, str(func))
        data_args, data_kwargs = _unwrap(args, kwargs, data_of)
        fresh = torch.empty(0, dtype=target.dtype, device="meta" if dry else target.device)
        for position, name in rule.writes:
            if position < len(data_args):
                data_args = (*data_args[:position], fresh, *data_args[position + 1 :])
            else:
                data_kwargs = {**data_kwargs, name: fresh}
        result = func(*data_args, **data_kwargs)
        if result.shape != target.shape:
            _refuse(
                f"the loader writes {tuple(result.shape)} values of {label(names)} with {func} "
                f"into a tensor of shape {tuple(target.shape)} (it would be resized)"
            )
        mask = _combined(staged, result.shape, str(func))
        outside = _outside(args, kwargs, prov.ledger, skip=target)
        _refuse_mixed_with_outside(func, names, mask, outside)
        _merge(target, result, mask, None, names, prov)
        return target
    if not any(_any(s._update == KEEP) for s in staged):
        # Nothing to keep: the staged inputs are plain data in all but name (a patch covering
        # every element), and the operation is exact as it is.
        _admit(prov, target, names, str(func))
        if prov.ledger is not None:
            prov.ledger.log_masked(target, None, None, names, dense=prov.dense)
        data_args, data_kwargs = _unwrap(args, kwargs, data_of)
        return target if dry else func(*data_args, **data_kwargs)
    _refuse(
        f"the loader writes staged data of {label(names)} into a tensor with {func}, which "
        "reads or accumulates what the tensor held: the positions the patch does not change "
        "would not keep their values (only copy_, indexed assignment, index_copy_, "
        "masked_scatter_, scatter_, fill_ and out= pointwise writes can be masked)"
    )


def _reads_own_output(target: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether an ``out=`` operation also reads its output's storage (``add(p, w, out=p)``)."""
    try:
        key = target.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return True
    inputs = _ops.tensors_in((args, {k: v for k, v in kwargs.items() if k != "out"}))
    return any(
        not isinstance(t, StagedTensor) and t.untyped_storage().data_ptr() == key for t in inputs
    )


def _admit(prov: Provenance, target: torch.Tensor, names: frozenset[str], how: str) -> None:
    if prov.ledger is not None:
        prov.ledger.admit(target, names, how, dense=prov.dense)


def _merge(
    target: torch.Tensor,
    values: torch.Tensor,
    update: torch.Tensor,
    source: StagedTensor | None,
    names: frozenset[str],
    prov: Provenance,
    *,
    binary: bool = False,
) -> None:
    """Write `values` into `target` where `update` does not say KEEP, in place.

    Cast, moved and broadcast as ``copy_`` does.
    """
    if target.is_conj() or target.is_neg():
        # ``torch.where(..., out=)`` would write the stored bits, not what the view stands for.
        _refuse(
            f"the loader copies staged data of {label(names)} into a lazily conjugated or "
            "negated view of a tensor (w.conj(), w.conj().imag); copy into the tensor itself"
        )
    try:
        if not update.is_meta:
            update = update.expand(target.shape)
        elif torch.broadcast_shapes(update.shape, target.shape) != target.shape:  # type: ignore[no-untyped-call]
            raise RuntimeError  # (a dry run: by shapes alone, no op a loader's own mode sees)
    except RuntimeError:
        _refuse(
            f"the loader copies staged data of {label(names)} ({tuple(update.shape)}) into a "
            f"tensor of shape {tuple(target.shape)}, which it does not broadcast to"
        )
    if update.is_meta and prov.ledger is not None:  # a dry run: logged, not written
        prov.ledger.log_masked(target, None, source, names)
        return
    if prov.dense:  # every position written: a plain copy_, which casts and moves itself
        if prov.ledger is not None:
            prov.ledger.log_masked(target, None, source, names, dense=True)
        target.copy_(values)
        return
    # KEEP/CHANGED bytes read as False/True already; CONST needs a comparison.
    update = update.view(torch.bool) if binary else update != KEEP
    if update.device != target.device:
        update = update.to(target.device)
    if values.device != target.device or values.dtype != target.dtype:
        values = values.to(device=target.device, dtype=target.dtype)
    if prov.ledger is not None:
        prov.ledger.log_masked(target, update, source, names)
    torch.where(update, values, target, out=target)


# ------------------------------------------------------------------------------------ staging


def stage(
    shape: Sequence[int],
    dtype: torch.dtype,
    indices: torch.Tensor,
    values: torch.Tensor,
    *,
    fill: float | int | bool = 0,
    name: str = "",
    ledger: Ledger | None = None,
) -> StagedTensor:
    """The staged tensor of a sparse patch: `values` at flat `indices`, "keep" elsewhere.

    Numbers are not checked here (range, duplicates): validate patches first. `fill` is what
    the values hold at unchanged positions; no write ever reads it.
    """
    numel = math.prod(int(d) for d in shape)
    device = values.device
    flat = torch.full((numel,), fill, dtype=dtype, device=device)
    update = torch.zeros((numel,), dtype=torch.uint8, device=device)  # KEEP
    if values.numel():
        positions = indices.to(device=device, dtype=torch.long)
        scatter_flat(flat, positions, values.to(dtype=dtype))
        update.index_fill_(0, positions, CHANGED)
    data = flat.view(tuple(int(d) for d in shape))
    root = Root(data)
    # Fewer indices than elements: some position is kept (no pass needed). As many or more
    # (a patch naming every element, or repeats): the mask says.
    partial = indices.numel() < numel or _any(update == KEEP)
    prov = Provenance(frozenset({name}), ledger, root, partial=partial)
    return StagedTensor(data, update.view(data.shape), prov)


def stage_dense(data: torch.Tensor, *, name: str, ledger: Ledger) -> StagedTensor:
    """A dense patch's tensor, wrapped so that every write of it is logged (any thread)."""
    changed = torch.full((), CHANGED, dtype=torch.uint8, device=data.device).expand(data.shape)
    prov = Provenance(frozenset({name}), ledger, None, True, True, partial=False)
    return StagedTensor(data, changed, prov)
