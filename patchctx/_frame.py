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
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
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

    def enter(self) -> None:
        """Suspend this thread's masked regions and push `mode` (see `leave`)."""
        self.regions = _swap.suspend()
        self.mode.__enter__()  # type: ignore[no-untyped-call]

    def leave(self) -> None:
        """Undo `enter`, and whatever the loader left changed; idempotent."""
        set_recording(self.recording)
        self._leave_modes()
        if self.regions is not None:
            _swap.resume(self.regions, self.left)

    def left_open(self) -> str | None:
        """What the loader left open on the thread (taken off it now), or `None`."""
        return f"the loader left {', '.join(self.left)} open" if self.left else None

    def _leave_modes(self) -> None:
        """Take `mode` off the thread's dispatch modes, with every mode entered since it.

        Each mode that is not in `below` is popped without running its code (its ``__exit__``
        is the loader's); `mode`'s own exit puts torch's mode flags back as they were when it
        was entered. Infrastructure modes sit in slots of their own, listed below every user
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
                self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            else:
                self.left.append(f"{type(top).__name__} (a dispatch mode it entered)")
                _pop_mode(top.__dict__.get("_mode_key"))
