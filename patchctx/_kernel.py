"""The C kernel's passes over CPU tensors: one call where numpy and torch take several.

A sparse patch's host work is a handful of loops over its indices and values: order and range,
NaN, the write. numpy and torch each make them in a few operations of 0.3 to 1.5 µs of fixed
cost apiece, plus a temporary or an int64 copy of the indices, and a short patch spends most of
its time there. `patchctx/_ckernel.c` makes each one loop, called in about 0.3 µs, reading the
indices as they come (int32 or int64) and writing positions it computes itself.

The module is optional (`hatch_build.py` compiles it where a C compiler works): each function
here returns `None` (or False for `scatter`) where it does not apply, and the caller goes on
the Python, numpy and torch way, which stays the reference the tests hold the kernel to. It
applies to plain strided CPU tensors only (no tensor subclass with a dispatch of its own, no
lazy negation or conjugation, which raw bytes would not see), with the host's ways on
(`_cpu_passes.HOST`), and writes only when no dispatch or function mode is active: torch
operations would show a write to such a mode; the kernel's bytes would not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from patchctx import _cpu_passes
from patchctx._bits import own_dispatch

__all__ = [
    "BUILT",
    "NAN_KIND",
    "USE",
    "active",
    "check",
    "exchange",
    "exchange_strided",
    "has_nan",
    "scatter",
    "scatter_strided",
]


def _load() -> ModuleType | None:
    """The compiled module, if there is one built from the source next to this file."""
    try:
        from patchctx import _ckernel
    except ImportError:
        return None
    source = Path(__file__).with_name("_ckernel.c")
    if source.is_file():  # a source tree: not a module left from an earlier version of it
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        if getattr(_ckernel, "SOURCE", None) != digest:
            return None
    return _ckernel


_module = _load()

# Whether a compiled kernel of this source was found.
BUILT = _module is not None
# Whether patchctx uses it (read as `_kernel.USE`: tests set it False to run the reference
# passes, and compare the two).
USE = BUILT


def active() -> bool:
    """Whether CPU tensors take the kernel's passes where they apply (built, used, host)."""
    return _module is not None and USE and _cpu_passes.HOST


_WIDTH = {torch.int32: 4, torch.int64: 8}
# Per index width, the first value read as unsigned that no valid index reaches: a negative
# one reads as this or above.
_BEYOND = {4: 1 << 31, 8: 1 << 63}
# The kernel's code for each IEEE float dtype whose NaN it finds by the bits (0: none).
NAN_KIND = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4, torch.float64: 8}


def check(indices: torch.Tensor, bound: int, values: torch.Tensor, kind: int) -> bool | None:
    """A sparse patch's common case: indices strictly increasing in ``[0, bound)``, and no NaN.

    `indices` and `values` are a checked patch's (`patchctx._patch.CheckedPatch`: 1-D,
    strided, of a plain class, no lazy negation or conjugation), on CPU. `kind`: the values'
    `NAN_KIND` to find a NaN among them, or 0 for no check of the values. The order and range
    as `_cpu_passes.increasing_below` decides them (read as unsigned: a negative index is
    above every bound). `None` where the kernel does not apply.
    """
    width = _WIDTH.get(indices.dtype)
    if _module is None or not USE or not _cpu_passes.HOST or width is None:
        return None
    if not indices.is_contiguous() or (kind and not values.is_contiguous()):
        return None  # (rare: a strided view; the reference passes take it)
    count = indices.numel()  # (1-D: a little cheaper than reading the shape)
    if bound <= 0:
        return not count  # (no index is in range)
    return bool(
        _module.check(
            indices.data_ptr(),
            count,
            width,
            min(bound, _BEYOND[width]) - 1,  # the highest index allowed
            values.data_ptr() if kind else 0,
            kind,
        )
    )


def has_nan(values: torch.Tensor) -> bool | None:
    """Whether 1-D IEEE float CPU `values` hold a NaN of any sign or payload, by their bits.

    `None` where the kernel does not apply (another dtype, a tensor whose bytes are not its
    values, not contiguous).
    """
    kind = NAN_KIND.get(values.dtype)
    if _module is None or not USE or not _cpu_passes.HOST or kind is None:
        return None
    if (
        values.dim() != 1
        or not values.is_cpu
        or not values.is_contiguous()
        or values.layout is not torch.strided
        or own_dispatch(values)
        or values.is_neg()
        or values.is_conj()
    ):
        return None
    return bool(_module.has_nan(values.data_ptr(), values.shape[0], kind))


def _width_to_write(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> int:
    """The index width the kernel writes `values` into `target` with.

    0 where it does not apply (see `scatter`).
    """
    width = _WIDTH.get(indices.dtype)
    if (
        width is None
        or _module is None
        or not USE
        or not _cpu_passes.HOST
        or values.dtype is not target.dtype
        or not (target.is_cpu and indices.is_cpu and values.is_cpu)
        or target.layout is not torch.strided
        or target.is_quantized
        or not (target.is_contiguous() and indices.is_contiguous() and values.is_contiguous())
        or own_dispatch(target)
        or target.is_inference()
        or target.is_neg()
        or target.is_conj()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or target.dtype.itemsize > 8
    ):
        return 0
    return width


def _outside(missed: int, count: int, limit: int, written: bool) -> RuntimeError:
    """The refusal of a call whose positions lay outside the destination (`missed` of them)."""
    what = "were not written" if written else "nothing was written"
    return RuntimeError(
        f"patchctx: {missed} of {count} positions lay outside the destination of {limit} "
        f"elements; {what} (the patch's indices changed after validation)"
    )


def _written(target: torch.Tensor, missed: int, count: int) -> bool:
    """After a kernel write: False when it wrote nothing (-1), else bump the version."""
    if missed < 0:  # indices or values in the target's bytes: nothing written
        return False
    torch._C._increment_version((target,))
    if missed:
        raise _outside(missed, count, target.numel(), written=True)
    return True


def _taken(indices: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """A copy of ``indices[begin:end]``: what an atomic write writes, and its undo restores."""
    if begin == 0 and end == indices.numel():  # (no slice to make: a microsecond)
        return indices.clone()
    return indices[begin:end].clone()


def scatter(
    target: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    begin: int,
    end: int,
    shift: int,
) -> bool:
    """``target.view(-1)[indices[i] - shift] = values[i]`` for ``i`` in ``[begin, end)``.

    `target` is a destination replay checked live; `indices` and `values` a checked patch's
    (see `check`) or validation's int64 positions, validated: in range once shifted. Bumps
    `target`'s version counter as torch's writes do. False, having written nothing, where the
    kernel does not apply: another device or dtype, a tensor that is not contiguous, a target
    of another layout, quantized, of a class with a dispatch of its own, lazily negated or
    conjugated, or an inference tensor; an active dispatch or function mode (torch's writes
    would show the write to it; ``torch.set_default_device`` is one); indices or values in
    the target's own bytes (the caller reads them from a copy, `_apart`).

    Raises:
        RuntimeError: Some position lay outside `target` (the caller's validation did not
            hold: the indices changed after it, say). No byte outside `target` was written;
            the positions inside it were.
    """
    width = _width_to_write(target, indices, values)
    if not width:
        return False
    count = end - begin
    if count <= 0:
        return True
    size = target.dtype.itemsize
    missed: int = _module.scatter(  # type: ignore[union-attr]
        target.data_ptr(),
        target.numel(),
        size,
        indices.data_ptr() + begin * width,
        width,
        count,
        shift,
        values.data_ptr() + begin * size,
    )
    return _written(target, missed, count)


def exchange(
    target: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    begin: int,
    end: int,
    shift: int,
    keep: Callable[[torch.Tensor, torch.Tensor], None],
) -> bool:
    """`scatter`, keeping first what it overwrites: the write of an atomic call.

    The indices ``indices[begin:end]`` are copied (what another thread does to the caller's
    tensor after this cannot change which positions are written, or restored), the values at
    their positions read into a new tensor `old`, and ``keep(taken, old)`` called with the
    copy and those values *before* anything is written: an interrupt at any point leaves
    either nothing written or the old values kept. False, having written nothing, where the
    kernel does not apply (as `scatter`; `keep` may have been called then, and restoring what
    it kept changes nothing).

    Raises:
        RuntimeError: Some position lay outside `target`; nothing was written.
    """
    width = _width_to_write(target, indices, values)
    if not width:
        return False
    count = end - begin
    if count <= 0:
        return True
    size = target.dtype.itemsize
    taken = _taken(indices, begin, end)
    old = torch.empty(count, dtype=target.dtype)
    address, limit = target.data_ptr(), target.numel()
    missed: int = _module.gather(  # type: ignore[union-attr]
        address, limit, size, taken.data_ptr(), width, count, shift, old.data_ptr()
    )
    if missed:
        raise _outside(missed, count, limit, written=False)
    keep(taken, old)
    start = values.data_ptr() + begin * size
    missed = _module.scatter(  # type: ignore[union-attr]
        address, limit, size, taken.data_ptr(), width, count, shift, start
    )
    return _written(target, missed, count)


def scatter_strided(
    flat: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    begin: int,
    end: int,
    view: tuple[int, int, tuple[tuple[int, int, int], ...]],
) -> bool:
    """`scatter` through a strided view of the staged tensor copied into one of `flat`.

    `view`: the source view's offset in the staged tensor, the target view's offset in
    `flat` (a contiguous 1-D tensor over the target's storage), and per dimension of size > 1,
    by decreasing source stride, the source stride, the size and the target stride (an
    injective view: `patchctx._routes.Segment`'s plan). Each index ``i`` in ``[begin, end)``
    whose element lies in the source view is written at its element of the target view;
    the others (another rank's, say) are skipped. As `scatter` otherwise.
    """
    width = _width_to_write(flat, indices, values)
    if not width:
        return False
    count = end - begin
    if count <= 0:
        return True
    size = flat.dtype.itemsize
    offset, base, plan = view
    missed: int = _module.scatter_strided(  # type: ignore[union-attr]
        flat.data_ptr(),
        flat.numel(),
        size,
        indices.data_ptr() + begin * width,
        width,
        count,
        offset,
        base,
        plan,
        values.data_ptr() + begin * size,
    )
    return _written(flat, missed, count)


def exchange_strided(
    flat: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    begin: int,
    end: int,
    view: tuple[int, int, tuple[tuple[int, int, int], ...]],
    keep: Callable[[torch.Tensor, torch.Tensor], None],
) -> bool:
    """`scatter_strided`, keeping first what it overwrites: an atomic call's strided write.

    As `exchange`: the indices are copied, then ``keep(positions, old)`` is called with the
    int64 positions in `flat` the view's indices would write and the values there now,
    *before* anything is written; then the write, from the copy.

    Raises:
        RuntimeError: Some position lay outside `flat`; nothing was written.
    """
    width = _width_to_write(flat, indices, values)
    if not width:
        return False
    count = end - begin
    if count <= 0:
        return True
    size = flat.dtype.itemsize
    offset, base, plan = view
    taken = _taken(indices, begin, end)
    positions = torch.empty(count, dtype=torch.long)
    old = torch.empty(count, dtype=flat.dtype)
    address, limit = flat.data_ptr(), flat.numel()
    missed, found = _module.gather_strided(  # type: ignore[union-attr]
        address,
        limit,
        size,
        taken.data_ptr(),
        width,
        count,
        offset,
        base,
        plan,
        positions.data_ptr(),
        old.data_ptr(),
    )
    if missed:
        raise _outside(missed, count, limit, written=False)
    keep(positions[:found], old[:found])
    written: int = _module.scatter_strided(  # type: ignore[union-attr]
        address,
        limit,
        size,
        taken.data_ptr(),
        width,
        count,
        offset,
        base,
        plan,
        values.data_ptr() + begin * size,
    )
    return _written(flat, written, count)
