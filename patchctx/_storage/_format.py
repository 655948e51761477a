"""The patch file format: one update is safetensors files plus a JSON manifest.

Anyone with the ``safetensors`` package can write or read it; the schema is on the Storage page
of the docs (``docs/storage.md``) and in `save_patches`. In short, a folder holds

``manifest.json``
    Written last, atomically: the update exists once it does. It names the format and its
    version, the versions the update goes between (``base_version -> target_version``), each
    data file with its size and SHA-256, and each patch: its checkpoint name, shape and dtype,
    the file and tensor key of its values, and (sparse patches) how its positions are stored.
``patches-<update id>-<n>.safetensors``
    Plain safetensors files. Values are tensors of the patch's dtype (dense: every value;
    sparse: one per position). Positions are one of four encodings, chosen per patch by size
    (`PositionEncoding`): ``int32`` or ``int64`` flat indices, ``gaps`` (uint16 gap words plus
    a uint32/uint64 escape table, the wire codec's stream split into two typed tensors), or a
    ``bitmask`` (uint8), each optionally compressed with zstd (a uint8 tensor holding one zstd
    frame of the encoding's little-endian bytes).

Nothing is pickled; the reader checks every size, key, dtype and checksum before returning a
single patch, and refuses anything else with `StoredUpdateError`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from patchctx._encoding import (
    MalformedPositions,
    PositionsSummary,
    WireEncoding,
    decode_positions,
    encode_positions,
    positions_summary,
)
from patchctx._errors import (
    InvalidPatchError,
    InvalidPatchTypeError,
    PatchError,
    PatchProblem,
)
from patchctx._patch import CheckpointWeightPatch, validate_patches
from patchctx._storage._errors import StoredUpdateError
from patchctx._storage._files import Store, open_store
from patchctx._storage._reader import read_data_file
from patchctx._strategies import BoolMask

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PositionEncoding",
    "StoredPatch",
    "UpdateManifest",
    "decode_update",
    "load_patches",
    "manifest_of",
    "read_manifest",
    "save_patches",
]

FORMAT = "patchctx.patches"
"""The ``format`` field of every manifest."""
FORMAT_VERSION = 1
"""The schema version this patchctx writes (and the newest it reads)."""
MANIFEST = "manifest.json"
"""The manifest's file name in an update's folder."""

_INT32_LIMIT = 2**31
_UINT32_GAPS_LIMIT = 2**32
_ESCAPE = 0xFFFF
# zstd is tried on position streams of at least this many bytes, and kept when it saves 10 %.
_ZSTD_MIN_BYTES = 1024
_ZSTD_KEEP = 0.9
_ZSTD_LEVEL = 3
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
_SAFETENSORS_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.uint16,
        torch.int32,
        torch.uint32,
        torch.int64,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
    }
)


class PositionEncoding(str, enum.Enum):
    """How a stored sparse patch's positions are written (the manifest's ``encoding``).

    Examples:
        >>> from patchctx import PositionEncoding
        >>> [encoding.value for encoding in PositionEncoding]
        ['int32', 'int64', 'gaps', 'bitmask']
    """

    INT32 = "int32"
    """Flat row-major indices, one int32 tensor (tensors below 2**31 elements)."""
    INT64 = "int64"
    """Flat row-major indices, one int64 tensor."""
    GAPS = "gaps"
    """Sorted unique positions as uint16 gap words and a uint32 (uint64) escape table."""
    BITMASK = "bitmask"
    """Sorted unique positions as a uint8 bitmask of ``ceil(numel / 8)`` bytes."""


@dataclass(frozen=True, slots=True)
class StoredPatch:
    """One patch as a manifest describes it (no tensor data).

    Attributes:
        name: The checkpoint name.
        shape: The full checkpoint shape.
        dtype: The checkpoint dtype (the values' dtype).
        file: The data file holding its tensors.
        values: The tensor key of its values.
        encoding: How its positions are stored; `None` for a dense patch.
        count: Its number of positions (sparse), or of values (dense).
        zstd: Whether its positions are one zstd frame.
        tensors: The tensor keys of its positions, in the encoding's order.
        values_as_bytes: The values are stored as uint8 (a dtype safetensors lacks).

    Examples:
        >>> import torch
        >>> from patchctx import StoredPatch
        >>> entry = StoredPatch("w", (4,), torch.float32, "f.safetensors", "0.values")
        >>> entry.encoding is None, entry.count
        (True, 0)
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    values: str
    encoding: PositionEncoding | None = None
    count: int = 0
    zstd: bool = False
    tensors: tuple[str, ...] = ()
    values_as_bytes: bool = False
    escapes: int = 0
    raw_bytes: int = 0


@dataclass(frozen=True, slots=True)
class UpdateManifest:
    """What an update's ``manifest.json`` says: versions, files and patches.

    Attributes:
        base_version: The version the update applies to (`None`: any; a dense anchor).
        target_version: The version a receiver holds after applying it.
        files: Data file name -> (bytes, SHA-256 hex digest).
        patches: The stored patches, in order.
        metadata: Free string pairs the producer added.
        update_id: A random identifier of this write, part of the data file names.

    Examples:
        >>> import tempfile, torch
        >>> from patchctx import CheckpointWeightPatch, read_manifest, save_patches
        >>> folder = tempfile.mkdtemp()
        >>> _ = save_patches(folder, [CheckpointWeightPatch("w", (3,), torch.float32,
        ...                                                 torch.ones(3))], target_version=7)
        >>> manifest = read_manifest(folder)
        >>> manifest.base_version, manifest.target_version, len(manifest.patches)
        (None, 7, 1)
    """

    base_version: int | None
    target_version: int | None
    files: Mapping[str, tuple[int, str]]
    patches: tuple[StoredPatch, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    update_id: str = ""

    def to_json(self) -> str:
        """The manifest's text (the schema of the Storage page)."""
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "update_id": self.update_id,
                "base_version": self.base_version,
                "target_version": self.target_version,
                "metadata": dict(self.metadata),
                "files": {
                    name: {"bytes": size, "sha256": digest}
                    for name, (size, digest) in self.files.items()
                },
                "patches": [_entry_json(entry) for entry in self.patches],
            },
            indent=1,
        )


def _entry_json(entry: StoredPatch) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": entry.name,
        "shape": list(entry.shape),
        "dtype": _dtype_name(entry.dtype),
        "file": entry.file,
        "values": entry.values,
    }
    if entry.values_as_bytes:
        out["values_stored_as"] = "uint8"
    if entry.encoding is None:
        out["positions"] = None
    else:
        positions: dict[str, Any] = {
            "encoding": entry.encoding.value,
            "count": entry.count,
            "tensors": list(entry.tensors),
            "compression": "zstd" if entry.zstd else None,
        }
        if entry.encoding is PositionEncoding.GAPS:
            positions["escapes"] = entry.escapes
        if entry.zstd:
            positions["raw_bytes"] = entry.raw_bytes
        out["positions"] = positions
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: object) -> torch.dtype | None:
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


# ------------------------------------------------------------------------------ writing


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def _problem(index: int | None, name: str, reason: str, *, type_error: bool = False) -> PatchError:
    return InvalidPatchError.from_problems([PatchProblem(index, name, reason, type_error)])


def _candidates(summary: PositionsSummary) -> dict[PositionEncoding, int]:
    """Raw bytes of each encoding that can carry the positions `summary` describes."""
    sizes = {}
    if summary.in_range and summary.numel < _INT32_LIMIT:
        sizes[PositionEncoding.INT32] = 4 * summary.count
    sizes[PositionEncoding.INT64] = 8 * summary.count
    if summary.ordered:
        for wire, stored in (
            (WireEncoding.GAPS, PositionEncoding.GAPS),
            (WireEncoding.BITMASK, PositionEncoding.BITMASK),
        ):
            size = summary.nbytes(wire)
            if size is not None:
                sizes[stored] = size
    return sizes


def _escape_dtype(numel: int) -> torch.dtype:
    return torch.uint32 if numel <= _UINT32_GAPS_LIMIT else torch.uint64


def _position_tensors(
    index: int,
    patch: CheckpointWeightPatch,
    numel: int,
    encoding: PositionEncoding | None,
    zstd: bool | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors holding `patch`'s positions, and the manifest fields describing them."""
    assert patch.indices is not None
    indices = patch.indices.reshape(-1).cpu()
    summary = positions_summary(indices, numel)
    sizes = _candidates(summary)
    if encoding is None:
        chosen = min(sizes, key=lambda e: (sizes[e], list(PositionEncoding).index(e)))
    elif encoding not in sizes:
        need = (
            "sorted, unique positions"
            if encoding in (PositionEncoding.GAPS, PositionEncoding.BITMASK)
            else "a tensor below 2**31 elements"
        )
        raise _problem(index, patch.name, f"positions={encoding.value!r} needs {need}")
    else:
        chosen = encoding
    fields: dict[str, Any] = {"encoding": chosen, "count": summary.count, "escapes": 0}
    if chosen in (PositionEncoding.INT32, PositionEncoding.INT64):
        typed = indices.to(torch.int32 if chosen is PositionEncoding.INT32 else torch.int64)
        parts = {f"{index}.indices": typed}
    elif chosen is PositionEncoding.BITMASK:
        parts = {f"{index}.bitmask": encode_positions(indices, summary, WireEncoding.BITMASK)}
    else:
        stream = encode_positions(indices, summary, WireEncoding.GAPS)
        words = stream[: 2 * summary.count].view(torch.uint16)
        escapes = stream[2 * summary.count :].clone().view(_escape_dtype(numel))
        parts = {f"{index}.gaps": words, f"{index}.escapes": escapes}
        fields["escapes"] = summary.escapes
    raw = sum(t.numel() * t.element_size() for t in parts.values())
    codec = (
        _zstd() if zstd is not False and raw >= (_ZSTD_MIN_BYTES if zstd is None else 0) else None
    )
    if zstd and codec is None:
        raise _problem(
            index, patch.name, "zstd=True needs zstandard: pip install 'patchctx[storage]'"
        )
    if codec is not None:
        stream_bytes = b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts.values()
        )
        packed = codec.ZstdCompressor(level=_ZSTD_LEVEL).compress(stream_bytes)
        if zstd or len(packed) < _ZSTD_KEEP * raw:
            fields["zstd"] = True
            fields["raw_bytes"] = raw
            parts = {
                f"{index}.positions.zst": torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            }
    fields["tensors"] = tuple(parts)
    return parts, fields


def _values_tensor(patch: CheckpointWeightPatch) -> tuple[torch.Tensor, bool]:
    values = patch.values.detach().to(device="cpu", dtype=patch.dtype).contiguous()
    if patch.indices is None:
        values = values.reshape(patch.shape)  # dense: the checkpoint tensor itself
    if patch.dtype in _SAFETENSORS_DTYPES:
        return values, False
    # A dtype safetensors has no code for: its bytes, one row per value.
    raw = values.reshape(-1).view(torch.uint8).reshape(values.numel(), patch.dtype.itemsize)
    return raw, True


def _version(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidPatchTypeError(
            [
                PatchProblem(
                    None,
                    "",
                    f"{what} must be a non-negative int or None, got {value!r}",
                    is_type_error=True,
                )
            ]
        )
    return value


def _own(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safetensors will write: contiguous, and no two sharing memory."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        tensor = tensor.contiguous()
        if tensor.numel():
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in seen:
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def save_patches(
    path: object,
    patches: Iterable[object],
    *,
    base_version: int | None = None,
    target_version: int | None = None,
    positions: PositionEncoding | str | None = None,
    zstd: bool | None = None,
    max_file_bytes: int = 2**30,
    metadata: Mapping[str, str] | None = None,
) -> UpdateManifest:
    """Write patches as an update: safetensors data files, then ``manifest.json``, atomically.

    Every patch is validated first (as `validate_patches` does, accepting any value: NaN and
    sentinels too); nothing is written when one is invalid. Values are stored as tensors of
    the patch's dtype (cast when given in another; a dtype safetensors has no code for, such
    as complex128, is stored as its bytes, a uint8 tensor of one row per value, marked
    ``values_stored_as: "uint8"``). Each sparse patch's positions take the smallest of the
    encodings that can carry them (`PositionEncoding`; ties go to the first), and then one
    zstd frame of those bytes when zstandard is installed, the stream is at least 1 KiB and
    compression saves 10 %. The data files are named after a fresh update id, so rewriting a
    folder never changes a file an older manifest names; the new manifest replaces the old
    one atomically, and files no manifest names any more are removed after it.

    Args:
        path: A directory, or an fsspec URL (``memory://``, ``s3://``...; needs fsspec).
        patches: `CheckpointWeightPatch` objects, or any `PatchLike`.
        base_version: The version the update applies to; `None` for one that applies to any
            (a dense anchor).
        target_version: The version a receiver holds after applying it.
        positions: Force one position encoding for every sparse patch (refused for a patch it
            cannot carry).
        zstd: `True`: compress every position stream; `False`: never; `None`: when it pays.
        max_file_bytes: Start a new data file once one holds this many bytes.
        metadata: Extra string pairs for the manifest.

    Returns:
        The manifest written.

    Raises:
        InvalidPatchError: A patch or argument is invalid; nothing was written.

    Examples:
        >>> import tempfile, torch
        >>> from patchctx import CheckpointWeightPatch, load_patches, save_patches
        >>> folder = tempfile.mkdtemp()
        >>> sparse = CheckpointWeightPatch("w", (1000,), torch.bfloat16,
        ...                                torch.ones(3, dtype=torch.bfloat16),
        ...                                torch.tensor([2, 40, 999]))
        >>> manifest = save_patches(folder, [sparse], base_version=6, target_version=7)
        >>> [entry.encoding.value for entry in manifest.patches]
        ['gaps']
        >>> [p.indices.tolist() for p in load_patches(folder)]
        [[2, 40, 999]]
    """
    store = open_store(path, "save_patches")
    base = _version(base_version, "base_version")
    target = _version(target_version, "target_version")
    forced = None if positions is None else _encoding_arg(positions)
    extra = _save_options(zstd, max_file_bytes, metadata)
    checked = validate_patches(list(patches), strategy=BoolMask())
    update_id = uuid.uuid4().hex[:16]
    files, entries = _laid_out(checked, update_id, forced, zstd, max_file_bytes)
    from safetensors.torch import save

    written: dict[str, tuple[int, str]] = {}
    file_metadata = {"format": FORMAT, "update_id": update_id}
    for name, tensors in files.items():
        data = save(_own(tensors), metadata=file_metadata)
        store.write(name, data)
        written[name] = (len(data), hashlib.sha256(data).hexdigest())
    manifest = UpdateManifest(base, target, written, tuple(entries), extra, update_id)
    store.write(MANIFEST, manifest.to_json().encode())
    for leftover in store.listdir(""):
        if (
            leftover.endswith(".safetensors")
            and leftover.startswith("patches-")
            and leftover not in written
        ):
            store.remove(leftover)
    return manifest


def _save_options(
    zstd: object, max_file_bytes: object, metadata: Mapping[str, str] | None
) -> dict[str, str]:
    """`save_patches`' options checked (before anything is read or written); the metadata."""
    if zstd not in (None, True, False):
        raise _problem(None, "", f"zstd must be True, False or None, got {zstd!r}", type_error=True)
    if (
        isinstance(max_file_bytes, bool)
        or not isinstance(max_file_bytes, int)
        or max_file_bytes < 1
    ):
        raise _problem(None, "", f"max_file_bytes must be a positive int, got {max_file_bytes!r}")
    extra = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise _problem(None, "", "metadata must map str to str", type_error=True)
    return extra


def _laid_out(
    checked: Sequence[CheckpointWeightPatch],
    update_id: str,
    forced: PositionEncoding | None,
    zstd: bool | None,
    max_file_bytes: int,
) -> tuple[dict[str, dict[str, torch.Tensor]], list[StoredPatch]]:
    """The tensors of each data file, by file name, and each patch's manifest entry."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries: list[StoredPatch] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0

    def file_name(number: int) -> str:
        return f"patches-{update_id}-{number:05d}.safetensors"

    for index, patch in enumerate(checked):
        numel = math.prod(patch.shape)
        values, as_bytes = _values_tensor(patch)
        tensors = {f"{index}.values": values}
        fields: dict[str, Any] = {
            "encoding": None,
            "count": values.shape[0] if as_bytes else values.numel(),
        }
        if patch.indices is not None:
            parts, fields = _position_tensors(index, patch, numel, forced, zstd)
            tensors.update(parts)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if current and current_bytes + size > max_file_bytes:
            files[file_name(len(files))] = current
            current, current_bytes = {}, 0
        current.update(tensors)
        current_bytes += size
        entries.append(
            StoredPatch(
                name=patch.name,
                shape=tuple(patch.shape),
                dtype=patch.dtype,
                file=file_name(len(files)),
                values=f"{index}.values",
                encoding=fields["encoding"],
                count=int(fields["count"]),
                zstd=bool(fields.get("zstd", False)),
                tensors=tuple(fields.get("tensors", ())),
                values_as_bytes=as_bytes,
                escapes=int(fields.get("escapes", 0)),
                raw_bytes=int(fields.get("raw_bytes", 0)),
            )
        )
    if current or not files:
        files[file_name(len(files))] = current
    return files, entries


def _encoding_arg(value: object) -> PositionEncoding:
    try:
        return PositionEncoding(value)
    except ValueError:
        choices = ", ".join(repr(e.value) for e in PositionEncoding)
        raise _problem(
            None, "", f"positions must be one of {choices} or None, got {value!r}"
        ) from None


# ------------------------------------------------------------------------------ reading


class _Refuse(Exception):
    """A reason the manifest is not a valid one (turned into `StoredUpdateError`)."""


def _need(condition: bool, reason: str) -> None:
    if not condition:
        raise _Refuse(reason)


def _int(value: object, what: str, *, minimum: int = 0) -> int:
    _need(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{what} must be an int >= {minimum}, got {value!r}",
    )
    assert isinstance(value, int)
    return value


def _optional_version(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    return None if value is None else _int(value, key)


def _parse_entry(position: int, raw: object, files: Mapping[str, object]) -> StoredPatch:
    where = f"patches[{position}]"
    _need(isinstance(raw, dict), f"{where} must be an object")
    assert isinstance(raw, dict)
    name = raw.get("name")
    _need(isinstance(name, str) and bool(name), f"{where}: name must be a non-empty string")
    assert isinstance(name, str)
    where = f"patches[{position}] {name!r}"
    shape_raw = raw.get("shape")
    _need(isinstance(shape_raw, list), f"{where}: shape must be a list of ints")
    assert isinstance(shape_raw, list)
    shape = tuple(_int(d, f"{where}: shape entry") for d in shape_raw)
    dtype = _dtype_of(raw.get("dtype"))
    _need(dtype is not None, f"{where}: unknown dtype {raw.get('dtype')!r}")
    assert dtype is not None
    file = raw.get("file")
    _need(
        isinstance(file, str) and file in files,
        f"{where}: file {file!r} is not in the manifest's files",
    )
    assert isinstance(file, str)
    values = raw.get("values")
    _need(isinstance(values, str), f"{where}: values must be a tensor key")
    assert isinstance(values, str)
    stored_as = raw.get("values_stored_as")
    _need(stored_as in (None, "uint8"), f"{where}: values_stored_as must be 'uint8' if present")
    positions = raw.get("positions")
    if positions is None:
        return StoredPatch(
            name,
            shape,
            dtype,
            file,
            values,
            values_as_bytes=stored_as == "uint8",
            count=math.prod(shape),
        )
    _need(isinstance(positions, dict), f"{where}: positions must be an object or null")
    assert isinstance(positions, dict)
    try:
        encoding = PositionEncoding(positions.get("encoding"))
    except ValueError:
        raise _Refuse(f"{where}: unknown position encoding {positions.get('encoding')!r}") from None
    count = _int(positions.get("count"), f"{where}: positions.count")
    tensors = positions.get("tensors")
    _need(
        isinstance(tensors, list) and all(isinstance(t, str) for t in tensors),
        f"{where}: positions.tensors must be a list of tensor keys",
    )
    assert isinstance(tensors, list)
    compression = positions.get("compression")
    _need(compression in (None, "zstd"), f"{where}: unknown compression {compression!r}")
    zstd = compression == "zstd"
    expected_parts = 1 if zstd or encoding is not PositionEncoding.GAPS else 2
    _need(
        len(tensors) == expected_parts,
        f"{where}: {encoding.value} positions take {expected_parts} tensor(s)",
    )
    escapes = _int(positions.get("escapes", 0), f"{where}: positions.escapes")
    raw_bytes = _int(positions.get("raw_bytes", 0), f"{where}: positions.raw_bytes")
    return StoredPatch(
        name,
        shape,
        dtype,
        file,
        values,
        encoding,
        count,
        zstd,
        tuple(tensors),
        stored_as == "uint8",
        escapes,
        raw_bytes,
    )


def _parse_manifest(text: bytes) -> UpdateManifest:
    try:
        raw = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _Refuse(f"the manifest is not valid JSON (torn or corrupted?): {error}") from None
    _need(isinstance(raw, dict), "the manifest must be a JSON object")
    _need(raw.get("format") == FORMAT, f"format must be {FORMAT!r}, got {raw.get('format')!r}")
    version = raw.get("format_version")
    _need(
        isinstance(version, int) and 1 <= version <= FORMAT_VERSION,
        f"format_version {version!r} is not one this patchctx reads (1 to {FORMAT_VERSION})",
    )
    files_raw = raw.get("files")
    _need(isinstance(files_raw, dict), "files must be an object")
    files: dict[str, tuple[int, str]] = {}
    for name, about in files_raw.items():
        _need(
            isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None,
            f"data file name {name!r} is not a plain *.safetensors name",
        )
        _need(isinstance(about, dict), f"files[{name!r}] must be an object")
        digest = about.get("sha256")
        _need(
            isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None,
            f"files[{name!r}].sha256 must be 64 hex digits",
        )
        files[name] = (_int(about.get("bytes"), f"files[{name!r}].bytes"), digest)
    patches_raw = raw.get("patches")
    _need(isinstance(patches_raw, list), "patches must be a list")
    metadata = raw.get("metadata", {})
    _need(
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()),
        "metadata must map strings to strings",
    )
    update_id = raw.get("update_id", "")
    _need(isinstance(update_id, str), "update_id must be a string")
    return UpdateManifest(
        _optional_version(raw, "base_version"),
        _optional_version(raw, "target_version"),
        files,
        tuple(_parse_entry(i, entry, files) for i, entry in enumerate(patches_raw)),
        metadata,
        update_id,
    )


def read_manifest(path: object) -> UpdateManifest:
    """Read and check an update's ``manifest.json`` (its data files are not read).

    Args:
        path: The update's directory or fsspec URL.

    Returns:
        The manifest.

    Raises:
        StoredUpdateError: There is no manifest, or it is not a valid one of this format.

    Examples:
        >>> import tempfile
        >>> from patchctx import StoredUpdateError, read_manifest
        >>> try:
        ...     read_manifest(tempfile.mkdtemp())
        ... except StoredUpdateError as error:
        ...     print("refused:", "no manifest" in str(error))
        refused: True
    """
    store = open_store(path, "read_manifest")
    return manifest_of(store)


def manifest_of(store: Store) -> UpdateManifest:
    """`read_manifest` for a `Store`."""
    where = store.describe(MANIFEST)
    try:
        text = store.read(MANIFEST)
    except FileNotFoundError:
        raise StoredUpdateError(
            f"{where}: no manifest (not published, or removed)", path=where
        ) from None
    try:
        return _parse_manifest(text)
    except _Refuse as refused:
        raise StoredUpdateError(f"{where}: {refused}", path=where) from None


def _expect(
    tensors: Mapping[str, torch.Tensor],
    key: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    where: str,
) -> torch.Tensor:
    tensor = tensors.get(key)
    _need(tensor is not None, f"{where}: tensor {key!r} is missing from its file")
    assert tensor is not None
    _need(
        tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape),
        f"{where}: tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} "
        f"{tuple(shape)}",
    )
    return tensor


def _decode_entry(
    entry: StoredPatch, index: int, tensors: Mapping[str, torch.Tensor]
) -> CheckpointWeightPatch:
    where = f"patches[{index}] {entry.name!r}"
    numel = math.prod(entry.shape)
    count = entry.count if entry.encoding is not None else numel
    raw_values = tensors.get(entry.values)
    _need(raw_values is not None, f"{where}: tensor {entry.values!r} is missing from its file")
    assert raw_values is not None
    if entry.values_as_bytes:
        _expect(tensors, entry.values, torch.uint8, (count, entry.dtype.itemsize), where)
        flat = raw_values.reshape(-1)
        if flat.storage_offset() % entry.dtype.itemsize:
            flat = flat.clone()  # a view of the file's buffer not aligned for `entry.dtype`
        values = flat.view(entry.dtype)
    else:
        _need(
            raw_values.dtype == entry.dtype,
            f"{where}: values are {raw_values.dtype}, the manifest says {entry.dtype}",
        )
        _need(
            raw_values.numel() == count, f"{where}: {raw_values.numel()} values, expected {count}"
        )
        values = raw_values.reshape(-1)  # dense values may be stored checkpoint-shaped
    if entry.encoding is None:
        return CheckpointWeightPatch(entry.name, entry.shape, entry.dtype, values)
    if entry.encoding is PositionEncoding.INT32:
        _need(numel < _INT32_LIMIT, f"{where}: int32 positions for a tensor of {numel} elements")
    stream = _position_stream(entry, numel, tensors, where)
    try:
        if entry.encoding in (PositionEncoding.INT32, PositionEncoding.INT64):
            width = torch.int32 if entry.encoding is PositionEncoding.INT32 else torch.int64
            indices = decode_positions(
                stream, numel, entry.count, WireEncoding.INDICES, dtype=width
            )
        else:
            wire = (
                WireEncoding.GAPS
                if entry.encoding is PositionEncoding.GAPS
                else WireEncoding.BITMASK
            )
            indices = decode_positions(stream, numel, entry.count, wire)
    except MalformedPositions as error:
        raise _Refuse(f"{where}: malformed {entry.encoding.value} positions: {error}") from None
    return CheckpointWeightPatch(entry.name, entry.shape, entry.dtype, values, indices)


def _position_stream(
    entry: StoredPatch, numel: int, tensors: Mapping[str, torch.Tensor], where: str
) -> torch.Tensor:
    """The little-endian byte stream of `entry`'s positions (decompressed when zstd)."""
    if entry.encoding is PositionEncoding.INT32:
        expected = [(torch.int32, (entry.count,))]
    elif entry.encoding is PositionEncoding.INT64:
        expected = [(torch.int64, (entry.count,))]
    elif entry.encoding is PositionEncoding.BITMASK:
        expected = [(torch.uint8, (-(-numel // 8),))]
    else:
        expected = [(torch.uint16, (entry.count,)), (_escape_dtype(numel), (entry.escapes,))]
    raw_size = sum(math.prod(shape) * dtype.itemsize for dtype, shape in expected)
    if entry.zstd:
        (key,) = entry.tensors
        packed = tensors.get(key)
        _need(
            packed is not None and packed.dtype == torch.uint8 and packed.ndim == 1,
            f"{where}: tensor {key!r} must be a 1-D uint8 zstd frame",
        )
        assert packed is not None
        _need(
            entry.raw_bytes == raw_size,
            f"{where}: raw_bytes {entry.raw_bytes}, expected {raw_size}",
        )
        codec = _zstd()
        if codec is None:
            raise _Refuse(
                f"{where}: zstd-compressed positions need zstandard: "
                "pip install 'patchctx[storage]'"
            )
        try:
            data = codec.ZstdDecompressor().decompress(
                packed.numpy().tobytes(), max_output_size=raw_size
            )
        except codec.ZstdError as error:
            raise _Refuse(f"{where}: the zstd frame does not decompress: {error}") from None
        _need(
            len(data) == raw_size,
            f"{where}: the zstd frame holds {len(data)} bytes, expected {raw_size}",
        )
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
    parts = [
        _expect(tensors, key, dtype, shape, where).contiguous().view(torch.uint8).reshape(-1)
        for key, (dtype, shape) in zip(entry.tensors, expected, strict=True)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _keys_of(entry: StoredPatch) -> list[str]:
    return [entry.values, *entry.tensors]


def load_patches(
    path: object,
    *,
    base_version: int | None = None,
    target_version: int | None = None,
    max_numel: int | None = None,
) -> list[CheckpointWeightPatch]:
    """Read an update written by `save_patches` (or any producer following the schema).

    Every data file is read once, by its size, into memory this process owns and checked
    against the manifest's size and SHA-256; its safetensors layout is checked (no pickle)
    and the tensors are views of that memory, so a file rewritten after the check changes
    nothing returned. Every tensor key, dtype and shape is checked against the manifest:
    each file holds exactly the tensors the manifest names. Positions are decoded
    and every patch validated (range, duplicates) before anything is returned.

    Args:
        path: The update's directory or fsspec URL.
        base_version: When given, the manifest's ``base_version`` must equal it.
        target_version: When given, the manifest's ``target_version`` must equal it.
        max_numel: When given, a patch whose declared shape has more elements is refused
            before any data file is read: decoding positions (a bitmask, a zstd frame) costs
            memory in proportion to the declared shape, not to the file, so a reader that
            knows its tensors bounds what a hostile manifest can make it allocate.
            `StorageFollower` passes 16 times its model's elements.

    Returns:
        The patches, in the order they were saved.

    Raises:
        StoredUpdateError: The manifest is missing, torn or invalid; a data file is missing,
            torn, corrupted or does not match the manifest; a version differs from the one
            asked for. Nothing is returned in part.

    Examples:
        >>> import tempfile, torch
        >>> from patchctx import (CheckpointWeightPatch, StoredUpdateError, load_patches,
        ...                       save_patches)
        >>> folder = tempfile.mkdtemp()
        >>> _ = save_patches(folder, [CheckpointWeightPatch("b", (2,), torch.float32,
        ...                                                 torch.tensor([1.0, 2.0]))],
        ...                  base_version=3, target_version=4)
        >>> load_patches(folder)[0].values
        tensor([1., 2.])
        >>> try:
        ...     load_patches(folder, base_version=2)
        ... except StoredUpdateError as error:
        ...     print("refused: base", error.path.endswith("manifest.json"))
        refused: base True
    """
    store = open_store(path, "load_patches")
    manifest = manifest_of(store)
    where = store.describe(MANIFEST)
    for key, wanted, found in (
        ("base_version", base_version, manifest.base_version),
        ("target_version", target_version, manifest.target_version),
    ):
        if wanted is not None and wanted != found:
            raise StoredUpdateError(f"{where}: {key} is {found!r}, expected {wanted!r}", path=where)
    return decode_update(store, manifest, max_numel=max_numel)


def decode_update(
    store: Store, manifest: UpdateManifest, *, max_numel: int | None = None
) -> list[CheckpointWeightPatch]:
    """Read, check and decode the data files of `manifest` from `store`.

    A patch declaring more than `max_numel` elements is refused before any file is read.
    """
    where = store.describe(MANIFEST)
    if max_numel is not None:
        for index, entry in enumerate(manifest.patches):
            numel = math.prod(entry.shape)
            if numel > max_numel:
                raise StoredUpdateError(
                    f"{where}: patches[{index}] {entry.name!r} declares shape {entry.shape} "
                    f"({numel:,} elements), more than the reader's bound of {max_numel:,}; "
                    "nothing was read",
                    path=where,
                )
    contents = {
        name: read_data_file(store, name, size, digest, manifest.update_id)
        for name, (size, digest) in manifest.files.items()
    }
    try:
        used: dict[str, set[str]] = {name: set() for name in contents}
        for entry in manifest.patches:
            for key in _keys_of(entry):
                _need(key not in used[entry.file], f"tensor {key!r} of {entry.file} is named twice")
                used[entry.file].add(key)
        for name, tensors in contents.items():
            extra = sorted(set(tensors) - used[name])
            _need(not extra, f"{name} holds tensors the manifest does not name: {extra[:5]}")
        patches = [
            _decode_entry(entry, i, contents[entry.file])
            for i, entry in enumerate(manifest.patches)
        ]
    except _Refuse as refused:
        raise StoredUpdateError(f"{where}: {refused}", path=where) from None
    try:
        return validate_patches(patches, strategy=BoolMask())
    except InvalidPatchError as error:
        raise StoredUpdateError(f"{where}: {error}", path=where) from error
