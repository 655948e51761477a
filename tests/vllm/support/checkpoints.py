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

from tests.vllm.support.dist import Rank, Results
from tests.vllm.support.patches import (
    Patch,
    apply_to_checkpoint,
    dense,
    load_patches,
    masked_load,
    sparse,
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


def model_rounds(checkpoint: Mapping[str, torch.Tensor], seed: int) -> list[list[Patch]]:
    """Three rounds of mixed patches over a checkpoint, as an RL trainer would send them.

    Round 1 touches every tensor (sparse matrices, dense vectors); round 2 a third of them,
    one name twice; round 3 every matrix very sparsely after a dense replacement of one.
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
    return [round1, round2, round3]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def model_job(rank: Rank, args: Mapping[str, Any]) -> Results:
    """Each architecture at this rank: parameters after the patch rounds, three ways.

    ``truth``: a fresh model loaded from the patched checkpoint; ``applied``: the checkpoint,
    then each round through `load_patches`; ``masked``: the same through `masked_load`.
    Keys are ``"<arch>/<variant>/<parameter name>"``.
    """
    results: Results = {}
    for arch, directory in args["model_dirs"].items():
        model_dir = Path(directory)
        checkpoint = read_checkpoint(model_dir)
        rounds = model_rounds(checkpoint, seed=args.get("seed", 0))
        patched = apply_to_checkpoint(checkpoint, [p for r in rounds for p in r])
        truth: Any = build_model(model_dir, rank.world_size)
        truth.load_weights(patched.items())
        results.update({f"{arch}/truth/{k}": v for k, v in model_state(truth).items()})
        for variant, apply in (("applied", load_patches), ("masked", masked_load)):
            model: Any = build_model(model_dir, rank.world_size)
            model.load_weights(checkpoint.items())
            for patches in rounds:
                apply(model, patches)
            results.update({f"{arch}/{variant}/{k}": v for k, v in model_state(model).items()})
    return results
