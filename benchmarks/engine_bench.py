"""End to end through ``vllm serve``: update latency of four ways to change the served weights.

``./dev bench --engine`` (vLLM's environment, ``.venv-vllm``) starts one ``vllm serve`` on
127.0.0.1 with the ``patchctx`` weight-transfer backend (a tiny-but-not-trivial Qwen2 written
by ``transformers``; the CPU backend keeps checkpoint layout), and drives it over HTTP with the
``patchctx`` trainer engine, payloads through shared memory. For each density (the fraction
of every tensor's elements a training step changed) it times, side by side:

- ``patchctx``: the backend as shipped (sparse patches, routes replayed in O(nnz));
- ``vllm fn``: the same payload applied by vLLM's own ``load_checkpoint_weight_patches``
  behind the same API (``PatchctxInitInfo(apply="vllm")``);
- ``layerwise``: every tensor sent dense and loaded inside vLLM's layerwise reload, the way
  vLLM's dense backends update (``apply="layerwise"``);
- ``load_weights``: every tensor sent dense into the model's ``load_weights`` (reference).

Columns: the trainer's diff time (``diff_state_dicts``; 0 for the dense methods), the bytes on
the wire, the worker's apply time (reported by the worker) and the whole ``update_weights``
round trip (transfer, checks and apply). Min and median over ``--repeats`` updates, methods
interleaved and their order rotated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

METHODS = ("patchctx", "vllm fn", "layerwise", "load_weights")
APPLY = {"patchctx": "patchctx", "vllm fn": "vllm", "layerwise": "layerwise"}


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


def worker_apply_ms(url: str) -> float:
    from tests.vllm.support.serve import post

    status, answer = post(f"{url}/collective_rpc", {"method": "patchctx_last_update"})
    assert status == 200, answer
    return float(answer["results"][0]["milliseconds"])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from patchctx import CheckpointWeightPatch
    from patchctx.vllm import HTTPWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
    from tests.vllm.support.checkpoints import read_checkpoint
    from tests.vllm.support.serve import vllm_serve

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="patchctx-engine-bench-"))
    model_dir = write_model(root / "model", args.hidden, args.layers, args.vocab)
    weights = read_checkpoint(model_dir)
    numel = sum(t.numel() for t in weights.values())
    print(
        f"model: Qwen2, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{numel / 1e6:.1f} M parameters (float32), {len(weights)} tensors",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    extra = ["--worker-extension-cls", "patchctx.vllm.PatchWorkerExtension"]
    started = time.perf_counter()
    with vllm_serve(model_dir, root / "server.log", extra_args=extra) as server:
        print(f"vllm serve up in {time.perf_counter() - started:.0f} s\n{HEADER}", flush=True)
        client = HTTPWeightSyncClient(server.url, timeout=600)

        def trainer(apply: str) -> Any:
            info = PatchctxTrainerInitInfo(rank=0, inline_below=0)
            engine = PatchctxTrainerEngine.trainer_init(info, client=client)
            # the worker's applier, for this connection
            client.init_weight_transfer_engine(
                {"transport": "shm", "weight_version": engine.version, "apply": apply}
            )
            engine.remember(weights)
            return engine

        seed = 1
        warm = trainer("patchctx")  # routes recorded once, as in a long RL run
        new = step(weights, 0.01, seed)
        warm.send_state_dict(new)
        weights = new
        for density in args.densities:
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            for repeat in range(args.repeats):
                order = METHODS[repeat % len(METHODS) :] + METHODS[: repeat % len(METHODS)]
                for method in order:
                    seed += 1
                    new = step(weights, density, seed)
                    engine = trainer(APPLY.get(method, "load_weights"))
                    if method in ("patchctx", "vllm fn"):
                        stats = engine.send_state_dict(new)
                    else:
                        dense = [
                            CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.reshape(-1))
                            for n, t in new.items()
                        ]
                        stats = engine.send_weights(dense)
                    assert stats is not None
                    samples[method].append(
                        {
                            "diff_ms": stats.diff_ms,
                            "nbytes": stats.nbytes,
                            "apply_ms": worker_apply_ms(server.url),
                            "update_ms": stats.update_ms,
                        }
                    )
                    weights = new
            for method in METHODS:
                got = samples[method]
                row = {"density": density, "method": method}
                for key in ("diff_ms", "apply_ms", "update_ms"):
                    values = [s[key] for s in got]
                    row[key] = (min(values), statistics.median(values))
                row["nbytes"] = statistics.median(s["nbytes"] for s in got)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0]:9.1f} / {pair[1]:9.1f}"

    return (
        f"| {row['density'] * 100:6.2f}% | {row['method']:<12} | {ms(row['diff_ms'])} | "
        f"{row['nbytes'] / 1e6:9.2f} | {ms(row['apply_ms'])} | {ms(row['update_ms'])} |"
    )


HEADER = (
    "| density | method       | diff ms (min / median) | wire MB   | "
    "apply ms (min / median) | update_weights ms (min / median) |\n"
    "| ---: | --- | ---: | ---: | ---: | ---: |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="patchctx end to end through vllm serve")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = run(args)
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
