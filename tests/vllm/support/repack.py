"""Which parameters vLLM transformed after loading: a prototype of patchctx's refusal check.

Two signals, both read from the model object (see ``tests/vllm/FINDINGS.md``):

1. **vLLM's own load-time metadata.** ``initialize_model`` records, for every module, meta
   copies of its parameters as created (``model_loader.reload.layerwise.LAYERWISE_INFO``,
   kept for layerwise reloading). A live parameter whose shape, strides, dtype, class or
   attributes differ from that record was replaced or reshaped after loading: the CPU
   backend's emptied linear weights (shape ``(0,)``, a plain ``Parameter`` without
   ``weight_loader``) and its repacked MoE experts (same shape, but a new ``Parameter`` that
   kept only ``weight_loader`` of the recorded attributes).
2. **Kernel-owned copies.** A linear-like module (``LinearBase`` or ``ParallelLMHead``) whose
   ``cpu_linear`` is not ``torch.nn.functional.linear`` computes with a copy the kernel made
   at load time (oneDNN); its ``weight`` may be unchanged, but writing it changes nothing the
   matmul reads. Every name sharing that storage (a tied input embedding) is affected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
    dropped = sorted(set(recorded.__dict__) - set(live.__dict__))
    if dropped:
        found.append(f"attributes {dropped} dropped (parameter replaced)")
    return found


def transformed_weights(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases included) that must not take a checkpoint patch."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    reasons: dict[str, str] = {}
    kernel_copies: dict[int, str] = {}  # storage address -> module that computes with a copy
    for module_name, module in model.named_modules():
        info: Any = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        for name, param in module.named_parameters(recurse=False):
            meta = recorded.get(name)
            found = _differences(param, meta) if meta is not None else []
            if found:
                qualified = f"{module_name}.{name}" if module_name else name
                reasons[qualified] = "transformed after loading: " + "; ".join(found)
        cpu_linear = getattr(module, "cpu_linear", None)
        if (
            cpu_linear is not None
            and cpu_linear is not torch.nn.functional.linear
            and isinstance(module, (LinearBase, ParallelLMHead))
            and module.weight.numel()
        ):
            kernel_copies[module.weight.untyped_storage().data_ptr()] = module_name
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = kernel_copies.get(param.untyped_storage().data_ptr()) if param.numel() else None
        if owner is not None and name not in reasons:
            reasons[name] = f"read through a kernel-owned copy ({owner}.cpu_linear)"
    return reasons
