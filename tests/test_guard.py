"""Fail closed: one small loader per write path; each is masked exactly or refused before writing.

In every case, afterwards no parameter or buffer holds the sentinel.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from patchctx import (
    BoolMask,
    CheckpointWeightPatch,
    CopyStrategy,
    IntSentinel,
    LoaderContractError,
    NaNMask,
    load_checkpoint_weight_patches,
)
from tests.support.models import assert_same_state, same_bits, state

Write = Callable[["Layer", torch.Tensor], object]


class Layer(nn.Module):
    """A [4, 6] weight, a [2, 6] packed neighbour and a buffer, loaded by `write`."""

    def __init__(self, write: Write, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        if dtype.is_floating_point:
            self.weight = nn.Parameter(
                torch.randn(4, 6, generator=generator).to(dtype), requires_grad=False
            )
        else:
            self.weight = nn.Parameter(
                torch.randint(-100, 100, (4, 6), generator=generator).to(dtype), requires_grad=False
            )
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(4))
        self.write = write

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.write(self, tensor)
        return {"weight"}


def holds_sentinel(model: nn.Module, strategy: CopyStrategy) -> bool:
    for tensor in model.state_dict().values():
        if tensor.is_floating_point() and torch.isnan(tensor).any():
            return True
        if (
            isinstance(strategy, IntSentinel)
            and not tensor.is_floating_point()
            and (tensor == strategy.sentinel(tensor.dtype)).any()
        ):
            return True
    return False


PATCH = CheckpointWeightPatch(
    "w", (4, 6), torch.float32, torch.tensor([1.5, -2.0, 3.25]), torch.tensor([1, 8, 23])
)


def expected_after(model: Layer, patch: CheckpointWeightPatch = PATCH) -> torch.Tensor:
    expected = model.weight.detach().clone()
    assert patch.indices is not None
    expected.view(-1)[patch.indices] = patch.values.to(expected.dtype)
    return expected


def _setitem(target: torch.Tensor, key: object, value: torch.Tensor) -> None:
    target[key] = value  # type: ignore[index]


def _setitem_in_two_slices(target: torch.Tensor, value: torch.Tensor) -> None:
    target[1:] = value[1:]
    target[0:1] = value[0:1]


def rows(tensor: torch.Tensor) -> torch.Tensor:
    return torch.arange(tensor.shape[0])


def flat(tensor: torch.Tensor) -> torch.Tensor:
    return torch.arange(tensor.numel())


# Write paths, each a tiny loader of any 2-D staged tensor into m.weight.
MASKED: list[tuple[str, Write]] = [
    ("copy_", lambda m, w: m.weight.data.copy_(w)),
    ("copy_-non_blocking", lambda m, w: m.weight.data.copy_(w, non_blocking=True)),
    ("Tensor.copy_-unbound", lambda m, w: torch.Tensor.copy_(m.weight.data, w)),
    ("C-level-copy_-bypassing-the-swap", lambda m, w: torch._C.TensorBase.copy_(m.weight.data, w)),
    ("setitem-basic-slice", lambda m, w: _setitem_in_two_slices(m.weight.data, w)),
    ("setitem-ellipsis", lambda m, w: _setitem(m.weight.data, Ellipsis, w)),
    ("setitem-advanced-index", lambda m, w: _setitem(m.weight.data, rows(w), w)),
    ("setitem-on-parameter", lambda m, w: _setitem(m.weight, slice(None), w)),
    ("copy-of-a-cast", lambda m, w: m.weight.data.copy_(w.to(torch.float64))),
    ("copy-via-a-temporary", lambda m, w: m.weight.data.copy_(torch.empty_like(w).copy_(w))),
    ("copy-of-contiguous-transpose", lambda m, w: m.weight.data.copy_(w.t().contiguous().t())),
    ("copy-of-cat", lambda m, w: m.weight.data.copy_(torch.cat([w[:2], w[2:]]))),
    (
        "gather-then-advanced-setitem",
        lambda m, w: m.weight.data.view(-1).__setitem__(flat(w), w.reshape(-1)[flat(w)]),
    ),
]

REFUSED: list[tuple[str, Write]] = [
    ("param.data-rebind", lambda m, w: setattr(m.weight, "data", w.clone())),
    ("index_copy_", lambda m, w: m.weight.data.index_copy_(0, rows(w), w)),
    ("index_add_", lambda m, w: m.weight.data.index_add_(0, rows(w), w)),
    (
        "masked_scatter_",
        lambda m, w: m.weight.data.masked_scatter_(torch.ones_like(w, dtype=torch.bool), w),
    ),
    ("scatter_", lambda m, w: m.weight.data.scatter_(0, rows(w).unsqueeze(1).expand(w.shape), w)),
    ("torch.add-out", lambda m, w: torch.add(w, 0, out=m.weight.data)),
    ("where-out", lambda m, w: torch.where(torch.isnan(w), m.weight.data, w, out=m.weight.data)),
    ("add_", lambda m, w: m.weight.data.add_(w)),
    ("inplace-operator", lambda m, w: m.weight.data.__iadd__(w)),
    ("mul_0-then-add_", lambda m, w: m.weight.data.mul_(0).add_(w)),
    ("set_", lambda m, w: m.weight.data.set_(w.clone().untyped_storage())),
    ("copy-of-arithmetic", lambda m, w: m.weight.data.copy_(w * 2)),
    ("copy-of-nan_to_num", lambda m, w: m.weight.data.copy_(torch.nan_to_num(w))),
    ("staged-tampered-in-place", lambda m, w: m.weight.data.copy_(w.fill_(0))),
    ("staged-overwritten-by-copy_", lambda m, w: m.weight.data.copy_(w.copy_(torch.zeros_like(w)))),
    ("copy-of-where", lambda m, w: m.weight.data.copy_(torch.where(torch.isnan(w), 0.0, w))),
    ("index_put-accumulate", lambda m, w: m.weight.data.index_put_((rows(w),), w, accumulate=True)),
    (
        "module-attribute-replaced",
        lambda m, w: setattr(m, "weight", nn.Parameter(w.clone(), requires_grad=False)),
    ),
]


@pytest.mark.parametrize("write", [pytest.param(w, id=i) for i, w in MASKED])
@pytest.mark.parametrize("atomic", [False, True])
def test_write_paths_that_are_masked(write: Write, atomic: bool) -> None:
    model = Layer(write)
    expected = expected_after(model)
    load_checkpoint_weight_patches(model, [PATCH], strategy=NaNMask(), atomic=atomic)
    assert same_bits(model.weight.detach(), expected)
    assert not holds_sentinel(model, NaNMask())


@pytest.mark.parametrize("write", [pytest.param(w, id=i) for i, w in REFUSED])
@pytest.mark.parametrize("atomic", [False, True])
def test_write_paths_that_are_refused_before_writing(write: Write, atomic: bool) -> None:
    model = Layer(write)
    before = state(model)
    weight_object = model.weight
    pointer = model.weight.data_ptr()
    with pytest.raises(LoaderContractError):
        load_checkpoint_weight_patches(model, [PATCH], strategy=NaNMask(), atomic=atomic)
    assert not holds_sentinel(model, NaNMask())
    assert model.weight is weight_object and model.weight.data_ptr() == pointer, "storage put back"
    if atomic:
        assert_same_state(state(model), before)
    else:
        # Refused at the first write of staged data: only the loader's own writes before it
        # (the mul_(0)) may have landed.
        changed = not same_bits(model.weight.detach(), before["weight"])
        assert not changed or write is dict(REFUSED)["mul_0-then-add_"]


def test_mul_0_then_add_is_refused_and_the_mul_is_undone_under_atomic() -> None:
    model = Layer(dict(REFUSED)["mul_0-then-add_"])
    before = state(model)
    with pytest.raises(LoaderContractError, match=r"add_.*cannot be masked in place"):
        load_checkpoint_weight_patches(model, [PATCH], atomic=True)
    assert_same_state(state(model), before)
    with pytest.raises(LoaderContractError):
        load_checkpoint_weight_patches(model, [PATCH])
    assert not model.weight.any(), "without atomic, the mul_(0) before the refusal stays"


def test_writes_without_staged_data_proceed() -> None:
    def padded(m: Layer, w: torch.Tensor) -> None:
        m.weight[:3].data.copy_(w[:3])
        m.weight[3:].data.fill_(0)  # vLLM's embedding loader zero-fills padding rows
        m.scale.mul_(2)  # a buffer the loader maintains

    model = Layer(padded)
    expected = expected_after(model)
    expected[3] = 0
    load_checkpoint_weight_patches(model, [PATCH])
    assert same_bits(model.weight.detach(), expected)
    assert model.scale.tolist() == [2.0] * 4


def test_bool_mask_refuses_computed_copies_and_masks_views() -> None:
    nan_values = PATCH._replace(values=torch.tensor([float("nan"), -2.0, 3.25]))
    model = Layer(dict(MASKED)["setitem-basic-slice"])
    expected = expected_after(model, nan_values)
    load_checkpoint_weight_patches(model, [nan_values], strategy=BoolMask())
    assert same_bits(model.weight.detach(), expected)  # NaN is a value under BoolMask
    model = Layer(dict(MASKED)["copy-of-contiguous-transpose"])
    before = state(model)
    with pytest.raises(LoaderContractError):
        load_checkpoint_weight_patches(model, [nan_values], strategy=BoolMask())
    assert_same_state(state(model), before)


@pytest.mark.parametrize(
    ("write", "outcome"),
    [
        (dict(MASKED)["copy_"], "masked"),
        (dict(MASKED)["setitem-advanced-index"], "masked"),
        (dict(MASKED)["copy-via-a-temporary"], "masked"),
        (dict(REFUSED)["index_copy_"], "refused"),
        (lambda m, w: m.weight.data.copy_(w.to(torch.int32)), "refused"),  # the sentinel moves
    ],
)
def test_int8_sentinel_paths(write: Write, outcome: str) -> None:
    model = Layer(write, dtype=torch.int8)
    patch = CheckpointWeightPatch(
        "w", (4, 6), torch.int8, torch.tensor([5, -7], dtype=torch.int8), torch.tensor([0, 13])
    )
    before = state(model)
    if outcome == "masked":
        expected = expected_after(model, patch)
        load_checkpoint_weight_patches(model, [patch])
        assert same_bits(model.weight.detach(), expected)
    else:
        with pytest.raises(LoaderContractError):
            load_checkpoint_weight_patches(model, [patch])
        assert_same_state(state(model), before)
    assert not holds_sentinel(model, IntSentinel())


def test_threads_outside_the_load_are_not_guarded() -> None:
    import threading

    results: list[bool] = []
    started = threading.Event()
    finish = threading.Event()

    def slow(m: Layer, w: torch.Tensor) -> None:
        started.set()
        assert finish.wait(10)
        m.weight.data.copy_(w)

    model = Layer(slow)
    worker = threading.Thread(target=load_checkpoint_weight_patches, args=(model, [PATCH]))
    worker.start()
    assert started.wait(10)
    other = torch.zeros(4, 6)
    other.index_copy_(0, torch.arange(4), torch.full((4, 6), float("nan")))  # not refused here
    results.append(bool(torch.isnan(other).all()))
    finish.set()
    worker.join()
    assert results == [True]
    assert same_bits(model.weight.detach(), expected_after(Layer(slow)))


def test_a_deepcopy_of_the_model_is_not_touched() -> None:
    model = Layer(dict(MASKED)["copy_"])
    twin = copy.deepcopy(model)
    before = state(twin)
    load_checkpoint_weight_patches(model, [PATCH])
    assert_same_state(state(twin), before)


# -------------------------------------------------------------------------------- protect


class TwoWeights(nn.Module):
    """'a' and 'b' load into their own parameter; 'b' stands for a weight an engine repacked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(2, 3), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)
        return {name for name, _ in weights}


def two(name: str, value: float) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name, (2, 3), torch.float32, torch.tensor([value]), torch.tensor([4])
    )


def test_protected_tensors_are_refused_before_the_write_and_atomic_restores_the_rest() -> None:
    model = TwoWeights()
    protect = {"b": "repacked by the engine"}
    with pytest.raises(
        LoaderContractError, match=r"protected tensor 'b' \(repacked by the engine\)"
    ):
        load_checkpoint_weight_patches(
            model, [two("a", 1.0), two("b", 2.0)], protect=protect, atomic=True
        )
    assert not model.a.any() and not model.b.any()
    load_checkpoint_weight_patches(model, [two("a", 1.0)], protect=protect)
    assert model.a.view(-1)[4] == 1.0


def test_known_routes_into_protected_tensors_are_refused_before_any_write() -> None:
    from patchctx import RouteCache

    model = TwoWeights()
    routes = RouteCache()
    load_checkpoint_weight_patches(model, [two("a", 1.0), two("b", 1.0)], routes=routes)
    before = state(model)
    with pytest.raises(LoaderContractError, match=r"nothing was written: 'b' -> 'b'"):
        load_checkpoint_weight_patches(
            model, [two("a", 5.0), two("b", 5.0)], routes=routes, protect={"b": "repacked"}
        )
    assert_same_state(state(model), before)  # even 'a', patched first, was not touched
    assert routes.stats.replayed == 0


def test_staged_data_kept_in_a_plain_tensor_attribute_carries_no_sentinel() -> None:
    class Cached(Layer):
        """Keeps a copy of what it loaded in a plain attribute (not a registered buffer)."""

        def __init__(self) -> None:
            super().__init__(dict(MASKED)["copy_"])
            self.last_loaded = torch.zeros(4, 6)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.last_loaded.copy_(tensor)
                self.weight.data.copy_(tensor)
            return {"weight"}

    model = Cached()
    before = state(model)
    with pytest.raises(LoaderContractError, match="neither a parameter or buffer"):
        load_checkpoint_weight_patches(model, [PATCH])
    assert not torch.isnan(model.last_loaded).any(), "refused before the write"
    assert_same_state(state(model), before)


class Stashes(Layer):
    """Keeps a temporary it made from the staged tensor (or the staged tensor itself)."""

    def __init__(self, keep: str) -> None:
        super().__init__(dict(MASKED)["copy_"])
        self.keep = keep
        self.stash: list[torch.Tensor] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.data.copy_(tensor)
            if self.keep == "clone":
                self.stash.append(tensor.clone())
            elif self.keep == "view":
                self.stash.append(tensor[1:])
            elif self.keep == "scratch-then-dropped":
                scratch = torch.tensor([0.0]).expand(4, 6).clone()
                scratch.copy_(tensor)  # a temporary made by the loader: allowed
        return {"weight"}


@pytest.mark.parametrize("keep", ["clone", "view"])
def test_staged_data_stashed_past_the_call_fails_the_load(keep: str) -> None:
    model = Stashes(keep)
    before = state(model)
    with pytest.raises(LoaderContractError, match="kept staged data of 'w'"):
        load_checkpoint_weight_patches(model, [PATCH], atomic=True)
    assert_same_state(state(model), before)


def test_temporaries_the_loader_drops_are_fine() -> None:
    model = Stashes("scratch-then-dropped")
    expected = expected_after(model)
    load_checkpoint_weight_patches(model, [PATCH])
    assert same_bits(model.weight.detach(), expected)


def test_a_dense_patch_into_a_protected_tensor_is_refused_naming_the_patch() -> None:
    model = TwoWeights()
    dense = CheckpointWeightPatch("b", (2, 3), torch.float32, torch.ones(6))
    with pytest.raises(
        LoaderContractError,
        match=r"the dense patch to 'b' would write into the protected tensor 'b' \(repacked\)",
    ):
        load_checkpoint_weight_patches(model, [dense], protect={"b": "repacked"})
    assert not model.b.any()
