"""The data plane, stage by stage, against one memcpy of the payload (issue 29's copy limit).

``./dev bench --engine --dataplane`` (vLLM's environment: ``patchctx.vllm`` is imported) times,
in this process with one torch thread, what an update's payload goes through today over
shared memory, each stage on its own: the trainer's `encode_patches` and SHA-256 and the
file written to ``/dev/shm``; the worker's read, SHA-256 and `decode_payload`. Next to them:
one ``memcpy`` of the payload's bytes (a torch ``copy_`` of that many bytes, the unit of the
issue's goal) and what a data plane at the copy limit would use instead: the tensors' bytes
written once straight into a mapped shared-memory file, read back as a view of the mapping
(no copy), and the checksums that run near memory speed (``zlib.crc32`` from the standard
library; ``xxhash``'s XXH3 when it is installed). A mapped file made fresh per update pays
for its pages (tmpfs allocates and zeroes them on first touch, about a copy's cost): the
stage "into a mapping reused across updates" is the copy alone. Min and median over
``--repeats``.

Two payloads: a dense fp32 tensor (``--numel`` elements) and a sparse patch of 1% of it
(int32 positions and fp32 values, the raw bytes the goal counts). The ratio column is each
stage's time over one memcpy of the payload (dense) or of its raw positions and values
(sparse); the goal is at most 2.5 (dense) and 4 (sparse) for the whole path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()
    got = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        got.append((time.perf_counter() - started) * 1e3)
    return min(got), statistics.median(got)


def stages(patch: Any, raw_bytes: int, repeats: int) -> list[dict[str, Any]]:
    from patchctx.vllm import SharedMemoryTransport, decode_payload, encode_patches
    from patchctx.vllm._transport import digest

    payload = encode_patches([patch], base_version="a", target_version="b")
    sender = SharedMemoryTransport(tempfile.mkdtemp(dir="/dev/shm"))
    source = torch.empty(raw_bytes, dtype=torch.uint8).random_(0, 255)
    target = torch.empty_like(source)
    descriptor = {**sender.describe(payload), "nbytes": len(payload)}  # size: the caller adds it

    writer = SharedMemoryTransport(str(sender.directory))

    def write() -> None:
        writer.describe(payload)
        writer.release()

    receiver = SharedMemoryTransport(str(sender.directory))
    path = sender.directory / descriptor["shm"]

    def mapped_write() -> None:  # the tensors' bytes written once into a mapped file
        with open(path.with_suffix(".map"), "w+b") as file:
            file.truncate(raw_bytes)
            with mmap.mmap(file.fileno(), raw_bytes) as mapping:
                torch.frombuffer(mapping, dtype=torch.uint8).copy_(source)
                del mapping  # the view above is gone; the mapping may close

    arena = open(path.with_suffix(".arena"), "w+b")  # noqa: SIM115 (closed below)
    arena.truncate(raw_bytes)
    arena_map = mmap.mmap(arena.fileno(), raw_bytes)
    arena_views = [torch.frombuffer(arena_map, dtype=torch.uint8)]  # cleared before closing

    def arena_write() -> None:  # the same, into a mapping made (and faulted in) once
        arena_views[0].copy_(source)

    def mapped_read() -> None:  # a view of the mapping: no copy
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as m:
            memoryview(m)[:8].tobytes()

    rows: list[tuple[str, str, Callable[[], object]]] = [
        ("memcpy of the payload's bytes (the unit)", "unit", lambda: target.copy_(source)),
        ("trainer: encode_patches", "today", lambda: encode_patches([patch])),
        ("trainer: SHA-256", "today", lambda: digest(payload)),
        ("trainer: shm file write", "today", write),
        ("worker: shm file read", "today", lambda: receiver.receive(descriptor)),
        ("worker: SHA-256", "today", lambda: digest(payload)),
        ("worker: decode_payload", "today", lambda: decode_payload(payload)),
        ("bytes written once into a mapped shm file", "limit", mapped_write),
        ("the same into a mapping reused across updates", "limit", arena_write),
        ("a view of the mapped file (no copy)", "limit", mapped_read),
        ("zlib.crc32", "limit", lambda: zlib.crc32(payload)),
        ("blake2b (keyed, for untrusted links)", "limit", lambda: hashlib.blake2b(payload)),
    ]
    try:
        import xxhash  # type: ignore[import-not-found,unused-ignore]

        rows.append(("xxhash XXH3-64", "limit", lambda: xxhash.xxh3_64_intdigest(payload)))
    except ImportError:
        pass
    out = []
    unit = None
    for label, kind, fn in rows:
        low, mid = _times(fn, repeats)
        unit = unit or (low, mid)
        out.append(
            {
                "stage": label,
                "kind": kind,
                "ms": (low, mid),
                "memcpys": (low / unit[0], mid / unit[1]),
            }
        )
    arena_views.clear()
    arena_map.close()
    arena.close()
    sender.close()
    for extra in sender.directory.iterdir():
        extra.unlink()
    sender.directory.rmdir()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the data plane against one memcpy")
    parser.add_argument("--numel", type=int, default=1 << 24, help="fp32 elements (dense)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from patchctx import CheckpointWeightPatch

    numel = args.numel
    dense = CheckpointWeightPatch("w", (numel,), torch.float32, torch.randn(numel))
    nnz = numel // 100
    positions = torch.randperm(numel)[:nnz].sort().values.to(torch.int32)
    sparse = CheckpointWeightPatch("w", (numel,), torch.float32, torch.randn(nnz), positions)
    report = {}
    for name, patch, raw in (
        ("dense", dense, numel * 4),
        ("sparse 1%", sparse, nnz * 8),
    ):
        rows = stages(patch, raw, args.repeats)
        report[name] = rows
        today = sum(r["memcpys"][1] for r in rows if r["kind"] == "today")
        print(
            f"\n{name}: {raw / 1e6:.1f} MB of raw bytes; today's path (median) costs "
            f"{today:.1f} memcpys of them\n"
            "| stage | ms (min / median) | memcpys (min / median) |\n| --- | ---: | ---: |"
        )
        for r in rows:
            print(
                f"| {r['stage']} | {r['ms'][0]:.2f} / {r['ms'][1]:.2f} | "
                f"{r['memcpys'][0]:.2f} / {r['memcpys'][1]:.2f} |"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
