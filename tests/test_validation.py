"""Every invalid input: the exception class vLLM raised, a message naming the patch, no write."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from patchctx import (
    BoolMask,
    ByteBudget,
    CheckpointWeightPatch,
    InvalidPatchError,
    NaNMask,
    PatchError,
    RouteCache,
    _patch,
    load_checkpoint_weight_patches,
    validate_patches,
)
from tests.support.models import assert_same_state, packed_tp_model, random_checkpoint, state

NAME = "tr.proj.weight"  # shape (16, 8), float32
SHAPE = (16, 8)


def good(**changes: Any) -> CheckpointWeightPatch:
    patch = CheckpointWeightPatch(
        NAME, SHAPE, torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 9])
    )
    return patch._replace(**changes)


INVALID = [
    # (id, patch, exception class, message fragment)
    ("empty-name", good(name=""), ValueError, "name must be non-empty"),
    ("name-not-str", good(name=7), TypeError, "name must be a str"),
    ("dtype-not-dtype", good(dtype="float32"), TypeError, "dtype must be a torch.dtype"),
    ("negative-shape", good(shape=(-1, 8)), ValueError, "negative dimension"),
    ("shape-not-ints", good(shape=("a", 8)), TypeError, "shape must be a sequence of ints"),
    (
        "shape-float-tensor",
        good(shape=(torch.tensor(16.5), 8)),
        TypeError,
        "shape must be a sequence of ints",
    ),
    ("shape-float", good(shape=(16.0, 8)), TypeError, "shape must be a sequence of ints"),
    ("values-2d", good(values=torch.ones(2, 1)), ValueError, "values must be a 1-D tensor"),
    ("values-not-tensor", good(values=[1.0, 2.0]), TypeError, "values must be a torch.Tensor"),
    ("dense-count", good(indices=None), ValueError, "dense patch has 2 values for a 128-element"),
    (
        "indices-2d",
        good(indices=torch.tensor([[3, 9]])),
        ValueError,
        "indices must be a 1-D tensor",
    ),
    ("indices-float", good(indices=torch.tensor([3.0, 9.0])), TypeError, "int32 or int64"),
    (
        "indices-int16",
        good(indices=torch.tensor([3, 9], dtype=torch.int16)),
        TypeError,
        "int32 or int64",
    ),
    (
        "count-mismatch",
        good(indices=torch.tensor([3, 9, 10])),
        ValueError,
        "3 indices for 2 values",
    ),
    ("nan-value", good(values=torch.tensor([1.0, float("nan")])), ValueError, "values contain NaN"),
    (
        "out-of-range-high",
        good(indices=torch.tensor([3, 128])),
        ValueError,
        "out of range [0, 128)",
    ),
    ("out-of-range-negative", good(indices=torch.tensor([-1, 3])), ValueError, "min -1"),
    (
        "duplicates-sorted",
        good(indices=torch.tensor([3, 3])),
        ValueError,
        "duplicate indices within the patch (3)",
    ),
    (
        "duplicates-unsorted",
        good(values=torch.ones(3), indices=torch.tensor([9, 3, 9])),
        ValueError,
        "duplicate indices",
    ),
    ("bool-dtype-sparse", good(dtype=torch.bool), TypeError, "sparse patch cannot be staged"),
    (
        "values-meta",
        good(values=torch.empty(2, device="meta")),
        ValueError,
        "values are a meta tensor",
    ),
    (
        "indices-meta",
        good(indices=torch.empty(2, dtype=torch.long, device="meta")),
        ValueError,
        "indices are a meta tensor",
    ),
    (
        "dense-values-meta",
        good(values=torch.empty(128, device="meta"), indices=None),
        ValueError,
        "values are a meta tensor",
    ),
    (
        "values-sparse-layout",
        good(values=torch.tensor([1.0, 2.0]).to_sparse()),
        TypeError,
        "values must be a strided tensor, got torch.sparse_coo",
    ),
    (
        "indices-sparse-layout",
        good(indices=torch.tensor([3, 9]).to_sparse()),
        TypeError,
        "indices must be a strided tensor, got torch.sparse_coo",
    ),
    (
        "dtype-quantized",
        good(dtype=torch.qint8, indices=None, shape=(2,)),
        TypeError,
        "values of dtype torch.float32 cannot be cast to torch.qint8",
    ),
]


@pytest.fixture
def model() -> Any:
    model = packed_tp_model()
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    return model


@pytest.mark.parametrize(
    ("bad", "error", "fragment"), [pytest.param(*case[1:], id=case[0]) for case in INVALID]
)
def test_invalid_patch_raises_before_any_write(
    model: Any, bad: CheckpointWeightPatch, error: type[Exception], fragment: str
) -> None:
    before = state(model)
    fine = CheckpointWeightPatch(
        "qkv.q_proj.weight", (16, 16), torch.float32, torch.tensor([5.0]), torch.tensor([0])
    )
    calls_before = len(model.load_calls)
    with pytest.raises(error) as info:
        load_checkpoint_weight_patches(model, [fine, bad])  # the valid patch comes first
    assert isinstance(info.value, InvalidPatchError)
    assert isinstance(info.value, PatchError)
    message = str(info.value)
    assert fragment in message
    assert f"patches[1] {str(bad.name)!r}" in message
    assert_same_state(state(model), before)
    assert len(model.load_calls) == calls_before, "no loader call may happen"


def test_every_problem_is_reported_in_one_message(model: Any) -> None:
    patches = [
        good(name=""),
        good(),
        good(indices=torch.tensor([3, 500])),
        good(values=torch.tensor([float("nan"), 1.0]), indices=torch.tensor([5, 5])),
        "not a patch",
    ]
    with pytest.raises(InvalidPatchError) as info:
        load_checkpoint_weight_patches(model, patches)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("5 problems; nothing was written:")
    for fragment in (
        "patches[0] ''",
        "patches[2]",
        "NaN",
        "duplicate",
        "patches[4]",
        "is not a patch",
    ):
        assert fragment in message
    assert "patches[1]" not in message
    assert [p.index for p in info.value.problems] == [0, 2, 3, 3, 4]
    assert isinstance(info.value, TypeError)  # "not a patch" is a type problem


def test_duplicates_allowed_when_not_validated(model: Any) -> None:
    patch = good(values=torch.tensor([1.0, 1.0]), indices=torch.tensor([4, 4]))
    load_checkpoint_weight_patches(model, [patch], validate_unique_indices=False)
    with pytest.raises(InvalidPatchError):
        load_checkpoint_weight_patches(model, [patch])


def test_two_patches_may_touch_the_same_positions(model: Any) -> None:
    load_checkpoint_weight_patches(model, [good(), good(values=torch.tensor([7.0, 8.0]))])
    assert model.layer("tr").weight.t().reshape(-1)[9] == 8.0


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"max_chunk_bytes": 0}, ValueError, "max_chunk_bytes must be positive"),
        ({"max_chunk_bytes": -5}, ValueError, "max_chunk_bytes must be positive"),
        ({"max_chunk_bytes": 1.5}, TypeError, "max_chunk_bytes takes an int"),
        ({"max_chunk_bytes": 10, "chunking": ByteBudget(10)}, ValueError, "not both"),
        ({"chunking": ByteBudget}, TypeError, "ChunkingPolicy instance"),
        ({"ordering": "coalesce"}, TypeError, "OrderingPolicy instance"),
        ({"strategy": NaNMask}, TypeError, r"write NaNMask() instead"),
        ({"aliases": {"a": 1}}, TypeError, "aliases="),
    ],
)
def test_invalid_arguments(
    model: Any, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    before = state(model)
    with pytest.raises(error) as info:
        load_checkpoint_weight_patches(model, [good()], **kwargs)
    assert fragment in str(info.value)
    assert_same_state(state(model), before)


def test_byte_budget_must_be_positive() -> None:
    with pytest.raises(InvalidPatchError, match="must be positive"):
        ByteBudget(0)
    with pytest.raises(InvalidPatchError, match="takes an int"):
        ByteBudget(True)


def test_model_without_load_weights() -> None:
    with pytest.raises(TypeError, match="load_weights"):
        load_checkpoint_weight_patches(torch.nn.Linear(2, 2), [good()])  # type: ignore[arg-type]


def test_strategy_decides_what_is_reserved(model: Any) -> None:
    nan_patch = good(values=torch.tensor([float("nan"), 1.0]))
    with pytest.raises(InvalidPatchError, match="NaN"):
        validate_patches([nan_patch], strategy=NaNMask())
    assert validate_patches([nan_patch], strategy=BoolMask()) == [nan_patch]
    int_patch = CheckpointWeightPatch(
        "q", (4,), torch.int8, torch.tensor([-128]), torch.tensor([0])
    )
    with pytest.raises(InvalidPatchError, match="-128"):
        validate_patches([int_patch])
    with pytest.raises(TypeError, match="floating dtype"):  # vLLM: TypeError for int sparse
        validate_patches([int_patch], strategy=NaNMask())


@pytest.mark.parametrize("sorted_indices", [True, False])
@pytest.mark.parametrize("other", [torch.float32, torch.float64])
def test_a_reserved_value_is_found_whatever_the_other_patches_values_dtype(
    sorted_indices: bool, other: torch.dtype
) -> None:
    """``2**32 + 128`` is -128 in int8, the sentinel. The exact checks (unsorted indices) look
    at a group's values together: each patch's are cast to the checkpoint dtype first, as
    staging casts them, not promoted with another patch's floats (which rounds them to 2**32)."""
    reserved = CheckpointWeightPatch(
        "a",
        (8,),
        torch.int8,
        torch.tensor([2**32 + 128, 7]),
        torch.tensor([1, 3] if sorted_indices else [3, 1]),
    )
    assert reserved.values.to(torch.int8)[0] == -128
    other_patch = CheckpointWeightPatch(
        "b", (8,), torch.int8, torch.tensor([1.0, 2.0], dtype=other), torch.tensor([0, 2])
    )
    for patches in ([reserved], [reserved, other_patch], [other_patch, reserved]):
        with pytest.raises(InvalidPatchError, match="values contain -128") as info:
            validate_patches(patches)
        assert [problem.name for problem in info.value.problems] == ["a"]


@pytest.mark.parametrize(
    "shape",
    [
        (np.int64(16), np.int32(8)),
        (torch.tensor(16), torch.tensor(8, dtype=torch.int32)),
        torch.Size([16, 8]),
        [16, 8],
    ],
    ids=["numpy-ints", "0-d-int-tensors", "torch-size", "list"],
)
def test_a_shape_of_any_integers_is_normalised_to_a_tuple_of_ints(model: Any, shape: Any) -> None:
    """Dimensions that are integers of another type (numpy's, 0-d integer tensors: what
    ``torch.full`` takes in vLLM's staging) are valid; validation returns plain ints."""
    patch = good(shape=shape)
    [checked] = validate_patches([patch])
    assert checked.shape == SHAPE
    assert type(checked.shape) is tuple and all(type(d) is int for d in checked.shape)
    reference = copy.deepcopy(model)
    load_checkpoint_weight_patches(model, [patch])
    load_checkpoint_weight_patches(reference, [good()])
    assert_same_state(state(model), state(reference))


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every host read validation makes (common case and exact checks)."""
    reads: list[int] = []
    original = _patch._host_read
    original_flags = _patch._read_flags

    def counting(flags: torch.Tensor) -> list[bool]:
        reads.append(flags.numel())
        return original(flags)

    def counting_flags(flags: list[torch.Tensor | int], device: torch.device) -> list[int]:
        reads.append(len(flags))
        return original_flags(flags, device)

    monkeypatch.setattr(_patch, "_host_read", counting)
    monkeypatch.setattr(_patch, "_read_flags", counting_flags)
    return reads


@pytest.mark.host_only
def test_sorted_indices_need_one_host_read_for_the_whole_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = count_host_reads(monkeypatch)
    patches = [good(indices=torch.tensor([i, i + 5], dtype=torch.int32)) for i in range(10)]
    sorts: list[int] = []
    original_sort = torch.Tensor.sort

    def counting_sort(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sorts.append(1)
        return original_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    validate_patches(patches)
    # One read for all ten: on CPU, whether every patch of the concatenation is increasing
    # and in range (one numpy pass), and the one dtype's reserved values.
    assert reads == [2]
    assert sorts == []  # sorted input is validated in O(nnz), without a sort


@pytest.mark.host_only
def test_unsorted_indices_add_one_read_for_the_duplicate_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = count_host_reads(monkeypatch)
    patches = [good(), good(indices=torch.tensor([9, 3])), good(indices=torch.tensor([7, 1]))]
    validate_patches(patches)
    # The common case (on CPU with few patches, decided on the host patch by patch: no flags
    # to read) finds one not increasing; the exact checks then read 2 flags x 3 patches + 1
    # per dtype, and sort the 2 unsorted ones for duplicates.
    assert reads == [7, 2]
    reads.clear()
    validate_patches(patches, validate_unique_indices=False)
    assert reads == [7]


def test_unsorted_out_of_range_is_caught_even_when_the_ends_are_in_range() -> None:
    # The ends (3 and 5) are in range; the middle is not: the second phase must see it.
    bad = good(values=torch.ones(3), indices=torch.tensor([3, 500, 5]))
    with pytest.raises(InvalidPatchError, match=r"out of range \[0, 128\).*max 500"):
        validate_patches([bad])
    # Wrapping int32 differences must not make an out-of-range sequence look increasing.
    wraps = torch.tensor([0, 2**31 - 1, -5, 7], dtype=torch.int32)
    with pytest.raises(InvalidPatchError, match="min -5, max 2147483647"):
        validate_patches([good(values=torch.ones(4), indices=wraps)])
    with pytest.raises(InvalidPatchError, match="min -7"):
        validate_patches(
            [good(values=torch.ones(3), indices=torch.tensor([3, -7, 5]))],
            validate_unique_indices=False,
        )


@pytest.mark.parametrize("numel", [2**31, 2**32 - 1, 2**32 + 5, 2**40])
@pytest.mark.parametrize("count", [3, 6000])
def test_int32_indices_into_a_tensor_beyond_int32_are_judged_by_the_exact_checks(
    numel: int, count: int
) -> None:
    """Unsorted or repeated int32 indices into a tensor of 2**31 elements or more: the exact
    checks compare them with a bound int32 cannot hold. Valid ones pass, a repeat is reported
    as a repeat, not as out of range (validation only: nothing of that size is allocated)."""
    unsorted = torch.arange(count, 0, -1, dtype=torch.int32)
    [checked] = validate_patches(
        [CheckpointWeightPatch("w", (numel,), torch.float32, torch.ones(count), unsorted)]
    )
    assert checked.indices is unsorted
    repeated = unsorted.clone()
    repeated[1] = repeated[0]
    with pytest.raises(InvalidPatchError, match="duplicate indices") as info:
        validate_patches(
            [CheckpointWeightPatch("w", (numel,), torch.float32, torch.ones(count), repeated)]
        )
    assert "out of range" not in str(info.value)
    negative = unsorted.clone()
    negative[1] = -3
    with pytest.raises(InvalidPatchError, match=r"out of range.*min -3"):
        validate_patches(
            [CheckpointWeightPatch("w", (numel,), torch.float32, torch.ones(count), negative)]
        )


def test_dense_only_calls_do_no_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_host_reads(monkeypatch)
    validate_patches([good(values=torch.zeros(128), indices=None)])
    assert reads == []


class Wrapper(torch.Tensor):
    """A tensor subclass with a dispatch of its own (as DTensor and FakeTensor have): its data
    lies in `held`, and every operation runs on that."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, held: torch.Tensor) -> Wrapper:
        made: Wrapper = torch.Tensor._make_wrapper_subclass(
            cls, held.shape, dtype=held.dtype, device=held.device, strides=held.stride()
        )
        made.held = held
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        def unwrap(value: Any) -> Any:
            return value.held if isinstance(value, Wrapper) else value

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class Plain(torch.Tensor):
    """A Python subclass without a dispatch of its own: its data is its own."""


@pytest.mark.parametrize("count", [1, 3, 9])
@pytest.mark.parametrize("field", ["values", "indices", "dense values"])
def test_tensors_with_a_dispatch_of_their_own_are_refused_by_name_before_any_write(
    count: int, field: str
) -> None:
    """Their data is not where numpy and torch's writes read it: refused, clearly, for every
    number of patches (a few CPU patches reached numpy's "not supported for tensor
    subclasses" before), and nothing is written."""
    model = packed_tp_model()
    specs = model.checkpoint_specs()
    checkpoint = random_checkpoint(specs)
    model.load_weights(checkpoint.items())
    before = state(model)
    patches = []
    for name in list(specs)[:count]:
        spec = specs[name]
        numel = checkpoint[name].numel()
        if field == "dense values":
            values = torch.zeros(numel, dtype=spec.dtype)
            patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, Wrapper(values)))
            continue
        indices = torch.arange(0, numel, 3)
        values = torch.ones(indices.shape[0], dtype=spec.dtype)
        if field == "values":
            values = Wrapper(values)
        else:
            indices = Wrapper(indices)
        patches.append(CheckpointWeightPatch(name, spec.shape, spec.dtype, values, indices))
    kind = "values" if "values" in field else "indices"
    with pytest.raises(
        InvalidPatchError, match=f"{kind} are of class Wrapper, a tensor subclass"
    ) as info:
        load_checkpoint_weight_patches(model, patches)
    assert "pass a plain tensor (a DTensor's .full_tensor()" in str(info.value)
    assert isinstance(info.value, TypeError)  # a type problem, as vLLM reports those
    assert_same_state(state(model), before)


@pytest.mark.parametrize("count", [1, 3, 9])
def test_parameters_and_plain_subclasses_load_as_plain_tensors(count: int) -> None:
    model = packed_tp_model()
    specs = model.checkpoint_specs()
    checkpoint = random_checkpoint(specs)
    model.load_weights(checkpoint.items())
    patches = []
    for k, name in enumerate(list(specs)[:count]):
        spec = specs[name]
        indices = torch.arange(k % 3, checkpoint[name].numel(), 4)
        values = torch.full((indices.shape[0],), 0.25 * (k + 1), dtype=spec.dtype)
        checkpoint[name].view(-1)[indices] = values
        wrapped = (
            torch.nn.Parameter(values, requires_grad=False) if k % 2 else values.as_subclass(Plain)
        )
        patches.append(
            CheckpointWeightPatch(name, spec.shape, spec.dtype, wrapped, indices.as_subclass(Plain))
        )
    routes = RouteCache()
    load_checkpoint_weight_patches(model, patches, routes=routes)  # records the routes
    load_checkpoint_weight_patches(model, patches, routes=routes)  # replays them
    assert routes.stats.replayed == count
    reference = packed_tp_model()
    reference.load_weights(checkpoint.items())
    assert_same_state(state(model), state(reference))


def test_an_async_collective_tensor_is_refused_by_name_and_loads_once_waited() -> None:
    """torch's functional collectives return an AsyncCollectiveTensor (a wrapper whose data is
    ready only once waited on): refused with the remedy; its ``.wait()`` loads as the truth."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    model = packed_tp_model()
    specs = model.checkpoint_specs()
    checkpoint = random_checkpoint(specs)
    model.load_weights(checkpoint.items())
    before = state(model)
    name = next(iter(specs))
    spec = specs[name]
    indices = torch.arange(0, checkpoint[name].numel(), 7)
    values = torch.full((indices.shape[0],), 0.5, dtype=spec.dtype)
    received = AsyncCollectiveTensor(values.clone())
    patch = CheckpointWeightPatch(name, spec.shape, spec.dtype, received, indices)
    with pytest.raises(InvalidPatchError, match=r"AsyncCollectiveTensor's \.wait\(\)"):
        load_checkpoint_weight_patches(model, [patch])
    assert_same_state(state(model), before)
    load_checkpoint_weight_patches(model, [patch._replace(values=received.wait())])
    checkpoint[name].view(-1)[indices] = values
    reference = packed_tp_model()
    reference.load_weights(checkpoint.items())
    assert_same_state(state(model), state(reference))


def test_the_suite_runs_the_way_it_was_asked(request: pytest.FixtureRequest) -> None:
    """``--accelerators-way`` (the test command's second pass) sends CPU tensors the GPU's way;
    without it they take the host's. A pass that silently ran the host's ways twice fails."""
    from patchctx import _cpu_passes

    assert _cpu_passes.HOST is not request.config.getoption("--accelerators-way")


# -- patch tensors changed after validation (a family) -------------------------------------
#
# Who changes them: an ordering policy, a chunking policy, or the loader (holding the caller's
# tensors), before the patch is written; how: ``t.data = x`` and ``set_`` (neither bumps the
# version counter of what validation read), in place through torch, through a numpy alias
# (no version counter at all), or the storage resized. Whatever the path (the loader, a route
# replay, atomic or not), what is written is what validation checked. A dense patch's values
# are checked for their structure only, and read when written: their rebinding does not
# reach what is written, and their storage shrunk is refused before it is read.


def _mutate(tensor: torch.Tensor, how: str) -> None:
    other = torch.full((1,), 3, dtype=tensor.dtype)  # a shorter tensor: an attacker's
    if how == "data=":
        tensor.data = other
    elif how == "set_":
        tensor.set_(other.untyped_storage(), 0, other.shape, other.stride())
    elif how == "in-place":
        tensor.fill_(5)
    elif how == "numpy-alias":
        tensor.numpy()[...] = 7
    elif how == "storage-resized":
        tensor.untyped_storage().resize_(0)
    else:
        raise AssertionError(how)


MUTATIONS = ["data=", "set_", "in-place", "numpy-alias", "storage-resized"]
WHO = ["ordering", "chunking", "loader"]


def _changed_patches() -> list[CheckpointWeightPatch]:
    return [
        CheckpointWeightPatch(
            "qkv.q_proj.weight",
            (16, 16),
            torch.float32,
            torch.tensor([5.0, -1.0, 2.5]),
            torch.tensor([0, 17, 200]),
        ),
        CheckpointWeightPatch(
            NAME, SHAPE, torch.float32, torch.tensor([4.0, 8.0]), torch.tensor([1, 127])
        ),
        CheckpointWeightPatch(
            "mlp.gate_proj.weight", (32, 16), torch.float32, torch.arange(512.0) / 7, None
        ),
        CheckpointWeightPatch(
            "mlp.up_proj.weight", (32, 16), torch.float32, -torch.arange(512.0) / 3, None
        ),
    ]


@pytest.mark.parametrize("how", MUTATIONS)
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("routes", [False, True])
@pytest.mark.parametrize("atomic", [False, True])
def test_what_validation_checked_is_written_whatever_changes_the_patch_tensors_after(
    model: Any, how: str, who: str, routes: bool, atomic: bool
) -> None:
    reference = copy.deepcopy(model)
    cache = RouteCache() if routes else None
    if cache is not None:  # the sparse names' routes known: the second call replays them
        load_checkpoint_weight_patches(model, _changed_patches()[:2], routes=cache)
        load_checkpoint_weight_patches(reference, _changed_patches()[:2])
    patches = _changed_patches()
    if how in ("data=", "set_"):
        targets = [t for p in patches for t in (p.values, p.indices) if t is not None]
    else:  # a dense patch's contents are read when written; its storage resized: below
        targets = [t for p in patches[:2] for t in (p.values, p.indices) if t is not None]
    load_checkpoint_weight_patches(reference, _changed_patches())
    done: list[int] = []

    def mutate() -> None:
        if not done:
            done.append(1)
            for tensor in targets:
                assert tensor is not None
                _mutate(tensor, how)

    class Mutating:
        def order(self, checked: Any) -> Any:
            mutate()
            return list(checked)

    class Chunking:
        def split_before(self, chunk: Any) -> bool:
            mutate()
            return True

    loader = model.load_weights

    def load_weights(weights: Any) -> Any:
        mutate()
        return loader(weights)

    kwargs: dict[str, Any] = {"routes": cache, "atomic": atomic}
    if who == "ordering":
        kwargs["ordering"] = Mutating()
    elif who == "chunking":
        kwargs["chunking"] = Chunking()
    else:
        model.load_weights = load_weights
    load_checkpoint_weight_patches(model, patches, **kwargs)
    assert done, "the mutation ran"
    assert_same_state(state(model), state(reference))


@pytest.mark.parametrize("atomic", [False, True])
def test_a_dense_patch_whose_storage_shrank_after_validation_is_refused_before_it_is_read(
    model: Any, atomic: bool
) -> None:
    before = state(model)
    dense = _changed_patches()[2]

    class Shrinking:
        def order(self, checked: Any) -> Any:
            dense.values.untyped_storage().resize_(0)
            return list(checked)

    with pytest.raises(InvalidPatchError, match=r"patches\[0\] 'mlp.gate_proj.weight'.*resized"):
        load_checkpoint_weight_patches(model, [dense], ordering=Shrinking(), atomic=atomic)
    assert_same_state(state(model), before)


def test_checked_patches_show_the_callers_tensors_and_never_validations_copies() -> None:
    patch = good()
    (checked,) = _patch.check_patches([patch], strategy=NaNMask())
    assert checked.patch.values is patch.values and checked.patch.indices is patch.indices
    assert checked._patch.values.untyped_storage().data_ptr() != (
        patch.values.untyped_storage().data_ptr()
    )
