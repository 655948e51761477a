"""The cost of one tensor's update, sparse or dense: the whole path, estimated.

`UpdateCost` is what `diff_state_dicts(..., cost=...)` weighs per tensor: the whole path of
each option, from the trainer's tensor to the worker's applied one. The trainer's diff (a
sparse patch scans the whole tensor and gathers its changes; a dense one stops scanning once
sparse is ruled out and casts the tensor), the data plane (encode, checksum, the local
transport's copies, decode: per payload byte, and per changed element for the positions),
the wire at the link's bandwidth, and the apply (route replay per changed element and line
written, or a streaming copy per byte). The defaults were measured on the 2-core CPU
machine this library is developed on, with one torch thread (see `UpdateCost`);
`UpdateCost.calibrate` measures them on the caller's machine, through the caller's data
plane when given it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from numbers import Real
from typing import TYPE_CHECKING

import torch

from patchctx._arguments import positive_int
from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, PatchProblem

if TYPE_CHECKING:
    from patchctx._encoding import WireEncoding
    from patchctx._load import RouteCache
    from patchctx._patch import CheckpointWeightPatch

__all__ = ["UpdateCost"]


def _problem(reason: str, *, type_error: bool = False) -> PatchProblem:
    return PatchProblem(None, "", reason, is_type_error=type_error)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateCost:
    """Estimated seconds of a tensor's update, sparse or dense, for choosing between them.

    For a tensor of `numel` elements of `element_size` bytes, `nnz` of them changed, and a
    sparse patch of `sparse_bytes` on the wire (values and positions in their smallest
    encoding, see `wire_sizes`), the sparse estimate is `sparse_seconds_per_patch` plus
    ``numel * scan_seconds_per_element`` (the trainer's scan), plus ``nnz *
    (sparse_seconds_per_element + diff_seconds_per_element + plane_seconds_per_element)``,
    plus ``lines * sparse_seconds_per_line`` for the 64-byte lines of the tensor that hold a
    change (`lines`: ``touched_lines(nnz, numel, element_size)``, for changes spread at
    random), plus ``numel * bitmask_seconds_per_element`` when the positions are a bitmask,
    plus ``sparse_bytes * payload_seconds_per_byte`` plus ``sparse_bytes /
    link_bytes_per_second``. The dense estimate is `dense_seconds_per_patch` plus ``numel *
    element_size * (dense_diff_seconds_per_byte + dense_seconds_per_byte +
    payload_seconds_per_byte)`` plus ``numel * element_size / link_bytes_per_second``. (A
    dense patch's scan, which stops once sparse is ruled out, is not counted.)

    The payload term is what the data plane costs per byte on both sides together: the
    trainer encodes the patch and checksums it, a local transport copies it (shared memory),
    the worker checksums and decodes it. On a CPU it is several times a dense apply per byte,
    so it decides the choice from a few percent up: a tensor whose sparse payload is half the
    dense one's saves half of it.

    A replay's write of one element fetches and writes back its whole cache line: at a few
    percent most changed elements have a line of their own, and each costs about
    ``sparse_seconds_per_element + sparse_seconds_per_line``; by tens of percent every line
    holds several, and each costs little more than its own part. A bitmask is decoded by
    scanning every bit of it, so its cost grows with the tensor, not with the changes; on a
    CPU that scan costs more per element than a dense copy, so a tensor whose positions are
    smallest as a bitmask goes dense unless the link is slow.

    The defaults are `calibrate`'s measurements on the 2-core CPU machine patchctx is
    developed on (torch 2.13, one thread, bf16 tensors of 2**22 and 2**24 elements, the
    trainer's from fp32: 1.0 to 2.2 ns per changed element and 3 to 4.8 ns per line
    written; 0.6 to 0.7 ns per bitmask element at 25 %; 0.03 to 0.09 ns per dense byte; 22
    µs per sparse patch and 8.4 µs per dense one, in a call of many; a scan of 0.2 to 0.4 ns
    per element, 7 ns per changed element gathered, 0.06 to 0.08 ns per byte cast to dense,
    7 to 8 ns per changed element to encode its position), with dense patches following
    their routes; the link is 10 GB/s. The payload figure, 3.5 ns per byte, is the ``shm``
    data plane's of ``patchctx.vllm`` on that machine (SHA-256 on both sides, the payload
    built as bytes and written to and read from ``/dev/shm``): ``./dev bench --engine``
    measures it with `calibrate`. They are a 2-core CPU's: on a GPU, or to fit your model
    and machine, use `calibrate`; `describe` shows the figures.

    Attributes:
        link_bytes_per_second: The bandwidth from trainer to worker (`math.inf`: free).
        sparse_seconds_per_element: Decoding and applying one changed element (route replay).
        sparse_seconds_per_line: Each 64-byte line of the tensor a replay writes into.
        bitmask_seconds_per_element: Decoding a bitmask, per element of the tensor.
        dense_seconds_per_byte: Applying one byte of a dense patch (a copy through the loader).
        sparse_seconds_per_patch: The fixed cost of one more sparse patch in a call.
        dense_seconds_per_patch: The fixed cost of one more dense patch in a call.
        payload_seconds_per_byte: Carrying one payload byte from the trainer's patch to the
            worker's decoded one (encode, checksum, local transport, decode), both sides
            together; the link's own time is `link_bytes_per_second`'s.
        diff_seconds_per_element: The trainer's diff per changed element of a sparse
            patch: gathering its position and value.
        scan_seconds_per_element: The trainer's diff per element of a tensor sent sparse:
            casting both sides to the receiver's dtype and comparing them, all of it.
        dense_diff_seconds_per_byte: The trainer's diff per byte of a dense patch: the cast
            of the tensor into the receiver's dtype (a copy).
        plane_seconds_per_element: The data plane's work per changed element beyond its
            bytes: its position encoded and checked (the worker's decode is
            `sparse_seconds_per_element`'s).
        position_bytes: Bytes of each changed element's position on the wire when the data
            plane sends positions flat, as indices (4: int32, as ``patchctx.vllm`` does over
            shared memory; 8 is used for tensors of 2**31 elements or more); 0: in their
            smallest encoding (`wire_sizes`). Set, a sparse patch is priced at its flat size
            and never as a bitmask, and goes dense when that size is not below the dense one.

    Examples:
        >>> from patchctx import UpdateCost
        >>> cost = UpdateCost(link_bytes_per_second=1e9)
        >>> numel, nnz = 4096 * 4096, 4096 * 4096 // 100  # bf16, 1% changed
        >>> sparse_bytes = nnz * (2 + 2)  # values and uint16 gaps
        >>> sparse = cost.sparse_seconds(nnz, sparse_bytes, numel=numel, element_size=2)
        >>> f"{sparse:.4f} s, {cost.dense_seconds(numel, 2):.4f} s"
        '0.0132 s, 0.1557 s'
        >>> cost.prefers_sparse(numel=numel, nnz=nnz, element_size=2, sparse_bytes=sparse_bytes)
        True
    """

    link_bytes_per_second: float = 10e9
    sparse_seconds_per_element: float = 1.2e-9
    sparse_seconds_per_line: float = 4.5e-9
    bitmask_seconds_per_element: float = 0.7e-9
    dense_seconds_per_byte: float = 6.0e-11
    sparse_seconds_per_patch: float = 22e-6
    dense_seconds_per_patch: float = 8.4e-6
    payload_seconds_per_byte: float = 3.5e-9
    diff_seconds_per_element: float = 7.5e-9
    scan_seconds_per_element: float = 0.4e-9
    dense_diff_seconds_per_byte: float = 0.08e-9
    plane_seconds_per_element: float = 8e-9
    position_bytes: float = 0.0

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

    def flat_position_bytes(self, numel: int) -> float:
        """Bytes of one flat position in a tensor of `numel` elements (`position_bytes`).

        Examples:
            >>> from patchctx import UpdateCost
            >>> cost = UpdateCost(position_bytes=4)
            >>> cost.flat_position_bytes(2**20), cost.flat_position_bytes(2**31)
            (4.0, 8.0)
        """
        if self.position_bytes <= 0:
            return 0.0
        return (
            max(float(self.position_bytes), 8.0) if numel >= 2**31 else float(self.position_bytes)
        )

    def sparse_seconds(
        self,
        nnz: int,
        sparse_bytes: int,
        *,
        bitmask_numel: int = 0,
        numel: int = 0,
        element_size: int = 0,
    ) -> float:
        """Estimated seconds to send, decode and apply a sparse patch of `nnz` elements.

        Args:
            nnz: Changed elements.
            sparse_bytes: Its size on the wire (values and positions).
            bitmask_numel: The tensor's elements when the positions travel as a bitmask
                (every bit is decoded), else 0.
            numel: Elements of the tensor, for the trainer's scan of all of them and the
                lines a replay writes (`touched_lines`; 0: neither counted).
            element_size: Bytes per element of the tensor.
        """
        per_element = (
            self.sparse_seconds_per_element
            + self.diff_seconds_per_element
            + self.plane_seconds_per_element
        )
        return (
            self.sparse_seconds_per_patch
            + numel * self.scan_seconds_per_element
            + nnz * per_element
            + touched_lines(nnz, numel, element_size) * self.sparse_seconds_per_line
            + bitmask_numel * self.bitmask_seconds_per_element
            + sparse_bytes * self.payload_seconds_per_byte
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
            + nbytes
            * (
                self.dense_diff_seconds_per_byte
                + self.dense_seconds_per_byte
                + self.payload_seconds_per_byte
            )
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
        sparse = self.sparse_seconds(
            nnz,
            sparse_bytes,
            bitmask_numel=numel if bitmask else 0,
            numel=numel,
            element_size=element_size,
        )
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
        payload: Callable[[CheckpointWeightPatch], object] | None = None,
        source_dtype: torch.dtype | None = None,
        position_bytes: float = 0.0,
    ) -> UpdateCost:
        """Measure the apply costs here: dense and sparse patches to small models.

        A parameter of `numel` elements is loaded by a plain ``copy_`` loader. Dense patches
        of it and of a 256-element tensor, along their routes (as a worker with a `RouteCache`
        applies them), give `dense_seconds_per_byte`. Sparse patches of it at 1% and 50%
        (their positions decoded from their smallest encoding, then replayed, as a worker
        receives them; the time of a one-element patch, and a bitmask's decode, taken off)
        give `sparse_seconds_per_element` and `sparse_seconds_per_line`, the two unknowns of
        the two measurements.
        Decoding a bitmask with a quarter of its bits set gives `bitmask_seconds_per_element`
        (the densities where a slow link makes a bitmask worth its decode).
        The fixed costs are those of one more patch in a call of 33 small ones (a worker's
        update is a call of many: the call's own cost is paid whichever form a tensor takes):
        a dense patch along its route, and a one-element sparse patch decoded and replayed.
        The trainer's diff is measured from a `source_dtype` tensor into `dtype`: with one
        change (its scan of every element), a tenth and a half changed (the gather per
        changed element: the slope between the two, where the choice is close; the rest of
        the tenth's time, if more than the one change's, counts as scan) and made to go
        dense (its cast per byte); encoding the positions of a
        tenth gives `plane_seconds_per_element`.
        With `payload`, a function that carries one patch through the caller's data plane
        as an update does (encode, checksum, transport, decode, and apply, as a worker does:
        whatever it does counts, the apply measured here taken off), dense patches of
        `numel` and of 256 elements give `payload_seconds_per_byte`, and sparse patches of
        one element and of a tenth of it give `plane_seconds_per_element` (what the plane
        spends per changed element beyond its bytes); without it, the payload field keeps
        its default (the data plane is the caller's, not the library's core).
        Each is the fastest of `repeats` runs, so run it on a quiet machine, with the thread
        count the worker uses. It takes a second or two on a CPU at the defaults.

        Args:
            link_bytes_per_second: The link's bandwidth (not measured).
            numel: Elements of the measured tensor; large enough to leave the caches.
            dtype: Its dtype (the receiver's). Sparse patches of a dtype `Auto` cannot stage
                (bool, complex) are measured with `BoolMask`, as a worker must load them.
            device: Where to measure ("cuda" for a GPU worker).
            repeats: Runs per measurement; the fastest counts.
            payload: Carries a patch through the data plane, end to end (its result is
                ignored); `None`: `payload_seconds_per_byte` is not measured.
            source_dtype: The trainer's dtype, which its diff casts from (`None`: `dtype`;
                ``torch.float32`` for fp32 master weights).
            position_bytes: The result's `position_bytes` (not measured): how `payload`'s
                plane sends positions (4: flat int32, as ``patchctx.vllm`` over shared
                memory). Its sparse patches are then counted at that size, so that
                `plane_seconds_per_element` is what the plane spends beyond those bytes.

        Raises:
            InvalidPatchError: `numel` or `repeats` is not positive.
            InvalidPatchTypeError: `numel` or `repeats` is not an int (a bool is not).

        Returns:
            An `UpdateCost` with the measured fields.

        Examples:
            >>> from patchctx import UpdateCost
            >>> cost = UpdateCost.calibrate(link_bytes_per_second=1e9, numel=2**16, repeats=2)
            >>> cost.link_bytes_per_second, cost.sparse_seconds_per_patch > 0
            (1000000000.0, True)
        """
        # Checked first: no run means every time is inf and every field NaN.
        numel = positive_int(numel, "UpdateCost.calibrate(numel=...)")
        repeats = positive_int(repeats, "UpdateCost.calibrate(repeats=...)")
        where = torch.device(device)
        measured = _measure_costs(numel=numel, dtype=dtype, device=where, repeats=repeats)
        source = dtype if source_dtype is None else source_dtype
        measured.update(_measure_diff(numel, dtype, source, where, repeats))
        flat = replace(cls(), position_bytes=position_bytes)  # checks it
        if payload is not None:
            measured.update(_measure_payload(payload, measured, numel, dtype, where, repeats, flat))
        return replace(flat, link_bytes_per_second=link_bytes_per_second, **measured)

    def describe(self) -> str:
        """The figures in readable units, one a line (what `calibrate` measured).

        Examples:
            >>> from patchctx import UpdateCost
            >>> print(UpdateCost().describe())  # doctest: +NORMALIZE_WHITESPACE
            link                       10.0 GB/s
            sparse, per element          1.20 ns
            sparse, per line written     4.50 ns
            bitmask, per element         0.70 ns
            dense apply, per byte       0.060 ns
            payload, per byte            3.50 ns
            diff scan, per element       0.40 ns
            diff, per sparse element     7.50 ns
            diff to dense, per byte     0.080 ns
            plane, per sparse element    8.00 ns
            sparse, per patch            22.0 us
            dense, per patch              8.4 us
            positions                 smallest
        """
        link, flat = self.link_bytes_per_second, self.position_bytes > 0
        rows = [
            ("link", "free" if link == math.inf else f"{link / 1e9:.1f} GB/s"),
            ("sparse, per element", f"{self.sparse_seconds_per_element * 1e9:.2f} ns"),
            ("sparse, per line written", f"{self.sparse_seconds_per_line * 1e9:.2f} ns"),
            ("bitmask, per element", f"{self.bitmask_seconds_per_element * 1e9:.2f} ns"),
            ("dense apply, per byte", f"{self.dense_seconds_per_byte * 1e9:.3f} ns"),
            ("payload, per byte", f"{self.payload_seconds_per_byte * 1e9:.2f} ns"),
            ("diff scan, per element", f"{self.scan_seconds_per_element * 1e9:.2f} ns"),
            ("diff, per sparse element", f"{self.diff_seconds_per_element * 1e9:.2f} ns"),
            ("diff to dense, per byte", f"{self.dense_diff_seconds_per_byte * 1e9:.3f} ns"),
            ("plane, per sparse element", f"{self.plane_seconds_per_element * 1e9:.2f} ns"),
            ("sparse, per patch", f"{self.sparse_seconds_per_patch * 1e6:.1f} us"),
            ("dense, per patch", f"{self.dense_seconds_per_patch * 1e6:.1f} us"),
            ("positions", f"flat, {self.position_bytes:g} B" if flat else "smallest"),
        ]
        return "\n".join(f"{name:<25} {value:>10}" for name, value in rows)


# Bytes of a cache line: what a write of one element fetches and writes back.
LINE_BYTES = 64


def touched_lines(nnz: int, numel: int, element_size: int) -> float:
    """The 64-byte lines of a tensor that hold at least one of `nnz` changed elements.

    Expected for changes spread at random over the tensor's `numel` elements of
    `element_size` bytes: each line holds ``64 // element_size`` of them (at least one), and
    holds none of the changes with probability ``(1 - nnz / numel) ** per_line``. 0 when
    `numel` or `element_size` is 0 (not given).

    Examples:
        >>> from patchctx._cost import touched_lines
        >>> round(touched_lines(1, 2**20, 2)), round(touched_lines(2**19, 2**20, 2))
        (1, 32768)
    """
    if numel <= 0 or element_size <= 0 or nnz <= 0:
        return 0.0
    per_line = max(1, LINE_BYTES // element_size)
    lines = -(-numel * element_size // LINE_BYTES)
    density = min(nnz / numel, 1.0)
    return lines * -math.expm1(per_line * math.log1p(-density)) if density < 1 else float(lines)


class _Slabs(torch.nn.Module):
    """`count` parameters ``w0``, ``w1``, ... loaded by plain copies (learnable routes)."""

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


def _sorted_positions(numel: int, nnz: int, where: torch.device, seed: int) -> torch.Tensor:
    """`nnz` distinct positions below `numel` at random, sorted, in the index dtype."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(numel, generator=generator)[:nnz].sort().values
    return positions.to(device=where, dtype=torch.int32 if numel < 2**31 else torch.int64)


def _measure_payload(
    payload: Callable[[CheckpointWeightPatch], object],
    measured: dict[str, float],
    numel: int,
    dtype: torch.dtype,
    where: torch.device,
    repeats: int,
    plane: UpdateCost,
) -> dict[str, float]:
    """What `payload` costs beyond the apply already `measured`: per byte, per sparse element.

    Dense patches of two sizes give the slope per byte; sparse patches of one element and of
    a tenth of the tensor (their smallest encoding, or flat at `plane`'s
    `UpdateCost.position_bytes`) give what the data plane spends per
    changed element beyond their bytes at that slope (positions encoded, decoded, checked).
    The apply `measured` (per byte, per element and line) is taken off both, since a
    `payload` that applies the patch, as a worker does, pays it too.
    """
    from patchctx._encoding import positions_summary
    from patchctx._patch import CheckpointWeightPatch
    from patchctx._strategies import Auto

    small, numel = 256, max(numel, 64 * 256)

    def carried(patch: CheckpointWeightPatch) -> float:
        payload(patch)  # first use (buffers, routes, imports) not counted
        return _fastest(lambda: payload(patch), where, repeats)

    def dense(size: int) -> float:
        values = torch.ones(size, dtype=dtype, device=where)
        return carried(CheckpointWeightPatch("w0", (size,), dtype, values))

    itemsize = dtype.itemsize
    slope = (dense(numel) - dense(small)) / ((numel - small) * itemsize)
    per_byte = max(slope - measured["dense_seconds_per_byte"], 0.0)
    found = {"payload_seconds_per_byte": per_byte + 0.0}
    if Auto().unsupported_reason(dtype) is not None:
        return found  # no sparse patch of this dtype travels under the default strategy

    def sparse(nnz: int) -> tuple[float, int]:
        positions = _sorted_positions(numel, nnz, where, seed=2)
        values = torch.ones(nnz, dtype=dtype, device=where)
        _, size = positions_summary(positions, numel).smallest()
        if plane.position_bytes > 0:
            size = round(nnz * plane.flat_position_bytes(numel))
        spent = carried(CheckpointWeightPatch("w0", (numel,), dtype, values, positions))
        return spent, nnz * itemsize + size

    many = max(numel // 10, 2)
    (spent_one, bytes_one), (spent_many, bytes_many) = sparse(1), sparse(many)
    applied = (many - 1) * measured["sparse_seconds_per_element"] + (
        touched_lines(many, numel, itemsize) - touched_lines(1, numel, itemsize)
    ) * measured["sparse_seconds_per_line"]
    rest = spent_many - spent_one - (bytes_many - bytes_one) * per_byte - applied
    found["plane_seconds_per_element"] = max(rest, 0.0) / (many - 1) + 0.0
    return found


def _measure_diff(
    numel: int, dtype: torch.dtype, source: torch.dtype, where: torch.device, repeats: int
) -> dict[str, float]:
    """The trainer's side, from a `source` tensor to a patch in `dtype` and its positions.

    A diff with one change scans the whole tensor (`scan_seconds_per_element`); ones with a
    tenth and a half changed also gather their positions and values: the slope between them
    is `diff_seconds_per_element`, and what the tenth's time holds beyond that slope's share
    raises the scan (a changed element costs several times more at a tenth than at a half:
    a line fitted through one and a tenth would price a half's gather several times over,
    on the densities where the choice is close); one
    made to go dense at its first change stops scanning there and casts the tensor
    (`dense_diff_seconds_per_byte`, the scan of the block it read taken off). Encoding the
    positions is `plane_seconds_per_element` (the data plane's, as the trainer's codec
    does; `calibrate` with a `payload` measures it through the caller's plane instead).
    """
    from patchctx._changes import block_size
    from patchctx._choose import diff_tensor
    from patchctx._encoding import encode_positions, positions_summary
    from patchctx._strategies import Auto, BoolMask

    numel = max(numel, 64 * 256)
    strategy = BoolMask() if Auto().unsupported_reason(dtype) is not None else Auto()
    generator = torch.Generator().manual_seed(1)
    old = {"w": torch.zeros(numel, dtype=dtype, device=where)}
    base = torch.zeros(numel, dtype=source, device=where)
    draw = torch.rand(numel, generator=generator)
    changed, half = (draw < 0.1).to(where), (draw < 0.5).to(where)
    many, most = {"w": base.masked_fill(changed, 1)}, {"w": base.masked_fill(half, 1)}
    one, first = {"w": base.clone()}, {"w": base.clone()}
    one["w"][numel // 2] = 1
    first["w"][0] = 1
    nnz = max(int(changed.sum()), 2)
    nnz_half = max(int(half.sum()), nnz + 1)

    def diff(new: dict[str, torch.Tensor], dense_above: float | None = None) -> object:
        # One tensor's diff, by wire size (`diff_state_dicts` adds its checks once per call).
        return diff_tensor("w", old["w"], new["w"], dtype, strategy, dense_above)

    spent_one = _fastest(lambda: diff(one), where, repeats)
    spent_tenth = _fastest(lambda: diff(many), where, repeats)
    spent_half = _fastest(lambda: diff(most), where, repeats)
    gather = max(spent_half - spent_tenth, 0.0) / (nnz_half - nnz)
    scan = max(spent_tenth - nnz * gather, spent_one) / numel
    to_dense = _fastest(lambda: diff(first, dense_above=0.5 / numel), where, repeats)
    scanned = min(block_size(where), numel) * spent_one / numel  # the plain scan of a block
    cast = max(to_dense - scanned, 0.0) / (numel * dtype.itemsize)
    positions = _sorted_positions(numel, nnz, where, seed=3)
    summary = positions_summary(positions, numel)
    encoding, _ = summary.smallest()
    encode = _fastest(lambda: encode_positions(positions, summary, encoding), where, repeats)
    return {
        "scan_seconds_per_element": scan + 0.0,
        "diff_seconds_per_element": gather + 0.0,
        "dense_diff_seconds_per_byte": cast + 0.0,
        "plane_seconds_per_element": encode / nnz + 0.0,
    }


class _Rig:
    """What `_measure_costs` times: applies as a worker makes them, on `_Slabs` models."""

    def __init__(self, dtype: torch.dtype, where: torch.device, repeats: int) -> None:
        from patchctx._strategies import Auto, BoolMask

        self.dtype, self.where, self.repeats = dtype, where, repeats
        # The default strategy, as a worker's; for the dtypes it cannot stage (bool,
        # complex), the one it names instead.
        self.strategy = BoolMask() if Auto().unsupported_reason(dtype) is not None else None
        self.generator = torch.Generator().manual_seed(0)

    def load(self, model: _Slabs, patches: list[CheckpointWeightPatch], routes: RouteCache) -> None:
        """Apply `patches` to `model` along `routes`, as a worker does."""
        from patchctx._load import load_checkpoint_weight_patches

        load_checkpoint_weight_patches(model, patches, routes=routes, strategy=self.strategy)

    def fastest(self, fn: Callable[[], object]) -> float:
        """`_fastest` on this rig's device."""
        return _fastest(fn, self.where, self.repeats)

    def dense_time(self, size: int) -> float:
        """A dense patch of `size`, along its route (learnt by the first call's dry run)."""
        from patchctx._load import RouteCache
        from patchctx._patch import CheckpointWeightPatch

        dtype, where = self.dtype, self.where
        model, cache = _Slabs(1, size, dtype, where), RouteCache(learn_dense=True)
        ones = torch.ones(size, dtype=dtype, device=where)
        patch = CheckpointWeightPatch("w0", (size,), dtype, ones)
        self.load(model, [patch], cache)
        return self.fastest(lambda: self.load(model, [patch], cache))

    def sparse_patch(self, numel: int, nnz: int) -> CheckpointWeightPatch:
        """`nnz` ones at sorted random positions of ``w0``, a tensor of `numel`."""
        from patchctx._patch import CheckpointWeightPatch

        positions = torch.randperm(numel, generator=self.generator)[:nnz].sort().values
        return CheckpointWeightPatch(
            "w0",
            (numel,),
            self.dtype,
            torch.ones(nnz, dtype=self.dtype, device=self.where),
            positions.to(device=self.where, dtype=torch.int32 if numel < 2**31 else torch.int64),
        )

    def sparse_time(
        self, model: _Slabs, routes: RouteCache, numel: int, nnz: int
    ) -> tuple[float, WireEncoding]:
        """What the receiver does: decode the positions (smallest encoding), then replay."""
        from patchctx._encoding import decode_positions, encode_positions, positions_summary

        patch = self.sparse_patch(numel, nnz)
        assert patch.indices is not None
        summary = positions_summary(patch.indices, numel)
        encoding, _ = summary.smallest()
        data = encode_positions(patch.indices, summary, encoding)

        def receive() -> None:
            indices = decode_positions(data, numel, nnz, encoding)
            self.load(model, [patch._replace(indices=indices)], routes)

        return self.fastest(receive), encoding

    def per_patch(self, *, dense: bool, small: int = 256, count: int = 33) -> float:
        """One more small patch in a call of many, as a worker's update is: (many - one) / count."""
        from patchctx._encoding import decode_positions, encode_positions, positions_summary
        from patchctx._load import RouteCache
        from patchctx._patch import CheckpointWeightPatch

        dtype, where = self.dtype, self.where
        slabs, cache = _Slabs(count, small, dtype, where), RouteCache(learn_dense=True)
        names = [f"w{k}" for k in range(count)]
        if dense:
            ones = torch.ones(small, dtype=dtype, device=where)
            patches = [CheckpointWeightPatch(name, (small,), dtype, ones) for name in names]

            def call(upto: int) -> None:
                self.load(slabs, patches[:upto], cache)

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
                self.load(slabs, received, cache)

        call(count)  # records (or learns) every route
        single = self.fastest(lambda: call(1))
        return max(self.fastest(lambda: call(count)) - single, 0.0) / (count - 1)


def _measure_costs(
    *, numel: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> dict[str, float]:
    """`UpdateCost.calibrate`'s apply fields, measured on `_Slabs` models (see `_Rig`)."""
    from patchctx._encoding import (
        WireEncoding,
        decode_positions,
        encode_positions,
        positions_summary,
    )
    from patchctx._load import RouteCache

    small = 256
    numel = max(numel, 64 * small)
    rig = _Rig(dtype, torch.device(device), repeats)
    model, routes = _Slabs(1, numel, dtype, rig.where), RouteCache()
    rig.load(model, [rig.sparse_patch(numel, 1)], routes)  # records the route
    sparse_fixed, _ = rig.sparse_time(model, routes, numel, 1)
    dense_fixed = rig.dense_time(small)
    dense_total = rig.dense_time(numel)
    per_byte = (dense_total - dense_fixed) / ((numel - small) * dtype.itemsize)
    # A bitmask's decode, per element of the tensor (a quarter of it set).
    mask_positions = rig.sparse_patch(numel, numel // 4).indices
    assert mask_positions is not None
    summary = positions_summary(mask_positions, numel)
    mask = encode_positions(mask_positions, summary, WireEncoding.BITMASK)
    bits = numel // 4
    per_bit = rig.fastest(lambda: decode_positions(mask, numel, bits, WireEncoding.BITMASK)) / numel
    # Replay: a time per changed element, and one per 64-byte line it writes into (a random
    # write fetches and writes back a whole line; at a few percent most lines hold one
    # change, by tens of percent every line holds several). Two densities, 1% and 50%, give
    # both, each decoded from its smallest encoding (gaps, then a bitmask, whose decode is
    # `per_bit`'s and taken off).
    equations = []
    for nnz in (max(numel // 100, 1), numel // 2):
        spent, encoding = rig.sparse_time(model, routes, numel, nnz)
        spent -= sparse_fixed
        if encoding is WireEncoding.BITMASK:
            spent -= per_bit * numel
        equations.append((float(nnz), touched_lines(nnz, numel, dtype.itemsize), max(spent, 0.0)))
    per_element, per_line = _per_element_and_line(equations)
    measured = {
        "sparse_seconds_per_element": per_element,
        "sparse_seconds_per_line": per_line,
        "bitmask_seconds_per_element": per_bit,
        "dense_seconds_per_byte": max(per_byte, 0.0),
        "sparse_seconds_per_patch": rig.per_patch(dense=False),
        "dense_seconds_per_patch": rig.per_patch(dense=True),
    }
    # Zero over a negative determinant is -0.0: a "negative" cost to whoever reads it.
    return {name: value + 0.0 for name, value in measured.items()}


def _per_element_and_line(equations: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Solve two (changed elements, lines written, seconds) for a time per element and line."""
    (n1, l1, t1), (n2, l2, t2) = equations
    determinant = n1 * l2 - n2 * l1
    per_element = (t1 * l2 - t2 * l1) / determinant if determinant else t2 / n2
    per_line = (n1 * t2 - n2 * t1) / determinant if determinant else 0.0
    if per_line < 0:  # no cost by line to be seen: all of it by element
        return t2 / n2, 0.0
    if per_element < 0:  # all of it by line
        return 0.0, t2 / l2
    return per_element, per_line
