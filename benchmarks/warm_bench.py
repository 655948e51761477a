"""The first update with and without `RouteCache.warm`, side by side (time and peak memory).

One `PackedSlice` (a decoder layer's worth at tensor-parallel rank 1 of 2, loaded as vLLM
loads it) per round and method, each round with fresh random sparse patches:

- ``cold``: a new `RouteCache`; the first update goes through the loader (stages every tensor)
  and records the routes;
- ``warm``: a new `RouteCache`, ``warm`` for every checkpoint name (timed on its own line),
  then the same first update, which replays;
- ``steady``: the update after that one (routes known either way), for reference.

Times are min / median milliseconds over the rounds, methods interleaved with their order
rotating. Peak extra memory is the process's peak RSS above its level before the call (the
kernel's mark reset per measurement); run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed
buffers leave the RSS at once (the script re-runs itself that way when it can).

``python -m benchmarks.warm_bench --hidden 4096 --density 0.001 0.01 --rounds 5``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.patch_bench import DTYPES, Meter, PackedSlice, random_patches
from patchctx import RouteCache, load_checkpoint_weight_patches

STEPS = ("cold first update", "warm", "first update after warm", "steady update")


def _model(hidden: int, dtype: torch.dtype) -> PackedSlice:
    model = PackedSlice(hidden, tp=2, rank=1, dtype=dtype, device="cpu")
    generator = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=generator) for name, shape in model.shapes.items()}
    with torch.no_grad():
        model.load_weights(full.items())
    return model


def measure(
    hidden: int, dtype: torch.dtype, density: float, rounds: int
) -> dict[str, list[tuple[float, int | None]]]:
    meter = Meter("cpu")
    base = _model(hidden, dtype)
    specs = [(name, shape, dtype) for name, shape in base.shapes.items()]
    found: dict[str, list[tuple[float, int | None]]] = {step: [] for step in STEPS}
    generator = torch.Generator().manual_seed(1)
    for round_ in range(rounds + 1):  # round 0 warms up the machinery, not reported
        first = random_patches(base.shapes, dtype, density, generator, "cpu")
        second = random_patches(base.shapes, dtype, density, generator, "cpu")

        def cold(
            first: list[Any] = first, second: list[Any] = second, round_: int = round_
        ) -> None:
            model, routes = copy.deepcopy(base), RouteCache()
            taken = meter(lambda: load_checkpoint_weight_patches(model, first, routes=routes))
            assert routes.stats.replayed == 0
            steady = meter(lambda: load_checkpoint_weight_patches(model, second, routes=routes))
            if round_:
                found["cold first update"].append(taken)
                found["steady update"].append(steady)

        def warm(first: list[Any] = first, round_: int = round_) -> None:
            model, routes = copy.deepcopy(base), RouteCache()
            learnt = meter(lambda: routes.warm(model, specs))
            taken = meter(lambda: load_checkpoint_weight_patches(model, first, routes=routes))
            assert routes.stats.replayed == len(first) and routes.stats.loader_calls == 0
            if round_:
                found["warm"].append(learnt)
                found["first update after warm"].append(taken)

        runs: list[Callable[[], None]] = [cold, warm]
        for run in runs[round_ % 2 :] + runs[: round_ % 2]:
            run()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform == "linux":
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "benchmarks.warm_bench", *(argv or sys.argv[1:])]
        return subprocess.call(command, env=env)
    torch.set_num_threads(1)
    print(
        f"PackedSlice hidden={args.hidden} {args.dtype}, TP rank 1 of 2, 1 torch thread, "
        f"{args.rounds} rounds: min / median ms, peak extra MiB (max)"
    )
    print(f"{'density':>8}  {'step':<24}  {'ms min':>8}  {'ms median':>9}  {'MiB':>8}")
    for density in args.density:
        found = measure(args.hidden, DTYPES[args.dtype], density, args.rounds)
        for step in STEPS:
            times = [t * 1000 for t, _ in found[step]]
            peaks = [m for _, m in found[step] if m is not None]
            peak = f"{max(peaks) / 2**20:8.1f}" if peaks else f"{'-':>8}"
            print(
                f"{density:>8.2%}  {step:<24}  {min(times):8.2f}  "
                f"{statistics.median(times):9.2f}  {peak}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
