"""One error contract: every bad argument raises a PatchError, of the built-in class vLLM used.

Also: `patchctx.testing` keeps checking under ``python -O`` (no ``assert`` statements), and
`CheckedPatch` objects come from validation only.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

from patchctx import (
    Auto,
    BoolMask,
    ByteBudget,
    CheckedPatch,
    CheckpointWeightPatch,
    Coalesce,
    IntSentinel,
    InvalidPatchError,
    InvalidPatchTypeError,
    NaNMask,
    PatchError,
    RouteCache,
    audit,
    diff_state_dicts,
    load_checkpoint_weight_patches,
    masked_copy,
    validate_patches,
)
from tests.support.examples import ROOT


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.w.copy_(tensor)
        return {"w"}


PATCH = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([2]))


def load(**options: Any) -> object:
    return load_checkpoint_weight_patches(Model(), [PATCH], **options)


# (call, the built-in class it must also be, a fragment of the message)
BAD_ARGUMENTS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("ByteBudget('x')", lambda: ByteBudget("x"), TypeError, "takes an int, got 'x'"),  # type: ignore[arg-type]
    ("ByteBudget(True)", lambda: ByteBudget(True), TypeError, "takes an int"),
    ("ByteBudget(0)", lambda: ByteBudget(0), ValueError, "must be positive"),
    ("IntSentinel(value='x')", lambda: IntSentinel(value="x"), TypeError, "int or None"),  # type: ignore[arg-type]
    ("IntSentinel(value=1.5)", lambda: IntSentinel(value=1.5), TypeError, "int or None"),  # type: ignore[arg-type]
    ("masked_copy(timeout=-1)", lambda: masked_copy(timeout=-1), ValueError, ">= 0 seconds"),
    ("masked_copy(timeout=nan)", lambda: masked_copy(timeout=math.nan), ValueError, ">= 0"),
    ("masked_copy(timeout=inf)", lambda: masked_copy(timeout=math.inf), ValueError, "finite"),
    ("masked_copy(timeout='1')", lambda: masked_copy(timeout="1"), TypeError, "seconds"),  # type: ignore[call-overload]
    (
        "masked_copy(strategy=NaNMask)",
        lambda: masked_copy(strategy=NaNMask),  # type: ignore[call-overload]
        TypeError,
        "write NaNMask() instead",
    ),
    ("strategy=BoolMask", lambda: load(strategy=BoolMask), TypeError, "write BoolMask()"),
    ("chunking=ByteBudget", lambda: load(chunking=ByteBudget), TypeError, "write ByteBudget()"),
    ("ordering=Coalesce", lambda: load(ordering=Coalesce), TypeError, "write Coalesce()"),
    ("routes=RouteCache", lambda: load(routes=RouteCache), TypeError, "write RouteCache()"),
    ("routes={}", lambda: load(routes={}), TypeError, "RouteCache instance"),
    ("max_chunk_bytes=-1", lambda: load(max_chunk_bytes=-1), ValueError, "must be positive"),
    ("protect={'w': 1}", lambda: load(protect={"w": 1}), TypeError, "protect="),
    ("protect={'v': 'x'}", lambda: load(protect={"v": "x"}), ValueError, "not a parameter"),
    ("aliases=[]", lambda: load(aliases=[]), TypeError, "aliases="),
    (
        "validate_patches(strategy=Auto)",
        lambda: validate_patches([PATCH], strategy=Auto),  # type: ignore[arg-type]
        TypeError,
        "write Auto() instead",
    ),
    (
        "audit(strategy=NaNMask)",
        lambda: audit(Model(), [("w", (4,), torch.float32)], strategy=NaNMask),  # type: ignore[arg-type]
        TypeError,
        "write NaNMask() instead",
    ),
    (
        "audit(protect={'v': 'x'})",
        lambda: audit(Model(), [("w", (4,), torch.float32)], protect={"v": "x"}),
        ValueError,
        "'v', which is not a parameter or buffer",
    ),
    (
        "diff_state_dicts(strategy=BoolMask)",
        lambda: diff_state_dicts({}, {}, strategy=BoolMask),  # type: ignore[arg-type]
        TypeError,
        "write BoolMask() instead",
    ),
    (
        "diff_state_dicts(dense_above='x')",
        lambda: diff_state_dicts({}, {}, dense_above="x"),  # type: ignore[arg-type]
        TypeError,
        "density",
    ),
    (
        "diff_state_dicts(dense_above=2)",
        lambda: diff_state_dicts({}, {}, dense_above=2),
        ValueError,
        "density",
    ),
    (
        "NaNMask().stage(dtype='float32')",
        lambda: NaNMask().stage((2,), "float32", torch.tensor([0]), torch.tensor([1.0])),  # type: ignore[arg-type]
        TypeError,
        "must be a torch.dtype",
    ),
    (
        "CheckedPatch(...)",
        lambda: CheckedPatch(0, PATCH, 4),
        TypeError,
        "made by patchctx's validation only",
    ),
]


@pytest.mark.parametrize(
    ("call", "builtin", "fragment"),
    [
        pytest.param(call, builtin, fragment, id=name)
        for name, call, builtin, fragment in BAD_ARGUMENTS
    ],
)
def test_every_bad_argument_raises_a_patch_error_of_the_builtin_class(
    call: Callable[[], object], builtin: type[Exception], fragment: str
) -> None:
    with pytest.raises(PatchError) as info:
        call()
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, InvalidPatchError)
    assert isinstance(info.value, InvalidPatchTypeError) == (builtin is TypeError)
    assert fragment in str(info.value)


def test_the_conformance_checks_hold_under_python_dash_o() -> None:
    script = textwrap.dedent(
        """
        import torch
        from dataclasses import dataclass
        from patchctx import NaNMask
        from patchctx.testing import ConformanceError, check_strategy

        @dataclass(frozen=True)
        class Broken(NaNMask):
            def merge(self, destination, source, *, non_blocking=False):
                return destination  # writes nothing

        assert False, "asserts are stripped here"
        try:
            check_strategy(Broken(), dtypes=[torch.float32])
        except ConformanceError as error:
            print("caught", "merge-matches-dense-reference[float32]" in str(error))
        """
    )
    result = subprocess.run(
        [sys.executable, "-O", "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "caught True"
