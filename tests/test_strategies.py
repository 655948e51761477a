"""Strategies: the conformance table for every built-in strategy and a user-written one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from patchctx import (
    Auto,
    BoolMask,
    CopyStrategy,
    IntSentinel,
    InvalidPatchError,
    LoaderContractError,
    NaNMask,
    masked_copy,
)
from patchctx.testing import DEFAULT_DTYPES, ConformanceError, check_strategy, conformance_cases
from tests.support.models import same_bits

NAN = float("nan")


@dataclass(frozen=True, slots=True)
class ValueMask:
    """A user-written strategy: a reserved float value (here 1e30) marks "keep"."""

    marker: float = 1e30

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float32, torch.float64):
            return f"ValueMask handles float32/float64, not {dtype}"
        return None

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (values.to(dtype) == self.marker).any()

    def describe_reserved(self, dtype: torch.dtype) -> str:
        return repr(self.marker)

    def stage(
        self, shape: Sequence[int], dtype: torch.dtype, indices: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        reason = self.unsupported_reason(dtype)
        if reason:
            raise InvalidPatchError(reason)
        flat = torch.full((int(torch.tensor(shape).prod()),), self.marker, dtype=dtype)
        flat[indices.long()] = values.to(dtype)
        return flat.view(tuple(shape))

    def merge(
        self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False
    ) -> torch.Tensor:
        if destination.shape != source.shape:
            raise LoaderContractError("shapes differ")
        keep = source == self.marker
        update = source.to(destination.dtype)
        return torch.where(keep, destination, update, out=destination)


STRATEGIES: list[CopyStrategy] = [NaNMask(), BoolMask(), IntSentinel(), Auto(), ValueMask()]
CASES = [
    pytest.param(strategy, case, id=f"{strategy!r}-{case.id}")
    for strategy in STRATEGIES
    for case in conformance_cases(strategy)
]


@pytest.mark.parametrize(("strategy", "case"), CASES)
def test_conformance(strategy: CopyStrategy, case: object) -> None:
    case.check(strategy)  # type: ignore[attr-defined]


def test_check_strategy_reports_every_failure_of_a_broken_strategy() -> None:
    @dataclass(frozen=True)
    class Broken(ValueMask):
        def merge(
            self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False
        ) -> torch.Tensor:
            return destination.copy_(source)  # ignores the mask: writes the marker

    with pytest.raises(AssertionError) as info:
        check_strategy(Broken(), dtypes=[torch.float32])
    message = str(info.value)
    assert "merge-matches-dense-reference[float32]" in message
    assert "refuses-shape-mismatch[float32]" in message
    assert "stage-layout[float32]" not in message


def test_supported_dtypes_are_what_the_docs_say() -> None:
    floats = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    floats += [torch.float8_e4m3fn, torch.float8_e5m2]
    ints = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
    for dtype in floats:
        assert NaNMask().unsupported_reason(dtype) is None
        assert IntSentinel().unsupported_reason(dtype) is not None
        assert Auto().resolve(dtype) == NaNMask()
    for dtype in ints:
        assert IntSentinel().unsupported_reason(dtype) is None
        assert NaNMask().unsupported_reason(dtype) is not None
        assert Auto().resolve(dtype) == IntSentinel()
    for dtype in DEFAULT_DTYPES:
        assert BoolMask().unsupported_reason(dtype) is None
    assert Auto().unsupported_reason(torch.bool) is not None
    assert Auto().unsupported_reason(torch.complex64) is not None


def test_strategies_are_frozen_slotted_values() -> None:
    for strategy in (NaNMask(), BoolMask(), IntSentinel(), Auto()):
        assert not hasattr(strategy, "__dict__")
        # FrozenInstanceError (an AttributeError); CPython 3.11's slotted frozen dataclasses
        # raise TypeError from their __setattr__ instead. Either way: not mutable.
        with pytest.raises((AttributeError, TypeError)):
            strategy.x = 1  # type: ignore[union-attr]
        assert strategy == type(strategy)()
        assert hash(strategy) == hash(type(strategy)())
    assert IntSentinel(value=3) != IntSentinel()
    assert repr(IntSentinel(value=3)) == "IntSentinel(value=3)"
    with pytest.raises(TypeError):
        IntSentinel(3)  # type: ignore[call-arg]  # keyword-only
    with pytest.raises(TypeError, match="must be an int"):
        IntSentinel(value=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.int8, -128), (torch.int32, -(2**31)), (torch.int64, -(2**63)), (torch.uint8, 255)],
)
def test_int_sentinel_default_value(dtype: torch.dtype, expected: int) -> None:
    assert IntSentinel().sentinel(dtype) == expected
    staged = IntSentinel().stage((3,), dtype, torch.tensor([1]), torch.tensor([7], dtype=dtype))
    assert staged._data.tolist() == [expected, 7, expected]  # type: ignore[attr-defined]


def test_int_sentinel_value_must_fit_the_dtype() -> None:
    reason = IntSentinel(value=300).unsupported_reason(torch.int8)
    assert reason is not None and "does not fit" in reason
    with pytest.raises(InvalidPatchError, match="does not fit"):
        IntSentinel(value=300).stage((2,), torch.int8, torch.tensor([0]), torch.tensor([1]))


def test_int_sentinel_reserved_values_after_the_cast() -> None:
    # 128 as int64 wraps to -128 in int8: the sentinel. The check is done after the cast.
    assert bool(IntSentinel().reserved_values(torch.tensor([128]), torch.int8))
    assert not bool(IntSentinel().reserved_values(torch.tensor([127]), torch.int8))
    assert "-128" in IntSentinel().describe_reserved(torch.int8)


def test_int_sentinel_keeps_exactly_the_sentinel_positions() -> None:
    destination = torch.arange(-4, 4, dtype=torch.int8)
    staged = IntSentinel().stage(
        (8,), torch.int8, torch.tensor([0, 7]), torch.tensor([-127, 127], dtype=torch.int8)
    )
    IntSentinel().merge(destination, staged)
    assert destination.tolist() == [-127, -3, -2, -1, 0, 1, 2, 127]


def test_int_sentinel_data_cast_across_integer_widths_keeps_its_mask() -> None:
    staged = IntSentinel().stage((4,), torch.int8, torch.tensor([1]), torch.tensor([5]))
    destination = torch.zeros(4, dtype=torch.int32)
    IntSentinel().merge(destination, staged.to(torch.int64))
    assert destination.tolist() == [0, 5, 0, 0]
    plain = torch.tensor([-128, 5, -128, -128], dtype=torch.int8)  # sentinels in plain data
    with pytest.raises(LoaderContractError, match=r"int8.*int32"):
        IntSentinel().merge(destination, plain)  # a cast would move the sentinel


def test_nan_mask_reserved_values_and_refusals() -> None:
    assert bool(NaNMask().reserved_values(torch.tensor([1.0, NAN]), torch.bfloat16))
    assert not bool(NaNMask().reserved_values(torch.tensor([1.0, float("inf")]), torch.float16))
    destination = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(LoaderContractError, match="floating"):
        NaNMask().merge(destination, torch.zeros(3))
    with pytest.raises(LoaderContractError, match="floating"):
        NaNMask().merge(torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(LoaderContractError, match=r"\(3,\).*\(2, 2\)|same shape"):
        NaNMask().merge(torch.zeros(2, 2), torch.zeros(3))
    with pytest.raises(InvalidPatchError, match="floating dtype"):
        NaNMask().stage((3,), torch.int8, torch.tensor([0]), torch.tensor([1]))


def test_nan_mask_follows_copies_and_casts_of_the_staged_tensor() -> None:
    staged = NaNMask().stage((4, 2), torch.float32, torch.tensor([0, 5]), torch.tensor([1.5, 2.5]))
    destination = torch.zeros(2, 4, dtype=torch.bfloat16)
    NaNMask().merge(destination, staged.t().contiguous().to(torch.float16))
    expected = torch.zeros(2, 4, dtype=torch.bfloat16)
    expected[0, 0], expected[1, 2] = 1.5, 2.5
    assert same_bits(destination, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_bool_mask_carries_any_value_including_nan(dtype: torch.dtype) -> None:
    special = {
        torch.float32: [NAN, float("-inf"), -0.0],
        torch.bfloat16: [NAN, float("inf"), 0.0],
        torch.int8: [-128, 127, 0],
        torch.bool: [True, False, True],
    }[dtype]
    values = torch.tensor(special, dtype=dtype)
    indices = torch.tensor([4, 0, 2])
    staged = BoolMask().stage((5,), dtype, indices, values)
    destination = torch.ones(5, dtype=dtype)
    BoolMask().merge(destination, staged)
    expected = torch.ones(5, dtype=dtype)
    expected[indices] = values
    assert same_bits(destination, expected)


def test_bool_mask_follows_views_and_materialised_copies_alike() -> None:
    staged = BoolMask().stage(
        (4, 3), torch.float32, torch.tensor([1, 11]), torch.tensor([NAN, 2.0])
    )
    destination = torch.zeros(3, 2)
    BoolMask().merge(destination, staged.narrow(0, 2, 2).t())  # rows 2-3, transposed
    assert destination[2, 1] == 2.0
    assert not torch.isnan(destination).any()
    for materialised in (
        staged.t().contiguous().t(),
        staged.to(torch.float64),
        torch.cat([staged, staged])[4:],
        staged.clone(),
    ):
        target = torch.ones(materialised.shape, dtype=materialised.dtype)
        BoolMask().merge(target, materialised)
        assert torch.isnan(target[0, 1]) and target[3, 2] == 2.0
        assert int((target == 1).sum()) == 10  # every other element kept


def test_bool_mask_refuses_a_plain_source_it_has_no_mask_for() -> None:
    target = torch.zeros(3)
    with pytest.raises(LoaderContractError, match="not staged by patchctx"):
        BoolMask().merge(target, torch.ones(3))
    assert not target.any()


def test_bool_mask_inside_masked_copy_through_a_packed_loader() -> None:
    strategy = BoolMask()
    staged = strategy.stage((4, 2), torch.int32, torch.tensor([2, 3]), torch.tensor([-1, -2]))
    packed = torch.full((6, 2), 9, dtype=torch.int32)
    with masked_copy(strategy=strategy):
        packed.narrow(0, 2, 2).copy_(staged.narrow(0, 1, 2))  # rank 1 of 2 -> second slot
    assert packed.tolist() == [[9, 9], [9, 9], [-1, -2], [9, 9], [9, 9], [9, 9]]


def test_auto_dispatches_merge_on_the_source_dtype() -> None:
    f = Auto().stage((3,), torch.float16, torch.tensor([2]), torch.tensor([4.0]))
    i = Auto().stage((3,), torch.int16, torch.tensor([0]), torch.tensor([4]))
    df, di = torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.int16)
    Auto().merge(df, f)
    Auto().merge(di, i)
    assert df.tolist() == [1.0, 1.0, 4.0]
    assert di.tolist() == [4, 1, 1]
    with pytest.raises(InvalidPatchError, match="no sentinel"):
        Auto().stage((3,), torch.bool, torch.tensor([0]), torch.tensor([True]))
    with pytest.raises(LoaderContractError, match="no sentinel"):
        Auto().merge(torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool))


def test_stage_reports_structural_problems_together() -> None:
    with pytest.raises(InvalidPatchError) as info:
        NaNMask().stage((-1, 2), torch.float32, torch.tensor([[0]]), torch.tensor([1.0]))
    assert "negative" in str(info.value) and "1-D" in str(info.value)
    with pytest.raises(InvalidPatchError, match="int32 or int64"):
        NaNMask().stage((2,), torch.float32, torch.tensor([0.0]), torch.tensor([1.0]))
    with pytest.raises(InvalidPatchError, match="2 indices for 1 values"):
        NaNMask().stage((2,), torch.float32, torch.tensor([0, 1]), torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        NaNMask().stage((2,), "float32", torch.tensor([0]), torch.tensor([1.0]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float16, torch.float8_e4m3fn),
        (torch.float64, torch.float32),
    ],
)
def test_nan_mask_casts_exactly_as_copy_does(
    src_dtype: torch.dtype, dst_dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(40, generator=generator) * 3).to(src_dtype)
    indices = torch.randperm(64, generator=generator)[:40]
    staged = NaNMask().stage((8, 8), src_dtype, indices, values)
    destination = torch.randn(8, 8, generator=generator).to(dst_dtype)
    expected = destination.clone()
    expected.view(-1)[indices] = torch.empty(40, dtype=dst_dtype).copy_(values)
    NaNMask().merge(destination, staged)
    assert same_bits(destination, expected)


def test_merge_accepts_non_blocking() -> None:
    staged = NaNMask().stage((3,), torch.float32, torch.tensor([1]), torch.tensor([2.0]))
    destination = torch.zeros(3)
    NaNMask().merge(destination, staged, non_blocking=True)
    assert destination.tolist() == [0.0, 2.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("strategy", [IntSentinel(), BoolMask(), Auto()])
def test_wide_unsigned_integers_stage_and_merge(strategy: CopyStrategy, dtype: torch.dtype) -> None:
    """CPU has no index_copy_ for uint16/32/64; their bits move through a signed view."""
    staged = strategy.stage((2, 3), dtype, torch.tensor([1, 5]), torch.tensor([7, 0]).to(dtype))
    weight = torch.full((2, 3), 9).to(dtype)
    strategy.merge(weight, staged)
    assert weight.view(-1).tolist() == [9, 7, 9, 9, 9, 0]


@dataclass(frozen=True, slots=True)
class _Blends(ValueMask):
    """Merges by arithmetic instead of selection: inf * 0 is NaN, and -0.0 + 0.0 is +0.0."""

    def merge(
        self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False
    ) -> torch.Tensor:
        keep = (source == self.marker).to(destination.dtype)
        new = torch.where(source == self.marker, 0, source).to(destination.dtype)
        return destination.copy_(destination * keep + new * (1 - keep))


@dataclass(frozen=True, slots=True)
class _LiesAboutReserved(ValueMask):
    """Says no value is reserved, so validation lets its marker through as an update."""

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((), dtype=torch.bool)


def test_the_conformance_cases_pass_a_correct_marker_strategy() -> None:
    check_strategy(ValueMask(), dtypes=[torch.float32, torch.float64])


@pytest.mark.parametrize("strategy", [_Blends(), _LiesAboutReserved()], ids=repr)
def test_the_conformance_cases_catch_merges_that_lose_special_values_or_markers(
    strategy: CopyStrategy,
) -> None:
    with pytest.raises(ConformanceError, match="special-values-land-or-are-reserved"):
        check_strategy(strategy, dtypes=[torch.float32])


_ASKED: list[str] = []


@dataclass(frozen=True, slots=True)
class _HostAnswering(ValueMask):
    """ValueMask with the protocol's two optional members, recording when each is used."""

    fixed_support = True

    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        _ASKED.append("unsupported_reason")
        return ValueMask.unsupported_reason(self, dtype)

    def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        _ASKED.append("reserved_values")
        return ValueMask.reserved_values(self, values, dtype)

    def reserved_on_host(self, values: torch.Tensor, dtype: torch.dtype) -> bool:
        _ASKED.append("reserved_on_host")
        return bool((values.to(dtype) == self.marker).any())


def test_a_strategys_optional_fast_paths_are_used_as_the_builtins_are() -> None:
    from patchctx import CheckpointWeightPatch, validate_patches

    def patch(value: float) -> CheckpointWeightPatch:
        return CheckpointWeightPatch(
            "w", (4,), torch.float32, torch.tensor([value]), torch.tensor([2])
        )

    _ASKED.clear()
    strategy = _HostAnswering(marker=7.0)
    validate_patches([patch(1.0)], strategy=strategy)
    validate_patches([patch(2.0)], strategy=strategy)
    # Reserved values answered on the host, never through the 0-d tensor; the dtype's support
    # asked once for both calls (``fixed_support``).
    assert _ASKED.count("reserved_on_host") == 2
    assert "reserved_values" not in _ASKED
    assert _ASKED.count("unsupported_reason") == 1
    # The host answer is the one that decides: the marker itself is refused.
    with pytest.raises(InvalidPatchError, match=r"7\.0"):
        validate_patches([patch(7.0)], strategy=strategy)


@dataclass(frozen=True, slots=True)
class _Asked(ValueMask):
    def unsupported_reason(self, dtype: torch.dtype) -> str | None:
        _ASKED.append("unsupported_reason")
        return ValueMask.unsupported_reason(self, dtype)


class _UnhashableFixed(_Asked):
    fixed_support = True
    __hash__ = None  # type: ignore[assignment]  # says fixed, cannot be kept


@pytest.mark.parametrize("kind", [_Asked, _UnhashableFixed])
def test_a_strategy_without_kept_support_is_asked_every_call(kind: type[ValueMask]) -> None:
    from patchctx import CheckpointWeightPatch, validate_patches

    _ASKED.clear()
    patch = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([2]))
    validate_patches([patch], strategy=kind())
    validate_patches([patch], strategy=kind())
    assert _ASKED.count("unsupported_reason") == 2
