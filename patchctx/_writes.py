"""The write policy of one loader call: which writes reach the model, logged, undoable, checked.

Two kinds of write reach a model tensor during a loader call:

- **masked writes** of staged data, performed by `patchctx._staged` in whatever thread the
  loader uses. The `WriteLedger` first *admits* the destination (a parameter or buffer that
  existed before the call, not protected, not already written by the loader's own plain writes
  at those bytes), then logs the old values of the positions about to change (O(changed)) and
  offers the write to the route recorder;
- **plain writes** (no staged data), seen by the guard in the loader's thread
  (`patchctx._guard`): logged with their old values, refused before they happen when they would
  reach a protected tensor, reshape or reallocate a model tensor, or change positions a masked
  write already produced (the kept positions would stop being the model's values).

All spans are byte ranges of a storage, so views of one storage in different dtypes compare.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch.utils.weak import WeakIdKeyDictionary

from patchctx import _ops
from patchctx._arguments import known_names
from patchctx._bits import own_dispatch
from patchctx._errors import CastKindError, LoaderContractError
from patchctx._geometry import Fill, Geometry, Holder
from patchctx._kinds import kind_of, same_kind
from patchctx._recording import Recorder
from patchctx._staged import StagedTensor, label
from patchctx._undo import UndoLog

__all__ = ["Constant", "ModelIndex", "Span", "WriteLedger", "span_of", "storage_key"]

# The value of a constant fill (``fill_`` with a Python scalar; ``zero_`` fills 0).
Constant: TypeAlias = bool | int | float | complex


# The attribute that carries, on a tensor the loader computed from a dense patch's plain data,
# which patches it comes from (`WriteLedger.plain_sources`).
_SOURCES = "_patchctx_dense_sources"


def storage_key(tensor: torch.Tensor) -> int | None:
    """The data pointer of `tensor`'s storage, or `None` (meta, empty, no storage)."""
    if isinstance(tensor, StagedTensor):
        return None
    try:
        storage = tensor.untyped_storage()
        # (a wrapper subclass, DTensor-like: a storage object whose data pointer is refused)
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # meta, sparse layouts, functional wrappers
        return None


@dataclass(frozen=True, slots=True)
class Span:
    """The bytes ``[low, high]`` of one storage that a view touches."""

    storage: int
    low: int
    high: int

    def overlaps(self, other: Span) -> bool:
        return self.storage == other.storage and self.low <= other.high and other.low <= self.high


def span_of(tensor: torch.Tensor, key: int) -> Span:
    low, high = Geometry.of(tensor).span()
    size = tensor.element_size()
    return Span(key, low * size, (high + 1) * size - 1)


@dataclass(frozen=True, slots=True)
class Owner:
    name: str
    tensor: torch.Tensor


class ModelIndex:
    """The model's parameters and buffers by storage, and the protected ones."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], protect: Mapping[str, str] | None = None
    ) -> None:
        self.tensors = dict(tensors)
        by_key: dict[int, list[Owner]] = {}
        # Tensors of a subclass with a dispatch of its own (DTensor, torchao's): no storage to
        # key by; a write into one lands in inner tensors patchctx cannot tell from temporaries.
        self.wrapped: list[str] = []
        for name, tensor in self.tensors.items():
            key = storage_key(tensor)
            if key is not None:
                by_key.setdefault(key, []).append(Owner(name, tensor))
            elif type(tensor) not in (torch.Tensor, torch.nn.Parameter) and own_dispatch(tensor):
                self.wrapped.append(name)
        self._by_storage: dict[int, Owner] = {key: owners[0] for key, owners in by_key.items()}
        # The model's storages by byte range (start, end, key), sorted: a tensor whose storage
        # is not a model tensor's but whose bytes lie in one is an alias made around torch
        # (numpy, ctypes, from_numpy, frombuffer, DLPack), which no storage key matches.
        self._ranges = sorted(
            (key, key + owners[0].tensor.untyped_storage().nbytes(), key)
            for key, owners in by_key.items()
        )
        self._starts = [start for start, _, _ in self._ranges]
        self._reach = list(itertools.accumulate((stop for _, stop, _ in self._ranges), max))
        # The names of each storage several names share (tied, or views of one flat storage).
        self._sharing = {
            key: [(owner, span_of(owner.tensor, key)) for owner in owners]
            for key, owners in by_key.items()
            if len(owners) > 1
        }
        self._protected: dict[int, str] = {}
        known_names(protect or {}, self.tensors, "protect=")  # a typo must not disarm it
        for name, reason in (protect or {}).items():
            protected = self.tensors.get(name)
            key = None if protected is None else storage_key(protected)
            if key is not None:
                self._protected[key] = f"{name!r} ({reason})"

    def holds(self, key: int) -> bool:
        """Whether the storage with data pointer `key` (`storage_key`) is a model tensor's."""
        return key in self._by_storage

    def owner(self, tensor: torch.Tensor) -> Owner | None:
        key = storage_key(tensor)
        return None if key is None else self._by_storage.get(key)

    def aliased(self, tensor: torch.Tensor) -> Owner | None:
        """The model tensor whose bytes `tensor`'s storage overlaps, if it is not its own.

        Ownership by byte range, not by the storage's start: an alias of a slice of a weight
        made around torch (``torch.from_numpy(w[2:].numpy())``, ``frombuffer``, ctypes, DLPack)
        has a storage of its own that starts inside the weight's.
        """
        key = storage_key(tensor)
        if key is None or key in self._by_storage or not self._ranges:
            return None
        end = key + tensor.untyped_storage().nbytes()
        at = bisect.bisect_left(self._starts, end) - 1  # the last range starting before `end`
        while at >= 0 and self._reach[at] > key:  # some range up to `at` ends after `key`
            _, stop, owner_key = self._ranges[at]
            if stop > key:  # [start, stop) overlaps [key, end)
                return self._by_storage[owner_key]
            at -= 1
        return None

    def refuse_aliased(self, tensor: torch.Tensor, what: str) -> None:
        """Refuse a write into a model tensor's bytes through an alias of another storage."""
        owner = self.aliased(tensor)
        if owner is not None:
            raise LoaderContractError(
                f"{what} writes into the bytes of {owner.name!r} through a tensor of another "
                "storage (an alias made around torch: numpy, ctypes, torch.from_numpy, "
                "torch.frombuffer, DLPack), which atomic=True cannot undo and protect= cannot "
                "see; write through the model's own tensor. Nothing was written"
            )

    def sharers(self, tensor: torch.Tensor) -> list[Owner]:
        """The model tensors over bytes of `tensor`, other than its `owner`.

        A loader reaches those bytes through one of their names, which the storage cannot tell
        (a tied name, a view of a flat storage): a route through them holds only while each
        is still the tensor it is now.
        """
        key = storage_key(tensor)
        if key is None or key not in self._sharing:
            return []
        span, first = span_of(tensor, key), self._by_storage[key].name
        return [
            owner
            for owner, there in self._sharing[key]
            if owner.name != first and there.overlaps(span)
        ]

    def holders(self, tensor: torch.Tensor) -> tuple[Holder, ...]:
        """`sharers` as a route checks them."""
        return tuple(Holder.of(owner.name, owner.tensor) for owner in self.sharers(tensor))

    def protection(self, tensor: torch.Tensor) -> str | None:
        """Why `tensor`'s storage must not be written, or `None`."""
        if not self._protected:
            return None
        key = storage_key(tensor)
        return None if key is None else self._protected.get(key)

    def refuse_protected(self, tensor: torch.Tensor, what: str) -> None:
        reason = self.protection(tensor)
        if reason is not None:
            raise LoaderContractError(
                f"{what} would write into the protected tensor {reason}; nothing was written to it"
            )


@dataclass(frozen=True, slots=True)
class _Plain:
    span: Span
    owner: str
    how: str
    constant: bool
    fill: Fill | None = None  # a constant fill of some bytes, as a route would make it again


@dataclass(frozen=True, slots=True)
class MaskedWrite:
    """A write of staged data into `span` of the tensor `owner`, for the patches `names`."""

    span: Span
    owner: str
    names: frozenset[str]


class Lineage:
    """Where the loader's plain tensors come from: model tensors, dense data, constants alone.

    A value read out of one computed from model tensors is theirs; constants may meet kept
    positions.
    """

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        # Dense data handed to the loader as plain tensors: their storages, and the tensors the
        # loader computed from them in its thread, with their names (on the computed tensors
        # themselves, under this call's own token: no weak references, whose callbacks an
        # interrupt could hit).
        self.sources: dict[int, set[str]] = {}
        self._token = object()
        # Tensors the loader computed from model tensors in its thread (a comparison, a cast,
        # ``nonzero``), with those model tensors: a value read out of one is theirs.
        self.derived: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Plain tensors the loader made during the call from nothing but constants (a
        # factory, a literal, or an operation on such tensors alone). By identity, held
        # weakly; by storage, what a write with other inputs invalidates.
        self._constants: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._constant_storages: dict[int, list[weakref.ref[torch.Tensor]]] = {}

    def dense_source(self, key: int, name: str) -> None:
        """A dense patch's plain data, in the storage with data pointer `key`."""
        self.sources.setdefault(key, set()).add(name)

    def source_names(self, tensors: list[torch.Tensor]) -> frozenset[str]:
        """The dense patches `tensors` view or were computed from (in the loader's thread)."""
        found: set[str] = set()
        for tensor in tensors:
            key = storage_key(tensor)
            if key is not None and key in self.sources:
                found |= self.sources[key]
            mark = getattr(tensor, _SOURCES, None)
            if mark is not None and mark[0] is self._token:
                found |= mark[1]
        return frozenset(found)

    def carry(self, result: object, names: frozenset[str]) -> None:
        """The plain tensors of `result` carry the dense patches `names` on."""
        for output in _ops.tensors_in(result):
            if self.index.owner(output) is None and not isinstance(output, StagedTensor):
                setattr(output, _SOURCES, (self._token, names))

    def derive(self, inputs: list[torch.Tensor], result: object) -> None:
        """The loader computed `result` from `inputs`: note the model tensors it comes from."""
        sources = self.origins(inputs)
        if sources:
            for output in _ops.tensors_in(result):
                if self.index.owner(output) is None:
                    self.derived[output] = sources

    def is_constant(self, tensor: torch.Tensor) -> bool:
        """Whether the loader made `tensor` from constants alone, in this call (`constancy`)."""
        return tensor in self._constants

    def constancy(
        self,
        lifts: bool,
        inputs: list[torch.Tensor],
        written: list[torch.Tensor],
        result: object,
    ) -> None:
        """Note what a plain operation of the loader's thread made of constants.

        Its outputs (and the tensors it wrote) are constants when it is a factory or a literal
        (`lifts`, or no tensor input at all) or reads constants only; otherwise every constant
        over the bytes it wrote stops being one (a view of it written, say).
        """
        constants = self._constants
        if lifts or all(tensor in constants for tensor in inputs):
            for tensor in [*_ops.tensors_in(result), *written]:
                key = storage_key(tensor)
                if key is not None and self.index.owner(tensor) is None:
                    constants[tensor] = True
                    self._constant_storages.setdefault(key, []).append(weakref.ref(tensor))
            return
        for tensor in written:
            key = storage_key(tensor)
            for ref in self._constant_storages.pop(key, []) if key is not None else []:
                held = ref()
                if held is not None and held in constants:
                    del constants[held]

    def origins(self, tensors: list[torch.Tensor]) -> tuple[Owner, ...]:
        """The model tensors `tensors` are views of or were computed from."""
        found: list[Owner] = []
        for tensor in tensors:
            owner = self.index.owner(tensor)
            if owner is not None:
                found += [owner, *self.index.sharers(tensor)]
            found += self.derived.get(tensor, ())  # type: ignore[no-untyped-call]
        return tuple(found)


class WriteLog:
    """The writes of one loader call into the model, masked and plain, and their checks.

    Each is logged before it happens (old values, `UndoLog`) and offered to the recorder.
    """

    performs = True  # False for a dry run's ledger: writes checked and logged, not done

    loading: frozenset[str] = frozenset()  # the checkpoint names of the call, for messages

    def __init__(
        self, index: ModelIndex, undo: UndoLog, recorder: Recorder, log_plain: bool, compact: bool
    ) -> None:
        self.index, self.undo, self.recorder = index, undo, recorder
        self.log_plain = log_plain  # save old values of plain writes (sparse calls, atomic)
        # Masked writes: save the old values at the changed positions only (O(changed), what
        # atomic=True promises to hold until the call returns), or the whole written view (one
        # memcpy, much faster than finding the positions, for a log dropped after the call).
        self.compact = compact
        self.thread = threading.get_ident()
        self.plain: list[_Plain] = []
        self.masked: list[MaskedWrite] = []
        self._lock = threading.RLock()

    def log_masked(
        self,
        destination: torch.Tensor,
        update: torch.Tensor | None,
        source: StagedTensor | None,
        names: frozenset[str],
        *,
        dense: bool = False,
    ) -> None:
        with self._lock:
            owner = self.index.owner(destination)
            if owner is None:
                return  # dense data into a temporary of the loader's
            key = storage_key(destination)
            assert key is not None
            span = span_of(destination, key)
            if dense:
                self.plain.append(
                    _Plain(span, owner.name, f"the dense patch to {label(names)}", False)
                )
                if self.log_plain:
                    self.undo.save_view(destination)
                return
            self.masked.append(MaskedWrite(span, owner.name, names))
            if not self.performs:
                pass  # (a dry run: nothing is written, nothing to undo)
            elif update is None or not self.compact:  # every position, or a short-lived log
                self.undo.save_view(destination)
            else:
                where = update.nonzero()
                strides = torch.tensor(destination.stride(), device=destination.device)
                positions = (where * strides).sum(1) + int(destination.storage_offset())
                self.undo.save_positions(destination, positions)
            if threading.get_ident() != self.thread:
                self.recorder.unprovable(names, "the loader wrote it from another thread")
            elif source is None:
                self.recorder.unprovable(names, "the loader wrote it with an indexed write")
            else:
                holders = self.index.holders(destination)
                self.recorder.segment(
                    source, destination, owner.name, key, owner.tensor, span, holders
                )

    def unprovable(self, names: frozenset[str], reason: str) -> None:
        with self._lock:
            self.recorder.unprovable(names, reason)

    def cannot_follow(self, func: object, error: Exception, names: frozenset[str]) -> None:
        """An operation on staged data raised: it goes up to the loader as it is."""

    def skip(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[Any]
    ) -> Any:
        """A dry run's own write into the model: checked and logged, not done (`performs`)."""
        raise NotImplementedError

    def plain_write(self, target: torch.Tensor, how: str, *, constant: Constant | None) -> None:
        """Before the loader's own write into `target` (a model tensor): check and log it.

        Args:
            target: The tensor written.
            how: The operation, for messages.
            constant: The value of a constant fill (``fill_``, ``zero_``), `None` for any
                other write.
        """
        owner = self.index.owner(target)
        if owner is None:
            return
        self.index.refuse_protected(
            target, f"the loader (loading {label(self.loading)}, with {how})"
        )
        key = storage_key(target)
        assert key is not None
        span = span_of(target, key)
        fill = None
        if constant is not None and target.numel():  # (an empty view: nothing to make again)
            fill = Fill(
                Geometry.of(target),
                target.dtype,
                constant,
                owner.name,
                key,
                owner.tensor.dtype,
                Geometry.of(owner.tensor),
                self.index.holders(target),
            )
        with self._lock:
            for earlier in self.masked:
                if earlier.span.overlaps(span):
                    if constant is None:
                        raise LoaderContractError(
                            f"the loader changes {owner.name!r} with {how} after writing staged "
                            f"data of {label(earlier.names)} into the same bytes: the positions "
                            "the patch does not change would be changed again. Send this tensor "
                            "as a dense patch; nothing was written"
                        )
                    self.recorder.unprovable(
                        earlier.names, f"the loader overwrites part of it with {how}"
                    )
            self.plain.append(_Plain(span, owner.name, how, constant is not None, fill))
            if self.log_plain:
                self.undo.save_view(target)

    def read(self, tensor: torch.Tensor, how: object) -> None:
        """The loader reads `tensor` (`how`): a weight written from staged data feeds another."""
        if not self.masked:
            return
        key = storage_key(tensor)
        if key is None:
            return
        span = span_of(tensor, key)
        with self._lock:
            for earlier in self.masked:
                if earlier.span.overlaps(span):
                    self.recorder.unprovable(
                        earlier.names,
                        "the loader reads the weight back after writing it (a tied or derived "
                        "copy that replay would not update)",
                    )

    def other_writes(self) -> list[_Plain]:
        """The loader's own writes that replay would skip (not constant fills)."""
        return [write for write in self.plain if not write.constant]

    def constants(self) -> list[tuple[Span, Fill]]:
        """The loader's constant fills of at least one element, in order, with their bytes."""
        return [(write.span, write.fill) for write in self.plain if write.fill is not None]


class WriteLedger(WriteLog):
    """Admits, logs and checks every write of one loader call (any thread; see module doc)."""

    def __init__(
        self,
        index: ModelIndex,
        undo: UndoLog,
        recorder: Recorder,
        *,
        log_plain: bool,
        compact: bool = True,
        loading: frozenset[str] = frozenset(),
        dtypes: Mapping[str, torch.dtype] | None = None,
        kind_casts: bool = True,
    ) -> None:
        super().__init__(index, undo, recorder, log_plain, compact)
        self.loading = loading
        # The call's accounting: each name's checkpoint dtype (a write into a weight of
        # another kind is refused unless `kind_casts`), and the names whose data reached a
        # model tensor (a name that reaches none was skipped by the loader).
        self.dtypes = dict(dtypes or {})
        self.kind_casts = kind_casts
        self.consumed: set[str] = set()
        self.lineage = Lineage(index)
        self.open = True
        # Every refusal raised during the load, in any thread: a loader that catches one and
        # carries on has acted on data it could not see, so the load fails all the same.
        self.refusals: list[LoaderContractError] = []
        self.born: weakref.WeakSet[StagedTensor] = weakref.WeakSet()
        # The storages of the caller's dense patch values, handed to the loader as they are
        # (no copy): the loader's in-place writes into them are undone when the call ends,
        # so the caller's patches stay what they sent (a retry, a second replica).
        self.inputs: set[int] = set()
        self.input_undo = UndoLog()

    # -- masked writes (patchctx._staged.Ledger) -------------------------------------------

    def admit(
        self, destination: torch.Tensor, names: frozenset[str], how: str, *, dense: bool
    ) -> bool:
        with self._lock:
            if not self.open:
                raise LoaderContractError(
                    f"staged data of {label(names)} is written with {how} after its load "
                    "finished (the loader kept it, or another thread wrote it late): it holds "
                    "'keep' marks, not weights; nothing was written"
                )
            if not destination.numel():
                return False  # nothing is written into an empty tensor (it owns no storage)
            owner = self.index.owner(destination)
            if owner is None:
                self.index.refuse_aliased(destination, f"the loader, with {how},")
            if owner is None and dense:
                return False  # dense data is exact anywhere: a temporary of the loader's
            if owner is None:
                raise LoaderContractError(
                    f"the loader writes staged data of {label(names)} with {how} into a plain "
                    f"tensor ({tuple(destination.shape)} {destination.dtype}) that is not a "
                    "parameter or buffer of the model: the positions the patch does not change "
                    "would hold no value there. Copy into the model's own tensors, or make the "
                    "temporary from the staged tensor (w.clone(), torch.empty_like(w)); "
                    "nothing was written"
                    + (
                        f". The model holds tensors of a subclass with a dispatch of its own "
                        f"({', '.join(map(repr, self.index.wrapped[:3]))}...): a write into "
                        "one lands in its inner tensors, so such a tensor takes dense patches "
                        "only"
                        if self.index.wrapped
                        else ""
                    )
                )
            self.index.refuse_protected(destination, f"the patch to {label(names)}")
            self._reached(destination, owner.name, names)
            if dense:
                return True
            span = span_of(destination, storage_key(destination) or 0)
            for earlier in self.plain:
                if earlier.span.overlaps(span):
                    raise LoaderContractError(
                        f"the loader wrote into {earlier.owner!r} with {earlier.how} before "
                        f"writing staged data of {label(names)} over the same bytes: the "
                        "positions the patch does not change would keep the loader's values "
                        "instead of the model's. Send this tensor as a dense patch; nothing "
                        "was written"
                    )
            return True

    def _reached(self, destination: torch.Tensor, owner: str, names: frozenset[str]) -> None:
        """Data of `names` is about to be written into the model tensor `destination`.

        Kinds compare against the model tensor's own dtype and the view's: a view of it as
        bytes or as integers of the same width (a bit-exact reinterpretation), or the real
        part of a complex one, is not a cast.
        """
        if not self.kind_casts:
            found = self.index.owner(destination)
            weight = destination.dtype if found is None else found.tensor.dtype
            for name in sorted(names):
                dtype = self.dtypes.get(name)
                if (
                    dtype is not None
                    and not same_kind(dtype, weight)
                    and not same_kind(dtype, destination.dtype)  # (.imag, .real of a complex)
                ):
                    raise CastKindError(
                        f"the patch to {name!r} ({str(dtype).removeprefix('torch.')}) would be "
                        f"cast into a {kind_of(weight)} weight ({owner!r}, "
                        f"{str(weight).removeprefix('torch.')}): a cast across kinds changes "
                        "what the values mean. Send it in the weight's kind, or pass "
                        "kind_casts=True; nothing was written"
                    )
        self.consumed |= names

    def values_read(self, names: frozenset[str], what: str) -> None:
        """The loader takes values of `names` out of torch: no route, and they are consumed."""
        with self._lock:
            self.recorder.unprovable(names, f"the loader read values with {what}")
            self.consumed |= names  # (it may write them itself)

    def is_constant(self, tensor: torch.Tensor) -> bool:
        """Whether the loader made `tensor` from constants alone, in this call (`Lineage`)."""
        return self.lineage.is_constant(tensor)

    # -- the loader's plain tensors (the guard, in the loader's thread) ---------------------

    def dense_source(self, key: int, name: str) -> None:
        """A dense patch's plain data, in the storage with data pointer `key`."""
        self.lineage.dense_source(key, name)

    def plain_sources(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], result: object
    ) -> None:
        """An operation of the loader's on plain tensors: follow the dense patches' data.

        Into model tensors (`targets`), their names are consumed (after the kind check);
        into anything else, the result carries them on.
        """
        names = self.lineage.source_names(inputs)
        if names and not targets:
            self.lineage.carry(result, names)
        for target in targets if names else []:
            owner = self.index.owner(target)
            if owner is not None:
                self._reached(target, owner.name, names)

    def host_read(self, tensor: torch.Tensor) -> None:
        """The loader reads `tensor` out of torch (``.item()``): the model tensors it is of."""
        if self.lineage.sources:  # a dense patch's values, taken by the loader (to write them)
            self.consumed |= self.lineage.source_names([tensor])
        sources = self.lineage.origins([tensor])
        if sources:
            with self._lock:
                for read in sources:
                    self.recorder.host_read(read.name, read.tensor)

    def input_write(self, target: torch.Tensor) -> None:
        """Before the loader writes `target` in place: save it if it is a caller's input."""
        if self.inputs and storage_key(target) in self.inputs:
            with self._lock:
                self.input_undo.save_view(target)

    def restore_inputs(self) -> None:
        """Put back every caller's input the loader wrote in place (idempotent)."""
        self.input_undo.restore()

    def close(self) -> None:
        with self._lock:
            self.open = False
