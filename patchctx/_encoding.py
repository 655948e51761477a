"""How a patch's positions travel on the wire: four encodings, their exact sizes, and codecs.

A dense patch sends every value. A sparse patch sends its values (in their own dtype) and its
positions, in whichever of three encodings is smallest for that patch:

``indices``
    Flat row-major positions as little-endian integers of `index_dtype` width: int32 when the
    tensor has fewer than 2**31 elements, int64 otherwise. ``4 * nnz`` (or ``8 * nnz``) bytes.
    The only encoding that carries positions in any order (and, for the receiver to refuse,
    duplicates or positions out of range: those keep the width they were given in).
``gaps``
    For positions sorted, unique and in range ``p[0] < p[1] < ... < p[n-1] < numel``: the gaps
    ``g[i] = p[i] - p[i-1]`` with ``p[-1] = -1`` (so every gap is at least 1). The stream is
    ``n`` little-endian uint16 words, word ``i`` holding ``g[i] - 1`` when that is below
    ``0xFFFF``, else the escape ``0xFFFF``; then, right after the words (no padding), one
    little-endian unsigned entry per escape, in order, holding its ``g[i] - 1``: uint32 when the
    tensor has at most 2**32 elements, uint64 otherwise. ``2 * n + 4 * escapes`` (or
    ``8 * escapes``) bytes. An escape always holds at least ``0xFFFF``, so each position list
    has exactly one stream. The escape table after the words (rather than inline) lets the
    receiver find the escapes with one vectorised comparison and rebuild positions with one
    cumulative sum.
``bitmask``
    For the same sorted, unique, in-range positions: ``ceil(numel / 8)`` bytes, position ``p``
    is bit ``p % 8`` (least significant first) of byte ``p // 8``; the bits past ``numel`` in
    the last byte are zero. The values are in position order.

The dense form (`WireEncoding.DENSE`) is what a dense patch travels as. Which of sparse and
dense a changed tensor becomes is `diff_state_dicts`' choice; this module picks the encoding of
a sparse patch once it exists, ties going to the first of ``indices``, ``gaps``, ``bitmask``.

Every function here is vectorised torch on the patch's own device (on CPU the summary, the gap
stream and decoding are numpy, a third or less of torch's time there), O(nnz) in time and
memory for ``indices`` and ``gaps`` and O(numel / 8 + nnz) for ``bitmask``: nothing of
checkpoint size is allocated, on either side. Decoding a bitmask walks it in blocks of 2**17
bytes (2**20 positions). Decoded positions are sorted and unique, in `index_dtype(numel)`.
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

from patchctx import _tuning
from patchctx._patch import PatchLike

__all__ = [
    "WireEncoding",
    "decode_positions",
    "encode_positions",
    "index_dtype",
    "positions_summary",
    "wire_encoding",
    "wire_sizes",
]

# Below this many elements every flat position fits int32.
_INT32_LIMIT = 2**31
# Up to this many elements an escaped gap (at most numel - 1) fits uint32.
_UINT32_GAPS_LIMIT = 2**32
ESCAPE = 0xFFFF
# Streams on CPU are decoded by numpy (tests turn it off to run torch's way there too).
_NUMPY_ON_CPU = True


class WireEncoding(str, enum.Enum):
    """How a patch travels on the wire (see the module `patchctx._encoding` for the bytes).

    Examples:
        >>> from patchctx import WireEncoding
        >>> [encoding.value for encoding in WireEncoding]
        ['dense', 'indices', 'gaps', 'bitmask']
        >>> WireEncoding("gaps") is WireEncoding.GAPS
        True
    """

    DENSE = "dense"
    """Every value of the tensor, no positions."""
    INDICES = "indices"
    """Flat int32 (below 2**31 elements) or int64 positions, 4 or 8 bytes each."""
    GAPS = "gaps"
    """uint16 gaps between sorted positions, with a uint32 (uint64) escape for larger gaps."""
    BITMASK = "bitmask"
    """One bit per element of the tensor, ``ceil(numel / 8)`` bytes."""


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of the flat indices of a sparse patch to a tensor of `numel` elements.

    Examples:
        >>> from patchctx._encoding import index_dtype
        >>> index_dtype(2**31 - 1), index_dtype(2**31)
        (torch.int32, torch.int64)
    """
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


def _escape_width(numel: int) -> int:
    """Bytes of one escape-table entry of a gap stream for a tensor of `numel` elements."""
    return 4 if numel <= _UINT32_GAPS_LIMIT else 8


# ---------------------------------------------------------------------------------- sizes


@dataclass(frozen=True, slots=True)
class PositionsSummary:
    """What the sizes of a sparse patch's encodings depend on (one host read to learn).

    Attributes:
        numel: Elements of the full tensor.
        count: Positions (changed elements).
        in_range: Every position is in ``[0, numel)``.
        ordered: The positions are in range, strictly increasing (so unique): the condition
            for ``gaps`` and ``bitmask``.
        escapes: Gaps that need an escape-table entry (meaningful when `ordered`).
        given_size: Bytes per index as the patch holds them (4 or 8).
    """

    numel: int
    count: int
    in_range: bool
    ordered: bool
    escapes: int
    given_size: int

    def flat_size(self) -> int:
        """Bytes per index of the ``indices`` encoding."""
        if not self.in_range:
            return self.given_size
        return index_dtype(self.numel).itemsize

    def nbytes(self, encoding: WireEncoding) -> int | None:
        """Bytes of the positions in `encoding`; `None` when it cannot carry them."""
        if encoding is WireEncoding.INDICES:
            return self.count * self.flat_size()
        if not self.ordered or encoding is WireEncoding.DENSE:
            return None
        if encoding is WireEncoding.GAPS:
            return gaps_nbytes(self.count, self.escapes, self.numel)
        return bitmask_nbytes(self.numel)

    def smallest(self) -> tuple[WireEncoding, int]:
        """The smallest sparse encoding and the bytes of its positions (ties: the first)."""
        best = (WireEncoding.INDICES, self.count * self.flat_size())
        for encoding in (WireEncoding.GAPS, WireEncoding.BITMASK):
            size = self.nbytes(encoding)
            if size is not None and size < best[1]:
                best = (encoding, size)
        return best


def gaps_nbytes(count: int, escapes: int, numel: int) -> int:
    """Bytes of a gap stream of `count` positions with `escapes` escaped gaps.

    Examples:
        >>> from patchctx._encoding import gaps_nbytes
        >>> gaps_nbytes(10, 0, 1000), gaps_nbytes(10, 1, 2**20), gaps_nbytes(10, 1, 2**33)
        (20, 24, 28)
    """
    return 2 * count + _escape_width(numel) * escapes


def bitmask_nbytes(numel: int) -> int:
    """Bytes of the bitmask of a tensor of `numel` elements."""
    return -(-numel // 8)


def _as_int64(indices: torch.Tensor) -> torch.Tensor:
    return indices.reshape(-1).to(torch.int64)


def count_escapes(positions: torch.Tensor) -> torch.Tensor:
    """How many gaps of sorted `positions` need an escape, as a 0-d int64 tensor (no sync).

    Examples:
        >>> import torch
        >>> from patchctx._encoding import count_escapes
        >>> int(count_escapes(torch.tensor([65_535, 65_536, 200_000])))  # 0xFFFF, 0, 134_463
        2
    """
    flat = _as_int64(positions)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    # gap - 1 >= 0xFFFF, i.e. gap > 0xFFFF; the first gap is p[0] + 1
    first = (flat[:1] >= ESCAPE).sum()
    return first + (flat.diff() > ESCAPE).sum()


def positions_summary(indices: torch.Tensor, numel: int) -> PositionsSummary:
    """Summarise a sparse patch's indices for sizing (O(nnz), one host synchronisation).

    Examples:
        >>> import torch
        >>> from patchctx._encoding import positions_summary
        >>> positions_summary(torch.tensor([3, 1], dtype=torch.int32), 4)
        PositionsSummary(numel=4, count=2, in_range=True, ordered=False, escapes=0, given_size=4)
    """
    if indices.numel() == 0:
        return PositionsSummary(numel, 0, True, True, 0, indices.element_size())
    host = _on_host(indices)
    if host is not None:
        return _summary_on_host(indices, host, numel)
    flat = _as_int64(indices)
    count = flat.numel()
    low, high = flat.aminmax()
    in_range = (low >= 0) & (high < numel)
    increasing = (flat.diff() > 0).all() if count > 1 else torch.ones((), dtype=torch.bool)
    flags = torch.stack(
        [in_range.to(torch.int64), increasing.to(flat.device, torch.int64), count_escapes(flat)]
    )
    in_range_read, increasing_read, escapes = (int(v) for v in flags.tolist())
    ordered = bool(in_range_read and increasing_read)
    escapes = escapes if ordered else 0
    return PositionsSummary(
        numel, count, bool(in_range_read), ordered, escapes, indices.element_size()
    )


def _on_host(indices: torch.Tensor) -> np.ndarray | None:
    """`indices` flattened as a numpy array (a view where they are contiguous), or `None`.

    `None` is where numpy's way does not apply: not on CPU, not int32 / int64, a subclass.
    """
    if (
        not _NUMPY_ON_CPU
        or type(indices) is not torch.Tensor
        or indices.device.type != "cpu"
        or indices.dtype not in (torch.int32, torch.int64)
    ):
        return None
    return indices.detach().reshape(-1).numpy()


def _summary_on_host(indices: torch.Tensor, flat: np.ndarray, numel: int) -> PositionsSummary:
    """`positions_summary` of `flat` (not empty, int32 or int64), by numpy.

    It costs about one and a half copies of the positions' bytes, where torch's way (widened
    to int64) made a dozen.

    The range is read first: only positions all in ``[0, numel)`` are looked at for order, so
    their steps cannot wrap around in the positions' own dtype.
    """
    low, high = (int(v) for v in torch.stack(list(indices.aminmax())).tolist())
    in_range = low >= 0 and high < numel
    first = int(flat[0])
    ordered, escapes = in_range, int(first >= ESCAPE)
    if in_range and flat.size > 1:
        steps = np.diff(flat)  # each gap: at least 1 where the positions increase
        ordered = int(steps.min()) > 0
        if ordered and int(steps.max()) > ESCAPE:  # gap - 1 >= 0xFFFF
            escapes += int(np.count_nonzero(steps > ESCAPE))
    return PositionsSummary(
        numel, flat.size, in_range, ordered, escapes if ordered else 0, indices.element_size()
    )


def _numel(patch: PatchLike) -> int:
    return math.prod(int(d) for d in patch.shape)


def wire_sizes(patch: PatchLike) -> dict[WireEncoding, int]:
    """The bytes `patch` takes on the wire in each encoding that can carry it.

    A dense patch travels only as `WireEncoding.DENSE` (its values). A sparse patch's values
    travel in their own dtype, and its positions as ``indices`` always, and as ``gaps`` and
    ``bitmask`` when they are sorted, unique and in range (what `diff_state_dicts` makes).
    Names, shapes and the payload's header are not counted. The sizes are exact: the lengths
    of the byte streams the `patchctx.vllm` codec writes.

    Args:
        patch: A `CheckpointWeightPatch` or any `PatchLike`.

    Returns:
        Bytes (values plus positions) per possible encoding, in `WireEncoding` order.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, wire_sizes
        >>> patch = CheckpointWeightPatch("w", (4096,), torch.bfloat16,
        ...                               torch.ones(100, dtype=torch.bfloat16),
        ...                               torch.arange(0, 4000, 40, dtype=torch.int32))
        >>> {encoding.value: size for encoding, size in wire_sizes(patch).items()}
        {'indices': 600, 'gaps': 400, 'bitmask': 712}
    """
    values = patch.values.numel() * patch.values.element_size()
    if patch.indices is None:
        return {WireEncoding.DENSE: values}
    summary = positions_summary(patch.indices, _numel(patch))
    sizes = {}
    for encoding in (WireEncoding.INDICES, WireEncoding.GAPS, WireEncoding.BITMASK):
        size = summary.nbytes(encoding)
        if size is not None:
            sizes[encoding] = values + size
    return sizes


def wire_encoding(patch: PatchLike) -> WireEncoding:
    """The encoding `patch` travels in: the smallest of `wire_sizes` (ties: the first).

    Args:
        patch: A `CheckpointWeightPatch` or any `PatchLike`.

    Returns:
        `WireEncoding.DENSE` for a dense patch, else the smallest sparse encoding.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, wire_encoding
        >>> def patch(every):  # one changed element in `every`, of 2**20
        ...     positions = torch.arange(0, 2**20, every, dtype=torch.int32)
        ...     return CheckpointWeightPatch("w", (2**20,), torch.bfloat16,
        ...                                  torch.ones(len(positions), dtype=torch.bfloat16),
        ...                                  positions)
        >>> [wire_encoding(patch(every)).value for every in (100_000, 1000, 2)]
        ['indices', 'gaps', 'bitmask']
    """
    if patch.indices is None:
        return WireEncoding.DENSE
    return positions_summary(patch.indices, _numel(patch)).smallest()[0]


# ------------------------------------------------------------------------------ encoding


_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_MASK = {2: 0xFFFF, 4: 0xFFFFFFFF}


def _little_endian(values: torch.Tensor, width: int) -> torch.Tensor:
    """int64 `values` modulo ``2**(8 * width)``, as `width`-byte little-endian integers (uint8)."""
    if sys.byteorder == "little":
        return values.to(_SIGNED[width]).view(torch.uint8).reshape(-1)
    shifts = torch.arange(0, 8 * width, 8, dtype=torch.int64, device=values.device)
    return ((values.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def _from_little_endian(
    raw: torch.Tensor, width: int, *, signed: bool = False, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Undo `_little_endian`: a new tensor of `dtype` (int32 or int64).

    Unsigned (a uint64 at 2**63 or above comes out negative in int64) or, with `signed`, two's
    complement.
    """
    if sys.byteorder == "little":
        if raw.storage_offset() % width:
            raw = raw.clone()  # `view` needs an aligned start; only short tables get here
        wide = raw.view(_SIGNED[width]).to(dtype)  # a new tensor whenever it is changed below
        if not signed and width < dtype.itemsize:
            wide.bitwise_and_(_UNSIGNED_MASK[width])
        return wide
    shifts = torch.arange(0, 8 * width, 8, dtype=torch.int64, device=raw.device)
    wide = (raw.view(-1, width).to(torch.int64) << shifts).sum(dim=1)
    if signed and width < 8:
        wide = wide - ((wide >> (8 * width - 1)) << (8 * width))
    return wide.to(dtype)


def encode_positions(
    indices: torch.Tensor, summary: PositionsSummary, encoding: WireEncoding
) -> torch.Tensor:
    """The bytes (a 1-D uint8 tensor on the indices' device) of `indices` in `encoding`.

    `summary` is `positions_summary(indices, numel)`. ``indices`` are written
    `PositionsSummary.flat_size` bytes wide (the caller names the dtype in its header);
    ``gaps`` and ``bitmask`` need `PositionsSummary.ordered` positions (not checked again).

    Examples:
        >>> import torch
        >>> from patchctx._encoding import WireEncoding, encode_positions, positions_summary
        >>> positions = torch.tensor([0, 3, 70_000])
        >>> summary = positions_summary(positions, 70_001)
        >>> encode_positions(positions, summary, WireEncoding.GAPS).tolist()
        [0, 0, 2, 0, 255, 255, 108, 17, 1, 0]
        >>> encode_positions(positions, summary, WireEncoding.BITMASK)[:1].tolist()
        [9]
    """
    host = _on_host(indices) if encoding is WireEncoding.GAPS and summary.count else None
    if host is not None:
        return torch.from_numpy(_gaps_on_host(host, summary))
    flat = _as_int64(indices)
    numel = summary.numel
    if encoding is WireEncoding.INDICES:
        return _little_endian(flat, summary.flat_size())
    if encoding is WireEncoding.GAPS:
        before = torch.cat([flat.new_full((1,), -1), flat[:-1]]) if flat.numel() else flat
        gaps = flat - before - 1
        escaped = gaps >= ESCAPE
        words = _little_endian(torch.where(escaped, ESCAPE, gaps), 2)
        table = _little_endian(gaps[escaped], _escape_width(numel))
        return torch.cat([words, table])
    if encoding is WireEncoding.BITMASK:
        mask = torch.zeros(bitmask_nbytes(numel), dtype=torch.uint8, device=flat.device)
        if flat.numel():
            # Sorted positions: the bits of one byte are consecutive, summed (= or-ed) per byte.
            byte, inverse = torch.unique_consecutive(flat >> 3, return_inverse=True)
            bits = torch.ones_like(flat) << (flat & 7)
            per_byte = torch.zeros(byte.numel(), dtype=torch.int64, device=flat.device)
            per_byte.index_add_(0, inverse, bits)
            mask[byte] = per_byte.to(torch.uint8)
        return mask
    raise ValueError(f"{encoding!r} does not encode positions")


def _gaps_on_host(flat: np.ndarray, summary: PositionsSummary) -> np.ndarray:
    """The ``gaps`` stream of ordered `flat` (not empty), by numpy, in one buffer.

    Each word is the step to the next position less one, modulo 2**16. Only where `summary`
    counts escapes are the steps read again, for the table.
    """
    count, escapes = summary.count, summary.escapes
    width = _escape_width(summary.numel)
    out = np.empty(2 * count + width * escapes, dtype=np.uint8)
    words = out[: 2 * count].view("<u2")
    words[0] = min(int(flat[0]), ESCAPE)
    np.subtract(flat[1:], flat[:-1], out=words[1:], casting="unsafe")  # steps, mod 2**16
    words[1:] -= 1
    if escapes:
        gaps = np.empty(count, dtype=np.int64)
        gaps[0] = flat[0]
        np.subtract(flat[1:], flat[:-1], out=gaps[1:])
        gaps[1:] -= 1
        escaped = np.flatnonzero(gaps >= ESCAPE)
        words[escaped] = ESCAPE
        out[2 * count :] = gaps[escaped].astype("<u4" if width == 4 else "<u8").view(np.uint8)
    return out


# ------------------------------------------------------------------------------ decoding


class MalformedPositions(ValueError):
    """The bytes are not a valid stream of the encoding (the message says why)."""


def decode_positions(
    data: torch.Tensor,
    numel: int,
    count: int,
    encoding: WireEncoding,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode `count` positions into a tensor of `numel` elements from `data` (uint8, 1-D).

    ``gaps`` and ``bitmask`` give sorted, unique positions in ``[0, numel)``, in
    `index_dtype(numel)`; ``indices`` gives `dtype` (int32 or int64) integers as they were
    sent, range and order unchecked (the receiver's validation checks them). The stream must be
    exactly one valid encoding of `count` positions: anything else (a truncated or overlong
    stream, a bit set past `numel`, a count that differs, an escape that is not needed or
    reaches past the tensor) raises `MalformedPositions`. No temporary has `numel` elements.

    Examples:
        >>> import torch
        >>> from patchctx._encoding import (WireEncoding, decode_positions, encode_positions,
        ...                                 positions_summary)
        >>> positions = torch.tensor([1, 8, 9])
        >>> data = encode_positions(positions, positions_summary(positions, 10),
        ...                         WireEncoding.BITMASK)
        >>> decode_positions(data, 10, 3, WireEncoding.BITMASK)
        tensor([1, 8, 9], dtype=torch.int32)
    """
    if data.dtype != torch.uint8 or data.ndim != 1:
        raise MalformedPositions("positions must be a 1-D uint8 byte stream")
    if count < 0 or numel < 0:
        raise MalformedPositions(f"count {count} and numel {numel} must be non-negative")
    # Words and escapes are read through views of other widths, which need unit steps: a
    # strided stream (every other byte of a buffer) is the same bytes, copied once.
    data = data.contiguous()
    if count > numel and encoding is not WireEncoding.INDICES:
        raise MalformedPositions(f"{count} positions do not fit a tensor of {numel} elements")
    if encoding is WireEncoding.INDICES:
        chosen = dtype or index_dtype(numel)
        if chosen not in (torch.int32, torch.int64):
            raise MalformedPositions(f"indices are int32 or int64, not {chosen}")
        width = chosen.itemsize
        if data.numel() != count * width:
            raise MalformedPositions(
                f"{count} {chosen} indices take {count * width} bytes, the stream has "
                f"{data.numel()}"
            )
        return _from_little_endian(data, width, signed=True, dtype=chosen)
    if encoding is WireEncoding.GAPS:
        return _decode_gaps(data, numel, count)
    if encoding is WireEncoding.BITMASK:
        return _decode_bitmask(data, numel, count)
    raise MalformedPositions(f"{encoding.value} is not an encoding of positions")


def _decode_gaps(data: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    out_dtype = index_dtype(numel)
    if data.numel() < 2 * count:
        raise MalformedPositions(
            f"a gap stream of {count} positions needs at least {2 * count} bytes, has "
            f"{data.numel()}"
        )
    if count == 0:
        if data.numel():
            raise MalformedPositions(f"an empty gap stream has {data.numel()} bytes, not 0")
        return torch.empty(0, dtype=out_dtype, device=data.device)
    if _NUMPY_ON_CPU and data.device.type == "cpu":
        return torch.from_numpy(_decode_gaps_on_host(data.numpy(), numel, count))
    # The positions are built in place in one tensor of the output dtype: gap - 1, then the
    # gap, then its running sum, then the position.
    positions = _from_little_endian(data[: 2 * count], 2, dtype=out_dtype)
    escaped = positions == ESCAPE
    escapes = int(escaped.sum())
    width = _escape_width(numel)
    expected = 2 * count + width * escapes
    if data.numel() != expected:
        raise MalformedPositions(
            f"a gap stream of {count} positions with {escapes} escapes is {expected} bytes, "
            f"this one is {data.numel()}"
        )
    if escapes:
        table = _from_little_endian(data[2 * count :], width)
        low, high = (int(v) for v in torch.stack(list(table.aminmax())).tolist())
        if low < ESCAPE or high >= numel:  # uint64 entries over 2**63 read as negative
            raise MalformedPositions(
                f"an escape must hold a gap of at least {ESCAPE} and below the tensor's "
                f"{numel} elements"
            )
        positions.masked_scatter_(escaped, table.to(out_dtype))
    del escaped
    positions.add_(1)
    positions.cumsum_(0)
    positions.sub_(1)
    # Gaps are at least 1 and below 2**31 (2**62 for int64), so the positions increase unless
    # the sum wraps around, which first shows as a negative position.
    low, last = (int(v) for v in torch.stack([positions.min(), positions[-1]]).tolist())
    if low < 0 or last >= numel:
        raise MalformedPositions(f"the gaps reach past the tensor's {numel} elements")
    return positions


def _host_dtype(numel: int) -> type[np.signedinteger]:
    """`index_dtype(numel)` as numpy's."""
    return np.int32 if numel < _INT32_LIMIT else np.int64


def _decode_gaps_on_host(raw: np.ndarray, numel: int, count: int) -> np.ndarray:
    """`_decode_gaps` for a stream on CPU (at least ``2 * count`` bytes, count > 0), by numpy.

    Four passes over the positions, in place in the output: the gaps (an escape word reads as
    ``0x10000``), their maximum (escapes are looked for only when it shows one), the running
    sum (from the first gap less one: the positions themselves), and the smallest position.
    torch made a dozen, and three host reads.
    """
    wide = _host_dtype(numel)
    words = raw[: 2 * count].view("<u2")
    positions = np.empty(count, dtype=wide)
    np.add(words, wide(1), out=positions)  # each gap: its word + 1
    escaped = np.flatnonzero(positions == ESCAPE + 1) if positions.max() > ESCAPE else None
    escapes = 0 if escaped is None else escaped.size
    width = _escape_width(numel)
    expected = 2 * count + width * escapes
    if raw.size != expected:
        raise MalformedPositions(
            f"a gap stream of {count} positions with {escapes} escapes is {expected} bytes, "
            f"this one is {raw.size}"
        )
    if escaped is not None:
        table = raw[2 * count :].view("<u4" if width == 4 else "<u8")
        if int(table.min()) < ESCAPE or int(table.max()) >= numel:
            raise MalformedPositions(
                f"an escape must hold a gap of at least {ESCAPE} and below the tensor's "
                f"{numel} elements"
            )
        # Widened before adding one: in uint32, 2**32 - 1 + 1 wraps to a gap of 0. Below
        # numel, so the sum fits the output dtype.
        positions[escaped] = table.astype(wide) + 1
    positions[0] -= 1  # p[i] = g[0] + ... + g[i] - 1
    np.cumsum(positions, dtype=wide, out=positions)
    # Every gap is at least 1 and below numel, so the running sum increases unless it wraps
    # around, which first shows as a negative position (no step can jump over the negatives).
    if int(positions.min()) < 0 or int(positions[-1]) >= numel:
        raise MalformedPositions(f"the gaps reach past the tensor's {numel} elements")
    return positions


def _decode_bitmask_on_host(raw: np.ndarray, numel: int, count: int) -> np.ndarray:
    """`_decode_bitmask` for a mask on CPU (its length and spare bits checked), by numpy.

    Per block of `_tuning.BITMASK_BLOCK_BYTES`: the bits unpacked to bools (8 bytes per byte
    of mask), numpy's ``nonzero`` of them, shifted into the output. A block without a set bit is
    skipped after one scan. At 10 % density, about a third of torch's time.
    """
    out = np.empty(count, dtype=_host_dtype(numel))
    filled = 0
    for start in range(0, raw.size, _tuning.BITMASK_BLOCK_BYTES):
        block = raw[start : start + _tuning.BITMASK_BLOCK_BYTES]
        if not block.any():
            continue
        (found,) = np.unpackbits(block, bitorder="little").view(np.bool_).nonzero()
        if filled + found.size > count:
            raise MalformedPositions(f"the bitmask sets more than the {count} bits announced")
        np.add(found, 8 * start, out=out[filled : filled + found.size], casting="unsafe")
        filled += found.size
    if filled != count:
        raise MalformedPositions(f"the bitmask sets {filled} bits, {count} were announced")
    return out


def _bit_table(device: torch.device) -> torch.Tensor:
    """For each byte value, its 8 bits (least significant first) as bools packed in an int64."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return bits.to(torch.bool).contiguous().view(torch.int64).view(-1).to(device)


def _decode_bitmask(data: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    out_dtype = index_dtype(numel)
    nbytes = bitmask_nbytes(numel)
    if data.numel() != nbytes:
        raise MalformedPositions(
            f"the bitmask of {numel} elements is {nbytes} bytes, this one is {data.numel()}"
        )
    spare = 8 * nbytes - numel
    if spare and int(data[-1]) >> (8 - spare):
        raise MalformedPositions(f"the bitmask sets a bit past the tensor's {numel} elements")
    if _NUMPY_ON_CPU and data.device.type == "cpu":
        return torch.from_numpy(_decode_bitmask_on_host(data.numpy(), numel, count))
    out = torch.empty(count, dtype=out_dtype, device=data.device)
    table = _bit_table(data.device)
    # Sparse masks (by the announced count) unpack only their non-zero bytes.
    sparse = 32 * count < numel
    filled = 0
    for start in range(0, nbytes, _tuning.BITMASK_BLOCK_BYTES):
        block = data[start : start + _tuning.BITMASK_BLOCK_BYTES]
        if sparse:
            occupied = block.nonzero().view(-1)
            if occupied.numel() == 0:
                continue
            bits = table[block[occupied].long()].view(torch.bool).view(-1, 8).nonzero()
            found = (occupied[bits[:, 0]] + start) * 8 + bits[:, 1]
        else:
            found = table[block.long()].view(torch.bool).nonzero().view(-1)
            found += 8 * start
        if filled + found.numel() > count:
            raise MalformedPositions(f"the bitmask sets more than the {count} bits announced")
        out[filled : filled + found.numel()] = found
        filled += found.numel()
    if filled != count:
        raise MalformedPositions(f"the bitmask sets {filled} bits, {count} were announced")
    return out
