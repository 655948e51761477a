"""Serving speed: greedy decoding of one engine with and without patchctx, side by side.

``./dev bench --engine --serving`` (vLLM's environment) starts ``vllm.LLM`` in this process on
the engine bench's Qwen2 three ways, one after the other, twice over (A B C A B C), and times
greedy decoding of ``--tokens`` tokens from one prompt, ``--repeats`` times per start:

- ``vllm``: vLLM's CPU backend as shipped, no patchctx backend (linear weights prepacked);
- ``patchctx``: the same engine with ``weight_transfer_config={"backend": "patchctx"}``:
  vLLM's prepacked kernels, the checkpoint-layout weight kept next to them for patches, and
  the layers a patch writes repacked (`patchctx.vllm._layout`);
- ``kept layout``: ``keep_checkpoint_layout()``: no prepacking, ``torch.nn.functional.linear``
  on the live weights.

``ratio`` is each method's time over ``vllm``'s (min over min, median over median). The
``patchctx`` row also times one update (1% sparse to every matrix) and its repacking, and
decodes again after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

METHODS = ("vllm", "patchctx", "kept layout")


def _decode_ms(llm: Any, tokens: int, repeats: int) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 3])
    llm.generate([prompt], params, use_tqdm=False)  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        [out] = llm.generate([prompt], params, use_tqdm=False)
        times.append((time.perf_counter() - started) * 1000.0)
        assert len(out.outputs[0].token_ids) == tokens
    return times


def _update(llm: Any, model_dir: Path) -> dict[str, float]:
    """One 1% sparse update of every matrix through the patchctx backend (in this process)."""
    from patchctx.vllm import LLMWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
    from tests.vllm.support.checkpoints import read_checkpoint

    weights = read_checkpoint(model_dir)
    client = LLMWeightSyncClient(llm)
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", inline_below=1 << 30), client=client
    )
    engine.remember(weights)
    generator = torch.Generator().manual_seed(5)
    new = {}
    for name, tensor in weights.items():
        mask = (torch.rand(tensor.shape, generator=generator) < 0.01) & (tensor.ndim == 2)
        new[name] = tensor + mask * 1e-3
    stats = engine.send_state_dict(new)
    assert stats is not None
    return {"update_ms": stats.update_ms, "nbytes": float(stats.nbytes)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.engine_bench import write_model
    from patchctx.vllm import keep_checkpoint_layout
    from tests.vllm.support.engine import engine_env, shutdown_llm, start_llm

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="patchctx-serving-bench-"))
    model_dir = write_model(root / "model", args.hidden, args.layers, args.vocab)
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    after_update: list[float] = []
    updates: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for method in METHODS:
            options: dict[str, Any] = {}
            if method == "patchctx":
                options["weight_transfer_config"] = {"backend": "patchctx"}
            layout = keep_checkpoint_layout() if method == "kept layout" else None
            with engine_env(multiprocess=False), layout or contextlib.nullcontext():
                llm = start_llm(model_dir, **options)
            try:
                samples[method] += _decode_ms(llm, args.tokens, args.repeats)
                if method == "patchctx":
                    updates.append(_update(llm, model_dir))
                    after_update += _decode_ms(llm, args.tokens, args.repeats)
            finally:
                shutdown_llm(llm)
            print(f"{method}: {samples[method][-args.repeats :]}", flush=True)
    base = samples["vllm"]
    rows = []
    for method, times in [*samples.items(), ("patchctx, after an update", after_update)]:
        rows.append(
            {
                "method": method,
                "decode_ms": (min(times), statistics.median(times)),
                "ratio": (
                    min(times) / min(base),
                    statistics.median(times) / statistics.median(base),
                ),
            }
        )
    if updates:
        rows.append({"method": "update (1% sparse, repack included)", "updates": updates})
    return rows


HEADER = "| engine | decode ms (min / median) | over vllm (min / median) |\n| --- | ---: | ---: |"


def format_row(row: dict[str, Any]) -> str:
    if "updates" in row:
        times = [u["update_ms"] for u in row["updates"]]
        return f"| {row['method']} | {min(times):.1f} / {statistics.median(times):.1f} | |"
    low, mid = row["decode_ms"]
    over_low, over_mid = row["ratio"]
    return f"| {row['method']} | {low:.1f} / {mid:.1f} | {over_low:.3f} / {over_mid:.3f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="decode speed with and without patchctx")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = run(args)
    print(
        f"\nQwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32, "
        f"{args.tokens} greedy tokens, {args.rounds} starts x {args.repeats} runs per engine\n"
        + HEADER
    )
    for row in rows:
        print(format_row(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
