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
from patchctx._kinds import same_kind
from patchctx.vllm import PatchPayload, decode_patches, decode_payload, encode_patches
from patchctx.vllm._codec import DTYPES, plan_payload, swap_bytes

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
        # Values of the patch's kind travel in its dtype (cast as a load casts them); of
        # another kind, as they are (the loader refuses or casts them, as in-process).
        kept = same_kind(sent.values.dtype, sent.dtype)
        assert same(got.values, sent.values.to(sent.dtype) if kept else sent.values), got.name
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
        # values in another dtype than the checkpoint's
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
    (length,) = struct.unpack_from("<Q", data)
    assert (8 + length) % 8 == 0
    sizes = {"I8": 1, "U8": 1, "I16": 2, "F64": 8}
    for tensor in opened(data)["tensors"].values():  # each starts at a multiple of its size
        assert tensor["data_offsets"][0] % sizes[tensor["dtype"]] == 0
    assert_round_trip(patches)


def test_decoded_tensors_are_views_of_a_buffer_and_copies_of_bytes() -> None:
    patch = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))
    data = encode_patches([patch])
    [copied] = decode_patches(data)
    copied.values.add_(1)  # writable, and `data` (immutable bytes) is not touched
    assert decode_patches(data)[0].values.tolist() == [1.0, 2.0]
    buffer = bytearray(data)
    [viewed] = decode_patches(buffer)
    buffer[-8:] = torch.tensor([5.0, 6.0]).numpy().tobytes()
    assert viewed.values.tolist() == [5.0, 6.0]  # a view of the buffer: no copy was made


def opened(data: bytes) -> dict[str, Any]:
    """A payload's header, its manifest opened up: versions, patches and tensors."""
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + length])
    manifest = json.loads(header.pop("__metadata__")["manifest"])
    return {**manifest, "tensors": header}


def data_of(data: bytes) -> bytes:
    (length,) = struct.unpack_from("<Q", data, 0)
    return data[8 + length :]


def with_header(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A payload of `header` (in `opened` form) or of `raw` header text, then `data`."""
    if raw is None:
        assert isinstance(header, dict)
        opened_up = dict(header)
        tensors = opened_up.pop("tensors")
        metadata = {
            "format": "patchctx.patches",
            "payload_version": "3",
            "manifest": json.dumps(opened_up),
        }
        raw = json.dumps({"__metadata__": metadata, **tensors}).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def test_the_format_is_the_documented_layout_and_safetensors_reads_it() -> None:
    from safetensors.torch import load

    patch = CheckpointWeightPatch(
        "w", (4,), torch.int32, torch.tensor([9], dtype=torch.int32), torch.tensor([2])
    )
    dense = CheckpointWeightPatch("b", (2, 2), torch.bfloat16, torch.ones(4))  # cast to bf16
    data = encode_patches([patch, dense], base_version=3, target_version=4)
    (length,) = struct.unpack_from("<Q", data)
    assert (8 + length) % 8 == 0
    assert opened(data) == {
        "base_version": 3,
        "target_version": 4,
        "patches": [
            {
                "name": "w",
                "shape": [4],
                "dtype": "int32",
                "values": "0.values",
                # one position of four: a 1-byte bitmask beats 2 bytes of gaps and 4 of int32
                "positions": {
                    "encoding": "bitmask",
                    "count": 1,
                    "tensors": ["0.bitmask"],
                    "compression": None,
                },
            },
            {
                "name": "b",
                "shape": [2, 2],
                "dtype": "bfloat16",
                "values": "1.values",
                "positions": None,
            },
        ],
        # largest elements first, back to back
        "tensors": {
            "0.values": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
            "1.values": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [4, 12]},
            "0.bitmask": {"dtype": "U8", "shape": [1], "data_offsets": [12, 13]},
        },
    }
    assert data_of(data)[0:4] == (9).to_bytes(4, "little")
    assert data_of(data)[12:13] == bytes([0b100])
    # The safetensors package alone reads it: tensors and the manifest.
    tensors = load(data)
    assert tensors["1.values"].dtype == torch.bfloat16 and tensors["1.values"].shape == (2, 2)
    assert tensors["0.values"].tolist() == [9]


def test_a_payload_is_a_storage_data_file_of_the_same_tensors() -> None:
    """The storage format and the payload name, type and lay out a patch's tensors alike."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import load, load_file

    from patchctx import read_manifest, save_patches

    patches = [
        CheckpointWeightPatch(
            "g",
            (4096,),
            torch.bfloat16,
            torch.ones(3, dtype=torch.bfloat16),
            torch.tensor([3, 99, 4000]),
        ),
        CheckpointWeightPatch("b", (2, 2), torch.float32, torch.arange(4.0)),
    ]
    folder = Path(tempfile.mkdtemp())
    manifest = read_manifest(save_patches(folder, patches, zstd=False) and folder)
    [name] = manifest.files
    stored = load_file(folder / name)
    sent = load(encode_patches(patches))
    assert sorted(stored) == sorted(sent)
    for key, tensor in stored.items():
        assert tensor.dtype == sent[key].dtype and torch.equal(tensor, sent[key]), key
    fields = ("name", "shape", "dtype", "values")
    for entry, got in zip(
        manifest.patches, opened(encode_patches(patches))["patches"], strict=True
    ):
        assert [getattr(entry, f) for f in fields] == [
            got["name"],
            tuple(got["shape"]),
            DTYPES[got["dtype"]],
            got["values"],
        ]
        if entry.encoding is not None:
            assert entry.encoding.value == got["positions"]["encoding"]
            assert list(entry.tensors) == got["positions"]["tensors"]


def test_payloads_of_the_format_before_are_refused_saying_so() -> None:
    old = b"PATCHCTX" + struct.pack("<II", 2, 0)
    with pytest.raises(InvalidPatchError, match="format before version 3"):
        decode_payload(old)


def test_the_checksum_and_intent_cover_every_byte_and_name_the_patch() -> None:
    patches = [
        CheckpointWeightPatch("a", (4,), torch.float32, torch.arange(4.0)),
        CheckpointWeightPatch("b", (8,), torch.float32, torch.ones(2), torch.tensor([1, 5])),
    ]
    for algorithm in ("xxh3_128", "sha256"):
        plan = plan_payload(patches, target_version=1)
        buffer = bytearray(plan.nbytes)
        sealed = plan.write_into(buffer, algorithm=algorithm)
        assert sealed.checksum.startswith(algorithm + ":")
        decode_payload(buffer, checksum=sealed.checksum, intent=sealed.intent)
        for at in range(len(buffer)):  # every byte, header included, is covered
            changed = bytearray(buffer)
            changed[at] ^= 1
            with pytest.raises(InvalidPatchError):
                decode_payload(changed, checksum=sealed.checksum)
        (length,) = struct.unpack_from("<Q", buffer)
        changed = bytearray(buffer)
        changed[8 + length] ^= 1  # the first data byte: patch "a"'s values
        with pytest.raises(InvalidPatchError, match=r"patches\[0\] 'a': is not what the trainer"):
            decode_payload(changed, intent=sealed.intent)


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
    block: Any = opened(data)["patches"]
    expected = {
        WireEncoding.INDICES: "int32",
        WireEncoding.GAPS: "gaps",
        WireEncoding.BITMASK: "bitmask",
    }
    assert block[0]["positions"]["encoding"] == expected[encoding]
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
        header = opened(encode_patches([patch]))
        tensors = header["tensors"]
        sizes = [tensors[k]["data_offsets"][1] - tensors[k]["data_offsets"][0] for k in tensors]
        assert sum(sizes) == patch_nbytes([patch])
    # the bitmask at 50%: 1/8 byte per element instead of 4 bytes per changed one
    assert len(encode_patches([big])) < numel // 8 + numel + 1024


def corrupted(patch: CheckpointWeightPatch, edit: dict[int, int]) -> bytes:
    """`patch`'s payload with bytes of its positions replaced (offset in the position stream:
    gap words, then escapes)."""
    data = bytearray(encode_patches([patch]))
    (size,) = struct.unpack_from("<Q", data, 0)
    header = opened(bytes(data))
    places = [
        header["tensors"][key]["data_offsets"]
        for key in header["patches"][0]["positions"]["tensors"]
    ]
    stream = [8 + size + at for begin, end in places for at in range(begin, end)]
    for offset, value in edit.items():
        data[stream[offset]] = value
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


def edited(change: str) -> bytes:
    """A valid payload with one thing in its header changed (by `change`, a Python statement
    over `h`, the opened header, `p`, its first patch, and `t`, its tensors)."""
    data = valid_payload()
    h = opened(data)
    exec(change, {"h": h, "p": h["patches"][0], "t": h["tensors"]})
    return with_header(h, data_of(data))


def metadata(**fields: str) -> bytes:
    """A header of only `__metadata__`, `fields` replacing the valid ones."""
    valid = {"format": "patchctx.patches", "payload_version": "3", "manifest": "{}"}
    return json.dumps({"__metadata__": {**valid, **fields}}).encode()


MALFORMED = {
    "the format before": b"PATCHCTX" + valid_payload()[8:],
    "a pickle": pickle.dumps([{"name": "w"}]),
    "torch.save bytes": b"PK\x03\x04" + bytes(40),
    "empty": b"",
    "short prefix": b"\x01\x00",
    "header past the end": struct.pack("<Q", 1 << 20) + b"{}",
    "huge header length": struct.pack("<Q", 2**63) + b"{}",
    "truncated data": valid_payload()[:-8],
    "trailing bytes": valid_payload() + bytes(8),
    "misaligned data": struct.pack("<Q", 3) + b"{} ",
    "not utf-8": with_header(None, raw=b'{"a": "\xff"}'),
    "not json": with_header(None, raw=b"{'patches': []}"),
    "NaN constant": with_header(None, raw=b'{"x": NaN}'),
    "duplicate key": with_header(None, raw=b'{"__metadata__":{},"__metadata__":{}}'),
    "deep nesting": with_header(None, raw=b"[" * 100_000 + b"]" * 100_000),
    "huge integer": with_header(None, raw=b'{"x": ' + b"9" * 5000 + b"}"),
    "a list header": with_header(None, raw=b"[]"),
    "no metadata": with_header(None, raw=b"{}"),
    "another format": with_header(None, raw=metadata(format="other")),
    "a future payload version": with_header(None, raw=metadata(payload_version="4")),
    "manifest not json": with_header(None, raw=metadata(manifest="{")),
    "manifest not an object": with_header(None, raw=metadata(manifest="[]")),
    "missing key": edited("del h['target_version']"),
    "unknown key": edited("h['code'] = 'import os'"),
    "bool version": edited("h['base_version'] = True"),
    "float version": edited("h['base_version'] = 1.5"),
    "patches not a list": edited("h['patches'] = {}"),
    "patch not an object": edited("h['patches'][0] = 'w'"),
    "patch missing a key": edited("del p['positions']"),
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
    "values dtype of the same kind": edited("p['values_dtype'] = 'float32'"),
    "values stored as something": edited("p['values_stored_as'] = 'int8'"),
    "values of another tensor": edited("p['values'] = '1.values'"),
    "values of no tensor": edited("p['values'] = 'nope'"),
    "a tensor named twice": edited("h['patches'][1]['values'] = '0.values'"),
    "a tensor no patch names": edited(
        "t['extra'] = {'dtype': 'U8', 'shape': [0], 'data_offsets': [0, 0]}"
    ),
    "tensor dtype unknown": edited("t['0.values']['dtype'] = 'C64'"),
    "tensor dtype retyped": edited("t['0.values']['dtype'] = 'F16'"),
    "tensor with an extra key": edited("t['0.values']['stride'] = [1]"),
    "tensor not an object": edited("t['0.values'] = [0, 3]"),
    "offsets not a pair": edited("t['0.values']['data_offsets'] = [0]"),
    "offsets past the end": edited("t['0.values']['data_offsets'] = [1 << 20, (1 << 20) + 6]"),
    "negative offset": edited("t['0.values']['data_offsets'] = [-8, -2]"),
    "offsets of another size": edited("t['0.values']['data_offsets'][1] += 2"),
    "misaligned tensor": edited(
        "b = t['1.values']['data_offsets']; t['1.values']['data_offsets'] = [b[0] + 1, b[1] + 1]"
    ),
    "tensors overlap": edited("t['1.values']['data_offsets'] = t['0.values']['data_offsets']"),
    "shape of another count": edited("t['0.values']['shape'] = [2]"),
    "positions not an object": edited("p['positions'] = 'bitmask'"),
    "positions with an extra key": edited("p['positions']['stride'] = 1"),
    "positions of an unknown encoding": edited("p['positions']['encoding'] = 'rle'"),
    "positions compressed": edited("p['positions']['compression'] = 'zstd'"),
    "positions count differs": edited("p['positions']['count'] = 2"),
    "positions count negative": edited("p['positions']['count'] = -1"),
    "positions of too many tensors": edited("p['positions']['tensors'] += ['1.values']"),
    "escapes on flat positions": edited("p['positions']['escapes'] = 0"),
    "a gap stream without escapes": edited("del h['patches'][2]['positions']['escapes']"),
    "escapes count differs": edited("h['patches'][2]['positions']['escapes'] = 1"),
    "int32 read as int64": edited("p['positions']['encoding'] = 'int64'"),
    "a bitmask read as int32": edited("p['positions']['encoding'] = 'int32'"),
    "gaps read as a bitmask": edited("h['patches'][2]['positions']['encoding'] = 'bitmask'"),
    "a dense patch of fewer values": edited("h['patches'][1]['shape'] = [5]"),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_payloads_raise_invalid_patch_error(data: bytes) -> None:
    with pytest.raises(InvalidPatchError, match="malformed patch payload"):
        decode_payload(data)


@pytest.mark.parametrize("data", [None, "PATCHCTX", 12, [1, 2]])
def test_a_payload_must_be_bytes(data: object) -> None:
    with pytest.raises(InvalidPatchError, match="a payload is bytes"):
        decode_payload(data)


def test_a_pickle_is_never_unpickled() -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("unpickled!",))

    # Even with a header length in front, the rest is read as JSON + raw bytes, never unpickled.
    blob = pickle.dumps(Boom())
    data = struct.pack("<Q", len(blob)) + blob
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
    header = opened(valid_payload())
    patch = header["patches"][0]
    tensors = header["tensors"]
    target = data.draw(
        st.sampled_from([header, patch, patch["positions"], tensors, tensors["0.values"]])
    )
    key = data.draw(st.sampled_from(sorted(set(target) - {"tensors"})))
    target[key] = data.draw(JSON)
    outcome(with_header(header, data_of(valid_payload())))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzzed_bytes_after_a_valid_prefix_never_raise_anything_else(tail: bytes) -> None:
    outcome(struct.pack("<Q", len(tail)) + tail)
