"""The data plane of the ``patchctx`` backend: how payload bytes get from trainer to workers.

The control plane is vLLM's (``update_weights`` over HTTP, Ray or ``collective_rpc``): it
carries an update descriptor, a small JSON object with the payload's size, its checksum and
where to fetch it. A transport has two halves:

- the worker's (`Transport`): ``receive(descriptor)`` returns the payload as a buffer (a
  private mapping of a shared-memory file, a host copy of a broadcast), which the worker
  decodes as views;
- the trainer's (`Sender`): ``write(plan)`` writes a planned payload straight into the
  transport's buffer and returns the descriptor and checksums, ``transmit()`` moves the bytes
  (while ``update_weights`` is in flight when ``concurrent``, as collectives need),
  ``release(reuse=)`` frees (or keeps for a later update) what one update held.

Three are built in: ``inline`` (base64 inside the descriptor, below a size limit), ``shm``
(a file in a shared-memory directory of this host; what CI exercises) and ``nccl`` (a
broadcast over a trainer-worker NCCL group made by vLLM's own rendezvous helpers). Every
received payload is checked against the descriptor's size and checksum before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import mmap
import os
import re
import stat
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from patchctx import InvalidPatchError
from patchctx.vllm._codec import PayloadPlan, Sealed

__all__ = [
    "DEFAULT_INLINE_LIMIT",
    "DEFAULT_SHM_DIR",
    "INLINE_LIMIT_ENV",
    "InlineTransport",
    "NCCLTransport",
    "Sender",
    "SharedMemoryTransport",
    "Transport",
    "check_received",
    "check_size",
    "inline_limit",
    "payload_limit",
]

DEFAULT_INLINE_LIMIT = 4 << 20
"""Largest payload (bytes, before base64) a worker accepts inside the HTTP request."""
INLINE_LIMIT_ENV = "PATCHCTX_VLLM_INLINE_LIMIT"
DEFAULT_SHM_DIR = "/dev/shm"
SHM_PREFIX = "patchctx-"
POOL_MARK = "-pool-"
"""Marks a payload file the trainer keeps for later updates (the worker does not delete it)."""
MAX_PAYLOAD_ENV = "PATCHCTX_VLLM_MAX_PAYLOAD"
"""Largest payload (bytes) a worker accepts from any transport (default: see `payload_limit`)."""
# A trainer's id, as it appears in its payload files' names.
OWNER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def payload_limit(model_bytes: int, tensor_parallel: int = 1) -> int:
    """The largest payload a worker takes: ``PATCHCTX_VLLM_MAX_PAYLOAD``, or what the model allows.

    A payload is at most every checkpoint tensor once, each element with its value and an
    8-byte position: 16 times the model's bytes (times the tensor-parallel size, each rank
    holding a shard) plus 16 MiB for headers covers any honest one. Nothing larger is ever
    allocated or read.

    Examples:
        >>> from patchctx.vllm._transport import payload_limit
        >>> payload_limit(1 << 20) == 16 * (1 << 20) + (16 << 20)
        True
    """
    value = os.environ.get(MAX_PAYLOAD_ENV)
    if value is not None:
        return int(value)
    return 16 * model_bytes * max(1, tensor_parallel) + (16 << 20)


def check_size(nbytes: object, limit: int | None) -> int:
    """`nbytes` if it is an int in ``[0, limit]``; `InvalidPatchError` (before any read) if not."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise InvalidPatchError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if limit is not None and nbytes > limit:
        raise InvalidPatchError(
            f"the payload announces {nbytes} bytes, over this worker's limit of {limit} "
            f"({MAX_PAYLOAD_ENV}, or 16x the model's bytes); nothing was read or written"
        )
    return nbytes


def inline_limit() -> int:
    """The worker's inline limit: ``PATCHCTX_VLLM_INLINE_LIMIT`` (bytes) or the default."""
    value = os.environ.get(INLINE_LIMIT_ENV)
    return DEFAULT_INLINE_LIMIT if value is None else int(value)


def digest(payload: bytes | bytearray | memoryview) -> str:
    """The payload's SHA-256, as hex."""
    return hashlib.sha256(payload).hexdigest()


def check_received(payload: Any, descriptor: Mapping[str, Any]) -> Any:
    """`payload` (any buffer) if its size and SHA-256 are the descriptor's, else refused.

    Examples:
        >>> from patchctx.vllm._transport import check_received, digest
        >>> check_received(b"abc", {"nbytes": 3, "sha256": digest(b"abc")})
        b'abc'
        >>> try:
        ...     check_received(b"ab", {"nbytes": 3, "sha256": digest(b"abc")})
        ... except ValueError as error:  # an InvalidPatchError
        ...     print(str(error)[:60])
        the payload is truncated or corrupt: 2 bytes received, 3 ann
    """
    nbytes, expected = descriptor.get("nbytes"), descriptor.get("sha256")
    if len(payload) != nbytes:
        raise InvalidPatchError(
            f"the payload is truncated or corrupt: {len(payload)} bytes received, "
            f"{nbytes} announced; nothing was written"
        )
    if digest(payload) != expected:
        raise InvalidPatchError(
            "the payload is corrupt: its SHA-256 is not the announced one; nothing was written"
        )
    return payload


@runtime_checkable
class Transport(Protocol):
    """The worker's half of a data plane: fetch the payload an update descriptor names.

    Examples:
        >>> from patchctx.vllm._transport import InlineTransport, Transport
        >>> isinstance(InlineTransport(), Transport)
        True
    """

    name: str

    def receive(self, descriptor: Mapping[str, Any]) -> Any:
        """The payload, a buffer of ``descriptor["nbytes"]`` bytes (checked by the caller)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (a process group, say)."""
        ...


@runtime_checkable
class Sender(Protocol):
    """The trainer's half of a data plane.

    Examples:
        >>> from patchctx.vllm._transport import InlineTransport, Sender
        >>> isinstance(InlineTransport(), Sender)
        True
    """

    name: str
    concurrent: bool
    """Whether `transmit` must run while the worker's ``update_weights`` is in flight."""

    def write(
        self, plan: PayloadPlan, *, algorithm: str, pooled: bool = False
    ) -> tuple[dict[str, Any], Sealed]:
        """Write `plan` into the transport's buffer; the descriptor's fields and its hashes.

        With `pooled`, the buffer may be one an earlier update used (and is kept until
        ``release(reuse=True)``); without, it is fresh and never written again.
        """
        ...

    def describe(self, payload: bytes) -> dict[str, Any]:
        """The descriptor's transport fields for ready-made bytes (size and digest added)."""
        ...

    def transmit(self, payload: bytes | None = None) -> None:
        """Move the bytes (a collective, for example); may do nothing."""
        ...

    def release(self, *, reuse: bool = False) -> None:
        """Free what the update held; with `reuse`, keep pooled buffers for the next one.

        Pass `reuse` only once the update's ``finish_weight_update`` has returned: no worker
        holds a view of them any more.
        """
        ...

    def close(self) -> None:
        """Release the sender's resources."""
        ...


class InlineTransport:
    """The payload inside the ``update_weights`` request, base64: for small updates.

    Workers accept at most `limit` bytes this way (default ``PATCHCTX_VLLM_INLINE_LIMIT``,
    else 4 MiB): larger updates belong on a data plane, not in the HTTP server's memory.

    Examples:
        >>> from patchctx.vllm._transport import InlineTransport, check_received, digest
        >>> transport = InlineTransport(limit=16)
        >>> descriptor = {**transport.describe(b"payload"), "nbytes": 7,
        ...               "sha256": digest(b"payload")}
        >>> check_received(transport.receive(descriptor), descriptor)
        b'payload'
        >>> try:
        ...     transport.receive({"inline": "A" * 40, "nbytes": 30})
        ... except ValueError as error:  # an InvalidPatchError
        ...     print(str(error)[:59])
        an inline payload of 30 bytes is over this worker's limit o
    """

    name = "inline"
    concurrent = False

    def __init__(self, *, limit: int | None = None) -> None:
        self.limit = inline_limit() if limit is None else limit

    def _check_size(self, nbytes: object) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidPatchError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if nbytes > self.limit:
            raise InvalidPatchError(
                f"an inline payload of {nbytes} bytes is over this worker's limit of "
                f"{self.limit} bytes ({INLINE_LIMIT_ENV}); send it through the transport "
                "chosen at init"
            )

    def receive(self, descriptor: Mapping[str, Any]) -> bytes:
        """Decode the base64 text of ``descriptor["inline"]``."""
        self._check_size(descriptor.get("nbytes"))
        text = descriptor.get("inline")
        if not isinstance(text, str) or len(text) > 4 * (self.limit // 3 + 1):
            raise InvalidPatchError("inline must be base64 text within the inline limit")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as error:
            raise InvalidPatchError(f"inline is not valid base64: {error}") from None

    def write(
        self, plan: PayloadPlan, *, algorithm: str, pooled: bool = False
    ) -> tuple[dict[str, Any], Sealed]:
        """``{"inline": base64 text}`` of the payload, written into a fresh buffer."""
        self._check_size(plan.nbytes)
        buffer = bytearray(plan.nbytes)
        sealed = plan.write_into(buffer, algorithm=algorithm)
        return {"inline": base64.b64encode(buffer).decode("ascii")}, sealed

    def describe(self, payload: bytes) -> dict[str, Any]:
        """``{"inline": base64 text}``."""
        self._check_size(len(payload))
        return {"inline": base64.b64encode(payload).decode("ascii")}

    def transmit(self, payload: bytes | None = None) -> None:
        """Nothing to do: the bytes travel in the request."""

    def release(self, *, reuse: bool = False) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""


@dataclass(eq=False)
class _PoolFile:
    """A payload file the trainer keeps mapped between updates (tmpfs pages stay resident)."""

    path: Path
    size: int
    mapping: mmap.mmap | None

    def resize(self, size: int) -> None:
        if size == self.size and (self.mapping is not None or size == 0):
            return
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        with open(self.path, "r+b") as file:
            file.truncate(size)
            if size:
                self.mapping = _map_shared(file.fileno(), size)
        self.size = size

    def drop(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        self.path.unlink(missing_ok=True)


def _map_shared(fd: int, size: int) -> mmap.mmap:
    """A writable shared mapping, its page tables filled at once where the OS can."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _Pool:
    """The trainer's payload files: fresh ones (deleted at release) and pooled ones."""

    def __init__(self, directory: Path, owner: str | None) -> None:
        self.directory, self.owner = directory, owner
        self.written: list[Path] = []
        self.free: list[_PoolFile] = []  # pooled files no worker reads: may be written
        self.busy: list[_PoolFile] = []  # pooled files of the update in flight

    def name(self, pooled: bool) -> Path:
        owner = f"{self.owner}-" if self.owner is not None else ""
        mark = POOL_MARK.lstrip("-") if pooled else ""
        return self.directory / f"{SHM_PREFIX}{owner}{mark}{uuid.uuid4().hex}"

    def fresh(self, size: int) -> Path:
        """A new file of `size` bytes, mode 0600, deleted at release."""
        path = self.name(pooled=False)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.written.append(path)
        with os.fdopen(fd, "r+b") as file:
            file.truncate(size)
        return path

    def take(self, size: int) -> _PoolFile:
        """A pooled file of `size` bytes no worker reads (one of the same size if any)."""
        same = [f for f in self.free if f.size == size]
        if same or self.free:
            chosen = (same or self.free)[0]
            self.free.remove(chosen)
        else:
            path = self.name(pooled=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            chosen = _PoolFile(path, -1, None)
        self.busy.append(chosen)
        chosen.resize(size)
        return chosen

    def release(self, *, reuse: bool) -> None:
        while self.written:
            self.written.pop().unlink(missing_ok=True)
        while self.busy:
            pooled = self.busy.pop()
            if reuse:
                self.free.append(pooled)
            else:
                pooled.drop()

    def close(self) -> None:
        self.release(reuse=False)
        while self.free:
            self.free.pop().drop()


Kept = dict[str, tuple[tuple[int, int, int], mmap.mmap]]


def _kept_mapping(
    mapped: Kept, directory: Path, name: str, info: os.stat_result, fd: int
) -> mmap.mmap:
    """The worker's mapping of a pooled file, kept across updates (its page tables too).

    The trainer writes a pooled file again only after the finish of the update that read it,
    when no view of it is left here; a mapping of another file (or size) than the one the
    name now holds is dropped, and so is every mapping of a file no longer there.
    """
    key = (info.st_dev, info.st_ino, info.st_size)
    for other, (known, _) in list(mapped.items()):
        try:
            now = os.stat(directory / other, follow_symlinks=False)
            alive = (now.st_dev, now.st_ino, now.st_size) == known
        except OSError:
            alive = False
        if not alive or (other == name and known != key):
            mapped.pop(other)  # closed once its last view is gone
    entry = mapped.get(name)
    if entry is None:
        mapping = mmap.mmap(
            fd, info.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        entry = mapped[name] = (key, mapping)
    return entry[1]


class SharedMemoryTransport:
    """A file per payload in a shared-memory directory of this host (default ``/dev/shm``).

    The trainer writes the payload straight into a mapped ``<directory>/patchctx-<id>-...``
    file and names it in the descriptor; each worker maps it (all tensor-parallel ranks map
    the same file) and decodes views of it, without a copy. A worker opens only files named
    ``patchctx-*`` directly inside its own directory, never through a link, a FIFO or a
    device, and checks the size before it maps a byte.

    Lifetimes (so that no byte changes after a worker checked it): a file is written once
    per update, before it is described, and never while a worker may read it. A fresh file
    (``send_weight_chunk``) is deleted by the worker once read and by the trainer after the
    chunk; the worker's mapping keeps its bytes. A pooled file (``send_weights``: names with
    ``-pool-``) is written again only for a later update, after the ``finish_weight_update``
    of the one that used it returned (every worker has then applied or dropped the update,
    and holds no view of it); the trainer deletes its pool at shutdown, and a worker sweeps
    a dead trainer's files when another connects. With ``copy=True`` (an untrusted link:
    ``integrity="sha256"``) a worker reads the file into its own memory instead of mapping
    it, so that what it checked cannot change.

    Args:
        directory: The directory; the trainer and the workers must name the same one.
        owner: The trainer's id (its files' names start with it).
        limit: The largest payload a worker maps.
        copy: Read a private copy instead of mapping the file (worker side).

    Examples:
        >>> import tempfile
        >>> from patchctx.vllm._transport import SharedMemoryTransport, digest
        >>> sender = SharedMemoryTransport(tempfile.mkdtemp())
        >>> descriptor = {**sender.describe(b"payload"), "nbytes": 7}
        >>> bytes(SharedMemoryTransport(sender.directory).receive(descriptor))
        b'payload'
        >>> sender.release()  # the file is gone
        >>> try:
        ...     SharedMemoryTransport(sender.directory).receive({"shm": "../etc/passwd"})
        ... except ValueError as error:  # an InvalidPatchError
        ...     print(str(error)[-15:])
        '../etc/passwd'
    """

    name = "shm"
    concurrent = False

    def __init__(
        self,
        directory: str = "/dev/shm",
        *,
        owner: str | None = None,
        limit: int | None = None,
        copy: bool = False,
    ) -> None:
        self.directory = Path(directory)
        if owner is not None and not OWNER.fullmatch(owner):
            raise InvalidPatchError(f"a trainer id is 1-64 of [A-Za-z0-9_.-], got {owner!r}")
        self.owner = owner
        self.limit = limit
        self.copy = copy
        self._pool = _Pool(self.directory, owner)  # trainer side: the files it wrote
        # A trainer that exits without closing its sender deletes its pool all the same (a
        # killed one leaves it to the workers' sweep at the next connect).
        weakref.finalize(self, self._pool.close)
        # Worker side: pooled files kept mapped, by name: ((device, inode, size), mapping).
        self._mapped: Kept = {}

    def _path(self, name: object) -> Path:
        if (
            not isinstance(name, str)
            or not name.startswith(SHM_PREFIX)
            or Path(name).name != name
            or name in (".", "..")
        ):
            raise InvalidPatchError(
                f"shm must name a {SHM_PREFIX}* file in the transport's directory, got {name!r}"
            )
        return self.directory / name

    def receive(self, descriptor: Mapping[str, Any]) -> Any:
        """Map (or, with `copy`, read) the file ``descriptor["shm"]`` names.

        A regular file of exactly ``nbytes``, opened without following a link and without
        blocking (a FIFO or device named like a payload is refused, not waited on); its size
        is checked before a byte is read. The mapping is private: a write into a decoded
        tensor never reaches the file.
        """
        path = self._path(descriptor.get("shm"))
        nbytes = check_size(descriptor.get("nbytes"), self.limit)
        try:
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
            fd = os.open(path, flags)
        except OSError as error:
            raise InvalidPatchError(
                f"the payload file {str(path)!r} cannot be read ({error.strerror}): the trainer "
                "may have died before writing it; nothing was written"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidPatchError(
                    f"the payload file {str(path)!r} is not a regular file (a FIFO, a device, "
                    "a directory); nothing was read or written"
                )
            if info.st_size != nbytes:
                raise InvalidPatchError(
                    f"the payload is truncated or corrupt: the file {str(path)!r} holds "
                    f"{info.st_size} bytes, {nbytes} announced; nothing was read or written"
                )
            if nbytes == 0:
                return bytearray()
            if not self.copy and POOL_MARK in path.name:
                return _kept_mapping(self._mapped, self.directory, path.name, info, fd)
            if self.copy:
                buffer = bytearray(nbytes)
                with os.fdopen(os.dup(fd), "rb", buffering=0) as file:
                    got = file.readinto(buffer)
                if got != nbytes:
                    raise InvalidPatchError(
                        f"the payload file {str(path)!r} changed while read; nothing was written"
                    )
                return buffer
            return mmap.mmap(
                fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)

    def forget(self, descriptor: Mapping[str, Any]) -> None:
        """Drop the kept mapping of ``descriptor["shm"]`` (after a refusal: map it afresh)."""
        name = descriptor.get("shm")
        if isinstance(name, str):
            self._mapped.pop(name, None)

    def consume(self, descriptor: Mapping[str, Any]) -> None:
        """Delete the file ``descriptor["shm"]`` names once every worker has it (not a pooled one).

        The workers' mappings keep its bytes; a pooled file stays for its trainer to reuse.
        """
        try:
            path = self._path(descriptor.get("shm"))
        except InvalidPatchError:
            return
        if POOL_MARK in path.name:
            return
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink(missing_ok=True)
        except OSError:
            pass

    def sweep(self, owner: str | None) -> int:
        """Delete the payload files trainer `owner` left (it died, or restarted)."""
        if owner is None or not OWNER.fullmatch(owner):
            return 0
        removed = 0
        for path in self.directory.glob(f"{SHM_PREFIX}{owner}-*"):
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    path.unlink(missing_ok=True)
                    removed += 1
            except OSError:
                pass
        return removed

    def write(
        self, plan: PayloadPlan, *, algorithm: str, pooled: bool = False
    ) -> tuple[dict[str, Any], Sealed]:
        """Write `plan` straight into a mapped file; ``{"shm": its name}`` and its hashes.

        The mapping is the trainer's only handle on the file: a fresh one is closed before
        this returns, a pooled one is kept by the pool and written again only after
        ``release(reuse=True)``.
        """
        if not pooled:
            path = self._pool.fresh(plan.nbytes)
            if plan.nbytes == 0:
                return {"shm": path.name}, plan.write_into(bytearray())
            with open(path, "r+b") as file, _map_shared(file.fileno(), plan.nbytes) as mapping:
                sealed = plan.write_into(mapping, algorithm=algorithm)
            return {"shm": path.name}, sealed
        chosen = self._pool.take(plan.nbytes)
        target = chosen.mapping if chosen.mapping is not None else bytearray()
        return {"shm": chosen.path.name}, plan.write_into(target, algorithm=algorithm)

    def describe(self, payload: bytes) -> dict[str, Any]:
        """Write ready-made `payload` bytes to a new file; ``{"shm": its name}``."""
        path = self._pool.fresh(len(payload))
        with open(path, "r+b") as file:
            file.write(payload)
        return {"shm": path.name}

    def transmit(self, payload: bytes | None = None) -> None:
        """Nothing to do: `write` wrote the file."""

    def release(self, *, reuse: bool = False) -> None:
        """Delete the fresh files; pooled ones go back to the pool with `reuse`, else too."""
        self._pool.release(reuse=reuse)

    def close(self) -> None:
        """Delete every file this sender holds; drop every mapping this worker kept."""
        self._pool.close()
        self._mapped.clear()


class NCCLTransport:
    """A broadcast of the payload bytes over a trainer-worker NCCL group (CUDA).

    The group is made the way vLLM's ``nccl`` and ``sparse_nccl`` backends make theirs: the
    trainer is rank 0 of a ``StatelessProcessGroup`` rendezvous at
    ``master_address:master_port``, and each worker joins at ``1 +`` its global rank (vLLM's
    ``worker_init_process_group`` / ``trainer_init`` helpers). One update is one broadcast of
    a ``uint8`` tensor of the announced size: the trainer writes the payload into a (pinned)
    host buffer and broadcasts it; the worker copies it to host memory once and decodes
    views of that copy.

    Args:
        communicator: A ``PyNcclCommunicator`` (or anything with ``broadcast(tensor, src=,
            stream=)`` and ``device``), made with `for_worker` or `for_trainer`.

    Examples:
        >>> import torch
        >>> from patchctx.vllm._transport import NCCLTransport
        >>> class Loopback:  # stands for a NCCL communicator whose rank 0 sent b"hi"
        ...     device = torch.device("cpu")
        ...     def broadcast(self, tensor, src, stream=None):
        ...         tensor.copy_(torch.tensor(list(b"hi"), dtype=torch.uint8))
        >>> bytes(NCCLTransport(Loopback()).receive({"nbytes": 2}))
        b'hi'
    """

    name = "nccl"
    concurrent = True

    def __init__(self, communicator: Any, *, limit: int | None = None) -> None:
        self.communicator = communicator
        self.limit = limit  # the most bytes a receive allocates (see `payload_limit`)
        self._staged: torch.Tensor | None = None  # what `write` wrote, for `transmit`

    @classmethod
    def for_worker(
        cls,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        parallel_config: Any,
        limit: int | None = None,
    ) -> NCCLTransport:
        """Join the trainer's group from an inference worker (rank ``1 +`` worker rank)."""
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_process_group,
        )

        info = NCCLWeightTransferInitInfo(
            master_address=master_address,
            master_port=master_port,
            rank_offset=1,
            world_size=world_size,
        )
        return cls(worker_init_process_group(info, parallel_config), limit=limit)

    @classmethod
    def for_trainer(
        cls, *, master_address: str, master_port: int, world_size: int
    ) -> NCCLTransport:
        """Open the group as its rank 0, on the trainer's current CUDA device."""
        from types import SimpleNamespace

        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        rendezvous = SimpleNamespace(
            master_address=master_address, master_port=master_port, world_size=world_size
        )
        return cls(trainer_init(rendezvous))

    def _device(self) -> torch.device:
        device = getattr(self.communicator, "device", torch.device("cpu"))
        return device if isinstance(device, torch.device) else torch.device(device)

    def _stream(self) -> Any:
        device = self._device()
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def receive(self, descriptor: Mapping[str, Any]) -> Any:
        """Receive the broadcast of ``descriptor["nbytes"]`` bytes (at most `limit`)."""
        nbytes = check_size(descriptor.get("nbytes"), self.limit)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device())
        self.communicator.broadcast(buffer, src=0, stream=self._stream())
        return buffer.cpu().numpy().data  # one device-to-host copy on CUDA, none here

    def write(
        self, plan: PayloadPlan, *, algorithm: str, pooled: bool = False
    ) -> tuple[dict[str, Any], Sealed]:
        """Write `plan` into a host buffer (pinned with CUDA) for `transmit`."""
        pinned = self._device().type == "cuda"
        host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=pinned)
        sealed = plan.write_into(host.numpy().data, algorithm=algorithm)
        self._staged = host
        return {}, sealed

    def describe(self, payload: bytes) -> dict[str, Any]:
        """Nothing but the size and digest (added by the caller)."""
        self._staged = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return {}

    def transmit(self, payload: bytes | None = None) -> None:
        """Broadcast the bytes from rank 0 (while the workers' ``update_weights`` runs)."""
        device = self._device()
        if payload is not None:
            self.describe(payload)
        host = self._staged
        if host is None:
            raise InvalidPatchError("nothing to transmit: write or describe a payload first")
        buffer = host.to(device, non_blocking=True) if device.type == "cuda" else host
        self.communicator.broadcast(buffer, src=0, stream=self._stream())
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def release(self, *, reuse: bool = False) -> None:
        """Drop the staged buffer."""
        self._staged = None

    def close(self) -> None:
        """Destroy the communicator."""
        destroy = getattr(self.communicator, "destroy", None)
        if callable(destroy):
            destroy()
