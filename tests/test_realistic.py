"""The realistic workload the benchmarks import: Adam on fp32 masters, diffed in bf16."""

from __future__ import annotations

import torch

from benchmarks.realistic import adam_master_weights, changed_fraction, realistic_update
from tests.support.models import same_bits
from tests.support.reference import apply_densely

SHAPES = {"a.weight": (64, 96), "b.weight": (32,)}


def test_patches_turn_the_sent_bf16_weights_into_the_new_ones() -> None:
    update = realistic_update(SHAPES, lr=1e-5, warmup=2)
    sent = {name: tensor.to(torch.bfloat16) for name, tensor in update.old.items()}
    patched, _ = apply_densely(sent, update.patches)
    for name, tensor in update.new.items():
        assert same_bits(patched[name], tensor.to(torch.bfloat16)), name
    assert all(p.dtype == torch.bfloat16 for p in update.patches)
    assert 0 < update.overall_density < 1
    assert update.dense_nbytes == (64 * 96 + 32) * 2


def test_density_falls_with_the_learning_rate() -> None:
    high = realistic_update(SHAPES, lr=1e-5).overall_density
    low = realistic_update(SHAPES, lr=1e-6).overall_density
    huge = realistic_update(SHAPES, lr=1e-1)
    assert low < high
    assert huge.overall_density > 0.99
    assert all(p.indices is None for p in huge.patches)  # everything changed: dense


def test_master_weights_are_fp32_and_reproducible() -> None:
    old, new = adam_master_weights(SHAPES, lr=1e-5, seed=3)
    again, _ = adam_master_weights(SHAPES, lr=1e-5, seed=3)
    assert all(t.dtype == torch.float32 for t in (*old.values(), *new.values()))
    assert all(torch.equal(old[n], again[n]) for n in old)
    first_step = (new["a.weight"] - old["a.weight"]).abs()
    assert torch.allclose(first_step, torch.full_like(first_step, 1e-5), rtol=1e-2)
    assert changed_fraction(old["b.weight"], old["b.weight"], torch.bfloat16) == 0.0
