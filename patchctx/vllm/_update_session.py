"""A worker's weight-update session as vLLM sees it: vLLM's own flag, the same on every worker.

vLLM's worker marks a session open from ``start_weight_update`` until a finish returns or a
call raises, and ends the mark only on the worker that raises. With several workers only the
last one raises (`patchctx.vllm._backend.agree`), so the others end the mark here.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["UpdateSession", "calling_worker"]

# vLLM's worker's "weight update in progress" flag: a private attribute of vLLM's, named once.
_VLLM_ACTIVE = "_weight_update_active"


def calling_worker() -> Any:
    """The vLLM worker creating the engine (from the caller's frames), or `None`."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame_self = frame.f_locals.get("self")
        if hasattr(frame_self, _VLLM_ACTIVE) and hasattr(frame_self, "weight_transfer_engine"):
            return frame_self
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


class UpdateSession:
    """Whether a weight-update session is open on this worker, and its end.

    Attributes:
        worker: vLLM's worker, whose flag is the session's (`None` when the engine was not
            created by one: `started` is the flag then).
        started: A session is open (vLLM's own flag, when there is no worker).
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.started = False

    def is_open(self) -> bool:
        """Whether a session is open (vLLM's worker's flag, else `started`)."""
        if self.worker is not None:
            return bool(getattr(self.worker, _VLLM_ACTIVE, False))
        return self.started

    def end(self) -> None:
        """Mark the session ended on vLLM's worker, as vLLM does on the worker that raises."""
        self.started = False
        if self.worker is not None and getattr(self.worker, _VLLM_ACTIVE, False):
            setattr(self.worker, _VLLM_ACTIVE, False)
