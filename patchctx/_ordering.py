"""Ordering policies: in which order, and how grouped, patches reach the loader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from patchctx._errors import InvalidPatchError, PatchProblem
from patchctx._patch import CheckedPatch, CheckpointWeightPatch, merged, patch_of
from patchctx._strategies import indexable, scatter_flat

__all__ = ["Coalesce", "InputOrder", "OrderingPolicy"]


@runtime_checkable
class OrderingPolicy(Protocol):
    """Turns the validated patches into the sequence that is staged and loaded.

    It receives `CheckedPatch` objects, in input order, and returns the sequence to load:
    checked patches it received (reordered, or some left out) and new `CheckpointWeightPatch`
    objects it built (a merge, say), which are validated like input before any write. The
    result must leave every weight as applying the input patches one by one, in input order,
    would. The loader then chunks the sequence, never putting one name twice into one loader
    call.

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

    def order(
        self, patches: Sequence[CheckedPatch]
    ) -> Sequence[CheckedPatch | CheckpointWeightPatch]:
        """Return the patches to load, in loading order."""
        ...


@dataclass(frozen=True, slots=True)
class InputOrder:
    """Patches load in input order; a repeated name starts a new loader call (vLLM's semantics).

    Dense and sparse patches go in separate loader calls (as in vLLM), so input that alternates
    between them makes one call per run; `Coalesce` groups them.

    Examples:
        >>> import torch
        >>> from patchctx import Auto, CheckpointWeightPatch, InputOrder
        >>> from patchctx._patch import check_patches
        >>> a = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))
        >>> [p.name for p in InputOrder().order(check_patches([a, a], strategy=Auto()))]
        ['w', 'w']
    """

    def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
        return list(patches)


@dataclass(frozen=True, slots=True)
class Coalesce:
    """One patch per name, dense ones first: the fewest loader calls for a batch of patches.

    All patches to one name merge into one before staging, the later value winning. A dense
    patch followed by sparse ones becomes one dense patch; sparse patches alone become one
    sparse patch with sorted, unique indices. Then the dense patches go first and the sparse
    ones after, each in the order their names first appeared: since dense and sparse patches
    never share a loader call, an update that alternates between them (a trainer's diff, where
    biases and norms go dense and matrices sparse) makes two loader calls instead of one per
    run. The final weights equal those of `InputOrder` (patches to different names touch
    different parameters); merging costs O(total nnz log nnz), or one copy of the tensor when a
    dense patch is involved.

    Examples:
        >>> import torch
        >>> from patchctx import Auto, CheckpointWeightPatch, Coalesce
        >>> from patchctx._patch import check_patches
        >>> first = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([1.0, 2.0]),
        ...                               torch.tensor([0, 3]))
        >>> bias = CheckpointWeightPatch("b", (2,), torch.float32, torch.tensor([0.5, 0.5]))
        >>> later = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([9.0]),
        ...                               torch.tensor([3]))
        >>> merged = Coalesce().order(check_patches([first, bias, later], strategy=Auto()))
        >>> [(p.name, p.sparse) for p in merged]
        [('b', False), ('w', True)]
        >>> merged[1].patch.indices.tolist(), merged[1].patch.values.tolist()
        ([0, 3], [1.0, 9.0])
    """

    def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
        groups: dict[str, list[CheckedPatch]] = {}
        for item in patches:
            groups.setdefault(item.name, []).append(item)
        merged = [_merge(group) for group in groups.values()]
        return [item for item in merged if not item.sparse] + [
            item for item in merged if item.sparse
        ]


def _merge(checked: list[CheckedPatch]) -> CheckedPatch:
    if len(checked) == 1:
        return checked[0]
    group = [patch_of(item) for item in checked]
    first, numel = group[0], checked[0].numel
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
            if patch.indices is not None:
                scatter_flat(flat, patch.indices, patch.values.to(device=device, dtype=base.dtype))
        return merged(base._replace(values=flat, indices=None), numel)
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
    # Merged from validated patches: in range, sorted and unique by construction.
    joined = first._replace(values=values.view(first.dtype), indices=indices)
    return merged(joined, numel, sorted_unique=True)
