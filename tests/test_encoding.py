"""Wire encodings of a sparse patch's positions: exact sizes, round trips, strict decoding."""

from __future__ import annotations

import itertools
import math
import tracemalloc
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchctx import (
    CheckpointWeightPatch,
    WireEncoding,
    _encoding,
    patch_nbytes,
    wire_encoding,
    wire_sizes,
)
from patchctx._encoding import (
    MalformedPositions,
    decode_positions,
    encode_positions,
    index_dtype,
    positions_summary,
)
from patchctx._tuning import BITMASK_BLOCK_BYTES
from tests.support.memory import AllocationTracker


@pytest.fixture(autouse=True, params=["numpy", "torch"])
def decoder(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test twice: CPU streams decoded by numpy (the default), and torch's way, which
    accelerators take."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(_encoding, "_NUMPY_ON_CPU", request.param == "numpy")
        yield request.param


SPARSE = (WireEncoding.INDICES, WireEncoding.GAPS, WireEncoding.BITMASK)
# Largest tensor whose bitmask a test builds (2 MiB of mask).
BITMASK_LIMIT = 2**24


@st.composite
def sorted_positions(draw: st.DrawFn, max_numel: int = 5000) -> tuple[torch.Tensor, int]:
    """Sorted unique positions into a tensor of `numel` elements, at a random density, with
    the edges 0 and numel - 1 often among them."""
    numel = draw(st.integers(1, max_numel))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**16))
    chosen = torch.rand(numel, generator=torch.Generator().manual_seed(seed)) < density
    if draw(st.booleans()):
        chosen[0] = True
    if draw(st.booleans()):
        chosen[-1] = True
    return chosen.nonzero().view(-1), numel


def round_trip(positions: torch.Tensor, numel: int, encoding: WireEncoding) -> torch.Tensor:
    summary = positions_summary(positions, numel)
    data = encode_positions(positions, summary, encoding)
    assert data.dtype == torch.uint8 and data.ndim == 1
    assert data.numel() == summary.nbytes(encoding)  # the size function is exact
    decoded = decode_positions(data, numel, positions.numel(), encoding)
    assert decoded.dtype == index_dtype(numel)
    assert torch.equal(decoded.long(), positions.long())
    return decoded


@given(sorted_positions(), st.sampled_from(SPARSE))
def test_every_encoding_round_trips_sorted_positions(
    drawn: tuple[torch.Tensor, int], encoding: WireEncoding
) -> None:
    positions, numel = drawn
    round_trip(positions, numel, encoding)


@given(
    st.sampled_from([2**16 - 1, 2**16, 2**16 + 1, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**40]),
    st.lists(st.integers(0, 2**40), max_size=40),
    st.booleans(),
)
def test_large_tensors_round_trip_without_allocating_them(
    numel: int, picks: list[int], edges: bool
) -> None:
    """Positions near the 2**16, 2**31 and 2**32 boundaries, gaps of every size (escapes that
    need uint32 and uint64 entries), int64 positions, and no tensor of `numel` elements."""
    chosen = {p % numel for p in picks} | ({0, numel - 1} if edges else set())
    if edges:  # gaps of 0xFFFF + 1 and 0x10000 + 1 before the last element
        chosen |= {p for p in (numel - 2 - 0xFFFF, numel - 2 - 0x10000) if p >= 0}
    positions = torch.tensor(sorted(chosen), dtype=torch.int64)
    for encoding in SPARSE:
        if encoding is WireEncoding.BITMASK and numel > BITMASK_LIMIT:
            continue
        decoded = round_trip(positions, numel, encoding)
        assert decoded.dtype == (torch.int32 if numel < 2**31 else torch.int64)


def test_escape_boundaries_and_widths() -> None:
    # a gap of 0xFFFF (gap - 1 = 0xFFFE) is a word; 0x10000 escapes; 2**32 escapes in uint32
    for numel, width in ((2**32, 4), (2**32 + 1, 8)):
        positions = torch.tensor([0xFFFE, 0xFFFE + 0x10000, numel - 1])
        summary = positions_summary(positions, numel)
        data = encode_positions(positions, summary, WireEncoding.GAPS)
        assert summary.escapes == 2 and data.numel() == 3 * 2 + 2 * width
        assert data[:6].tolist() == [0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
        assert torch.equal(decode_positions(data, numel, 3, WireEncoding.GAPS).long(), positions)
    # the largest uint32 escape: from -1 to 2**32 - 2 is a gap of 2**32 - 1
    last = torch.tensor([2**32 - 2])
    round_trip(last, 2**32, WireEncoding.GAPS)


def test_empty_positions_in_every_encoding() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    for numel in (0, 1, 9, 2**31):
        for encoding in SPARSE:
            if encoding is WireEncoding.BITMASK and numel > BITMASK_LIMIT:
                continue
            round_trip(empty, numel, encoding)


def test_bitmask_layout_is_little_endian_bit_order() -> None:
    positions = torch.tensor([0, 3, 9, 17])
    data = encode_positions(positions, positions_summary(positions, 18), WireEncoding.BITMASK)
    assert data.tolist() == [0b1001, 0b10, 0b10]


def test_bitmask_spanning_several_decode_blocks() -> None:
    numel = 3 * BITMASK_BLOCK_BYTES * 8 + 5
    positions = torch.tensor([0, 8 * BITMASK_BLOCK_BYTES - 1, 8 * BITMASK_BLOCK_BYTES, numel - 1])
    round_trip(positions, numel, WireEncoding.BITMASK)


def test_decoding_allocates_nothing_of_checkpoint_size() -> None:
    numel = 2**26  # a bitmask of 8 MiB for a tensor of 64M elements
    positions = torch.tensor([5, 2**20, 2**25 + 3, numel - 1])
    summary = positions_summary(positions, numel)
    for encoding in SPARSE:
        data = encode_positions(positions, summary, encoding)
        tracemalloc.start()  # numpy's arrays (torch's storages are the tracker's)
        try:
            with AllocationTracker(preexisting=[data]) as tracker:
                decode_positions(data, numel, 4, encoding)
            _, host_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # at most a bitmask block's scratch: far below one byte per element (64 MiB)
        assert tracker.peak <= 64 * BITMASK_BLOCK_BYTES, (encoding, tracker.peak)
        assert host_peak <= 64 * BITMASK_BLOCK_BYTES, (encoding, host_peak)


def test_indices_encoding_keeps_positions_in_any_order() -> None:
    unordered = torch.tensor([7, 2, 2, 9], dtype=torch.int64)
    summary = positions_summary(unordered, 10)
    assert summary.in_range and not summary.ordered
    assert summary.nbytes(WireEncoding.GAPS) is None and summary.flat_size() == 4
    data = encode_positions(unordered, summary, WireEncoding.INDICES)
    decoded = decode_positions(data, 10, 4, WireEncoding.INDICES, dtype=torch.int32)
    assert decoded.tolist() == [7, 2, 2, 9]
    # out of range: sent as given (the receiver's validation names the patch)
    wild = torch.tensor([-1, 2**40], dtype=torch.int64)
    summary = positions_summary(wild, 10)
    assert not summary.in_range and summary.flat_size() == 8
    data = encode_positions(wild, summary, WireEncoding.INDICES)
    decoded = decode_positions(data, 10, 2, WireEncoding.INDICES, dtype=torch.int64)
    assert decoded.tolist() == [-1, 2**40]


# ------------------------------------------------------------------------------- choosing


def patch_with(positions: torch.Tensor, numel: int, dtype: torch.dtype) -> CheckpointWeightPatch:
    values = torch.ones(positions.numel(), dtype=dtype)
    return CheckpointWeightPatch("w", (numel,), dtype, values, positions.to(index_dtype(numel)))


@given(sorted_positions(), st.sampled_from([torch.bfloat16, torch.float32, torch.int8]))
def test_sizes_are_the_encoded_lengths_and_the_choice_is_their_minimum(
    drawn: tuple[torch.Tensor, int], dtype: torch.dtype
) -> None:
    positions, numel = drawn
    patch = patch_with(positions, numel, dtype)
    sizes = wire_sizes(patch)
    assert list(sizes) == list(SPARSE)
    summary = positions_summary(positions, numel)
    values = positions.numel() * dtype.itemsize
    for encoding, size in sizes.items():
        assert size == values + encode_positions(positions, summary, encoding).numel()
    chosen = wire_encoding(patch)
    assert sizes[chosen] == min(sizes.values())
    assert list(sizes).index(chosen) == min(
        i for i, s in enumerate(sizes.values()) if s == min(sizes.values())
    )
    assert patch_nbytes([patch]) == sizes[chosen]
    # never larger than the flat int32 payload the old rule counted
    assert patch_nbytes([patch]) <= positions.numel() * (4 + dtype.itemsize)


def test_each_encoding_wins_somewhere() -> None:
    numel = 2**20
    expect = {2**17: WireEncoding.INDICES, 2**8: WireEncoding.GAPS, 2: WireEncoding.BITMASK}
    for every, encoding in expect.items():
        patch = patch_with(torch.arange(0, numel, every), numel, torch.bfloat16)
        assert wire_encoding(patch) is encoding
    dense = CheckpointWeightPatch("b", (4,), torch.float32, torch.zeros(4))
    assert wire_sizes(dense) == {WireEncoding.DENSE: 16}
    assert wire_encoding(dense) is WireEncoding.DENSE


def test_bytes_against_density_are_what_the_formats_say() -> None:
    numel = 4096 * 4096
    for density in (0.0001, 0.01, 0.5):
        every = round(1 / density)
        positions = torch.arange(0, numel, every)
        nnz = positions.numel()
        escapes = 1 if every > 0xFFFF else 0
        patch = patch_with(positions, numel, torch.bfloat16)
        assert wire_sizes(patch) == {
            WireEncoding.INDICES: nnz * (2 + 4),
            WireEncoding.GAPS: nnz * 2 + 2 * nnz + 4 * escapes * (nnz - 1),
            WireEncoding.BITMASK: nnz * 2 + numel // 8,
        }


# ------------------------------------------------------------------------- strict decoding


def gaps_of(positions: list[int], numel: int) -> torch.Tensor:
    tensor = torch.tensor(positions, dtype=torch.int64)
    return encode_positions(tensor, positions_summary(tensor, numel), WireEncoding.GAPS)


def words(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int16).view(torch.uint8)


def table(*values: int, width: int = 4) -> torch.Tensor:
    dtype = torch.int32 if width == 4 else torch.int64
    return torch.tensor(values, dtype=torch.int64).to(dtype).view(torch.uint8)


MALFORMED_GAPS = {
    "truncated words": (gaps_of([1, 5, 9], 10)[:-1], 10, 3, "needs at least 6 bytes"),
    "a missing escape entry": (words(0, 0xFFFF), 2**20, 2, "with 1 escapes is 8 bytes"),
    "a truncated escape entry": (
        torch.cat([words(0xFFFF), table(70_000)[:3]]),
        2**20,
        1,
        "is 6 bytes, this one is 5",
    ),
    "bytes after the stream": (torch.cat([gaps_of([1, 5], 10), words(0)]), 10, 2, "is 4 bytes"),
    "past the end": (words(3, 7), 10, 2, "reach past"),
    "more positions than fit": (words(0, 0, 0), 2, 3, "do not fit"),
    "an escape that was not needed": (torch.cat([words(0xFFFF), table(5)]), 10, 1, "escape"),
    "an escape past the tensor": (torch.cat([words(0xFFFF), table(2**20)]), 2**20, 1, "escape"),
    "an escape that overflows": (
        torch.cat([words(0xFFFF), table(-1, width=8)]),
        2**40,
        1,
        "escape",
    ),
    "sums that wrap around": (
        torch.cat([words(*[0xFFFF] * 4), table(*[2**40 - 1] * 4, width=8)]),
        2**40,
        4,
        "reach past",
    ),
}


@pytest.mark.parametrize(
    ("data", "numel", "count", "message"), MALFORMED_GAPS.values(), ids=MALFORMED_GAPS.keys()
)
def test_malformed_gap_streams_are_refused(
    data: torch.Tensor, numel: int, count: int, message: str
) -> None:
    with pytest.raises(MalformedPositions, match=message):
        decode_positions(data, numel, count, WireEncoding.GAPS)


def bitmask_of(positions: list[int], numel: int) -> torch.Tensor:
    tensor = torch.tensor(positions, dtype=torch.int64)
    return encode_positions(tensor, positions_summary(tensor, numel), WireEncoding.BITMASK)


MALFORMED_BITMASKS = {
    "truncated": (bitmask_of([1, 12], 20)[:-1], 20, 2, "is 3 bytes"),
    "overlong": (torch.cat([bitmask_of([1], 8), words(0)]), 8, 1, "is 1 bytes"),
    "a bit past numel": (torch.tensor([0, 0b100], dtype=torch.uint8), 10, 1, "past the tensor"),
    "fewer bits than announced": (bitmask_of([1, 2], 16), 16, 3, "sets 2 bits, 3 were"),
    "more bits than announced": (bitmask_of([1, 2, 9], 16), 16, 2, "more than the 2"),
    "more bits over several blocks": (
        bitmask_of([0, 8 * BITMASK_BLOCK_BYTES + 1], 8 * BITMASK_BLOCK_BYTES + 8),
        8 * BITMASK_BLOCK_BYTES + 8,
        1,
        "more than the 1",
    ),
}


@pytest.mark.parametrize(
    ("data", "numel", "count", "message"),
    MALFORMED_BITMASKS.values(),
    ids=MALFORMED_BITMASKS.keys(),
)
def test_malformed_bitmasks_are_refused(
    data: torch.Tensor, numel: int, count: int, message: str
) -> None:
    with pytest.raises(MalformedPositions, match=message):
        decode_positions(data, numel, count, WireEncoding.BITMASK)


def test_malformed_flat_indices_and_arguments_are_refused() -> None:
    with pytest.raises(MalformedPositions, match="take 8 bytes"):
        decode_positions(torch.zeros(7, dtype=torch.uint8), 10, 2, WireEncoding.INDICES)
    with pytest.raises(MalformedPositions, match="int32 or int64"):
        decode_positions(
            torch.zeros(2, dtype=torch.uint8), 10, 1, WireEncoding.INDICES, dtype=torch.int16
        )
    with pytest.raises(MalformedPositions, match="1-D uint8"):
        decode_positions(torch.zeros(2, dtype=torch.int16), 10, 1, WireEncoding.GAPS)
    with pytest.raises(MalformedPositions, match="not an encoding of positions"):
        decode_positions(torch.zeros(2, dtype=torch.uint8), 10, 1, WireEncoding.DENSE)
    with pytest.raises(ValueError, match="does not encode positions"):
        encode_positions(
            torch.tensor([1]), positions_summary(torch.tensor([1]), 2), WireEncoding.DENSE
        )


@given(st.binary(max_size=64), st.integers(0, 40), st.integers(1, 600), st.sampled_from(SPARSE))
def test_random_bytes_decode_to_valid_positions_or_are_refused(
    raw: bytes, count: int, numel: int, encoding: WireEncoding
) -> None:
    data = torch.tensor(list(raw), dtype=torch.uint8)
    try:
        decoded = decode_positions(data, numel, count, encoding)
    except MalformedPositions:
        return
    assert decoded.numel() == count
    if encoding is not WireEncoding.INDICES:
        flat = decoded.long()
        assert bool((flat >= 0).all()) and bool((flat < numel).all())
        assert bool((flat.diff() > 0).all())
        # one valid stream per position list: re-encoding gives the same bytes
        again = encode_positions(flat, positions_summary(flat, numel), encoding)
        assert torch.equal(again, data)


def test_sizes_match_for_numel_that_is_not_a_multiple_of_8() -> None:
    for numel in (1, 7, 9, 15, 17):
        positions = torch.tensor([numel - 1])
        assert positions_summary(positions, numel).nbytes(WireEncoding.BITMASK) == math.ceil(
            numel / 8
        )
        round_trip(positions, numel, WireEncoding.BITMASK)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_encoding_and_decoding_stay_on_the_positions_device(device: str) -> None:
    numel = 3 * 2**20
    positions = torch.tensor([0, 70_000, 70_001, 2**21, numel - 1], device=device)
    summary = positions_summary(positions, numel)
    for encoding in SPARSE:
        data = encode_positions(positions, summary, encoding)
        assert data.device == positions.device
        decoded = decode_positions(data, numel, positions.numel(), encoding)
        assert decoded.device == positions.device
        assert torch.equal(decoded.long().cpu(), positions.cpu())


@pytest.mark.parametrize("encoding", SPARSE)
def test_a_stream_at_an_odd_offset_of_a_payload_decodes(encoding: WireEncoding) -> None:
    # A payload packs streams back to back: one may start at any byte.
    numel = 2**22
    positions = torch.tensor([0, 3, 70_000, 70_001, 2**21, numel - 1])
    data = encode_positions(positions, positions_summary(positions, numel), encoding)
    payload = torch.cat([torch.zeros(1, dtype=torch.uint8), data])
    decoded = decode_positions(payload[1:], numel, positions.numel(), encoding)
    assert decoded.tolist() == positions.tolist()


@pytest.mark.parametrize("encoding", SPARSE)
def test_a_strided_stream_decodes_like_a_contiguous_one(encoding: WireEncoding) -> None:
    # A 1-D uint8 view with a step (one byte of every two of a buffer) is a valid stream:
    # decoding it must not depend on its layout.
    numel = 2**22
    positions = torch.tensor([0, 3, 70_000, 70_001, 2**21, numel - 1])
    data = encode_positions(positions, positions_summary(positions, numel), encoding)
    buffer = torch.zeros(2 * data.numel(), dtype=torch.uint8)
    buffer[::2] = data
    decoded = decode_positions(buffer[::2], numel, positions.numel(), encoding)
    assert decoded.tolist() == positions.tolist()


def test_the_largest_uint32_escape_is_a_gap_of_2_to_the_32_not_0() -> None:
    # Up to 2**32 elements, escapes are uint32 and hold the gap less one: 2**32 - 1 (below
    # numel, so admitted) is a gap of 2**32, past the tensor from any position. Adding one in
    # uint32 would wrap it to a gap of 0: a repeated position, not strictly increasing.
    numel = 2**32
    stream = torch.cat([words(0, 0xFFFF), table(2**32 - 1)])
    with pytest.raises(MalformedPositions, match="reach past"):
        decode_positions(stream, numel, 2, WireEncoding.GAPS)
    # The largest escape that fits: from position 0 to the last element.
    stream = torch.cat([words(0, 0xFFFF), table(2**32 - 2)])
    assert decode_positions(stream, numel, 2, WireEncoding.GAPS).tolist() == [0, 2**32 - 1]


def reference_summary(values: list[int], numel: int) -> tuple[bool, bool, int]:
    """`in_range`, `ordered` and `escapes` of `values`, in Python's integers."""
    in_range = all(0 <= v < numel for v in values)
    ordered = in_range and all(a < b for a, b in itertools.pairwise(values))
    gaps = [b - a - 1 for a, b in zip([-1, *values], values, strict=False)]
    return in_range, ordered, sum(g >= 0xFFFF for g in gaps) if ordered else 0


@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),
    st.sampled_from([torch.int32, torch.int64]),
    st.integers(0, 2**34),
    st.sampled_from(["as drawn", "sorted", "near int32's ends"]),
)
def test_the_summary_of_any_positions_is_the_reference_and_ordered_ones_round_trip(
    drawn: list[int], dtype: torch.dtype, numel: int, shape: str
) -> None:
    """Any int32 / int64 values, in or out of range, increasing or not, including steps that
    wrap around in the positions' own dtype: the summary is what Python's integers say, and
    wherever it says ordered the gap stream decodes to the positions."""
    bits = 32 if dtype == torch.int32 else 64
    values = [(v + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1) for v in drawn]
    if shape == "sorted":
        values = sorted(set(values))
        numel = max([numel, *[v + 1 for v in values]])
    elif shape == "near int32's ends":  # a step from 2**31 - 1 to -2**31 wraps to +1
        values = [2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1, *values[:3]]
        values = [(v + 2**31) % 2**32 - 2**31 for v in values] if bits == 32 else values
    positions = torch.tensor(values, dtype=dtype)
    summary = positions_summary(positions, numel)
    assert (summary.in_range, summary.ordered, summary.escapes) == reference_summary(values, numel)
    assert summary.count == len(values) and summary.given_size == dtype.itemsize
    if summary.ordered:
        data = encode_positions(positions, summary, WireEncoding.GAPS)
        assert data.numel() == summary.nbytes(WireEncoding.GAPS)
        decoded = decode_positions(data, numel, len(values), WireEncoding.GAPS)
        assert decoded.tolist() == values


def test_the_gap_stream_of_a_strided_int32_view_is_its_contiguous_ones() -> None:
    numel = 2**22
    base = torch.tensor([0, 9, 3, 70_000, 70_001, 70_002, 2**21, 2**21, numel - 1, 0])
    strided = base.to(torch.int32)[::2]  # 0, 3, 70_001, 2**21, numel - 1
    summary = positions_summary(strided, numel)
    expected = encode_positions(strided.contiguous(), summary, WireEncoding.GAPS)
    assert torch.equal(encode_positions(strided, summary, WireEncoding.GAPS), expected)
    assert decode_positions(expected, numel, 5, WireEncoding.GAPS).tolist() == strided.tolist()
