"""Checked by mypy, never run: user-written policies and strategies satisfy the protocols."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import assert_type

from patchctx import (
    AuditReport,
    CheckedPatch,
    CheckpointWeightPatch,
    ChunkState,
    Coalesce,
    PerTensor,
    RouteCache,
    UpdateCost,
    WireEncoding,
    audit,
    diff_state_dicts,
    load_checkpoint_weight_patches,
    patch_nbytes,
    wire_encoding,
    wire_sizes,
)


class AtMostTwo:
    def split_before(self, chunk: ChunkState) -> bool:
        return chunk.count >= 2


class ByName:
    def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
        return sorted(patches, key=lambda patch: patch.name)


class MergesInto:
    """An ordering policy that builds new patches (patchctx validates them)."""

    def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch | CheckpointWeightPatch]:
        return [patches[0], patches[0].patch._replace(name="other")]


class WrongChunking:
    def split_before(self, chunk_nbytes: int, chunk_len: int, next_nbytes: int) -> bool:
        return False


class WrongOrdering:
    def order(self, patches: Sequence[CheckedPatch]) -> list[str]:
        return []


class Model(torch.nn.Module):
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


model = Model()
patches = [CheckpointWeightPatch("w", (2,), torch.float32, torch.zeros(2))]

assert_type(load_checkpoint_weight_patches(model, patches), set[str])
assert_type(
    load_checkpoint_weight_patches(
        model, patches, chunking=AtMostTwo(), ordering=ByName(), routes=RouteCache(), atomic=True
    ),
    set[str],
)
load_checkpoint_weight_patches(model, patches, chunking=PerTensor(), ordering=Coalesce())
load_checkpoint_weight_patches(model, patches, ordering=MergesInto())
load_checkpoint_weight_patches(model, patches, chunking=WrongChunking())  # type: ignore[arg-type]
load_checkpoint_weight_patches(model, patches, ordering=WrongOrdering())  # type: ignore[arg-type]
load_checkpoint_weight_patches(model, patches, ordering=AtMostTwo())  # type: ignore[arg-type]
load_checkpoint_weight_patches(model, patches, routes={})  # type: ignore[arg-type]
load_checkpoint_weight_patches(model, patches, 1024)  # type: ignore[call-arg]
assert_type(audit(model, [("w", (2,), torch.float32)]), AuditReport)
assert_type(ChunkState(1, 1, CheckedPatch._make(0, patches[0], 2), 8).next, CheckedPatch)
assert_type(diff_state_dicts({}, {}), list[CheckpointWeightPatch])
assert_type(patch_nbytes(patches), int)
assert_type(diff_state_dicts({}, {}, cost=UpdateCost()), list[CheckpointWeightPatch])
assert_type(UpdateCost.calibrate(numel=1024), UpdateCost)
assert_type(UpdateCost().sparse_seconds(10, 60), float)
assert_type(wire_sizes(patches[0]), dict[WireEncoding, int])
assert_type(wire_encoding(patches[0]), WireEncoding)
diff_state_dicts({}, {}, cost=1e9)  # type: ignore[arg-type]
UpdateCost(1e9)  # type: ignore[call-arg]
