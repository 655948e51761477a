"""Ordering policies: in which order, and how grouped, patches reach the loader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from patchctx._errors import InvalidPatchError, PatchProblem
from patchctx._patch import CheckpointWeightPatch
from patchctx._strategies import indexable, scatter_flat

__all__ = ["Coalesce", "InputOrder", "OrderingPolicy"]


@runtime_checkable
class OrderingPolicy(Protocol):
    """Turns the validated patches into the sequence that is staged and loaded.

    The result must leave every weight as applying the input patches one by one, in input
    order, would. The loader then chunks the sequence, never putting one name twice into one
    loader call.

    Examples:
        A policy of your own: group by layer for locality (patches to different names touch
        different parameters, so reordering across names keeps the result).

        >>> from patchctx import OrderingPolicy
        >>> class ByName:
        ...     def order(self, patches):
        ...         return sorted(patches, key=lambda patch: patch.name)
        >>> isinstance(ByName(), OrderingPolicy)
        True
    """

    def order(self, patches: Sequence[CheckpointWeightPatch]) -> Sequence[CheckpointWeightPatch]:
        """Return the patches to load, in loading order."""
        ...


@dataclass(frozen=True, slots=True)
class InputOrder:
    """Patches load in input order; a repeated name starts a new loader call (vLLM's semantics).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, InputOrder
        >>> a = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))
        >>> [p.name for p in InputOrder().order([a, a])]
        ['w', 'w']
    """

    def order(self, patches: Sequence[CheckpointWeightPatch]) -> list[CheckpointWeightPatch]:
        return list(patches)


@dataclass(frozen=True, slots=True)
class Coalesce:
    """All patches to one name merge into one before staging: later wins, one loader call per name.

    The merged patch sits where the name first appeared. A dense patch followed by sparse ones
    becomes one dense patch; sparse patches alone become one sparse patch with sorted, unique
    indices. The final weights equal those of `InputOrder`, with fewer staged tensors and loader
    calls; merging costs O(total nnz log nnz), or one copy of the tensor when a dense patch is
    involved.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, Coalesce
        >>> first = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([1.0, 2.0]),
        ...                               torch.tensor([0, 3]))
        >>> later = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([9.0]),
        ...                               torch.tensor([3]))
        >>> (merged,) = Coalesce().order([first, later])
        >>> merged.indices.tolist(), merged.values.tolist()
        ([0, 3], [1.0, 9.0])
    """

    def order(self, patches: Sequence[CheckpointWeightPatch]) -> list[CheckpointWeightPatch]:
        groups: dict[str, list[CheckpointWeightPatch]] = {}
        for patch in patches:
            groups.setdefault(patch.name, []).append(patch)
        return [_merge(group) for group in groups.values()]


def _merge(group: list[CheckpointWeightPatch]) -> CheckpointWeightPatch:
    first = group[0]
    if len(group) == 1:
        return first
    for other in group[1:]:
        if tuple(other.shape) != tuple(first.shape) or other.dtype != first.dtype:
            raise InvalidPatchError(
                [
                    PatchProblem(
                        None,
                        first.name,
                        f"Coalesce: patches to {first.name!r} disagree on the tensor: shape "
                        f"{tuple(first.shape)!r} {first.dtype} vs {tuple(other.shape)!r} "
                        f"{other.dtype}; use InputOrder() to load them one by one",
                    )
                ]
            )
    device = first.values.device
    last_dense = max((k for k, p in enumerate(group) if p.indices is None), default=None)
    if last_dense is not None:
        base = group[last_dense]
        flat = base.values.to(device=device, dtype=base.dtype).clone()
        for patch in group[last_dense + 1 :]:
            assert patch.indices is not None
            scatter_flat(flat, patch.indices, patch.values.to(device=device, dtype=base.dtype))
        return base._replace(values=flat, indices=None)
    indices = torch.cat(
        [p.indices.to(device=device, dtype=torch.long) for p in group if p.indices is not None]
    )
    values = torch.cat([indexable(p.values.to(device=device, dtype=first.dtype)) for p in group])
    order = torch.argsort(indices, stable=True)
    indices, values = indices[order], values[order]
    if indices.numel():
        last_of_run = torch.ones_like(indices, dtype=torch.bool)
        last_of_run[:-1] = indices[1:] != indices[:-1]
        indices, values = indices[last_of_run], values[last_of_run]
    return first._replace(values=values.view(first.dtype), indices=indices)
