"""Weights the engine transformed after loading: found from the model, refused before a write.

vLLM post-processes weights after ``load_weights`` (``process_weights_after_loading``): the CPU
backend prepacks dense linear weights for its GEMM and replaces them by empty tensors, keeps a
prepacked copy of the LM head, and repacks MoE experts into its kernel's layout; quantized
kernels repack and reshape. A checkpoint-layout patch into such a weight is wrong or lost.
Three signals, read from the live model:

1. Known kernels: a fused-MoE layer whose experts run on vLLM's CPU MoE kernel (``w13_weight``
   and ``w2_weight`` are in the kernel's layout), and a linear or LM-head module whose
   ``cpu_linear`` computes from its own prepacked copy (every name bound to that weight),
   unless patchctx kept its weight to repack it after each patch (`patchctx.vllm._layout`).
2. vLLM's own load-time record: ``initialize_model`` keeps meta copies of every parameter as
   created (``LAYERWISE_INFO[module].restore_metadata``); a live parameter whose shape,
   strides, dtype or class differs, or that lost recorded attributes (``replace_parameter``
   keeps only ``weight_loader``), was replaced after loading.
3. Without that record (another vLLM version): an empty weight in a module that computes with
   ``cpu_linear``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from patchctx._errors import LoaderContractError
from patchctx._staged import StagedTensor, provenance_of
from patchctx.vllm._layout import REPACK_MARK
from patchctx.vllm._walk import ModelWalk, attribute

__all__ = ["refusing_transformed", "transformed_in", "transformed_weights"]

_MISSING = object()
_KEEP = (
    "patchctx repacks such layers after each patch in engines started with the patchctx "
    "backend or worker extension, unless PATCHCTX_VLLM_REPACK=0; or, to keep it in "
    "checkpoint layout, start the engine with "
    "PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1 in its environment (vllm serve, multi-process "
    "engines), or inside patchctx.vllm.keep_checkpoint_layout() (in-process engines)"
)


def _layerwise_records() -> Any:
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM-internal; rules 1 and 3 still apply
        return None
    return LAYERWISE_INFO


def _class(path: str, name: str) -> type | None:
    try:
        module = __import__(path, fromlist=[name])
    except ImportError:  # pragma: no cover - depends on the vLLM version
        return None
    found = getattr(module, name, None)
    return found if isinstance(found, type) else None


def _differences(live: torch.Tensor, recorded: torch.Tensor) -> list[str]:
    found = []
    if live.shape != recorded.shape:
        found.append(f"shape {tuple(recorded.shape)} -> {tuple(live.shape)}")
    elif live.stride() != recorded.stride():
        found.append(f"strides {recorded.stride()} -> {live.stride()}")
    if live.dtype != recorded.dtype:
        found.append(f"dtype {recorded.dtype} -> {live.dtype}")
    if type(live) is not type(recorded):
        found.append(f"class {type(recorded).__name__} -> {type(live).__name__}")
    # `weight_loader` is no evidence either way: vLLM's `replace_parameter` keeps it, and its
    # own `reload_weights` adds it to the record of parameters that never had one.
    dropped = sorted(set(vars(recorded)) - set(vars(live)) - {"weight_loader"})
    if dropped:
        found.append(f"attributes {dropped} dropped")
    return found


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def transformed_weights(model: torch.nn.Module) -> dict[str, str]:
    """Find the parameters the engine transformed after loading, with the reason for each.

    A checkpoint-layout patch must not be written into such a weight: it is in another layout
    (repacked MoE experts), empty (prepacked CPU linear weights), or no longer read by the
    kernel (an LM head computed from a prepacked copy, and the input embedding tied to it).
    The worker extension passes this map as ``protect=`` to
    `load_checkpoint_weight_patches`, with ``atomic=True``, so a patch set that reaches one is
    refused and changes nothing.

    Args:
        model: The vLLM model as the worker holds it (after ``process_weights_after_loading``).

    Returns:
        Qualified parameter name -> reason, every name of a tied parameter included; empty
        when every weight is in checkpoint layout (e.g. unquantized models on GPU, or CPU
        engines under `keep_checkpoint_layout` without MoE layers).

    Examples:
        >>> import torch
        >>> from patchctx.vllm import transformed_weights
        >>> transformed_weights(torch.nn.Linear(2, 2))  # nothing vLLM did to it
        {}
    """
    return transformed_in(ModelWalk.of(model))


def transformed_in(walk: ModelWalk) -> dict[str, str]:
    """`transformed_weights` of the model `walk` lists (read from it now, not cached)."""
    kernels = _Kernels.found()
    reasons: dict[str, str] = {}
    kernel_copies: dict[int, str] = {}  # storage -> module computing from its own copy
    for prefix, module in walk.unique_modules():

        def qualified(local: str, prefix: str = prefix) -> str:
            return f"{prefix}.{local}" if prefix else local

        for local, reason in _moe_repacked(module, kernels.cpu_experts):
            reasons[qualified(local)] = reason
        prepacked = _prepacked(module, kernels.linear)
        if isinstance(prepacked, str):
            reasons.setdefault(qualified("weight"), prepacked)
        elif prepacked is not None:
            kernel_copies[prepacked] = prefix
        for local, reason in _replaced(module, kernels.records):
            reasons.setdefault(qualified(local), reason)
    for name, tensor in walk.params.items() if kernel_copies else ():
        owner = kernel_copies.get(_storage(tensor) or -1)
        if owner is not None and name not in reasons:
            reasons[name] = _computed_from_copy(name, owner)
    return reasons


@dataclass(frozen=True)
class _Kernels:
    """What the three signals recognise in this vLLM (`None` or empty where it lacks one)."""

    linear: tuple[type, ...]  # modules that may compute with ``cpu_linear``
    cpu_experts: type | None  # vLLM's CPU MoE kernel
    records: Any  # vLLM's load-time record of every parameter (``LAYERWISE_INFO``)

    @classmethod
    def found(cls) -> _Kernels:
        linear = (
            _class("vllm.model_executor.layers.linear", "LinearBase"),
            _class("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
        )
        return cls(
            tuple(c for c in linear if c is not None),
            _class("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts"),
            _layerwise_records(),
        )


def _moe_repacked(module: torch.nn.Module, cpu_experts: type | None) -> Iterator[tuple[str, str]]:
    """Signal 1, MoE: the experts `module` runs on vLLM's CPU MoE kernel, in its layout."""
    kernel = getattr(
        getattr(attribute(module, "quant_method"), "moe_kernel", None), "fused_experts", None
    )
    if (
        cpu_experts is None
        or not isinstance(kernel, cpu_experts)
        or getattr(kernel, "_use_zentorch", False)
    ):
        return
    isa = getattr(kernel, "isa", "?")
    for local in ("w13_weight", "w2_weight"):
        if isinstance(attribute(module, local), torch.Tensor):
            yield (
                local,
                (f"repacked by the CPU MoE kernel into its own layout (isa {isa!r}) after loading"),
            )


def _prepacked(module: torch.nn.Module, linear: tuple[type, ...]) -> str | int | None:
    """Signals 1 and 3, linear: `module` computes from its own prepacked copy of its weight.

    Returns the reason when its weight was replaced by an empty tensor, the weight's storage
    when the weight stays (every name bound to it is then refused), `None` when neither.
    """
    cpu_linear = attribute(module, "cpu_linear")
    weight = attribute(module, "weight")
    if (
        callable(attribute(module, REPACK_MARK))  # kept weight: repacked after patches
        or cpu_linear is None
        or cpu_linear is torch.nn.functional.linear
        or not isinstance(module, linear)
        or not isinstance(weight, torch.Tensor)
    ):
        return None
    if weight.numel() == 0:
        return (
            "prepacked by the CPU GEMM kernel after loading and replaced by an empty tensor "
            f"({_KEEP})"
        )
    return _storage(weight)


def _replaced(module: torch.nn.Module, records: Any) -> Iterator[tuple[str, str]]:
    """Signal 2: `module`'s parameters that differ from vLLM's load-time record of them."""
    info = records.get(module) if records is not None else None
    recorded: Mapping[str, object] = (
        getattr(info, "restore_metadata", ({}, {}))[0] if info is not None else {}
    )
    for local, param in module.named_parameters(recurse=False) if recorded else ():
        meta = recorded.get(local)
        found = _differences(param, meta) if isinstance(meta, torch.Tensor) else []
        if found:
            yield local, "replaced after loading (" + "; ".join(found) + ")"


def _computed_from_copy(name: str, owner: str) -> str:
    """Why `name`, bound to the weight `owner`'s CPU kernel copied, is refused."""
    head = f"{owner}.weight" if owner else "weight"
    if name == head:
        return (
            f"the CPU kernel ({owner}.cpu_linear) computes from its own copy, prepacked "
            f"after loading: a patch would not reach the logits ({_KEEP})"
        )
    return (
        f"tied to {head!r}, whose CPU kernel computes from its own copy, prepacked "
        "after loading: a patch would change the embedding lookup but not the logits "
        f"({_KEEP})"
    )


def _patch_names(loaded_weight: object) -> str | None:
    """The checkpoint name(s) whose staged data `loaded_weight` carries, in a patch load."""
    if not isinstance(loaded_weight, StagedTensor):
        return None
    return ", ".join(sorted(provenance_of(loaded_weight).names))


def _refusal(name: str, reason: str) -> Any:
    def refuse(param: object, loaded_weight: object, *args: object, **kwargs: object) -> NoReturn:
        names = _patch_names(loaded_weight)
        what = f"the patch to {names!r}" if names else "a patch"
        raise LoaderContractError(
            f"{what} would write {name}: {reason}. Checkpoint-layout patches cannot be applied "
            "to it; refused before writing to it"
        )

    return refuse


@contextmanager
def refusing_transformed(
    model: torch.nn.Module,
    reasons: Mapping[str, str],
    params: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """While the block runs, loading into a transformed parameter raises `LoaderContractError`.

    vLLM's loaders call ``param.weight_loader``: each transformed parameter gets one that
    refuses, naming the parameter and the reason, before anything is written to it (an empty
    prepacked weight would otherwise fail with an unrelated ``AttributeError`` or size
    assertion). Parameters whose ``weight_loader`` cannot be replaced (a property) keep it;
    ``protect=`` refuses their writes at the write. Restored on exit. `params`: the model's
    ``named_parameters(remove_duplicate=False)``, when the caller has listed them already.
    """
    saved: list[tuple[Any, object]] = []
    seen: set[int] = set()
    if reasons and params is None:
        params = dict(model.named_parameters(remove_duplicate=False))
    try:
        for name, reason in reasons.items():
            param = None if params is None else params.get(name)
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            old = vars(param).get("weight_loader", _MISSING)
            try:
                param.weight_loader = _refusal(name, reason)
            except AttributeError:  # a read-only property (vLLM's BasevLLMParameter)
                continue
            saved.append((param, old))
        yield
    finally:
        for param, old in reversed(saved):
            if old is _MISSING:
                del param.weight_loader
            else:
                param.weight_loader = old
