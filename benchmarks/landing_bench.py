"""The cost of the backend's proof of landing: a worker's finish with and without read-back.

``python -m benchmarks.landing_bench`` (in ``.venv-vllm``): one worker engine holding a bf16
4096 x 2048 weight; each round sends one sparse patch (its route learnt first, so the patch
is replayed; the last row's is dense) and times ``finish_weight_update``, which applies the
update and, with the read-back on, reads back every changed element through the route.
With and without, in one process, order alternated; min and median of 7 per density.
(Issue 29 owns the main bench tables; this is the measurement behind the vLLM page.)
"""

from __future__ import annotations

import base64
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from patchctx import CheckpointWeightPatch
from patchctx.vllm import PatchctxWeightTransferEngine, encode_patches
from patchctx.vllm._transport import digest

ROWS, COLS = 4096, 2048


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(
            torch.zeros(ROWS, COLS, dtype=torch.bfloat16), requires_grad=False
        )

    def load_weights(self, weights: Any) -> set[str]:
        for _, tensor in weights:
            self.w.data.copy_(tensor)
        return {"w"}


def main() -> None:
    torch.set_num_threads(1)
    parallel = SimpleNamespace(rank=0, pipeline_parallel_size=1)
    config = SimpleNamespace(parallel_config=parallel, model_config=None)
    engine = PatchctxWeightTransferEngine(None, config, torch.device("cpu"), Model())
    engine.receiver.inline.limit = 64 << 20
    generator = torch.Generator().manual_seed(0)
    numel = ROWS * COLS
    version, steps = ["default"], [0]

    def finish(density: float, verify: bool) -> float:
        engine.verify_landing = verify
        count = int(numel * density)
        indices = (
            None  # 100%: a dense patch, every element read back
            if density == 1.0
            else torch.randperm(numel, generator=generator)[:count].sort().values
        )
        values = torch.randn(count, generator=generator).bfloat16()
        patch = CheckpointWeightPatch("w", (ROWS, COLS), torch.bfloat16, values, indices)
        steps[0] += 1
        target = str(steps[0])
        payload = encode_patches([patch], base_version=version[0], target_version=target)
        engine.start_weight_update()
        engine.update_weights(
            {
                "nbytes": len(payload),
                "sha256": digest(payload),
                "update_id": f"u{target}",
                "inline": base64.b64encode(payload).decode(),
            }
        )
        started = time.perf_counter()
        engine.finish_weight_update()
        version[0] = target
        return (time.perf_counter() - started) * 1000.0

    finish(0.001, False)  # learns the route
    for density in (0.001, 0.01, 0.05, 1.0):
        times: dict[bool, list[float]] = {True: [], False: []}
        for round_ in range(7):
            for verify in (True, False) if round_ % 2 else (False, True):
                times[verify].append(finish(density, verify))
        off, on = times[False], times[True]
        print(
            f"density {density:.1%}: finish {min(off):.2f} / {statistics.median(off):.2f} ms "
            f"without the read-back, {min(on):.2f} / {statistics.median(on):.2f} ms with it "
            f"(min / median); {int(numel * density)} elements read back"
        )


if __name__ == "__main__":
    main()
