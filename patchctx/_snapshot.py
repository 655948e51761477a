"""The model's structure before a loader call: which tensors it has, and their exact layout.

After the call (successful or not) the structure is compared with the snapshot. A parameter,
buffer or submodule that was replaced (``module.norm = nn.LayerNorm(...)``), deleted, rebound
(``param.data = w``), reshaped (``as_strided_``, ``t_``) or added (a new ``nn.Parameter``,
``register_buffer``, a new submodule, a slot registered as ``None`` filled, as
``nn.Linear(bias=False)``'s bias) is put back as it was, and the load is refused: patch
loads write values in place and nothing else. So is every other part of a slot: whether it
holds a parameter or a buffer, a buffer's persistence (``state_dict``), ``requires_grad``, an
instance attribute that shadows it (``del m.w; m.w = tensor``), and the order of the slots
(put back silently). A storage whose size changed (``untyped_storage().resize_()``) cannot be
put back with its contents; that is reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from patchctx._errors import LoaderContractError
from patchctx._model import slot_dicts

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
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class _Empty:
    """A parameter or buffer slot registered as ``None``."""

    module: torch.nn.Module
    attr: str
    name: str
    is_parameter: bool


@dataclass(frozen=True, slots=True)
class _Slots:
    """One module's slots: their names in order, persistence, and attributes that shadow them."""

    module: torch.nn.Module
    prefix: str
    order: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # parameters, buffers, modules
    members: frozenset[str]
    non_persistent: frozenset[str]
    unshadowed: tuple[str, ...]  # the slot names not also in the instance dict (all, normally)

    def qualified(self, attr: str) -> str:
        return f"{self.prefix}.{attr}" if self.prefix else attr


def _non_persistent(module: torch.nn.Module) -> set[str]:
    found = module.__dict__.get("_non_persistent_buffers_set")
    return found if isinstance(found, set) else set()


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
        self._empty: list[_Empty] = []
        self._members: dict[int, _Slots] = {}
        # Each module's submodules by attribute, as objects: one replaced under its own name
        # (or deleted) leaves the set of names as it was.
        self._children: list[tuple[torch.nn.Module, str, str, torch.nn.Module | None]] = []
        modules = model.named_modules(remove_duplicate=False) if hasattr(model, "modules") else []
        for prefix, module in modules:
            if id(module) in self._members:
                continue
            params, buffers, children = slot_dicts(module)
            order = (tuple(params), tuple(buffers), tuple(children))
            members = frozenset().union(*order)
            slots = _Slots(
                module,
                prefix,
                order,
                members,
                frozenset(_non_persistent(module)),
                tuple(attr for attr in members if attr not in module.__dict__),
            )
            self._members[id(module)] = slots
            for attr, child in children.items():
                self._children.append((module, attr, slots.qualified(attr), child))
            for attr, tensor in [*params.items(), *buffers.items()]:
                is_parameter = attr in params
                if tensor is None:
                    self._empty.append(_Empty(module, attr, slots.qualified(attr), is_parameter))
                    continue
                self._entries.append(
                    _Entry(
                        module,
                        attr,
                        slots.qualified(attr),
                        tensor,
                        tensor.data,
                        _layout(tensor),
                        is_parameter,
                        tensor.requires_grad,
                    )
                )

    def restore(self) -> list[str]:
        """Put back what changed; return the qualified names that had changed (sorted)."""
        changed: set[str] = set()
        lost: set[str] = set()
        for slots in self._members.values():
            dicts = slot_dicts(slots.module)
            for attr in [*dicts[0], *dicts[1], *dicts[2]]:
                if attr not in slots.members:
                    for slot in dicts:
                        slot.pop(attr, None)
                    changed.add(slots.qualified(attr))
        for module, attr, name, child in self._children:
            params, buffers, children = slot_dicts(module)
            if attr not in children or children[attr] is not child:
                params.pop(attr, None)  # in case a tensor took its name
                buffers.pop(attr, None)
                children[attr] = child
                changed.add(name)
        for entry in self._entries:
            if _put(entry.module, entry.attr, entry.tensor, is_parameter=entry.is_parameter):
                changed.add(entry.name)
            if entry.tensor.requires_grad != entry.requires_grad:
                entry.tensor.requires_grad_(entry.requires_grad)
                changed.add(entry.name)
            if _layout(entry.tensor) != entry.layout:
                old_pointer, old_nbytes = entry.layout[5], entry.layout[6]
                if (_pointer(entry.data), _nbytes(entry.data)) != (old_pointer, old_nbytes):
                    # The storage itself was resized in place: its contents are gone. Give it
                    # its size back so that reading the weight cannot crash, and zero it, so
                    # that it holds no uninitialised memory (what the error says it holds).
                    lost.add(entry.name)
                    if old_nbytes is not None:
                        storage = entry.data.untyped_storage()
                        storage.resize_(old_nbytes)
                        as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device)
                        as_bytes.set_(storage).zero_()
                entry.tensor.data = entry.data  # (in any gradient mode: no operation)
                changed.add(entry.name)
        for empty in self._empty:
            if _put(empty.module, empty.attr, None, is_parameter=empty.is_parameter):
                changed.add(empty.name)
        for slots in self._members.values():
            changed.update(_restore_slots(slots))
        if lost:
            raise LoaderContractError(
                f"the loader resized the storage of {', '.join(map(repr, sorted(lost)))} in "
                "place (untyped_storage().resize_()): its old contents are gone and cannot be "
                "put back, even with atomic=True (no torch operation shows the resize, so no "
                "undo log can keep them). Its size was put back and it was zeroed; every other "
                "tensor is as before. Reload these weights"
            )
        return sorted(changed)


def _put(
    module: torch.nn.Module, attr: str, value: torch.Tensor | None, *, is_parameter: bool
) -> bool:
    """Hold `value` in `module`'s parameter (or buffer) slot `attr`, and only there.

    Returns:
        Whether anything had to be put back.
    """
    params, buffers, children = slot_dicts(module)
    home, other = (params, buffers) if is_parameter else (buffers, params)
    if attr in home and home[attr] is value and attr not in other and attr not in children:
        return False
    other.pop(attr, None)
    children.pop(attr, None)  # in case a submodule took its name
    home[attr] = value
    return True


def _restore_slots(slots: _Slots) -> set[str]:
    """Put back one module's buffer persistence, unshadow its slots, and restore their order.

    Returns:
        The qualified names that had changed (an order changed alone is not reported: it is
        what putting a slot back does).
    """
    module = slots.module
    changed: set[str] = set()
    non_persistent = module.__dict__.get("_non_persistent_buffers_set")
    if isinstance(non_persistent, set) and non_persistent != slots.non_persistent:
        changed.update(map(slots.qualified, non_persistent ^ slots.non_persistent))
        non_persistent.clear()
        non_persistent.update(slots.non_persistent)
    for attr in slots.unshadowed:
        if attr in module.__dict__:  # `del m.w; m.w = tensor`: a plain attribute hides the slot
            del module.__dict__[attr]
            changed.add(slots.qualified(attr))
    for now, order in zip(slot_dicts(module), slots.order, strict=True):
        if tuple(now) != order and now.keys() == set(order):
            held = dict(now)
            now.clear()
            now.update((attr, held[attr]) for attr in order)
    return changed
