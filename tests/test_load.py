"""load_checkpoint_weight_patches against a dense reference and against vLLM's semantics."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_map

from patchctx import (
    Auto,
    BoolMask,
    ByteBudget,
    CheckedPatch,
    CheckpointWeightPatch,
    ChunkingPolicy,
    ChunkState,
    Coalesce,
    CopyStrategy,
    InputOrder,
    IntSentinel,
    InvalidPatchError,
    LoaderContractError,
    NaNMask,
    OrderingPolicy,
    PerTensor,
    RouteCache,
    SingleCall,
    diff_state_dicts,
    load_checkpoint_weight_patches,
)
from tests.support.builders import patch_sequences, sparse_patch
from tests.support.memory import AllocationTracker
from tests.support.models import (
    IntLinear,
    PlainLayer,
    Spec,
    ToyModel,
    assert_same_state,
    loaded,
    packed_tp_model,
    same_bits,
    state,
)
from tests.support.reference import reference_after, vllm_semantics_load

CHUNKINGS: list[ChunkingPolicy] = [ByteBudget(), ByteBudget(600), PerTensor(), SingleCall()]
ORDERINGS: list[OrderingPolicy] = [InputOrder(), Coalesce()]


def sparse(
    name: str, model: ToyModel, indices: list[int], values: list[float]
) -> CheckpointWeightPatch:
    spec = model.checkpoint_specs()[name]
    return CheckpointWeightPatch(
        name, spec.shape, spec.dtype, torch.tensor(values, dtype=spec.dtype), torch.tensor(indices)
    )


@given(
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    tp=st.sampled_from([(1, 0), (2, 1), (4, 2)]),
    chunking=st.sampled_from(CHUNKINGS),
    ordering=st.sampled_from(ORDERINGS),
)
def test_patch_sequences_match_the_dense_reference(
    data: st.DataObject,
    dtype: torch.dtype,
    tp: tuple[int, int],
    chunking: ChunkingPolicy,
    ordering: OrderingPolicy,
) -> None:
    model = packed_tp_model(tp_size=tp[0], tp_rank=tp[1], dtype=dtype)
    checkpoint = loaded(model)
    patches = data.draw(patch_sequences(model.checkpoint_specs()))
    reference = reference_after(model, checkpoint, patches)
    names = load_checkpoint_weight_patches(model, patches, chunking=chunking, ordering=ordering)
    assert_same_state(state(model), state(reference))
    assert names == {f"layers.{p.name.split('.')[0]}.weight" for p in patches}
    for call in model.load_calls:
        assert len(call) == len(set(call)), "a loader call carried one name twice"
    if isinstance(ordering, Coalesce):
        assert len(model.load_calls[0]) >= 1
        loaded_names = [n for call in model.load_calls for n in call]
        assert len(loaded_names) == len(set(loaded_names)), "Coalesce: one load per name"


@given(data=st.data(), ordering=st.sampled_from(ORDERINGS))
def test_int8_weights_work_out_of_the_box(data: st.DataObject, ordering: OrderingPolicy) -> None:
    model = ToyModel({"q": IntLinear(5, 9)})
    checkpoint = loaded(model)
    patches = data.draw(patch_sequences(model.checkpoint_specs()))
    reference = reference_after(model, checkpoint, patches)
    load_checkpoint_weight_patches(model, patches, ordering=ordering)
    assert_same_state(state(model), state(reference))


@given(
    data=st.data(),
    kind=st.sampled_from(["dense", "sparse"]),
    budget=st.sampled_from([1, 900, 1 << 20]),
)
def test_bit_identical_to_vllm_semantics(data: st.DataObject, kind: str, budget: int) -> None:
    model = packed_tp_model(tp_size=2, tp_rank=1, dtype=torch.float32)
    loaded(model)
    specs = {n: s for n, s in model.checkpoint_specs().items() if s.dtype == torch.float32}
    patches = data.draw(patch_sequences(specs, kinds=(kind,)))
    theirs = copy.deepcopy(model)
    their_names = vllm_semantics_load(theirs, patches, max_chunk_bytes=budget)
    our_names = load_checkpoint_weight_patches(model, patches, max_chunk_bytes=budget)
    assert_same_state(state(model), state(theirs))
    assert our_names == their_names
    if kind == "dense":
        assert model.load_calls == theirs.load_calls  # same chunks, same loader calls
        return
    # Sparse: a chunk counts the staged masks too (one byte per element), which vLLM's NaN
    # staging has none of: the same calls, or each of vLLM's split further, in order.
    assert [n for call in model.load_calls for n in call] == [
        n for call in theirs.load_calls for n in call
    ]
    assert len(model.load_calls) >= len(theirs.load_calls)
    for call in model.load_calls:
        staged = sum(math.prod(specs[n].shape) * (4 + 1) for n in call)
        assert staged <= budget or len(call) == 1


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_call", [1, 2, 3])
def test_byte_budget_bounds_the_bytes_the_load_path_allocates(
    dtype: torch.dtype, per_call: int
) -> None:
    """What `ByteBudget(n)` bounds is measured on the real load path: every storage torch
    allocates during the call (the staged tensors, their masks, the loader's temporaries and
    the undo log), tracked by a torch function mode. Staging a sparse patch costs its tensor
    and its mask (one byte per element): a budget of `per_call` such patches lets exactly
    that many into one loader call, and what is alive never exceeds it by more than a few
    hundred bytes of scratch (a mask uncounted is 4096 here)."""
    rows, cols, count = 64, 64, 5
    model = ToyModel({f"l{k}": PlainLayer({"w": Spec((rows, cols), dtype)}) for k in range(count)})
    loaded(model)
    numel = rows * cols
    patches = [
        CheckpointWeightPatch(
            f"l{k}.w.weight", (rows, cols), dtype, torch.ones(4, dtype=dtype), torch.arange(4) * 7
        )
        for k in range(count)
    ]
    staged = numel * (dtype.itemsize + 1)
    budget = per_call * staged
    preexisting = [
        *model.parameters(),
        *(p.values for p in patches),
        *(p.indices for p in patches if p.indices is not None),
    ]
    with AllocationTracker(preexisting=preexisting) as tracker:
        load_checkpoint_weight_patches(model, patches, chunking=ByteBudget(budget))
    assert [len(call) for call in model.load_calls] == [
        min(per_call, count - start) for start in range(0, count, per_call)
    ]
    # (the slack: validation's and replay's scratch for 4 indices, on either device's way)
    assert budget <= tracker.peak <= budget + 1024, (tracker.peak, budget)
    assert tracker.live <= 0, "staged tensors must be freed after their loader call"


def test_max_chunk_bytes_is_shorthand_for_byte_budget() -> None:
    a, b = packed_tp_model(), packed_tp_model()
    loaded(a)
    loaded(b)
    specs = a.checkpoint_specs()
    patches = [sparse(n, a, [1], [5.0]) for n in sorted(specs)]
    load_checkpoint_weight_patches(a, patches, max_chunk_bytes=3000)
    load_checkpoint_weight_patches(b, patches, chunking=ByteBudget(3000))
    assert a.load_calls == b.load_calls
    assert len(a.load_calls) > 1


def test_single_call_splits_only_where_a_name_repeats_or_the_kind_changes() -> None:
    model = packed_tp_model()
    loaded(model)
    q = sparse("qkv.q_proj.weight", model, [0], [1.0])
    k = sparse("qkv.k_proj.weight", model, [0], [1.0])
    spec = model.checkpoint_specs()["mlp.up_proj.weight"]
    dense = CheckpointWeightPatch(
        "mlp.up_proj.weight", spec.shape, spec.dtype, torch.zeros(math.prod(spec.shape))
    )
    load_checkpoint_weight_patches(model, [q, k, q, dense, k], chunking=SingleCall())
    assert model.load_calls == [
        ["qkv.q_proj.weight", "qkv.k_proj.weight"],
        ["qkv.q_proj.weight"],
        ["mlp.up_proj.weight"],
        ["qkv.k_proj.weight"],
    ]


def test_per_tensor_makes_one_call_per_patch() -> None:
    model = packed_tp_model()
    loaded(model)
    patches = [sparse(n, model, [2], [3.0]) for n in ("qkv.q_proj.weight", "qkv.v_proj.weight")]
    load_checkpoint_weight_patches(model, patches, chunking=PerTensor())
    assert model.load_calls == [["qkv.q_proj.weight"], ["qkv.v_proj.weight"]]


def test_user_defined_policies() -> None:
    class EveryTwo:
        def split_before(self, chunk: ChunkState) -> bool:
            return chunk.count >= 2

    class ByName:
        """Sorts by name (different names touch different parameters here)."""

        def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
            return sorted(patches, key=lambda p: p.name)

    model = packed_tp_model()
    checkpoint = loaded(model)
    names = ["tr.proj.weight", "qkv.q_proj.weight", "mlp.gate_proj.weight", "down.down_proj.weight"]
    patches = [sparse(n, model, [1, 2], [4.0, 5.0]) for n in names]
    reference = reference_after(model, checkpoint, patches)
    load_checkpoint_weight_patches(model, patches, chunking=EveryTwo(), ordering=ByName())
    assert model.load_calls == [sorted(names)[:2], sorted(names)[2:]]
    assert_same_state(state(model), state(reference))


def test_user_ordering_that_builds_new_patches_is_validated() -> None:
    class Broken:
        def order(self, patches: Sequence[CheckedPatch]) -> list[CheckpointWeightPatch]:
            return [p.patch._replace(indices=torch.tensor([10**6])) for p in patches]

    model = packed_tp_model()
    loaded(model)
    before = state(model)
    with pytest.raises(InvalidPatchError, match=r"Broken.*produced an invalid patch.*out of range"):
        load_checkpoint_weight_patches(
            model, [sparse("tr.proj.weight", model, [1], [4.0])], ordering=Broken()
        )
    assert_same_state(state(model), before)


@pytest.mark.parametrize("change", ["index out of range", "NaN value"])
def test_a_checked_patch_a_policy_changed_in_place_loads_as_validated(change: str) -> None:
    """Validation ran before the policy: a policy that writes into a patch's tensors in place
    changes the caller's tensors, never validation's own copies, which are what is loaded."""

    class Tampering:
        def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
            patch = patches[0].patch
            assert patch.indices is not None
            if change == "index out of range":
                patch.indices[0] = -1
            else:
                patch.values[0] = float("nan")
            return list(patches)

    model = packed_tp_model()
    loaded(model)
    reference = copy.deepcopy(model)
    patch = sparse("tr.proj.weight", model, [1, 4], [4.0, 5.0])
    load_checkpoint_weight_patches(reference, [sparse("tr.proj.weight", model, [1, 4], [4.0, 5.0])])
    load_checkpoint_weight_patches(model, [patch], ordering=Tampering())
    assert_same_state(state(model), state(reference))


@pytest.mark.parametrize("tampering", ["drops every patch", "reverses"])
def test_a_policy_subclassing_input_order_is_honoured(tampering: str) -> None:
    """`InputOrder` is the default, and passes patches through untouched; a subclass that
    overrides `order` is a policy of its own, and what it returns is what loads."""

    class Custom(InputOrder):
        def order(self, patches: Sequence[CheckedPatch]) -> list[CheckedPatch]:
            return [] if tampering == "drops every patch" else list(reversed(patches))

    model = packed_tp_model()
    loaded(model)
    reference = copy.deepcopy(model)
    first = sparse("tr.proj.weight", model, [1, 4], [4.0, 5.0])
    second = sparse("tr.proj.weight", model, [1], [9.0])
    names = load_checkpoint_weight_patches(model, [first, second], ordering=Custom())
    if tampering == "drops every patch":
        assert names == set() and model.load_calls == []
    else:  # the input's later patch first: position 1 ends as the first patch wrote it
        load_checkpoint_weight_patches(reference, [second, first])
    assert_same_state(state(model), state(reference))


def test_coalesce_merges_dense_then_sparse_and_sparse_runs() -> None:
    model = packed_tp_model()
    checkpoint = loaded(model)
    spec = model.checkpoint_specs()["tr.proj.weight"]
    dense = CheckpointWeightPatch(
        "tr.proj.weight",
        spec.shape,
        spec.dtype,
        torch.arange(math.prod(spec.shape), dtype=torch.float32),
    )
    patches = [
        sparse("tr.proj.weight", model, [5, 1], [1.0, 2.0]),
        dense,
        sparse("tr.proj.weight", model, [3, 1], [7.0, 8.0]),
        sparse("qkv.q_proj.weight", model, [9, 4], [1.0, 1.5]),
        sparse("qkv.q_proj.weight", model, [4], [2.5]),
    ]
    reference = reference_after(model, checkpoint, patches)
    load_checkpoint_weight_patches(model, patches, ordering=Coalesce(), chunking=SingleCall())
    assert_same_state(state(model), state(reference))
    assert model.load_calls == [["tr.proj.weight"], ["qkv.q_proj.weight"]]  # dense, then sparse


def test_coalesce_refuses_patches_that_disagree_on_the_tensor() -> None:
    model = packed_tp_model()
    loaded(model)
    before = state(model)
    a = sparse("tr.proj.weight", model, [1], [1.0])
    b = a._replace(shape=(a.shape[1], a.shape[0]))
    with pytest.raises(InvalidPatchError, match="disagree on the tensor"):
        load_checkpoint_weight_patches(model, [a, b], ordering=Coalesce())
    assert_same_state(state(model), before)


def test_dense_and_sparse_mixed_in_input_order() -> None:
    model = packed_tp_model()
    checkpoint = loaded(model)
    spec = model.checkpoint_specs()["qkv.q_proj.weight"]
    numel = math.prod(spec.shape)
    values = torch.full((numel,), float("nan"))  # NaN is a legal *dense* value
    patches = [
        sparse("qkv.q_proj.weight", model, [0, 1], [1.0, 2.0]),
        CheckpointWeightPatch("qkv.q_proj.weight", spec.shape, spec.dtype, values),
        sparse("qkv.q_proj.weight", model, [1], [3.0]),
    ]
    reference = reference_after(model, checkpoint, patches)
    load_checkpoint_weight_patches(model, patches)
    assert_same_state(state(model), state(reference))
    q_rows = model.layer("qkv").weight[:8]
    assert torch.isnan(q_rows).sum() == q_rows.numel() - 1  # all NaN but the re-patched one


def test_aliases_load_under_the_canonical_name_or_are_dropped() -> None:
    model = packed_tp_model()
    checkpoint = loaded(model)
    alias = {"lm_head.proj.weight": "tr.proj.weight"}
    via_alias = sparse("tr.proj.weight", model, [2], [9.0])._replace(name="lm_head.proj.weight")
    reference = reference_after(model, checkpoint, [via_alias._replace(name="tr.proj.weight")])
    assert load_checkpoint_weight_patches(model, [via_alias], aliases=alias) == {"layers.tr.weight"}
    assert_same_state(state(model), state(reference))
    assert model.load_calls == [["tr.proj.weight"]]

    model.load_calls.clear()
    canonical = sparse("tr.proj.weight", model, [3], [4.0])
    tied = canonical._replace(name="lm_head.proj.weight")  # the same update, sent twice
    load_checkpoint_weight_patches(model, [tied, canonical], aliases=alias)
    assert model.load_calls == [["tr.proj.weight"]]
    assert float(model.layer("tr").weight.t().reshape(-1)[3]) == 4.0


def test_an_alias_patched_differently_from_its_canonical_name_is_refused() -> None:
    model = packed_tp_model()
    loaded(model)
    before = state(model)
    alias = {"lm_head.proj.weight": "tr.proj.weight"}
    canonical = sparse("tr.proj.weight", model, [3], [4.0])
    same = canonical._replace(name="lm_head.proj.weight")
    load_checkpoint_weight_patches(model, [canonical, same], aliases=alias)  # tied: sent twice
    assert model.load_calls == [["tr.proj.weight"]]
    model.load_calls.clear()
    different = same._replace(values=torch.tensor([5.0]))
    with pytest.raises(InvalidPatchError, match=r"patches\[1\] 'lm_head.proj.weight': is an alias"):
        load_checkpoint_weight_patches(model, [canonical, different], aliases=alias)
    assert model.load_calls == []
    after_first = state(model)
    assert not same_bits(after_first["layers.tr.weight"], before["layers.tr.weight"])
    negative_zero = canonical._replace(values=torch.tensor([-0.0]))
    with pytest.raises(InvalidPatchError):  # bits differ: -0.0 is not 0.0
        load_checkpoint_weight_patches(
            model,
            [
                canonical._replace(values=torch.tensor([0.0])),
                negative_zero._replace(name="lm_head.proj.weight"),
            ],
            aliases=alias,
        )


def test_accepts_any_object_with_the_fields_such_as_vllms_namedtuple() -> None:
    class VllmPatch(NamedTuple):
        name: str
        shape: tuple[int, ...]
        dtype: torch.dtype
        values: torch.Tensor
        indices: torch.Tensor | None = None

    model = packed_tp_model()
    checkpoint = loaded(model)
    ours = sparse("tr.proj.weight", model, [0, 7], [1.0, 2.0])
    theirs = VllmPatch(*ours)
    reference = reference_after(model, checkpoint, [ours])
    load_checkpoint_weight_patches(model, [theirs])
    assert_same_state(state(model), state(reference))


def test_returns_union_of_reported_names_and_none_counts_as_empty() -> None:
    class Quiet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))  # requires grad: no_grad must be on
            self.calls = 0

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            assert not torch.is_grad_enabled()
            for _, tensor in weights:
                self.w.copy_(tensor)
                self.calls += 1

    model = Quiet()
    patch = CheckpointWeightPatch("w", (3,), torch.float32, torch.tensor([2.0]), torch.tensor([1]))
    assert load_checkpoint_weight_patches(model, [patch, patch]) == set()
    assert model.calls == 2
    assert model.w.tolist() == [0.0, 2.0, 0.0]
    assert load_checkpoint_weight_patches(model, []) == set()
    assert model.calls == 2  # no loader call for no patches


@pytest.mark.parametrize("recording", [True, False], ids=["grad on", "grad off"])
@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("ending", ["returns", "invalid", "loader raises", "interrupted"])
def test_gradient_recording_is_off_inside_and_as_it_was_after(
    recording: bool, atomic: bool, ending: str
) -> None:
    """The call turns gradient recording off itself (not through ``torch.no_grad()``) and puts
    it back as it found it, however it ends; an atomic call's restore of a weight that requires
    grad runs while it is still off (an in-place write into such a leaf raises otherwise)."""

    class Failing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))  # requires grad
            self.seen: list[bool] = []

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, tensor in weights:
                self.seen.append(torch.is_grad_enabled())
                self.w.copy_(tensor)
                if ending == "loader raises":
                    raise RuntimeError("the loader fails after its write")
                if ending == "interrupted":
                    raise KeyboardInterrupt

    model = Failing()
    indices = torch.tensor([1]) if ending != "invalid" else torch.tensor([3])
    patch = CheckpointWeightPatch("w", (3,), torch.float32, torch.tensor([2.0]), indices)
    expected = {
        "returns": None,
        "invalid": InvalidPatchError,
        "loader raises": RuntimeError,
        "interrupted": KeyboardInterrupt,
    }[ending]
    with torch.set_grad_enabled(recording):
        if expected is None:
            load_checkpoint_weight_patches(model, [patch], atomic=atomic)
        else:
            with pytest.raises(expected):
                load_checkpoint_weight_patches(model, [patch], atomic=atomic)
        assert torch.is_grad_enabled() is recording
    assert model.seen == ([] if ending == "invalid" else [False])
    # (A loader call that fails keeps none of its writes, atomic or not: see `_session`.)
    assert model.w.tolist() == ([0.0, 2.0, 0.0] if ending == "returns" else [0.0, 0.0, 0.0])


def test_gradient_recording_is_put_back_per_thread() -> None:
    """Gradient recording is a thread's own: two threads loading at once, one recording
    gradients and one not, each find theirs as it was after every call (and off inside)."""
    errors: list[str] = []
    start = threading.Barrier(2)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64))  # requires grad

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, tensor in weights:
                if torch.is_grad_enabled():
                    errors.append("gradient recording on inside a load")
                self.w.copy_(tensor)

    def work(recording: bool) -> None:
        model, routes = Model(), RouteCache()
        torch.set_grad_enabled(recording)
        start.wait()
        for k in range(200):
            patch = CheckpointWeightPatch(
                "w", (64,), torch.float32, torch.tensor([float(k)]), torch.tensor([k % 64])
            )
            load_checkpoint_weight_patches(model, [patch], routes=routes if k % 2 else None)
            if torch.is_grad_enabled() is not recording:
                errors.append(f"the thread recording={recording} found it changed after call {k}")

    threads = [threading.Thread(target=work, args=(recording,)) for recording in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


class TurnsRecordingOn(torch.nn.Module):
    """A loader that turns gradient recording on after each copy and leaves it on; its
    weights require gradients (an in-place write into one raises while recording)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(4))
        self.fail = fail

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            getattr(self, name).copy_(tensor)  # (the second one raises: recording is on)
            torch.set_grad_enabled(True)
            names.add(name)
            if self.fail:
                raise RuntimeError("the loader fails after its write")
        return names


@pytest.mark.parametrize("recording", [True, False], ids=["grad on", "grad off"])
@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
def test_a_loader_that_turns_recording_on_cannot_make_patchctxs_own_writes_fail(
    recording: bool, atomic: bool
) -> None:
    """What a loader does to gradient recording lasts until its call returns: the patches
    after it are replayed, and a failed call is rolled back, with recording off again (an
    atomic call's restore into a weight that requires grad raised, and left it written)."""
    sparse_b = CheckpointWeightPatch(
        "b", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2])
    )
    dense_a = CheckpointWeightPatch("a", (4,), torch.float32, torch.arange(4.0))
    # A dense patch through the loader, then a sparse one replayed along a known route.
    model, routes = TurnsRecordingOn(), RouteCache()
    load_checkpoint_weight_patches(
        model, [sparse_b._replace(values=torch.tensor([1.0]))], routes=routes
    )
    with torch.set_grad_enabled(recording):
        load_checkpoint_weight_patches(model, [dense_a, sparse_b], routes=routes, atomic=atomic)
        assert torch.is_grad_enabled() is recording
    assert routes.stats.replayed == 1
    assert model.a.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert model.b.tolist() == [0.0, 0.0, 7.0, 0.0]
    # Two sparse patches in one loader call that fails: rolled back, atomic or not.
    failing = TurnsRecordingOn(fail=True)
    sparse_a = dense_a._replace(values=torch.tensor([5.0]), indices=torch.tensor([1]))
    with torch.set_grad_enabled(recording):
        with pytest.raises(RuntimeError, match="the loader fails"):
            load_checkpoint_weight_patches(failing, [sparse_a, sparse_b], atomic=atomic)
        assert torch.is_grad_enabled() is recording
    assert failing.a.tolist() == [0.0] * 4
    assert failing.b.tolist() == [0.0] * 4


@pytest.mark.parametrize("strategy", [NaNMask(), BoolMask(), Auto()])
@given(data=st.data())
def test_every_float_strategy_gives_the_same_weights(
    data: st.DataObject, strategy: CopyStrategy
) -> None:
    model = packed_tp_model(tp_size=2, tp_rank=0, dtype=torch.bfloat16)
    checkpoint = loaded(model)
    specs = model.checkpoint_specs()
    name = data.draw(st.sampled_from(sorted(specs)))
    drawn = data.draw(sparse_patch(name, specs[name], allow_nan=isinstance(strategy, BoolMask)))
    patch = CheckpointWeightPatch(
        name, drawn.spec.shape, drawn.spec.dtype, drawn.values, drawn.indices
    )
    reference = reference_after(model, checkpoint, [patch])
    load_checkpoint_weight_patches(model, [patch], strategy=strategy)
    assert_same_state(state(model), state(reference))


def test_int_sentinel_with_a_custom_value() -> None:
    model = ToyModel({"q": IntLinear(2, 4)})
    checkpoint = loaded(model)
    patch = CheckpointWeightPatch(
        "q.qweight.weight",
        (2, 4),
        torch.int8,
        torch.tensor([-128, 5], dtype=torch.int8),
        torch.tensor([0, 6]),
    )
    reference = reference_after(model, checkpoint, [patch])
    load_checkpoint_weight_patches(model, [patch], strategy=IntSentinel(value=99))
    assert_same_state(state(model), state(reference))


def test_coalesce_groups_alternating_dense_and_sparse_patches() -> None:
    model = packed_tp_model()
    checkpoint = loaded(model)
    specs = model.checkpoint_specs()

    def dense(name: str, value: float) -> CheckpointWeightPatch:
        spec = specs[name]
        return CheckpointWeightPatch(
            name, spec.shape, spec.dtype, torch.full((math.prod(spec.shape),), value)
        )

    patches = [
        dense("tr.proj.weight", 0.5),
        sparse("qkv.q_proj.weight", model, [1, 4], [1.0, 2.0]),
        dense("mlp.up_proj.weight", 0.25),
        sparse("down.down_proj.weight", model, [3], [3.0]),
        dense("qkv.k_proj.weight", -1.0),
    ]
    reference = reference_after(model, checkpoint, patches)
    load_checkpoint_weight_patches(model, patches)
    assert len(model.load_calls) == 5  # InputOrder: one call per run of one kind
    assert_same_state(state(model), state(reference))

    model = packed_tp_model()
    loaded(model)
    load_checkpoint_weight_patches(model, patches, ordering=Coalesce())
    assert model.load_calls == [
        ["tr.proj.weight", "mlp.up_proj.weight", "qkv.k_proj.weight"],
        ["qkv.q_proj.weight", "down.down_proj.weight"],
    ]
    assert_same_state(state(model), state(reference))


def test_coalesce_in_a_training_loop_makes_fewer_loader_calls() -> None:
    from tests.support.training import train_and_send

    one, other = train_and_send(InputOrder()), train_and_send(Coalesce())
    assert one.patches == other.patches and 0 < one.dense < one.patches  # dense and sparse
    # Measured: 60 patches in 4 steps, 25 loader calls in input order, 5 with Coalesce
    # (a dense call per step, and a sparse call that records routes).
    assert other.loader_calls <= 2 * 4 < one.loader_calls
    for side in (one, other):
        for received, trained in zip(
            side.receiver.inner.parameters(), side.trainer.parameters(), strict=True
        ):
            assert same_bits(received, trained.detach().to(torch.bfloat16))


class OneWeight(torch.nn.Module):
    """One flat weight `w` of `numel` elements, loaded by a plain ``copy_``."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel, dtype=dtype), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.w.copy_(tensor)
        return {"w"}


class _Adapter:
    """Not a module: a loader by checkpoint name and the parameters it writes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.calls = 0

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def named_buffers(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.module.named_buffers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        parameters = dict(self.module.named_parameters())
        for name, tensor in weights:
            parameters[name].copy_(tensor.view_as(parameters[name]))
        return {name for name, _ in weights}


def _module() -> torch.nn.Module:
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return module.requires_grad_(False)


def test_a_plain_adapter_object_works_end_to_end() -> None:
    module = _module()
    adapter = _Adapter(module)
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    routes = RouteCache()
    patch = CheckpointWeightPatch(
        "0.weight", (3, 4), torch.float32, torch.tensor([5.0, 6.0]), torch.tensor([1, 10])
    )
    bias = CheckpointWeightPatch("0.bias", (3,), torch.float32, torch.tensor([1.0, 2.0, 3.0]))
    names = load_checkpoint_weight_patches(
        adapter, [patch, bias], routes=routes, atomic=True, ordering=Coalesce()
    )
    assert names == {"0.weight", "0.bias"}
    expected = before["0.weight"].clone().view(-1)
    expected[[1, 10]] = torch.tensor([5.0, 6.0])
    assert torch.equal(module.get_parameter("0.weight").view(-1), expected)
    assert module.get_parameter("0.bias").tolist() == [1.0, 2.0, 3.0]
    assert "0.weight" in routes  # a view copy: the route was recorded
    calls, replayed = adapter.calls, routes.stats.replayed
    again = patch._replace(values=torch.tensor([7.0, 8.0]))
    load_checkpoint_weight_patches(adapter, [again], routes=routes)
    assert adapter.calls == calls  # replayed, no loader call
    assert routes.stats.replayed == replayed + 1
    assert module.get_parameter("0.weight").view(-1)[[1, 10]].tolist() == [7.0, 8.0]


def test_a_plain_adapter_object_that_rebinds_a_parameter_is_refused_and_undone() -> None:
    from patchctx import LoaderContractError

    module = _module()
    weight = module.get_parameter("0.weight")
    storage, before = weight.untyped_storage().data_ptr(), weight.clone()

    class Rebinding(_Adapter):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                weight.data = tensor.clone()
            return set()

    dense = CheckpointWeightPatch("0.weight", (3, 4), torch.float32, torch.ones(12))
    with pytest.raises(LoaderContractError, match="replaced, reshaped or added"):
        load_checkpoint_weight_patches(Rebinding(module), [dense])
    assert weight.untyped_storage().data_ptr() == storage and torch.equal(weight, before)


def test_a_model_without_named_parameters_is_refused_before_any_work() -> None:
    from patchctx import InvalidPatchTypeError

    class LoaderOnly:
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            raise AssertionError("never called")

    patch = CheckpointWeightPatch("w", (2,), torch.float32, torch.zeros(2))
    with pytest.raises(InvalidPatchTypeError, match=r"named_parameters\(\) method"):
        load_checkpoint_weight_patches(LoaderOnly(), [patch])  # type: ignore[arg-type]


def test_protect_names_that_match_no_tensor_are_refused() -> None:
    model = packed_tp_model()
    loaded(model)
    before = state(model)
    patch = sparse("tr.proj.weight", model, [1], [4.0])
    with pytest.raises(InvalidPatchError, match=r"'layers\.tr\.wieght'.*did you mean") as info:
        load_checkpoint_weight_patches(
            model, [patch], protect={"layers.tr.wieght": "repacked", "layers.tr.weight": "x"}
        )
    assert [problem.name for problem in info.value.problems] == ["layers.tr.wieght"]
    assert_same_state(state(model), before)


@pytest.mark.parametrize("parameter", [torch.float16, torch.float32])
@pytest.mark.parametrize("dense", [True, False])
def test_values_that_are_a_lazy_negative_view_load_with_their_sign(
    parameter: torch.dtype, dense: bool
) -> None:
    """A contiguous negative view (``torch._neg_view``, ``z.conj().imag``) as patch values:
    torch's cast copy drops its sign, so validation resolves it once."""

    stored = torch.tensor([1.5, 2.0, 3.0, 4.0])
    values = torch._neg_view(stored if dense else stored[:2])
    assert values.is_neg() and values.is_contiguous()
    indices = None if dense else torch.tensor([1, 3])
    model = OneWeight(4, parameter)
    load_checkpoint_weight_patches(
        model, [CheckpointWeightPatch("w", (4,), torch.float32, values, indices)]
    )
    expected = torch.tensor([-1.5, -2.0, -3.0, -4.0] if dense else [0.0, -1.5, 0.0, -2.0])
    assert torch.equal(model.w.detach(), expected.to(parameter))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("count", [2, 5000])
@pytest.mark.parametrize("mode", ["loader", "atomic", "routes"])
def test_indices_that_are_a_lazy_negative_view_load_at_their_positions(
    index_dtype: torch.dtype, count: int, mode: str
) -> None:
    """Indices that are a negative view (``torch._neg_view(-i)``) stand for ``i``: validation,
    staging and replay read them by the values they stand for (numpy refused them)."""

    wanted = torch.arange(1, 2 * count, 2, dtype=index_dtype)
    indices = torch._neg_view(-wanted)
    assert indices.is_neg() and torch.equal(indices, wanted)
    values = torch.arange(1.0, count + 1.0)
    model = OneWeight(2 * count)
    routes = RouteCache() if mode == "routes" else None
    if routes is not None:  # learn the route, so that the patch below replays
        first = CheckpointWeightPatch("w", (2 * count,), torch.float32, values[:1], wanted[:1])
        load_checkpoint_weight_patches(model, [first], routes=routes)
    patch = CheckpointWeightPatch("w", (2 * count,), torch.float32, values, indices)
    load_checkpoint_weight_patches(model, [patch], routes=routes, atomic=mode == "atomic")
    expected = torch.zeros(2 * count)
    expected[wanted.long()] = values
    assert torch.equal(model.w.detach(), expected)
    if routes is not None:
        assert routes.stats.replayed == 1


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("count", [2, 2000])
@pytest.mark.parametrize("mode", ["loader", "atomic", "routes", "diff"])
def test_complex32_sparse_patches_load_under_bool_mask(count: int, mode: str) -> None:
    """torch has no ``put_`` for complex32 (``ComplexHalf``) on CPU: its sparse patches move
    as bits through an integer view, on every path, and a diff round-trips."""

    shape = (2 * count,)
    indices = torch.arange(1, 2 * count, 2)
    values = torch.complex(torch.arange(1.0, count + 1.0), -torch.ones(count))
    expected = torch.zeros(shape, dtype=torch.complex64)
    expected[indices] = values
    expected = expected.to(torch.complex32)
    model = OneWeight(2 * count, torch.complex32)
    routes = RouteCache() if mode == "routes" else None
    if routes is not None:  # learn the route, so that the patch below replays
        first = CheckpointWeightPatch("w", shape, torch.complex32, values[:1], indices[:1])
        load_checkpoint_weight_patches(model, [first], strategy=BoolMask(), routes=routes)
    patches = [CheckpointWeightPatch("w", shape, torch.complex32, values, indices)]
    if mode == "diff":
        old = {"w": torch.zeros(shape, dtype=torch.complex32)}
        patches = diff_state_dicts(old, {"w": expected}, strategy=BoolMask(), cost=None)
        assert patches[0].indices is not None
    load_checkpoint_weight_patches(
        model, patches, strategy=BoolMask(), routes=routes, atomic=mode == "atomic"
    )
    assert same_bits(model.w.detach(), expected)
    if routes is not None:
        assert routes.stats.replayed == 1


@pytest.mark.parametrize("strategy", [Auto(), BoolMask()])
@pytest.mark.parametrize("mode", ["loader", "atomic", "routes"])
def test_a_sparse_patch_to_an_empty_tensor_loads(strategy: CopyStrategy, mode: str) -> None:
    """A checkpoint tensor with a zero dimension (an empty shard, a zero-width bias) has no
    storage to own: an empty sparse patch to it loads and changes nothing, as a dense one
    does, instead of being refused as a write into a tensor that is not the model's."""

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.empty = torch.nn.Parameter(torch.zeros(0, 4), requires_grad=False)
            self.w = torch.nn.Parameter(torch.zeros(3), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                getattr(self, name).copy_(tensor)
            return {name for name, _ in weights}

    model = Two()
    routes = RouteCache() if mode == "routes" else None
    patches = [
        CheckpointWeightPatch(
            "empty", (0, 4), torch.float32, torch.zeros(0), torch.zeros(0, dtype=torch.long)
        ),
        CheckpointWeightPatch("w", (3,), torch.float32, torch.tensor([2.0]), torch.tensor([1])),
    ]
    for _ in range(2 if routes is not None else 1):
        names = load_checkpoint_weight_patches(
            model, patches, strategy=strategy, routes=routes, atomic=mode == "atomic"
        )
        assert names == {"empty", "w"}
    assert model.empty.shape == (0, 4)
    assert torch.equal(model.w.detach(), torch.tensor([0.0, 2.0, 0.0]))


@pytest.fixture
def deterministic_algorithms() -> Iterable[None]:
    """``torch.use_deterministic_algorithms(True)`` for one test, as reproducible RL runs set."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.usefixtures("deterministic_algorithms")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint16, torch.complex128]
)
@pytest.mark.parametrize("count", [3, 2000])
@pytest.mark.parametrize("mode", ["loader", "atomic", "routes"])
def test_sparse_patches_load_under_deterministic_algorithms(
    dtype: torch.dtype, count: int, mode: str
) -> None:
    """torch has no deterministic ``put_``: under ``use_deterministic_algorithms(True)``
    staging, replay and the undo log write with ``index_put_``, which has one, and a patch
    loads the dense truth instead of raising torch's ``RuntimeError``."""

    shape = (3 * count,)
    indices = torch.arange(0, 3 * count, 3)
    values = torch.arange(1, count + 1).to(dtype)
    model = OneWeight(3 * count, dtype)
    routes = RouteCache() if mode == "routes" else None
    if routes is not None:  # learn the route, so that the patch below replays
        first = CheckpointWeightPatch("w", shape, dtype, values[:1], indices[:1])
        load_checkpoint_weight_patches(model, [first], strategy=BoolMask(), routes=routes)
    patch = CheckpointWeightPatch("w", shape, dtype, values, indices)
    load_checkpoint_weight_patches(
        model, [patch], strategy=BoolMask(), routes=routes, atomic=mode == "atomic"
    )
    expected = torch.zeros(shape, dtype=dtype)
    expected.view(torch.uint8).view(-1, expected.element_size())[indices] = values.view(
        torch.uint8
    ).view(-1, expected.element_size())
    assert same_bits(model.w.detach(), expected)
    if routes is not None:
        assert routes.stats.replayed == 1


@pytest.mark.parametrize("view", ["conj", "conj-imag"])
def test_staged_data_copied_into_a_lazily_conjugated_view_is_refused_with_nothing_written(
    view: str,
) -> None:
    """``p.conj().copy_(w)`` or ``p.conj().imag.copy_(w)``: the view stands for other values
    than the bits it holds, and a masked merge would write the bits. Refused; a dense patch
    (a plain ``copy_``, which resolves the view) loads the dense truth."""

    class Conjugating(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                if view == "conj":
                    self.p.data.conj().copy_(tensor)
                else:
                    self.p.data.conj().imag.copy_(tensor)
            return {"p"}

    dtype = torch.complex64 if view == "conj" else torch.float32
    value = torch.tensor([2 + 3j]) if view == "conj" else torch.tensor([9.0])
    model = Conjugating()
    before = model.p.detach().clone()
    sparse = CheckpointWeightPatch("p", (4,), dtype, value.to(dtype), torch.tensor([1]))
    with pytest.raises(LoaderContractError, match="conjugated or negated view"):
        load_checkpoint_weight_patches(model, [sparse], routes=RouteCache(), strategy=BoolMask())
    assert torch.equal(model.p.detach(), before)
    full = torch.zeros(4, dtype=dtype)
    full[1] = value.to(dtype)[0]
    truth = Conjugating()
    truth.load_weights([("p", full)])
    load_checkpoint_weight_patches(model, [CheckpointWeightPatch("p", (4,), dtype, full)])
    assert torch.equal(model.p.detach(), truth.p.detach())


class _Wrapped(torch.Tensor):
    """A wrapper-subclass tensor with a dispatch of its own (as DTensor and torchao's are)."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )
        wrapper.held = inner
        return wrapper

    def __init__(self, inner: torch.Tensor) -> None:
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        def inner(value: Any) -> Any:
            return value.held if isinstance(value, _Wrapped) else value

        result = func(*tree_map(inner, args), **tree_map(inner, kwargs or {}))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return _Wrapped(result)
        return result


class _WithAWrappedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(4.0), requires_grad=False)
        self.d = nn.Parameter(_Wrapped(torch.zeros(3)), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            getattr(self, name).copy_(tensor)
        return {name for name, _ in weights}


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("routes", [False, True])
def test_a_wrapper_subclass_parameter_elsewhere_breaks_no_load_of_other_names(
    atomic: bool, routes: bool
) -> None:
    """A model holding a parameter of a tensor subclass with a dispatch of its own loads the
    other names (dense truth); a sparse patch into the wrapped one is refused by name with a
    `PatchError` saying why, nothing written."""
    model = _WithAWrappedParameter()
    cache = RouteCache() if routes else None
    sparse_w = CheckpointWeightPatch(
        "w", (4,), torch.float32, torch.tensor([9.0]), torch.tensor([2])
    )
    dense_w = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    for _ in range(2):  # the second sparse patch replays, where routes are on
        load_checkpoint_weight_patches(model, [sparse_w], atomic=atomic, routes=cache)
    assert model.w.tolist() == [0.0, 1.0, 9.0, 3.0]
    load_checkpoint_weight_patches(model, [dense_w], atomic=atomic, routes=cache)
    assert model.w.tolist() == [1.0, 2.0, 3.0, 4.0]
    into_wrapped = CheckpointWeightPatch(
        "d", (3,), torch.float32, torch.tensor([5.0]), torch.tensor([1])
    )
    with pytest.raises(LoaderContractError, match=r"'d'.*subclass with a dispatch of its own"):
        load_checkpoint_weight_patches(model, [into_wrapped], atomic=atomic, routes=cache)
    assert cast(_Wrapped, model.d).held.tolist() == [0.0, 0.0, 0.0]
    assert model.w.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("atomic", [False, True])
def test_a_patch_too_large_to_stage_is_refused_by_name_with_nothing_of_its_call_written(
    atomic: bool,
) -> None:
    """A declared shape whose staged tensor no allocator gives (here 2**40 x 2**20 float32)
    raises `InvalidPatchError` naming the patch, not the allocator's raw error; the earlier
    patch of an atomic call is undone."""
    model = packed_tp_model()
    loaded(model)
    before = state(model)
    first = sparse("tr.proj.weight", model, [1], [4.0])
    huge = CheckpointWeightPatch(
        "qkv.q_proj.weight", (2**40, 2**20), torch.float32, torch.tensor([1.0]), torch.tensor([2])
    )
    with pytest.raises(InvalidPatchError, match=r"'qkv.q_proj.weight'.*cannot be staged"):
        load_checkpoint_weight_patches(model, [first, huge], atomic=atomic, chunking=PerTensor())
    if atomic:
        assert_same_state(state(model), before)
