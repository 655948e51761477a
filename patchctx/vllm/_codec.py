"""The payload of the ``patchctx`` transports: one safetensors file, written into the buffer.

A payload is exactly one file of the Storage page's format (`save_patches`), so the
``safetensors`` package alone reads it, and the storage reader's conventions hold::

    offset   size  field
    0        8     header length N (uint64, little-endian)
    8        N     header: UTF-8 JSON, padded with spaces so that 8 + N is a multiple of 8
    8 + N    D     data: every tensor's raw little-endian bytes, back to back, covering it all

The header maps each tensor key to ``{"dtype", "shape", "data_offsets"}`` (safetensors'
dtype codes, offsets relative to the data) and holds ``__metadata__`` with exactly
``format`` (``"patchctx.patches"``), ``payload_version`` (``"3"``) and ``manifest``: JSON
text of ``{"base_version", "target_version", "patches"}``. Each patch entry is a storage
manifest's entry without ``file`` (the payload is the one file): ``name``, ``shape``,
``dtype``, ``values`` (the key of its values tensor, in the patch's dtype: a dense patch's
is checkpoint-shaped), ``positions`` (``null`` for a dense patch, else ``{"encoding",
"count", "tensors", "compression": null}`` and, for ``gaps``, ``escapes``), and, when it
applies, ``values_stored_as: "uint8"`` (a dtype safetensors has no code for, one row of
bytes per value) or ``values_dtype`` (values of another kind than the patch's, carried as
they are so that the loader refuses or casts them as it does in-process). Tensors are
ordered by element size, largest first, so each starts aligned to its own.

The encoder plans the header first (`plan_payload`), then writes every tensor straight into
the transport's buffer (a mapped shared-memory file, a pinned host buffer; `bytes` only for
`encode_patches`), casting values to the patch's dtype in that one copy. It hashes each
patch's bytes as it goes: a digest per patch (its entry and its tensors' bytes) and one
checksum of the header and those digests, which covers every byte of the payload. The hash
is XXH3-128 on trusted local links and SHA-256 where the link is not trusted.

Decoding checks every field, bound and size before it builds a tensor (strict JSON, exactly
the known keys, dtypes from a fixed table, tensors covering the data exactly, each named by
one patch), checks the digests, then builds tensors as views of the buffer
(``torch.frombuffer``: no copy, no pickle, no code). Positions are decoded without a tensor
of checkpoint size. Anything malformed raises `InvalidPatchError` naming the patch.
Payloads of the format before this one (``b"PATCHCTX"``, versions 1 and 2) are refused:
trainer and workers run one patchctx version.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from patchctx import _tuning
from patchctx._encoding import (
    MalformedPositions,
    WireEncoding,
    decode_positions,
    encode_positions,
    positions_summary,
)
from patchctx._errors import InvalidPatchError, PatchProblem
from patchctx._kinds import same_kind
from patchctx._patch import CheckpointWeightPatch
from patchctx._storage._reader import SAFETENSORS_CODES
from patchctx._swap import builtin_copy

__all__ = [
    "PatchPayload",
    "PayloadPlan",
    "Sealed",
    "decode_patches",
    "decode_payload",
    "encode_patches",
    "plan_payload",
]

FORMAT = "patchctx.patches"
PAYLOAD_VERSION = "3"
OLD_MAGIC = b"PATCHCTX"
_LENGTH = struct.Struct("<Q")
_ALIGN = 8
_MAX_DIMS = 64
_MAX_NUMEL = 2**62
_MAX_HEADER = 100 << 20
_INT64 = 2**63
_INT32_LIMIT = 2**31
_UINT32_GAPS_LIMIT = 2**32
FAST = "xxh3_128"
"""The checksum of trusted local links (shared memory, NCCL): XXH3-128, near memory speed."""
SECURE = "sha256"
"""The checksum where a link is not trusted: SHA-256."""
ALGORITHMS = (FAST, SECURE)

# Dtypes a payload may carry, by the name the manifest uses. Names torch lacks are left out.
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
# safetensors' dtype codes of the dtypes a payload carries (the fnuz float8s are stored as
# bytes, as the storage format does).
CODES = {code: dtype for code, dtype in SAFETENSORS_CODES.items() if dtype in _NAMES}
_CODE_OF = {dtype: code for code, dtype in CODES.items()}
_ENCODINGS = ("int32", "int64", "gaps", "bitmask")


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


def hasher(algorithm: str) -> Any:
    """A new hash object of `algorithm` (`FAST` or `SECURE`)."""
    if algorithm == SECURE:
        return hashlib.sha256()
    if algorithm == FAST:
        import xxhash

        return xxhash.xxh3_128()
    raise InvalidPatchError(f"checksum algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}")


def _canonical(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _tensor_label(key: str, code: str, shape: Sequence[int]) -> bytes:
    return json.dumps([key, code, list(shape)], separators=(",", ":")).encode()


def _checksum(algorithm: str, header: memoryview | bytes, digests: Sequence[bytes]) -> str:
    total = hasher(algorithm)
    total.update(b"patchctx.payload.3\0")
    total.update(header)
    for each in digests:
        total.update(each)
    return f"{algorithm}:{total.hexdigest()}"


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


def swap_bytes(raw: torch.Tensor, element_size: int) -> torch.Tensor:
    """Reverse the byte order of each `element_size`-byte element of a uint8 tensor."""
    if element_size == 1 or raw.numel() == 0:
        return raw
    return raw.view(-1, element_size).flip(1).reshape(-1)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements, 1-D, lazy negation and conjugation resolved (no copy if none)."""
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1)


@dataclass(slots=True)
class _Block:
    """One tensor of the payload: where it goes and how its bytes are written."""

    key: str
    code: str
    shape: tuple[int, ...]
    itemsize: int
    nbytes: int
    # Fills a uint8 tensor of exactly `nbytes` (and the same bytes as a memoryview), hashing
    # what it wrote into the digest as it goes.
    write: Callable[[torch.Tensor, memoryview, Any], None]
    offset: int = 0


@dataclass(slots=True)
class _Entry:
    canonical: bytes
    blocks: list[_Block]


class PayloadPlan:
    """A payload laid out but not written: its header and where each tensor goes.

    `write_into` fills a buffer of `nbytes` (a mapped shared-memory file, a pinned tensor's
    memory, a `bytearray`) with one copy of each tensor and returns the checksum and
    per-patch digests (`Sealed`). Made by `plan_payload`.

    Attributes:
        header: The payload's first bytes: the header's length and the header.
        nbytes: The payload's size in bytes.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import decode_payload, plan_payload
        >>> plan = plan_payload([CheckpointWeightPatch("w", (2,), torch.float32,
        ...                                            torch.tensor([1.0, 2.0]))])
        >>> buffer = bytearray(plan.nbytes)
        >>> sealed = plan.write_into(buffer)
        >>> sealed.checksum.startswith("xxh3_128:"), len(sealed.intent)
        (True, 1)
        >>> decode_payload(buffer, checksum=sealed.checksum).patches[0].values.tolist()
        [1.0, 2.0]
    """

    __slots__ = ("_entries", "header", "nbytes")

    def __init__(self, header: bytes, entries: list[Any], nbytes: int) -> None:
        self.header = header
        self.nbytes = nbytes
        self._entries: list[_Entry] = entries

    def write_into(self, buffer: Any, *, algorithm: str = "xxh3_128") -> Sealed:
        """Write the payload into `buffer` (writable, exactly `nbytes`); its `Sealed` hashes."""
        view = memoryview(buffer).cast("B")
        if view.readonly or view.nbytes != self.nbytes:
            raise ValueError(
                f"a payload of {self.nbytes} bytes needs a writable buffer of that size, got "
                f"{view.nbytes} bytes{' (read-only)' if view.readonly else ''}"
            )
        start = len(self.header)
        view[:start] = self.header
        data = torch.frombuffer(view, dtype=torch.uint8) if self.nbytes else None
        digests = []
        for entry in self._entries:
            digest = hasher(algorithm)
            digest.update(entry.canonical)
            for block in entry.blocks:
                begin = start + block.offset
                digest.update(_tensor_label(block.key, block.code, block.shape))
                if block.nbytes:
                    assert data is not None
                    end = begin + block.nbytes
                    block.write(data[begin:end], view[begin:end], digest)
            digests.append(digest.digest())
        checksum = _checksum(algorithm, view[:start], digests)
        return Sealed(checksum, [d.hex() for d in digests])


@dataclass(frozen=True, slots=True)
class Sealed:
    """What the trainer tells the workers about a written payload: what it must hash to.

    Attributes:
        checksum: ``"<algorithm>:<hex>"`` of the header and every patch's digest.
        intent: Each patch's digest (hex): its manifest entry and its tensors' bytes.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import plan_payload
        >>> plan = plan_payload([CheckpointWeightPatch("w", (1,), torch.float32,
        ...                                            torch.ones(1))])
        >>> sealed = plan.write_into(bytearray(plan.nbytes), algorithm="sha256")
        >>> sealed.checksum[:7], len(sealed.intent[0])
        ('sha256:', 64)
    """

    checksum: str
    intent: list[str]


def _values_block(
    key: str, values: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]
) -> tuple[_Block, torch.dtype, bool]:
    """The values tensor, its dtype and whether it is bytes.

    Values travel in `dtype` when of its kind (cast while copied), else in their own dtype.
    """
    carried = dtype if same_kind(values.dtype, dtype) else values.dtype
    flat = _flat(values)
    count = flat.numel()
    code = _CODE_OF.get(carried)
    if code is None:  # a dtype safetensors lacks: rows of bytes
        rows = _LazyRows(flat, carried)
        write_rows = _copy_writer(rows, torch.uint8)
        size = carried.itemsize
        return _Block(key, "U8", (count, size), 1, count * size, write_rows), carried, True
    layout = tuple(shape) if carried is dtype else (count,)
    block = _Block(
        key, code, layout, carried.itemsize, count * carried.itemsize, _copy_writer(flat, carried)
    )
    return block, carried, False


class _LazyRows:
    """The bytes of values cast to a dtype safetensors lacks, made when first written."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype) -> None:
        self.flat, self.dtype = flat, dtype

    def tensor(self) -> torch.Tensor:
        source = self.flat.to(self.dtype)
        if source.numel() and source.stride() != (1,):
            source = source.clone(memory_format=torch.contiguous_format)
        return source.view(torch.uint8).reshape(-1)


def _copy_writer(
    source: torch.Tensor | _LazyRows, dtype: torch.dtype
) -> Callable[[torch.Tensor, memoryview, Any], None]:
    """Copy `source` into a uint8 target viewed as `dtype` (casting), hashing each chunk."""

    def write(target: torch.Tensor, raw: memoryview, digest: Any) -> None:
        flat = source.tensor() if isinstance(source, _LazyRows) else source
        typed = target.view(dtype)
        count, size = typed.numel(), dtype.itemsize
        if (
            flat.device.type != "cpu"
            or sys.byteorder == "big"
            or count * size <= _tuning.HASHED_CHUNK
        ):
            builtin_copy(typed, flat)  # a device's tensor: one transfer
            if sys.byteorder == "big":
                builtin_copy(target, swap_bytes(target.clone(), size))
            digest.update(raw)
            return
        step = _tuning.HASHED_CHUNK // size
        for begin in range(0, count, step):
            end = min(count, begin + step)
            builtin_copy(typed[begin:end], flat[begin:end])
            digest.update(raw[begin * size : end * size])

    return write


def _position_blocks(
    index: int, indices: torch.Tensor, numel: int, smallest: bool
) -> tuple[list[_Block], dict[str, Any]]:
    """The tensors of a sparse patch's positions and its manifest ``positions`` object."""
    flat = indices.detach().reshape(-1)
    count = flat.numel()
    if not smallest:  # flat indices as they are: no pass over them here
        width = torch.int32 if flat.dtype == torch.int32 and numel < _INT32_LIMIT else torch.int64
        name = "int32" if width == torch.int32 else "int64"
        key = f"{index}.indices"
        block = _Block(
            key,
            _CODE_OF[width],
            (count,),
            width.itemsize,
            count * width.itemsize,
            _copy_writer(flat, width),
        )
        return [block], {"encoding": name, "count": count, "tensors": [key], "compression": None}
    summary = positions_summary(flat, numel)
    encoding, _ = summary.smallest()
    positions: dict[str, Any] = {"count": count, "compression": None}
    if encoding is WireEncoding.INDICES:
        width = torch.int32 if summary.flat_size() == 4 else torch.int64
        key = f"{index}.indices"
        positions.update(encoding="int32" if width == torch.int32 else "int64", tensors=[key])
        nbytes = count * width.itemsize
        return [
            _Block(
                key, _CODE_OF[width], (count,), width.itemsize, nbytes, _copy_writer(flat, width)
            )
        ], positions
    stream = encode_positions(flat, summary, encoding).cpu()
    if encoding is WireEncoding.BITMASK:
        key = f"{index}.bitmask"
        positions.update(encoding="bitmask", tensors=[key])
        return [
            _Block(
                key, "U8", (stream.numel(),), 1, stream.numel(), _copy_writer(stream, torch.uint8)
            )
        ], positions
    words, table = stream[: 2 * count], stream[2 * count :]
    wide = torch.uint32 if numel <= _UINT32_GAPS_LIMIT else torch.uint64
    escapes = table.numel() // wide.itemsize
    gaps_key, escapes_key = f"{index}.gaps", f"{index}.escapes"
    positions.update(encoding="gaps", tensors=[gaps_key, escapes_key], escapes=escapes)
    return [
        _Block(gaps_key, "U16", (count,), 2, 2 * count, _copy_writer(words, torch.uint8)),
        _Block(
            escapes_key,
            _CODE_OF[wide],
            (escapes,),
            wide.itemsize,
            table.numel(),
            _copy_writer(table, torch.uint8),
        ),
    ], positions


def plan_payload(
    patches: Iterable[CheckpointWeightPatch],
    *,
    base_version: str | int | None = None,
    target_version: str | int | None = None,
    positions: str = "smallest",
) -> PayloadPlan:
    """Lay out the payload of `patches`: its header and each tensor's place (nothing copied).

    Args:
        patches: `CheckpointWeightPatch` objects (or any objects with the same fields).
        base_version: The weight version the patches were computed against.
        target_version: The version the worker holds after applying them.
        positions: ``"smallest"``: each sparse patch's positions in the smallest encoding
            (`wire_encoding`: one pass over them to choose); ``"flat"``: as flat int32 (below
            2**31 elements, when given as int32) or int64 indices, copied as they are (for
            links where a copy costs more than the bytes it saves: shared memory).

    Returns:
        The `PayloadPlan`.

    Raises:
        InvalidPatchError: A patch's structure is wrong; nothing is planned.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import plan_payload
        >>> sparse = CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([1.0]),
        ...                                torch.tensor([3], dtype=torch.int32))
        >>> plan_payload([sparse], positions="flat").nbytes % 8
        0
    """
    if positions not in ("smallest", "flat"):
        raise InvalidPatchError(f"positions={positions!r}: 'smallest' or 'flat'")
    base = _check_version(base_version, "base_version")
    target = _check_version(target_version, "target_version")
    entries: list[dict[str, Any]] = []
    planned: list[_Entry] = []
    for position, patch in enumerate(patches):
        entry, blocks = _plan_entry(position, patch, smallest=positions == "smallest")
        entries.append(entry)
        planned.append(_Entry(_canonical(entry), blocks))
    manifest = {"base_version": base, "target_version": target, "patches": entries}
    prefix, data_bytes = _lay_out(manifest, [b for entry in planned for b in entry.blocks])
    return PayloadPlan(prefix, planned, len(prefix) + data_bytes)


def _plan_entry(
    position: int, patch: CheckpointWeightPatch, *, smallest: bool
) -> tuple[dict[str, Any], list[_Block]]:
    """One patch's manifest entry and its tensors, its fields checked first."""
    name = getattr(patch, "name", None)

    def problem(reason: str) -> NoReturn:
        raise InvalidPatchError([PatchProblem(position, str(name), reason)])

    if not isinstance(name, str) or not name:
        problem(f"name must be a non-empty str, got {name!r}")
    shape = getattr(patch, "shape", None)
    if not isinstance(shape, Sequence | torch.Size) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        problem(f"shape must be a sequence of non-negative ints, got {shape!r}")
    dtype_name = _dtype_name(getattr(patch, "dtype", None), f"patches[{position}] {name!r} dtype")
    dtype = DTYPES[dtype_name]
    values, indices = getattr(patch, "values", None), getattr(patch, "indices", None)
    if not isinstance(values, torch.Tensor) or values.ndim != 1:
        problem(f"values must be a 1-D tensor, got {values!r:.80}")
    _dtype_name(values.dtype, f"patches[{position}] {name!r} values")
    numel = math.prod(shape)
    if indices is None:
        if values.numel() != numel:
            problem(
                f"a dense patch needs {numel} values for shape {tuple(shape)}, got {values.numel()}"
            )
    elif (
        not isinstance(indices, torch.Tensor)
        or indices.ndim != 1
        or indices.dtype not in (torch.int32, torch.int64)
    ):
        problem("indices must be a 1-D int32 or int64 tensor or None")
    elif indices.numel() != values.numel():
        problem(f"{indices.numel()} indices for {values.numel()} values (must match)")
    key = f"{position}.values"
    values_block, carried, as_bytes = _values_block(
        key, values, dtype, shape if indices is None else (values.numel(),)
    )
    entry: dict[str, Any] = {
        "name": name,
        "shape": list(shape),
        "dtype": dtype_name,
        "values": key,
        "positions": None,
    }
    if as_bytes:
        entry["values_stored_as"] = "uint8"
    if carried is not dtype:
        entry["values_dtype"] = _NAMES[carried]
    blocks = [values_block]
    if indices is not None:
        more, entry["positions"] = _position_blocks(position, indices, numel, smallest)
        blocks += more
    return entry, blocks


def _lay_out(manifest: dict[str, Any], tensors: list[_Block]) -> tuple[bytes, int]:
    """Place every tensor (setting its offset); the header's bytes and the data's size."""
    # Largest elements first: each tensor then starts at a multiple of its element size.
    offset = 0
    for block in sorted(tensors, key=lambda b: -b.itemsize):
        block.offset = offset
        offset += block.nbytes
    text = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False)
    header: dict[str, Any] = {
        "__metadata__": {"format": FORMAT, "payload_version": PAYLOAD_VERSION, "manifest": text}
    }
    for block in tensors:
        header[block.key] = {
            "dtype": block.code,
            "shape": list(block.shape),
            "data_offsets": [block.offset, block.offset + block.nbytes],
        }
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded += b" " * (-(_LENGTH.size + len(encoded)) % _ALIGN)
    return _LENGTH.pack(len(encoded)) + encoded, offset


def encode_patches(
    patches: Iterable[CheckpointWeightPatch],
    *,
    base_version: str | int | None = None,
    target_version: str | int | None = None,
) -> bytes:
    """Encode patches (and the weight versions they go between) as bytes.

    Tensors inside ``collective_rpc`` arguments do not survive vLLM's multi-process RPC as
    tensors; bytes do. The payload is one safetensors file (the Storage page's format, see
    the module `patchctx.vllm._codec`): any ``safetensors`` reader loads its tensors, and
    nothing is pickled. Values travel in the patch's dtype (cast as they are copied; values
    of another kind keep theirs, for the loader to refuse or cast). A sparse patch's
    positions travel in the smallest of flat int32/int64 indices, uint16 gaps with escapes,
    and a bitmask (`wire_encoding`). Tensors on another device are copied to the CPU. The
    transports write the same bytes straight into their buffers (`plan_payload`).

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
        >>> from safetensors.torch import load  # any safetensors reader
        >>> sorted(load(data))
        ['0.bitmask', '0.values']
        >>> [patch] = decode_patches(data)
        >>> patch.name, patch.shape, patch.dtype, patch.indices.tolist(), patch.values.tolist()
        ('lm_head.weight', (4, 2), torch.bfloat16, [7], [0.5])
    """
    plan = plan_payload(patches, base_version=base_version, target_version=target_version)
    out = bytearray(plan.nbytes)
    plan.write_into(out)
    return bytes(out)


# ------------------------------------------------------------------------------- decoding


class _Malformed(Exception):
    """Internal: the payload is malformed (turned into InvalidPatchError at the boundary)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Malformed(f"the header repeats the key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise _Malformed(f"the header holds {name}, which JSON does not allow")


def _json(text: bytes | str, what: str) -> Any:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as error:
        if isinstance(error, _Malformed):
            raise
        raise _Malformed(f"{what} is not valid JSON: {error}") from None


def _object(
    value: object, keys: tuple[str, ...], where: str, optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{where} must be a JSON object, got {type(value).__name__}")
    missing = sorted(set(keys) - set(value))
    extra = sorted(set(value) - set(keys) - set(optional))
    if missing or extra:
        raise _Malformed(
            f"{where} must have exactly the keys {list(keys)}"
            + (f" (and may have {list(optional)})" if optional else "")
            + f" (missing {missing}, unknown {extra})"
        )
    return value


def _integer(value: object, where: str, *, low: int = 0, high: int = _MAX_NUMEL) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _Malformed(f"{where} must be an int in [{low}, {high}], got {value!r}")
    return value


def _version(value: object, where: str) -> str | int | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64:
        return value
    raise _Malformed(f"{where} must be a string, an integer or null, got {value!r}")


def _shape(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise _Malformed(f"{where} must be a list of at most {_MAX_DIMS} ints, got {value!r:.80}")
    dims = tuple(_integer(d, f"{where}[{i}]") for i, d in enumerate(value))
    if math.prod(dims) > _MAX_NUMEL:
        raise _Malformed(f"{where} {list(dims)} has more than 2**62 elements")
    return dims


@dataclass(frozen=True, slots=True)
class _Tensor:
    code: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _tensors(header: dict[str, Any], data_bytes: int) -> dict[str, _Tensor]:
    """Every tensor entry of the header, checked; together they cover the data exactly."""
    out: dict[str, _Tensor] = {}
    for key, raw in header.items():
        if key == "__metadata__":
            continue
        where = f"tensor {key!r:.80}"
        info = _object(raw, ("dtype", "shape", "data_offsets"), where)
        code = info["dtype"]
        if not isinstance(code, str) or code not in CODES:
            raise _Malformed(f"{where}: dtype must be one of {', '.join(CODES)}, got {code!r:.40}")
        dtype = CODES[code]
        shape = _shape(info["shape"], f"{where}.shape")
        offsets = info["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise _Malformed(f"{where}: data_offsets must be [begin, end]")
        begin = _integer(offsets[0], f"{where}.data_offsets[0]", high=data_bytes)
        end = _integer(offsets[1], f"{where}.data_offsets[1]", high=data_bytes)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise _Malformed(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes; "
                f"{code} {list(shape)} takes {math.prod(shape) * dtype.itemsize}"
            )
        if begin % dtype.itemsize:
            raise _Malformed(f"{where} starts at byte {begin}, not a multiple of {code}'s size")
        out[key] = _Tensor(code, dtype, shape, begin, end)
    reached = 0
    for key, tensor in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if tensor.begin != reached:
            what = "overlaps another" if tensor.begin < reached else "leaves a hole before it"
            raise _Malformed(f"tensor {key!r:.80} {what} (starts at {tensor.begin}, not {reached})")
        reached = tensor.end
    if reached != data_bytes:
        raise _Malformed(f"the tensors cover {reached} of the {data_bytes} data bytes")
    return out


@dataclass(slots=True)
class _Parsed:
    """A payload whose header and layout are checked; no tensor built yet."""

    header_bytes: int
    base: str | int | None
    target: str | int | None
    entries: list[dict[str, Any]]
    tensors: dict[str, _Tensor]
    keys: list[list[str]]  # each patch's tensor keys, values first


def _take(tensors: dict[str, _Tensor], key: object, where: str, owners: dict[str, str]) -> _Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise _Malformed(f"{where}: {key!r:.80} is not a tensor of the payload")
    if key in owners:
        raise _Malformed(f"{where}: tensor {key!r:.80} is {owners[key]}'s already")
    owners[key] = where
    return tensors[key]


def _expect(tensor: _Tensor, dtype: torch.dtype, shape: tuple[int, ...], where: str) -> None:
    if tensor.dtype != dtype or tensor.shape != shape:
        raise _Malformed(
            f"{where} is {tensor.code} {list(tensor.shape)}, expected "
            f"{_CODE_OF.get(dtype, dtype)} {list(shape)}"
        )


def _parse_entry(
    raw: object, index: int, tensors: dict[str, _Tensor], owners: dict[str, str]
) -> list[str]:
    where = f"patches[{index}]"
    entry = _object(
        raw,
        ("name", "shape", "dtype", "values", "positions"),
        where,
        ("values_stored_as", "values_dtype"),
    )
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise _Malformed(f"{where}.name must be a non-empty string, got {name!r:.80}")
    where = f"{where} {name!r}"
    dims = _shape(entry["shape"], f"{where}.shape")
    numel = math.prod(dims)
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _Malformed(f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    dtype = DTYPES[dtype_name]
    carried = dtype
    if "values_dtype" in entry:
        other = entry["values_dtype"]
        if not isinstance(other, str) or other not in DTYPES or same_kind(DTYPES[other], dtype):
            raise _Malformed(
                f"{where}.values_dtype must name a dtype of another kind than {dtype_name}, "
                f"got {other!r:.40}"
            )
        carried = DTYPES[other]
    positions = entry["positions"]
    if positions is None:
        count = numel
    else:
        keys = ("encoding", "count", "tensors", "compression")
        positions = _object(positions, keys, f"{where}.positions", ("escapes",))
        count = _integer(positions["count"], f"{where}.positions.count")
    values = _take(tensors, entry["values"], f"{where}.values", owners)
    if "values_stored_as" in entry:
        if entry["values_stored_as"] != "uint8":
            raise _Malformed(f"{where}.values_stored_as must be 'uint8'")
        _expect(values, torch.uint8, (count, carried.itemsize), f"{where}.values")
    elif _CODE_OF.get(carried) is None:
        raise _Malformed(f"{where}: {_NAMES[carried]} values are stored as uint8 rows")
    else:
        layout = dims if positions is None and values.shape == dims else (count,)
        _expect(values, carried, layout, f"{where}.values")
    keys_of = [entry["values"]]
    if positions is None:
        return keys_of
    encoding = positions["encoding"]
    if encoding not in _ENCODINGS:
        raise _Malformed(
            f"{where}.positions.encoding must be one of {_ENCODINGS}, got {encoding!r:.40}"
        )
    if positions["compression"] is not None:
        raise _Malformed(f"{where}.positions.compression must be null (zstd is for storage)")
    parts = positions["tensors"]
    wanted = 2 if encoding == "gaps" else 1
    if not isinstance(parts, list) or len(parts) != wanted:
        raise _Malformed(f"{where}.positions.tensors must list {wanted} tensor key(s)")
    if ("escapes" in positions) != (encoding == "gaps"):
        raise _Malformed(f"{where}.positions.escapes belongs to gaps positions only")
    found = [_take(tensors, key, f"{where}.positions", owners) for key in parts]
    if encoding == "int32":
        if numel >= _INT32_LIMIT:
            raise _Malformed(f"{where}: int32 positions for a tensor of {numel} elements")
        _expect(found[0], torch.int32, (count,), f"{where}.positions")
    elif encoding == "int64":
        _expect(found[0], torch.int64, (count,), f"{where}.positions")
    elif encoding == "bitmask":
        _expect(found[0], torch.uint8, (-(-numel // 8),), f"{where}.positions")
    else:
        escapes = _integer(positions["escapes"], f"{where}.positions.escapes", high=count)
        wide = torch.uint32 if numel <= _UINT32_GAPS_LIMIT else torch.uint64
        _expect(found[0], torch.uint16, (count,), f"{where}.positions gaps")
        _expect(found[1], wide, (escapes,), f"{where}.positions escapes")
    return [*keys_of, *parts]


def _parse(view: memoryview) -> _Parsed:
    size = view.nbytes
    if size >= 8 and bytes(view[:8]) == OLD_MAGIC:
        raise _Malformed(
            "a payload of the format before version 3 (b'PATCHCTX'): trainer and workers run "
            "one patchctx version; upgrade the trainer"
        )
    if size < _LENGTH.size:
        raise _Malformed(f"{size} bytes is shorter than the 8-byte header length")
    (length,) = _LENGTH.unpack_from(view, 0)
    start = _LENGTH.size + length
    if length > _MAX_HEADER or start > size:
        raise _Malformed(f"the header claims {length} bytes; {size - 8} follow")
    if start % _ALIGN:
        raise _Malformed(f"the data starts at byte {start}, not a multiple of {_ALIGN}")
    header = _json(bytes(view[_LENGTH.size : start]), "the header")
    if not isinstance(header, dict):
        raise _Malformed(f"the header must be a JSON object, got {type(header).__name__}")
    metadata = _object(
        header.get("__metadata__"), ("format", "payload_version", "manifest"), "__metadata__"
    )
    if metadata["format"] != FORMAT or metadata["payload_version"] != PAYLOAD_VERSION:
        raise _Malformed(
            f"not a patchctx payload (format {metadata['format']!r:.40}, version "
            f"{metadata['payload_version']!r:.20}; this patchctx reads {FORMAT!r} "
            f"{PAYLOAD_VERSION})"
        )
    if not isinstance(metadata["manifest"], str):
        raise _Malformed("__metadata__.manifest must be JSON text")
    manifest = _object(
        _json(metadata["manifest"], "the manifest"),
        ("base_version", "target_version", "patches"),
        "the manifest",
    )
    entries = manifest["patches"]
    if not isinstance(entries, list):
        raise _Malformed(f"patches must be a list, got {type(entries).__name__}")
    base = _version(manifest["base_version"], "base_version")
    target = _version(manifest["target_version"], "target_version")
    tensors = _tensors(header, size - start)
    owners: dict[str, str] = {}
    keys = [_parse_entry(entry, i, tensors, owners) for i, entry in enumerate(entries)]
    unnamed = sorted(set(tensors) - set(owners))
    if unnamed:
        raise _Malformed(f"tensors no patch names: {unnamed[:5]}")
    return _Parsed(start, base, target, entries, tensors, keys)


def _digests(view: memoryview, parsed: _Parsed, algorithm: str) -> list[bytes]:
    start = parsed.header_bytes
    out = []
    for entry, keys in zip(parsed.entries, parsed.keys, strict=True):
        digest = hasher(algorithm)
        digest.update(_canonical(entry))
        for key in keys:
            tensor = parsed.tensors[key]
            digest.update(_tensor_label(key, tensor.code, tensor.shape))
            digest.update(view[start + tensor.begin : start + tensor.end])
        out.append(digest.digest())
    return out


def _check(
    view: memoryview,
    parsed: _Parsed,
    checksum: str | None,
    intent: Sequence[str] | None,
) -> None:
    """The payload hashes to `checksum` and each patch to its `intent` digest (if given)."""
    algorithm = FAST
    if checksum is not None:
        algorithm, _, _ = checksum.partition(":")
        if algorithm not in ALGORITHMS:
            raise InvalidPatchError(
                f"checksum {checksum!r:.40}: its algorithm is one of {', '.join(ALGORITHMS)}"
            )
    digests = _digests(view, parsed, algorithm)
    if intent is not None:
        if len(intent) != len(digests):
            raise InvalidPatchError(
                f"the trainer meant {len(intent)} patches; the payload decodes to "
                f"{len(digests)}; nothing was written"
            )
        problems = [
            PatchProblem(
                i,
                str(entry.get("name")),
                "is not what the trainer meant: its entry or bytes differ from the ones it "
                "wrote (retyped, re-encoded or altered after it was made); nothing was written",
            )
            for i, (entry, got, meant) in enumerate(
                zip(parsed.entries, digests, intent, strict=True)
            )
            if got.hex() != meant
        ]
        if problems:
            raise InvalidPatchError(problems)
    if (
        checksum is not None
        and _checksum(algorithm, view[: parsed.header_bytes], digests) != checksum
    ):
        raise InvalidPatchError(
            f"the payload is corrupt: its {algorithm} checksum is not the announced one; "
            "nothing was written"
        )


def _build(data: torch.Tensor, parsed: _Parsed) -> tuple[CheckpointWeightPatch, ...]:
    """The patches, as views of `data` (the payload's data bytes); positions decoded."""

    def bytes_of(key: str) -> torch.Tensor:
        tensor = parsed.tensors[key]
        raw = data[tensor.begin : tensor.end]
        if sys.byteorder == "big":
            raw = swap_bytes(raw.clone(), tensor.dtype.itemsize)
        return raw

    out = []
    for index, (entry, keys) in enumerate(zip(parsed.entries, parsed.keys, strict=True)):
        name, dims, dtype = entry["name"], tuple(entry["shape"]), DTYPES[entry["dtype"]]
        carried = DTYPES[entry.get("values_dtype", entry["dtype"])]
        raw = bytes_of(keys[0])
        values = raw.view(carried) if raw.numel() else torch.empty(0, dtype=carried)
        positions = entry["positions"]
        indices = None
        if positions is not None:
            numel, count = math.prod(dims), positions["count"]
            stream = (
                torch.cat([bytes_of(k) for k in keys[1:]]) if len(keys) > 2 else bytes_of(keys[1])
            )
            encoding = positions["encoding"]
            wire = {
                "int32": WireEncoding.INDICES,
                "int64": WireEncoding.INDICES,
                "gaps": WireEncoding.GAPS,
                "bitmask": WireEncoding.BITMASK,
            }[encoding]
            width = DTYPES[encoding] if wire is WireEncoding.INDICES else None
            try:
                indices = decode_positions(stream, numel, count, wire, dtype=width)
            except MalformedPositions as error:
                raise _Malformed(
                    f"patches[{index}] {name!r}.positions ({encoding}): {error}"
                ) from None
        out.append(CheckpointWeightPatch(name, dims, dtype, values, indices))
    return tuple(out)


def _buffer(data: object) -> tuple[memoryview, Any]:
    """A writable byte view of `data` and the object to build tensors over (no copy)."""
    if isinstance(data, bytes):
        data = bytearray(data)  # immutable bytes: one copy, for tensors that may be written
    try:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise _Malformed(f"a payload is bytes or a buffer, got {type(data).__name__}") from None
    if view.readonly:
        view = memoryview(bytearray(view))
    return view, view


def decode_payload(
    data: Any,
    *,
    checksum: str | None = None,
    intent: Sequence[str] | None = None,
) -> PatchPayload:
    """Decode what `encode_patches` (or a transport's `plan_payload`) made.

    Every field is checked before a tensor is built: the header (strict JSON, exactly the
    known keys, no duplicates), names, shapes, dtypes (from a fixed list), that the tensors
    cover the data exactly and each is named by one patch with the dtype and shape its entry
    implies, and, when given, the `checksum` and each patch's `intent` digest. Tensors are
    views of `data` when it is a writable buffer (a `bytearray`, a mapping), of one copy when
    it is `bytes`: nothing is unpickled and no code runs.

    Args:
        data: The payload.
        checksum: ``"<algorithm>:<hex>"`` the payload must hash to (`Sealed.checksum`).
        intent: Each patch's digest (`Sealed.intent`): a patch that hashes otherwise is
            refused by name.

    Returns:
        The decoded `PatchPayload`.

    Raises:
        InvalidPatchError: The payload is malformed, truncated, corrupt or not a patchctx
            payload.

    Examples:
        >>> from patchctx.vllm import decode_payload, encode_patches
        >>> decode_payload(encode_patches([], base_version="a", target_version="b"))
        PatchPayload(patches=(), base_version='a', target_version='b')
        >>> from patchctx import InvalidPatchError
        >>> try:
        ...     decode_payload(b"GIF89a, an image")
        ... except InvalidPatchError as error:
        ...     print(str(error).split(";")[0])
        malformed patch payload: the header claims 2318334806574123335 bytes
    """
    try:
        view, owner = _buffer(data)
        parsed = _parse(view)
        _check(view, parsed, checksum, intent)
        tensor = (
            torch.frombuffer(owner, dtype=torch.uint8)[parsed.header_bytes :]
            if view.nbytes > parsed.header_bytes
            else torch.empty(0, dtype=torch.uint8)
        )
        return PatchPayload(_build(tensor, parsed), parsed.base, parsed.target)
    except _Malformed as error:
        raise InvalidPatchError(f"malformed patch payload: {error}") from None


def decode_patches(data: Any) -> list[CheckpointWeightPatch]:
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
