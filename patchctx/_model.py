"""What patchctx needs from a model, as a protocol, and how it finds the model's tensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from patchctx._errors import InvalidPatchTypeError, PatchProblem

__all__ = [
    "SupportsLoadWeights",
    "as_module",
    "check_model",
    "model_tensors",
    "read_names",
    "slot_dicts",
]


def slot_dicts(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """`module`'s own parameter, buffer and submodule slots: torch's private dicts themselves.

    The one place patchctx reads ``torch.nn.Module``'s private state: walks read the dicts
    (``named_parameters()`` and its kin are generators, several times slower) and a snapshot
    puts them back.
    """
    return module._parameters, module._buffers, module._modules


@runtime_checkable
class SupportsLoadWeights(Protocol):
    """What patchctx needs from a model: its loader, and the tensors the loader writes.

    Every vLLM model satisfies it, and so does any ``torch.nn.Module`` with a ``load_weights``
    method. Anything else (an adapter around a model whose loader has another name, say) needs
    these two methods:

    - ``load_weights(weights)`` takes a list of ``(checkpoint name, tensor)`` pairs and writes
      each tensor into the model's parameters, mapping checkpoint coordinates to runtime ones;
      it returns the names it loaded (any iterable of them, a generator included: patchctx
      reads it to the end inside the load), or `None`. patchctx calls it once per chunk of
      patches.
    - ``named_parameters()`` yields ``(qualified name, tensor)`` for every tensor the loader may
      write. patchctx guards exactly these (masked writes, refusals, routes, undo): a write of
      sparse staged data into any other lasting tensor is refused. An object that also has
      ``named_buffers()`` has its buffers guarded too. The names are those ``protect=`` takes.

    For a ``torch.nn.Module``, tied parameters are listed under each of their names.

    Examples:
        A Hugging Face ``transformers`` model has no ``load_weights``, but its parameter names
        are the checkpoint's names: `LoadByName` is the adapter it takes, a class of a few
        lines written against this protocol (the vLLM lane runs it on a real ``transformers``
        model).

        >>> import torch
        >>> from patchctx import LoadByName, SupportsLoadWeights
        >>> isinstance(LoadByName(torch.nn.Linear(2, 2)), SupportsLoadWeights)
        True
        >>> isinstance(torch.nn.Linear(2, 2), SupportsLoadWeights)  # no load_weights
        False
    """

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], /) -> Iterable[str] | None:
        """Write the ``(checkpoint name, tensor)`` pairs into the model; return the names."""
        ...

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor ``load_weights`` may write, by qualified name."""
        ...


def check_model(model: object, where: str) -> None:
    """Refuse, before any work, a model that lacks what `SupportsLoadWeights` states."""
    missing = [
        method
        for method in ("load_weights", "named_parameters")
        if not callable(getattr(model, method, None))
    ]
    if missing:
        raise InvalidPatchTypeError(
            [
                PatchProblem(
                    None,
                    "",
                    f"{where}: model must have {' and '.join(f'a {m}() method' for m in missing)} "
                    f"(see SupportsLoadWeights); {type(model).__name__} has not",
                    is_type_error=True,
                )
            ]
        )


def read_names(loaded: Iterable[str] | None) -> set[str]:
    """The names one ``load_weights`` call returned, read to the end now.

    A loader written as a generator, or returning any other lazy iterable (``map``, an
    iterator, an object whose ``__iter__`` does the work), runs its body only while its result
    is read. So every caller reads the result here, where the loader call itself runs (inside
    the guard, before the staged data is dropped), never later. An iterator left unfinished by
    an error is closed here too, so that its ``finally`` blocks run where the loader ran.

    Args:
        loaded: What ``load_weights`` returned; `None` counts as no names.

    Returns:
        The names, as a set.

    Raises:
        TypeError: `loaded` is not iterable, or holds an unhashable item.
        BaseException: Whatever the loader's body raised while it was read.
    """
    if loaded is None:
        return set()
    iterator = iter(loaded)
    try:
        return set(iterator)
    except BaseException:
        close = getattr(iterator, "close", None)
        if callable(close):  # a generator suspended at the item that failed
            close()
        raise


def model_tensors(model: SupportsLoadWeights) -> dict[str, torch.Tensor]:
    """Every tensor of `model` the loader may write, by qualified name."""
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(model, torch.nn.Module):
        tensors.update(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        return tensors
    tensors.update(model.named_parameters())
    named_buffers = getattr(model, "named_buffers", None)
    if callable(named_buffers):
        tensors.update(named_buffers())
    return tensors


class _Adapted(torch.nn.Module):
    """A model that is not a ``torch.nn.Module``, seen as one by the load session.

    Its tensors are registered as buffers under their qualified names, so the session finds
    them, snapshots their storages (a loader that rebinds ``tensor.data`` is undone and refused)
    and names them in messages; ``load_weights`` is the model's own.
    """

    def __init__(self, model: SupportsLoadWeights) -> None:
        super().__init__()
        self.adapted = model
        for name, tensor in model_tensors(model).items():
            self._buffers[name] = tensor

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> Iterable[str] | None:
        return self.adapted.load_weights(weights)


def as_module(model: SupportsLoadWeights) -> torch.nn.Module:
    """`model` itself when it is a ``torch.nn.Module``; otherwise a module that stands for it."""
    if isinstance(model, torch.nn.Module):
        return model
    return _Adapted(model)
