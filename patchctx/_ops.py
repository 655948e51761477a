"""The op rules, one table: what each ATen operation does to the tensors it is given.

Registered per op, as torch's own subclasses keep their tables (``register(...)``), and read
through `rule` alone, by the staged data, the guard, the write ledger and the dry run: which
arguments an op writes, whether it views, moves, rearranges or only reshapes elements, and
how it lets values out of torch. What the table does not name comes from the op's schema and
tags (a pointwise op, an ``out=`` form), or is "opaque": a computation that may mix positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "Rule",
    "accumulates",
    "argument",
    "host_reads",
    "register",
    "rule",
    "targets_of",
    "tensors_in",
]

aten = torch.ops.aten

Kind = Literal["view", "like", "layout", "pointwise", "opaque"]


@dataclass(frozen=True, slots=True)
class Rule:
    """What one ATen operation (an overload) does with its tensors."""

    # How its results relate to its inputs' elements: a view of them, a factory shaped like
    # its input, a copy that rearranges or casts them (``self``, or the list of cat/stack, is
    # the data), a pointwise computation, or any other computation.
    kind: Kind = "opaque"
    writes: tuple[tuple[int, str], ...] = ()  # (position, name) of every argument written
    out: bool = False  # an ``out=`` form
    # A write that moves these data arguments into ``self`` without reading what it held at
    # the positions it writes (indexed assignment, ``index_copy_``...), unless it accumulates.
    moves: tuple[int, ...] | None = None
    accumulate: tuple[int, str] | None = None  # the argument that makes such a write add up
    whole: bool = False  # ``copy_``: ``self`` takes its source whole (a merge, a route segment)
    pure_write: bool = False  # an in-place write that reads nothing of what it overwrites
    fill: bool = False  # fills ``self`` with one value (``zero_``: 0; ``fill_``: its value)
    reshaping: bool = False  # changes a tensor's shape, strides or storage, not its values
    cast: bool = False  # ``to``: the elements cast or moved, in place (a mask goes along as is)
    lists: bool = False  # its data argument is a list of tensors (cat, stack)
    known: bool = False  # a factory "like" its input whose values are known (not empty_like)
    reinterprets: bool = False  # ``view(dtype)``: the same bytes read as another dtype
    lifts: bool = False  # a literal's tensor made by torch (``torch.tensor(2.0)``): a constant
    # How it lets values out of torch: all its tensors (a Python scalar, a shape that depends
    # on them), only its "indices" or its "mask" (for the shape), or not at all.
    leak: Literal["all", "indices", "mask"] | None = None
    item: bool = False  # hands one element to Python (``.item()``, ``bool(t)``): a value read
    said: str = ""  # the op, as messages name it
    tensors: tuple[tuple[int, str], ...] = ()  # (position, name) of every tensor argument


_TABLE: dict[Any, dict[str, Any]] = {}  # op (packet or overload) -> the facts registered
_RULES: dict[torch._ops.OpOverload, Rule] = {}


def register(ops: str, **facts: Any) -> None:
    """Register `facts` (fields of `Rule`) for `ops`, ATen names: packets or overloads."""
    for name in ops.split():
        op = aten
        for part in name.split("."):
            op = getattr(op, part)
        _TABLE.setdefault(op, {}).update(facts)


# Copies that rearrange or cast elements without combining them (a mask goes along).
register(
    "_to_copy index_select index gather repeat repeat_interleave flip roll narrow_copy "
    "slice_copy select_copy t_copy transpose_copy permute_copy expand_copy view_copy "
    "unsqueeze_copy squeeze_copy alias_copy detach_copy unfold_copy _unsafe_view masked_select "
    "take tril triu",
    kind="layout",
)
register("_to_copy", cast=True)
register("cat stack hstack vstack", kind="layout", lists=True)
register(
    "zeros_like ones_like full_like rand_like randn_like randint_like", kind="like", known=True
)
register("new_zeros new_ones new_full", kind="like", known=True)
register("empty_like new_empty new_empty_strided", kind="like")
register("copy_", moves=(1,), pure_write=True, whole=True)
register("index_put_ _index_put_impl_", moves=(2,), accumulate="accumulate")
register("index_copy_ scatter_", moves=(3,))
register("scatter_", accumulate="reduce")
register("masked_scatter_ masked_fill_", moves=(2,))
register("index_fill_", moves=(3,))
register("fill_", moves=(1,), pure_write=True, fill=True)
register("zero_", pure_write=True, fill=True)
register("view.dtype", reinterprets=True)
register("_local_scalar_dense", said=".item()", item=True)
register("lift_fresh lift_fresh_copy", lifts=True)
register(
    "set_ resize_ resize_as_ as_strided_ t_ transpose_ squeeze_ unsqueeze_ swapdims_ swapaxes_ "
    "detach_ _resize_output_",
    reshaping=True,
)
register("index _unsafe_index", leak_of="indices")
register("masked_select", leak_of="mask")

# What an operation returns to Python that is not a tensor: a value that has left torch.
_SCALAR_RETURNS = frozenset({"bool", "number", "float", "Scalar", "complex"})


def rule(func: torch._ops.OpOverload) -> Rule:
    """The rule of `func`: its registered facts over what its schema and tags say."""
    found = _RULES.get(func)
    if found is None:
        found = _RULES[func] = _build(func)
    return found


def _build(func: torch._ops.OpOverload) -> Rule:
    facts = {**_TABLE.get(func.overloadpacket, {}), **_TABLE.get(func, {})}
    schema, tags = func._schema, func.tags
    slots = list(enumerate(schema.arguments))
    names = [slot.name for _, slot in slots]
    accumulate, leak_of = facts.pop("accumulate", None), facts.pop("leak_of", "all")
    scalar = any(str(r.type) in _SCALAR_RETURNS for r in schema.returns)
    leak: Any = "all" if scalar or torch.Tag.data_dependent_output in tags else None
    kind = facts.pop("kind", "pointwise" if torch.Tag.pointwise in tags else "opaque")
    made = Rule(
        kind="view" if func.is_view else kind,
        writes=tuple((p, s.name) for p, s in slots if s.alias_info and s.alias_info.is_write),
        out=torch.Tag.out in tags,
        accumulate=None if accumulate not in names else (names.index(accumulate), accumulate),
        leak=leak or (leak_of if torch.Tag.dynamic_output_shape in tags else None),
        said=str(func.overloadpacket),
        tensors=tuple((p, s.name) for p, s in slots if "Tensor" in str(s.type)),
    )
    return replace(made, **facts)


def tensors_in(value: object) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def argument(args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def accumulates(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a moving write adds into what ``self`` held (``accumulate=True``, ``reduce=``)."""
    found = rule(func).accumulate
    return found is not None and bool(argument(args, kwargs, *found))


def targets_of(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors `func` writes (its written arguments)."""
    targets: list[torch.Tensor] = []
    for position, name in rule(func).writes:
        targets.extend(tensors_in(argument(args, kwargs, position, name)))
    return targets


def host_reads(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors whose values `func` hands to Python: what the loader may decide on.

    A value leaves torch (``.item()``, ``bool(t)``, ``torch.equal``, ``allclose``: under
    ``inference_mode`` as ``aten.item`` itself), or a result's shape depends on values
    (``nonzero``, ``unique``, a boolean-mask index: the tensors that decide it), which the
    loader reads with ``.shape`` or ``numel()`` and no operation at all (`Rule.leak`).
    """
    kind = rule(func).leak
    if kind is None:
        return []
    return tensors_in((args, kwargs) if kind == "all" else argument(args, kwargs, 1, kind))
