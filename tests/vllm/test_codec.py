"""The payload format of ``patchctx.vllm``: round trips, strict validation, fuzzed corruption.

The format needs no vLLM, but ``patchctx.vllm`` does (it refuses to import without it), so
these tests live in the lane.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchctx import (
    CheckpointWeightPatch,
    IntSentinel,
    InvalidPatchError,
    WireEncoding,
    masked_copy,
    wire_encoding,
)
from patchctx._encoding import index_dtype
from patchctx.vllm import PatchPayload, decode_patches, decode_payload, encode_patches
from patchctx.vllm._codec import DTYPES, FORMAT_VERSION, MAGIC, swap_bytes

FUZZ_ROUND_TRIPS = settings(max_examples=60, deadline=None)
FLOATS = ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INTS = ("int8", "uint8", "int16", "int32", "int64", "bool")


def sample(dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(count, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high + 1, (count,), generator=g).to(dtype)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def same_positions(got: torch.Tensor | None, sent: torch.Tensor | None, numel: int) -> bool:
    """The positions sent, as `index_dtype(numel)` integers when they are in range (the wire
    carries positions, not their dtype); as sent (dtype included) when some are not."""
    if got is None or sent is None:
        return got is None and sent is None
    in_range = sent.numel() == 0 or bool((sent >= 0).all() and (sent < numel).all())
    expected = sent.to(index_dtype(numel)) if in_range else sent
    return same(got, expected)


def assert_round_trip(patches: list[CheckpointWeightPatch], **versions: object) -> PatchPayload:
    payload = decode_payload(encode_patches(patches, **versions))  # type: ignore[arg-type]
    assert len(payload.patches) == len(patches)
    for got, sent in zip(payload.patches, patches, strict=True):
        assert got.name == sent.name and got.shape == tuple(sent.shape)
        assert got.dtype == sent.dtype
        assert same(got.values, sent.values), got.name
        assert same_positions(got.indices, sent.indices, math.prod(sent.shape)), got.name
    return payload


@pytest.mark.parametrize("dtype_name", FLOATS + INTS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sparse_and_dense_patches_round_trip_bit_for_bit(
    dtype_name: str, index_dtype: torch.dtype
) -> None:
    dtype = DTYPES[dtype_name]
    indices = torch.tensor([0, 5, 11, 3], dtype=index_dtype)
    patches = [
        CheckpointWeightPatch("a.weight", (3, 4), dtype, sample(dtype, 4, 1), indices),
        CheckpointWeightPatch("a.bias", (5,), dtype, sample(dtype, 5, 2)),
        # values in another dtype than the checkpoint's (cast when loaded, not when encoded)
        CheckpointWeightPatch("b", (2, 2), dtype, sample(torch.float32, 1, 3), indices[:1]),
    ]
    assert_round_trip(patches)


def test_special_floats_survive_bit_for_bit() -> None:
    values = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -3.0e38])
    patch = CheckpointWeightPatch("w", (5,), torch.float32, values)
    [got] = decode_patches(encode_patches([patch]))
    assert same(got.values, values)


@pytest.mark.parametrize("sentinel", [0, 7, 255])
def test_encoding_inside_a_callers_int_sentinel_region_keeps_every_byte(sentinel: int) -> None:
    # The payload's bytes are copied into place with copy_: a caller's region must not keep
    # the (zero) destination wherever a byte equals its sentinel.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float32)  # every byte value
    patch = CheckpointWeightPatch("w", (64,), torch.float32, values)
    expected = encode_patches([patch])
    with masked_copy(strategy=IntSentinel(value=sentinel)):
        assert encode_patches([patch]) == expected
    [got] = decode_patches(expected)
    assert same(got.values, values)


def test_values_that_are_one_element_strided_or_lazily_negated_views_encode() -> None:
    # ``z.imag`` of one complex element is "contiguous" with stride 2 (a byte view needs 1);
    # ``z.conj().imag`` is a lazy negation besides.
    z = torch.tensor([1 + 2j])
    for values, expected in ((z.imag, 2.0), (z.conj().imag, -2.0)):
        patch = CheckpointWeightPatch("w", (4,), torch.float32, values, torch.tensor([2]))
        [got] = decode_patches(encode_patches([patch]))
        assert got.values.tolist() == [expected]


def test_empty_payloads_and_empty_patches() -> None:
    assert decode_payload(encode_patches([])) == PatchPayload(())
    empty = CheckpointWeightPatch("w", (0, 4), torch.bfloat16, torch.empty(0, dtype=torch.bfloat16))
    nothing = CheckpointWeightPatch(
        "v", (3,), torch.float32, torch.empty(0), torch.empty(0, dtype=torch.int64)
    )
    assert_round_trip([empty, nothing])


@pytest.mark.parametrize(
    ("base", "target"), [(None, None), (0, 1), ("step-9", "step-10"), (-(2**63), 2**63 - 1)]
)
def test_versions_round_trip(base: object, target: object) -> None:
    payload = assert_round_trip([], base_version=base, target_version=target)
    assert (payload.base_version, payload.target_version) == (base, target)
    assert type(payload.target_version) is type(target)


def test_non_contiguous_and_odd_sized_tensors_are_aligned() -> None:
    values = torch.arange(12, dtype=torch.float64).view(3, 4).t()[1]  # strided view
    patches = [
        CheckpointWeightPatch("odd", (3,), torch.int8, torch.tensor([1, 2, 3], dtype=torch.int8)),
        CheckpointWeightPatch("f64", (3,), torch.float64, values),
        CheckpointWeightPatch("i16", (1,), torch.int16, torch.tensor([7], dtype=torch.int16)),
    ]
    data = encode_patches(patches)
    assert len(data) % 8 == 0
    assert_round_trip(patches)


def test_decoded_tensors_are_writable_and_independent_of_the_input_bytes() -> None:
    patch = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))
    data = bytearray(encode_patches([patch]))
    [got] = decode_patches(data)
    data[-8:] = bytes(8)
    assert got.values.tolist() == [1.0, 2.0]
    got.values.add_(1)  # no read-only buffer warnings, no shared memory with `data`


def test_the_format_is_the_documented_layout() -> None:
    patch = CheckpointWeightPatch(
        "w", (4,), torch.int32, torch.tensor([9], dtype=torch.int32), torch.tensor([2])
    )
    data = encode_patches([patch], base_version=3, target_version=4)
    magic, version, size = struct.unpack_from("<8sII", data)
    assert (magic, version) == (MAGIC, 2) and (16 + size) % 8 == 0
    header = json.loads(data[16 : 16 + size])
    assert header == {
        "base_version": 3,
        "target_version": 4,
        "data_bytes": 16,
        "patches": [
            {
                "name": "w",
                "shape": [4],
                "dtype": "int32",
                "values": {"dtype": "int32", "offset": 0, "numel": 1},
                # one position of four: a 1-byte bitmask beats 2 bytes of gaps and 4 of int32
                "indices": {"encoding": "bitmask", "offset": 8, "nbytes": 1},
            }
        ],
    }
    data_section = data[16 + size :]
    assert data_section[0:4] == (9).to_bytes(4, "little")
    assert data_section[8:9] == bytes([0b100])


def version_1_payload(indices: torch.Tensor) -> bytes:
    """A payload as patchctx wrote it before positions had encodings (format version 1)."""
    values = torch.tensor([1.5, -2.0], dtype=torch.float32)
    header = {
        "base_version": None,
        "target_version": 7,
        "data_bytes": 16,
        "patches": [
            {
                "name": "w",
                "shape": [3, 4],
                "dtype": "float32",
                "values": {"dtype": "float32", "offset": 0, "numel": 2},
                "indices": {"dtype": "int32", "offset": 8, "numel": 2},
            }
        ],
    }
    text = json.dumps(header).encode()
    text += b" " * (-(16 + len(text)) % 8)
    data = values.numpy().tobytes() + indices.to(torch.int32).numpy().tobytes()
    return struct.pack("<8sII", MAGIC, 1, len(text)) + text + data


def test_version_1_payloads_are_still_read() -> None:
    payload = decode_payload(version_1_payload(torch.tensor([11, 4])))
    [patch] = payload.patches
    assert payload.target_version == 7
    assert patch.indices is not None and patch.indices.tolist() == [11, 4]
    assert patch.indices.dtype == torch.int32 and patch.values.tolist() == [1.5, -2.0]


# ------------------------------------------------------------------------- position encodings


def sparse_patch(numel: int, positions: torch.Tensor, dtype: torch.dtype) -> CheckpointWeightPatch:
    values = sample(dtype, positions.numel(), 5)
    return CheckpointWeightPatch("layer.weight", (numel,), dtype, values, positions)


@pytest.mark.parametrize(
    ("every", "encoding"),
    [(2**17, WireEncoding.INDICES), (300, WireEncoding.GAPS), (3, WireEncoding.BITMASK)],
)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32", "int8"])
def test_every_encoding_travels_and_decodes_to_the_same_positions(
    every: int, encoding: WireEncoding, dtype_name: str
) -> None:
    numel = 2**20
    positions = torch.arange(7, numel, every, dtype=torch.int64)
    patch = sparse_patch(numel, positions, DTYPES[dtype_name])
    assert wire_encoding(patch) is encoding
    data = encode_patches([patch])
    block: Any = header_of(data)["patches"]
    expected = {
        WireEncoding.INDICES: "int32",
        WireEncoding.GAPS: "gaps",
        WireEncoding.BITMASK: "bitmask",
    }
    assert block[0]["indices"]["encoding"] == expected[encoding]
    [got] = decode_patches(data)
    assert got.indices is not None and got.indices.dtype == torch.int32
    assert torch.equal(got.indices.long(), positions) and same(got.values, patch.values)


@FUZZ_ROUND_TRIPS
@given(
    numel=st.integers(1, 70_000),
    density=st.sampled_from([0.0001, 0.003, 0.05, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
    edges=st.booleans(),
)
def test_random_positions_round_trip_through_the_payload(
    numel: int, density: float, seed: int, edges: bool
) -> None:
    chosen = torch.rand(numel, generator=torch.Generator().manual_seed(seed)) < density
    if edges:
        chosen[[0, -1]] = True
    positions = chosen.nonzero().view(-1)
    patch = sparse_patch(numel, positions.to(torch.int32), torch.bfloat16)
    [got] = decode_patches(encode_patches([patch]))
    assert got.indices is not None and torch.equal(got.indices, positions.to(torch.int32))


def test_payload_size_follows_patch_nbytes() -> None:
    from patchctx import patch_nbytes

    numel = 2**20
    small = sparse_patch(numel, torch.arange(0, numel, 1000), torch.bfloat16)
    big = sparse_patch(numel, torch.arange(0, numel, 2), torch.bfloat16)
    for patch in (small, big):
        entries: Any = header_of(encode_patches([patch]))["patches"]
        block = entries[0]["indices"]
        assert block["nbytes"] + patch.values.numel() * 2 == patch_nbytes([patch])
    # the bitmask at 50%: 1/8 byte per element instead of 4 bytes per changed one
    assert len(encode_patches([big])) < numel // 8 + numel + 1024


def corrupted(patch: CheckpointWeightPatch, edit: dict[int, int]) -> bytes:
    """`patch`'s payload with bytes of its positions block replaced (offset in the block)."""
    data = bytearray(encode_patches([patch]))
    size = struct.unpack_from("<I", data, 12)[0]
    block: Any = header_of(bytes(data))["patches"]
    start = 16 + size + block[0]["indices"]["offset"]
    for offset, value in edit.items():
        data[start + offset] = value
    return bytes(data)


def test_malformed_position_streams_are_refused_naming_the_patch() -> None:
    bitmask = sparse_patch(10, torch.tensor([1, 2, 3, 5, 8]), torch.bfloat16)
    assert wire_encoding(bitmask) is WireEncoding.BITMASK
    with pytest.raises(InvalidPatchError, match=r"patches\[0\] 'layer.weight'.*past the tensor"):
        decode_payload(corrupted(bitmask, {1: 0b100}))  # bit 10 of a 10-element tensor
    with pytest.raises(InvalidPatchError, match="more than the 5 bits announced"):
        decode_payload(corrupted(bitmask, {0: 0b10101110}))
    with pytest.raises(InvalidPatchError, match="sets 4 bits, 5 were announced"):
        decode_payload(corrupted(bitmask, {0: 0b00001110}))
    gaps = sparse_patch(2**17, torch.tensor([5, 100_000, 100_007]), torch.bfloat16)
    assert wire_encoding(gaps) is WireEncoding.GAPS
    # the escape entry (after three words) made to reach past the tensor
    with pytest.raises(InvalidPatchError, match="escape must hold a gap"):
        decode_payload(corrupted(gaps, {6: 0xFF, 7: 0xFF, 8: 0xFF, 9: 0xFF}))
    # a word made an escape: the stream is now too short for its escapes
    with pytest.raises(InvalidPatchError, match="with 2 escapes is 14 bytes"):
        decode_payload(corrupted(gaps, {4: 0xFF, 5: 0xFF}))
    # words made larger: the positions reach past the tensor
    with pytest.raises(InvalidPatchError, match="reach past"):
        decode_payload(corrupted(gaps, {0: 0xFE, 1: 0xFF, 4: 0xFE, 5: 0xFF}))


def test_huge_tensors_travel_as_gaps_without_being_allocated() -> None:
    numel = 2**40  # int64 positions, uint64 escapes
    positions = torch.tensor([0, 5, 2**33, numel - 1])
    [got] = decode_patches(encode_patches([sparse_patch(numel, positions, torch.float32)]))
    assert got.indices is not None and got.indices.dtype == torch.int64
    assert got.indices.tolist() == positions.tolist()


def test_byte_swapping_for_big_endian_hosts_is_an_involution() -> None:
    raw = torch.arange(16, dtype=torch.uint8)
    swapped = swap_bytes(raw, 4)
    assert swapped[:4].tolist() == [3, 2, 1, 0]
    assert torch.equal(swap_bytes(swapped, 4), raw)


# ------------------------------------------------------------------------- encoding errors


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (CheckpointWeightPatch("", (1,), torch.float32, torch.ones(1)), "non-empty str"),
        (CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(3)), "needs 2 values"),
        (CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(1, 2)), "1-D tensor"),
        (CheckpointWeightPatch("w", (2,), torch.complex64, torch.ones(2)), "cannot be encoded"),
        (CheckpointWeightPatch("w", (-1,), torch.float32, torch.ones(1)), "non-negative"),
        (
            CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(2), torch.tensor([1.0])),
            "int32 or int64",
        ),
        (
            CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(2), torch.tensor([1])),
            "1 indices for 2 values",
        ),
    ],
)
def test_encoding_refuses_malformed_patches(patch: CheckpointWeightPatch, message: str) -> None:
    with pytest.raises(InvalidPatchError, match=message):
        encode_patches([patch])


@pytest.mark.parametrize("version", [True, 1.5, 2**63, b"x", ["a"]])
def test_encoding_refuses_versions_that_are_not_str_or_int(version: object) -> None:
    with pytest.raises(InvalidPatchError, match="base_version"):
        encode_patches([], base_version=version)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- decoding errors


def valid_payload() -> bytes:
    return encode_patches(
        [
            CheckpointWeightPatch(
                "model.layers.0.mlp.down_proj.weight",
                (4, 8),
                torch.bfloat16,
                torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16),
                torch.tensor([0, 9, 31], dtype=torch.int32),
            ),
            CheckpointWeightPatch("model.norm.weight", (4,), torch.float32, torch.ones(4)),
            CheckpointWeightPatch(  # positions as gaps
                "model.layers.0.input_layernorm.weight",
                (4096,),
                torch.bfloat16,
                torch.tensor([0.25, 4.0, -1.0], dtype=torch.bfloat16),
                torch.tensor([3, 100, 4000], dtype=torch.int32),
            ),
        ],
        base_version=1,
        target_version=2,
    )


def with_header(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-(16 + len(text)) % 8)
    return struct.pack("<8sII", MAGIC, FORMAT_VERSION, len(text)) + text + data


def header_of(data: bytes) -> dict[str, object]:
    size = struct.unpack_from("<I", data, 12)[0]
    header: dict[str, object] = json.loads(data[16 : 16 + size])
    return header


def data_of(data: bytes) -> bytes:
    size = struct.unpack_from("<I", data, 12)[0]
    return data[16 + size :]


def edited(change: str) -> bytes:
    """A valid payload with one thing in its header changed (by `change`, a Python statement
    over `h`, the header, and `p`, its first patch)."""
    data = valid_payload()
    h = header_of(data)
    p = h["patches"][0]  # type: ignore[index]
    exec(change, {"h": h, "p": p})
    return with_header(h, data_of(data))


MALFORMED = {
    "wrong magic": b"PATCHCTY" + valid_payload()[8:],
    "a pickle": pickle.dumps([{"name": "w"}]),
    "torch.save bytes": b"PK\x03\x04" + bytes(40),
    "empty": b"",
    "short prefix": MAGIC + b"\x01\x00",
    "future format": MAGIC + struct.pack("<II", 3, 0),
    "version 0": MAGIC + struct.pack("<II", 0, 0),
    "header past the end": MAGIC + struct.pack("<II", 1, 1 << 20) + b"{}",
    "truncated data": valid_payload()[:-8],
    "trailing bytes": valid_payload() + bytes(8),
    "misaligned data section": MAGIC + struct.pack("<II", 1, 3) + b"{} ",
    "not utf-8": with_header(None, raw=b'{"a": "\xff"}'),
    "not json": with_header(None, raw=b"{'patches': []}"),
    "NaN constant": with_header(None, raw=b'{"data_bytes": NaN}'),
    "duplicate key": with_header(
        None,
        raw=b'{"base_version":null,"target_version":null,"data_bytes":0,"patches":[],"patches":[]}',
    ),
    "deep nesting": with_header(None, raw=b"[" * 100_000 + b"]" * 100_000),
    "huge integer": with_header(None, raw=b'{"data_bytes": ' + b"9" * 5000 + b"}"),
    "a list header": with_header([]),
    "missing key": edited("del h['target_version']"),
    "unknown key": edited("h['code'] = 'import os'"),
    "negative data_bytes": edited("h['data_bytes'] = -8"),
    "bool version": edited("h['base_version'] = True"),
    "float version": edited("h['base_version'] = 1.5"),
    "patches not a list": edited("h['patches'] = {}"),
    "patch not an object": edited("h['patches'][0] = 'w'"),
    "patch missing a key": edited("del p['indices']"),
    "patch with an extra key": edited("p['extra'] = 1"),
    "empty name": edited("p['name'] = ''"),
    "name not a string": edited("p['name'] = 7"),
    "negative dimension": edited("p['shape'] = [4, -8]"),
    "float dimension": edited("p['shape'] = [4.0, 8]"),
    "bool dimension": edited("p['shape'] = [True, 8]"),
    "shape not a list": edited("p['shape'] = 32"),
    "too many dimensions": edited("p['shape'] = [1] * 65"),
    "too many elements": edited("p['shape'] = [2**40, 2**40]"),
    "unknown dtype": edited("p['dtype'] = 'object'"),
    "dtype not a string": edited("p['dtype'] = ['float32']"),
    "torch. prefix": edited("p['dtype'] = 'torch.float32'"),
    "values dtype unknown": edited("p['values']['dtype'] = 'complex64'"),
    "indices of a float dtype": edited("p['indices']['encoding'] = 'float32'"),
    "indices of an unknown encoding": edited("p['indices']['encoding'] = 'rle'"),
    "indices block of version 1": edited(
        "p['indices'] = {'dtype': 'int32', 'offset': 8, 'numel': 3}"
    ),
    "indices past the end": edited("p['indices']['offset'] = 1 << 20"),
    "indices nbytes past the end": edited("p['indices']['nbytes'] = 1 << 40"),
    "indices truncated": edited("p['indices']['nbytes'] -= 1"),
    "indices overlong": edited("p['indices']['nbytes'] += 1"),
    "misaligned int32 indices": edited("p['indices'].update(encoding='int32', offset=9)"),
    "a bitmask read as int32": edited("p['indices']['encoding'] = 'int32'"),
    "a bitmask read as gaps": edited("p['indices']['encoding'] = 'gaps'"),
    "gaps read as a bitmask": edited("h['patches'][2]['indices']['encoding'] = 'bitmask'"),
    "gaps truncated": edited("h['patches'][2]['indices']['nbytes'] = 4"),
    "gaps with a position too many": edited("h['patches'][2]['values']['numel'] = 4"),
    "version 1 read as version 2": version_1_payload(torch.tensor([11, 4]))[:8]
    + struct.pack("<I", 2)
    + version_1_payload(torch.tensor([11, 4]))[12:],
    "values past the end": edited("p['values']['offset'] = 1 << 20"),
    "values numel past the end": edited("p['values']['numel'] = 1 << 40"),
    "misaligned values": edited("p['values']['offset'] = 1"),
    "negative offset": edited("p['values']['offset'] = -8"),
    "bool numel": edited("p['values']['numel'] = True"),
    "counts differ": edited("p['values']['numel'] = 2"),
    "more values than positions": edited("p['values']['numel'] = 4"),
    "dense count differs": edited("h['patches'][1]['values']['numel'] = 3"),
    "block not an object": edited("p['values'] = [0, 3]"),
    "block with an extra key": edited("p['values']['stride'] = 1"),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_payloads_raise_invalid_patch_error(data: bytes) -> None:
    with pytest.raises(InvalidPatchError, match="malformed patch payload"):
        decode_payload(data)


@pytest.mark.parametrize("data", [None, "PATCHCTX", 12, [1, 2]])
def test_a_payload_must_be_bytes(data: object) -> None:
    with pytest.raises(InvalidPatchError, match="a payload is bytes"):
        decode_payload(data)  # type: ignore[arg-type]


def test_a_pickle_is_never_unpickled() -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("unpickled!",))

    # Even with our magic in front, the rest is read as JSON + raw bytes, never unpickled.
    data = MAGIC + struct.pack("<II", 1, 0) + pickle.dumps(Boom())
    with pytest.raises(InvalidPatchError):
        decode_payload(data)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(data: bytes) -> None:
    """Decoding either succeeds with well-formed patches or raises InvalidPatchError."""
    try:
        payload = decode_payload(data)
    except InvalidPatchError:
        return
    for patch in payload.patches:
        assert isinstance(patch.values, torch.Tensor) and patch.values.ndim == 1
        if patch.indices is None:
            assert patch.values.numel() == math.prod(patch.shape)
        else:
            assert patch.indices.numel() == patch.values.numel()


@FUZZ
@given(st.data())
def test_fuzzed_byte_edits_never_raise_anything_else(data: st.DataObject) -> None:
    payload = bytearray(valid_payload())
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(payload) - 1))
        payload[position] = data.draw(st.integers(0, 255))
    outcome(bytes(payload))


@FUZZ
@given(st.data())
def test_fuzzed_truncations_and_splices_never_raise_anything_else(data: st.DataObject) -> None:
    payload = valid_payload()
    start = data.draw(st.integers(0, len(payload)))
    stop = data.draw(st.integers(start, len(payload)))
    insert = data.draw(st.binary(max_size=32))
    outcome(payload[:start] + insert + payload[stop:])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(st.data())
def test_fuzzed_headers_never_raise_anything_else(data: st.DataObject) -> None:
    header = header_of(valid_payload())
    patch = header["patches"][0]  # type: ignore[index]
    target = data.draw(st.sampled_from([header, patch, patch["values"], patch["indices"]]))
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(JSON)
    outcome(with_header(header, data_of(valid_payload())))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzzed_bytes_after_a_valid_prefix_never_raise_anything_else(tail: bytes) -> None:
    outcome(MAGIC + struct.pack("<II", 1, len(tail)) + tail)
