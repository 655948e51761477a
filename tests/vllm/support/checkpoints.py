"""Tiny Hugging Face checkpoints written by ``transformers``, and vLLM models built from them.

Nothing is downloaded: each checkpoint is a randomly initialised ``transformers`` model of a
real architecture (Qwen2 with tied embeddings, Llama, Qwen3-MoE, Mixtral), saved with
``save_pretrained``. Sizes keep every test fast while exercising what matters: head_dim 32 (the
CPU attention backend needs >= 32), one KV head (replicated across TP=2 ranks), a vocabulary
that vLLM pads (200 -> 256, so TP=2 rank 1 holds padding rows), 4 experts in MoE layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchctx.vllm import audit_model
from tests.vllm.support.dist import Rank, Results
from tests.vllm.support.patches import (
    ModelWorker,
    Patch,
    apply_to_checkpoint,
    dense,
    masked_load,
    patchctx_load,
    sparse,
    vllm_load,
)

HIDDEN = 64
HEADS = 2  # head_dim = 64 / 2 = 32
KV_HEADS = 1
VOCAB = 200
LAYERS = 2

ARCHITECTURES = ("qwen2", "llama", "qwen3_moe", "mixtral")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


def hf_config(arch: str) -> Any:
    """The ``transformers`` config of a tiny checkpoint of `arch`."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
    }
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=HIDDEN // HEADS,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")


def write_checkpoint(arch: str, directory: Path, *, seed: int = 0) -> Path:
    """Write a tiny random float32 checkpoint of `arch` into `directory` (returned)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    # Random init leaves some tensors at exact constants (norms at 1): perturb them so that
    # every tensor carries information a wrong mapping would destroy.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    return directory


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `directory`, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def write_checkpoint_tensors(
    source: Path, tensors: Mapping[str, torch.Tensor], directory: Path
) -> Path:
    """Copy the checkpoint at `source` into `directory` with its tensors replaced."""
    import shutil

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, directory / path.name)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    return directory


def inspect_models_in_process() -> None:
    """Let vLLM's model registry inspect model classes in this process.

    On first use of an architecture, vLLM inspects the model class in a fresh Python process
    (to keep CUDA uninitialised) and caches the result under ``VLLM_CACHE_ROOT``: about 8 s
    per architecture on a clean machine. On CPU there is nothing to protect; run it inline.
    """
    from vllm.model_executor.models import registry

    def inline(fn: Any) -> Any:
        return fn()

    registry._run_in_subprocess = inline


def vllm_config(model_dir: Path, tp_size: int = 1) -> Any:
    """The ``VllmConfig`` the tests build models and engines with."""
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    inspect_models_in_process()
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
    )
    return VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
    )


def build_model(model_dir: Path, tp_size: int = 1) -> nn.Module:
    """vLLM's model for the checkpoint at `model_dir`, built at this rank, weights not loaded."""
    from vllm.model_executor.model_loader.utils import initialize_model

    model: nn.Module = initialize_model(vllm_config(model_dir, tp_size))
    return model


def load_model(model_dir: Path, tp_size: int = 1) -> nn.Module:
    """vLLM's model with the checkpoint loaded through its ``load_weights`` (no post-processing:
    parameters stay in the layout the loaders write, as on a GPU without repacking)."""
    model = build_model(model_dir, tp_size)
    model_any: Any = model
    model_any.load_weights(read_checkpoint(model_dir).items())
    return model


def load_engine_model(model_dir: Path, tp_size: int = 1) -> nn.Module:
    """vLLM's model as the default CPU engine holds it: loaded, then post-processed
    (``process_weights_after_loading``: linear weights prepacked, MoE experts repacked)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )

    config = vllm_config(model_dir, tp_size)
    with set_current_vllm_config(config):
        model: Any = initialize_model(config)
        model.load_weights(read_checkpoint(model_dir).items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    loaded: nn.Module = model
    return loaded


TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def checkpoint_aliases(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The tied-embedding alias of a checkpoint that stores no LM head (Qwen2 here)."""
    return {} if "lm_head.weight" in checkpoint else dict(TIED)


def model_rounds(checkpoint: Mapping[str, torch.Tensor], seed: int) -> list[list[Patch]]:
    """Three rounds of mixed patches over a checkpoint, as an RL trainer would send them.

    Round 1 touches every tensor (sparse matrices, dense vectors); round 2 a third of them,
    one name twice; round 3 every matrix very sparsely after a dense replacement of one. A
    tied checkpoint gets a round 4: a patch named ``lm_head.weight`` (its embedding; alone,
    since an alias patched with its canonical name in one call is dropped, as vLLM does).
    """
    names = sorted(checkpoint)
    shapes = {name: tuple(checkpoint[name].shape) for name in names}
    matrices = [n for n in names if len(shapes[n]) > 1]
    round1 = [
        sparse(n, shapes[n], density=0.02, seed=seed + i)
        if len(shapes[n]) > 1
        else dense(n, shapes[n], seed=seed + i)
        for i, n in enumerate(names)
    ]
    round2 = [
        sparse(n, shapes[n], density=0.1, seed=seed + 500 + i) for i, n in enumerate(names[::3])
    ]
    embed = next(n for n in names if "embed_tokens" in n)
    round2 += [sparse(embed, shapes[embed], density=0.05, seed=seed + 900)]
    round3 = [dense(matrices[0], shapes[matrices[0]], seed=seed + 1000)]
    round3 += [
        sparse(n, shapes[n], density=0.005, seed=seed + 1100 + i) for i, n in enumerate(matrices)
    ]
    round4 = [
        sparse(alias, shapes[embed], density=0.01, seed=seed + 1900)
        for alias in checkpoint_aliases(checkpoint)
    ]
    return [round1, round2, round3, *([round4] if round4 else [])]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def specs_of(checkpoint: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in sorted(checkpoint.items())]


def counts(report: Any) -> torch.Tensor:
    found = report.counts()
    return torch.tensor([found["replayable"], found["masked"], found["unsupported"]])


def unchanged(before: Mapping[str, torch.Tensor], model: nn.Module) -> bool:
    after = model_state(model)
    return before.keys() == after.keys() and all(
        torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before
    )


def engine_layout_checks(model_dir: Path, world_size: int) -> dict[str, torch.Tensor]:
    """On the model as the default CPU engine holds it: audit counts, and that patches to
    transformed weights are refused, naming the weight, with nothing written."""
    model = load_engine_model(model_dir, world_size)
    checkpoint = read_checkpoint(model_dir)
    report = audit_model(model, specs_of(checkpoint))
    refused = report.names("unsupported")
    worker = ModelWorker(model)
    before = model_state(model)
    vectors = [n for n in sorted(checkpoint) if checkpoint[n].ndim == 1]
    fine = [dense(vectors[0], tuple(checkpoint[vectors[0]].shape), seed=1)]
    flags = []
    for name in refused:
        bad = sparse(name, tuple(checkpoint[name].shape), density=0.05, seed=2)
        result = patchctx_load(worker, [*fine, bad], errors="return")
        error = result.get("error", {})
        flags.append(
            not result["ok"]
            and error.get("type") == "LoaderContractError"
            and f"the patch to {name!r} would write " in error.get("message", "")
            and "Checkpoint-layout patches cannot be applied" in error.get("message", "")
            and unchanged(before, model)
        )
    done = patchctx_load(worker, fine)  # what is not transformed still takes patches
    patched = not unchanged(before, model)
    return {
        "engine_counts": counts(report),
        "engine_refusals": torch.tensor(flags, dtype=torch.bool),
        "engine_patchable": torch.tensor([done["ok"] and patched, done["protected"] > 0]),
    }


def model_job(rank: Rank, args: Mapping[str, Any]) -> Results:
    """Each architecture at this rank: parameters after the patch rounds, several ways.

    ``truth``: a fresh model loaded from the patched checkpoint; ``patchctx``: the checkpoint,
    then each round through ``patchctx.vllm``'s worker extension (one `RouteCache`, tied
    aliases); ``vllm``: the same through vLLM's ``load_checkpoint_weight_patches``;
    ``masked``: the same through `masked_load`. Keys are
    ``"<arch>/<variant>/<parameter name>"``, plus per architecture ``"<arch>/routes"`` (routes
    held, names patched sparsely, patches replayed, loader calls), ``"<arch>/counts"`` (the
    audit in checkpoint layout: replayable, masked, unsupported) and the results of
    `engine_layout_checks`.
    """
    results: Results = {}
    for arch, directory in args["model_dirs"].items():
        model_dir = Path(directory)
        checkpoint = read_checkpoint(model_dir)
        aliases = checkpoint_aliases(checkpoint)
        rounds = model_rounds(checkpoint, seed=args.get("seed", 0))
        patched = apply_to_checkpoint(checkpoint, [p for r in rounds for p in r], aliases)
        truth: Any = build_model(model_dir, rank.world_size)
        truth.load_weights(patched.items())
        results.update({f"{arch}/truth/{k}": v for k, v in model_state(truth).items()})
        models: dict[str, Any] = {}
        for variant in ("patchctx", "vllm", "masked"):
            models[variant] = build_model(model_dir, rank.world_size)
            models[variant].load_weights(checkpoint.items())
        before = model_state(models["patchctx"])
        results[f"{arch}/counts"] = counts(audit_model(models["patchctx"], specs_of(checkpoint)))
        assert unchanged(before, models["patchctx"]), "audit changed a weight"
        worker = ModelWorker(models["patchctx"])
        for patches in rounds:
            renamed = [p._replace(name=aliases.get(p.name, p.name)) for p in patches]
            patchctx_load(worker, patches)
            vllm_load(models["vllm"], patches, aliases)
            masked_load(models["masked"], renamed)
        for variant, model in models.items():
            results.update({f"{arch}/{variant}/{k}": v for k, v in model_state(model).items()})
        routes = worker._patchctx_worker().routes
        sparse_names = {
            aliases.get(p.name, p.name) for r in rounds for p in r if p.indices is not None
        }
        patched_names = {aliases.get(p.name, p.name) for r in rounds for p in r}
        results[f"{arch}/routes"] = torch.tensor(
            [
                len(routes),
                len(sparse_names),
                len(sparse_names & set(routes)),
                len(patched_names),
                routes.stats.replayed,
                routes.stats.loader_calls,
            ]
        )
        if args.get("engine_layout", True):
            for key, value in engine_layout_checks(model_dir, rank.world_size).items():
                results[f"{arch}/{key}"] = value
    return results
