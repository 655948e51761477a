"""`audit`: which checkpoint names take O(nnz) replays, masked loads, or nothing at all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from patchctx._arguments import name_map
from patchctx._errors import LoaderContractError
from patchctx._grad import without_grad
from patchctx._model import SupportsLoadWeights, as_module, check_model, model_tensors
from patchctx._report import status_counts, status_table
from patchctx._session import Load, ModelIndex, run_loader
from patchctx._staged import UnchangedValueRead
from patchctx._strategies import Auto, CopyStrategy, as_strategy
from patchctx._undo import UndoLog

__all__ = ["AuditReport", "AuditRow", "audit"]


@dataclass(frozen=True, slots=True)
class AuditRow:
    """The verdict for one checkpoint name.

    Attributes:
        name: The checkpoint name.
        status: ``"replayable"`` (a route is recorded: sparse patches cost O(nnz) from the
            second one on), ``"masked"`` (sparse patches work through the loader, O(N) each)
            or ``"unsupported"`` (sparse patches are refused).
        reason: Why the name is not replayable, or a note; empty when there is nothing to say.

    Examples:
        >>> from patchctx import AuditRow
        >>> AuditRow("lm_head.weight", "masked", "a cast before copy_")
        AuditRow(name='lm_head.weight', status='masked', reason='a cast before copy_')
    """

    name: str
    status: Literal["replayable", "masked", "unsupported"]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The result of `audit`: one row per checkpoint name, in the order given.

    Printing it shows a table.

    Examples:
        >>> from patchctx import AuditReport, AuditRow
        >>> report = AuditReport((AuditRow("a", "replayable"), AuditRow("b", "masked", "a cast")))
        >>> report.counts()
        {'replayable': 1, 'masked': 1, 'unsupported': 0}
        >>> report.names("masked")
        ['b']
    """

    rows: tuple[AuditRow, ...]

    def counts(self) -> dict[str, int]:
        """How many names have each status (all three keys present)."""
        return status_counts(self.rows, ("replayable", "masked", "unsupported"))

    def names(self, status: Literal["replayable", "masked", "unsupported"]) -> list[str]:
        """The names with `status`."""
        return [row.name for row in self.rows if row.status == status]

    def __str__(self) -> str:
        return status_table(self.rows, self.counts())


@without_grad
def audit(
    model: SupportsLoadWeights,
    specs: Iterable[tuple[str, Sequence[int], torch.dtype]],
    *,
    strategy: CopyStrategy | None = None,
    protect: Mapping[str, str] | None = None,
) -> AuditReport:
    """Find out, for each checkpoint tensor, how sparse patches to it will be applied.

    For each ``(name, shape, dtype)``, an all-"keep" sparse patch (it changes nothing) goes
    through the model's ``load_weights`` under the same guard as a real patch load. Every write
    the loader makes is undone afterwards, its own unmasked writes included, so auditing changes
    no weight. Run it once per model (and per tensor-parallel rank) to see which names will be
    O(nnz) with a `RouteCache` and which will not, and why.

    Args:
        model: The model, as for `load_checkpoint_weight_patches`.
        specs: The checkpoint tensors: name, full shape and dtype.
        strategy: The strategy real patches will use; default `Auto()`.
        protect: Tensors that must not be written, with the reason, as for
            `load_checkpoint_weight_patches`: a name whose loader would write into one is
            reported ``"unsupported"`` with that reason.

    Returns:
        One row per name: replayable, masked, or unsupported with the reason.

    Examples:
        >>> import torch
        >>> from patchctx import audit
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        ...         self.b = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             if name == "a":
        ...                 self.a.copy_(tensor)                    # a view copy
        ...             else:
        ...                 self.b.copy_(tensor.t().contiguous())   # a computed copy
        ...         return {name for name, _ in weights}
        >>> report = audit(Model(), [("a", (2, 3), torch.float32), ("b", (2, 3), torch.float32)])
        >>> print(report)
        name  status       reason
        ----  -----------  ------
        a     replayable
        b     masked       the loader copied a computed copy, not a view
        1 replayable, 1 masked, 0 unsupported
    """
    check_model(model, "audit")
    chosen = as_strategy(strategy, Auto(), "audit")
    protected = name_map(protect, "protect= maps tensor names to the reason they are protected")
    persistent = ModelIndex(model_tensors(model), protected)
    module = as_module(model)  # what the loader calls run on
    rows = []
    for name, shape, dtype in specs:
        rows.append(
            _audit_one(module, persistent, chosen, name, tuple(int(d) for d in shape), dtype)
        )
    return AuditReport(tuple(rows))


def _audit_one(
    model: torch.nn.Module,
    persistent: ModelIndex,
    strategy: CopyStrategy,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> AuditRow:
    reason = strategy.unsupported_reason(dtype)
    if reason is not None:
        return AuditRow(name, "unsupported", reason)
    device = next((t.device for t in persistent.tensors.values()), torch.device("cpu"))
    nothing = torch.zeros(0, dtype=torch.long, device=device)
    keep_everything = torch.zeros(0, dtype=dtype, device=device)
    undo = UndoLog()
    try:
        result = run_loader(
            model,
            [Load(name, shape, dtype, keep_everything, nothing)],
            index=persistent,
            undo=undo,
            atomic=True,
        )
    except UnchangedValueRead as error:
        reason = (
            "the loader reads values out of torch: sparse patches work through it only when "
            f"they change every element ({error})"
        )
        return AuditRow(name, "masked", reason)
    except LoaderContractError as error:
        return AuditRow(name, "unsupported", str(error))
    except Exception as error:  # the loader itself failed on this name
        return AuditRow(name, "unsupported", f"the loader raised {type(error).__name__}: {error}")
    finally:
        undo.restore()
    if name not in result.consumed:
        # Nothing of it reached the model: a patch to it is refused (strict), or changes
        # nothing (strict=False); never a route.
        return AuditRow(
            name,
            "unsupported",
            "the loader writes nothing for it (on this rank: it skips the name, unknown or "
            "held by another rank); a patch to it is refused unless strict=False",
        )
    if name in result.routes:
        return AuditRow(name, "replayable")
    return AuditRow(name, "masked", result.unprovable.get(name, ""))
