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

import numpy
import torch

from patchctx import (
    AuditReport,
    AuditRow,
    CheckpointWeightPatch,
    InvalidPatchError,
    PatchError,
    PatchProblem,
    RouteCache,
    WarmReport,
    audit,
    load_checkpoint_weight_patches,
    validate_patches,
)
from patchctx._bits import bit_view
from patchctx._geometry import Route, Segment
from patchctx._model import SupportsLoadWeights, model_tensors, read_names
from patchctx._undo import storage_flat
from patchctx.vllm._aliases import aliases_in, tied_aliases
from patchctx.vllm._errors import WeightVersionError
from patchctx.vllm._layout import repack_touched
from patchctx.vllm._transformed import refusing_transformed, transformed_in, transformed_weights
from patchctx.vllm._walk import ModelWalk

__all__ = ["UNKNOWN", "WorkerPatcher", "audit_model", "check_version"]

UNKNOWN: None = None
"""The version of weights that may hold part of a failed non-atomic update."""

# What `audit` says of a name whose loader writes nothing on this rank.
_WRITES_NOTHING = "writes nothing"
# ... and of one whose loader raised.
_LOADER_RAISED = "the loader raised"


def check_version(value: object) -> str | int | None:
    """`value` if it is a weight version (a str, an int or None); `InvalidPatchError` if not."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidPatchError(f"a weight version is a str, an int or None, got {value!r}")


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


def layerwise_reload_active(model: torch.nn.Module, walk: ModelWalk | None = None) -> bool:
    """Whether vLLM's layerwise reload is under way on `model` (listed by `walk`, if given).

    Between ``initialize_layerwise_reload(model)`` and ``finalize_layerwise_reload``, vLLM
    has replaced the model's parameters by meta tensors and buffers what its loaders receive
    until a layer is complete; the live weights are back only after finalization.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM-internal
        return False
    modules = model.modules() if walk is None else (module for _, module in walk.modules)
    for module in modules:
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            return True
    return False


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
        return self.routes._route(name)

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

    def _refuse_unconsumed(
        self, model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]
    ) -> None:
        unknown: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for patch in patches:
            if patch.name not in self.consumed:
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
                    "no loader of this model consumes it (the model skips or does not know "
                    "the name)"
                )
            elif row.status == "unsupported":
                if row.reason.startswith(_LOADER_RAISED):  # an unknown name, a wrong shape
                    refused[row.name] = f"the model's loader refuses it ({row.reason[:300]})"
                # else: a transformed weight, refused with its reason by the load itself
            else:
                self.consumed.add(row.name)
        if refused:
            raise InvalidPatchError(
                [
                    PatchProblem(
                        position, patch.name, refused[patch.name] + "; nothing was written"
                    )
                    for position, patch in enumerate(patches)
                    if patch.name in refused
                ]
            )

    def _apply_in_layerwise_reload(
        self,
        model: torch.nn.Module,
        patches: Sequence[CheckpointWeightPatch],
        target_version: str | int | None,
        started: float,
    ) -> dict[str, Any]:
        """Dense patches handed to vLLM's layerwise reload as the checkpoint tensors they are.

        The weights are meta tensors until ``finalize_layerwise_reload``: there is nothing to
        mask a sparse patch against, and vLLM's buffering loaders must see plain tensors. A
        dense patch is a full checkpoint tensor, so it goes to ``load_weights`` unchanged
        (tied aliases resolved); vLLM processes and places it at finalization.
        """
        validate_patches(patches)
        sparse = [i for i, patch in enumerate(patches) if patch.indices is not None]
        if sparse:
            raise InvalidPatchError(
                [
                    PatchProblem(
                        i,
                        patches[i].name,
                        "a sparse patch needs the live weights, and vLLM's layerwise reload "
                        "holds them as meta tensors until finalize_layerwise_reload: send it "
                        "after finalizing, or send the whole tensor; nothing was written",
                    )
                    for i in sparse
                ]
            )
        aliases = tied_aliases(model)
        weights = [
            (aliases.get(p.name, p.name), p.values.reshape(p.shape).to(p.dtype)) for p in patches
        ]
        try:
            # A generator loader runs while its names are read: inside this try, so that a
            # failure part way leaves the version unknown.
            loaded = read_names(model.load_weights(weights))  # type: ignore[operator]
        except BaseException:
            self.version = UNKNOWN  # vLLM may hold part of it for finalization
            raise
        self.version = target_version
        return _in_layerwise_reload_stats(patches, loaded, target_version, started)

    def check(self, model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch]) -> None:
        """Every check `apply` makes before its first write (`InvalidPatchError` if one fails).

        The patches themselves (`validate_patches`), and names that no loader consumes or
        whose loader refuses them (first patch to a name only; the loader sees an all-keep
        patch and every write is undone).
        """
        validate_patches(patches)
        if self.check_consumed:
            self._refuse_unconsumed(model, patches)

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
                self._refuse_unconsumed(model, patches)
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
        """Proof of landing: read back what each patch wrote, through its route, O(changed).

        For every patch whose name has a route (learnt at start, by an earlier patch, or by
        this very call), the values at the storage positions the route maps its indices to
        (every element for a dense patch) must be the patch's values as ``copy_`` casts them
        into the weight, bit for bit. This sees what no guard does: a custom kernel, another
        process, a stale route. Raises `PatchError` naming the names that differ (the call is
        then undone when atomic).

        Returns:
            ``{"verified": patches read back, "elements": elements compared, "unverified":
            patches without a route (through the loader's masked path, checked by the guard)}``.
        """
        aliases = tied_aliases(model)
        tensors = model_tensors(cast("SupportsLoadWeights", model))
        final: dict[str, CheckpointWeightPatch] = {}
        for patch in patches:  # the last patch to each name is checked: it is what stands
            final[aliases.get(patch.name, patch.name)] = patch
        differ: list[str] = []
        verified = elements = unverified = 0
        for name, patch in final.items():
            route = self.route(name)
            if route is None or not route.segments:
                unverified += 1
                continue
            values = patch.values.detach().reshape(-1).to(patch.dtype)
            if patch.indices is not None:
                indices = patch.indices.detach().to(device=values.device, dtype=torch.long)
                ordered = indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all())
            for segment in route.segments:
                live = tensors.get(segment.tensor_name)
                if live is None:
                    differ.append(f"{patch.name!r} (its weight {segment.tensor_name!r} is gone)")
                    break
                flat = storage_flat(live.detach().view(segment.dtype))
                if patch.indices is None:  # the segment's views themselves, as replay wrote
                    got, want = _dense_views(segment, flat, values.to(live.device))
                else:
                    found, picked = segment.positions(
                        indices.to(live.device), sorted_unique=ordered
                    )
                    got = flat[found]
                    want = values.to(live.device)[picked].to(segment.dtype)
                elements += int(got.numel())
                if not _same_bits(got, want):
                    differ.append(f"{patch.name!r} (in {segment.tensor_name!r})")
                    break
            else:
                verified += 1
        if differ:
            raise PatchError(
                "proof of landing failed: what the weights hold after the update is not what "
                "was sent, for " + ", ".join(differ) + " (a kernel, another process or a "
                "stale route wrote them); the update is undone"
            )
        return {"verified": verified, "elements": elements, "unverified": unverified}


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` and `want` hold the same bits.

    Contiguous CPU memory is compared by numpy, at about twice ``torch.equal``'s speed there.
    """
    got, want = bit_view(got), bit_view(want)
    if (
        got.device.type == want.device.type == "cpu"
        and got.is_contiguous()
        and want.is_contiguous()
        and got.dtype == want.dtype
    ):
        return bool(numpy.array_equal(got.numpy(), want.numpy()))
    return torch.equal(got, want)


def _dense_views(
    segment: Segment, flat: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight's view a dense patch's segment wrote, the patch's values it should hold).

    Strided views compared in place: a dense read-back reads each byte once, with no index
    of 8 bytes per element built, gathered through and thrown away.
    """
    there, here = segment.target, segment.source
    got = torch.as_strided(flat, there.size, there.stride, there.offset)
    values = values.contiguous()  # the source geometry is a contiguous tensor's
    start = values.storage_offset() + here.offset
    return got, torch.as_strided(values, here.size, here.stride, start).to(segment.dtype)


def _in_layerwise_reload_stats(
    patches: Sequence[CheckpointWeightPatch], loaded: set[str], version: object, started: float
) -> dict[str, Any]:
    return {
        "ok": True,
        "names": sorted({patch.name for patch in patches}),
        "loaded": sorted(loaded),
        "replayed": 0,
        "through_loader": len(patches),
        "loader_calls": 1,
        "milliseconds": (time.perf_counter() - started) * 1000.0,
        "version": version,
        "atomic": False,
        "protected": 0,
    }


def failure_details(error: BaseException, rank: int) -> dict[str, Any]:
    """An error as plain data that survives any RPC: its class, message, rank (and versions)."""
    details: dict[str, Any] = {"type": type(error).__name__, "message": str(error), "rank": rank}
    if isinstance(error, WeightVersionError):
        details.update(expected=error.expected, found=error.found)
    return details
