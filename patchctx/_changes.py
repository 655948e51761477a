"""Changes: which elements of a tensor differ, bit for bit, from the same tensor as it was.

The kernel behind `diff_state_dicts`. Both tensors are read in blocks of row-major elements,
each block cast to the receiver's dtype into a reused buffer (or read in place when it already
has that dtype and layout). The two blocks' bits are XORed as integers of the element width
(nonzero exactly where an element changed, so ``-0.0`` differs from ``+0.0`` and NaN compares
by its payload) and the XOR cast to a boolean change mask. Nothing larger than a block is
allocated besides the result.

Two passes, one host read between them:

1. `ChangeScan.count` counts the changed elements of every block and asks whether any changed
   value is one the receiver's strategy reserves (NaN under `NaNMask`, the sentinel under
   `IntSentinel`). Counts and flags stay on the tensors' device until the one read at the end.
2. `ChangeScan.gather` (only for a sparse patch) compares each block with changes again and
   writes its changed positions and values straight into the preallocated result, sizes known.

Comparing twice costs a second read of both tensors. Its alternative, one pass into a result
buffer sized for the worst case, allocates a third of a tensor of int32 positions up front and
still needs the counts to compact it; on an accelerator a re-read is the cheaper of the two.
On CPU the positions come from groups of 8 mask entries (`positions_by_groups`) rather than
torch's ``nonzero``, whose cost per element scanned exceeds a streaming read of both tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from patchctx._strategies import Auto, BoolMask, CopyStrategy, IntSentinel, NaNMask

__all__ = [
    "DEFAULT_BLOCK",
    "ChangeCount",
    "ChangeScan",
    "ReservedTest",
    "bits_of",
    "block_size",
    "count_groups",
    "count_set",
    "positions_by_groups",
    "reserved_test",
]

# Elements per block. Each block costs ~20 dispatches (100-150 us on CPU), so on CPU a block of
# 1M elements (5 MB of buffers for a bf16 receiver) keeps that under 0.15 ns per element. On
# an accelerator the same dispatches cost as much host time while a block streams at TB/s:
# 16M elements (80 MB of buffers) keeps the launches from dominating as far as one can.
DEFAULT_BLOCK = {"cpu": 1 << 20}
_DEVICE_BLOCK = 1 << 24

# Integer views of the same width; the comparison and every data move happen on these bits.
_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def block_size(device: torch.device) -> int:
    """The default number of elements per block on `device`."""
    return DEFAULT_BLOCK.get(device.type, _DEVICE_BLOCK)


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D `tensor` as integers of its element width: 1-D, or ``(n, 2)`` for 16 bytes."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    size = tensor.element_size()
    view = _BIT_VIEWS.get(size)
    if view is not None:
        return tensor.view(view)
    return torch.view_as_real(tensor).view(torch.int64)  # complex128: two float64 halves


def _bit_dtype(dtype: torch.dtype) -> torch.dtype:
    return _BIT_VIEWS.get(dtype.itemsize, torch.int64)


def _pieces(
    old: torch.Tensor, new: torch.Tensor, block: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Matching views of `old` and `new` (same shape) that cover their row-major order.

    Yields (flat offset of the piece's first element, the piece of `old`, that of `new`), each
    piece at most `block` elements. Contiguous tensors are cut into flat slices; otherwise
    both are cut into the same slabs along their leading dimensions.
    """
    numel = new.numel()
    if old.is_contiguous() and new.is_contiguous():
        old_flat, new_flat = old.view(-1), new.view(-1)
        for offset in range(0, numel, block):
            yield offset, old_flat[offset : offset + block], new_flat[offset : offset + block]
    else:
        yield from _slabs(old, new, block, 0)


def _slabs(
    old: torch.Tensor, new: torch.Tensor, block: int, start: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    rows = new.shape[0]
    row = new.numel() // rows
    if row <= block:
        step = block // row
        for first in range(0, rows, step):
            yield start + first * row, old[first : first + step], new[first : first + step]
    else:
        for index in range(rows):
            yield from _slabs(old[index], new[index], block, start + index * row)


# -------------------------------------------------------------------------- reserved values


class ReservedTest(Protocol):
    """Whether a block's changed values hold one the receiver's strategy reserves."""

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor,
        count: torch.Tensor,
        scratch: torch.Tensor,
    ) -> torch.Tensor:
        """A 0-d bool tensor on the block's device, computed without a host read.

        Args:
            values: The block of `new` in the receiver's dtype, as bits (`bits_of`); read only.
            changed: Its change mask (1-D bool, one entry per element).
            count: The number of changed elements (0-d).
            scratch: A buffer shaped like `values` that the test may overwrite.
        """
        ...


@dataclass(frozen=True, slots=True)
class _NaNBits:
    """NaN in an IEEE format with infinities: the magnitude bits exceed those of +inf."""

    magnitude: int  # every bit but the sign
    infinity: int  # the bits of +inf

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor,
        count: torch.Tensor,
        scratch: torch.Tensor,
    ) -> torch.Tensor:
        torch.bitwise_and(values, self.magnitude, out=scratch)
        scratch.mul_(changed)  # unchanged elements count as +0.0, which is no NaN
        return scratch.amax() > self.infinity


@dataclass(frozen=True, slots=True)
class _EqualBits:
    """A single reserved bit pattern (an integer sentinel)."""

    pattern: int

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor,
        count: torch.Tensor,
        scratch: torch.Tensor,
    ) -> torch.Tensor:
        hits = torch.eq(
            values, self.pattern, out=scratch.view(torch.uint8)[: values.numel()].view(torch.bool)
        )
        hits.logical_and_(changed)
        return hits.any()


@dataclass(frozen=True, slots=True)
class _AskStrategy:
    """Any other strategy: ask it about a block whose every element is a changed value.

    The unchanged elements take the value of the first changed one, which cannot change the
    answer; a block with no change answers False.
    """

    strategy: CopyStrategy
    dtype: torch.dtype

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor,
        count: torch.Tensor,
        scratch: torch.Tensor,
    ) -> torch.Tensor:
        first = changed.view(torch.uint8).argmax().view(1)
        mask = changed.view(-1, 1) if values.ndim == 2 else changed
        torch.where(mask, values, values.index_select(0, first), out=scratch)
        flag = self.strategy.reserved_values(scratch.reshape(-1).view(self.dtype), self.dtype)
        return torch.logical_and(flag.to(count.device), count > 0)


def _as_bits(value: int, width: int) -> int:
    """An integer of `width` bytes as its bits read by the integer view of that width.

    One byte is read unsigned (``uint8``), wider ones signed (``int16``, ``int32``, ``int64``).
    """
    bits = value % (1 << (8 * width))
    if width > 1 and bits >= 1 << (8 * width - 1):
        bits -= 1 << (8 * width)
    return bits


def _nan_bits(dtype: torch.dtype) -> _NaNBits | None:
    """The bit test for NaN in `dtype`, for the IEEE formats of 2, 4 and 8 bytes."""
    width = dtype.itemsize
    if not dtype.is_floating_point or width not in (2, 4, 8):
        return None
    # +inf, by its IEEE layout: sign 0, exponent all ones, mantissa 0. Checked against torch.
    exponent_bits = {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8, torch.float64: 11}
    exponent = exponent_bits.get(dtype)
    if exponent is None:
        return None
    mantissa = 8 * width - 1 - exponent
    return _NaNBits(
        magnitude=(1 << (8 * width - 1)) - 1, infinity=((1 << exponent) - 1) << mantissa
    )


def reserved_test(strategy: CopyStrategy, dtype: torch.dtype) -> ReservedTest | None:
    """How to find reserved values among changed ones; `None` when `strategy` reserves none.

    patchctx's own strategies get a test on the bits (a few integer passes over a block);
    any other strategy is asked through its `reserved_values`.
    """
    kind = type(strategy)
    if kind is BoolMask:
        return None
    if kind is Auto:
        assert isinstance(strategy, Auto)
        resolved: CopyStrategy = strategy.resolve(dtype)
        kind = type(resolved)
    else:
        resolved = strategy
    if kind is NaNMask:
        found = _nan_bits(dtype)
        if found is not None:
            return found
    if kind is IntSentinel and not dtype.is_floating_point and not dtype.is_complex:
        assert isinstance(resolved, IntSentinel)
        if dtype != torch.bool:
            return _EqualBits(_as_bits(resolved.sentinel(dtype), dtype.itemsize))
    return _AskStrategy(strategy, dtype)


# -------------------------------------------------------------------- positions by groups
#
# torch's nonzero on CPU costs about 1.4 ns per element scanned, even when almost nothing is
# set: more than a streaming read of both tensors. The mask is instead read 8 bytes at a time:
# one int64 multiply gathers a group's 8 flags into one byte (its pattern), and two tables of
# 256 entries give each pattern's number of set flags and the index of its r-th one. The work
# is then a few passes over the groups (an eighth of the elements) and a few over the changes.

# Byte j of a little-endian int64 whose bytes are 0 or 1 lands on bit 56 + j of the product:
# the shifted copies of the eight bytes never overlap, so no carry reaches the top byte.
_GATHER_FLAGS = sum(1 << (56 - 7 * j) for j in range(8))


def _build_pattern_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(set flags per pattern [256], index of the r-th set flag of a pattern [256 * 8]).

    Computed on `device` by tensor operations: no host-to-device copy, so no synchronisation.
    """
    flags = (
        torch.arange(256, device=device)
        .view(-1, 1)
        .bitwise_right_shift(torch.arange(8, device=device))
        .bitwise_and_(1)
    )  # [pattern, bit]
    rank = flags.cumsum(1).sub_(1)  # of each set flag among its pattern's
    column = torch.where(flags.bool(), rank, 8)  # unset flags go to a spare ninth column
    indices = torch.zeros(256, 9, dtype=torch.int64, device=device)
    indices.scatter_(1, column, torch.arange(8, device=device).expand(256, 8))
    return flags.sum(1), indices[:, :8].reshape(-1)


# Built at import, so that no diff allocates them (or holds on to them) while it runs.
_CPU_PATTERN_TABLES = _build_pattern_tables(torch.device("cpu"))


@functools.cache
def _pattern_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The pattern tables on `device` (built there once)."""
    if device.type == "cpu":
        return _CPU_PATTERN_TABLES
    return _build_pattern_tables(device)


def _patterns(words: torch.Tensor) -> torch.Tensor:
    """The pattern (0-255, bit j = flag j) of each group of 8 mask entries, read as int64."""
    return words.mul(_GATHER_FLAGS).bitwise_right_shift_(56).bitwise_and_(0xFF)


def positions_by_groups(mask: torch.Tensor, count: int, groups: int) -> torch.Tensor:
    """The positions of the set entries of `mask`, ascending, as int64; no host read.

    Args:
        mask: 1-D bool, its length a multiple of 8, on any device.
        count: How many entries are set.
        groups: How many groups of 8 entries hold at least one (`count_groups`).
    """
    popcount, bit_index = _pattern_tables(mask.device)
    words = mask.view(torch.int64)
    where: torch.Tensor | None = None
    if groups * 4 <= words.numel():  # sparse groups: find them, then read only those
        found = torch.nonzero_static(words, size=groups).view(-1)
        patterns = _patterns(words.index_select(0, found))
        where = found
    else:
        patterns = _patterns(words)
    per_group = popcount.index_select(0, patterns)
    # Change j of group g is its (j - first[g])-th set flag: entry j - shift[g] of bit_index,
    # with shift[g] = first[g] - 8 * pattern[g]. Per group first, so that each change costs
    # only an expansion, two gathers and two adds.
    first = per_group.cumsum(0).sub_(per_group)
    if where is None:
        # Every group, empty ones too: change j belongs to the last group starting at or
        # before j, the number of group starts up to j, less one (a running count of marks
        # at the starts; torch's repeat_interleave is several times slower with empty groups).
        marks = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
        ones = torch.ones(1, dtype=torch.int64, device=mask.device).expand(first.numel())
        marks.index_add_(0, first, ones)
        group = marks[:count].cumsum_(0).sub_(1)
    else:
        group = torch.repeat_interleave(per_group, output_size=count)  # a group per change
    shift = first.sub_(patterns.mul_(8))
    entry = torch.arange(count, device=mask.device).sub_(shift.index_select(0, group))
    bit = bit_index.index_select(0, entry)
    start = group.mul_(8) if where is None else where.mul_(8).index_select(0, group)
    return start.add_(bit)


# Byte j of an int64 times this lands, summed with bytes 0..j-1, on byte 7: the top byte of the
# product is the sum of the eight bytes, as long as no partial sum reaches 256.
_SUM_BYTES = sum(1 << (8 * j) for j in range(8))


def count_set(mask: torch.Tensor) -> torch.Tensor:
    """How many entries of a 1-D bool `mask` are set (0-d int64), 8 bytes per operation.

    ``torch.count_nonzero`` reads a byte at a time; here 16 words of 8 flags are first added
    as integers (each byte then holds at most 16, so bytes never carry into each other), and
    one multiply sums each row's eight bytes into its top byte.
    """
    length = mask.numel()
    if length % 128 == 0:
        rows = mask.view(torch.int64).view(-1, 16).sum(dim=1)
    elif length % 8 == 0:
        rows = mask.view(torch.int64).clone()
    else:
        return torch.count_nonzero(mask)
    return rows.mul_(_SUM_BYTES).bitwise_right_shift_(56).bitwise_and_(0xFF).sum()


def count_groups(mask: torch.Tensor) -> torch.Tensor:
    """How many groups of 8 entries of `mask` (its length a multiple of 8) hold a set one."""
    return torch.count_nonzero(mask.view(torch.int64))


# ------------------------------------------------------------------------------------ scan


@dataclass(frozen=True, slots=True)
class ChangeCount:
    """What the counting pass found (read from the device in one go)."""

    changed: int  # elements whose bits differ
    reserved: bool  # whether a changed value is one the strategy reserves
    per_block: tuple[int, ...]  # changed elements per block, in order
    groups_per_block: tuple[int, ...] | None  # groups of 8 with a change per block, if counted


class ChangeScan:
    """The elements of `new` whose bits differ from `old`'s, both seen in `dtype`.

    `old` and `new` have one shape (0-d counts as one element, and an empty one is not
    scanned); the work happens on `new`'s device, `old` is brought there a block at a time.
    Per block, the bits of both are XORed (nonzero where an element changed) and the result
    converted to a boolean change mask. The scan owns, reused by every block and by both
    passes, at most three buffers of one block in the receiver's dtype (the casts of `old`
    and `new` where a block cannot be read in place; the XOR goes into the cast of `old`, or
    into a buffer of its own when there is none) and one block of booleans (the mask): for a
    bf16 receiver, 5 bytes per block element at most.

    Args:
        old: What the receiver holds.
        new: What it should hold.
        dtype: The receiver's dtype; both sides are compared as their casts to it.
        block: Elements per block (default: `block_size` of the device).
        groups: Find the changed positions of a sparse block through groups of 8 mask
            entries (`positions_by_groups`; default: on CPU, where torch's `nonzero` costs
            more than the rest of the diff). Accelerators run ``nonzero_static``.
    """

    def __init__(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        dtype: torch.dtype,
        *,
        block: int | None = None,
        groups: bool | None = None,
    ) -> None:
        if new.shape != old.shape:
            raise ValueError(f"shapes differ: {tuple(old.shape)} and {tuple(new.shape)}")
        self.old = old.reshape(1) if old.dim() == 0 else old
        self.new = new.reshape(1) if new.dim() == 0 else new
        self.dtype = dtype
        self.device = new.device
        self.numel = new.numel()
        chosen = block_size(self.device) if block is None else block
        if chosen < 1:
            raise ValueError(f"block must be at least 1 element, got {chosen}")
        self.block = min(chosen, max(self.numel, 1))
        self.groups = self.device.type == "cpu" if groups is None else groups
        self._buffers: dict[str, torch.Tensor] = {}

    # -- blocks

    def _buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = torch.empty(self.block, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer

    def _bits(self, piece: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
        """`piece` in the receiver's dtype, as flat bits; whether that is a buffer of ours."""
        if piece.dtype == self.dtype and piece.device == self.device and piece.is_contiguous():
            return bits_of(piece.reshape(-1)), False
        buffer = self._buffer(name, self.dtype)[: piece.numel()]
        buffer.view(piece.shape).copy_(piece)
        return bits_of(buffer), True

    def _xor(
        self, old_piece: torch.Tensor, new_piece: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bits of the new piece, old XOR new: per element, nonzero exactly where it changed)."""
        old_bits, owned = self._bits(old_piece, "old")
        new_bits, _ = self._bits(new_piece, "new")
        xor = old_bits if owned else bits_of(self._buffer("xor", self.dtype)[: new_piece.numel()])
        torch.bitwise_xor(old_bits, new_bits, out=xor)
        return new_bits, xor

    def _mask(self, xor: torch.Tensor) -> torch.Tensor:
        mask = self._buffer("mask", torch.bool)[: xor.shape[0]]
        if xor.ndim == 2:  # complex128: changed when either half changed
            torch.any(xor, dim=1, out=mask)
        else:
            mask.copy_(xor)  # the cast to bool is `!= 0`, and much cheaper than torch.ne
        return mask

    # -- passes

    def count(self, reserved: ReservedTest | None = None) -> ChangeCount:
        """Count the changed elements, and test them for reserved values; one host read.

        Args:
            reserved: The test for reserved values (`reserved_test`); `None` skips it.
        """
        counts, groups, flags = [], [], []
        for _, old_piece, new_piece in _pieces(self.old, self.new, self.block):
            new_bits, xor = self._xor(old_piece, new_piece)
            mask = self._mask(xor)
            count = count_set(mask)
            counts.append(count)
            if self.groups:
                groups.append(count_groups(mask) if mask.numel() % 8 == 0 else count)
            if reserved is not None:
                flags.append(reserved(new_bits, mask, count, xor))  # the XOR is spent
        found = [torch.stack(counts)]
        if groups:
            found.append(torch.stack(groups))
        if flags:
            found.append(torch.stack(flags).any().view(1).to(torch.int64))
        read = [int(value) for value in torch.cat(found).tolist()]  # the one host read
        blocks = len(counts)
        per_block = tuple(read[:blocks])
        per_group = tuple(read[blocks : 2 * blocks]) if groups else None
        return ChangeCount(sum(per_block), bool(flags) and bool(read[-1]), per_block, per_group)

    def gather(
        self, counted: ChangeCount, index_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sorted flat positions of the changed elements and their new values.

        No host read: the sizes come from `counted` (this scan's `count`). The values are
        fresh tensors in the receiver's dtype, never views of `new`.
        """
        total = counted.changed
        positions = torch.empty(total, dtype=index_dtype, device=self.device)
        trailing = (2,) if self.dtype.itemsize == 16 else ()
        values = torch.empty((total, *trailing), dtype=_bit_dtype(self.dtype), device=self.device)
        groups = counted.groups_per_block or (0,) * len(counted.per_block)
        offset = 0
        pieces = _pieces(self.old, self.new, self.block)
        for (start, old_piece, new_piece), count, changed_groups in zip(
            pieces, counted.per_block, groups, strict=True
        ):
            if count == 0:
                continue
            new_bits, xor = self._xor(old_piece, new_piece)
            mask = self._mask(xor)
            if self.groups and mask.numel() % 8 == 0:
                local = positions_by_groups(mask, count, changed_groups)
            else:
                local = torch.nonzero_static(mask, size=count).view(-1)
            end = offset + count
            torch.add(local, start, out=positions[offset:end])
            torch.index_select(new_bits, 0, local, out=values[offset:end])
            offset = end
        return positions, values.reshape(-1).view(self.dtype)
