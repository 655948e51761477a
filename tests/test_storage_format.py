"""The patch file format: safetensors files plus a manifest, read and written by anyone.

Round trips are bit-exact for every dtype and every position encoding (with and without zstd);
a reader with safetensors alone (no patchctx imported) decodes what `save_patches` writes, and
`load_patches` reads what a producer with safetensors alone writes; every torn, corrupted or
mismatched update is refused with `StoredUpdateError`, also when the attacker fixes the
checksums up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    PatchError,
    PositionEncoding,
    StoredUpdateError,
    load_patches,
    read_manifest,
    save_patches,
)
from patchctx.testing import DEFAULT_DTYPES
from tests.support.models import random_tensor, same_bits

# Every dtype the strategy conformance table covers, and one safetensors has no code for
# (stored as its bytes).
DTYPES = [*DEFAULT_DTYPES, torch.complex128]
ENCODINGS = list(PositionEncoding)


def sparse(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, positions: torch.Tensor, seed: int = 0
) -> CheckpointWeightPatch:
    values = random_tensor((positions.numel(),), dtype, torch.Generator().manual_seed(seed))
    return CheckpointWeightPatch(name, shape, dtype, values, positions)


def assert_same_patches(
    actual: list[CheckpointWeightPatch], expected: list[CheckpointWeightPatch]
) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert (got.name, tuple(got.shape), got.dtype) == (want.name, tuple(want.shape), want.dtype)
        assert same_bits(got.values.reshape(-1), want.values.reshape(-1))
        if want.indices is None:
            assert got.indices is None
        else:
            assert got.indices is not None
            assert torch.equal(got.indices.long(), want.indices.long())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.value)
@pytest.mark.parametrize("zstd", [False, True], ids=["raw", "zstd"])
def test_round_trip_is_bit_exact_for_every_dtype_and_encoding(
    tmp_path: Path, dtype: torch.dtype, encoding: PositionEncoding, zstd: bool
) -> None:
    generator = torch.Generator().manual_seed(1)
    # Gaps over 0xFFFF (escapes) and a position at the very end.
    positions = torch.cat([torch.tensor([0, 5, 6]), torch.tensor([70_000, 200_001, 299_999])]).to(
        torch.int64
    )
    patches = [
        sparse("w.sparse", (300, 1000), dtype, positions),
        CheckpointWeightPatch("w.dense", (3, 5), dtype, random_tensor((15,), dtype, generator)),
        sparse("w.empty", (8,), dtype, torch.empty(0, dtype=torch.int64)),
    ]
    manifest = save_patches(tmp_path, patches, positions=encoding, zstd=zstd)
    stored = [entry.encoding for entry in manifest.patches]
    assert stored == [encoding, None, encoding]
    assert [entry.zstd for entry in manifest.patches] == [zstd, False, zstd]
    assert_same_patches(load_patches(tmp_path), patches)


@given(
    numel=st.integers(1, 5000),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.bool]),
)
def test_automatic_encoding_round_trips_and_is_the_smallest(
    tmp_path_factory: pytest.TempPathFactory, numel: int, density: float, seed: int, dtype: Any
) -> None:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(numel, generator=generator) < density
    positions = chosen.nonzero().reshape(-1).to(torch.int32)
    patch = sparse("t", (numel,), dtype, positions, seed)
    folder = tmp_path_factory.mktemp("auto")
    manifest = save_patches(folder, [patch], zstd=False)
    assert_same_patches(load_patches(folder), [patch])
    nnz = positions.numel()
    escapes = 0  # numel < 0x10000 here
    sizes = {
        "int32": 4 * nnz,
        "int64": 8 * nnz,
        "gaps": 2 * nnz + escapes,
        "bitmask": -(-numel // 8),
    }
    entry = manifest.patches[0]
    assert entry.encoding is not None
    assert sizes[entry.encoding.value] == min(sizes.values())


def test_the_choice_follows_size_and_order(tmp_path: Path) -> None:
    numel = 1 << 20
    rare = torch.arange(0, numel, 5000)  # gaps
    dense = torch.arange(0, numel, 3)  # bitmask
    unsorted = torch.tensor([9, 2, 7])  # only flat indices carry it
    huge = torch.tensor([0, 2**31 + 5])  # a tensor over 2**31 elements: int64 (or gaps)
    patches = [
        sparse("rare", (numel,), torch.bfloat16, rare),
        sparse("dense", (numel,), torch.bfloat16, dense),
        sparse("unsorted", (10,), torch.bfloat16, unsorted),
        sparse("huge", (2**31 + 8,), torch.bfloat16, huge),
    ]
    manifest = save_patches(tmp_path, patches, zstd=False)
    got = {e.name: e.encoding.value for e in manifest.patches if e.encoding is not None}
    assert got == {"rare": "gaps", "dense": "bitmask", "unsorted": "int32", "huge": "gaps"}
    forced = save_patches(tmp_path / "int64", patches[3:], positions="int64")
    assert forced.patches[0].encoding is PositionEncoding.INT64
    assert_same_patches(load_patches(tmp_path), patches)


def test_zstd_is_used_where_it_pays_and_recorded(tmp_path: Path) -> None:
    regular = torch.arange(0, 1 << 20, 100)  # constant gaps: compress to almost nothing
    noise = torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))[:50]
    patches = [
        sparse("regular", (1 << 20,), torch.float16, regular),
        sparse("tiny", (1 << 16,), torch.float16, noise.sort().values),
    ]
    manifest = save_patches(tmp_path, patches)
    assert [e.zstd for e in manifest.patches] == [True, False]  # tiny: under 1 KiB
    text = json.loads((tmp_path / "manifest.json").read_text())
    positions = text["patches"][0]["positions"]
    assert positions["compression"] == "zstd" and positions["raw_bytes"] == 2 * regular.numel()
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size < regular.numel() * 2 + 2 * regular.numel() // 10  # values + ~nothing
    assert_same_patches(load_patches(tmp_path), patches)


def test_large_updates_are_split_into_files(tmp_path: Path) -> None:
    patches = [
        CheckpointWeightPatch(f"w{i}", (256,), torch.float32, torch.full((256,), float(i)))
        for i in range(6)
    ]
    manifest = save_patches(tmp_path, patches, max_file_bytes=2048)
    assert len(manifest.files) == 3
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert_same_patches(load_patches(tmp_path), patches)


def test_rewriting_a_folder_replaces_the_update_whole(tmp_path: Path) -> None:
    first = [CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))]
    second = [CheckpointWeightPatch("w", (4,), torch.float32, torch.full((4,), 2.0))]
    old = save_patches(tmp_path, first, target_version=1)
    new = save_patches(tmp_path, second, target_version=2)
    assert set(old.files).isdisjoint(new.files)  # no file an old manifest names is rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*new.files, "manifest.json"])
    assert read_manifest(tmp_path).target_version == 2
    assert_same_patches(load_patches(tmp_path), second)


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_urls(tmp_path: Path, scheme: str) -> None:
    url = f"file://{tmp_path}/update" if scheme == "file" else f"memory://{tmp_path.name}/update"
    patches = [sparse("w", (64, 64), torch.bfloat16, torch.arange(0, 4096, 17))]
    save_patches(url, patches, base_version=1, target_version=2)
    assert_same_patches(load_patches(url, base_version=1, target_version=2), patches)
    if scheme == "file":
        assert (tmp_path / "update" / "manifest.json").exists()
        assert not list((tmp_path / "update").glob(".*.tmp"))


# ------------------------------------------------------------------- readers and producers


READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    import zstandard
    from safetensors import safe_open

    out = sys.argv[1]
    result = {}
    for folder in sys.argv[2:]:
      manifest = json.load(open(f"{folder}/manifest.json"))
      assert manifest["format"] == "patchctx.patches" and manifest["format_version"] == 1
      for entry in manifest["patches"]:
          # memory-mapped; no pickle
          with safe_open(f"{folder}/{entry['file']}", framework="pt") as f:
              tensors = {key: f.get_tensor(key) for key in f.keys()}
          values = tensors[entry["values"]]
          if entry.get("values_stored_as") == "uint8":
              values = values.reshape(-1).view(getattr(torch, entry["dtype"]))
          assert str(values.dtype) == "torch." + entry["dtype"]
          numel = int(np.prod(entry["shape"]))
          pos = entry["positions"]
          if pos is None:
              positions = None
          else:
              parts = [tensors[key] for key in pos["tensors"]]
              raw = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
              if pos["compression"] == "zstd":
                  raw = zstandard.ZstdDecompressor().decompress(
                      raw, max_output_size=pos["raw_bytes"])
              raw = np.frombuffer(raw, dtype=np.uint8)
              n = pos["count"]
              if pos["encoding"] in ("int32", "int64"):
                  positions = raw.view("<i4" if pos["encoding"] == "int32" else "<i8")
              elif pos["encoding"] == "bitmask":
                  positions = np.flatnonzero(np.unpackbits(raw, bitorder="little")[:numel])
              else:  # gaps: uint16 words (gap - 1, or 0xFFFF = escaped), then the escapes
                  words = raw[: 2 * n].view("<u2").astype(np.int64)
                  table = raw[2 * n :].view("<u4" if numel <= 2**32 else "<u8")
                  gaps = words + 1
                  gaps[words == 0xFFFF] = table.astype(np.int64) + 1
                  positions = np.cumsum(gaps) - 1
              assert len(positions) == n
              positions = [int(p) for p in positions]
          bits = values.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
          result[entry["name"]] = {"positions": positions, "bits": bits.hex()}
    assert "patchctx" not in sys.modules, "the reader must not import patchctx"
    json.dump(result, open(out, "w"))
    """
)


def test_safetensors_alone_reads_every_encoding(tmp_path: Path) -> None:
    positions = torch.tensor([0, 5, 6, 70_000, 200_001, 299_999])
    patches = []
    for encoding in ENCODINGS:
        for zstd in (False, True):
            for dtype in (torch.bfloat16, torch.complex128, torch.int8):
                name = f"{encoding.value}.{zstd}.{dtype}"
                patches.append((sparse(name, (300_000,), dtype, positions), encoding, zstd))
    dense = CheckpointWeightPatch("dense", (2, 3), torch.float16, torch.arange(6.0).half())
    for number, (patch, encoding, zstd) in enumerate(patches):
        save_patches(tmp_path / str(number), [patch], positions=encoding, zstd=zstd)
    save_patches(tmp_path / "dense", [dense])
    script = tmp_path / "reader.py"
    script.write_text(READER)
    folders = [str(tmp_path / str(number)) for number in range(len(patches))]
    out = tmp_path / "read.json"
    env = {**os.environ, "PYTHONPATH": ""}  # -I, and no path to patchctx: it cannot be imported
    subprocess.run(
        [sys.executable, "-I", str(script), str(out), *folders, str(tmp_path / "dense")],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    everything = json.loads(out.read_text())
    for patch in [*(p for p, _, _ in patches), dense]:
        read = everything[patch.name]
        expected = None if patch.indices is None else patch.indices.tolist()
        assert read["positions"] == expected
        raw = patch.values.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        assert read["bits"] == raw.hex()


def _producer_update(folder: Path) -> list[CheckpointWeightPatch]:
    """An update written with safetensors and json alone, following the documented schema."""
    folder.mkdir()
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    dense = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    data = st_save(
        {
            "a.values": values,
            "a.indices": torch.tensor([3, 10, 11], dtype=torch.int32),
            "b.values": dense,
        }
    )
    (folder / "update.safetensors").write_bytes(data)
    manifest = {
        "format": "patchctx.patches",
        "format_version": 1,
        "base_version": 41,
        "target_version": 42,
        "files": {
            "update.safetensors": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        },
        "patches": [
            {
                "name": "layer.a",
                "shape": [4, 4],
                "dtype": "bfloat16",
                "file": "update.safetensors",
                "values": "a.values",
                "positions": {
                    "encoding": "int32",
                    "count": 3,
                    "tensors": ["a.indices"],
                    "compression": None,
                },
            },
            {
                "name": "layer.b",
                "shape": [2, 3],
                "dtype": "float32",
                "file": "update.safetensors",
                "values": "b.values",
                "positions": None,
            },
        ],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return [
        CheckpointWeightPatch("layer.a", (4, 4), torch.bfloat16, values, torch.tensor([3, 10, 11])),
        CheckpointWeightPatch("layer.b", (2, 3), torch.float32, dense),
    ]


def test_an_update_written_with_safetensors_alone_loads(tmp_path: Path) -> None:
    expected = _producer_update(tmp_path / "u")
    assert_same_patches(load_patches(tmp_path / "u", base_version=41, target_version=42), expected)


# ------------------------------------------------------------------------------- refusals


def _written(tmp_path: Path) -> tuple[Path, dict[str, Any], Path]:
    folder = tmp_path / "u"
    patches = [
        sparse("w", (100_000,), torch.float32, torch.arange(0, 100_000, 7)),
        CheckpointWeightPatch("b", (4,), torch.float32, torch.ones(4)),
    ]
    save_patches(folder, patches, base_version=3, target_version=4, positions="gaps", zstd=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    (data,) = folder.glob("*.safetensors")
    return folder, manifest, data


def _rewrite(folder: Path, manifest: dict[str, Any], data: Path, tensors: dict[str, Any]) -> None:
    """Replace the data file and fix the manifest's checksums up, as an attacker would."""
    raw = st_save(tensors)
    data.write_bytes(raw)
    manifest["files"][data.name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _refused(folder: Path, match: str, **versions: int) -> None:
    with pytest.raises(StoredUpdateError, match=match) as caught:
        load_patches(folder, **versions)
    assert isinstance(caught.value, PatchError)


def test_torn_manifest(tmp_path: Path) -> None:
    folder, _, _ = _written(tmp_path)
    text = (folder / "manifest.json").read_bytes()
    (folder / "manifest.json").write_bytes(text[: len(text) // 2])
    _refused(folder, "not valid JSON")


def test_missing_manifest_and_missing_file(tmp_path: Path) -> None:
    folder, _, data = _written(tmp_path)
    data.unlink()
    _refused(folder, "missing")
    (folder / "manifest.json").unlink()
    _refused(folder, "no manifest")


def test_torn_and_corrupted_data_files(tmp_path: Path) -> None:
    folder, _, data = _written(tmp_path)
    raw = data.read_bytes()
    data.write_bytes(raw[:-100])
    _refused(folder, "bytes, the manifest says")
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(flipped))
    _refused(folder, "SHA-256")


def test_versions_that_differ(tmp_path: Path) -> None:
    folder, _, _ = _written(tmp_path)
    _refused(folder, "base_version is 3, expected 2", base_version=2)
    _refused(folder, "target_version is 4, expected 5", target_version=5)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.update(format_version=2), "format_version 2"),
        (lambda m: m.update(format="other"), "format must be"),
        (lambda m: m["patches"][1].update(dtype="float13"), "unknown dtype"),
        (lambda m: m["patches"][1].update(shape=[5]), r"4 values, expected 5"),
        (lambda m: m["patches"][1].update(dtype="float16"), "values are torch.float32"),
        (lambda m: m["patches"][0]["positions"].update(count=5), "expected"),
        (lambda m: m["patches"][0]["positions"].update(encoding="rle"), "unknown position"),
        (lambda m: m["patches"][0].update(file="../../etc/passwd"), "not in the manifest"),
        (
            lambda m: m.update(files={"../x.safetensors": next(iter(m["files"].values()))}),
            "not a plain",
        ),
        (lambda m: m["patches"].pop(1), "does not name"),
        (lambda m: m["patches"].append(dict(m["patches"][1])), "named twice"),
        (lambda m: m["patches"][0].update(shape=[10]), "malformed gaps positions"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_manifests_that_do_not_match_their_files(tmp_path: Path, edit: Any, match: str) -> None:
    folder, manifest, _ = _written(tmp_path)
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refused(folder, match)


def test_consistent_checksums_do_not_let_bad_tensors_through(tmp_path: Path) -> None:
    folder, manifest, data = _written(tmp_path)
    tensors = st_load(data.read_bytes())
    gaps_key = manifest["patches"][0]["positions"]["tensors"][0]
    # Positions past the tensor's end.
    bad = dict(tensors)
    bad[gaps_key] = torch.full_like(tensors[gaps_key], 0xFFFE)
    _rewrite(folder, manifest, data, bad)
    _refused(folder, "malformed gaps positions")
    # An extra tensor the manifest does not name.
    _rewrite(folder, manifest, data, {**tensors, "smuggled": torch.zeros(1)})
    _refused(folder, "does not name")
    # Values of another dtype under the right key.
    values_key = manifest["patches"][1]["values"]
    _rewrite(folder, manifest, data, {**tensors, values_key: torch.ones(4, dtype=torch.float64)})
    _refused(folder, "values are torch.float64")
    # Not a safetensors file at all (a pickle, say).
    raw = b"\x80\x04\x95" + os.urandom(64)
    data.write_bytes(raw)
    manifest["files"][data.name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refused(folder, "not a readable safetensors")


def test_int_positions_out_of_range_or_repeated_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "u"
    save_patches(
        folder, [sparse("w", (10,), torch.float32, torch.tensor([1, 2]))], positions="int32"
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    (data,) = folder.glob("*.safetensors")
    tensors = st_load(data.read_bytes())
    key = manifest["patches"][0]["positions"]["tensors"][0]
    _rewrite(folder, manifest, data, {**tensors, key: torch.tensor([1, 10], dtype=torch.int32)})
    _refused(folder, "out of range")
    _rewrite(folder, manifest, data, {**tensors, key: torch.tensor([3, 3], dtype=torch.int32)})
    _refused(folder, "duplicate")


def test_corrupted_zstd_frame(tmp_path: Path) -> None:
    folder = tmp_path / "u"
    save_patches(
        folder, [sparse("w", (1 << 20,), torch.float16, torch.arange(0, 1 << 20, 7))], zstd=True
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    (data,) = folder.glob("*.safetensors")
    tensors = st_load(data.read_bytes())
    key = manifest["patches"][0]["positions"]["tensors"][0]
    frame = tensors[key].clone()
    frame[len(frame) // 2 :] ^= 0x5A
    _rewrite(folder, manifest, data, {**tensors, key: frame})
    with pytest.raises(StoredUpdateError, match=r"zstd|malformed"):
        load_patches(folder)


def test_invalid_patches_write_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "u"
    bad = [
        CheckpointWeightPatch("ok", (4,), torch.float32, torch.ones(4)),
        CheckpointWeightPatch("bad", (4,), torch.float32, torch.ones(2), torch.tensor([1, 9])),
    ]
    with pytest.raises(InvalidPatchError, match="patches\\[1\\] 'bad'"):
        save_patches(folder, bad)
    assert not folder.exists()
    unsorted = [sparse("u", (10,), torch.float32, torch.tensor([3, 1]))]
    with pytest.raises(InvalidPatchError, match="'u': positions='gaps' needs sorted"):
        save_patches(folder, unsorted, positions="gaps")
    assert not folder.exists()
    with pytest.raises(InvalidPatchError, match="positions must be one of"):
        save_patches(folder, unsorted, positions="rle")
    with pytest.raises(TypeError, match="path must be"):
        save_patches(42, unsorted)


def test_every_stored_tensor_is_exactly_the_manifests(tmp_path: Path) -> None:
    _, manifest, data = _written(tmp_path)
    tensors = st_load(data.read_bytes())
    named = set()
    for entry in manifest["patches"]:
        named.add(entry["values"])
        if entry["positions"]:
            named.update(entry["positions"]["tensors"])
    assert set(tensors) == named
    numel = math.prod(manifest["patches"][0]["shape"])
    assert tensors[manifest["patches"][0]["values"]].numel() == len(range(0, numel, 7))


def test_a_declared_shape_past_the_readers_bound_is_refused_before_any_file_is_read(
    tmp_path: Path,
) -> None:
    """Decoding a bitmask or a zstd frame costs memory by the declared shape, not the file:
    a reader that knows its tensors bounds what a manifest can make it allocate."""
    folder, manifest, data = _written(tmp_path)
    manifest["patches"][0]["shape"] = [2**40]  # a bitmask of 128 GiB, if it were decoded
    (folder / "manifest.json").write_text(json.dumps(manifest))
    data.unlink()  # refused on the manifest alone: no data file is opened
    with pytest.raises(StoredUpdateError, match=r"declares shape \(1099511627776,\)"):
        load_patches(folder, max_numel=10**9)
    with pytest.raises(StoredUpdateError, match="missing"):  # without a bound: the files
        load_patches(folder)


def _layout(data: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (as JSON) and the data after it."""
    raw = data.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _assemble(header_text: str, body: bytes, *, length: int | None = None) -> bytes:
    encoded = header_text.encode()
    return (len(encoded) if length is None else length).to_bytes(8, "little") + encoded + body


def _replace_file(folder: Path, manifest: dict[str, Any], data: Path, raw: bytes) -> None:
    """Put `raw` in the data file and fix the manifest's size and checksum up."""
    data.write_bytes(raw)
    manifest["files"][data.name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _values_key(manifest: dict[str, Any]) -> str:
    key = manifest["patches"][1]["values"]
    assert isinstance(key, str)
    return key


LAYOUTS: list[tuple[str, Any, str]] = [
    (
        "overlapping",
        lambda h, b, key: (
            h[key].update(data_offsets=[0, h[key]["data_offsets"][1] - h[key]["data_offsets"][0]]),
            b,
        ),
        "does not follow",
    ),
    ("a hole", lambda h, b, key: (h, b + bytes(8)), "no tensor holds"),
    (
        "past the end",
        lambda h, b, key: (
            h[key].update(data_offsets=[len(b) - 8, len(b) + 8]),
            b,
        ),
        "outside the data",
    ),
    ("wrong size", lambda h, b, key: (h[key].update(shape=[5]), b), "which takes 20"),
    ("unknown code", lambda h, b, key: (h[key].update(dtype="F4"), b), "unknown dtype code"),
    ("extra field", lambda h, b, key: (h[key].update(crc=1), b), "exactly dtype"),
    (
        "another update",
        lambda h, b, key: (h["__metadata__"].update(update_id="0123456789abcdef"), b),
        "a data file of update",
    ),
]


@pytest.mark.parametrize(("what", "edit", "match"), LAYOUTS, ids=[w for w, _, _ in LAYOUTS])
def test_safetensors_layouts_that_do_not_hold_are_refused(
    tmp_path: Path, what: str, edit: Any, match: str
) -> None:
    """The reader checks the layout itself (every rule safetensors checks), over its own copy."""
    folder, manifest, data = _written(tmp_path)
    header, body = _layout(data)
    result = edit(header, body, _values_key(manifest))
    _replace_file(folder, manifest, data, _assemble(json.dumps(header), result[1]))
    _refused(folder, match)


def test_headers_that_are_not_a_safetensors_header_are_refused(tmp_path: Path) -> None:
    folder, manifest, data = _written(tmp_path)
    header, body = _layout(data)
    text = json.dumps(header)
    key = _values_key(manifest)
    repeated = text[:-1] + f", {json.dumps(key)}: {json.dumps(header[key])}}}"
    for raw, match in (
        (_assemble(repeated, body), "twice"),
        (_assemble(text, body, length=len(text) + len(body) + 1), "a header of"),
        (_assemble(text, body, length=2**62), "a header of"),
        (_assemble("[1, 2]", body), "not a JSON object"),
        (_assemble(text[:-1], body), "not JSON"),
        (b"\x01\x00", "shorter than a header"),
    ):
        _replace_file(folder, manifest, data, raw)
        _refused(folder, match)


def test_bool_bytes_other_than_zero_and_one_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "u"
    save_patches(folder, [CheckpointWeightPatch("m", (8,), torch.bool, torch.ones(8).bool())])
    manifest = json.loads((folder / "manifest.json").read_text())
    (data,) = folder.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] = 2  # the last value's byte
    _replace_file(folder, manifest, data, bytes(raw))
    _refused(folder, "bool bytes other than 0 and 1")


def _bits(patches: list[CheckpointWeightPatch]) -> list[bytes]:
    out = []
    for patch in patches:
        out.append(patch.values.contiguous().view(torch.uint8).numpy().tobytes())
        if patch.indices is not None:
            out.append(patch.indices.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def test_a_file_rewritten_in_place_after_the_read_changes_nothing_returned(
    tmp_path: Path,
) -> None:
    """What was checked is what is returned: the reader holds its own copy, not a mapping."""
    folder, _, data = _written(tmp_path)
    loaded = load_patches(folder)
    before = _bits(loaded)
    size = data.stat().st_size
    with open(data, "r+b") as file:  # the same inode, as a writer to a mapped file would do
        file.write(bytes(range(256)) * (size // 256) + bytes(size % 256))
    assert _bits(loaded) == before
    _refused(folder, "SHA-256")


def test_a_writer_racing_the_reader_gets_it_refused_never_half_read(tmp_path: Path) -> None:
    """A process rewriting and truncating the file in place while it is read: every load is
    the update bit for bit, or refused (never a crash, never a mixture)."""
    folder, _, data = _written(tmp_path)
    expected = _bits(load_patches(folder))
    good = data.read_bytes()
    bad = bytes(b ^ 0xFF for b in good)
    stop = threading.Event()

    def writer() -> None:
        with open(data, "r+b") as file:
            turn = 0
            while not stop.is_set():
                turn += 1
                file.seek(0)
                if turn % 3 == 0:
                    file.truncate(len(good) // 2)
                else:
                    file.write(bad if turn % 3 == 1 else good)
                    file.flush()

    thread = threading.Thread(target=writer)
    thread.start()
    outcomes = {"loaded": 0, "refused": 0}
    try:
        for _ in range(300):
            try:
                got = load_patches(folder)
            except StoredUpdateError:
                outcomes["refused"] += 1
            else:
                assert _bits(got) == expected
                outcomes["loaded"] += 1
    finally:
        stop.set()
        thread.join()
    assert outcomes["refused"] > 0, outcomes
