"""`prepare`: the one-time costs of a process's first patch load, paid when the caller says."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable

import torch

from patchctx._load import load_checkpoint_weight_patches
from patchctx._patch import CheckpointWeightPatch

__all__ = ["prepare"]


class _One(torch.nn.Module):
    """A model of one 4-element weight, loaded by ``copy_`` (the commonest loader write)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        weight = torch.zeros(4, device=device)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.weight.copy_(tensor)
        return {"weight"}


def prepare(device: torch.device | str = "cpu") -> float:
    """Pay the first patch load's one-time costs now; return the seconds it took.

    The first time a process runs a loader on staged data, torch imports what it dispatches
    tensor subclasses with (``torch.distributed.tensor``, which pulls in ``torch.fx``'s
    symbolic shapes): 1 to 3 s on a 2-core CPU, 5 s or more on a loaded one. Every later
    call costs its own work only. patchctx's dispatch modes do not import ``torch._dynamo``
    (torch's default for such modes; another second or two). `prepare` runs one sparse
    patch through a throwaway one-weight model, so that cost falls where the caller chooses
    (process start, before the first training step) instead of on the first update.
    It also imports the loader's dry run, which a first update may need. `RouteCache.warm`
    and `audit` pay it too, and a vLLM worker with the ``patchctx`` backend
    pays it at engine start (warm-up). Safe from any thread; a second call is cheap.

    Args:
        device: The device the process's patches will be applied on.

    Returns:
        Seconds spent (close to zero once the process has loaded a patch).

    Examples:
        >>> import patchctx
        >>> spent = patchctx.prepare()
        >>> patchctx.prepare() < 0.5  # paid already
        True
    """
    started = time.perf_counter()
    where = torch.device(device)
    patch = CheckpointWeightPatch(
        "weight",
        (4,),
        torch.float32,
        torch.ones(1, device=where),
        torch.tensor([1], device=where),
    )
    load_checkpoint_weight_patches(_One(where), [patch])
    # The dry run, which a first update may need (a constant fill's owner, `learn_dense`), is
    # imported on its first use: here, when the caller chose.
    importlib.import_module("patchctx._warm")
    return time.perf_counter() - started
