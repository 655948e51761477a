"""The ``vllm.general_plugins`` entry point: registers the ``patchctx`` weight-transfer backend.

vLLM calls `register` in every process it starts (API server, engine core, workers) before it
builds an engine, so ``WeightTransferConfig(backend="patchctx")`` and
``vllm serve ... --weight-transfer-config '{"backend": "patchctx"}'`` work with no code in the
user's script. Registration names the module and class only: nothing of the backend is
imported until an engine with that backend starts.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "patchctx"


def register() -> None:
    """Register the ``patchctx`` backend with vLLM's weight-transfer factories (idempotent).

    Examples:
        >>> from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        >>> from patchctx.vllm._plugin import register
        >>> register(); register()  # vLLM may load plugins more than once per process
        >>> "patchctx" in WeightTransferEngineFactory._registry
        True
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "patchctx.vllm._backend", "PatchctxWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "patchctx.vllm._trainer", "PatchctxTrainerEngine"
        )
