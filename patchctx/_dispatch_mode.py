"""A dispatch-mode base that does not import ``torch._dynamo`` on its first use.

torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in
``torch._disable_dynamo``, so that Dynamo never compiles the mode's own frames. That wrapper
imports ``torch._dynamo`` on the first call: 1.5 to 5 s on a 2-core CPU, paid by the first
patch load of a process. Dynamo can only compile a frame once it is imported (its frame hook
is its own), so `DispatchMode` calls the handler directly while ``torch._dynamo`` is not in
``sys.modules`` and through ``torch._dynamo.disable`` once it is: the same protection, without
the import.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchMode"]


def _skip_dynamo_once_loaded(handler: Callable[..., Any]) -> Callable[..., Any]:
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(handler)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None or not hasattr(dynamo, "disable"):  # absent or half imported
                return handler(*args, **kwargs)
            disabled.append(dynamo.disable(handler, recursive=True, wrapping=False))
        return disabled[0](*args, **kwargs)

    return dispatch


class DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """`TorchDispatchMode` whose handler skips Dynamo without importing it (see the module)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's own wrapper off: `__init_subclass__` puts ours in its place

    def __init_subclass__(cls, **kwargs: Any) -> None:
        handler = cls.__dict__.get("__torch_dispatch__")  # before any wrapper of torch's
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]
        if callable(handler):
            cls.__torch_dispatch__ = _skip_dynamo_once_loaded(handler)  # type: ignore[method-assign]
