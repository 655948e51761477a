"""The O(n) passes over CPU tensors that validation and replay make, done by numpy.

On CPU, torch runs an elementwise operation over more than 32K elements on every intra-op
thread and waits for all of them. When another process keeps a core busy, each such operation
waits for the thread that shares that core, and an update of a few dozen of them took 2 to 10
times its quiet time. numpy runs them on the calling thread, at least as fast at one thread,
and fuses some: patchctx's own passes over CPU tensors are made here.

- `increasing_below`, `each_increasing_below`: indices strictly increasing and in range, in
  one pass, read as *unsigned* integers. A negative index reads as a huge unsigned one, so the
  order test and the bound on the last index together rule out negatives, and no difference is
  taken that could wrap. torch needs three passes (``aminmax``, ``diff`` into a buffer, ``min``).
- `positions_into`, `shifted_positions`: indices minus a shift, as int64 positions, into a
  buffer.
- `has_nan_bits`: a NaN among IEEE floats, by numpy's float maximum (fp32, fp64) or by two
  integer maxima of the same bits (signed, then unsigned: bf16, fp16), without a temporary;
  `has_value`: an integer sentinel among integers.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from patchctx import _tuning

__all__ = [
    "HOST",
    "each_increasing_below",
    "has_nan_bits",
    "has_value",
    "host_scratch",
    "increasing_below",
    "listed_positions",
    "nan_bits_known",
    "positions_into",
    "shifted_positions",
]

# Whether CPU tensors take the host's ways: these passes, Python lists, flags read one by one,
# the CPU writes. False sends them the accelerators' ways (torch operations into reused device
# buffers, flags read together, ``index_copy_``), which run on CPU too: tests set it to run
# that code where no accelerator is (read as `_cpu_passes.HOST`).
HOST = True


_UNSIGNED: dict[int, type[np.unsignedinteger]] = {4: np.uint32, 8: np.uint64}


_local = threading.local()


def host_scratch(dtype: type[np.generic], size: int) -> np.ndarray:
    """A numpy buffer of `size` elements owned by this thread, reused by later calls.

    The host twin of `patchctx._blocks.scratch` (no fresh block-sized temporary per pass),
    at a tenth of its cost: no torch tensor to slice (a slice of one is about a microsecond).
    Every user fills its prefix and is done with it before its next call on the thread.
    """
    try:
        buffers: dict[type[np.generic], np.ndarray] = _local.buffers
    except AttributeError:
        buffers = _local.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.shape[0] < size:
        buffer = buffers[dtype] = np.empty(max(size, 1), dtype)
    return buffer[:size]


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
    if count <= _tuning.SMALL_ORDER_TEST:  # a fresh temporary beats finding the thread's buffer
        return bool(np.greater(unsigned[1:], unsigned[:-1]).all())
    steps = host_scratch(np.bool_, count - 1)
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
    steps = host_scratch(np.bool_, unsigned.shape[0] - 1)
    np.greater(unsigned[1:], unsigned[:-1], out=steps)
    steps[lasts[:-1]] = True
    return bool(steps.all())


def positions_into(indices: torch.Tensor, shift: int, out: torch.Tensor) -> None:
    """``out[:] = indices - shift`` for 1-D CPU int32/int64 `indices` into an int64 `out`.

    The indices are in range (validated) and the shift is the difference of two offsets in the
    same tensor: the result cannot wrap.
    """
    _shifted_into(indices.numpy(), shift, out.numpy())


def shifted_positions(indices: torch.Tensor, begin: int, end: int, shift: int) -> torch.Tensor:
    """``indices[begin:end] - shift`` as int64 positions, in this thread's reused buffer.

    As `positions_into`, without a torch slice or buffer to make first (about a microsecond
    each): numpy slices, and the result is a tensor over the buffer (`host_scratch`), valid
    until this thread's next call.
    """
    target = host_scratch(np.int64, end - begin)
    _shifted_into(indices.numpy()[begin:end], shift, target)
    return torch.from_numpy(target)


def listed_positions(listed: list[int], begin: int, end: int, shift: int) -> torch.Tensor:
    """``listed[begin:end] - shift`` as a new int64 CPU tensor, for a few validated indices.

    One numpy array made from the list (about 1.5 µs for a few, against 3 to 4 for the
    tensor path of `shifted_positions`); a tensor of its own, not a thread buffer.
    """
    found = np.array(listed[begin:end], np.int64)
    if shift:
        np.subtract(found, shift, out=found)
    return torch.from_numpy(found)


def _shifted_into(source: np.ndarray, shift: int, target: np.ndarray) -> None:
    """``target[:] = source - shift``, int32/int64 `source` into int64 `target`."""
    if shift and source.dtype == np.int64:
        np.subtract(source, shift, out=target)
        return
    np.copyto(target, source)  # int32 to int64: a cast copy, then subtract in place (faster
    if shift:  # than numpy's subtraction with a cast, or torch's)
        np.subtract(target, shift, out=target)


# Per IEEE dtype: its integer view, and the bits of +infinity and of -infinity. A NaN's bits are
# above +infinity's read as signed (positive NaN: the largest signed values) or above
# -infinity's read as unsigned (negative NaN: the largest unsigned values); nothing else is.
_NAN_ABOVE: dict[torch.dtype, tuple[torch.dtype, type[np.unsignedinteger], int, int]] = {
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float16: (torch.int16, np.uint16, 0x7C00, 0xFC00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000, 0xFF800000),
    torch.float64: (torch.int64, np.uint64, 0x7FF0000000000000, 0xFFF0000000000000),
}


def nan_bits_known(values: torch.Tensor) -> bool:
    """Whether `has_nan_bits` can test `values`: an IEEE float dtype on CPU, read as stored."""
    return (
        values.dtype in _NAN_ABOVE
        and values.device.type == "cpu"
        and HOST
        and values.layout == torch.strided
        and not values.is_neg()
    )


def has_nan_bits(values: torch.Tensor) -> bool:
    """Whether `values` (see `nan_bits_known`) hold a NaN of any sign or payload.

    fp32 and fp64 by numpy's float maximum, which propagates NaN (one pass, as fast as
    torch's ``amax`` at one thread); bf16 and fp16, which numpy cannot reduce fast, by the
    bits.
    """
    if not values.numel():
        return False
    if values.requires_grad:  # (numpy refuses those; a detach costs half a microsecond)
        values = values.detach()
    if values.dtype in (torch.float32, torch.float64):
        return bool(np.isnan(values.numpy().max()))
    integer, unsigned, positive, negative = _NAN_ABOVE[values.dtype]
    bits = values.view(integer).numpy()
    return bool(bits.max() > positive) or bool(bits.view(unsigned).max() > negative)


def has_value(values: torch.Tensor, value: int) -> bool:
    """Whether the integer (or bool) CPU `values` hold `value`: one numpy reduction.

    An extreme of the dtype (the default sentinels) is found by ``min`` or ``max``, anything
    else by a comparison.
    """
    found = values.detach().numpy()
    if not found.size:
        return False
    info = np.iinfo(found.dtype) if found.dtype != np.bool_ else None
    if info is not None and value == info.min:
        return bool(found.min() == value)
    if info is not None and value == info.max:
        return bool(found.max() == value)
    return bool((found == value).any())
