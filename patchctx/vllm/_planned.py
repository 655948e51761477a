"""An update turned into its writes before the pause: positions found, values cast, ahead of time.

A storage sync prepares in the background while the engine generates (`StorageWorkerExtension`).
When every patch of the prepared update follows a known route (learnt at engine start, by an
earlier update, or by the prepare itself), where each value goes is a pure function of the
route and the patch: the storage positions of each segment and the values cast as ``copy_``
would cast them. `plan_update` computes them in the background. `apply_planned`, in the pause,
checks that every tensor the plan writes is still the one it was planned on (its object, data
pointer, dtype, layout and storage size, and those of every tensor sharing its bytes), reads the
engine's facts again (layerwise reload, transformed weights), saves the old values and writes,
all or nothing: the pause does the writes and their checks, nothing else.

A plan is refused (`plan_update` returns `None`, and the pause runs the full atomic call) where
that shortcut would decide differently from `load_checkpoint_weight_patches`: a name without a
usable route, a route that read model values or writes nothing, routes due for verification, a
name sent twice or under two tied names, a cast across kinds, a written weight the engine
transformed. At apply time, a plan whose tensors changed (a weight replaced, a layout changed, a
reload under way) is not used either: `apply_planned` returns `None` before any write, and the
caller runs the full call, which then refuses or applies what the model now is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from patchctx import CheckpointWeightPatch, PatchError
from patchctx._bits import write_at
from patchctx._blocks import undo_block
from patchctx._geometry import Fill, Holder, Route, Segment
from patchctx._grad import without_grad
from patchctx._model import model_tensors
from patchctx._swap import builtin_copy
from patchctx._undo import UndoLog, storage_flat
from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._apply import UNKNOWN, WorkerPatcher, layerwise_reload_active
from patchctx.vllm._layout import repack_touched
from patchctx.vllm._transformed import transformed_in
from patchctx.vllm._walk import ModelWalk

__all__ = ["MAX_PLAN_BYTES", "PlannedUpdate", "apply_planned", "plan_budget", "plan_update"]

MAX_PLAN_BYTES = 1 << 30
"""The most memory one plan holds, on the weights' device (``PATCHCTX_PLAN_MAX_BYTES``).

A plan keeps 8 bytes of position and one value per changed element while the engine serves:
an update past the budget is not planned (its apply is the full call), so a large update
never takes memory that generation may need (an accelerator's KV cache)."""


def plan_budget() -> int:
    """`MAX_PLAN_BYTES`, or ``PATCHCTX_PLAN_MAX_BYTES`` from the environment (0: no plans)."""
    raw = os.environ.get("PATCHCTX_PLAN_MAX_BYTES", "").strip()
    if not raw:
        return MAX_PLAN_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"PATCHCTX_PLAN_MAX_BYTES must be a byte count, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"PATCHCTX_PLAN_MAX_BYTES must not be negative, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where the model registers a tensor, and the tensor it registered when planned."""

    module: torch.nn.Module
    attr: str
    tensor: torch.Tensor

    @classmethod
    def of(cls, model: torch.nn.Module, name: str, tensor: torch.Tensor) -> _Slot:
        prefix, _, attr = name.rpartition(".")
        return cls(model.get_submodule(prefix) if prefix else model, attr, tensor)

    def held(self) -> bool:
        return getattr(self.module, self.attr, None) is self.tensor


@dataclass(frozen=True, slots=True)
class _Write:
    """One segment's or fill's write: its destination, how it is checked live, what goes in.

    Sparse: ``positions`` (int64 storage offsets, owned by the plan) and ``values`` in the
    destination dtype. Dense: ``values`` is the whole cast patch and the segment's geometry
    says which view of it goes into which view of the destination. A fill makes its constant.
    """

    slot: _Slot
    check: Segment | Fill
    holders: tuple[tuple[Holder, _Slot], ...]
    positions: torch.Tensor | None
    values: torch.Tensor | None
    block: int  # positions saved, then written, at a time (`undo_block` on CPU; sparse only)

    def live(self) -> bool:
        tensor = self.slot.tensor
        return (
            self.slot.held()
            and self.check.live(tensor)
            and all(slot.held() and holder.live(slot.tensor) for holder, slot in self.holders)
        )

    def write(self, undo: UndoLog) -> None:
        target, check = self.slot.tensor, self.check
        if isinstance(check, Fill):
            check.apply(target, undo)
            return
        values, positions = self.values, self.positions
        assert values is not None
        if positions is not None:
            flat = storage_flat(target).detach()
            count, step = positions.shape[0], self.block
            for start in range(0, count, step):
                at = positions[start : start + step]
                undo.save_positions(flat, at, owned=True)
                write_at(flat, at, values[start : start + step])
            return
        there, here = check.target, check.source
        view = torch.as_strided(target, there.size, there.stride, there.offset)
        undo.save_view(view)
        source = torch.as_strided(
            values, here.size, here.stride, values.storage_offset() + here.offset
        )
        builtin_copy(view, source)


@dataclass(frozen=True, slots=True)
class PlannedUpdate:
    """A prepared update's writes, found in the background (see the module).

    Attributes:
        patches: The update's patches (what `WorkerPatcher.apply` would take).
        writes: Every write, in the order the full call would make them.
        loaded: The parameter names the loader reported for the patches' routes.
        nbytes: Bytes the plan holds (positions and cast values).
    """

    patches: tuple[CheckpointWeightPatch, ...]
    writes: tuple[_Write, ...]
    loaded: frozenset[str]
    nbytes: int


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _owned(tensor: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`tensor`, or a copy when it lies in one of the model's written storages."""
    if tensor.untyped_storage().data_ptr() in storages:
        return tensor.clone()
    return tensor


class _Builder:
    """The writes of one plan, patch by patch (`plan_update`)."""

    def __init__(
        self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], protect: dict[str, str]
    ) -> None:
        self.model, self.tensors, self.protect = model, tensors, protect
        self.slots: dict[str, _Slot] = {}
        self.storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        self.writes: list[_Write] = []
        self.loaded: set[str] = set()
        self.nbytes = 0

    def slot(self, name: str) -> _Slot | None:
        """Where `name` is registered, if the model holds it and it was not transformed."""
        if name in self.protect:
            return None
        if name not in self.slots:
            tensor = self.tensors.get(name)
            if tensor is None:
                return None
            self.slots[name] = _Slot.of(self.model, name, tensor)
        return self.slots[name]

    def steps(
        self, route: Route
    ) -> list[tuple[Segment | Fill, _Slot, tuple[tuple[Holder, _Slot], ...]]] | None:
        """Each segment and fill of `route` with its destination and holders, checked live."""
        steps = []
        every: tuple[Segment | Fill, ...] = (*route.segments, *route.fills)
        for written in every:
            target = self.slot(written.tensor_name)
            if target is None or not written.live(target.tensor):
                return None
            holders: list[tuple[Holder, _Slot]] = []
            for holder in written.holders:
                held = self.slot(holder.tensor_name)
                if held is None or not holder.live(held.tensor):
                    return None
                holders.append((holder, held))
            steps.append((written, target, tuple(holders)))
        return steps

    def add(self, patch: CheckpointWeightPatch, route: Route) -> bool:
        """Add the writes of `patch` along `route`; False where the plan cannot make them."""
        steps = self.steps(route)
        if steps is None:
            return False
        values = patch.values.detach().reshape(-1)
        full = indices = None
        ordered = False
        if patch.indices is None:  # the whole tensor, cast once (as the staging casts it)
            full = _owned(values.to(dtype=route.dtype).contiguous(), self.storages)
            self.nbytes += full.nbytes if full.data_ptr() != values.data_ptr() else 0
        else:
            indices = patch.indices.detach().reshape(-1)
            ordered = indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all())
        for written, target, held_by in steps:
            device = target.tensor.device
            if isinstance(written, Fill):
                self.writes.append(_Write(target, written, held_by, None, None, 0))
            elif full is not None:
                source = full if full.device == device else full.to(device)
                self.writes.append(_Write(target, written, held_by, None, source, 0))
            else:
                assert indices is not None
                found, picked = written.positions(indices.to(device), sorted_unique=ordered)
                # Cast as the loader path does: to the checkpoint dtype, then by ``copy_``.
                chosen = values.to(device)[picked].to(dtype=route.dtype).to(dtype=written.dtype)
                update = _owned(chosen.contiguous(), self.storages)
                self.nbytes += found.nbytes + update.nbytes
                count = max(int(found.shape[0]), 1)
                block = count
                if found.is_cpu and count > 1:  # the old values' cache lines, warm for the write
                    span = int(found.max()) - int(found.min()) + 1
                    block = undo_block(count, span)
                self.writes.append(_Write(target, written, held_by, found, update, block))
        self.loaded |= route.reported
        return True


@without_grad
def plan_update(
    patcher: WorkerPatcher,
    model: torch.nn.Module,
    patches: Sequence[CheckpointWeightPatch],
    *,
    max_bytes: int | None = None,
) -> PlannedUpdate | None:
    """The writes of `patches` on `patcher`'s routes, or `None` where only the full call decides.

    Call it after the patches were checked (`WorkerPatcher.check`) and their routes learnt
    (`WorkerPatcher.warm`), outside the pause. It reads no weight values: only the routes and
    which tensors the model registers. `max_bytes` (default `plan_budget`): a plan that would
    hold more is not made.
    """
    routes = patcher.routes
    budget = plan_budget() if max_bytes is None else max_bytes
    sparse = sum(p.indices.numel() for p in patches if p.indices is not None)
    if not patches or routes.verify_every is not None or sparse * 9 > budget:
        return None
    walk = ModelWalk.of(model)
    if layerwise_reload_active(model, walk):
        return None
    protect = transformed_in(walk)
    aliases = tied_aliases(model)
    tensors = model_tensors(model)  # type: ignore[arg-type]
    canonical = [aliases.get(p.name, p.name) for p in patches]
    if len(set(canonical)) != len(canonical):
        return None  # a name twice (or under two tied names): the full call orders them
    chosen: list[tuple[CheckpointWeightPatch, Route]] = []
    for patch, name in zip(patches, canonical, strict=True):
        route = patcher.route(name)
        if (
            route is None
            or not route.segments
            or route.reads
            or route.holding is not None
            or route.shape != tuple(patch.shape)
            or route.dtype != patch.dtype
            or _kind(patch.values.dtype) != _kind(patch.dtype)
            or any(_kind(s.dtype) != _kind(route.dtype) for s in route.segments)
        ):
            return None
        chosen.append((patch, route))
    builder = _Builder(model, tensors, protect)
    for patch, route in chosen:
        if not builder.add(patch, route) or builder.nbytes > budget:
            return None
    return PlannedUpdate(
        tuple(patches), tuple(builder.writes), frozenset(builder.loaded), builder.nbytes
    )


@without_grad
def apply_planned(
    patcher: WorkerPatcher,
    model: torch.nn.Module,
    plan: PlannedUpdate,
    *,
    base_version: str | int | None,
    target_version: str | int | None,
) -> dict[str, Any] | None:
    """Make `plan`'s writes, all or nothing; `None`, having written nothing, if it is stale.

    The statistics are those of `WorkerPatcher.apply` (with ``planned: True``).

    Raises:
        WeightVersionError: `base_version` is not the worker's; nothing was written.
        PatchError: A write failed; every write was undone.
    """
    started = time.perf_counter()
    patcher.check_base(base_version)
    # Read and written as plain tensors: vLLM's parameter classes route every method through
    # their `__torch_function__`, a few microseconds each (the live checks: 3x faster).
    with torch._C.DisableTorchFunctionSubclass():
        live = all(write.live() for write in plan.writes)
    if not live:
        return None
    walk = ModelWalk.of(model)  # the engine's facts, read now (as every apply reads them)
    if layerwise_reload_active(model, walk):
        return None
    protect = transformed_in(walk)
    if protect and any(
        write.check.tensor_name in protect
        or any(holder.tensor_name in protect for holder, _ in write.holders)
        for write in plan.writes
    ):
        return None
    checked = time.perf_counter()
    wrote, repacked = _commit(patcher, model, plan, target_version)
    names = sorted({patch.name for patch in plan.patches})
    patcher.consumed.update(names)
    patcher.routes.stats.replayed += len(plan.patches)
    return {
        "ok": True,
        "names": names,
        "loaded": sorted(plan.loaded),
        "replayed": len(plan.patches),
        "through_loader": 0,
        "loader_calls": 0,
        "milliseconds": (time.perf_counter() - started) * 1000.0,
        # Where the pause went: the live checks and the engine's facts, the writes (old
        # values saved first), the repack of prepacked layers.
        "stages_ms": {
            "checks": (checked - started) * 1000.0,
            "writes": (wrote - checked) * 1000.0,
            "repack": (time.perf_counter() - wrote) * 1000.0,
        },
        "version": target_version,
        "atomic": True,
        "protected": len(protect),
        "repacked": len(repacked),
        "planned": True,
    }


def _commit(
    patcher: WorkerPatcher,
    model: torch.nn.Module,
    plan: PlannedUpdate,
    target_version: str | int | None,
) -> tuple[float, list[str]]:
    """`plan`'s writes and the repack, then the version, all or nothing.

    Returns when the writes ended (`time.perf_counter`) and the layers repacked.
    """
    undo = UndoLog()
    previous = patcher.version
    done = False

    def roll_back() -> None:
        # Resumable: run again by the `finally` when an interrupt cuts it short.
        undo.restore()
        patcher.version = UNKNOWN  # until the kernels compute from the restored weights
        repack_touched(model, plan.loaded)
        patcher.version = previous

    try:
        try:
            with torch._C.DisableTorchFunctionSubclass():
                for write in plan.writes:
                    write.write(undo)
            wrote = time.perf_counter()
            # The layers vLLM prepacked compute from their own copy: their post-load step
            # again, on the layers written; then the version says the update is in.
            repacked = repack_touched(model, plan.loaded)
            patcher.version = target_version
            done = True
        except Exception as error:
            raise PatchError(
                f"applying the planned update failed ({type(error).__name__}: "
                f"{str(error)[:300]}); every write was undone"
            ) from error
    except BaseException:
        if not done:
            roll_back()
        raise
    finally:
        if not done:
            roll_back()  # a second attempt, for an exception that cut the first short
    return wrote, repacked
