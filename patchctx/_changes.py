"""Changes: which elements of a tensor differ, bit for bit, from the same tensor as it was.

The kernel behind `diff_state_dicts`. Both tensors are read in blocks of row-major elements,
each block cast to the receiver's dtype into a reused buffer (or read in place when it already
has that dtype and layout), and compared as integers of the same width, so ``-0.0`` differs
from ``+0.0`` and NaN compares by its payload. Nothing larger than a block is ever allocated
besides the result.

Two passes, one host read between them:

1. `ChangeScan.count` counts the changed elements of every block and asks whether any changed
   value is one the receiver's strategy reserves (NaN under `NaNMask`, the sentinel under
   `IntSentinel`). Counts and flags stay on the tensors' device until the one read at the end.
2. `ChangeScan.gather` (only for a sparse patch) compares each block with changes again and
   writes its changed positions and values straight into the preallocated result, sizes known.

Comparing twice costs a second read of both tensors. Its alternative, one pass into a result
buffer sized for the worst case, allocates a third of a tensor of int32 positions up front and
still needs the counts to compact it; on an accelerator a re-read is the cheaper of the two.
"""

from __future__ import annotations

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
    "reserved_test",
]

# Elements per block. On CPU a quarter million keeps a block's casts and mask in the L2 cache
# while amortising the ~10 dispatches per block; accelerators want fewer, larger launches.
DEFAULT_BLOCK = {"cpu": 1 << 18}
_DEVICE_BLOCK = 1 << 22

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


# ------------------------------------------------------------------------------------ scan


@dataclass(frozen=True, slots=True)
class ChangeCount:
    """What the counting pass found (read from the device in one go)."""

    changed: int  # elements whose bits differ
    reserved: bool  # whether a changed value is one the strategy reserves
    per_block: tuple[int, ...]  # changed elements per block, in order
    words_per_block: tuple[int, ...] | None  # changed 8-byte words per block, when counted


class ChangeScan:
    """The elements of `new` whose bits differ from `old`'s, both seen in `dtype`.

    `old` and `new` have one shape (0-d counts as one element, and an empty one is not
    scanned); the work happens on `new`'s device, `old` is brought there a block at a time.
    Per block, the bits of both are XORed (nonzero where an element changed) and the result
    converted to a boolean change mask. The scan owns at most four buffers of one block each,
    reused by every block and by both passes: the casts of `old` and `new` (only when a block
    cannot be read in place), the XOR (in the cast of `old` when there is one) and the mask.

    Args:
        old: What the receiver holds.
        new: What it should hold.
        dtype: The receiver's dtype; both sides are compared as their casts to it.
        block: Elements per block (default: `block_size` of the device).
        words: Find the changed positions of a sparse block through the changed 8-byte words
            first (default: on CPU, where the mask's `nonzero` costs far more per element
            than a pass over words; accelerators run the plain path).
    """

    def __init__(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        dtype: torch.dtype,
        *,
        block: int | None = None,
        words: bool | None = None,
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
        # Elements per 8-byte word; the word path needs at least two of them per word.
        self._per_word = 8 // dtype.itemsize if dtype.itemsize <= 4 else 0
        use_words = self.device.type == "cpu" if words is None else words
        self.words = use_words and self._per_word > 1
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

    def _word_path(self, length: int, words: int) -> bool:
        """Whether to go through words for a block of `length` elements, `words` changed."""
        if not self.words or length % self._per_word:
            return False
        return words * 4 <= length // self._per_word  # at most a quarter of the words changed

    # -- passes

    def count(self, reserved: ReservedTest | None = None) -> ChangeCount:
        """Count the changed elements, and test them for reserved values; one host read.

        Args:
            reserved: The test for reserved values (`reserved_test`); `None` skips it.
        """
        counts, words, flags = [], [], []
        for _, old_piece, new_piece in _pieces(self.old, self.new, self.block):
            new_bits, xor = self._xor(old_piece, new_piece)
            mask = self._mask(xor)
            count = torch.count_nonzero(mask)
            counts.append(count)
            if self.words and xor.numel() % self._per_word == 0:
                words.append(torch.count_nonzero(xor.view(torch.int64)))
            elif self.words:
                words.append(count)  # not read through words
            if reserved is not None:
                flags.append(reserved(new_bits, mask, count, xor))  # the XOR is spent
        found = [torch.stack(counts)]
        if words:
            found.append(torch.stack(words))
        if flags:
            found.append(torch.stack(flags).any().view(1).to(torch.int64))
        read = [int(value) for value in torch.cat(found).tolist()]  # the one host read
        blocks = len(counts)
        per_block = tuple(read[:blocks])
        per_word = tuple(read[blocks : 2 * blocks]) if words else None
        return ChangeCount(sum(per_block), bool(flags) and bool(read[-1]), per_block, per_word)

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
        words = counted.words_per_block or (0,) * len(counted.per_block)
        offset = 0
        pieces = _pieces(self.old, self.new, self.block)
        for (start, old_piece, new_piece), count, changed_words in zip(
            pieces, counted.per_block, words, strict=True
        ):
            if count == 0:
                continue
            new_bits, xor = self._xor(old_piece, new_piece)
            if self._word_path(xor.shape[0], changed_words):
                local = self._through_words(xor, changed_words, count)
            else:
                local = torch.nonzero_static(self._mask(xor), size=count).view(-1)
            end = offset + count
            torch.add(local, start, out=positions[offset:end])
            torch.index_select(new_bits, 0, local, out=values[offset:end])
            offset = end
        return positions, values.reshape(-1).view(self.dtype)

    def _through_words(self, xor: torch.Tensor, words: int, count: int) -> torch.Tensor:
        """The changed positions of a block, found among its changed 8-byte words only."""
        per_word = self._per_word
        as_words = xor.view(torch.int64)
        word_mask = self._buffer("mask", torch.bool)[: as_words.numel()]
        word_mask.copy_(as_words)
        changed_words = torch.nonzero_static(word_mask, size=words).view(-1)
        elements = as_words.index_select(0, changed_words).view(xor.dtype)
        within = torch.nonzero_static(elements.bool(), size=count).view(-1)
        first = changed_words.mul_(per_word)
        return first.index_select(0, within.div(per_word, rounding_mode="floor")).add_(
            within.remainder_(per_word)
        )
