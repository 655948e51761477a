"""Independent truths to compare patchctx with.

- `apply_densely`: the full checkpoint tensors with patches applied one by one, in input order.
- `vllm_semantics_load`: vLLM's documented algorithm for ``load_checkpoint_weight_patches``,
  written out in `benchmarks.baseline` (the benchmark's baseline when vLLM is not installed).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch

from benchmarks.baseline import nan_swap_load
from patchctx import CheckpointWeightPatch
from tests.support.models import ToyModel


def apply_densely(
    checkpoint: dict[str, torch.Tensor], patches: Iterable[CheckpointWeightPatch]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Apply patches to full tensors in input order; return the tensors and the touched names."""
    full = {name: tensor.clone() for name, tensor in checkpoint.items()}
    touched: list[str] = []
    for patch in patches:
        if patch.indices is None:
            full[patch.name] = patch.values.to(patch.dtype).reshape(patch.shape).clone()
        else:
            flat = full[patch.name].view(-1)
            flat[patch.indices.long()] = patch.values.to(patch.dtype)
        if patch.name not in touched:
            touched.append(patch.name)
    return full, touched


def reference_after(
    model: ToyModel, checkpoint: dict[str, torch.Tensor], patches: Sequence[CheckpointWeightPatch]
) -> ToyModel:
    """A copy of `model` (holding `checkpoint`) that loads the densely patched full tensors."""
    reference = copy.deepcopy(model)
    full, touched = apply_densely(checkpoint, patches)
    reference.load_weights([(name, full[name]) for name in touched])
    return reference


def vllm_semantics_load(
    model: ToyModel, patches: Sequence[CheckpointWeightPatch], max_chunk_bytes: int = 512 << 20
) -> set[str]:
    """vLLM's algorithm, written out (floats only; a call is all dense or all sparse)."""
    return nan_swap_load(model, patches, max_chunk_bytes)
