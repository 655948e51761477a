"""The worker side of the ``patchctx`` weight-transfer backend (vLLM's RL API).

vLLM creates one `PatchctxWeightTransferEngine` per worker when the engine is started with
``weight_transfer_config={"backend": "patchctx"}`` and drives it through the worker's
``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` (one or more
chunks) -> ``finish_weight_update``, from ``vllm serve``'s HTTP endpoints, ``LLM`` or Ray.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, overload

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
from patchctx._model import read_names
from patchctx.vllm._admission import admit, check_init
from patchctx.vllm._apply import WorkerPatcher
from patchctx.vllm._codec import ALGORITHMS, PatchPayload
from patchctx.vllm._errors import UpdateConflictError, WeightVersionError
from patchctx.vllm._ledger import OpenUpdate, UpdateLedger
from patchctx.vllm._receiving import ChunkReceiver
from patchctx.vllm._transport import OWNER, Transport
from patchctx.vllm._update_session import UpdateSession, calling_worker
from patchctx.vllm._warmup import warm_at_start

__all__ = [
    "VLLM_START_VERSION",
    "PatchctxInitInfo",
    "PatchctxUpdateInfo",
    "PatchctxWeightTransferEngine",
    "worker_error",
]

_T = TypeVar("_T")

VLLM_START_VERSION = "default"
"""The weight version a vLLM 0.32 engine reports (``/weight_info``) before any update."""

TRANSPORTS = ("shm", "nccl", "inline")
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

    @classmethod
    def parsed(cls, update_dict: object) -> PatchctxUpdateInfo:
        """The update info of a request's object; `InvalidPatchError` if malformed."""
        if not isinstance(update_dict, Mapping):
            raise InvalidPatchError(f"update_info must be an object, got {update_dict!r:.80}")
        try:
            return cls(**update_dict)
        except (TypeError, ValueError) as error:
            raise InvalidPatchError(f"invalid update_info: {error}") from None

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

    def split_apply(self) -> bool:
        """Whether some workers applied an update and others did not; if so, `error` says it.

        Their weights differ then: the message says how to bring them back to one version.
        """
        if not (
            0 < self.failed < self.workers
            and isinstance(self.error, PatchError)
            and not isinstance(self.error, UpdateConflictError)
        ):
            return False
        self.error.args = (
            f"{self.error}; {self.workers - self.failed} of {self.workers} workers applied "
            "the update, the others did not: their weights differ now; reload the weights, "
            "then declare the version (init_weight_transfer_engine, adopt_version=True)",
        )
        return True


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


def agreed(step: Callable[[], object], rank: int) -> Outcome:
    """Run one step of an update on this worker, and `agree` on its outcome with every worker."""
    error = None
    try:
        step()
    except Exception as caught:
        error = worker_error(caught, rank)
    return agree(error)


def compare_apply(
    how: str, model: torch.nn.Module, patches: list[CheckpointWeightPatch], vllm_config: Any
) -> dict[str, Any]:
    """Apply `patches` the way a comparison method would (``PatchctxInitInfo.apply``)."""
    started = time.perf_counter()
    from patchctx.vllm._aliases import tied_aliases

    aliases = tied_aliases(model)
    renamed = [
        CheckpointWeightPatch(aliases.get(p.name, p.name), p.shape, p.dtype, p.values, p.indices)
        for p in patches
    ]
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


class Alias(Generic[_T]):
    """An attribute of the engine that is one of its collaborators' (read and set there)."""

    def __init__(self, collaborator: str, name: str, doc: str) -> None:
        self.collaborator, self.name, self.__doc__ = collaborator, name, doc

    @overload
    def __get__(self, engine: None, owner: type) -> Alias[_T]: ...
    @overload
    def __get__(self, engine: object, owner: type | None = None) -> _T: ...
    def __get__(self, engine: object, owner: type | None = None) -> Alias[_T] | _T:
        if engine is None:
            return self
        return cast("_T", getattr(getattr(engine, self.collaborator), self.name))

    def __set__(self, engine: object, value: _T) -> None:
        setattr(getattr(engine, self.collaborator), self.name, value)


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
        # Fetching and checking chunks (transports, integrity, bounds); the updates' book.
        self.receiver = ChunkReceiver(model, vllm_config)
        self.ledger = UpdateLedger(self.rank, VLLM_START_VERSION)
        # Read back what each update wrote before committing it (`WorkerPatcher.read_back`);
        # PATCHCTX_VLLM_VERIFY_LANDING=0 turns it off.
        self.verify_landing = os.environ.get("PATCHCTX_VLLM_VERIFY_LANDING", "1") != "0"
        self.last_stats: dict[str, Any] | None = None
        self.applier = "patchctx"
        # Every checkpoint name's route, learnt now by a dry run of the loaders (nothing is
        # written), so the first update already replays in O(nnz); `None` if not warmed.
        self.warm_report = warm_at_start(self.patcher, model, vllm_config, self.rank)
        # vLLM's worker's session flag, kept the same on every worker (see `agree`).
        self.session = UpdateSession(calling_worker())

    # What callers read of the collaborators, by the engine's own names.
    update = Alias[OpenUpdate | None]("ledger", "update", "The update being received, or `None`.")
    commits = Alias[list[tuple[str, str | None, str | int | None]]](
        "ledger", "commits", "Every update applied: (update id, trainer id, target version)."
    )
    transport = Alias[Transport | None]("receiver", "transport", "The transport chosen at init.")
    integrity = Alias[str | None](
        "receiver", "integrity", "The checksum required (`None`: by transport)."
    )
    worker = Alias[Any]("session", "worker", "vLLM's worker (`None`: not created by one).")

    @property
    def pending(self) -> list[PatchPayload]:
        """The chunks of the open update held so far (nothing of them applied)."""
        return [] if self.update is None else list(self.update.chunks)

    # -- lifecycle -----------------------------------------------------------------------

    def init_transfer_engine(self, init_info: PatchctxInitInfo) -> None:
        """Connect a trainer: check it may, roll back what it takes over, open the transport.

        Refused, with nothing changed, when another trainer's update is open (unless
        ``takeover``) and when the trainer's declared base (``weight_version``) is not the
        version the worker's weights are at (unless ``adopt_version``).
        """
        outcome = agreed(lambda: self._connect(init_info), self.rank)
        if outcome.raise_here:
            assert outcome.error is not None
            raise outcome.error

    def _connect(self, info: PatchctxInitInfo) -> None:
        check_init(self.ledger, info, self.session.is_open(), self.patcher.version)
        if self.ledger.update is not None or self.session.is_open():
            self.ledger.roll_back(info)
            self.session.end()
        self.receiver.disconnect(self.ledger.trainer_id, info.trainer_id)
        if info.adopt_version:  # declared by whoever reloaded the weights: a new line
            self.patcher.version = info.weight_version
        self.ledger.connect(info)
        self.applier = info.apply
        self.receiver.connect(info, self.parallel_config)

    def start_weight_update(self) -> None:
        """Start a session. An update left open by an ended session stays open for its trainer.

        vLLM refuses a start while a session is active; a session ended by a refused chunk
        keeps the open update, so that another trainer's chunk cannot end it: its own trainer
        sends the rest (or starts over), or a takeover init rolls it back.
        """
        self.session.started = True

    def parse_update_info(self, update_dict: dict[str, Any]) -> PatchctxUpdateInfo:
        """Build the typed update info; `InvalidPatchError` (a `ValueError`) if malformed."""
        return PatchctxUpdateInfo.parsed(update_dict)

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
            keep_open = self.ledger.foreign(info)
            self._receive(info)
        except Exception as caught:
            error = worker_error(caught, self.rank)
        checked = agree(error)  # every worker has read the payload now
        self.receiver.consumed(descriptor, refused=checked.error is not None)
        if checked.error is not None:
            if not keep_open:
                self.ledger.drop()
            self._fail(checked)

    def _fail(self, outcome: Outcome) -> None:
        """End the session on this worker; raise the agreed error on the last worker only."""
        if outcome.raise_here:
            assert outcome.error is not None
            self.session.started = False  # vLLM ends its own flag on the worker that raises
            raise outcome.error
        self.session.end()  # vLLM does this on the worker that raises

    def receive_weights(self, update_info: PatchctxUpdateInfo) -> None:
        """Receive and check one chunk on this worker alone; the last one applies the update.

        (vLLM's base engine API: one call per chunk, no separate finish.)
        """
        self._receive(update_info)
        if update_info.last:
            self._commit()

    def _receive(self, info: PatchctxUpdateInfo) -> None:
        """Fetch, check and hold one chunk; on the last, check the whole update."""
        open_update = admit(self.ledger, info)
        payload = self.receiver.fetch(info)
        open_update = self.ledger.joined(open_update, info, payload, self.patcher)
        chunks = [*open_update.chunks, payload]
        if info.last and self.applier == "patchctx":  # before any write, on every worker
            self.patcher.check(self.model, [p for chunk in chunks for p in chunk.patches])
        open_update.chunks = chunks
        open_update.complete = info.last
        self.ledger.update = open_update

    def _commit(self) -> None:
        """Apply the open, complete update in one atomic call; its target is the new version."""
        open_update = self.ledger.take_complete()
        patches: list[CheckpointWeightPatch] = [
            p for chunk in open_update.chunks for p in chunk.patches
        ]
        if self.applier != "patchctx":
            stats = compare_apply(self.applier, self.model, patches, self.vllm_config)
            self.last_stats = {**stats, "rank": self.rank}
            self.patcher.version = open_update.target
            self.ledger.committed(open_update, None)
            return
        stats = self.patcher.apply(
            self.model,
            patches,
            base_version=open_update.base,
            target_version=open_update.target,  # None: a version nobody named
            atomic=True,
            verify_landing=self.verify_landing,
        )
        self.last_stats = {"rank": self.rank, "chunks": len(open_update.chunks), **stats}
        self.ledger.committed(open_update, stats)

    def finish_weight_update(self) -> None:
        """Apply the open update whole, or refuse: vLLM then records no version.

        vLLM sets the version ``finish_weight_update`` names only when this returns, so the
        version ``/weight_info`` reports always names applied weights. A finish without a
        complete update (no chunk, or not the last one yet) is refused and applies nothing;
        an incomplete update stays open for its trainer. If applying fails, every weight is
        as before (atomic) and the update is dropped.
        """
        applied = agreed(self._commit, self.rank)
        if applied.error is not None:
            if applied.split_apply():
                self.patcher.version = None  # some workers applied the update, others not
            self.session.end()  # vLLM keeps its session open when finish raises
            if applied.raise_here:
                raise applied.error
            return
        self.session.started = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def shutdown(self) -> None:
        """Close the transport (an open update is dropped: none of it was applied)."""
        self.ledger.drop(at_shutdown=True)
        self.receiver.close()
