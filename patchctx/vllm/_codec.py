"""A small self-describing binary format for patches: bytes that survive any RPC.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic b"PATCHCTX"
    8       4     format version (uint32, currently 2; version 1 is still read)
    12      4     header length H in bytes (uint32)
    16      H     header: UTF-8 JSON, padded with spaces so that 16 + H is a multiple of 8
    16 + H  D     data: the raw little-endian bytes of every tensor, each block starting at
                  a multiple of 8; D is the header's "data_bytes", and the payload ends there

The header is a JSON object with exactly the keys ``base_version``, ``target_version``
(each a string, an integer or null), ``data_bytes`` and ``patches``; each patch is an object
with exactly ``name``, ``shape`` (list of ints), ``dtype`` (a dtype name), ``values`` and
``indices`` (null for a dense patch). ``values`` is a tensor block ``{"dtype", "offset",
"numel"}``; ``indices`` is a positions block ``{"encoding", "offset", "nbytes"}`` whose
encoding is ``"int32"`` or ``"int64"`` (flat indices), ``"gaps"`` or ``"bitmask"`` (the
formats of `patchctx._encoding`), holding as many positions as there are values. Offsets are
relative to the data section. Version 1 payloads, whose ``indices`` was a tensor block of
int32 or int64, are still decoded.

The encoder sends each sparse patch's positions in the smallest encoding (`wire_encoding`).
Decoding checks every field, bound and size before it builds a tensor, builds tensors with
``torch.frombuffer`` (no pickle, no code), decodes positions without a tensor of checkpoint
size (sorted and unique for ``gaps`` and ``bitmask``, in `index_dtype`), and raises
`InvalidPatchError` for anything malformed.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from patchctx._encoding import (
    MalformedPositions,
    WireEncoding,
    decode_positions,
    encode_positions,
    positions_summary,
)
from patchctx._errors import InvalidPatchError, PatchProblem
from patchctx._patch import CheckpointWeightPatch
from patchctx._swap import builtin_copy

__all__ = ["PatchPayload", "decode_patches", "decode_payload", "encode_patches"]

MAGIC = b"PATCHCTX"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_ALIGN = 8
_MAX_DIMS = 64
_MAX_NUMEL = 2**62
_INT64 = 2**63

# Dtypes a payload may carry, by the name the header uses. Names torch lacks are left out.
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_INDEX_DTYPES = ("int32", "int64")
# Position encodings by their header name; the flat one is named by its dtype.
_ENCODINGS = {
    "int32": WireEncoding.INDICES,
    "int64": WireEncoding.INDICES,
    "gaps": WireEncoding.GAPS,
    "bitmask": WireEncoding.BITMASK,
}


@dataclass(frozen=True, slots=True)
class PatchPayload:
    """A decoded payload: the patches and the weight versions they go between.

    Attributes:
        patches: The patches, in the order they were encoded.
        base_version: The weight version the patches were made against (`None`: unchecked).
        target_version: The version the weights are at once the patches are applied
            (`None`: the worker's version becomes unknown).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import decode_payload, encode_patches
        >>> patch = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))
        >>> payload = decode_payload(encode_patches([patch], base_version=4, target_version=5))
        >>> payload.base_version, payload.target_version, payload.patches[0].values.tolist()
        (4, 5, [1.0, 2.0])
    """

    patches: tuple[CheckpointWeightPatch, ...]
    base_version: str | int | None = None
    target_version: str | int | None = None


# ------------------------------------------------------------------------------- encoding


def _check_version(value: object, what: str) -> str | int | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64:
        return value
    raise InvalidPatchError(f"{what} must be a str, an int (64-bit) or None, got {value!r}")


def _dtype_name(dtype: object, problem: str) -> str:
    name = _NAMES.get(dtype) if isinstance(dtype, torch.dtype) else None
    if name is None:
        raise InvalidPatchError(
            f"{problem}: {dtype!r} cannot be encoded (supported: {', '.join(DTYPES)})"
        )
    return name


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as contiguous little-endian bytes on the CPU (uint8, 1-D)."""
    # A lazy negation or conjugation is resolved: its bytes are the values before it.
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).cpu()
    if flat.numel() and flat.stride() != (1,):
        # Contiguous is not enough for a byte view: a one-element view keeps its stride (the
        # imaginary part of a complex number has 2), and the view needs 1.
        flat = flat.clone(memory_format=torch.contiguous_format)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if sys.byteorder == "big":
        raw = swap_bytes(raw, flat.element_size())
    return raw.reshape(-1)


def swap_bytes(raw: torch.Tensor, element_size: int) -> torch.Tensor:
    """Reverse the byte order of each `element_size`-byte element of a uint8 tensor."""
    if element_size == 1 or raw.numel() == 0:
        return raw
    return raw.view(-1, element_size).flip(1).reshape(-1)


def encode_patches(
    patches: Iterable[CheckpointWeightPatch],
    *,
    base_version: str | int | None = None,
    target_version: str | int | None = None,
) -> bytes:
    """Encode patches (and the weight versions they go between) as bytes.

    Tensors inside ``collective_rpc`` arguments do not survive vLLM's multi-process RPC as
    tensors; bytes do. The format is self-describing and never pickled: a fixed prefix (magic
    ``b"PATCHCTX"``, format version, header length), a JSON header with every name, shape,
    dtype and byte offset, then the raw little-endian tensor data. Values keep their own dtype
    (cast to the patch's dtype only when loaded, as in `load_checkpoint_weight_patches`).
    A sparse patch's positions travel in the smallest of flat int32/int64 indices, uint16
    gaps with escapes, and a bitmask (`wire_encoding`; `patch_nbytes` is the sum of those
    sizes and the values'); they decode to the same positions, as `index_dtype` integers.
    Tensors on another device are copied to the CPU (positions are encoded where they are).

    Args:
        patches: `CheckpointWeightPatch` objects (or any objects with the same fields).
        base_version: The weight version the patches were computed against; a worker that
            holds another version refuses them. `None` skips the check.
        target_version: The version the worker holds after applying them.

    Returns:
        The payload, for `decode_patches` / `decode_payload` on the other side.

    Raises:
        InvalidPatchError: A patch's structure is wrong (not 1-D, counts that do not match
            the shape, a dtype the format does not carry); nothing is encoded.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import decode_patches, encode_patches
        >>> sparse = CheckpointWeightPatch("lm_head.weight", (4, 2), torch.bfloat16,
        ...                                torch.tensor([0.5], dtype=torch.bfloat16),
        ...                                indices=torch.tensor([7], dtype=torch.int32))
        >>> data = encode_patches([sparse], target_version="step-12")
        >>> data[:8], len(data)
        (b'PATCHCTX', 280)
        >>> [patch] = decode_patches(data)
        >>> patch.name, patch.shape, patch.dtype, patch.indices.tolist(), patch.values.tolist()
        ('lm_head.weight', (4, 2), torch.bfloat16, [7], [0.5])
    """
    base = _check_version(base_version, "base_version")
    target = _check_version(target_version, "target_version")
    entries: list[dict[str, Any]] = []
    blocks: list[torch.Tensor] = []
    size = 0

    def block(tensor: torch.Tensor, dtype_name: str) -> dict[str, Any]:
        nonlocal size
        raw = _host_bytes(tensor)
        size += -size % _ALIGN
        entry = {"dtype": dtype_name, "offset": size, "numel": tensor.numel()}
        blocks.append(raw)
        size += raw.numel()
        return entry

    def positions(indices: torch.Tensor, numel: int) -> dict[str, Any]:
        nonlocal size
        summary = positions_summary(indices, numel)
        encoding, _ = summary.smallest()
        raw = encode_positions(indices, summary, encoding).cpu()
        name = encoding.value
        if encoding is WireEncoding.INDICES:
            name = "int32" if summary.flat_size() == 4 else "int64"
        size += -size % _ALIGN
        entry = {"encoding": name, "offset": size, "nbytes": raw.numel()}
        blocks.append(raw)
        size += raw.numel()
        return entry

    for position, patch in enumerate(patches):
        name = getattr(patch, "name", None)

        def problem(reason: str, *, name: object = name, position: int = position) -> NoReturn:
            raise InvalidPatchError([PatchProblem(position, str(name), reason)])

        if not isinstance(name, str) or not name:
            problem(f"name must be a non-empty str, got {name!r}")
        shape = getattr(patch, "shape", None)
        if not isinstance(shape, Sequence | torch.Size) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            problem(f"shape must be a sequence of non-negative ints, got {shape!r}")
        dtype = _dtype_name(getattr(patch, "dtype", None), f"patches[{position}] {name!r} dtype")
        values, indices = getattr(patch, "values", None), getattr(patch, "indices", None)
        if not isinstance(values, torch.Tensor) or values.ndim != 1:
            problem(f"values must be a 1-D tensor, got {values!r:.80}")
        numel = math.prod(shape)
        entry: dict[str, Any] = {"name": name, "shape": list(shape), "dtype": dtype}
        values_dtype = _dtype_name(values.dtype, f"patches[{position}] {name!r} values")
        if indices is None:
            if values.numel() != numel:
                problem(
                    f"a dense patch needs {numel} values for shape {tuple(shape)}, "
                    f"got {values.numel()}"
                )
        elif (
            not isinstance(indices, torch.Tensor)
            or indices.ndim != 1
            or indices.dtype not in (torch.int32, torch.int64)
        ):
            problem("indices must be a 1-D int32 or int64 tensor or None")
        elif indices.numel() != values.numel():
            problem(f"{indices.numel()} indices for {values.numel()} values (must match)")
        entry["values"] = block(values, values_dtype)
        entry["indices"] = None if indices is None else positions(indices, numel)
        entries.append(entry)
    size += -size % _ALIGN
    header_text = json.dumps(
        {
            "base_version": base,
            "target_version": target,
            "data_bytes": size,
            "patches": entries,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    header_text += b" " * (-(_PREFIX.size + len(header_text)) % _ALIGN)
    start = _PREFIX.size + len(header_text)
    out = bytearray(start + size)
    _PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, len(header_text))
    out[_PREFIX.size : start] = header_text
    view = torch.frombuffer(out, dtype=torch.uint8)
    placed = [b for e in entries for b in (e["values"], e["indices"]) if b is not None]
    for where, raw in zip(placed, blocks, strict=True):
        if raw.numel():
            begin = start + where["offset"]
            builtin_copy(view[begin : begin + raw.numel()], raw)
    return bytes(out)


# ------------------------------------------------------------------------------- decoding


class _Malformed(Exception):
    """Internal: the payload is malformed (turned into InvalidPatchError at the boundary)."""


def _fail(reason: str) -> _Malformed:
    return _Malformed(reason)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _fail(f"the header repeats the key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise _fail(f"the header holds {name}, which JSON does not allow")


def _object(value: object, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(f"{where} must be a JSON object, got {type(value).__name__}")
    if set(value) != set(keys):
        missing, extra = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
        raise _fail(
            f"{where} must have exactly the keys {list(keys)} (missing {missing}, unknown {extra})"
        )
    return value


def _integer(value: object, where: str, *, low: int = 0, high: int = _MAX_NUMEL) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(f"{where} must be an int in [{low}, {high}], got {value!r}")
    return value


def _version(value: object, where: str) -> str | int | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64:
        return value
    raise _fail(f"{where} must be a string, an integer or null, got {value!r}")


Ranges = list[tuple[int, int, str]]  # the data bytes each block holds: [start, end), where


def _tensor(
    entry: object,
    where: str,
    data: torch.Tensor,
    allowed: Sequence[str] | None = None,
    ranges: Ranges | None = None,
) -> torch.Tensor:
    block = _object(entry, ("dtype", "offset", "numel"), where)
    name = block["dtype"]
    if not isinstance(name, str) or name not in DTYPES or (allowed and name not in allowed):
        choices = allowed or tuple(DTYPES)
        raise _fail(f"{where}.dtype must be one of {', '.join(choices)}, got {name!r}")
    dtype = DTYPES[name]
    itemsize = dtype.itemsize
    numel = _integer(block["numel"], f"{where}.numel")
    offset = _integer(block["offset"], f"{where}.offset")
    if offset % itemsize:
        raise _fail(f"{where}.offset {offset} is not a multiple of {name}'s size ({itemsize})")
    end = offset + numel * itemsize
    if end > data.numel():
        raise _fail(f"{where} reaches byte {end} of a data section of {data.numel()} bytes")
    if ranges is not None and end > offset:
        ranges.append((offset, end, where))
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    raw = data[offset:end]
    if sys.byteorder == "big":
        raw = swap_bytes(raw.clone(), itemsize)
    return raw.view(dtype)


def _positions(
    entry: object, where: str, data: torch.Tensor, numel: int, count: int, ranges: Ranges
) -> torch.Tensor:
    """A version-2 positions block, decoded (see `patchctx._encoding` for the formats)."""
    block = _object(entry, ("encoding", "offset", "nbytes"), where)
    name = block["encoding"]
    if not isinstance(name, str) or name not in _ENCODINGS:
        raise _fail(f"{where}.encoding must be one of {', '.join(_ENCODINGS)}, got {name!r}")
    offset = _integer(block["offset"], f"{where}.offset")
    nbytes = _integer(block["nbytes"], f"{where}.nbytes")
    dtype = DTYPES[name] if name in _INDEX_DTYPES else None
    if dtype is not None and offset % dtype.itemsize:
        raise _fail(f"{where}.offset {offset} is not a multiple of {name}'s size")
    end = offset + nbytes
    if end > data.numel():
        raise _fail(f"{where} reaches byte {end} of a data section of {data.numel()} bytes")
    if end > offset:
        ranges.append((offset, end, where))
    try:
        return decode_positions(data[offset:end], numel, count, _ENCODINGS[name], dtype=dtype)
    except MalformedPositions as error:
        raise _fail(f"{where} ({name}): {error}") from None


def _refuse_overlaps(ranges: Ranges) -> None:
    """Every block holds bytes of its own: two that share one are a forged payload."""
    ordered = sorted(ranges)
    for (_, end, where), (start, _, other) in itertools.pairwise(ordered):
        if start < end:
            raise _fail(f"{other} overlaps {where} (bytes from {start} to {end})")


def _patch(
    entry: object,
    where: str,
    data: torch.Tensor,
    version: int = FORMAT_VERSION,
    ranges: Ranges | None = None,
) -> CheckpointWeightPatch:
    fields = _object(entry, ("name", "shape", "dtype", "values", "indices"), where)
    name = fields["name"]
    if not isinstance(name, str) or not name:
        raise _fail(f"{where}.name must be a non-empty string, got {name!r}")
    where = f"{where} {name!r}"
    shape = fields["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise _fail(f"{where}.shape must be a list of at most {_MAX_DIMS} ints, got {shape!r}")
    dims = tuple(_integer(d, f"{where}.shape[{i}]") for i, d in enumerate(shape))
    numel = math.prod(dims)
    if numel > _MAX_NUMEL:
        raise _fail(f"{where}.shape {list(dims)} has more than 2**62 elements")
    dtype_name = fields["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _fail(f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    ranges = [] if ranges is None else ranges
    values = _tensor(fields["values"], f"{where}.values", data, ranges=ranges)
    if fields["indices"] is None:
        if values.numel() != numel:
            raise _fail(
                f"{where}: a dense patch of shape {list(dims)} needs {numel} values, "
                f"the payload has {values.numel()}"
            )
        indices = None
    elif version == 1:
        indices = _tensor(fields["indices"], f"{where}.indices", data, _INDEX_DTYPES, ranges)
        if indices.numel() != values.numel():
            raise _fail(f"{where}: {indices.numel()} indices for {values.numel()} values")
    else:
        indices = _positions(
            fields["indices"], f"{where}.indices", data, numel, values.numel(), ranges
        )
    return CheckpointWeightPatch(name, dims, DTYPES[dtype_name], values, indices)


def _decode(data: object) -> PatchPayload:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _fail(f"a payload is bytes, got {type(data).__name__}")
    buffer = bytearray(data)  # one writable copy: tensors below are views into it
    if len(buffer) < _PREFIX.size:
        raise _fail(f"{len(buffer)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_size = _PREFIX.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise _fail(f"not a patchctx payload ({bytes(buffer[:8])!r} is not {MAGIC!r})")
    if version not in READABLE_VERSIONS:
        versions = " and ".join(map(str, READABLE_VERSIONS))
        raise _fail(f"payload format version {version}; this patchctx reads {versions}")
    start = _PREFIX.size + header_size
    if start > len(buffer):
        raise _fail(f"the header claims {header_size} bytes; only {len(buffer) - 16} follow")
    if start % _ALIGN:
        raise _fail(f"the data section starts at byte {start}, not a multiple of {_ALIGN}")
    try:
        header = json.loads(
            bytes(buffer[_PREFIX.size : start]).decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as error:
        raise _fail(f"the header is not valid JSON: {error}") from None
    header = _object(
        header, ("base_version", "target_version", "data_bytes", "patches"), "the header"
    )
    data_bytes = _integer(header["data_bytes"], "data_bytes")
    if start + data_bytes != len(buffer):
        raise _fail(
            f"the header announces {data_bytes} data bytes; the payload holds {len(buffer) - start}"
        )
    entries = header["patches"]
    if not isinstance(entries, list):
        raise _fail(f"patches must be a list, got {type(entries).__name__}")
    base = _version(header["base_version"], "base_version")
    target = _version(header["target_version"], "target_version")
    data_section = torch.frombuffer(buffer, dtype=torch.uint8)[start:]
    ranges: Ranges = []
    patches = tuple(
        _patch(entry, f"patches[{i}]", data_section, version, ranges)
        for i, entry in enumerate(entries)
    )
    _refuse_overlaps(ranges)
    return PatchPayload(patches, base, target)


def decode_payload(data: bytes | bytearray | memoryview) -> PatchPayload:
    """Decode what `encode_patches` made: the patches and the weight versions.

    Every field is checked before a tensor is built: the prefix, the header (strict JSON,
    exactly the known keys, no duplicates), names, shapes, dtypes (from a fixed list), that
    each tensor block lies inside the data section and is aligned, that no two blocks share a
    byte, that counts match the shapes, and that the payload ends where the header says.
    Tensors are read with ``torch.frombuffer`` from one copy of the payload (they share it);
    nothing is unpickled and no code runs.

    Args:
        data: The payload.

    Returns:
        The decoded `PatchPayload`.

    Raises:
        InvalidPatchError: The payload is malformed, truncated, or not a patchctx payload.

    Examples:
        >>> from patchctx.vllm import decode_payload, encode_patches
        >>> decode_payload(encode_patches([], base_version="a", target_version="b"))
        PatchPayload(patches=(), base_version='a', target_version='b')
        >>> from patchctx import InvalidPatchError
        >>> try:
        ...     decode_payload(b"GIF89a, an image")
        ... except InvalidPatchError as error:
        ...     print(error)
        malformed patch payload: not a patchctx payload (b'GIF89a, ' is not b'PATCHCTX')
    """
    try:
        return _decode(data)
    except _Malformed as error:
        raise InvalidPatchError(f"malformed patch payload: {error}") from None


def decode_patches(data: bytes | bytearray | memoryview) -> list[CheckpointWeightPatch]:
    """Decode the patches of a payload made by `encode_patches` (versions are ignored).

    Args:
        data: The payload.

    Returns:
        The patches, in the order they were encoded.

    Raises:
        InvalidPatchError: The payload is malformed (see `decode_payload`).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import decode_patches, encode_patches
        >>> dense = CheckpointWeightPatch("model.norm.weight", (3,), torch.float32,
        ...                               torch.tensor([1.0, 2.0, 3.0]))
        >>> decode_patches(encode_patches([dense]))[0].values
        tensor([1., 2., 3.])
    """
    return list(decode_payload(data).patches)
