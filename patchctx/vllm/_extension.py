"""The worker side: a vLLM worker extension that applies encoded patches to the worker's model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from patchctx import InvalidPatchError, PatchError
from patchctx.vllm._apply import WorkerPatcher, audit_model, check_version, failure_details
from patchctx.vllm._codec import DTYPES, decode_payload

__all__ = ["APPLY_METHOD", "SET_VERSION_METHOD", "PatchWorkerExtension"]

APPLY_METHOD = "patchctx_apply_patches"
SET_VERSION_METHOD = "patchctx_set_weight_version"

_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "atomic": (bool,),
    "max_chunk_bytes": (int, type(None)),
    "validate_unique_indices": (bool,),
    "errors": (str,),
}
_DEFAULTS: dict[str, Any] = {
    "atomic": False,
    "max_chunk_bytes": None,
    "validate_unique_indices": True,
    "errors": "raise",
}


def _options(options: object) -> dict[str, Any]:
    if options is None:
        return dict(_DEFAULTS)
    if not isinstance(options, Mapping):
        raise InvalidPatchError(f"options must be a dict, got {options!r:.80}")
    unknown = sorted(set(options) - set(_DEFAULTS))
    if unknown:
        raise InvalidPatchError(f"unknown options {unknown}; known: {sorted(_DEFAULTS)}")
    chosen = {**_DEFAULTS, **options}
    for key, types in _OPTION_TYPES.items():
        value = chosen[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise InvalidPatchError(f"option {key}={value!r} has the wrong type")
    if chosen["errors"] not in ("raise", "return"):
        raise InvalidPatchError(f"option errors={chosen['errors']!r}: 'raise' or 'return'")
    return chosen


def _parsed_specs(specs: Sequence[Sequence[Any]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    parsed = []
    for spec in specs:
        name, shape, dtype = spec
        if dtype not in DTYPES:
            raise InvalidPatchError(f"{name!r}: unknown dtype name {dtype!r}")
        parsed.append((str(name), tuple(int(d) for d in shape), DTYPES[dtype]))
    return parsed


class PatchWorkerExtension:
    """A vLLM worker extension: apply encoded patches to the worker's model, keep versions.

    Start the engine with
    ``LLM(..., worker_extension_cls="patchctx.vllm.PatchWorkerExtension")``; vLLM mixes this
    class into each worker, and `apply_patches` calls it on every worker through
    ``collective_rpc``. Each worker keeps

    - a `RouteCache` for its model: the first sparse patch to a name goes through the model's
      ``load_weights`` (O(N)); later ones replay in O(nnz);
    - its weight version: `None` (unknown) until declared with `set_weight_version` or moved
      by a successful update to the payload's ``target_version``. A payload whose
      ``base_version`` is not the worker's version is refused before any write
      (`WeightVersionError`). After a failed update without ``atomic``, which may have
      written part of the patches, the version becomes unknown.

    Every call resolves tied embeddings with `tied_aliases` and refuses weights the engine
    transformed after loading (`transformed_weights`): when the model has any, the update is
    atomic whatever ``atomic`` says, so a refusal leaves every weight as it was.

    Methods (called by name through ``llm.collective_rpc``): ``patchctx_apply_patches(payload,
    options)`` (used by `apply_patches`), ``patchctx_set_weight_version(version)``,
    ``patchctx_weight_version()``, ``patchctx_warm(specs=None)`` (`RouteCache.warm` on the worker:
    routes learnt before the first update, from the checkpoint's safetensors headers by
    default) and ``patchctx_audit(specs)`` (`audit_model` on the worker,
    with specs as ``[name, shape, dtype name]`` lists; returns ``[name, status, reason]``
    rows). All names start with ``patchctx_``: vLLM refuses an extension whose attribute names
    clash with the worker's.

    Examples:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from patchctx import CheckpointWeightPatch
        >>> from patchctx.vllm import PatchWorkerExtension, WeightVersionError, encode_patches
        >>> class Model(torch.nn.Module):  # stands for the worker's vLLM model
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.w.copy_(tensor)
        ...         return {"w"}
        >>> model, worker = Model(), PatchWorkerExtension()  # stands for vLLM's worker
        >>> worker.model_runner = SimpleNamespace(get_model=lambda: model)
        >>> def patch(value):
        ...     return CheckpointWeightPatch("w", (2, 2), torch.float32, torch.tensor([value]),
        ...                                  torch.tensor([3]))
        >>> stats = worker.patchctx_apply_patches(encode_patches([patch(1.0)], target_version=1))
        >>> stats["names"], stats["loader_calls"], stats["version"]
        (['w'], 1, 1)
        >>> payload = encode_patches([patch(2.0)], base_version=1, target_version=2)
        >>> stats = worker.patchctx_apply_patches(payload)
        >>> stats["replayed"], stats["loader_calls"], stats["version"]
        (1, 0, 2)
        >>> try:  # made against version 1, but the worker moved on to 2
        ...     worker.patchctx_apply_patches(encode_patches([patch(3.0)], base_version=1))
        ... except WeightVersionError as error:
        ...     print(error.expected, error.found, model.w.view(-1).tolist())
        1 2 [0.0, 0.0, 0.0, 2.0]
    """

    model_runner: Any  # set by vLLM's worker
    _patchctx_takes_patches = True  # _layout.EXTENSION_MARK: repack for this engine

    def _patchctx_worker(self) -> WorkerPatcher:
        state = vars(self).get("_patchctx_worker_state")
        if state is None:
            state = WorkerPatcher()
            self._patchctx_worker_state = state
        assert isinstance(state, WorkerPatcher)
        return state

    def _patchctx_model(self) -> torch.nn.Module:
        model = self.model_runner.get_model()
        assert isinstance(model, torch.nn.Module)
        return model

    def patchctx_weight_version(self) -> str | int | None:
        """The weight version this worker holds (`None`: unknown)."""
        return self._patchctx_worker().version

    def patchctx_last_update(self) -> dict[str, Any] | None:
        """What this worker's ``patchctx`` backend did in its last update (or `None`).

        ``milliseconds`` (the apply, on the worker), ``replayed``, ``loader_calls``...;
        `None` without that backend or before an update.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        stats = getattr(engine, "last_stats", None)
        return dict(stats) if isinstance(stats, dict) else None

    def patchctx_set_weight_version(self, version: str | int | None) -> None:
        """Declare the weight version this worker holds (e.g. after loading a checkpoint)."""
        self._patchctx_worker().version = check_version(version)

    def patchctx_audit(self, specs: Sequence[Sequence[Any]]) -> list[list[str]]:
        """`audit_model` on this worker's model; specs are ``[name, shape, dtype name]``."""
        report = audit_model(self._patchctx_model(), _parsed_specs(specs))
        return [[row.name, row.status, row.reason] for row in report.rows]

    def patchctx_warm(self, specs: Sequence[Sequence[Any]] | None = None) -> list[list[str]]:
        """Learn routes before the first update (`RouteCache.warm`: nothing is written).

        Specs are ``[name, shape, dtype name]`` lists; `None` (the default) reads every
        tensor of the checkpoint the engine loaded from its safetensors headers. Returns
        ``[name, status, reason]`` rows (status ``learned``, ``unlearnable`` or ``deferred``).
        """
        if specs is None:
            from patchctx.vllm._warmup import checkpoint_specs

            parsed = checkpoint_specs(getattr(self, "vllm_config", None))
        else:
            parsed = _parsed_specs(specs)
        report = self._patchctx_worker().warm(self._patchctx_model(), parsed)
        return [[row.name, row.status, row.reason] for row in report.rows]

    def patchctx_apply_patches(
        self, payload: bytes, options: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Apply an `encode_patches` payload to this worker's model; return its statistics.

        The same worker code as the ``patchctx`` weight-transfer backend
        (`PatchctxWeightTransferEngine`): version check, names no loader consumes refused,
        tied aliases, transformed weights refused.

        Args:
            payload: What `encode_patches` made.
            options: ``atomic`` (bool), ``max_chunk_bytes`` (int or None),
                ``validate_unique_indices`` (bool), ``errors`` (``"raise"``, the default, or
                ``"return"``: a `PatchError` comes back as ``{"ok": False, "error": {...}}``
                so that its class survives multi-process RPC; `apply_patches` re-raises it).

        Returns:
            ``rank``, ``ok``, ``names`` (the checkpoint names patched), ``loaded`` (the names
            the model's ``load_weights`` reported), ``replayed`` (patches applied by route
            replay), ``through_loader`` (patches loaded through ``load_weights``),
            ``loader_calls``, ``milliseconds``, ``version`` (after the call), ``atomic``
            (whether the call was atomic) and ``protected`` (how many parameters were
            refused as transformed).
        """
        state = self._patchctx_worker()
        rank = int(getattr(self, "rank", 0) or 0)
        try:
            chosen = _options(options)
        except InvalidPatchError as error:
            return self._patchctx_failure(error, rank, "raise", state)
        try:
            decoded = decode_payload(payload)
            stats = state.apply(
                self._patchctx_model(),
                decoded.patches,
                base_version=decoded.base_version,
                target_version=decoded.target_version,
                atomic=chosen["atomic"],
                max_chunk_bytes=chosen["max_chunk_bytes"],
                validate_unique_indices=chosen["validate_unique_indices"],
            )
        except PatchError as error:
            return self._patchctx_failure(error, rank, chosen["errors"], state)
        return {"rank": rank, **stats}

    def _patchctx_failure(
        self, error: PatchError, rank: int, errors: str, state: WorkerPatcher
    ) -> dict[str, Any]:
        if errors != "return":
            raise error
        details = failure_details(error, rank)
        return {"rank": rank, "ok": False, "error": details, "version": state.version}
