"""How the trainer engine puts an update on its way: chunks, written and delivered in order.

`run_update` is one update from start to finish (or abort). `UpdateWriter` lays each chunk
out (`plan_payload`), writes it into the transport's buffer (or inline, when small), and tells
the workers of it (``update_weights``) while the next chunk is written. `connect` opens the
transport and declares the trainer to every worker; `priced` tells a cost model how this
trainer's positions travel. `PatchctxTrainerEngine` holds what outlives an update: the
version, the record of the state, the senders.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from patchctx import CheckpointWeightPatch, UpdateCost, patch_nbytes
from patchctx.vllm._backend import VLLM_START_VERSION
from patchctx.vllm._codec import FAST, SECURE, PayloadPlan, Sealed, plan_payload
from patchctx.vllm._transport import (
    InlineTransport,
    NCCLTransport,
    Sender,
    SharedMemoryTransport,
)

__all__ = [
    "BytesSender",
    "UpdateWriter",
    "chunks",
    "connect",
    "kept",
    "priced",
    "run_update",
    "served_version",
]

# What `UpdateWriter.send_all` measured: diff, encode and update seconds, bytes, transports.
Figures = tuple[float, float, float, int, set[str]]


@runtime_checkable
class BytesSender(Protocol):
    """A sender that takes ready-made payload bytes (`Sender` without ``write``).

    Examples:
        >>> from patchctx.vllm._sending import BytesSender
        >>> from patchctx.vllm._transport import InlineTransport
        >>> isinstance(InlineTransport(), BytesSender)
        True
    """

    name: str
    concurrent: bool

    def describe(self, payload: bytes) -> dict[str, Any]:
        """The descriptor's transport fields for `payload`."""
        ...

    def transmit(self, payload: bytes) -> None:
        """Move the bytes."""
        ...

    def release(self) -> None:
        """Free what the update held."""
        ...

    def close(self) -> None:
        """Release the sender's resources."""
        ...


class _FromBytes:
    """A `Sender` over a `BytesSender`: the payload is written into bytes, then handed over."""

    def __init__(self, inner: BytesSender) -> None:
        self.inner = inner
        self.name, self.concurrent = inner.name, inner.concurrent
        self._payload: bytes | None = None

    def write(
        self, plan: PayloadPlan, *, algorithm: str, pooled: bool = False
    ) -> tuple[dict[str, Any], Sealed]:
        buffer = bytearray(plan.nbytes)
        sealed = plan.write_into(buffer, algorithm=algorithm)
        self._payload = bytes(buffer)
        return self.inner.describe(self._payload), sealed

    def describe(self, payload: bytes) -> dict[str, Any]:
        self._payload = payload
        return self.inner.describe(payload)

    def transmit(self, payload: bytes | None = None) -> None:
        data = payload if payload is not None else self._payload
        assert data is not None, "write first"
        self.inner.transmit(data)

    def release(self, *, reuse: bool = False) -> None:
        self._payload = None
        self.inner.release()

    def close(self) -> None:
        self.inner.close()


def chunks(
    patches: Iterable[CheckpointWeightPatch], chunk_bytes: int | None
) -> Iterator[list[CheckpointWeightPatch]]:
    """`patches` in runs of about `chunk_bytes` of values and indices (one run: `None`).

    A run is yielded once it is full, before the next patch is asked for: from a stream
    of patches (`iter_diff_state_dicts`), the rest is diffed while it travels.
    """
    if chunk_bytes is None:
        yield list(patches)
        return
    group: list[CheckpointWeightPatch] = []
    size = 0
    for patch in patches:
        nbytes = patch_nbytes([patch])
        if group and size + nbytes > chunk_bytes:
            yield group
            group, size = [], 0
        group.append(patch)
        size += nbytes
    yield group


def kept(
    patches: Iterable[CheckpointWeightPatch], taken: list[CheckpointWeightPatch]
) -> Iterator[CheckpointWeightPatch]:
    """`patches`, each appended to `taken` as it is handed on."""
    for patch in patches:
        taken.append(patch)
        yield patch


def priced(cost: UpdateCost | None, sender: Sender | BytesSender | None) -> UpdateCost | None:
    """`cost`, told how positions travel by `sender`.

    Over shared memory they go flat (int32 indices, see `UpdateWriter.plan`): a sparse patch
    is priced at that size, which from half its elements changed (fp32) is the dense one's.
    """
    if cost is None or sender is None:
        return cost
    flat = 4.0 if sender.name == "shm" else 0.0
    return cost if cost.position_bytes == flat else replace(cost, position_bytes=flat)


def served_version(client: Any) -> str | None:
    """The version the server reports (``/weight_info``), if the client can ask."""
    get_version = getattr(client, "get_weight_version", None)
    served = get_version() if callable(get_version) else None
    return None if served is None else str(served)


def connect(info: Any, client: Any, *, trainer_id: str) -> tuple[str, Sender | BytesSender]:
    """Declare the trainer (`info`, a ``PatchctxTrainerInitInfo``) to every worker.

    The workers learn the transport, the base version and the trainer's id; over NCCL the
    trainer joins the rendezvous while they do. Returns the base version (``base_version``,
    or else, since the trainer cannot know, the one the server serves) and the sender.
    """
    version = info.base_version
    if version is None:
        served = served_version(client)
        version = VLLM_START_VERSION if served is None else served
    worker_info: dict[str, Any] = {
        "transport": info.transport,
        "weight_version": version,
        "adopt_version": info.adopt_version,
        "trainer_id": trainer_id,
        "takeover": info.takeover,
        "shm_dir": info.shm_dir,
        "integrity": info.integrity,
    }
    if info.transport != "nccl":
        client.init_weight_transfer_engine(worker_info)
        if info.transport == "shm":
            return version, SharedMemoryTransport(info.shm_dir, owner=trainer_id)
        return version, InlineTransport()  # the workers' limit, whatever inline_below says
    worker_info.update(
        master_address=info.master_address,
        master_port=info.master_port,
        world_size=info.world_size,
    )
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(client.init_weight_transfer_engine, worker_info)
        assert info.master_address is not None and info.master_port is not None
        assert info.world_size is not None
        sender = NCCLTransport.for_trainer(
            master_address=info.master_address,
            master_port=info.master_port,
            world_size=info.world_size,
        )
        pending.result()
    return version, sender


class UpdateWriter:
    """One update's (or one caller-owned chunk's) writing and delivery.

    Args:
        client: vLLM's weight-sync client (asked ``update_weights``, and the finish of an
            update the trainer aborts).
        sender: The transport's sender.
        inline: The inline sender, for chunks small enough to travel in the request.
        trainer_id: The trainer's id, on every chunk.
        integrity: The checksum algorithm chosen at init (`None`: by transport).
    """

    def __init__(
        self,
        *,
        client: Any,
        sender: Sender | BytesSender,
        inline: InlineTransport,
        trainer_id: str,
        integrity: str | None,
    ) -> None:
        self.client = client
        self.main = sender if isinstance(sender, Sender) else _FromBytes(sender)
        self.inline = inline
        self.trainer_id = trainer_id
        self.integrity = integrity
        self.ended_by_workers = False  # an ``update_weights`` raised: vLLM ended the update

    def plan(
        self, patches: list[CheckpointWeightPatch], base: str | None, target: str | None
    ) -> tuple[PayloadPlan, Sender]:
        """The chunk's layout and the sender it goes by (inline when small enough).

        Over shared memory, positions travel flat: a copy of them costs less than encoding
        them smaller and decoding them again. Elsewhere (and inline) the smallest encoding.
        """
        flat = self.main.name == "shm"
        plan = plan_payload(
            patches,
            base_version=base,
            target_version=target,
            positions="flat" if flat else "smallest",
        )
        if 0 < plan.nbytes <= self.inline.limit:
            if flat:
                plan = plan_payload(patches, base_version=base, target_version=target)
            return plan, self.inline
        return plan, self.main

    def write(
        self,
        plan: PayloadPlan,
        sender: Sender,
        *,
        pooled: bool,
        last: bool,
        update_id: str,
        chunk: int,
    ) -> dict[str, Any]:
        """Write the chunk into the sender's buffer; its update info."""
        algorithm = self.integrity or (SECURE if sender.name == "inline" else FAST)
        fields, sealed = sender.write(plan, algorithm=algorithm, pooled=pooled)
        return {
            **fields,
            "nbytes": plan.nbytes,
            "checksum": sealed.checksum,
            "last": last,
            "update_id": update_id,
            "trainer_id": self.trainer_id,
            "chunk": chunk,
            "intent": sealed.intent,
        }

    def send_one(
        self,
        patches: list[CheckpointWeightPatch],
        base: str | None,
        target: str,
        update_id: str,
        position: int,
        *,
        last: bool,
    ) -> int:
        """Write and deliver one chunk of a caller-owned update (`last`: its last); its bytes.

        The caller owns the finish, so the chunk's buffer is a fresh one, never written
        again, and released once the workers have it.
        """
        plan, sender = self.plan(patches, base, target)
        try:
            info = self.write(
                plan, sender, pooled=False, last=last, update_id=update_id, chunk=position
            )
            self.deliver(info, sender)
        finally:
            sender.release()
        return plan.nbytes

    def deliver(self, info: dict[str, Any], sender: Sender) -> str:
        """Send a written chunk (its buffer is not released here); the transport's name."""
        if sender.concurrent:
            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = pool.submit(self._update_weights, info)
                sender.transmit()
                pending.result()
        else:
            self._update_weights(info)
        return sender.name

    def _update_weights(self, info: dict[str, Any]) -> None:
        try:
            self.client.update_weights(info)
        except BaseException:
            self.ended_by_workers = True
            raise

    def send_all(
        self,
        groups: Iterator[list[CheckpointWeightPatch]],
        base: str | None,
        target: str,
        update_id: str,
        in_flight: list[Future[str]],
    ) -> Figures:
        """Write and deliver every chunk: diff, encode and update seconds, bytes, transports.

        Chunk k+1 is written while the workers receive and check chunk k (one delivery at a
        time, in order, from a thread of its own; a collective sender delivers each chunk as
        it is written), and from a stream of patches, chunk k+2 is diffed meanwhile: a chunk
        goes once the next one is known, which tells whether it is the last. The delivery in
        flight is in `in_flight`, for the caller to wait on when this raises.
        """
        began = time.perf_counter()
        encode_s, nbytes, transports = 0.0, 0, set()
        group: list[CheckpointWeightPatch] | None = next(groups)  # a stream's first chunk
        diff_s = time.perf_counter() - began
        position = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            while group is not None:
                asked = time.perf_counter()
                following = next(groups, None)  # a stream's next patches are diffed here
                begin = time.perf_counter()
                diff_s += begin - asked
                plan, sender = self.plan(group, base, target)
                info = self.write(
                    plan,
                    sender,
                    pooled=True,
                    last=following is None,
                    update_id=update_id,
                    chunk=position,
                )
                encode_s += time.perf_counter() - begin
                nbytes += plan.nbytes
                while in_flight:
                    transports.add(in_flight[0].result())
                    in_flight.pop()
                if sender.concurrent:
                    transports.add(self.deliver(info, sender))
                else:
                    in_flight.append(pool.submit(self.deliver, info, sender))
                group, position = following, position + 1
            while in_flight:
                transports.add(in_flight[0].result())
                in_flight.pop()
        update_s = time.perf_counter() - began - encode_s - diff_s
        return diff_s, encode_s, update_s, nbytes, transports

    def abort(self, in_flight: list[Future[str]]) -> None:
        """End the update the workers have not ended: a failure of the trainer's own.

        When ``update_weights`` fails, vLLM has ended the update on every worker already
        (ending it again is an error there). A failure of the trainer's own (a patch that
        cannot be encoded, a payload a transport refuses) must end it too, or every later
        update is refused as "already active". Ended without a version: the workers drop the
        chunks they hold, and vLLM's version stays where it is. A chunk still in flight ends
        first.
        """
        for pending in in_flight:
            with contextlib.suppress(BaseException):
                pending.result()
        if not self.ended_by_workers:
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()

    def release(self, *, reuse: bool) -> None:
        """Free the update's buffers: pooled ones are kept for the next only when `reuse`."""
        self.main.release(reuse=reuse)
        self.inline.release(reuse=reuse)


def run_update(
    client: Any,
    writer: UpdateWriter,
    groups: Iterator[list[CheckpointWeightPatch]],
    base: str | None,
    target: str,
) -> tuple[str, Figures]:
    """One update, start to finish: its id and what `UpdateWriter.send_all` measured.

    ``start_weight_update``, every chunk of `groups`, then ``finish_weight_update(target)``,
    where the workers apply the update whole or refuse it (vLLM then records no version);
    on any failure the update is aborted instead (`UpdateWriter.abort`). Either way, once
    this returns no worker holds a view of its buffers: pooled ones are written again only
    after a finish that returned, and after any failure (a timeout: a worker may still be
    reading) they are deleted instead.
    """
    update_id = uuid.uuid4().hex[:16]
    client.start_weight_update()
    finished = False
    in_flight: list[Future[str]] = []
    try:
        figures = writer.send_all(groups, base, target, update_id, in_flight)
    except BaseException:
        writer.abort(in_flight)
        raise
    else:
        client.finish_weight_update(target)
        finished = True
    finally:
        writer.release(reuse=finished)
    return update_id, figures
