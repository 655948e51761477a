"""Bits: the one table of integer views patchctx moves and compares raw element bytes through.

torch lacks indexing kernels for some dtypes (float8 and the unsigned 16/32/64-bit integers on
CPU), and comparing floats by value treats NaN payloads and -0.0 as it likes. Both needs are met
by reading the same bytes as an integer dtype of the same width.
"""

from __future__ import annotations

import torch

from patchctx import _cpu_passes, _tuning

__all__ = ["bit_view", "indexable", "own_dispatch", "scatter_flat", "write_at"]

# What a tensor class dispatches through when it has no dispatch of its own: torch.Tensor,
# nn.Parameter and plain Python subclasses, whose bytes are their values.
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def own_dispatch(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is of a subclass with a dispatch of its own, data elsewhere or none.

    Wrapper subclasses (DTensor, FakeTensor, ``_make_wrapper_subclass``) are; `nn.Parameter`
    and plain Python subclasses are not: patchctx reads and writes their bytes directly.
    """
    kind = type(tensor)
    return kind is not torch.Tensor and kind.__torch_dispatch__ is not _PLAIN_DISPATCH


_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Dtypes torch lacks indexing kernels for on CPU, and the integer view of the same width that
# moves their bits: the unsigned 16/32/64-bit integers and complex32 (``put_`` and
# ``index_copy_`` are not implemented for ``ComplexHalf``).
_SIGNED = {
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
    torch.complex32: torch.int32,
}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of `tensor` as integers: one element each, or two for 16-byte complex.

    Two tensors hold the same bits exactly when their bit views are equal (``torch.equal``).
    """
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    size = tensor.element_size()
    if size in _OF_WIDTH:
        return tensor.view(_OF_WIDTH[size])
    if tensor.is_complex():  # complex128: two float64 halves
        return torch.view_as_real(tensor).view(torch.int64)
    raise TypeError(f"patchctx: no integer view for {tensor.dtype}")  # pragma: no cover


def indexable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or an integer view of the same bits where torch lacks indexing kernels.

    The float8 dtypes (on some devices), the unsigned 16/32/64-bit integers and complex32 (on
    CPU) have no ``index_copy_``/``index_select``/``cat`` (or ``put_``) kernels; moving their
    bits through a signed or ``uint8`` view of the same width is exact. View the result back
    with ``.view(dtype)``.
    """
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    signed = _SIGNED.get(tensor.dtype)
    return tensor if signed is None else tensor.view(signed)


# Integers of each element width: moving bits through them is exact for every dtype.
_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# Per dtype: the integer view `write_at` writes through with ``scatter_`` on CPU (None: a
# 16-byte element, ``index_copy_`` only), and the view ``index_copy_`` needs (None: itself).
_WRITE_VIEWS: dict[torch.dtype, tuple[torch.dtype | None, torch.dtype | None]] = {}


def _write_views(dtype: torch.dtype) -> tuple[torch.dtype | None, torch.dtype | None]:
    views = _WRITE_VIEWS.get(dtype)
    if views is None:
        probe = torch.empty(0, dtype=dtype)
        indexed = indexable(probe).dtype
        views = _WRITE_VIEWS[dtype] = (
            _WIDTH_INTS.get(probe.element_size()),
            None if indexed == dtype else indexed,
        )
    return views


def write_at(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``target.view(-1)[positions] = values``, `target` 1-D or contiguous of any shape.

    `positions` are int64 on `target`'s device (row-major order), `values` in its dtype. On
    CPU, a few positions go in with ``put_`` on `target` itself (no flat view to make); more
    move as bits through an integer view of the same width with ``scatter_``, the fastest of
    torch's index writes there for every width (1.3-2x ``index_copy_`` at 10-30 % density;
    ``scatter_`` on bf16 or fp16 themselves is 10-1000x slower). Elsewhere, and for 16-byte
    elements, ``index_copy_``. All through `indexable` where torch has no kernel for a dtype.
    Under ``torch.use_deterministic_algorithms(True)``, ``index_put_`` (``put_`` has no
    deterministic implementation, nor ``index_copy_`` on CUDA; ``index_put_`` has one on
    every device).
    """
    dtype = target.dtype
    if values.dtype is not dtype:  # a bit view of other-width values would write garbage
        raise TypeError(f"write_at: values are {values.dtype}, the destination {dtype}")
    bits, indexed = _WRITE_VIEWS.get(dtype) or _write_views(dtype)
    deterministic = torch.are_deterministic_algorithms_enabled()
    on_host = target.is_cpu and _cpu_passes.HOST
    if not deterministic and on_host and positions.shape[0] <= _tuning.FEW:
        if indexed is None:
            target.put_(positions, values)
        else:
            target.view(indexed).put_(positions, values.view(indexed))
        return
    if deterministic:
        flat = target.view(-1)
        if bits is None:  # 16 bytes (complex128): index_put_ has its own kernel
            flat.index_put_((positions,), values)
        else:
            flat.view(bits).index_put_((positions,), values.view(bits))
        return
    flat = target.view(-1)
    if bits is not None and on_host:
        flat.view(bits).scatter_(0, positions, values.view(bits))
    elif indexed is None:
        flat.index_copy_(0, positions, values)
    else:
        flat.view(indexed).index_copy_(0, positions, values.view(indexed))


def scatter_flat(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[indices] = values`` (1-D, values already in ``flat.dtype``), for every dtype."""
    positions = indices.to(device=flat.device, dtype=torch.long)
    write_at(flat, positions, values.to(device=flat.device))
