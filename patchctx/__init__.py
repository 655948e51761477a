"""patchctx: dense and sparse weight patches in checkpoint coordinates.

A running PyTorch model (a vLLM worker above all) takes updates written against the Hugging Face
checkpoint (name, full shape, flat indices and values) while the model's own ``load_weights()``
keeps mapping them to runtime coordinates (tensor-parallel slices, packed parameters, experts).
"""

import importlib
from typing import TYPE_CHECKING

from patchctx._by_name import LoadByName
from patchctx._chunking import ByteBudget, ChunkingPolicy, ChunkState, PerTensor, SingleCall
from patchctx._errors import (
    CastKindError,
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    LoaderError,
    PatchError,
    PatchProblem,
    RegionError,
    RegionTimeoutError,
)
from patchctx._load import RouteCache, load_checkpoint_weight_patches
from patchctx._masked_copy import MaskedCopy, masked_copy
from patchctx._model import SupportsLoadWeights
from patchctx._ordering import Coalesce, InputOrder, OrderingPolicy
from patchctx._patch import CheckedPatch, CheckpointWeightPatch, PatchLike, validate_patches
from patchctx._routes import RouteStats
from patchctx._strategies import Auto, BoolMask, CopyStrategy, IntSentinel, NaNMask, ReservedBits

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and the docs
    from patchctx._audit import AuditReport, AuditRow, audit
    from patchctx._cost import UpdateCost
    from patchctx._diff import diff_state_dicts, iter_diff_state_dicts, patch_nbytes
    from patchctx._encoding import WireEncoding, wire_encoding, wire_sizes
    from patchctx._lowbyte import LowByteDetector
    from patchctx._prepare import prepare
    from patchctx._shards import TensorShard
    from patchctx._storage import (
        PositionEncoding,
        PreparedUpdate,
        PublishedVersion,
        StorageFollower,
        StoragePublisher,
        StoredPatch,
        StoredUpdateError,
        UpdateManifest,
        load_patches,
        read_manifest,
        save_patches,
    )
    from patchctx._warm import WarmReport, WarmRow

# The trainer side, storage, the one-off diagnostics (`audit`, `prepare`) and the dry run's
# report (`RouteCache.warm`), imported on first use: a worker that only applies patches never
# loads them (``import patchctx`` stays the core; tools/structure.py counts it).
_LAZY: dict[str, str] = {
    name: f"patchctx.{module}"
    for module, names in {
        "_audit": "AuditReport AuditRow audit",
        "_cost": "UpdateCost",
        "_diff": "diff_state_dicts iter_diff_state_dicts patch_nbytes",
        "_encoding": "WireEncoding wire_encoding wire_sizes",
        "_lowbyte": "LowByteDetector",
        "_prepare": "prepare",
        "_shards": "TensorShard",
        "_warm": "WarmReport WarmRow",
        "_storage": "PositionEncoding PreparedUpdate PublishedVersion StorageFollower "
        "StoragePublisher StoredPatch StoredUpdateError UpdateManifest load_patches "
        "read_manifest save_patches",
    }.items()
    for name in names.split()
}


def __getattr__(name: str) -> object:
    """Import a name of `_LAZY` the first time it is asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'patchctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"
"""The version of this patchctx, a PEP 440 string."""

__all__ = [
    "AuditReport",
    "AuditRow",
    "Auto",
    "BoolMask",
    "ByteBudget",
    "CastKindError",
    "CheckedPatch",
    "CheckpointWeightPatch",
    "ChunkState",
    "ChunkingPolicy",
    "Coalesce",
    "CopyStrategy",
    "InputOrder",
    "IntSentinel",
    "InvalidPatchError",
    "InvalidPatchTypeError",
    "LoadByName",
    "LoaderContractError",
    "LoaderError",
    "LowByteDetector",
    "MaskedCopy",
    "NaNMask",
    "OrderingPolicy",
    "PatchError",
    "PatchLike",
    "PatchProblem",
    "PerTensor",
    "PositionEncoding",
    "PreparedUpdate",
    "PublishedVersion",
    "RegionError",
    "RegionTimeoutError",
    "ReservedBits",
    "RouteCache",
    "RouteStats",
    "SingleCall",
    "StorageFollower",
    "StoragePublisher",
    "StoredPatch",
    "StoredUpdateError",
    "SupportsLoadWeights",
    "TensorShard",
    "UpdateCost",
    "UpdateManifest",
    "WarmReport",
    "WarmRow",
    "WireEncoding",
    "__version__",
    "audit",
    "diff_state_dicts",
    "iter_diff_state_dicts",
    "load_checkpoint_weight_patches",
    "load_patches",
    "masked_copy",
    "patch_nbytes",
    "prepare",
    "read_manifest",
    "save_patches",
    "validate_patches",
    "wire_encoding",
    "wire_sizes",
]
