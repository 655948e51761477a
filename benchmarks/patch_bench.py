"""Side-by-side benchmark: sparse patches on a packed-QKV tensor-parallel slice and an MLP weight.

Every method applies the same random sparse patches to its own copy of one model, in one
process, interleaved (the order of methods rotates from repeat to repeat):

- ``baseline``: vLLM's ``load_checkpoint_weight_patches`` when vLLM is importable, else the same
  algorithm written out (``benchmarks/baseline.py``); the table says which ran;
- ``patchctx``: ``load_checkpoint_weight_patches`` without routes (the loader path);
- ``patchctx+routes``: with a ``RouteCache`` in the steady state (routes recorded beforehand; the
  recording round is reported on its own line);
- ``lower-bound``: a bare ``index_copy_`` of already-known destination positions and values;
- ``dense-reload``: loading the full patched tensors through the loader with plain copies.

For each (dtype, density): the median milliseconds of one round (a patch to each of the four
checkpoint tensors), the ratio to the baseline, the peak extra memory of a round, and whether
every method ended with bit-identical weights.

Memory is measured, not computed: on CPU, the process's peak RSS above its level before the
call, with the kernel's peak mark reset per measurement; on CUDA, ``max_memory_allocated``
after a reset. On CPU the script runs itself twice and merges the rows: once for times, with
the default allocator (a long-running worker reuses freed memory), and once for memory, with
``MALLOC_MMAP_THRESHOLD_=65536`` so that every buffer is mapped fresh and unmapped on free (the
RSS then sees every allocation; that run's times would include page faults the first run does
not pay).

Run ``./dev bench`` (this script with its defaults, about two minutes on 2 CPU cores), or
``python -m benchmarks.patch_bench --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.baseline import nan_swap_load, vllm_function
from benchmarks.machine import other_load, verdict_line
from benchmarks.realistic import realistic_update
from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches
from patchctx._model import model_tensors
from patchctx._strategies import indexable
from patchctx._undo import storage_flat

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
METHODS = ("baseline", "patchctx", "patchctx+routes", "lower-bound", "dense-reload")


# ---------------------------------------------------------------------------------- model


class PackedSlice(nn.Module):
    """One decoder layer's worth at one tensor-parallel rank, loaded the way vLLM loads it.

    Checkpoint: ``q_proj`` [heads*hd, hidden], ``k_proj``/``v_proj`` [kv*hd, hidden] (packed
    into one parameter, each narrowed to this rank's rows) and ``mlp.weight`` [inter, hidden]
    (loaded whole).
    """

    def __init__(self, hidden: int, tp: int, rank: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.head_dim = min(128, hidden // 4)
        heads = hidden // self.head_dim
        kv_heads = max(tp, heads // 4)
        self.rank = rank
        self.q_local = heads // tp * self.head_dim
        self.kv_local = kv_heads // tp * self.head_dim
        self.inter = hidden * 11008 // 4096
        rows = self.q_local + 2 * self.kv_local
        self.qkv = nn.Parameter(
            torch.empty(rows, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.mlp = nn.Parameter(
            torch.empty(self.inter, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.shapes: dict[str, tuple[int, ...]] = {
            "q_proj.weight": (heads * self.head_dim, hidden),
            "k_proj.weight": (kv_heads * self.head_dim, hidden),
            "v_proj.weight": (kv_heads * self.head_dim, hidden),
            "mlp.weight": (self.inter, hidden),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "mlp.weight":
                self.mlp.data.copy_(tensor)
                loaded.add("mlp")
                continue
            offset, size = {
                "q_proj.weight": (0, self.q_local),
                "k_proj.weight": (self.q_local, self.kv_local),
                "v_proj.weight": (self.q_local + self.kv_local, self.kv_local),
            }[name]
            shard = tensor.narrow(0, self.rank * size, size)
            self.qkv.data.narrow(0, offset, size).copy_(shard)
            loaded.add("qkv")
        return loaded


# ------------------------------------------------------------------------------ measuring


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Time with the garbage collector off, as ``timeit`` does (one collection first).

    A collection just before a timed call evicts the caches: on this machine it made the call
    after it 0.4-0.6 ms slower, several times a small update's whole cost, which no worker
    pays in its steady state.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Meter:
    """Wall time and peak extra memory of one call."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.rss_reset = device == "cpu" and _can_reset_peak_rss()

    def __call__(self, fn: Callable[[], object]) -> tuple[float, int | None]:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        elif self.rss_reset:
            _reset_peak_rss()
            before = _status("VmRSS")
        start = time.perf_counter()
        fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if self.device == "cuda":
            return elapsed, torch.cuda.max_memory_allocated() - before
        if self.rss_reset:
            return elapsed, max(0, _status("VmHWM") - before)
        return elapsed, None


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _can_reset_peak_rss() -> bool:
    try:
        _reset_peak_rss()
        _status("VmHWM")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------- patches


def random_patches(
    shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    density: float,
    generator: torch.Generator,
    device: str,
) -> list[CheckpointWeightPatch]:
    """One sparse patch per checkpoint tensor: sorted unique int32 indices (the producer format)."""
    patches = []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        count = max(1, round(numel * density))
        # Unique positions without a full permutation: sample with replacement, then dedupe.
        indices = torch.unique(
            torch.randint(0, numel, (int(count * 1.1) + 8,), generator=generator)
        )
        indices = (
            indices[torch.randperm(indices.numel(), generator=generator)[:count]].sort().values
        )
        values = (torch.randn(indices.numel(), generator=generator) * 0.02).to(dtype)
        patches.append(
            CheckpointWeightPatch(
                name, shape, dtype, values.to(device), indices.to(torch.int32).to(device)
            )
        )
    return patches


# ---------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Scenario:
    """What one block of rows measures: fresh random patches per round, or one fixed update
    applied from the same starting weights every round."""

    label: str
    patches: Callable[[], list[CheckpointWeightPatch]]
    start: dict[str, torch.Tensor] | None = None


def _scenarios(
    args: argparse.Namespace,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    generator: torch.Generator,
    device: str,
) -> Iterator[Scenario]:
    if args.patches == "random":
        for density in args.densities:
            yield Scenario(
                f"{density:.3%}", partial(random_patches, shapes, dtype, density, generator, device)
            )
        return
    for lr in args.lrs:
        update = realistic_update(shapes, lr=lr, dtype=dtype, warmup=args.warmup, seed=args.seed)
        start = {name: tensor.to(dtype).to(device) for name, tensor in update.old.items()}
        patches = [
            p._replace(
                values=p.values.to(device),
                indices=None if p.indices is None else p.indices.to(device),
            )
            for p in update.patches
        ]
        yield Scenario(f"adam lr={lr:g}", partial(list, patches), start)


@dataclass
class Row:
    dtype: str
    scenario: str
    density: float
    method: str
    median_ms: float
    ratio_to_baseline: float | None
    peak_extra_mib: float | None
    bytes_per_changed_element: float | None
    changed_elements: int
    identical: bool | None = None
    min_ms: float | None = None
    max_ms: float | None = None


def run(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    device = args.device
    theirs = None if args.baseline == "written" else vllm_function()
    if args.baseline == "vllm" and theirs is None:
        sys.exit("--baseline vllm: vLLM is not importable here")
    baseline_kind = (
        "vLLM's load_checkpoint_weight_patches" if theirs else "vLLM's algorithm written out"
    )

    def baseline(model: nn.Module, patches: list[CheckpointWeightPatch]) -> object:
        if theirs is not None:
            return theirs(model, patches)
        return nan_swap_load(model, patches)

    meter = Meter(device)
    rows: list[Row] = []
    generator = torch.Generator().manual_seed(args.seed)
    first_use_s, _ = meter(partial(_first_use, device))
    for dtype_name in args.dtypes:
        progress(f"{dtype_name}: building the model (hidden {args.hidden}, TP {args.tp})")
        rows += _bench_dtype(args, dtype_name, baseline, meter, generator)
    meta = {
        "baseline": baseline_kind,
        "hidden": args.hidden,
        "tp": args.tp,
        "rank": args.rank,
        "device": device,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "first_use_seconds": first_use_s,
        "machine": platform.platform(),
        "memory": "peak RSS above the pre-call level (kernel peak mark reset per call)"
        if device == "cpu"
        else "torch.cuda.max_memory_allocated above the pre-call level",
    }
    return rows, meta


def _bench_dtype(
    args: argparse.Namespace,
    dtype_name: str,
    baseline: Callable[[nn.Module, list[CheckpointWeightPatch]], object],
    meter: Meter,
    generator: torch.Generator,
) -> list[Row]:
    device, dtype = args.device, DTYPES[dtype_name]
    rows: list[Row] = []
    base = PackedSlice(args.hidden, args.tp, args.rank, dtype, device)
    checkpoint = {
        name: (torch.randn(shape, generator=generator) * 0.02).to(dtype).to(device)
        for name, shape in base.shapes.items()
    }
    base.load_weights(checkpoint.items())
    models: dict[str, PackedSlice] = {method: copy.deepcopy(base) for method in METHODS}
    routes = RouteCache()
    tensors = {m: model_tensors(model) for m, model in models.items()}

    # Warm-up round, through every method; patchctx+routes records its routes here.
    warm = random_patches(base.shapes, dtype, args.densities[0], generator, device)
    record = partial(load_checkpoint_weight_patches, models["patchctx+routes"], warm, routes=routes)
    record_s, record_mem = meter(record)
    assert len(routes) == len(base.shapes), "every name of the benchmark model is replayable"
    _apply_others(models, warm, checkpoint, baseline, routes, tensors, skip="patchctx+routes")
    rows.append(
        Row(
            dtype_name,
            "first round",
            _nnz(warm) / sum(math.prod(shape) for shape in base.shapes.values()),
            "route recording (1st round)",
            record_s * 1e3,
            None,
            _mib(record_mem),
            None,
            _nnz(warm),
            min_ms=record_s * 1e3,
            max_ms=record_s * 1e3,
        )
    )

    progress(f"{dtype_name}: routes recorded in {record_s * 1e3:.0f} ms")
    for scenario in _scenarios(args, base.shapes, dtype, generator, device):
        progress(f"{dtype_name} {scenario.label}: {args.repeats} rounds x {len(METHODS)} methods")
        timings: dict[str, list[float]] = {m: [] for m in METHODS}
        memory: dict[str, list[int]] = {m: [] for m in METHODS}
        changed = 0
        for repeat in range(args.repeats):
            if scenario.start is not None:  # every round starts from the same weights
                for name, tensor in scenario.start.items():
                    checkpoint[name].copy_(tensor)
                for model in models.values():
                    _dense_reload(model, checkpoint)
            patches = scenario.patches()
            changed = _nnz(patches)
            for patch in patches:  # the dense truth
                assert patch.indices is not None, "the benchmark compares sparse patches"
                checkpoint[patch.name].view(-1)[patch.indices.long()] = patch.values
            calls: dict[str, Callable[[], object]] = {
                "baseline": partial(baseline, models["baseline"], patches),
                "patchctx": partial(load_checkpoint_weight_patches, models["patchctx"], patches),
                "patchctx+routes": partial(
                    load_checkpoint_weight_patches,
                    models["patchctx+routes"],
                    patches,
                    routes=routes,
                ),
                "lower-bound": partial(
                    _index_copies, _lower_bound_plan(routes, patches, tensors["lower-bound"])
                ),
                "dense-reload": partial(_dense_reload, models["dense-reload"], checkpoint),
            }
            order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
            for method in order:
                seconds, extra = meter(calls[method])
                timings[method].append(seconds)
                if extra is not None:
                    memory[method].append(extra)
        density = changed / sum(math.prod(shape) for shape in base.shapes.values())
        reference = models["baseline"].state_dict()
        base_ms = statistics.median(timings["baseline"]) * 1e3
        for method in METHODS:
            ms = statistics.median(timings[method]) * 1e3
            peak = max(memory[method]) if memory[method] else None
            same = all(
                torch.equal(_bits(tensor), _bits(reference[key]))
                for key, tensor in models[method].state_dict().items()
            )
            rows.append(
                Row(
                    dtype_name,
                    scenario.label,
                    density,
                    method,
                    ms,
                    base_ms / ms if ms else None,
                    _mib(peak),
                    None if peak is None else peak / changed,
                    changed,
                    same,
                    min_ms=min(timings[method]) * 1e3,
                    max_ms=max(timings[method]) * 1e3,
                )
            )
    return rows


def _first_use(device: str) -> None:
    """The guard's one-time cost per process (its dispatch mode imports torch._dynamo), paid
    here on a tiny model so that it does not count against the first measured call."""
    tiny = PackedSlice(16, 1, 0, torch.float32, device)
    shape = tiny.shapes["mlp.weight"]
    patch = CheckpointWeightPatch(
        "mlp.weight",
        shape,
        torch.float32,
        torch.ones(1, device=device),
        torch.zeros(1, dtype=torch.long, device=device),
    )
    load_checkpoint_weight_patches(tiny, [patch])


def _dense_reload(model: nn.Module, checkpoint: dict[str, torch.Tensor]) -> object:
    loader: Any = model
    return loader.load_weights(checkpoint.items())


def _apply_others(
    models: dict[str, PackedSlice],
    patches: list[CheckpointWeightPatch],
    checkpoint: dict[str, torch.Tensor],
    baseline: Callable[[nn.Module, list[CheckpointWeightPatch]], object],
    routes: RouteCache,
    tensors: dict[str, dict[str, torch.Tensor]],
    *,
    skip: str,
) -> None:
    for name, patch in zip(checkpoint, patches, strict=True):
        assert patch.indices is not None
        checkpoint[name].view(-1)[patch.indices.long()] = patch.values
    for method, model in models.items():
        if method == skip:
            continue
        if method == "baseline":
            baseline(model, patches)
        elif method == "dense-reload":
            _dense_reload(model, checkpoint)
        elif method == "lower-bound":
            _index_copies(_lower_bound_plan(routes, patches, tensors[method]))
        else:
            load_checkpoint_weight_patches(model, patches)


def _lower_bound_plan(
    routes: RouteCache, patches: list[CheckpointWeightPatch], tensors: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Destination positions and cast values, computed ahead: what a bare scatter needs."""
    plan = []
    for patch in patches:
        route = routes._route(patch.name)
        assert route is not None and patch.indices is not None
        for segment in route.segments:
            target = tensors[segment.tensor_name]
            positions, picked = segment.positions(patch.indices, sorted_unique=True)
            values = patch.values[picked].to(segment.dtype)
            plan.append((indexable(storage_flat(target)), positions, indexable(values)))
    return plan


def _index_copies(plan: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for flat, positions, values in plan:
        flat.index_copy_(0, positions, values)


def _nnz(patches: list[CheckpointWeightPatch]) -> int:
    return sum(p.values.numel() for p in patches)


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().contiguous()
    return tensor.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    )


# ---------------------------------------------------------------------------------- output

_T0 = "PATCHCTX_BENCH_T0"  # the wall-clock start of the whole run, shared with the child runs
_RUN = "PATCHCTX_BENCH_RUN"  # which child run this is ("times", "memory"), for progress lines


def progress(message: str) -> None:
    """One line on stderr: the time since the run started, which run, what it is doing."""
    start = float(os.environ.get(_T0, _STARTED))
    run_label = os.environ.get(_RUN)
    prefix = f"[{time.time() - start:6.1f} s]" + (f" {run_label}:" if run_label else "")
    print(f"{prefix} {message}", file=sys.stderr, flush=True)


_STARTED = time.time()

# How the table names each method, and what the legend says of it.
METHOD_LEGEND = {
    "baseline": "vLLM's load_checkpoint_weight_patches (or its algorithm written out, "
    "see the header): stages every patch as a full NaN-filled tensor",
    "patchctx": "load_checkpoint_weight_patches without routes: the same O(N) loader path",
    "patchctx+routes": "with a RouteCache, routes already recorded: O(nnz) replay",
    "lower-bound": "a bare index_copy_ of positions and values computed beforehand",
    "dense-reload": "the full patched tensors loaded through the loader, plain copies",
    "record routes": "the first round of patchctx+routes, which records the routes",
}
_SHORT = {"route recording (1st round)": "record routes"}


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[Row], meta: dict[str, Any]) -> str:
    """The compact table: one block per (dtype, patches), times as min / median / max."""
    header = (
        f"{'dtype':<5} {'patches':<13} {'density':>7}  {'method':<15} "
        f"{'min ms':>8} {'median':>8} {'max':>8} {'vs base':>7} {'MiB':>6} {'B/chg':>7} same"
    )
    lines = [
        f"patchctx benchmark: hidden {meta['hidden']}, TP {meta['tp']} rank {meta['rank']}, "
        f"{meta['device']}, torch {meta['torch']}, {meta['threads']} threads, "
        f"{meta['repeats']} rounds",
        f"baseline: {meta['baseline']}",
        "",
        header,
        "-" * len(header),
    ]
    previous = None
    for row in rows:
        group = (row.dtype, row.scenario)
        if previous is not None and group != previous:
            lines.append("")
        first = group != previous
        previous = group
        same = "" if row.identical is None else ("yes" if row.identical else "NO")
        lines.append(
            f"{row.dtype if first else '':<5} {_patches(row) if first else '':<13} "
            f"{_cell(row.density, '.3%') if first else '':>7}  "
            f"{_SHORT.get(row.method, row.method):<15} "
            f"{_cell(row.min_ms, '.2f'):>8} {row.median_ms:>8.2f} {_cell(row.max_ms, '.2f'):>8} "
            f"{_cell(row.ratio_to_baseline, '.1f', 'x'):>7} {_cell(row.peak_extra_mib, '.1f'):>6} "
            f"{_cell(row.bytes_per_changed_element, '.1f'):>7} {same}".rstrip()
        )
    lines += ["", legend(meta)]
    return "\n".join(lines)


def verdict(rows: list[Row]) -> list[str]:
    """Per dtype and patch set: which way wins and by how much, with a bar per speed-up.

    patchctx with routes (what a worker runs after the first update) against vLLM's function
    and against a dense reload of the patched tensors, medians; the bar is the speed-up over
    vLLM's function on a log scale (one ``#`` per doubling).
    """
    lines = []
    groups: dict[tuple[str, str], dict[str, Row]] = {}
    for row in rows:
        if row.identical is not None:  # measured rounds, not route recording
            groups.setdefault((row.dtype, row.scenario), {})[row.method] = row
    for (dtype, scenario), methods in groups.items():
        ours, theirs = methods.get("patchctx+routes"), methods.get("baseline")
        dense = methods.get("dense-reload")
        if ours is None or theirs is None or dense is None or not ours.median_ms:
            continue
        fastest = min(
            ("patchctx+routes", "baseline", "dense-reload"), key=lambda m: methods[m].median_ms
        )
        over_theirs = theirs.median_ms / ours.median_ms
        over_dense = dense.median_ms / ours.median_ms
        bar = "#" * max(1, round(math.log2(over_theirs))) if over_theirs > 1 else "-"
        dense_word = (
            f"{over_dense:.1f}x faster than"
            if over_dense >= 1
            else f"{1 / over_dense:.1f}x slower than"
        )
        lines.append(
            f"{dtype:<5} {scenario:>8}: {fastest} wins; patchctx+routes {over_theirs:6.1f}x "
            f"faster than vLLM's function, {dense_word} a dense reload  {bar}"
        )
    return lines


def _patches(row: Row) -> str:
    """The table's `patches` cell: random patches are named by their density column."""
    return "random" if row.scenario.endswith("%") else row.scenario


def legend(meta: dict[str, Any]) -> str:
    """What every column and every method of the table means."""
    columns = [
        ("dtype", "checkpoint and parameter dtype"),
        ("patches", "what one round applies: a random density, or one Adam step (realistic)"),
        ("density", "fraction of all checkpoint elements a round changes"),
        ("method", "how the patches are applied (below)"),
        (
            "min ms, median, max",
            f"wall time of one round (one patch to each of the 4 checkpoint tensors) "
            f"over {meta['repeats']} rounds, methods interleaved",
        ),
        ("vs base", "the baseline's median divided by the method's: above 1.0x is faster"),
        ("MiB", f"peak extra memory of a round: {meta['memory']}"),
        ("B/chg", "that peak in bytes per changed element"),
        ("same", "weights bit-identical to the baseline's after the last round"),
    ]
    lines = ["columns:", *_entries(columns), "methods:", *_entries(METHOD_LEGEND.items())]
    lines += textwrap.wrap(
        "not in the rows: the one-time first use of patchctx's guard in this process, "
        f"{meta['first_use_seconds']:.2f} s",
        _WIDTH,
    )
    return "\n".join(lines)


_WIDTH = 100  # of the legend


def _entries(entries: Iterable[tuple[str, str]]) -> list[str]:
    """`name  text` lines, the texts aligned and wrapped under themselves."""
    entries = list(entries)
    width = max(len(name) for name, _ in entries) + 4
    lines = []
    for name, text in entries:
        lines += textwrap.wrap(
            text,
            _WIDTH,
            initial_indent=f"  {name:<{width - 2}}",
            subsequent_indent=" " * width,
        )
    return lines


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _names(text: str) -> list[str]:
    return text.split(",")


def parser() -> argparse.ArgumentParser:
    """The command line (``--help`` shows every default)."""
    cli = argparse.ArgumentParser(
        prog="./dev bench",
        description="patchctx side-by-side benchmark: sparse patches to one decoder layer's "
        "weights at one tensor-parallel rank, applied by vLLM's algorithm, by patchctx with "
        "and without routes, by a bare index_copy_ and by a dense reload. Progress goes to "
        "stderr, the table (or the JSON) to stdout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cli.add_argument("--hidden", type=int, default=4096, help="hidden size of the model")
    cli.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the QKV slice")
    cli.add_argument("--rank", type=int, default=0, help="the tensor-parallel rank measured")
    cli.add_argument(
        "--densities",
        type=_floats,
        default="0.001,0.01,0.1",
        help="fractions of each checkpoint tensor a random patch changes (comma-separated)",
    )
    cli.add_argument(
        "--dtypes",
        type=_names,
        default="bf16,fp32",
        help=f"dtypes to measure (comma-separated, from {', '.join(DTYPES)})",
    )
    cli.add_argument("--repeats", type=int, default=5, help="measured rounds per row")
    cli.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds: hidden 256 and 2 rounds (overrides --hidden and "
        "--repeats)",
    )
    cli.add_argument(
        "--patches",
        choices=["random", "realistic"],
        default="random",
        help="random: uniform random positions at each --densities; realistic: one Adam step on "
        "fp32 master weights at each --lrs, cast to the dtype and diffed (diff_state_dicts)",
    )
    cli.add_argument(
        "--lrs", type=_floats, default="1e-6,1e-7", help="learning rates of --patches realistic"
    )
    cli.add_argument(
        "--warmup", type=int, default=10, help="Adam steps before the measured one (realistic)"
    )
    cli.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run")
    cli.add_argument(
        "--baseline",
        choices=["auto", "vllm", "written"],
        default="auto",
        help="vllm: vLLM's own function; written: its algorithm written out "
        "(benchmarks/baseline.py); auto: vLLM's when it is importable",
    )
    cli.add_argument("--seed", type=int, default=0, help="seed of the weights and patches")
    cli.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the rows and settings as JSON to PATH; without PATH, print the JSON "
        "instead of the table",
    )
    cli.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="also draw the times and the memory per changed element as a PNG chart "
        "(needs matplotlib, which ./dev installs)",
    )
    cli.add_argument(
        "--measure",
        choices=["both", "time", "memory"],
        default="both",
        help="on CPU, time and memory come from two runs of this script (see the module's "
        "docstring): 'both' starts them and merges their rows; 'time' or 'memory' is one of them",
    )
    cli.add_argument("--quiet", action="store_true", help="print no table")
    return cli


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    for name in args.dtypes:
        if name not in DTYPES:
            cli.error(f"--dtypes: unknown {name!r} (choose from {', '.join(DTYPES)})")
    if args.quick:
        args.hidden, args.repeats = 256, 2
    # The concurrent-load check, in the parent run only (its children are the measurement).
    before = other_load() if os.environ.get(_RUN) is None else None
    os.environ.setdefault(_T0, str(_STARTED))
    forwarded = sys.argv[1:] if argv is None else list(argv)
    if args.device == "cpu" and args.measure == "both":
        rows, meta = _time_and_memory(forwarded)
    else:
        if args.device == "cpu" and args.measure == "memory" and not _fixed_mmap_threshold():
            # Every buffer of 64 KiB or more is mapped fresh and unmapped on free, so the RSS
            # sees every allocation (freed memory is never reused unseen).
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(_MMAP_THRESHOLD)
            os.execv(sys.executable, [sys.executable, "-m", "benchmarks.patch_bench", *forwarded])
        rows, meta = run(args)
        meta["measured"] = args.measure
    child = os.environ.get(_RUN) is not None  # one of the two runs of --measure both
    if before is not None:
        after = other_load()
        meta["load"] = [asdict(before), asdict(after)]
        meta["load_verdict"] = verdict_line(before, after)
    report = json.dumps({"settings": meta, "rows": [asdict(r) for r in rows]}, indent=2)
    if args.json == "-":
        print(report)
    elif not args.quiet:
        print(table(rows, meta))
        if before is not None:
            print("\nverdict (medians):")
            for line in verdict(rows):
                print("  " + line)
            print("  " + meta["load_verdict"])
    if args.json not in (None, "-"):
        Path(args.json).write_text(report + "\n")
        if not child:  # a child's JSON is its parent's business
            progress(f"wrote {args.json}")
    if args.plot is not None:
        from benchmarks.charts import bench_png

        bench_png({"settings": meta, "rows": [asdict(r) for r in rows]}, args.plot)
        progress(f"wrote {args.plot}")
    if not child:
        progress("done")
    return 0 if all(r.identical is not False for r in rows) else 1


_MMAP_THRESHOLD = 65536


def _fixed_mmap_threshold() -> bool:
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(_MMAP_THRESHOLD)


def _time_and_memory(forwarded: list[str]) -> tuple[list[Row], dict[str, Any]]:
    """Two runs, merged: times with the default allocator (a long-running process reuses
    freed memory), peak memory with a fixed mmap threshold (every allocation visible)."""
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for measure in ("time", "memory"):
            out = Path(folder) / f"{measure}.json"
            env = dict(os.environ)
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
            env[_RUN] = {"time": "times", "memory": "memory"}[measure]
            progress(
                "run 1 of 2: times, default allocator"
                if measure == "time"
                else "run 2 of 2: peak memory, every buffer mapped fresh"
            )
            command = [sys.executable, "-m", "benchmarks.patch_bench", *_without_output(forwarded)]
            command += ["--measure", measure, "--quiet", "--json", str(out)]
            subprocess.run(command, env=env, check=True)
            results[measure] = json.loads(out.read_text())
    rows = []
    for timed, sized in zip(results["time"]["rows"], results["memory"]["rows"], strict=True):
        assert (timed["dtype"], timed["scenario"], timed["method"]) == (
            sized["dtype"],
            sized["scenario"],
            sized["method"],
        )
        merged = dict(timed)
        merged["peak_extra_mib"] = sized["peak_extra_mib"]
        merged["bytes_per_changed_element"] = sized["bytes_per_changed_element"]
        if timed["identical"] is not None:
            merged["identical"] = bool(timed["identical"] and sized["identical"])
        rows.append(Row(**merged))
    meta = results["time"]["settings"]
    meta["memory"] = (
        "peak RSS above the pre-call level (kernel peak mark reset per call), measured in a "
        f"second run with MALLOC_MMAP_THRESHOLD_={_MMAP_THRESHOLD}"
    )
    meta["measured"] = "time (default allocator) and memory (second run), merged"
    return rows, meta


def _without_output(arguments: list[str]) -> list[str]:
    """The caller's arguments minus --json/--plot/--measure/--quiet (the parent owns those)."""
    kept, skip = [], False
    for number, argument in enumerate(arguments):
        if skip:
            skip = False
            continue
        if argument in ("--plot", "--measure"):
            skip = True
            continue
        if argument == "--json":  # its PATH is optional
            following = arguments[number + 1] if number + 1 < len(arguments) else "--"
            skip = not following.startswith("--")
            continue
        if argument == "--quiet" or argument.startswith(("--json=", "--plot=", "--measure=")):
            continue
        kept.append(argument)
    return kept


if __name__ == "__main__":
    sys.exit(main())
