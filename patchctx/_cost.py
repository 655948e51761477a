"""The cost of one tensor's update, sparse or dense: wire time plus apply time, estimated.

`UpdateCost` is what `diff_state_dicts(..., cost=...)` weighs per tensor. Both options pay a
fixed cost per patch and their wire bytes at the link's bandwidth; a sparse patch then costs
a time per changed element (route replay: an index write of each value), a dense one a time
per byte of the tensor (a streaming copy through the loader). The defaults were measured on
the 2-core CPU machine this library is developed on, with one torch thread (see
`UpdateCost`); `UpdateCost.calibrate` measures them on the caller's machine instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from numbers import Real

import torch

from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, PatchProblem

__all__ = ["UpdateCost"]


def _problem(reason: str, *, type_error: bool = False) -> PatchProblem:
    return PatchProblem(None, "", reason, is_type_error=type_error)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateCost:
    """Estimated seconds of a tensor's update, sparse or dense, for choosing between them.

    For a tensor of `numel` elements of `element_size` bytes, `nnz` of them changed, and a
    sparse patch of `sparse_bytes` on the wire (values and positions in their smallest
    encoding, see `wire_sizes`), the sparse estimate is `sparse_seconds_per_patch` plus
    ``nnz * sparse_seconds_per_element``, plus ``numel * bitmask_seconds_per_element`` when
    the positions are a bitmask, plus ``sparse_bytes / link_bytes_per_second``. The dense
    estimate is `dense_seconds_per_patch` plus ``numel * element_size *
    dense_seconds_per_byte`` plus ``numel * element_size / link_bytes_per_second``.

    A bitmask is decoded by scanning every bit of it, so its cost grows with the tensor, not
    with the changes; on a CPU that scan costs more per element than a dense copy, so a
    tensor whose positions are smallest as a bitmask goes dense unless the link is slow.

    The defaults are `calibrate`'s measurements on the 2-core CPU machine patchctx is
    developed on, quiet (torch 2.13, one thread, bf16 tensors of 2**22 and 2**24 elements:
    5.5 and 10.9 ns per changed element, 2.2 ns per bitmask element, 0.07 and 0.09 ns per
    dense byte, 85 to 105 µs per sparse patch and 145 to 175 µs per dense one; the defaults
    lie between), with dense patches following known routes; the link is 10 GB/s. They are a
    2-core CPU's: on a GPU, or to fit your model and machine, use `calibrate`.

    Attributes:
        link_bytes_per_second: The bandwidth from trainer to worker (`math.inf`: free).
        sparse_seconds_per_element: Decoding and applying one changed element (route replay).
        bitmask_seconds_per_element: Decoding a bitmask, per element of the tensor.
        dense_seconds_per_byte: Applying one byte of a dense patch (a copy through the loader).
        sparse_seconds_per_patch: The fixed cost of one sparse patch.
        dense_seconds_per_patch: The fixed cost of one dense patch.

    Examples:
        >>> from patchctx import UpdateCost
        >>> cost = UpdateCost(link_bytes_per_second=1e9)
        >>> numel, nnz = 4096 * 4096, 4096 * 4096 // 100  # bf16, 1% changed
        >>> sparse_bytes = nnz * (2 + 2)  # values and uint16 gaps
        >>> f"{cost.sparse_seconds(nnz, sparse_bytes):.4f} s, {cost.dense_seconds(numel, 2):.4f} s"
        '0.0021 s, 0.0364 s'
        >>> cost.prefers_sparse(numel=numel, nnz=nnz, element_size=2, sparse_bytes=sparse_bytes)
        True
    """

    link_bytes_per_second: float = 10e9
    sparse_seconds_per_element: float = 8.0e-9
    bitmask_seconds_per_element: float = 2.2e-9
    dense_seconds_per_byte: float = 8.0e-11
    sparse_seconds_per_patch: float = 95e-6
    dense_seconds_per_patch: float = 160e-6

    def __post_init__(self) -> None:
        problems = []
        for field in fields(self):
            value = getattr(self, field.name)
            where = f"UpdateCost({field.name}=...)"
            if not isinstance(value, Real) or isinstance(value, bool):
                problems.append(_problem(f"{where} takes a number, got {value!r}", type_error=True))
                continue
            number = float(value)
            if field.name == "link_bytes_per_second":
                if not number > 0:
                    reason = f"{where} must be positive (math.inf: free), got {value!r}"
                    problems.append(_problem(reason))
            elif not 0 <= number < math.inf:
                problems.append(_problem(f"{where} must be a finite number >= 0, got {value!r}"))
        if any(problem.is_type_error for problem in problems):
            raise InvalidPatchTypeError(problems)
        if problems:
            raise InvalidPatchError(problems)

    def sparse_seconds(self, nnz: int, sparse_bytes: int, *, bitmask_numel: int = 0) -> float:
        """Estimated seconds to send, decode and apply a sparse patch of `nnz` elements.

        Args:
            nnz: Changed elements.
            sparse_bytes: Its size on the wire (values and positions).
            bitmask_numel: The tensor's elements when the positions travel as a bitmask
                (every bit is decoded), else 0.
        """
        return (
            self.sparse_seconds_per_patch
            + nnz * self.sparse_seconds_per_element
            + bitmask_numel * self.bitmask_seconds_per_element
            + sparse_bytes / self.link_bytes_per_second
        )

    def dense_seconds(self, numel: int, element_size: int) -> float:
        """Estimated seconds to send and apply a dense patch of `numel` elements.

        Args:
            numel: Elements of the tensor.
            element_size: Bytes per element as sent (the receiver's dtype).
        """
        nbytes = numel * element_size
        return (
            self.dense_seconds_per_patch
            + nbytes * self.dense_seconds_per_byte
            + nbytes / self.link_bytes_per_second
        )

    def prefers_sparse(
        self, *, numel: int, nnz: int, element_size: int, sparse_bytes: int, bitmask: bool = False
    ) -> bool:
        """Whether the sparse patch is estimated strictly faster than the dense one.

        Args:
            numel: Elements of the tensor.
            nnz: Changed elements.
            element_size: Bytes per value.
            sparse_bytes: The sparse patch's size on the wire.
            bitmask: Whether its positions travel as a bitmask.
        """
        sparse = self.sparse_seconds(nnz, sparse_bytes, bitmask_numel=numel if bitmask else 0)
        return sparse < self.dense_seconds(numel, element_size)

    @classmethod
    def calibrate(
        cls,
        *,
        link_bytes_per_second: float = 10e9,
        numel: int = 2**22,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        repeats: int = 5,
    ) -> UpdateCost:
        """Measure the apply costs here: dense and sparse patches to a one-parameter model.

        A parameter of `numel` elements is loaded by a plain ``copy_`` loader. Dense patches
        of it and of a 256-element tensor give `dense_seconds_per_byte` and the fixed cost.
        A one-element sparse patch through a `RouteCache` (route recorded first) gives the
        sparse fixed cost; `sparse_seconds_per_element` is the cost above it per element of a
        sparse patch (its positions decoded from their smallest encoding, then replayed, as a
        worker receives it) at the density where sparse and dense cross (replay gets cheaper per
        element as density grows, so the estimate is made exact where the choice turns): a
        first measurement at 5%, a second at the crossing it predicts (within 0.5%..50%).
        Decoding a bitmask with a tenth of its bits set gives `bitmask_seconds_per_element`.
        Each is the fastest of `repeats` runs, so run it on a quiet machine, with the thread
        count the worker uses. It takes a second or two on a CPU at the defaults.

        Args:
            link_bytes_per_second: The link's bandwidth (not measured).
            numel: Elements of the measured tensor; large enough to leave the caches.
            dtype: Its dtype (the receiver's).
            device: Where to measure ("cuda" for a GPU worker).
            repeats: Runs per measurement; the fastest counts.

        Returns:
            An `UpdateCost` with the measured fields.

        Examples:
            >>> from patchctx import UpdateCost
            >>> cost = UpdateCost.calibrate(link_bytes_per_second=1e9, numel=2**16, repeats=2)
            >>> cost.link_bytes_per_second, cost.sparse_seconds_per_patch > 0
            (1000000000.0, True)
        """
        measured = _measure_costs(numel=numel, dtype=dtype, device=device, repeats=repeats)
        return replace(cls(), link_bytes_per_second=link_bytes_per_second, **measured)


class _Slab(torch.nn.Module):
    """One parameter, loaded by a plain copy: the simplest loader a route can be learned from."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(numel, dtype=dtype, device=device), requires_grad=False
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.data.copy_(tensor)
        return {"weight"}


def _fastest(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds (a CUDA device synchronised)."""
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _measure_costs(
    *, numel: int, dtype: torch.dtype, device: torch.device | str, repeats: int
) -> dict[str, float]:
    from patchctx._encoding import (
        WireEncoding,
        decode_positions,
        encode_positions,
        positions_summary,
    )
    from patchctx._load import load_checkpoint_weight_patches
    from patchctx._patch import CheckpointWeightPatch
    from patchctx._routes import RouteCache

    where = torch.device(device)
    small = 256
    numel = max(numel, 64 * small)
    generator = torch.Generator().manual_seed(0)

    def dense_time(size: int) -> float:
        model = _Slab(size, dtype, where)
        patch = CheckpointWeightPatch(
            "weight", (size,), dtype, torch.ones(size, dtype=dtype, device=where)
        )
        return _fastest(lambda: load_checkpoint_weight_patches(model, [patch]), where, repeats)

    model = _Slab(numel, dtype, where)
    routes = RouteCache()

    def sparse_patch(nnz: int) -> CheckpointWeightPatch:
        positions = torch.randperm(numel, generator=generator)[:nnz].sort().values
        return CheckpointWeightPatch(
            "weight",
            (numel,),
            dtype,
            torch.ones(nnz, dtype=dtype, device=where),
            positions.to(device=where, dtype=torch.int32 if numel < 2**31 else torch.int64),
        )

    def sparse_time(nnz: int) -> float:
        # what the receiver does: decode the positions (smallest encoding), then replay
        patch = sparse_patch(nnz)
        assert patch.indices is not None
        summary = positions_summary(patch.indices, numel)
        encoding, _ = summary.smallest()
        data = encode_positions(patch.indices, summary, encoding)

        def receive() -> None:
            indices = decode_positions(data, numel, nnz, encoding)
            load_checkpoint_weight_patches(model, [patch._replace(indices=indices)], routes=routes)

        return _fastest(receive, where, repeats)

    load_checkpoint_weight_patches(model, [sparse_patch(1)], routes=routes)  # records the route
    sparse_fixed = sparse_time(1)
    dense_fixed = dense_time(small)
    dense_total = dense_time(numel)
    per_byte = (dense_total - dense_fixed) / ((numel - small) * dtype.itemsize)
    # Replay's cost per element falls with density (positions share cache lines), so the chord
    # from the fixed cost is taken where sparse and dense cross: a first guess at 5%, then
    # where that guess says they cross.
    # A bitmask's decode, per element of the tensor (a tenth of it set).
    mask_positions = sparse_patch(numel // 10).indices
    assert mask_positions is not None
    summary = positions_summary(mask_positions, numel)
    mask = encode_positions(mask_positions, summary, WireEncoding.BITMASK)
    per_bit = (
        _fastest(
            lambda: decode_positions(mask, numel, numel // 10, WireEncoding.BITMASK),
            where,
            repeats,
        )
        / numel
    )
    nnz = numel // 20
    for _ in range(2):
        per_element = max(sparse_time(nnz) - sparse_fixed, 0.0) / nnz
        crossing = (dense_total - sparse_fixed) / max(per_element, 1e-15)
        nnz = int(min(max(crossing, numel / 200), numel / 2))
    return {
        "sparse_seconds_per_element": max(per_element, 0.0),
        "bitmask_seconds_per_element": per_bit,
        "dense_seconds_per_byte": max(per_byte, 0.0),
        "sparse_seconds_per_patch": sparse_fixed,
        "dense_seconds_per_patch": dense_fixed,
    }
