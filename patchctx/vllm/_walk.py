"""One walk of a vLLM model shared by the checks of one apply; attribute reads made cheap.

Each apply of a worker reads facts from the live model: whether vLLM's layerwise reload is under
way, which weights the engine transformed, which embedding names are tied, which layers to
repack. Each used to walk the module tree itself, and most of their time went to
``getattr(module, name, None)`` on attributes a module does not have: torch's
``Module.__getattr__`` builds an exception message for each. The facts are read again, in
full, in every apply (nothing is cached between applies, so nothing can be stale): the walk is
shared, and `attribute` returns what ``getattr`` would, faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["ModelWalk", "attribute"]

_MISSING = object()
_MODULE_GETATTR = torch.nn.Module.__getattr__
_STORES = ("_parameters", "_buffers", "_modules")


def attribute(obj: object, name: str) -> object:
    """``getattr(obj, name, None)``, without torch's cost for a module lacking `name`.

    For a ``torch.nn.Module`` whose class (and metaclass) define nothing named `name` and keep
    Python's and torch's attribute look-up, the value is the instance's own attribute, else
    its parameter, buffer or submodule of that name, else `None`: exactly what ``getattr``
    finds in that case. Anything else goes through ``getattr``.

    Examples:
        >>> import torch
        >>> from patchctx.vllm._walk import attribute
        >>> layer = torch.nn.Linear(2, 2)
        >>> attribute(layer, "weight") is layer.weight, attribute(layer, "cpu_linear")
        (True, None)
    """
    kind = type(obj)
    if (
        getattr(kind, "__getattr__", None) is _MODULE_GETATTR
        and kind.__getattribute__ is object.__getattribute__
        and getattr(kind, name, _MISSING) is _MISSING
    ):
        own = obj.__dict__
        if name in own:
            return own[name]
        for store in _STORES:
            members = own.get(store)
            if members is not None and name in members:
                return members[name]
        return None
    return getattr(obj, name, None)


@dataclass
class ModelWalk:
    """The module tree and the parameters of a model, listed once.

    Attributes:
        modules: ``model.named_modules(remove_duplicate=False)``: every module under every
            name it has, in module order.
        params: ``model.named_parameters(remove_duplicate=False)``, by name.

    Examples:
        >>> import torch
        >>> from patchctx.vllm._walk import ModelWalk
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> model.add_module("again", model[0])  # one module under two names
        >>> walk = ModelWalk.of(model)
        >>> [name for name, _ in walk.modules], [name for name, _ in walk.unique_modules()]
        (['', '0', 'again'], ['', '0'])
    """

    modules: list[tuple[str, torch.nn.Module]]
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelWalk:
        """Walk `model` now."""
        return cls(
            list(model.named_modules(remove_duplicate=False)),
            dict(model.named_parameters(remove_duplicate=False)),
        )

    def unique_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """``model.named_modules()``: each module once, under the first name it has.

        The first appearances in a walk that keeps duplicates are those of a walk that skips
        them: a skipped module's submodules were all listed under its first name.
        """
        seen: set[int] = set()
        for name, module in self.modules:
            if id(module) not in seen:
                seen.add(id(module))
                yield name, module
