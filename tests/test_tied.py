"""Tied parameters found on the model: a patch to either name, or both, loads as vLLM expects.

The model here behaves like vLLM's tied models since 0.32: its loader takes the embedding's
name and refuses the LM head's (a tied checkpoint has no LM head). No ``aliases=`` is passed.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    LoaderError,
    RouteCache,
    load_checkpoint_weight_patches,
)
from tests.support.models import same_bits

VOCAB, HIDDEN = 64, 8


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.requires_grad_(False)
        self.calls: list[list[str]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = []
        for name, tensor in weights:
            names.append(name)
            if name != "model.embed_tokens.weight":
                raise KeyError(f"unexpected checkpoint name {name!r}")
            self.model.embed_tokens.weight.copy_(tensor)
        self.calls.append(names)
        return set(names)


def patch(name: str, indices: list[int], value: float) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name,
        (VOCAB, HIDDEN),
        torch.float32,
        torch.full((len(indices),), value),
        torch.tensor(indices),
    )


def expected(model: TiedModel, indices: list[int], value: float) -> torch.Tensor:
    weight = model.model.embed_tokens.weight.detach().clone().view(-1)
    weight[indices] = value
    return weight.view(VOCAB, HIDDEN)


def test_an_alias_only_patch_loads_under_the_canonical_name() -> None:
    model = TiedModel()
    want = expected(model, [0, 1, 2], 3.0)
    loaded = load_checkpoint_weight_patches(model, [patch("lm_head.weight", [0, 1, 2], 3.0)])
    assert loaded == {"model.embed_tokens.weight"}
    assert same_bits(model.model.embed_tokens.weight, want)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_dense_alias_patch_and_replayed_routes() -> None:
    model, routes = TiedModel(), RouteCache()
    dense = CheckpointWeightPatch(
        "lm_head.weight", (VOCAB, HIDDEN), torch.float32, torch.arange(VOCAB * HIDDEN * 1.0)
    )
    load_checkpoint_weight_patches(model, [dense], routes=routes)
    assert same_bits(model.model.embed_tokens.weight.view(-1), dense.values)
    for value in (5.0, 6.0):  # the second one replays the route recorded by the first
        want = expected(model, [7, 300], value)
        load_checkpoint_weight_patches(
            model, [patch("lm_head.weight", [7, 300], value)], routes=routes
        )
        assert same_bits(model.model.embed_tokens.weight, want)
    assert routes.stats.replayed >= 1


@pytest.mark.parametrize("chunk", [None, 1024])
def test_both_names_with_the_same_update_load_once(chunk: int | None) -> None:
    model = TiedModel()
    want = expected(model, list(range(0, 512, 17)), 2.0)
    both = [
        patch(name, list(range(0, 512, 17)), 2.0)
        for name in ("lm_head.weight", "model.embed_tokens.weight")
    ]
    loaded = load_checkpoint_weight_patches(model, both, max_chunk_bytes=chunk)
    assert loaded == {"model.embed_tokens.weight"}
    assert same_bits(model.model.embed_tokens.weight, want)
    assert sum(len(call) for call in model.calls) == 1


def test_both_names_with_different_updates_are_refused_before_any_write() -> None:
    model = TiedModel()
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(InvalidPatchError, match=r"alias of 'model\.embed_tokens\.weight'"):
        load_checkpoint_weight_patches(
            model, [patch("lm_head.weight", [1], 1.0), patch("model.embed_tokens.weight", [1], 2.0)]
        )
    assert same_bits(model.model.embed_tokens.weight, before) and model.calls == []


def test_untied_models_and_explicit_aliases_are_unchanged() -> None:
    class Untied(TiedModel):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head.weight = nn.Parameter(torch.zeros(VOCAB, HIDDEN), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            names = set()
            for name, tensor in weights:
                target = self.lm_head if name == "lm_head.weight" else self.model.embed_tokens
                target.weight.copy_(tensor)
                names.add(name)
            return names

    model = Untied()
    embed = model.model.embed_tokens.weight.detach().clone()
    load_checkpoint_weight_patches(model, [patch("lm_head.weight", [4], 9.0)])
    assert model.lm_head.weight.view(-1)[4] == 9.0 and same_bits(
        model.model.embed_tokens.weight, embed
    )
    # aliases= still maps what the model does not show
    load_checkpoint_weight_patches(
        model, [patch("output.weight", [5], 8.0)], aliases={"output.weight": "lm_head.weight"}
    )
    assert model.lm_head.weight.view(-1)[5] == 8.0


def test_a_name_mapped_to_itself_is_loaded_under_its_own_name() -> None:
    model = TiedModel()
    before = model.model.embed_tokens.weight.detach().clone()
    pinned = {"lm_head.weight": "lm_head.weight"}
    with pytest.raises(
        LoaderError, match=r"unexpected checkpoint name 'lm_head\.weight'"
    ) as raised:
        load_checkpoint_weight_patches(
            model, [patch("lm_head.weight", [1], 1.0)], aliases=pinned, atomic=True
        )
    assert isinstance(raised.value.__cause__, KeyError)  # the loader's own error, as the cause
    assert same_bits(model.model.embed_tokens.weight, before)
