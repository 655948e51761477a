"""The exception hierarchy: every error patchctx raises derives from `PatchError`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CastKindError",
    "InvalidPatchError",
    "InvalidPatchTypeError",
    "LoaderContractError",
    "LoaderError",
    "PatchError",
    "PatchProblem",
    "RegionError",
    "RegionTimeoutError",
]


class PatchError(Exception):
    """Base class of every error raised by patchctx.

    Catch it to handle any patchctx failure in one place; the subclasses also derive from the
    built-in exception that vLLM's own function raised in the same situation (`ValueError`,
    `TypeError`, `NotImplementedError`), so code written against vLLM keeps working.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask, PatchError
        >>> try:  # NaN cannot mark "keep" in an integer tensor
        ...     NaNMask().stage((4,), torch.int8, torch.tensor([0]), torch.tensor([1]))
        ... except PatchError as error:
        ...     print(type(error).__name__, isinstance(error, ValueError))
        InvalidPatchError True
    """

    written: tuple[str, ...] = ()
    """The names whose patches a failed call without ``atomic`` left written (earlier loader
    calls and replays, and the dense patches of the failing loader call); also said in the
    error's notes. Empty when the call left nothing written."""


@dataclass(frozen=True, slots=True)
class PatchProblem:
    """One thing wrong with one patch.

    Attributes:
        index: Position of the patch in the caller's sequence, or `None` when the problem is
            not about a single patch (an argument of the call, say).
        name: The patch's checkpoint name (as given, possibly empty).
        reason: What is wrong, with the offending value quoted, and how to fix it.
        is_type_error: Whether vLLM raised `TypeError` (rather than `ValueError`) for this
            kind of problem.

    Examples:
        >>> from patchctx import PatchProblem
        >>> print(PatchProblem(3, "lm_head.weight", "index 70000 is out of range (65536)"))
        patches[3] 'lm_head.weight': index 70000 is out of range (65536)
    """

    index: int | None
    name: str
    reason: str
    is_type_error: bool = False

    def __str__(self) -> str:
        if self.index is None:
            return self.reason
        return f"patches[{self.index}] {self.name!r}: {self.reason}"


class InvalidPatchError(PatchError, ValueError):
    """One or more patches (or call arguments) are invalid; nothing was written.

    The message lists every problem found, one per line, each naming the patch by its position
    and checkpoint name. The same problems are available as `problems`.

    Attributes:
        problems: Every problem found, in input order.

    Examples:
        >>> from patchctx import InvalidPatchError, PatchProblem
        >>> error = InvalidPatchError([
        ...     PatchProblem(0, "model.embed_tokens.weight", "2 duplicate indices"),
        ...     PatchProblem(4, "lm_head.weight", "values hold NaN, which NaNMask reserves"),
        ... ])
        >>> print(error)
        2 problems; nothing was written:
          - patches[0] 'model.embed_tokens.weight': 2 duplicate indices
          - patches[4] 'lm_head.weight': values hold NaN, which NaNMask reserves
        >>> [problem.index for problem in error.problems]
        [0, 4]
    """

    problems: tuple[PatchProblem, ...]

    def __init__(self, problems: Sequence[PatchProblem] | str) -> None:
        if isinstance(problems, str):
            problems = (PatchProblem(None, "", problems),)
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = str(self.problems[0])
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} problems; nothing was written:\n{lines}"
        super().__init__(message)

    @classmethod
    def from_problems(cls, problems: Sequence[PatchProblem]) -> InvalidPatchError:
        """Build the error, choosing the class that also derives from `TypeError` when needed.

        vLLM raised `TypeError` for a wrong dtype object and for wrong index dtypes; when any
        collected problem is of that kind, the returned error is an `InvalidPatchTypeError`,
        which is both a `ValueError` and a `TypeError`.

        Args:
            problems: The problems found (at least one).

        Returns:
            The error to raise.
        """
        if any(p.is_type_error for p in problems):
            return InvalidPatchTypeError(problems)
        return cls(problems)


class InvalidPatchTypeError(InvalidPatchError, TypeError):
    """An `InvalidPatchError` that is also a `TypeError` (a wrong dtype or index type).

    `InvalidPatchError.from_problems` returns one when any problem is of the kind vLLM reported
    with `TypeError`, so both ``except ValueError`` and ``except TypeError`` keep catching it.

    Examples:
        >>> from patchctx import InvalidPatchError, PatchProblem
        >>> problem = PatchProblem(1, "w", "indices must be int32 or int64", is_type_error=True)
        >>> error = InvalidPatchError.from_problems([problem])
        >>> type(error).__name__, isinstance(error, TypeError), isinstance(error, ValueError)
        ('InvalidPatchTypeError', True, True)
    """


class LoaderContractError(PatchError, NotImplementedError):
    """A write during a masked load falls outside what patchctx can mask exactly.

    Raised instead of writing, for example when a loader accumulates staged data into a weight
    (the positions a patch does not change would not keep their values), computes across
    changed and unchanged positions, reads unchanged values out of torch, or changes the
    model's structure. The destination is left as it was. It is a `NotImplementedError`: the
    loader does something patchctx does not support.

    Examples:
        >>> import torch
        >>> from patchctx import BoolMask, LoaderContractError
        >>> staged = BoolMask().stage((2, 3), torch.float32, torch.tensor([4]),
        ...                           torch.tensor([1.0]))
        >>> weight = torch.zeros(2, 3)
        >>> try:
        ...     _ = weight.add_(staged)  # accumulating: the other positions would change
        ... except LoaderContractError:
        ...     print("refused, weight untouched:", not weight.any().item())
        refused, weight untouched: True
    """


class CastKindError(LoaderContractError, TypeError):
    """A patch's values would change kind on their way into a weight; nothing was written.

    A cast between floating dtypes (float32 into bfloat16, fp8 into float32) rounds, as a
    dense load does. A cast that changes what kind of number a value is (a bool or an integer
    into a floating weight, a floating value into an integer or bool weight) is almost always
    a mistake: a bool patch into a norm weight sets it to 1.0. Such casts are refused, at
    validation (the values against the patch's dtype) or at the write (the patch's dtype
    against the weight's), unless the call passes ``kind_casts=True``. Both a
    `LoaderContractError` and a `TypeError`.

    Examples:
        >>> import torch
        >>> from patchctx import CastKindError, CheckpointWeightPatch
        >>> from patchctx import load_checkpoint_weight_patches
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm = torch.nn.Parameter(torch.full((3,), 0.5), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.norm.copy_(tensor)
        ...         return {"norm"}
        >>> model = Model()
        >>> mask = CheckpointWeightPatch("norm", (3,), torch.bool, torch.ones(3, dtype=torch.bool))
        >>> try:
        ...     load_checkpoint_weight_patches(model, [mask])
        ... except CastKindError as error:
        ...     print(str(error)[:68], model.norm.tolist())
        the patch to 'norm' (bool) would be cast into a float weight ('norm' [0.5, 0.5, 0.5]
    """


class LoaderError(PatchError, RuntimeError):
    """The model's own ``load_weights`` raised while loading patches.

    The loader's exception is the `__cause__` (a `KeyError` for a name it does not know, a
    torch `RuntimeError` for a tensor of the wrong shape...). The message names the patches of
    the failing loader call and says what the call left written.

    Attributes:
        names: The checkpoint names of the loader call that failed.
        written: The names whose patches stand written after the failure: earlier loader
            calls and replays of a call without ``atomic`` (empty when nothing was left
            written).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, LoaderError
        >>> from patchctx import load_checkpoint_weight_patches
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         params = dict(self.named_parameters())
        ...         for name, tensor in weights:
        ...             params[name].copy_(tensor)  # a KeyError for a name it does not know
        ...         return {"w"}
        >>> typo = CheckpointWeightPatch("w_typo", (3,), torch.float32, torch.ones(3))
        >>> try:
        ...     load_checkpoint_weight_patches(Model(), [typo])
        ... except LoaderError as error:
        ...     print(type(error.__cause__).__name__, error.names)
        KeyError ('w_typo',)
    """

    def __init__(
        self, message: str, *, names: Sequence[str] = (), written: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.names = tuple(names)
        self.written = tuple(written)


class RegionError(PatchError, RuntimeError):
    """A masked region could not be entered in time, or was left out of order.

    Also a `TimeoutError` when `masked_copy(timeout=...)` expired while another thread held
    the region lock (nothing changed), and a `RuntimeError` in every case, as before.

    Examples:
        >>> from patchctx import PatchError, RegionError, masked_copy
        >>> region = masked_copy()
        >>> try:
        ...     region.__exit__(None, None, None)  # never entered
        ... except RegionError as error:
        ...     print(isinstance(error, PatchError), "no open masked region" in str(error))
        True True
    """


class RegionTimeoutError(RegionError, TimeoutError):
    """`masked_copy(timeout=...)` expired while another thread held the lock; nothing changed.

    Examples:
        >>> from patchctx import RegionError, RegionTimeoutError
        >>> issubclass(RegionTimeoutError, (RegionError, TimeoutError))
        True
    """
