"""RouteCache.warm on vLLM's real layers and models, at TP=1 and TP=2, and at engine start.

Every checkpoint tensor of every layer case (packed Q/K/V, merged gate/up, row and column
parallel, padded vocabulary, fused-MoE experts) is learnt by a dry run, with no weight changed,
and its route equals the one a real sparse patch records; the first sparse update then replays
every patch without calling a loader and gives the dense truth. The backend warms at engine
start from the checkpoint's safetensors headers.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from safetensors.torch import save_file

from patchctx import CheckpointWeightPatch
from patchctx.vllm import PatchctxWeightTransferEngine, encode_patches
from patchctx.vllm._transport import digest
from patchctx.vllm._warmup import checkpoint_specs
from tests.vllm.support import layers
from tests.vllm.support.checkpoints import ARCHITECTURES
from tests.vllm.support.dist import Results, run_tp
from tests.vllm.support.warm import warm_layer_job, warm_model_job
from tests.vllm.test_models import ENGINE_LAYOUT

DTYPES = ("float32", "bfloat16")


@functools.cache
def layer_results(tp: int) -> list[Results]:
    return run_tp(warm_layer_job, tp, {"dtypes": DTYPES})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(layers.CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_warm_learns_every_route_of_vllm_layers(tp: int, case: str, dtype: str) -> None:
    for rank, results in enumerate(layer_results(tp)):
        names, learned, same, agree, replayed, calls, clean = results[
            f"{case}/{dtype}/warm"
        ].tolist()
        assert learned == names, f"rank {rank}: {learned} of {names} learnt"
        assert same and clean and agree, f"rank {rank}: unchanged={same} verify={clean}"
        assert replayed == names and calls == 0, (replayed, calls)
        assert bool(results[f"{case}/{dtype}/equal"]), f"rank {rank}: not the dense truth"


@pytest.fixture(scope="module")
def model_results(checkpoints: dict[str, Path]) -> dict[int, list[Results]]:
    dirs = {arch: str(path) for arch, path in checkpoints.items()}
    return {tp: run_tp(warm_model_job, tp, {"model_dirs": dirs}) for tp in (1, 2)}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_warm_learns_every_route_of_vllm_models_and_the_first_update_replays(
    model_results: dict[int, list[Results]], tp: int, arch: str
) -> None:
    for rank, results in enumerate(model_results[tp]):
        names, learned, same, agree, replayed, calls, consumed = results[f"{arch}/warm"].tolist()
        assert learned == names and same and agree, (rank, names, learned, same, agree)
        # Every patch of the first update replays: no loader call, no audit of a new name.
        assert calls == 0 and replayed > 0 and consumed > 0, (replayed, calls, consumed)
        assert bool(results[f"{arch}/equal"]), f"rank {rank}: not the dense truth"
        names, learned, unlearnable, same = results[f"{arch}/engine"].tolist()
        # On the CPU engine's layout, names that reach a transformed weight are not learnt.
        assert unlearnable == ENGINE_LAYOUT[arch][2], (rank, learned, unlearnable)
        assert learned + unlearnable == names and same


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)

    def load_weights(self, weights: object) -> set[str]:
        for _, tensor in weights:  # type: ignore[attr-defined]
            self.w.copy_(tensor.narrow(0, 2, 2))  # rank 1 of 2
        return {"w"}


def _engine(directory: Path) -> PatchctxWeightTransferEngine:
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(rank=0, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(directory)),
        load_config=None,
    )
    return PatchctxWeightTransferEngine(None, config, torch.device("cpu"), Model())


def test_the_backend_warms_at_engine_start_and_the_first_update_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_specs(SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)))) == [
        ("w", (4, 4), torch.float32)
    ]
    engine = _engine(tmp_path)
    assert engine.warm_report is not None and engine.warm_report.names("learned") == ["w"]
    patch = CheckpointWeightPatch(
        "w", (4, 4), torch.float32, torch.tensor([5.0]), torch.tensor([9])
    )
    payload = encode_patches([patch], base_version="default", target_version="1")
    engine.start_weight_update()
    engine.update_weights(
        {
            "nbytes": len(payload),
            "sha256": digest(payload),
            "update_id": "u1",
            "inline": base64.b64encode(payload).decode(),
        }
    )
    engine.finish_weight_update()
    assert engine.last_stats is not None
    assert engine.last_stats["replayed"] == 1 and engine.last_stats["loader_calls"] == 0
    assert engine.model.w[0].tolist() == [0.0, 5.0, 0.0, 0.0]
    # Without safetensors files, or switched off, nothing is warmed and the engine starts.
    assert _engine(tmp_path / "missing").warm_report is None
    monkeypatch.setenv("PATCHCTX_VLLM_WARM", "0")
    assert _engine(tmp_path).warm_report is None


def test_an_engine_with_the_backend_warms_at_start_and_its_first_update_replays(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A real in-process ``LLM`` with the ``patchctx`` backend: every sparse patch of the
    first update replays a route learnt at engine start, and generations match
    ``transformers`` on the identically patched checkpoint."""
    from patchctx.vllm import LLMWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
    from tests.vllm.support.engine import (
        assert_same_generations,
        hf_greedy,
        running_engine,
        vllm_greedy,
    )
    from tests.vllm.test_engine import patched_checkpoint, update

    model_dir = checkpoints["qwen2"]
    patches = update(model_dir, seed=5)
    config: dict[str, Any] = {"weight_transfer_config": {"backend": "patchctx"}}
    with running_engine(model_dir, keep_layout=True, **config) as llm:
        trainer = PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(rank=0, transport="inline"), client=LLMWeightSyncClient(llm)
        )
        trainer.send_weights(patches)
        (stats,) = llm.collective_rpc("patchctx_last_update")
        after = vllm_greedy(llm)
    sparse_patches = sum(p.indices is not None for p in patches)
    # Every name was learned at start: every patch replays, the dense ones along their routes
    # too, and none goes through the loader.
    assert sparse_patches > 0 and stats["replayed"] == len(patches), stats
    assert stats["through_loader"] == 0, stats
    assert_same_generations(after, hf_greedy(patched_checkpoint(model_dir, patches, tmp_path)))


def test_the_worker_extension_warms_on_demand(tmp_path: Path) -> None:
    from tests.vllm.support.patches import ModelWorker, patchctx_load

    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    worker = ModelWorker(Model())
    assert worker.patchctx_warm([["w", [4, 4], "float32"]]) == [["w", "learned", ""]]
    worker = ModelWorker(Model())
    worker.vllm_config = SimpleNamespace(  # type: ignore[attr-defined]  # vLLM's worker has it
        model_config=SimpleNamespace(model=str(tmp_path))
    )
    assert worker.patchctx_warm() == [["w", "learned", ""]]
    patch = CheckpointWeightPatch(
        "w", (4, 4), torch.float32, torch.tensor([5.0]), torch.tensor([9])
    )
    stats = patchctx_load(worker, [patch])
    assert stats["replayed"] == 1 and stats["loader_calls"] == 0
