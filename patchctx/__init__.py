"""patchctx: dense and sparse weight patches in checkpoint coordinates.

A running PyTorch model (a vLLM worker above all) takes updates written against the Hugging Face
checkpoint (name, full shape, flat indices and values) while the model's own ``load_weights()``
keeps mapping them to runtime coordinates (tensor-parallel slices, packed parameters, experts).
"""

from patchctx._errors import (
    InvalidPatchError,
    InvalidPatchTypeError,
    LoaderContractError,
    PatchError,
    PatchProblem,
)
from patchctx._masked_copy import MaskedCopy, masked_copy
from patchctx._strategies import Auto, BoolMask, CopyStrategy, IntSentinel, NaNMask

__version__ = "0.1.0"
"""The version of this patchctx, a PEP 440 string."""

__all__ = [
    "Auto",
    "BoolMask",
    "CopyStrategy",
    "IntSentinel",
    "InvalidPatchError",
    "InvalidPatchTypeError",
    "LoaderContractError",
    "MaskedCopy",
    "NaNMask",
    "PatchError",
    "PatchProblem",
    "__version__",
    "masked_copy",
]
