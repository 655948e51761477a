"""Changes: which elements of a tensor differ, bit for bit, from the same tensor as it was.

The kernel behind `diff_state_dicts`. Both tensors are read in blocks of row-major elements,
each block cast to the receiver's dtype into a reused buffer (or read in place when it already
has that dtype and layout). The two blocks' bits are compared as integers of the element width
(so ``-0.0`` differs from ``+0.0`` and NaN compares by its payload) into a boolean change
mask: on the CPU by numpy's ``not_equal`` in one streaming read, elsewhere by their XOR
(nonzero exactly where an element changed) cast to bool. Nothing larger than a block is
allocated besides the result.

`ChangeScan.find` works in one of two ways:

- **One pass (CPU).** Each block's changed positions and values are taken while its mask is
  fresh: numpy's ``flatnonzero`` reads the mask (torch's ``nonzero`` branches on every entry
  and costs several times more per element than a streaming read of both tensors), and the
  changed values are gathered by those positions. Reserved values are then looked for among
  the changed values only. The caller says, from a running count, when a sparse patch is out
  of the question: the scan then stops, since a dense patch needs no positions. A host read
  per block costs nothing on a CPU.
- **Two passes, one host read (accelerators).** `ChangeScan.count` counts the changes of every
  block and tests them for reserved values, all on the device until one read at the end;
  `ChangeScan.gather` (only when the patch may go sparse) compares each block with changes
  again and writes its positions and values straight into the preallocated result. Comparing
  twice costs a second read of both tensors; syncing per block would cost more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy
import torch
from numpy.typing import NDArray

from patchctx import _tuning
from patchctx._strategies import CopyStrategy, ReservedBits
from patchctx._swap import builtin_copy

__all__ = [
    "SINGLE_PASS_DEVICES",
    "BlockBits",
    "ChangeCount",
    "ChangeScan",
    "Changes",
    "ReservedTest",
    "bits_of",
    "block_size",
    "count_set",
    "positions_unless",
    "reserved_test",
    "set_positions",
]


# Devices whose scan takes one pass, reading each block's mask on the host (`ChangeScan.find`).
SINGLE_PASS_DEVICES = frozenset({"cpu"})

# Integer views of the same width; the comparison and every data move happen on these bits.
_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def block_size(device: torch.device) -> int:
    """The default number of elements per block on `device` (`_tuning.DIFF_BLOCK`)."""
    return _tuning.DIFF_BLOCK.get(device.type, _tuning.DIFF_BLOCK["other"])


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


# (flat offset of the piece's first element, the piece of `old`, that of `new`)
_Piece: TypeAlias = tuple[int, torch.Tensor, torch.Tensor]


def _pieces(old: torch.Tensor, new: torch.Tensor, block: int) -> Iterator[_Piece]:
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
    """Whether changed values hold one the receiver's strategy reserves."""

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor | None,
        scratch: torch.Tensor | None,
    ) -> torch.Tensor:
        """A 0-d bool tensor on the values' device, computed without a host read.

        Args:
            values: Values in the receiver's dtype, as bits (`bits_of`); read only.
            changed: Which of them changed (1-D bool, one entry per element); `None`: all.
            scratch: A buffer shaped like `values` that the test may overwrite (given with
                `changed`); `None`: the test allocates what it needs.
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
        changed: torch.Tensor | None,
        scratch: torch.Tensor | None,
    ) -> torch.Tensor:
        magnitudes = torch.bitwise_and(values, self.magnitude, out=scratch)
        if changed is not None:
            magnitudes.mul_(changed)  # unchanged elements count as +0.0, which is no NaN
        return magnitudes.amax() > self.infinity


@dataclass(frozen=True, slots=True)
class _EqualBits:
    """A single reserved bit pattern (an integer sentinel)."""

    pattern: int

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor | None,
        scratch: torch.Tensor | None,
    ) -> torch.Tensor:
        if changed is None or scratch is None:
            return torch.eq(values, self.pattern).any()
        hits = torch.eq(
            values, self.pattern, out=scratch.view(torch.uint8)[: values.numel()].view(torch.bool)
        )
        hits.logical_and_(changed)
        return hits.any()


@dataclass(frozen=True, slots=True)
class _AskStrategy:
    """Any other strategy: ask it about values that are all changed ones.

    With a change mask, the unchanged elements take the value of the first changed one, which
    cannot change the answer; a block with no change answers False.
    """

    strategy: CopyStrategy
    dtype: torch.dtype

    def __call__(
        self,
        values: torch.Tensor,
        changed: torch.Tensor | None,
        scratch: torch.Tensor | None,
    ) -> torch.Tensor:
        if changed is None or scratch is None:
            if values.shape[0] == 0:
                return torch.zeros((), dtype=torch.bool, device=values.device)
            flag = self.strategy.reserved_values(values.reshape(-1).view(self.dtype), self.dtype)
            return flag.to(values.device, torch.bool)
        first = changed.view(torch.uint8).argmax().view(1)
        mask = changed.view(-1, 1) if values.ndim == 2 else changed
        torch.where(mask, values, values.index_select(0, first), out=scratch)
        flag = self.strategy.reserved_values(scratch.reshape(-1).view(self.dtype), self.dtype)
        return torch.logical_and(flag.to(values.device), changed.any())


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

    A strategy that says its reserved values as bits (``reserved_bits``, `ReservedBits`: the
    built-ins do) gets a test on the bits, a few integer passes over a block; any other, or
    one whose bits have no such test here (NaN of a float8 dtype), is asked through its
    `reserved_values`.
    """
    said = getattr(strategy, "reserved_bits", None)
    bits = said(dtype) if callable(said) else None
    if not isinstance(bits, ReservedBits):
        return _AskStrategy(strategy, dtype)
    if bits.nan:
        found = _nan_bits(dtype)
        return _AskStrategy(strategy, dtype) if found is None else found
    if bits.value is not None:
        pattern = _value_bits(bits.value, dtype)
        return _AskStrategy(strategy, dtype) if pattern is None else _EqualBits(pattern)
    return None


def _value_bits(value: int | float, dtype: torch.dtype) -> int | None:
    """The bits of `value` in `dtype` as its integer view reads them; `None`: no one pattern."""
    if dtype.is_complex or dtype == torch.bool or dtype.itemsize not in (1, 2, 4, 8):
        return None
    if not dtype.is_floating_point:
        return _as_bits(int(value), dtype.itemsize) if isinstance(value, int) else None
    cast = torch.tensor([float(value)], dtype=torch.float64).to(dtype)
    if bool(torch.isnan(cast.to(torch.float64))):
        return None  # NaN has many patterns: ``nan=True`` says it
    return int(bits_of(cast).item())


# ------------------------------------------------------------------------------- counting

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


# -------------------------------------------------------------------------- set positions
#
# torch's nonzero on CPU branches on every entry: at a few percent of entries set, each set one
# costs a mispredicted branch, several times a streaming read of both tensors. numpy's
# flatnonzero of a bool array does not branch per entry while the array is dense (from about
# 11% set, in numpy 1.26 to 2.4) but costs 0.4 ns an entry; sparser, it branches too. Reading
# 8 entries as one uint64 first finds the groups of 8 that hold a set entry (a flatnonzero an
# eighth as long); only those groups' entries are then read.

_GROUPS_READ_ALONE = 0.6  # above this fraction of groups holding a set entry, read the mask whole


def set_positions(mask: NDArray[numpy.bool_]) -> NDArray[numpy.intp]:
    """The positions of the set entries of a 1-D bool `mask`, ascending (int64).

    Examples:
        >>> import numpy
        >>> set_positions(numpy.array([0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1], dtype=bool)).tolist()
        [1, 9, 10]
    """
    groups, held = _held_groups(mask)
    return _positions(mask, groups, held)


def positions_unless(
    mask: NDArray[numpy.bool_], fits: Callable[[int], bool]
) -> tuple[int, NDArray[numpy.intp] | None]:
    """`set_positions` of `mask`, unless its count of set entries is one `fits` rules out.

    `fits` must answer no for every count above one it said no to. The groups of 8 entries
    that hold a set one, found first, bound the count: at least one and at most 8 per group.
    When the most fits, the positions are found as `set_positions` finds them; when the least
    does not, nothing more is read; in between the mask is counted (about a tenth of the cost
    of finding its positions once an eighth of the groups hold a set entry) before its
    positions are looked for.

    Returns:
        (the count, the positions), or (a count `fits` ruled out, at most the mask's, `None`).
    """
    groups, held = _held_groups(mask)
    least = held.shape[0]
    most = min(8 * least + mask.shape[0] - 8 * groups.shape[0], mask.shape[0])
    if most and not fits(most):  # the usual sparse block settles here, with one question
        if least and not fits(least):
            return least, None
        count = int(numpy.count_nonzero(mask))
        if count > least and not fits(count):
            return count, None
    found = _positions(mask, groups, held)
    return found.shape[0], found


def _held_groups(
    mask: NDArray[numpy.bool_],
) -> tuple[NDArray[numpy.uint64], NDArray[numpy.intp]]:
    """(the whole groups of 8 entries of `mask` as uint64, the positions of the nonzero ones)."""
    length = mask.shape[0]
    groups = mask[: length - length % 8].view(numpy.uint64)
    return groups, numpy.flatnonzero(groups != 0)


def _positions(
    mask: NDArray[numpy.bool_], groups: NDArray[numpy.uint64], held: NDArray[numpy.intp]
) -> NDArray[numpy.intp]:
    length = mask.shape[0]
    whole = 8 * groups.shape[0]
    if held.shape[0] == 0 and whole == length:  # nothing changed: the common case
        return held
    if held.shape[0] > _GROUPS_READ_ALONE * groups.shape[0]:
        return numpy.flatnonzero(mask)
    inner = numpy.flatnonzero(numpy.take(groups, held).view(numpy.bool_))
    found: NDArray[numpy.intp] = held[inner >> 3] * 8 + (inner & 7)
    if whole == length:
        return found
    return numpy.concatenate([found, numpy.flatnonzero(mask[whole:]) + whole])


# ------------------------------------------------------------------------------------ scan


@dataclass(frozen=True, slots=True)
class ChangeCount:
    """What the counting pass found (read from the device in one go)."""

    changed: int  # elements whose bits differ
    reserved: bool  # whether a changed value is one the strategy reserves
    per_block: tuple[int, ...]  # changed elements per block, in order


@dataclass(frozen=True, slots=True)
class Changes:
    """What `ChangeScan.find` found.

    Attributes:
        changed: The number of changed elements; when `positions` is None, at least this
            many (the scan may stop once a sparse patch is ruled out). 0: nothing changed.
        positions: The sorted flat positions of every changed element, in the index dtype
            asked for; `None` when the tensor must go dense (a changed value is reserved, or
            `could_be_sparse` said no).
        values: Their new values in the receiver's dtype (fresh tensors, never views of
            `new`); `None` exactly when `positions` is.
    """

    changed: int
    positions: torch.Tensor | None = None
    values: torch.Tensor | None = None


class BlockBits:
    """One block of a scan at a time, in the receiver's dtype: its bits, XOR and change mask.

    Owns the block-sized buffers `ChangeScan` describes (reused by every block): the casts
    of `old` and `new` where a block cannot be read in place, the XOR where neither cast
    holds it, and the boolean mask.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, block: int) -> None:
        self.dtype, self.device, self.block = dtype, device, block
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None:
            buffer = torch.empty(self.block, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer

    def bits(self, piece: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
        """`piece` in the receiver's dtype, as flat bits; whether that is a buffer of ours.

        A conjugate or negative view (``x.conj()``) is read through the buffer too: its
        memory holds the values before the lazy conjugation or negation.
        """
        if (
            piece.dtype == self.dtype
            and piece.device == self.device
            and piece.is_contiguous()
            and not piece.is_conj()
            and not piece.is_neg()
        ):
            return bits_of(piece.reshape(-1)), False
        if piece.is_neg() or piece.is_conj():
            # Resolved first: torch's cast copy of a contiguous negative view to another dtype
            # drops the sign (torch 2.13, float32 to float16). A rare, block-sized copy.
            piece = piece.resolve_neg().resolve_conj()
        buffer = self._buffer(name, self.dtype)[: piece.numel()]
        builtin_copy(buffer.view(piece.shape), piece)
        return bits_of(buffer), True

    def xor(
        self, old_piece: torch.Tensor, new_piece: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bits of the new piece, old XOR new: per element, nonzero exactly where it changed)."""
        old_bits, owned = self.bits(old_piece, "old")
        new_bits, _ = self.bits(new_piece, "new")
        xor = old_bits if owned else bits_of(self._buffer("xor", self.dtype)[: new_piece.numel()])
        torch.bitwise_xor(old_bits, new_bits, out=xor)
        return new_bits, xor

    def mask(self, xor: torch.Tensor) -> torch.Tensor:
        """The change mask of a block's XOR (a buffer of ours: spent by the next block)."""
        mask = self._buffer("mask", torch.bool)[: xor.shape[0]]
        if xor.ndim == 2:  # complex128: changed when either half changed
            torch.any(xor, dim=1, out=mask)
        else:
            builtin_copy(mask, xor)  # the cast to bool is `!= 0`, much cheaper than torch.ne
        return mask

    def host_mask(
        self, old_piece: torch.Tensor, new_piece: torch.Tensor
    ) -> tuple[torch.Tensor, NDArray[numpy.bool_]]:
        """(bits of the new piece, its change mask as a numpy array) for a host read.

        On the CPU the two pieces' bits are compared by numpy's ``not_equal`` straight into
        the mask: one streaming read of both, where the XOR and its cast to bool write and
        read a block in between (about a third of the scan's time at low density).
        """
        if self.device.type != "cpu" or self.dtype.itemsize == 16:
            new_bits, xor = self.xor(old_piece, new_piece)
            return new_bits, self.mask(xor).numpy()
        old_bits, _ = self.bits(old_piece, "old")
        new_bits, _ = self.bits(new_piece, "new")
        mask = self._buffer("mask", torch.bool)[: new_bits.shape[0]].numpy()
        numpy.not_equal(old_bits.detach().numpy(), new_bits.detach().numpy(), out=mask)
        return new_bits, mask


class ChangeScan:
    """The elements of `new` whose bits differ from `old`'s, both seen in `dtype`.

    `old` and `new` have one shape (0-d counts as one element, and an empty one is not
    scanned); the work happens on `new`'s device, `old` is brought there a block at a time.
    Per block, the bits of both are XORed (nonzero where an element changed) and the result
    converted to a boolean change mask. The scan owns, reused by every block, at most three
    buffers of one block in the receiver's dtype (the casts of `old` and `new` where a block
    cannot be read in place; the XOR goes into the cast of `old`, or into a buffer of its own
    when there is none) and one block of booleans (the mask): for a bf16 receiver, 5 bytes
    per block element at most.

    Args:
        old: What the receiver holds.
        new: What it should hold.
        dtype: The receiver's dtype; both sides are compared as their casts to it.
        block: Elements per block (default: `block_size` of the device).
        single_pass: Find the positions of each block's changes while its mask is fresh,
            reading the mask on the host (`find`'s one pass; default: on the devices of
            `SINGLE_PASS_DEVICES`, the CPU, where a host read costs nothing). Otherwise
            `find` counts first and gathers in a second pass, one host read between them.
    """

    def __init__(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        dtype: torch.dtype,
        *,
        block: int | None = None,
        single_pass: bool | None = None,
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
        if single_pass is None:
            single_pass = self.device.type in SINGLE_PASS_DEVICES
        self.single_pass = single_pass
        self.blocks = BlockBits(dtype, self.device, self.block)

    # -- the scan

    def find(
        self,
        reserved: ReservedTest | None,
        index_dtype: torch.dtype,
        could_be_sparse: Callable[[int], bool],
    ) -> Changes:
        """The changed elements: how many, and, unless the tensor must go dense, which.

        Args:
            reserved: The test for reserved values (`reserved_test`); `None` skips it.
            index_dtype: The dtype of the positions returned.
            could_be_sparse: Whether a patch of at least this many changed elements might
                still go sparse. It must answer no for every count above one it said no
                to; from its first no, the scan neither gathers positions nor (in one pass)
                goes on reading.
        """
        if self.single_pass:
            return self._one_pass(reserved, index_dtype, could_be_sparse)
        counted = self.count(reserved)
        if counted.changed == 0 or counted.reserved or not could_be_sparse(counted.changed):
            return Changes(counted.changed)
        return Changes(counted.changed, *self.gather(counted, index_dtype))

    def _one_pass(
        self,
        reserved: ReservedTest | None,
        index_dtype: torch.dtype,
        could_be_sparse: Callable[[int], bool],
    ) -> Changes:
        """Each block's positions and values while its mask is fresh (CPU: no sync to pay).

        While the density seen so far, this block's included, would rule sparse out were it
        the whole tensor's, a block is only counted (`positions_unless` counts it before
        looking for its positions, a tenth of their cost): the scan will likely stop, and its
        positions would be wasted. So the block whose count rules sparse out, often a
        tensor's only one, costs a count, not its positions. Should the
        tensor end sparse after all (its changes came early), the blocks only counted are read
        again. The blocks' results are joined at the end, so the result is held twice for that
        moment.
        """
        parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        counted_only: dict[int, _Piece] = {}  # by their place in `parts`
        changed = scanned = 0
        likely = True  # whether the tensor looks likely to go sparse
        for piece in _pieces(self.old, self.new, self.block):
            new_bits, mask = self.blocks.host_mask(piece[1], piece[2])
            scanned += mask.shape[0]
            if likely:  # positions unless this block's density, were it the rest's, rules out
                fits = functools.partial(
                    _could_reach, could_be_sparse, changed, self.numel, scanned
                )
                count, local = positions_unless(mask, fits)
            else:
                count, local = int(numpy.count_nonzero(mask)), None
            if count == 0:
                continue
            if local is None:
                if not could_be_sparse(changed + count):
                    return Changes(changed + count)  # `count` may be a bound: at least this many
                if likely:  # ruled out at the density so far only; `count` may be a bound
                    exact = int(numpy.count_nonzero(mask))
                    if exact > count and not could_be_sparse(changed + exact):
                        return Changes(changed + exact)
                    count = exact
                counted_only[len(parts)] = piece
                parts.append(None)
            else:
                parts.append(_taken(piece[0], new_bits, local, index_dtype))
            changed += count
            likely = could_be_sparse(-(-changed * self.numel // scanned))
        if changed == 0:
            return Changes(0)
        for number, (start, old_piece, new_piece) in counted_only.items():
            new_bits, mask = self.blocks.host_mask(old_piece, new_piece)
            local = set_positions(mask)
            parts[number] = _taken(start, new_bits, local, index_dtype)
        done = [part for part in parts if part is not None]
        found_values = _joined([bits for _, bits in done])
        if reserved is not None and bool(reserved(found_values, None, None)):
            return Changes(changed)
        positions = _joined([at for at, _ in done])
        return Changes(changed, positions, found_values.reshape(-1).view(self.dtype))

    def count(self, reserved: ReservedTest | None = None) -> ChangeCount:
        """Count the changed elements, and test them for reserved values; one host read.

        Args:
            reserved: The test for reserved values (`reserved_test`); `None` skips it.
        """
        counts, flags = [], []
        for _, old_piece, new_piece in _pieces(self.old, self.new, self.block):
            new_bits, xor = self.blocks.xor(old_piece, new_piece)
            mask = self.blocks.mask(xor)
            counts.append(count_set(mask))
            if reserved is not None:
                flags.append(reserved(new_bits, mask, xor))  # the XOR is spent
        found = [torch.stack(counts)]
        if flags:
            found.append(torch.stack(flags).any().view(1).to(torch.int64))
        read = [int(value) for value in torch.cat(found).tolist()]  # the one host read
        per_block = tuple(read[: len(counts)])
        return ChangeCount(sum(per_block), bool(flags) and bool(read[-1]), per_block)

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
        offset = 0
        pieces = _pieces(self.old, self.new, self.block)
        for (start, old_piece, new_piece), count in zip(pieces, counted.per_block, strict=True):
            if count == 0:
                continue
            new_bits, xor = self.blocks.xor(old_piece, new_piece)
            local = torch.nonzero_static(self.blocks.mask(xor), size=count).view(-1)
            end = offset + count
            torch.add(local, start, out=positions[offset:end])
            torch.index_select(new_bits, 0, local, out=values[offset:end])
            offset = end
        return positions, values.reshape(-1).view(self.dtype)


def _could_reach(
    could_be_sparse: Callable[[int], bool], changed: int, numel: int, scanned: int, more: int
) -> bool:
    """Whether a tensor with the density of its first `scanned` elements might go sparse."""
    return could_be_sparse(-(-(changed + more) * numel // scanned))


def _taken(
    start: int, new_bits: torch.Tensor, local: NDArray[numpy.intp], index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions in `index_dtype`, values as bits) of a block's changes at `local`."""
    at = torch.from_numpy(local)
    values = new_bits.index_select(0, at)  # first: `to` may return `at` itself
    return at.to(index_dtype).add_(start), values


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
