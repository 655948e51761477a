"""The load session: everything that happens while one chunk goes through ``load_weights``.

A session is active in one thread for the duration of one loader call, through two hooks:

- the ``copy_`` swap (`patchctx._swap`): every ``Tensor.copy_`` of the thread lands in
  `LoadSession.copy_`;
- a thread-local ``TorchDispatchMode`` (`_Guard`): every other ATen operation of the thread is
  seen with its schema, so writes are known exactly (``alias_info.is_write``), whatever Python
  path made them (``param.data[a:b] = w``, ``index_put_``, ``out=``, ``masked_scatter_``...).

It tracks which tensors carry staged data: views of a staged tensor (same storage) and tensors
*derived* from staged data (outputs of operations with staged inputs). With that it

- performs each write of sparse staged data into a model parameter or buffer with the
  strategy's masked semantics (``copy_`` and ``__setitem__``), or refuses it with
  `LoaderContractError` *before* anything is written;
- lets writes that carry no staged data through (the loader's own business, e.g. vLLM zeroing
  vocabulary padding rows) and logs them;
- records a route segment for every view copy, and decides after the call which names are
  provably replayable;
- saves the old values of every write into the undo log (``atomic=True``);
- detects a parameter or buffer whose storage was replaced (``param.data = w``), puts the old
  storage back and refuses the load.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from patchctx import _swap
from patchctx._arguments import known_names
from patchctx._errors import LoaderContractError
from patchctx._routes import Geometry, Route, Segment
from patchctx._strategies import Auto, CopyStrategy, IntSentinel, NaNMask
from patchctx._undo import UndoLog

__all__ = ["LoadSession", "PersistentIndex"]

aten = torch.ops.aten

# Operations whose output holds exactly the input's elements, rearranged or cast: a sentinel
# carried in the data (NaN, an integer sentinel) survives them.
_LAYOUT_COPIES = frozenset(
    {
        aten.clone,
        aten._to_copy,
        aten.cat,
        aten.stack,
        aten.index_select,
        aten.index,
        aten.gather,
        aten.repeat,
        aten.narrow_copy,
        aten.slice_copy,
        aten.select_copy,
        aten.t_copy,
        aten.transpose_copy,
        aten.permute_copy,
        aten.expand_copy,
        aten.view_copy,
        aten.unsqueeze_copy,
        aten.squeeze_copy,
    }
)


@cache
def _written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the operation writes, from its schema."""
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _tensors(value: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # meta, sparse layouts, functional wrappers
        return None
    return storage.data_ptr() if storage.nbytes() else None


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `tensor`'s storage: every view keeps it alive (``_base``)."""
    base = tensor._base
    return tensor if base is None else base


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype}"


# ----------------------------------------------------------------------------- persistent


@dataclass(frozen=True, slots=True)
class _Owner:
    name: str
    tensor: torch.Tensor


class PersistentIndex:
    """The model's parameters and buffers by storage: what outlives a loader call.

    `protect` names tensors (qualified names, with the reason) that no write may reach: a
    write into their storage, under any of its names, is refused before it happens.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], protect: Mapping[str, str] | None = None
    ) -> None:
        self.tensors = dict(tensors)
        self._by_storage: dict[int, _Owner] = {}
        for name, tensor in tensors.items():
            key = _storage_key(tensor)
            if key is not None and key not in self._by_storage:
                self._by_storage[key] = _Owner(name, tensor)
        self._protected: dict[int, str] = {}
        known_names(protect or {}, self.tensors, "protect=")  # a typo must not disarm it
        for name, reason in (protect or {}).items():
            protected = self.tensors.get(name)
            key = None if protected is None else _storage_key(protected)
            if key is not None:
                self._protected[key] = f"{name!r} ({reason})"

    def owner(self, tensor: torch.Tensor) -> _Owner | None:
        key = _storage_key(tensor)
        return None if key is None else self._by_storage.get(key)

    def protection(self, tensor: torch.Tensor) -> str | None:
        """Why `tensor`'s storage must not be written, or `None`."""
        if not self._protected:
            return None
        key = _storage_key(tensor)
        return None if key is None else self._protected.get(key)

    def refuse_protected(self, tensor: torch.Tensor, what: str) -> None:
        """Raise before `what` writes into a protected tensor."""
        reason = self.protection(tensor)
        if reason is not None:
            raise LoaderContractError(
                f"{what} would write into the protected tensor {reason}; nothing was written to it"
            )


class _Snapshot:
    """Which storage every parameter and buffer had before the call, to detect a rebinding."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._entries: list[
            tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor, int | None]
        ] = []
        for module in model.modules():
            for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None:
                    self._entries.append((module, attr, tensor, tensor.data, _storage_key(tensor)))
        self._names = {
            (id(module), attr): f"{prefix}.{attr}" if prefix else attr
            for prefix, module in model.named_modules(remove_duplicate=False)
            for attr in [*module._parameters, *module._buffers]
        }

    def restore(self) -> list[str]:
        """Put back every replaced tensor or storage; return the names that had been changed."""
        changed = []
        for module, attr, tensor, data, key in self._entries:
            current = module._parameters.get(attr, module._buffers.get(attr))
            if current is not tensor:
                if attr in module._parameters:
                    module._parameters[attr] = tensor  # type: ignore[assignment]
                else:
                    module._buffers[attr] = tensor
                changed.append(self._names.get((id(module), attr), attr))
            if _storage_key(tensor) != key:
                tensor.data = data
                changed.append(self._names.get((id(module), attr), attr))
        return sorted(set(changed))


# --------------------------------------------------------------------------- staged data


@dataclass
class _Staged:
    name: str
    ref: weakref.ref[torch.Tensor]  # weak: a staged tensor alive after the call was kept
    dtype: torch.dtype
    numel: int
    sparse: bool
    # The loader wrote into the staged tensor itself: its sentinels can no longer be trusted.
    tampered: bool = False


@dataclass(frozen=True, slots=True)
class _Derived:
    ref: weakref.ref[torch.Tensor]
    names: frozenset[str]
    sparse: bool
    faithful: bool  # every sentinel survived the derivation (layout copies and casts only)


@dataclass(frozen=True, slots=True)
class _Origin:
    """The staged data a tensor carries."""

    names: frozenset[str]
    sparse: bool
    staged: _Staged | None  # set when the tensor is a view of one staged tensor
    faithful: bool


@dataclass(frozen=True, slots=True)
class _Write:
    """A write into a persistent storage: where, and on behalf of which sparse name (if any)."""

    storage: int
    low: int
    high: int
    name: str | None


def _sentinel_survives(strategy: CopyStrategy, source: torch.dtype, result: torch.dtype) -> bool:
    """Whether a cast from `source` to `result` keeps the strategy's "keep" marks readable."""
    if isinstance(strategy, Auto):
        strategy = strategy.resolve(source)
    if isinstance(strategy, NaNMask):
        return source.is_floating_point and result.is_floating_point
    if isinstance(strategy, IntSentinel):
        return source == result
    return False  # BoolMask and strategies of your own follow views only


@dataclass
class LoadSession:
    """One loader call with staged tensors: masks, guards, records routes, logs undo."""

    strategy: CopyStrategy
    persistent: PersistentIndex
    undo: UndoLog | None = None
    staged: dict[int, _Staged] = field(default_factory=dict)
    derived: dict[int, _Derived] = field(default_factory=dict)
    segments: dict[str, list[Segment]] = field(default_factory=dict)
    unprovable: dict[str, str] = field(default_factory=dict)
    writes: list[_Write] = field(default_factory=list)
    # Storages created during the call (outputs of the loader's operations): its temporaries.
    fresh: set[int] = field(default_factory=set)
    _internal: int = 0

    def add(self, name: str, tensor: torch.Tensor, *, sparse: bool) -> torch.Tensor:
        """Register a staged tensor handed to the loader under `name`; return it."""
        key = _storage_key(tensor)
        if key is None:
            return tensor
        entry = _Staged(name, weakref.ref(_root(tensor)), tensor.dtype, tensor.numel(), sparse)
        if sparse:
            self.segments.setdefault(name, [])
            if not (tensor.is_contiguous() and tensor.storage_offset() == 0):
                self.unprovable[name] = "the strategy staged a non-contiguous tensor"
            self.staged[key] = entry
        else:
            self.staged.setdefault(key, entry)
        return tensor

    # -- classification ----------------------------------------------------------------

    def origin(self, tensor: torch.Tensor) -> _Origin | None:
        key = _storage_key(tensor)
        if key is None:
            return None
        staged = self.staged.get(key)
        if staged is not None:
            return _Origin(frozenset({staged.name}), staged.sparse, staged, not staged.tampered)
        derived = self.derived.get(key)
        if derived is None:
            return None
        if derived.ref() is None:  # freed; its memory may have been reused
            del self.derived[key]
            return None
        return _Origin(derived.names, derived.sparse, None, derived.faithful)

    def _origin_of(self, values: list[torch.Tensor]) -> _Origin | None:
        found = [o for o in map(self.origin, values) if o is not None]
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        return _Origin(
            frozenset().union(*(o.names for o in found)),
            any(o.sparse for o in found),
            None,
            all(o.faithful for o in found),
        )

    def _mark_derived(self, tensor: torch.Tensor, origin: _Origin, *, faithful: bool) -> None:
        key = _storage_key(tensor)
        if key is None or key in self.staged:
            return
        self.derived[key] = _Derived(
            weakref.ref(_root(tensor)), origin.names, origin.sparse, faithful
        )

    @contextmanager
    def internal(self) -> Iterator[None]:
        """Our own operations: not seen by the guard."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    # -- writes --------------------------------------------------------------------------

    def _log_write(
        self, view: torch.Tensor, owner: _Owner, name: str | None, what: str | None = None
    ) -> None:
        self.persistent.refuse_protected(
            view, what or f"the loader (for {name or 'its own purposes'!s})"
        )
        key = _storage_key(view)
        assert key is not None
        low, high = Geometry.of(view).span()
        self.writes.append(_Write(key, low, high, name))
        if self.undo is not None:
            with self.internal():
                self.undo.save_view(view)

    def _log_masked_write(self, destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
        self.persistent.refuse_protected(destination, f"the patch to {name!r}")
        key = _storage_key(destination)
        assert key is not None
        low, high = Geometry.of(destination).span()
        self.writes.append(_Write(key, low, high, name))
        if self.undo is None:
            return
        with self.internal():
            update_mask = getattr(self.strategy, "update_mask", None)
            if update_mask is None:  # a strategy of your own: save the whole view
                self.undo.save_view(destination)
                return
            where = update_mask(source).to(destination.device).nonzero()
            strides = torch.tensor(destination.stride(), device=destination.device)
            positions = (where * strides).sum(1) + destination.storage_offset()
            self.undo.save_positions(destination, positions)

    def _note_fresh(
        self, func: torch._ops.OpOverload, inputs: list[torch.Tensor], result: Any
    ) -> None:
        """Remember the storages the loader's operations create: its temporaries."""
        outputs = _tensors(result)
        if not outputs:
            return
        if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy):
            inputs = []  # torch.tensor(...) data: created by the loader a moment ago
        existing = {_storage_key(t) for t in inputs}
        for output in outputs:
            key = _storage_key(output)
            if key is not None and key not in existing:
                self.fresh.add(key)

    def _refuse_lasting(self, target: torch.Tensor, origin: _Origin, how: str) -> None:
        """Staged data may reach only the model (masked) and the loader's own temporaries."""
        key = _storage_key(target)
        if key is None or key in self.fresh or key in self.staged:
            return
        raise LoaderContractError(
            f"the loader writes staged data of {', '.join(sorted(origin.names))!r} with {how} "
            f"into a tensor ({_describe(target)}) that is neither a parameter or buffer of the "
            "model nor created during the load (a plain tensor attribute, a global, a cache): "
            "it would keep the 'keep' marks after the call; nothing was written. Register it as "
            "a buffer, or let the loader write only into parameters and its own temporaries."
        )

    def _kept_after_the_call(self) -> list[str]:
        """Sparse staged data still alive once the loader returned: it was stashed somewhere."""
        kept = {e.name for e in self.staged.values() if e.sparse and e.ref() is not None}
        for derived in self.derived.values():
            if derived.sparse and derived.ref() is not None:
                kept |= derived.names
        return sorted(kept)

    def _note_tampering(self, target: torch.Tensor, how: str) -> None:
        """The loader writes into a sparse staged tensor: its "keep" marks are not trusted."""
        staged = self.staged.get(_storage_key(target) or -1)
        if staged is not None and staged.sparse:
            staged.tampered = True
            self._unprovable(frozenset({staged.name}), f"the loader modified it with {how}")

    def _unprovable(self, names: frozenset[str], reason: str) -> None:
        for name in names:
            self.unprovable.setdefault(name, reason)

    def copy_(
        self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool
    ) -> torch.Tensor:
        """Every ``copy_`` of the loader call (the swap's interceptor)."""
        self._note_tampering(destination, "copy_")
        origin = self.origin(source)
        owner = self.persistent.owner(destination)
        if origin is None or not origin.sparse:
            # No sentinel in the data: a plain copy, logged when it lands in the model.
            if owner is not None:
                dense = None if origin is None else ", ".join(sorted(origin.names))
                self._log_write(destination, owner, None, dense and f"the dense patch to {dense!r}")
            elif origin is not None:
                self._mark_derived(destination, origin, faithful=True)
            with self.internal():
                return _swap.plain_copy(destination, source, non_blocking)
        if owner is None:
            # Sparse staged data into a temporary: copy it as is, sentinels included, and keep
            # following it; the final write into the model decides.
            self._refuse_lasting(destination, origin, "copy_")
            self._unprovable(origin.names, "the loader copied staged data into a temporary")
            with self.internal():
                result = _swap.plain_copy(destination, source, non_blocking)
            faithful = origin.faithful and _sentinel_survives(
                self.strategy, source.dtype, destination.dtype
            )
            self._mark_derived(destination, origin, faithful=faithful)
            return result
        return self._masked_copy(destination, source, origin, owner, non_blocking)

    def _masked_copy(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        origin: _Origin,
        owner: _Owner,
        non_blocking: bool,
    ) -> torch.Tensor:
        names = ", ".join(sorted(origin.names))
        if not origin.faithful:
            raise LoaderContractError(
                f"the loader writes staged data of {names!r} into {owner.name!r} after an "
                "operation that may have dropped its 'keep' marks (an in-place change of the "
                "staged tensor, or a computation other than a view, layout copy or cast); "
                "nothing was written"
            )
        if destination.shape != source.shape:
            raise LoaderContractError(
                f"the loader copies staged data of {names!r} ({_describe(source)}) into "
                f"{owner.name!r} through a view of a different shape ({_describe(destination)}); "
                "a masked copy_ needs the same shape on both sides; nothing was written"
            )
        name = next(iter(origin.names)) if len(origin.names) == 1 else names
        self._record(destination, source, origin, owner, name)
        self._log_masked_write(destination, source, name)
        with self.internal():
            return self.strategy.merge(destination, source, non_blocking=non_blocking)

    def _record(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        origin: _Origin,
        owner: _Owner,
        name: str,
    ) -> None:
        staged = origin.staged
        if staged is None:
            self._unprovable(origin.names, "the loader copied a computed copy, not a view")
            return
        source_geometry = Geometry.of(source)
        target_geometry = Geometry.of(destination)
        low, high = source_geometry.span()
        if (
            source.dtype != staged.dtype
            or destination.dtype != owner.tensor.dtype
            or not source_geometry.injective()
            or not target_geometry.injective()
            or low < 0
            or high >= staged.numel
        ):
            self._unprovable(origin.names, "the copy is not a one-to-one view of the staged data")
            return
        key = _storage_key(destination)
        assert key is not None
        self.segments.setdefault(name, []).append(
            Segment(
                source_geometry,
                target_geometry,
                owner.name,
                key,
                destination.dtype,
                Geometry.of(owner.tensor),
            )
        )

    # -- the guard -----------------------------------------------------------------------

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Every ATen operation of the loader call other than our own (the guard)."""
        if func is aten.copy_.default:  # __setitem__ with basic indexing, C++ callers
            non_blocking = (
                bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            )
            return self.copy_(args[0], args[1], non_blocking)
        written = _written_arguments(func)
        if not written:
            result = func(*args, **kwargs)
            inputs = _tensors((args, kwargs))
            self._note_fresh(func, inputs, result)
            origin = self._origin_of(inputs)
            if origin is not None:
                faithful = origin.faithful and func.overloadpacket in _LAYOUT_COPIES
                for output in _tensors(result):
                    if self.origin(output) is None:
                        survives = faithful and all(
                            _sentinel_survives(self.strategy, t.dtype, output.dtype)
                            for t in inputs
                            if self.origin(t) is not None
                        )
                        self._mark_derived(output, origin, faithful=survives)
            return result
        targets = []
        for position, arg_name in written:
            value = args[position] if position < len(args) else kwargs.get(arg_name)
            targets.extend(_tensors(value))
        sources = [t for t in _tensors((args, kwargs)) if all(t is not w for w in targets)]
        origin = self._origin_of(sources)
        for target in targets:
            owner = self.persistent.owner(target)
            self._note_tampering(target, str(func))
            if owner is None:
                if origin is not None and origin.sparse:
                    self._refuse_lasting(target, origin, str(func))
                continue
            if func.overloadpacket in (aten.set_, aten.resize_):
                raise LoaderContractError(
                    f"the loader calls {func} on {owner.name!r}, replacing or resizing its "
                    "storage; patch loads are in place; nothing was written"
                )
            if origin is not None and origin.sparse:
                if func is aten.index_put_.default and target is args[0]:
                    return self._masked_index_put(args, kwargs, origin, owner)
                raise LoaderContractError(
                    f"the loader writes staged data of {', '.join(sorted(origin.names))!r} into "
                    f"{owner.name!r} with {func}, which cannot be masked in place (only copy_ "
                    "and indexed assignment can); nothing was written"
                )
            self._log_write(target, owner, None)
        result = func(*args, **kwargs)
        for target in targets:
            if self.persistent.owner(target) is not None:
                continue
            # A temporary written from staged data, or staged-derived data changed in place:
            # it carries staged data whose marks can no longer be trusted.
            carried = origin or self.origin(target)
            if carried is not None and carried.staged is None:
                self._mark_derived(target, carried, faithful=False)
        return result

    def _masked_index_put(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], origin: _Origin, owner: _Owner
    ) -> Any:
        target, indices, values = args[0], args[1], args[2]
        accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        names = ", ".join(sorted(origin.names))
        if accumulate or not origin.faithful:
            raise LoaderContractError(
                f"the loader accumulates or computes staged data of {names!r} into "
                f"{owner.name!r} with an indexed write; nothing was written"
            )
        self._unprovable(origin.names, "the loader wrote it with advanced indexing")
        # Gather the destination elements, merge into them, scatter them back: positions the
        # source marks "keep" are written with their own old value.
        current = aten.index.Tensor(target, indices)
        source = values.expand_as(current) if values.shape != current.shape else values
        self._log_write(target, owner, names)
        self.strategy.merge(current, source)
        return aten.index_put_.default(target, indices, current, False)

    # -- running -------------------------------------------------------------------------

    def run(self, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Call ``model.load_weights(weights)`` with the copy_ swap and the guard active."""
        snapshot = _Snapshot(model)
        guard = _Guard(self)
        loader: Any = model
        try:
            _swap.enter(self, self)
            try:
                with guard:
                    loaded = loader.load_weights(weights)
                    names = set() if loaded is None else set(loaded)
            finally:
                _swap.leave(self)
        except Exception as error:
            changed = snapshot.restore()
            if changed:
                raise _rebound(changed) from error
            raise
        except BaseException:
            snapshot.restore()
            raise
        changed = snapshot.restore()
        if changed:
            raise _rebound(changed)
        weights.clear()  # ours now: the staged tensors may die here unless the loader kept them
        kept = self._kept_after_the_call()
        if kept:
            gc.collect()  # a reference cycle may be all that keeps a temporary alive
            kept = self._kept_after_the_call()
        if kept:
            raise LoaderContractError(
                f"the loader kept staged data of {', '.join(map(repr, kept))} in a tensor that "
                "outlives the load (a cache, an attribute, a global): it holds 'keep' marks, not "
                "weights; discard it. The parameters themselves were written correctly."
            )
        return names

    def routes(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Route]:
        """The provable routes of this call's sparse names (after a successful `run`)."""
        for name, segments in self.segments.items():
            if name in self.unprovable:
                continue
            for write in self.writes:
                if write.name == name:
                    continue
                if any(
                    write.storage == segment.storage_ptr
                    and write.low <= segment.target.span()[1]
                    and segment.target.span()[0] <= write.high
                    for segment in segments
                ):
                    self.unprovable[name] = "another write touched the positions it writes"
                    break
        return {
            name: Route(name, *shapes[name], tuple(segments))
            for name, segments in self.segments.items()
            if name not in self.unprovable and name in shapes
        }


def _rebound(names: list[str]) -> LoaderContractError:
    return LoaderContractError(
        f"the loader replaced the storage of {', '.join(map(repr, names))} (e.g. param.data = w); "
        "patch loads must write in place so captured pointers (CUDA graphs) stay valid. The old "
        "storage was put back."
    )


class _Guard(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The thread-local dispatch mode of a `LoadSession`."""

    def __init__(self, session: LoadSession) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.session = session

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.session._internal:
            return func(*args, **kwargs)
        return self.session.dispatch(func, args, kwargs)
