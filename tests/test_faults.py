"""Asynchronous exceptions at every line, and regions that cross threads and contexts.

A ``KeyboardInterrupt`` from a signal can arrive between any two lines. A trace function
raises one at the N-th line executed in patchctx's own code, for every N of a whole region or a
whole load, one run per N (not at random). After each run the lock is free, ``copy_`` is the
original, no dispatch mode is left on the thread, and the model is bit for bit as before (or,
when the interrupt came after the load was complete, as after it).
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import linecache
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.utils._python_dispatch as _dispatch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import patchctx
from patchctx import (
    CheckpointWeightPatch,
    NaNMask,
    RouteCache,
    _swap,
    load_checkpoint_weight_patches,
    masked_copy,
)
from tests.support.zoo import ZooLayer, full_state, same_state, sparse

ORIGINAL = torch.Tensor.copy_
PACKAGE = str(Path(patchctx.__file__).parent)


class Injected(KeyboardInterrupt):
    pass


# torch's Python code that patchctx calls to change the thread's state: dispatch modes
# (``TorchDispatchMode.__enter__``/``__exit__``, ``_push_mode``, ``_pop_mode``, the mode
# flags) and gradient recording. With `deep`, every line of these counts too.
TORCH_STATE = tuple(
    str(Path(torch.__file__).parent / name)
    for name in ("utils/_python_dispatch.py", "autograd/grad_mode.py")
)


def run_with_interrupt_at(
    line: int | None, body: Callable[[], object], *, calls: bool = False, deep: bool = False
) -> tuple[int, bool]:
    """Run `body`, raising `Injected` at the `line`-th line event in patchctx's code.

    With `calls`, the start of every Python function patchctx's code calls (torch's
    ``TorchDispatchMode.__exit__``, say) counts as a line event too: CPython checks for a
    signal as a frame starts, so an interrupt can arrive there before its first line runs.
    With `deep`, so does every line of torch's own functions that change the thread's modes
    and gradient recording (`TORCH_STATE`), wherever they are called from in the body.

    Returns the number of line events seen and whether the interrupt was raised.
    """
    seen = 0
    raised = False

    def count(frame: FrameType) -> None:
        nonlocal seen, raised
        seen += 1
        if seen == line:
            raised = True
            raise Injected

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and not _irreducible(frame):
            count(frame)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE) or (deep and filename in TORCH_STATE):
            return local
        caller = frame.f_back
        if (
            calls
            and caller is not None
            and caller.f_code.co_filename.startswith(PACKAGE)
            and not _finalizer(frame)
        ):
            count(frame)  # raised in the called frame, before its first line
        return None

    # Other libraries' garbage-collector callbacks (hypothesis has one) run inside patchctx's
    # gc.collect(): not patchctx's code, and an interrupt there is only reported.
    callbacks = gc.callbacks[:]
    gc.callbacks.clear()
    sys.settrace(tracer)
    try:
        body()
    except Injected:
        pass
    finally:
        sys.settrace(None)
        gc.callbacks[:] = callbacks
    return seen, raised


def _finalizer(frame: FrameType) -> bool:
    """A finalizer, weak-reference or garbage-collector callback (another library's, say):
    Python reports what it raises, never propagates it (an interrupt there is lost whatever
    the code around it does)."""
    code = frame.f_code
    return (
        code.co_name == "__del__"
        or code.co_filename.endswith("_weakrefset.py")
        or any(getattr(callback, "__code__", None) is code for callback in gc.callbacks)
    )


_EXIT = patchctx.MaskedCopy.__exit__.__code__


def _irreducible(frame: FrameType) -> bool:
    """Line events no signal can be delivered at, or none of our code can answer:

    - the first line of ``MaskedCopy.__exit__`` (``region = None``): an exception there
      comes before anything of the exit runs, as if the ``with`` statement had not called
      ``__exit__`` (the lookup of the region, `_swap.innermost`, is inside its ``try`` and
      is covered). patchctx's own code never opens a region with ``with`` (the decorators,
      the load), so it is covered at every line;
    - a bare ``try:`` line: it runs no instruction a signal is checked at, and CPython 3.11
      raises an exception from a trace function there outside the enclosing handlers (an
      artefact of tracing: an outer ``finally`` would not even run).
    """
    if frame.f_code is _EXIT and frame.f_lineno == _EXIT.co_firstlineno + 1:
        return True
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == "try:"


def assert_consistent() -> None:
    assert _swap.holder() is None, "the region lock is held"
    assert torch.Tensor.copy_ is ORIGINAL, "copy_ is still swapped"
    assert _swap.active_interceptor() is None, "a region is still active on this thread"
    assert not _swap.is_bypassed(), "this thread's copy_ calls still bypass every region"
    assert _get_current_dispatch_mode() is None, "a dispatch mode is left on the thread"
    assert not _dispatch._is_in_torch_dispatch_mode, "torch's mode flags are left set"
    assert not _dispatch._is_in_non_infra_torch_dispatch_mode, "torch's mode flags are left set"
    assert torch.is_grad_enabled(), "gradient recording is left off"


def region_body() -> None:
    destination = torch.zeros(4)
    staged = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    with masked_copy(strategy=NaNMask()):
        destination.copy_(staged)


@masked_copy(strategy=NaNMask())
def decorated_body(destination: torch.Tensor, staged: torch.Tensor) -> None:
    destination.copy_(staged)


def decorated_region_body() -> None:
    destination = torch.zeros(4)
    decorated_body(destination, torch.tensor([1.0, float("nan"), 3.0, float("nan")]))
    assert destination.tolist() == [1.0, 0.0, 3.0, 0.0]


@pytest.mark.parametrize("body", [region_body, decorated_region_body], ids=["with", "decorator"])
def test_an_interrupt_at_any_line_of_a_region_leaves_lock_swap_and_stack_consistent(
    body: Callable[[], None],
) -> None:
    total, _ = run_with_interrupt_at(None, body)
    assert total > 20
    for line in range(1, total + 1):
        run_with_interrupt_at(line, body)
        assert_consistent()
        body()  # and the next region works
        assert_consistent()


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("routes", [False, True])
def test_an_interrupt_at_any_line_of_a_load_leaves_the_model_as_before_or_as_after(
    atomic: bool, routes: bool
) -> None:
    def copy(m: ZooLayer, w: torch.Tensor) -> None:
        m.weight.data[:2].copy_(w[:2])
        m.weight.data[2:].copy_(w[2:])

    patches = [sparse([1, 8, 23], [1.5, -2.0, 3.25], torch.float32)]
    second = [sparse([2, 9], [7.0, 8.0], torch.float32)]
    cache = RouteCache() if routes else None
    model = ZooLayer(copy, torch.float32)
    load_checkpoint_weight_patches(model, patches, routes=cache)  # records the route
    before = full_state(model)
    after_model = ZooLayer(copy, torch.float32)
    load_checkpoint_weight_patches(after_model, patches)
    load_checkpoint_weight_patches(after_model, second)
    after = full_state(after_model)

    def body() -> None:
        load_checkpoint_weight_patches(model, second, routes=cache, atomic=atomic)

    total, _ = run_with_interrupt_at(None, body)
    assert not same_state(full_state(model), after, storages=False)
    assert total > 50
    for line in range(1, total + 1):
        model = ZooLayer(copy, torch.float32)
        load_checkpoint_weight_patches(model, patches)
        cache = RouteCache() if routes else None
        if cache is not None:
            load_checkpoint_weight_patches(model, patches, routes=cache)
        run_with_interrupt_at(line, body)
        assert_consistent()
        state = full_state(model)
        as_before = same_state(state, before, storages=False)
        as_after = same_state(state, after, storages=False)
        assert as_before == [] or as_after == [], f"line {line}: half written: {as_before}"


class PaddedPair(nn.Module):
    """Two weights; the loader zero-fills `e`'s padding rows (a constant fill), so a call of
    both names learns each one's route by a dry run of that name alone, inside the load."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8), requires_grad=False)
        self.e = nn.Parameter(torch.zeros(10), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if name == "e":
                self.e[:8].copy_(tensor)
                self.e[8:].zero_()
            else:
                self.w.copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("atomic", [False, True])
def test_an_interrupt_anywhere_in_a_load_that_learns_routes_by_dry_runs_leaves_no_guard(
    atomic: bool,
) -> None:
    """The dry runs push a dispatch mode and bypass masked regions: an interrupt at any line,
    or as any function they call starts (``TorchDispatchMode.__exit__`` included), must leave
    neither behind, and the model as before or as after."""

    def patches() -> list[CheckpointWeightPatch]:
        return [
            CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([1.0]), torch.tensor([1])),
            CheckpointWeightPatch("e", (8,), torch.float32, torch.tensor([2.0]), torch.tensor([2])),
        ]

    after_model = PaddedPair()
    load_checkpoint_weight_patches(after_model, patches())
    after = full_state(after_model)
    before = full_state(PaddedPair())
    model = PaddedPair()

    def body() -> None:
        load_checkpoint_weight_patches(model, patches(), routes=RouteCache(), atomic=atomic)

    total, _ = run_with_interrupt_at(None, body, calls=True)
    assert total > 200
    for line in range(1, total + 1):
        model = PaddedPair()
        run_with_interrupt_at(line, body, calls=True)
        assert_consistent()
        state = full_state(model)
        as_before = same_state(state, before, storages=False)
        as_after = same_state(state, after, storages=False)
        assert as_after == [] or (as_before == [] if atomic else True), f"line {line}"
        # The thread carries on: a later load writes, and a region still masks.
        load_checkpoint_weight_patches(model, patches())
        assert same_state(full_state(model), after, storages=False) == [], f"line {line}"


_SPECS = [("w", (8,), torch.float32), ("e", (8,), torch.float32)]


def _warm() -> None:
    RouteCache().warm(PaddedPair(), _SPECS)


def _audit() -> None:
    patchctx.audit(PaddedPair(), _SPECS)


def _diff() -> None:
    old = {"w": torch.zeros(8), "e": torch.zeros(8)}
    new = {"w": torch.zeros(8), "e": torch.arange(8.0)}
    patchctx.diff_state_dicts(old, new)


@pytest.mark.parametrize("call", [_warm, _audit, _diff], ids=["warm", "audit", "diff"])
def test_an_interrupt_anywhere_in_a_call_that_turns_gradient_recording_off_puts_it_back(
    call: Callable[[], None],
) -> None:
    """`RouteCache.warm`, `audit` and `diff_state_dicts` run with gradient recording off: an
    interrupt at any line, or as any function they call starts (as the ``__exit__`` of a
    ``with torch.no_grad()`` block would), leaves it on as it was, and nothing else behind."""
    total, _ = run_with_interrupt_at(None, call, calls=True)
    assert total > 20
    for line in range(1, total + 1):
        run_with_interrupt_at(line, call, calls=True)
        assert_consistent()


@pytest.mark.parametrize("what", ["mode", "infrastructure mode", "region"])
def test_an_interrupt_anywhere_in_a_load_whose_loader_leaves_a_mode_or_region_open(
    what: str,
) -> None:
    """Taking off what the loader left open (its dispatch mode, its masked region) is
    cleanup too: an interrupt at any line of it, or as any function it calls starts, still
    leaves the thread clean and the model as before."""
    from tests.test_guard import LeavesItOpen

    before = full_state(LeavesItOpen(what, False))
    model = LeavesItOpen(what, False)
    patch = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([3.0]), torch.tensor([1]))

    def body() -> None:
        with pytest.raises(patchctx.LoaderContractError):
            load_checkpoint_weight_patches(model, [patch], routes=RouteCache())

    total, _ = run_with_interrupt_at(None, body, calls=True)
    assert total > 100
    for line in range(1, total + 1):
        model = LeavesItOpen(what, False)
        run_with_interrupt_at(line, body, calls=True)
        assert_consistent()
        assert same_state(full_state(model), before, storages=False) == [], f"line {line}"


_GRAD_MODE_MANAGERS = {
    "no_grad",
    "enable_grad",
    "set_grad_enabled",
    "_set_grad_enabled",
    "inference_mode",
}


def test_patchctx_sets_gradient_mode_only_through_its_own_helper() -> None:
    """torch's gradient-mode context managers put the mode back in Python code that a signal
    can cut short before it runs (their decorator's exit runs in torch's frames, which the
    interrupts above do not reach): patchctx sets the mode only in `patchctx._grad`."""
    import ast

    found = []
    for path in sorted(Path(PACKAGE).rglob("*.py")):
        if path.name == "_grad.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _GRAD_MODE_MANAGERS:
                found.append(f"{path.name}:{node.lineno} {node.attr}")
    assert found == []


class ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            tensor.mul_(2)
            self.w.copy_(tensor)
        return {"w"}


def test_an_interrupt_anywhere_leaves_the_callers_dense_values_as_sent() -> None:
    """A loader that writes its dense input in place: its writes are undone when the call
    ends, however it ends."""
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sent = values.clone()

    def body() -> None:
        load_checkpoint_weight_patches(
            ScalesItsInput(), [CheckpointWeightPatch("w", (4,), torch.float32, values)]
        )

    total, _ = run_with_interrupt_at(None, body, calls=True)
    assert total > 50
    for line in range(1, total + 1):
        run_with_interrupt_at(line, body, calls=True)
        assert_consistent()
        assert torch.equal(values, sent), f"line {line}: {values.tolist()}"


def _run_then_mark(body: Callable[[], object], finished: list[bool]) -> None:
    body()
    finished.append(True)


def test_a_route_cache_is_usable_after_an_interrupt_anywhere_in_its_calls() -> None:
    """Its lock is never held past an interrupt (it is not taken by a ``with`` block)."""
    model = PaddedPair()
    patch = CheckpointWeightPatch("w", (8,), torch.float32, torch.tensor([1.0]), torch.tensor([1]))
    cache = RouteCache()

    def body() -> None:
        load_checkpoint_weight_patches(model, [patch], routes=cache)
        cache.invalidate("w")
        cache.clear()

    total, _ = run_with_interrupt_at(None, body, calls=True)
    for line in range(1, total + 1):
        run_with_interrupt_at(line, body, calls=True)
        assert_consistent()
        finished: list[bool] = []
        worker = threading.Thread(target=_run_then_mark, args=(body, finished))
        worker.start()
        worker.join(timeout=10)
        assert finished, f"line {line}: the cache's lock is still held"


class Copies(nn.Module):
    """One weight, written by a plain ``copy_``: every sparse patch goes through the loader."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.w.copy_(tensor)
        return {"w"}


def test_loads_in_two_threads_at_once_leave_torchs_mode_flags_as_they_were() -> None:
    """torch's mode flags are globals of every thread: two threads' loads, interleaved, must
    not leave them set (one thread saving what the other had just set, then putting it back)."""
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def loads(seed: int) -> None:
        try:
            model = Copies()
            generator = torch.Generator().manual_seed(seed)
            start.wait()
            for _ in range(150):
                indices = torch.randperm(64, generator=generator)[:3].sort().values
                patch = CheckpointWeightPatch("w", (64,), torch.float32, torch.ones(3), indices)
                load_checkpoint_weight_patches(model, [patch])
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=loads, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert_consistent()


def test_a_region_left_from_another_thread_frees_the_lock() -> None:
    region = masked_copy()
    region.__enter__()
    done = threading.Event()

    def leave() -> None:
        region.__exit__(None, None, None)
        done.set()

    thread = threading.Thread(target=leave)
    thread.start()
    thread.join()
    assert done.is_set()
    assert_consistent()
    entered = []

    def enter() -> None:
        with masked_copy(timeout=2):
            entered.append(True)

    other = threading.Thread(target=enter)
    other.start()
    other.join()
    assert entered == [True]


def test_a_context_copied_into_another_thread_does_not_carry_the_region() -> None:
    nan = torch.full((3,), float("nan"))
    results: list[bool] = []
    with masked_copy(strategy=NaNMask()):
        context = contextvars.copy_context()

        def copy_in_other_thread() -> None:
            destination = torch.zeros(3)
            context.run(destination.copy_, nan)
            results.append(bool(torch.isnan(destination).all()))

        thread = threading.Thread(target=copy_in_other_thread)
        thread.start()
        thread.join()

        async def to_thread() -> bool:
            destination = torch.zeros(3)
            await asyncio.to_thread(destination.copy_, nan)
            return bool(torch.isnan(destination).all())

        results.append(asyncio.run(to_thread()))
    assert results == [True, True], "other threads copy plainly, even with the region's context"
    assert_consistent()


def _two_copies(m: ZooLayer, w: torch.Tensor) -> None:
    m.weight.data[:2].copy_(w[:2])
    m.weight.data[2:].copy_(w[2:])


@pytest.mark.parametrize("kind", ["load", "atomic load", "warm"])
def test_an_interrupt_at_any_line_inside_torchs_own_mode_and_grad_functions_is_survived(
    kind: str,
) -> None:
    """Injection that reaches inside torch: every line of the torch functions that change the
    thread's dispatch modes, their flags and gradient recording, and the start of every
    function patchctx calls, as well as every line of patchctx. After each run no mode is
    left and torch's mode flags are as before, and the model is as before or as after."""
    patches = [sparse([2, 9], [7.0, 8.0], torch.float32)]
    after_model = ZooLayer(_two_copies, torch.float32)
    load_checkpoint_weight_patches(after_model, patches)
    after = full_state(after_model)
    before = full_state(ZooLayer(_two_copies, torch.float32))

    def body(model: ZooLayer) -> Callable[[], object]:
        if kind == "warm":
            return lambda: RouteCache().warm(model, [("w", (4, 6), torch.float32)])
        atomic = kind == "atomic load"
        return lambda: load_checkpoint_weight_patches(model, patches, atomic=atomic)

    total, _ = run_with_interrupt_at(None, body(ZooLayer(_two_copies, torch.float32)), deep=True)
    inside_torch: list[int] = []

    def counting(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in TORCH_STATE:
            inside_torch.append(1)
        return None

    sys.settrace(counting)
    try:
        body(ZooLayer(_two_copies, torch.float32))()
    finally:
        sys.settrace(None)
    assert inside_torch, "the injection reaches no torch function"
    for line in range(1, total + 1):
        model = ZooLayer(_two_copies, torch.float32)
        run_with_interrupt_at(line, body(model), calls=True, deep=True)
        assert_consistent()
        state = full_state(model)
        as_before = same_state(state, before, storages=False)
        as_after = same_state(state, after, storages=False)
        assert as_before == [] or as_after == [], f"line {line}: half written: {as_before}"
        assert kind != "warm" or as_before == [], f"line {line}: warm wrote {as_before}"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer (POSIX)")
def test_real_sigalrm_interrupts_of_a_bounded_loop_of_loads_are_survived() -> None:
    """A real signal, not a trace function: a timer interrupts loads at whatever instruction
    it lands on (torch's C code defers it to the next bytecode), at spread-out delays, 600
    calls, atomic or not. After each call, interrupted or not, the thread is consistent and
    the model is as before the call or as after it."""
    patches = [sparse([1, 8, 23], [1.5, -2.0, 3.25], torch.float32)]
    after_model = ZooLayer(_two_copies, torch.float32)
    load_checkpoint_weight_patches(after_model, patches)
    after = full_state(after_model)
    before = full_state(ZooLayer(_two_copies, torch.float32))

    def alarm(signum: int, frame: object) -> None:
        raise Injected

    lost: list[str] = []

    def unraisable(report: Any) -> None:
        # A signal landing in a finalizer (a weak set's callback, say) is reported by Python
        # and never propagates: the call then completes. Kept only by name here, so that the
        # report's frames (and a staged tensor they hold) are freed at once.
        lost.append(type(report.exc_value).__name__)

    previous = signal.signal(signal.SIGALRM, alarm)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    interrupted = 0
    try:
        for run in range(600):
            model = ZooLayer(_two_copies, torch.float32)
            atomic = run % 2 == 1
            try:
                signal.setitimer(signal.ITIMER_REAL, 1e-5 * (1 + run % 97))
                try:
                    load_checkpoint_weight_patches(model, patches, atomic=atomic)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except Injected:
                interrupted += 1
            assert_consistent()
            state = full_state(model)
            as_before = same_state(state, before, storages=False)
            as_after = same_state(state, after, storages=False)
            assert as_before == [] or as_after == [], f"run {run}: half written: {as_before}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook
    assert interrupted > 0, "no call was interrupted"
    assert set(lost) <= {"Injected"}, lost
