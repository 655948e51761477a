"""Bits: the one table of integer views patchctx moves and compares raw element bytes through.

torch lacks indexing kernels for some dtypes (float8 and the unsigned 16/32/64-bit integers on
CPU), and comparing floats by value treats NaN payloads and -0.0 as it likes. Both needs are met
by reading the same bytes as an integer dtype of the same width.
"""

from __future__ import annotations

import torch

__all__ = ["bit_view", "indexable", "scatter_flat"]

_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


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

    The float8 dtypes (on some devices) and the unsigned 16/32/64-bit integers (on CPU) have no
    ``index_copy_``/``index_select``/``cat`` kernels; moving their bits through a signed or
    ``uint8`` view of the same width is exact. View the result back with ``.view(dtype)``.
    """
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    signed = _SIGNED.get(tensor.dtype)
    return tensor if signed is None else tensor.view(signed)


def scatter_flat(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[indices] = values`` (1-D, values already in ``flat.dtype``), for every dtype.

    Uses ``index_copy_`` (fast on CPU for bf16, unlike ``scatter_``), through `indexable`.
    """
    positions = indices.to(device=flat.device, dtype=torch.long)
    indexable(flat).index_copy_(0, positions, indexable(values.to(device=flat.device)))
