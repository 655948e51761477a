"""Which checkpoint names a vLLM model's loaders consume: its audit, and the refusal of the rest.

A patch whose name no loader of the worker's model consumes (a typo, a name another model
has) would be reported as applied while changing nothing: the first patch to each name is
audited (the loader sees an all-keep patch, every write undone) and refused unless a loader
writes a parameter with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch

from patchctx import (
    AuditReport,
    AuditRow,
    CheckpointWeightPatch,
    InvalidPatchError,
    PatchError,
    PatchProblem,
    audit,
)
from patchctx._model import SupportsLoadWeights
from patchctx.vllm._aliases import tied_aliases
from patchctx.vllm._transformed import refusing_transformed, transformed_weights

__all__ = ["audit_model", "refuse_unconsumed"]

# What `audit` says of a name whose loader writes nothing on this rank.
_WRITES_NOTHING = "writes nothing"
# ... and of one whose loader raised.
_LOADER_RAISED = "the loader raised"


def audit_model(
    model: torch.nn.Module, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]
) -> AuditReport:
    """`patchctx.audit` for a vLLM model, as the worker extension would apply patches.

    Names of tied embeddings are resolved as `tied_aliases` says, and every name whose loader
    would write a weight listed by `transformed_weights` is ``"unsupported"``, with the
    weight and the reason. No weight changes.

    Args:
        model: The vLLM model (on one worker / tensor-parallel rank).
        specs: The checkpoint tensors: name, full shape and dtype.

    Returns:
        One row per name, in the order given.

    Examples:
        >>> import torch
        >>> from patchctx.vllm import audit_model
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.norm.copy_(tensor)
        ...         return {"norm"}
        >>> audit_model(Model(), [("norm", (4,), torch.float32)]).counts()
        {'replayable': 1, 'masked': 0, 'unsupported': 0}
    """
    protect = transformed_weights(model)
    aliases = tied_aliases(model)
    specs = list(specs)
    resolved = [(aliases.get(name, name), shape, dtype) for name, shape, dtype in specs]
    with refusing_transformed(model, protect):
        report = audit(cast("SupportsLoadWeights", model), resolved, protect=protect)
    return AuditReport(
        tuple(
            AuditRow(name, row.status, row.reason)
            for (name, _, _), row in zip(specs, report.rows, strict=True)
        )
    )


def refuse_unconsumed(
    model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch], consumed: set[str]
) -> None:
    """Refuse the patches whose name no loader of `model` consumes, or whose loader refuses it.

    Only names not yet in `consumed` are audited (one at a time: a loader error names its
    patch); those the audit finds consumed are added to it. `InvalidPatchError` names every
    refused patch, before any write.
    """
    unknown: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for patch in patches:
        if patch.name not in consumed:
            unknown.setdefault(patch.name, (patch.name, tuple(patch.shape), patch.dtype))
    if not unknown:
        return
    rows: list[AuditRow] = []
    for name, spec in unknown.items():  # one at a time: a loader error names its patch
        try:
            rows += audit_model(model, [spec]).rows
        except PatchError:
            raise
        except Exception as error:
            position = next(i for i, p in enumerate(patches) if p.name == name)
            reason = f"the model's loader refuses it ({type(error).__name__}: {error})"
            raise InvalidPatchError(
                [PatchProblem(position, name, reason[:400] + "; nothing was written")]
            ) from error
    refused: dict[str, str] = {}
    for row in rows:
        if _WRITES_NOTHING in row.reason:
            refused[row.name] = (
                "no loader of this model consumes it (the model skips or does not know the name)"
            )
        elif row.status == "unsupported":
            if row.reason.startswith(_LOADER_RAISED):  # an unknown name, a wrong shape
                refused[row.name] = f"the model's loader refuses it ({row.reason[:300]})"
            # else: a transformed weight, refused with its reason by the load itself
        else:
            consumed.add(row.name)
    if refused:
        raise InvalidPatchError(
            [
                PatchProblem(position, patch.name, refused[patch.name] + "; nothing was written")
                for position, patch in enumerate(patches)
                if patch.name in refused
            ]
        )
