"""Checked by mypy, never run: masked_copy preserves signatures for type checkers.

Each `# type: ignore[...]` must be *used* (warn_unused_ignores): if a decorator lost the
signature (returned Any), the ignore would be unused and mypy would fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from typing_extensions import assert_type

from patchctx import CopyStrategy, IntSentinel, MaskedCopy, NaNMask, masked_copy


@masked_copy
def load(weights: list[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
    return set()


@masked_copy(strategy=IntSentinel())
def load_int(weights: list[tuple[str, torch.Tensor]]) -> int:
    return 0


@masked_copy()
def loader(n: int) -> Iterator[str]:
    yield str(n)


class Model(torch.nn.Module):
    @masked_copy(strategy=NaNMask(), timeout=1.0)
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        return set()


assert_type(load([]), set[str])
assert_type(load_int([]), int)
assert_type(loader(1), Iterator[str])
assert_type(Model().load_weights([]), set[str])
assert_type(masked_copy(), MaskedCopy)
assert_type(masked_copy(strategy=NaNMask()), MaskedCopy)
assert_type(masked_copy().strategy, CopyStrategy)

with masked_copy(strategy=NaNMask()) as region:
    assert_type(region, MaskedCopy)

load([], strict="yes")  # type: ignore[arg-type]
load()  # type: ignore[call-arg]
load_int("weights")  # type: ignore[arg-type]
loader("1")  # type: ignore[arg-type]
Model().load_weights(1)  # type: ignore[arg-type]
masked_copy(strategy="nan")  # type: ignore[call-overload]
masked_copy(timeout="1")  # type: ignore[call-overload]
