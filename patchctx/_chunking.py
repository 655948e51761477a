"""Chunking policies: how many staged tensors go into one ``load_weights`` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from patchctx._errors import InvalidPatchError

__all__ = ["ByteBudget", "ChunkingPolicy", "PerTensor", "SingleCall"]


@runtime_checkable
class ChunkingPolicy(Protocol):
    """Decides where one loader call ends and the next begins.

    Patches are staged and handed to ``model.load_weights`` in chunks. Before adding each tensor
    to a non-empty chunk, the loader asks the policy whether to start a new call first. Whatever
    the policy says, a chunk never carries the same name twice (that would reorder the name's
    patches), and dense and sparse patches go in separate calls.

    Examples:
        A policy of your own: at most two tensors per loader call.

        >>> import torch
        >>> from patchctx import ChunkingPolicy
        >>> class AtMostTwo:
        ...     def split_before(self, chunk_nbytes, chunk_len, next_nbytes):
        ...         return chunk_len >= 2
        >>> isinstance(AtMostTwo(), ChunkingPolicy)
        True
    """

    def split_before(self, chunk_nbytes: int, chunk_len: int, next_nbytes: int) -> bool:
        """Whether to start a new loader call before adding the next tensor.

        Args:
            chunk_nbytes: Staged bytes already in the current (non-empty) chunk.
            chunk_len: Tensors already in the current chunk (at least 1).
            next_nbytes: Staged bytes of the tensor about to be added: the full checkpoint
                tensor (``numel * element_size``), sparse patches included.
        """
        ...


@dataclass(frozen=True, slots=True)
class ByteBudget:
    """At most `max_bytes` of staged tensors per loader call (a single larger tensor goes alone).

    The default policy, with vLLM's default budget of 512 MiB; ``max_chunk_bytes=N`` is
    shorthand for ``chunking=ByteBudget(N)``. Staged bytes alive at any moment stay below
    ``max(max_bytes, largest single staged tensor)`` (counting the staged tensors themselves;
    `BoolMask` keeps one more byte per element beside each).

    Examples:
        >>> from patchctx import ByteBudget
        >>> ByteBudget(64).split_before(chunk_nbytes=48, chunk_len=3, next_nbytes=32)
        True
    """

    max_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
            raise InvalidPatchError(
                f"ByteBudget(max_bytes=...) takes an int, got {self.max_bytes!r}"
            )
        if self.max_bytes <= 0:
            raise InvalidPatchError(f"ByteBudget(max_bytes={self.max_bytes!r}): must be positive")

    def split_before(self, chunk_nbytes: int, chunk_len: int, next_nbytes: int) -> bool:
        return chunk_nbytes + next_nbytes > self.max_bytes


@dataclass(frozen=True, slots=True)
class PerTensor:
    """One tensor per loader call: the smallest staging footprint, the most calls.

    Examples:
        >>> from patchctx import PerTensor
        >>> PerTensor().split_before(chunk_nbytes=4, chunk_len=1, next_nbytes=4)
        True
    """

    def split_before(self, chunk_nbytes: int, chunk_len: int, next_nbytes: int) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class SingleCall:
    """As few loader calls as the ordering allows (one, unless a name repeats).

    Examples:
        >>> from patchctx import SingleCall
        >>> SingleCall().split_before(chunk_nbytes=1 << 40, chunk_len=1000, next_nbytes=1 << 30)
        False
    """

    def split_before(self, chunk_nbytes: int, chunk_len: int, next_nbytes: int) -> bool:
        return False
