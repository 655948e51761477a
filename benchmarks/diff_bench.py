"""The trainer's diff against the streaming bound, and against the kernel it replaced.

    python -m benchmarks.diff_bench [--elements N] [--large] [--rounds R] [--json FILE]

For a state dict of N elements (tensors of up to 4M elements, 1024 columns) held by the trainer
in fp32 or in bf16, with a bf16 receiver, at 0.1, 2.5, 15 and 50 % of the elements changed in
bf16, one process times, interleaved and in rotated order:

- ``copy``: ``copy_`` of every tensor of old and new into a preallocated one: the bytes the
  diff must read, moved at this machine's copy bandwidth. This is the streaming bound;
- ``read``: a plain read of both, ``torch.ne(a, b).any()`` over blocks of 1M elements;
- ``torch``: the diff in plain torch, whole tensors: both cast to bf16, ``ne`` of their bits,
  ``nonzero`` (int32 positions) and a gather of the values (sparse patches, always);
- ``before``: ``diff_state_dicts`` as of the base revision (default af305ae: whole-tensor casts,
  a checkpoint-sized mask), imported from ``git archive`` as ``patchctx_base``;
- ``now``: this tree's ``diff_state_dicts``;
- ``dense``: the same, every changed tensor forced dense (``dense_above`` at 1e-12): what the
  model's path costs at most where it ends dense, once its scan stops as soon as it can.

``--position-bytes 4`` prices positions as the shm data plane sends them (flat int32,
`UpdateCost.position_bytes`), for ``now``, ``dense`` and ``before`` where the base has it.

The table shows min and median milliseconds, the ratio of each to the bound (min / min and
median / median), and the peak extra memory of one call beside the bytes of the patches it
returns. Memory is measured in a second run of this script, as ``benchmarks.patch_bench`` does:
peak RSS above the pre-call level, the kernel's peak mark reset per call, with
``MALLOC_MMAP_THRESHOLD_=65536`` so every buffer is mapped fresh and unmapped when freed (on
CUDA: ``max_memory_allocated`` after a reset). Both diffs must leave a bf16 receiver with the
same bits. One torch thread unless ``--threads``. The default run (13M elements) takes about a
minute on two shared cores; ``--large`` is 280M elements in tensors of 32M (about ten minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import patchctx
from benchmarks.patch_bench import Meter
from benchmarks.versus import import_base

SOURCES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DENSITIES = (0.001, 0.025, 0.15, 0.5)
METHODS = ("copy", "read", "torch", "before", "now", "dense")
COLUMNS = 1024
TENSOR_ELEMENTS = 1 << 22
READ_BLOCK = 1 << 20


@dataclass
class Row:
    source: str
    density: float
    changed: float  # the measured fraction of elements changed in bf16
    method: str
    min_ms: float
    median_ms: float
    ratio_min: float  # min / min of "copy"
    ratio_median: float
    peak_extra_mib: float | None = None
    patches_mib: float | None = None


def state_dicts(
    elements: int,
    source: torch.dtype,
    density: float,
    seed: int,
    device: str,
    tensor_elements: int = TENSOR_ELEMENTS,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(old, new): `density` of the elements changed by 1/16 of their value, which bf16 sees."""
    generator = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    rows_left, index = -(-elements // COLUMNS), 0
    while rows_left:
        rows = min(rows_left, tensor_elements // COLUMNS)
        before = (torch.randn(rows, COLUMNS, generator=generator) * 0.02).to(source)
        after = before.clone()
        chosen = torch.rand(rows, COLUMNS, generator=generator) < density
        after[chosen] = (after[chosen].float() * 1.0625).to(source)
        old[f"w{index}"], new[f"w{index}"] = before.to(device), after.to(device)
        rows_left -= rows
        index += 1
    return old, new


def bound_copy(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> Callable[[], None]:
    """copy_ of every tensor into one reused destination as large as the largest tensor."""
    sources = [t.view(-1) for t in (*old.values(), *new.values())]
    largest = max(t.numel() for t in sources)
    destinations = {t.dtype: torch.zeros(largest, dtype=t.dtype, device=t.device) for t in sources}

    def run() -> None:
        for source in sources:
            destinations[source.dtype][: source.numel()].copy_(source)

    return run


def plain_read(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> Callable[[], None]:
    def run() -> None:
        found = []
        for name, before in old.items():
            a, b = before.view(-1), new[name].view(-1)
            for start in range(0, a.numel(), READ_BLOCK):
                found.append(
                    torch.ne(a[start : start + READ_BLOCK], b[start : start + READ_BLOCK]).any()
                )
        torch.stack(found).any().item()

    return run


def plain_torch(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], outputs: dict[str, Any]
) -> Callable[[], None]:
    """The diff in plain torch: cast both to bf16, ``ne`` of their bits, ``nonzero``, gather.

    Sparse patches (int32 positions) of every changed tensor, into ``outputs["torch"]``.
    """

    def run() -> None:
        patches = []
        for name, before in old.items():
            after = new[name].to(torch.bfloat16).view(-1)
            changed = after.view(torch.int16) != before.to(torch.bfloat16).view(-1).view(
                torch.int16
            )
            positions = changed.nonzero().view(-1).to(torch.int32)
            if positions.numel():
                values = after[positions]
                patches.append(
                    patchctx.CheckpointWeightPatch(
                        name, tuple(before.shape), torch.bfloat16, values, positions
                    )
                )
        outputs["torch"] = patches

    return run


def same_result(
    old: Mapping[str, torch.Tensor], first: Sequence[Any], second: Sequence[Any]
) -> bool:
    """Whether a bf16 receiver holding `old` ends with the same bits after either patch list.

    The lists may differ in form: this tree chooses dense or sparse per tensor by its cost
    model and encodings, the base revision by int32 wire size alone.
    """
    if [(p.name, tuple(p.shape), p.dtype) for p in first] != [
        (p.name, tuple(p.shape), p.dtype) for p in second
    ]:
        return False
    for one, other in zip(first, second, strict=True):
        start = old[one.name].to(torch.bfloat16).reshape(-1)
        ends = []
        for patch in (one, other):
            end = start.clone()
            if patch.indices is None:
                end.copy_(patch.values.reshape(-1))
            else:
                end.index_copy_(0, patch.indices.long(), patch.values.to(end.device))
            ends.append(end.view(torch.int16))
        if not torch.equal(*ends):
            return False
    return True


def measure_row(
    base: ModuleType,
    source: str,
    density: float,
    args: argparse.Namespace,
    memory: bool,
) -> list[Row]:
    old, new = state_dicts(
        args.elements, SOURCES[source], density, 1, args.device, args.tensor_elements
    )
    elements = sum(t.numel() for t in new.values())
    changed = sum(
        int(
            (
                old[n].to(torch.bfloat16).view(torch.int16)
                != t.to(torch.bfloat16).view(torch.int16)
            ).sum()
        )
        for n, t in new.items()
    )
    outputs: dict[str, list[Any]] = {}

    def diff(module: ModuleType, method: str, **options: object) -> Callable[[], None]:
        cost = getattr(module, "UpdateCost", None)
        fields = getattr(cost, "__dataclass_fields__", {})
        if args.position_bytes and cost is not None and "position_bytes" in fields:
            options["cost"] = cost(position_bytes=args.position_bytes)

        def run() -> None:
            outputs[method] = module.diff_state_dicts(old, new, dtype=torch.bfloat16, **options)

        return run

    calls = {
        "copy": bound_copy(old, new),
        "read": plain_read(old, new),
        "torch": plain_torch(old, new, outputs),
        "before": diff(base, "before"),
        "now": diff(patchctx, "now"),
        "dense": diff(patchctx, "dense", dense_above=1e-12),
    }
    meter = Meter(args.device)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    peaks: dict[str, int | None] = {}
    if memory:
        for method in METHODS:
            outputs.pop(method, None)
            peaks[method] = meter(calls[method])[1]
    else:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            turn = round_ % len(METHODS)
            order = METHODS[turn:] + METHODS[:turn]
            for method in order:
                outputs.pop(method, None)
                elapsed, _ = meter(calls[method])
                if round_:
                    times[method].append(elapsed)
        for other in ("before", "torch", "dense"):
            if not same_result(old, outputs[other], outputs["now"]):
                raise AssertionError(f"{source} {density}: {other} and now update differently")
    rows = []
    for method in METHODS:
        sizes: dict[str, float] = {
            m: patchctx.patch_nbytes(outputs[m]) / 2**20
            for m in ("before", "now", "dense")
            if m in outputs
        }
        peak = peaks.get(method)
        if memory:
            rows.append(
                Row(
                    source,
                    density,
                    changed / elements,
                    method,
                    0,
                    0,
                    0,
                    0,
                    None if peak is None else peak / 2**20,
                    sizes.get(method),
                )
            )
            continue
        bound = times["copy"]
        rows.append(
            Row(
                source,
                density,
                changed / elements,
                method,
                min(times[method]) * 1e3,
                statistics.median(times[method]) * 1e3,
                min(times[method]) / min(bound),
                statistics.median(times[method]) / statistics.median(bound),
                patches_mib=sizes.get(method),
            )
        )
    return rows


def table(rows: Sequence[Row], settings: Mapping[str, object]) -> str:
    lines = [
        f"diff_state_dicts, bf16 receiver, {settings['elements']:,} elements in tensors of "
        f"at most {settings['tensor_elements']:,}, "
        f"{settings['threads']} torch thread(s), {settings['device']}, "
        f"{settings['rounds']} rounds; before = {settings['base']}; "
        f"UpdateCost.position_bytes {settings['position_bytes']:g}",
        f"{'source':>6} {'density':>8} {'method':>7} {'min ms':>8} {'med ms':>8} "
        f"{'x bound':>8} {'x b.med':>8} {'peak MiB':>9} {'out MiB':>8}",
    ]
    for row in rows:
        peak = "" if row.peak_extra_mib is None else f"{row.peak_extra_mib:9.1f}"
        out = "" if row.patches_mib is None else f"{row.patches_mib:8.1f}"
        lines.append(
            f"{row.source:>6} {row.changed * 100:7.2f}% {row.method:>7} {row.min_ms:8.1f} "
            f"{row.median_ms:8.1f} {row.ratio_min:8.2f} {row.ratio_median:8.2f} {peak:>9} {out:>8}"
        )
    lines += [
        "columns:",
        "  density   elements whose bf16 bits changed",
        "  x bound   min / min of copy (the streaming bound); x b.med: median / median",
        "  peak MiB  peak extra memory of one call (RSS, buffers mapped fresh; CUDA: allocator)",
        "  out MiB   bytes of the patches returned (patch_nbytes)",
        "methods:",
        "  copy      copy_ of old and new into a preallocated tensor: the streaming bound",
        "  read      torch.ne(a, b).any() over 1M-element blocks of old and new",
        "  torch     the diff in plain torch: cast, ne of the bits, nonzero (int32), gather",
        "  before    diff_state_dicts of the base revision",
        "  now       diff_state_dicts of this tree",
        "  dense     the same, forced dense (dense_above=1e-12)",
    ]
    return "\n".join(lines)


def progress(started: float, message: str) -> None:
    print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--elements", type=int, default=13_000_000, help="default 13M")
    parser.add_argument("--tensor-elements", type=int, default=TENSOR_ELEMENTS, help="default 4M")
    parser.add_argument(
        "--large", action="store_true", help="280M elements in tensors of 32M, 3 rounds"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--base", default="af305ae", help="revision of 'before'")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--sources", default="fp32,bf16", help="trainer dtypes: fp32,bf16")
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    parser.add_argument(
        "--position-bytes",
        type=float,
        default=0.0,
        help="UpdateCost.position_bytes of the diffs (4: the shm plane; default 0)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.large:
        args.elements, args.tensor_elements, args.rounds = 280_000_000, 1 << 25, 3
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        for source in args.sources.split(","):
            for density in map(float, args.densities.split(",")):
                what = "memory" if args.memory_only else "times"
                progress(started, f"{what}: {source} {density * 100:.1f}%")
                rows += measure_row(base, source, density, args, args.memory_only)
    if args.memory_only:
        print(json.dumps([asdict(row) for row in rows]))
        return 0
    rows = merge_memory(rows, argv if argv is not None else sys.argv[1:], args, started)
    settings = {
        "elements": args.elements,
        "tensor_elements": args.tensor_elements,
        "threads": args.threads,
        "device": args.device,
        "rounds": args.rounds,
        "base": args.base,
        "position_bytes": args.position_bytes,
        "torch": torch.__version__,
    }
    print(table(rows, settings))
    if args.json is not None:
        report = {"settings": settings, "rows": [asdict(row) for row in rows]}
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    progress(started, "done")
    return 0


def merge_memory(
    rows: list[Row], argv: Sequence[str], args: argparse.Namespace, started: float
) -> list[Row]:
    """Peak memory from a second run of this script, every buffer mapped fresh (CPU)."""
    progress(started, "memory: a second run, every buffer mapped fresh")
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    command = [sys.executable, "-m", "benchmarks.diff_bench", *argv, "--memory-only"]
    found = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
    sized = {(r["source"], r["density"], r["method"]): r for r in json.loads(found.stdout)}
    for row in rows:
        measured = sized[(row.source, row.density, row.method)]
        row.peak_extra_mib = measured["peak_extra_mib"]
    return rows


if __name__ == "__main__":
    sys.exit(main())
