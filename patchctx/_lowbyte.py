"""A memory-lean change detector: one byte per element of what was sent, not a copy of it.

`LowByteDetector` keeps, for every element, the least significant byte of its bits in the
receiver's dtype, as last sent (1 byte per element, against 2 for a bf16 copy and 4 for fp32).
An element counts as changed when that byte differs. This is the detector TRL's delta sync uses.

**Recall, stated honestly.** A change is missed exactly when the old and new bit patterns are
equal modulo 256. For bfloat16 (sign, 8 exponent bits, 7 mantissa bits) the low byte holds
the mantissa and the lowest exponent bit, so a change between normal numbers of the same
sign is missed only when it multiplies the magnitude by a power of 4 exactly (the same
mantissa, two binades away): optimizer steps almost never do. A sign flip, or a change to an
unrelated value, is missed when the low bytes happen to agree: about 1 in 256 of them
(measured: recall 0.9968 on a million unrelated changes). For float32 (low byte = the 8
lowest mantissa bits), any change of at least 256 units in the last place is missed with
probability about 1/256. For 1-byte dtypes
the byte is the value: recall is exact. A missed element keeps its old value on the receiver
until it changes again (then its full new value is sent) or until the next dense anchor
(`StoragePublisher` sends one every ``anchor_every`` versions). Use `diff_state_dicts` with a
full copy where exactness matters more than memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from patchctx import _tuning
from patchctx._diff import receiver_dtype, sparse_is_smaller
from patchctx._encoding import count_escapes, index_dtype
from patchctx._errors import InvalidPatchError, PatchProblem
from patchctx._grad import without_grad
from patchctx._patch import CheckpointWeightPatch, validate_patches
from patchctx._strategies import Auto, CopyStrategy

__all__ = ["LowByteDetector"]


def _low_bytes(tensor: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """Write the low byte of each element's bits in `dtype` into `out` (uint8, flat)."""
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _tuning.LOW_BYTE_BLOCK):
        block = flat[start : start + _tuning.LOW_BYTE_BLOCK].to(dtype)
        if block.dtype == torch.bool:
            block = block.to(torch.uint8)
        raw = block.contiguous().view(torch.uint8).view(block.numel(), -1)
        out[start : start + block.numel()] = raw[:, 0]  # little-endian: byte 0 is the low one


class LowByteDetector:
    """Finds changed elements from one byte per element of what was last sent.

    See the module `patchctx._lowbyte` for its recall: it misses a change exactly when the
    old and new bits agree modulo 256; in bf16 a same-sign change only when it scales the
    magnitude by a power of 4 exactly, and other changes about once in 256.

    Args:
        sent: The state the receiver holds now (its low bytes are kept; the tensors are not).
        dtype: The receiver's dtype: a dtype for floating tensors, a mapping per name, or
            `None` (each tensor's own).
        strategy: The receiver's strategy; a tensor whose changed values it cannot carry (NaN
            under `NaNMask`) is sent dense.

    Examples:
        >>> import torch
        >>> from patchctx import LowByteDetector
        >>> weights = {"w": torch.ones(1000, dtype=torch.bfloat16)}
        >>> detector = LowByteDetector(weights)
        >>> detector.nbytes  # one byte per element
        1000
        >>> weights["w"][[3, 500]] += 0.25
        >>> [p.indices.tolist() for p in detector.diff(weights)]
        [[3, 500]]
        >>> detector.diff(weights)  # what was sent is remembered
        []
    """

    def __init__(
        self,
        sent: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        strategy: CopyStrategy | None = None,
    ) -> None:
        self.dtype = dtype
        self.strategy = Auto() if strategy is None else strategy
        self._bytes: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, tensor in sent.items():
            self._bytes[name] = self._read(name, tensor)
            self._shapes[name] = tuple(tensor.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the detector holds (one per element)."""
        return sum(b.numel() for b in self._bytes.values())

    def _receiver(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        return receiver_dtype(self.dtype, name, tensor)

    def _read(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tensor.numel(), dtype=torch.uint8, device=tensor.device)
        _low_bytes(tensor, self._receiver(name, tensor), out)
        return out

    @without_grad
    def diff(self, new: Mapping[str, torch.Tensor]) -> list[CheckpointWeightPatch]:
        """Patches for the elements whose low byte changed since the last call; remembers them.

        A tensor goes dense when a sparse patch would not be smaller, or when the strategy
        cannot carry a changed value (a dense patch also repairs anything missed before).

        Raises:
            InvalidPatchError: `new` lacks a name, adds one, or changes a shape.
        """
        problems = [
            PatchProblem(None, name, f"{name!r}: not in the state the detector was made from")
            for name in new
            if name not in self._bytes
        ] + [
            PatchProblem(None, name, f"{name!r}: missing from new")
            for name in self._bytes
            if name not in new
        ]
        problems += [
            PatchProblem(
                None,
                name,
                f"{name!r}: shape {tuple(new[name].shape)} differs from {self._shapes[name]}",
            )
            for name in new
            if name in self._shapes and tuple(new[name].shape) != self._shapes[name]
        ]
        if problems:
            raise InvalidPatchError.from_problems(problems)
        patches: list[CheckpointWeightPatch] = []
        fresh: dict[str, torch.Tensor] = {}
        for name, tensor in new.items():
            dtype = self._receiver(name, tensor)
            now = self._read(name, tensor)
            positions = (now != self._bytes[name]).nonzero().reshape(-1)
            fresh[name] = now
            nnz, numel = positions.numel(), tensor.numel()
            if nnz == 0:
                continue
            flat = tensor.detach().reshape(-1)
            escapes = lambda p=positions: int(count_escapes(p))  # noqa: E731
            if sparse_is_smaller(nnz, numel, dtype.itemsize, escapes):
                patches.append(
                    CheckpointWeightPatch(
                        name,
                        tuple(tensor.shape),
                        dtype,
                        flat[positions].to(dtype),
                        positions.to(index_dtype(numel)),
                    )
                )
            else:
                patches.append(
                    CheckpointWeightPatch(name, tuple(tensor.shape), dtype, flat.to(dtype).clone())
                )
        patches = self._carryable(patches, new)
        self._bytes.update(fresh)
        return patches

    def _carryable(
        self, patches: list[CheckpointWeightPatch], new: Mapping[str, torch.Tensor]
    ) -> list[CheckpointWeightPatch]:
        """Sparse patches the strategy cannot carry (a NaN under `NaNMask`), sent dense."""
        sparse = [p for p in patches if p.indices is not None]
        try:
            validate_patches(sparse, strategy=self.strategy)
            return patches
        except InvalidPatchError as error:
            refused = {problem.name for problem in error.problems}
        return [
            p
            if p.name not in refused or p.indices is None
            else p._replace(
                values=new[p.name].detach().reshape(-1).to(p.dtype).clone(), indices=None
            )
            for p in patches
        ]
