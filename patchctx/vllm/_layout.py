"""How vLLM's CPU backend lays out dense weights after loading, in engines that take patches.

vLLM's CPU backend prepacks every unquantized linear weight for its GEMM after loading
(``dispatch_cpu_unquantized_gemm``) and drops the checkpoint-layout weight. patchctx replaces
that one function, once per process, with a version that decides per layer:

- **repacked** (the default for engines that take patches: the ``patchctx`` weight-transfer
  backend or a `PatchWorkerExtension` worker extension): vLLM's own dispatch runs, but the
  weight is kept in checkpoint layout next to the prepacked copy. A patch writes the kept
  weight, and `repack_touched` runs vLLM's dispatch again on the layers the patch wrote
  (their own post-load step), so the engine computes with vLLM's own kernels at vLLM's own
  speed. The price: each dense linear weight is held twice (its checkpoint layout and the
  kernel's), and each patched layer is repacked (about the time of a copy of its weight).
  ``PATCHCTX_VLLM_REPACK=0`` turns it off: such weights are then refused, as before.
- **kept in checkpoint layout** (`keep_checkpoint_layout`, ``PATCHCTX_VLLM_KEEP_CHECKPOINT_
  LAYOUT=1``): no prepacking at all, ``torch.nn.functional.linear`` on the live weight (the
  slower GEMM; one copy of each weight).
- otherwise vLLM's own handling.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from patchctx.vllm._walk import attribute

__all__ = [
    "KEEP_LAYOUT_ENV",
    "REPACK_ENV",
    "keep_checkpoint_layout",
    "layout_kept",
    "repack_touched",
]

KEEP_LAYOUT_ENV = "PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT"
REPACK_ENV = "PATCHCTX_VLLM_REPACK"

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
# Set on a layer whose weight is kept next to vLLM's prepacked copy: vLLM's dispatch, to run
# again after a patch writes the weight.
REPACK_MARK = "_patchctx_repack"
# Set (to True) on `PatchWorkerExtension`: a worker extension class that takes patches.
EXTENSION_MARK = "_patchctx_takes_patches"


class _State:
    """Process-wide: how many `keep_checkpoint_layout` blocks are open, and the env switch."""

    depth = 0
    forever = False
    installed = False


def _takes_patches() -> bool:
    """Whether the engine being loaded now takes patches (the backend or the extension)."""
    if os.environ.get(REPACK_ENV, "1") == "0":
        return False
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - depends on the vLLM version
        return False
    config = get_current_vllm_config_or_none()
    if config is None:
        return False
    transfer = getattr(config, "weight_transfer_config", None)
    if getattr(transfer, "backend", None) == "patchctx":
        return True
    extension = getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "")
    if not isinstance(extension, str) or "." not in extension:
        return False
    module_name, _, class_name = extension.rpartition(".")
    try:
        cls = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    except (ImportError, AttributeError):
        return False
    # PatchWorkerExtension (and so each subclass) carries the mark: this floor sits under the
    # extension, which it need not import to know it.
    return isinstance(cls, type) and getattr(cls, EXTENSION_MARK, False) is True


def _keeps(layer: Any) -> bool:
    return _State.forever or _State.depth > 0 or bool(getattr(layer, _MARK, False))


def _keeping(original: Callable[..., None]) -> Callable[..., None]:
    def keep_layout(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        dense = isinstance(weight, torch.Tensor) and not weight.is_meta and weight.ndim == 2
        if dense and not _keeps(layer) and (repackable(layer) or _takes_patches()):
            # vLLM's own kernel, the weight kept for patches (see the module); vLLM calls
            # this again when it reloads weights: the layer stays repackable.
            original(layer, False)
            setattr(layer, REPACK_MARK, original)
            return
        if not _keeps(layer) or not dense:
            original(layer, remove_weight)  # not kept, or not a dense matrix: vLLM's own
            return
        # The layer keeps its layout for its whole life: vLLM calls this again when it
        # reloads weights (`reload_weights`, layerwise reload), after the block has ended.
        setattr(layer, _MARK, True)
        layer.cpu_linear = torch.nn.functional.linear  # computes from the live weight

    keep_layout.__patchctx_keeps_layout__ = True  # type: ignore[attr-defined]
    return keep_layout


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def repackable(module: torch.nn.Module) -> bool:
    """Whether `module` keeps its weight next to vLLM's prepacked copy (see the module)."""
    return callable(attribute(module, REPACK_MARK))


def repack_touched(model: torch.nn.Module, written: Iterable[str]) -> list[str]:
    """Run vLLM's post-load GEMM dispatch again on the repackable layers a patch wrote.

    Args:
        model: The vLLM model.
        written: Names of the parameters written (what ``load_weights`` reported). A layer
            is repacked when its weight is one of them or shares its storage (a tied LM
            head computes from its own prepacked copy of the embedding).

    Returns:
        The qualified names of the layers repacked, in model order.

    Examples:
        >>> import torch
        >>> from patchctx.vllm._layout import repack_touched
        >>> repack_touched(torch.nn.Linear(2, 2), ["weight"])  # nothing vLLM prepacked
        []
    """
    layers = [  # first, and cheap: an engine that keeps checkpoint layout has none
        (prefix, module, dispatch)
        for prefix, module in model.named_modules(remove_duplicate=False)
        if callable(dispatch := attribute(module, REPACK_MARK))
    ]
    repacked: list[str] = []
    if not layers:
        return repacked
    params = dict(model.named_parameters(remove_duplicate=False))
    storages = {_storage(params[name]) for name in written if name in params} - {None}
    for prefix, module, dispatch in layers:
        weight = attribute(module, "weight")
        if isinstance(weight, torch.Tensor) and storages and _storage(weight) in storages:
            dispatch(module, False)
            repacked.append(prefix)
    return repacked


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
    """Install the replacement (repacking engines that take patches, see the module).

    With ``KEEP_LAYOUT_ENV=1``, every engine of the process keeps checkpoint layout instead.
    Without a vLLM that has the replaced function, nothing is installed.
    """
    try:
        _install()
    except ImportError:  # pragma: no cover - depends on the vLLM version
        return
    if os.environ.get(KEEP_LAYOUT_ENV) == "1":
        _State.forever = True
