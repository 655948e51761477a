"""The storage path end to end through ``vllm serve``: the pause the engine sees, apart from
the background time, against a bare apply of the same patches measured in the same run.

``python -m benchmarks.engine_storage`` (vLLM's environment, ``.venv-vllm``; also
``./dev bench --engine --storage``) writes a Qwen2 with ``transformers``, starts one
``vllm serve`` with `patchctx.vllm.StorageWorkerExtension` (checkpoint layout kept: no CPU
prepacking, so that the bare apply below is the same call), publishes the checkpoint as an
anchor into a directory with `StoragePublisher` and brings the server to it. Then, for each
density (0.1, 1 and 10 % of every tensor's elements changed by a training step), each repeat
is one version:

- ``publish``: the trainer's `StoragePublisher.publish` of the new state (the diff against
  the last version, encode, checksums, the writes);
- ``background``: the worker's prepare (``patchctx_storage_prepare``: fetch, sizes and
  SHA-256, decode, validate, merge, learn the routes of names not seen before), while the
  engine keeps serving; the worker's own clock;
- ``apply``: the worker's apply inside the pause (``patchctx_storage_apply``: the version
  check, then the writes its prepare found, checked live, all or nothing; or, where routes
  do not decide them all, one atomic `load_checkpoint_weight_patches` call);
- ``window``: what the driver sees as the paused window: one request to the server's
  `patchctx.vllm.paused_apply` (``pause_generation(mode="keep")``, the apply on every worker,
  ``resume_generation``, inside the server; vLLM's ``pause_generation`` waits 20 ms by itself
  before it returns, which the apply overlaps), from sending it to its answer;
- ``bare``: the same patches, read back from the version's folder beforehand (not timed),
  applied on the worker by a plain ``load_checkpoint_weight_patches(model, patches,
  routes=..., atomic=True)`` on the warm routes: what the pause costs without a plan made
  in the background. Applying a
  version's values again leaves the weights as they are; every other repeat it runs before
  the sync instead of after.

The goals (issue 31) are of the pause the serving engine sees, the apply step: apply <= 1.2x
bare, and apply <= 5 % of the whole sync (publish + background + window) at 1 %. The window's
share is printed too. ``--quick``: a small model and 2 repeats (a few minutes on a
loaded 2-core machine, most of it the server's start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import write_model
from patchctx.vllm import StorageWorkerExtension

DENSITIES = (0.001, 0.01, 0.1)
STEPS = ("publish", "background", "apply", "window", "bare")
EXTENSION = "benchmarks.engine_storage.BareApplyExtension"  # also when run as __main__
ROOT = Path(__file__).resolve().parent.parent


class BareApplyExtension(StorageWorkerExtension):
    """`StorageWorkerExtension`, plus the bare apply the bench compares the pause with."""

    def bench_bare_apply(self, folder: str) -> dict[str, Any]:
        """Apply the update at `folder` by a plain call on the worker's routes; its time."""
        from patchctx import load_checkpoint_weight_patches, load_patches

        patches = load_patches(folder)
        model = self._patchctx_model()
        routes = self._patchctx_worker().routes
        before = routes.stats.replayed
        started = time.perf_counter()
        load_checkpoint_weight_patches(model, patches, routes=routes, atomic=True)  # type: ignore[arg-type]
        milliseconds = (time.perf_counter() - started) * 1e3
        return {
            "milliseconds": milliseconds,
            "replayed": routes.stats.replayed - before,
            "model_walks_ms": self._model_walks_ms(model),
        }

    @staticmethod
    def _model_walks_ms(model: torch.nn.Module) -> dict[str, float]:
        """What the worker's apply reads beyond the bare call: its one walk of the model."""
        from patchctx.vllm._aliases import aliases_in
        from patchctx.vllm._apply import layerwise_reload_active
        from patchctx.vllm._layout import repack_touched
        from patchctx.vllm._transformed import transformed_in
        from patchctx.vllm._walk import ModelWalk

        names = [name for name, _ in model.named_parameters()]
        walk = ModelWalk.of(model)
        out = {}
        for label, step in (
            ("walk", lambda: ModelWalk.of(model)),
            ("layerwise_reload_active", lambda: layerwise_reload_active(model, walk)),
            ("transformed_weights", lambda: transformed_in(walk)),
            ("tied_aliases", lambda: aliases_in(walk)),
            ("repack_touched", lambda: repack_touched(model, names)),
        ):
            started = time.perf_counter()
            step()
            out[label] = (time.perf_counter() - started) * 1e3
        return out


def trained(weights: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """`weights` after a training step that changed `density` of every tensor's elements."""
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=generator) < density
        new[name] = torch.where(
            mask, tensor + torch.randn(tensor.shape, generator=generator), tensor
        )
    return new


def _rpc(url: str, method: str, *args: Any) -> list[Any]:
    from tests.vllm.support.serve import post

    status, answer = post(f"{url}/collective_rpc", {"method": method, "args": list(args)}, 600.0)
    if status != 200 or not isinstance(answer, dict):
        raise RuntimeError(f"{method}: HTTP {status}: {answer!r:.400}")
    results = answer["results"]
    assert isinstance(results, list)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    from patchctx import StoragePublisher
    from patchctx.vllm import sync_server
    from tests.vllm.support.checkpoints import read_checkpoint
    from tests.vllm.support.serve import vllm_serve

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="patchctx-engine-storage-"))
    model_dir = write_model(root / "model", args.hidden, args.layers, args.vocab)
    weights = read_checkpoint(model_dir)
    numel = sum(t.numel() for t in weights.values())
    model_line = (
        f"Qwen2, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{numel / 1e6:.1f} M parameters (float32), {len(weights)} tensors, TP=1, "
        "checkpoint layout kept"
    )
    print(f"model: {model_line}", flush=True)
    store = root / "store"
    publisher = StoragePublisher(store, anchor_every=10**6)
    publisher.publish(weights)  # version 1: an anchor, the checkpoint the server loads
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with vllm_serve(
        model_dir,
        root / "server.log",
        extra_args=[
            "--worker-extension-cls",
            EXTENSION,
            "--middleware",
            "patchctx.vllm.paused_apply",
        ],
    ) as server:
        print(f"vllm serve up in {time.perf_counter() - started:.0f} s", flush=True)
        assert sync_server(server.url, str(store), timeout=600.0)["version"] == 1
        seed = 1
        for density in args.densities:
            samples: dict[str, list[float]] = {step: [] for step in STEPS}
            replayed: list[int] = []
            planned = 0  # versions applied by the writes their prepare found
            walks: list[dict[str, float]] = []
            stages: list[dict[str, float]] = []  # the planned pause's own split
            for repeat in range(args.repeats):
                seed += 1
                weights = trained(weights, density, seed)
                began = time.perf_counter()
                published = publisher.publish(weights)
                samples["publish"].append((time.perf_counter() - began) * 1e3)
                folder = str(store / f"v{published.version:08d}")
                bare_first = repeat % 2 == 1
                if bare_first:
                    (bare,) = _rpc(server.url, "bench_bare_apply", folder)
                synced = sync_server(server.url, str(store), timeout=600.0)
                assert synced["version"] == published.version, synced
                assert synced["server_window_ms"] is not None, "the server lacks paused_apply"
                if not bare_first:
                    (bare,) = _rpc(server.url, "bench_bare_apply", folder)
                (worker,) = synced["workers"]
                samples["background"].append(worker["prepare_seconds"] * 1e3)
                samples["apply"].append(worker["milliseconds"])
                samples["window"].append(synced["pause_seconds"] * 1e3)
                samples["bare"].append(bare["milliseconds"])
                replayed.append(int(worker["replayed"]))
                planned += bool(worker.get("planned"))
                walks.append(bare["model_walks_ms"])
                if "stages_ms" in worker:
                    stages.append(worker["stages_ms"])
            row: dict[str, Any] = {
                "density": density,
                "replayed": min(replayed),
                "planned": planned,
                "versions": args.repeats,
            }
            if stages:
                row["pause_stages_ms"] = {
                    label: statistics.median(p[label] for p in stages) for label in stages[0]
                }
            row["model_walks_ms"] = {
                label: statistics.median(w[label] for w in walks) for label in walks[0]
            }
            for step, values in samples.items():
                row[step] = (min(values), statistics.median(values))
            median = {step: row[step][1] for step in STEPS}
            row["apply_over_bare"] = median["apply"] / median["bare"]
            whole = median["publish"] + median["background"] + median["window"]
            row["apply_share"] = median["apply"] / whole
            row["window_share"] = median["window"] / whole
            rows.append(row)
            print(format_row(row), flush=True)
    return {"model": model_line, "repeats": args.repeats, "rows": rows}


HEADER = (
    "density  publish ms     background ms   apply ms      window ms     bare ms       "
    "apply/bare  apply share  window share\n"
    "         min / median   min / median    min / median  min / median  min / median"
)


def format_row(row: dict[str, Any]) -> str:
    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0]:6.1f} / {pair[1]:6.1f}"

    return (
        f"{row['density']:6.1%}  {ms(row['publish'])} {ms(row['background'])}  "
        f"{ms(row['apply'])} {ms(row['window'])} {ms(row['bare'])}  "
        f"{row['apply_over_bare']:6.2f}x    {row['apply_share']:7.1%}      "
        f"{row['window_share']:7.1%}"
    )


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        ratio = row["apply_over_bare"]
        met = "meets" if ratio <= 1.2 else "misses"
        line = f"{row['density']:.1%}: the pause (apply) {ratio:.2f}x bare ({met} <= 1.2x)"
        if "planned" in row:
            line += f", {row['planned']} of {row['versions']} versions planned in the prepare"
        if row["density"] == 0.01:
            share = row["apply_share"]
            line += (
                f"; the pause (apply) {share:.1%} of the whole sync "
                f"({'meets' if share <= 0.05 else 'misses'} <= 5 %); the paused window "
                f"{row['window_share']:.1%}"
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--quick", action="store_true", help="hidden 256, 2 layers, vocab 4096, 2 repeats"
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.repeats = 256, 2, 4096, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The server's worker imports the extension from this checkout.
    before = os.environ.get("PYTHONPATH")
    paths = [str(ROOT), *filter(None, (before or "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    try:
        report = run(args)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    print(f"\nmodel: {report['model']}; {report['repeats']} versions per row\n" + HEADER)
    for row in report["rows"]:
        print(format_row(row))
    print("\nwhat the worker's apply reads from the model, beyond the bare call (median ms):")
    for row in report["rows"]:
        walks = ", ".join(f"{k} {v:.2f}" for k, v in row["model_walks_ms"].items())
        print(f"  {row['density']:.1%}: {walks}")
    if any("pause_stages_ms" in row for row in report["rows"]):
        print("\nwhere the planned pause went (median ms):")
        for row in report["rows"]:
            if "pause_stages_ms" in row:
                split = ", ".join(f"{k} {v:.2f}" for k, v in row["pause_stages_ms"].items())
                print(f"  {row['density']:.1%}: {split}")
    print("\nverdict (medians):")
    for line in verdict(report["rows"]):
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
