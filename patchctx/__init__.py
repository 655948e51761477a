"""patchctx: dense and sparse weight patches in checkpoint coordinates.

A running PyTorch model (a vLLM worker above all) takes updates written against the Hugging Face
checkpoint (name, full shape, flat indices and values) while the model's own ``load_weights()``
keeps mapping them to runtime coordinates (tensor-parallel slices, packed parameters, experts).
"""

from patchctx._audit import AuditReport, AuditRow, audit
from patchctx._by_name import LoadByName
from patchctx._chunking import ByteBudget, ChunkingPolicy, ChunkState, PerTensor, SingleCall
from patchctx._cost import UpdateCost
from patchctx._diff import diff_state_dicts, patch_nbytes
from patchctx._encoding import WireEncoding, wire_encoding, wire_sizes
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
    StoredUpdateError,
)
from patchctx._load import load_checkpoint_weight_patches
from patchctx._lowbyte import LowByteDetector
from patchctx._masked_copy import MaskedCopy, masked_copy
from patchctx._model import SupportsLoadWeights
from patchctx._ordering import Coalesce, InputOrder, OrderingPolicy
from patchctx._patch import CheckedPatch, CheckpointWeightPatch, PatchLike, validate_patches
from patchctx._prepare import prepare
from patchctx._routes import RouteCache, RouteStats
from patchctx._shards import TensorShard
from patchctx._storage import (
    PositionEncoding,
    PreparedUpdate,
    PublishedVersion,
    StorageFollower,
    StoragePublisher,
    StoredPatch,
    UpdateManifest,
    load_patches,
    read_manifest,
    save_patches,
)
from patchctx._strategies import Auto, BoolMask, CopyStrategy, IntSentinel, NaNMask
from patchctx._warm import WarmReport, WarmRow

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
