"""The model's structure before a loader call: which tensors it has, and their exact layout.

After the call (successful or not) the structure is compared with the snapshot. A parameter,
buffer or submodule that was replaced (``module.norm = nn.LayerNorm(...)``), deleted, rebound
(``param.data = w``), reshaped (``as_strided_``, ``t_``) or added (a new ``nn.Parameter``,
``register_buffer``, a new submodule) is put back as it was, and the load is refused: patch
loads write values in place and nothing else. A storage whose
size changed (``untyped_storage().resize_()``) cannot be put back with its contents; that is
reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from patchctx._errors import LoaderContractError

__all__ = ["Snapshot"]


def _nbytes(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@dataclass(frozen=True, slots=True)
class _Entry:
    module: torch.nn.Module
    attr: str
    name: str
    tensor: torch.Tensor
    data: torch.Tensor  # an alias of the original storage and layout, to put it back
    layout: tuple[Any, ...]
    is_parameter: bool


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
        _pointer(tensor),
        _nbytes(tensor),
    )


class Snapshot:
    """Every parameter, buffer and submodule of a model, with its layout (see module doc)."""

    def __init__(self, model: Any) -> None:
        self._entries: list[_Entry] = []
        self._members: dict[int, tuple[torch.nn.Module, str, frozenset[str]]] = {}
        # Each module's submodules by attribute, as objects: one replaced under its own name
        # (or deleted) leaves the set of names as it was.
        self._children: list[tuple[torch.nn.Module, str, str, torch.nn.Module | None]] = []
        modules = model.named_modules(remove_duplicate=False) if hasattr(model, "modules") else []
        for prefix, module in modules:
            if id(module) in self._members:
                continue
            members = frozenset([*module._parameters, *module._buffers, *module._modules])
            self._members[id(module)] = (module, prefix, members)
            for attr, child in module._modules.items():
                name = f"{prefix}.{attr}" if prefix else attr
                self._children.append((module, attr, name, child))
            for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    self._entries.append(
                        _Entry(
                            module,
                            attr,
                            name,
                            tensor,
                            tensor.data,
                            _layout(tensor),
                            attr in module._parameters,
                        )
                    )

    def restore(self) -> list[str]:
        """Put back what changed; return the qualified names that had changed (sorted)."""
        changed: set[str] = set()
        lost: set[str] = set()
        for module, prefix, members in self._members.values():
            now = [*module._parameters, *module._buffers, *module._modules]
            for attr in now:
                if attr not in members:
                    module._parameters.pop(attr, None)
                    module._buffers.pop(attr, None)
                    module._modules.pop(attr, None)
                    changed.add(f"{prefix}.{attr}" if prefix else attr)
        for module, attr, name, child in self._children:
            if attr not in module._modules or module._modules[attr] is not child:
                module._parameters.pop(attr, None)  # in case a tensor took its name
                module._buffers.pop(attr, None)
                module._modules[attr] = child
                changed.add(name)
        for entry in self._entries:
            module, attr = entry.module, entry.attr
            current = module._parameters.get(attr, module._buffers.get(attr))
            if current is not entry.tensor:
                module._parameters.pop(attr, None)
                module._buffers.pop(attr, None)
                module._modules.pop(attr, None)  # in case a submodule took its name
                if entry.is_parameter:
                    module._parameters[attr] = entry.tensor  # type: ignore[assignment]
                else:
                    module._buffers[attr] = entry.tensor
                changed.add(entry.name)
            if _layout(entry.tensor) != entry.layout:
                old_pointer, old_nbytes = entry.layout[5], entry.layout[6]
                if (_pointer(entry.data), _nbytes(entry.data)) != (old_pointer, old_nbytes):
                    # The storage itself was resized in place: its contents are gone. Give it
                    # its size back so that reading the weight cannot crash.
                    lost.add(entry.name)
                    if old_nbytes is not None:
                        entry.data.untyped_storage().resize_(old_nbytes)
                with torch.no_grad():
                    entry.tensor.data = entry.data
                changed.add(entry.name)
        if lost:
            raise LoaderContractError(
                f"the loader resized the storage of {', '.join(map(repr, sorted(lost)))} in "
                "place (untyped_storage().resize_()): its old contents are gone and cannot be "
                "put back; reload these weights"
            )
        return sorted(changed)
