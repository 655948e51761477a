"""The driver side: send patches to every worker of a ``vllm.LLM`` through ``collective_rpc``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from patchctx._errors import (
    CastKindError,
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    LoaderError,
    PatchError,
)
from patchctx._patch import CheckpointWeightPatch
from patchctx.vllm._codec import encode_patches
from patchctx.vllm._errors import WeightVersionError
from patchctx.vllm._extension import APPLY_METHOD, SET_VERSION_METHOD

__all__ = ["PatchStats", "apply_patches", "set_weight_version"]

_ERRORS: dict[str, type[PatchError]] = {
    cls.__name__: cls
    for cls in (
        InvalidPatchError,
        InvalidPatchTypeError,
        LoaderContractError,
        WeightVersionError,
        CastKindError,
        LoaderError,
        PatchError,
    )
}


@dataclass(frozen=True, slots=True)
class PatchStats:
    """What one worker did with a patch set (returned by `apply_patches`, one per worker).

    Attributes:
        rank: The worker's rank.
        names: The checkpoint names patched, sorted.
        loaded: The names the model's ``load_weights`` reported (runtime names), sorted.
        replayed: Sparse patches applied by route replay, in O(nnz), without the loader.
        through_loader: Patches loaded through ``load_weights``.
        loader_calls: Calls of the model's ``load_weights``.
        milliseconds: Time spent in the worker, decoding included.
        version: The worker's weight version afterwards.
        atomic: Whether the update was atomic (asked for, or forced because the model has
            weights the engine transformed).
        protected: How many parameters were refused as transformed by the engine.
        repacked: How many layers vLLM's CPU backend prepacked were repacked after the
            update (their post-load step run again on the layers it wrote).

    Examples:
        >>> from patchctx.vllm import PatchStats
        >>> stats = PatchStats.from_worker({
        ...     "rank": 0, "ok": True, "names": ["lm_head.weight"], "loaded": ["lm_head.weight"],
        ...     "replayed": 1, "through_loader": 0, "loader_calls": 0, "milliseconds": 0.4,
        ...     "version": 7, "atomic": False, "protected": 0})
        >>> stats.replayed, stats.version
        (1, 7)
    """

    rank: int
    names: tuple[str, ...]
    loaded: tuple[str, ...]
    replayed: int
    through_loader: int
    loader_calls: int
    milliseconds: float
    version: str | int | None
    atomic: bool
    protected: int
    repacked: int = 0

    @classmethod
    def from_worker(cls, result: Mapping[str, Any]) -> PatchStats:
        """Build from the dict a worker's ``patchctx_apply_patches`` returned."""
        return cls(
            rank=int(result["rank"]),
            names=tuple(result["names"]),
            loaded=tuple(result["loaded"]),
            replayed=int(result["replayed"]),
            through_loader=int(result["through_loader"]),
            loader_calls=int(result["loader_calls"]),
            milliseconds=float(result["milliseconds"]),
            version=result["version"],
            atomic=bool(result["atomic"]),
            protected=int(result["protected"]),
            repacked=int(result.get("repacked", 0)),
        )


def _raise_failures(results: list[Mapping[str, Any]]) -> None:
    failed = [r for r in results if not r.get("ok")]
    if not failed:
        return
    first = failed[0]
    error = first["error"]
    cls = _ERRORS.get(str(error.get("type")), PatchError)
    succeeded = [r["rank"] for r in results if r.get("ok")]
    message = f"worker rank {first['rank']}: {error.get('message')}"
    if len(failed) > 1:
        message += f" (ranks {[r['rank'] for r in failed]} failed)"
    if succeeded:
        message += (
            f"; ranks {succeeded} applied the patches: the workers now differ, reload the "
            "weights or resend a full update"
        )
    if cls is WeightVersionError:
        raise WeightVersionError(message, expected=error.get("expected"), found=error.get("found"))
    raise cls(message)


def apply_patches(
    llm: Any,
    patches: Iterable[CheckpointWeightPatch],
    *,
    base_version: str | int | None = None,
    target_version: str | int | None = None,
    atomic: bool = False,
    max_chunk_bytes: int | None = None,
    validate_unique_indices: bool = True,
) -> list[PatchStats]:
    """Apply patches to every worker of a ``vllm.LLM`` started with `PatchWorkerExtension`.

    Encodes the patches once (`encode_patches`), sends them with
    ``llm.collective_rpc("patchctx_apply_patches", ...)``, and returns each worker's
    statistics. Each worker applies them to its own shard of the model with
    `load_checkpoint_weight_patches` (its own `RouteCache`, tied aliases, transformed weights
    refused), after checking `base_version` against its weight version.

    Args:
        llm: The engine (``vllm.LLM``), started with
            ``worker_extension_cls="patchctx.vllm.PatchWorkerExtension"`` (or a subclass).
        patches: `CheckpointWeightPatch` objects.
        base_version: The weight version the patches were computed against; workers holding
            another version refuse them before any write. `None` skips the check.
        target_version: The version the workers hold afterwards (`None`: unknown).
        atomic: Undo every write of a worker whose update fails. Forced on a worker whose
            model has weights the engine transformed after loading.
        max_chunk_bytes: Staged bytes per ``load_weights`` call (default 512 MiB).
        validate_unique_indices: Reject duplicate indices within one patch.

    Returns:
        One `PatchStats` per worker, in rank order.

    Raises:
        WeightVersionError: A worker holds another version than `base_version`; nothing was
            written on it. Also raised when the workers end at different versions.
        InvalidPatchError: A patch is invalid; nothing was written.
        LoaderContractError: A patch would reach a weight the engine transformed, or a write
            patchctx cannot mask; with ``atomic`` (or on such engines) nothing was written.
        PatchError: The same classes, raised on any worker, carry the worker's rank; when
            some workers succeeded and others failed, the message says which.

    Examples:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import PatchWorkerExtension, apply_patches
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bias = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.bias.copy_(tensor)
        ...         return {"bias"}
        >>> class OneWorkerLLM:  # what apply_patches uses of vllm.LLM
        ...     def __init__(self):
        ...         model, self.worker = Model(), PatchWorkerExtension()
        ...         self.worker.model_runner = SimpleNamespace(get_model=lambda: model)
        ...     def collective_rpc(self, method, args=()):
        ...         return [getattr(self.worker, method)(*args)]
        >>> llm = OneWorkerLLM()
        >>> patch = CheckpointWeightPatch("bias", (3,), torch.float32, torch.ones(3))
        >>> [stats] = apply_patches(llm, [patch], target_version="step-1")
        >>> stats.names, stats.replayed, stats.loader_calls, stats.version  # a learnt route
        (('bias',), 1, 0, 'step-1')
    """
    payload = encode_patches(patches, base_version=base_version, target_version=target_version)
    options = {
        "atomic": atomic,
        "max_chunk_bytes": max_chunk_bytes,
        "validate_unique_indices": validate_unique_indices,
        "errors": "return",
    }
    results = list(llm.collective_rpc(APPLY_METHOD, args=(payload, options)))
    _raise_failures(results)
    stats = [PatchStats.from_worker(result) for result in results]
    versions = {repr(s.version) for s in stats}
    if len(versions) > 1:
        raise WeightVersionError(
            f"the workers ended at different weight versions: "
            f"{[(s.rank, s.version) for s in stats]}"
        )
    return sorted(stats, key=lambda s: s.rank)


def set_weight_version(llm: Any, version: str | int | None) -> None:
    """Declare the weight version every worker of `llm` holds (e.g. right after start-up).

    A worker starts with an unknown version (`None`) and refuses patches that name a
    ``base_version`` until it is declared, or until an update names a ``target_version``.

    Args:
        llm: The engine, started with `PatchWorkerExtension`.
        version: A string, an integer, or `None` (unknown).

    Examples:
        >>> from types import SimpleNamespace
        >>> from patchctx.vllm import PatchWorkerExtension, set_weight_version
        >>> worker = PatchWorkerExtension()
        >>> llm = SimpleNamespace(
        ...     collective_rpc=lambda method, args=(): [getattr(worker, method)(*args)])
        >>> set_weight_version(llm, "step-0")
        >>> worker.patchctx_weight_version()
        'step-0'
    """
    llm.collective_rpc(SET_VERSION_METHOD, args=(version,))
