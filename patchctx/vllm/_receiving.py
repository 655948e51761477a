"""How a worker receives one chunk: the transport, the checksum it requires, what it may declare.

`ChunkReceiver` fetches a chunk's payload (inline, or through the transport chosen at init),
checks its size and checksum, decodes it, and bounds every name, shape and dtype it declares
by what the worker knows, all before anything is staged or written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from patchctx import CheckpointWeightPatch, InvalidPatchError
from patchctx._errors import PatchProblem
from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._codec import FAST, SECURE, PatchPayload, decode_payload
from patchctx.vllm._transport import (
    InlineTransport,
    NCCLTransport,
    SharedMemoryTransport,
    Transport,
    check_received,
    check_size,
    payload_limit,
)
from patchctx.vllm._warmup import checkpoint_specs

if TYPE_CHECKING:
    from patchctx.vllm._backend import PatchctxInitInfo, PatchctxUpdateInfo

__all__ = ["DEFAULT_INTEGRITY", "ChunkReceiver"]

# The checksum each transport needs by default: a fast one where the link is trusted (this
# host's shared memory, the NCCL group), SHA-256 where it is not (bytes inside HTTP requests).
DEFAULT_INTEGRITY = {"shm": FAST, "nccl": FAST, "inline": SECURE}


class ChunkReceiver:
    """One worker's receiving side: its transports, the integrity it requires, its bounds.

    Attributes:
        inline: The transport of payloads sent inline (always open).
        transport: The transport chosen at init (`None` before one, or after shutdown).
        integrity: The checksum algorithm required (`None`: by transport, `DEFAULT_INTEGRITY`).
        max_payload: The largest payload accepted, in bytes.
        specs: The checkpoint's tensors (name -> shape, dtype), read from its files: what a
            payload may declare. Empty when unknown (bounded by the model's size then).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model = model
        self.inline = InlineTransport()
        self.transport: Transport | None = None
        self.integrity: str | None = None
        parallel = vllm_config.parallel_config
        self.tensor_parallel = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.model_bytes = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]
            if t.device.type != "meta"
        )
        self.max_payload = payload_limit(self.model_bytes, self.tensor_parallel)
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            name: (shape, dtype) for name, shape, dtype in _specs(vllm_config)
        }

    def disconnect(self, previous: str | None, trainer: str | None) -> None:
        """Close the transport of trainer `previous`, for `trainer` (the one connecting)."""
        if self.transport is not None:
            if isinstance(self.transport, SharedMemoryTransport) and previous != trainer:
                self.transport.sweep(previous)  # files a trainer died before sending
            self.transport.close()
            self.transport = None

    def connect(self, info: PatchctxInitInfo, parallel_config: Any) -> None:
        """Require the integrity `info` names; open the transport it chooses."""
        self.integrity = info.integrity
        if info.transport == "shm":
            self.transport = SharedMemoryTransport(
                info.shm_dir, limit=self.max_payload, copy=info.integrity == SECURE
            )
            self.transport.sweep(info.trainer_id)  # its own, from an earlier life
        elif info.transport == "nccl":
            assert info.master_address is not None
            assert info.master_port is not None and info.world_size is not None
            self.transport = NCCLTransport.for_worker(
                master_address=info.master_address,
                master_port=info.master_port,
                world_size=info.world_size,
                parallel_config=parallel_config,
                limit=self.max_payload,
            )

    def fetch(self, info: PatchctxUpdateInfo) -> PatchPayload:
        """The chunk's payload, read, checked, decoded and bounded (views of the read bytes)."""
        check_size(info.nbytes, self.max_payload)
        descriptor = info.descriptor()
        transport: Transport
        if info.inline is not None:
            transport = self.inline
        elif self.transport is None:
            raise InvalidPatchError(
                "no transport: call init_weight_transfer_engine first, or send the payload inline"
            )
        else:
            transport = self.transport
        self.check_integrity(info, transport.name)
        data = transport.receive(descriptor)
        if info.sha256 is not None:
            check_received(data, descriptor)
        elif len(data) != info.nbytes:
            raise InvalidPatchError(
                f"the payload is truncated or corrupt: {len(data)} bytes received, "
                f"{info.nbytes} announced; nothing was written"
            )
        # Views of `data` (a private mapping of the trainer's file): held until commit/abort.
        payload = decode_payload(data, checksum=info.checksum, intent=info.intent)
        del data
        self.bound(payload.patches)
        return payload

    def consumed(self, descriptor: dict[str, Any], refused: bool) -> None:
        """Every worker has read the chunk of `descriptor`: nothing of it stays in /dev/shm."""
        if descriptor and isinstance(self.transport, SharedMemoryTransport):
            self.transport.consume(descriptor)
            if refused:
                self.transport.forget(descriptor)  # a refused file is mapped afresh next time

    def close(self) -> None:
        """Close the transport chosen at init, if any."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def check_integrity(self, info: PatchctxUpdateInfo, transport: str) -> None:
        """The chunk carries a checksum of the strength this transport needs (before a read)."""
        need = self.integrity or DEFAULT_INTEGRITY.get(transport, SECURE)
        if info.sha256 is not None:
            return  # the payload's own SHA-256: strong enough anywhere
        if info.checksum is None:
            raise InvalidPatchError(
                "the chunk carries no checksum (checksum or sha256); nothing was read or written"
            )
        algorithm = info.checksum.partition(":")[0]
        if need == SECURE and algorithm != SECURE:
            raise InvalidPatchError(
                f"this worker requires a {SECURE} checksum on the {transport} transport (its "
                f"integrity setting); the chunk carries {algorithm!r}; nothing was read or "
                "written"
            )

    def bound(self, patches: Sequence[CheckpointWeightPatch]) -> None:
        """Every declared name, shape and dtype is one the worker knows, before any staging.

        With the checkpoint's specs (read from its files): the name (tied aliases resolved)
        must be one of its tensors, with its shape. Without them: no patch may declare more
        bytes than the model holds (times the tensor-parallel size). Either way, nothing
        checkpoint-sized is allocated for a name or shape the payload only declares.
        """
        problems = []
        aliases = tied_aliases(self.model) if self.specs else {}
        limit = self.model_bytes * self.tensor_parallel
        for i, patch in enumerate(patches):
            shape = tuple(int(d) for d in patch.shape)
            if self.specs:
                name = aliases.get(patch.name, patch.name)
                known = self.specs.get(name) or self.specs.get(patch.name)
                if known is None:
                    problems.append(
                        PatchProblem(
                            i,
                            patch.name,
                            "is not a tensor of the checkpoint this engine loaded; nothing "
                            "was written",
                        )
                    )
                elif known[0] != shape:
                    problems.append(
                        PatchProblem(
                            i,
                            patch.name,
                            f"declares shape {list(shape)}; the checkpoint's tensor is "
                            f"{list(known[0])}; nothing was written",
                        )
                    )
                continue
            nbytes = math.prod(shape) * patch.dtype.itemsize
            if nbytes > limit:
                problems.append(
                    PatchProblem(
                        i,
                        patch.name,
                        f"declares {list(shape)} {patch.dtype} ({nbytes} bytes), more than the "
                        f"whole model holds ({limit} bytes); nothing was written",
                    )
                )
        if problems:
            raise InvalidPatchError(problems)


def _specs(vllm_config: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The checkpoint's tensors, or none (a config without a local checkpoint)."""
    try:
        return checkpoint_specs(vllm_config)
    except Exception:  # unreadable files: bounded by the model's size instead
        return []
