"""The errors of the vLLM side: weight versions and the ownership and order of an update."""

from __future__ import annotations

from patchctx._errors import PatchError

__all__ = ["UpdateConflictError", "WeightVersionError"]


class WeightVersionError(PatchError, ValueError):
    """Patches were made against weights other than those the model holds; nothing was written.

    A patch set is a difference: it is only right on top of the weights it was computed from.
    When a payload names the version it expects (``base_version``) and the worker holds
    another one (say, the trainer resumed from an older checkpoint while the inference engine
    kept the newer weights), the payload is refused before any write. Raised by
    `patchctx.vllm.apply_patches` and the worker extension.

    Attributes:
        expected: The version the patches were made against.
        found: The version the worker holds (`None`: unknown, e.g. never declared, or lost
            after a failed non-atomic update).

    Examples:
        >>> from patchctx.vllm import WeightVersionError
        >>> error = WeightVersionError("patches made against step 41; the worker holds step 40",
        ...                            expected=41, found=40)
        >>> isinstance(error, ValueError), error.expected, error.found
        (True, 41, 40)
    """

    def __init__(
        self,
        message: str,
        *,
        expected: str | int | None = None,
        found: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class UpdateConflictError(PatchError, RuntimeError):
    """A weight update's owner, order or state does not allow the step; nothing changed.

    An update belongs to the trainer that opened it (its update id is on every chunk): another
    trainer's ``init_weight_transfer_engine``, chunks or a finish of an incomplete update are
    refused with this error, and the open update stays as it was (a takeover init rolls it
    back whole instead). Also raised for chunks out of order, a chunk after the last one, and
    a finish before the last chunk. Raised by `patchctx.vllm`'s weight-transfer backend.

    Examples:
        >>> from patchctx import PatchError
        >>> from patchctx.vllm import UpdateConflictError
        >>> error = UpdateConflictError("update 'a1' of trainer 'A' is open")
        >>> isinstance(error, PatchError), isinstance(error, RuntimeError)
        (True, True)
    """
