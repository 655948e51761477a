"""`LoadByName`: a loader for a module whose parameter names are the checkpoint's names."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from patchctx._grad import without_grad

__all__ = ["LoadByName"]


class LoadByName:
    """Gives any ``torch.nn.Module`` whose tensors carry the checkpoint's names a loader.

    A Hugging Face ``transformers`` model is the usual case: it has no ``load_weights``, but
    its ``state_dict`` names are the checkpoint's names, so loading is a copy by name. Wrap the
    model and pass the wrapper wherever patchctx takes a model (it satisfies
    `SupportsLoadWeights`); the wrapped module is changed in place.

    Tied parameters (``lm_head.weight`` sharing ``model.embed_tokens.weight``) are found under
    each name. Keep one wrapper per module: a `RouteCache` belongs to the object it was given,
    and starts afresh for another. A checkpoint name the module does not have, or a tensor
    whose shape differs from the parameter's, raises instead of being skipped or broadcast.

    Args:
        module: The module to load into.

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, LoadByName, SupportsLoadWeights
        >>> from patchctx import load_checkpoint_weight_patches
        >>> module = torch.nn.Linear(2, 2, bias=False).requires_grad_(False)
        >>> _ = module.weight.zero_()
        >>> isinstance(LoadByName(module), SupportsLoadWeights)
        True
        >>> patch = CheckpointWeightPatch(
        ...     "weight", (2, 2), torch.float32, torch.tensor([5.0]), torch.tensor([3])
        ... )
        >>> load_checkpoint_weight_patches(LoadByName(module), [patch])
        {'weight'}
        >>> module.weight
        Parameter containing:
        tensor([[0., 0.],
                [0., 5.]])
    """

    __slots__ = ("__weakref__", "module")

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"LoadByName takes a torch.nn.Module; got {type(module).__name__}")
        self.module = module

    def __repr__(self) -> str:
        return f"LoadByName({type(self.module).__name__})"

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's parameters, tied ones under each of their names."""
        return self.module.named_parameters(remove_duplicate=False)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's buffers, shared ones under each of their names."""
        return self.module.named_buffers(remove_duplicate=False)

    @without_grad
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each ``(name, tensor)`` into the module's tensor of that name.

        Raises:
            KeyError: A name the module does not have.
            ValueError: A tensor whose shape is not the named tensor's.
        """
        tensors = dict(self.named_parameters())
        tensors.update(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            if name not in tensors:
                raise KeyError(f"{type(self.module).__name__} has no tensor named {name!r}")
            target = tensors[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"{name!r}: a tensor of shape {tuple(tensor.shape)} for a parameter of "
                    f"shape {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        return loaded
