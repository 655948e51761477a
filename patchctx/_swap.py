"""The swap: the only code in patchctx that touches ``torch.Tensor.copy_``.

While at least one `masked_copy` region is open anywhere in the process, ``torch.Tensor.copy_``
is replaced by `_dispatching_copy_`. That function looks at the regions of the *current
context* (a `ContextVar` stack) and uses the innermost one that was opened **by the current
thread** and is still open; with none, the copy goes to whatever ``copy_`` was there before the
swap. Other threads, contexts copied into other threads (``asyncio.to_thread``,
``contextvars.copy_context``) and code outside a region therefore see plain ``copy_``.

Regions are serialized by one process-wide lock that one thread holds at a time and may enter
again (regions nest). The lock's whole state is the list `_held` of open regions: who holds it,
whether the swap must be installed, and whether a waiting thread may enter are all derived from
that list, and every change of it is followed by `_settle`, which makes the swap match it.
Every transition is idempotent and run twice on exit paths (``try: step() finally: step()``),
so an exception raised asynchronously at any line (``KeyboardInterrupt`` from a signal) leaves
the lock, the swap and the stack consistent. A region left from another thread than the one
that opened it is closed there, and the lock freed, instead of staying held forever.

If something else replaced ``copy_`` while a region was open, the last exit warns and leaves that
replacement in place instead of clobbering it.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import torch

from patchctx._errors import RegionError, RegionTimeoutError

__all__ = [
    "CopyInterceptor",
    "Region",
    "active_interceptor",
    "builtin_copy",
    "bypass",
    "end_bypass",
    "enter",
    "holder",
    "is_bypassed",
    "is_installed",
    "leave",
    "plain_copy",
    "release_all",
    "resume",
    "suspend",
]

CopyFn = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
_T = TypeVar("_T")


class CopyInterceptor(Protocol):
    """What a region performs every ``copy_`` of its thread with."""

    def copy_(
        self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool
    ) -> torch.Tensor:
        """Perform ``destination.copy_(source, non_blocking)`` the region's way."""
        ...


def _find_builtin_copy() -> CopyFn:
    # The C implementation, wherever it sits in the MRO (``torch._C.TensorBase`` today). Used
    # to break recursion when a foreign wrapper of copy_ calls back into ours.
    for klass in torch.Tensor.__mro__:
        candidate = klass.__dict__.get("copy_")
        if isinstance(candidate, types.MethodDescriptorType):
            return candidate
    raise ImportError("patchctx: cannot find the built-in torch.Tensor.copy_")  # pragma: no cover


_BUILTIN_COPY: Final[CopyFn] = _find_builtin_copy()
_ABSENT: Final = object()


@dataclass(eq=False)
class Region:
    """One open masked region: who opened it, in which thread, and what performs its copies."""

    owner: object
    interceptor: CopyInterceptor
    thread: int = field(default_factory=threading.get_ident)
    open: bool = True


class _Swap:
    """What the installation replaced; written only under `_cond`."""

    def __init__(self) -> None:
        self.installed = False
        # What ``torch.Tensor.__dict__["copy_"]`` held before our install (`_ABSENT`: nothing,
        # so copy_ was inherited and our entry is deleted on restore).
        self.saved_entry: object = _ABSENT
        # The resolved ``torch.Tensor.copy_`` before our install: what plain copies call.
        self.previous: CopyFn = _BUILTIN_COPY


_swap = _Swap()
# One lock guards `_held` and the swap. It is taken and released only through `_locked`, never
# by a ``with`` statement: an exception raised between a ``with`` body's last line and its
# ``__exit__`` (a signal arriving there) would leave it held.
_lock: Final = threading.RLock()
_cond: Final = threading.Condition(_lock)
_held: list[Region] = []  # the open regions, all of one thread, outermost first
_stack: ContextVar[tuple[Region, ...]] = ContextVar("patchctx_regions", default=())
# Per-thread reentrancy mark: set while this thread is inside `_dispatching_copy_`. A copy_ made
# from inside an interceptor (or from a foreign wrapper that calls back into ours) is plain.
_reentry = threading.local()


def _current(stack: tuple[Region, ...]) -> Region | None:
    me = threading.get_ident()
    for region in reversed(stack):
        if region.open and region.thread == me:
            return region
    return None


def _dispatching_copy_(
    self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    if getattr(_reentry, "inside", False):
        return _BUILTIN_COPY(self, src, non_blocking)
    region = _current(_stack.get())
    try:
        _reentry.inside = True
        if region is not None:
            result = region.interceptor.copy_(self, src, non_blocking)
        else:
            result = _swap.previous(self, src, non_blocking)
        _reentry.inside = False
        return result
    finally:
        _reentry.inside = False  # a second reset, for an exception that cut the first


_dispatching_copy_.__name__ = "copy_"
_dispatching_copy_.__qualname__ = "Tensor.copy_"
_dispatching_copy_.__doc__ = _BUILTIN_COPY.__doc__


def plain_copy(
    destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """Copy without interception, whatever region is open (for interceptors' own writes)."""
    was_inside = is_bypassed()
    try:
        bypass()
        result = _swap.previous(destination, source, non_blocking)
        end_bypass(was_inside)
        return result
    finally:
        end_bypass(was_inside)  # a second reset, for an exception that cut the first


def builtin_copy(
    destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """Patchctx's own copy of its own data: torch's ``copy_``, whatever is swapped in.

    A caller's open region (their NaNMask would keep the destination wherever patchctx's
    source holds NaN; their IntSentinel, wherever an index or byte equals the sentinel) or
    another library's replacement of ``copy_`` must not reach the buffers, replays, rollbacks
    and encodings patchctx writes itself.
    """
    return _BUILTIN_COPY(destination, source, non_blocking)


def is_bypassed() -> bool:
    """Whether this thread's ``copy_`` calls go to the built-in one (see `bypass`)."""
    return bool(getattr(_reentry, "inside", False))


def bypass() -> None:
    """From now on every ``copy_`` of this thread is the built-in one (our own writes).

    Read `is_bypassed` before; call this first thing inside a ``try``; call `end_bypass`
    with what was read both at the end of the ``try`` and in its ``finally``.
    """
    _reentry.inside = True


def end_bypass(was_inside: bool) -> None:
    """Undo `bypass` (idempotent)."""
    _reentry.inside = was_inside


def is_installed() -> bool:
    """Whether ``torch.Tensor.copy_`` is currently our dispatching function."""
    return torch.Tensor.__dict__.get("copy_") is _dispatching_copy_


def release_all(lock: Any) -> None:
    """Release every level of the ``RLock`` `lock` this thread holds (none held: nothing)."""
    while True:  # an RLock refuses a release by a thread that does not hold it
        try:
            lock.release()
        except RuntimeError:
            return


def _locked(body: Callable[[], _T], *, wait: bool = False, timeout: float | None = None) -> _T:
    """Run `body` holding `_lock`; release it on every exit, even an asynchronous one.

    With `wait`, first wait until no other thread has a region open; `timeout` bounds that
    wait (`TimeoutError`).
    """
    try:
        _lock.acquire()
        if wait:
            me = threading.get_ident()
            if not _cond.wait_for(lambda: not _held or _held[0].thread == me, timeout):
                raise RegionTimeoutError(
                    f"patchctx: another thread held the masked-copy lock for more than "
                    f"{timeout!r} s; nothing was changed"
                )
        result = body()
        release_all(_lock)
        return result
    except BaseException:
        release_all(_lock)
        raise
    finally:
        release_all(_lock)  # a second release, for an exception that cut the first


def holder() -> int | None:
    """The thread that holds the region lock, or `None` when it is free."""
    held = list(_held)
    return held[0].thread if held else None


def active_interceptor() -> CopyInterceptor | None:
    """The current thread's innermost open interceptor, or `None` outside every region."""
    region = _current(_stack.get())
    return None if region is None else region.interceptor


def _settle() -> None:
    """Make the swap match `_held` (under `_cond`): installed iff a region is open.

    Reads what ``torch.Tensor`` holds rather than trusting a flag alone, so a settle cut short
    by an asynchronous exception is completed by the next one.
    """
    current = torch.Tensor.__dict__.get("copy_", _ABSENT)
    ours = current is _dispatching_copy_
    if _held:
        if not _swap.installed:
            if not ours:  # what we replace, once
                _swap.saved_entry = current
                _swap.previous = torch.Tensor.copy_
                setattr(torch.Tensor, "copy_", _dispatching_copy_)  # noqa: B010 - the swap
            _swap.installed = True
        return
    if ours:
        if _swap.saved_entry is _ABSENT:
            delattr(torch.Tensor, "copy_")
        else:
            setattr(torch.Tensor, "copy_", _swap.saved_entry)  # noqa: B010 - exact restore
    elif _swap.installed and current is not _swap.saved_entry:
        warnings.warn(
            "patchctx: torch.Tensor.copy_ was replaced by other code while a masked region "
            f"was open (it is now {current!r}); leaving that replacement in place instead "
            "of restoring the original. Restore torch.Tensor.copy_ yourself once that code "
            "is done.",
            RuntimeWarning,
            stacklevel=4,
        )
    _swap.installed = False
    _swap.previous = _BUILTIN_COPY


def _close(region: Region) -> None:
    """Close `region` and release its hold (idempotent; any thread)."""

    def close() -> None:
        region.open = False
        if region in _held:
            _held.remove(region)
        _settle()
        _cond.notify_all()

    _locked(close)


def enter(region: Region, *, timeout: float | None = None) -> None:
    """Open `region` in this thread: take the lock, install the swap, push the region.

    On any failure the region is closed again, so the caller, which holds `region` from
    before the call, can always `leave` it (idempotent) without knowing how far this got.

    Raises:
        TimeoutError: Another thread held the lock longer than `timeout`; nothing changed.
    """

    def hold() -> None:
        _held.append(region)
        _settle()

    pushed = False
    try:
        _locked(hold, wait=True, timeout=timeout)
        _stack.set((*_stack.get(), region))
        pushed = True
    except BaseException:
        _close(region)
        raise
    finally:
        if not pushed:
            _close(region)  # a second close, for an exception that cut the first


def innermost(owner: object) -> Region:
    """The region `owner` opened last in this context, or else in any thread.

    Raises:
        RuntimeError: `owner` has no open region, or a region opened after its own is still
            open in this thread (regions close in the reverse order of opening).
    """
    region = _current(_stack.get())
    if region is not None:
        if region.owner is not owner:
            raise RegionError(
                f"patchctx: {owner!r} is leaving a masked region it did not open last in this "
                "thread; regions must be left in the reverse order of entry"
            )
        return region
    # Left from another thread (or another context): close the owner's innermost region.
    for candidate in reversed(list(_held)):
        if candidate.owner is owner:
            return candidate
    raise RegionError(f"patchctx: {owner!r} has no open masked region to leave")


def leave(region: Region) -> None:
    """Close `region`, from any thread (idempotent: callers call it twice on exit paths)."""
    _close(region)
    stack = _stack.get()
    if region in stack:
        _stack.set(tuple(r for r in stack if r is not region and r.open))


def suspend() -> tuple[Region, ...]:
    """From now on this thread's open regions do not apply; returns them for `resume`."""
    regions = _stack.get()
    _stack.set(())
    return regions


def resume(regions: tuple[Region, ...], left: list[str]) -> None:
    """Undo `suspend` (idempotent), closing the regions opened since that are still open.

    Code that ran in between (a loader) and opened a region without closing it would keep
    the lock, and the swap, past the call: each such region is closed and described in
    `left`, for the caller to refuse the call with.
    """
    for region in _stack.get():
        if all(region is not kept for kept in regions):
            if region.open:
                left.append(f"{region.owner!r} (a masked region it opened)")
            _close(region)  # (again if closed: a close cut short is completed)
    _stack.set(regions)
