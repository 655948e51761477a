"""vLLM's parallel layers, each behind a ``load_weights`` that calls the layers' own loaders.

A `LayerCase` builds one real vLLM layer (under the current vLLM config and process groups)
and names the checkpoint tensors it loads: the Hugging Face-style name, the full checkpoint
shape, which parameter receives it and the extra arguments its ``weight_loader`` takes (a shard
id, or the expert's name / shard / id). `LayerHarness` wraps the layer in a module whose
``load_weights`` routes each checkpoint tensor to ``param.weight_loader`` exactly as vLLM's
models do, so vLLM's ``load_checkpoint_weight_patches`` and patchctx can drive it like a model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchctx import RouteCache
from tests.vllm.support.dist import Rank, Results
from tests.vllm.support.patches import (
    Patch,
    apply_to_checkpoint,
    dense,
    masked_load,
    patchctx_layer_load,
    random_checkpoint,
    sparse,
    vllm_load,
)

HIDDEN = 64
HEAD_SIZE = 32
HEADS = 4
KV_HEADS = 1  # fewer KV heads than TP=2 ranks: each rank holds a replica of the KV head
INTER = 128
VOCAB = 100  # padded to 128 by vLLM (padding_size=64): rank 1 at TP=2 holds padding rows
EXPERTS = 4
EXPERT_INTER = 64


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor of a layer and how the layer's loader receives it."""

    name: str
    shape: tuple[int, ...]
    param: str  # the parameter's name inside the layer, e.g. "routed_experts.w13_weight"
    loader_args: tuple[object, ...] = ()


class LayerHarness(nn.Module):
    """A one-layer model: ``load_weights`` calls each parameter's own ``weight_loader``."""

    def __init__(self, layer: nn.Module, tensors: Iterable[CheckpointTensor]) -> None:
        super().__init__()
        self.layer = layer
        self.tensors = {t.name: t for t in tensors}
        self.load_calls = 0

    def parameter(self, name: str) -> nn.Parameter:
        param = self.layer.get_parameter(name)
        return param

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.load_calls += 1
        loaded: set[str] = set()
        for name, tensor in weights:
            spec = self.tensors[name]
            param: Any = self.parameter(spec.param)
            param.weight_loader(param, tensor, *spec.loader_args)
            loaded.add(f"layer.{spec.param}")
        return loaded

    def state(self) -> dict[str, torch.Tensor]:
        """Every parameter, cloned."""
        return {name: p.detach().clone() for name, p in self.layer.named_parameters()}


@dataclass(frozen=True)
class LayerCase:
    """A vLLM layer and the checkpoint tensors it loads."""

    name: str
    build: Callable[[torch.dtype], nn.Module]
    tensors: tuple[CheckpointTensor, ...]

    def harness(self, dtype: torch.dtype) -> LayerHarness:
        return LayerHarness(self.build(dtype), self.tensors)


def _qkv(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer: nn.Module = QKVParallelLinear(
        HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, bias=True, params_dtype=dtype, prefix="qkv_proj"
    )
    return layer


def _gate_up(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer: nn.Module = MergedColumnParallelLinear(
        HIDDEN, [INTER, INTER], bias=False, params_dtype=dtype, prefix="gate_up_proj"
    )
    return layer


def _row(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.linear import RowParallelLinear

    layer: nn.Module = RowParallelLinear(
        INTER, HIDDEN, bias=True, params_dtype=dtype, prefix="down_proj"
    )
    return layer


def _column(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    layer: nn.Module = ColumnParallelLinear(
        HIDDEN, INTER, bias=True, params_dtype=dtype, prefix="up_proj"
    )
    return layer


def _embedding(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    layer: nn.Module = VocabParallelEmbedding(
        VOCAB, HIDDEN, params_dtype=dtype, prefix="embed_tokens"
    )
    return layer


def _lm_head(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    layer: nn.Module = ParallelLMHead(
        VOCAB, HIDDEN, bias=True, params_dtype=dtype, prefix="lm_head"
    )
    return layer


_moe_names = itertools.count()


def _experts(dtype: torch.dtype) -> nn.Module:
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    layer: nn.Module = FusedMoEFactory(
        num_experts=EXPERTS,
        top_k=2,
        hidden_size=HIDDEN,
        intermediate_size=EXPERT_INTER,
        params_dtype=dtype,
        # MoE layers register their prefix in the current vLLM config: one name per layer.
        prefix=f"experts{next(_moe_names)}",
    )
    return layer


_Q, _KV = HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE


def _expert_tensors() -> tuple[CheckpointTensor, ...]:
    tensors = []
    for e in range(EXPERTS):
        for proj, param, shard, shape in (
            ("gate_proj", "w13_weight", "w1", (EXPERT_INTER, HIDDEN)),
            ("up_proj", "w13_weight", "w3", (EXPERT_INTER, HIDDEN)),
            ("down_proj", "w2_weight", "w2", (HIDDEN, EXPERT_INTER)),
        ):
            tensors.append(
                CheckpointTensor(
                    f"experts.{e}.{proj}.weight",
                    shape,
                    f"routed_experts.{param}",
                    (f"experts.{param}", shard, e),
                )
            )
    return tuple(tensors)


CASES: dict[str, LayerCase] = {
    case.name: case
    for case in (
        LayerCase(
            "qkv",
            _qkv,
            (
                CheckpointTensor("q_proj.weight", (_Q, HIDDEN), "weight", ("q",)),
                CheckpointTensor("k_proj.weight", (_KV, HIDDEN), "weight", ("k",)),
                CheckpointTensor("v_proj.weight", (_KV, HIDDEN), "weight", ("v",)),
                CheckpointTensor("q_proj.bias", (_Q,), "bias", ("q",)),
                CheckpointTensor("k_proj.bias", (_KV,), "bias", ("k",)),
                CheckpointTensor("v_proj.bias", (_KV,), "bias", ("v",)),
            ),
        ),
        LayerCase(
            "qkv_fused",
            _qkv,
            (
                CheckpointTensor("qkv_proj.weight", (_Q + 2 * _KV, HIDDEN), "weight"),
                CheckpointTensor("qkv_proj.bias", (_Q + 2 * _KV,), "bias"),
            ),
        ),
        LayerCase(
            "gate_up",
            _gate_up,
            (
                CheckpointTensor("gate_proj.weight", (INTER, HIDDEN), "weight", (0,)),
                CheckpointTensor("up_proj.weight", (INTER, HIDDEN), "weight", (1,)),
            ),
        ),
        LayerCase(
            "gate_up_fused",
            _gate_up,
            (CheckpointTensor("gate_up_proj.weight", (2 * INTER, HIDDEN), "weight"),),
        ),
        LayerCase(
            "row",
            _row,
            (
                CheckpointTensor("down_proj.weight", (HIDDEN, INTER), "weight"),
                CheckpointTensor("down_proj.bias", (HIDDEN,), "bias"),
            ),
        ),
        LayerCase(
            "column",
            _column,
            (
                CheckpointTensor("up_proj.weight", (INTER, HIDDEN), "weight"),
                CheckpointTensor("up_proj.bias", (INTER,), "bias"),
            ),
        ),
        LayerCase(
            "embedding",
            _embedding,
            (CheckpointTensor("embed_tokens.weight", (VOCAB, HIDDEN), "weight"),),
        ),
        LayerCase(
            "lm_head",
            _lm_head,
            (
                CheckpointTensor("lm_head.weight", (VOCAB, HIDDEN), "weight"),
                CheckpointTensor("lm_head.bias", (VOCAB,), "bias"),
            ),
        ),
        LayerCase("experts", _experts, _expert_tensors()),
    )
}


def layer_rounds(case: LayerCase, seed: int) -> list[list[Patch]]:
    """Two rounds of patches for `case`: sparse everywhere, then overlapping sparse + dense."""
    first, last = case.tensors[0], case.tensors[-1]
    round1 = [
        sparse(t.name, t.shape, density=0.05, seed=seed + i) for i, t in enumerate(case.tensors)
    ]
    round2 = [
        sparse(first.name, first.shape, density=0.3, seed=seed + 100),
        dense(last.name, last.shape, seed=seed + 200),
        sparse(last.name, last.shape, density=0.02, seed=seed + 300),
    ]
    return [round1, round2]


VARIANTS = ("base", "truth", "patchctx", "vllm", "masked")


def layer_job(rank: Rank, args: Mapping[str, Any]) -> Results:
    """Per case and dtype: the layer's parameters after each way of loading the same patches.

    ``base``: the checkpoint; ``truth``: the patched checkpoint, loaded densely through the
    layer's own loaders; ``patchctx``: the checkpoint, then each round through patchctx's
    ``load_checkpoint_weight_patches`` with one `RouteCache` (later rounds replay routes);
    ``vllm``: the same through vLLM's ``load_checkpoint_weight_patches``; ``masked``: the same
    through `masked_load`. Keys are ``"<case>/<dtype>/<variant>/<parameter>"``, plus
    ``"<case>/<dtype>/routes"``: (routes recorded, patches replayed, loader calls).
    """
    results: Results = {}
    for dtype_name in args["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for n, case in enumerate(CASES.values()):
            if args.get("cases") and case.name not in args["cases"]:
                continue
            checkpoint = random_checkpoint({t.name: t.shape for t in case.tensors}, seed=n)
            rounds = layer_rounds(case, seed=1000 * n)
            patched = apply_to_checkpoint(checkpoint, [p for r in rounds for p in r])
            layers = {variant: case.harness(dtype) for variant in VARIANTS}
            layers["truth"].load_weights(patched.items())
            for variant in ("base", "patchctx", "vllm", "masked"):
                layers[variant].load_weights(checkpoint.items())
            routes = RouteCache()
            for patches in rounds:
                patchctx_layer_load(layers["patchctx"], patches, routes)
                vllm_load(layers["vllm"], patches)
                masked_load(layers["masked"], patches)
            for variant, layer in layers.items():
                for param, value in layer.state().items():
                    results[f"{case.name}/{dtype_name}/{variant}/{param}"] = value
            stats = routes.stats
            results[f"{case.name}/{dtype_name}/routes"] = torch.tensor(
                [stats.recorded, stats.replayed, stats.loader_calls]
            )
    return results
