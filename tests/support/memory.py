"""Deterministic probes of what a piece of Python does with tensors: memory and host reads.

Both are `TorchFunctionMode`s, so they see every torch function and tensor method the code
under test calls (a `TorchDispatchMode` would too, but its first use imports torch._dynamo,
which costs seconds).

- `AllocationTracker`: every tensor a call returns is looked at; a storage not seen before
  (and not one of the `preexisting` inputs) counts as allocated, and as freed when the last
  tensor the tracker saw on it is garbage collected (CPython frees at once, so the count
  follows the program exactly). Scratch memory inside one kernel is not seen; everything the
  Python code holds on to is.
- `HostReads`: every call that reads tensor data on the host (``tolist``, ``item``,
  ``bool(t)``, ``torch.nonzero``, ...), which on an accelerator is a synchronisation.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _tensors(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [item for part in result for item in _tensors(part)]
    return []


class AllocationTracker(TorchFunctionMode):
    """Live and peak bytes of the storages created by torch calls while the mode is active."""

    def __init__(self, preexisting: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._preexisting = {t.untyped_storage().data_ptr() for t in preexisting}
        self._references: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for item in _tensors(result):
            self._track(item)
        return result

    def _track(self, tensor: torch.Tensor) -> None:
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return  # a wrapper (patchctx's staged data): its inner tensors are tracked instead
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._preexisting:
            return
        if key not in self._references:
            self._references[key] = 0
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._references[key] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        self._references[key] -= 1
        if self._references[key] == 0:
            del self._references[key]
            self.live -= self._sizes.pop(key)


class HostReads(TorchFunctionMode):
    """The names of the torch calls that read tensor data on the host, in order."""

    READS = frozenset(
        {
            "tolist",
            "item",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "unique",
            "masked_select",
            "equal",
            "allclose",
            "numpy",
            "cpu",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
