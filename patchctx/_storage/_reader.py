"""Reading a stored update's data file: one copy into memory this process owns, then views.

A data file is read once, by its exact size, into a ``bytearray`` (`Store.read_exactly`); its
SHA-256 is computed over that buffer, and every tensor is a view of it. Nothing else is read
from the file afterwards, so a process that rewrites or truncates the file after the check
cannot change what is decoded or applied.

Why not map the file and use the mapping itself (``safe_open``, ``torch.frombuffer`` over an
``mmap``)? On Linux a mapping does not hold the file's contents, shared or private: a private
(``MAP_PRIVATE``) mapping still shows another process's later writes to every page this
process has not written itself, so a checksum over the mapping proves nothing about what is
read from it a moment later; and a file truncated under a mapping makes the next access raise
``SIGBUS``, which kills the serving process instead of refusing the update. One copy out of
the page cache is what a safe reader pays anyway; reading with ``readinto`` straight into the
owned buffer makes it the only copy (``safetensors.torch.load`` over the file's bytes makes a
second, per tensor).

The safetensors layout is parsed here, over the owned buffer, because safetensors' own readers
take a file name (and map it) or copy every tensor out of bytes: an 8-byte little-endian
header length, a JSON header (tensor name -> dtype code, shape, ``data_offsets`` into the data
that follows; ``__metadata__``: string pairs), then the data. Every rule safetensors itself
checks is checked: the header fits, is JSON without repeated keys, names known dtype codes,
and its tensors' byte ranges match their shapes and tile the data exactly, without gaps or
overlaps.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from typing import Any

import torch

from patchctx._storage._errors import StoredUpdateError
from patchctx._storage._files import SizeMismatch, Store

__all__ = ["SAFETENSORS_CODES", "read_data_file"]

# safetensors' dtype codes: the one table of them (the payload codec reads it too).
SAFETENSORS_CODES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# safetensors' own bound on the header.
_MAX_HEADER = 100_000_000


class _Unreadable(Exception):
    """Why bytes are not a safetensors file."""


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Unreadable(f"the header names {key!r} twice")
        out[key] = value
    return out


def _shape(raw: object, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    ):
        raise _Unreadable(f"tensor {key!r}: shape must be a list of non-negative ints")
    return tuple(raw)


def parse_safetensors(buffer: bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file held in `buffer` (views of it), and its metadata."""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise _Unreadable("patchctx reads safetensors files on little-endian hosts only")
    if len(buffer) < 8:
        raise _Unreadable(f"{len(buffer)} bytes: shorter than a header")
    length = int.from_bytes(buffer[:8], "little")
    if length > min(_MAX_HEADER, len(buffer) - 8):
        raise _Unreadable(f"a header of {length} bytes in a file of {len(buffer)}")
    try:
        header = json.loads(bytes(buffer[8 : 8 + length]), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError) as error:
        raise _Unreadable(f"the header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise _Unreadable("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _Unreadable("__metadata__ must map strings to strings")
    start = 8 + length
    data_bytes = len(buffer) - start
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    ranges = []
    tensors = {}
    for key, about in header.items():
        if not isinstance(about, dict) or set(about) != {"dtype", "shape", "data_offsets"}:
            raise _Unreadable(f"tensor {key!r}: needs exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_CODES.get(about["dtype"]) if isinstance(about["dtype"], str) else None
        if dtype is None:
            raise _Unreadable(f"tensor {key!r}: unknown dtype code {about['dtype']!r}")
        shape = _shape(about["shape"], key)
        offsets = about["data_offsets"]
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise _Unreadable(f"tensor {key!r}: data_offsets {offsets!r} outside the data")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise _Unreadable(
                f"tensor {key!r}: {end - begin} bytes for {dtype} {shape}, which takes "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        ranges.append((begin, end, key))
        flat = whole[start + begin : start + end]
        if (start + begin) % dtype.itemsize:
            flat = flat.clone()  # not aligned for a view as `dtype`: a copy of our own bytes
        tensor = flat.view(dtype).reshape(shape)
        if dtype == torch.bool and end > begin and int(flat.max()) > 1:
            raise _Unreadable(f"tensor {key!r}: bool bytes other than 0 and 1")
        tensors[key] = tensor
    covered = 0
    for begin, end, key in sorted(ranges):
        if begin != covered:
            raise _Unreadable(f"tensor {key!r}: its data does not follow the previous tensor's")
        covered = end
    if covered != data_bytes:
        raise _Unreadable(f"{data_bytes - covered} bytes of data no tensor holds")
    return tensors, metadata


def read_data_file(
    store: Store, name: str, size: int, digest: str, update_id: str
) -> dict[str, torch.Tensor]:
    """Data file `name` of an update, checked against the manifest's `size` and `digest`.

    The tensors are views of one buffer this process owns (see the module). A file whose
    safetensors metadata carries an ``update_id`` other than the manifest's is refused (a
    data file of another update); a producer that writes none is not asked for one.
    """
    where = store.describe(name)
    try:
        data = store.read_exactly(name, size)
    except FileNotFoundError:
        raise StoredUpdateError(f"{where}: missing (the manifest names it)", path=where) from None
    except SizeMismatch as mismatch:
        found = (
            "changed size while it was read"
            if mismatch.found is None
            else f"{mismatch.found} bytes"
        )
        raise StoredUpdateError(
            f"{where}: {found}, the manifest says {size} bytes (torn or replaced)", path=where
        ) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise StoredUpdateError(
            f"{where}: SHA-256 differs from the manifest's (corrupted)", path=where
        )
    try:
        tensors, metadata = parse_safetensors(data)
    except _Unreadable as error:
        raise StoredUpdateError(
            f"{where}: not a readable safetensors file: {error}", path=where
        ) from None
    found_id = metadata.get("update_id")
    if update_id and found_id is not None and found_id != update_id:
        raise StoredUpdateError(
            f"{where}: a data file of update {found_id!r}, the manifest is update {update_id!r}",
            path=where,
        )
    return tensors
