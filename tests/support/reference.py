"""Independent truths to compare patchctx with.

- `apply_densely`: the full checkpoint tensors with patches applied one by one, in input order.
- `vllm_semantics_load`: vLLM's documented algorithm for ``load_checkpoint_weight_patches``,
  written out here from its description (stage NaN, swap ``Tensor.copy_`` process-wide for a
  NaN-keeping ``where``, call ``load_weights``; flush a chunk when the byte target would be
  exceeded or a name repeats). Used only as a reference in tests.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence

import torch

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
    """The reference algorithm (floats only; a call is all dense or all sparse)."""
    sparse = any(p.indices is not None for p in patches)
    names: set[str] = set()
    chunk: list[tuple[str, torch.Tensor]] = []
    chunk_bytes = 0

    def flush() -> None:
        nonlocal chunk, chunk_bytes
        if chunk:
            names.update(_nan_keeping_load(model, chunk) if sparse else model.load_weights(chunk))
        chunk, chunk_bytes = [], 0

    for patch in patches:
        numel = math.prod(patch.shape)
        size = numel * torch.empty((), dtype=patch.dtype).element_size()
        if chunk and (chunk_bytes + size > max_chunk_bytes or patch.name in {n for n, _ in chunk}):
            flush()
        if patch.indices is None:
            tensor = patch.values.to(patch.dtype).view(patch.shape)
        else:
            flat = torch.full((numel,), float("nan"), dtype=patch.dtype)
            flat[patch.indices.long()] = patch.values.to(patch.dtype)
            tensor = flat.view(patch.shape)
        chunk.append((patch.name, tensor))
        chunk_bytes += size
    flush()
    return names


def _nan_keeping_load(model: ToyModel, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
    saved = torch.Tensor.copy_

    def keep_nan_positions(
        destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False
    ) -> torch.Tensor:
        if destination.shape != source.shape:
            raise NotImplementedError("reference: same-shaped copies only")
        source = source.to(device=destination.device, dtype=destination.dtype)
        return torch.where(torch.isnan(source), destination, source, out=destination)

    setattr(torch.Tensor, "copy_", keep_nan_positions)  # noqa: B010
    try:
        return model.load_weights(weights)
    finally:
        if "copy_" in torch.Tensor.__dict__ and saved is torch._C.TensorBase.copy_:
            delattr(torch.Tensor, "copy_")
        else:  # pragma: no cover - someone else had replaced it before
            setattr(torch.Tensor, "copy_", saved)  # noqa: B010
