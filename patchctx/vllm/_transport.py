"""The data plane of the ``patchctx`` backend: how payload bytes get from trainer to workers.

The control plane is vLLM's (``update_weights`` over HTTP, Ray or ``collective_rpc``): it
carries an update descriptor, a small JSON object with the payload's size, its SHA-256 and
where to fetch it. A transport has two halves:

- the worker's (`Transport`): ``receive(descriptor)`` returns the bytes;
- the trainer's (`Sender`): ``describe(payload)`` returns the descriptor, ``transmit(payload)``
  moves the bytes (while ``update_weights`` is in flight when ``concurrent``, as collectives
  need), ``release()`` frees what one update held.

Three are built in: ``inline`` (base64 inside the descriptor, below a size limit), ``shm``
(a file in a shared-memory directory of this host; what CI exercises) and ``nccl`` (a
broadcast over a trainer-worker NCCL group made by vLLM's own rendezvous helpers). Every
received payload is checked against the descriptor's size and digest before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from patchctx import InvalidPatchError

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


def check_received(payload: bytes, descriptor: Mapping[str, Any]) -> bytes:
    """`payload` if its size and SHA-256 are the descriptor's; `InvalidPatchError` if not.

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

    def receive(self, descriptor: Mapping[str, Any]) -> bytes:
        """The payload's bytes (checked by the caller against size and digest)."""
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

    def describe(self, payload: bytes) -> dict[str, Any]:
        """The descriptor's transport fields for `payload` (size and digest are added)."""
        ...

    def transmit(self, payload: bytes) -> None:
        """Move the bytes (a collective, for example); may do nothing."""
        ...

    def release(self) -> None:
        """Free what the last update held, once the worker has it."""
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

    def describe(self, payload: bytes) -> dict[str, Any]:
        """``{"inline": base64 text}``."""
        self._check_size(len(payload))
        return {"inline": base64.b64encode(payload).decode("ascii")}

    def transmit(self, payload: bytes) -> None:
        """Nothing to do: the bytes travel in the request."""

    def release(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""


class SharedMemoryTransport:
    """A file per update in a shared-memory directory of this host (default ``/dev/shm``).

    The trainer writes the payload to ``<directory>/patchctx-<random>`` and names the file in
    the descriptor; each worker reads it (all tensor-parallel ranks read the same file) and
    the trainer deletes it after the update. A worker reads only files named
    ``patchctx-*`` directly inside its own directory, never through a link, and checks size
    and digest, so a trainer killed while writing leaves a payload that is refused.

    Args:
        directory: The directory; the trainer and the workers must name the same one.

    Examples:
        >>> import tempfile
        >>> from patchctx.vllm._transport import SharedMemoryTransport, digest
        >>> sender = SharedMemoryTransport(tempfile.mkdtemp())
        >>> descriptor = {**sender.describe(b"payload"), "nbytes": 7}
        >>> SharedMemoryTransport(sender.directory).receive(descriptor)
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
        self, directory: str = "/dev/shm", *, owner: str | None = None, limit: int | None = None
    ) -> None:
        self.directory = Path(directory)
        if owner is not None and not OWNER.fullmatch(owner):
            raise InvalidPatchError(f"a trainer id is 1-64 of [A-Za-z0-9_.-], got {owner!r}")
        self.owner = owner
        self.limit = limit
        self._written: list[Path] = []

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

    def receive(self, descriptor: Mapping[str, Any]) -> bytes:
        """Read the file ``descriptor["shm"]`` names: a regular file of exactly ``nbytes``.

        Opened without following a link and without blocking (a FIFO or device named like
        a payload is refused, not waited on); its size is checked before a byte is read.
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
            regular = stat.S_ISREG(info.st_mode)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise InvalidPatchError(
                f"the payload file {str(path)!r} is not a regular file (a FIFO, a device, "
                "a directory); nothing was read or written"
            )
        with os.fdopen(fd, "rb", buffering=0) as file:
            if info.st_size != nbytes:
                raise InvalidPatchError(
                    f"the payload is truncated or corrupt: the file {str(path)!r} holds "
                    f"{info.st_size} bytes, {nbytes} announced; nothing was read or written"
                )
            return file.read(nbytes)  # (a regular file: what it holds, at most nbytes)

    def consume(self, descriptor: Mapping[str, Any]) -> None:
        """Delete the file ``descriptor["shm"]`` names, once every worker has read it."""
        try:
            path = self._path(descriptor.get("shm"))
        except InvalidPatchError:
            return
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink(missing_ok=True)
        except OSError:
            pass

    def sweep(self, owner: str | None) -> int:
        """Delete the payload files trainer `owner` left (it died before they were read)."""
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

    def describe(self, payload: bytes) -> dict[str, Any]:
        """Write `payload` to a new file; ``{"shm": its name}``."""
        owner = f"{self.owner}-" if self.owner is not None else ""
        name = f"{SHM_PREFIX}{owner}{uuid.uuid4().hex}"
        path = self.directory / name
        with open(path, "xb") as file:
            file.write(payload)
        self._written.append(path)
        return {"shm": name}

    def transmit(self, payload: bytes) -> None:
        """Nothing to do: `describe` wrote the file."""

    def release(self) -> None:
        """Delete the files this sender wrote."""
        while self._written:
            self._written.pop().unlink(missing_ok=True)

    def close(self) -> None:
        """Delete what is left."""
        self.release()


class NCCLTransport:
    """A broadcast of the payload bytes over a trainer-worker NCCL group (CUDA).

    The group is made the way vLLM's ``nccl`` and ``sparse_nccl`` backends make theirs: the
    trainer is rank 0 of a ``StatelessProcessGroup`` rendezvous at
    ``master_address:master_port``, and each worker joins at ``1 +`` its global rank (vLLM's
    ``worker_init_process_group`` / ``trainer_init`` helpers). One update is one broadcast of
    a ``uint8`` tensor of the announced size; the worker copies it to host memory to decode.

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
        >>> NCCLTransport(Loopback()).receive({"nbytes": 2})
        b'hi'
    """

    name = "nccl"
    concurrent = True

    def __init__(self, communicator: Any, *, limit: int | None = None) -> None:
        self.communicator = communicator
        self.limit = limit  # the most bytes a receive allocates (see `payload_limit`)

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

    def _stream(self) -> Any:
        device = getattr(self.communicator, "device", torch.device("cpu"))
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def receive(self, descriptor: Mapping[str, Any]) -> bytes:
        """Receive the broadcast of ``descriptor["nbytes"]`` bytes (at most `limit`)."""
        nbytes = check_size(descriptor.get("nbytes"), self.limit)
        device = getattr(self.communicator, "device", torch.device("cpu"))
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.communicator.broadcast(buffer, src=0, stream=self._stream())
        return bytes(buffer.cpu().numpy().tobytes())

    def describe(self, payload: bytes) -> dict[str, Any]:
        """Nothing but the size and digest (added by the caller)."""
        return {}

    def transmit(self, payload: bytes) -> None:
        """Broadcast the bytes from rank 0 (while the workers' ``update_weights`` runs)."""
        device = getattr(self.communicator, "device", torch.device("cpu"))
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        self.communicator.broadcast(buffer, src=0, stream=self._stream())
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def release(self) -> None:
        """Nothing held between updates."""

    def close(self) -> None:
        """Destroy the communicator."""
        destroy = getattr(self.communicator, "destroy", None)
        if callable(destroy):
            destroy()
