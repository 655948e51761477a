"""The trainer side of the ``patchctx`` backend: diff, encode, send through vLLM's RL API.

`PatchctxTrainerEngine` is the backend's `TrainerWeightTransferEngine`: it drives the
inference side through any ``VLLMWeightSyncClient`` (vLLM's HTTP or Ray clients, or
`HTTPWeightSyncClient`, which keeps the worker's error class and reads ``/weight_info``).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
)
from patchctx.vllm._backend import VLLM_START_VERSION, raise_worker_error
from patchctx.vllm._codec import ALGORITHMS
from patchctx.vllm._errors import UpdateConflictError
from patchctx.vllm._record import advance, kept_spares, remembered
from patchctx.vllm._sending import (
    BytesSender,
    UpdateWriter,
    chunks,
    connect,
    kept,
    priced,
    run_update,
    served_version,
)
from patchctx.vllm._transport import InlineTransport, Sender

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


def _check_served(client: Any, update_id: str, target: str) -> None:
    """Refuse, after the finish, a server that names another version than `target`."""
    served = served_version(client)
    if served is not None and served != target:
        raise UpdateConflictError(
            f"update {update_id!r} was applied as version {target!r}, but the server now "
            f"reports {served!r}: another trainer named a version in between "
            "(vLLM's finish carries no update id); check which weights are served"
        )


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

    Non-sender ranks (``rank != 0``) do nothing. For each CPU tensor it sent dense, the engine
    keeps the memory its record held before as the next dense copy's destination
    (`diff_state_dicts`'s ``buffers``): one more copy of those tensors in memory, and no page
    faults of fresh memory at each update (at 130 M float32 parameters, 50% changed, the diff
    took 121 to 124 ms copying into fresh memory and 94 ms into kept memory).

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
        self.spare: dict[str, torch.Tensor] = {}  # the next dense copies' memory (CPU)
        self.trainer_id = self.init_info.trainer_id or uuid.uuid4().hex[:16]
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
        engine.version, engine.sender = connect(init_info, client, trainer_id=engine.trainer_id)
        return engine

    def remember(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take `state` as what the workers hold now (what the next diff starts from).

        The record is the engine's own copy. A tensor it already holds in the same shape,
        dtype and device is written in place, so a trainer that calls this at every step
        pays one copy, not a fresh allocation's page faults too.
        """
        held, self.sent = self.sent, {}  # cut short, the record is empty: the diff refuses
        self.sent = remembered(held, state, self.init_info.dtype)
        self.spare = kept_spares(self.spare, self.sent)

    def send_weights(
        self,
        patches: Iterable[CheckpointWeightPatch] | None = None,
        *,
        target_version: str | None = None,
    ) -> SendStats | None:
        """Send `patches` as one update (or, without them, the source's difference).

        With ``chunk_bytes``, `patches` may be a generator that makes them as they are
        asked for (a stream is taken as it comes): each chunk goes once it is full, while
        the next ones are made.
        """
        if patches is None:
            if self.source is None:
                raise ValueError("send_weights() without patches needs a WeightSource at init")
            return self.send_state_dict(dict(self.source), target_version=target_version)
        given = patches if self.init_info.chunk_bytes is not None else list(patches)
        return self._send(given, 0.0, time.perf_counter(), target_version)

    def send_state_dict(
        self, state: Mapping[str, torch.Tensor], *, target_version: str | None = None
    ) -> SendStats | None:
        """Diff `state` against what was last sent and send the difference.

        Once the workers took it, the record of what they hold is advanced by the patches
        sent (O(changed elements), not a copy of `state`), bit for bit what `remember`
        would make of `state`; where the patches cannot say it (names or shapes that
        differ), `state` is copied whole.

        A dense patch's values are the diff's own copy of `state`'s tensor: the bytes sent,
        kept as the record, whatever another thread writes into `state` meanwhile. In one
        chunk the whole diff is made before the update opens; in chunks, each goes once
        full, and the rest is diffed while it travels and the workers check it.
        """
        started = time.perf_counter()
        info = self.init_info
        stream = iter_diff_state_dicts(
            self.sent,
            state,
            dtype=info.dtype,
            cost=priced(info.cost, self.sender),
            buffers=self.spare,
        )
        if not self.is_sender:  # checked as the sender checks it; the diff is the sender's
            self.remember(state)
            return None
        patches = list(stream) if info.chunk_bytes is None else stream
        diff_ms = (time.perf_counter() - started) * 1000.0
        taken: list[CheckpointWeightPatch] = []
        stats = self._send(patches, diff_ms, started, target_version, taken=taken)
        if stats is None:  # only a rank that is not the sender gets none
            return None
        try:
            advanced = advance(self.sent, state, taken, spare=self.spare)
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
        target = next_version(self.version)
        self._session = None if last else (update_id, position + 1)
        writer = self._writer()
        nbytes = writer.send_one(
            list(patches), self.version, target, update_id, position, last=last
        )
        if last:
            self.version = target
        return nbytes

    def _writer(self) -> UpdateWriter:
        """The writer of one update (or one caller-owned chunk) by this engine's senders."""
        assert self.sender is not None, "trainer_init() first"
        return UpdateWriter(
            client=self.client,
            sender=self.sender,
            inline=self.inline,
            trainer_id=self.trainer_id,
            integrity=self.init_info.integrity,
        )

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
        groups = chunks(kept(patches, taken), self.init_info.chunk_bytes)
        update_id, figures = run_update(self.client, self._writer(), groups, self.version, target)
        self.version = target
        _check_served(self.client, update_id, target)
        diff_s, encode_s, update_s, nbytes, transports = figures
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
