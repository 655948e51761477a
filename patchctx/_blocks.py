"""Blocked passes over long index and value tensors, with scratch buffers reused per thread.

Validation and route replay walk a patch's indices in blocks of `_tuning.BLOCK` positions. A
block is
large enough that the per-operation cost (a few microseconds in eager PyTorch, more under CPU
contention) is negligible, and small enough that its temporaries stay a few MiB instead of
O(nnz): the int64 positions and the order check write into one buffer per thread, device and
dtype, allocated once and reused, so a call makes no large fresh allocation (no page faults,
no allocator churn) however many patches it applies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from patchctx import _tuning

__all__ = ["block_size", "blocks", "scratch", "undo_block"]


_local = threading.local()


def block_size() -> int:
    """`_tuning.BLOCK`, read at call time."""
    return _tuning.BLOCK


def undo_block(count: int, span: int) -> int:
    """Positions per block for `count` positions over `span` elements, saved then written.

    As many as fall in `_tuning.UNDO_SPAN` elements at that density, between 16K (or
    `_tuning.BLOCK`, if less) and `_tuning.BLOCK`.
    """
    block, span_of = _tuning.BLOCK, _tuning.UNDO_SPAN
    return max(min(block, 1 << 14), min(block, count * span_of // max(span, 1)))


def scratch(device: torch.device, dtype: torch.dtype, size: int) -> torch.Tensor:
    """A buffer of at least `size` elements, owned by this thread; reused by later calls.

    Every user takes a prefix, fills it and is done with it before the next call on the same
    thread asks for the same (device, dtype), so no two live uses overlap.
    """
    buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] | None = getattr(
        _local, "buffers", None
    )
    if buffers is None:
        buffers = _local.buffers = {}
    # On CUDA the buffer is reused in stream order: a write queued on another stream could
    # overtake a read of the previous use, so each stream gets its own.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, dtype, stream)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = buffers[key] = torch.empty(max(size, 1), dtype=dtype, device=device)
    return buffer[:size]


def blocks(start: int, stop: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` of the consecutive blocks of `_tuning.BLOCK` over ``[start, stop)``."""
    size = _tuning.BLOCK  # read at each call, so that tests can make blocks small
    for begin in range(start, stop, size):
        yield begin, min(stop, begin + size)
