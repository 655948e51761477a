"""The op rules, one table: what each ATen operation does to the tensors it is given.

Which arguments it writes, which ops move, rearrange or only reshape elements, which let values
out of torch: read alike by the staged data, the guard, the write ledger and the dry run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "LAYOUT",
    "LIFTS",
    "LIKE",
    "LISTS",
    "MOVES",
    "PURE_WRITES",
    "RESHAPING",
    "accumulates",
    "argument",
    "host_reads",
    "leak_kind",
    "tensors_in",
    "written_arguments",
]

aten = torch.ops.aten


def _schema_writes(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    return tuple(
        (position, slot.name)
        for position, slot in enumerate(func._schema.arguments)
        if slot.alias_info is not None and slot.alias_info.is_write
    )


_WRITTEN: dict[torch._ops.OpOverload, tuple[tuple[int, str], ...]] = {}


def written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the operation writes, from its schema."""
    found = _WRITTEN.get(func)
    if found is None:
        found = _WRITTEN[func] = _schema_writes(func)
    return found


def tensors_in(value: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def argument(args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


# Operations that rearrange or cast elements without combining them (staged data's mask goes
# along); their data argument is `self`, or the tensor list of cat/stack (position 0).
LAYOUT = frozenset(
    {
        aten._to_copy,
        aten.cat,
        aten.stack,
        aten.hstack,
        aten.vstack,
        aten.index_select,
        aten.index,
        aten.gather,
        aten.repeat,
        aten.repeat_interleave,
        aten.flip,
        aten.roll,
        aten.narrow_copy,
        aten.slice_copy,
        aten.select_copy,
        aten.t_copy,
        aten.transpose_copy,
        aten.permute_copy,
        aten.expand_copy,
        aten.view_copy,
        aten.unsqueeze_copy,
        aten.squeeze_copy,
        aten.alias_copy,
        aten.detach_copy,
        aten.unfold_copy,
        aten._unsafe_view,
        aten.masked_select,
        aten.take,
        aten.tril,
        aten.triu,
    }
)
LISTS = frozenset({aten.cat, aten.stack, aten.hstack, aten.vstack})
# Factories shaped like their input: values that are known (True) or undefined (False).
LIKE = {
    aten.zeros_like: True,
    aten.ones_like: True,
    aten.full_like: True,
    aten.rand_like: True,
    aten.randn_like: True,
    aten.randint_like: True,
    aten.empty_like: False,
    aten.new_empty: False,
    aten.new_empty_strided: False,
    aten.new_zeros: True,
    aten.new_ones: True,
    aten.new_full: True,
}
# Writes that move elements from a data argument into `self` without reading `self`'s old
# values at the positions they write: (positions of the data arguments).
MOVES: dict[Any, tuple[int, ...]] = {
    aten.copy_: (1,),
    aten.index_put_: (2,),
    aten._index_put_impl_: (2,),
    aten.index_copy_: (3,),
    aten.masked_scatter_: (2,),
    aten.scatter_: (3,),
    aten.fill_: (1,),
    aten.index_fill_: (3,),
    aten.masked_fill_: (2,),
}


def accumulates(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if func.overloadpacket not in (aten.index_put_, aten._index_put_impl_):
        return bool(func.overloadpacket is aten.scatter_ and "reduce" in kwargs)
    value = argument(args, kwargs, 3, "accumulate")
    return bool(value)


# What an operation returns to Python that is not a tensor: a value that has left torch.
_SCALAR_RETURNS = frozenset({"bool", "number", "float", "Scalar", "complex"})


@functools.cache
def leak_kind(func: torch._ops.OpOverload) -> str | None:
    """How `func` lets values out of torch, per op (asked once).

    "all" its staged inputs (a Python scalar, or a shape that depends on them), only its
    "indices" or its "mask" (for the shape), or `None`.
    """
    tags = func.tags
    if torch.Tag.data_dependent_output in tags or any(
        str(r.type) in _SCALAR_RETURNS for r in func._schema.returns
    ):
        return "all"
    if torch.Tag.dynamic_output_shape not in tags:
        return None
    packet = func.overloadpacket
    if packet in (aten.index, aten._unsafe_index):
        return "indices"
    return "mask" if packet is aten.masked_select else "all"


# In-place operations that change a tensor's shape, strides or storage rather than its values.
RESHAPING = frozenset(
    {
        aten.set_,
        aten.resize_,
        aten.resize_as_,
        aten.as_strided_,
        aten.t_,
        aten.transpose_,
        aten.squeeze_,
        aten.unsqueeze_,
        aten.swapdims_,
        aten.swapaxes_,
        aten.detach_,
        aten._resize_output_,
    }
)


def host_reads(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors whose values `func` hands to Python: what the loader may decide on.

    A value leaves torch (``.item()``, ``bool(t)``, ``torch.equal``, ``allclose``: under
    ``inference_mode`` as ``aten.item`` itself), or a result's shape depends on values
    (``nonzero``, ``unique``, a boolean-mask index: the tensors that decide it), which the
    loader reads with ``.shape`` or ``numel()`` and no operation at all. The staged data's
    own rule (`patchctx._staged._leak_kind`) says which.
    """
    kind = leak_kind(func)
    if kind is None:
        return []
    return tensors_in((args, kwargs) if kind == "all" else argument(args, kwargs, 1, kind))


# In-place operations that do not read the values they overwrite.
PURE_WRITES = frozenset({aten.copy_, aten.fill_, aten.zero_})
# A literal's tensor made by torch before it reaches the dispatcher (``torch.tensor(2.0)``):
# a constant, though its operation takes a tensor.
LIFTS = frozenset({aten.lift_fresh, aten.lift_fresh_copy})
