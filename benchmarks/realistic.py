"""Realistic RL weight updates: Adam steps on fp32 master weights, cast to bf16, diffed.

A trainer keeps fp32 master weights and sends the receiver their bf16 cast. After a step only
the elements whose bf16 rounding moved need sending; `diff_state_dicts` finds them. The update
size per element is what Adam makes it: exactly ``lr`` on the very first step (the normalised
first moment is +-1), and a fraction of ``lr`` later, once the moments have averaged noisy
gradients (``warmup`` steps before the measured ones).

Gradients are a fixed per-element component (the signal that keeps pointing the same way) plus
fresh Gaussian noise of the same scale at every step. Weights start as N(0, init_std**2), the
usual LLM initialisation.

Run: ``python -m benchmarks.realistic`` (a 4096x4096 weight, lr 1e-5 and 1e-6).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from patchctx import CheckpointWeightPatch, diff_state_dicts, patch_nbytes


@dataclass(frozen=True)
class RealisticUpdate:
    """fp32 master weights before and after the measured steps, and the patches between them.

    Attributes:
        old: The master weights whose `dtype` cast the receiver holds.
        new: The master weights after the measured steps.
        patches: ``diff_state_dicts(old, new, dtype=dtype, cost=None)`` (by size: the update as
            sparse as the wire allows, whatever it costs to apply).
        dtype: The receiver's dtype.
        density: Per name, the fraction of elements whose `dtype` bits changed.
    """

    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]
    patches: list[CheckpointWeightPatch]
    dtype: torch.dtype
    density: dict[str, float]

    @property
    def overall_density(self) -> float:
        changed = sum(self.density[n] * self.old[n].numel() for n in self.old)
        return changed / sum(t.numel() for t in self.old.values())

    @property
    def dense_nbytes(self) -> int:
        """Bytes of sending every tensor densely in the receiver dtype."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(t.numel() * size for t in self.old.values())


def adam_master_weights(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    lr: float,
    steps: int = 1,
    warmup: int = 0,
    init_std: float = 0.02,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fp32 master weights before and after `steps` Adam steps (after `warmup` unmeasured ones)."""
    generator = torch.Generator().manual_seed(seed)
    params = {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator) * init_std)
        for name, shape in shapes.items()
    }
    signal = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    optimizer = torch.optim.Adam(params.values(), lr=lr)

    def step() -> None:
        for name, param in params.items():
            noise = torch.randn(param.shape, generator=generator)
            param.grad = (signal[name] + noise).mul_(1e-2)
        optimizer.step()

    for _ in range(warmup):
        step()
    old = {name: param.detach().clone() for name, param in params.items()}
    for _ in range(steps):
        step()
    new = {name: param.detach().clone() for name, param in params.items()}
    return old, new


def realistic_update(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    lr: float,
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 1,
    warmup: int = 0,
    init_std: float = 0.02,
    seed: int = 0,
) -> RealisticUpdate:
    """Adam steps on fp32 master weights, diffed in the receiver's `dtype`."""
    old, new = adam_master_weights(
        shapes, lr=lr, steps=steps, warmup=warmup, init_std=init_std, seed=seed
    )
    patches = diff_state_dicts(old, new, dtype=dtype, cost=None)
    density = {name: changed_fraction(old[name], new[name], dtype) for name in old}
    return RealisticUpdate(old, new, patches, dtype, density)


_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_fraction(old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> float:
    """The fraction of elements whose bits differ once both tensors are cast to `dtype`."""
    if old.numel() == 0:
        return 0.0
    before, after = old.to(dtype), new.to(dtype)
    view = _BIT_VIEWS[before.element_size()]
    return int((before.view(view) != after.view(view)).sum()) / old.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the weight is size x size")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6])
    parser.add_argument("--warmup", type=int, nargs="+", default=[0, 10])
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    shapes = {"weight": (args.size, args.size)}
    print(f"Adam on a {args.size}x{args.size} fp32 master weight (init std 0.02), diffed in bf16")
    print(f"{'lr':>8} {'warmup':>6} {'steps':>5} {'density':>9} {'kind':>6} {'wire / dense':>12}")
    for lr in args.lr:
        for warmup in args.warmup:
            start = time.perf_counter()
            update = realistic_update(shapes, lr=lr, warmup=warmup, steps=args.steps)
            elapsed = time.perf_counter() - start
            kinds = {"sparse" if p.indices is not None else "dense" for p in update.patches}
            ratio = patch_nbytes(update.patches) / update.dense_nbytes
            print(
                f"{lr:>8.0e} {warmup:>6} {args.steps:>5} {update.overall_density:>9.3%} "
                f"{'/'.join(sorted(kinds)) or '-':>6} {ratio:>12.3f}  ({elapsed:.1f} s)"
            )


if __name__ == "__main__":
    main()
