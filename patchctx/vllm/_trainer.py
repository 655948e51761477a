"""The trainer side of the ``patchctx`` backend: diff, encode, send through vLLM's RL API.

`PatchctxTrainerEngine` is the backend's `TrainerWeightTransferEngine`: it drives the
inference side through any ``VLLMWeightSyncClient`` (vLLM's HTTP or Ray clients, or
`HTTPWeightSyncClient`, which keeps the worker's error class and reads ``/weight_info``).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from patchctx import (
    CheckpointWeightPatch,
    PatchError,
    UpdateCost,
    iter_diff_state_dicts,
    patch_nbytes,
)
from patchctx._swap import builtin_copy
from patchctx.vllm._backend import VLLM_START_VERSION, raise_worker_error
from patchctx.vllm._codec import ALGORITHMS, FAST, SECURE, PayloadPlan, Sealed, plan_payload
from patchctx.vllm._errors import UpdateConflictError
from patchctx.vllm._transport import (
    InlineTransport,
    NCCLTransport,
    Sender,
    SharedMemoryTransport,
)

__all__ = [
    "HTTPWeightSyncClient",
    "LLMWeightSyncClient",
    "PatchctxTrainerEngine",
    "PatchctxTrainerInitInfo",
    "SendStats",
]


class HTTPWeightSyncClient:
    """vLLM's weight-sync control plane over ``vllm serve``'s HTTP endpoints (dev mode).

    The four methods of vLLM's ``VLLMWeightSyncClient`` protocol plus
    `get_weight_version` (``/weight_info``) and `weight_checksums` (``/weight_checker``).
    A worker's patchctx error comes back as the same class (`WeightVersionError`,
    `InvalidPatchError`, ...), its message naming the worker's rank; any other failure
    raises `RuntimeError` with the server's answer. Standard library only.

    Args:
        base_url: The server, e.g. ``"http://127.0.0.1:8000"``.
        timeout: Seconds per request.

    Examples:
        >>> from patchctx.vllm import HTTPWeightSyncClient
        >>> client = HTTPWeightSyncClient("http://127.0.0.1:8000/")
        >>> client.base_url
        'http://127.0.0.1:8000'
    """

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def request(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """POST `body` as JSON (GET without one); the decoded JSON answer."""
        data = None if body is None else json.dumps(body).encode()
        method = "GET" if path in ("weight_info",) else "POST"
        request = urllib.request.Request(
            f"{self.base_url}/{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            answer = error.read().decode(errors="replace")
            for text in _strings(answer):
                raise_worker_error(text)
            raise RuntimeError(f"{path}: HTTP {error.code}: {answer[:2000]}") from None
        return json.loads(text) if text else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine``."""
        self.request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``/start_weight_update``."""
        self.request("start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``/update_weights``."""
        self.request("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update``, setting vLLM's weight version when one is given."""
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.request("finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        """``/shutdown_weight_transfer_engine``."""
        self.request("shutdown_weight_transfer_engine", {})

    def get_weight_version(self) -> str:
        """The weight version vLLM reports (``/weight_info``)."""
        return str(self.request("weight_info")["weight_version"])

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every parameter on every worker (``/weight_checker``, ``checksum``)."""
        return dict(self.request("weight_checker", {"action": "checksum"})["checksums"])


class LLMWeightSyncClient:
    """vLLM's weight-sync control plane of a ``vllm.LLM`` in this process.

    ``LLM`` has the RL methods, but takes requests (``{"init_info": ...}``,
    ``{"update_info": ...}``) where vLLM's client protocol passes the info itself: this
    adapter passes them on. A worker's patchctx error is raised again as its class.

    Args:
        llm: The ``vllm.LLM``, started with ``weight_transfer_config={"backend": "patchctx"}``.

    Examples:
        >>> from types import SimpleNamespace
        >>> from patchctx.vllm import LLMWeightSyncClient
        >>> llm = SimpleNamespace(get_weight_version=lambda: "default")
        >>> LLMWeightSyncClient(llm).get_weight_version()
        'default'
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.llm, method)(*args)
        except PatchError:
            raise
        except Exception as error:
            raise_worker_error(str(error))
            raise

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``LLM.init_weight_transfer_engine``."""
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``LLM.start_weight_update``."""
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``LLM.update_weights``."""
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``LLM.finish_weight_update``, setting vLLM's weight version when one is given."""
        self._call("finish_weight_update", weight_version)

    def get_weight_version(self) -> str:
        """The weight version vLLM reports."""
        return str(self._call("get_weight_version"))


def _strings(answer: str) -> list[str]:
    """Every string inside a JSON answer (the answer itself when it is not JSON)."""
    try:
        stack: list[Any] = [json.loads(answer)]
    except ValueError:
        return [answer]
    found = []
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


@dataclass
class PatchctxTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """Trainer-side init info of the ``patchctx`` backend.

    Attributes:
        transport: ``"shm"`` (default), ``"nccl"`` or ``"inline"`` (see `PatchctxInitInfo`).
        inline_below: Payloads of at most this many bytes travel inline in the request
            whatever the transport (`None`: the workers' default inline limit,
            ``PATCHCTX_VLLM_INLINE_LIMIT`` or 4 MiB; 0: never).
        shm_dir: The shared-memory directory, the same on both sides (``"shm"``).
        master_address: NCCL rendezvous address (``"nccl"``).
        master_port: NCCL rendezvous port (``"nccl"``).
        world_size: The trainer plus every inference worker (``"nccl"``).
        dtype: The receiver's dtype for `diff_state_dicts` (`None`: each tensor's own).
        chunk_bytes: Split an update into ``update_weights`` chunks of about this many
            bytes of values and indices (`None`: one chunk). The workers check each chunk
            as it arrives and apply all of them, atomically, with the last; the trainer
            writes the next chunk meanwhile.
        cost: How `diff_state_dicts` chooses sparse or dense per tensor (`UpdateCost`). Its
            defaults assume a 10 GB/s link and this library's 2-core CPU: pass
            ``UpdateCost(link_bytes_per_second=...)`` for your link, or
            ``UpdateCost.calibrate(...)`` measured on a worker. `None`: by wire bytes alone.
        base_version: The weight version of the state this trainer remembers (what its next
            diff starts from): a trainer resumed from a checkpoint passes the version that
            checkpoint was sent as, and the workers refuse it if they serve another one.
            `None`: the trainer cannot know, and takes the version the server reports
            (``/weight_info``), which is right only when its remembered state is what the
            server serves (a fresh trainer that `remember` s the served weights).
        adopt_version: Make the workers take `base_version` (or the server's version) as
            theirs, unchecked: after the weights were reloaded outside patchctx (vLLM's
            ``reload_weights``), or when a failed update left their version unknown.
        takeover: Roll back an update another trainer left open (it died mid-update) and
            connect; without it, connecting while one is open is refused.
        trainer_id: This trainer's id (1-64 of ``[A-Za-z0-9_.-]``): its chunks carry it, and
            the workers refuse another trainer's chunks. `None`: a random one.
        integrity: The checksum of every chunk, and what the workers require
            (`PatchctxInitInfo.integrity`): ``"xxh3_128"``, ``"sha256"``, or `None` (XXH3 on
            ``shm`` and ``nccl``, SHA-256 for inline payloads).
        rank: This trainer process's rank; rank 0 sends.

    Examples:
        >>> from patchctx.vllm import PatchctxTrainerInitInfo
        >>> info = PatchctxTrainerInitInfo(transport="inline", rank=0)
        >>> info.backend, info.is_sender
        ('patchctx', True)
    """

    backend: ClassVar[str] = "patchctx"

    transport: str = "shm"
    inline_below: int | None = None
    shm_dir: str = "/dev/shm"
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    dtype: torch.dtype | None = None
    chunk_bytes: int | None = None
    cost: UpdateCost | None = field(default_factory=UpdateCost)
    base_version: str | None = None
    adopt_version: bool = False
    takeover: bool = False
    trainer_id: str | None = None
    integrity: str | None = None

    def __post_init__(self) -> None:
        if self.integrity is not None and self.integrity not in ALGORITHMS:
            raise ValueError(f"integrity={self.integrity!r}: one of {ALGORITHMS} or None")


@dataclass(frozen=True)
class SendStats:
    """What one update cost, trainer side.

    Attributes:
        patches: Patches sent.
        nbytes: Payload bytes on the wire (values and indices plus a small header per
            chunk).
        diff_ms: Time to compute the patches (`diff_state_dicts`), 0 when given.
        encode_ms: Time to encode the payload into the transport's buffer, hashes included.
        update_ms: Time of the ``update_weights`` round trip: transfer and apply on every
            worker.
        total_ms: Start to finish, diff included.
        transport: How the payload travelled (``"inline"``, ``"shm"``, ``"nccl"``; joined
            by ``+`` when chunks took different ways).
        version: The weight version the update named as its target.
        dense_nbytes: Of `nbytes`, the values of the patches sent dense: what the diff's
            choice sent whole (over shared memory a sparse patch's flat positions can make
            it as large as the dense one, so `nbytes` alone does not tell them apart).

    Examples:
        >>> from patchctx.vllm import SendStats
        >>> SendStats(1, 96, 0.0, 0.1, 2.0, 2.5, "inline", "1").nbytes
        96
    """

    patches: int
    nbytes: int
    diff_ms: float
    encode_ms: float
    update_ms: float
    total_ms: float
    transport: str
    version: str | None
    dense_nbytes: int = 0


def next_version(version: str | None) -> str:
    """The version after `version`; never one that came before it in its line.

    The next integer after an integer; ``"1"`` after vLLM's start version (``"default"``) or
    none; after any other name ``NAME`` (a reload's ``"reloaded"``, ``"step-12"``),
    ``"NAME.1"``, then ``"NAME.2"``... (the workers also refuse a version their weights were
    at before).

    Examples:
        >>> from patchctx.vllm._trainer import next_version
        >>> next_version("default"), next_version("41"), next_version("reloaded")
        ('1', '42', 'reloaded.1')
        >>> next_version("reloaded.1"), next_version("step-12")
        ('reloaded.2', 'step-12.1')
    """
    if version is None or version == VLLM_START_VERSION:
        return "1"
    if version.isdecimal():
        return str(int(version) + 1)
    numbered = re.fullmatch(r"(.*)\.(\d+)", version)
    if numbered is not None:
        return f"{numbered.group(1)}.{int(numbered.group(2)) + 1}"
    return f"{version}.1"


@runtime_checkable
class BytesSender(Protocol):
    """A sender that takes ready-made payload bytes (`Sender` without ``write``).

    Examples:
        >>> from patchctx.vllm._trainer import BytesSender
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


def _chunks(
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


def _kept(
    patches: Iterable[CheckpointWeightPatch], taken: list[CheckpointWeightPatch]
) -> Iterator[CheckpointWeightPatch]:
    """`patches`, each appended to `taken` as it is handed on."""
    for patch in patches:
        taken.append(patch)
        yield patch


def _storage(tensor: torch.Tensor) -> int:
    """Where `tensor`'s memory starts (its storage's address)."""
    return int(tensor.untyped_storage().data_ptr())


def _advance(
    sent: dict[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    patches: list[CheckpointWeightPatch],
) -> bool:
    """Write `patches`, the diff from `sent` to `state`, into `sent`: O(changed), not a copy.

    `sent` then holds, bit for bit, what ``remember(state)`` would build: the diff's positions
    are where the bits of the cast differ, and its values are those bits. A tied name (a
    tensor of `state` that views another's elements) gets the patch sent under its twin. A
    dense patch's values (the diff's own copy, never a view of `state`) become the record.
    Returns whether it could; `False` (names, shapes or dtypes that differ, twins of another
    geometry) writes nothing, and the caller copies the state whole. Dense values that are
    `state`'s own memory (``dense_views``) are copied into the record, never adopted: the
    trainer writes its state again at its next step.
    """
    if sent.keys() != state.keys():
        return False
    by_name = {patch.name: patch for patch in patches}
    if len(by_name) != len(patches):
        return False
    twins: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], list[str]] = {}
    for name, tensor in state.items():
        held = sent[name]
        if held.shape != tensor.shape or held.device != tensor.device:
            return False
        if tensor.numel() == 0:
            continue
        where = tensor.untyped_storage().data_ptr()
        offset = int(tensor.storage_offset())
        key = (where, offset, tuple(tensor.shape), tensor.stride(), tensor.dtype)
        twins.setdefault(key, []).append(name)
    if len({key[0] for key in twins}) != len(twins):
        return False  # tensors that overlap in other ways: the diff's own rules, a whole copy
    for names in twins.values():
        patched = [by_name[name] for name in names if name in by_name]
        if len(patched) == 1:  # sent once, under whichever twin the diff took first
            by_name.update(dict.fromkeys(names, patched[0]))
    for name, patch in by_name.items():
        record = sent.get(name)
        if record is None or patch.values.dtype != record.dtype or not record.is_contiguous():
            return False
        if patch.indices is None and patch.values.numel() != record.numel():
            return False
    uses = Counter(id(patch) for patch in by_name.values())
    states = {key[0] for key in twins}  # the storages of `state`'s tensors
    for name, patch in by_name.items():
        record = sent[name]
        if (
            patch.indices is None
            and uses[id(patch)] == 1
            and patch.values.is_contiguous()
            and patch.values.untyped_storage().data_ptr() not in states
        ):
            # The diff's dense values are its own copy, and spent once sent: they become
            # the record (a twin's record is a copy, so no two names share one).
            sent[name] = patch.values.view(record.shape)
        elif patch.indices is None:
            builtin_copy(record.view(-1), patch.values.reshape(-1))
        else:
            record.view(-1).index_put_((patch.indices.to(torch.int64),), patch.values)
    return True


class PatchctxTrainerEngine(TrainerWeightTransferEngine[PatchctxTrainerInitInfo]):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """The ``patchctx`` backend's trainer engine: diffs, encodes and sends updates.

    Built with ``trainer_init`` (or vLLM's ``WeightTransferTrainerFactory.trainer_init``,
    which dispatches on ``PatchctxTrainerInitInfo.backend``). It declares its base to the
    workers (``base_version``, or else the version ``/weight_info`` reports), so every update
    names the version it was computed against and the workers refuse it if their weights are
    elsewhere. Every chunk carries the trainer's id and the update's; the workers apply an
    update whole at its ``finish_weight_update``, and the engine then checks that
    ``/weight_info`` names its version.

    - ``send_weights(patches)``: send `CheckpointWeightPatch` objects as one update
      (``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update(version)``).
    - ``send_weights()``: with a `WeightSource` given at init, diff the source's tensors
      against what was last sent (`diff_state_dicts`, in `dtype`) and send the difference.
    - ``send_state_dict(state)``: the same from a state dict.

    Non-sender ranks (``rank != 0``) do nothing.

    Examples:
        >>> import torch
        >>> from patchctx.vllm import PatchctxTrainerEngine, PatchctxTrainerInitInfo
        >>> class Recorder:  # stands for vLLM's client (HTTP, Ray, ...)
        ...     def __init__(self):
        ...         self.calls = []
        ...     def __getattr__(self, name):
        ...         return lambda *args, **kwargs: self.calls.append(name)
        >>> client = Recorder()
        >>> engine = PatchctxTrainerEngine.trainer_init(
        ...     PatchctxTrainerInitInfo(transport="inline", rank=0), client=client)
        >>> sent = {"w": torch.zeros(8)}
        >>> engine.remember(sent)
        >>> stats = engine.send_state_dict({"w": torch.tensor([0, 0, 1.0, 0, 0, 0, 0, 0])})
        >>> stats.patches, stats.transport, stats.version, client.calls[-4:-1]
        (1, 'inline', '1', ['start_weight_update', 'update_weights', 'finish_weight_update'])
    """

    init_info_cls = PatchctxTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: PatchctxTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info or PatchctxTrainerInitInfo(rank=0)
        self.sender: Sender | BytesSender | None = None
        self.inline = InlineTransport(limit=self.init_info.inline_below)  # None: the default
        self.version: str | None = None
        self.sent: dict[str, torch.Tensor] = {}
        self._ended_by_workers = False  # the current update's update_weights raised
        self.trainer_id = self.init_info.trainer_id or uuid.uuid4().hex[:16]
        self._adapter: tuple[object, Sender] | None = None  # for a sender without `write`
        # The update a caller-owned session (`send_weight_chunk`) is sending, and its next chunk.
        self._session: tuple[str, int] | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: PatchctxTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | None = None,
    ) -> PatchctxTrainerEngine:
        """Connect: open the transport, declare the trainer's base version to every worker.

        Refused while another trainer's update is open (it died between
        ``start_weight_update`` and ``finish_weight_update``, or is still sending), unless
        ``takeover``: the workers then roll it back whole (none of it was applied). Refused
        too when the declared base is not the version the workers' weights are at.
        """
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, init_info=init_info
        )
        if source is not None:
            engine.remember(dict(source))
        if not engine.is_sender:
            return engine
        version = init_info.base_version
        if version is None:  # the trainer cannot know: it starts from what the server serves
            get_version = getattr(client, "get_weight_version", None)
            served = get_version() if callable(get_version) else None
            version = VLLM_START_VERSION if served is None else str(served)
        engine.version = version
        worker_info: dict[str, Any] = {
            "transport": init_info.transport,
            "weight_version": engine.version,
            "adopt_version": init_info.adopt_version,
            "trainer_id": engine.trainer_id,
            "takeover": init_info.takeover,
            "shm_dir": init_info.shm_dir,
            "integrity": init_info.integrity,
        }
        if init_info.transport == "nccl":
            worker_info.update(
                master_address=init_info.master_address,
                master_port=init_info.master_port,
                world_size=init_info.world_size,
            )
            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = pool.submit(client.init_weight_transfer_engine, worker_info)
                assert init_info.master_address is not None and init_info.master_port is not None
                assert init_info.world_size is not None
                engine.sender = NCCLTransport.for_trainer(
                    master_address=init_info.master_address,
                    master_port=init_info.master_port,
                    world_size=init_info.world_size,
                )
                pending.result()
        else:
            client.init_weight_transfer_engine(worker_info)
            engine.sender = (
                SharedMemoryTransport(init_info.shm_dir, owner=engine.trainer_id)
                if init_info.transport == "shm"
                else InlineTransport()  # the workers' limit, whatever inline_below says
            )
        return engine

    def remember(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take `state` as what the workers hold now (what the next diff starts from).

        The record is the engine's own copy. A tensor it already holds in the same shape,
        dtype and device is written in place, so a trainer that calls this at every step
        pays one copy, not a fresh allocation's page faults too.
        """
        dtype = self.init_info.dtype
        held, self.sent = self.sent, {}  # cut short, the record is empty: the diff refuses
        shared = Counter(_storage(tensor) for tensor in held.values())
        given = {_storage(tensor) for tensor in state.values()}
        record: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            # `dtype` is the receiver's for floating tensors only (as `diff_state_dicts` reads
            # it): an integer step counter or quantized weight stays exact, in its own dtype.
            want = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            old = held.get(name)
            if (
                old is not None
                and old.shape == tensor.shape
                and old.dtype == want
                and old.device == tensor.device
                and old.is_contiguous()
                and old.numel() > 0
                and shared[_storage(old)] == 1
                and _storage(old) not in given
            ):
                builtin_copy(old, tensor.detach())  # (a caller's masked region never applies)
                record[name] = old
            else:
                record[name] = tensor.detach().to(want, copy=True)
        self.sent = record

    def send_weights(
        self,
        patches: Iterable[CheckpointWeightPatch] | None = None,
        *,
        target_version: str | None = None,
    ) -> SendStats | None:
        """Send `patches` as one update (or, without them, the source's difference).

        With ``chunk_bytes``, `patches` may be a generator that makes them as they are
        asked for: each chunk goes once it is full, while the next ones are made.
        """
        if patches is None:
            if self.source is None:
                raise ValueError("send_weights() without patches needs a WeightSource at init")
            return self.send_state_dict(dict(self.source), target_version=target_version)
        # In chunks, a stream of patches is taken as it comes: each chunk goes once full.
        chunked = self.init_info.chunk_bytes is not None
        given = patches if chunked else list(patches)
        return self._send(given, 0.0, time.perf_counter(), target_version)

    def send_state_dict(
        self, state: Mapping[str, torch.Tensor], *, target_version: str | None = None
    ) -> SendStats | None:
        """Diff `state` against what was last sent and send the difference.

        Once the workers took it, the record of what they hold is advanced by the patches
        sent (O(changed elements), not a copy of `state`), bit for bit what `remember`
        would make of `state`; where the patches cannot say it (names or shapes that
        differ), `state` is copied whole.
        """
        started = time.perf_counter()
        info = self.init_info
        # Dense values are views of `state` (no copy): every chunk is written into the
        # sender's buffer before this call returns, and `_advance` copies them into the record.
        stream = iter_diff_state_dicts(
            self.sent, state, dtype=info.dtype, cost=self._cost(), dense_views=True
        )
        if not self.is_sender:  # checked as the sender checks it; the diff is the sender's
            self.remember(state)
            return None
        # One chunk: the whole diff before the update opens. In chunks: each goes once full,
        # and the rest is diffed while it travels and the workers check it.
        patches = list(stream) if info.chunk_bytes is None else stream
        diff_ms = (time.perf_counter() - started) * 1000.0
        taken: list[CheckpointWeightPatch] = []
        stats = self._send(patches, diff_ms, started, target_version, taken=taken)
        if stats is None:  # only a rank that is not the sender gets none
            return None
        try:
            advanced = _advance(self.sent, state, taken)
        except BaseException:
            self.sent = {}  # half advanced: the next diff refuses until the state is whole
            self.remember(state)
            raise
        if not advanced:
            self.remember(state)
        return stats

    def send_weight_chunk(self, patches: Iterable[CheckpointWeightPatch], *, last: bool) -> int:
        """Send one chunk inside a caller-owned ``start`` / ``finish``; return its bytes.

        Chunks are held by the workers and applied together, atomically, by
        ``finish_weight_update``. The chunks of one session form one update (its id on each);
        each names the trainer's current version as base and the next one as target; pass
        the same target to ``finish_weight_update`` (`version` is it after the last chunk).
        The caller owns the finish, so each chunk's buffer is a fresh one, never written again.
        """
        update_id, position = self._session or (uuid.uuid4().hex[:16], 0)
        plan, sender = self._plan(list(patches), self.version, next_version(self.version))
        self._session = None if last else (update_id, position + 1)
        try:
            info = self._write(
                plan, sender, pooled=False, last=last, update_id=update_id, chunk=position
            )
            self._deliver(info, sender)
        finally:
            sender.release()
        if last:
            self.version = next_version(self.version)
        return plan.nbytes

    def _cost(self) -> UpdateCost | None:
        """The init info's cost model, told how this trainer's positions travel.

        Over shared memory they go flat (int32 indices, see `_plan`): a sparse patch is
        priced at that size, which from half its elements changed (fp32) is the dense one's.
        """
        cost = self.init_info.cost
        if cost is None or self.sender is None:
            return cost
        flat = 4.0 if self._writing(self.sender).name == "shm" else 0.0
        return cost if cost.position_bytes == flat else replace(cost, position_bytes=flat)

    def _writing(self, sender: Sender | BytesSender) -> Sender:
        """`sender` itself if it writes plans, else an adapter (one per sender)."""
        if isinstance(sender, Sender):
            return sender
        if self._adapter is None or self._adapter[0] is not sender:
            self._adapter = (sender, _FromBytes(sender))
        return self._adapter[1]

    def _algorithm(self, sender: Sender) -> str:
        chosen = self.init_info.integrity
        if chosen is not None:
            return chosen
        return SECURE if sender.name == "inline" else FAST

    def _plan(
        self,
        patches: list[CheckpointWeightPatch],
        base: str | None,
        target: str | None,
    ) -> tuple[PayloadPlan, Sender]:
        """The chunk's layout and the sender it goes by (inline when small enough).

        Over shared memory, positions travel flat: a copy of them costs less than encoding
        them smaller and decoding them again. Elsewhere (and inline) the smallest encoding.
        """
        assert self.sender is not None, "trainer_init() first"
        main = self._writing(self.sender)
        flat = main.name == "shm"
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
        return plan, main

    def _write(
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
        fields, sealed = sender.write(plan, algorithm=self._algorithm(sender), pooled=pooled)
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

    def _deliver(self, info: dict[str, Any], sender: Sender) -> str:
        """Send a written chunk (its buffer is not released here)."""
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
            self._ended_by_workers = True  # vLLM ends an update whose update_weights raised
            raise

    def _send_chunks(
        self,
        groups: Iterator[list[CheckpointWeightPatch]],
        target: str,
        update_id: str,
        pool: ThreadPoolExecutor,
        in_flight: list[Future[str]],
    ) -> tuple[float, float, float, int, set[str]]:
        """Write and deliver every chunk: diff, encode and update seconds, bytes, transports.

        Chunk k+1 is written while the workers receive and check chunk k (one delivery at a
        time, in order, from `pool`; a collective sender delivers each chunk as it is
        written), and from a stream of patches, chunk k+2 is diffed meanwhile: a chunk goes
        once the next one is known, which tells whether it is the last. The delivery in
        flight is in `in_flight`, for the caller to wait on.
        """
        began = time.perf_counter()
        encode_s, nbytes, transports = 0.0, 0, set()
        group: list[CheckpointWeightPatch] | None = next(groups)  # a stream's first chunk
        diff_s = time.perf_counter() - began
        position = 0
        while group is not None:
            asked = time.perf_counter()
            following = next(groups, None)  # a stream's next patches are diffed here
            begin = time.perf_counter()
            diff_s += begin - asked
            plan, sender = self._plan(group, self.version, target)
            info = self._write(
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
                transports.add(self._deliver(info, sender))
            else:
                in_flight.append(pool.submit(self._deliver, info, sender))
            group, position = following, position + 1
        while in_flight:
            transports.add(in_flight[0].result())
            in_flight.pop()
        update_s = time.perf_counter() - began - encode_s - diff_s
        return diff_s, encode_s, update_s, nbytes, transports

    def _send(
        self,
        patches: Iterable[CheckpointWeightPatch],
        diff_ms: float,
        started: float,
        target_version: str | None,
        *,
        taken: list[CheckpointWeightPatch] | None = None,
    ) -> SendStats | None:
        """Send `patches` as one update; those of a stream are diffed as its chunks go.

        `taken` receives every patch sent, in order.
        """
        if not self.is_sender:
            return None
        target = target_version or next_version(self.version)
        taken = [] if taken is None else taken
        groups = _chunks(_kept(patches, taken), self.init_info.chunk_bytes)
        self._ended_by_workers = False
        update_id = uuid.uuid4().hex[:16]
        self.client.start_weight_update()
        finished = False
        pool = ThreadPoolExecutor(max_workers=1)
        in_flight: list[Future[str]] = []
        try:
            diff_s, encode_s, update_s, nbytes, transports = self._send_chunks(
                groups, target, update_id, pool, in_flight
            )
        except BaseException:
            for pending in in_flight:  # a chunk still in flight: let it end before the abort
                with contextlib.suppress(BaseException):
                    pending.result()
            # When update_weights fails, vLLM has ended the update on every worker already
            # (ending it again is an error there). A failure of the trainer's own (a patch
            # that cannot be encoded, a payload a transport refuses) must end it too, or every
            # later update is refused as "already active". Ended without a version: the
            # workers drop the chunks they hold, and vLLM's version stays where it is.
            if not self._ended_by_workers:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
            raise
        else:
            # The workers apply the update here, whole, or refuse (vLLM then records no
            # version). Either way, once this returns no worker holds a view of its buffers.
            self.client.finish_weight_update(target)
            finished = True
        finally:
            # Pooled buffers are written again only after a finish that returned; after any
            # failure (a timeout: a worker may still be reading) they are deleted instead.
            if self.sender is not None:
                self._writing(self.sender).release(reuse=finished)
            self.inline.release(reuse=finished)
            pool.shutdown()
        self.version = target
        get_version = getattr(self.client, "get_weight_version", None)
        served = get_version() if callable(get_version) else None
        if served is not None and str(served) != target:
            raise UpdateConflictError(
                f"update {update_id!r} was applied as version {target!r}, but the server now "
                f"reports {served!r}: another trainer named a version in between "
                "(vLLM's finish carries no update id); check which weights are served"
            )
        return SendStats(
            patches=len(taken),
            nbytes=nbytes,
            diff_ms=diff_ms + (0.0 if isinstance(patches, list) else diff_s * 1000.0),
            encode_ms=encode_s * 1000.0,
            update_ms=update_s * 1000.0,
            total_ms=(time.perf_counter() - started) * 1000.0,
            transport="+".join(sorted(transports)),
            version=target,
            dense_nbytes=sum(
                patch.values.numel() * patch.values.element_size()
                for patch in taken
                if patch.indices is None
            ),
        )

    def shutdown(self) -> None:
        """Close the transport."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
