"""Patches while vLLM's layerwise reload is under way: dense ones, handed to it as they are."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from patchctx import CheckpointWeightPatch, InvalidPatchError, PatchProblem, validate_patches
from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._walk import ModelWalk

__all__ = ["layerwise_reload_active", "layerwise_stats", "layerwise_weights"]


def layerwise_reload_active(model: torch.nn.Module, walk: ModelWalk | None = None) -> bool:
    """Whether vLLM's layerwise reload is under way on `model` (listed by `walk`, if given).

    Between ``initialize_layerwise_reload(model)`` and ``finalize_layerwise_reload``, vLLM
    has replaced the model's parameters by meta tensors and buffers what its loaders receive
    until a layer is complete; the live weights are back only after finalization.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM-internal
        return False
    modules = model.modules() if walk is None else (module for _, module in walk.modules)
    for module in modules:
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            return True
    return False


def layerwise_weights(
    model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]
) -> list[tuple[str, torch.Tensor]]:
    """Dense patches as the checkpoint tensors vLLM's layerwise reload takes; nothing written.

    The weights are meta tensors until ``finalize_layerwise_reload``: there is nothing to
    mask a sparse patch against, and vLLM's buffering loaders must see plain tensors. A
    dense patch is a full checkpoint tensor, so it goes to ``load_weights`` unchanged
    (tied aliases resolved); vLLM processes and places it at finalization. Sparse patches
    are refused (`InvalidPatchError`).
    """
    validate_patches(patches)
    sparse = [i for i, patch in enumerate(patches) if patch.indices is not None]
    if sparse:
        raise InvalidPatchError(
            [
                PatchProblem(
                    i,
                    patches[i].name,
                    "a sparse patch needs the live weights, and vLLM's layerwise reload "
                    "holds them as meta tensors until finalize_layerwise_reload: send it "
                    "after finalizing, or send the whole tensor; nothing was written",
                )
                for i in sparse
            ]
        )
    aliases = tied_aliases(model)
    return [(aliases.get(p.name, p.name), p.values.reshape(p.shape).to(p.dtype)) for p in patches]


def layerwise_stats(
    patches: Sequence[CheckpointWeightPatch], loaded: set[str], version: object, started: float
) -> dict[str, Any]:
    """`WorkerPatcher.apply`'s statistics of a load into vLLM's layerwise reload."""
    return {
        "ok": True,
        "names": sorted({patch.name for patch in patches}),
        "loaded": sorted(loaded),
        "replayed": 0,
        "through_loader": len(patches),
        "loader_calls": 1,
        "milliseconds": (time.perf_counter() - started) * 1000.0,
        "version": version,
        "atomic": False,
        "protected": 0,
    }
