"""End to end through ``vllm serve``: a training step's update, from the trainer's weights to
the HTTP answer that ends it, by patchctx and by vLLM's own dense reload.

``./dev bench --engine`` (vLLM's environment, ``.venv-vllm``) writes a Qwen2 with
``transformers`` (130 M parameters by default; ``--quick``: 16 M, one engine, fewer rows, a few
minutes), starts one ``vllm serve`` per tensor-parallel size (``--tp``, default 1 and 2) on
127.0.0.1 with the ``patchctx`` weight-transfer backend (vLLM's prepacked CPU kernels,
repacked after each patch; ``--keep-layout`` keeps checkpoint layout instead), and for each
density (the fraction of every tensor's elements a training step changed) times, side by
side in one process, methods interleaved and their order rotated:

- ``patchctx``: `PatchctxTrainerEngine.send_state_dict` with the cost model, calibrated at
  start on this machine through this tree's data plane (``UpdateCost.calibrate`` with
  `local_plane` as its ``payload``: trainer and worker engines in this process, over shared
  memory; its figures are printed) and given each link's rate;
- ``patchctx sparse``: the same with ``cost=None`` (sparse wherever the payload is smaller);
- ``patchctx dense``: the same path with every tensor sent dense (the diff told so);
- ``vllm reload``: vLLM's own dense update: the trainer saves the whole state dict as a
  safetensors file on tmpfs (``/dev/shm``), then ``reload_weights(weights_path=...)`` over
  ``/collective_rpc`` (vLLM's in-place layerwise reload).

One trainer engine per link makes every patchctx update, as a training loop keeps one: its
shared-memory pool and its record of the served state stay warm between updates. Before
each of them it is told (``remember``, untimed) the state the workers hold, which another
method's update may have changed; its own record's advance is timed with its update.

Columns: the trainer's time (diff and encode, or the save), the bytes that cross the link,
the time they waited for it, the worker's time (the rest: the ``update_weights`` round
trips, the finish where the workers apply and its check, or ``reload_weights``) and the
total from the trainer's state dict to the answer that ends the update; for ``patchctx``,
what the cost model sent (sparse, dense or mixed, by its bytes) and its time over the better
of ``patchctx sparse`` and ``patchctx dense``. Min and median over ``--repeats`` updates.

``--links``: each rate (bytes per second; 0 = shared memory, no limit; default shm, 1 Gb/s and
10 Gb/s) runs every row again over a token bucket in this process: each payload (patchctx's
``update_weights`` descriptors name its bytes; the reload's safetensors file) waits for its
bytes at that rate before the worker may read it, as if it crossed a link of that rate with
no overlap. This simulates trainers and workers on different hosts; it is not a network. The
bench ends with the first update's latency against a steady one, a verdict per row and a
concurrent-load check (`benchmarks.machine`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
    `waited` adds up the seconds spent waiting, as slept.
    """

    def __init__(self, rate: float, burst: int = 64 << 10) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.perf_counter()
        self.waited = 0.0

    def admit(self, nbytes: int) -> None:
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= nbytes
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)
            self.stamp = time.perf_counter()
            self.waited += self.stamp - now  # as slept (a loaded machine oversleeps)
            self.tokens = 0.0


class LimitedClient:
    """A weight-sync client whose payloads cross a `TokenBucket` before the worker reads them.

    Each ``update_weights`` descriptor names its payload's bytes (``nbytes``, whatever the
    transport); they cross the bucket before the workers are told of them, as the reload's
    file does before ``reload_weights``. Everything else is the inner client's.
    """

    def __init__(self, inner: Any, bucket: TokenBucket) -> None:
        self.inner, self.bucket = inner, bucket

    def update_weights(self, update_info: Any) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        self.bucket.admit(sum(int(info["nbytes"]) for info in infos))
        self.inner.update_weights(update_info)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Slab(torch.nn.Module):
    """One parameter ``w0``, loaded by a plain copy: the model of `local_plane`'s worker."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

    def load_weights(self, weights: Any) -> set[str]:
        for _, tensor in weights:
            self.w0.copy_(tensor)
        return {"w0"}


class _InProcessWorker:
    """vLLM's weight-sync client calls, made on a worker engine in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.version = engine, "default"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()
        if weight_version is not None:
            self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version


def local_plane() -> Any:
    """``payload`` for `UpdateCost.calibrate`: a patch from the trainer's hands to a worker's
    model, through this tree's data plane (shared memory), trainer and worker in this
    process: `PatchctxTrainerEngine.send_weights` to a `PatchctxWeightTransferEngine` that
    checks, decodes and applies it (one worker per patch shape)."""
    from types import SimpleNamespace

    from patchctx.vllm import (
        PatchctxTrainerEngine,
        PatchctxTrainerInitInfo,
        PatchctxWeightTransferEngine,
    )

    trainers: dict[tuple[tuple[int, ...], torch.dtype], Any] = {}

    def carry(patch: Any) -> object:
        key = (tuple(patch.shape), patch.dtype)
        if key not in trainers:
            parallel = SimpleNamespace(rank=0, pipeline_parallel_size=1)
            config = SimpleNamespace(parallel_config=parallel, model_config=None)
            worker = PatchctxWeightTransferEngine(None, config, torch.device("cpu"), _Slab(*key))
            info = PatchctxTrainerInitInfo(rank=0, inline_below=0, cost=None)
            trainers[key] = PatchctxTrainerEngine.trainer_init(
                info, client=_InProcessWorker(worker)
            )
        return trainers[key].send_weights([patch])

    return carry


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    from tests.vllm.support.serve import post

    status, answer = post(f"{url}/{path}", body, timeout=600)
    assert status == 200, answer
    return answer


def reload_update(
    url: str, new: dict[str, torch.Tensor], directory: Path, bucket: TokenBucket | None
) -> dict[str, float]:
    """vLLM's dense update: save a safetensors file on tmpfs, ``reload_weights`` from it.

    Over a simulated link the file's bytes cross the bucket before the reload may read them.
    """
    from safetensors.torch import save_file

    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file({k: v.contiguous() for k, v in new.items()}, str(path))
    nbytes = path.stat().st_size
    saved = crossed = time.perf_counter()
    if bucket is not None:
        bucket.admit(nbytes)
        crossed = time.perf_counter()
    _post(
        url,
        "collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
    )
    done = time.perf_counter()
    return {
        "trainer_ms": (saved - started) * 1e3,
        "nbytes": float(nbytes),
        "wire_ms": (crossed - saved) * 1e3,
        "worker_ms": (done - crossed) * 1e3,
        "total_ms": (done - started) * 1e3,
    }


def patchctx_update(
    engine: Any, new: dict[str, torch.Tensor], method: str, bucket: TokenBucket | None
) -> dict[str, float]:
    """One update by a patchctx method: the trainer's diff and encode, the wire, the rest.

    ``patchctx dense`` is the same path as the others, the diff made to send every tensor
    dense (`diff_state_dicts` with a `dense_above` no tensor is under).
    """
    from patchctx import diff_state_dicts

    waited = 0.0 if bucket is None else bucket.waited
    began = time.perf_counter()
    if method == "patchctx dense":
        dense = diff_state_dicts(engine.sent, new, cost=None, dense_above=1e-12)
        diff_ms = (time.perf_counter() - began) * 1e3
        stats = engine.send_weights(dense)
        assert stats is not None
        engine.remember(new)  # what a caller of send_weights does next
    else:
        stats = engine.send_state_dict(new)  # its record of the state included
        assert stats is not None
        diff_ms = stats.diff_ms
    # The whole call, as the caller waits for it: the trainer's record of what the workers
    # now hold (after the update) is trainer time too.
    total_ms = (time.perf_counter() - began) * 1e3
    sent_ms = stats.total_ms + (diff_ms if method == "patchctx dense" else 0.0)
    trainer_ms = diff_ms + stats.encode_ms + (total_ms - sent_ms)
    wire_ms = 0.0 if bucket is None else (bucket.waited - waited) * 1e3
    return {
        "trainer_ms": trainer_ms,
        "nbytes": float(stats.nbytes),
        "dense_nbytes": float(stats.dense_nbytes),
        "wire_ms": wire_ms,
        # the update_weights round trips, the finish (where the workers apply) and its check
        "worker_ms": total_ms - trainer_ms - wire_ms,
        "total_ms": total_ms,
    }


def calibrate(enabled: bool) -> Any:
    """The cost model: measured here through this tree's data plane, or the defaults."""
    from patchctx import UpdateCost

    if not enabled:
        return UpdateCost()
    # The fastest of 9 runs each: on a shared machine a measurement's fastest run is the
    # one the others left alone, and the data plane's large copies swing the most.
    return UpdateCost.calibrate(
        numel=2**22,
        dtype=torch.float32,
        source_dtype=torch.float32,
        payload=local_plane(),
        repeats=9,
        position_bytes=4,  # the shm plane sends positions flat, as int32 indices
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.vllm.support.checkpoints import read_checkpoint

    torch.set_num_threads(1)
    quiet_before = other_load()
    print(f"load check before: {quiet_before.describe()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="patchctx-engine-bench-"))
    model_dir = write_model(root / "model", args.hidden, args.layers, args.vocab)
    weights = read_checkpoint(model_dir)
    numel = sum(t.numel() for t in weights.values())
    model_line = (
        f"Qwen2, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{numel / 1e6:.1f} M parameters (float32), {len(weights)} tensors, "
        + ("checkpoint layout kept" if args.keep_layout else "vLLM's prepacked CPU kernels")
        + ("" if args.chunk_bytes is None else f"; patchctx in chunks of {args.chunk_bytes} B")
        + "".join(f"; servers with {name}={value}" for name, value in args.server_env)
    )
    print(f"model: {model_line}", flush=True)
    calibrated = calibrate(args.calibrate)
    source = "calibrated here" if args.calibrate else "the defaults, not calibrated"
    print(f"cost model ({source}; float32, through this tree's shm data plane):", flush=True)
    print(calibrated.describe(), flush=True)
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    # The reload's file (the model's size, on tmpfs) and the checkpoint: removed however the
    # run ends.
    shm = Path(tempfile.mkdtemp(prefix="patchctx-reload-", dir="/dev/shm"))
    try:
        for tp in args.tp:
            try:  # each engine starts from the checkpoint
                serve_rows(args, tp, root, model_dir, shm, weights, calibrated, rows, first)
            except RuntimeError as error:  # vllm serve did not start at this TP: say so, go on
                print(f"TP={tp}: vllm serve failed: {str(error)[-2000:]}", flush=True)
                rows.append({"tp": tp, "failed": str(error)[-2000:]})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)  # the servers' logs stay in `root`
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


def serve_rows(
    args: argparse.Namespace,
    tp: int,
    root: Path,
    model_dir: Path,
    shm: Path,
    weights: dict[str, torch.Tensor],
    calibrated: Any,
    rows: list[dict[str, Any]],
    first: dict[str, Any],
) -> None:
    """Every row of one engine (tensor-parallel size `tp`), appended to `rows`."""
    from dataclasses import replace

    from patchctx.vllm import HTTPWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
    from tests.vllm.support.serve import vllm_serve

    extra = ["--worker-extension-cls", "patchctx.vllm.PatchWorkerExtension"]
    started = time.perf_counter()
    with vllm_serve(
        model_dir,
        root / f"server-tp{tp}.log",
        extra_args=extra,
        tensor_parallel_size=tp,
        keep_layout=args.keep_layout,
        env=dict(args.server_env),
    ) as server:
        print(f"TP={tp}: vllm serve up in {time.perf_counter() - started:.0f} s", flush=True)
        client = HTTPWeightSyncClient(server.url, timeout=600)

        def trainer(cost: Any, bucket: TokenBucket | None) -> Any:
            info = PatchctxTrainerInitInfo(
                rank=0, inline_below=0, cost=cost, chunk_bytes=args.chunk_bytes
            )
            linked = client if bucket is None else LimitedClient(client, bucket)
            engine = PatchctxTrainerEngine.trainer_init(info, client=linked)
            engine.remember(weights)
            return engine

        seed = 1000 * tp
        # The first update of a fresh engine (routes warmed and the one-time costs paid at
        # start), against the steady ones at the same density below.
        new = step(weights, 0.01, seed)
        stats = trainer(calibrated, None).send_state_dict(new)
        assert stats is not None
        first.setdefault("total_ms", stats.total_ms)
        first.setdefault("density", 0.01)
        weights = new
        # The reload's first save creates its file on tmpfs, page faults that no later save
        # pays: one reload untimed, as patchctx's first update is timed apart. Then
        # `--warmup` more updates of each (untimed in the rows, reported): vLLM's repack
        # serves its packed copies from fresh memory until glibc's heap has grown to hold
        # them (docs/vllm.md, the first update), which would charge the first rows.
        reload_update(server.url, weights, shm, None)
        warm = trainer(calibrated, None)
        warmed: dict[str, list[float]] = {"patchctx": [], "vllm reload": []}
        first.setdefault("warmup", {})[str(tp)] = warmed
        for _ in range(args.warmup):
            seed += 1
            new = step(weights, 0.01, seed)
            warm.remember(weights)
            stats = warm.send_state_dict(new)
            assert stats is not None
            warmed["patchctx"].append(stats.total_ms)
            seed += 1
            weights = step(new, 0.01, seed)
            warmed["vllm reload"].append(reload_update(server.url, weights, shm, None)["total_ms"])
        warm.shutdown()  # its pool and record freed: the rows' engines run as without it
        del warm
        for link in args.links:
            limited = link > 0
            cost = replace(calibrated, link_bytes_per_second=link) if limited else calibrated
            # One trainer engine per link, as a training loop keeps one: its shared-memory
            # pool and its record stay warm between updates. The three patchctx methods
            # take turns on it, each with its own cost policy.
            engine = trainer(cost, TokenBucket(link) if limited else None)
            for density in args.densities:
                samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
                for repeat in range(args.repeats):
                    order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
                    for method in order:
                        seed += 1
                        new = step(weights, density, seed)
                        bucket = TokenBucket(link) if limited else None
                        if method == "vllm reload":
                            got = reload_update(server.url, new, shm, bucket)
                        else:
                            if bucket is not None:
                                engine.client.bucket = bucket  # (the bench's LimitedClient)
                            # The workers hold `weights` (another method's update may have
                            # put them there): the record, written in place, says so.
                            engine.remember(weights)
                            chosen = None if method != "patchctx" else cost
                            engine.init_info = replace(engine.init_info, cost=chosen)
                            got = patchctx_update(engine, new, method, bucket)
                        samples[method].append(got)
                        weights = new
                for method in METHODS:
                    row = summary_row(tp, link, density, method, samples[method])
                    rows.append(row)
                    print(format_row(row), flush=True)


def summary_row(
    tp: int, link: float, density: float, method: str, got: list[dict[str, float]]
) -> dict[str, Any]:
    row: dict[str, Any] = {"tp": tp, "link": link, "density": density, "method": method}
    for key in ("trainer_ms", "wire_ms", "worker_ms", "total_ms"):
        values = [sample[key] for sample in got]
        row[key] = (min(values), statistics.median(values))
    row["nbytes"] = statistics.median(sample["nbytes"] for sample in got)
    if all("dense_nbytes" in sample for sample in got):
        row["dense_nbytes"] = statistics.median(sample["dense_nbytes"] for sample in got)
    return row


def link_name(link: float) -> str:
    return "shm" if link <= 0 else f"{link * 8 / 1e9:g} Gb/s"


def choice(rows: dict[str, dict[str, Any]]) -> str:
    """The cost model's row against the better forced one: its form, and the ratio of mins.

    Its form is the forced row's whose bytes it sent dense (``dense_nbytes``; rows without
    it: whose bytes it sent), within 0.5% of the dense payload (a few small tensors sent the
    other way, norms and biases by their fixed costs, are not a choice the machine can time),
    or ``mixed``. Over shared memory a sparse patch's positions travel flat, so from half
    its elements changed (fp32) a sparse payload is as large as the dense one: its bytes
    alone cannot tell which was sent. Past 1.05x it is marked OVER, unless it sent
    what the better one sent (the same payload: the gap is the machine's noise, not the
    model's choice), marked ``same``.
    """
    ours = rows["patchctx"]
    sparse, dense = rows["patchctx sparse"], rows["patchctx dense"]
    best = min((sparse, dense), key=lambda row: row["total_ms"][0])
    key = (
        "dense_nbytes" if all("dense_nbytes" in row for row in (ours, sparse, dense)) else "nbytes"
    )
    nbytes, close = ours[key], 0.005 * dense["nbytes"]
    form = (
        "sparse"
        if abs(nbytes - sparse[key]) <= close
        else "dense"
        if abs(nbytes - dense[key]) <= close
        else "mixed"
    )
    better = "sparse" if best is sparse else "dense"
    ratio = ours["total_ms"][0] / best["total_ms"][0]
    mark = "" if ratio <= 1.05 else ", same" if form == better else ", OVER 1.05"
    return f"{form} ({ratio:.2f}x {better}{mark})"


def format_row(row: dict[str, Any], chosen: str = "") -> str:
    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0]:8.1f} / {pair[1]:8.1f}"

    return (
        f"| {row['tp']} | {link_name(row['link']):>8} | {row['density'] * 100:6.2f}% | "
        f"{row['method']:<15} | {ms(row['trainer_ms'])} | {row['nbytes'] / 1e6:8.2f} | "
        f"{ms(row['wire_ms'])} | {ms(row['worker_ms'])} | {ms(row['total_ms'])} | {chosen} |"
    )


HEADER = (
    "| TP | link | density | method | trainer ms (min / median) | wire MB | "
    "wire ms (min / median) | worker ms (min / median) | total ms (min / median) | "
    "the model's choice (its min / the better forced one's) |\n"
    "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"
)


def grouped(report: dict[str, Any]) -> dict[tuple[int, float, float], dict[str, dict[str, Any]]]:
    by: dict[tuple[int, float, float], dict[str, dict[str, Any]]] = {}
    for row in report["rows"]:
        if "failed" not in row:
            by.setdefault((row["tp"], row["link"], row["density"]), {})[row["method"]] = row
    return by


def table(report: dict[str, Any]) -> list[str]:
    lines = [HEADER]
    for methods in grouped(report).values():
        for method in METHODS:
            chosen = choice(methods) if method == "patchctx" else ""
            lines.append(format_row(methods[method], chosen))
    return lines


def verdict(report: dict[str, Any]) -> list[str]:
    """Per TP, link and density: patchctx against vLLM's reload, and the cost model's choice.

    On the fastest of each row's updates (the min: what the machine gives when others leave
    it alone; medians swing with concurrent load).
    """
    lines = []
    for (tp, link, density), methods in grouped(report).items():
        ours = methods["patchctx"]["total_ms"][0]
        reload = methods["vllm reload"]["total_ms"][0]
        speed = reload / ours if ours else math.inf
        word = "faster" if speed >= 1 else "SLOWER"
        factor = speed if speed >= 1 else 1 / speed
        lines.append(
            f"TP={tp} {link_name(link):>8} {density:7.2%}: patchctx {ours:8.1f} ms, "
            f"{factor:5.2f}x {word} than vllm reload ({reload:.1f} ms); the cost model sent "
            f"{choice(methods)}"
        )
    for row in report["rows"]:
        if "failed" in row:
            lines.append(f"TP={row['tp']}: no rows, vllm serve failed (see above)")
    return lines


QUICK = {
    "hidden": 512,
    "layers": 4,
    "vocab": 8192,
    "tp": [1],
    "densities": [0.001, 0.01, 0.1, 0.5],
    "repeats": 3,
}


def _variable(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` as a pair (an argparse type)."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="patchctx end to end through vllm serve")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: "
        + ", ".join(f"{key} {value}" for key, value in QUICK.items())
        + " (each still overridable)",
    )
    parser.add_argument("--hidden", type=int, help="default 1024 (130 M parameters)")
    parser.add_argument("--layers", type=int, help="default 8")
    parser.add_argument("--vocab", type=int, help="default 32768")
    parser.add_argument(
        "--tp", type=int, nargs="+", help="tensor-parallel sizes, one engine each (default 1 2)"
    )
    parser.add_argument(
        "--densities", type=float, nargs="+", help="default 0.0001 0.001 0.01 0.1 0.5"
    )
    parser.add_argument(
        "--links",
        type=float,
        nargs="+",
        default=[0.0, 1.25e8, 1.25e9],
        help="link rates in bytes/s (0: shared memory; 1.25e8 is 1 Gb/s, 1.25e9 10 Gb/s)",
    )
    parser.add_argument("--repeats", type=int, help="updates per row (default 3)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed updates of patchctx and of the reload (1%%) per engine before its rows, "
        "reported apart (default 2)",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help="patchctx's trainers send in update_weights chunks of about this many bytes, "
        "the diff of the rest overlapping each chunk's wire and check (default: one chunk)",
    )
    parser.add_argument("--keep-layout", action="store_true", help="no CPU prepacking")
    parser.add_argument(
        "--server-env",
        type=_variable,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable of the servers' environment only (repeatable), e.g. glibc's "
        "MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ (see docs/vllm.md, the first update)",
    )
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
    full = {
        "hidden": 1024,
        "layers": 8,
        "vocab": 32768,
        "tp": [1, 2],
        "densities": [0.0001, 0.001, 0.01, 0.1, 0.5],
        "repeats": 3,
    }
    for key, value in (QUICK if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.storage:
        from benchmarks.engine_storage import main as storage_main

        sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab"]
        sizes += [str(args.vocab), "--repeats", str(args.repeats)]
        return storage_main(sizes + (["--json", str(args.json)] if args.json else []))
    # --- end of the storage path's row ---
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run(args)
    print(f"\nmodel: {report['model']}; {report['repeats']} updates per row")
    print("\n".join(table(report)))
    first = report["first_update"]
    steady = next(
        (
            r["total_ms"]
            for r in report["rows"]
            if r.get("method") == "patchctx"
            and r["link"] == 0
            and r["density"] == first.get("density")
        ),
        None,
    )
    if first:
        print(
            f"\nfirst update of a fresh engine ({first['density']:.0%}): "
            f"{first['total_ms']:.1f} ms"
            + (
                f"; steady at that density (min / median): {steady[0]:.1f} / {steady[1]:.1f} ms"
                if steady
                else ""
            )
        )
    for tp, warmed in first.get("warmup", {}).items():
        shown = "; ".join(
            f"{name} " + ", ".join(f"{ms:.0f}" for ms in times)
            for name, times in warmed.items()
            if times
        )
        if shown:
            print(f"warm-up updates at TP={tp} (1%, untimed in the rows), ms: {shown}")
    print(
        "\nlinks other than shm are simulated: a token bucket in this process charges each "
        "payload's bytes (the reload's safetensors file, patchctx's update_weights payloads) "
        "at the link's rate before the worker may read them (no overlap; not a network)"
    )
    print("\nverdict (on each row's fastest update):")
    for line in verdict(report):
        print("  " + line)
    print("  " + report["load_verdict"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nchart: .venv/bin/python -m benchmarks.charts {args.json} --engine engine.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
