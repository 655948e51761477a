"""The swap: the only code in patchctx that touches ``torch.Tensor.copy_``.

While at least one masked region is active anywhere in the process, ``torch.Tensor.copy_`` is
replaced by `_dispatching_copy_`. That function looks at the *current thread's* stack of
interceptors (a `ContextVar`): the innermost one handles the copy; with none, the copy goes to
whatever ``copy_`` was there before the swap, with its signature and return value untouched.
Other threads, and code in this thread outside a region, therefore see plain ``copy_``.

Regions are serialized by one process-global `threading.RLock` (reentrant, so regions nest in one
thread). A depth count installs the replacement on the first entry and restores the exact object
that was there before on the last exit, also when the region's body raises. If something else
replaced ``copy_`` while a region was active, the last exit warns and leaves that replacement in
place instead of clobbering it.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from typing import Final, Protocol

import torch

__all__ = [
    "CopyInterceptor",
    "active_interceptor",
    "enter",
    "is_installed",
    "leave",
    "plain_copy",
]

CopyFn = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


class CopyInterceptor(Protocol):
    """What a region puts on the thread's stack: it performs every ``copy_`` of the region."""

    def copy_(
        self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool
    ) -> torch.Tensor:
        """Perform ``destination.copy_(source, non_blocking)`` the region's way."""
        ...


def _find_builtin_copy() -> CopyFn:
    # The C implementation, wherever it sits in the MRO (``torch._C.TensorBase`` today). Used only
    # to break recursion when a foreign wrapper of copy_ calls back into ours.
    for klass in torch.Tensor.__mro__:
        candidate = klass.__dict__.get("copy_")
        if isinstance(candidate, types.MethodDescriptorType):
            return candidate
    raise ImportError("patchctx: cannot find the built-in torch.Tensor.copy_")  # pragma: no cover


_BUILTIN_COPY: Final[CopyFn] = _find_builtin_copy()
_ABSENT: Final = object()
_LOCK: Final = threading.RLock()


class _SwapState:
    """Process-global state; read and written only while holding `_LOCK`."""

    depth: int = 0
    # What ``torch.Tensor.__dict__["copy_"]`` held before our install (`_ABSENT` if nothing:
    # then copy_ was inherited and we delete our entry on restore).
    saved_entry: object = _ABSENT
    # The resolved ``torch.Tensor.copy_`` before our install: what plain copies call.
    previous: CopyFn = _BUILTIN_COPY


_state = _SwapState()
_stack: ContextVar[tuple[tuple[object, CopyInterceptor], ...]] = ContextVar(
    "patchctx_interceptors", default=()
)
# Per-thread reentrancy mark: set while this thread is inside `_dispatching_copy_`. A copy_ made
# from inside an interceptor (or from a foreign wrapper that calls back into ours) is plain.
_reentry = threading.local()


def _dispatching_copy_(
    self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    if getattr(_reentry, "inside", False):
        return _BUILTIN_COPY(self, src, non_blocking)
    stack = _stack.get()
    _reentry.inside = True
    try:
        if stack:
            return stack[-1][1].copy_(self, src, non_blocking)
        return _state.previous(self, src, non_blocking)
    finally:
        _reentry.inside = False


_dispatching_copy_.__name__ = "copy_"
_dispatching_copy_.__qualname__ = "Tensor.copy_"
_dispatching_copy_.__doc__ = _BUILTIN_COPY.__doc__


def plain_copy(
    destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """Copy without interception, whatever region is active (for interceptors' own writes)."""
    if _state.depth == 0:
        return torch.Tensor.copy_(destination, source, non_blocking)
    was_inside = getattr(_reentry, "inside", False)
    _reentry.inside = True  # a foreign wrapper that calls back into ours gets the built-in
    try:
        return _state.previous(destination, source, non_blocking)
    finally:
        _reentry.inside = was_inside


def is_installed() -> bool:
    """Whether ``torch.Tensor.copy_`` is currently our dispatching function."""
    return torch.Tensor.__dict__.get("copy_") is _dispatching_copy_


def active_interceptor() -> CopyInterceptor | None:
    """The current thread's innermost interceptor, or `None` outside every region."""
    stack = _stack.get()
    return stack[-1][1] if stack else None


def _install() -> None:
    _state.saved_entry = torch.Tensor.__dict__.get("copy_", _ABSENT)
    _state.previous = torch.Tensor.copy_
    setattr(torch.Tensor, "copy_", _dispatching_copy_)  # noqa: B010 - the swap itself


def _uninstall() -> None:
    current = torch.Tensor.__dict__.get("copy_", _ABSENT)
    if current is not _dispatching_copy_:
        warnings.warn(
            "patchctx: torch.Tensor.copy_ was replaced by other code while a masked region was "
            f"active (it is now {current!r}); leaving that replacement in place instead of "
            "restoring the original. Restore torch.Tensor.copy_ yourself once that code is done.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif _state.saved_entry is _ABSENT:
        delattr(torch.Tensor, "copy_")
    else:
        setattr(torch.Tensor, "copy_", _state.saved_entry)  # noqa: B010 - the exact restore


def enter(owner: object, interceptor: CopyInterceptor, *, timeout: float | None = None) -> None:
    """Start a region in this thread: take the global lock, install the swap, push `interceptor`.

    Args:
        owner: The object that will call `leave` (checked there, so regions exit in order).
        interceptor: What performs every ``copy_`` of this thread until the region ends.
        timeout: Seconds to wait for the global lock; `None` waits forever.

    Raises:
        TimeoutError: The lock was not free within `timeout`; nothing changed.
    """
    acquired = _LOCK.acquire() if timeout is None else _LOCK.acquire(timeout=timeout)
    if not acquired:
        raise TimeoutError(
            f"patchctx: another thread held the masked-copy lock for more than {timeout!r} s; "
            "nothing was changed"
        )
    installed_here = False
    try:
        if _state.depth == 0:
            _install()
            installed_here = True
        _stack.set((*_stack.get(), (owner, interceptor)))
        _state.depth += 1
    except BaseException:
        if installed_here:
            _uninstall()
        _LOCK.release()
        raise


def leave(owner: object) -> None:
    """End this thread's innermost region, which `owner` must have started.

    Raises:
        RuntimeError: The innermost region of this thread was not started by `owner`.
    """
    stack = _stack.get()
    if not stack or stack[-1][0] is not owner:
        raise RuntimeError(
            f"patchctx: {owner!r} is leaving a masked region it did not start last in this "
            "thread; regions must be exited in the reverse order of entry"
        )
    try:
        _stack.set(stack[:-1])
    finally:
        try:
            _state.depth -= 1
            if _state.depth == 0:
                _uninstall()
        finally:
            _LOCK.release()
