"""A small training loop that sends each step's update as patches to a bf16 receiver.

The trainer holds fp32 weights; the receiver holds bf16 ones and loads by checkpoint name, as an
inference worker does. Each step the trainer diffs what it last sent against its weights, in
bf16: matrices change in a few percent of their elements (sparse patches) while the biases,
zero-initialised, change in nearly all of them (dense patches), so the patches of one step
alternate between dense and sparse in state-dict order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from patchctx import (
    OrderingPolicy,
    RouteCache,
    diff_state_dicts,
    load_checkpoint_weight_patches,
)


def trainer_model(hidden: int = 32, layers: int = 5, seed: int = 0) -> nn.Sequential:
    """Linear layers with zero-initialised biases, and a LayerNorm after each."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(linear.bias)
        modules += [linear, nn.LayerNorm(hidden)]
    return nn.Sequential(*modules)


class Receiver(nn.Module):
    """The inference side: the same tensors in bf16, loaded by name."""

    def __init__(self, trainer: nn.Module) -> None:
        super().__init__()
        self.inner = trainer.to(torch.bfloat16).requires_grad_(False)
        self.calls: list[list[str]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        parameters = dict(self.inner.named_parameters())
        names = []
        for name, tensor in weights:
            parameters[name].copy_(tensor)
            names.append(name)
        self.calls.append(names)
        return set(names)


@dataclass
class Run:
    """What a training loop sent and what it cost the receiver."""

    receiver: Receiver
    trainer: nn.Module
    patches: int
    dense: int
    loader_calls: int


def train_and_send(ordering: OrderingPolicy, *, steps: int = 4, lr: float = 1e-4) -> Run:
    """Train `steps` steps; after each, diff, and load the patches with `ordering` and routes."""
    trainer = trainer_model()
    receiver = Receiver(trainer_model())
    routes = RouteCache()
    optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1)
    sent = {name: tensor.detach().clone() for name, tensor in trainer.state_dict().items()}
    patches = dense = 0
    for _ in range(steps):
        inputs = torch.randn(16, 32, generator=generator)
        loss = trainer(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        current = trainer.state_dict()
        # By wire bytes: the cost model sends tensors this small dense, and the loop is meant
        # to mix both kinds.
        update = diff_state_dicts(sent, current, dtype=torch.bfloat16, cost=None)
        patches += len(update)
        dense += sum(patch.indices is None for patch in update)
        load_checkpoint_weight_patches(receiver, update, ordering=ordering, routes=routes)
        sent = {name: tensor.detach().clone() for name, tensor in current.items()}
    return Run(receiver, trainer, patches, dense, len(receiver.calls))
