"""The hand-drawn diagrams of the docs (`docs/assets/*.svg`) say what the code does.

The route diagram (Routes and performance) claims a mapping: for the packed Q/K/V layer of
Getting started at rank 1 of 2, checkpoint indices 6 to 11 of `q_proj.weight` land at storage
positions 0 to 5 of `qkv_proj`, and indices 0 to 5 nowhere; after the first patch, later ones
replay without calling the loader. The vLLM diagram names public functions and methods; they
must exist under those names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

import torch
from torch import nn

from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches
from tests.support.examples import ROOT

ASSETS = ROOT / "docs" / "assets"


class PackedQKV(nn.Module):
    """Getting started's layer: q/k/v [4, 3] packed into [6, 3], split over 2 ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.local, self.rank = 2, rank
        self.qkv_proj = nn.Parameter(torch.zeros(6, 3), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        slots = {"q_proj.weight": 0, "k_proj.weight": 1, "v_proj.weight": 2}
        for name, loaded in weights:
            shard = loaded.narrow(0, self.rank * self.local, self.local)
            self.qkv_proj.data.narrow(0, slots[name] * self.local, self.local).copy_(shard)
        return {"qkv_proj"}


def patch(indices: list[int], values: list[float]) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        "q_proj.weight", (4, 3), torch.float32, torch.tensor(values), torch.tensor(indices)
    )


def test_the_route_diagram_shows_the_mapping_patchctx_records() -> None:
    text = (ASSETS / "route-diagram.svg").read_text(encoding="utf-8")
    assert "[6, 12)" in text and "position i - 6" in text and "qkv_proj[1, 1]" in text
    layer, routes = PackedQKV(rank=1), RouteCache()
    # the diagram's patch: indices 1 and 10; only 10 is rank 1's, at qkv_proj[1, 1]
    load_checkpoint_weight_patches(layer, [patch([1, 10], [0.5, -2.0])], routes=routes)
    assert layer.qkv_proj[1, 1].item() == -2.0
    assert torch.count_nonzero(layer.qkv_proj).item() == 1
    assert layer.calls == 1 and "q_proj.weight" in routes
    # every checkpoint index: in [6, 12) it lands at position index - 6, replayed
    for index in range(12):
        before = layer.qkv_proj.detach().clone()
        load_checkpoint_weight_patches(layer, [patch([index], [100.0 + index])], routes=routes)
        changed = (layer.qkv_proj != before).view(-1).nonzero().view(-1).tolist()
        assert changed == ([index - 6] if index >= 6 else []), index
    assert layer.calls == 1, "later patches replay the route without calling the loader"


def public_names(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return set(value)
    raise AssertionError(f"{path} has no __all__")


def test_the_vllm_diagram_names_what_exists() -> None:
    text = (ASSETS / "vllm-lifecycle.svg").read_text(encoding="utf-8")
    core = {"diff_state_dicts", "load_checkpoint_weight_patches", "RouteCache"}
    vllm = {
        "PatchWorkerExtension",
        "set_weight_version",
        "apply_patches",
        "encode_patches",
        "decode_payload",
        "WeightVersionError",
        "transformed_weights",
        "tied_aliases",
        "PatchStats",
    }
    for name in core | vllm:
        assert name in text, f"the diagram no longer shows {name}: update this test"
    assert core <= public_names("patchctx/__init__.py")
    assert vllm <= public_names("patchctx/vllm/__init__.py")
    assert '"patchctx.vllm.PatchWorkerExtension"' in text


def test_the_storage_timeline_names_what_exists() -> None:
    import patchctx

    text = (ASSETS / "storage-timeline.svg").read_text(encoding="utf-8")
    for method in ("StoragePublisher.publish", "StorageFollower.prepare", "StorageFollower.apply"):
        owner, name = method.split(".")
        assert method in text or name in text, method
        assert callable(getattr(getattr(patchctx, owner), name))
    for name in ("load_checkpoint_weight_patches", 'pause_generation(mode="keep")'):
        assert name.replace('"', "&quot;") in text or name in text, name
    assert "resume_generation" in text
