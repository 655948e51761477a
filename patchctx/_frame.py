"""A loader call's frame on its thread: what entering it changes, put back as it ends.

Around the model's ``load_weights`` (a patch load's, or a dry run's) patchctx suspends the
thread's masked regions and pushes a dispatch mode of its own. The loader may change the
thread too, and not put it back: turn gradient recording on, enter a dispatch mode (a user
mode, or an infrastructure one such as ``FakeTensorMode``) or open a masked region and never
leave it. `Frame.leave` puts all of it back as it was before the loader ran, and names what
the loader left open (`Frame.left_open`) for the caller to refuse the call with: left there,
a mode would sit above patchctx's and see every later operation of the thread, and a region
would hold the region lock and the ``copy_`` swap for good. Recording goes back off so that
patchctx's own later writes (a rollback, an atomic call's undo, route replays) never fail
on weights that require gradients.

Every step of `Frame.leave` is idempotent, so that callers run it twice on every exit path
(an interrupt that cuts the first short is completed by the second; see `patchctx._session`).
patchctx's own mode is pushed and popped without ``TorchDispatchMode.__enter__`` and
``__exit__``: these keep torch's mode flags as stacks of old values, which an exit cut short
between its pops and its pop of the mode would pop twice on a second attempt (an
``IndexError``, the mode left on the thread). The flags are module globals shared by every
thread, so saving and restoring them per call would let two threads' calls, interleaved,
leave them set for good (one thread saving what the other had just set). Here they are held
for all threads together: the first frame to enter saves them (by assignment, before any is
changed), every frame sets them, and the last frame to leave puts the saved values back, as
often as it takes.
"""

from __future__ import annotations

import torch
import torch.utils._python_dispatch as _dispatch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from patchctx import _swap
from patchctx._grad import set_recording

__all__ = ["Frame"]


class Frame:
    """The thread's state around one loader call, under `mode` (patchctx's guard)."""

    def __init__(self, mode: TorchDispatchMode) -> None:
        self.mode = mode
        self.recording = torch.is_grad_enabled()
        self.below = _get_current_dispatch_mode_stack()  # the thread's modes before `mode`
        self.regions: tuple[_swap.Region, ...] | None = None
        self.left: list[str] = []  # what the loader left open, described
        self.entered = False  # counted among the frames that hold torch's mode flags

    def enter(self) -> None:
        """Suspend this thread's masked regions and push `mode` (see `leave`)."""
        self.regions = _swap.suspend()
        if not _HOLDERS:  # the first frame of all threads: the flags as nothing set them
            _SAVED.update({name: _FLAGS_NOW[name] for name in _FLAGS if name in _FLAGS_NOW})
        self.entered = True  # before the append: an interrupt between them leaves no holder
        _HOLDERS.append(self)  # (list operations are atomic: no lock for `leave` to be cut in)
        flags = _SAVED
        mode = self.mode
        # What ``TorchDispatchMode.__enter__`` sets, in torch's module of modes.
        if _FLAGS[0] in flags:
            _dispatch._is_in_torch_dispatch_mode = True
        if _FLAGS[1] in flags:
            _dispatch._is_in_non_infra_torch_dispatch_mode = bool(
                flags[_FLAGS[1]] or not _asks(mode, "is_infra_mode")
            )
        if _FLAGS[2] in flags:
            value = bool(flags[_FLAGS[2]] or not _asks(mode, "ignore_compile_internals"))
            _dispatch._is_in_any_mode_without_ignore_compile_internals = value
            if _SET_COMPILE_FLAG is not None:
                _SET_COMPILE_FLAG(value)
        _push_mode(mode)

    def leave(self) -> None:
        """Undo `enter`, and whatever the loader left changed; idempotent."""
        set_recording(self.recording)
        self._leave_modes()
        self._restore_flags()
        if self.regions is not None:
            _swap.resume(self.regions, self.left)

    def left_open(self) -> str | None:
        """What the loader left open on the thread (taken off it now), or `None`."""
        return f"the loader left {', '.join(self.left)} open" if self.left else None

    def _leave_modes(self) -> None:
        """Take `mode` off the thread's dispatch modes, with every mode entered since it.

        Each mode that is not in `below` is popped without running its code (its ``__exit__``
        is the loader's); `_restore_flags` then puts torch's mode flags back as they were
        before `enter`. Infrastructure modes sit in slots of their own, listed below every user
        mode: the last mode listed that is not in `below` is always one that can be popped.
        """
        while True:
            entered = [
                entry
                for entry in _get_current_dispatch_mode_stack()
                if all(entry is not kept for kept in self.below)
            ]
            if not entered:
                return
            top = entered[-1]
            if top is self.mode:
                _pop_mode(None)  # (patchctx's modes have no dispatch key of their own)
            else:
                self.left.append(f"{type(top).__name__} (a dispatch mode it entered)")
                _pop_mode(top.__dict__.get("_mode_key"))

    def _restore_flags(self) -> None:
        """Once no frame of any thread holds torch's mode flags, put back what the first saw.

        Idempotent: this frame leaves the holders once, and the values are assigned.
        """
        if not self.entered:
            return
        if self in _HOLDERS:  # (only this frame removes itself)
            _HOLDERS.remove(self)
        if _HOLDERS:
            return  # another thread's frame still holds them
        for name, value in _SAVED.items():
            setattr(_dispatch, name, value)
        if _SET_COMPILE_FLAG is not None and _FLAGS[2] in _SAVED:
            _SET_COMPILE_FLAG(bool(_SAVED[_FLAGS[2]]))


# torch's mode flags, module globals that ``TorchDispatchMode.__enter__`` sets (those of this
# torch version: older ones have fewer), and the C-level copy of the last one.
_FLAGS = (
    "_is_in_torch_dispatch_mode",
    "_is_in_non_infra_torch_dispatch_mode",
    "_is_in_any_mode_without_ignore_compile_internals",
)
_FLAGS_NOW = vars(_dispatch)
# The frames, of every thread, that hold torch's mode flags set, and the flags' values before
# the first of them. No lock: a lock held by a frame an interrupt (or a finalizer run by the
# garbage collector) cuts short would stop every other thread; list operations are atomic,
# and two first frames racing save the same values (neither has set a flag yet).
_HOLDERS: list[Frame] = []
_SAVED: dict[str, object] = {}
_SET_COMPILE_FLAG = getattr(_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)


def _asks(mode: TorchDispatchMode, question: str) -> bool:
    """A mode's class answer (``is_infra_mode``, ``ignore_compile_internals``): False if none."""
    answer = getattr(type(mode), question, None)
    return bool(answer()) if callable(answer) else False
