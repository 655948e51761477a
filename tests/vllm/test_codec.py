"""The payload format of ``patchctx.vllm``: round trips, strict validation, fuzzed corruption.

The format needs no vLLM, but ``patchctx.vllm`` does (it refuses to import without it), so
these tests live in the lane.
"""

from __future__ import annotations

import json
import math
import pickle
import struct

import pytest

pytest.importorskip("vllm")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchctx import CheckpointWeightPatch, InvalidPatchError
from patchctx.vllm import PatchPayload, decode_patches, decode_payload, encode_patches
from patchctx.vllm._codec import DTYPES, MAGIC, swap_bytes

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


def assert_round_trip(patches: list[CheckpointWeightPatch], **versions: object) -> PatchPayload:
    payload = decode_payload(encode_patches(patches, **versions))  # type: ignore[arg-type]
    assert len(payload.patches) == len(patches)
    for got, sent in zip(payload.patches, patches, strict=True):
        assert got.name == sent.name and got.shape == tuple(sent.shape)
        assert got.dtype == sent.dtype
        assert same(got.values, sent.values), got.name
        assert same(got.indices, sent.indices), got.name
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
    assert (magic, version) == (MAGIC, 1) and (16 + size) % 8 == 0
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
                "indices": {"dtype": "int64", "offset": 8, "numel": 1},
            }
        ],
    }
    data_section = data[16 + size :]
    assert data_section[0:4] == (9).to_bytes(4, "little")
    assert data_section[8:16] == (2).to_bytes(8, "little")


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
        ],
        base_version=1,
        target_version=2,
    )


def with_header(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-(16 + len(text)) % 8)
    return struct.pack("<8sII", MAGIC, 1, len(text)) + text + data


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
    "future format": MAGIC + struct.pack("<II", 2, 0),
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
    "indices of a float dtype": edited("p['indices']['dtype'] = 'float32'"),
    "values past the end": edited("p['values']['offset'] = 1 << 20"),
    "values numel past the end": edited("p['values']['numel'] = 1 << 40"),
    "misaligned values": edited("p['values']['offset'] = 1"),
    "negative offset": edited("p['values']['offset'] = -8"),
    "bool numel": edited("p['values']['numel'] = True"),
    "counts differ": edited("p['indices']['numel'] = 2"),
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
