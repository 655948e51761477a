"""This patchctx against an earlier revision of itself, in one process: regressions, side by side.

    .venv/bin/python -m benchmarks.versus --base 09d5532 [--rounds 9] [--hidden 4096] [--json F]
    .venv/bin/python -m benchmarks.versus --base 09d5532 --many 200   # fixed costs

The base revision's ``patchctx`` package is exported with ``git archive`` into a temporary
folder and imported under another name (``patchctx_base``), so both versions run in the same
process, at one torch thread, on identical models (the bench's packed tensor-parallel decoder
layer, bf16, rank 0 of 2). Each round times, in rotated order, a steady-state route replay and
a loader-path call of each version, at 0.1, 1 and 10 % density; the table shows min and median
and the ratio this/base. After every round the four models must be bit-identical.

``--many N`` measures fixed costs instead: N tensors of 256x256 (bf16) at 0.1 %, replayed all
in one call (time per tensor) and one patch per call, beside a dense reload of the same
tensors by their loader (time per tensor).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import patchctx
from benchmarks.patch_bench import PackedSlice

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("base-replay", "this-replay", "base-loader", "this-loader")


def import_base(revision: str, folder: Path) -> ModuleType:
    """``patchctx`` as of `revision`, importable as ``patchctx_base`` (``vllm`` left out)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "patchctx"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    package = folder / "patchctx_base"
    (folder / "patchctx").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        path.write_text(re.sub(r"\bpatchctx\b", "patchctx_base", text), encoding="utf-8")
    sys.path.insert(0, str(folder))
    return importlib.import_module("patchctx_base")


def sparse_patches(
    module: ModuleType, shapes: Mapping[str, tuple[int, ...]], density: float, seed: int
) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    patches = []
    for name, shape in shapes.items():
        numel = shape[0] * shape[1]
        count = max(1, int(numel * density))
        indices = torch.randperm(numel, generator=generator)[:count].sort().values.int()
        values = (torch.randn(count, generator=generator) * 0.02).to(torch.bfloat16)
        patches.append(module.CheckpointWeightPatch(name, shape, torch.bfloat16, values, indices))
    return patches


class Many(torch.nn.Module):
    """N small weights, each loaded by a plain ``copy_`` (models with many small tensors)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16), requires_grad=False)
            for _ in range(count)
        )

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.ws[int(name[1:])].data.copy_(tensor)
        return {name for name, _ in weights}


def run_many(base: ModuleType, count: int, rounds: int) -> dict[str, list[float]]:
    """Fixed costs: per tensor in one call of N patches, per call of one patch (seconds)."""
    shapes = {f"w{i}": (256, 256) for i in range(count)}
    modules = {"base": base, "this": patchctx}
    models = {side: Many(count) for side in modules}
    caches = {side: module.RouteCache() for side, module in modules.items()}
    for side, module in modules.items():
        first = sparse_patches(module, shapes, 0.001, seed=1)
        module.load_checkpoint_weight_patches(models[side], first, routes=caches[side])
    dense = Many(count)
    checkpoint = [(name, torch.zeros(256, 256, dtype=torch.bfloat16)) for name in shapes]
    times: dict[str, list[float]] = {
        key: [] for key in ("base-per-tensor", "this-per-tensor", "base-one-patch-call")
    }
    times["this-one-patch-call"] = []
    times["dense-per-tensor"] = []
    for round_ in range(rounds + 1):
        sides = ("base", "this") if round_ % 2 else ("this", "base")
        for side in sides:
            module = modules[side]
            patches = sparse_patches(module, shapes, 0.001, seed=round_ + 2)
            start = time.perf_counter()
            module.load_checkpoint_weight_patches(models[side], patches, routes=caches[side])
            middle = time.perf_counter()
            for patch in patches[:50]:
                module.load_checkpoint_weight_patches(models[side], [patch], routes=caches[side])
            end = time.perf_counter()
            if round_:
                times[f"{side}-per-tensor"].append((middle - start) / count)
                times[f"{side}-one-patch-call"].append((end - middle) / 50)
        start = time.perf_counter()
        dense.load_weights(checkpoint)
        if round_:
            times["dense-per-tensor"].append((time.perf_counter() - start) / count)
    for name, tensor in models["base"].state_dict().items():
        if not torch.equal(tensor, models["this"].state_dict()[name]):
            raise AssertionError(f"the two versions differ at {name}")
    return times


def many_table(times: dict[str, list[float]], revision: str, count: int) -> str:
    lines = [
        f"fixed costs: {count} tensors of 256x256 bf16 at 0.1 %, this patchctx / {revision}, "
        "µs, min and median; both versions bit-identical",
        f"{'':>28} {'base min':>9} {'this min':>9} {'base med':>9} {'this med':>9}",
    ]
    for label, key in (
        ("replay, per tensor", "per-tensor"),
        ("call of one patch", "one-patch-call"),
    ):
        base, this = times[f"base-{key}"], times[f"this-{key}"]
        lines.append(
            f"{label:>28} {min(base) * 1e6:9.1f} {min(this) * 1e6:9.1f} "
            f"{statistics.median(base) * 1e6:9.1f} {statistics.median(this) * 1e6:9.1f}"
        )
    dense = times["dense-per-tensor"]
    lines.append(
        f"{'dense reload, per tensor':>28} {'':>9} {min(dense) * 1e6:9.1f} {'':>9} "
        f"{statistics.median(dense) * 1e6:9.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--many", type=int, help="measure fixed costs on this many tensors")
    parser.add_argument(
        "--atomic", action="store_true", help="every call with atomic=True (old values saved)"
    )
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    report: object
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        if args.many:
            report = run_many(base, args.many, args.rounds)
            print(many_table(report, args.base, args.many))
        else:
            report = run(base, args.hidden, args.rounds, atomic=args.atomic)
            print(table(report, args.base, args.rounds))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


def run(
    base: ModuleType, hidden: int, rounds: int, *, atomic: bool = False
) -> dict[str, dict[str, list[float]]]:
    layer = PackedSlice(hidden, 2, 0, torch.bfloat16, "cpu")
    generator = torch.Generator().manual_seed(0)
    checkpoint = {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in layer.shapes.items()
    }
    layer.load_weights(checkpoint.items())
    modules = {"base": base, "this": patchctx}
    results: dict[str, dict[str, list[float]]] = {}
    for density in (0.001, 0.01, 0.1):
        models = {method: copy.deepcopy(layer) for method in METHODS}
        caches = {side: module.RouteCache() for side, module in modules.items()}
        for side, module in modules.items():  # record the routes (not timed)
            first = sparse_patches(module, layer.shapes, density, seed=1)
            module.load_checkpoint_weight_patches(
                models[f"{side}-replay"], first, routes=caches[side]
            )
            module.load_checkpoint_weight_patches(models[f"{side}-loader"], first)
        times: dict[str, list[float]] = {method: [] for method in METHODS}
        for round_ in range(rounds + 1):  # round 0 warms up
            order = METHODS[round_ % 4 :] + METHODS[: round_ % 4]
            for method in order:
                side, kind = method.split("-")
                module = modules[side]
                patches = sparse_patches(module, layer.shapes, density, seed=round_ + 2)
                routes = caches[side] if kind == "replay" else None
                start = time.perf_counter()
                module.load_checkpoint_weight_patches(
                    models[method], patches, routes=routes, atomic=atomic
                )
                if round_:
                    times[method].append(time.perf_counter() - start)
            reference = models["base-loader"].state_dict()
            for method in METHODS:
                for name, tensor in models[method].state_dict().items():
                    if not torch.equal(tensor, reference[name]):
                        raise AssertionError(f"{method} differs from base-loader at {name}")
        results[f"{density:.1%}"] = times
    return results


def table(results: dict[str, dict[str, list[float]]], revision: str, rounds: int) -> str:
    lines = [
        f"this patchctx / {revision}, one process, 1 thread, {rounds} rounds, ms per call "
        "(all names of the layer); the four models were bit-identical after every round",
        f"{'density':>8} {'path':>7} {'base min':>9} {'this min':>9} {'ratio':>6} "
        f"{'base med':>9} {'this med':>9} {'ratio':>6}",
    ]
    for density, times in results.items():
        for kind in ("replay", "loader"):
            base, this = times[f"base-{kind}"], times[f"this-{kind}"]
            b_min, t_min = min(base) * 1e3, min(this) * 1e3
            b_med, t_med = statistics.median(base) * 1e3, statistics.median(this) * 1e3
            lines.append(
                f"{density:>8} {kind:>7} {b_min:9.2f} {t_min:9.2f} {t_min / b_min:6.2f} "
                f"{b_med:9.2f} {t_med:9.2f} {t_med / b_med:6.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
