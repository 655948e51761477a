"""The kind of a dtype's values (bool, integer, floating, complex), for cast refusals.

A cast inside one kind rounds (float32 into bfloat16) or wraps the same kind of number; a cast
across kinds changes what the number means (a bool patch into a norm weight sets it to 1.0).
`load_checkpoint_weight_patches` refuses casts across kinds unless asked (``kind_casts=True``).
"""

from __future__ import annotations

import torch

__all__ = ["QUANTIZED", "kind_of", "same_kind"]

# The quantized dtypes: their values are not plain numbers, so no cast into or out of them.
QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def kind_of(dtype: torch.dtype) -> str:
    """``"bool"``, ``"integer"``, ``"float"`` or ``"complex"``.

    Examples:
        >>> import torch
        >>> from patchctx._kinds import kind_of
        >>> kind_of(torch.bool), kind_of(torch.uint8), kind_of(torch.float8_e4m3fn)
        ('bool', 'integer', 'float')
    """
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "integer"


def same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether a cast from `a` to `b` keeps the kind of the values."""
    return a == b or kind_of(a) == kind_of(b)
