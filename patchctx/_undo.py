"""The undo log behind ``atomic=True``: old values of everything a call writes, restored in reverse.

Two kinds of entry: the old values at known storage positions (sparse writes: O(nnz) memory),
and the old contents of a whole written view (dense and unmasked writes: O(view) memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from patchctx._bits import indexable

__all__ = ["UndoLog", "storage_flat"]


def storage_flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the whole storage of `tensor`, in its dtype (position = storage offset)."""
    numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    return torch.as_strided(tensor, (numel,), (1,), 0)


@dataclass(frozen=True, slots=True)
class _Positions:
    tensor: torch.Tensor  # any tensor on the written storage, in the written dtype
    positions: torch.Tensor  # int64 storage offsets
    old: torch.Tensor


@dataclass(frozen=True, slots=True)
class _View:
    tensor: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    old: torch.Tensor


class UndoLog:
    """Old values of every write made by one call, to restore them bit-exactly on failure."""

    __slots__ = ("_entries", "nbytes")

    def __init__(self) -> None:
        self._entries: list[_Positions | _View] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def save_positions(
        self, tensor: torch.Tensor, positions: torch.Tensor, *, owned: bool = False
    ) -> None:
        """Remember the values at `positions` (storage offsets) of `tensor`'s storage.

        `positions` are copied (callers reuse their position buffers) unless `owned`: int64
        on `tensor`'s device, and never changed by the caller while the log holds them.
        """
        if not owned:
            positions = positions.to(device=tensor.device, dtype=torch.long, copy=True)
        old = indexable(storage_flat(tensor)).index_select(0, positions)
        self._entries.append(_Positions(tensor, positions, old))
        self.nbytes += old.nbytes + positions.nbytes

    def save_view(self, view: torch.Tensor) -> None:
        """Remember the whole contents of `view` (a view of a persistent tensor)."""
        old = view.detach().clone()
        self._entries.append(
            _View(view.detach(), tuple(view.shape), view.stride(), int(view.storage_offset()), old)
        )
        self.nbytes += old.nbytes

    def mark(self) -> int:
        """A point to `restore` or `forget` back to."""
        return len(self._entries)

    def forget(self, mark: int = 0) -> None:
        """Drop the entries after `mark` without restoring them (their writes stand)."""
        for entry in self._entries[mark:]:
            self.nbytes -= entry.old.nbytes + (
                entry.positions.nbytes if isinstance(entry, _Positions) else 0
            )
        del self._entries[mark:]

    def restore(self, mark: int = 0) -> None:
        """Put back every value saved after `mark`, newest first, bypassing all interception.

        Each entry is dropped once restored, so a restore interrupted half way can be resumed
        by calling it again.
        """
        from patchctx._swap import builtin_copy

        while len(self._entries) > mark:
            entry = self._entries[-1]
            if isinstance(entry, _Positions):
                flat = indexable(storage_flat(entry.tensor))
                flat.index_copy_(0, entry.positions, entry.old)
            else:
                target = torch.as_strided(entry.tensor, entry.size, entry.stride, entry.offset)
                builtin_copy(target, entry.old)
            self.forget(len(self._entries) - 1)
