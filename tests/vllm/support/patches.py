"""Patches in checkpoint coordinates, their dense reference, and the appliers under test.

`load_patches` is the one place that applies a list of patches to a model with a finished
patch applier. Until ``patchctx.load_checkpoint_weight_patches`` lands it calls vLLM's own
function (one call per run of dense or sparse patches, since vLLM refuses to mix them); the
switch is one line. `masked_load` is the foundation path: each sparse patch is staged by
`NaNMask` and loaded through the model's ``load_weights`` inside `masked_copy`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from patchctx import NaNMask, masked_copy


class Patch(NamedTuple):
    """Field-compatible with vLLM's (and patchctx's) ``CheckpointWeightPatch``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


def random_tensor(shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float32) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator).to(dtype)


def random_checkpoint(
    specs: Mapping[str, tuple[int, ...]], seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A full checkpoint of random tensors, one per name (deterministic in `seed`)."""
    return {
        name: random_tensor(shape, seed * 1009 + i, dtype)
        for i, (name, shape) in enumerate(sorted(specs.items()))
    }


def sparse(
    name: str,
    shape: tuple[int, ...],
    *,
    density: float,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Patch:
    """A sparse patch at `density`, always touching the first and the last element."""
    numel = math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    count = max(2, round(numel * density))
    chosen = torch.randperm(numel, generator=generator)[:count]
    indices = torch.unique(torch.cat([torch.tensor([0, numel - 1]), chosen]))
    indices = indices[torch.randperm(indices.numel(), generator=generator)]
    values = torch.randn(indices.numel(), generator=generator).to(dtype)
    return Patch(name, shape, dtype, values, indices)


def dense(
    name: str, shape: tuple[int, ...], *, seed: int, dtype: torch.dtype = torch.float32
) -> Patch:
    """A dense patch: a full replacement of the tensor."""
    return Patch(name, shape, dtype, random_tensor((math.prod(shape),), seed, dtype))


def apply_to_checkpoint(
    checkpoint: Mapping[str, torch.Tensor], patches: Iterable[Patch]
) -> dict[str, torch.Tensor]:
    """The dense reference: the checkpoint with every patch applied in order."""
    patched = {name: t.clone() for name, t in checkpoint.items()}
    for patch in patches:
        target = patched[patch.name]
        if patch.indices is None:
            target.copy_(patch.values.view(patch.shape))
        else:
            target.view(-1)[patch.indices.long()] = patch.values.to(target.dtype)
    return patched


def _restore_plain_copy() -> None:
    # vLLM's function restores copy_ by assigning the built-in to torch.Tensor, which leaves an
    # entry in Tensor.__dict__ that shadows the inherited one; drop it again.
    entry = torch.Tensor.__dict__.get("copy_")
    if entry is not None and entry is torch._C.TensorBase.__dict__.get("copy_"):
        delattr(torch.Tensor, "copy_")


def vllm_load(model: nn.Module, patches: Sequence[Patch]) -> set[str]:
    """Apply `patches` in order with vLLM's ``load_checkpoint_weight_patches``."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    loaded: set[str] = set()
    try:
        for _, run in itertools.groupby(patches, key=lambda p: p.indices is None):
            batch = [CheckpointWeightPatch(*p) for p in run]
            loaded |= set(load_checkpoint_weight_patches(model, batch))
    finally:
        _restore_plain_copy()
    return loaded


def load_patches(model: nn.Module, patches: Sequence[Patch]) -> set[str]:
    """The patch applier under test (vLLM's until patchctx's loader lands: switch here)."""
    return vllm_load(model, patches)


def masked_load(model: Any, patches: Iterable[Patch]) -> set[str]:
    """Apply each patch with one ``load_weights`` call: sparse ones staged by NaNMask."""
    loaded: set[str] = set()
    strategy = NaNMask()
    for patch in patches:
        if patch.indices is None:
            names = model.load_weights([(patch.name, patch.values.view(patch.shape))])
        else:
            staged = strategy.stage(patch.shape, patch.dtype, patch.indices, patch.values)
            with masked_copy(strategy=strategy):
                names = model.load_weights([(patch.name, staged)])
        loaded |= set(names or ())
    return loaded
