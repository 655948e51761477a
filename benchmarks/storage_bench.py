"""The storage path's pause against its background time, and against a bare apply.

One decoder layer at one tensor-parallel rank (`benchmarks.patch_bench.PackedSlice`, bf16),
updated at 0.1, 1 and 10 % density through a stored delta (``save_patches`` into a version
folder). Per round, interleaved and rotated, in one process at one thread:

- ``background``: `StorageFollower.prepare` (read the files, check sizes and SHA-256, decode,
  merge, validate; routes already learnt), what a worker does while it keeps generating;
- ``pause``: `StorageFollower.apply` of the prepared update, the step inside
  ``pause_generation`` (one atomic `load_checkpoint_weight_patches` call);
- ``bare``: the same patches, already in memory, applied by the same call with the same
  routes: the least a pause can cost;
- ``publish``: the trainer's `save_patches` of the delta (encode, checksums, write), given
  the patches (the diff itself is `benchmarks.diff_bench`'s).

``pause share`` is the pause over the whole sync (publish + background + pause) on a local
disk: with a network or an object store between trainer and workers the background grows and
the share shrinks; the pause does not.

The goals (issue 31): pause <= 1.2x bare, and pause <= 5 % of the whole sync at 1 %.
``python -m benchmarks.storage_bench [--hidden 2048] [--rounds 7] [--quick]``.

``--reader REV``: `load_patches` (fetch and decode: read, SHA-256, safetensors layout,
positions, validation) of one stored update, this revision against revision `REV`'s
(`benchmarks.versus.import_base`), interleaved in one process at one thread: time (min and
median) and the peak resident memory above the process's before each call (Linux's
``VmHWM``, reset through ``/proc/self/clear_refs`` before each call). The update: a 1 %-density
bf16 step of a model of ``--elements`` elements (default 100 M) in 4 M-element tensors.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.patch_bench import PackedSlice, random_patches
from patchctx import (
    CheckpointWeightPatch,
    PreparedUpdate,
    RouteCache,
    StorageFollower,
    load_checkpoint_weight_patches,
    load_patches,
    save_patches,
)

DENSITIES = (0.001, 0.01, 0.1)


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


class _Sync:
    """One density's model, stored delta and follower; each method is one measured step."""

    def __init__(self, hidden: int, density: float, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.model = PackedSlice(hidden, tp=2, rank=0, dtype=torch.bfloat16, device="cpu")
        with torch.no_grad():
            self.model.qkv.normal_(generator=generator)
            self.model.mlp.normal_(generator=generator)
        self.patches = random_patches(self.model.shapes, torch.bfloat16, density, generator, "cpu")
        store = Path(tempfile.mkdtemp(prefix="patchctx-storage-bench-"))
        self.manifest = save_patches(
            store / "v00000002", self.patches, base_version=1, target_version=2
        )
        self.scratch = store / "publish"  # the trainer's writes, timed apart from the follower
        self.routes = RouteCache()
        self.follower = StorageFollower(store, self.model, version=1, routes=self.routes)
        self.prepared: PreparedUpdate | None = None
        self.background()  # learns the routes (once per name, as a worker does)
        self.pause()

    def publish(self) -> None:
        save_patches(self.scratch, self.patches, base_version=1, target_version=2)

    def background(self) -> None:
        self.follower.version = 1
        self.prepared = self.follower.prepare()

    def pause(self) -> None:
        assert self.prepared is not None
        self.follower.apply(self.prepared)

    def bare(self) -> None:
        load_checkpoint_weight_patches(self.model, self.patches, routes=self.routes, atomic=True)


def storage_rows(hidden: int, rounds: int, seed: int = 0) -> list[dict[str, float]]:
    """One row per density: milliseconds (min and median) of background, pause and bare."""
    rows = []
    for density in DENSITIES:
        sync = _Sync(hidden, density, seed)
        times: dict[str, list[float]] = {"publish": [], "background": [], "pause": [], "bare": []}
        for round_ in range(rounds):
            order = [
                ("publish", sync.publish),
                ("background", sync.background),
                ("pause", sync.pause),
                ("bare", sync.bare),
            ]
            if round_ % 2:  # rotate: bare before the storage path every other round
                order = [order[3], *order[:3]]
            for name, action in order:
                times[name].append(_timed(action))
        row: dict[str, float] = {
            "density": density,
            "nnz": float(sum(p.values.numel() for p in sync.patches)),
            "file_mib": sum(size for size, _ in sync.manifest.files.values()) / 2**20,
        }
        for name, values in times.items():
            row[f"{name}_min_ms"] = min(values) * 1e3
            row[f"{name}_median_ms"] = statistics.median(values) * 1e3
        row["pause_over_bare"] = row["pause_median_ms"] / row["bare_median_ms"]
        row["pause_share"] = row["pause_median_ms"] / (
            row["pause_median_ms"] + row["background_median_ms"] + row["publish_median_ms"]
        )
        rows.append(row)
    return rows


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "density       nnz  file MiB  publish ms     background ms   pause ms     bare ms   "
        "pause/bare  pause share",
        "                             min / median   min / median    min / median min / median",
    ]
    for row in rows:
        lines.append(
            f"{row['density']:7.1%} {row['nnz']:9.0f} {row['file_mib']:9.2f}  "
            f"{row['publish_min_ms']:6.1f} / {row['publish_median_ms']:6.1f} "
            f"{row['background_min_ms']:6.1f} / {row['background_median_ms']:6.1f}  "
            f"{row['pause_min_ms']:5.1f} / {row['pause_median_ms']:5.1f}  "
            f"{row['bare_min_ms']:5.1f} / {row['bare_median_ms']:5.1f}   "
            f"{row['pause_over_bare']:6.2f}x   {row['pause_share']:8.1%}"
        )
    return "\n".join(lines)


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_above(action: Callable[[], object]) -> tuple[float, float]:
    """Seconds of `action`, and its peak resident memory above the start, in MiB."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident size
    before = _resident_kib("VmRSS")
    seconds = _timed(action)
    return seconds, (_resident_kib("VmHWM") - before) / 1024


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc), so each peak starts from the same."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: peaks start higher
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reader_rows(revision: str, elements: int, rounds: int, density: float = 0.01) -> str:
    """`load_patches` of one update, this revision against `revision`'s (see the module)."""
    import importlib

    from benchmarks.versus import import_base

    base = import_base(revision, Path(tempfile.mkdtemp(prefix="patchctx-reader-base-")))
    # The renaming import also renamed the format's name in the base's manifest check.
    vars(importlib.import_module("patchctx_base._storage._format"))["FORMAT"] = "patchctx.patches"
    generator = torch.Generator().manual_seed(0)
    side = 2048
    shapes = {f"layers.{i}.weight": (side, side) for i in range(max(1, elements // side**2))}
    numel = sum(math.prod(shape) for shape in shapes.values())
    delta = random_patches(shapes, torch.bfloat16, density, generator, "cpu")
    anchor = [
        CheckpointWeightPatch(name, shape, torch.bfloat16, torch.randn(shape).bfloat16().flatten())
        for name, shape in shapes.items()
    ]
    lines = [
        f"load_patches: {len(shapes)} bf16 tensors of {side}x{side}, {numel / 1e6:.0f} M "
        f"elements; {rounds} rounds, {torch.get_num_threads()} thread(s), interleaved",
        "update                         reader       time ms min / median   "
        "peak MiB above start min / median",
    ]
    for label, patches in (
        (f"{density:.0%} delta ({sum(p.values.numel() for p in delta):,} changed)", delta),
        ("dense anchor", anchor),
    ):
        folder = Path(tempfile.mkdtemp(prefix="patchctx-reader-")) / "update"
        manifest = save_patches(folder, patches)
        file_mib = sum(size for size, _ in manifest.files.values()) / 2**20
        readers: dict[str, Callable[[], object]] = {
            f"base {revision}": functools.partial(base.load_patches, folder),
            "this": functools.partial(load_patches, folder),
        }
        for reader in readers.values():
            got = reader()
            assert isinstance(got, list) and len(got) == len(patches)
            del got
        times: dict[str, list[float]] = {name: [] for name in readers}
        peaks: dict[str, list[float]] = {name: [] for name in readers}
        for round_ in range(rounds):
            names = list(readers)
            if round_ % 2:
                names.reverse()
            for name in names:
                _trim()
                seconds, peak = _peak_above(readers[name])
                times[name].append(seconds * 1e3)
                peaks[name].append(peak)
        for name in readers:
            lines.append(
                f"{label + f', {file_mib:.1f} MiB':30} {name:12} "
                f"{min(times[name]):8.1f} / {statistics.median(times[name]):8.1f}   "
                f"{min(peaks[name]):8.1f} / {statistics.median(peaks[name]):8.1f}"
            )
        del patches
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--reader", metavar="REV", help="load_patches against revision REV's")
    parser.add_argument("--elements", type=int, default=100_000_000, help="with --reader")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.reader:
        print(reader_rows(args.reader, args.elements, args.rounds))
        return 0
    hidden, rounds = (256, 3) if args.quick else (args.hidden, args.rounds)
    rows = storage_rows(hidden, rounds)
    print(
        f"storage path: PackedSlice hidden={hidden} tp=2 bf16, {rounds} rounds, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
