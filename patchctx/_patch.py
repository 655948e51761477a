"""Patches in checkpoint coordinates and their validation (all of it before the first write)."""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import torch

from patchctx import _cpu_passes, _tuning
from patchctx._bits import own_dispatch
from patchctx._blocks import block_size, blocks, scratch
from patchctx._cpu_passes import each_increasing_below, increasing_below, positions_into
from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, PatchProblem
from patchctx._kinds import QUANTIZED
from patchctx._strategies import (
    Auto,
    CopyStrategy,
    as_strategy,
    reserved_on_host,
)

__all__ = ["CheckedPatch", "CheckpointWeightPatch", "PatchLike", "validate_patches"]


class CheckpointWeightPatch(NamedTuple):
    """One dense or sparse update of a checkpoint tensor, in checkpoint coordinates.

    The fields are exactly those of vLLM's ``CheckpointWeightPatch``; any object with these
    attributes (vLLM's own NamedTuple included) is accepted wherever patchctx takes patches.

    Attributes:
        name: The checkpoint (Hugging Face) name, as the model's ``load_weights`` expects it.
        shape: The full checkpoint tensor's shape.
        dtype: The checkpoint tensor's dtype; values are cast to it.
        values: 1-D. For a dense patch, the whole tensor flattened (row-major); for a sparse
            patch, the new values at `indices`.
        indices: 1-D int32 or int64 flat (row-major) positions into the full tensor, or `None`
            for a dense patch.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch
        >>> patch = CheckpointWeightPatch("lm_head.weight", (4, 2), torch.bfloat16,
        ...                               values=torch.tensor([0.5]), indices=torch.tensor([7]))
        >>> patch.indices is None  # sparse: one element changes
        False
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


@runtime_checkable
class PatchLike(Protocol):
    """What patchctx reads from a patch: the five fields of `CheckpointWeightPatch`.

    `CheckpointWeightPatch`, vLLM's own NamedTuple of the same name and any look-alike (a
    dataclass, a NamedTuple of your own) satisfy it; the fields are only read. Every patch is
    validated before the first write, so a wrongly typed field is reported there, not here.

    Examples:
        >>> import torch
        >>> from typing import NamedTuple
        >>> from patchctx import PatchLike, patch_nbytes
        >>> class MyPatch(NamedTuple):  # e.g. vllm's CheckpointWeightPatch
        ...     name: str
        ...     shape: tuple[int, ...]
        ...     dtype: torch.dtype
        ...     values: torch.Tensor
        ...     indices: torch.Tensor | None = None
        >>> patch = MyPatch("w", (4,), torch.float32, torch.zeros(4))
        >>> isinstance(patch, PatchLike), patch_nbytes([patch])
        (True, 16)
    """

    @property
    def name(self) -> str:
        """The checkpoint (Hugging Face) name."""
        ...

    @property
    def shape(self) -> Sequence[int]:
        """The full checkpoint tensor's shape."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint tensor's dtype."""
        ...

    @property
    def values(self) -> torch.Tensor:
        """1-D: the whole tensor flattened (dense) or the values at `indices` (sparse)."""
        ...

    @property
    def indices(self) -> torch.Tensor | None:
        """1-D flat positions (int32 or int64), or `None` for a dense patch."""
        ...


class CheckedPatch:
    """A patch that passed validation, with what validation learned about it.

    Ordering policies receive these and return them (see `OrderingPolicy`); chunking policies
    see the next one in `ChunkState`. Only validation makes them, so holding one means the
    patch is valid for the call's strategy: constructing one yourself is refused (return a
    `CheckpointWeightPatch` from a policy instead, and patchctx validates it).

    Attributes:
        patch: The patch, as a `CheckpointWeightPatch` (shape normalised to a tuple of ints).
        position: Its index in the caller's sequence; `None` for a patch an ordering policy
            made (a merge, say).
        numel: Elements of the full checkpoint tensor.
        sorted_unique: Sparse only: the indices are strictly increasing.

    Examples:
        >>> import torch
        >>> from patchctx import CheckedPatch, CheckpointWeightPatch, InputOrder
        >>> from patchctx._patch import check_patches
        >>> from patchctx import Auto
        >>> patch = CheckpointWeightPatch("w", (2, 3), torch.bfloat16, torch.tensor([1.0]),
        ...                               torch.tensor([4]))
        >>> (checked,) = check_patches([patch], strategy=Auto())
        >>> checked.name, checked.sparse, checked.staged_nbytes, checked.sorted_unique
        ('w', True, 18, True)
        >>> InputOrder().order([checked]) == [checked]
        True
        >>> try:
        ...     CheckedPatch(patch)
        ... except TypeError as error:
        ...     print(type(error).__name__)
        InvalidPatchTypeError
    """

    __slots__ = (
        "_given",
        "_listed",
        "_numel",
        "_patch",
        "_position",
        "_positions",
        "_sorted_unique",
        "_starts",
    )

    _position: int | None
    # The patch as validated and written: for a sparse patch, copies of its values and
    # indices that validation made before reading them and nothing outside patchctx ever
    # holds (what a policy, a loader or another thread does to the caller's tensors after
    # validation is not written); for a dense one, its values as a detached alias (a later
    # ``.data =`` or ``set_`` on the caller's tensor does not reach it).
    _patch: CheckpointWeightPatch
    # The patch as the caller gave it (normalised), what `patch` shows policies; `None` for
    # a patch patchctx made (a merge), shown as copies.
    _given: CheckpointWeightPatch | None
    _numel: int
    _sorted_unique: bool
    # Sparse patches validated in a batch: their indices as int64, on the values' device (a
    # by-product of validation that replay uses instead of converting them again).
    _positions: torch.Tensor | None
    # Short sparse patches on CPU validated on the host: their indices as a Python list (a
    # snapshot, as `_positions` is), which replay searches and shifts without a torch operation.
    _listed: list[int] | None
    # Where the storages of its values and indices start (`storage_start`), found while
    # validation reads the tensors anyway: what a call checks its writes against (`_load`).
    _starts: tuple[int, ...] | None

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise InvalidPatchTypeError(
            [
                PatchProblem(
                    None,
                    "",
                    "CheckedPatch is made by patchctx's validation only; a policy that builds a "
                    "new patch returns a CheckpointWeightPatch, which is validated before any "
                    "write",
                    is_type_error=True,
                )
            ]
        )

    @classmethod
    def _make(
        cls,
        position: int | None,
        patch: CheckpointWeightPatch,
        numel: int,
        *,
        sorted_unique: bool = False,
        positions: torch.Tensor | None = None,
        listed: list[int] | None = None,
        starts: tuple[int, ...] | None = None,
        given: CheckpointWeightPatch | None = None,
    ) -> CheckedPatch:
        self = object.__new__(cls)
        _set_position(self, position)
        _set_patch(self, patch)
        _set_given(self, given)
        _set_numel(self, numel)
        _set_sorted_unique(self, sorted_unique)
        _set_positions(self, positions)
        _set_listed(self, listed)
        _set_starts(self, starts)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"CheckedPatch is read-only; cannot set {name!r}")

    def __repr__(self) -> str:
        kind = "sparse" if self.sparse else "dense"
        return (
            f"CheckedPatch({self.name!r}, {kind}, shape={self._patch.shape!r}, "
            f"dtype={self._patch.dtype}, position={self._position!r})"
        )

    @property
    def patch(self) -> CheckpointWeightPatch:
        """The validated patch, as the caller gave it (shape normalised to a tuple of ints).

        What is written is what validation checked: patchctx's own copies of a sparse patch's
        values and indices, which this never returns (a patch patchctx made, a merge, shows
        as fresh copies). Changing these tensors after validation changes nothing loaded.
        """
        given = self._given
        if given is not None:
            return given
        patch = self._patch
        indices = patch.indices
        return patch._replace(
            values=patch.values.clone(), indices=None if indices is None else indices.clone()
        )

    @property
    def position(self) -> int | None:
        """Index in the caller's sequence (`None`: made by an ordering policy)."""
        return self._position

    @property
    def numel(self) -> int:
        """Elements of the full checkpoint tensor."""
        return self._numel

    @property
    def sorted_unique(self) -> bool:
        """Sparse only: the indices are strictly increasing (sorted and unique)."""
        return self._sorted_unique

    @property
    def name(self) -> str:
        """The patch's checkpoint name."""
        return self._patch.name

    @property
    def sparse(self) -> bool:
        """Whether the patch is sparse (has indices)."""
        return self._patch.indices is not None

    @property
    def staged_nbytes(self) -> int:
        """Bytes this patch stages for the loader (what `ByteBudget` counts).

        The checkpoint-shaped tensor, and for a sparse patch the mask of changed positions
        it carries (one byte per element).
        """
        size = _element_size(self._patch.dtype)
        return self._numel * (size + 1 if self._patch.indices is not None else size)

    def renamed(self, name: str) -> CheckedPatch:
        """The same checked patch under another name (an alias resolved)."""
        given = None if self._given is None else self._given._replace(name=name)
        return self._again(self._position, self._patch._replace(name=name), self._positions, given)

    def _copied(self) -> CheckedPatch:
        """The same checked patch reading copies of its values and indices.

        What a call reads instead of tensors that an earlier write of the same call would
        change (see `patchctx._load`). Validation's own by-products are kept: its int64
        positions (moved to the copy when they are the indices themselves) and its list of
        short indices are snapshots already.
        """
        patch = self._patch
        indices = patch.indices
        copy = None if indices is None else indices.clone()
        positions = copy if self._positions is indices else self._positions
        patch = patch._replace(values=patch.values.clone(), indices=copy)
        return self._again(self._position, patch, positions, self._given)

    def unpositioned(self) -> CheckedPatch:
        """The same checked patch, marked as made by a policy."""
        return self._again(None, self._patch, self._positions, self._given)

    def _again(
        self,
        position: int | None,
        patch: CheckpointWeightPatch,
        positions: torch.Tensor | None,
        given: CheckpointWeightPatch | None,
    ) -> CheckedPatch:
        """A checked patch like this one, with what validation learned about it kept.

        Where its storages start is found again when asked (`starts_of`): the tensors may differ.
        """
        return CheckedPatch._make(
            position,
            patch,
            self._numel,
            sorted_unique=self._sorted_unique,
            positions=positions,
            listed=self._listed,
            given=given,
        )


# The slots' own setters: `CheckedPatch.__setattr__` refuses every write from outside, and these
# cost half of ``object.__setattr__`` (no lookup of the name), which runs per patch per call.
def _slot_setter(name: str) -> Callable[[CheckedPatch, Any], None]:
    setter: Callable[[CheckedPatch, Any], None] = vars(CheckedPatch)[name].__set__
    return setter


_set_position = _slot_setter("_position")
_set_patch = _slot_setter("_patch")
_set_given = _slot_setter("_given")
_set_numel = _slot_setter("_numel")
_set_sorted_unique = _slot_setter("_sorted_unique")
_set_positions = _slot_setter("_positions")
_set_listed = _slot_setter("_listed")
_set_starts = _slot_setter("_starts")


def patch_of(item: CheckedPatch) -> CheckpointWeightPatch:
    """The patch a call writes for `item`: validation's own copies (`CheckedPatch._patch`)."""
    return item._patch


def merged(patch: CheckpointWeightPatch, numel: int, sorted_unique: bool = False) -> CheckedPatch:
    """A checked patch of patchctx's own making (a merge of checked ones: nothing to check)."""
    return CheckedPatch._make(None, patch, numel, sorted_unique=sorted_unique)


def copied_of(item: CheckedPatch) -> CheckedPatch:
    return item._copied()  # (see `CheckedPatch._copied`)


def positions_of(item: CheckedPatch) -> tuple[torch.Tensor | None, list[int] | None]:
    """What replay reads instead of `item`'s indices: validation's int64 positions, its list."""
    return item._positions, item._listed


def starts_of(item: CheckedPatch) -> tuple[int, ...]:
    """Where the storages a checked patch reads start (`CheckedPatch._starts`).

    Each as ``untyped_storage().data_ptr()``, without making the storage's Python object
    (for a tensor just made, that costs a microsecond).
    """
    if item._starts is not None:
        return item._starts
    patch = item._patch
    values, indices = patch.values, patch.indices
    start = values.data_ptr() - values.storage_offset() * values.itemsize
    if indices is None:
        return (int(start),)
    return int(start), int(indices.data_ptr() - indices.storage_offset() * indices.itemsize)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_FIELDS = ("name", "shape", "dtype", "values", "indices")


def _as_patch(
    position: int, obj: object, problems: list[PatchProblem]
) -> CheckpointWeightPatch | None:
    if isinstance(obj, CheckpointWeightPatch):
        return obj
    missing = [f for f in _FIELDS if not hasattr(obj, f)]
    if missing:
        problems.append(
            PatchProblem(
                position,
                str(getattr(obj, "name", "")),
                f"is not a patch: {type(obj).__name__} has no attribute(s) {', '.join(missing)} "
                "(expected CheckpointWeightPatch(name, shape, dtype, values, indices=None))",
                is_type_error=True,
            )
        )
        return None
    return CheckpointWeightPatch(*(getattr(obj, f) for f in _FIELDS))


_INDEX_DTYPES = (torch.int32, torch.int64)
_CPU = torch.device("cpu")

# No tensor holds more elements than int64 counts.
_MAX_NUMEL = 2**63 - 1


def _well_formed(
    patch: CheckpointWeightPatch, strategy: CopyStrategy, supported: dict[torch.dtype, bool]
) -> int | None:
    """The patch's numel when its structure is plainly valid (the common case), else `None`.

    Accepts a subset of what `_structure` accepts, with the same result on it (a shape of
    plain ints, already a tuple), in a few attribute reads: `_structure` decides the rest.
    """
    name, shape, dtype, values, indices = patch
    if type(name) is not str or not name or type(shape) is not tuple:
        return None
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        numel *= d
    if numel > _MAX_NUMEL or not isinstance(dtype, torch.dtype):
        return None
    # (A tensor's shape is read once: each attribute read of a tensor costs about 50 ns.)
    if (
        not isinstance(values, torch.Tensor)
        or (type(values) is not torch.Tensor and own_dispatch(values))
        or len(sizes := values.shape) != 1
        or values.layout is not torch.strided  # data to read: not a sparse layout, not meta
        or values.is_meta
        or values.is_neg()
        or values.is_conj()
    ):
        return None
    if values.dtype is not dtype and (dtype in QUANTIZED or values.dtype in QUANTIZED):
        return None  # no cast to or from a quantized dtype
    if indices is None:
        return numel if sizes[0] == numel else None
    if (
        not isinstance(indices, torch.Tensor)
        or (type(indices) is not torch.Tensor and own_dispatch(indices))
        or indices.shape != sizes
        or indices.dtype not in _INDEX_DTYPES
        or indices.layout is not torch.strided
        or indices.is_meta
        or indices.is_neg()
    ):
        return None
    ok = supported.get(dtype)
    if ok is None:
        ok = supported[dtype] = strategy.unsupported_reason(dtype) is None
    return numel if ok else None


def _data_problem(what: str, tensor: torch.Tensor) -> tuple[str, bool] | None:
    """Why `tensor` cannot be read as the patch's `what`, and whether that is a type problem.

    Returns `None` when it can: a strided tensor with data, of a class without a dispatch of
    its own (validation and replay read and write it through numpy and torch directly).
    """
    if own_dispatch(tensor):
        name = type(tensor).__name__
        return (
            f"{what} are of class {name}, a tensor subclass with a dispatch of its own, whose data "
            "patchctx cannot read directly; pass a plain tensor (a DTensor's .full_tensor() "
            "or .to_local(), an AsyncCollectiveTensor's .wait())",
            True,
        )
    if tensor.layout is not torch.strided:
        return f"{what} must be a strided tensor, got {tensor.layout}", True
    if tensor.is_meta:
        return f"{what} are a meta tensor, which holds no data", False
    return None


def _structure(
    position: int, patch: CheckpointWeightPatch, strategy: CopyStrategy
) -> tuple[CheckpointWeightPatch, int, list[PatchProblem]]:
    """Check everything that needs no tensor data; normalise the shape to a tuple of ints."""
    name = patch.name
    problems: list[PatchProblem] = []

    def problem(reason: str, *, type_error: bool = False) -> None:
        problems.append(PatchProblem(position, str(name), reason, is_type_error=type_error))

    if not isinstance(name, str):
        problem(f"name must be a str, got {name!r}", type_error=True)
    elif not name:
        problem("name must be non-empty")
    dtype_ok = isinstance(patch.dtype, torch.dtype)
    if not dtype_ok:
        problem(f"dtype must be a torch.dtype, got {patch.dtype!r}", type_error=True)
    shape: tuple[int, ...] = ()
    try:
        # Any integer: numpy's and 0-d integer tensors too (``torch.full`` takes them), never a
        # float (a 0-d float tensor's ``int()`` would truncate it).
        shape = tuple(operator.index(d) for d in patch.shape)
    except TypeError:
        problem(f"shape must be a sequence of ints, got {patch.shape!r}", type_error=True)
        shape = ()
    if any(d < 0 for d in shape):
        problem(f"shape {shape!r} has a negative dimension")
    numel = math.prod(shape) if all(d >= 0 for d in shape) else 0
    if numel > _MAX_NUMEL:
        problem(f"shape {shape!r} has {numel} elements, more than a tensor can hold (2**63 - 1)")
        numel = 0
    values = patch.values
    if not isinstance(values, torch.Tensor):
        problem(f"values must be a torch.Tensor, got {type(values).__name__}", type_error=True)
        return patch, numel, problems
    if values.ndim != 1:
        problem(f"values must be a 1-D tensor, got shape {tuple(values.shape)}")
    if (found := _data_problem("values", values)) is not None:
        problem(found[0], type_error=found[1])
    if (
        dtype_ok
        and values.dtype != patch.dtype
        and (values.dtype in QUANTIZED or patch.dtype in QUANTIZED)
    ):
        problem(
            f"values of dtype {values.dtype} cannot be cast to {patch.dtype} (torch has no "
            "cast to or from a quantized dtype); send the values in the checkpoint dtype",
            type_error=True,
        )
    indices = patch.indices
    if indices is None:
        if values.ndim == 1 and values.numel() != numel:
            problem(
                f"dense patch has {values.numel()} values for a {numel}-element tensor of shape "
                f"{shape!r}"
            )
    else:
        if dtype_ok:
            reason = strategy.unsupported_reason(patch.dtype)
            if reason is not None:
                problem(f"sparse patch cannot be staged: {reason}", type_error=True)
        _index_problems(indices, values, problem)
    if problems:
        return patch, numel, problems
    if type(patch.shape) is not tuple or any(type(d) is not int for d in patch.shape):
        patch = patch._replace(shape=shape)
    if values.is_neg() or values.is_conj():
        # A lazy negation or conjugation (``z.conj().imag``) is resolved once, here: torch's
        # cast copy of a contiguous negative view drops the sign (2.13, float32 to float16).
        patch = patch._replace(values=values.resolve_conj().resolve_neg())
    if indices is not None and indices.is_neg():
        # Indices too (``torch._neg_view(-i)`` stands for ``i``): numpy refuses to read them,
        # and the same cast copy would drop their sign.
        patch = patch._replace(indices=indices.resolve_neg())
    return patch, numel, []


def _index_problems(indices: object, values: torch.Tensor, problem: Callable[..., None]) -> None:
    """`_structure` of a sparse patch's indices: a 1-D int32 or int64 tensor, one per value."""
    if not isinstance(indices, torch.Tensor):
        problem(
            f"indices must be a torch.Tensor or None, got {type(indices).__name__}",
            type_error=True,
        )
        return
    if indices.ndim != 1:
        problem(f"indices must be a 1-D tensor, got shape {tuple(indices.shape)}")
    if (found := _data_problem("indices", indices)) is not None:
        problem(found[0], type_error=found[1])
    if indices.dtype not in (torch.int32, torch.int64):
        problem(f"indices must be int32 or int64, got {indices.dtype}", type_error=True)
    elif indices.ndim == 1 and values.ndim == 1 and indices.numel() != values.numel():
        problem(f"{indices.numel()} indices for {values.numel()} values (must match)")


def _host_read(flags: torch.Tensor) -> list[bool]:
    """The one host synchronisation of a validation phase: read a device's flags at once."""
    return [bool(v) for v in flags.tolist()]


def _on_host(device: torch.device) -> bool:
    """Whether tensors on `device` take the host's ways (`_cpu_passes.HOST`)."""
    return device.type == "cpu" and _cpu_passes.HOST


def _read_flags(flags: list[torch.Tensor | int], device: torch.device) -> list[int]:
    """The one host synchronisation of the common case: read a device's 0-d flags at once.

    On CPU each is read where it lies (no synchronisation to save; stacking them costs more),
    and some are host integers already.
    """
    if _on_host(device):
        return cast(list[int], [f if isinstance(f, int) else f.item() for f in flags])
    tensors = cast(list[torch.Tensor], flags)  # off CPU, every flag is a device tensor
    return [int(v) for v in torch.stack(tensors).tolist()] if flags else []


def _numeric_problems(
    checked: list[CheckedPatch], strategy: CopyStrategy, validate_unique_indices: bool
) -> tuple[list[CheckedPatch], list[PatchProblem]]:
    """Reserved values, index range and duplicates of every sparse patch.

    The common case first, at a fixed number of operations per call and per block (see
    `_all_valid`): every sparse patch strictly increasing, in range, without a reserved value.
    Only when that does not hold do the exact checks run, to say which patch fails and why (or
    to accept indices that are valid but not increasing).
    """
    valid = _all_valid(checked, strategy)
    if valid is not None:
        for k, item in enumerate(checked):  # made by validation just now: not shared yet
            if item._patch.indices is not None:
                _set_sorted_unique(item, True)
                _set_positions(item, valid.get(k))
        return checked, []
    return _exact_numeric_problems(checked, strategy, validate_unique_indices)


# Above this, a patch's numel could overflow int64 arithmetic on indices: exact checks only.
_FAST_NUMEL_LIMIT = 1 << 62


def _all_valid(
    checked: list[CheckedPatch], strategy: CopyStrategy
) -> dict[int, torch.Tensor] | None:
    """Whether every sparse patch is in the producer format and carries no reserved value.

    Returns the int64 positions of the small patches (by their index in `checked`), or `None`
    when some patch has an index out of range, indices that are not strictly increasing, or a
    reserved value (the exact checks then find which). One host read per device.

    Small patches (up to `_tuning.CPU_BATCHED_UP_TO` indices on CPU, `_tuning.BATCHED_UP_TO`
    elsewhere) with indices of one dtype are checked together (`_batch_flags`), a lone one on
    its device by itself (`_small_flags`). On CPU, fewer than `_tuning.CPU_JOINED_FROM` small
    ones, and every large one, are decided on the host patch by patch (`_host_valid`). Large
    patches on an accelerator: per block of `_tuning.BLOCK` indices, the extremes, the
    smallest step (into a reused buffer) and the strategy's reserved-value reduction
    (`_blocked_flags`). No temporary exceeds a block.
    """
    if len(checked) == 1:  # a call of one patch: no grouping to do
        item = checked[0]
        patch = item._patch
        indices = patch.indices
        device = patch.values.device
        on_host = _on_host(device)
        if indices is not None and on_host and item._numel < _FAST_NUMEL_LIMIT:
            return {} if _host_valid(item, indices, strategy) else None
        if (
            indices is not None
            and not on_host
            and indices.shape[0] <= _tuning.BATCHED_UP_TO
            and item._numel < _FAST_NUMEL_LIMIT
        ):
            flags: list[torch.Tensor | int] = []
            checks: list[tuple[str, int]] = []
            found = _small_flags(item, indices, device, strategy, flags, checks)
            return {0: found} if _judged(_read_flags(flags, device), checks) else None
    # Small patches by device and index dtype.
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    large: dict[torch.device, list[int]] = {}
    for k, item in enumerate(checked):
        patch = item._patch
        indices = patch.indices
        if indices is None:
            continue
        if item._numel >= _FAST_NUMEL_LIMIT:
            return None
        values = patch.values
        if values.is_cpu and _cpu_passes.HOST:  # (one device object for all: none to hash)
            device, most = _CPU, _tuning.CPU_BATCHED_UP_TO
        else:
            device, most = values.device, _tuning.BATCHED_UP_TO
        if indices.shape[0] > most:
            large.setdefault(device, []).append(k)
            continue
        groups.setdefault(device, {}).setdefault(indices.dtype, []).append(k)
    positions: dict[int, torch.Tensor] = {}
    for device in {*groups, *large}:
        if not _device_valid(
            checked, device, groups.get(device, {}), large.get(device, []), strategy, positions
        ):
            return None
    return positions


def _device_valid(
    checked: list[CheckedPatch],
    device: torch.device,
    groups: dict[torch.dtype, list[int]],
    large: list[int],
    strategy: CopyStrategy,
    positions: dict[int, torch.Tensor],
) -> bool:
    """`_all_valid` on one device: small patches by index dtype (`groups`), `large` ones alone."""
    flags: list[torch.Tensor | int] = []  # 0-d tensors (on CPU, some host ints), read at once
    checks: list[tuple[str, int]] = []  # how to judge each flag on the host
    small = [k for ks in groups.values() for k in ks]
    on_host = _on_host(device)
    if on_host and len(small) < _tuning.CPU_JOINED_FROM:
        for k in small:  # one by one (`_tuning.CPU_JOINED_FROM`)
            indices = checked[k]._patch.indices
            assert indices is not None
            if not _host_valid(checked[k], indices, strategy):
                return False
    elif len(small) == 1:  # one patch: its int64 positions, no concatenation
        (k,) = small
        indices = checked[k]._patch.indices
        assert indices is not None
        positions[k] = _small_flags(checked[k], indices, device, strategy, flags, checks)
    else:
        small_values: dict[torch.dtype, list[torch.Tensor]] = {}  # by checkpoint dtype
        for ks in groups.values():
            _batch_flags(checked, ks, device, flags, checks, positions)
            for k in ks:
                patch = checked[k]._patch
                values = patch.values
                if values.dtype != patch.dtype:  # cast one by one, as staging does: a
                    values = values.to(patch.dtype)  # joint cast could round twice
                small_values.setdefault(patch.dtype, []).append(values)
        for dtype, joined in small_values.items():
            flags.append(
                strategy.reserved_values(
                    joined[0] if len(joined) == 1 else torch.cat(joined), dtype
                )
            )
            checks.append(("eq", 0))
    for k in large:
        indices = checked[k]._patch.indices
        assert indices is not None
        if on_host:
            if not _host_valid(checked[k], indices, strategy):
                return False
        else:
            _blocked_flags(checked[k], indices.to(device), device, strategy, flags, checks)
    return not flags or _judged(_read_flags(flags, device), checks)


def _host_valid(item: CheckedPatch, indices: torch.Tensor, strategy: CopyStrategy) -> bool:
    """`_all_valid` for one sparse patch on CPU, decided on the host: no flags to read.

    Per block of `_tuning.BLOCK` indices, two host passes: the order and range of the block and the
    step into it (`increasing_below`), then its values (`reserved_on_host`). No temporary
    exceeds a block; the first block that fails ends the check (the exact checks say why).
    """
    if not indices.is_cpu:  # (indices may lie elsewhere than their values)
        indices = indices.cpu()
    patch = item._patch
    values, dtype, numel = patch.values, patch.dtype, item._numel
    count = indices.shape[0]
    if count <= _tuning.LISTED_UP_TO:
        # A few indices: checked as a Python list, kept for replay (`CheckedPatch._listed`).
        listed: list[int] = indices.tolist()
        if count and (
            listed[0] < 0
            or listed[-1] >= numel
            or not all(a < b for a, b in itertools.pairwise(listed))
        ):
            return False
        if reserved_on_host(strategy, values, dtype):
            return False
        _set_listed(item, listed)
        return True
    for begin, end in blocks(0, count):
        if end - begin == count:  # one block: no slicing (each slice is an operation)
            return increasing_below(indices, numel) and not reserved_on_host(
                strategy, values, dtype
            )
        if not increasing_below(indices[max(begin - 1, 0) : end], numel) or reserved_on_host(
            strategy, values[begin:end], dtype
        ):
            return False
    return True


def _judged(read: list[int], checks: list[tuple[str, int]]) -> bool:
    """Whether every flag read passes its check (``eq``, ``ge`` or ``le`` its bound)."""
    for value, (kind, bound) in zip(read, checks, strict=True):
        if kind == "eq" and value != bound:
            return False
        if kind == "ge" and value < bound:
            return False
        if kind == "le" and value > bound:
            return False
    return True


def _small_flags(
    item: CheckedPatch,
    indices: torch.Tensor,
    device: torch.device,
    strategy: CopyStrategy,
    flags: list[torch.Tensor | int],
    checks: list[tuple[str, int]],
) -> torch.Tensor:
    """`_all_valid` for one small sparse patch: its int64 positions on `device`.

    Adds its flags: the extremes, the smallest step and the strategy's reserved-value
    reduction. The steps are exact once the extremes are in range (below ``2**62``). (CPU
    patches are checked on the host by `_host_valid`, or together by `_batch_flags`.)
    """
    if indices.device != device:
        indices = indices.to(device)
    positions = indices if indices.dtype == torch.long else _int64(indices)
    count = positions.shape[0]
    if count:
        patch = item._patch
        low, high = torch.aminmax(positions)
        flags += (low, high)
        checks += (("ge", 0), ("le", item._numel - 1))
        if count > 1:
            flags.append(torch.diff(positions).min())
            checks.append(("ge", 1))
        flags.append(strategy.reserved_values(patch.values, patch.dtype))
        checks.append(("eq", 0))
    return positions


def _int64(indices: torch.Tensor) -> torch.Tensor:
    """`indices` as a new int64 tensor; long ones on CPU by numpy (see `patchctx._cpu_passes`)."""
    if not _on_host(indices.device) or indices.shape[0] <= _tuning.HOST_FROM:
        return indices.long()
    positions = torch.empty(indices.shape, dtype=torch.long)
    positions_into(indices, 0, positions)
    return positions


def _batch_flags(
    checked: list[CheckedPatch],
    keys: list[int],
    device: torch.device,
    flags: list[torch.Tensor | int],
    checks: list[tuple[str, int]],
    positions: dict[int, torch.Tensor],
) -> None:
    """`_all_valid` for small patches whose indices share a dtype: a fixed number of operations.

    The indices are concatenated once, in their dtype (a mixed-dtype ``torch.cat`` converts
    piece by piece, 20x slower). All of them are in range and each patch's strictly increasing
    exactly when: the smallest is at least 0, each patch's last is below its numel, and every
    non-positive step of the concatenation is a step from one patch to the next. Steps between
    values that are all at least 0 cannot wrap. On CPU one numpy pass tests all of it
    (`each_increasing_below`). One conversion of the concatenation gives every patch's int64
    positions.
    """
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    lasts: list[int] = []  # position of each non-empty patch's last index in the concatenation
    limits: list[int] = []
    end = 0
    on_cpu = device.type == "cpu"
    for k in keys:
        indices = checked[k]._patch.indices
        assert indices is not None
        if not indices.is_cpu if on_cpu else indices.device != device:
            indices = indices.to(device)
        parts.append(indices)
        count = indices.shape[0]
        sizes.append(count)
        end += count
        if count:
            lasts.append(end - 1)
            limits.append(checked[k]._numel)
    flat = torch.cat(parts)
    if end and _on_host(device):
        flags.append(int(each_increasing_below(flat, lasts, limits)))
        checks.append(("eq", 1))
    elif end:
        nonpositive = torch.diff(flat) <= 0
        # The steps from one patch's last index to the next one's first may go down.
        between = torch.tensor(lasts[:-1], dtype=torch.long, device=device)
        last = flat.index_select(0, torch.tensor(lasts, dtype=torch.long, device=device))
        top = torch.tensor(limits, dtype=torch.long, device=device)
        flags += (
            nonpositive.sum() - nonpositive.index_select(0, between).sum(),
            flat.min(),
            (last >= top).sum(),
        )
        checks += (("eq", 0), ("ge", 0), ("eq", 0))
    pieces = _int64(flat).split_with_sizes(sizes)
    for k, piece in zip(keys, pieces, strict=True):
        positions[k] = piece


def _blocked_flags(
    item: CheckedPatch,
    indices: torch.Tensor,
    device: torch.device,
    strategy: CopyStrategy,
    flags: list[torch.Tensor | int],
    checks: list[tuple[str, int]],
) -> None:
    """`_all_valid` for one long patch on an accelerator (its `indices` on `device`).

    Block by block, flags read with the device's others (on CPU, `_host_valid` decides on
    the host).
    """
    values = item._patch.values
    count = indices.numel()
    # The steps go into a reused buffer (a later block has `block_size()` of them).
    steps = scratch(device, indices.dtype, min(count, block_size()))
    for begin, end in blocks(0, count):
        whole = end - begin == count  # one block: no slicing (each slice is an operation)
        block = indices if whole else indices[begin:end]
        low, high = torch.aminmax(block)
        flags += (low, high)
        checks += (("ge", 0), ("le", item.numel - 1))
        # The step into this block from the previous one is checked here too. Exact once the
        # extremes are in range: differences of in-range indices cannot overflow.
        window = block if begin == 0 else indices[begin - 1 : end]
        if window.numel() > 1:
            flags.append(torch.diff(window, out=steps[: window.numel() - 1]).min())
            checks.append(("ge", 1))
        flags.append(
            strategy.reserved_values(values if whole else values[begin:end], item._patch.dtype)
        )
        checks.append(("eq", 0))


def _exact_numeric_problems(
    checked: list[CheckedPatch], strategy: CopyStrategy, validate_unique_indices: bool
) -> tuple[list[CheckedPatch], list[PatchProblem]]:
    """Reserved values, index range and duplicates of every sparse patch, patch by patch.

    Small sparse patches on one device are checked together, in a fixed number of operations
    (their indices concatenated once), large ones by a few reductions each; either way with
    one host read per device: strictly increasing
    indices (the producer format) are then fully validated, in O(nnz) and without a sort.
    A second read happens only for a group of patches of one dtype holding a reserved value
    (to say which), and, when duplicates must be ruled out (`validate_unique_indices`), for
    patches whose indices are not strictly increasing: it sorts them.
    """
    by_device: dict[torch.device, list[int]] = {}
    for k, item in enumerate(checked):
        if item._patch.indices is not None:
            by_device.setdefault(item._patch.values.device, []).append(k)

    problems: list[PatchProblem] = []
    unsorted: dict[torch.device, list[int]] = {}
    increasing_of: dict[int, bool] = {}
    for device, ks in by_device.items():
        out_of_range, increasing = _index_flags([checked[k] for k in ks], device)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in ks:
            by_dtype.setdefault(checked[k]._patch.dtype, []).append(k)
        groups = list(by_dtype.items())
        reserved = [
            _reserved_in(strategy, [checked[k] for k in group], dtype, device)
            for dtype, group in groups
        ]
        values = _host_read(torch.cat([out_of_range, ~increasing, *reserved]))
        n = len(ks)
        for j, k in enumerate(ks):
            item = checked[k]
            increasing_of[k] = not values[n + j]
            if values[j]:
                problems.append(_range_problem(item))
                increasing_of[k] = False  # not meaningful for out-of-range indices
            elif validate_unique_indices and values[n + j]:
                unsorted.setdefault(device, []).append(k)
        for g, (dtype, group) in enumerate(groups):
            if not values[2 * n + g]:
                continue
            # Some patch of this dtype holds a reserved value: find which (rare).
            flags = torch.stack(
                [strategy.reserved_values(checked[k]._patch.values, dtype) for k in group]
            )
            for k, has in zip(group, _host_read(flags), strict=True):
                if has:
                    problems.append(_reserved_problem(checked[k], strategy))

    # Second phase, only for in-range indices that are not strictly increasing: duplicates,
    # by sorting.
    for device, ks in unsorted.items():
        duplicate_flags = []
        for k in ks:
            patch_indices = checked[k]._patch.indices
            assert patch_indices is not None
            ordered = patch_indices.to(device=device).sort().values
            duplicate_flags.append((ordered[1:] == ordered[:-1]).any())
        for k, duplicated in zip(ks, _host_read(torch.stack(duplicate_flags)), strict=True):
            if duplicated:
                problems.append(_duplicate_problem(checked[k]))

    problems.sort(key=lambda p: (p.index is None, p.index or 0))
    result = [
        CheckedPatch._make(
            c.position,
            c._patch,
            c.numel,
            sorted_unique=increasing_of.get(k, False),
            given=c._given,
        )
        for k, c in enumerate(checked)
    ]
    return result, problems


def _reserved_in(
    strategy: CopyStrategy, items: list[CheckedPatch], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-element flag: whether any of `items` (one dtype) holds a value `strategy` reserves."""
    # Cast one by one, as staging does: a joint cast after `torch.cat` promotes the values to
    # a common dtype first (int64 and float32 to float32), which can round them differently.
    values = [item._patch.values.to(device=device, dtype=dtype) for item in items]
    if len(values) == 1 or sum(v.numel() for v in values) > _tuning.BATCHED_BELOW * len(values):
        flags = [strategy.reserved_values(v, dtype).to(device) for v in values]
        return torch.stack(flags).any().reshape(1)
    return strategy.reserved_values(torch.cat(values), dtype).to(device).reshape(1)


def _index_flags(
    items: list[CheckedPatch], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch (1-D bool tensors): any index out of range; indices strictly increasing.

    Small patches: one pass over all their indices at once (int64, so differences cannot
    overflow). Large ones: a few reductions each.
    """
    lengths = [item._patch.indices.numel() for item in items]  # type: ignore[union-attr]
    count = len(items)
    if not sum(lengths):
        none = torch.zeros(count, dtype=torch.bool, device=device)
        return none, ~none
    if count == 1 or sum(lengths) > _tuning.BATCHED_BELOW * count:
        # Large patches: a few reductions each, in the index dtype (no int64 copy, no owner
        # map: for millions of indices those extra passes cost more than the calls they save).
        ranges: list[torch.Tensor] = []
        orders: list[torch.Tensor] = []
        for item in items:
            indices = item._patch.indices.to(device)  # type: ignore[union-attr]
            if not indices.numel():
                ranges.append(torch.zeros((), dtype=torch.bool, device=device))
                orders.append(torch.ones((), dtype=torch.bool, device=device))
                continue
            low, high = torch.aminmax(indices)
            if item.numel > torch.iinfo(indices.dtype).max:
                # No index of this dtype reaches the end, and the bound would wrap in the
                # comparison (2**31 is int32's -2**31).
                ranges.append(low < 0)
            else:
                ranges.append((low < 0) | (high >= item.numel))
            # Exact whenever the indices are in range: differences of non-negative values of
            # the index dtype cannot overflow.
            orders.append(
                torch.diff(indices).min() > 0
                if indices.numel() > 1
                else torch.ones((), dtype=torch.bool, device=device)
            )
        return torch.stack(ranges), torch.stack(orders)
    flat = torch.cat([item._patch.indices.to(device) for item in items])  # type: ignore[union-attr]
    flat = flat.to(torch.long)
    owner = torch.repeat_interleave(
        torch.arange(count, device=device), torch.tensor(lengths, device=device)
    )
    limits = torch.tensor([item.numel for item in items], device=device)[owner]
    bad = ((flat < 0) | (flat >= limits)).to(torch.long)
    out_of_range = torch.zeros(count, dtype=torch.long, device=device).index_add_(0, owner, bad)
    later = owner[1:]
    not_after = ((flat[1:] <= flat[:-1]) & (later == owner[:-1])).to(torch.long)
    decreasing = torch.zeros(count, dtype=torch.long, device=device).index_add_(0, later, not_after)
    return out_of_range > 0, decreasing == 0


def _reserved_problem(item: CheckedPatch, strategy: CopyStrategy) -> PatchProblem:
    patch = item._patch
    return PatchProblem(
        item.position,
        patch.name,
        f"values contain {strategy.describe_reserved(patch.dtype)}, which {strategy!r} cannot "
        "carry as an update; use BoolMask() (any value) or send this tensor as a dense patch",
    )


def _range_problem(item: CheckedPatch) -> PatchProblem:
    indices = item._patch.indices
    assert indices is not None
    low, high = (int(v) for v in torch.aminmax(indices))
    return PatchProblem(
        item.position,
        item._patch.name,
        f"indices out of range [0, {item.numel}) for shape {item._patch.shape!r}: "
        f"min {low}, max {high}",
    )


def _duplicate_problem(item: CheckedPatch) -> PatchProblem:
    indices = item._patch.indices
    assert indices is not None
    ordered = indices.sort().values
    repeated = torch.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    shown = ", ".join(str(int(v)) for v in repeated[:5])
    more = f" and {repeated.numel() - 5} more" if repeated.numel() > 5 else ""
    return PatchProblem(
        item.position,
        item._patch.name,
        f"duplicate indices within the patch ({shown}{more}); send each position once, or pass "
        "validate_unique_indices=False for a trusted producer",
    )


def _owned(patch: CheckpointWeightPatch) -> CheckpointWeightPatch:
    """What validation checks and every path writes: tensors no one outside patchctx holds.

    A sparse patch's values and indices are copied before validation reads them, so nothing
    done to the caller's tensors afterwards (``t.data = x`` and ``set_``, which no version
    counter sees, in-place writes through numpy or another thread, a storage resized) reaches
    what is written. A dense patch's values are validated for their structure only: they are
    read when written, through a detached alias of their own (``.data =`` or ``set_`` on the
    caller's tensor does not change it); `readable` checks their storage again there.
    """
    values, indices = patch.values.detach(), patch.indices
    if indices is None:
        return patch._replace(values=values)
    return patch._replace(values=values.clone(), indices=indices.detach().clone())


def readable(item: CheckedPatch) -> None:
    """Refuse a dense patch whose values' storage shrank since validation (before reading it).

    torch reads a tensor's bytes without checking that its storage still holds them: after
    ``x.untyped_storage().resize_(0)`` on the caller's tensor, reading the alias would read
    freed memory.
    """
    values = item._patch.values
    if not values.numel():
        return
    needed = values.storage_offset() + 1
    for size, stride in zip(values.shape, values.stride(), strict=True):
        needed += (size - 1) * stride
    if values.untyped_storage().nbytes() < needed * values.element_size():
        raise InvalidPatchError(
            [
                PatchProblem(
                    item._position,
                    item._patch.name,
                    "the dense values' storage was resized after validation "
                    f"(untyped_storage().resize_()): it holds "
                    f"{values.untyped_storage().nbytes()} bytes, fewer than the "
                    f"{needed * values.element_size()} the values need; nothing of it was read",
                )
            ]
        )


_SUPPORTED: dict[CopyStrategy, dict[torch.dtype, bool]] = {}


def check_patches(
    patches: Iterable[object],
    *,
    strategy: CopyStrategy,
    validate_unique_indices: bool = True,
) -> list[CheckedPatch]:
    """Validate every patch (structure, then numbers) and raise one report of all problems."""
    problems: list[PatchProblem] = []
    structural: list[CheckedPatch] = []
    # The strategy's answer, asked once per dtype: per call, or once for all calls for
    # patchctx's own strategies (immutable values; the answer depends on the torch build only).
    supported: dict[torch.dtype, bool] = {}
    if getattr(strategy, "fixed_support", False) is True:  # answers kept per strategy value
        with contextlib.suppress(TypeError):  # (an unhashable one is asked every call)
            supported = _SUPPORTED.setdefault(strategy, supported)
    for position, obj in enumerate(patches):
        patch = _as_patch(position, obj, problems)
        if patch is None:
            continue
        numel = _well_formed(patch, strategy, supported)
        if numel is None:  # something is off: the full checks say what
            patch, numel, found = _structure(position, patch, strategy)
            problems.extend(found)
            if found:
                continue
        structural.append(CheckedPatch._make(position, _owned(patch), numel, given=patch))
    if len(structural) > 1:  # a write of the call may reach what a later patch reads
        for item in structural:  # (found here, where the tensors were just read)
            _set_starts(item, starts_of(item))
    checked, numeric = _numeric_problems(structural, strategy, validate_unique_indices)
    problems.extend(numeric)
    if problems:
        problems.sort(key=lambda p: -1 if p.index is None else p.index)
        raise InvalidPatchError.from_problems(problems)
    return checked


def validate_patches(
    patches: Iterable[object],
    *,
    strategy: CopyStrategy | None = None,
    validate_unique_indices: bool = True,
) -> list[CheckpointWeightPatch]:
    """Check patches the way `load_checkpoint_weight_patches` does, without loading anything.

    Use it before staging patches yourself for `masked_copy`. Structure is checked first (name,
    shape, dtype, 1-D values, value count, index dtype and count, values and indices that hold
    data, values that cast to the dtype, the strategy's support of the dtype), then numbers
    with one host synchronisation per device: values the strategy cannot carry, indices out of
    range, and duplicate indices within a patch. Indices that are strictly increasing (the
    common producer format) are validated in O(nnz) without a sort, in a fixed number of
    operations for all small patches together and per block of a million indices for large
    ones. When some patch's are not increasing (or a check fails), exact per-patch checks
    follow, with one more host synchronisation on that device, and one more again when
    duplicates must be ruled out by a sort (none with ``validate_unique_indices=False``).

    Args:
        patches: `CheckpointWeightPatch` objects, or anything with the same attributes.
        strategy: The strategy that will stage the sparse patches (default `Auto()`).
        validate_unique_indices: Reject duplicate indices within one patch.

    Returns:
        The patches as `CheckpointWeightPatch` tuples (shapes normalised to tuples of ints).

    Raises:
        InvalidPatchError: Listing every problem found, each naming the patch by position and
            name. It is an `InvalidPatchTypeError` (also a `TypeError`) when one of the
            problems is of a kind vLLM reported with `TypeError`.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, InvalidPatchError, validate_patches
        >>> bad = CheckpointWeightPatch("w", (2, 2), torch.float32, torch.tensor([1.0, 2.0]),
        ...                             torch.tensor([3, 4]))
        >>> try:
        ...     validate_patches([bad])
        ... except InvalidPatchError as error:
        ...     print(error)
        patches[0] 'w': indices out of range [0, 4) for shape (2, 2): min 3, max 4
    """
    chosen = as_strategy(strategy, Auto(), "validate_patches")
    return [
        c.patch
        for c in check_patches(
            patches, strategy=chosen, validate_unique_indices=validate_unique_indices
        )
    ]
