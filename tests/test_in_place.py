"""In place: a patch load never reallocates a parameter's storage.

Every load path (dense, sparse through the loader, sparse by route replay, atomic or not, every
write path the guard masks) writes into the storage the model already had: the parameter
objects, their data pointers and their storage sizes are unchanged, and a view taken before the
call (what a captured CUDA graph holds) sees the new values.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches
from tests.support.models import (
    ToyModel,
    assert_same_state,
    packed_tp_model,
    random_checkpoint,
    state,
)
from tests.support.reference import reference_after
from tests.support.zoo import ZOO, Entry, check, sparse


def storages(model: nn.Module) -> dict[str, tuple[nn.Parameter | torch.Tensor, int, int]]:
    """Each parameter and buffer: the object, its storage's data pointer and its size."""
    return {
        name: (tensor, tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }


def assert_same_storages(
    before: dict[str, tuple[nn.Parameter | torch.Tensor, int, int]], model: nn.Module
) -> None:
    after = storages(model)
    assert after.keys() == before.keys()
    for name, (tensor, pointer, nbytes) in before.items():
        now, now_pointer, now_nbytes = after[name]
        assert now is tensor, f"{name}: the parameter object was replaced"
        assert (now_pointer, now_nbytes) == (pointer, nbytes), f"{name}: storage reallocated"


def patches_for(model: ToyModel, seed: int) -> list[CheckpointWeightPatch]:
    """A sparse patch to every checkpoint tensor and a dense one to the first."""
    specs = model.checkpoint_specs()
    generator = torch.Generator().manual_seed(seed)
    patches = []
    for name, spec in specs.items():
        numel = math.prod(spec.shape)
        indices = torch.randperm(numel, generator=generator)[: max(1, numel // 8)].sort().values
        values = torch.randn(indices.numel(), generator=generator).to(spec.dtype)
        patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, values, indices))
    name, spec = next(iter(specs.items()))
    dense = torch.randn(math.prod(spec.shape), generator=generator).to(spec.dtype)
    patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, dense))
    return patches


@pytest.mark.parametrize("atomic", [False, True])
def test_no_load_path_reallocates_a_storage(atomic: bool) -> None:
    model = packed_tp_model(tp_size=2, tp_rank=1)
    checkpoint = random_checkpoint(model.checkpoint_specs())
    model.load_weights(checkpoint.items())
    before = storages(model)
    captured = {name: tensor.detach().view(-1) for name, tensor in model.state_dict().items()}
    routes = RouteCache()
    first, second = patches_for(model, 1), patches_for(model, 2)
    load_checkpoint_weight_patches(model, first, routes=routes, atomic=atomic)  # loader path
    load_checkpoint_weight_patches(model, second, routes=routes, atomic=atomic)  # replays
    # Every sparse patch of the second call, and the dense patch of both calls (the first
    # call's sparse patches record the routes its dense patch then follows).
    assert routes.stats.replayed == len(model.checkpoint_specs()) + 2
    assert_same_storages(before, model)
    expected = state(reference_after(model, checkpoint, first + second))
    assert_same_state(state(model), expected)
    # A view taken before the calls, as a captured CUDA graph holds one, sees the new values.
    assert_same_state({n: v.view(expected[n].shape) for n, v in captured.items()}, expected)


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.id) for e in ZOO if e.outcome == "masked"])
def test_masked_write_paths_write_into_the_existing_storage(entry: Entry) -> None:
    # `check` asserts, after every call, that each tensor kept its storage (pointer and size)
    # and holds the dense truth.
    patches = [sparse([1, 8, 23], [1.5, -2.0, 3.25], torch.float32)]
    for routes in (False, True):
        verdict = check(
            entry.write, torch.float32, patches, strategy=None, atomic=False, routes=routes
        )
        assert verdict.outcomes == ["masked"]
