"""The baseline: vLLM's ``load_checkpoint_weight_patches``, or its algorithm written out.

The algorithm, from vLLM's documentation of it: every sparse patch is staged as a full
checkpoint-shaped tensor filled with NaN except at the changed positions; loader calls are
batched up to a byte target (a repeated name starts a new call); while a sparse batch loads,
``torch.Tensor.copy_`` is replaced process-wide by a copy that keeps the destination wherever
the source is NaN. Used as the side-by-side baseline of the benchmark when vLLM is not
installed, and as an independent truth in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

PatchLoader = Callable[..., set[str]]


def vllm_function() -> PatchLoader | None:
    """vLLM's own function when vLLM is importable, else `None`."""
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            load_checkpoint_weight_patches,
        )
    except Exception:  # not installed, or installed without a working backend
        return None
    return load_checkpoint_weight_patches  # type: ignore[no-any-return]


def nan_swap_load(model: Any, patches: Sequence[Any], max_chunk_bytes: int = 512 << 20) -> set[str]:
    """The baseline algorithm (floating dtypes; a call is all dense or all sparse)."""
    sparse = any(p.indices is not None for p in patches)
    names: set[str] = set()
    batch: list[tuple[str, torch.Tensor]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            reported = _swapped_load(model, batch) if sparse else model.load_weights(batch)
            names.update(reported or ())
        batch, batch_bytes = [], 0

    for patch in patches:
        numel = math.prod(patch.shape)
        size = numel * torch.empty((), dtype=patch.dtype).element_size()
        if batch and (batch_bytes + size > max_chunk_bytes or patch.name in {n for n, _ in batch}):
            flush()
        if patch.indices is None:
            tensor = patch.values.to(patch.dtype).view(patch.shape)
        else:
            flat = torch.full((numel,), float("nan"), dtype=patch.dtype, device=patch.values.device)
            flat.index_copy_(0, patch.indices.long(), patch.values.to(patch.dtype))
            tensor = flat.view(patch.shape)
        batch.append((patch.name, tensor))
        batch_bytes += size
    flush()
    return names


def _swapped_load(model: Any, weights: list[tuple[str, torch.Tensor]]) -> Any:
    saved = torch.Tensor.__dict__.get("copy_")
    builtin = torch.Tensor.copy_

    def keep_where_nan(
        destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False
    ) -> torch.Tensor:
        if destination.shape != source.shape:
            raise NotImplementedError("baseline: same-shaped floating copies only")
        source = source.to(device=destination.device, dtype=destination.dtype)
        return torch.where(torch.isnan(source), destination, source, out=destination)

    setattr(torch.Tensor, "copy_", keep_where_nan)  # noqa: B010 - the process-wide swap
    try:
        return model.load_weights(weights)
    finally:
        if saved is None:
            delattr(torch.Tensor, "copy_")
        else:
            setattr(torch.Tensor, "copy_", saved)  # noqa: B010
        assert torch.Tensor.copy_ is builtin or saved is not None
