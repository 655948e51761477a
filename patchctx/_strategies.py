"""Copy strategies: how a staged tensor marks "keep the destination" and how a masked write works.

A strategy is a small frozen value object. It stages a sparse patch as a full checkpoint-shaped
tensor (`stage`), performs the masked in-place write that replaces ``copy_`` inside a masked
region (`merge`), and says which dtypes it supports and which values it cannot carry.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol, cast, runtime_checkable

import torch

from patchctx import _cpu_passes, _swap, _tuning
from patchctx._arguments import instance_of, optional_int
from patchctx._bits import indexable, scatter_flat
from patchctx._cpu_passes import has_nan_bits, has_value, nan_bits_known
from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, LoaderContractError
from patchctx._kinds import QUANTIZED
from patchctx._staged import StagedTensor, mask_of, stage

__all__ = [
    "Auto",
    "BoolMask",
    "CopyStrategy",
    "IntSentinel",
    "NaNMask",
    "ReservedBits",
    "indexable",
    "reserved_on_host",
    "scatter_flat",
]


@runtime_checkable
class CopyStrategy(Protocol):
    """The capability a masked copy needs: stage a sparse patch and merge it into a weight.

    Implement all five methods on a frozen value object to write a strategy of your own, then
    run `patchctx.testing.check_strategy` on it. The protocol is runtime-checkable: a strategy
    needs no base class, only the methods.

    Optional, asked by name: ``reserved_on_host(values, dtype) -> bool`` answers
    `reserved_values` on the host; ``reserved_bits(dtype)`` says them as `ReservedBits`; a
    class attribute ``fixed_support = True`` says `unsupported_reason` depends on the dtype
    alone (answers kept per hashable value). The built-ins have all three.

    Examples:
        >>> import torch
        >>> from patchctx import CopyStrategy, IntSentinel, NaNMask
        >>> isinstance(NaNMask(), CopyStrategy)
        True
        >>> NaNMask().unsupported_reason(torch.bfloat16) is None
        True
        >>> IntSentinel().reserved_values(torch.tensor([5, -128]), torch.int8)
        tensor(True)
    """

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        """Say why `dtype` cannot be staged by this strategy, or return `None` if it can."""
        ...

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whether `values`, cast to `dtype`, hold a value this strategy reserves.

        Returns a 0-d bool tensor (a reserved value cannot be carried as an update),
        computed on `values.device` without a host sync, so callers batch the sync.
        """
        ...

    def describe_reserved(self, dtype: torch.dtype) -> str:
        """Name the reserved values for `dtype` in words, for error messages."""
        ...

    def stage(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """Build the full checkpoint tensor of a sparse patch on `values.device`.

        Positions in `indices` (flat, row-major) hold `values` cast to `dtype`; every other
        position says "keep the destination". Numbers are not checked here (range, duplicates,
        reserved values): validate patches first.
        """
        ...

    def merge(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        """Write `source` into `destination` in place, keeping it where `source` says "keep".

        Same contract as ``destination.copy_(source)`` for same-shaped tensors (dtype cast and
        device move included); returns `destination`. Raises `LoaderContractError` for a write
        it cannot mask exactly.
        """
        ...


class ReservedBits(NamedTuple):
    """A strategy's reserved values in one dtype, said as bits (``reserved_bits(dtype)``).

    The diff tests them on raw bits; they must agree with `reserved_values` (``check_strategy``
    compares), and validation finds NaN on the host by them.

    Attributes:
        nan: Every NaN of the dtype (any sign and payload) is reserved.
        value: This value is, by the bits of its cast (a float ``0.0`` is not ``-0.0``).

    Examples:
        >>> import torch
        >>> from patchctx import IntSentinel, NaNMask
        >>> NaNMask().reserved_bits(torch.bfloat16), IntSentinel().reserved_bits(torch.int8)
        (ReservedBits(nan=True, value=None), ReservedBits(nan=False, value=-128))
    """

    nan: bool = False
    value: int | float | None = None


# ----------------------------------------------------------------------------------- helpers


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"


def _merge_staged(
    strategy: object, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool
) -> torch.Tensor | None:
    """The masked merge of staged data (its own mask), or `None` for a same-shaped plain one."""
    if isinstance(source, StagedTensor):
        return _swap.plain_copy(destination, source, non_blocking)
    if destination.shape != source.shape:
        raise LoaderContractError(
            f"{strategy!r}: masked copy_ from a source {_describe(source)} into a destination "
            f"{_describe(destination)}; a masked copy needs the same shape on both sides "
            "(no broadcasting), so the loader's final write must be a same-shaped copy_"
        )
    return None


def _move(source: torch.Tensor, destination: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    if source.device != destination.device:
        return source.to(device=destination.device, non_blocking=non_blocking)
    return source


def _stage_filled(
    strategy: CopyStrategy,
    shape: Sequence[int],
    dtype: torch.dtype,
    indices: torch.Tensor,
    values: torch.Tensor,
    fill: float,
) -> torch.Tensor:
    """A staged tensor holding `values` at `indices` and "keep" (values `fill`) elsewhere."""
    problems: list[str] = []
    if not isinstance(dtype, torch.dtype):
        raise InvalidPatchTypeError(
            f"{strategy!r}.stage: dtype must be a torch.dtype, got {dtype!r}"
        )
    reason = strategy.unsupported_reason(dtype)
    if reason is not None:
        problems.append(reason)
    if any(int(d) < 0 for d in shape):
        problems.append(f"shape {tuple(shape)!r} has a negative dimension")
    if indices.ndim != 1 or values.ndim != 1:
        problems.append(
            f"indices and values must be 1-D, got {tuple(indices.shape)} and {tuple(values.shape)}"
        )
    elif indices.numel() != values.numel():
        problems.append(f"{indices.numel()} indices for {values.numel()} values")
    if indices.dtype not in (torch.int32, torch.int64):
        problems.append(f"indices must be int32 or int64, got {indices.dtype}")
    if problems:
        raise InvalidPatchError(f"{strategy!r}.stage: " + "; ".join(problems))
    return stage(shape, dtype, indices, values, fill=fill)


@functools.cache
def _nan_capable(dtype: torch.dtype) -> bool:
    """Whether torch can hold, detect and select NaN for `dtype` (probed once per dtype)."""
    if not dtype.is_floating_point:
        return False
    try:
        probe = torch.full((2,), float("nan"), dtype=dtype)
        keep = torch.isnan(probe)
        out = torch.zeros(2, dtype=dtype)
        torch.where(keep, out, probe, out=out)
        return bool(keep.all()) and not bool(torch.isnan(out).any())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.cache
def _int_capable(dtype: torch.dtype) -> bool:
    """Whether torch compares and selects integers of `dtype` (probed once per dtype).

    The unsigned 16/32/64-bit dtypes have limited support in some builds.
    """
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return False
    try:
        probe = torch.zeros(2, dtype=dtype)
        out = torch.ones(2, dtype=dtype)
        torch.where(probe == probe, probe, out, out=out)
        return bool((out == 0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# The bits of +infinity in the 16-bit floats; a NaN's bits (sign cleared) are above them.
_HALF_NAN = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


@functools.cache
def _reduces(dtype: torch.dtype, reduction: str) -> bool:
    """Whether this torch build implements `reduction` (amin/amax) for `dtype` on CPU."""
    try:
        getattr(torch.zeros(2, dtype=dtype), reduction)()
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


# -------------------------------------------------------------------------------- strategies


@dataclass(frozen=True, slots=True)
class NaNMask:
    """NaN marks "keep the destination": floating dtypes only, NaN cannot be an update value.

    This is the scheme of vLLM's ``load_checkpoint_weight_patches``. Supports float16,
    bfloat16, float32, float64 and the float8 dtypes on which this torch build implements
    ``isnan``. A merge reads its mask from the source itself, so the loader may view, cast,
    transpose or even copy the staged tensor before its final ``copy_``: NaN survives all of it.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask
        >>> staged = NaNMask().stage((2, 3), torch.float32, torch.tensor([1, 5]),
        ...                          torch.tensor([7.0, 9.0]))
        >>> weight = torch.zeros(2, 3)
        >>> _ = NaNMask().merge(weight, staged)
        >>> weight
        tensor([[0., 7., 0.],
                [0., 0., 9.]])
    """

    fixed_support: ClassVar[bool] = True

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        if not dtype.is_floating_point:
            return (
                f"NaNMask needs a floating dtype to mark unchanged positions with NaN, got "
                f"{dtype}; use IntSentinel() for integer weights or BoolMask() for any dtype"
            )
        if not _nan_capable(dtype):
            return (
                f"NaNMask: this torch build cannot detect NaN in {dtype} (torch.isnan or "
                "torch.where is not implemented for it); use BoolMask()"
            )
        return None

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = values.to(dtype=dtype)
        if not values.numel():
            return torch.zeros((), dtype=torch.bool, device=values.device)
        if values.numel() > _tuning.HOST_FROM and nan_bits_known(values):
            # On CPU, two numpy maxima of the bits (see `patchctx._cpu_passes`).
            return torch.tensor(has_nan_bits(values))
        half = _HALF_NAN.get(dtype)
        if half is not None and values.numel() > _tuning.INTEGER_NAN_FROM:
            # bf16 / fp16: a NaN's bits without the sign exceed those of infinity. Two integer
            # passes cost a third of the float amax (which converts every element); for a few
            # elements, wrapping the mask into a tensor costs more than the float amax.
            magnitude = torch.bitwise_and(values.view(torch.int16), 0x7FFF)
            return magnitude.amax() > half
        if _reduces(dtype, "amax"):
            # amax propagates NaN: one reduction, no temporary (isnan().any() makes a mask).
            return torch.isnan(values.amax())
        return torch.isnan(values).any()

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return f"NaN (NaNMask reserves NaN in {dtype} to mean 'keep the destination')"

    def reserved_bits(self, dtype: torch.dtype) -> ReservedBits | None:
        return ReservedBits(nan=True) if dtype.is_floating_point else None

    def stage(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        return _stage_filled(self, shape, dtype, indices, values, float("nan"))

    def merge(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        staged = _merge_staged(self, destination, source, non_blocking)
        if staged is not None:
            return staged
        if not (source.is_floating_point() and destination.is_floating_point()):
            raise LoaderContractError(
                f"{self!r}: masked copy_ from {_describe(source)} into {_describe(destination)}; "
                "NaNMask needs a floating source and destination (NaN marks 'keep')"
            )
        source = _move(source, destination, non_blocking)
        keep = torch.isnan(source)
        if source.dtype != destination.dtype:
            source = source.to(dtype=destination.dtype)
        return torch.where(keep, destination, source, out=destination)

    def update_mask(self, source: torch.Tensor) -> torch.Tensor:
        """Where `source` carries an update (not NaN; staged data: its own mask)."""
        if isinstance(source, StagedTensor):
            return cast("torch.Tensor", mask_of(source))
        return ~torch.isnan(source)


@dataclass(frozen=True, slots=True, kw_only=True)
class IntSentinel:
    """A reserved integer marks "keep the destination": for int8/int32 quantized or packed weights.

    Args:
        value: The reserved value. `None` (the default) means the dtype's minimum for signed
            dtypes (``-128`` for int8) and the dtype's maximum for unsigned ones (``255`` for
            uint8: its minimum, 0, is the most common packed value there is). The reserved
            value cannot be an update value; validation rejects it.

    For plain tensors (the sentinel in the data), a merge requires the source and destination
    to have the same integer dtype: a cast across integer widths would move the sentinel. Data
    staged by `stage` carries its mask, casts included.

    Examples:
        >>> import torch
        >>> from patchctx import IntSentinel
        >>> staged = IntSentinel().stage((4,), torch.int8, torch.tensor([2]),
        ...                              torch.tensor([5], dtype=torch.int8))
        >>> weight = torch.arange(4, dtype=torch.int8)
        >>> _ = IntSentinel().merge(weight, staged)
        >>> weight
        tensor([0, 1, 5, 3], dtype=torch.int8)
        >>> IntSentinel(value=0).sentinel(torch.int8)
        0
    """

    fixed_support: ClassVar[bool] = True

    value: int | None = None

    def __post_init__(self) -> None:
        optional_int(self.value, "IntSentinel(value=...)")

    def sentinel(self, dtype: torch.dtype) -> int:
        """The reserved value for `dtype`."""
        if self.value is not None:
            return self.value
        info = torch.iinfo(dtype)
        return info.max if info.min == 0 else info.min

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return (
                f"IntSentinel handles integer dtypes, got {dtype}; use NaNMask() for floating "
                "weights or BoolMask() for any dtype"
            )
        if dtype in QUANTIZED or not _int_capable(dtype):
            return f"IntSentinel: this torch build cannot compare and select {dtype} tensors"
        info = torch.iinfo(dtype)
        sentinel = self.sentinel(dtype)
        if not info.min <= sentinel <= info.max:
            return (
                f"IntSentinel(value={sentinel!r}) does not fit {dtype} "
                f"([{info.min}, {info.max}]); choose a value inside that range"
            )
        return None

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = values.to(dtype=dtype)
        sentinel = self.sentinel(dtype)
        if (
            values.numel() > _tuning.HOST_FROM
            and values.device.type == "cpu"
            and _cpu_passes.HOST
            and not values.is_neg()
        ):
            # One numpy pass on the calling thread (see `patchctx._cpu_passes`).
            return torch.tensor(has_value(values, sentinel))
        if values.numel():
            # The default sentinel is an extreme of the dtype: one reduction finds it.
            info = torch.iinfo(dtype)
            if sentinel == info.min and _reduces(dtype, "amin"):
                return values.amin() == sentinel
            if sentinel == info.max and _reduces(dtype, "amax"):
                return values.amax() == sentinel
        return (values == sentinel).any()

    def reserved_bits(self, dtype: torch.dtype) -> ReservedBits | None:
        fits = self.unsupported_reason(dtype) is None
        return ReservedBits(value=self.sentinel(dtype)) if fits else None

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return (
            f"{self.sentinel(dtype)} (IntSentinel reserves it in {dtype} to mean "
            "'keep the destination'; pass IntSentinel(value=...) to reserve another value)"
        )

    def stage(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        return _stage_filled(self, shape, dtype, indices, values, self.sentinel(dtype))

    def merge(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        staged = _merge_staged(self, destination, source, non_blocking)
        if staged is not None:
            return staged
        if source.dtype != destination.dtype or self.unsupported_reason(source.dtype) is not None:
            raise LoaderContractError(
                f"{self!r}: masked copy_ from {_describe(source)} into {_describe(destination)}; "
                "IntSentinel needs source and destination of the same integer dtype (a cast "
                "across integer widths would move the sentinel)"
            )
        source = _move(source, destination, non_blocking)
        keep = source == self.sentinel(source.dtype)
        return torch.where(keep, destination, source, out=destination)

    def update_mask(self, source: torch.Tensor) -> torch.Tensor:
        """Where `source` carries an update (not the sentinel; staged data: its own mask)."""
        if isinstance(source, StagedTensor):
            return cast("torch.Tensor", mask_of(source))
        return source != self.sentinel(source.dtype)


@dataclass(frozen=True, slots=True)
class BoolMask:
    """An explicit boolean mask marks the updated positions: any dtype, NaN allowed as a value.

    `stage` returns a staged tensor that carries, beside its values, the mask of the positions
    the patch changes, through every view, copy, cast or reinterpretation the loader makes of
    it (see the Concepts page). Its ``copy_`` into a weight keeps the weight wherever the mask
    says "keep", in any thread and inside any region; no value is reserved. A plain tensor
    carries no mask, so `merge` refuses one.

    Examples:
        >>> import torch
        >>> from patchctx import BoolMask
        >>> staged = BoolMask().stage((3,), torch.float32, torch.tensor([0]),
        ...                           torch.tensor([float("nan")]))
        >>> weight = torch.ones(3)
        >>> _ = BoolMask().merge(weight, staged)
        >>> weight
        tensor([nan, 1., 1.])
    """

    fixed_support: ClassVar[bool] = True

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        if dtype in QUANTIZED:
            return f"BoolMask cannot stage the quantized dtype {dtype}"
        return None

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((), dtype=torch.bool, device=values.device)

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return "no value (BoolMask reserves none)"

    def reserved_bits(self, dtype: torch.dtype) -> ReservedBits:
        return ReservedBits()

    def stage(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        return _stage_filled(self, shape, dtype, indices, values, 0)

    def merge(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        if isinstance(source, StagedTensor):
            return _swap.plain_copy(destination, source, non_blocking)
        self.update_mask(source)  # raises: a plain tensor has no mask
        raise AssertionError  # pragma: no cover

    def update_mask(self, source: torch.Tensor) -> torch.Tensor:
        """Where `source` (a tensor staged by `stage`, or a view of one) carries an update."""
        if isinstance(source, StagedTensor):
            return cast("torch.Tensor", mask_of(source))
        raise LoaderContractError(
            f"{self!r}: the source of this copy_ ({_describe(source)}) was not staged by "
            "patchctx, so it carries no mask; stage it with BoolMask().stage(...)"
        )


_NAN_MASK = NaNMask()
_INT_SENTINEL = IntSentinel()


@dataclass(frozen=True, slots=True)
class Auto:
    """NaNMask for floating dtypes, IntSentinel (default sentinel) for integer ones.

    The default of `load_checkpoint_weight_patches`, so integer weights work out of the box.
    `merge` chooses by the source's dtype.

    Examples:
        >>> import torch
        >>> from patchctx import Auto
        >>> Auto().resolve(torch.bfloat16), Auto().resolve(torch.int8)
        (NaNMask(), IntSentinel(value=None))
    """

    fixed_support: ClassVar[bool] = True

    def resolve(self, dtype: torch.dtype) -> NaNMask | IntSentinel:
        """The strategy this one delegates to for `dtype`."""
        return _NAN_MASK if dtype.is_floating_point else _INT_SENTINEL

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        if dtype.is_complex or dtype == torch.bool:
            return f"Auto() has no sentinel for {dtype}; use BoolMask()"
        return self.resolve(dtype).unsupported_reason(dtype)

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.resolve(dtype).reserved_values(values, dtype)

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return self.resolve(dtype).describe_reserved(dtype)

    def reserved_bits(self, dtype: torch.dtype) -> ReservedBits | None:
        return self.resolve(dtype).reserved_bits(dtype)

    def stage(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        reason = self.unsupported_reason(dtype) if isinstance(dtype, torch.dtype) else None
        if reason is not None:
            raise InvalidPatchError(f"{self!r}.stage: {reason}")
        return self.resolve(dtype).stage(shape, dtype, indices, values)

    def merge(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        *,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        if source.dtype.is_complex or source.dtype == torch.bool:
            raise LoaderContractError(
                f"{self!r}: masked copy_ from {_describe(source)}: Auto() has no sentinel for "
                f"{source.dtype}"
            )
        return self.resolve(source.dtype).merge(destination, source, non_blocking=non_blocking)

    def update_mask(self, source: torch.Tensor) -> torch.Tensor:
        """Where `source` carries an update, by the strategy its dtype resolves to."""
        return self.resolve(source.dtype).update_mask(source)


def reserved_on_host(strategy: CopyStrategy, values: torch.Tensor, dtype: torch.dtype) -> bool:
    """`reserved_values` on the host: the strategy's ``reserved_on_host``, else NaN by count."""
    answer = getattr(strategy, "reserved_on_host", None)
    if callable(answer):
        return bool(answer(values, dtype))
    said = getattr(strategy, "reserved_bits", None)
    bits = said(dtype) if callable(said) else None
    nan = isinstance(bits, ReservedBits) and bits.nan and values.dtype is dtype
    if nan and dtype in _NAN_BY_AMAX:  # by count: Python floats, torch's amax, the bits
        count = values.numel()
        if count <= _tuning.LISTED_UP_TO and values.is_cpu:
            # A few values as Python floats (NaN stays NaN): no tensor operation at all.
            return any(map(math.isnan, values.tolist()))
        if count <= _tuning.AMAX_UP_TO and values.is_cpu:
            # amax propagates NaN: one reduction, below torch's grain size (one thread).
            return bool(torch.isnan(values.amax())) if count else False
        if nan_bits_known(values):
            return has_nan_bits(values)
    return bool(strategy.reserved_values(values, dtype))


# The floats whose NaN `reserved_on_host` finds itself (by torch's amax, up to
# `_tuning.AMAX_UP_TO` values).
_NAN_BY_AMAX = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def as_strategy(strategy: object, default: CopyStrategy, where: str) -> CopyStrategy:
    """Check a caller's `strategy=` argument (`None` means `default`)."""
    if strategy is None:
        return default
    examples = "NaNMask(), BoolMask(), IntSentinel(), Auto() or your own"
    return cast(
        CopyStrategy, instance_of(strategy, CopyStrategy, f"{where}(strategy=...)", examples)
    )
