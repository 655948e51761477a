"""The index check of long sparse patches on CPU: one numpy pass instead of three torch ones.

Validating a long patch's indices in torch takes their extremes (``aminmax``), their steps
(``diff`` into a buffer) and the smallest step: three passes over memory that is cold at the
sizes where it matters. `increasing_below` reads them once, as *unsigned* integers: a negative
index reads as a huge unsigned one, so the order test and the bound on the last index together
rule out negatives, and no difference is taken that could wrap.
"""

from __future__ import annotations

import numpy as np
import torch

from patchctx._blocks import scratch

__all__ = ["each_increasing_below", "increasing_below"]

_UNSIGNED: dict[int, type[np.unsignedinteger]] = {4: np.uint32, 8: np.uint64}

_CPU = torch.device("cpu")


def increasing_below(window: torch.Tensor, bound: int) -> bool:
    """Whether the 1-D int32/int64 CPU `window` is strictly increasing within ``[0, bound)``.

    Exact: read as unsigned, strictly increasing values below ``min(bound, 2**(bits - 1))``
    are all below the last one, so none is negative as a signed integer either.
    """
    count = window.shape[0]
    if not count:
        return True
    size = window.element_size()
    unsigned = window.numpy().view(_UNSIGNED[size])
    if int(unsigned[-1]) >= min(bound, 1 << (8 * size - 1)):
        return False
    if count == 1:
        return True
    steps = scratch(_CPU, torch.bool, count - 1).numpy()
    return bool(np.greater(unsigned[1:], unsigned[:-1], out=steps).all())


def each_increasing_below(flat: torch.Tensor, lasts: list[int], bounds: list[int]) -> bool:
    """`increasing_below` for each of many windows concatenated into `flat`, in one pass.

    Window ``k`` ends at ``flat[lasts[k]]`` and must lie in ``[0, bounds[k])``; the windows are
    non-empty and in order. The steps from one window's last index to the next one's first are
    free to go down.
    """
    size = flat.element_size()
    unsigned = flat.numpy().view(_UNSIGNED[size])
    top = 1 << (8 * size - 1)
    ends = unsigned[lasts].tolist()
    if any(last >= min(bound, top) for last, bound in zip(ends, bounds, strict=True)):
        return False
    if unsigned.shape[0] < 2:
        return True
    steps = scratch(_CPU, torch.bool, unsigned.shape[0] - 1).numpy()
    np.greater(unsigned[1:], unsigned[:-1], out=steps)
    steps[lasts[:-1]] = True
    return bool(steps.all())
