"""End to end through ``vllm serve``: a training step's update, from the trainer's weights to
the HTTP answer that ends it, by patchctx and by vLLM's own dense reload.

``./dev bench --engine`` (vLLM's environment, ``.venv-vllm``) writes a Qwen2 with
``transformers``, starts one ``vllm serve`` on 127.0.0.1 with the ``patchctx`` weight-transfer
backend (vLLM's prepacked CPU kernels, repacked after each patch; ``--keep-layout`` keeps
checkpoint layout instead), and for each density (the fraction of every tensor's elements a
training step changed) times, side by side in one process, methods interleaved and their
order rotated:

- ``patchctx``: `PatchctxTrainerEngine.send_state_dict` with the cost model, calibrated at
  start on this machine (``UpdateCost.calibrate`` with the real shared-memory data plane as
  its ``payload``; its figures are printed) and given each link's rate;
- ``patchctx sparse``: the same with ``cost=None`` (sparse wherever the payload is smaller);
- ``patchctx dense``: every tensor sent dense through the same backend;
- ``vllm reload``: vLLM's own dense update: the trainer saves the whole state dict as a
  safetensors file on tmpfs (``/dev/shm``), then ``reload_weights(weights_path=...)`` over
  ``/collective_rpc`` (vLLM's in-place layerwise reload).

Columns: the trainer's time (diff and encode, or the save), the bytes that cross the link,
the worker's time (the ``update_weights`` or ``reload_weights`` round trip: transfer,
checks, apply, repacking) and the total from the trainer's state dict to the answer that
ends the update. Min and median over ``--repeats`` updates.

``--links``: each rate (bytes per second; 0 = shared memory, no limit) runs every row again
over a token bucket in this process: each payload (each safetensors file) waits for its
bytes at that rate before the worker may read it, as if it crossed a link of that rate
with no overlap. This simulates trainers and workers on different hosts; it is not a
network. The bench ends with the first update's latency against a steady one, a verdict per
row and a concurrent-load check (`benchmarks.machine`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import other_load, verdict_line

METHODS = ("patchctx", "patchctx sparse", "patchctx dense", "vllm reload")
PATCHCTX = METHODS[:3]


def write_model(directory: Path, hidden: int, layers: int, vocab: int) -> Path:
    import transformers

    from tests.vllm.support.serve import write_tokenizer

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    write_tokenizer(directory, vocab)
    return directory


def step(weights: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """`weights` after a training step that changed `density` of every tensor's elements."""
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=generator) < density
        new[name] = tensor + mask * 1e-3 * torch.randn(tensor.shape, generator=generator)
    return new


class TokenBucket:
    """A link of `rate` bytes per second: `admit` returns once `nbytes` could have crossed it.

    Tokens (bytes) accrue at `rate` up to `burst`; a payload waits for all of its bytes.
    """

    def __init__(self, rate: float, burst: int = 64 << 10) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.perf_counter()

    def admit(self, nbytes: int) -> None:
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= nbytes
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)
            self.stamp = time.perf_counter()
            self.tokens = 0.0


class LimitedSender:
    """A sender whose payloads cross a `TokenBucket` before the worker may read them."""

    def __init__(self, inner: Any, bucket: TokenBucket) -> None:
        self.inner, self.bucket = inner, bucket
        self.name, self.concurrent = inner.name, inner.concurrent

    def describe(self, payload: bytes) -> dict[str, Any]:
        described: dict[str, Any] = self.inner.describe(payload)
        self.bucket.admit(len(payload))  # the worker is told of it once it has "arrived"
        return described

    def transmit(self, payload: bytes) -> None:
        self.inner.transmit(payload)

    def release(self) -> None:
        self.inner.release()

    def close(self) -> None:
        self.inner.close()


def shm_payload(patch: Any) -> object:
    """One patch through the shared-memory data plane, trainer and worker (for calibrate)."""
    from patchctx.vllm import SharedMemoryTransport, decode_payload, encode_patches
    from patchctx.vllm._transport import check_received, digest

    sender = SharedMemoryTransport()
    payload = encode_patches([patch], base_version="a", target_version="b")
    descriptor = {**sender.describe(payload), "nbytes": len(payload), "sha256": digest(payload)}
    try:
        data = SharedMemoryTransport().receive(descriptor)
        return decode_payload(check_received(data, descriptor))
    finally:
        sender.release()


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    from tests.vllm.support.serve import post

    status, answer = post(f"{url}/{path}", body, timeout=600)
    assert status == 200, answer
    return answer


def reload_update(
    url: str, new: dict[str, torch.Tensor], directory: Path, bucket: TokenBucket | None
) -> dict[str, float]:
    """vLLM's dense update: save a safetensors file on tmpfs, ``reload_weights`` from it."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file({k: v.contiguous() for k, v in new.items()}, str(path))
    nbytes = path.stat().st_size
    if bucket is not None:
        bucket.admit(nbytes)
    saved = time.perf_counter()
    _post(
        url,
        "collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
    )
    done = time.perf_counter()
    return {
        "trainer_ms": (saved - started) * 1e3,
        "nbytes": float(nbytes),
        "worker_ms": (done - saved) * 1e3,
        "total_ms": (done - started) * 1e3,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from patchctx import CheckpointWeightPatch, UpdateCost
    from patchctx.vllm import HTTPWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
    from tests.vllm.support.checkpoints import read_checkpoint
    from tests.vllm.support.serve import vllm_serve

    torch.set_num_threads(1)
    quiet_before = other_load()
    print(f"load check before: {quiet_before.describe()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="patchctx-engine-bench-"))
    model_dir = write_model(root / "model", args.hidden, args.layers, args.vocab)
    weights = read_checkpoint(model_dir)
    numel = sum(t.numel() for t in weights.values())
    model_line = (
        f"Qwen2, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{numel / 1e6:.1f} M parameters (float32), {len(weights)} tensors, TP={args.tp}, "
        + ("checkpoint layout kept" if args.keep_layout else "vLLM's prepacked CPU kernels")
    )
    print(f"model: {model_line}", flush=True)
    if args.calibrate:
        calibrated = UpdateCost.calibrate(numel=2**23, dtype=torch.float32, payload=shm_payload)
    else:
        calibrated = UpdateCost()
    print("cost model (UpdateCost.calibrate here, float32, shm payload):", flush=True)
    print(calibrated.describe(), flush=True)
    rows: list[dict[str, Any]] = []
    extra = ["--worker-extension-cls", "patchctx.vllm.PatchWorkerExtension"]
    started = time.perf_counter()
    shm = Path(tempfile.mkdtemp(prefix="patchctx-reload-", dir="/dev/shm"))
    first: dict[str, float] = {}
    with vllm_serve(
        model_dir,
        root / "server.log",
        extra_args=extra,
        tensor_parallel_size=args.tp,
        keep_layout=args.keep_layout,
    ) as server:
        print(f"vllm serve up in {time.perf_counter() - started:.0f} s", flush=True)
        client = HTTPWeightSyncClient(server.url, timeout=600)

        def trainer(cost: UpdateCost | None, bucket: TokenBucket | None) -> Any:
            info = PatchctxTrainerInitInfo(rank=0, inline_below=0, cost=cost)
            engine = PatchctxTrainerEngine.trainer_init(info, client=client)
            if bucket is not None:
                engine.sender = LimitedSender(engine.sender, bucket)
            engine.remember(weights)
            return engine

        seed = 1
        # The first update of a fresh engine (routes warmed and the one-time costs paid at
        # start), against the steady ones at the same density below.
        new = step(weights, 0.01, seed)
        stats = trainer(calibrated, None).send_state_dict(new)
        assert stats is not None
        first = {"total_ms": stats.total_ms, "density": 0.01}
        weights = new
        for link in args.links:
            limited = link > 0
            cost = replace_link(calibrated, link) if limited else calibrated
            for density in args.densities:
                samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
                for repeat in range(args.repeats):
                    order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
                    for method in order:
                        seed += 1
                        new = step(weights, density, seed)
                        bucket = TokenBucket(link) if limited else None
                        if method == "vllm reload":
                            samples[method].append(reload_update(server.url, new, shm, bucket))
                            weights = new
                            continue
                        engine = trainer(None if method == "patchctx sparse" else cost, bucket)
                        if method == "patchctx dense":
                            began = time.perf_counter()
                            dense = [
                                CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.reshape(-1))
                                for n, t in new.items()
                            ]
                            built = (time.perf_counter() - began) * 1e3
                            stats = engine.send_weights(dense)
                            assert stats is not None
                            trainer_ms, total_ms = built + stats.encode_ms, built + stats.total_ms
                        else:
                            stats = engine.send_state_dict(new)
                            assert stats is not None
                            trainer_ms, total_ms = stats.diff_ms + stats.encode_ms, stats.total_ms
                        samples[method].append(
                            {
                                "trainer_ms": trainer_ms,
                                "nbytes": float(stats.nbytes),
                                "worker_ms": stats.update_ms,
                                "total_ms": total_ms,
                            }
                        )
                        weights = new
                for method in METHODS:
                    got = samples[method]
                    row: dict[str, Any] = {"link": link, "density": density, "method": method}
                    for key in ("trainer_ms", "worker_ms", "total_ms"):
                        values = [s[key] for s in got]
                        row[key] = (min(values), statistics.median(values))
                    row["nbytes"] = statistics.median(s["nbytes"] for s in got)
                    rows.append(row)
                    print(format_row(row), flush=True)
    quiet_after = other_load()
    return {
        "model": model_line,
        "repeats": args.repeats,
        "cost": calibrated.describe(),
        "first_update": first,
        "rows": rows,
        "load": [quiet_before.__dict__, quiet_after.__dict__],
        "load_verdict": verdict_line(quiet_before, quiet_after),
    }


def replace_link(cost: Any, link: float) -> Any:
    from dataclasses import replace

    return replace(cost, link_bytes_per_second=link)


def link_name(link: float) -> str:
    return "shm" if link <= 0 else f"{link * 8 / 1e9:g} Gb/s"


def format_row(row: dict[str, Any]) -> str:
    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0]:8.1f} / {pair[1]:8.1f}"

    return (
        f"| {link_name(row['link']):>8} | {row['density'] * 100:6.2f}% | {row['method']:<15} | "
        f"{ms(row['trainer_ms'])} | {row['nbytes'] / 1e6:8.2f} | {ms(row['worker_ms'])} | "
        f"{ms(row['total_ms'])} |"
    )


HEADER = (
    "| link | density | method | trainer ms (min / median) | wire MB | "
    "worker ms (min / median) | total ms (min / median) |\n"
    "| --- | ---: | --- | ---: | ---: | ---: | ---: |"
)


def verdict(report: dict[str, Any]) -> list[str]:
    """Per link and density: patchctx against vLLM's reload, and the cost model's choice.

    On the fastest of each row's updates (the min: what the machine gives when others leave
    it alone; medians swing with concurrent load).
    """
    lines = []
    by: dict[tuple[float, float], dict[str, dict[str, Any]]] = {}
    for row in report["rows"]:
        by.setdefault((row["link"], row["density"]), {})[row["method"]] = row
    for (link, density), methods in by.items():
        ours = methods["patchctx"]["total_ms"][0]
        reload = methods["vllm reload"]["total_ms"][0]
        best = min(methods[m]["total_ms"][0] for m in ("patchctx sparse", "patchctx dense"))
        speed = reload / ours if ours else math.inf
        word = "faster" if speed >= 1 else "SLOWER"
        factor = speed if speed >= 1 else 1 / speed
        choice = ours / best if best else math.inf
        lines.append(
            f"{link_name(link):>8} {density:7.2%}: patchctx {ours:8.1f} ms, {factor:5.2f}x "
            f"{word} than vllm reload ({reload:.1f} ms); the cost model's choice is "
            f"{choice:.2f}x the better of sparse and dense"
            + ("" if choice <= 1.05 else " (OVER 1.05)")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="patchctx end to end through vllm serve")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine")
    parser.add_argument(
        "--densities", type=float, nargs="+", default=[0.0001, 0.001, 0.01, 0.1, 0.5]
    )
    parser.add_argument(
        "--links",
        type=float,
        nargs="+",
        default=[0.0],
        help="link rates in bytes/s (0: shared memory; 1.25e8 is 1 Gb/s, 1.25e9 10 Gb/s)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-layout", action="store_true", help="no CPU prepacking")
    parser.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="the UpdateCost defaults instead of a calibration at start",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    # --- the storage path's row (issue 31): benchmarks.engine_storage, on its own server ---
    parser.add_argument("--storage", action="store_true", help="the storage path's row instead")
    args = parser.parse_args(argv)
    if args.storage:
        from benchmarks.engine_storage import main as storage_main

        sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab"]
        sizes += [str(args.vocab), "--repeats", str(args.repeats)]
        return storage_main(sizes + (["--json", str(args.json)] if args.json else []))
    # --- end of the storage path's row ---
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run(args)
    print(f"\nmodel: {report['model']}; {report['repeats']} updates per row\n" + HEADER)
    for row in report["rows"]:
        print(format_row(row))
    first = report["first_update"]
    steady = next(
        (
            r["total_ms"]
            for r in report["rows"]
            if r["method"] == "patchctx" and r["link"] == 0 and r["density"] == first["density"]
        ),
        None,
    )
    print(
        f"\nfirst update of a fresh engine ({first['density']:.0%}): {first['total_ms']:.1f} ms"
        + (
            f"; steady at that density (min / median): {steady[0]:.1f} / {steady[1]:.1f} ms"
            if steady
            else ""
        )
    )
    print("\nverdict (on each row's fastest update):")
    for line in verdict(report):
        print("  " + line)
    print("  " + report["load_verdict"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
