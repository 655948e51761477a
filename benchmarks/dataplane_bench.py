"""The data plane, stage by stage, against one memcpy of the payload (issue 29's copy limit).

``./dev bench --engine --dataplane`` (vLLM's environment: ``patchctx.vllm`` is imported) times,
in this process with one torch thread, what an update's payload goes through over shared
memory, each stage on its own and then the whole path in one go:

- trainer: `plan_payload` (the header; nothing copied), then the shared-memory sender's
  ``write``: each tensor copied once straight into a pooled mapped file, each patch hashed
  (XXH3-128) as it is written;
- worker: the file mapped (privately, no copy), `decode_payload` with the descriptor's
  checksum and per-patch digests (one hash pass), tensors built as views of the mapping;
- sparse patches: the worker's check of the positions (`validate_patches`: range, order,
  duplicates), which every update gets before it is applied.

The unit is one ``memcpy`` of the payload's bytes (a torch ``copy_`` of that many bytes), or
for a sparse patch of its raw int32 positions and fp32 values. The goal: the whole path at
most 2.5 of them (dense) and 4 (sparse). Two payloads: a dense fp32 tensor of ``--numel``
elements (the default is 197 MB, the size of the issue's dense update) and a sparse patch of
1% of it. The sparse one is also shown with its positions in the smallest encoding (gaps),
what the inline and NCCL paths send. Min and median over ``--repeats``, stages interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
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


def path_stages(patch: Any, unit_bytes: int, repeats: int, positions: str) -> list[dict[str, Any]]:
    """Each stage of one payload's way from trainer to worker, and the whole way."""
    from patchctx import validate_patches
    from patchctx.vllm import SharedMemoryTransport, decode_payload
    from patchctx.vllm._codec import FAST, plan_payload

    directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    sender = SharedMemoryTransport(directory, owner="bench")
    receiver = SharedMemoryTransport(directory, limit=1 << 40)
    source = torch.empty(unit_bytes, dtype=torch.uint8).random_(0, 255)
    target = torch.empty_like(source)
    plan = plan_payload([patch], base_version="a", target_version="b", positions=positions)
    state: dict[str, Any] = {}

    def write() -> None:
        fields, sealed = sender.write(plan, algorithm=FAST, pooled=True)
        sender.release(reuse=True)  # as after a finish that returned
        state.update(descriptor={**fields, "nbytes": plan.nbytes}, sealed=sealed)

    write()

    def receive() -> Any:
        return receiver.receive(state["descriptor"])

    def decode() -> Any:
        sealed = state["sealed"]
        return decode_payload(receive(), checksum=sealed.checksum, intent=sealed.intent)

    def check() -> None:
        validate_patches(decode().patches)

    def whole(checked: bool = True) -> None:
        fresh = plan_payload([patch], base_version="a", target_version="b", positions=positions)
        fields, sealed = sender.write(fresh, algorithm=FAST, pooled=True)
        data = receiver.receive({**fields, "nbytes": fresh.nbytes})
        payload = decode_payload(data, checksum=sealed.checksum, intent=sealed.intent)
        if checked and patch.indices is not None:
            validate_patches(payload.patches)
        del payload, data  # the worker drops its views at commit
        sender.release(reuse=True)

    decoded = decode().patches[0]
    assert torch.equal(decoded.values, patch.values.to(patch.dtype)), "decoded other values"
    rows: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (the unit)", lambda: target.copy_(source)),
        (
            "trainer: plan_payload",
            lambda: plan_payload(
                [patch], base_version="a", target_version="b", positions=positions
            ),
        ),
        ("trainer: write into the pooled mapping (+ XXH3)", write),
        ("worker: map the file (no copy)", receive),
        ("worker: map + check XXH3 + decode as views", decode),
    ]
    if patch.indices is not None:
        rows.append(("worker: ... + check the positions", check))
        rows.append(("the data plane alone (no positions check)", lambda: whole(False)))
    rows.append(("whole path, trainer's tensors to the worker's patches", whole))
    out = []
    unit: tuple[float, float] | None = None
    for label, fn in rows:
        low, mid = _times(fn, repeats)
        unit = unit or (low, mid)
        out.append({"stage": label, "ms": (low, mid), "memcpys": (low / unit[0], mid / unit[1])})
    sender.close()
    for extra in Path(directory).iterdir():
        extra.unlink()
    Path(directory).rmdir()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the data plane against one memcpy")
    parser.add_argument(
        "--numel", type=int, default=49_283_072, help="fp32 elements (dense; default 197 MB)"
    )
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
    goals = {"dense": 2.5, "sparse 1%": 4.0, "sparse 1%, gap-coded": 4.0}
    for name, patch, raw, encoding in (
        ("dense", dense, numel * 4, "flat"),
        ("sparse 1%", sparse, nnz * 8, "flat"),
        ("sparse 1%, gap-coded", sparse, nnz * 8, "smallest"),
    ):
        rows = path_stages(patch, raw, args.repeats, encoding)
        report[name] = rows
        total = rows[-1]["memcpys"]
        print(
            f"\n{name}: {raw / 1e6:.1f} MB of raw bytes; the whole path costs "
            f"{total[0]:.2f} / {total[1]:.2f} memcpys of them (min / median; goal <= "
            f"{goals[name]})\n"
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
