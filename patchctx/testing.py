"""A conformance table for copy strategies, yours included.

Every built-in strategy is tested against these cases. Run them on a strategy of your own with
`check_strategy` (it raises `ConformanceError`, an `AssertionError`, listing every failed
case), or parametrize a pytest test over `conformance_cases` to get one test per case:

>>> from patchctx import BoolMask
>>> from patchctx.testing import check_strategy
>>> check_strategy(BoolMask())

Each case stages a random sparse patch for one dtype, merges it (directly, through views and
inside a `masked_copy` region) and compares with a dense reference bit for bit. Cases for a
dtype the strategy declares unsupported (`unsupported_reason`) check only that staging it is
refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from patchctx._errors import LoaderContractError, PatchError
from patchctx._masked_copy import masked_copy
from patchctx._staged import StagedTensor, data_of
from patchctx._strategies import CopyStrategy, ReservedBits

__all__ = [
    "DEFAULT_DTYPES",
    "ConformanceCase",
    "ConformanceError",
    "check_strategy",
    "conformance_cases",
]

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
"""The checkpoint dtypes the conformance table covers by default.

Floating (including float8), signed and unsigned integer, bool and complex: a strategy is
checked on those it supports and must refuse the others cleanly.
"""


@dataclass(frozen=True)
class ConformanceCase:
    """One check of a strategy's contract for one dtype.

    Attributes:
        id: A readable identifier, e.g. ``"merge-matches-dense-reference[bfloat16]"``.
        dtype: The checkpoint dtype the case stages.
        check: Runs the case against a strategy; raises `ConformanceError` (an
            `AssertionError`) on failure.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask
        >>> from patchctx.testing import conformance_cases
        >>> case = conformance_cases(NaNMask(), [torch.float32])[1]
        >>> case.id, case.dtype
        ('merge-empty-patch[float32]', torch.float32)
        >>> case.check(NaNMask())  # returns quietly when the strategy passes
    """

    id: str
    dtype: torch.dtype
    check: Callable[[CopyStrategy], None]


class ConformanceError(PatchError, AssertionError):
    """A strategy broke its contract: raised by the conformance cases and `check_strategy`.

    It is an `AssertionError`, so pytest reports it as a failed check, and a `PatchError`, like
    every error patchctx raises. The checks raise it explicitly: they do not use ``assert``
    statements, so they keep working under ``python -O``.

    Examples:
        >>> from patchctx import PatchError
        >>> from patchctx.testing import ConformanceError
        >>> issubclass(ConformanceError, AssertionError), issubclass(ConformanceError, PatchError)
        (True, True)
    """


def _require(condition: object, message: str) -> None:
    """Raise `ConformanceError` with `message` unless `condition` holds (not an ``assert``)."""
    if not condition:
        raise ConformanceError(message)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor).contiguous()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(as_int[tensor.element_size()])


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    _require(actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}")
    _require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    _require(torch.equal(_bits(actual), _bits(expected)), f"{what}: values differ from reference")


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        parts = torch.randn((*shape, 2), generator=generator)
        return torch.view_as_complex(parts).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int64).to(dtype)


@dataclass(frozen=True)
class _Patch:
    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor


def _patch(
    strategy: CopyStrategy, dtype: torch.dtype, shape: tuple[int, ...], seed: int, density: float
) -> _Patch:
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    count = max(0, min(numel, round(numel * density)))
    indices = torch.randperm(numel, generator=generator)[:count].sort().values
    for _ in range(64):
        values = _random((count,), dtype, generator)
        if not bool(strategy.reserved_values(values, dtype)):
            return _Patch(shape, indices, values)
    raise ConformanceError(f"could not draw {count} {dtype} values that the strategy can carry")


def _reference(destination: torch.Tensor, patch: _Patch, dtype: torch.dtype) -> torch.Tensor:
    expected = destination.clone()
    flat = expected.view(-1)
    flat[patch.indices.long()] = patch.values.to(dtype).to(destination.dtype)
    return expected


def _case_stage_layout(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        patch = _patch(strategy, dtype, (3, 5), seed=1, density=0.4)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        _require(isinstance(staged, torch.Tensor), "stage must return a tensor")
        _require(staged.shape == patch.shape, f"staged shape {staged.shape} != {patch.shape}")
        _require(staged.dtype == dtype, f"staged dtype {staged.dtype} != {dtype}")
        _require(staged.device == patch.values.device, "staged tensor must be on values.device")
        _require(staged.is_contiguous(), "staged tensor must be contiguous (row-major)")
        if patch.values.numel():
            data = data_of(staged)
            _require(
                data.untyped_storage().data_ptr() != patch.values.untyped_storage().data_ptr(),
                "staged tensor must not alias the caller's values",
            )

    return check


def _case_merge_reference(dtype: torch.dtype, density: float) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        generator = torch.Generator().manual_seed(7)
        patch = _patch(strategy, dtype, (4, 6), seed=2, density=density)
        destination = _random(patch.shape, dtype, generator)
        expected = _reference(destination, patch, dtype)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        pointer = destination.data_ptr()
        returned = strategy.merge(destination, staged)
        _require(returned is destination, "merge must return the destination object")
        _require(destination.data_ptr() == pointer, "merge must write in place")
        _assert_same_bits(destination, expected, f"merge at density {density}")

    return check


def _case_merge_views(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    """A tensor-parallel loader: narrow + transpose of the staged tensor into a packed slice."""

    def check(strategy: CopyStrategy) -> None:
        generator = torch.Generator().manual_seed(11)
        patch = _patch(strategy, dtype, (6, 4), seed=3, density=0.5)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        packed = _random((4, 10), dtype, generator)  # [cols, other + rows/2 ...]
        expected = packed.clone()
        reference_full = _reference(torch.zeros(patch.shape, dtype=dtype), patch, dtype)
        touched = torch.zeros(patch.shape, dtype=torch.bool).view(-1)
        touched[patch.indices.long()] = True
        view_mask = touched.view(patch.shape).narrow(0, 3, 3).t()
        view_new = reference_full.narrow(0, 3, 3).t()
        target = expected[:, 5:8]
        target[view_mask] = view_new[view_mask]
        strategy.merge(packed[:, 5:8], staged.narrow(0, 3, 3).t())
        _assert_same_bits(packed, expected, "merge through narrow + transpose views")

    return check


def _case_masked_copy_region(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        generator = torch.Generator().manual_seed(13)
        patch = _patch(strategy, dtype, (5, 3), seed=4, density=0.3)
        destination = _random(patch.shape, dtype, generator)
        expected = _reference(destination, patch, dtype)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        with masked_copy(strategy=strategy):
            returned = destination.copy_(staged)
        _require(returned is destination, "copy_ inside the region must return the destination")
        _assert_same_bits(destination, expected, "copy_ inside masked_copy")
        outside = _random(patch.shape, dtype, generator)
        expected_outside = _reference(outside, patch, dtype)
        outside.copy_(staged)
        if isinstance(staged, StagedTensor):  # patchctx's staged data: masked everywhere
            _assert_same_bits(outside, expected_outside, "copy_ of staged data outside a region")
        else:  # a plain tensor: plain copy_ outside the region
            _assert_same_bits(outside, staged, "plain copy_ after the region")

    return check


def _case_shape_mismatch(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        generator = torch.Generator().manual_seed(17)
        patch = _patch(strategy, dtype, (2, 4), seed=5, density=0.5)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        destination = _random((4, 2), dtype, generator)
        before = destination.clone()
        try:
            strategy.merge(destination, staged)
        except LoaderContractError:
            pass
        else:
            raise ConformanceError("merge into a differently shaped destination must raise")
        _assert_same_bits(destination, before, "destination after a refused merge")

    return check


def _case_cast(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    """Across a dtype cast, a merge either writes what copy_ writes or refuses, writing nothing."""
    if dtype.is_complex:
        other = torch.complex128 if dtype != torch.complex128 else torch.complex64
    else:
        other = torch.float32 if dtype != torch.float32 else torch.bfloat16

    def check(strategy: CopyStrategy) -> None:
        generator = torch.Generator().manual_seed(19)
        patch = _patch(strategy, dtype, (3, 4), seed=6, density=0.5)
        staged = strategy.stage(patch.shape, dtype, patch.indices, patch.values)
        destination = _random(patch.shape, other, generator)
        before = destination.clone()
        try:
            strategy.merge(destination, staged)
        except LoaderContractError:
            _assert_same_bits(destination, before, "destination after a refused cast")
            return
        _assert_same_bits(destination, _reference(before, patch, dtype), f"merge {dtype}->{other}")

    return check


def _specials(dtype: torch.dtype) -> torch.Tensor:
    """Values random draws never give: infinities, signed zeros, NaN, extremes, subnormals."""
    if dtype == torch.bool:
        return torch.tensor([True, False])
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.float64 if dtype.is_complex else dtype
        info = torch.finfo(real)
        edges = [math.inf, -math.inf, -0.0, 0.0, math.nan, info.max, info.min, info.tiny]
        edges.append(info.smallest_normal / 2)  # subnormal (zero where the dtype has none)
        column = torch.tensor(edges, dtype=torch.float64).to(real)
        if dtype.is_complex:
            return torch.complex(column, column.flip(0)).to(dtype)
        return column
    bounds = torch.iinfo(dtype)
    extremes = sorted({bounds.min, bounds.max, 0, 1, max(bounds.min, -1)})
    return torch.tensor(extremes, dtype=torch.int64).to(dtype)


def _case_special_values(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    """Kept destinations holding special values stay bit for bit.

    And every special value, and the value the strategy fills unchanged positions with, is
    either reserved (validation refuses it) or lands exactly.
    """

    def check(strategy: CopyStrategy) -> None:
        specials = _specials(dtype)
        count = specials.numel()
        patch = _patch(strategy, dtype, (count,), seed=3, density=0.5)
        destination = specials.clone()
        expected = _reference(destination, patch, dtype)
        strategy.merge(destination, strategy.stage(patch.shape, dtype, patch.indices, patch.values))
        _assert_same_bits(destination, expected, "merge over special values")
        one = _patch(strategy, dtype, (2,), seed=5, density=0.5)  # one index of two changes
        staged = strategy.stage(one.shape, dtype, one.indices, one.values)
        data = data_of(staged)
        kept = 1 - int(one.indices[0])
        candidates = [specials[k : k + 1] for k in range(count)]
        candidates.append(data.reshape(-1)[kept : kept + 1].clone())
        for value in candidates:
            if bool(strategy.reserved_values(value, dtype)):
                continue  # refused by validation: never staged
            destination = _random((3,), dtype, torch.Generator().manual_seed(4))
            expected = destination.clone()
            expected[1:2] = value
            merged = strategy.stage((3,), dtype, torch.tensor([1]), value)
            strategy.merge(destination, merged)
            _assert_same_bits(
                destination,
                expected,
                f"the update {value.item()!r}, not reserved by reserved_values, must land",
            )

    return check


def _case_reserved_flag(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        values = torch.zeros(0, dtype=dtype)
        flag = strategy.reserved_values(values, dtype)
        _require(isinstance(flag, torch.Tensor), "reserved_values must return a tensor")
        _require(flag.dtype == torch.bool and flag.ndim == 0, "reserved_values: a 0-d bool tensor")
        _require(not bool(flag), "an empty tensor holds no reserved value")
        _require(
            isinstance(strategy.describe_reserved(dtype), str),
            "describe_reserved must return a str",
        )

    return check


def _case_reserved_bits(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    """``reserved_bits`` (optional) says what `reserved_values` says, value by value."""

    def check(strategy: CopyStrategy) -> None:
        said = getattr(strategy, "reserved_bits", None)
        bits = said(dtype) if callable(said) else None
        if bits is None:
            return  # no fast path: the diff asks reserved_values
        _require(isinstance(bits, ReservedBits), "reserved_bits must return ReservedBits or None")
        candidates = [_specials(dtype), _random((64,), dtype, torch.Generator().manual_seed(6))]
        if dtype.is_floating_point:  # a NaN of the other sign, by its bits
            candidates.append(torch.tensor([-math.nan], dtype=torch.float64).to(dtype))
        marker = None
        if bits.value is not None and not (dtype.is_complex or dtype == torch.bool):
            if dtype.is_floating_point:  # compared by its bits: 0.0 does not cover -0.0
                marker = torch.tensor([float(bits.value)], dtype=torch.float64).to(dtype)
            else:
                info, at = torch.iinfo(dtype), int(bits.value)
                near = [v for v in (at - 1, at + 1) if info.min <= v <= info.max]
                candidates.append(torch.tensor(near, dtype=torch.int64).to(dtype))
                marker = torch.tensor([at], dtype=torch.int64).to(dtype)
            candidates.append(marker)
        elif bits.value is not None:
            return  # complex and bool: the diff asks reserved_values, whatever the bits say
        every = torch.cat(candidates)
        for value in (every[k : k + 1] for k in range(every.numel())):
            if bits.nan:
                claimed = bool(torch.isnan(value).any())
            else:
                claimed = marker is not None and torch.equal(_bits(value), _bits(marker))
            answer = bool(strategy.reserved_values(value, dtype))
            _require(
                claimed == answer,
                f"reserved_bits says {bits} but reserved_values says {answer} for "
                f"{value.item()!r}: they must agree",
            )

    return check


def _case_unsupported(dtype: torch.dtype) -> Callable[[CopyStrategy], None]:
    def check(strategy: CopyStrategy) -> None:
        reason = strategy.unsupported_reason(dtype)
        _require(isinstance(reason, str) and reason, "unsupported_reason must explain itself")
        try:
            strategy.stage((2,), dtype, torch.tensor([0]), torch.zeros(1, dtype=dtype))
        except (PatchError, TypeError, ValueError):
            return
        raise ConformanceError(f"staging the unsupported dtype {dtype} must raise")

    return check


def conformance_cases(
    strategy: CopyStrategy, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES
) -> list[ConformanceCase]:
    """The cases that apply to `strategy`, for each of `dtypes`.

    Args:
        strategy: The strategy under test (asked which dtypes it supports).
        dtypes: The checkpoint dtypes to cover.

    Returns:
        One `ConformanceCase` per check and dtype; run each with ``case.check(strategy)``.
        A dtype the strategy declares unsupported gets one case: that staging it is refused.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask
        >>> from patchctx.testing import conformance_cases
        >>> cases = conformance_cases(NaNMask(), [torch.bfloat16, torch.int8])
        >>> len(cases), cases[0].id, cases[-1].id
        (12, 'stage-layout[bfloat16]', 'refuses-unsupported[int8]')

        In a pytest suite, one test per case:

        >>> import pytest
        >>> @pytest.mark.parametrize("case", conformance_cases(NaNMask()), ids=lambda c: c.id)
        ... def test_my_strategy(case):
        ...     case.check(NaNMask())
    """
    cases = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        if strategy.unsupported_reason(dtype) is not None:
            cases.append(
                ConformanceCase(f"refuses-unsupported[{name}]", dtype, _case_unsupported(dtype))
            )
            continue
        builders: list[tuple[str, Callable[[CopyStrategy], None]]] = [
            ("stage-layout", _case_stage_layout(dtype)),
            ("merge-empty-patch", _case_merge_reference(dtype, 0.0)),
            ("merge-matches-dense-reference", _case_merge_reference(dtype, 0.4)),
            ("merge-full-patch", _case_merge_reference(dtype, 1.0)),
            ("merge-through-views", _case_merge_views(dtype)),
            ("copy-inside-masked-copy", _case_masked_copy_region(dtype)),
            ("refuses-shape-mismatch", _case_shape_mismatch(dtype)),
            ("cast-exact-or-refused", _case_cast(dtype)),
            ("reserved-values-flag", _case_reserved_flag(dtype)),
            ("special-values-land-or-are-reserved", _case_special_values(dtype)),
            ("reserved-bits-agree", _case_reserved_bits(dtype)),
        ]
        cases.extend(ConformanceCase(f"{label}[{name}]", dtype, fn) for label, fn in builders)
    return cases


def check_strategy(strategy: CopyStrategy, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES) -> None:
    """Run every conformance case on `strategy`.

    Args:
        strategy: The strategy under test.
        dtypes: The checkpoint dtypes to cover.

    Raises:
        ConformanceError: One or more cases failed (an `AssertionError`); the message lists
            each with its reason.

    Examples:
        >>> from patchctx import NaNMask
        >>> from patchctx.testing import check_strategy
        >>> check_strategy(NaNMask())
    """
    failures = []
    for case in conformance_cases(strategy, dtypes):
        try:
            case.check(strategy)
        except Exception as error:  # collect every failure into one report
            failures.append(f"{case.id}: {type(error).__name__}: {error}")
    if failures:
        listing = "\n".join(f"  - {f}" for f in failures)
        raise ConformanceError(f"{strategy!r} failed {len(failures)} conformance cases:\n{listing}")
