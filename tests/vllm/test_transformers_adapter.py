"""`LoadByName`, the Hugging Face adapter, on a real ``transformers`` model.

``transformers`` comes with vLLM: this test lives in the vLLM lane.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from patchctx import (  # noqa: E402 - after the skip
    Coalesce,
    LoadByName,
    RouteCache,
    SupportsLoadWeights,
    diff_state_dicts,
    load_checkpoint_weight_patches,
)
from tests.vllm.support.checkpoints import hf_config  # noqa: E402


def test_load_by_name_patches_a_transformers_model_like_training_does() -> None:
    adapter = LoadByName
    torch.manual_seed(0)
    trainer = transformers.AutoModelForCausalLM.from_config(
        hf_config("qwen2"), dtype=torch.float32
    )  # tied embeddings: lm_head.weight is model.embed_tokens.weight
    receiver = copy.deepcopy(trainer).to(torch.bfloat16).requires_grad_(False)  # inference
    tied = receiver.get_output_embeddings().weight is receiver.get_input_embeddings().weight
    assert tied and isinstance(adapter(receiver), SupportsLoadWeights)
    loader, routes = adapter(receiver), RouteCache()
    optimizer = torch.optim.Adam(trainer.parameters(), lr=1e-5)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    sent = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    for _ in range(3):
        trainer(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        patches = diff_state_dicts(sent, trainer.state_dict(), dtype=torch.bfloat16, cost=None)
        names = [patch.name for patch in patches]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # once
        loaded = load_checkpoint_weight_patches(
            loader, patches, routes=routes, ordering=Coalesce(), atomic=True
        )
        assert loaded <= set(names)  # what the loader calls reported (replays make none)
        sent = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    assert any(patch.indices is not None for patch in patches)
    assert routes.stats.replayed > 0  # the adapter's copies are views: routes were recorded
    reference = copy.deepcopy(trainer).to(torch.bfloat16)  # the trainer's weights, as sent
    for name, tensor in reference.state_dict().items():
        assert torch.equal(receiver.state_dict()[name], tensor), name
    with torch.no_grad():
        logits = receiver(input_ids=tokens).logits
        assert torch.equal(logits, reference(input_ids=tokens).logits)
