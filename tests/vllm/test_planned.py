"""The storage sync's pause, planned in the background: the dense truth, or the full call.

`StorageWorkerExtension` finds an update's writes while it prepares (where routes decide all of
them) and, in the pause, only checks the tensors they write and writes. These tests hold that
path to the contracts of the full call: every apply gives what loading the whole published
checkpoint gives, a weight changed between the prepare and the pause is never written through
the plan, and an interrupt at any line of the pause leaves every weight as it was or the whole
update applied, with the worker's version saying which.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from patchctx import StoragePublisher, _tuning
from patchctx.vllm import StorageWorkerExtension
from tests.support.models import (
    ToyLayer,
    ToyModel,
    assert_same_state,
    loaded,
    packed_tp_model,
    state,
)
from tests.test_faults import run_with_interrupt_at

pytestmark = pytest.mark.vllm


def worker_for(model: nn.Module) -> StorageWorkerExtension:
    worker = StorageWorkerExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)
    return worker


def prepare(worker: StorageWorkerExtension, store: Path) -> None:
    worker.patchctx_storage_prepare(str(store))
    deadline = time.monotonic() + 120
    while worker.patchctx_storage_status()["state"] == "preparing":
        assert time.monotonic() < deadline, "the prepare did not end"
        time.sleep(0.005)
    status = worker.patchctx_storage_status()
    assert status["state"] in ("prepared", "nothing"), status


def sync(worker: StorageWorkerExtension, store: Path) -> dict[str, Any]:
    prepare(worker, store)
    stats = worker.patchctx_storage_apply()
    assert stats["ok"], stats
    return stats


def following(
    tmp_path: Path, *, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[ToyModel, dict[str, torch.Tensor], Path, StoragePublisher, StorageWorkerExtension]:
    """A model at a published anchor, its worker synced to it."""
    model = packed_tp_model(dtype=dtype)
    checkpoint = loaded(model, seed=seed)
    store = tmp_path / "store"
    publisher = StoragePublisher(store, anchor_every=10**6)
    publisher.publish(checkpoint)
    worker = worker_for(model)
    sync(worker, store)
    return model, checkpoint, store, publisher, worker


def truth(checkpoint: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What loading the whole checkpoint into a fresh model gives: the dense truth."""
    twin = packed_tp_model(dtype=dtype)
    twin.load_weights(checkpoint.items())
    return state(twin)


def step(
    checkpoint: dict[str, torch.Tensor], density: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A training step that changes about `density` of every tensor's elements."""
    new = {}
    for name, tensor in checkpoint.items():
        mask = torch.rand(tensor.shape, generator=generator) < density
        moved = tensor + torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        new[name] = torch.where(mask, moved, tensor)
    return new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_planned_apply_gives_the_dense_truth(tmp_path: Path, dtype: torch.dtype) -> None:
    # Packed QKV and gate/up at one TP rank, a row-parallel slice, a transpose, a cast to
    # another dtype, a padded embedding (a fill): every route shape replays through the plan.
    # The anchor first: routes learnt on the way.
    model, checkpoint, store, publisher, worker = following(tmp_path, seed=3, dtype=dtype)
    generator = torch.Generator().manual_seed(5)
    planned = 0
    for density in (0.3, 0.05, 1.0, 0.001, 0.5):
        checkpoint = step(checkpoint, density, generator)
        published = publisher.publish(checkpoint)
        stats = sync(worker, store)
        assert stats["version"] == published.version
        planned += bool(stats.get("planned"))
        if stats.get("planned"):  # the pause neither ran the loader nor learnt anything
            assert stats["loader_calls"] == 0 and stats["through_loader"] == 0
        assert_same_state(state(model), truth(checkpoint, dtype))
    assert planned >= 4, "the deltas did not take the planned path"


def _replace_object(layer: ToyLayer) -> None:
    layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)


def _rebind_data(layer: ToyLayer) -> None:
    layer.weight.data = layer.weight.detach().clone()


def _relayout(layer: ToyLayer) -> None:  # the same values, column-major
    layer.weight.data = layer.weight.detach().t().contiguous().t()


def _replace_storage(layer: ToyLayer) -> None:  # same object, same strides, new bytes
    with torch.no_grad():
        weight = layer.weight
        weight.set_(weight.detach().clone().untyped_storage(), 0, weight.shape, weight.stride())


@pytest.mark.parametrize(
    ("change", "replans"),
    [
        (_replace_object, True),
        (_rebind_data, True),
        (_relayout, False),  # the loader's view copies onto it are not routes: no plan
        (_replace_storage, True),
    ],
)
def test_a_weight_changed_after_the_prepare_is_never_written_through_the_plan(
    tmp_path: Path, change: Any, replans: bool
) -> None:
    model, checkpoint, store, publisher, worker = following(tmp_path, seed=7)
    generator = torch.Generator().manual_seed(11)
    checkpoint = step(checkpoint, 0.2, generator)
    publisher.publish(checkpoint)
    prepare(worker, store)
    layer = model.layer("qkv")
    change(layer)
    detached = layer.weight  # the tensor the model now holds: it must take the update
    stats = worker.patchctx_storage_apply()
    # The full call decides on the model as it now is: here, through the loader again,
    # into the weight the model holds (a plan would have written the one it left).
    assert stats["ok"] and not stats.get("planned"), stats
    assert layer.weight is detached
    assert_same_state(state(model), truth(checkpoint, torch.float32))
    # The next update plans again where the full call learnt routes onto the new weight.
    checkpoint = step(checkpoint, 0.2, generator)
    publisher.publish(checkpoint)
    assert bool(sync(worker, store).get("planned")) is replans
    assert_same_state(state(model), truth(checkpoint, torch.float32))


@pytest.mark.parametrize("block", [None, 16], ids=["one-block", "blocks-of-16"])
def test_an_interrupt_at_any_line_of_the_pause_leaves_all_or_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int | None
) -> None:
    from patchctx.vllm._planned import apply_planned, plan_update

    if block is not None:  # many blocks per write: each saved, then written
        monkeypatch.setattr(_tuning, "BLOCK", block)

    model, checkpoint, store, publisher, worker = following(tmp_path, seed=13)
    patcher = worker._patchctx_worker()
    base = patcher.version
    checkpoint = step(checkpoint, 0.3, torch.Generator().manual_seed(17))
    publisher.publish(checkpoint)
    prepare(worker, store)
    prepared = worker.patchctx_storage_status()
    from patchctx import load_patches

    folder = store / f"v{prepared['target']:08d}"
    patches = load_patches(str(folder))
    plan = plan_update(patcher, model, patches)
    assert plan is not None
    before, after = state(model), truth(checkpoint, torch.float32)
    line, interrupted, applied = 1, 0, 0
    while True:
        seen, raised = run_with_interrupt_at(
            line,
            lambda: apply_planned(
                patcher, model, plan, base_version=base, target_version=prepared["target"]
            ),
        )
        if patcher.version == prepared["target"]:
            assert_same_state(state(model), after)
            applied += 1
            for name, tensor in model.state_dict().items():  # back, keeping every tensor
                tensor.copy_(before[name])
            patcher.version = base
        else:
            assert patcher.version == base
            assert_same_state(state(model), before)
            interrupted += raised
        if not raised:
            break
        line += 1
    assert interrupted > 50 and applied >= 1, (interrupted, applied, seen)


def test_a_vllm_model_takes_planned_updates_as_its_loader_would(
    checkpoints: dict[str, Path], tmp_path: Path, single_rank: None
) -> None:
    # vLLM's own Qwen2 (packed QKV and gate/up, a tied LM head) loaded in this process.
    from tests.vllm.support.checkpoints import load_model, read_checkpoint

    model_dir = checkpoints["qwen2"]
    checkpoint = read_checkpoint(model_dir)
    model = load_model(model_dir)
    reference = load_model(model_dir)
    store = tmp_path / "store"
    publisher = StoragePublisher(store, anchor_every=10**6)
    publisher.publish(checkpoint)
    worker = worker_for(model)
    sync(worker, store)
    generator = torch.Generator().manual_seed(19)
    for density in (0.01, 0.2):
        checkpoint = step(checkpoint, density, generator)
        publisher.publish(checkpoint)
        stats = sync(worker, store)
        assert stats.get("planned"), stats
        reference_any: Any = reference
        reference_any.load_weights(checkpoint.items())
        assert_same_state(state(model), state(reference))


@pytest.mark.parametrize("budget", ["0", "100"])
def test_an_update_past_the_plan_budget_takes_the_full_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    # A plan holds positions and values while the engine serves: past the budget, none is
    # made, and the update applies through the full call.
    model, checkpoint, store, publisher, worker = following(tmp_path, seed=23)
    monkeypatch.setenv("PATCHCTX_PLAN_MAX_BYTES", budget)
    checkpoint = step(checkpoint, 0.2, torch.Generator().manual_seed(29))
    publisher.publish(checkpoint)
    stats = sync(worker, store)
    assert not stats.get("planned") and stats["replayed"] >= 1
    assert_same_state(state(model), truth(checkpoint, torch.float32))
    monkeypatch.setenv("PATCHCTX_PLAN_MAX_BYTES", str(1 << 30))
    checkpoint = step(checkpoint, 0.2, torch.Generator().manual_seed(31))
    publisher.publish(checkpoint)
    assert sync(worker, store).get("planned")
    assert_same_state(state(model), truth(checkpoint, torch.float32))


def test_a_malformed_plan_budget_fails_the_prepare_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, checkpoint, store, publisher, worker = following(tmp_path, seed=37)
    before = state(model)
    monkeypatch.setenv("PATCHCTX_PLAN_MAX_BYTES", "1 GiB")
    publisher.publish(step(checkpoint, 0.2, torch.Generator().manual_seed(41)))
    worker.patchctx_storage_prepare(str(store))
    deadline = time.monotonic() + 120
    while (status := worker.patchctx_storage_status())["state"] == "preparing":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert status["state"] == "failed" and "PATCHCTX_PLAN_MAX_BYTES" in status["error"]
    refused = worker.patchctx_storage_apply()
    assert not refused["ok"] and "PATCHCTX_PLAN_MAX_BYTES" in refused["error"]["message"]
    assert_same_state(state(model), before)
