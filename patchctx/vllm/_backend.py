"""The worker side of the ``patchctx`` weight-transfer backend (vLLM's RL API).

vLLM creates one `PatchctxWeightTransferEngine` per worker when the engine is started with
``weight_transfer_config={"backend": "patchctx"}`` and drives it through the worker's
``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` (one or more
chunks) -> ``finish_weight_update``, from ``vllm serve``'s HTTP endpoints, ``LLM`` or Ray.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from patchctx import (
    CastKindError,
    CheckpointWeightPatch,
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    LoaderError,
    PatchError,
)
from patchctx._errors import PatchProblem
from patchctx._model import read_names
from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._apply import WorkerPatcher
from patchctx.vllm._codec import ALGORITHMS, FAST, SECURE, PatchPayload, decode_payload
from patchctx.vllm._errors import UpdateConflictError, WeightVersionError
from patchctx.vllm._transport import (
    OWNER,
    InlineTransport,
    NCCLTransport,
    SharedMemoryTransport,
    Transport,
    check_received,
    check_size,
    payload_limit,
)
from patchctx.vllm._warmup import checkpoint_specs, warm_at_start

__all__ = [
    "VLLM_START_VERSION",
    "PatchctxInitInfo",
    "PatchctxUpdateInfo",
    "PatchctxWeightTransferEngine",
    "worker_error",
]

logger = logging.getLogger("patchctx.vllm")

VLLM_START_VERSION = "default"
"""The weight version a vLLM 0.32 engine reports (``/weight_info``) before any update."""

TRANSPORTS = ("shm", "nccl", "inline")
# The checksum each transport needs by default: a fast one where the link is trusted (this
# host's shared memory, the NCCL group), SHA-256 where it is not (bytes inside HTTP requests).
DEFAULT_INTEGRITY = {"shm": FAST, "nccl": FAST, "inline": SECURE}
APPLIERS = ("patchctx", "vllm", "load_weights", "layerwise")
# The classes a worker's error may come back as, by name.
_CLASSES: dict[str, type[PatchError]] = {
    cls.__name__: cls
    for cls in (
        PatchError,
        InvalidPatchError,
        InvalidPatchTypeError,
        LoaderContractError,
        WeightVersionError,
        UpdateConflictError,
        CastKindError,
        LoaderError,
    )
}
_MARK = re.compile(r"\[patchctx rank (\d+): (\w+)\] ")
# What vLLM's multi-process executor appends to a worker's error message.
_VLLM_SUFFIX = re.compile(r"'?,? please check the stack trace above for the root cause\.?$")


@dataclass(kw_only=True)
class PatchctxInitInfo(WeightTransferInitInfo):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """What ``init_weight_transfer_engine`` takes (``init_info``) for the ``patchctx`` backend.

    Attributes:
        transport: ``"shm"`` (default: a file per update in `shm_dir`, on this host),
            ``"nccl"`` (a broadcast over a NCCL group with the trainer, CUDA) or
            ``"inline"`` (only inline payloads, below the workers' size limit).
        weight_version: The version the connecting trainer's remembered state is at (its
            base). A worker whose weights are at another version refuses the init
            (`WeightVersionError`): a trainer resumed from an older checkpoint would send
            differences against weights the engine no longer holds. `None`: not checked.
        adopt_version: Take `weight_version` as the worker's own version instead of checking
            it, starting a new line of versions: the weights were reloaded outside patchctx
            (vLLM's ``reload_weights``), or the worker's version is unknown after a failed
            update. Say so only when it is true.
        trainer_id: The connecting trainer's id (1-64 of ``[A-Za-z0-9_.-]``). The worker
            then refuses chunks of any other trainer, and only this trainer or a takeover
            may end an update it opened. `None`: an anonymous trainer.
        takeover: Roll back an update another trainer left open (it died mid-update) and
            connect. Without it, an init while another trainer's update is open is refused
            (`UpdateConflictError`) and nothing changes.
        shm_dir: The shared-memory directory (``"shm"``).
        master_address: Rendezvous address of the NCCL group (``"nccl"``).
        master_port: Rendezvous port (``"nccl"``).
        world_size: The NCCL group's size: the trainer plus every worker (``"nccl"``).
        integrity: The checksum the worker requires: ``"xxh3_128"`` (XXH3-128, near memory
            speed; for links only the trainer writes to), ``"sha256"`` (for links that are
            not trusted: a shared-memory payload is then read into the worker's own memory
            before it is checked, so that it cannot change after) or `None` (the default:
            ``"xxh3_128"`` on ``shm`` and ``nccl``, ``"sha256"`` for inline payloads).
        apply: How updates are applied: ``"patchctx"`` (the default, all of the above).
            For comparisons (``./dev bench --engine``), with the same transport and checks
            of the payload and version: ``"vllm"`` (vLLM's own
            ``load_checkpoint_weight_patches``), ``"load_weights"`` (dense patches straight
            into the model's ``load_weights``) and ``"layerwise"`` (the same inside vLLM's
            layerwise reload, as vLLM's dense backends do).

    Examples:
        >>> from patchctx.vllm import PatchctxInitInfo
        >>> PatchctxInitInfo(transport="shm", weight_version="7").shm_dir
        '/dev/shm'
        >>> PatchctxInitInfo(transport="nccl")
        Traceback (most recent call last):
        ...
        ValueError: the nccl transport needs master_address, master_port and world_size
    """

    transport: str = "shm"
    weight_version: str | None = None
    adopt_version: bool = False
    trainer_id: str | None = None
    takeover: bool = False
    shm_dir: str = "/dev/shm"
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    integrity: str | None = None
    apply: str = "patchctx"

    def __post_init__(self) -> None:
        if self.integrity is not None and self.integrity not in ALGORITHMS:
            raise ValueError(f"integrity={self.integrity!r}: one of {ALGORITHMS} or None")
        if self.apply not in APPLIERS:
            raise ValueError(f"apply={self.apply!r}: one of {APPLIERS}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: one of {TRANSPORTS}")
        if self.weight_version is not None and not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a str, got {self.weight_version!r}")
        if self.trainer_id is not None and (
            not isinstance(self.trainer_id, str) or not OWNER.fullmatch(self.trainer_id)
        ):
            raise ValueError(f"trainer_id is 1-64 of [A-Za-z0-9_.-], got {self.trainer_id!r}")
        for flag in ("adopt_version", "takeover"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.adopt_version and self.weight_version is None:
            raise ValueError("adopt_version needs the weight_version to adopt")
        if self.transport == "nccl" and (
            self.master_address is None or self.master_port is None or self.world_size is None
        ):
            raise ValueError("the nccl transport needs master_address, master_port and world_size")


@dataclass
class PatchctxUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """What ``update_weights`` takes (``update_info``): one chunk of an update.

    Attributes:
        nbytes: The payload's size in bytes (an `encode_patches` payload).
        checksum: ``"<algorithm>:<hex>"``, the payload's checksum as the trainer wrote it
            (`Sealed.checksum`: the header and every patch's digest, so every byte once);
            ``xxh3_128`` or ``sha256``, as the worker's ``integrity`` requires.
        sha256: Or the SHA-256 of the payload's bytes, hex (for a sender that has the
            bytes only). A chunk with neither is refused, and so is one that does not match.
        update_id: The update this chunk belongs to (1-64 of ``[A-Za-z0-9_.-]``), the same
            on every chunk of one update. A chunk of another update while one is open is
            refused (`UpdateConflictError`), unless its trainer opened the open one (it
            started over: the open one is dropped, nothing of it was applied).
        trainer_id: The sending trainer's id, as given at init.
        chunk: The chunk's position in its update (0, 1, ...); out of order is refused.
        intent: Each patch's digest as the trainer wrote it (`Sealed.intent`: its manifest
            entry and its tensors' bytes, in the checksum's algorithm, or ``xxh3_128``):
            a payload that decodes to anything else (retyped, re-encoded, re-laid out with a
            new checksum) is refused, naming the patches that differ.
        inline: The payload itself, base64 (below the workers' inline limit); `None`: fetch
            it through the transport chosen at init.
        shm: The payload file's name (``"shm"`` transport).
        last: Whether this chunk completes the update. Chunks are checked as they arrive
            and held; ``finish_weight_update`` applies them all in one atomic call, so an
            update whose trainer died before finishing changes nothing.

    Examples:
        >>> from patchctx.vllm import PatchctxUpdateInfo
        >>> PatchctxUpdateInfo(nbytes=96, checksum="xxh3_128:" + "0" * 32, update_id="u1",
        ...                    shm="patchctx-1").last
        True
        >>> PatchctxUpdateInfo(nbytes=-1, sha256="", update_id="u1")
        Traceback (most recent call last):
        ...
        ValueError: nbytes must be a non-negative int, got -1
    """

    nbytes: int
    sha256: str | None = None
    checksum: str | None = None
    update_id: str | None = None
    trainer_id: str | None = None
    chunk: int | None = None
    intent: list[str] | None = None
    inline: str | None = None
    shm: str | None = None
    last: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {self.nbytes!r}")
        if self.sha256 is not None and not isinstance(self.sha256, str):
            raise ValueError(f"sha256 must be hex text, got {self.sha256!r}")
        if self.checksum is not None and (
            not isinstance(self.checksum, str)
            or len(self.checksum) > 200
            or self.checksum.partition(":")[0] not in ALGORITHMS
        ):
            raise ValueError(
                f"checksum must be '<algorithm>:<hex>' with an algorithm of {ALGORITHMS}, "
                f"got {self.checksum!r:.80}"
            )
        if not isinstance(self.last, bool):
            raise ValueError(f"last must be a bool, got {self.last!r}")
        for what in ("update_id", "trainer_id"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, str) or not OWNER.fullmatch(value)):
                raise ValueError(f"{what} is 1-64 of [A-Za-z0-9_.-], got {value!r:.80}")
        if self.update_id is None:
            raise ValueError(
                "update_id is missing: every chunk names its update (PatchctxTrainerEngine "
                "does this)"
            )
        if self.chunk is not None and (
            not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 0
        ):
            raise ValueError(f"chunk must be a non-negative int, got {self.chunk!r}")
        if self.intent is not None and (
            not isinstance(self.intent, list)
            or not all(isinstance(d, str) and len(d) <= 128 for d in self.intent)
        ):
            raise ValueError("intent must be a list of hex digests")

    def descriptor(self) -> dict[str, Any]:
        """The fields a transport reads."""
        return {
            "nbytes": self.nbytes,
            "sha256": self.sha256,
            "checksum": self.checksum,
            "inline": self.inline,
            "shm": self.shm,
        }


def worker_error(error: BaseException, rank: int) -> PatchError:
    """`error` as a patchctx error whose message starts with its class and the worker's rank.

    vLLM carries a worker's exception to the API server and the HTTP client as text
    (``Exception(message)``); the mark ``[patchctx rank R: Class]`` survives that, and
    `raise_worker_error` turns it back into the same class.

    Examples:
        >>> from patchctx.vllm._backend import raise_worker_error, worker_error
        >>> error = worker_error(KeyError("model.norm.weight"), rank=1)
        >>> str(error)
        "[patchctx rank 1: KeyError] 'model.norm.weight'"
        >>> raise_worker_error("Call to update_weights method failed: " + str(error))
        Traceback (most recent call last):
        ...
        patchctx._errors.PatchError: [patchctx rank 1: KeyError] 'model.norm.weight'
    """
    if _MARK.match(str(error)):
        return error if isinstance(error, PatchError) else PatchError(str(error))
    message = f"[patchctx rank {rank}: {type(error).__name__}] {error}"
    if isinstance(error, WeightVersionError):
        return WeightVersionError(message, expected=error.expected, found=error.found)
    if isinstance(error, PatchError):
        try:
            return type(error)(message)
        except TypeError:  # pragma: no cover - a subclass with another signature
            return PatchError(message)
    return PatchError(message)


def raise_worker_error(text: str) -> None:
    """Raise the patchctx error whose mark `text` contains (any text around it is dropped).

    Does nothing when `text` holds no mark.
    """
    found = _MARK.search(text)
    if found is None:
        return
    message = _VLLM_SUFFIX.sub("", text[found.start() :].strip())
    cls = _CLASSES.get(found.group(2))
    if cls is not None:
        if cls is WeightVersionError:
            raise WeightVersionError(message)
        try:
            raise cls(message)
        except TypeError:  # pragma: no cover
            pass
    raise PatchError(message)


def _world() -> Any:
    """The group of this engine's workers (`None` outside a vLLM worker, or alone)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except (ImportError, AssertionError):
        return None
    return group if group.world_size > 1 else None


@dataclass(frozen=True)
class Outcome:
    """What the workers of an engine agreed on after one step of an update."""

    error: PatchError | None
    """The first failing worker's error (`None`: every worker succeeded)."""
    raise_here: bool
    """Whether this worker raises it (the last one; the only one when alone)."""
    failed: int
    """How many workers failed."""
    workers: int
    """How many workers took part."""


def agree(error: PatchError | None) -> Outcome:
    """Share each worker's outcome with every worker of the engine.

    Every worker of the engine calls this at the same point of an update. vLLM 0.32's
    multi-process executor reads the workers' answers in rank order and stops at the first
    failure, leaving the later ranks' answers queued for the next call: a failure raised on
    rank 0 of a TP=2 engine would be read as the answer to the next request. So a failure
    on any worker is raised by the last worker only (whose answer is read last), with the
    first failing worker's rank and class, and every worker learns that the update failed.
    """
    world = _world()
    if world is None:
        return Outcome(error, error is not None, int(error is not None), 1)
    outcomes: list[Any] = [None] * world.world_size
    mine = None if error is None else (type(error).__name__, str(error))
    torch.distributed.all_gather_object(outcomes, mine, group=world.cpu_group)
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return Outcome(None, False, 0, world.world_size)
    name, message = failed[0]
    first = error if error is not None and str(error) == message else None
    if first is None:
        first = _CLASSES.get(name, PatchError)(message)
    last = world.rank_in_group == world.world_size - 1
    return Outcome(first, last, len(failed), world.world_size)


def compare_apply(
    how: str, model: torch.nn.Module, patches: list[CheckpointWeightPatch], vllm_config: Any
) -> dict[str, Any]:
    """Apply `patches` the way a comparison method would (``PatchctxInitInfo.apply``)."""
    started = time.perf_counter()
    from patchctx.vllm._aliases import tied_aliases

    aliases = tied_aliases(model)
    renamed = [p._replace(name=aliases.get(p.name, p.name)) for p in patches]
    if how == "vllm":
        from vllm.model_executor.model_loader import checkpoint_weight_patch as vllm_patch

        try:
            for _, run in itertools.groupby(renamed, key=lambda p: p.indices is None):
                batch = [vllm_patch.CheckpointWeightPatch(*p) for p in run]
                vllm_patch.load_checkpoint_weight_patches(model, batch)
        finally:
            # vLLM restores copy_ by assignment, shadowing the inherited built-in: drop it
            entry = torch.Tensor.__dict__.get("copy_")
            if entry is not None and entry is torch._C.TensorBase.__dict__.get("copy_"):
                delattr(torch.Tensor, "copy_")
    else:
        if any(p.indices is not None for p in renamed):
            raise InvalidPatchError(f"apply={how!r} takes dense patches only")
        weights = [(p.name, p.values.reshape(p.shape).to(p.dtype)) for p in renamed]
        if how == "layerwise":
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            with set_current_vllm_config(vllm_config):
                initialize_layerwise_reload(model)
                read_names(model.load_weights(weights))  # type: ignore[operator]
                finalize_layerwise_reload(model, vllm_config.model_config)
        else:
            read_names(model.load_weights(weights))  # type: ignore[operator]  # runs a generator
    return {"milliseconds": (time.perf_counter() - started) * 1000.0, "patches": len(patches)}


def _calling_worker() -> Any:
    """The vLLM worker creating this engine (from the caller's frames), or `None`."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame_self = frame.f_locals.get("self")
        if hasattr(frame_self, "_weight_update_active") and hasattr(
            frame_self, "weight_transfer_engine"
        ):
            return frame_self
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


class PatchctxWeightTransferEngine(WeightTransferEngine[PatchctxInitInfo, PatchctxUpdateInfo]):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """vLLM weight-transfer backend ``patchctx``: checkpoint-coordinate patches, in place.

    Registered under the name ``patchctx`` by patchctx's ``vllm.general_plugins`` entry
    point, so ``vllm serve MODEL --weight-transfer-config '{"backend": "patchctx"}'`` or
    ``LLM(..., weight_transfer_config=WeightTransferConfig(backend="patchctx"))`` creates one
    per worker. Each update (an `encode_patches` payload, fetched through the transport
    chosen at ``init_weight_transfer_engine``, or inline below a size limit) is

    - checked: size and SHA-256 of the payload, every field of it, the base version against
      the version the worker's weights are at (vLLM's own: ``"default"`` at start, then the
      ``weight_version`` each ``finish_weight_update`` names; the trainer may declare it at
      init), names that no loader of the model consumes, weights the engine transformed
      after loading — all before the first write;
    - applied in place through the model's own ``load_weights`` with the worker's
      `RouteCache`, tied embeddings resolved, as one atomic call: if anything fails, every
      weight is as before and the engine keeps serving them.

    An error reaches the caller (over HTTP too) as text starting with
    ``[patchctx rank R: Class]``; `HTTPWeightSyncClient` raises the same class again.
    Dense and sparse patches may be mixed. vLLM's layerwise reload is not used: patches are
    written in place, and weights that would need post-processing are refused instead.

    Examples:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import PatchctxWeightTransferEngine, encode_patches
        >>> from patchctx.vllm._transport import digest
        >>> class Model(torch.nn.Module):  # stands for the worker's vLLM model
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for _, tensor in weights:
        ...             self.w.copy_(tensor)
        ...         return {"w"}
        >>> parallel = SimpleNamespace(rank=0, pipeline_parallel_size=1)
        >>> config = SimpleNamespace(parallel_config=parallel, model_config=None)
        >>> engine = PatchctxWeightTransferEngine(None, config, torch.device("cpu"), Model())
        >>> patch = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([2.0]),
        ...                               torch.tensor([1]))
        >>> payload = encode_patches([patch], base_version="default", target_version="1")
        >>> engine.start_weight_update()
        >>> engine.update_weights({"nbytes": len(payload), "sha256": digest(payload),
        ...                        "update_id": "u1",
        ...                        "inline": __import__("base64").b64encode(payload).decode()})
        >>> engine.finish_weight_update()
        >>> engine.model.w.tolist(), engine.patcher.version
        ([0.0, 2.0, 0.0, 0.0], '1')
    """

    init_info_cls = PatchctxInitInfo
    update_info_cls = PatchctxUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        self.rank = int(getattr(parallel, "rank", 0) or 0)
        self.patcher = WorkerPatcher(
            version=VLLM_START_VERSION,
            check_consumed=int(getattr(parallel, "pipeline_parallel_size", 1) or 1) == 1,
        )
        self.inline = InlineTransport()
        self.transport: Transport | None = None
        # The update being received (chunks held, nothing applied), or None.
        self.update: OpenUpdate | None = None
        # The connected trainer (the last init_weight_transfer_engine); None: anonymous.
        self.trainer_id: str | None = None
        # Every version this worker's weights have been at, in order: versions never repeat.
        self.served: list[str | int | None] = [VLLM_START_VERSION]
        # Every update applied: (update id, trainer id, target version), in order.
        self.commits: list[tuple[str, str | None, str | int | None]] = []
        self._started = False  # a session is open (vLLM's own flag, when there is no worker)
        # Read back what each update wrote before committing it (`WorkerPatcher.read_back`);
        # PATCHCTX_VLLM_VERIFY_LANDING=0 turns it off.
        self.verify_landing = os.environ.get("PATCHCTX_VLLM_VERIFY_LANDING", "1") != "0"
        self.last_stats: dict[str, Any] | None = None
        self.applier = "patchctx"
        self.integrity: str | None = None  # None: by transport (DEFAULT_INTEGRITY)
        tensor_parallel = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.tensor_parallel = tensor_parallel
        self.model_bytes = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]
            if t.device.type != "meta"
        )
        self.max_payload = payload_limit(self.model_bytes, tensor_parallel)
        # The checkpoint's tensors (names, shapes, dtypes), read from its files: what a
        # payload may declare. Empty when unknown (bounded by the model's size then).
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            name: (shape, dtype) for name, shape, dtype in _specs(vllm_config)
        }
        # Every checkpoint name's route, learnt now by a dry run of the loaders (nothing is
        # written), so the first update already replays in O(nnz); `None` if not warmed.
        self.warm_report = warm_at_start(self.patcher, model, vllm_config, self.rank)
        # vLLM's worker, to keep its "update in progress" flag the same on every worker when
        # only the last one raises (see `agree`), and to end a session a finish refused.
        # `None` when not created by a vLLM worker.
        self.worker = _calling_worker()

    @property
    def pending(self) -> list[PatchPayload]:
        """The chunks of the open update held so far (nothing of them applied)."""
        return [] if self.update is None else list(self.update.chunks)

    def _end_vllm_update(self) -> None:
        """Mark the update ended on vLLM's worker, as vLLM does on the worker that raises."""
        self._started = False
        if self.worker is not None and getattr(self.worker, "_weight_update_active", False):
            self.worker._weight_update_active = False

    def _session_open(self) -> bool:
        if self.worker is not None:
            return bool(getattr(self.worker, "_weight_update_active", False))
        return self._started

    # -- lifecycle -----------------------------------------------------------------------

    def init_transfer_engine(self, init_info: PatchctxInitInfo) -> None:
        """Connect a trainer: check it may, roll back what it takes over, open the transport.

        Refused, with nothing changed, when another trainer's update is open (unless
        ``takeover``) and when the trainer's declared base (``weight_version``) is not the
        version the worker's weights are at (unless ``adopt_version``).
        """
        error = None
        try:
            self._check_init(init_info)
            self._connect(init_info)
        except Exception as caught:
            error = worker_error(caught, self.rank)
        outcome = agree(error)
        if outcome.raise_here:
            assert outcome.error is not None
            raise outcome.error

    def _owner(self) -> str | None:
        return self.update.trainer if self.update is not None else self.trainer_id

    def _check_init(self, info: PatchctxInitInfo) -> None:
        """Every refusal of an init, before anything changes."""
        busy = self.update is not None or self._session_open()
        owner = self._owner()
        mine = info.trainer_id is not None and info.trainer_id == owner
        if busy and not mine and not info.takeover:
            what = (
                f"update {self.update.update_id!r} ({len(self.update.chunks)} chunk(s) held, "
                f"{'complete' if self.update.complete else 'not complete'})"
                if self.update is not None
                else "a weight-update session (started, no chunk yet)"
            )
            raise UpdateConflictError(
                f"{what} of trainer {owner!r} is open: trainer {info.trainer_id!r} cannot "
                "connect while it is. Wait for it to finish, or pass takeover=True to roll "
                "it back whole (none of it is applied) and connect; nothing changed"
            )
        declared = info.weight_version
        if declared is not None and not info.adopt_version and declared != self.patcher.version:
            raise WeightVersionError(
                f"the trainer declares its state at weight version {declared!r}; this worker's "
                f"weights are at {self.patcher.version!r}. Its differences would be applied "
                "to other weights than they were computed from (a trainer resumed from an "
                "older checkpoint?): send a full update from the served weights, or declare "
                "adopt_version=True only if the weights really are at that version; nothing "
                "changed",
                expected=declared,
                found=self.patcher.version,
            )

    def _connect(self, info: PatchctxInitInfo) -> None:
        if self.update is not None or self._session_open():
            dropped = self.update
            self.update = None
            self._end_vllm_update()
            logger.warning(
                "patchctx: rank %d rolled back %s of trainer %r for trainer %r (%s); none of "
                "it was applied",
                self.rank,
                f"update {dropped.update_id!r}" if dropped is not None else "an empty session",
                dropped.trainer if dropped is not None else self.trainer_id,
                info.trainer_id,
                "takeover" if info.takeover else "its own init again",
            )
        previous = self.trainer_id
        if self.transport is not None:
            if isinstance(self.transport, SharedMemoryTransport) and previous != info.trainer_id:
                self.transport.sweep(previous)  # files a trainer died before sending
            self.transport.close()
            self.transport = None
        if info.adopt_version:  # declared by whoever reloaded the weights: a new line
            self.patcher.version = info.weight_version
            self.served = [info.weight_version]
        self.trainer_id = info.trainer_id
        self.applier = info.apply
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
                parallel_config=self.parallel_config,
                limit=self.max_payload,
            )

    def start_weight_update(self) -> None:
        """Start a session. An update left open by an ended session stays open for its trainer.

        vLLM refuses a start while a session is active; a session ended by a refused chunk
        keeps the open update, so that another trainer's chunk cannot end it: its own trainer
        sends the rest (or starts over), or a takeover init rolls it back.
        """
        self._started = True

    def parse_update_info(self, update_dict: dict[str, Any]) -> PatchctxUpdateInfo:
        """Build the typed update info; `InvalidPatchError` (a `ValueError`) if malformed."""
        if not isinstance(update_dict, Mapping):
            raise InvalidPatchError(f"update_info must be an object, got {update_dict!r:.80}")
        try:
            return PatchctxUpdateInfo(**update_dict)
        except (TypeError, ValueError) as error:
            raise InvalidPatchError(f"invalid update_info: {error}") from None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and check one chunk, and hold it. Errors name class and rank.

        Nothing is written: ``finish_weight_update`` applies a complete update. Every
        worker of the engine agrees on the outcome (`agree`): a refusal on any worker is a
        refusal on all. A refusal of the open update's own chunk drops that update (nothing
        of it was applied); a refused chunk of another update leaves the open one as it was.
        """
        error = None
        descriptor: dict[str, Any] = {}
        keep_open = True  # a chunk nobody can tell the owner of never ends the open update
        try:
            info = self.parse_update_info(update_info)
            descriptor = info.descriptor()
            keep_open = self._foreign(info)
            self._receive(info)
        except Exception as caught:
            error = worker_error(caught, self.rank)
        checked = agree(error)  # every worker has read the payload now
        if descriptor and isinstance(self.transport, SharedMemoryTransport):
            self.transport.consume(descriptor)  # nothing stays in /dev/shm once read
            if checked.error is not None:
                self.transport.forget(descriptor)  # a refused file is mapped afresh next time
        if checked.error is not None:
            if not keep_open:
                self.update = None
            self._fail(checked)

    def _fail(self, outcome: Outcome) -> None:
        """End the session on this worker; raise the agreed error on the last worker only."""
        if outcome.raise_here:
            assert outcome.error is not None
            self._started = False  # vLLM ends its own flag on the worker that raises
            raise outcome.error
        self._end_vllm_update()  # vLLM does this on the worker that raises

    def receive_weights(self, update_info: PatchctxUpdateInfo) -> None:
        """Receive and check one chunk on this worker alone; the last one applies the update.

        (vLLM's base engine API: one call per chunk, no separate finish.)
        """
        self._receive(update_info)
        if update_info.last:
            self._commit()

    def _foreign(self, info: PatchctxUpdateInfo) -> bool:
        """Whether the chunk belongs to another update than the open one, or another trainer."""
        open_update = self.update
        if open_update is None or open_update.update_id == info.update_id:
            return False
        return info.trainer_id is None or info.trainer_id != open_update.trainer

    def _receive(self, info: PatchctxUpdateInfo) -> None:
        """Fetch, check and hold one chunk; on the last, check the whole update."""
        if (
            self.trainer_id is not None
            and info.trainer_id != self.trainer_id
            and (self.update is None or self._foreign(info))
        ):
            raise UpdateConflictError(
                f"a chunk of trainer {info.trainer_id!r}, but trainer {self.trainer_id!r} is "
                "the one connected (the last init_weight_transfer_engine): connect first; "
                "nothing changed"
            )
        open_update = self.update
        if open_update is not None and open_update.update_id != info.update_id:
            if self._foreign(info):
                raise UpdateConflictError(
                    f"update {open_update.update_id!r} of trainer {open_update.trainer!r} is "
                    f"open ({len(open_update.chunks)} chunk(s) held): a chunk of update "
                    f"{info.update_id!r} cannot join or replace it. It stays open for its "
                    "trainer; a takeover init rolls it back; nothing changed"
                )
            logger.warning(
                "patchctx: rank %d: trainer %r started update %r over its own open update %r "
                "(%d chunk(s) dropped, none applied)",
                self.rank,
                info.trainer_id,
                info.update_id,
                open_update.update_id,
                len(open_update.chunks),
            )
            self.update = open_update = None
        if open_update is not None and open_update.complete:
            raise UpdateConflictError(
                f"update {info.update_id!r} is complete (its last chunk arrived): a further "
                "chunk is refused; finish it, or start another update"
            )
        expected = 0 if open_update is None else len(open_update.chunks)
        if info.chunk is not None and info.chunk != expected:
            raise UpdateConflictError(
                f"chunk {info.chunk} of update {info.update_id!r} arrived where chunk "
                f"{expected} was due (a chunk lost or sent twice); the update is dropped, "
                "nothing of it was applied"
            )
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
        self._check_integrity(info, transport.name)
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
        self._bound(payload.patches)
        if open_update is None:
            self.patcher.check_base(payload.base_version)
            self._check_target(payload.base_version, payload.target_version)
            open_update = OpenUpdate(
                info.update_id or "",
                info.trainer_id,
                payload.base_version,
                payload.target_version,
            )
        elif (payload.base_version, payload.target_version) != (
            open_update.base,
            open_update.target,
        ):
            raise InvalidPatchError(
                "the chunks of one update name different versions: "
                f"{open_update.base!r} -> {open_update.target!r} and "
                f"{payload.base_version!r} -> {payload.target_version!r}"
            )
        chunks = [*open_update.chunks, payload]
        if info.last:
            patches = [p for chunk in chunks for p in chunk.patches]
            if self.applier == "patchctx":
                self.patcher.check(self.model, patches)  # before any write, on every worker
        open_update.chunks = chunks
        open_update.complete = info.last
        self.update = open_update

    def _check_integrity(self, info: PatchctxUpdateInfo, transport: str) -> None:
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

    def _bound(self, patches: Sequence[CheckpointWeightPatch]) -> None:
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

    def _check_target(self, base: str | int | None, target: str | int | None) -> None:
        """Versions never repeat: the target is none the weights have been at."""
        if target is not None and target in self.served:
            raise WeightVersionError(
                f"the update's target version {target!r} is one these weights were at before "
                f"(versions served: {self.served[-8:]!r}): a version names one set of weights "
                "only; nothing was written",
                expected=base,
                found=self.patcher.version,
            )

    def _commit(self) -> None:
        """Apply the open, complete update in one atomic call; its target is the new version."""
        open_update = self.update
        assert open_update is not None and open_update.complete
        self.update = None
        chunks = open_update.chunks
        patches: list[CheckpointWeightPatch] = [p for chunk in chunks for p in chunk.patches]
        if self.applier != "patchctx":
            self.last_stats = compare_apply(self.applier, self.model, patches, self.vllm_config)
            self.last_stats["rank"] = self.rank
            self.patcher.version = open_update.target
            self.served.append(open_update.target)
            return
        stats = self.patcher.apply(
            self.model,
            patches,
            base_version=open_update.base,
            target_version=open_update.target,  # None: a version nobody named
            atomic=True,
            verify_landing=self.verify_landing,
        )
        self.served.append(open_update.target)
        self.commits.append((open_update.update_id, open_update.trainer, open_update.target))
        self.last_stats = {"rank": self.rank, "chunks": len(chunks), **stats}
        logger.info(
            "patchctx: rank %d applied update %r (%d patches, %d replayed, %d loader calls) "
            "in %.1f ms; weights now at version %r",
            self.rank,
            open_update.update_id,
            len(patches),
            stats["replayed"],
            stats["loader_calls"],
            stats["milliseconds"],
            stats["version"],
        )

    def finish_weight_update(self) -> None:
        """Apply the open update whole, or refuse: vLLM then records no version.

        vLLM sets the version ``finish_weight_update`` names only when this returns, so the
        version ``/weight_info`` reports always names applied weights. A finish without a
        complete update (no chunk, or not the last one yet) is refused and applies nothing;
        an incomplete update stays open for its trainer. If applying fails, every weight is
        as before (atomic) and the update is dropped.
        """
        error = None
        try:
            if self.update is None or not self.update.complete:
                raise UpdateConflictError(
                    "no complete update to finish: "
                    + (
                        "no chunk arrived in this session"
                        if self.update is None
                        else f"update {self.update.update_id!r} has {len(self.update.chunks)} "
                        "chunk(s), not its last one yet (it stays open for its trainer)"
                    )
                    + "; nothing was applied, and no version is recorded"
                )
            self._commit()
        except Exception as caught:
            error = worker_error(caught, self.rank)
        applied = agree(error)
        if applied.error is not None:
            if (
                0 < applied.failed < applied.workers
                and isinstance(applied.error, PatchError)
                and not isinstance(applied.error, UpdateConflictError)
            ):
                self.patcher.version = None  # some workers applied the update, others not
                applied.error.args = (
                    f"{applied.error}; {applied.workers - applied.failed} of "
                    f"{applied.workers} workers applied the update, the others did not: "
                    "their weights differ now; reload the weights, then declare the "
                    "version (init_weight_transfer_engine, adopt_version=True)",
                )
            self._end_vllm_update()  # vLLM keeps its session open when finish raises
            if applied.raise_here:
                raise applied.error
            return
        self._started = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def shutdown(self) -> None:
        """Close the transport (an open update is dropped: none of it was applied)."""
        if self.update is not None:
            logger.warning(
                "patchctx: rank %d dropped update %r at shutdown; nothing of it was written",
                self.rank,
                self.update.update_id,
            )
            self.update = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None


@dataclass
class OpenUpdate:
    """An update being received: its owner, versions and the chunks held (none applied)."""

    update_id: str
    trainer: str | None
    base: str | int | None
    target: str | int | None
    chunks: list[PatchPayload] = field(default_factory=list)
    complete: bool = False


def _specs(vllm_config: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The checkpoint's tensors, or none (a config without a local checkpoint)."""
    try:
        return checkpoint_specs(vllm_config)
    except Exception:  # unreadable files: bounded by the model's size instead
        return []
