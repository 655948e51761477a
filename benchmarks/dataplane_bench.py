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
most 2.5 of them (dense) and 4 (sparse). The payloads: a dense fp32 tensor of ``--numel``
elements (the default is 197 MB, the size of the issue's dense update), sparse patches of 1%
and 10% of it, the 1% one also with its positions in the smallest encoding (gaps), what the
inline and NCCL paths send. A one-element patch first measures the fixed cost of an update
(header, mapping, calls), and each payload's whole path is also shown less it, with its
median count of minor page faults (what the allocator costs). Min and median over
``--repeats``, each stage's calls one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FIXED = "fixed cost"


def _times(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Min and median ms of one call of `fn` (after one warm call), and its median page faults."""
    fn()
    got, faults = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        fn()
        got.append((time.perf_counter() - started) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(got), statistics.median(got), statistics.median(faults)


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
    out: list[dict[str, Any]] = []
    unit: tuple[float, float] | None = None
    for label, fn in rows:
        low, mid, faults = _times(fn, repeats)
        unit = unit or (low, mid)
        out.append(
            {
                "stage": label,
                "ms": (low, mid),
                "memcpys": (low / unit[0], mid / unit[1]),
                "page faults": faults,
            }
        )
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

    def sparse(nnz: int) -> Any:
        positions = torch.randperm(numel)[:nnz].sort().values.to(torch.int32)
        return CheckpointWeightPatch("w", (numel,), torch.float32, torch.randn(nnz), positions)

    one, tenth = sparse(numel // 100), sparse(numel // 10)
    report: dict[str, list[dict[str, Any]]] = {}
    payloads = (
        # What an update costs whatever its size: the header, the mapping, the calls.
        (FIXED, sparse(1), 8, "flat", None),
        ("dense", dense, numel * 4, "flat", 2.5),
        ("sparse 1%", one, one.values.numel() * 8, "flat", 4.0),
        ("sparse 1%, gap-coded", one, one.values.numel() * 8, "smallest", 4.0),
        ("sparse 10%", tenth, tenth.values.numel() * 8, "flat", 4.0),
    )
    for name, patch, raw, encoding, goal in payloads:
        rows = path_stages(patch, raw, args.repeats, encoding)
        report[name] = rows
        whole = rows[-1]
        if goal is None:
            print(
                f"\n{name}: {whole['ms'][0]:.2f} / {whole['ms'][1]:.2f} ms for the whole path "
                f"of a one-element sparse patch, {whole['page faults']:.0f} page faults"
            )
            continue
        fixed = report[FIXED][-1]["ms"]
        unit = rows[0]["ms"]
        whole["memcpys less the fixed cost"] = tuple(
            (whole["ms"][i] - fixed[i]) / unit[i] for i in (0, 1)
        )
        total, marginal = whole["memcpys"], whole["memcpys less the fixed cost"]
        print(
            f"\n{name}: {raw / 1e6:.1f} MB of raw bytes; the whole path costs "
            f"{total[0]:.2f} / {total[1]:.2f} memcpys of them (min / median; goal <= {goal}), "
            f"{marginal[0]:.2f} / {marginal[1]:.2f} less the fixed cost of an update, "
            f"{whole['page faults']:.0f} page faults\n"
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
