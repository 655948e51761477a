"""Patch a small packed, tensor-parallel model through its own load_weights and show what changed.

Two ranks of a tiny attention block hold Q, K and V packed into one parameter, each rank a slice.
A sparse update to the checkpoint tensor ``q_proj.weight`` (full Hugging Face shape, flat
indices) is staged once and loaded on both ranks with ``masked_copy``: each rank's loader narrows
out its own slice and copies it into its part of the packed parameter, and only the changed
elements move.

Run: ``python examples/demo.py`` (``--help`` for its options).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch
from torch import nn

from patchctx import NaNMask, masked_copy


class PackedAttention(nn.Module):
    """Q, K and V packed into one parameter at one tensor-parallel rank, like vLLM's QKV layer."""

    def __init__(self, hidden: int, heads: int, head_dim: int, tp_size: int, tp_rank: int):
        super().__init__()
        self.local = heads // tp_size * head_dim
        self.rank = tp_rank
        self.qkv = nn.Parameter(torch.zeros(3 * self.local, hidden), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        offsets = {"q_proj.weight": 0, "k_proj.weight": 1, "v_proj.weight": 2}
        for name, full in weights:
            shard = full.narrow(0, self.rank * self.local, self.local)  # this rank's rows
            self.qkv.data.narrow(0, offsets[name] * self.local, self.local).copy_(shard)
        return {"qkv"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--changed", type=int, default=6, help="elements of q_proj to change")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    heads, head_dim, tp_size = 4, 2, 2
    checkpoint = {
        name: torch.randn(heads * head_dim, args.hidden)
        for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    }
    ranks = [PackedAttention(args.hidden, heads, head_dim, tp_size, r) for r in range(tp_size)]
    for rank in ranks:
        rank.load_weights(checkpoint.items())
    before = [rank.qkv.detach().clone() for rank in ranks]

    shape = checkpoint["q_proj.weight"].shape
    indices = torch.randperm(shape.numel())[: args.changed].sort().values
    values = torch.randn(args.changed)
    strategy = NaNMask()
    staged = strategy.stage(shape, torch.float32, indices, values)

    print(f"sparse patch to q_proj.weight {tuple(shape)}: {args.changed} elements")
    for flat, value in zip(indices.tolist(), values.tolist(), strict=True):
        print(f"  checkpoint[{flat // shape[1]}, {flat % shape[1]}] <- {value:+.4f}")
    for r, rank in enumerate(ranks):
        with masked_copy(strategy=strategy):
            rank.load_weights([("q_proj.weight", staged)])
        changed = (rank.qkv != before[r]).nonzero().tolist()
        print(f"rank {r}: {len(changed)} of {rank.qkv.numel()} packed elements changed")
        for row, col in changed:
            print(f"  qkv[{row}, {col}]: {before[r][row, col]:+.4f} -> {rank.qkv[row, col]:+.4f}")
        assert not torch.isnan(rank.qkv).any()
    total = sum(int((rank.qkv != before[r]).sum()) for r, rank in enumerate(ranks))
    assert total == args.changed, "every changed checkpoint element lands on exactly one rank"
    print(f"all {args.changed} changes landed once across {tp_size} ranks; nothing else moved")


if __name__ == "__main__":
    main()
