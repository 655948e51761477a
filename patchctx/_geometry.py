"""Route geometry: the value types a route is made of, below the loader call that records them.

A `Geometry` is a strided view of a storage; a `Holder` names the model tensor behind one; a
`Segment` maps a run of checkpoint flat indices onto a holder's storage positions; a `Fill` is
a constant the loader writes while loading a name; a `Read` is a model tensor it reads; a
`Route` is all of it for one checkpoint name. The recorder builds them, the ledger and the
session check them, `patchctx._routes` stores and replays them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from patchctx import _cpu_passes
from patchctx._undo import UndoLog

__all__ = ["Fill", "Geometry", "Holder", "Read", "Route", "Segment", "host_covered"]


@dataclass(frozen=True, slots=True)
class Geometry:
    """A strided view of a storage: sizes, strides and offset, in elements."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Geometry:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def dims(self) -> list[int]:
        """Dimensions of size > 1, by decreasing stride (the order a flat offset decomposes in)."""
        return sorted((d for d, s in enumerate(self.size) if s > 1), key=lambda d: -self.stride[d])

    def span(self) -> tuple[int, int]:
        """The lowest and highest storage offset the view touches (inclusive)."""
        low = high = self.offset
        for size, stride in zip(self.size, self.stride, strict=True):
            if size > 1:
                reach = (size - 1) * stride
                low, high = low + min(0, reach), high + max(0, reach)
        return low, high

    def injective(self) -> bool:
        """Whether distinct elements sit at distinct offsets, decomposable greedily by stride.

        True for every view made of narrow, select, slicing with steps, transpose, permute,
        unsqueeze and reshape of contiguous runs: strides are positive and each exceeds the
        largest offset reachable through the smaller ones.
        """
        reach = 0
        for d in reversed(self.dims()):
            if self.stride[d] <= reach:
                return False
            reach += (self.size[d] - 1) * self.stride[d]
        return True

    def contiguous_run(self) -> bool:
        """Whether the view is one contiguous run of offsets, in row-major order."""
        expected = 1
        for d in reversed(range(len(self.size))):
            if self.size[d] > 1 and self.stride[d] != expected:
                return False
            expected *= self.size[d]
        return True


def _still(
    tensor: torch.Tensor, data_ptr: int, dtype: torch.dtype, layout: Geometry, needs: int
) -> bool:
    """Whether `tensor` is the one recorded, live checks of segments and fills alike.

    Its first element at `data_ptr`, in `dtype` and `layout`, its storage at least `needs`
    bytes: the first element's address and the storage offset together fix the storage's.
    """
    return (
        tensor.data_ptr() == data_ptr
        and tensor.dtype == dtype
        and tensor.storage_offset() == layout.offset
        and tensor.stride() == layout.stride
        and tensor.shape == layout.size
        and needs <= tensor.untyped_storage().nbytes()
    )


@dataclass(frozen=True, slots=True)
class Holder:
    """Another model tensor over bytes a route writes: a tied name, a view of a flat storage.

    A segment or fill names the first model tensor found on its storage, but the loader may
    reach those bytes through another name of them. The route holds only while each such
    tensor is still the one recorded: one untied or rebound would no longer receive the
    writes made through the storage it left.
    """

    tensor_name: str
    data_ptr: int
    dtype: torch.dtype
    layout: Geometry

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Holder:
        return cls(name, tensor.data_ptr(), tensor.dtype, Geometry.of(tensor))

    def live(self, tensor: torch.Tensor | None) -> bool:
        return tensor is not None and _still(tensor, self.data_ptr, self.dtype, self.layout, 0)


@dataclass(frozen=True, slots=True)
class Segment:
    """One recorded copy: a view of the staged checkpoint tensor into a view of a parameter.

    Attributes:
        source: The view of the staged (contiguous, checkpoint-shaped) tensor that was copied.
        target: The view of the destination storage it was copied into (same sizes).
        tensor_name: Fully qualified name of the parameter or buffer owning that storage.
        storage_ptr: The storage's data pointer when recorded (checked before replay).
        dtype: The destination dtype (values are cast as ``copy_`` would).
        layout: The parameter's own sizes, strides and offset when recorded: the loader's
            views derive from them, so a parameter rebound to another layout of the same
            storage invalidates the segment.
        holders: The other model tensors over the bytes written, checked like the owner.
    """

    source: Geometry
    target: Geometry
    tensor_name: str
    storage_ptr: int
    dtype: torch.dtype
    layout: Geometry
    holders: tuple[Holder, ...] = ()
    _plan: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    direct: bool = field(init=False, repr=False, compare=False)
    span: tuple[int, int] = field(init=False, repr=False, compare=False)
    shift: int | None = field(init=False, repr=False, compare=False)
    high: int = field(init=False, repr=False, compare=False)  # highest target offset
    # Direct segments within their tensor's own elements, the tensor contiguous: checkpoint
    # index i is element ``i - _inside`` of the live tensor's ``view(-1)`` (None otherwise).
    # Replay writes through the tensor itself then, without a flat view of its storage.
    inside: int | None = field(init=False, repr=False, compare=False)
    # Checkpoint index i is element i of the live tensor's ``view(-1)``: the staged tensor's
    # run from 0 onto the whole of a contiguous destination tensor (most weights).
    whole: bool = field(init=False, repr=False, compare=False)
    # Live-check constants: the data pointer of the tensor's first element, and the storage
    # bytes the segment needs.
    _data_ptr: int = field(init=False, repr=False, compare=False)
    needs: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        source, target, layout = self.source, self.target, self.layout
        direct = source.contiguous_run() and target.contiguous_run()
        shift = source.offset - target.offset if direct else None  # position = index - shift
        low, high = target.span()
        size = self.dtype.itemsize
        _derive(
            self,
            _plan=tuple(
                (source.stride[d], source.size[d], target.stride[d]) for d in source.dims()
            ),
            direct=direct,
            span=source.span(),
            shift=shift,
            high=high,
            inside=shift + layout.offset
            if shift is not None
            and layout.contiguous_run()
            and layout.offset <= low
            and high < layout.offset + layout.numel
            else None,
            whole=direct
            and source.offset == 0
            and target.offset == layout.offset
            and target.numel == layout.numel == source.numel
            and layout.contiguous_run(),
            _data_ptr=self.storage_ptr + layout.offset * size,
            needs=(high + 1) * size,
        )

    def live(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is still the storage and layout this segment was recorded on."""
        return _still(tensor, self._data_ptr, self.dtype, self.layout, self.needs)

    def covered(self, indices: torch.Tensor) -> tuple[int, int]:
        """The slice of sorted `indices` that falls inside the source view's span."""
        if indices.device.type == "cpu" and _cpu_passes.HOST:  # nothing to batch: search now
            return host_covered(indices, self.span)
        start, stop = self.search(indices).tolist()
        return int(start), int(stop)

    def search(self, indices: torch.Tensor) -> torch.Tensor:
        """`covered` as a 2-element tensor on the indices' device (no host synchronisation).

        Bounds beyond the index dtype's range are settled here: no int32 index can reach a
        span that starts above 2**31 - 1, and every one is below a span end above it.
        """
        low, high = self.span
        count = indices.shape[0]
        top = torch.iinfo(indices.dtype).max
        if low > top:
            return torch.full((2,), count, dtype=torch.long, device=indices.device)
        if high >= top:
            bounds = torch.tensor([low, count], dtype=torch.long, device=indices.device)
            start = torch.searchsorted(indices, bounds[:1].to(indices.dtype))
            return torch.cat([start, bounds[1:]])
        bounds = torch.tensor([low, high + 1], dtype=indices.dtype, device=indices.device)
        return torch.searchsorted(indices, bounds)

    def positions(
        self,
        indices: torch.Tensor,
        *,
        sorted_unique: bool,
        covered: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """Storage positions for the checkpoint `indices` this segment covers.

        Returns the positions (int64, on the indices' device) and a selector (a slice when the
        indices are sorted, else a boolean mask) picking the matching entries of the patch.
        """
        low, high = self.source.span()
        if sorted_unique:
            start, stop = covered if covered is not None else self.covered(indices)
            picked: slice | torch.Tensor = slice(start, stop)
            inside = indices[start:stop]
        else:
            # Bounds beyond the index dtype would wrap in the comparison (2**31 is int32's
            # -2**31): no index of the dtype is above its maximum.
            top = torch.iinfo(indices.dtype).max
            if low > top:
                picked = torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)
            elif high >= top:
                picked = indices >= low
            else:
                picked = (indices >= low) & (indices <= high)
            inside = indices[picked]
        # A fresh int64 tensor (never the caller's): 8 bytes per covered index. The shift is
        # subtracted in int64: torch computes an int32 tensor minus a Python int in int32,
        # which wraps once a position passes 2**31 (a slice of a huge fused weight).
        shift = self.source.offset - self.target.offset if self.direct else self.source.offset
        if inside.dtype == torch.long:
            shifted = torch.sub(inside, shift)
        else:
            shifted = inside.to(torch.long)
            shifted.sub_(shift)
        if self.direct:
            return shifted, picked
        # General strided view: decompose (index - offset) greedily by source stride.
        rest = shifted
        positions = torch.full_like(rest, self.target.offset)
        valid = torch.ones_like(rest, dtype=torch.bool)
        for stride, size, target_stride in self._plan:
            coordinate = torch.div(rest, stride, rounding_mode="floor")
            valid &= (coordinate >= 0) & (coordinate < size)
            rest -= coordinate * stride
            positions += coordinate * target_stride
        valid &= rest == 0
        if isinstance(picked, slice):
            where = torch.arange(picked.start, picked.stop, device=indices.device)[valid]
            return positions[valid], where
        where = picked.nonzero().squeeze(1)[valid]
        return positions[valid], where


def host_covered(indices: torch.Tensor, span: tuple[int, int]) -> tuple[int, int]:
    """`Segment.covered` for indices on CPU: numpy's binary search, no torch operations."""
    low, high = span
    count = indices.shape[0]
    top = torch.iinfo(indices.dtype).max
    if low > top:  # no index of this dtype reaches the span
        return count, count
    found = indices.numpy()
    # The bounds in the indices' own dtype: numpy casts the whole array to a wider one first
    # (O(n)) for a needle of another dtype, a Python int included.
    needle = found.dtype.type
    start = int(found.searchsorted(needle(low)))
    return start, count if high >= top else int(found.searchsorted(needle(high + 1)))


@dataclass(frozen=True, slots=True)
class Fill:
    """One constant fill the loader made of model bytes outside the name's own (a padding).

    Replay repeats it: the loader makes it every time it loads the name, and whatever wrote
    those bytes since (another name, the model itself) is overwritten by the loader path too.

    Attributes:
        target: The filled view of the destination storage, in elements of `view_dtype`.
        view_dtype: The dtype the loader viewed the storage in (a byte view, say).
        value: The constant (``zero_`` fills 0).
        tensor_name: Fully qualified name of the parameter or buffer owning that storage.
        storage_ptr: The storage's data pointer when recorded (checked before replay).
        dtype: The owning tensor's dtype.
        layout: The owning tensor's own sizes, strides and offset when recorded.
        holders: The other model tensors over the bytes filled, checked like the owner.
    """

    target: Geometry
    view_dtype: torch.dtype
    value: bool | int | float | complex = field(compare=False)
    tensor_name: str
    storage_ptr: int
    dtype: torch.dtype
    layout: Geometry
    holders: tuple[Holder, ...] = ()
    # The constant as compared: its type and repr, so -0.0 is not 0.0 and NaN equals NaN.
    _constant: tuple[str, str] = field(init=False, repr=False)
    _data_ptr: int = field(init=False, repr=False, compare=False)
    needs: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _derive(
            self,
            _constant=(type(self.value).__name__, repr(self.value)),
            _data_ptr=self.storage_ptr + self.layout.offset * self.dtype.itemsize,
            needs=(self.target.span()[1] + 1) * self.view_dtype.itemsize,
        )

    def live(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is still the storage and layout this fill was recorded on."""
        return _still(tensor, self._data_ptr, self.dtype, self.layout, self.needs)

    def apply(self, tensor: torch.Tensor, undo: UndoLog | None = None) -> None:
        """Make the fill again in `tensor`'s storage (`tensor`: the owner, checked live)."""
        there = self.target
        if self.view_dtype == tensor.dtype:
            view = torch.as_strided(tensor, there.size, there.stride, there.offset)
        else:  # a view in another dtype (bytes, say): the same storage, reinterpreted
            view = torch.empty(0, dtype=self.view_dtype, device=tensor.device).set_(
                tensor.untyped_storage(), there.offset, there.size, there.stride
            )
        if undo is not None:
            undo.save_view(view)
        view.fill_(self.value)


@dataclass(frozen=True, slots=True)
class Read:
    """A model tensor the loader read out of torch (``.item()``) while loading the name.

    The loader may have decided where to write on it (an expert map): the route holds only
    while the tensor is the same one, unchanged since (its version counter, which every
    in-place write bumps). Its storage is compared as an object: another one that an
    allocator put at the same address, as unwritten as the first, is another tensor.
    """

    tensor_name: str
    data_ptr: int
    version: int
    storage: weakref.ref[torch.UntypedStorage] = field(compare=False)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Read:
        storage = weakref.ref(tensor.untyped_storage())
        return cls(name, tensor.data_ptr(), tensor._version, storage)

    def live(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.untyped_storage() is self.storage()
            and tensor.data_ptr() == self.data_ptr
            and not tensor.is_inference()  # (no version counter to read)
            and tensor._version == self.version
        )


@dataclass(frozen=True, slots=True)
class Route:
    """How one checkpoint name reaches the model: its segments in the order they were copied.

    `reported` holds the names the loader returned for it when the route was recorded, so a
    replay reports what the loader path would. `fills` are the constant fills the loader made
    of other bytes while loading the name alone, in order: replay makes them again. A route
    that writes nothing (a name the loader skips) has no tensor to check live: it keeps the
    names of the model's tensors (`holding`), and holds while the model holds those.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[Segment, ...]
    reported: frozenset[str] = frozenset()
    fills: tuple[Fill, ...] = ()
    reads: tuple[Read, ...] = field(default=(), compare=False)
    holding: frozenset[str] | None = field(default=None, compare=False)
    numel: int = field(init=False, repr=False, compare=False)
    # One whole-tensor segment in the checkpoint dtype (see `Segment.whole`): replay writes
    # a patch's positions into the live tensor's ``view(-1)`` as they are.
    whole: bool = field(init=False, repr=False, compare=False)
    # The model tensors a replay writes (segments' and fills' owners and holders), and those
    # its loader read, by name.
    writes: frozenset[str] = field(init=False, repr=False, compare=False)
    read_names: frozenset[str] = field(init=False, repr=False, compare=False)
    # What a replay writes through, in order: the segments, then the fills.
    written: tuple[Segment | Fill, ...] = field(init=False, repr=False, compare=False)
    # The bytes the segments write within: from each one's storage start, `Segment.needs`.
    spans: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    # The storages a replay writes (segments' and fills'), by their data pointers.
    storages: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        written: tuple[Segment | Fill, ...] = (*self.segments, *self.fills)
        first = self.segments[0] if len(self.segments) == 1 else None
        _derive(
            self,
            numel=numel,
            spans=tuple((s.storage_ptr, s.storage_ptr + s.needs) for s in self.segments),
            written=written,
            storages=frozenset(w.storage_ptr for w in written),
            writes=frozenset(w.tensor_name for w in written)
            | {h.tensor_name for w in written for h in w.holders},
            read_names=frozenset(r.tensor_name for r in self.reads),
            whole=first is not None
            and not self.fills
            and first.whole
            and first.source.numel == numel
            and first.dtype == self.dtype,
        )


def _derive(value: object, **fields: object) -> None:
    """Set the derived fields (``init=False``) of a frozen dataclass `value`."""
    for name, field_value in fields.items():
        object.__setattr__(value, name, field_value)
