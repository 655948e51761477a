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
    developed on, quiet (torch 2.13, one thread, bf16 tensors of 2**22 and 2**24 elements: 3.5
    to 3.8 and 6.1 to 7.0 ns per changed element, 1.0 and 1.2 ns per bitmask element, 0.03 and
    0.09 ns per dense byte; the defaults lie between; 22 µs per sparse patch and 8.4 µs per
    dense one, in a call of many), with dense patches following their routes; the link is
    10 GB/s. They are a 2-core CPU's: on a GPU, or to fit your model and machine, use
    `calibrate`.

    Attributes:
        link_bytes_per_second: The bandwidth from trainer to worker (`math.inf`: free).
        sparse_seconds_per_element: Decoding and applying one changed element (route replay).
        bitmask_seconds_per_element: Decoding a bitmask, per element of the tensor.
        dense_seconds_per_byte: Applying one byte of a dense patch (a copy through the loader).
        sparse_seconds_per_patch: The fixed cost of one more sparse patch in a call.
        dense_seconds_per_patch: The fixed cost of one more dense patch in a call.

    Examples:
        >>> from patchctx import UpdateCost
        >>> cost = UpdateCost(link_bytes_per_second=1e9)
        >>> numel, nnz = 4096 * 4096, 4096 * 4096 // 100  # bf16, 1% changed
        >>> sparse_bytes = nnz * (2 + 2)  # values and uint16 gaps
        >>> f"{cost.sparse_seconds(nnz, sparse_bytes):.4f} s, {cost.dense_seconds(numel, 2):.4f} s"
        '0.0015 s, 0.0356 s'
        >>> cost.prefers_sparse(numel=numel, nnz=nnz, element_size=2, sparse_bytes=sparse_bytes)
        True
    """

    link_bytes_per_second: float = 10e9
    sparse_seconds_per_element: float = 5.0e-9
    bitmask_seconds_per_element: float = 1.1e-9
    dense_seconds_per_byte: float = 6.0e-11
    sparse_seconds_per_patch: float = 22e-6
    dense_seconds_per_patch: float = 8.4e-6

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
        """Measure the apply costs here: dense and sparse patches to small models.

        A parameter of `numel` elements is loaded by a plain ``copy_`` loader. Dense patches
        of it and of a 256-element tensor, along their routes (as a worker with a `RouteCache`
        applies them), give `dense_seconds_per_byte`. `sparse_seconds_per_element` is the
        cost per element, above that of a one-element patch, of a sparse patch (its positions
        decoded from their smallest encoding, then replayed, as a worker receives it) at the
        density where sparse and dense cross (replay gets cheaper per element as density
        grows, so the estimate is made exact where the choice turns): a first measurement at
        5%, a second at the crossing it predicts (within 0.5%..50%).
        Decoding a bitmask with a tenth of its bits set gives `bitmask_seconds_per_element`.
        The fixed costs are those of one more patch in a call of 33 small ones (a worker's
        update is a call of many: the call's own cost is paid whichever form a tensor takes):
        a dense patch along its route, and a one-element sparse patch decoded and replayed.
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


class _Slabs(torch.nn.Module):
    """`count` parameters ``w0``, ``w1``, ... of `numel` elements, loaded by plain copies."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        for k in range(count):
            weight = torch.zeros(numel, dtype=dtype, device=device)
            self.register_parameter(f"w{k}", torch.nn.Parameter(weight, requires_grad=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)
            names.add(name)
        return names


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
        # As a worker applies it: along the route (learnt by the first call's dry run).
        model, cache = _Slab(size, dtype, where), RouteCache()
        patch = CheckpointWeightPatch(
            "weight", (size,), dtype, torch.ones(size, dtype=dtype, device=where)
        )
        load_checkpoint_weight_patches(model, [patch], routes=cache)
        return _fastest(
            lambda: load_checkpoint_weight_patches(model, [patch], routes=cache), where, repeats
        )

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

    def per_patch(dense: bool) -> float:
        # One more small patch in a call of many, as a worker's update is: (many - one) / count.
        count = 33
        slabs, cache = _Slabs(count, small, dtype, where), RouteCache()
        names = [f"w{k}" for k in range(count)]
        if dense:
            ones = torch.ones(small, dtype=dtype, device=where)
            patches = [CheckpointWeightPatch(name, (small,), dtype, ones) for name in names]

            def call(upto: int) -> None:
                load_checkpoint_weight_patches(slabs, patches[:upto], routes=cache)

        else:
            position = torch.tensor([small // 2], device=where)
            summary = positions_summary(position, small)
            encoding, _ = summary.smallest()
            data = encode_positions(position, summary, encoding)
            one = torch.ones(1, dtype=dtype, device=where)

            def call(upto: int) -> None:
                received = [
                    CheckpointWeightPatch(
                        name, (small,), dtype, one, decode_positions(data, small, 1, encoding)
                    )
                    for name in names[:upto]
                ]
                load_checkpoint_weight_patches(slabs, received, routes=cache)

        call(count)  # records (or learns) every route
        single = _fastest(lambda: call(1), where, repeats)
        return max(_fastest(lambda: call(count), where, repeats) - single, 0.0) / (count - 1)

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
        "sparse_seconds_per_patch": per_patch(dense=False),
        "dense_seconds_per_patch": per_patch(dense=True),
    }
