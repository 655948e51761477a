"""``vllm.LLM`` on tiny checkpoints with ``patchctx.vllm``'s worker extension: patches sent
through ``collective_rpc`` give the same greedy generations as ``transformers`` on the
identically patched checkpoint; weights the CPU backend transformed after loading are refused
(where vLLM's own function would write them silently); a version mismatch changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

pytest.importorskip("vllm")

from patchctx import LoaderContractError
from patchctx.vllm import (
    WeightVersionError,
    apply_patches,
    set_weight_version,
    transformed_weights,
)
from patchctx.vllm._layout import REPACK_ENV
from tests.vllm.support.checkpoints import read_checkpoint, write_checkpoint_tensors
from tests.vllm.support.engine import (
    assert_same_generations,
    differ,
    hf_greedy,
    running_engine,
    vllm_greedy,
)
from tests.vllm.support.patches import Patch, apply_to_checkpoint, dense, sparse, vllm_load

LINEAR_WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def patched_checkpoint(source: Path, patches: list[Patch], directory: Path) -> Path:
    """The checkpoint at `source` with `patches` applied, written to `directory`."""
    return write_checkpoint_tensors(
        source, apply_to_checkpoint(read_checkpoint(source), patches), directory
    )


def parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def expected_reason(name: str, tied: bool) -> str | None:
    """What the CPU backend does to a weight after loading (see FINDINGS.md), by name."""
    if name.endswith(LINEAR_WEIGHTS) or name.endswith("mlp.gate.weight"):
        return "prepacked by the CPU GEMM kernel after loading and replaced by an empty tensor"
    if name.endswith(("experts.w13_weight", "experts.w2_weight")):
        return "repacked by the CPU MoE kernel into its own layout"
    if name == "lm_head.weight":
        return "the CPU kernel (lm_head.cpu_linear) computes from its own copy"
    if tied and name == "model.embed_tokens.weight":
        return "tied to 'lm_head.weight', whose CPU kernel computes from its own copy"
    return None


@pytest.mark.parametrize(
    ("arch", "hazard"),
    [
        ("qwen2", "model.embed_tokens.weight"),  # tied: lookups change, logits do not
        ("qwen3_moe", "model.layers.0.mlp.experts.1.up_proj.weight"),  # lands in kernel layout
    ],
)
def test_default_cpu_engine_refuses_patches_into_transformed_weights(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    arch: str,
    hazard: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's own layout: patchctx's repacking turned off (PATCHCTX_VLLM_REPACK=0).
    monkeypatch.setenv(REPACK_ENV, "0")
    model_dir = checkpoints[arch]
    checkpoint = read_checkpoint(model_dir)
    patch = sparse(hazard, tuple(checkpoint[hazard].shape), density=0.3, seed=7)
    norm = dense("model.norm.weight", tuple(checkpoint["model.norm.weight"].shape), seed=8)
    with running_engine(model_dir) as llm:
        before = vllm_greedy(llm)
        assert_same_generations(before, hf_greedy(model_dir))

        found = llm.apply_model(transformed_weights)[0]
        for name in llm.apply_model(parameter_names)[0]:
            expected = expected_reason(name, tied=arch == "qwen2")
            if expected is None:
                assert name not in found, f"{name}: {found.get(name)}"
            else:
                assert found.get(name, "").startswith(expected), f"{name}: {found.get(name)}"

        # patchctx refuses, naming the patch and the weight, and writes nothing: the norm
        # patch sent first is undone (the update is atomic once anything is protected).
        set_weight_version(llm, "v0")
        with pytest.raises(LoaderContractError) as refused:
            apply_patches(llm, [norm, patch], base_version="v0", target_version="v1")
        message = str(refused.value)
        assert f"the patch to {hazard!r} would write model." in message
        assert "Checkpoint-layout patches cannot be applied" in message
        assert_same_generations(vllm_greedy(llm), before, atol=1e-6)
        # nothing changed, so the worker still holds v0: an update made against v0 applies
        [stats] = apply_patches(llm, [norm], base_version="v0", target_version="v1")
        assert stats.version == "v1" and stats.atomic and stats.protected == len(found)
        assert differ(vllm_greedy(llm), before)

        # What vLLM's own function does with the same patch: it loads it, and the engine then
        # follows neither the old nor the patched model.
        llm.apply_model(lambda m: vllm_load(m, [patch]))
        after = vllm_greedy(llm)
    truth = hf_greedy(patched_checkpoint(model_dir, [norm, patch], tmp_path / "patched"))
    assert differ(truth, hf_greedy(model_dir)), "the hazard patch should change the model"
    assert differ(after, truth), "the CPU engine now follows checkpoint-layout patches"


def update(model_dir: Path, seed: int) -> list[Patch]:
    """A mixed update of every checkpoint tensor that the CPU engine keeps in checkpoint layout
    once `keep_checkpoint_layout` is on (MoE experts stay repacked): sparse matrices, dense
    vectors."""
    checkpoint = read_checkpoint(model_dir)
    patches = []
    for i, (name, tensor) in enumerate(sorted(checkpoint.items())):
        shape = tuple(tensor.shape)
        if ".experts." in name:
            continue
        if len(shape) > 1:
            patches.append(sparse(name, shape, density=0.05, seed=seed + i))
        else:
            patches.append(dense(name, shape, seed=seed + i))
    return patches


@pytest.mark.parametrize(
    ("arch", "multiprocess"),
    [("qwen2", False), ("qwen3_moe", False), ("qwen2", True)],
    ids=["qwen2-in-process", "qwen3_moe-in-process", "qwen2-multiprocess"],
)
def test_patches_through_collective_rpc_match_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, multiprocess: bool
) -> None:
    model_dir = checkpoints[arch]
    first, second = update(model_dir, seed=11), update(model_dir, seed=500)
    second = [p for p in second if p.indices is not None]  # sparse only: replayed
    stale = update(model_dir, seed=900)
    # Multi-process: the extension users name, the layout switch through the environment.
    extension = "patchctx.vllm.PatchWorkerExtension" if multiprocess else None
    options = {"worker_extension_cls": extension} if extension else {}
    with running_engine(model_dir, multiprocess=multiprocess, keep_layout=True, **options) as llm:
        if not multiprocess:
            assert llm.collective_rpc("patchctx_test_layout_kept") == [True]
        before = vllm_greedy(llm)
        set_weight_version(llm, 0)
        [one] = apply_patches(llm, first, base_version=0, target_version=1)
        after_one = vllm_greedy(llm)
        [two] = apply_patches(llm, second, base_version=1, target_version=2)
        after_two = vllm_greedy(llm)
        # A payload made against version 1 (e.g. by a trainer resumed from an older
        # checkpoint) is refused on a worker at version 2, before any write.
        with pytest.raises(WeightVersionError, match="made against weight version 1"):
            apply_patches(llm, stale, base_version=1, target_version=3)
        after_refusal = vllm_greedy(llm)
        versions = llm.collective_rpc("patchctx_weight_version")
        expert = None
        if arch == "qwen3_moe":  # experts stay repacked: refused, nothing written
            name = "model.layers.1.mlp.experts.2.down_proj.weight"
            expert = sparse(
                name, tuple(read_checkpoint(model_dir)[name].shape), density=0.1, seed=3
            )
            with pytest.raises(LoaderContractError, match="repacked by the CPU MoE kernel"):
                apply_patches(llm, [*stale[:3], expert], base_version=2, target_version=3)
            assert_same_generations(vllm_greedy(llm), after_two, atol=1e-6)
    assert versions == [2]
    assert (one.version, two.version) == (1, 2)
    # Layout kept: nothing protected on the dense model, only the experts on the MoE model.
    assert one.protected == (4 if arch == "qwen3_moe" else 0)
    assert one.names == tuple(sorted(p.name for p in first)) and one.loader_calls > 0
    assert two.replayed == len(second) and two.loader_calls == 0, two
    for stats in (one, two):
        print(
            f"{arch} {'multi-process' if multiprocess else 'in-process'}: "
            f"{len(stats.names)} names, {stats.replayed} replayed, {stats.through_loader} "
            f"through {stats.loader_calls} loader calls, {stats.milliseconds:.1f} ms"
        )

    assert_same_generations(before, hf_greedy(model_dir))
    truth_one = hf_greedy(patched_checkpoint(model_dir, first, tmp_path / "one"))
    truth_two = hf_greedy(patched_checkpoint(model_dir, first + second, tmp_path / "two"))
    assert differ(before, truth_one) and differ(truth_one, truth_two)
    assert_same_generations(after_one, truth_one)
    assert_same_generations(after_two, truth_two)
    # nothing was written; multi-process engines differ from run to run by ~2e-6
    assert_same_generations(after_refusal, after_two, atol=1e-5)


def test_the_backend_in_an_llm_in_this_process(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """``LLM(..., weight_transfer_config={"backend": "patchctx"})`` with the trainer engine
    through `LLMWeightSyncClient`: updates match ``transformers``, a refusal names its class."""
    from patchctx.vllm import LLMWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo

    model_dir = checkpoints["qwen2"]
    patches = update(model_dir, seed=77)
    config: dict[str, Any] = {"weight_transfer_config": {"backend": "patchctx"}}
    with running_engine(model_dir, keep_layout=True, **config) as llm:
        client = LLMWeightSyncClient(llm)
        trainer = PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(rank=0, transport="inline"), client=client
        )
        stats = trainer.send_weights(patches)
        assert stats is not None and client.get_weight_version() == "1"
        after = vllm_greedy(llm)
        trainer.version = "0"
        with pytest.raises(WeightVersionError, match=r"\[patchctx rank 0: WeightVersionError\]"):
            trainer.send_weights(patches)
        assert_same_generations(vllm_greedy(llm), after, atol=1e-6)
    assert_same_generations(after, hf_greedy(patched_checkpoint(model_dir, patches, tmp_path)))


def test_the_layout_switch_outlives_start_up_and_vllms_reload(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """An in-process engine started inside ``keep_checkpoint_layout()``: after the block, vLLM's
    own ``reload_weights`` re-runs the post-processing, and the weights stay patchable."""
    model_dir = checkpoints["llama"]
    patches = update(model_dir, seed=88)
    with running_engine(model_dir, keep_layout=True) as llm:  # the block ends at start-up
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        assert llm.collective_rpc("patchctx_test_layout_kept") == [True]
        assert llm.apply_model(transformed_weights) == [{}]
        set_weight_version(llm, 0)
        apply_patches(llm, patches, base_version=0, target_version=1)
        after = vllm_greedy(llm)
    assert_same_generations(after, hf_greedy(patched_checkpoint(model_dir, patches, tmp_path)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_prepacked_layers_are_repacked_after_the_patches_that_write_them(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """An engine with vLLM's CPU prepacking (no layout switch): patches write the weights kept
    next to the prepacked copies, the layers they wrote are repacked, and greedy generations
    follow ``transformers`` on the patched checkpoint; MoE experts stay refused."""
    model_dir = checkpoints[arch]
    first, second = update(model_dir, seed=21), update(model_dir, seed=600)
    second = [p for p in second if p.indices is not None]  # sparse only: replayed
    checkpoint = read_checkpoint(model_dir)
    with running_engine(model_dir) as llm:
        assert llm.collective_rpc("patchctx_test_layout_kept") == [False]
        found = llm.apply_model(transformed_weights)[0]
        # Only the MoE experts are left transformed; every dense weight takes patches.
        assert all(name.endswith(("_experts.w13_weight", "_experts.w2_weight")) for name in found)
        before = vllm_greedy(llm)
        set_weight_version(llm, 0)
        [one] = apply_patches(llm, first, base_version=0, target_version=1)
        after_one = vllm_greedy(llm)
        [two] = apply_patches(llm, second, base_version=1, target_version=2)
        after_two = vllm_greedy(llm)
        if arch == "qwen3_moe":
            name = "model.layers.1.mlp.experts.2.down_proj.weight"
            expert = sparse(name, tuple(checkpoint[name].shape), density=0.1, seed=3)
            with pytest.raises(LoaderContractError, match="repacked by the CPU MoE kernel"):
                apply_patches(llm, [second[0], expert], base_version=2, target_version=3)
            assert_same_generations(vllm_greedy(llm), after_two, atol=1e-6)
    # Every linear layer and the LM head (tied to the patched embedding) repacked once each.
    linear = sum(1 for p in first if p.name.endswith(".weight") and p.indices is not None)
    assert one.repacked > 0 and two.repacked > 0 and one.repacked <= linear + 1
    assert two.replayed == len(second) and two.loader_calls == 0, two
    assert_same_generations(before, hf_greedy(model_dir))
    truth_one = hf_greedy(patched_checkpoint(model_dir, first, tmp_path / "one"))
    truth_two = hf_greedy(patched_checkpoint(model_dir, first + second, tmp_path / "two"))
    assert differ(before, truth_one) and differ(truth_one, truth_two)
    assert_same_generations(after_one, truth_one)
    assert_same_generations(after_two, truth_two)
