"""The worker extension in-process engine tests share.

vLLM injects the ``worker_extension_cls`` into the worker class's bases once per process and
refuses a second class with attribute names in common, so every in-process engine of a test
session uses `LaneWorkerExtension`: ``patchctx.vllm.PatchWorkerExtension`` plus one probe.
Multi-process engines use ``patchctx.vllm.PatchWorkerExtension`` itself, as users do.
"""

from __future__ import annotations

import torch

from patchctx.vllm import PatchWorkerExtension


class LaneWorkerExtension(PatchWorkerExtension):
    """``PatchWorkerExtension`` and a probe of the worker's weight layout."""

    def patchctx_test_layout_kept(self) -> bool:
        """Whether every linear layer of this worker's model computes with
        ``torch.nn.functional.linear`` on its live weight (`keep_checkpoint_layout` was in
        effect when the model was loaded)."""
        from vllm.model_executor.layers.linear import LinearBase

        layers = [m for m in self.model_runner.get_model().modules() if isinstance(m, LinearBase)]
        return bool(layers) and all(
            getattr(m, "cpu_linear", None) is torch.nn.functional.linear and m.weight.numel()
            for m in layers
        )
