"""UpdateCost and the sparse-or-dense decision of diff_state_dicts(cost=...)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, fields, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchctx import (
    Auto,
    CheckpointWeightPatch,
    InvalidPatchError,
    InvalidPatchTypeError,
    UpdateCost,
    _cost,
    diff_state_dicts,
)
from patchctx._cost import touched_lines
from patchctx._diff import choose_sparse, sparse_nbytes

NUMEL = 2**20
# Apply only (a free link, no fixed costs): sparse 1 ns per changed element, dense 0.1 ns per
# byte; so in bf16 sparse wins below 20% density, in fp32 below 40%.
APPLY_ONLY = UpdateCost(
    link_bytes_per_second=math.inf,
    sparse_seconds_per_element=1e-9,
    sparse_seconds_per_line=0.0,
    bitmask_seconds_per_element=0.0,
    dense_seconds_per_byte=1e-10,
    sparse_seconds_per_patch=0.0,
    dense_seconds_per_patch=0.0,
    payload_seconds_per_byte=0.0,
    diff_seconds_per_element=0.0,
    scan_seconds_per_element=0.0,
    dense_diff_seconds_per_byte=0.0,
    plane_seconds_per_element=0.0,
)


def changed_at(
    count: int, dtype: torch.dtype = torch.bfloat16, spread: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    old = {"w": torch.zeros(NUMEL, dtype=dtype)}
    new = {"w": old["w"].clone()}
    positions = torch.linspace(0, NUMEL - 1, count).long() if spread else torch.arange(count)
    new["w"][positions] = 1.0
    return old, new


def is_sparse(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], **kwargs: object) -> bool:
    [patch] = diff_state_dicts(old, new, **kwargs)  # type: ignore[arg-type]
    return patch.indices is not None


def test_estimates_are_the_documented_formulas() -> None:
    cost = UpdateCost(
        link_bytes_per_second=1e9,
        sparse_seconds_per_element=2e-9,
        dense_seconds_per_byte=3e-10,
        sparse_seconds_per_patch=5e-6,
        dense_seconds_per_patch=7e-6,
        payload_seconds_per_byte=4e-9,
        diff_seconds_per_element=6e-9,
        scan_seconds_per_element=5e-10,
        dense_diff_seconds_per_byte=1e-10,
        plane_seconds_per_element=8e-9,
        sparse_seconds_per_line=0.0,
    )
    assert cost.sparse_seconds(1000, 4000) == pytest.approx(
        5e-6 + 1000 * (2e-9 + 6e-9 + 8e-9) + 4000 * 4e-9 + 4000 / 1e9
    )
    # Given the tensor, the trainer's scan of all of its elements counts too.
    assert cost.sparse_seconds(1000, 4000, numel=10_000, element_size=2) == pytest.approx(
        cost.sparse_seconds(1000, 4000) + 10_000 * 5e-10
    )
    assert cost.dense_seconds(10_000, 2) == pytest.approx(
        7e-6 + 20_000 * (1e-10 + 3e-10 + 4e-9) + 20_000 / 1e9
    )
    assert cost.prefers_sparse(numel=10_000, nnz=1000, element_size=2, sparse_bytes=4000) == (
        cost.sparse_seconds(1000, 4000) < cost.dense_seconds(10_000, 2)
    )


def test_a_replay_pays_for_the_lines_it_writes_into() -> None:
    # bf16: 32 elements to a 64-byte line, 2**20 elements in 65,536 lines.
    numel, lines = 2**20, 2**20 * 2 // 64
    assert touched_lines(0, numel, 2) == 0 and touched_lines(numel, numel, 2) == lines
    assert touched_lines(1, numel, 2) == pytest.approx(1.0, rel=1e-4)
    for nnz in (100, 10_000, 300_000):  # at random, each line misses all of them this often
        missed = (1 - nnz / numel) ** 32
        assert touched_lines(nnz, numel, 2) == pytest.approx(lines * (1 - missed))
    assert touched_lines(10, numel, 16) == pytest.approx(10, rel=1e-4)  # 4 to a line
    assert touched_lines(5, 0, 2) == touched_lines(5, numel, 0) == 0  # not given
    cost = UpdateCost(
        link_bytes_per_second=math.inf,
        sparse_seconds_per_element=1e-9,
        sparse_seconds_per_line=4e-9,
        sparse_seconds_per_patch=0.0,
        diff_seconds_per_element=0.0,
        scan_seconds_per_element=0.0,
        plane_seconds_per_element=0.0,
    )

    def per_element(nnz: int) -> float:
        return cost.sparse_seconds(nnz, 0, numel=numel, element_size=2) / nnz

    # A change alone on its line pays for the line; by half the tensor, 16 share each.
    assert per_element(100) == pytest.approx(5e-9, rel=1e-2)
    assert per_element(numel // 2) == pytest.approx(1e-9 + 4e-9 / 16, rel=1e-3)
    assert cost.sparse_seconds(100, 0) == pytest.approx(100e-9)  # no tensor given: no lines


@pytest.mark.parametrize(("dtype", "crossover"), [(torch.bfloat16, 0.2), (torch.float32, 0.4)])
def test_dense_above_the_crossover_and_sparse_below(dtype: torch.dtype, crossover: float) -> None:
    below, above = round(NUMEL * crossover * 0.95), round(NUMEL * crossover * 1.05)
    assert is_sparse(*changed_at(below, dtype), cost=APPLY_ONLY)
    assert not is_sparse(*changed_at(above, dtype), cost=APPLY_ONLY)
    # by size alone, both are sparse (a bitmask and the values are smaller than dense)
    assert is_sparse(*changed_at(above, dtype), cost=None)


def test_a_bitmask_costs_its_decode_per_element_of_the_tensor() -> None:
    # 10% changed: positions are smallest as a bitmask (1/8 byte per element, not 2 * 10%)
    old, new = changed_at(round(NUMEL * 0.1))
    assert is_sparse(old, new, cost=APPLY_ONLY)
    scan = UpdateCost(**{**asdict(APPLY_ONLY), "bitmask_seconds_per_element": 1e-10})
    assert not is_sparse(old, new, cost=scan)  # 0.1 ns per element scanned tips it
    # 1% changed: gaps are smaller, so the bitmask's cost does not apply
    old, new = changed_at(round(NUMEL * 0.01))
    assert is_sparse(old, new, cost=scan)
    assert scan.sparse_seconds(10, 100, bitmask_numel=1000) == pytest.approx(
        10 * 1e-9 + 1000 * 1e-10
    )


def test_flat_positions_price_a_sparse_patch_at_its_flat_size() -> None:
    # 60% of an fp32 tensor changed, only bytes costing: in its smallest encoding (a bitmask)
    # the sparse payload is 0.125 + 4 * 0.6 bytes per element and wins; sent flat (int32
    # positions, as patchctx.vllm's shared memory plane does) it is 8 * 0.6 = 4.8, more than
    # the dense 4, so the tensor goes dense. At 10% flat (0.8 bytes) it stays sparse.
    by_bytes = replace(APPLY_ONLY, sparse_seconds_per_element=0.0, dense_seconds_per_byte=0.0)
    by_bytes = replace(by_bytes, payload_seconds_per_byte=1e-9)
    flat = replace(by_bytes, position_bytes=4)
    old, new = changed_at(round(NUMEL * 0.6), torch.float32)
    assert is_sparse(old, new, cost=by_bytes)
    assert not is_sparse(old, new, cost=flat)
    old, new = changed_at(round(NUMEL * 0.1), torch.float32)
    assert is_sparse(old, new, cost=flat)
    # a flat sparse patch pays no bitmask decode, whatever its density
    decoded = replace(flat, bitmask_seconds_per_element=1.0)
    assert is_sparse(old, new, cost=decoded)
    assert flat.flat_position_bytes(2**31) == 8 and by_bytes.flat_position_bytes(2**31) == 0


def test_calibrate_counts_a_flat_planes_sparse_bytes_at_their_flat_size() -> None:
    # A plane that costs exactly its bytes: told it sends positions flat, calibrate finds
    # no per-element cost beyond them (counted at their smallest encoding, the 3 extra
    # bytes of each int32 position would be charged per element instead).
    def bytes_only(patch: CheckpointWeightPatch) -> None:
        size = patch.values.numel() * patch.values.element_size()
        if patch.indices is not None:
            size += patch.indices.numel() * 4
        torch.empty(size * 64, dtype=torch.uint8).fill_(1)  # time in proportion to bytes

    flat = UpdateCost.calibrate(numel=2**20, repeats=3, payload=bytes_only, position_bytes=4)
    smallest = UpdateCost.calibrate(numel=2**20, repeats=3, payload=bytes_only)
    assert flat.position_bytes == 4 and smallest.position_bytes == 0
    assert flat.plane_seconds_per_element < smallest.plane_seconds_per_element


def test_a_slow_link_favours_the_smaller_payload() -> None:
    # at 30% in bf16 replay is slower than a copy, but over a 100 MB/s link the bitmask
    # payload (0.125 + 2 * 0.3 bytes per element) beats 2 bytes per element
    old, new = changed_at(round(NUMEL * 0.3))
    assert not is_sparse(old, new, cost=APPLY_ONLY)
    slow = UpdateCost(
        link_bytes_per_second=1e8,
        sparse_seconds_per_element=1e-9,
        bitmask_seconds_per_element=0.0,
        dense_seconds_per_byte=1e-10,
    )
    assert is_sparse(old, new, cost=slow)


def test_fixed_costs_send_small_tensors_dense() -> None:
    old = {"b": torch.zeros(64)}
    new = {"b": torch.zeros(64)}
    new["b"][3] = 1.0
    assert is_sparse(old, new, cost=None)  # 4 + 8 bytes against 256
    assert is_sparse(old, new, cost=APPLY_ONLY)
    # The defaults: one more sparse patch in a call costs 22 µs, a dense one along its route
    # 8.4 µs, which no element count of this tensor makes up for.
    assert not is_sparse(old, new)
    assert not is_sparse(old, new, cost=UpdateCost(sparse_seconds_per_patch=1e-3))
    bigger = {"b": torch.zeros(2**16)}  # a dense patch's bytes now cost more than that
    changed = {"b": bigger["b"].clone()}
    changed["b"][3] = 1.0
    assert is_sparse(bigger, changed)


def test_dense_above_caps_what_the_cost_model_chooses() -> None:
    old, new = changed_at(round(NUMEL * 0.05))
    assert is_sparse(old, new, cost=APPLY_ONLY)
    assert not is_sparse(old, new, cost=APPLY_ONLY, dense_above=0.04)
    assert is_sparse(old, new, cost=APPLY_ONLY, dense_above=0.06)


def test_strategy_fallbacks_win_over_the_cost_model() -> None:
    old, new = changed_at(10)
    new["w"][7] = float("nan")  # Auto (NaNMask for floats) cannot carry NaN
    free_sparse = UpdateCost(sparse_seconds_per_element=0.0, sparse_seconds_per_patch=0.0)
    assert not is_sparse(old, new, cost=free_sparse, strategy=Auto())


def test_the_gap_escape_count_is_asked_for_only_when_the_choice_turns_on_it() -> None:
    nnz, element = 1000, 2
    calls: list[int] = []

    def escapes(count: int) -> Callable[[], int]:
        def ask() -> int:
            calls.append(count)
            return count

        return ask

    # sparse = fixed + (values + gaps) / (1 B/s), dense = numel * 2 / (1 B/s); the fixed cost
    # puts the turn at 8.5 escapes (gaps are the smallest encoding here: 2 * nnz + 4 * escapes)
    fixed = 2 * NUMEL - (nnz * element + 2 * nnz) - 4 * 8.5
    knife_edge = UpdateCost(
        link_bytes_per_second=1.0,
        sparse_seconds_per_element=0.0,
        dense_seconds_per_byte=0.0,
        sparse_seconds_per_patch=fixed,
        dense_seconds_per_patch=0.0,
    )
    for count, sparse in ((3, True), (8, True), (9, False), (16, False)):
        chosen = choose_sparse(
            nnz, NUMEL, element, escapes=escapes(count), cost=knife_edge, dense_above=None
        )
        assert chosen is sparse, count
    assert calls == [3, 8, 9, 16]
    # a clear case is decided without counting
    assert choose_sparse(nnz, NUMEL, element, escapes=escapes(0), cost=None, dense_above=None)
    assert calls == [3, 8, 9, 16]
    assert sparse_nbytes(nnz, NUMEL, element, 5) == nnz * element + 2 * nnz + 4 * 5


@given(
    numel=st.integers(1, 2**40),
    fractions=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    element=st.sampled_from([1, 2, 4, 8, 16]),
    link=st.sampled_from([math.inf, 1e6, 1e9, 10e9, 1e12]),
    per_element=st.floats(0, 1e-6),
    bitmask=st.floats(0, 1e-8),
    per_byte=st.floats(0, 1e-8),
    fixed=st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-3)),
    dense_above=st.none() | st.floats(0.001, 1),
    escapes=st.integers(0, 2**20),
)
def test_the_choice_never_returns_to_sparse_as_changes_grow(
    numel: int,
    fractions: tuple[float, float],
    element: int,
    link: float,
    per_element: float,
    bitmask: float,
    per_byte: float,
    fixed: tuple[float, float],
    dense_above: float | None,
    escapes: int,
) -> None:
    """The diff's one pass stops once a running count rules sparse out (with no escaped gap,
    the best case): that is sound only if no larger count could go sparse again."""
    cost = UpdateCost(
        link_bytes_per_second=link,
        sparse_seconds_per_element=per_element,
        bitmask_seconds_per_element=bitmask,
        dense_seconds_per_byte=per_byte,
        sparse_seconds_per_patch=fixed[0],
        dense_seconds_per_patch=fixed[1],
    )
    fewer, more = sorted(max(1, round(numel * fraction)) for fraction in fractions)
    for chosen_cost in (cost, None):
        best_case = {
            nnz: choose_sparse(
                nnz, numel, element, escapes=0, cost=chosen_cost, dense_above=dense_above
            )
            for nnz in (fewer, more)
        }
        assert best_case[fewer] or not best_case[more]
        # and the best case is the best: escaped gaps never turn dense into sparse
        actual = choose_sparse(
            more,
            numel,
            element,
            escapes=min(escapes, more),
            cost=chosen_cost,
            dense_above=dense_above,
        )
        assert best_case[more] or not actual


def test_the_defaults_cross_between_a_fifth_and_a_half() -> None:
    """The calibrated defaults, with a free link: sparse at 0.5% and 10%, dense at 50% (bf16
    and fp32), for a tensor of 16M elements (a hidden-4096 projection). The payload's cost
    per byte keeps 10% sparse (its payload is a sixth of the dense one's)."""
    cost = UpdateCost(link_bytes_per_second=math.inf)
    numel = 4096 * 4096
    for element in (2, 4):
        for density, sparse in ((0.005, True), (0.1, True), (0.5, False)):
            nnz = round(numel * density)
            assert (
                choose_sparse(nnz, numel, element, escapes=0, cost=cost, dense_above=None) is sparse
            ), (element, density)


def test_the_payload_and_the_diff_enter_the_choice() -> None:
    # 10% of a bf16 tensor: apply alone prefers dense; a data plane that costs per byte
    # prefers the smaller payload; a trainer that pays dearly per changed element, dense.
    numel, nnz = 2**22, 2**22 // 10
    apply_only = replace(APPLY_ONLY, sparse_seconds_per_element=3e-9)
    choices = [
        choose_sparse(nnz, numel, 2, escapes=0, cost=cost, dense_above=None)
        for cost in (
            apply_only,
            replace(apply_only, payload_seconds_per_byte=3e-9),
            replace(apply_only, payload_seconds_per_byte=3e-9, diff_seconds_per_element=50e-9),
        )
    ]
    assert choices == [False, True, False]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"link_bytes_per_second": 0}, InvalidPatchError, "must be positive"),
        ({"link_bytes_per_second": -1.0}, InvalidPatchError, "must be positive"),
        ({"sparse_seconds_per_element": -1e-9}, InvalidPatchError, "finite number >= 0"),
        ({"dense_seconds_per_byte": math.nan}, InvalidPatchError, "finite number >= 0"),
        ({"dense_seconds_per_patch": math.inf}, InvalidPatchError, "finite number >= 0"),
        ({"sparse_seconds_per_patch": True}, InvalidPatchTypeError, "takes a number"),
        ({"link_bytes_per_second": "10GB/s"}, InvalidPatchTypeError, "takes a number"),
    ],
)
def test_invalid_costs_are_refused(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        UpdateCost(**kwargs)  # type: ignore[arg-type]


def test_a_free_link_and_integers_are_accepted() -> None:
    cost = UpdateCost(link_bytes_per_second=math.inf, dense_seconds_per_patch=0)
    per_byte = sum(
        (cost.dense_diff_seconds_per_byte, cost.dense_seconds_per_byte),
        cost.payload_seconds_per_byte,
    )
    assert cost.dense_seconds(10, 2) == pytest.approx(10 * 2 * per_byte)


def test_diff_state_dicts_refuses_a_cost_that_is_not_an_update_cost() -> None:
    old, new = changed_at(10)
    with pytest.raises(InvalidPatchTypeError, match=r"write UpdateCost\(\) instead"):
        diff_state_dicts(old, new, cost=UpdateCost)  # type: ignore[arg-type]
    with pytest.raises(InvalidPatchTypeError, match="takes a UpdateCost instance"):
        diff_state_dicts(old, new, cost=1e9)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"repeats": 0}, InvalidPatchError, r"repeats=\.\.\.\) must be positive"),
        ({"repeats": -1}, InvalidPatchError, r"repeats=\.\.\.\) must be positive"),
        ({"repeats": True}, InvalidPatchTypeError, r"repeats=\.\.\.\) takes an int"),
        ({"numel": 2.5}, InvalidPatchTypeError, r"numel=\.\.\.\) takes an int"),
        ({"numel": 0}, InvalidPatchError, r"numel=\.\.\.\) must be positive"),
    ],
    ids=["no repeats", "negative repeats", "bool repeats", "float numel", "no numel"],
)
def test_calibrate_refuses_counts_it_cannot_measure_with(
    arguments: dict[str, object], error: type[Exception], message: str
) -> None:
    # Without a run, every time is inf and every field NaN: refused by name, not as NaN fields.
    with pytest.raises(error, match=message):
        UpdateCost.calibrate(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_calibrate_measures_dtypes_the_default_strategy_cannot_stage(dtype: torch.dtype) -> None:
    # Auto() has no sentinel for bool or complex; calibrate takes no strategy, so it must pick
    # the one a worker of that dtype uses instead of refusing the dtype.
    cost = UpdateCost.calibrate(numel=2**14, dtype=dtype, repeats=1)
    for field in fields(cost):
        assert 0 <= getattr(cost, field.name) < math.inf, field.name


def test_calibrate_never_returns_a_negative_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # Timings that show no cost at all (a tiny tensor, a coarse clock): the two-density solve
    # divides zero by a negative determinant. Every field must be +0.0, not -0.0.
    monkeypatch.setattr(_cost, "_fastest", lambda fn, device, repeats: 0.0)
    cost = UpdateCost.calibrate(numel=2**14, repeats=1)
    for field in fields(cost):
        assert math.copysign(1.0, getattr(cost, field.name)) == 1.0, field.name


def test_calibrate_measures_every_field_here() -> None:
    cost = UpdateCost.calibrate(link_bytes_per_second=5e9, numel=2**16, repeats=1)
    assert cost.link_bytes_per_second == 5e9
    for name in (
        "sparse_seconds_per_element",
        "dense_seconds_per_byte",
        "sparse_seconds_per_patch",
        "dense_seconds_per_patch",
    ):
        value = getattr(cost, name)
        assert 0 <= value < 1.0, name
    # One more patch in a call, measured as a difference: no more than its call of one.
    assert cost.sparse_seconds_per_patch < 1e-3 and cost.dense_seconds_per_patch < 1e-3


def test_calibrate_measures_the_payload_it_is_given() -> None:
    carried: list[tuple[int, bool]] = []

    def copy_twice(patch: CheckpointWeightPatch) -> None:  # a data plane of two copies
        carried.append((patch.values.numel(), patch.indices is not None))
        patch.values.clone().clone()
        if patch.indices is not None:
            patch.indices.clone().clone()

    measured = UpdateCost.calibrate(numel=2**18, repeats=2, payload=copy_twice)
    assert 0 <= measured.payload_seconds_per_byte < 1e-6
    assert 0 <= measured.plane_seconds_per_element < 1e-6
    # dense patches of the two sizes, sparse ones of one element and a tenth, as documented
    assert {(2**18, False), (256, False), (1, True), (2**18 // 10, True)} <= set(carried)
    without = UpdateCost.calibrate(numel=2**16, repeats=1)
    assert without.payload_seconds_per_byte == UpdateCost().payload_seconds_per_byte


def test_calibrate_measures_the_trainer_from_its_source_dtype() -> None:
    # fp32 master weights diffed into bf16: the scan casts, a dense patch is a cast copy.
    cost = UpdateCost.calibrate(numel=2**18, repeats=1, source_dtype=torch.float32)
    assert 0 < cost.scan_seconds_per_element < 1e-6  # a whole tensor read: never free
    for name in ("diff_seconds_per_element", "dense_diff_seconds_per_byte"):  # differences
        assert 0 <= getattr(cost, name) < 1e-6, name


def test_calibrate_prices_the_trainers_diff_where_the_choice_is_close() -> None:
    # A changed element costs the diff far less at a half than its share at a tenth: the
    # figures fit both, so the diff they price at 30% is the one measured there (within 2x,
    # a loaded machine's swing), where a fit through one change and a tenth was 2-3x over.
    numel = 2**20
    cost = UpdateCost.calibrate(numel=numel, repeats=3, source_dtype=torch.float32)
    old = {"w": torch.zeros(numel)}
    draw = torch.rand(numel, generator=torch.Generator().manual_seed(7))
    new = {"w": old["w"].masked_fill(draw < 0.3, 1.0)}
    nnz = int((draw < 0.3).sum())
    spent = _cost._fastest(
        lambda: diff_state_dicts(old, new, cost=None), torch.device("cpu"), repeats=5
    )
    priced = numel * cost.scan_seconds_per_element + nnz * cost.diff_seconds_per_element
    assert spent / 2 < priced < spent * 2, (priced, spent)


def test_describe_shows_every_figure() -> None:
    text = UpdateCost(link_bytes_per_second=math.inf, payload_seconds_per_byte=2e-9).describe()
    assert len(text.splitlines()) == len(fields(UpdateCost))
    assert "link" in text and "free" in text and "payload, per byte            2.00 ns" in text
