"""Patches in checkpoint coordinates, their dense reference, and the appliers under test.

`patchctx_load` applies patches through ``patchctx.vllm``'s worker extension (the payload
codec, a per-model `RouteCache`, tied aliases, transformed weights refused) on a model the
tests built; `patchctx_layer_load` is ``patchctx.load_checkpoint_weight_patches`` with a
`RouteCache` for the one-layer harnesses. The independent truths they are compared with:
`apply_to_checkpoint` (the dense reference, loaded through the model's own loader), vLLM's own
``load_checkpoint_weight_patches`` (`vllm_load`), and `masked_load` (the foundation: each
sparse patch staged by `NaNMask` and loaded inside `masked_copy`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    NaNMask,
    RouteCache,
    SupportsLoadWeights,
    load_checkpoint_weight_patches,
    masked_copy,
)
from patchctx.vllm import PatchWorkerExtension, encode_patches

# The tests build patchctx's own patches (vLLM's NamedTuple has the same fields).
Patch = CheckpointWeightPatch


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
    checkpoint: Mapping[str, torch.Tensor],
    patches: Iterable[Patch],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """The dense reference: the checkpoint with every patch applied in order (a patch named
    after an alias, e.g. a tied ``lm_head.weight``, applies to its canonical tensor)."""
    patched = {name: t.clone() for name, t in checkpoint.items()}
    for patch in patches:
        target = patched[(aliases or {}).get(patch.name, patch.name)]
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


def vllm_load(
    model: nn.Module, patches: Sequence[Patch], aliases: Mapping[str, str] | None = None
) -> set[str]:
    """Apply `patches` in order with vLLM's ``load_checkpoint_weight_patches`` (one call per
    run of dense or sparse patches: it refuses to mix them). `aliases` renames patches first,
    as a caller of vLLM's function must for a tied ``lm_head.weight``."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    renamed = [p._replace(name=(aliases or {}).get(p.name, p.name)) for p in patches]
    loaded: set[str] = set()
    try:
        for _, run in itertools.groupby(renamed, key=lambda p: p.indices is None):
            batch = [CheckpointWeightPatch(*p) for p in run]
            loaded |= set(load_checkpoint_weight_patches(model, batch))
    finally:
        _restore_plain_copy()
    return loaded


class ModelWorker(PatchWorkerExtension):
    """``patchctx.vllm``'s worker extension around a model the tests built (no engine): what a
    vLLM worker with ``worker_extension_cls="patchctx.vllm.PatchWorkerExtension"`` runs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.model_runner = self

    def get_model(self) -> nn.Module:
        return self.model


def patchctx_load(worker: ModelWorker, patches: Sequence[Patch], **options: Any) -> dict[str, Any]:
    """Apply `patches` through the worker extension (encoded, as collective_rpc sends them)."""
    return worker.patchctx_apply_patches(encode_patches(patches), options)


def patchctx_layer_load(
    model: SupportsLoadWeights, patches: Sequence[Patch], routes: RouteCache
) -> set[str]:
    """Apply `patches` to a one-layer harness with patchctx's loader and a `RouteCache`."""
    return load_checkpoint_weight_patches(model, patches, routes=routes)


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
