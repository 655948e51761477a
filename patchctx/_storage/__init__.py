"""Delta sync through storage: patch files anyone can read, and version chains over them.

`save_patches` / `load_patches` write and read one update (safetensors files and a manifest,
`patchctx._storage._format`). The publisher and follower of `patchctx._storage._sync` chain
updates into versions at a directory or an fsspec URL. Nothing of the core imports this package;
its public names are re-exported by `patchctx`.
"""

from patchctx._storage._errors import StoredUpdateError
from patchctx._storage._format import (
    PositionEncoding,
    StoredPatch,
    UpdateManifest,
    load_patches,
    read_manifest,
    save_patches,
)
from patchctx._storage._sync import (
    PreparedUpdate,
    PublishedVersion,
    StorageFollower,
    StoragePublisher,
)

__all__ = [
    "PositionEncoding",
    "PreparedUpdate",
    "PublishedVersion",
    "StorageFollower",
    "StoragePublisher",
    "StoredPatch",
    "StoredUpdateError",
    "UpdateManifest",
    "load_patches",
    "read_manifest",
    "save_patches",
]
