"""Checked by mypy, never run: what a model and a patch must be, stated in the types.

A model is anything with ``load_weights`` and ``named_parameters`` (`SupportsLoadWeights`): a
vLLM-style ``torch.nn.Module``, or a plain adapter object. A patch is anything with the five
fields (`PatchLike`): patchctx's NamedTuple, vLLM's, a dataclass of your own. Each
``# type: ignore[...]`` must be used (warn_unused_ignores): it marks what must be refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from typing_extensions import assert_type

from patchctx import (
    CheckpointWeightPatch,
    PatchLike,
    SupportsLoadWeights,
    load_checkpoint_weight_patches,
    patch_nbytes,
    validate_patches,
)


class VllmStyleModel(torch.nn.Module):
    """vLLM's signature: an iterable of pairs in, the loaded names out."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


class ReturnsNothing(torch.nn.Module):
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        return None


class Adapter:
    """Not a module: a loader and the tensors it writes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        return [name for name, _ in weights]


class LoaderOnly:
    """No named_parameters: patchctx could not guard the tensors it writes."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


class WrongLoader(torch.nn.Module):
    """Takes a dict: patchctx passes a list of pairs."""

    def load_weights(self, weights: dict[str, torch.Tensor]) -> set[str]:
        return set()


class VllmPatch(NamedTuple):
    """vLLM's own NamedTuple has these fields."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


@dataclass(frozen=True)
class DataclassPatch:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None


class NoIndices(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor


ours = CheckpointWeightPatch("w", (2,), torch.float32, torch.zeros(2))
theirs = VllmPatch("w", (2,), torch.float32, torch.zeros(2))
mine = DataclassPatch("w", torch.Size([2]), torch.float32, torch.zeros(2), None)

model: SupportsLoadWeights = VllmStyleModel()
assert_type(load_checkpoint_weight_patches(VllmStyleModel(), [ours, theirs, mine]), set[str])
load_checkpoint_weight_patches(ReturnsNothing(), [theirs])
load_checkpoint_weight_patches(Adapter(torch.nn.Linear(2, 2)), (p for p in [mine]))
load_checkpoint_weight_patches(LoaderOnly(), [ours])  # type: ignore[arg-type]
load_checkpoint_weight_patches(WrongLoader(), [ours])  # type: ignore[arg-type]
load_checkpoint_weight_patches(torch.nn.Linear(2, 2), [ours])  # type: ignore[arg-type]
load_checkpoint_weight_patches(model, [NoIndices("w", (2,), torch.float32, torch.zeros(2))])  # type: ignore[list-item]
load_checkpoint_weight_patches(model, [("w", (2,), torch.float32, torch.zeros(2))])  # type: ignore[list-item]

patch: PatchLike = theirs
assert_type(patch_nbytes([theirs, mine]), int)
assert_type(validate_patches([theirs]), list[CheckpointWeightPatch])
