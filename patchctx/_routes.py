"""Routes: the exact map from checkpoint flat index to parameter storage position, learnt once.

While a sparse patch goes through the loader, every copy of its staged tensor into a parameter
is seen by the load session. When the copy's source is a *view* of the staged tensor, its
offset and strides and the destination's offset and strides give an affine map from checkpoint
flat index to storage position: a `Segment`. A name whose every write was such a copy, with
nothing else touching those positions, gets a `Route` (its segments, in order, and the
constant fills the loader made of other bytes while loading it, each a `Fill`). Later sparse
patches to that name skip the loader: `replay` finds which indices each segment covers (binary
search when the indices are sorted), maps them, and writes the values with ``index_copy_``, in
place, in O(nnz); then it makes the fills again, as the loader would.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import torch

from patchctx import _cpu_passes, _tuning
from patchctx._arguments import flag, positive_int
from patchctx._bits import indexable, write_at
from patchctx._blocks import block_size, scratch, undo_block
from patchctx._cpu_passes import shifted_positions
from patchctx._geometry import Route, Segment, host_covered
from patchctx._model import slot_dicts
from patchctx._swap import builtin_copy, release_all
from patchctx._undo import UndoLog, storage_flat

__all__ = [
    "LiveTensors",
    "Route",
    "RouteBook",
    "RouteStore",
    "book_of",
    "replay",
    "replay_bounds",
    "replay_dense",
    "replay_whole",
]


_T = TypeVar("_T")


class RouteBook:
    """What a `RouteStore` remembers, and the narrow interface the load layer drives it by.

    The load layer asks it to plan (`usable`: the route of a patch, its destinations checked
    live; `due_for_verification`) and to learn (`store`, `verified`, `learnt_nothing`);
    `RouteCache` (the load layer) documents the behaviour.
    """

    def __init__(self, verify_every: int | None, learn_dense: bool) -> None:
        self.learn_dense = learn_dense
        self.verify_every = verify_every
        self.routes: dict[str, Route] = {}
        self.model: weakref.ref[Any] | None = None
        self.lock = threading.RLock()  # taken only through `locked`
        self.uses: dict[str, int] = {}
        self.verify_all = False  # `RouteCache.verify`: every patch goes through the loader
        self.mismatches: list[str] = []
        # The model the slots were found in, and its slots (one object, swapped at once).
        self.slots: tuple[torch.nn.Module | None, dict[str, _Slot]] = (None, {})
        # Names a dry run found no route for, with the shape and dtype it was run with: their
        # dense patches go through the loader without another dry run (`unlearned`).
        self.no_route: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.stats = RouteStats()

    def route(self, name: str) -> Route | None:
        """The route remembered for `name`, unchecked."""
        return self.routes.get(name)

    def locked(self, body: Callable[[], _T]) -> _T:
        """Run `body` holding the lock; release it on every exit, even an asynchronous one.

        Never a ``with`` block: an exception raised between its body's last line and its exit
        would keep the lock, and every later call would wait for ever.
        """
        lock = self.lock
        try:
            lock.acquire()
            result = body()
            release_all(lock)
            return result
        finally:
            release_all(lock)  # a second release, for an exception that cut the first

    def forget(self, name: str | None = None) -> None:
        """Forget the route of `name`, or every route (`None`)."""

        def forget() -> None:
            if name is None:
                self.routes.clear()
                self.no_route.clear()
            else:
                self.routes.pop(name, None)
                self.no_route.pop(name, None)

        self.locked(forget)

    def bind(self, model: object) -> None:
        """Tie the cache to `model`; a different model clears it."""

        def bind() -> None:
            bound = self.model() if self.model is not None else None
            if bound is not model:
                self.forget()  # (the lock is reentrant)
                self.model = weakref.ref(model)
                self.slots = (None, {})

        self.locked(bind)

    def live(self, model: torch.nn.Module) -> LiveTensors:
        """`model`'s tensors by name, looked up where they are registered right now.

        The (module, attribute) of every name is found once per model, with the chain of
        submodules that leads to it from the model (found again when a name is missing, e.g.
        after a submodule was added, or when a link of its chain changed, e.g. a submodule
        replaced under its own name), not on every call: a lookup is a few dict reads, and a
        parameter or submodule replaced by another object is seen at once. (A module that is
        no longer the model's keeps its tensors, and a route's live check would pass on them:
        its writes would miss the model.) The names are those of `model`, the model of the
        call, even when another thread binds the cache to another model meanwhile: a route it
        records there is then checked against this model's tensors, and fails.
        """
        return LiveTensors(self, model)

    def slot_of(self, name: str, model: torch.nn.Module) -> torch.Tensor | None:
        """The tensor `model` registers under `name` now, or `None` (see `live`)."""
        found_in, slots = self.slots
        slot = slots.get(name) if found_in is model else None
        if slot is not None:
            for parent, attr, child in slot[2]:  # (a loop: a generator costs more than it)
                if slot_dicts(parent)[2].get(attr) is not child:
                    slot = None
                    break
        if slot is None:
            slots = _slots_of(model)
            self.slots = (model, slots)
            slot = slots.get(name)
            if slot is None:
                return None
        params, buffers, _ = slot_dicts(slot[0])
        tensor = params.get(slot[1])
        return tensor if tensor is not None else buffers.get(slot[1])

    def store(self, route: Route) -> None:
        """Remember `route` (recorded by a loader call or learnt by a dry run)."""
        self.locked(lambda: self.routes.__setitem__(route.name, route))
        self.stats.recorded += 1

    def unlearned(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a dry run of the loader found no route for `name` at this shape and dtype."""
        return self.no_route.get(name) == (shape, dtype)

    def learnt_nothing(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Remember that a dry run found no route for `name` (see `unlearned`)."""
        self.locked(lambda: self.no_route.__setitem__(name, (shape, dtype)))

    def due_for_verification(self, name: str) -> bool:
        """Whether this patch to `name` goes through the loader to check its route."""
        if self.verify_all:
            return True
        if self.verify_every is None:
            return False
        uses = self.uses.get(name, 0) + 1
        self.uses[name] = uses
        return uses % self.verify_every == 0

    def verified(self, name: str, old: Route, new: Route | None) -> None:
        """Compare a route the loader just recorded with the cached one."""
        self.stats.verified += 1
        if new is None or new.segments != old.segments or new.fills != old.fills:
            self.stats.mismatched += 1
            self.mismatches.append(name)

    def usable(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tensors: Mapping[str, torch.Tensor],
    ) -> tuple[Route, list[torch.Tensor]] | None:
        """The route of `name` if it matches the patch's tensor and every destination is live.

        Returns it with each segment's destination tensor, then each fill's, as checked (what
        replay writes).
        """
        route = self.routes.get(name)
        if route is None:
            return None
        same = route.shape == shape and route.dtype == dtype
        targets = _live_targets(route, tensors) if same else None
        if targets is None:  # another tensor now, or a destination no longer live
            self.forget(name)
            self.stats.invalidated += 1
            return None
        return route, targets


class RouteStore:
    """What `RouteCache` remembers and looks up; `RouteCache` (the load layer) documents it."""

    def __init__(self, *, verify_every: int | None = None, learn_dense: bool = False) -> None:
        if verify_every is not None:
            positive_int(verify_every, "RouteCache(verify_every=...)")
        flag(learn_dense, "RouteCache(learn_dense=...)")
        self._book = RouteBook(verify_every, learn_dense)
        self.stats = self._book.stats

    @property
    def verify_every(self) -> int | None:
        """Every how many patches to a name its route is checked against the loader."""
        return self._book.verify_every

    def __len__(self) -> int:
        return len(self._book.routes)

    def __contains__(self, name: object) -> bool:
        return name in self._book.routes

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._book.routes))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} routes)"

    def clear(self) -> None:
        """Forget every route (the next patch to each name goes through the loader)."""
        self._book.forget()

    def invalidate(self, name: str) -> None:
        """Forget the route of `name` (no error if there is none)."""
        self._book.forget(name)

    def _route(self, name: str) -> Route | None:  # what tests and benchmarks compare
        return self._book.route(name)


def book_of(store: RouteStore) -> RouteBook:
    """The `RouteBook` of `store`: what the load layer plans replays with and teaches."""
    return store._book


def _live_targets(route: Route, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """Each destination tensor of `route` (segments', then fills'), if all it relies on is live."""
    targets = []
    for written in route.written:
        tensor = tensors.get(written.tensor_name)
        if (
            tensor is None
            or not written.live(tensor)
            or (
                written.holders
                and not all(h.live(tensors.get(h.tensor_name)) for h in written.holders)
            )
        ):
            return None
        targets.append(tensor)
    if route.holding is not None and route.holding != _names(tensors):
        return None  # a route that writes nothing, and the model changed
    for read in route.reads:  # what the loader decided on is unchanged
        tensor = tensors.get(read.tensor_name)
        if tensor is None or not read.live(tensor):
            return None
    return targets


# Where a model registers a tensor: (module, attribute, the links (parent, attribute, child)
# from the model down to that module).
_Chain: TypeAlias = tuple[tuple[torch.nn.Module, str, torch.nn.Module], ...]
_Slot: TypeAlias = tuple[torch.nn.Module, str, _Chain]


def _slots_of(model: torch.nn.Module) -> dict[str, _Slot]:
    """Every parameter and buffer name of `model` (shared modules under each of their names)."""
    slots: dict[str, _Slot] = {}
    pending: list[tuple[torch.nn.Module, str, _Chain]] = [(model, "", ())]
    while pending:
        module, prefix, chain = pending.pop()
        params, buffers, children = slot_dicts(module)
        for attr in [*params, *buffers]:
            slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr, chain)
        for attr, child in children.items():
            if child is not None:
                path = f"{prefix}.{attr}" if prefix else attr
                pending.append((child, path, (*chain, (module, attr, child))))
    return slots


def _names(tensors: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The names of the model's tensors (parameters and buffers) in `tensors`."""
    return tensors.names() if isinstance(tensors, LiveTensors) else frozenset(tensors)


class LiveTensors(Mapping[str, torch.Tensor]):
    """`RouteBook.live`: a read-only name -> tensor view of one model."""

    def __init__(self, book: RouteBook, model: torch.nn.Module) -> None:
        self._book, self._model = book, model
        self._names: frozenset[str] | None = None

    def names(self) -> frozenset[str]:
        """The model's parameter and buffer names, found once (no loader call between)."""
        if self._names is None:
            self._names = frozenset(
                name
                for name, (module, attr, _) in _slots_of(self._model).items()
                if any(slot.get(attr) is not None for slot in slot_dicts(module)[:2])
            )
        return self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._book.slot_of(name, self._model)
        if tensor is None:
            raise KeyError(name)
        return tensor

    def get(self, name: str, default: Any = None) -> Any:
        tensor = self._book.slot_of(name, self._model)
        return default if tensor is None else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(list(_slots_of(self._model)))

    def __len__(self) -> int:
        return len(_slots_of(self._model))


@dataclass
class RouteStats:
    """Counters of a `RouteCache`, cumulative over the calls that used it.

    Attributes:
        recorded: Routes recorded (the first sparse patch of a name through the loader, or
            a dry run of the loader for a dense one).
        replayed: Patches applied by route replay, without the loader (sparse ones, and
            dense ones to a name whose route is known).
        loaded: Patches that went through the loader (dense, first-time or unprovable sparse).
        invalidated: Routes dropped because a destination was rebound or the tensor changed.
        loader_calls: Calls of the model's ``load_weights`` (one per chunk of loaded patches).
        verified: Routes checked against the loader (``verify_every``, `RouteCache.verify`).
        mismatched: Checked routes the loader no longer follows (replaced or dropped).

    Examples:
        >>> from patchctx import RouteCache
        >>> RouteCache().stats
        RouteStats(recorded=0, replayed=0, loaded=0, invalidated=0, loader_calls=0, \
verified=0, mismatched=0)
    """

    recorded: int = 0
    replayed: int = 0
    loaded: int = 0
    invalidated: int = 0
    loader_calls: int = 0
    verified: int = 0
    mismatched: int = 0


def replay(
    route: Route,
    indices: torch.Tensor,
    values: torch.Tensor,
    targets: Sequence[torch.Tensor],
    *,
    sorted_unique: bool,
    undo: UndoLog | None = None,
    positions: torch.Tensor | None = None,
    bounds: list[tuple[int, int] | None] | None = None,
    listed: list[int] | None = None,
) -> None:
    """Write a sparse patch along `route`: O(nnz), in place, casting as the loader path does.

    The loader path casts values to the checkpoint dtype when staging, and ``copy_`` casts them
    to the destination dtype: replay applies the same two casts, to the covered values only.
    `positions` are the indices as int64 on the values' device when validation made them
    (small patches); long ones are converted block by block (`_tuning.BLOCK` positions, into one
    reused buffer per thread), so memory stays O(block) and the work is a few operations
    per million positions. `bounds`: per segment, the covered slice of the sorted indices if
    the caller found it already (`replay_bounds`, one host read for many replays).
    `targets`: each segment's destination tensor, checked live (`RouteBook.usable`).
    `listed`: the indices as a Python list when validation made one (a few, on CPU: see
    `CheckedPatch._listed`); a CPU destination's positions are made from it.
    """
    # What the loader path reads before it writes anything (the staged copy): a patch whose
    # values or indices lie in storage the route writes is read from a copy of its own.
    # Validation's positions are the indices themselves or a tensor of its own, which replay
    # then reads instead of the indices.
    spans = route.spans
    if positions is None or positions is indices:
        apart = _apart(indices, spans)
        if apart is not indices:
            positions = None if positions is None else apart
            indices = apart
    if route.whole and undo is None:
        # The common case, in one write (`replay_whole`): a whole contiguous tensor, the
        # positions as they are (converted to int64 here when short: the blocked loop below
        # bounds the memory of long ones; it reads these too when the write does not apply).
        target = targets[0]
        if positions is None and listed is not None and target.is_cpu:
            positions = _cpu_passes.listed_positions(listed, 0, len(listed), 0)
        elif (
            positions is None
            and indices.device == target.device
            and indices.shape[0] <= _tuning.HOST_FROM
        ):
            positions = indices if indices.dtype == torch.long else indices.long()
        if positions is not None and replay_whole(route, target, positions, values):
            return
    values = _apart(values, spans)
    source = positions if positions is not None else indices
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    last = route.numel - 1
    for number, segment in enumerate(route.segments):
        covered = bounds[number] if bounds is not None else None
        if covered is None and segment.span == (0, last):
            covered = (0, source.shape[0])  # the whole tensor: every index, no search
        target = targets[number]
        device = target.device
        if device == source.device and device == values.device:
            device_indices, device_values = source, values
        else:
            if device not in on_device:
                on_device[device] = (source.to(device), values.to(device))
            device_indices, device_values = on_device[device]
        if sorted_unique and segment.direct:
            _write_run(
                route.dtype, segment, target, device_indices, device_values, covered, undo, listed
            )
        else:
            found, picked = segment.positions(
                device_indices, sorted_unique=sorted_unique, covered=covered
            )
            if found.numel():
                chosen = indexable(device_values)[picked].view(device_values.dtype)
                update = chosen.to(dtype=route.dtype).to(dtype=segment.dtype)
                if undo is not None:
                    undo.save_positions(target, found)
                write_at(storage_flat(target), found, update)
    _refill(route, targets, undo)


def _write_run(
    dtype: torch.dtype,
    segment: Segment,
    target: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    covered: tuple[int, int] | None,
    undo: UndoLog | None,
    listed: list[int] | None,
) -> None:
    """`replay`'s common case: sorted `indices`, a contiguous run onto a contiguous run.

    Binary search the covered slice, then shift it block by block (no copy at all when the
    shift is 0 and the indices are already int64). `dtype`: the checkpoint's.
    """
    count = indices.shape[0]
    start, stop = covered if covered is not None else segment.covered(indices)
    inside, direct = segment.inside, segment.shift
    assert direct is not None  # a direct segment
    if undo is None and inside is not None:
        # Within the contiguous tensor: its own elements, no view to make (the undo log
        # keeps storage positions, so an atomic call takes the storage's flat view).
        flat, shift = target, inside
    else:
        # The storage up to the segment's last position (`live` checked it is there).
        flat, shift = torch.as_strided(target, (segment.high + 1,), (1,), 0), direct
    device = target.device
    on_cpu = device.type == "cpu" and _cpu_passes.HOST
    size = block_size()
    if undo is not None and on_cpu and stop - start > size >> 6:  # (see `undo_block`)
        span = int(indices[stop - 1]) - int(indices[start]) + 1
        size = undo_block(stop - start, span)
    for begin in range(start, stop, size):
        end = min(stop, begin + size)
        whole = begin == 0 and end == count  # no slicing (each slice is an operation)
        if listed is not None and on_cpu:
            at = _cpu_passes.listed_positions(listed, begin, end, shift)
        elif shift == 0 and indices.dtype == torch.long:
            at = indices if whole else indices[begin:end]
        elif on_cpu:
            # numpy, into this thread's buffer: no intra-op threads to wait on, and no
            # torch slice or buffer to make (about a microsecond each).
            at = shifted_positions(indices, begin, end, shift)
        else:
            block = indices if whole else indices[begin:end]
            at = scratch(device, torch.long, min(size, stop - start))[: end - begin]
            if shift and block.dtype == torch.long:
                torch.sub(block, shift, out=at)
            else:
                builtin_copy(at, block)  # int32 to int64: cheaper than a subtraction
                if shift:  # in int64: int32 arithmetic wraps past 2**31 (see `positions`)
                    at.sub_(shift)
        update = values if whole else values[begin:end]
        if update.dtype != dtype:
            update = update.to(dtype=dtype)
        if update.dtype != segment.dtype:
            update = update.to(dtype=segment.dtype)
        if undo is not None:
            undo.save_positions(target, at)
        write_at(flat, at, update)


def replay_whole(
    route: Route, target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor
) -> bool:
    """`replay`'s common case, in one write; False, having written nothing, where it does not apply.

    A whole-tensor route (`Route.whole`), int64 `positions` on the destination's device that
    do not lie in the storage the route writes (validation's own, or indices `_apart` from
    it), no undo to keep, and values in the checkpoint dtype on the destination's device:
    what a batch of short patches to ordinary weights is. `target` is the route's destination
    as checked live. The values are read apart from the written storage here (`_apart`).
    """
    if values.dtype is not route.dtype or not (
        (values.is_cpu and target.is_cpu) or values.device == target.device
    ):
        return False
    write_at(target, positions, _apart(values, route.spans))
    return True


def _apart(tensor: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """1-D `tensor`, or a copy when its bytes meet one of a route's written `spans`.

    Replay writes block by block and segment by segment, reading the patch as it goes: values
    (or indices) that are a view of a written storage would be read after a write changed them.
    The loader path stages them first; a copy does the same. A segment writes within the first
    `Segment.needs` bytes of the storage at `Segment.storage_ptr` (checked live): `Route.spans`.
    """
    low = tensor.data_ptr()
    for start, end in spans:
        if low < end:  # (the end of `tensor` only when it may matter)
            if start <= low:  # it starts inside the span: they meet unless it is empty
                if tensor.shape[0]:
                    return tensor.clone()
                continue
            count = tensor.shape[0]
            if count and start < low + ((count - 1) * tensor.stride(0) + 1) * tensor.itemsize:
                return tensor.clone()
    return tensor


def _refill(route: Route, targets: Sequence[torch.Tensor], undo: UndoLog | None) -> None:
    """Make the route's constant fills again, in order (`targets`: segments', then fills')."""
    if route.fills:
        for fill, target in zip(route.fills, targets[len(route.segments) :], strict=True):
            fill.apply(target, undo)


def replay_dense(
    route: Route,
    values: torch.Tensor,
    targets: Sequence[torch.Tensor],
    *,
    undo: UndoLog | None = None,
) -> None:
    """Write a dense patch along `route`: each segment's view of it into its destination view.

    What the loader would do with the full tensor (a route records only view copies, made
    without reading values, and constant fills), without calling it: one strided ``copy_``
    per segment, casting as the loader path does (to the checkpoint dtype when staging, then
    by ``copy_``), then the fills.
    """
    # The segments' source geometry is that of the staged tensor: contiguous, from its start.
    # (as_strided takes an offset into the storage, so `values` may not start it: a view into
    # a received payload, say.) Values over bytes the route writes are read from a copy, as the
    # loader path reads its staged tensor (`_apart`).
    full = _apart(values, route.spans).to(dtype=route.dtype).contiguous()
    for segment, target in zip(route.segments, targets[: len(route.segments)], strict=True):
        source = full if full.device == target.device else full.to(target.device)
        there = segment.target
        view = torch.as_strided(target, there.size, there.stride, there.offset)
        here = segment.source
        start = source.storage_offset() + here.offset
        if undo is not None:
            undo.save_view(view)
        builtin_copy(view, torch.as_strided(source, here.size, here.stride, start))
    _refill(route, targets, undo)


def replay_bounds(
    replays: Sequence[tuple[Route, torch.Tensor | list[int], bool]], *, host: bool = True
) -> list[list[tuple[int, int] | None] | None]:
    """The covered slices of every partly covered segment of many replays, read at once.

    For each ``(route, indices, sorted_unique)``, per segment: the slice of the sorted indices
    it covers, or `None` where it covers the whole tensor (or the indices are unsorted). One
    host read per device for all of them; `replay` would otherwise read each on its own, a
    device synchronisation each. Indices on CPU are searched at once by numpy (`host`; False
    sends them the accelerators' way, for tests), a Python list of them (validation's
    `CheckedPatch._listed`) by `bisect`.
    """
    searches: dict[torch.device, list[torch.Tensor]] = {}
    # Per segment: None (whole tensor), the slice found on the host, or where to read it.
    wanted: list[list[tuple[torch.device, int] | tuple[int, int] | None] | None] = []
    for route, indices, sorted_unique in replays:
        if not sorted_unique:
            wanted.append(None)
            continue
        last = route.numel - 1
        slots: list[tuple[torch.device, int] | tuple[int, int] | None] = []
        for segment in route.segments:
            if segment.span == (0, last):
                slots.append(None)
            elif isinstance(indices, list):
                low, high = segment.span
                slots.append((bisect_left(indices, low), bisect_right(indices, high)))
            elif host and indices.device.type == "cpu" and _cpu_passes.HOST:  # search now
                slots.append(host_covered(indices, segment.span))
            else:
                found = searches.setdefault(indices.device, [])
                slots.append((indices.device, len(found)))
                found.append(segment.search(indices))
        wanted.append(slots)
    read = {device: torch.stack(found).tolist() for device, found in searches.items()}
    return [None if slots is None else [_slice(slot, read) for slot in slots] for slots in wanted]


def _slice(
    slot: tuple[torch.device, int] | tuple[int, int] | None, read: dict[torch.device, Any]
) -> tuple[int, int] | None:
    if slot is None:
        return None
    first, second = slot
    if isinstance(first, torch.device):  # read from the device with the others
        start, stop = read[first][second]
        return int(start), int(stop)
    return first, second
