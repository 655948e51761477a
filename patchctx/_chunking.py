"""Chunking policies: how many staged tensors go into one ``load_weights`` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from patchctx._arguments import positive_int
from patchctx._patch import CheckedPatch

__all__ = ["ByteBudget", "ChunkState", "ChunkingPolicy", "PerTensor", "SingleCall"]


@dataclass(frozen=True, slots=True)
class ChunkState:
    """What a chunking policy is told: the loader call being gathered, and the next patch.

    One object, so that it can grow (new fields) without breaking the policies written
    against it.

    Attributes:
        nbytes: Staged bytes already in the current chunk: the full checkpoint tensors
            (``numel * element_size``), and beside each sparse one its mask of changed
            positions (``numel`` bytes).
        count: Patches already in the current chunk (at least 1).
        next: The validated patch about to be added.
        next_nbytes: Staged bytes of `next` (``next.staged_nbytes``).

    Examples:
        >>> import torch
        >>> from patchctx import Auto, ByteBudget, CheckpointWeightPatch, ChunkState
        >>> from patchctx._patch import check_patches
        >>> patch = CheckpointWeightPatch("w", (8,), torch.float32, torch.zeros(8))
        >>> (checked,) = check_patches([patch], strategy=Auto())
        >>> state = ChunkState(nbytes=48, count=3, next=checked, next_nbytes=32)
        >>> ByteBudget(64).split_before(state)
        True
    """

    nbytes: int
    count: int
    next: CheckedPatch
    next_nbytes: int


@runtime_checkable
class ChunkingPolicy(Protocol):
    """Decides where one loader call ends and the next begins.

    Patches are staged and handed to ``model.load_weights`` in chunks. Before adding each tensor
    to a non-empty chunk, the loader asks the policy whether to start a new call first. Whatever
    the policy says, a chunk never carries the same name twice (that would reorder the name's
    patches), and dense and sparse patches go in separate calls.

    Examples:
        A policy of your own: at most two tensors per loader call.

        >>> from patchctx import ChunkingPolicy, ChunkState
        >>> class AtMostTwo:
        ...     def split_before(self, chunk: ChunkState) -> bool:
        ...         return chunk.count >= 2
        >>> isinstance(AtMostTwo(), ChunkingPolicy)
        True
    """

    def split_before(self, chunk: ChunkState, /) -> bool:
        """Whether to start a new loader call before adding ``chunk.next``."""
        ...


@dataclass(frozen=True, slots=True)
class ByteBudget:
    """At most `max_bytes` of staged tensors per loader call (a single larger tensor goes alone).

    The default policy, with vLLM's default budget of 512 MiB; ``max_chunk_bytes=N`` is
    shorthand for ``chunking=ByteBudget(N)``. Staged bytes alive at any moment stay below
    ``max(max_bytes, largest single staged tensor)``, counting the staged tensors and the mask
    of changed positions a sparse one carries (one byte per element).

    Examples:
        >>> from patchctx import ByteBudget
        >>> ByteBudget(64)
        ByteBudget(max_bytes=64)
        >>> try:
        ...     ByteBudget("64")
        ... except TypeError as error:
        ...     print(error)
        ByteBudget(max_bytes=...) takes an int, got '64'
    """

    max_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        positive_int(self.max_bytes, "ByteBudget(max_bytes=...)")

    def split_before(self, chunk: ChunkState, /) -> bool:
        return chunk.nbytes + chunk.next_nbytes > self.max_bytes


@dataclass(frozen=True, slots=True)
class PerTensor:
    """One tensor per loader call: the smallest staging footprint, the most calls.

    Examples:
        >>> from patchctx import PerTensor
        >>> PerTensor()
        PerTensor()
    """

    def split_before(self, chunk: ChunkState, /) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class SingleCall:
    """As few loader calls as the ordering allows (one, unless a name repeats).

    Examples:
        >>> from patchctx import SingleCall
        >>> SingleCall()
        SingleCall()
    """

    def split_before(self, chunk: ChunkState, /) -> bool:
        return False
