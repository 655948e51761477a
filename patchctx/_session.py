"""One loader call, from staging to verdict: the single entry point `run_loader`.

The jobs are split by module: provenance travels with the staged data (`patchctx._staged`),
the write policy and undo logging sit in `patchctx._writes` and `patchctx._undo`, the guard of
the loader's plain operations in `patchctx._guard`, route recording in `patchctx._recording`,
the structural check in `patchctx._snapshot`. This module is the lifecycle that ties them: one
`enter`/`leave` pair that every exit path shares, and one rollback that every failure runs.

Both are written to survive an exception raised at any line (a signal): every cleanup step is
idempotent and checks its own state, and is attempted twice on every path, at two different
lines (at the end of the ``try`` or in an ``except``, and again in the ``finally``), so a
step cut short by an asynchronous exception is completed by the other. No ``with`` block is
used for them: an exception arriving between a block's last line and its ``__exit__`` would
skip the exit (and `contextlib.ExitStack` does not retry a callback that was cut short).

A call either returns (every write it made is the dense truth for the positions it changed) or
raises with the model as it was before the call: structure put back, and every value the call
wrote restored from the undo log (dense writes are logged only when the caller asked for
``atomic``, since their old values cost as much memory as the weights).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from patchctx._errors import InvalidPatchError, LoaderContractError, PatchProblem
from patchctx._frame import Frame
from patchctx._geometry import Route, Segment
from patchctx._guard import Guard
from patchctx._model import read_names
from patchctx._recording import Recorder
from patchctx._snapshot import Snapshot
from patchctx._staged import provenance_of, stage, stage_dense
from patchctx._undo import UndoLog
from patchctx._writes import ModelIndex, WriteLedger, storage_key

__all__ = ["Load", "LoadResult", "ModelIndex", "run_loader"]


@dataclass(frozen=True, slots=True)
class Load:
    """One checkpoint tensor handed to the loader: dense (`indices` is `None`) or sparse."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None
    position: int | None = None  # in the caller's sequence, for messages


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one successful loader call reported and proved."""

    names: set[str]
    routes: dict[str, Route]
    segments: Mapping[str, list[Segment]]
    unprovable: Mapping[str, str]
    # Names that only sharing the call with other names and constant fills kept from a route:
    # a call of their own would settle them (`patchctx._recording`).
    alone: frozenset[str] = frozenset()
    # The names whose data reached a model tensor (or whose values the loader read out).
    consumed: frozenset[str] = frozenset()


def _tensor_for(load: Load, ledger: WriteLedger, *, atomic: bool) -> torch.Tensor:
    if load.indices is None:
        data = load.values.to(dtype=load.dtype).view(load.shape)
        shared = storage_key(data)
        if atomic:
            # Under atomic, dense data carries its provenance too: its writes are logged for
            # the rollback in whatever thread the loader makes them. Writes into the staged
            # tensor itself land in its data: a copy, never the caller's values.
            if shared is not None and shared == storage_key(load.values):
                data = data.clone()
            return stage_dense(data, name=load.name, ledger=ledger)
        if (
            shared is not None
            and shared == storage_key(load.values)
            and ledger.index.owner(data) is None  # values that are a weight: the model's own
        ):
            ledger.inputs.add(shared)  # the loader's in-place writes into it are undone
        if shared is not None:
            ledger.dense_source(shared, load.name)  # to see which weight it reaches
        return data
    try:
        return stage(
            load.shape, load.dtype, load.indices, load.values, name=load.name, ledger=ledger
        )
    except RuntimeError as error:  # the allocator (torch.OutOfMemoryError is one too)
        raise InvalidPatchError(
            [
                PatchProblem(
                    None,
                    load.name,
                    f"the sparse patch to {load.name!r} cannot be staged for the loader: its "
                    f"checkpoint tensor of shape {load.shape!r} {load.dtype} and its mask need "
                    f"{math.prod(load.shape) * (load.dtype.itemsize + 1)} bytes, which the "
                    f"allocator refused ({error}); nothing of this loader call was written (with "
                    "atomic=True, nothing of the whole call). Send it as smaller tensors, or "
                    "replay it along a route learnt by RouteCache.warm",
                )
            ]
        ) from error


def _rebound(names: list[str]) -> LoaderContractError:
    return LoaderContractError(
        f"the loader replaced, reshaped or added {', '.join(map(repr, names))} (param.data = w, "
        "as_strided_, a new parameter, buffer or submodule, one deleted...); patch loads write "
        "values in place so captured pointers (CUDA graphs) stay valid. The model's tensors "
        "and submodules were put back"
    )


class _Call:
    """The state of one call that every exit path needs (see `run_loader`)."""

    def __init__(
        self,
        model: Any,
        index: ModelIndex,
        undo: UndoLog,
        loads: list[Load],
        *,
        atomic: bool,
        kind_casts: bool,
    ) -> None:
        self.model = model
        self.recorder = Recorder()
        self.ledger = WriteLedger(
            index,
            undo,
            self.recorder,
            log_plain=atomic or any(load.indices is not None for load in loads),
            compact=atomic,
            loading=frozenset(load.name for load in loads),
            dtypes={load.name: load.dtype for load in loads},
            kind_casts=kind_casts,
        )
        self.undo = undo
        self.mark = undo.mark()
        self.snapshot = Snapshot(model)
        self.frame = Frame(Guard(self.ledger))

    def enter(self) -> None:
        """Suspend this thread's masked regions and push the guard (see `leave`)."""
        self.frame.enter()

    def leave(self) -> None:
        """Undo `enter` and close the ledger; idempotent, every step checked before it runs.

        What the loader left changed on the thread is put back too (`patchctx._frame`).
        """
        self.ledger.open = False  # from here on, staged data written anywhere is refused
        self.frame.leave()

    def rollback(self) -> None:
        """Put the model back as it was; idempotent, so an interrupted rollback can be redone."""
        try:
            self.snapshot.restore()
        except LoaderContractError:  # a storage resized in place: said by the snapshot
            self.undo.restore(self.mark)
            raise
        self.undo.restore(self.mark)

    def kept(self) -> list[str]:
        """Names whose staged data the loader kept after returning (a cache, an attribute)."""
        names: set[str] = set()
        for staged in list(self.ledger.born):
            names |= provenance_of(staged).names
        return sorted(names)


def run_loader(
    model: Any,
    loads: list[Load],
    *,
    index: ModelIndex,
    undo: UndoLog,
    atomic: bool,
    strict: bool = False,
    kind_casts: bool = True,
) -> LoadResult:
    """Call ``model.load_weights`` once with `loads` staged; return or roll back.

    Args:
        model: Anything with ``load_weights``.
        loads: The tensors of this call (not mixing dense and sparse).
        index: The model's tensors by storage, and the protected ones.
        undo: Receives the old values of every logged write; entries of this call are
            restored on failure (and kept for the caller's own rollback on success).
        atomic: Log dense writes too (sparse calls always log theirs).
        strict: Refuse the call (`InvalidPatchError`) when the data of one of `loads` reached
            no model tensor: the loader skipped the name.
        kind_casts: Allow writes into a weight whose dtype is of another kind than the
            load's (`CastKindError` otherwise).

    Raises:
        InvalidPatchError: `strict`, and the loader consumed no data of a load; the model is
            as it was before the call (except for dense writes when `atomic` is false).
        LoaderContractError: A write was refused; the model is as it was before the call.
        BaseException: Whatever the loader raised; the model is as it was before the call
            (except for dense writes when `atomic` is false).
    """
    call = _Call(model, index, undo, loads, atomic=atomic, kind_casts=kind_casts)
    done = False
    try:
        weights = [(load.name, _tensor_for(load, call.ledger, atomic=atomic)) for load in loads]
        names = _call_loader(call, loads, weights)
        _refuse_what_it_left(call)
        weights.clear()  # the staged tensors die here unless the loader kept them
        _refuse_kept(call)
        if strict:
            _refuse_skipped(call, loads)
        done = True
    except BaseException:
        call.rollback()
        raise
    finally:
        try:
            if not done:
                call.rollback()
        finally:
            # The caller's dense values, as they sent them (twice, like every undo).
            try:
                call.ledger.restore_inputs()
            finally:
                call.ledger.restore_inputs()
    recorder = call.recorder
    routes = recorder.routes(
        {load.name: (load.shape, load.dtype) for load in loads if load.indices is not None},
        other_writes=[write.how for write in call.ledger.other_writes()],
        constants=call.ledger.constants(),
        loading=call.ledger.loading,
        reported=names,
        tensor_names=frozenset(index.tensors),
    )
    return LoadResult(
        names,
        routes,
        recorder.segments,
        recorder.reasons,
        frozenset(recorder.alone),
        frozenset(call.ledger.consumed),
    )


def _call_loader(
    call: _Call, loads: list[Load], weights: list[tuple[str, torch.Tensor]]
) -> set[str]:
    """Run ``load_weights`` on the staged `weights` under the guard; the names it reports."""
    for load in loads:
        if load.indices is not None:
            call.recorder.expect(load.name)
    try:
        call.enter()
        try:
            # Read to the end here, under the guard: a generator's body runs only now.
            names = read_names(call.model.load_weights(weights))
        except BaseException:
            call.leave()
            raise
        call.leave()
    finally:
        call.leave()  # every cleanup runs twice, at different lines (module doc)
    return names


def _refuse_what_it_left(call: _Call) -> None:
    """Refuse a loader that left a mode on the thread, hid a refusal or rebound a tensor."""
    left_open = call.frame.left_open()
    if left_open is not None:
        raise LoaderContractError(
            f"{left_open}: a dispatch mode would see every later operation of this thread, "
            "a masked region would hold the region lock and the copy_ swap past the call. "
            "patchctx took it off the thread and refused the call"
        )
    if call.ledger.refusals:
        first = call.ledger.refusals[0]
        raise type(first)(
            f"the loader caught patchctx's refusal and carried on, so what it did next "
            f"rests on data it could not see: {first}"
        ) from first
    changed = call.snapshot.restore()
    if changed:
        raise _rebound(changed)


def _refuse_kept(call: _Call) -> None:
    """Refuse a loader that kept staged data past the call (once its references are gone)."""
    kept = call.kept()
    if kept:
        gc.collect()  # a reference cycle may be all that keeps a temporary alive
        kept = call.kept()
    if kept:
        raise LoaderContractError(
            f"the loader kept staged data of {', '.join(map(repr, kept))} in an object "
            "that outlives the load (a cache, an attribute, a global): it holds 'keep' "
            "marks, not weights. Copy what you need into the model's own tensors"
        )


def _refuse_skipped(call: _Call, loads: list[Load]) -> None:
    """`strict`: refuse the loads whose data reached no model tensor (an empty one: none)."""
    skipped = [
        load for load in loads if load.name not in call.ledger.consumed and 0 not in load.shape
    ]
    if skipped:
        raise InvalidPatchError(
            [
                PatchProblem(
                    load.position,
                    load.name,
                    "no loader call consumed it: the model's load_weights wrote none "
                    "of its data into a parameter or buffer (it skips the name: unknown, "
                    "misspelt, or held by another rank). Fix the name, or pass "
                    "strict=False for a loader that legitimately skips names",
                )
                for load in skipped
            ]
        )
