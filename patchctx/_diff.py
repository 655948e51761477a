"""The trainer side: two state dicts in, the smallest correct set of patches out.

`diff_state_dicts` compares the weights a trainer last sent with the weights it has now, tensor by
tensor, bitwise in the dtype the receiver holds, and emits one dense or sparse
`CheckpointWeightPatch` per changed tensor, sparse or dense by the smaller wire size or, given an
`UpdateCost`, by the shorter estimated update. `patch_nbytes` says how many bytes a patch set
puts on the wire, each sparse patch in its smallest encoding (`patchctx._encoding`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeAlias, cast

import torch

from patchctx._arguments import density, instance_of
from patchctx._choose import choose_sparse, diff_tensor, sparse_is_smaller, sparse_nbytes
from patchctx._cost import UpdateCost
from patchctx._encoding import index_dtype, wire_sizes
from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, PatchProblem
from patchctx._grad import without_grad
from patchctx._patch import CheckpointWeightPatch, PatchLike, validate_patches
from patchctx._shards import TensorShard, global_indices, local_box
from patchctx._strategies import Auto, CopyStrategy, as_strategy

__all__ = [
    "choose_sparse",
    "diff_state_dicts",
    "index_dtype",
    "iter_diff_state_dicts",
    "patch_nbytes",
    "sparse_is_smaller",
    "sparse_nbytes",
]

_DtypeArg: TypeAlias = "torch.dtype | Mapping[str, torch.dtype] | None"

_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


# ------------------------------------------------------------------------------- validation


def _dtype_problem(value: object, where: str) -> str | None:
    if not isinstance(value, torch.dtype):
        return f"{where} must be a torch.dtype, got {value!r}"
    if value in _QUANTIZED:
        return f"{where} is the quantized dtype {value}, which has no bitwise representation"
    return None


def _tensor_problem(side: str, name: str, value: object) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{name!r}: {side}[{name!r}] must be a torch.Tensor, got {type(value).__name__}"
    if value.layout != torch.strided:
        return f"{name!r}: {side}[{name!r}] is a {value.layout} tensor; pass dense (strided) ones"
    if value.dtype in _QUANTIZED:
        return f"{name!r}: {side}[{name!r}] has the quantized dtype {value.dtype}, not supported"
    if value.is_meta:
        return f"{name!r}: {side}[{name!r}] is a meta tensor: it holds no values to compare"
    return None


def _problem(reason: str, name: str = "", *, type_error: bool = False) -> PatchProblem:
    return PatchProblem(None, name, reason, is_type_error=type_error)


def _check_dtype(dtype: object, problems: list[PatchProblem]) -> bool:
    """Check `dtype=`; whether it is usable."""
    found: list[PatchProblem] = []
    if isinstance(dtype, Mapping):
        for key, value in dtype.items():
            reason = _dtype_problem(value, f"dtype[{key!r}]")
            if reason is not None:
                found.append(_problem(reason, str(key), type_error=True))
    elif dtype is not None:
        reason = _dtype_problem(dtype, "dtype")
        if reason is not None:
            found.append(_problem(reason, type_error=True))
        elif isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            found.append(
                _problem(
                    f"a single dtype= applies to the floating-point tensors and must be a "
                    f"floating dtype, got {dtype}; pass a mapping of names to dtypes for "
                    "integer, bool or complex receivers"
                )
            )
    problems.extend(found)
    return not found


def _check_names(names: object, problems: list[PatchProblem]) -> list[str] | None:
    """`names=` as a list (an iterator is read once); `None` when absent or unusable."""
    if names is None:
        return None
    listed = (
        list(names) if isinstance(names, Iterable) and not isinstance(names, (str, bytes)) else None
    )
    if listed is None or not all(isinstance(n, str) for n in listed):
        problems.append(
            _problem(f"names must be an iterable of str, got {names!r}", type_error=True)
        )
        return None
    return listed


def _check_dense_above(dense_above: object, problems: list[PatchProblem]) -> float | None:
    try:
        return density(dense_above, "dense_above")
    except InvalidPatchError as error:
        problems.extend(error.problems)
        return None


def _check_strategy(strategy: object, problems: list[PatchProblem]) -> CopyStrategy:
    try:
        return as_strategy(strategy, Auto(), "diff_state_dicts")
    except InvalidPatchError as error:
        problems.extend(error.problems)
        return Auto()


def _check_cost(cost: object, problems: list[PatchProblem]) -> UpdateCost | None:
    if cost is None:
        return None
    try:
        instance_of(cost, UpdateCost, "diff_state_dicts(cost=...)", "cost=UpdateCost()")
    except InvalidPatchError as error:
        problems.extend(error.problems)
        return None
    return cast(UpdateCost, cost)


def _chosen_names(
    old: Mapping[str, object],
    new: Mapping[str, object],
    names: list[str] | None,
    problems: list[PatchProblem],
) -> list[str]:
    if names is None:
        for name in old:
            if name not in new:
                problems.append(
                    _problem(
                        f"{name!r} is in old but not in new; pass names= to diff a subset",
                        str(name),
                    )
                )
        for name in new:
            if name not in old:
                problems.append(
                    _problem(
                        f"{name!r} is in new but not in old (the receiver does not hold it); "
                        "send it as a dense patch, or pass names= to leave it out",
                        str(name),
                    )
                )
        return [name for name in new if name in old]
    chosen = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            problems.append(_problem(f"{name!r} appears more than once in names", name))
            continue
        seen.add(name)
        missing = [side for side, d in (("old", old), ("new", new)) if name not in d]
        if missing:
            problems.append(
                _problem(f"{name!r} (from names) is not in {' or '.join(missing)}", name)
            )
        else:
            chosen.append(name)
    return chosen


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """Where `tensor`'s elements live (device, storage address); `None` when it holds none."""
    span = _span(tensor)
    return None if span is None or tensor.numel() == 0 else (tensor.device, span[0])


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The memory range `tensor`'s storage covers, or `None` when it holds none."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # meta and other storage-less tensors
        return None
    start, nbytes = storage.data_ptr(), storage.nbytes()
    return (start, start + nbytes) if start and nbytes else None


def _shared_storage_problems(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], names: list[str]
) -> list[PatchProblem]:
    """`old` tensors that share storage with `new` ones: what was sent is not known.

    The natural first try, ``sent = model.state_dict()`` without a clone, keeps views of the
    live weights: every optimizer step changes `sent` too, and the diff would come out empty.
    """
    owners: dict[tuple[torch.device, int], str] = {}
    for name in names:
        key = _storage(new[name])
        if key is not None:
            owners.setdefault(key, name)
    problems = []
    for name in names:
        key = _storage(old[name])
        other = None if key is None else owners.get(key)
        if other is not None:
            shared = f"new[{other!r}]"
            problems.append(
                _problem(
                    f"{name!r}: old[{name!r}] shares its storage with {shared}, so it changes "
                    "with the weights and cannot say what was sent (the diff would be empty). "
                    "Keep a copy of what you send: "
                    "sent = {k: v.detach().clone() for k, v in model.state_dict().items()}",
                    name,
                )
            )
    return problems


def receiver_dtype(dtype: _DtypeArg, name: str, tensor: torch.Tensor) -> torch.dtype:
    """The dtype the receiver holds `name` in, by ``diff_state_dicts``' `dtype=` rule.

    A mapping names the dtype per tensor (absent names keep their own); one dtype applies to
    floating tensors only; `None` keeps every tensor's own.
    """
    if isinstance(dtype, Mapping):
        return dtype.get(name, tensor.dtype)
    if dtype is not None and tensor.is_floating_point():
        return dtype
    return tensor.dtype


def _receiver_dtype(
    name: str,
    old: torch.Tensor,
    new: torch.Tensor,
    dtype: _DtypeArg,
) -> torch.dtype | str:
    """The dtype to compare `name` in, or the reason it is unknown."""
    if isinstance(dtype, Mapping):
        chosen = dtype.get(name)
        if chosen is not None:
            return chosen
    elif dtype is not None and old.is_floating_point() and new.is_floating_point():
        return dtype
    if old.dtype != new.dtype:
        return (
            f"{name!r}: old is {old.dtype} and new is {new.dtype}; pass dtype= (the dtype the "
            "receiver holds) to compare them"
        )
    return new.dtype


@dataclass(frozen=True, slots=True)
class _Plan:
    """What `diff_state_dicts` will do, once every argument is known to be valid."""

    tensors: list[tuple[str, torch.dtype]]  # (name, receiver dtype), in output order
    strategy: CopyStrategy
    dense_above: float | None
    cost: UpdateCost | None
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)  # `_usable_buffers`


def _plan(
    old: object,
    new: object,
    dtype: object,
    names: object,
    dense_above: object,
    strategy: object,
    cost: object = None,
) -> _Plan:
    """Every check that needs no tensor data, with all problems in one report."""
    problems: list[PatchProblem] = []
    for side, value in (("old", old), ("new", new)):
        if not isinstance(value, Mapping):
            problems.append(
                _problem(
                    f"{side} must be a mapping of names to tensors (a state dict), got "
                    f"{type(value).__name__}",
                    type_error=True,
                )
            )
    dtype_ok = _check_dtype(dtype, problems)
    listed = _check_names(names, problems)
    dense_above_fraction = _check_dense_above(dense_above, problems)
    chosen_strategy = _check_strategy(strategy, problems)
    chosen_cost = _check_cost(cost, problems)
    tensors: list[tuple[str, torch.dtype]] = []
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        if isinstance(dtype, Mapping):
            problems.extend(
                _problem(f"dtype names {key!r}, which is in neither old nor new", str(key))
                for key in dtype
                if key not in old and key not in new
            )
        usable_names = names is None or listed is not None
        for name in _chosen_names(old, new, listed, problems) if usable_names else []:
            before, after = old[name], new[name]
            found = [
                reason
                for side, value in (("old", before), ("new", after))
                if (reason := _tensor_problem(side, name, value)) is not None
            ]
            if found:
                problems.extend(_problem(reason, name, type_error=True) for reason in found)
                continue
            if before.shape != after.shape:
                problems.append(
                    _problem(
                        f"{name!r}: shape differs between old {tuple(before.shape)} and new "
                        f"{tuple(after.shape)}; a patch cannot change a tensor's shape",
                        name,
                    )
                )
                continue
            if dtype_ok:
                receiver = _receiver_dtype(name, before, after, cast(_DtypeArg, dtype))
                if isinstance(receiver, str):
                    problems.append(_problem(receiver, name))
                else:
                    tensors.append((name, receiver))
        problems.extend(_shared_storage_problems(old, new, [name for name, _ in tensors]))
    if problems:
        raise InvalidPatchError.from_problems(problems)
    return _Plan(tensors, chosen_strategy, dense_above_fraction, chosen_cost)


def _usable_buffers(
    buffers: object, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The `buffers` a dense copy may go into: whole tensors that overlap nothing else.

    Memory ranges are compared, not only storages: two storages over one numpy array overlap
    too. A buffer whose range meets a tensor of `old` or `new`, or another buffer, is left out.
    """
    if buffers is None:
        return {}
    if not isinstance(buffers, Mapping):
        raise InvalidPatchTypeError(
            f"buffers must be a mapping of names to tensors, got {type(buffers).__name__}"
        )
    if not buffers:
        return {}
    spans: list[tuple[int, int, str | None]] = []  # (start, end, buffer name or None)
    for tensor in (*old.values(), *new.values()):
        span = _span(tensor)
        if span is not None:
            spans.append((*span, None))
    for name, buffer in buffers.items():
        span = _span(buffer) if isinstance(buffer, torch.Tensor) else None
        if span is not None and buffer.is_contiguous() and not buffer.requires_grad:
            spans.append((*span, name))
    spans.sort(key=lambda item: item[0])
    clashing: set[str] = set()
    reach, holder = -1, None  # the furthest end so far, and whose it is
    for start, end, name in spans:
        if start < reach:
            clashing.update(n for n in (name, holder) if n is not None)
        if end > reach:
            reach, holder = end, name
    return {
        name: buffers[name] for _, _, name in spans if name is not None and name not in clashing
    }


# ----------------------------------------------------------------------------------- diffing


def _view_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """Equal for two tensors that view the same elements of one storage the same way."""
    storage = _storage(tensor)
    if storage is None:
        return None
    return (
        *storage,
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
    )


@without_grad
def diff_state_dicts(
    old: Mapping[str, torch.Tensor | TensorShard],
    new: Mapping[str, torch.Tensor | TensorShard],
    *,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
    names: Iterable[str] | None = None,
    dense_above: float | None = None,
    strategy: CopyStrategy | None = None,
    cost: UpdateCost | None = UpdateCost(),  # noqa: B008 (frozen: one shared instance is safe)
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> list[CheckpointWeightPatch]:
    """The smallest patch set that turns a receiver holding `old` into one holding `new`.

    Each tensor is compared **in the receiver's dtype**: both sides are cast to it and an
    element counts as changed when the bits of its two casts differ. So fp32 master-weight
    noise that rounds away in bf16 is not sent, while these are sent deliberately:

    - ``-0.0`` versus ``+0.0`` is a change (the bits differ; the receiver ends up with the
      exact bits of `new`).
    - NaN is compared by its bits too: the same NaN on both sides is unchanged, a NaN whose
      payload or sign differs is a change (casts to a narrower dtype may canonicalise
      payloads first, as the receiver's own cast does; torch's casts do so for some elements
      and not others, so after a cast NaN payloads are not guaranteed).

    `old` must be a copy of what was sent, not the live weights: ``model.state_dict()`` returns
    views of the parameters, which change with every optimizer step, so keep
    ``{k: v.detach().clone() for k, v in model.state_dict().items()}``. A tensor of `old` that
    shares its storage with one of `new` is refused, rather than diffed to nothing. Tied
    tensors (names whose tensors in `new` view the same elements, like ``lm_head.weight`` and
    ``model.embed_tokens.weight`` when the embeddings are tied) are sent once, under the first
    of their names in diff order; a receiver that holds them tied loads them once, and
    `load_checkpoint_weight_patches` takes the other name through ``aliases=``.

    Unchanged tensors produce no patch. A changed tensor of `numel` elements, `nnz` of them
    changed, becomes a dense patch (every value) or a sparse patch (flat row-major indices,
    sorted and unique; int32 when the tensor has fewer than 2**31 elements, int64 otherwise;
    values in the receiver dtype) by this rule, in this order:

    1. Dense when `strategy` (the one the receiver will load with) cannot stage the dtype or
       cannot carry one of the changed values: NaN under `NaNMask` (and `Auto` for floats),
       the sentinel under `IntSentinel` (and `Auto` for integers: the dtype's minimum, or its
       maximum for unsigned dtypes), bool and complex under `Auto`. Nothing is dropped; to
       keep such tensors sparse, pass ``strategy=BoolMask()`` here and to
       `load_checkpoint_weight_patches`.
    2. Dense when `dense_above` is given and ``nnz > dense_above * numel``.
    3. With ``cost=None``: sparse when its wire size is strictly below the dense one's,
       ``sparse_bytes < numel * value bytes``, where ``sparse_bytes`` is
       ``nnz * value bytes`` plus the smallest encoding of the positions (`wire_sizes`:
       ``indices``, ``gaps`` or ``bitmask``). With `cost` (the default): sparse when that
       holds and also
       ``cost.sparse_seconds(nnz, sparse_bytes, bitmask_numel=..., numel=numel,
       element_size=value bytes) < cost.dense_seconds(numel, value bytes)``
       (`UpdateCost`: the whole path, diff, data plane, wire at its link bandwidth, decode
       and apply; ``bitmask_numel`` is ``numel`` when the smallest encoding is the bitmask,
       else 0).
       Otherwise dense.

    So `dense_above` is a cap that holds whatever `cost` says, and the strategy's fallbacks
    hold over both; `patch_nbytes` then counts each sparse patch in its smallest encoding.
    A CPU tensor of at least 2**18 elements is first sampled at 1024 positions drawn
    uniformly at random (seeded by its size): when the sampled density less four standard
    errors already rules sparse out by 2 and 3, it goes dense unscanned, for about 30 µs
    instead of reading both sides. The draw follows no pattern a tensor could align with (a
    column, a row, a block is hit as often as its share), so a tensor the rule would send
    sparse goes dense by it with a chance of about 3 in 100,000, and then only its time is at
    stake: a dense patch carries every value.
    The diff streams each tensor in blocks (1M elements on CPU, 16M on accelerators): both
    sides of a block are cast into reused buffers and compared, so the extra memory beyond
    the returned patches is a few blocks (about 5 bytes per block element), never a tensor
    (on CPU, a sparse result is held twice while its blocks are joined).
    The returned values never alias `new` (the trainer may keep stepping in place). Tensors
    may live on any device; the work happens on `new`'s device (`old` is moved there a block
    at a time). On CPU one pass takes each block's positions while its mask is fresh, and
    stops once the running count rules sparse out; on an accelerator each non-empty tensor
    costs one host synchronisation (reading its number of changed elements per block and
    whether they hold a reserved value) between a counting and a gathering pass.
    Supported dtypes: every non-quantized one (floating incl. bfloat16 and float8, integer,
    bool, complex). A 0-d tensor is a one-element tensor (always dense: a sparse payload is
    never smaller); an empty tensor never changes.

    Args:
        old: The state dict the receiver holds (what was last sent), in checkpoint coordinates.
        new: The current state dict, with the same names and shapes.
        dtype: The receiver's dtype. `None`: each tensor's own (`old` and `new` must then
            agree). A dtype: applies to floating-point tensors; integer, bool and complex ones
            keep their own. A mapping: the dtype per name (names not in it keep their own).
        names: Diff only these names, in this order; other names of `old` and `new` are
            ignored. Default: every name of `new`, in order (and the names must match).
        dense_above: Send a tensor dense when more than this fraction of it changed, in
            (0, 1]; `None` decides by payload size alone.
        strategy: The strategy the receiver loads sparse patches with (default `Auto()`).
        cost: Choose sparse or dense per tensor by estimated update time (`UpdateCost`;
            the default ``UpdateCost()`` holds this library's measurements on a 2-core CPU,
            ``UpdateCost.calibrate()`` measures yours); `None` chooses by wire size alone,
            which sends a tensor sparse up to 15/16 of it changed (bf16, as a bitmask), where
            its replay is slower than a dense copy.
        buffers: Tensors by name that a dense patch's values are written into instead of
            fresh memory: a trainer that diffs at every step and keeps them from one diff to
            the next spares its dense copies the page faults of memory never touched before
            (1 to 10 µs each 4 KiB on the development machine). A buffer is used when it is
            contiguous, of the patch's size and receiver dtype, on `new`'s device, and shares
            no memory with `old`, `new` or another buffer; otherwise the copy is fresh. The
            patch's values are then a view of it: do not write it while the patch is in use.

    Returns:
        One patch per changed tensor, in the order of the names diffed (`names`, or the
        order of `new`).

    Raises:
        InvalidPatchError: Listing every problem before any work: names missing from one side,
            shapes that differ, dtypes that differ with no `dtype=` to settle them, `old`
            tensors that share storage with `new` ones, and bad arguments (an
            `InvalidPatchTypeError` when one is of the wrong type).

    Examples:
        >>> import torch
        >>> from patchctx import diff_state_dicts
        >>> old = {"w": torch.zeros(2, 4), "b": torch.ones(4)}
        >>> new = {"w": torch.zeros(2, 4), "b": torch.tensor([1.0, -0.0, 1.001, 1.0])}
        >>> new["w"][1, 2] = 0.5
        >>> [patch.indices for patch in diff_state_dicts(old, new)]  # tiny: dense is faster
        [None, None]
        >>> for patch in diff_state_dicts(old, new, cost=None):  # by wire bytes alone
        ...     print(patch.name, patch.indices, patch.values)
        w tensor([6], dtype=torch.int32) tensor([0.5000])
        b tensor([1, 2], dtype=torch.int32) tensor([-0.0000, 1.0010])

        In bf16, the receiver's dtype, 1.001 rounds to 1.0 and only the sign of zero changed:

        >>> for patch in diff_state_dicts(old, new, dtype=torch.bfloat16, cost=None):
        ...     print(patch.name, patch.indices, patch.values)
        w tensor([6], dtype=torch.int32) tensor([0.5000], dtype=torch.bfloat16)
        b tensor([1], dtype=torch.int32) tensor([-0.], dtype=torch.bfloat16)

        By estimated time (the default, `UpdateCost`), heavy changes to large tensors go dense,
        their replay being slower than a copy; by size alone (``cost=None``) they stay sparse:

        >>> old = {"big": torch.zeros(2**20)}
        >>> new = {"big": torch.zeros(2**20)}
        >>> new["big"][::1000] = 1.0  # 0.1% changed
        >>> [p.indices is None for p in diff_state_dicts(old, new)]
        [False]
        >>> new["big"][::2] = 1.0  # 50% changed: sparse is smaller, dense is faster
        >>> [p.indices is None for p in diff_state_dicts(old, new)]
        [True]
        >>> [p.indices is None for p in diff_state_dicts(old, new, cost=None)]
        [False]

        A dense patch's values go into memory of your own when `buffers` offers it:

        >>> kept = {"big": torch.empty(2**20)}
        >>> [patch] = diff_state_dicts(old, new, buffers=kept)
        >>> patch.values.data_ptr() == kept["big"].data_ptr()
        True
    """
    return list(
        iter_diff_state_dicts(
            old,
            new,
            dtype=dtype,
            names=names,
            dense_above=dense_above,
            strategy=strategy,
            cost=cost,
            buffers=buffers,
        )
    )


def iter_diff_state_dicts(
    old: Mapping[str, torch.Tensor | TensorShard],
    new: Mapping[str, torch.Tensor | TensorShard],
    *,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
    names: Iterable[str] | None = None,
    dense_above: float | None = None,
    strategy: CopyStrategy | None = None,
    cost: UpdateCost | None = UpdateCost(),  # noqa: B008 (frozen: one shared instance is safe)
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[CheckpointWeightPatch]:
    """`diff_state_dicts`, one patch at a time: each tensor is diffed when the next is asked for.

    A sender can put the first patches on their way while the rest are still being diffed
    (``PatchctxTrainerEngine`` with ``chunk_bytes`` sends each chunk as soon as it is full).
    Every check that needs no tensor data runs here, before this returns, and raises as
    `diff_state_dicts` raises; the patches are those `diff_state_dicts` returns, in its order.
    Sharded values (`TensorShard`, ``DTensor``) are the exception to the one-at-a-time rule:
    their patches are checked together (no position is sent twice), so with any of them the
    first patch comes once every tensor is diffed. `old` and `new` must stay as they are
    until the last patch is out.

    Args:
        old: As for `diff_state_dicts`.
        new: As for `diff_state_dicts`.
        dtype: As for `diff_state_dicts`.
        names: As for `diff_state_dicts`.
        dense_above: As for `diff_state_dicts`.
        strategy: As for `diff_state_dicts`.
        cost: As for `diff_state_dicts`.
        buffers: As for `diff_state_dicts`.

    Returns:
        An iterator over the patches.

    Raises:
        InvalidPatchError: As `diff_state_dicts`, from this call, before any tensor is read.

    Examples:
        >>> import torch
        >>> from patchctx import iter_diff_state_dicts
        >>> old = {"a": torch.zeros(4), "b": torch.zeros(4)}
        >>> new = {"a": torch.tensor([0.0, 2.0, 0.0, 0.0]), "b": torch.zeros(4)}
        >>> patches = iter_diff_state_dicts(old, new, cost=None)
        >>> [(patch.name, patch.indices.tolist()) for patch in patches]
        [('a', [1])]
        >>> iter_diff_state_dicts(old, {"a": torch.zeros(5)})
        Traceback (most recent call last):
        ...
        patchctx._errors.InvalidPatchError: ...
    """
    unsharded_old, unsharded_new, boxes = _unshard(old, new)
    plan = _plan(unsharded_old, unsharded_new, dtype, names, dense_above, strategy, cost)
    local_old = cast(Mapping[str, torch.Tensor], unsharded_old)  # mappings: _plan checked
    local_new = cast(Mapping[str, torch.Tensor], unsharded_new)
    plan = replace(plan, buffers=_usable_buffers(buffers, local_old, local_new))
    return _patches(plan, local_old, local_new, boxes)


def _patches(
    plan: _Plan,
    local_old: Mapping[str, torch.Tensor],
    local_new: Mapping[str, torch.Tensor],
    boxes: dict[str, TensorShard],
) -> Iterator[CheckpointWeightPatch]:
    held: list[CheckpointWeightPatch] = []  # with shards: every patch, until the check
    spread: list[CheckpointWeightPatch] = []  # dense boxes sent as every position
    diffed: set[tuple[object, ...]] = set()
    for name, receiver in plan.tensors:
        after = local_new[name]
        view = _view_key(after)
        # Tied names are one tensor on the receiver only when it holds them in one dtype.
        key = None if view is None else (*view, receiver)
        if key is not None and key in diffed:
            continue  # tied to a name diffed before (lm_head and embed_tokens): sent once
        if key is not None:
            diffed.add(key)
        box = boxes.get(name)
        patch = _diffed(name, local_old[name], after, receiver, plan, box)
        if patch is not None and box is not None:
            patch = _globalized(patch, box)
            if patch.indices is not None and patch.values.numel() == box.local.numel():
                spread.append(patch)
        if patch is None:
            continue
        if boxes:
            held.append(patch)
        else:
            yield patch
    if spread:
        _check_spread(spread, plan.strategy)
    yield from held


@without_grad
def _diffed(
    name: str,
    before: torch.Tensor,
    after: torch.Tensor,
    receiver: torch.dtype,
    plan: _Plan,
    box: TensorShard | None,
) -> CheckpointWeightPatch | None:
    """One tensor's patch (or none), with gradient recording off while it is made."""
    return diff_tensor(
        name,
        before.detach(),
        after.detach(),
        receiver,
        plan.strategy,
        plan.dense_above if box is None else None,
        plan.cost if box is None else None,
        into=plan.buffers.get(name) if box is None else None,
    )


def _unshard(old: object, new: object) -> tuple[object, object, dict[str, TensorShard]]:
    """Sharded values (`DTensor`, `TensorShard`) replaced by their local tensors; their boxes.

    `old` may hold, for a sharded name of `new`, the same kind of shard with the same box or a
    plain tensor of the box's local shape (a rank's copy of what it sent).
    """
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return old, new, {}
    boxes: dict[str, TensorShard] = {}
    problems: list[PatchProblem] = []
    local_old, local_new = dict(old), dict(new)
    for name in new:
        found = local_box(new[name])
        before = local_box(old[name]) if name in old else None
        if found is None:
            if isinstance(before, (TensorShard, str)):
                problems.append(_problem(f"{name!r}: old is sharded and new is not", str(name)))
            continue
        if isinstance(found, str) or isinstance(before, str):
            reason = found if isinstance(found, str) else before
            problems.append(_problem(f"{name!r}: {reason}", str(name)))
            continue
        if name not in old:
            continue  # _plan reports it
        if isinstance(before, TensorShard):
            same = (
                tuple(before.global_shape) == tuple(found.global_shape)
                and tuple(before.offsets) == tuple(found.offsets)
                and before.local.shape == found.local.shape
            )
            if not same:
                problems.append(
                    _problem(
                        f"{name!r}: old and new are different boxes of the tensor (global "
                        f"shape, offsets, local shape): {tuple(before.global_shape)} "
                        f"{tuple(before.offsets)} {tuple(before.local.shape)} versus "
                        f"{tuple(found.global_shape)} {tuple(found.offsets)} "
                        f"{tuple(found.local.shape)}",
                        str(name),
                    )
                )
                continue
            local_old[name] = before.local
        boxes[str(name)] = found
        local_new[name] = found.local
    if problems:
        raise InvalidPatchError.from_problems(problems)
    return local_old, local_new, boxes


def _globalized(patch: CheckpointWeightPatch, box: TensorShard) -> CheckpointWeightPatch:
    """`patch` of a box, in the coordinates of the whole tensor.

    Always sparse, but for a box that is the whole tensor.
    """
    shape = tuple(box.global_shape)
    if tuple(box.offsets) == (0,) * len(shape) and tuple(box.local.shape) == shape:
        return patch._replace(shape=shape)
    if patch.indices is None:
        local = torch.arange(box.local.numel(), device=patch.values.device)
    else:
        local = patch.indices
    return CheckpointWeightPatch(
        patch.name, shape, patch.dtype, patch.values.reshape(-1), global_indices(local, box)
    )


def _check_spread(patches: list[CheckpointWeightPatch], strategy: CopyStrategy) -> None:
    """A box whose diff came out dense goes sparse: the receiver's strategy must carry it."""
    try:
        validate_patches(patches, strategy=strategy)
    except InvalidPatchError as error:
        hint = (
            "a shard of a tensor cannot fall back to a dense patch (no rank holds the whole "
            "tensor); pass strategy=BoolMask() here and to load_checkpoint_weight_patches"
        )
        raise InvalidPatchError.from_problems(
            [PatchProblem(None, p.name, f"{p}; {hint}", p.is_type_error) for p in error.problems]
        ) from None


def patch_nbytes(patches: Iterable[PatchLike]) -> int:
    """The wire size of a patch set: values, and positions in their smallest encoding.

    A dense patch counts its values; a sparse one its values plus the smallest of its
    position encodings (`wire_sizes`: flat ``indices``, ``gaps`` or ``bitmask``), which is
    the one the `patchctx.vllm` codec sends. Values count in their own dtype. Names, shapes
    and headers are not counted. Divide by the bytes of the full tensors to log the
    compression of an update. Each sparse patch costs one pass over its indices (and one
    host synchronisation).

    Args:
        patches: `CheckpointWeightPatch` objects, or any `PatchLike` (vLLM's included).

    Returns:
        The total number of bytes.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, patch_nbytes
        >>> sparse = CheckpointWeightPatch("w", (1024,), torch.bfloat16,
        ...                                torch.zeros(10, dtype=torch.bfloat16),
        ...                                torch.arange(10, dtype=torch.int32))
        >>> dense = CheckpointWeightPatch("b", (8,), torch.float32, torch.zeros(8))
        >>> patch_nbytes([sparse, dense])  # 10 * (2 + 2), gap-coded, + 8 * 4
        72
    """
    return sum(min(wire_sizes(patch).values()) for patch in patches)
