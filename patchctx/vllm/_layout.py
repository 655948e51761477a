"""The switch that keeps vLLM's CPU backend from prepacking dense weights (patchable engines)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["KEEP_LAYOUT_ENV", "keep_checkpoint_layout", "layout_kept"]

KEEP_LAYOUT_ENV = "PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT"

_lock = threading.Lock()


def _utils() -> Any:
    try:
        from vllm.model_executor.layers import utils
    except ImportError as error:  # pragma: no cover - depends on the vLLM version
        raise ImportError(
            "keep_checkpoint_layout() needs vllm.model_executor.layers.utils (vLLM >= 0.32)"
        ) from error
    if not callable(getattr(utils, "dispatch_cpu_unquantized_gemm", None)):
        raise ImportError(  # pragma: no cover - depends on the vLLM version
            "keep_checkpoint_layout(): this vLLM has no "
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm to replace; the "
            "switch is written for vLLM 0.32's CPU backend"
        )
    return utils


_MARK = "_patchctx_keeps_checkpoint_layout"


class _State:
    """Process-wide: how many `keep_checkpoint_layout` blocks are open, and the env switch."""

    depth = 0
    forever = False
    installed = False


def _keeps(layer: Any) -> bool:
    return _State.forever or _State.depth > 0 or bool(getattr(layer, _MARK, False))


def _keeping(original: Callable[..., None]) -> Callable[..., None]:
    def keep_layout(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if (
            not _keeps(layer)
            or not isinstance(weight, torch.Tensor)
            or weight.is_meta
            or weight.ndim != 2
        ):
            original(layer, remove_weight)  # not kept, or not a dense matrix: vLLM's own
            return
        # The layer keeps its layout for its whole life: vLLM calls this again when it
        # reloads weights (`reload_weights`, layerwise reload), after the block has ended.
        setattr(layer, _MARK, True)
        layer.cpu_linear = torch.nn.functional.linear  # computes from the live weight

    keep_layout.__patchctx_keeps_layout__ = True  # type: ignore[attr-defined]
    return keep_layout


def layout_kept() -> bool:
    """Whether engines loaded now in this process keep checkpoint layout."""
    return _State.forever or _State.depth > 0


def _install() -> None:
    """Put the replacement in place, once per process.

    It defers to vLLM's own function for layers never loaded under the switch.
    """
    utils = _utils()
    with _lock:
        if _State.installed:
            return
        utils.dispatch_cpu_unquantized_gemm = _keeping(utils.dispatch_cpu_unquantized_gemm)
        _State.installed = True


@contextmanager
def keep_checkpoint_layout() -> Iterator[None]:
    """Keep dense weights of engines loaded in this block in checkpoint layout (CPU backend).

    After loading, vLLM's CPU backend prepacks every unquantized linear weight for its GEMM
    kernel and replaces the parameter by an empty tensor, and keeps a prepacked copy of the
    LM head (a tied input embedding included). Checkpoint-layout patches cannot reach such
    weights: the worker extension refuses them. Inside this block, engines load with those
    weights kept as loaded, and their layers compute with ``torch.nn.functional.linear`` on
    the live parameters, so every linear, embedding and LM-head weight takes patches. It
    replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (the one
    function vLLM 0.32 calls for both) once per process; engines started in the block keep
    the layout for their whole life, also when vLLM reloads their weights
    (``reload_weights``) after the block has ended. Engines started outside any block get
    vLLM's own handling. MoE experts stay repacked (the CPU MoE kernel reads only its own
    layout) and stay refused. GPU backends never call the replaced function.

    It acts in this process, so it covers in-process engines
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). For an engine whose worker runs in another
    process, set the environment variable ``PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1`` where
    the engine is started (``vllm serve`` included): every vLLM process imports
    ``patchctx.vllm`` before it loads the model (vLLM loads patchctx's plugin, which
    registers the ``patchctx`` weight-transfer backend, and resolves ``worker_extension_cls``),
    and that import installs the switch for the rest of the process's life.

    Meant for tests and CPU development runs: the CPU GEMM without prepacking is slower.

    Yields:
        Nothing; engines started after the block exits get vLLM's own handling.

    Examples:
        >>> from patchctx.vllm import keep_checkpoint_layout
        >>> from patchctx.vllm._layout import layout_kept
        >>> with keep_checkpoint_layout():
        ...     print(layout_kept())  # an LLM(...) started here keeps checkpoint layout
        True
        >>> layout_kept()
        False
    """
    _install()
    with _lock:
        _State.depth += 1
    try:
        yield
    finally:
        with _lock:
            _State.depth -= 1


def install_from_environment() -> None:
    """Install the switch for the process's lifetime when ``KEEP_LAYOUT_ENV=1`` is set."""
    if os.environ.get(KEEP_LAYOUT_ENV) == "1" and not _State.forever:
        _install()
        _State.forever = True
