"""The worker extension the engine tests load, and the switch that keeps checkpoint layout.

vLLM's CPU backend repacks weights after loading (see ``tests/vllm/FINDINGS.md``). For engine
tests that patch linear and embedding weights end to end, `keep_checkpoint_layout` replaces
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (the function both
``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod`` call after loading) with one
that keeps each weight as loaded and computes with ``torch.nn.functional.linear`` on it. MoE
experts stay repacked: the CPU MoE kernel only reads its own layout.

In-process engines: call `keep_checkpoint_layout` before the engine starts, undo afterwards.
Multi-process engines (spawned engine-core process): set ``PATCHCTX_TEST_KEEP_LAYOUT=1`` in the
environment; vLLM imports this module (the worker extension) in the worker before it loads the
model, and the import applies the switch there.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import torch

from tests.vllm.support.patches import Patch, load_patches

KEEP_LAYOUT_ENV = "PATCHCTX_TEST_KEEP_LAYOUT"


def _linear_on_loaded_weight(layer: Any, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


def keep_checkpoint_layout() -> Callable[[], None]:
    """Stop the CPU backend from repacking dense linear and embedding weights; returns undo."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = _linear_on_loaded_weight

    def undo() -> None:
        utils.dispatch_cpu_unquantized_gemm = original

    return undo


if os.environ.get(KEEP_LAYOUT_ENV) == "1":
    keep_checkpoint_layout()


def encode(patches: list[Patch]) -> bytes:
    """Patches as bytes for ``collective_rpc`` (a prototype of ``patchctx.vllm.encode_patches``)."""
    buffer = io.BytesIO()
    torch.save(
        [
            {
                "name": p.name,
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "values": p.values,
                "indices": p.indices,
            }
            for p in patches
        ],
        buffer,
    )
    return buffer.getvalue()


def decode(data: bytes) -> list[Patch]:
    items = torch.load(io.BytesIO(data), weights_only=True)
    return [
        Patch(
            item["name"],
            tuple(item["shape"]),
            getattr(torch, item["dtype"]),
            item["values"],
            item["indices"],
        )
        for item in items
    ]


class LaneWorkerExtension:
    """Mixed into vLLM's worker class by ``LLM(worker_extension_cls=...)``.

    vLLM injects an extension class into the worker class's bases once per process and refuses
    a second class with the same attribute names: use this one class for every engine started
    in a process.
    """

    model_runner: Any

    def patchctx_test_apply(self, payload: bytes) -> list[str]:
        """Apply encoded patches to this worker's model; return the names loaded."""
        model = self.model_runner.get_model()
        with torch.no_grad():
            return sorted(load_patches(model, decode(payload)))

    def patchctx_test_layout_kept(self) -> bool:
        """Whether this worker runs with `keep_checkpoint_layout` in effect."""
        from vllm.model_executor.layers import utils

        return utils.dispatch_cpu_unquantized_gemm is _linear_on_loaded_weight
