"""Sharded trainers: each rank diffs its own box and writes patch shards with global indices.

Real ranks on gloo (2 and 4 processes, `DTensor`s placed by `distribute_tensor`, as FSDP2 and
tensor parallelism place them, and the plain `TensorShard` form): the union of every rank's
patch shards, saved as patch files and applied to one receiver, equals the dense truth bit for
bit, through the dense reference and through a real loader.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.spawn import spawn

from patchctx import (
    BoolMask,
    CheckpointWeightPatch,
    InvalidPatchError,
    TensorShard,
    diff_state_dicts,
    load_checkpoint_weight_patches,
    load_patches,
    save_patches,
)
from tests.support.models import same_bits
from tests.support.reference import apply_densely

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built"
)

# name -> (global shape, mesh shape, placements as (kind, dim) per mesh dimension)
CASES: dict[int, dict[str, tuple[tuple[int, ...], tuple[int, ...], list[tuple[str, int]]]]] = {
    2: {
        "rows": ((6, 8), (2,), [("shard", 0)]),
        "cols": ((6, 8), (2,), [("shard", 1)]),
        "uneven": ((5, 3), (2,), [("shard", 0)]),
        "replicated": ((4, 4), (2,), [("replicate", 0)]),
        "vector": ((7,), (2,), [("shard", 0)]),
        "cube": ((3, 4, 5), (2,), [("shard", 2)]),
    },
    4: {
        "grid": ((6, 8), (2, 2), [("shard", 0), ("shard", 1)]),
        "rep-rows": ((6, 8), (2, 2), [("replicate", 0), ("shard", 0)]),
        "nested": ((9, 4), (2, 2), [("shard", 0), ("shard", 0)]),
        "tiny": ((3, 2), (4,), [("shard", 0)]),
        "cube": ((4, 3, 6), (2, 2), [("shard", 2), ("shard", 0)]),
    },
}


def full_states(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fp32 master weights before and after a step (the same on every rank)."""
    generator = torch.Generator().manual_seed(world)
    old, new = {}, {}
    for name, (shape, _, _) in CASES[world].items():
        before = torch.randn(shape, generator=generator)
        after = before.clone()
        chosen = torch.rand(shape, generator=generator) < 0.3
        after[chosen] += torch.randn(shape, generator=generator)[chosen]
        after.view(-1)[0] += 1e-6  # rounds away in bf16: not a change there
        old[name], new[name] = before, after
    old["plain"] = torch.randn(6, 8, generator=generator)
    new["plain"] = old["plain"].clone()
    new["plain"][::2, 1::3] -= 1.0
    return old, new


def _rank(rank: int, world: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world
    )
    try:
        old_full, new_full = full_states(world)
        old: dict[str, Any] = {}
        new: dict[str, Any] = {}
        for name, (_, mesh_shape, kinds) in CASES[world].items():
            mesh = init_device_mesh("cpu", mesh_shape)
            placements = [Shard(dim) if kind == "shard" else Replicate() for kind, dim in kinds]
            old[name] = distribute_tensor(old_full[name], mesh, placements)
            new[name] = distribute_tensor(new_full[name], mesh, placements)
        # The plain form: rank r holds a column band of rows, as a sharder of its own would.
        columns = 8 // world
        box = (slice(None), slice(rank * columns, (rank + 1) * columns))
        old["plain"] = old_full["plain"][box].clone()  # what this rank sent: its box alone
        new["plain"] = TensorShard(new_full["plain"][box].clone(), (6, 8), (0, rank * columns))
        patches = diff_state_dicts(old, new, dtype=torch.bfloat16, cost=None)
        for patch in patches:
            assert patch.indices is not None or math.prod(patch.shape) == patch.values.numel()
        save_patches(f"{folder}/rank{rank}", patches)
    finally:
        torch.distributed.destroy_process_group()


class Receiver(nn.Module):
    """bf16 weights, one parameter per checkpoint name, loaded by a plain ``copy_``."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(weights)
        self.weights = nn.ParameterList(
            nn.Parameter(w.to(torch.bfloat16), requires_grad=False) for w in weights.values()
        )

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            self.weights[self.names.index(name)].copy_(tensor)
            loaded.add(name)
        return loaded


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_diffs_applied_together_equal_the_dense_truth(tmp_path: Path, world: int) -> None:
    spawn(_rank, args=(world, str(tmp_path)), nprocs=world)  # type: ignore[no-untyped-call]
    old_full, new_full = full_states(world)
    shards = [p for rank in range(world) for p in load_patches(tmp_path / f"rank{rank}")]
    for patch in shards:  # every shard is sparse, in global coordinates of the full tensor
        assert tuple(patch.shape) == tuple(new_full[patch.name].shape)
        assert patch.indices is not None
    truth = {name: t.to(torch.bfloat16) for name, t in new_full.items()}
    start = {name: t.to(torch.bfloat16) for name, t in old_full.items()}
    applied, _ = apply_densely(start, shards)
    for name in truth:
        assert same_bits(applied[name], truth[name]), name
    # Each element changed in bf16 is sent by exactly one rank (replicas once).
    changed = sum(int((start[n] != truth[n]).sum()) for n in truth)
    assert sum(p.values.numel() for p in shards) == changed
    receiver = Receiver(old_full)
    load_checkpoint_weight_patches(receiver, shards)
    for name, weight in zip(receiver.names, receiver.weights, strict=True):
        assert same_bits(weight.data, truth[name]), name


def test_a_box_that_changed_everywhere_goes_sparse_with_every_position() -> None:
    full_old = torch.zeros(4, 6)
    full_new = torch.arange(24.0).reshape(4, 6) + 1
    old = {"w": full_old[2:, :3].clone()}
    new = {"w": TensorShard(full_new[2:, :3].clone(), (4, 6), (2, 0))}
    (patch,) = diff_state_dicts(old, new)
    assert patch.indices is not None and patch.shape == (4, 6)
    assert patch.indices.tolist() == [12, 13, 14, 18, 19, 20]
    assert patch.values.tolist() == full_new.view(-1)[[12, 13, 14, 18, 19, 20]].tolist()
    whole = {"w": TensorShard(full_new.clone(), (4, 6), (0, 0))}
    (dense,) = diff_state_dicts({"w": full_old}, whole)
    assert dense.indices is None  # the box is the whole tensor: dense is allowed


def test_sharded_values_the_strategy_cannot_carry_are_refused_with_a_way_out() -> None:
    old = {"w": torch.zeros(2, 2)}
    value = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    new = {"w": TensorShard(value, (4, 2), (0, 0))}
    with pytest.raises(InvalidPatchError, match=r"strategy=BoolMask\(\)"):
        diff_state_dicts(old, new)
    (patch,) = diff_state_dicts(old, new, strategy=BoolMask())
    assert patch.indices is not None and patch.values.isnan().sum() == 1


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        (torch.zeros(2, 2), TensorShard(torch.zeros(2, 2), (3, 2), (2, 0)), "reaches past"),
        (torch.zeros(2, 2), TensorShard(torch.zeros(2, 2), (4,), (0,)), "one entry per"),
        (
            TensorShard(torch.zeros(2, 2), (4, 2), (0, 0)),
            TensorShard(torch.zeros(2, 2), (4, 2), (2, 0)),
            "different boxes",
        ),
        (TensorShard(torch.zeros(2, 2), (4, 2), (0, 0)), torch.zeros(2, 2), "old is sharded"),
        (torch.zeros(3, 2), TensorShard(torch.zeros(2, 2), (4, 2), (0, 0)), "shape differs"),
    ],
)
def test_inconsistent_shards_are_refused_before_any_work(old: Any, new: Any, match: str) -> None:
    with pytest.raises(InvalidPatchError, match=match):
        diff_state_dicts({"w": old}, {"w": new})


def test_shard_patches_are_checkpoint_patches() -> None:
    shard = TensorShard(torch.ones(2, 3), (2, 6), (0, 3))
    (patch,) = diff_state_dicts({"w": torch.zeros(2, 3)}, {"w": shard}, cost=None)
    assert isinstance(patch, CheckpointWeightPatch)
    assert patch.indices is not None and patch.indices.tolist() == [3, 4, 5, 9, 10, 11]
