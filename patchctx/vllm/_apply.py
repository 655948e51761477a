"""What a worker does with an update, whoever delivers it: the backend or the worker extension.

One `WorkerPatcher` per worker (per model) keeps the worker's `RouteCache`, the weight version
its weights are at, and the checkpoint names already known to reach a parameter. `apply`
checks the base version, refuses names that no loader consumes, resolves tied embeddings,
refuses weights the engine transformed after loading, and applies everything in one call of
`load_checkpoint_weight_patches`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    RouteCache,
    WarmReport,
    load_checkpoint_weight_patches,
    validate_patches,
)
from patchctx._geometry import Route
from patchctx._model import SupportsLoadWeights, read_names
from patchctx._routes import book_of
from patchctx.vllm._aliases import aliases_in, tied_aliases
from patchctx.vllm._consumption import audit_model, refuse_unconsumed
from patchctx.vllm._errors import WeightVersionError
from patchctx.vllm._landing import read_back
from patchctx.vllm._layerwise import layerwise_reload_active, layerwise_stats, layerwise_weights
from patchctx.vllm._layout import repack_touched
from patchctx.vllm._transformed import refusing_transformed, transformed_in, transformed_weights
from patchctx.vllm._walk import ModelWalk

__all__ = [
    "UNKNOWN",
    "WorkerPatcher",
    "audit_model",
    "check_version",
    "layerwise_reload_active",
]

UNKNOWN: None = None
"""The version of weights that may hold part of a failed non-atomic update."""


def check_version(value: object) -> str | int | None:
    """`value` if it is a weight version (a str, an int or None); `InvalidPatchError` if not."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidPatchError(f"a weight version is a str, an int or None, got {value!r}")


@dataclass
class WorkerPatcher:
    """A worker's patch state: routes, the weight version, names known to reach a parameter.

    Attributes:
        routes: The worker's `RouteCache` (first sparse patch to a name through the loader,
            later ones replayed in O(nnz)).
        version: The weight version the worker's weights are at (`None`: unknown).
        consumed: Checkpoint names seen to reach a parameter of this worker's model.
        check_consumed: Refuse a patch whose name no loader consumes on this rank (off for
            pipeline parallelism, where another stage holds the name).

    Examples:
        >>> import torch
        >>> from patchctx import CheckpointWeightPatch, InvalidPatchError
        >>> from patchctx.vllm._apply import WorkerPatcher
        >>> class Model(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             if name == "w":
        ...                 self.w.copy_(tensor)
        ...         return {"w"}
        >>> patcher = WorkerPatcher(version="v0")
        >>> patch = CheckpointWeightPatch("w", (3,), torch.float32, torch.ones(3))
        >>> patcher.apply(Model(), [patch], base_version="v0", target_version="v1")["version"]
        'v1'
        >>> typo = CheckpointWeightPatch("w_typo", (3,), torch.float32, torch.ones(3))
        >>> try:  # the model's loader skips the name: refused, not reported as applied
        ...     patcher.apply(Model(), [typo], base_version="v1", target_version="v2")
        ... except InvalidPatchError as error:
        ...     print(error.problems[0].reason[:36], patcher.version)
        no loader of this model consumes it  v1
    """

    # The worker dry-runs the loader at engine start (`warm`) already: dense patches to names
    # without a route learn theirs the same way.
    routes: RouteCache = field(default_factory=lambda: RouteCache(learn_dense=True))
    version: str | int | None = None
    consumed: set[str] = field(default_factory=set)
    check_consumed: bool = True

    def route(self, name: str) -> Route | None:
        """The route `routes` holds for the checkpoint name `name` (`None`: none yet)."""
        return book_of(self.routes).route(name)

    def check_base(self, base_version: str | int | None) -> None:
        """Refuse (`WeightVersionError`) patches made against another version than `version`."""
        if base_version is None or base_version == self.version:
            return
        raise WeightVersionError(
            f"the patches were made against weight version {base_version!r}; this worker "
            f"holds {self.version!r}; nothing was written",
            expected=base_version,
            found=self.version,
        )

    def warm(
        self, model: torch.nn.Module, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]
    ) -> WarmReport:
        """Learn the routes of `specs` before the first update (`RouteCache.warm`).

        As `apply` would load them: tied aliases resolved to their canonical name (learnt
        once), weights the engine transformed refused. A name learnt with a route that writes
        a parameter counts as consumed, so the first update skips its `audit` too (which
        stages the whole tensor); a route that writes nothing on this rank does not.

        Returns:
            One row per canonical name.
        """
        protect = transformed_weights(model)
        aliases = tied_aliases(model)
        canonical: dict[str, tuple[str, Sequence[int], torch.dtype]] = {}
        names: dict[str, set[str]] = {}
        for name, shape, dtype in specs:
            target = aliases.get(name, name)
            canonical.setdefault(target, (target, shape, dtype))
            names.setdefault(target, {target}).add(name)
        with refusing_transformed(model, protect):
            report = self.routes.warm(
                cast("SupportsLoadWeights", model), list(canonical.values()), protect=protect
            )
        for row in report.rows:
            route = self.route(row.name)
            if row.status == "learned" and route is not None and route.segments:
                self.consumed |= names[row.name]
        return report

    def _apply_in_layerwise_reload(
        self,
        model: torch.nn.Module,
        patches: Sequence[CheckpointWeightPatch],
        target_version: str | int | None,
        started: float,
    ) -> dict[str, Any]:
        """Dense patches into vLLM's layerwise reload (`layerwise_weights`), as they are."""
        weights = layerwise_weights(model, patches)  # refused before a write, if at all
        try:
            # A generator loader runs while its names are read: inside this try, so that a
            # failure part way leaves the version unknown.
            loaded = read_names(model.load_weights(weights))  # type: ignore[operator]
        except BaseException:
            self.version = UNKNOWN  # vLLM may hold part of it for finalization
            raise
        self.version = target_version
        return layerwise_stats(patches, loaded, target_version, started)

    def check(self, model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]) -> None:
        """Every check `apply` makes before its first write (`InvalidPatchError` if one fails).

        The patches themselves (`validate_patches`), and names that no loader consumes or
        whose loader refuses them (first patch to a name only; the loader sees an all-keep
        patch and every write is undone).
        """
        validate_patches(patches)
        if self.check_consumed:
            refuse_unconsumed(model, patches, self.consumed)

    def apply(
        self,
        model: torch.nn.Module,
        patches: Sequence[CheckpointWeightPatch],
        *,
        base_version: str | int | None = None,
        target_version: str | int | None = None,
        atomic: bool = True,
        max_chunk_bytes: int | None = None,
        validate_unique_indices: bool = True,
        verify_landing: bool = False,
    ) -> dict[str, Any]:
        """Check, then apply `patches` to `model`; return statistics (see the extension).

        Raises:
            WeightVersionError: `base_version` is not `version`; nothing was written.
            InvalidPatchError: A patch is invalid, or no loader consumes its name.
            PatchError: The load failed; with `atomic` (forced when the model has transformed
                weights) nothing was written, otherwise `version` becomes unknown.
        """
        started = time.perf_counter()
        self.check_base(base_version)
        landing: dict[str, int] = {}
        # Every fact below is read from the model now, in one walk shared by the checks.
        walk = ModelWalk.of(model)
        if layerwise_reload_active(model, walk):
            return self._apply_in_layerwise_reload(model, patches, target_version, started)
        protect = transformed_in(walk)
        atomic = atomic or bool(protect)
        before = replace(self.routes.stats)
        try:
            if self.check_consumed:
                refuse_unconsumed(model, patches, self.consumed)
            with refusing_transformed(model, protect, walk.params):
                loaded = load_checkpoint_weight_patches(
                    # Every vLLM model has load_weights; torch types Module attributes loosely.
                    cast("SupportsLoadWeights", model),
                    patches,
                    max_chunk_bytes=max_chunk_bytes,
                    validate_unique_indices=validate_unique_indices,
                    routes=self.routes,
                    atomic=atomic,
                    aliases=aliases_in(walk),
                    protect=protect,
                    # A name no loader of this rank consumes is refused (above, or by the
                    # load); with pipeline parallelism another stage holds it.
                    strict=self.check_consumed,
                    verify=(
                        (lambda: landing.update(self.read_back(model, patches)))
                        if verify_landing
                        else None
                    ),
                )
        except InvalidPatchError:
            raise  # raised before any write
        except BaseException:
            if not atomic:
                self.version = UNKNOWN  # part of the patches may have been written
            raise
        try:
            # The layers vLLM prepacked after loading compute from their own copy: their
            # post-load step again, on the layers written (`repack_touched`).
            repacked = repack_touched(model, loaded)
        except BaseException:
            self.version = UNKNOWN  # written, but some kernels may still hold the old copy
            raise
        self.consumed.update(patch.name for patch in patches)
        self.version = target_version
        after = self.routes.stats
        return {
            "ok": True,
            "names": sorted({patch.name for patch in patches}),
            "loaded": sorted(loaded),
            "replayed": after.replayed - before.replayed,
            "through_loader": after.loaded - before.loaded,
            "loader_calls": after.loader_calls - before.loader_calls,
            "milliseconds": (time.perf_counter() - started) * 1000.0,
            "version": self.version,
            "atomic": atomic,
            "protected": len(protect),
            "repacked": len(repacked),
            **({"landing": landing} if verify_landing else {}),
        }

    def read_back(
        self, model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]
    ) -> dict[str, int]:
        """Proof of landing through `routes` (`patchctx.vllm._landing.read_back`)."""
        return read_back(self.routes, model, patches)


def failure_details(error: BaseException, rank: int) -> dict[str, Any]:
    """An error as plain data that survives any RPC: its class, message, rank (and versions)."""
    details: dict[str, Any] = {"type": type(error).__name__, "message": str(error), "rank": rank}
    if isinstance(error, WeightVersionError):
        details.update(expected=error.expected, found=error.found)
    return details
