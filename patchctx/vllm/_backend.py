"""The worker side of the ``patchctx`` weight-transfer backend (vLLM's RL API).

vLLM creates one `PatchctxWeightTransferEngine` per worker when the engine is started with
``weight_transfer_config={"backend": "patchctx"}`` and drives it through the worker's
``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` (one or more
chunks) -> ``finish_weight_update``, from ``vllm serve``'s HTTP endpoints, ``LLM`` or Ray.
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    PatchError,
)
from patchctx._errors import WeightVersionError  # public as patchctx.vllm.WeightVersionError
from patchctx._model import read_names
from patchctx.vllm._apply import WorkerPatcher
from patchctx.vllm._codec import PatchPayload, decode_payload
from patchctx.vllm._transport import (
    InlineTransport,
    NCCLTransport,
    SharedMemoryTransport,
    Transport,
    check_received,
)
from patchctx.vllm._warmup import warm_at_start

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
        weight_version: The version of the weights the engine holds now (what
            ``/weight_info`` says), declared by the trainer so that base versions are
            checked against vLLM's; `None` keeps the worker's record.
        shm_dir: The shared-memory directory (``"shm"``).
        master_address: Rendezvous address of the NCCL group (``"nccl"``).
        master_port: Rendezvous port (``"nccl"``).
        world_size: The NCCL group's size: the trainer plus every worker (``"nccl"``).
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
    shm_dir: str = "/dev/shm"
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    apply: str = "patchctx"

    def __post_init__(self) -> None:
        if self.apply not in APPLIERS:
            raise ValueError(f"apply={self.apply!r}: one of {APPLIERS}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: one of {TRANSPORTS}")
        if self.weight_version is not None and not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a str, got {self.weight_version!r}")
        if self.transport == "nccl" and (
            self.master_address is None or self.master_port is None or self.world_size is None
        ):
            raise ValueError("the nccl transport needs master_address, master_port and world_size")


@dataclass
class PatchctxUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc,unused-ignore]  # vLLM: Any without it
    """What ``update_weights`` takes (``update_info``): one chunk of an update.

    Attributes:
        nbytes: The payload's size in bytes (an `encode_patches` payload).
        sha256: Its SHA-256, hex; a payload that does not match is refused.
        inline: The payload itself, base64 (below the workers' inline limit); `None`: fetch
            it through the transport chosen at init.
        shm: The payload file's name (``"shm"`` transport).
        last: Whether this chunk completes the update. Chunks are checked as they arrive
            and held; the last one applies them all in one atomic call, so an update whose
            last chunk never comes (a trainer that died) changes nothing.

    Examples:
        >>> from patchctx.vllm import PatchctxUpdateInfo
        >>> PatchctxUpdateInfo(nbytes=96, sha256="0" * 64, shm="patchctx-1").last
        True
        >>> PatchctxUpdateInfo(nbytes=-1, sha256="")
        Traceback (most recent call last):
        ...
        ValueError: nbytes must be a non-negative int, got -1
    """

    nbytes: int
    sha256: str
    inline: str | None = None
    shm: str | None = None
    last: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {self.nbytes!r}")
        if not isinstance(self.sha256, str):
            raise ValueError(f"sha256 must be hex text, got {self.sha256!r}")
        if not isinstance(self.last, bool):
            raise ValueError(f"last must be a bool, got {self.last!r}")

    def descriptor(self) -> dict[str, Any]:
        """The fields a transport reads."""
        return {
            "nbytes": self.nbytes,
            "sha256": self.sha256,
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
        self.pending: list[PatchPayload] = []
        self.last_stats: dict[str, Any] | None = None
        self.applier = "patchctx"
        # Every checkpoint name's route, learnt now by a dry run of the loaders (nothing is
        # written), so the first update already replays in O(nnz); `None` if not warmed.
        self.warm_report = warm_at_start(self.patcher, model, vllm_config, self.rank)
        # vLLM's worker, to keep its "update in progress" flag the same on every worker when
        # only the last one raises (see `agree`), and to let a new trainer close an update a
        # dead one left open. `None` when not created by a vLLM worker.
        self.worker = _calling_worker()

    def _end_vllm_update(self) -> None:
        """Mark the update ended on vLLM's worker, as vLLM does on the worker that raises."""
        if self.worker is not None and getattr(self.worker, "_weight_update_active", False):
            self.worker._weight_update_active = False

    # -- lifecycle -----------------------------------------------------------------------

    def init_transfer_engine(self, init_info: PatchctxInitInfo) -> None:
        """Open the transport; end an update a dead trainer left open.

        Its chunks, never applied, are dropped, so the new trainer can start its own.
        """
        error = None
        try:
            self._discard("a new trainer connection was initialised")
            self._end_vllm_update()
            if self.transport is not None:
                self.transport.close()
                self.transport = None
            if init_info.weight_version is not None:
                self.patcher.version = init_info.weight_version
            self.applier = init_info.apply
            if init_info.transport == "shm":
                self.transport = SharedMemoryTransport(init_info.shm_dir)
            elif init_info.transport == "nccl":
                assert init_info.master_address is not None
                assert init_info.master_port is not None and init_info.world_size is not None
                self.transport = NCCLTransport.for_worker(
                    master_address=init_info.master_address,
                    master_port=init_info.master_port,
                    world_size=init_info.world_size,
                    parallel_config=self.parallel_config,
                )
        except Exception as caught:
            error = worker_error(caught, self.rank)
        outcome = agree(error)
        if outcome.raise_here:
            assert outcome.error is not None
            raise outcome.error

    def start_weight_update(self) -> None:
        """Start an update: no chunk is held."""
        self._discard("a new update was started")

    def parse_update_info(self, update_dict: dict[str, Any]) -> PatchctxUpdateInfo:
        """Build the typed update info; `InvalidPatchError` (a `ValueError`) if malformed."""
        if not isinstance(update_dict, Mapping):
            raise InvalidPatchError(f"update_info must be an object, got {update_dict!r:.80}")
        try:
            return PatchctxUpdateInfo(**update_dict)
        except (TypeError, ValueError) as error:
            raise InvalidPatchError(f"invalid update_info: {error}") from None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one chunk; the last one applies the update. Errors name class and rank.

        Two steps, each agreed by every worker of the engine (`agree`): fetch and check
        (nothing written: a refusal on any worker is a refusal on all), then apply (atomic
        on each worker; if one worker fails after others applied, the workers now differ,
        and every worker's version becomes unknown).
        """
        ready: list[PatchPayload] | None = None
        error = None
        try:
            ready = self._receive(self.parse_update_info(update_info))
        except Exception as caught:
            error = worker_error(caught, self.rank)
        checked = agree(error)
        if checked.error is not None:
            self._fail(checked)
            return
        if ready is None:
            return  # a chunk held for the last one
        try:
            self._apply(ready)
        except Exception as caught:
            error = worker_error(caught, self.rank)
        applied = agree(error)
        if applied.error is not None:
            if applied.failed < applied.workers:  # some workers applied the update
                self.patcher.version = None
                applied.error.args = (
                    f"{applied.error}; {applied.workers - applied.failed} of "
                    f"{applied.workers} workers applied the update, the others did not: "
                    "their weights differ now; reload the weights, then declare the "
                    "version (init_weight_transfer_engine)",
                )
            self._fail(applied)
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _fail(self, outcome: Outcome) -> None:
        """End the update on this worker; raise the agreed error on the last worker only."""
        self.pending = []
        if outcome.raise_here:
            assert outcome.error is not None
            raise outcome.error
        self._end_vllm_update()  # vLLM does this on the worker that raises

    def receive_weights(self, update_info: PatchctxUpdateInfo) -> None:
        """Receive, check and (on the last chunk) apply, on this worker alone."""
        ready = self._receive(update_info)
        if ready is not None:
            self._apply(ready)

    def _receive(self, update_info: PatchctxUpdateInfo) -> list[PatchPayload] | None:
        """Fetch, check and hold one chunk; on the last, every held chunk (checked)."""
        descriptor = update_info.descriptor()
        if update_info.inline is not None:
            data = self.inline.receive(descriptor)
        elif self.transport is None:
            raise InvalidPatchError(
                "no transport: call init_weight_transfer_engine first, or send the payload inline"
            )
        else:
            data = self.transport.receive(descriptor)
        payload = decode_payload(check_received(data, descriptor))
        if self.pending:
            first = self.pending[0]
            if (payload.base_version, payload.target_version) != (
                first.base_version,
                first.target_version,
            ):
                raise InvalidPatchError(
                    "the chunks of one update name different versions: "
                    f"{first.base_version!r} -> {first.target_version!r} and "
                    f"{payload.base_version!r} -> {payload.target_version!r}"
                )
        else:
            self.patcher.check_base(payload.base_version)
        self.pending.append(payload)
        if not update_info.last:
            return None
        chunks, self.pending = self.pending, []
        patches = [p for chunk in chunks for p in chunk.patches]
        if self.applier == "patchctx":
            self.patcher.check(self.model, patches)  # before any write, on every worker
        return chunks

    def _apply(self, chunks: list[PatchPayload]) -> None:
        patches: list[CheckpointWeightPatch] = [p for chunk in chunks for p in chunk.patches]
        if self.applier != "patchctx":
            self.last_stats = compare_apply(self.applier, self.model, patches, self.vllm_config)
            self.last_stats["rank"] = self.rank
            self.patcher.version = chunks[0].target_version
            return
        stats = self.patcher.apply(
            self.model,
            patches,
            base_version=chunks[0].base_version,
            target_version=chunks[0].target_version,  # None: a version nobody named
            atomic=True,
        )
        self.last_stats = {"rank": self.rank, "chunks": len(chunks), **stats}
        logger.info(
            "patchctx: rank %d applied %d patches (%d replayed, %d loader calls) in %.1f ms; "
            "weights now at version %r",
            self.rank,
            len(patches),
            stats["replayed"],
            stats["loader_calls"],
            stats["milliseconds"],
            stats["version"],
        )

    def finish_weight_update(self) -> None:
        """End the update. Chunks held without their last one are dropped (and logged).

        Nothing of such an update was written, and the worker's version stays where it was,
        so an update computed against the version ``finish_weight_update`` then names is
        refused: the weights are not at it.
        """
        self._discard("the update was finished before its last chunk")

    def shutdown(self) -> None:
        """Close the transport."""
        self._discard("shutdown")
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _discard(self, why: str) -> None:
        if self.pending:
            logger.warning(
                "patchctx: rank %d dropped %d chunk(s) of an unfinished update (%s); nothing "
                "of it was written",
                self.rank,
                len(self.pending),
                why,
            )
            self.pending = []
