"""`LoadByName`: a module whose tensor names are the checkpoint's takes patches by name."""

from __future__ import annotations

import pytest
import torch

from patchctx import (
    CheckpointWeightPatch,
    LoadByName,
    RouteCache,
    SupportsLoadWeights,
    load_checkpoint_weight_patches,
)


class Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight, as tied language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.requires_grad_(False)


def _dense_truth(module: torch.nn.Module, patch: CheckpointWeightPatch) -> dict[str, torch.Tensor]:
    state = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    target = state[patch.name].view(-1)
    assert patch.indices is not None
    target[patch.indices] = patch.values.to(target.dtype)
    state["head.weight"] = state["embed.weight"]  # tied: state_dict's clones are not
    return state


def test_sparse_patches_by_name_equal_a_dense_load_and_replay_through_routes() -> None:
    torch.manual_seed(0)
    module = Tied()
    loader, routes = LoadByName(module), RouteCache()
    assert isinstance(loader, SupportsLoadWeights)
    for step in range(3):
        indices = torch.randperm(24)[:5]
        patch = CheckpointWeightPatch(
            "embed.weight", (6, 4), torch.float32, torch.randn(5), indices
        )
        truth = _dense_truth(module, patch)
        assert load_checkpoint_weight_patches(loader, [patch], routes=routes) == {"embed.weight"}
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, truth[name]), (step, name)
        assert module.head.weight is module.embed.weight  # tied: one storage, both names
    assert routes.stats.replayed > 0  # the copy by name is a view: routes were learnt


def test_buffers_and_tied_names_are_loadable_under_each_name() -> None:
    module = Tied()
    loader = LoadByName(module)
    names = {name for name, _ in loader.named_parameters()}
    assert {"embed.weight", "head.weight"} <= names
    patch = CheckpointWeightPatch(
        "head.weight", (6, 4), torch.float32, torch.tensor([7.0]), torch.tensor([0])
    )
    load_checkpoint_weight_patches(loader, [patch])
    assert module.embed.weight[0, 0].item() == 7.0
    dense = CheckpointWeightPatch("scale", (4,), torch.float32, torch.full((4,), 2.0))
    load_checkpoint_weight_patches(loader, [dense])
    assert torch.equal(loader.module.get_buffer("scale"), torch.full((4,), 2.0))


def _cause_chain(error: BaseException) -> list[type[BaseException]]:
    chain: list[type[BaseException]] = []
    current: BaseException | None = error
    while current is not None:
        chain.append(type(current))
        current = current.__cause__
    return chain


@pytest.mark.parametrize(
    ("patch", "cause"),
    [
        (CheckpointWeightPatch("embed.weigth", (6, 4), torch.float32, torch.zeros(24)), KeyError),
        (
            CheckpointWeightPatch("norm.weight", (1, 4), torch.float32, torch.zeros(4)),
            ValueError,
        ),
    ],
    ids=["misspelled-name", "broadcastable-shape"],
)
def test_an_unknown_name_or_a_wrong_shape_raises_and_changes_nothing(
    patch: CheckpointWeightPatch, cause: type[BaseException]
) -> None:
    module = Tied()
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the cause is checked below
        load_checkpoint_weight_patches(LoadByName(module), [patch], atomic=True)
    assert cause in _cause_chain(raised.value)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_only_modules_are_wrapped() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        LoadByName(object())  # type: ignore[arg-type]


def test_its_loader_takes_parameters_that_require_gradients() -> None:
    module = torch.nn.Linear(2, 2)  # requires_grad=True, as a model being trained
    before = torch.is_grad_enabled()
    LoadByName(module).load_weights([("bias", torch.tensor([1.0, 2.0]))])
    assert torch.equal(module.bias.detach(), torch.tensor([1.0, 2.0]))
    assert torch.is_grad_enabled() == before
