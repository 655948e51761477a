"""diff_state_dicts and patch_nbytes: round trips through real loaders, bit for bit."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import patchctx._changes as changes
import patchctx._tuning as _tuning
from patchctx import (
    Auto,
    BoolMask,
    CheckpointWeightPatch,
    CopyStrategy,
    IntSentinel,
    InvalidPatchError,
    InvalidPatchTypeError,
    NaNMask,
    UpdateCost,
    diff_state_dicts,
    iter_diff_state_dicts,
    load_checkpoint_weight_patches,
    patch_nbytes,
    validate_patches,
)
from patchctx._diff import choose_sparse, index_dtype, sparse_is_smaller
from patchctx._encoding import count_escapes
from patchctx._strategies import indexable
from tests.support.builders import nan_with_payload, state_dict_pairs, tp_models
from tests.support.memory import AllocationTracker, HostReads
from tests.support.models import (
    ToyModel,
    assert_same_state,
    bits,
    mixed_dtype_model,
    same_bits,
    state,
)

STRATEGIES: list[CopyStrategy] = [Auto(), BoolMask()]
# None: by wire size; a slow link: wire size dominates; a free link: apply time alone
COSTS: list[UpdateCost | None] = [
    None,
    UpdateCost(),
    UpdateCost(link_bytes_per_second=1e6),
    UpdateCost(link_bytes_per_second=math.inf, sparse_seconds_per_patch=0.0),
]


def sparse_wire_bytes(positions: torch.Tensor, numel: int, element_size: int) -> tuple[int, bool]:
    """The documented size of a sparse patch, computed here from its definition: the values
    plus the smallest of int32 indices, uint16 gaps with uint32 escapes, and a bitmask (ties
    to the first); and whether that is the bitmask."""
    nnz = positions.numel()
    gaps_minus_one = torch.diff(positions, prepend=torch.tensor([-1])) - 1
    escapes = int((gaps_minus_one >= 0xFFFF).sum())
    encodings = [4 * nnz, 2 * nnz + 4 * escapes, (numel + 7) // 8]
    smallest = min(encodings)
    return nnz * element_size + smallest, encodings.index(smallest) == 2


def load_cast(
    model: ToyModel, tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, Any]
) -> None:
    model.load_weights([(name, tensor.to(dtypes[name])) for name, tensor in tensors.items()])
    model.load_calls.clear()


def element_bits(tensor: torch.Tensor) -> torch.Tensor:
    """One row of raw bits per element (complex: real and imaginary parts)."""
    raw = bits(tensor.reshape(-1))
    return raw.reshape(tensor.numel(), -1) if tensor.numel() else raw.reshape(0, 1)


def gather(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return indexable(flat).index_select(0, positions).view(flat.dtype)


def assert_smallest_correct(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    patches: Sequence[CheckpointWeightPatch],
    strategy: CopyStrategy,
    dense_above: float | None,
    cost: UpdateCost | None = None,
) -> None:
    """Each changed tensor has exactly one patch, with exactly the changed elements when
    sparse, and is dense exactly when the documented rule says so."""
    by_name = {patch.name: patch for patch in patches}
    assert len(by_name) == len(patches)
    assert [p.name for p in patches] == [n for n in new if n in by_name]
    for name in new:
        receiver = dtypes[name]
        before, after = old[name].to(receiver), new[name].to(receiver)
        changed = (element_bits(before) != element_bits(after)).any(dim=1)
        nnz, numel = int(changed.sum()), after.numel()
        if nnz == 0:
            assert name not in by_name
            continue
        patch = by_name[name]
        assert (patch.name, patch.shape, patch.dtype) == (name, tuple(after.shape), receiver)
        assert patch.values.dtype == receiver
        positions = changed.nonzero().view(-1)
        changed_values = gather(after.reshape(-1), positions)
        element = after.element_size()
        sparse_bytes, bitmask = sparse_wire_bytes(positions, numel, element)
        # Never more bytes than dense; with a cost model, also faster by its estimate.
        cheaper = sparse_bytes < numel * element and (
            cost is None
            or cost.sparse_seconds(
                nnz, sparse_bytes, bitmask_numel=numel * bitmask, numel=numel, element_size=element
            )
            < cost.dense_seconds(numel, element)
        )
        expect_sparse = (
            strategy.unsupported_reason(receiver) is None
            and not bool(strategy.reserved_values(changed_values, receiver))
            and cheaper
            and (dense_above is None or nnz <= dense_above * numel)
        )
        if expect_sparse:
            assert patch.indices is not None
            assert patch.indices.dtype == torch.int32
            assert torch.equal(patch.indices.long(), positions)
            assert same_bits(patch.values, changed_values)
        else:
            assert patch.indices is None
            assert same_bits(patch.values, after.reshape(-1))


def whole_scan_patch(
    old: torch.Tensor,
    new: torch.Tensor,
    receiver: torch.dtype,
    strategy: CopyStrategy,
    dense_above: float | None,
    cost: UpdateCost | None,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """(positions or None, values) by the diff's rule applied to the whole comparison: every
    changed element found first, then the strategy's fallbacks and `choose_sparse` with the
    positions' real escapes; `None` when nothing changed."""
    before, after = old.to(receiver), new.to(receiver)
    changed = (element_bits(before) != element_bits(after)).any(dim=1)
    positions = changed.nonzero().view(-1)
    nnz, numel = positions.numel(), after.numel()
    if nnz == 0:
        return None
    values = gather(after.reshape(-1), positions)
    sparse = (
        strategy.unsupported_reason(receiver) is None
        and not bool(strategy.reserved_values(values, receiver))
        and choose_sparse(
            nnz,
            numel,
            receiver.itemsize,
            escapes=int(count_escapes(positions)),
            cost=cost,
            dense_above=dense_above,
        )
    )
    return (positions, values) if sparse else (None, after.reshape(-1))


def rule_allows(
    nnz: int, numel: int, receiver: torch.dtype, cost: UpdateCost | None, dense_above: float | None
) -> bool:
    return choose_sparse(
        nnz, numel, receiver.itemsize, escapes=0, cost=cost, dense_above=dense_above
    )


@given(
    rows=st.integers(1, 48),
    columns=st.integers(1, 48),
    block=st.integers(1, 400),
    density=st.floats(0.0, 1.0),
    near_limit=st.none() | st.integers(-3, 3),
    front=st.floats(0.05, 1.0),
    receiver=st.sampled_from([torch.float32, torch.bfloat16]),
    nan=st.booleans(),
    strategy=st.sampled_from(STRATEGIES),
    cost=st.sampled_from([*COSTS, UpdateCost(position_bytes=4)]),
    dense_above=st.none() | st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_stopping_early_sends_what_the_whole_scan_would(
    rows: int,
    columns: int,
    block: int,
    density: float,
    near_limit: int | None,
    front: float,
    receiver: torch.dtype,
    nan: bool,
    strategy: CopyStrategy,
    cost: UpdateCost | None,
    dense_above: float | None,
    seed: int,
) -> None:
    """The scan stops once the changes found rule sparse out; the patch is the one the rule
    gives from every change: same form, same bits. Changes may crowd the front of the tensor
    (so early blocks look dense), number about the first count that rules sparse out
    (`near_limit`, else `density` of the front), tensors span many blocks, a NaN may force
    dense."""
    generator = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, columns, generator=generator)
    numel, reach = old.numel(), max(1, int(front * old.numel()))
    if near_limit is None:
        chosen = torch.rand(numel, generator=generator) < density
        chosen[reach:] = False
    else:
        limit = next(
            (
                n
                for n in range(1, numel + 1)
                if not rule_allows(n, numel, receiver, cost, dense_above)
            ),
            numel,
        )
        chosen = torch.zeros(numel, dtype=torch.bool)
        chosen[torch.randperm(reach, generator=generator)[: max(0, limit + near_limit)]] = True
    new = old.clone()
    new.view(-1)[chosen] *= 1.0625  # a change bf16 sees too
    if nan and bool(chosen.any()):
        new.view(-1)[int(chosen.nonzero()[0])] = math.nan
    with mock.patch.dict(_tuning.DIFF_BLOCK, {"cpu": block}):
        patches = diff_state_dicts(
            {"w": old},
            {"w": new},
            dtype=receiver,
            strategy=strategy,
            cost=cost,
            dense_above=dense_above,
        )
    expected = whole_scan_patch(old, new, receiver, strategy, dense_above, cost)
    if expected is None:
        assert patches == []
        return
    [patch] = patches
    positions, values = expected
    if positions is None:
        assert patch.indices is None
    else:
        assert patch.indices is not None
        assert torch.equal(patch.indices.long(), positions)
    assert same_bits(patch.values, values)


def changed_where(pattern: str, rows: int, columns: int, limit: int) -> torch.Tensor:
    """The flat positions a training step changed, by a named pattern of a (rows, columns)
    tensor; `limit` is the fewest changes that rule sparse out."""
    generator = torch.Generator().manual_seed(rows * columns)
    numel = rows * columns
    grid = torch.arange(numel).view(rows, columns)
    if pattern == "uniform-half":
        return torch.randperm(numel, generator=generator)[: numel // 2]
    if pattern == "one-column":  # a sample strided by a divisor of the row hits only it
        return grid[:, 0].reshape(-1)
    if pattern == "every-kth":  # every k-th element, k what a strided sample would take
        return torch.arange(0, numel, numel // _tuning.SAMPLES)
    if pattern == "first-rows":  # crowded at the front: the first block looks dense
        return grid[:8].reshape(-1)
    fraction = {"just-below-limit": 0.97, "just-above-limit": 1.03}[pattern]
    return torch.randperm(numel, generator=generator)[: min(numel, int(fraction * limit))]


@pytest.mark.parametrize(
    "pattern",
    [
        "uniform-half",
        "one-column",
        "every-kth",
        "first-rows",
        "just-below-limit",
        "just-above-limit",
    ],
)
@pytest.mark.parametrize("receiver", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cost", [UpdateCost(), None], ids=["cost", "by-size"])
def test_a_large_tensor_sampled_before_its_scan_gets_the_patch_the_whole_scan_gives(
    pattern: str, receiver: torch.dtype, cost: UpdateCost | None
) -> None:
    """A tensor of over 2**18 elements is sampled at random positions first, and sent dense
    unscanned when the sample rules sparse out beyond doubt. Whatever the pattern of the
    changes (a column or a stride that a regular sample would align with, changes crowding
    the front, counts on either side of the limit), the patch is the whole scan's."""
    rows, columns = 1024, 1100
    numel = rows * columns
    assert numel > 2**18
    limit = next(
        (n for n in range(1, numel + 1, 97) if not rule_allows(n, numel, receiver, cost, None)),
        numel,
    )
    old = torch.randn(rows, columns, generator=torch.Generator().manual_seed(3))
    new = old.clone()
    new.view(-1)[changed_where(pattern, rows, columns, limit)] *= 1.0625  # bf16 sees it too
    [patch] = diff_state_dicts({"w": old}, {"w": new}, dtype=receiver, cost=cost)
    expected = whole_scan_patch(old, new, receiver, Auto(), None, cost)
    assert expected is not None
    positions, values = expected
    assert (patch.indices is None) == (positions is None), (pattern, patch.indices)
    if positions is not None:
        assert patch.indices is not None and torch.equal(patch.indices.long(), positions)
    assert same_bits(patch.values, values)
    if pattern in ("one-column", "every-kth"):
        assert patch.indices is not None  # what a stride would have sent dense


def round_trip(
    model: ToyModel,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None,
    strategy: CopyStrategy,
    dense_above: float | None = None,
    cost: UpdateCost | None = None,
) -> list[CheckpointWeightPatch]:
    """Apply diff_state_dicts(old, new) to a model holding `old`; it must then hold `new`."""
    receiver = {name: spec.dtype for name, spec in model.checkpoint_specs().items()}
    load_cast(model, old, receiver)
    reference = copy.deepcopy(model)
    load_cast(reference, new, receiver)
    patches = diff_state_dicts(
        old, new, dtype=dtype, strategy=strategy, dense_above=dense_above, cost=cost
    )
    validate_patches(patches, strategy=strategy)
    load_checkpoint_weight_patches(model, patches, strategy=strategy)
    assert_same_state(state(model), state(reference))
    assert_smallest_correct(old, new, receiver, patches, strategy, dense_above, cost)
    return patches


# ------------------------------------------------------------------------------ round trips


@given(
    data=st.data(),
    fp32_trainer=st.booleans(),
    mapping=st.booleans(),
    strategy=st.sampled_from(STRATEGIES),
    dense_above=st.sampled_from([None, 0.05, 1.0]),
    cost=st.sampled_from(COSTS),
)
def test_round_trip_through_packed_tp_loaders(
    data: st.DataObject,
    fp32_trainer: bool,
    mapping: bool,
    strategy: CopyStrategy,
    dense_above: float | None,
    cost: UpdateCost | None,
) -> None:
    model, kwargs = data.draw(tp_models())
    receiver = kwargs["dtype"]
    assert isinstance(receiver, torch.dtype)
    specs = model.checkpoint_specs()
    trainer = dict.fromkeys(specs, torch.float32) if fp32_trainer else None
    old, new = data.draw(state_dict_pairs(specs, trainer_dtypes=trainer))
    dtype: torch.dtype | dict[str, torch.dtype] | None = receiver
    if mapping:
        dtype = {name: spec.dtype for name, spec in specs.items()}
    elif not fp32_trainer and data.draw(st.booleans()):
        dtype = None  # each tensor's own
    round_trip(model, old, new, dtype=dtype, strategy=strategy, dense_above=dense_above, cost=cost)


@given(data=st.data(), strategy=st.sampled_from(STRATEGIES))
def test_round_trip_with_every_kind_of_dtype_and_shape(
    data: st.DataObject, strategy: CopyStrategy
) -> None:
    """Scalars, empty tensors, bf16/fp16/fp32/fp64, float8, int8/int32/uint16/uint32, bool,
    complex."""
    model = mixed_dtype_model()
    specs = model.checkpoint_specs()
    fp32_masters = {
        name: torch.float32
        for name, spec in specs.items()
        if spec.dtype.is_floating_point and spec.dtype.itemsize <= 2
    }
    old, new = data.draw(state_dict_pairs(specs, trainer_dtypes=fp32_masters))
    dtypes = {name: spec.dtype for name, spec in specs.items()}
    round_trip(model, old, new, dtype=dtypes, strategy=strategy)


# --------------------------------------------------------------------- what counts as changed


def test_fp32_noise_that_vanishes_in_bf16_is_not_sent() -> None:
    old = {"w": torch.full((64,), 1.0)}
    new = {"w": old["w"] + 1e-4}  # well below bf16's half ulp at 1.0 (2**-8)
    assert diff_state_dicts(old, new, dtype=torch.bfloat16) == []
    [patch] = diff_state_dicts(old, new)
    assert patch.dtype == torch.float32


def test_an_element_changes_when_only_its_bf16_rounding_does() -> None:
    old = {"w": torch.full((64,), 1.0)}
    new = {"w": old["w"].clone()}
    new["w"][5] = 1.0 + 2**-8 + 2**-20  # rounds up to the next bf16 value
    [patch] = diff_state_dicts(old, new, dtype=torch.bfloat16, cost=None)
    assert patch.indices is not None and patch.indices.tolist() == [5]
    assert patch.values.tolist() == [1.0078125]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_negative_zero_is_a_change(dtype: torch.dtype) -> None:
    old = {"w": torch.zeros(16, dtype=dtype)}
    new = {"w": old["w"].clone()}
    new["w"][3] = -0.0
    [patch] = diff_state_dicts(old, new, cost=None)
    assert patch.indices is not None and patch.indices.tolist() == [3]
    assert same_bits(patch.values, torch.tensor([-0.0], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_compares_by_its_bits(dtype: torch.dtype) -> None:
    quiet, payload = nan_with_payload(dtype, 0), nan_with_payload(dtype, 1)
    old = {"w": torch.zeros(32, dtype=dtype)}
    old["w"][[1, 2]] = quiet
    new = {"w": old["w"].clone()}
    new["w"][2] = payload  # same value class, other bits
    [patch] = diff_state_dicts(old, new, strategy=BoolMask(), cost=None)
    assert patch.indices is not None and patch.indices.tolist() == [2]  # position 1: same NaN
    assert same_bits(patch.values, payload.view(1))


def test_nan_update_goes_dense_under_nan_mask_and_stays_sparse_under_bool_mask() -> None:
    old = {"w": torch.zeros(100)}
    new = {"w": old["w"].clone()}
    new["w"][[7, 9]] = torch.tensor([float("nan"), 1.0])
    for strategy in (Auto(), NaNMask()):
        [dense] = diff_state_dicts(old, new, strategy=strategy, cost=None)
        assert dense.indices is None and torch.isnan(dense.values[7])
    [sparse] = diff_state_dicts(old, new, strategy=BoolMask(), cost=None)
    assert sparse.indices is not None and sparse.indices.tolist() == [7, 9]


def test_int_sentinel_update_goes_dense() -> None:
    old = {"q": torch.zeros(100, dtype=torch.int8)}
    new = {"q": old["q"].clone()}
    new["q"][4] = -128  # IntSentinel's default sentinel for int8
    [dense] = diff_state_dicts(old, new, cost=None)
    assert dense.indices is None
    [sparse] = diff_state_dicts(old, new, strategy=IntSentinel(value=127), cost=None)
    assert sparse.indices is not None and sparse.values.tolist() == [-128]
    new["q"][4] = 5
    [sparse] = diff_state_dicts(old, new, cost=None)
    assert sparse.indices is not None


def test_an_unchanged_sentinel_does_not_force_a_dense_patch() -> None:
    old = {"q": torch.full((100,), -128, dtype=torch.int8)}  # the sentinel is everywhere ...
    new = {"q": old["q"].clone()}
    new["q"][50] = 3  # ... but no changed element holds it
    [patch] = diff_state_dicts(old, new, cost=None)
    assert patch.indices is not None and patch.indices.tolist() == [50]


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_dtypes_the_strategy_cannot_stage_go_dense(dtype: torch.dtype) -> None:
    old = {"x": torch.zeros(50, dtype=dtype)}
    new = {"x": old["x"].clone()}
    new["x"][1] = 1
    [dense] = diff_state_dicts(old, new, cost=None)
    assert dense.indices is None
    [sparse] = diff_state_dicts(old, new, strategy=BoolMask(), cost=None)
    assert sparse.indices is not None and sparse.indices.tolist() == [1]


# ---------------------------------------------------------------------------- dense or sparse


@pytest.mark.parametrize(
    ("dtype", "threshold"),
    # numel = 60, the first nnz elements change: gaps take 2 * nnz bytes, the bitmask 8, int32
    # indices 4 * nnz; sparse iff nnz * e + min(2 * nnz, 8) < 60 * e
    [(torch.float32, 58), (torch.bfloat16, 56), (torch.int8, 52), (torch.float64, 59)],
)
def test_sparse_only_when_its_payload_is_strictly_smaller(
    dtype: torch.dtype, threshold: int
) -> None:
    old = {"w": torch.zeros(60, dtype=dtype)}
    for nnz, sparse in ((threshold - 1, True), (threshold, False)):
        new = {"w": old["w"].clone()}
        new["w"][:nnz] = 1
        [patch] = diff_state_dicts(old, new, cost=None)
        assert (patch.indices is not None) is sparse, nnz
        assert patch_nbytes([patch]) <= 60 * old["w"].element_size()


def test_dense_above_sends_denser_tensors_dense() -> None:
    old = {"w": torch.zeros(1000)}
    new = {"w": old["w"].clone()}
    new["w"][:100] = 1.0  # density 0.1
    assert diff_state_dicts(old, new, dense_above=0.1, cost=None)[0].indices is not None
    assert diff_state_dicts(old, new, dense_above=0.099, cost=None)[0].indices is None
    assert diff_state_dicts(old, new, dense_above=1, cost=None)[0].indices is not None


def test_index_dtype_is_int32_below_2_to_the_31_elements() -> None:
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64
    assert sparse_is_smaller(10, 2**31 - 1, 2)
    # a huge bf16 tensor: the bitmask (numel / 8 bytes) plus 2-byte values wins up to 15/16
    assert sparse_is_smaller(15 * 2**27 - 1, 2**31, 2)
    assert not sparse_is_smaller(15 * 2**27, 2**31, 2)


# ------------------------------------------------------------------------ shapes and layouts


def test_scalars_and_empty_tensors() -> None:
    old = {"s": torch.tensor(1.0), "e": torch.zeros(0, 4), "same": torch.tensor(2.0)}
    new = {"s": torch.tensor(-1.0), "e": torch.zeros(0, 4), "same": torch.tensor(2.0)}
    [patch] = diff_state_dicts(old, new)
    assert patch.name == "s" and patch.shape == () and patch.indices is None
    assert patch.values.shape == (1,) and patch.values.tolist() == [-1.0]


@pytest.mark.parametrize("single_pass", [True, False], ids=["one-pass", "two-passes"])
def test_lazy_conjugate_and_negative_views_are_diffed_by_their_values(single_pass: bool) -> None:
    """``x.conj()`` and negative views keep the values before the lazy operation in memory:
    the diff compares and sends the values they stand for, never the bit."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, dtype=torch.complex64, generator=generator)
    changed = base.clone()
    changed[[2, 7, 63]] += 1
    real = torch.randn(64, generator=generator)
    stepped = real.clone()
    stepped[[0, 40]] = 5.0
    old = {
        "conj": base.conj().resolve_conj(),
        "conj_dense": base.conj().resolve_conj(),
        "neg": torch.neg(real),
    }
    new = {
        "conj": changed.conj(),  # lazily conjugated
        "conj_dense": (changed + 1).conj(),
        "neg": torch._neg_view(stepped),  # what torch makes of some backward views
    }
    assert new["conj"].is_conj() and new["neg"].is_neg()
    passes = frozenset({"cpu"}) if single_pass else frozenset()
    with mock.patch.object(changes, "SINGLE_PASS_DEVICES", passes):
        patches = diff_state_dicts(old, new, strategy=BoolMask(), cost=None)
    by_name = {p.name: p for p in patches}
    assert set(by_name) == {"conj", "conj_dense", "neg"}
    for name, positions in (("conj", [2, 7, 63]), ("conj_dense", None), ("neg", [0, 40])):
        patch = by_name[name]
        truth = new[name].resolve_conj().resolve_neg().reshape(-1)
        assert not patch.values.is_conj() and not patch.values.is_neg()
        if positions is None:
            assert patch.indices is None
            assert same_bits(patch.values, truth)
        else:
            assert patch.indices is not None and patch.indices.tolist() == positions
            assert same_bits(patch.values, truth[positions])
        receiver = old[name].clone().reshape(-1)
        if patch.indices is None:
            receiver.copy_(patch.values)
        else:
            receiver[patch.indices.long()] = patch.values
        assert same_bits(receiver, truth)


@pytest.mark.parametrize("receiver", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("single_pass", [True, False], ids=["one-pass", "two-pass"])
def test_a_contiguous_negative_view_is_diffed_by_its_sign_in_every_receiver_dtype(
    receiver: torch.dtype, single_pass: bool
) -> None:
    """``z.conj().imag`` of one complex element is a *contiguous* negative view, which torch's
    cast copy to fp16 reads without its sign: the diff must still see the change."""
    z = torch.complex(torch.zeros(1), torch.tensor([1.5]))
    old = {"w": torch.tensor([1.5]), "same": torch.tensor([-2.5])}
    new = {"w": z.conj().imag, "same": torch._neg_view(torch.tensor([2.5]))}
    assert new["w"].is_neg() and new["w"].is_contiguous()
    passes = frozenset({"cpu"}) if single_pass else frozenset()
    with mock.patch.object(changes, "SINGLE_PASS_DEVICES", passes):
        patches = diff_state_dicts(old, new, dtype=receiver)
    assert [p.name for p in patches] == ["w"]  # "same" holds -2.5 on both sides
    assert same_bits(patches[0].values, torch.tensor([-1.5]).to(receiver))


def test_a_tied_tensor_is_sent_under_each_name_the_receiver_holds_in_another_dtype() -> None:
    weight = torch.randn(8)
    old = {"a": weight.clone(), "b": weight.clone()}
    shared = weight.clone()
    shared[3] = 7.0
    new = {"a": shared, "b": shared}  # tied on the trainer
    patches = diff_state_dicts(old, new, dtype={"a": torch.bfloat16, "b": torch.float32})
    assert sorted((p.name, p.dtype) for p in patches) == [
        ("a", torch.bfloat16),
        ("b", torch.float32),
    ]
    # One receiver dtype: one tensor there too, sent once.
    assert [p.name for p in diff_state_dicts(old, new, dtype=torch.float32)] == ["a"]


def test_non_contiguous_tensors_and_trainable_parameters() -> None:
    base = torch.randn(8, 6)
    old = {"t": base.t(), "p": torch.nn.Parameter(torch.randn(5))}
    new = {"t": base.t().contiguous(), "p": torch.nn.Parameter(old["p"].detach().clone())}
    new["t"][2, 3] = 100.0
    with torch.no_grad():
        new["p"][0] = -1.0
    patches = diff_state_dicts(old, new, cost=None)
    assert [(p.name, p.indices.tolist()) for p in patches if p.indices is not None] == [
        ("t", [2 * 8 + 3]),
        ("p", [0]),
    ]
    assert all(not p.values.requires_grad for p in patches)


def test_patches_never_alias_new() -> None:
    old = {"dense": torch.zeros(4), "sparse": torch.zeros(100)}
    new = {"dense": torch.ones(4), "sparse": torch.zeros(100)}
    new["sparse"][3] = 1.0
    patches = diff_state_dicts(old, new, cost=None)
    for tensor in new.values():
        tensor.add_(5.0)  # the trainer steps on, in place
    assert [p.values.tolist() for p in patches] == [[1.0] * 4, [1.0]]


# ---------------------------------------------------------------------- names and dtype rules


def test_names_restrict_and_order_the_diff() -> None:
    old = {name: torch.zeros(3) for name in "abc"}
    new = {name: torch.ones(3) for name in "abc"}
    chosen = iter(["c", "a"])  # an iterator is read once
    assert [p.name for p in diff_state_dicts(old, new, names=chosen)] == ["c", "a"]
    only_new = {**new, "extra": torch.ones(1)}
    assert [p.name for p in diff_state_dicts(old, only_new, names=["b"])] == ["b"]


def test_a_single_dtype_applies_to_floating_tensors_only() -> None:
    old = {"f": torch.zeros(4), "q": torch.zeros(4, dtype=torch.int8)}
    new = {"f": torch.full((4,), 1.001), "q": torch.tensor([300, 0, 0, 0]).to(torch.int8)}
    patches = diff_state_dicts(old, new, dtype=torch.bfloat16)
    assert [(p.name, p.dtype) for p in patches] == [("f", torch.bfloat16), ("q", torch.int8)]


def test_a_receiver_dtype_settles_old_and_new_of_different_dtypes() -> None:
    sent = {"w": torch.ones(8, dtype=torch.bfloat16)}  # what was last sent, kept in bf16
    master = {"w": torch.ones(8) + 1e-4}  # fp32 master weights
    with pytest.raises(
        InvalidPatchError, match=re.escape("old is torch.bfloat16 and new is torch.float32")
    ):
        diff_state_dicts(sent, master)
    assert diff_state_dicts(sent, master, dtype=torch.bfloat16) == []
    assert diff_state_dicts(sent, master, dtype={"w": torch.bfloat16}) == []


def test_every_problem_is_reported_together_before_any_work() -> None:
    old = {"a": torch.zeros(2), "shape": torch.zeros(2, 3), "only_old": torch.zeros(1)}
    new = {
        "a": torch.zeros(2, dtype=torch.float64),
        "shape": torch.zeros(3, 2),
        "only_new": torch.zeros(1),
    }
    with pytest.raises(InvalidPatchError) as caught:
        diff_state_dicts(old, new, dense_above=0.0)
    reasons = [str(p) for p in caught.value.problems]
    assert len(reasons) == 5, reasons
    assert "dense_above must be a density in (0, 1]" in reasons[0]
    assert "'only_old' is in old but not in new" in reasons[1]
    assert "'only_new' is in new but not in old" in reasons[2]
    assert "old is torch.float32 and new is torch.float64" in reasons[3]
    assert "'shape': shape differs between old (2, 3) and new (3, 2)" in reasons[4]
    assert str(caught.value).startswith("5 problems")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "bfloat16"}, "dtype must be a torch.dtype, got 'bfloat16'"),
        ({"dtype": {"w": float}}, "dtype['w'] must be a torch.dtype"),
        ({"names": "w"}, "names must be an iterable of str"),
        ({"strategy": NaNMask}, "not a class"),
        ({"strategy": object()}, "takes a CopyStrategy"),
        ({"old": [torch.zeros(1)]}, "old must be a mapping"),
        ({"new": {"w": [1.0]}}, "new['w'] must be a torch.Tensor"),
        ({"new": {"w": torch.ones(1).to_sparse()}}, "new['w'] is a torch.sparse_coo tensor"),
        # (storage-less: without this, both sides looked like one storage at address 0)
        ({"old": {"w": torch.empty(1, device="meta")}}, "old['w'] is a meta tensor"),
    ],
)
def test_wrong_types_raise_a_type_error(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"old": {"w": torch.zeros(1)}, "new": {"w": torch.ones(1)}}
    arguments.update(kwargs)
    with pytest.raises(InvalidPatchTypeError, match=re.escape(message)):
        diff_state_dicts(**arguments)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.int8}, "a single dtype= applies to the floating-point tensors"),
        ({"dtype": {"typo": torch.float16}}, "dtype names 'typo', which is in neither"),
        ({"names": ["w", "w"]}, "'w' appears more than once in names"),
        ({"names": ["v"]}, "'v' (from names) is not in old or new"),
        ({"dense_above": 1.5}, "dense_above must be a density in (0, 1]"),
        ({"dense_above": True}, "dense_above must be a density in (0, 1]"),
    ],
)
def test_invalid_arguments_are_reported(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPatchError) as caught:
        diff_state_dicts({"w": torch.zeros(1)}, {"w": torch.ones(1)}, **kwargs)
    assert message in str(caught.value)


# ---------------------------------------------------------------------- streaming and syncs


@pytest.mark.parametrize("single_pass", [True, False], ids=["one-pass", "two-passes"])
@pytest.mark.parametrize("strategy", [Auto(), BoolMask()])
def test_one_host_read_per_tensor_and_none_for_a_tied_one(
    strategy: CopyStrategy, single_pass: bool
) -> None:
    """Two passes (accelerators): one read (a sync) per tensor. One pass (CPU, where a read
    is no sync): each block's mask, and the reserved-value flag of a tensor that may go sparse.
    """
    old = {
        "sparse": torch.zeros(10),
        "dense": torch.zeros(3),
        "nan": torch.zeros(10),
        "unchanged": torch.zeros(10),
        "tied": torch.zeros(10),
        "empty": torch.zeros(0),
    }
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["sparse"][1] = 1.0
    new["dense"][:] = 2.0
    new["nan"][2] = float("nan")
    new["tied"] = new["unchanged"].view(10)  # another object viewing the same elements
    assert strategy.unsupported_reason(torch.bfloat16) is None  # its one-time probe reads
    passes = frozenset({"cpu"}) if single_pass else frozenset()
    with mock.patch.object(changes, "SINGLE_PASS_DEVICES", passes), HostReads() as watch:
        patches = diff_state_dicts(old, new, dtype=torch.bfloat16, strategy=strategy, cost=None)
    assert [p.name for p in patches] == ["sparse", "dense", "nan"]
    assert [p.indices is None for p in patches] == [False, True, isinstance(strategy, Auto)]
    # one each for "sparse", "dense", "nan", "unchanged"; none for "tied" and "empty" (in one
    # pass, a block is seen as three numpy arrays: its two sides and its mask)
    block = ["numpy"] * 3
    if not single_pass:
        assert watch.reads == ["tolist"] * 4
    elif isinstance(strategy, Auto):  # NaN is reserved: "sparse" and "nan" are tested
        assert watch.reads == [*block, "__bool__", *block, *block, "__bool__", *block]
    else:
        assert watch.reads == block * 4


def test_old_sharing_storage_with_new_is_refused_with_the_clone_to_use() -> None:
    model = torch.nn.Linear(4, 4)
    sent = model.state_dict()  # views of the live weights, not a copy
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    with pytest.raises(InvalidPatchError) as caught:
        diff_state_dicts(sent, model.state_dict())
    assert [p.name for p in caught.value.problems] == ["weight", "bias"]
    assert "shares its storage with new['weight']" in str(caught.value)
    assert "v.detach().clone()" in str(caught.value)
    transposed = {"weight": model.weight.detach().t(), "bias": model.bias.detach().clone()}
    with pytest.raises(InvalidPatchError, match="'weight': old"):  # another view of it too
        diff_state_dicts(transposed, model.state_dict(), names=["bias", "weight"])
    sent = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    [patch] = diff_state_dicts(sent, model.state_dict(), cost=None)
    assert patch.name == "weight" and patch.indices is not None and patch.indices.tolist() == [0]


def test_a_tied_tensor_is_sent_once_under_its_first_name() -> None:
    embed = torch.zeros(6, 4)
    new = {"embed_tokens.weight": embed, "norm.weight": torch.ones(4), "lm_head.weight": embed}
    old = {name: tensor.clone() for name, tensor in new.items()}  # cloned: no longer tied
    embed[2, 1] = 3.0
    [patch] = diff_state_dicts(old, new, cost=None)
    assert patch.name == "embed_tokens.weight" and patch.indices is not None
    assert patch.indices.tolist() == [9] and patch.values.tolist() == [3.0]
    [patch] = diff_state_dicts(old, new, names=["lm_head.weight", "embed_tokens.weight"], cost=None)
    assert patch.name == "lm_head.weight"


@pytest.mark.parametrize("receiver", [torch.bfloat16, torch.float32])
def test_peak_memory_is_bounded_by_one_tensor_not_the_model(receiver: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    count, shape = 16, (128, 256)
    old = {f"w{k}": torch.randn(shape, generator=generator) for k in range(count)}
    new = {}
    for name, tensor in old.items():
        new[name] = tensor.clone()
        new[name].view(-1)[torch.randperm(tensor.numel(), generator=generator)[:300]] += 1.0
    tensor_bytes = math.prod(shape) * 4
    with AllocationTracker(preexisting=[*old.values(), *new.values()]) as tracker:
        patches = diff_state_dicts(old, new, dtype=receiver, cost=None)
    held = [t for p in patches for t in (p.values, p.indices) if t is not None]
    result = sum(t.numel() * t.element_size() for t in held)
    assert all(p.indices is not None for p in patches)
    assert tracker.live <= result + 1024  # nothing but the patches is left behind
    extra = tracker.peak - result
    assert extra <= 2 * tensor_bytes, (extra, tensor_bytes)
    assert extra < count * tensor_bytes // 4  # holding every tensor's cast would exceed this


# ------------------------------------------------------------------------------- patch_nbytes


def test_patch_nbytes_counts_values_and_indices_as_sent() -> None:
    sparse = CheckpointWeightPatch(
        "s", (100,), torch.bfloat16, torch.zeros(3, dtype=torch.bfloat16), torch.arange(3)
    )
    dense = CheckpointWeightPatch("d", (2, 2), torch.float16, torch.zeros(4))  # fp32 on the wire
    assert patch_nbytes([]) == 0
    # int64 indices travel in the smallest encoding: three uint16 gaps (not 3 * 8, not 3 * 4)
    assert patch_nbytes([sparse]) == 3 * (2 + 2)
    assert patch_nbytes(iter([sparse, dense])) == 3 * (2 + 2) + 4 * 4
    # positions out of order travel as int32 indices; positions out of range as they are
    unordered = sparse._replace(indices=torch.tensor([2, 0, 1]))
    assert patch_nbytes([unordered]) == 3 * (2 + 4)
    out_of_range = sparse._replace(indices=torch.tensor([0, 1, 100]))
    assert patch_nbytes([out_of_range]) == 3 * (2 + 8)


def test_the_stream_of_patches_diffs_each_tensor_when_asked_and_checks_everything_first() -> None:
    """`iter_diff_state_dicts`: every check before it returns, each tensor diffed only when
    its patch is asked for (a tensor changed after the first patch is out is diffed as it is
    then), and the patches `diff_state_dicts` returns, in its order, with tied names once."""
    old = {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.zeros(3)}
    new = {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.ones(3)}
    new["a"][2] = 1.0
    with pytest.raises(InvalidPatchError, match="'c': shape differs"):
        iter_diff_state_dicts(old, dict(new, c=torch.zeros(4)))  # no tensor read yet
    stream = iter_diff_state_dicts(old, new, cost=None)
    first = next(stream)
    assert (first.name, first.indices is not None and first.indices.tolist()) == ("a", [2])
    new["b"][5] = 7.0  # after the first patch: the stream has not read b yet
    rest = list(stream)
    assert [(p.name, p.values.tolist()) for p in rest] == [("b", [7.0]), ("c", [1.0] * 3)]
    tied = torch.arange(4.0)
    together = {"x": tied, "y": tied, "z": torch.ones(2)}
    apart = {"x": torch.zeros(4), "y": torch.zeros(4), "z": torch.zeros(2)}
    streamed = [(p.name, p.values.tolist()) for p in iter_diff_state_dicts(apart, together)]
    listed = [(p.name, p.values.tolist()) for p in diff_state_dicts(apart, together)]
    assert streamed == listed == [("x", [0.0, 1.0, 2.0, 3.0]), ("z", [1.0, 1.0])]


@pytest.mark.parametrize("says_bits", [True, False])
def test_a_strategy_of_your_own_that_says_its_reserved_bits_is_tested_as_the_built_ins(
    says_bits: bool,
) -> None:
    """The diff asks no strategy which one it is: a strategy of the caller's that says its
    reserved values as bits (``reserved_bits``) is tested on the bits, never asked through
    `reserved_values`; without it, it is asked. Either way the patches are NaNMask's."""

    class Marked:  # NaNMask's behaviour, by delegation: not a NaNMask
        fixed_support = True

        def __init__(self) -> None:
            self.asked = 0

        def __getattr__(self, name: str) -> Any:
            if name == "reserved_bits" and not says_bits:
                raise AttributeError(name)
            return getattr(NaNMask(), name)

        def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            self.asked += 1
            return NaNMask().reserved_values(values, dtype)

    old = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    new = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    new["a"][[3, 700]] = 1.0
    new["b"][[5, 900]] = torch.tensor([2.0, float("nan")])  # NaN: dense under NaNMask
    marked = Marked()
    ours = diff_state_dicts(old, new, strategy=cast(CopyStrategy, marked), cost=None)
    theirs = diff_state_dicts(old, new, strategy=NaNMask(), cost=None)
    assert [(p.name, p.indices is None) for p in ours] == [("a", False), ("b", True)]
    assert [(p.name, p.indices is None) for p in theirs] == [("a", False), ("b", True)]
    for mine, built_in in zip(ours, theirs, strict=True):
        assert torch.equal(mine.values.view(torch.int32), built_in.values.view(torch.int32))
    assert (marked.asked == 0) is says_bits, marked.asked


@pytest.mark.parametrize("receiver", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("view", ["plain", "transposed", "negative", "conjugate"])
def test_dense_values_go_into_a_buffer_that_fits_bit_for_bit_what_a_fresh_copy_holds(
    receiver: torch.dtype, view: str
) -> None:
    """A buffer of the patch's size and receiver dtype, sharing memory with nothing else,
    holds the dense patch's values; they are the fresh copy's bits, views resolved."""
    dtype = torch.complex64 if view == "conjugate" else torch.float32
    base = torch.randn(24, 16, dtype=dtype)
    new = {
        "plain": base,
        "transposed": base.t(),
        "negative": torch._neg_view(base),
        "conjugate": base.conj(),
    }[view]
    old = {"w": torch.zeros(new.shape, dtype=dtype)}
    want = receiver if dtype.is_floating_point else dtype
    [fresh] = diff_state_dicts(old, {"w": new}, dtype=receiver, cost=None)
    buffer = torch.full((new.numel(),), 7, dtype=want)
    [patch] = diff_state_dicts(old, {"w": new}, dtype=receiver, cost=None, buffers={"w": buffer})
    assert patch.indices is None and fresh.indices is None
    assert patch.values.data_ptr() == buffer.data_ptr()
    assert same_bits(patch.values, fresh.values)


def test_a_buffer_that_does_not_fit_or_overlaps_is_never_written() -> None:
    """Wrong size, dtype or layout; memory of `old`, of `new` or of another buffer (a view,
    or another tensor over the same numpy array): the copy is fresh and the buffer untouched.
    A sparse patch writes into no buffer."""
    import numpy

    old = {name: torch.zeros(64) for name in "abcdefgh"}
    new = {name: torch.arange(64.0) + 1 for name in "abcdefgh"}
    new["s"], old["s"] = torch.zeros(2**16), torch.zeros(2**16)
    new["s"][5] = 1.0  # one change in 65536: sparse
    shared = numpy.full(128, 9.0, dtype=numpy.float32)
    buffers = {
        "a": torch.full((63,), 9.0),  # one element short
        "b": torch.full((64,), 9.0, dtype=torch.float64),  # another dtype
        "c": torch.full((128,), 9.0)[::2],  # not contiguous
        "d": old["d"],  # old's own memory
        "e": new["e"][:],  # a view of new's
        "f": torch.from_numpy(shared[:64]),  # f and g: two storages over one array
        "g": torch.from_numpy(shared[32:96]),
        "h": torch.full((64,), 9.0, requires_grad=True),
        "s": torch.full((2**16,), 9.0),
    }
    before = {name: buffer.detach().clone() for name, buffer in buffers.items()}
    patches = {p.name: p for p in diff_state_dicts(old, new, buffers=buffers)}
    assert patches["s"].indices is not None
    for name, buffer in buffers.items():
        assert patches[name].values.data_ptr() != buffer.data_ptr(), name
        assert torch.equal(buffer.detach(), before[name]), name
        if name != "s":
            assert torch.equal(patches[name].values, new[name]), name
    with pytest.raises(InvalidPatchTypeError, match="buffers must be a mapping"):
        diff_state_dicts(old, new, buffers=[torch.zeros(64)])  # type: ignore[arg-type]
