"""The error of storage: a stored update that is missing, torn, corrupted or unexpected."""

from __future__ import annotations

from patchctx._errors import PatchError

__all__ = ["StoredUpdateError"]


class StoredUpdateError(PatchError, ValueError):
    """A stored update (files and manifest) is missing, torn, corrupted or not the one expected.

    Raised by `load_patches` and the storage transport before anything is returned or
    applied: a manifest that is absent or not valid JSON of the format, a data file that is
    missing or whose size or SHA-256 differs from the manifest's, tensors that do not match
    the manifest, an update whose versions do not continue the receiver's chain.

    Attributes:
        path: The file or folder at fault (a path or URL), as far as it is known.

    Examples:
        >>> from patchctx import PatchError, StoredUpdateError
        >>> error = StoredUpdateError("v7/manifest.json: no manifest", path="v7/manifest.json")
        >>> isinstance(error, PatchError), error.path
        (True, 'v7/manifest.json')
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path
