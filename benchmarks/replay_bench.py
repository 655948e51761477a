"""Steady-state replay against its lower bounds, its fixed costs, and its behaviour under load.

Six tables, each measured side by side in one process, methods interleaved (the order
rotates from round to round), min and median of the rounds:

1. **Density sweep** (one torch thread): one packed-QKV tensor-parallel slice and its MLP
   weight (``benchmarks.patch_bench.PackedSlice``) at each hidden size, dtype and density.
   ``replay`` is a whole ``load_checkpoint_weight_patches`` call with a warm ``RouteCache``
   (validation included); ``index_copy_`` and ``scatter_`` are the bare writes of positions
   and values computed beforehand (the issue's lower bound is ``index_copy_``; ``scatter_`` on
   an integer view is faster on CPU, and replay uses it there); ``dense`` loads the full
   patched tensors through the loader with plain copies; ``replay, one element each`` is the
   same call with one changed element per tensor (its fixed cost). The replay row's note sets
   it against the goal: replay / ``index_copy_``, (replay - its fixed cost) / ``index_copy_``,
   and replay / (1.2 x ``index_copy_`` + 10 µs a patch + 50 µs), the goal's budget. Each
   method runs after the others, so it finds the caches as the dense load (hundreds of MB)
   and the other writes left them: a call's fixed cost measured this way is several times
   its cost in a loop of calls (`fixed costs`), as each distinct operation's code and data
   are fetched from memory again.
2. **Row-parallel** (one thread): a row-parallel weight at rank 0 of 2 (``o_proj``: the
   checkpoint's columns narrowed), whose replay decomposes each index by the strided view,
   against the bare ``index_copy_`` of this rank's positions
   and a dense reload.
3. **Fixed costs** (one thread): N tensors of 256x256 bf16 at 0.1 %: replay per tensor in
   one call of N patches, a call of one patch, a dense reload per tensor, the bare write per
   tensor; with vLLM's own function beside them when vLLM is importable.
4. **Warm** (one thread): calls in a loop of calls, as ``timeit`` times them (the caches as
   the previous call left them): the packed layer at hidden 1024 bf16 with one element per
   tensor and at 1 %, validation alone of the latter, and the N small tensors per tensor.
5. **Cold** (one thread): the first call of an operation right after a 128 MiB copy, against
   its second call: a few tiny torch and numpy operations, a replay call of four one-element
   patches, its validation alone, and its bare writes. Why the sweep's calls cost more than
   the warm table's.
6. **Contention** (two threads): hidden 4096 at 10 %, quiet and with a competing busy
   process started by the script (``--spinners``), replay and the bare write, and the ratio
   loaded / quiet.

Run ``python -m benchmarks.replay_bench`` (about three minutes on 2 CPU cores), ``--quick`` for
a smoke run, ``--json PATH`` for the rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy
import torch
from torch import nn

from benchmarks.baseline import vllm_function
from benchmarks.patch_bench import (
    DTYPES,
    PackedSlice,
    _lower_bound_plan,
    collector_off,
    progress,
    random_patches,
)
from patchctx import (
    CheckpointWeightPatch,
    RouteCache,
    load_checkpoint_weight_patches,
    validate_patches,
)
from patchctx._bits import write_at
from patchctx._model import model_tensors


@dataclass
class Row:
    table: str  # "sweep", "row", "fixed", "warm", "cold", "contention"
    case: str  # what the row measures (hidden/dtype/density, or the fixed-cost case)
    method: str
    min_us: float
    median_us: float
    note: str = ""


# ------------------------------------------------------------------------------- measuring


def interleaved(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each method, the order rotating from round to round.

    Each method runs once first, unmeasured: first-use costs (allocator growth, caches) are
    not what a worker applying update after update pays. The garbage collector is off while
    timing, as in ``timeit``.
    """
    names = list(calls)
    for name in names:
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    with collector_off():
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
    return times


def _index_copies(plan: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for flat, positions, values in plan:  # both already indexable views (the plan's)
        flat.index_copy_(0, positions, values)


def _scatters(plan: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for flat, positions, values in plan:
        write_at(flat, positions, values)  # scatter_ through an integer view on CPU


def _dense(model: Any, checkpoint: dict[str, torch.Tensor]) -> None:
    model.load_weights(checkpoint.items())


# ----------------------------------------------------------------------------------- sweep


def sweep(args: argparse.Namespace) -> list[Row]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for hidden in args.hidden:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            progress(f"sweep: hidden {hidden} {dtype_name}")
            base = PackedSlice(hidden, 2, 0, dtype, "cpu")
            checkpoint = {
                name: (torch.randn(shape, generator=generator) * 0.02).to(dtype)
                for name, shape in base.shapes.items()
            }
            base.load_weights(checkpoint.items())
            models = {m: copy.deepcopy(base) for m in ("replay", "bare", "dense")}
            routes = RouteCache()
            first = random_patches(base.shapes, dtype, 0.001, generator, "cpu")
            load_checkpoint_weight_patches(models["replay"], first, routes=routes)
            bare = model_tensors(models["bare"])
            # The same call with one changed element per tensor: what a call costs beyond its
            # writes, measured in the same run (the same caches) as the rows it is set against.
            ones = random_patches(base.shapes, dtype, 0.0, generator, "cpu")  # (at least one)
            for density in args.densities:
                patches = random_patches(base.shapes, dtype, density, generator, "cpu")
                plan = _lower_bound_plan(routes, patches, bare)
                calls: dict[str, Callable[[], object]] = {
                    "replay": partial(
                        load_checkpoint_weight_patches, models["replay"], patches, routes=routes
                    ),
                    "index_copy_": partial(_index_copies, plan),
                    "scatter_": partial(_scatters, plan),
                    "dense": partial(_dense, models["dense"], checkpoint),
                    "replay, one element each": partial(
                        load_checkpoint_weight_patches, models["replay"], ones, routes=routes
                    ),
                }
                times = interleaved(calls, args.rounds)
                nnz = sum(p.values.numel() for p in patches)
                numel = sum(math.prod(s) for s in base.shapes.values())
                case = f"h{hidden} {dtype_name} {nnz / numel:.2%}"
                for method, seconds in times.items():
                    note = _goal(times, len(patches)) if method == "replay" else ""
                    rows.append(Row("sweep", case, method, *_us(seconds), note))
    return rows


def _goal(times: dict[str, list[float]], patches: int) -> str:
    """A replay row against the issue's goal: 1.2x the bare ``index_copy_`` plus fixed costs.

    Two readings of the fixed cost: the goal's budget (10 µs a patch and 50 µs a call), and
    the call's own, measured beside it (one element per tensor, the same way).
    """
    low = min(times["index_copy_"])
    replay = min(times["replay"])
    fixed = min(times["replay, one element each"])
    budget = 1.2 * low + 10e-6 * patches + 50e-6
    return (
        f"{replay / low:.2f}x index_copy_; {(replay - fixed) / low:.2f}x beyond its own fixed "
        f"cost; {replay / budget:.2f}x the goal's budget"
    )


# ---------------------------------------------------------------------------- row-parallel


class RowParallel(nn.Module):
    """A row-parallel weight at rank 0 of 2 (``o_proj``, ``down_proj``): its input columns.

    The checkpoint's [hidden, hidden] weight narrowed along dimension 1 to this rank's
    half: every row of the view is a separate run of the staged tensor, so replay decomposes
    each index into a row and a column (`patchctx._geometry.Segment`'s strided case), and the
    other rank's half of every row is skipped.
    """

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = hidden
        self.weight = nn.Parameter(
            torch.zeros(hidden, hidden // 2, dtype=dtype), requires_grad=False
        )
        self.shapes = {"o_proj.weight": (hidden, hidden)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.copy_(tensor.narrow(1, 0, self.hidden // 2))
        return {"o_proj.weight"}


def row_parallel(args: argparse.Namespace) -> list[Row]:
    """Replay through a strided view (a row-parallel slice), against the bare ``index_copy_``
    of this rank's positions and a dense reload."""
    hidden = args.row_hidden
    progress(f"row-parallel: hidden {hidden} bf16, rank 0 of 2")
    generator = torch.Generator().manual_seed(5)
    models = {m: RowParallel(hidden, torch.bfloat16) for m in ("replay", "bare", "dense")}
    routes = RouteCache()
    shapes = models["replay"].shapes
    first = random_patches(shapes, torch.bfloat16, 0.001, generator, "cpu")
    load_checkpoint_weight_patches(models["replay"], first, routes=routes)
    checkpoint = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    rows = []
    for density in args.row_densities:
        patches = random_patches(shapes, torch.bfloat16, density, generator, "cpu")
        plan = _lower_bound_plan(routes, patches, model_tensors(models["bare"]))
        calls: dict[str, Callable[[], object]] = {
            "replay": partial(
                load_checkpoint_weight_patches, models["replay"], patches, routes=routes
            ),
            "index_copy_": partial(_index_copies, plan),
            "dense": partial(_dense, models["dense"], checkpoint),
        }
        times = interleaved(calls, args.rounds)
        case = f"h{hidden} bf16 {density:.2%}"
        low = min(times["index_copy_"])
        for method, seconds in times.items():
            note = f"{min(seconds) / low:.2f}x index_copy_" if "replay" in method else ""
            rows.append(Row("row", case, method, *_us(seconds), note))
    return rows


# ----------------------------------------------------------------------------- fixed costs


class Many(nn.Module):
    """N small weights, each loaded by a plain ``copy_`` (models with many small tensors)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16), requires_grad=False)
            for _ in range(count)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.ws[int(name[1:])].copy_(tensor)
            names.add(name)
        return names


def fixed_costs(args: argparse.Namespace) -> list[Row]:
    count = args.many
    progress(f"fixed costs: {count} tensors of 256x256 bf16 at 0.1 %")
    shapes = {f"w{i}": (256, 256) for i in range(count)}
    generator = torch.Generator().manual_seed(1)
    models = {m: Many(count) for m in ("replay", "one", "bare", "dense", "vllm")}
    routes = {m: RouteCache() for m in ("replay", "one")}
    for method in routes:
        first = random_patches(shapes, torch.bfloat16, 0.001, generator, "cpu")
        load_checkpoint_weight_patches(models[method], first, routes=routes[method])
    checkpoint = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    theirs = vllm_function()
    bare = model_tensors(models["bare"])
    rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        patches = random_patches(shapes, torch.bfloat16, 0.001, generator, "cpu")
        plan = _lower_bound_plan(routes["replay"], patches, bare)
        one = patches[:50]
        calls: dict[str, Callable[[], object]] = {
            "replay, per tensor": partial(
                load_checkpoint_weight_patches, models["replay"], patches, routes=routes["replay"]
            ),
            "dense reload, per tensor": partial(_dense, models["dense"], checkpoint),
            "bare index write, per tensor": partial(_scatters, plan),
            "call of one patch": partial(_one_by_one, models["one"], one, routes["one"]),
        }
        if theirs is not None:
            calls["vLLM's function, call of one patch"] = partial(
                _theirs_one_by_one, theirs, models["vllm"], one
            )
        for method, seconds in interleaved(calls, 1).items():
            per = len(one) if "call of one" in method else count
            rounds.setdefault(method, []).append(seconds[0] / per)
    return [Row("fixed", f"{count} x 256x256 bf16, 0.1 %", m, *_us(s)) for m, s in rounds.items()]


def _packed_with_routes(generator: torch.Generator) -> tuple[PackedSlice, RouteCache]:
    """The packed layer at hidden 1024 bf16 (zeros), its routes recorded by a first update."""
    model = PackedSlice(1024, 2, 0, torch.bfloat16, "cpu")
    model.load_weights((n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in model.shapes.items())
    routes = RouteCache()
    first = random_patches(model.shapes, torch.bfloat16, 0.001, generator, "cpu")
    load_checkpoint_weight_patches(model, first, routes=routes)
    return model, routes


def warm(args: argparse.Namespace) -> list[Row]:
    """Calls in a loop of calls (as ``timeit``): the caches as the previous call left them.

    What a worker applying many small updates back to back pays: the packed layer at hidden
    1024 bf16 (four tensors) with one element each and at 1 %, validation alone of the latter,
    and the many-small-tensors call per tensor. Per row, the min and median over `--rounds`
    (at least 5) repeats of a loop; each repeat's time is the loop's mean per call.
    """
    progress("warm: calls in a loop, hidden 1024 bf16 and the many small tensors")
    generator = torch.Generator().manual_seed(3)
    model, routes = _packed_with_routes(generator)
    ones = random_patches(model.shapes, torch.bfloat16, 0.0, generator, "cpu")
    dense = random_patches(model.shapes, torch.bfloat16, 0.01, generator, "cpu")
    count = args.many
    many = Many(count)
    shapes = {f"w{i}": (256, 256) for i in range(count)}
    many_routes = RouteCache()
    load_checkpoint_weight_patches(
        many, random_patches(shapes, torch.bfloat16, 0.001, generator, "cpu"), routes=many_routes
    )
    small = random_patches(shapes, torch.bfloat16, 0.001, generator, "cpu")
    cases: list[tuple[str, Callable[[], object], int, int]] = [
        (
            "4 tensors, one element each",
            partial(load_checkpoint_weight_patches, model, ones, routes=routes),
            200,
            1,
        ),
        (
            "4 tensors at 1 %",
            partial(load_checkpoint_weight_patches, model, dense, routes=routes),
            50,
            1,
        ),
        (
            "4 tensors at 1 %, validation alone",
            partial(validate_patches, dense),
            50,
            1,
        ),
        (
            f"{count} x 256x256 at 0.1 %, per tensor",
            partial(load_checkpoint_weight_patches, many, small, routes=many_routes),
            5,
            count,
        ),
    ]
    rows = []
    with collector_off():
        for case, call, number, per in cases:
            method = "replay" if "alone" not in case else "validation"
            ways = {method: call}
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            for run in ways.values():
                run()
            for _ in range(max(args.rounds, 5)):
                for way, run in ways.items():  # alternated, repeat by repeat
                    start = time.perf_counter()
                    for _ in range(number):
                        run()
                    seconds[way].append((time.perf_counter() - start) / number / per)
            rows += [Row("warm", case, way, *_us(found)) for way, found in seconds.items()]
    return rows


def cold(args: argparse.Namespace) -> list[Row]:
    """An operation's first call after a sweep of memory, against its second call.

    Between two updates a worker streams far more than the caches hold (the sweep's dense
    loads, or inference): the first call of each distinct operation then fetches its code and
    data from memory again. Per operation (a few tiny torch and numpy ones, a replay call of
    four one-element patches, its validation alone, and its bare writes), each round copies a
    128 MiB buffer, then times the operation twice.
    """
    progress("cold: first calls after a 128 MiB sweep, against second calls")
    source = torch.empty(128 << 20, dtype=torch.uint8)
    sink = torch.empty_like(source)
    small = torch.arange(1000, dtype=torch.int32)
    host = small.numpy()
    generator = torch.Generator().manual_seed(4)
    model, routes = _packed_with_routes(generator)
    ones = random_patches(model.shapes, torch.bfloat16, 0.0, generator, "cpu")
    bare = copy.deepcopy(model)
    plan = _lower_bound_plan(routes, ones, model_tensors(bare))
    operations: dict[str, Callable[[], object]] = {
        "torch.cat of two 1000-element tensors": lambda: torch.cat([small, small]),
        "tensor.amax() of 1000 elements": small.amax,
        "numpy.greater of 1000 elements": lambda: numpy.greater(host[1:], host[:-1]),
        "replay: 4 tensors, one element each": partial(
            load_checkpoint_weight_patches, model, ones, routes=routes
        ),
        "validation alone of the same": partial(validate_patches, ones),
        "bare writes of the same": partial(_scatters, plan),
    }
    rows = []
    with collector_off():
        for case, operation in operations.items():
            operation()
            first, second = [], []
            for _ in range(max(args.rounds, 5)):
                sink.copy_(source)
                start = time.perf_counter()
                operation()
                middle = time.perf_counter()
                operation()
                first.append(middle - start)
                second.append(time.perf_counter() - middle)
            ratio = statistics.median(first) / statistics.median(second)
            rows.append(Row("cold", case, "after the sweep", *_us(first), f"{ratio:.1f}x"))
            rows.append(Row("cold", case, "called again", *_us(second)))
    return rows


def _one_by_one(model: Any, patches: list[CheckpointWeightPatch], routes: RouteCache) -> None:
    for patch in patches:
        load_checkpoint_weight_patches(model, [patch], routes=routes)


def _theirs_one_by_one(theirs: Any, model: nn.Module, patches: list[Any]) -> None:
    for patch in patches:
        theirs(model, [patch])


# ------------------------------------------------------------------------------ contention


def _spin(stop: Any) -> None:  # pragma: no cover - a child process
    while not stop.is_set():
        sum(range(10_000))


def contention(args: argparse.Namespace) -> list[Row]:
    progress("contention: hidden 4096 bf16 at 10 %, 2 threads, quiet then loaded")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(2)
        base = PackedSlice(args.contention_hidden, 2, 0, torch.bfloat16, "cpu")
        base.load_weights(
            (name, torch.zeros(shape, dtype=torch.bfloat16)) for name, shape in base.shapes.items()
        )
        models = {m: copy.deepcopy(base) for m in ("replay", "bare")}
        routes = RouteCache()
        first = random_patches(base.shapes, torch.bfloat16, 0.001, generator, "cpu")
        load_checkpoint_weight_patches(models["replay"], first, routes=routes)
        patches = random_patches(base.shapes, torch.bfloat16, 0.10, generator, "cpu")
        plan = _lower_bound_plan(routes, patches, model_tensors(models["bare"]))
        calls: dict[str, Callable[[], object]] = {
            "replay": partial(
                load_checkpoint_weight_patches, models["replay"], patches, routes=routes
            ),
            "bare index write": partial(_scatters, plan),
        }
        quiet = interleaved(calls, args.rounds)
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        spinners = [context.Process(target=_spin, args=(stop,)) for _ in range(args.spinners)]
        for spinner in spinners:
            spinner.start()
        try:
            time.sleep(0.5)
            loaded = interleaved(calls, args.rounds)
        finally:
            stop.set()
            for spinner in spinners:
                spinner.join()
    finally:
        torch.set_num_threads(threads)
    rows = []
    for method in calls:
        rows.append(Row("contention", "quiet", method, *_us(quiet[method])))
        ratio = statistics.median(loaded[method]) / statistics.median(quiet[method])
        note = f"{ratio:.1f}x quiet (medians), {len(spinners)} busy processes"
        rows.append(Row("contention", "loaded", method, *_us(loaded[method]), note))
    return rows


# ---------------------------------------------------------------------------------- output


def _us(seconds: list[float]) -> tuple[float, float]:
    return min(seconds) * 1e6, statistics.median(seconds) * 1e6


def table(rows: list[Row]) -> str:
    titles = {
        "sweep": "density sweep, 1 thread: one call applying a patch to each of 4 tensors (ms)",
        "row": "row-parallel slice (a strided view), 1 thread: one call of one patch (ms)",
        "fixed": "fixed costs, 1 thread (µs)",
        "contention": "contention, 2 threads: one call at 10 % (ms)",
        "warm": "calls in a loop of calls, 1 thread: per call or per tensor (µs)",
        "cold": "first calls after a 128 MiB sweep of memory, 1 thread (µs)",
    }
    lines = []
    for kind, title in titles.items():
        chosen = [r for r in rows if r.table == kind]
        if not chosen:
            continue
        scale = 1.0 if kind in ("fixed", "warm", "cold") else 1e-3
        lines += ["", title, f"{'case':>38}  {'method':<38}{'min':>10}{'median':>10}  note"]
        for row in chosen:
            lines.append(
                f"{row.case:>38}  {row.method:<38}{row.min_us * scale:>10.2f}"
                f"{row.median_us * scale:>10.2f}  {row.note}"
            )
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=_ints, default=[1024, 4096, 8192])
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=["bf16", "fp32"])
    parser.add_argument(
        "--densities",
        type=_floats,
        default=[0.0001, 0.001, 0.01, 0.03, 0.1, 0.3, 0.5],
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-hidden", type=int, default=4096)
    parser.add_argument("--row-densities", type=_floats, default=[0.001, 0.01, 0.1])
    parser.add_argument("--many", type=int, default=200)
    parser.add_argument("--contention-hidden", type=int, default=4096)
    parser.add_argument(
        "--spinners", type=int, default=1, help="busy processes competing in the contention table"
    )
    parser.add_argument(
        "--tables",
        type=lambda t: t.split(","),
        default=["sweep", "row", "fixed", "warm", "cold", "contention"],
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.dtypes, args.densities = [256], ["bf16"], [0.01, 0.3]
        args.rounds, args.many, args.contention_hidden = 2, 20, 256
        args.row_hidden, args.row_densities = 256, [0.01]
    torch.set_num_threads(1)
    rows: list[Row] = []
    runs = (
        ("sweep", sweep),
        ("row", row_parallel),
        ("fixed", fixed_costs),
        ("warm", warm),
        ("cold", cold),
        ("contention", contention),
    )
    for kind, run in runs:
        if kind in args.tables:
            rows += run(args)
    header = (
        f"replay benchmark: torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {args.rounds} rounds, min and median"
    )
    print(header + "\n" + table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"header": header, "rows": [asdict(r) for r in rows]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
