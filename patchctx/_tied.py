"""Tied parameters seen on the model itself: one storage under several names.

A model that ties two weights (``lm_head.weight`` and ``model.embed_tokens.weight`` with tied
embeddings) reaches one parameter under two qualified names. Its loader usually accepts only
one of them (vLLM's skips the LM head of a tied model). `tied_names` maps every later name of
such a parameter, in module order, to its first one, so a patch to either name loads under the
first; ``aliases=`` of `load_checkpoint_weight_patches` adds what cannot be seen this way.
"""

from __future__ import annotations

import torch

from patchctx._model import SupportsLoadWeights

__all__ = ["tied_names"]


def _key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """Equal for two tensors over the same elements of one storage (`None`: no storage)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta and other storage-less tensors
        return None
    if tensor.numel() == 0 or pointer == 0:
        return None
    return (
        tensor.device,
        pointer,
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
    )


def tied_names(model: SupportsLoadWeights) -> dict[str, str]:
    """Later name -> first name, for every parameter `model` reaches under several names.

    Only a ``torch.nn.Module`` can show its duplicates (``named_parameters`` of another object
    removes them); for anything else the map is empty.

    Examples:
        >>> import torch
        >>> from patchctx._tied import tied_names
        >>> class Tied(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Embedding(8, 2)
        ...         self.head = torch.nn.Linear(2, 8, bias=False)
        ...         self.head.weight = self.embed.weight
        >>> tied_names(Tied())
        {'head.weight': 'embed.weight'}
    """
    if not isinstance(model, torch.nn.Module):
        return {}
    first: dict[object, str] = {}
    tied: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        key = _key(parameter)
        if key is None:
            continue
        canonical = first.setdefault(key, name)
        if canonical != name:
            tied[name] = canonical
    return tied
