"""Wire bytes per encoding, and total update time: sparse only, dense only, patchctx's choice.

Two tables, one process, one torch thread (``torch.set_num_threads(1)``):

1. **Bytes** (computed, exact): for random sorted positions at each density, the bytes of a
   sparse patch's values plus its positions as flat ``indices``, ``gaps`` and ``bitmask``, the
   dense patch's bytes, and the encoding `wire_encoding` picks.
2. **Update time** (measured): one decoder layer at one tensor-parallel rank (the model of
   ``benchmarks.patch_bench``), a random change at each density, applied three ways, methods
   interleaved with their order rotating, min and median over ``--repeats`` rounds (the
   garbage collector off while timing, as ``timeit`` does):

   - ``sparse-only``: every tensor as a sparse patch (positions in their smallest encoding,
     decoded, then replayed through a `RouteCache` in the steady state);
   - ``dense-reload``: every tensor's full new values loaded through the model's loader with
     plain copies (what a trainer would do without patchctx);
   - ``dense-patchctx``: every tensor as a dense patch through
     `load_checkpoint_weight_patches` (what patchctx does with the dense part of a choice:
     every variant's routes are learned first with `RouteCache.warm`, as a vLLM worker's are
     at start, so dense patches follow them);
   - ``choice``: `diff_state_dicts(old, new, cost=UpdateCost(link_bytes_per_second=B,
     payload_seconds_per_byte=0, diff_seconds_per_element=0, ...))`: the trainer's and the
     data plane's terms at 0 (this bench does not time the
     data plane or the diff, so its choice leaves them out; ``./dev bench --engine`` times
     the whole path with the full model), the sparse patches decoded and everything applied
     with `load_checkpoint_weight_patches` (routes in the steady state).

   The total of each is ``wire bytes / B`` (at each ``--bandwidths`` B) plus the measured
   decode and apply time. ``ratio`` is the choice's total over the better of sparse-only and
   dense-reload, the goal of issue 14 being at most 1.05 at every density; ``own`` is the
   same over sparse-only and dense-patchctx, which isolates the cost model's choice from the
   fixed costs of patchctx's dense path.

Run ``python -m benchmarks.wire_bench`` (a few minutes on 2 CPU cores), ``--quick`` for a smoke
run, ``--json`` for the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.patch_bench import PackedSlice, collector_off
from patchctx import (
    CheckpointWeightPatch,
    RouteCache,
    UpdateCost,
    WireEncoding,
    diff_state_dicts,
    load_checkpoint_weight_patches,
    patch_nbytes,
    wire_encoding,
    wire_sizes,
)
from patchctx._encoding import decode_positions, encode_positions, positions_summary

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {"1024x1024": (1024, 1024), "4096x4096": (4096, 4096), "11008x4096": (11008, 4096)}
METHODS = ("sparse-only", "dense-reload", "dense-patchctx", "choice")


# This bench times wire, decode and apply only, not the data plane's encode and checksums or the
# trainer's diff: its choices use the default costs without those two terms.
APPLY_ONLY = UpdateCost(
    payload_seconds_per_byte=0.0,
    diff_seconds_per_element=0.0,
    scan_seconds_per_element=0.0,
    dense_diff_seconds_per_byte=0.0,
    plane_seconds_per_element=0.0,
)


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


_STARTED = time.perf_counter()


def random_positions(numel: int, density: float, generator: torch.Generator) -> torch.Tensor:
    """Sorted unique positions: each element changed with probability `density`."""
    return (torch.rand(numel, generator=generator) < density).nonzero().view(-1)


# ---------------------------------------------------------------------------------- bytes


@dataclass
class BytesRow:
    dtype: str
    shape: str
    density: float
    changed: int
    dense: int
    indices: int
    gaps: int
    bitmask: int
    chosen: str
    chosen_over_dense: float


def bytes_rows(args: argparse.Namespace) -> list[BytesRow]:
    rows = []
    generator = torch.Generator().manual_seed(args.seed)
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        numel = math.prod(shape)
        for density in args.densities:
            positions = random_positions(numel, density, generator).to(torch.int32)
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                values = torch.zeros(positions.numel(), dtype=dtype)
                patch = CheckpointWeightPatch("w", shape, dtype, values, positions)
                sizes = wire_sizes(patch)
                chosen = wire_encoding(patch)
                dense = numel * dtype.itemsize
                rows.append(
                    BytesRow(
                        dtype_name,
                        shape_name,
                        density,
                        positions.numel(),
                        dense,
                        sizes[WireEncoding.INDICES],
                        sizes[WireEncoding.GAPS],
                        sizes[WireEncoding.BITMASK],
                        chosen.value,
                        min(sizes.values()) / dense,
                    )
                )
    return rows


def bytes_table(rows: list[BytesRow]) -> str:
    lines = [
        "Wire bytes of one tensor's update (values + positions), per encoding, and the choice",
        "",
        f"{'dtype':5} {'shape':>10} {'density':>8} {'changed':>10} {'dense':>11} "
        f"{'indices':>11} {'gaps':>11} {'bitmask':>11} {'chosen':>8} {'/dense':>7}",
        "-" * 104,
    ]
    for r in rows:
        lines.append(
            f"{r.dtype:5} {r.shape:>10} {r.density:>8.2%} {r.changed:>10} {r.dense:>11} "
            f"{r.indices:>11} {r.gaps:>11} {r.bitmask:>11} {r.chosen:>8} "
            f"{r.chosen_over_dense:>7.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- time


@dataclass
class TimeRow:
    dtype: str
    hidden: int
    density: float
    bandwidth: float  # bytes per second
    method: str
    wire_bytes: int
    wire_ms: float
    decode_ms: float
    apply_min_ms: float
    apply_median_ms: float
    total_min_ms: float
    total_median_ms: float
    sparse_tensors: int
    tensors: int
    ratio_min: float | None = None
    ratio_median: float | None = None
    own_min: float | None = None
    own_median: float | None = None
    identical: bool | None = None


@dataclass
class Variant:
    """One way of sending an update: its patches, where they land, what it measured."""

    patches: list[CheckpointWeightPatch]
    model: PackedSlice
    routes: RouteCache | None
    encoded: list[tuple[torch.Tensor, int, int, WireEncoding]] = field(default_factory=list)
    applies: list[float] = field(default_factory=list)
    decodes: list[float] = field(default_factory=list)


def _encode(patches: Iterable[CheckpointWeightPatch]) -> list[tuple[torch.Tensor, int, int, Any]]:
    """Each sparse patch's positions as the codec sends them: (bytes, numel, count, encoding)."""
    out = []
    for patch in patches:
        if patch.indices is None:
            continue
        numel = math.prod(patch.shape)
        summary = positions_summary(patch.indices, numel)
        encoding, _ = summary.smallest()
        data = encode_positions(patch.indices, summary, encoding)
        out.append((data, numel, patch.indices.numel(), encoding))
    return out


def _decode(encoded: list[tuple[torch.Tensor, int, int, WireEncoding]]) -> None:
    for data, numel, count, encoding in encoded:
        decode_positions(data, numel, count, encoding)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _model(hidden: int, dtype: torch.dtype, start: dict[str, torch.Tensor]) -> PackedSlice:
    model = PackedSlice(hidden, 2, 0, dtype, "cpu")
    model.load_weights(start.items())
    return model


def _apply(variant: Variant) -> None:
    load_checkpoint_weight_patches(variant.model, variant.patches, routes=variant.routes)


def _dense_reload(model: PackedSlice, checkpoint: dict[str, torch.Tensor]) -> None:
    model.load_weights(checkpoint.items())


def time_rows(args: argparse.Namespace) -> list[TimeRow]:
    rows: list[TimeRow] = []
    for hidden in args.hidden:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            generator = torch.Generator().manual_seed(args.seed)
            shapes = PackedSlice(hidden, 2, 0, dtype, "meta").shapes
            old = {
                n: (torch.randn(s, generator=generator) * 0.02).to(dtype) for n, s in shapes.items()
            }
            for density in args.densities:
                rows += _time_density(args, hidden, dtype_name, dtype, old, density, generator)
    return rows


def _time_density(
    args: argparse.Namespace,
    hidden: int,
    dtype_name: str,
    dtype: torch.dtype,
    old: dict[str, torch.Tensor],
    density: float,
    generator: torch.Generator,
) -> list[TimeRow]:
    progress(f"{dtype_name} hidden {hidden} {density:.2%}: diffing")
    new = {}
    for name, tensor in old.items():
        flat = tensor.clone().view(-1)
        positions = random_positions(flat.numel(), density, generator)
        flat[positions] += torch.full((positions.numel(),), 0.5, dtype=dtype)
        new[name] = flat.view(tensor.shape)
    # every tensor sparse (sparse is free) or every tensor dense (sparse costs a second)
    all_sparse = replace(
        APPLY_ONLY,
        sparse_seconds_per_element=0.0,
        bitmask_seconds_per_element=0.0,
        sparse_seconds_per_patch=0.0,
        dense_seconds_per_byte=1.0,
    )
    all_dense = UpdateCost(sparse_seconds_per_patch=1.0)
    variants: dict[str, Variant] = {}
    keys: dict[str, str] = {}

    def variant(patches: list[CheckpointWeightPatch]) -> str:
        key = "".join("D" if p.indices is None else "s" for p in patches)
        if key not in variants:
            model, routes = _model(hidden, dtype, old), RouteCache()
            # The steady state of a worker: every route known (vLLM's backend warms them at
            # start), so dense patches follow their routes as sparse ones do.
            routes.warm(model, [(n, tuple(t.shape), t.dtype) for n, t in old.items()])
            variants[key] = Variant(patches, model, routes)
        return key

    keys["sparse-only"] = variant(diff_state_dicts(old, new, cost=all_sparse))
    keys["dense-patchctx"] = variant(diff_state_dicts(old, new, cost=all_dense))
    assert set(keys["sparse-only"]) == {"s"} and set(keys["dense-patchctx"]) == {"D"}
    for bandwidth in args.bandwidths:
        cost = replace(APPLY_ONLY, link_bytes_per_second=bandwidth)
        keys[f"choice {bandwidth:g}"] = variant(diff_state_dicts(old, new, cost=cost))
    for each in variants.values():
        each.encoded = _encode(each.patches)
        _apply(each)  # records the routes: the rounds below are the steady state
    dense_model = _model(hidden, dtype, old)
    dense_times: list[float] = []
    methods: list[tuple[str, Callable[[], None]]] = [
        ("dense-reload", partial(_dense_reload, dense_model, new))
    ]
    methods += [(key, partial(_apply, v)) for key, v in variants.items()]
    progress(f"{dtype_name} hidden {hidden} {density:.2%}: {args.repeats} rounds x {len(methods)}")
    with collector_off():
        for round_ in range(args.repeats):
            shift = round_ % len(methods)
            for key, fn in methods[shift:] + methods[:shift]:
                if key == "dense-reload":
                    dense_times.append(_timed(fn))
                else:
                    each = variants[key]
                    each.decodes.append(_timed(partial(_decode, each.encoded)))
                    each.applies.append(_timed(fn))
    reference = dict(dense_model.named_parameters())
    dense_bytes = sum(t.numel() * t.element_size() for t in new.values())
    rows: list[TimeRow] = []
    for bandwidth in args.bandwidths:
        measured: dict[str, TimeRow] = {}
        for method in METHODS:
            wire_s = 0.0
            if method == "dense-reload":
                wire, decode, applies, n_sparse, identical = dense_bytes, 0.0, dense_times, 0, None
            else:
                each = variants[keys[method if method != "choice" else f"choice {bandwidth:g}"]]
                wire = patch_nbytes(each.patches)
                decode = min(each.decodes)
                applies = each.applies
                n_sparse = sum(p.indices is not None for p in each.patches)
                identical = all(
                    torch.equal(p, reference[name]) for name, p in each.model.named_parameters()
                )
            wire_s = wire / bandwidth
            measured[method] = TimeRow(
                dtype_name,
                hidden,
                density,
                bandwidth,
                method,
                wire,
                wire_s * 1e3,
                decode * 1e3,
                min(applies) * 1e3,
                statistics.median(applies) * 1e3,
                (wire_s + decode + min(applies)) * 1e3,
                (wire_s + decode + statistics.median(applies)) * 1e3,
                n_sparse,
                len(old),
                identical=identical,
            )
        choice = measured["choice"]
        for field_min, field_median, dense in (
            ("ratio_min", "ratio_median", "dense-reload"),
            ("own_min", "own_median", "dense-patchctx"),
        ):
            pair = ("sparse-only", dense)
            best_min = min(measured[m].total_min_ms for m in pair)
            best_median = min(measured[m].total_median_ms for m in pair)
            setattr(choice, field_min, choice.total_min_ms / best_min)
            setattr(choice, field_median, choice.total_median_ms / best_median)
        rows += measured.values()
    return rows


def time_table(rows: list[TimeRow]) -> str:
    lines = [
        "Total update time = wire bytes / bandwidth + decode + apply (ms; apply: min / median)",
        "",
        f"{'dtype':5} {'hidden':>6} {'density':>8} {'link':>7} {'method':14} {'wire MB':>8} "
        f"{'wire':>8} {'decode':>7} {'apply min':>9} {'median':>8} {'total min':>9} "
        f"{'median':>8} {'sparse':>6} {'ratio':>11} {'own':>11} same",
        "-" * 152,
    ]
    for r in rows:
        ratio = "" if r.ratio_min is None else f"{r.ratio_min:.2f}/{r.ratio_median:.2f}"
        own = "" if r.own_min is None else f"{r.own_min:.2f}/{r.own_median:.2f}"
        same = "" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(
            f"{r.dtype:5} {r.hidden:>6} {r.density:>8.2%} {r.bandwidth / 1e9:>5g}GB "
            f"{r.method:14} {r.wire_bytes / 1e6:>8.2f} {r.wire_ms:>8.2f} {r.decode_ms:>7.2f} "
            f"{r.apply_min_ms:>9.2f} {r.apply_median_ms:>8.2f} {r.total_min_ms:>9.2f} "
            f"{r.total_median_ms:>8.2f} {r.sparse_tensors:>3}/{r.tensors:<2} {ratio:>11} {own:>11} "
            f"{same}"
        )
    choices = [r for r in rows if r.ratio_median is not None]
    if choices:
        lines += [
            "",
            "ratio: the choice's total over the better of sparse-only and dense-reload "
            "(min/median); worst median "
            f"{max(r.ratio_median or 0 for r in choices):.3f}, worst min "
            f"{max(r.ratio_min or 0 for r in choices):.3f}",
            "own: the same over the better of sparse-only and dense-patchctx (the cost model's "
            "own choice between what patchctx does); worst median "
            f"{max(r.own_median or 0 for r in choices):.3f}, worst min "
            f"{max(r.own_min or 0 for r in choices):.3f}",
            "sparse: tensors sent sparse; same: weights bit-identical to the dense reload's",
            "a choice that equals sparse-only or dense-patchctx (every tensor sparse, or every "
            "one dense) is that measurement",
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="python -m benchmarks.wire_bench",
        description="patchctx wire encodings and the sparse-or-dense choice: bytes per encoding "
        "against density, and total update time (wire at a stated bandwidth plus measured "
        "decode and apply) for sparse-only, dense-only and patchctx's choice.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cli.add_argument(
        "--densities",
        type=_floats,
        default="0.0001,0.001,0.01,0.03,0.1,0.3,0.5",
        help="fractions of each tensor changed (comma-separated)",
    )
    cli.add_argument("--dtypes", type=_names, default="bf16,fp32", help="bf16 and/or fp32")
    cli.add_argument(
        "--shapes", type=_names, default=",".join(SHAPES), help="shapes of the bytes table"
    )
    cli.add_argument(
        "--hidden", type=_ints, default="1024,4096", help="hidden sizes of the time table"
    )
    cli.add_argument(
        "--bandwidths",
        type=_floats,
        default="10e9,1e9",
        help="link bandwidths in bytes per second (comma-separated)",
    )
    cli.add_argument("--repeats", type=int, default=5, help="measured rounds per row")
    cli.add_argument("--seed", type=int, default=0, help="seed of the weights and changes")
    cli.add_argument(
        "--only", choices=["bytes", "time"], help="one of the two tables (default: both)"
    )
    cli.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds: hidden 256, shape 1024x1024, 2 rounds",
    )
    cli.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the rows and settings as JSON to PATH; without PATH, print the JSON "
        "instead of the tables",
    )
    return cli


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    for name in args.dtypes:
        if name not in DTYPES:
            cli.error(f"--dtypes: unknown {name!r} (choose from {', '.join(DTYPES)})")
    for name in args.shapes:
        if name not in SHAPES:
            cli.error(f"--shapes: unknown {name!r} (choose from {', '.join(SHAPES)})")
    if args.quick:
        args.hidden, args.repeats, args.shapes = [256], 2, ["1024x1024"]
    torch.set_num_threads(1)
    settings = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "repeats": args.repeats,
        "bandwidths": args.bandwidths,
        "cost": asdict(APPLY_ONLY),
        "tp": 2,
    }
    brows = [] if args.only == "time" else bytes_rows(args)
    trows = [] if args.only == "bytes" else time_rows(args)
    report = {
        "settings": settings,
        "bytes": [asdict(r) for r in brows],
        "time": [asdict(r) for r in trows],
    }
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        header = (
            f"patchctx wire bench: torch {torch.__version__}, {torch.get_num_threads()} thread, "
            f"CPU, TP 2 rank 0, {args.repeats} rounds, UpdateCost defaults without the "
            f"payload and diff terms {asdict(APPLY_ONLY)}"
        )
        parts = [header]
        if brows:
            parts.append(bytes_table(brows))
        if trows:
            parts.append(time_table(trows))
        print("\n\n".join(parts))
        if args.json is not None:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            progress(f"wrote {args.json}")
    identical = all(r.identical is not False for r in trows)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
