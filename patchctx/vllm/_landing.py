"""Proof of landing: what an update wrote, read back through the routes it replayed by."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy
import torch

from patchctx import CheckpointWeightPatch, PatchError, RouteCache
from patchctx._bits import bit_view
from patchctx._geometry import Segment
from patchctx._model import SupportsLoadWeights, model_tensors
from patchctx._routes import book_of
from patchctx._undo import storage_flat
from patchctx.vllm._aliases import tied_aliases

__all__ = ["read_back"]


def read_back(
    routes: RouteCache, model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]
) -> dict[str, int]:
    """Proof of landing: read back what each patch wrote, through its route, O(changed).

    For every patch whose name has a route in `routes` (learnt at start, by an earlier patch,
    or by this very call), the values at the storage positions the route maps its indices to
    (every element for a dense patch) must be the patch's values as ``copy_`` casts them
    into the weight, bit for bit. This sees what no guard does: a custom kernel, another
    process, a stale route. Raises `PatchError` naming the names that differ (the call is
    then undone when atomic).

    Returns:
        ``{"verified": patches read back, "elements": elements compared, "unverified":
        patches without a route (through the loader's masked path, checked by the guard)}``.
    """
    book = book_of(routes)
    aliases = tied_aliases(model)
    tensors = model_tensors(cast("SupportsLoadWeights", model))
    final: dict[str, CheckpointWeightPatch] = {}
    for patch in patches:  # the last patch to each name is checked: it is what stands
        final[aliases.get(patch.name, patch.name)] = patch
    differ: list[str] = []
    verified = elements = unverified = 0
    for name, patch in final.items():
        route = book.route(name)
        if route is None or not route.segments:
            unverified += 1
            continue
        values = patch.values.detach().reshape(-1).to(patch.dtype)
        if patch.indices is not None:
            indices = patch.indices.detach().to(device=values.device, dtype=torch.long)
            ordered = indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all())
        for segment in route.segments:
            live = tensors.get(segment.tensor_name)
            if live is None:
                differ.append(f"{patch.name!r} (its weight {segment.tensor_name!r} is gone)")
                break
            flat = storage_flat(live.detach().view(segment.dtype))
            if patch.indices is None:  # the segment's views themselves, as replay wrote
                got, want = _dense_views(segment, flat, values.to(live.device))
            else:
                found, picked = segment.positions(indices.to(live.device), sorted_unique=ordered)
                got = flat[found]
                want = values.to(live.device)[picked].to(segment.dtype)
            elements += int(got.numel())
            if not _same_bits(got, want):
                differ.append(f"{patch.name!r} (in {segment.tensor_name!r})")
                break
        else:
            verified += 1
    if differ:
        raise PatchError(
            "proof of landing failed: what the weights hold after the update is not what "
            "was sent, for " + ", ".join(differ) + " (a kernel, another process or a "
            "stale route wrote them); the update is undone"
        )
    return {"verified": verified, "elements": elements, "unverified": unverified}


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` and `want` hold the same bits.

    Contiguous CPU memory is compared by numpy, at about twice ``torch.equal``'s speed there.
    """
    got, want = bit_view(got), bit_view(want)
    if (
        got.device.type == want.device.type == "cpu"
        and got.is_contiguous()
        and want.is_contiguous()
        and got.dtype == want.dtype
    ):
        return bool(numpy.array_equal(got.numpy(), want.numpy()))
    return torch.equal(got, want)


def _dense_views(
    segment: Segment, flat: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight's view a dense patch's segment wrote, the patch's values it should hold).

    Strided views compared in place: a dense read-back reads each byte once, with no index
    of 8 bytes per element built, gathered through and thrown away.
    """
    there, here = segment.target, segment.source
    got = torch.as_strided(flat, there.size, there.stride, there.offset)
    values = values.contiguous()  # the source geometry is a contiguous tensor's
    start = values.storage_offset() + here.offset
    return got, torch.as_strided(values, here.size, here.stride, start).to(segment.dtype)
