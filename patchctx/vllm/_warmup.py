"""Routes learnt at engine start: the checkpoint's names, shapes and dtypes, read from its files.

A vLLM worker knows the checkpoint it loaded (``model_config.model``: a directory, or a Hugging
Face repository in the local cache). The header of a safetensors file lists every tensor's
name, shape and dtype without reading any data, so the worker can warm its `RouteCache` for
every checkpoint name before the first update arrives (`RouteCache.warm`: a dry run of the
model's loaders, nothing written). The first sparse update then already replays in O(nnz).

A checkpoint without safetensors files (``.bin``, GGUF, a repository not in the local cache)
gives no names: routes are then learnt by the first update, as before. So does a trainer that
sends another dtype than the file holds: a patch of another dtype drops the route and
records its own. The warm-up also pays the process's one-time cost of a first patch load
(`patchctx.prepare`), with or without names. ``PATCHCTX_VLLM_WARM=0`` in the engine's
environment turns the warm-up off, and leaves that cost to the first update.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from patchctx import WarmReport, prepare

__all__ = ["checkpoint_specs", "warm_at_start"]

logger = logging.getLogger("patchctx.vllm")

# safetensors' dtype names.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_HEADER_LIMIT = 100 * 1024 * 1024  # what safetensors itself accepts


def _directory(model_config: Any, load_config: Any) -> Path | None:
    """The local directory of the checkpoint, or `None` (not on this host)."""
    model = getattr(model_config, "model", None)
    if not isinstance(model, str):
        return None
    if Path(model).is_dir():
        return Path(model)
    try:
        hub: Any = importlib.import_module("huggingface_hub")  # a dependency of vLLM
        found = hub.snapshot_download(
            model,
            revision=getattr(model_config, "revision", None),
            cache_dir=getattr(load_config, "download_dir", None),
            allow_patterns=["*.safetensors", "*.safetensors.index.json"],
            local_files_only=True,
        )
    except Exception:  # not cached here, no huggingface_hub, not a repository name
        return None
    return Path(found)


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        if not 0 < size <= _HEADER_LIMIT:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
        header: dict[str, Any] = json.loads(file.read(size))
    return header


def checkpoint_specs(vllm_config: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor of the checkpoint the engine loaded.

    Read from the safetensors headers (no tensor data is read); the index file, when there is
    one, says which files make up the checkpoint. Empty when the checkpoint has no local
    safetensors files.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from types import SimpleNamespace
        >>> from safetensors.torch import save_file
        >>> from patchctx.vllm._warmup import checkpoint_specs
        >>> directory = tempfile.mkdtemp()
        >>> save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16)},
        ...           str(Path(directory) / "model.safetensors"))
        >>> checkpoint_specs(SimpleNamespace(model_config=SimpleNamespace(model=directory)))
        [('w', (2, 3), torch.bfloat16)]
    """
    directory = _directory(
        getattr(vllm_config, "model_config", None), getattr(vllm_config, "load_config", None)
    )
    if directory is None:
        return []
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    specs: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for path in files:
        for name, entry in _header(path).items():
            dtype = (
                SAFETENSORS_DTYPES.get(entry.get("dtype", "")) if name != "__metadata__" else None
            )
            if dtype is not None:
                specs.setdefault(name, (name, tuple(int(d) for d in entry["shape"]), dtype))
    return list(specs.values())


def warm_at_start(
    patcher: Any, model: torch.nn.Module, vllm_config: Any, rank: int
) -> WarmReport | None:
    """Warm `patcher`'s routes for the engine's checkpoint; log what was learnt.

    Never raises: a warm-up that fails leaves the routes to the first update, as without it.
    """
    if os.environ.get("PATCHCTX_VLLM_WARM", "1") == "0":
        return None
    started = time.perf_counter()
    try:
        # The process's one-time cost of a first patch load, here rather than in an update.
        device = next((p.device for p in model.parameters() if not p.is_meta), None)
        prepare(device if device is not None else "cpu")
        specs = checkpoint_specs(vllm_config)
        if not specs:
            logger.info(
                "patchctx: rank %d found no safetensors checkpoint to warm routes from; the "
                "first update learns them",
                rank,
            )
            return None
        report: WarmReport = patcher.warm(model, specs)
    except Exception as error:  # the engine must start regardless
        logger.warning(
            "patchctx: rank %d could not warm routes (%s: %s); the first update learns them",
            rank,
            type(error).__name__,
            error,
        )
        return None
    counts = report.counts()
    logger.info(
        "patchctx: rank %d warmed routes of %d checkpoint tensors in %.1f ms: %d learned, %d "
        "unlearnable, %d deferred",
        rank,
        len(report.rows),
        (time.perf_counter() - started) * 1000.0,
        counts["learned"],
        counts["unlearnable"],
        counts["deferred"],
    )
    for row in report.rows:
        if row.status != "learned":
            logger.debug("patchctx: rank %d %s %s: %s", rank, row.status, row.name, row.reason)
    return report
