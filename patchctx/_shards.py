"""Sharded trainer state: one rank's box of a global tensor, and its global flat indices.

A rank of a sharded trainer (FSDP2, tensor parallel, any sharder) holds, for each weight, a
*box*: the elements ``[offsets[d], offsets[d] + local.shape[d])`` along every dimension ``d``
of a tensor of ``global_shape``. `diff_state_dicts` diffs the box and writes the changes with
the **global** flat row-major indices of the full checkpoint tensor, so the patch shards of all
ranks together are the patch of the whole tensor, and no rank ever holds more than its box.

`TensorShard` is the plain form any sharder can produce; a `torch.distributed` `DTensor` with
`Shard` and `Replicate` placements is turned into one here (the rank's box by the chunking
rule of `torch.chunk`, which `distribute_tensor` and FSDP2 use; replicas are emitted by the
rank at coordinate 0 of every replicated mesh dimension only). Other placements (``Partial``,
strided shards) are refused: their local values are not a box of the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorShard", "global_indices", "local_box"]


@dataclass(frozen=True, slots=True)
class TensorShard:
    """One rank's box of a global tensor: the plain sharded form `diff_state_dicts` takes.

    Attributes:
        local: The rank's elements, of shape ``(len_0, len_1, ...)``.
        global_shape: The shape of the whole checkpoint tensor.
        offsets: Where the box starts along each dimension of the global tensor.

    Examples:
        >>> import torch
        >>> from patchctx import TensorShard
        >>> full = torch.arange(12.0).reshape(3, 4)
        >>> shard = TensorShard(full[1:, 2:], (3, 4), (1, 2))  # rows 1-2, columns 2-3
        >>> shard.local.tolist()
        [[6.0, 7.0], [10.0, 11.0]]
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def problem(self) -> str | None:
        """Why this is not a box of its global shape (`None` when it is)."""
        if not isinstance(self.local, torch.Tensor):
            return f"TensorShard.local must be a torch.Tensor, got {type(self.local).__name__}"
        shape, offsets = tuple(self.global_shape), tuple(self.offsets)
        if not all(isinstance(v, int) and v >= 0 for v in (*shape, *offsets)):
            return f"global_shape {shape!r} and offsets {offsets!r} must be non-negative ints"
        if not (len(shape) == len(offsets) == self.local.ndim):
            return (
                f"global_shape {shape!r}, offsets {offsets!r} and the local shape "
                f"{tuple(self.local.shape)} must have one entry per dimension"
            )
        for start, length, size in zip(offsets, self.local.shape, shape, strict=True):
            if start + length > size:
                return (
                    f"the box at offsets {offsets!r} of local shape {tuple(self.local.shape)} "
                    f"reaches past global_shape {shape!r}"
                )
        return None


def _placements(tensor: Any) -> tuple[Any, Any] | None:
    """``(device_mesh, placements)`` of a DTensor; `None` for any other tensor."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return tensor.device_mesh, tensor.placements


def local_box(value: object) -> TensorShard | str | None:
    """`value` as this rank's box: a `TensorShard`, or the reason it cannot be one.

    Returns `None` for a tensor that is not sharded, and a `TensorShard` with an empty local
    tensor for a replica this rank does not emit.
    """
    if isinstance(value, TensorShard):
        return value.problem() or value
    found = _placements(value)
    if found is None:
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = found
    assert isinstance(value, torch.Tensor)
    coordinate = mesh.get_coordinate()
    local = value.to_local()  # type: ignore[attr-defined]
    shape = tuple(int(d) for d in value.shape)
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return TensorShard(local.new_empty((0,) * len(shape)), shape, (0,) * len(shape))
    offsets, sizes = [0] * len(shape), list(shape)
    emit = True
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            emit = emit and coordinate[mesh_dim] == 0
            continue
        if type(placement) is not Shard:
            return (
                f"a DTensor placed {placement!r} is not a box of the weights; diff Shard and "
                "Replicate placements (redistribute it first), or pass a TensorShard"
            )
        dim, parts, at = placement.dim, mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-sizes[dim] // parts) if sizes[dim] else 0
        start = min(at * chunk, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(chunk, sizes[dim] - start))
    if tuple(local.shape) != tuple(sizes):
        return (
            f"the DTensor's local shape {tuple(local.shape)} is not the box {tuple(sizes)} "
            f"that its placements {placements!r} give; pass a TensorShard"
        )
    if not emit:  # a replica another rank emits
        return TensorShard(local.new_empty((0,) * len(shape)), shape, (0,) * len(shape))
    return TensorShard(local, shape, tuple(offsets))


def global_indices(local_flat: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """Global flat row-major indices of flat positions `local_flat` of `shard.local`.

    Sorted local positions give sorted global ones (a box keeps row-major order). The result
    is int32 when the global tensor has fewer than 2**31 elements, else int64.

    Examples:
        >>> import torch
        >>> from patchctx import TensorShard
        >>> from patchctx._shards import global_indices
        >>> shard = TensorShard(torch.zeros(2, 2), (3, 4), (1, 2))
        >>> global_indices(torch.tensor([0, 1, 2, 3]), shard).tolist()
        [6, 7, 10, 11]
    """
    numel = math.prod(shard.global_shape)
    out_dtype = torch.int32 if numel < 2**31 else torch.int64
    flat = local_flat.reshape(-1).to(torch.int64)
    shape, offsets = shard.local.shape, shard.offsets
    ndim = len(shape)
    # The box's trailing dimensions that span the whole global tensor move together.
    whole = ndim
    while (
        whole > 0 and offsets[whole - 1] == 0 and shape[whole - 1] == shard.global_shape[whole - 1]
    ):
        whole -= 1
    inner = math.prod(shard.global_shape[whole:])
    if whole == 0:
        return flat.to(out_dtype)
    strides = [math.prod(shard.global_shape[d + 1 :]) for d in range(ndim)]
    out = torch.zeros_like(flat)
    rest = flat
    if whole < ndim:
        out += rest % inner
        rest = rest // inner
    for dim in reversed(range(whole)):
        length = shape[dim]
        coordinate = rest % length if dim else rest
        out += (coordinate + offsets[dim]) * strides[dim]
        if dim:
            rest = rest // length
    return out.to(out_dtype)
