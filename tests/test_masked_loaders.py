"""masked_copy around real loader shapes, against a dense reference, bit for bit.

The reference loads the *full* patched checkpoint tensor with plain copy_ into an identical model;
the masked path loads only the staged sparse tensor. Every parameter must match exactly: the
changed positions written (with the loader's casts), everything else untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchctx import (
    Auto,
    BoolMask,
    CopyStrategy,
    IntSentinel,
    LoaderContractError,
    NaNMask,
    masked_copy,
)
from tests.support.builders import Sparse, sparse_patch, tp_models
from tests.support.models import (
    ContiguousLinear,
    IntLinear,
    ToyModel,
    assert_same_state,
    loaded,
    packed_tp_model,
    state,
)


def check_against_reference(model: ToyModel, strategy: CopyStrategy, patch: Sparse) -> None:
    checkpoint = loaded(model)
    reference = copy.deepcopy(model)
    reference.load_weights([(patch.name, patch.apply_to(checkpoint[patch.name]))])

    staged = strategy.stage(patch.spec.shape, patch.spec.dtype, patch.indices, patch.values)
    with masked_copy(strategy=strategy):
        model.load_weights([(patch.name, staged)])
    assert_same_state(state(model), state(reference))


@given(data=st.data(), built=tp_models())
def test_float_strategies_through_packed_tp_loaders(
    data: st.DataObject, built: tuple[ToyModel, dict[str, object]]
) -> None:
    model, _ = built
    specs = model.checkpoint_specs()
    name = data.draw(st.sampled_from(sorted(specs)))
    choices: list[CopyStrategy] = [NaNMask(), BoolMask(), Auto()]
    strategy = data.draw(st.sampled_from(choices))
    patch = data.draw(sparse_patch(name, specs[name], allow_nan=isinstance(strategy, BoolMask)))
    check_against_reference(model, strategy, patch)


@given(data=st.data())
def test_int8_weights_with_int_sentinel_and_bool_mask(data: st.DataObject) -> None:
    model = ToyModel({"q": IntLinear(6, 10)})
    specs = model.checkpoint_specs()
    name = data.draw(st.sampled_from(sorted(specs)))
    choices: list[CopyStrategy] = [IntSentinel(), BoolMask(), Auto()]
    strategy = data.draw(st.sampled_from(choices))
    spec = specs[name]
    sentinel = None
    if not isinstance(strategy, BoolMask) and not spec.dtype.is_floating_point:
        sentinel = IntSentinel().sentinel(spec.dtype)
    if isinstance(strategy, IntSentinel) and spec.dtype.is_floating_point:
        strategy = NaNMask()  # the float scale of the quantized layer
    patch = data.draw(sparse_patch(name, spec, forbid=sentinel))
    check_against_reference(model, strategy, patch)


@given(data=st.data())
def test_contiguous_intermediate_nan_mask_follows_it(data: st.DataObject) -> None:
    model = ToyModel({"c": ContiguousLinear(5, 7)})
    spec = model.checkpoint_specs()["c.proj.weight"]
    patch = data.draw(sparse_patch("c.proj.weight", spec))
    check_against_reference(model, NaNMask(), patch)


@given(data=st.data())
def test_contiguous_intermediate_bool_mask_follows_it_too(data: st.DataObject) -> None:
    model = ToyModel({"c": ContiguousLinear(5, 7)})
    spec = model.checkpoint_specs()["c.proj.weight"]
    patch = data.draw(sparse_patch("c.proj.weight", spec, allow_nan=True))
    check_against_reference(model, BoolMask(), patch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_fp32_cast_inside_copy(dtype: torch.dtype) -> None:
    # packed_tp_model's "cast" layer holds the other dtype than the checkpoint.
    model = packed_tp_model(dtype=dtype)
    spec = model.checkpoint_specs()["cast.proj.weight"]
    generator = torch.Generator().manual_seed(3)
    indices = torch.randperm(6 * 16, generator=generator)[:20]
    values = (torch.randn(20, generator=generator) * 1e3).to(dtype)
    check_against_reference(model, NaNMask(), Sparse("cast.proj.weight", spec, indices, values))


def test_nan_as_a_value_with_bool_mask_through_a_tp_slice() -> None:
    model = packed_tp_model(tp_size=2, tp_rank=1)
    spec = model.checkpoint_specs()["down.down_proj.weight"]
    # Row-parallel: rank 1 owns columns 16..31 of the [16, 32] checkpoint tensor.
    indices = torch.tensor([0 * 32 + 20, 5 * 32 + 31, 7 * 32 + 3])
    values = torch.tensor([float("nan"), -0.0, 2.0])
    check_against_reference(
        model, BoolMask(), Sparse("down.down_proj.weight", spec, indices, values)
    )
    assert torch.isnan(model.layer("down").weight[0, 4])


LOOKUPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "index_select": lambda book, codes: book.index_select(0, codes.reshape(-1)).view(2, 3),
    "take": lambda book, codes: torch.take(book, codes),
    "gather": lambda book, codes: book.expand(2, 4).gather(1, codes),
}


@pytest.mark.parametrize("lookup", LOOKUPS.values(), ids=LOOKUPS.keys())
def test_staged_codes_that_look_up_a_codebook_are_refused_before_any_write(
    lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Every kept code is a placeholder (0): looking it up would fetch ``book[0]``."""
    book = torch.tensor([10.0, 20.0, 30.0, 40.0])
    weight = torch.full((2, 3), 20.0)  # book[1] everywhere: the checkpoint's codes are all 1
    staged = BoolMask().stage((2, 3), torch.int64, torch.tensor([4]), torch.tensor([3]))
    with (
        pytest.raises(LoaderContractError, match="'index' argument"),
        masked_copy(strategy=BoolMask()),
    ):
        weight.copy_(lookup(book, staged))
    assert bool((weight == 20).all())
    every = BoolMask().stage((2, 3), torch.int64, torch.arange(6), torch.tensor([0, 1, 2, 3, 0, 1]))
    with masked_copy(strategy=BoolMask()):
        weight.copy_(lookup(book, every))  # every code known: exact
    assert weight.view(-1).tolist() == [10.0, 20.0, 30.0, 40.0, 10.0, 20.0]
