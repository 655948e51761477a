"""The sparse-or-dense rule and one tensor's diff: what `diff_state_dicts` and the cost model share.

`choose_sparse` decides by wire size (`sparse_nbytes`) or, given an `UpdateCost`, by estimated
update time; `diff_tensor` scans one tensor and emits its patch. `patchctx._diff` builds
`diff_state_dicts` on them, and `UpdateCost.calibrate` measures `diff_tensor` (this module
imports neither, so neither imports the other back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from patchctx import _tuning
from patchctx._changes import ChangeScan, bits_of, reserved_test
from patchctx._encoding import PositionsSummary, WireEncoding, count_escapes, index_dtype
from patchctx._patch import CheckpointWeightPatch
from patchctx._swap import builtin_copy

if TYPE_CHECKING:
    from patchctx._cost import UpdateCost
    from patchctx._strategies import CopyStrategy

__all__ = ["choose_sparse", "diff_tensor", "sparse_is_smaller", "sparse_nbytes"]


def sparse_nbytes(nnz: int, numel: int, element_size: int, escapes: int) -> int:
    """Wire bytes of a sparse patch of `nnz` sorted positions: values and smallest encoding.

    `escapes` is the number of its gaps that need an escape (see `patchctx._encoding`).
    """
    return _sparse_wire(nnz, numel, element_size, escapes)[1]


def _sparse_wire(nnz: int, numel: int, element_size: int, escapes: int) -> tuple[WireEncoding, int]:
    summary = PositionsSummary(numel, nnz, True, True, escapes, index_dtype(numel).itemsize)
    encoding, positions = summary.smallest()
    return encoding, nnz * element_size + positions


def _max_escapes(nnz: int, numel: int) -> int:
    """At most this many gaps of `nnz` sorted positions below `numel` need an escape.

    The gaps sum to at most `numel`, and an escaped one is over ``0xFFFF``.
    """
    return min(nnz, numel // 0x10000)


def sparse_is_smaller(
    nnz: int, numel: int, element_size: int, escapes: int | Callable[[], int] = 0
) -> bool:
    """Whether a sparse patch of `nnz` changed elements takes fewer bytes than all `numel` values.

    Its size is `sparse_nbytes`: the values plus the smallest position encoding. `escapes` is
    the number of escaped gaps of the positions, or a function that counts them, called only
    when the answer depends on it.
    """
    return choose_sparse(nnz, numel, element_size, escapes=escapes, cost=None, dense_above=None)


def choose_sparse(
    nnz: int,
    numel: int,
    element_size: int,
    *,
    escapes: int | Callable[[], int],
    cost: UpdateCost | None,
    dense_above: float | None,
) -> bool:
    """`diff_state_dicts`' rule for a tensor whose changed values the strategy can carry.

    Sparse when the density is at most `dense_above` (if given), the sparse patch's wire bytes
    (`sparse_nbytes`; with a `cost` whose `position_bytes` is set, its values and flat
    positions, as that data plane sends them) are strictly below the dense patch's, and,
    with `cost`, its estimated update time is strictly below the dense one's too. `escapes`
    (a count, or a function that counts) is needed only for the size of the ``gaps``
    encoding, and asked for only when the answer depends on it.
    """
    if nnz == 0:
        return True
    if dense_above is not None and nnz > dense_above * numel:
        return False

    def wins(escaped: int) -> bool:
        encoding, size = _sparse_wire(nnz, numel, element_size, escaped)
        if cost is not None and cost.position_bytes > 0:  # the plane sends them flat
            encoding = WireEncoding.INDICES
            size = nnz * (element_size + math.ceil(cost.flat_position_bytes(numel)))
        if size >= numel * element_size:
            return False  # never more bytes than the tensor itself, whatever the estimate
        if cost is None:
            return True
        return cost.prefers_sparse(
            numel=numel,
            nnz=nnz,
            element_size=element_size,
            sparse_bytes=size,
            bitmask=encoding is WireEncoding.BITMASK,
        )

    if not callable(escapes):
        return wins(escapes)
    best, worst = wins(0), wins(_max_escapes(nnz, numel))
    if best == worst:
        return best
    return wins(escapes())


def diff_tensor(
    name: str,
    old: torch.Tensor,
    new: torch.Tensor,
    dtype: torch.dtype,
    strategy: CopyStrategy,
    dense_above: float | None,
    cost: UpdateCost | None = None,
    *,
    into: torch.Tensor | None = None,
) -> CheckpointWeightPatch | None:
    """One tensor's patch from `old` to `new` in `dtype` (`None`: unchanged), by `choose_sparse`.

    A dense patch's values are written into `into` when it fits (`_dense`).
    """
    numel = new.numel()
    if numel == 0:
        return None
    scan = ChangeScan(old, new, dtype)
    unsupported = strategy.unsupported_reason(dtype) is not None
    itemsize = dtype.itemsize

    def could_be_sparse(changed: int) -> bool:  # with no escaped gap: the best case
        return not unsupported and choose_sparse(
            changed, numel, itemsize, escapes=0, cost=cost, dense_above=dense_above
        )

    if (
        numel >= _tuning.SAMPLED_FROM
        and new.device.type == "cpu"  # (elsewhere the sample's host read would be a sync)
        and not unsupported
        and not could_be_sparse(_least(old, new, dtype))
    ):
        return _dense(name, new, dtype, into)
    test = None if unsupported else reserved_test(strategy, dtype)
    found = scan.find(test, index_dtype(numel), could_be_sparse)
    if found.changed == 0:
        return None
    positions, values = found.positions, found.values
    if (
        positions is not None
        and values is not None
        and choose_sparse(
            found.changed,
            numel,
            itemsize,
            escapes=lambda: int(count_escapes(positions)),  # a second host read, rare
            cost=cost,
            dense_above=dense_above,
        )
    ):
        return CheckpointWeightPatch(name, tuple(new.shape), dtype, values, positions)
    return _dense(name, new, dtype, into)


def _dense(
    name: str, new: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None
) -> CheckpointWeightPatch:
    """`new` as a dense patch in `dtype`, its values a copy: into `into` when it fits."""
    # A dense patch owns its values: the trainer may keep updating `new` in place, and the
    # vLLM trainer engine keeps them as its record of what it sent. (A lazy conjugate or
    # negative view is resolved: its bit would not survive the wire.)
    source = new.resolve_conj().resolve_neg()
    if (
        into is not None
        and into.dtype == dtype
        and into.device == new.device
        and into.numel() == new.numel()
        and into.is_contiguous()
    ):
        builtin_copy(into.view(new.shape), source)
        return CheckpointWeightPatch(name, tuple(new.shape), dtype, into.view(-1))
    flat = source.to(dtype=dtype).reshape(-1)
    if flat.untyped_storage().data_ptr() == new.untyped_storage().data_ptr():
        flat = flat.clone()
    return CheckpointWeightPatch(name, tuple(new.shape), dtype, flat)


def _least(old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> int:
    """Fewest changed elements `new` has, as far as `_tuning.SAMPLES` random positions show.

    The sampled density less four standard errors (at least one part in `_tuning.SAMPLES` of
    its variance), times the size; 0 when the sample shows no change.
    """
    numel = new.numel()
    seed = torch.Generator().manual_seed(numel)
    at = torch.randint(numel, (_tuning.SAMPLES,), generator=seed).to(new.device)
    before = torch.take(old.detach(), at.to(old.device)).to(new.device, dtype)
    after = torch.take(new.detach(), at).to(dtype)
    differ = bits_of(before.resolve_conj().resolve_neg()) != bits_of(
        after.resolve_conj().resolve_neg()
    )
    if differ.dim() > 1:  # complex128: two halves per element
        differ = differ.any(dim=-1)
    seen = int(differ.sum()) / _tuning.SAMPLES  # (one host read)
    if seen == 0.0:
        return 0
    error = math.sqrt(max(seen * (1.0 - seen), 1.0 / _tuning.SAMPLES) / _tuning.SAMPLES)
    return max(0, math.floor((seen - 4.0 * error) * numel))
