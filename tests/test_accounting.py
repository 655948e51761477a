"""Every patch accounted for, one error contract, casts that keep their kind.

Loaders over names (`tests.support.zoo.NAMED_ZOO`: one skips names it does not know, as vLLM's
do; one raises its own ``KeyError``; one casts before copying; one checks shapes and raises its
own ``ValueError``), each given patches a careless trainer sends: a misspelt name, a dense
tensor of the wrong shape, bool or integer values into a float weight, floats into an integer
buffer. The oracle for every one, with and without ``atomic`` and routes: bit for bit the dense
load of the patched checkpoint through the same loader, or a `PatchError` naming the patch
(the loader's own exception its ``__cause__``) with the model exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from patchctx import (
    CastKindError,
    CheckpointWeightPatch,
    InvalidPatchError,
    LoaderError,
    PatchError,
    RouteCache,
    audit,
    load_checkpoint_weight_patches,
)
from tests.support.zoo import NAMED_ZOO, NamedLayer, check_named


def _sparse(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, values: list[float]
) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name, shape, dtype, torch.tensor(values).to(dtype), torch.arange(len(values)) * 2
    )


def _dense(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 3
) -> CheckpointWeightPatch:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator).reshape(-1)
    if dtype == torch.bool:
        values = values > 0
    elif not dtype.is_floating_point:
        values = (values * 10).round()
    return CheckpointWeightPatch(name, shape, dtype, values.to(dtype))


# (case, patch, expected outcome with the defaults, expected with strict=False, kind_casts=True)
CASES: list[tuple[str, CheckpointWeightPatch, str, str]] = [
    ("sparse-float32", _sparse("weight", (4, 6), torch.float32, [1.5, -2.0]), "exact", "exact"),
    ("dense-float32", _dense("weight", (4, 6), torch.float32), "exact", "exact"),
    ("sparse-float64-into-float32", _sparse("norm", (6,), torch.float64, [0.25]), "exact", "exact"),
    ("sparse-misspelt", _sparse("wieght", (4, 6), torch.float32, [1.0]), "refused", "either"),
    ("dense-misspelt", _dense("wieght", (4, 6), torch.float32), "refused", "either"),
    ("dense-wrong-shape", _dense("norm", (7,), torch.float32), "refused", "refused"),
    ("dense-bool-into-float", _dense("norm", (6,), torch.bool), "refused", "exact"),
    # (a cast of staged data before its copy_ is masked or refused, by the loader's path)
    ("sparse-bool-into-float", _sparse("norm", (6,), torch.bool, [1.0, 1.0]), "refused", "any"),
    ("dense-int32-into-float", _dense("norm", (6,), torch.int32), "refused", "exact"),
    ("dense-float-into-int32", _dense("codes", (6,), torch.float32), "refused", "exact"),
    ("sparse-float-into-int32", _sparse("codes", (6,), torch.float32, [3.0]), "refused", "exact"),
]


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("routes", [False, True])
@pytest.mark.parametrize("loader", sorted(NAMED_ZOO))
@pytest.mark.parametrize(("case", "patch", "strict_outcome", "lenient_outcome"), CASES)
def test_dense_truth_or_a_patch_error_naming_the_patch_with_nothing_changed(
    loader: str,
    case: str,
    patch: CheckpointWeightPatch,
    strict_outcome: str,
    lenient_outcome: str,
    atomic: bool,
    routes: bool,
) -> None:
    write = NAMED_ZOO[loader]
    outcome = check_named(write, patch, atomic=atomic, routes=routes)
    knows_only_its_names = loader != "skips-unknown-names"
    expected = strict_outcome
    assert outcome == expected, (loader, case, outcome)
    lenient = check_named(write, patch, atomic=atomic, routes=routes, strict=False, kind_casts=True)
    if lenient_outcome == "either":  # a misspelt name: skipped, or the loader's own KeyError
        lenient_outcome = "refused" if knows_only_its_names else "exact"
    if lenient_outcome != "any":  # (the oracle holds either way: `check_named` checked it)
        assert lenient == lenient_outcome, (loader, case, lenient)


def test_a_skipped_name_is_refused_before_any_write_of_its_loader_call() -> None:
    """A real-name patch and a misspelt one in one loader call: the call is undone whole (a
    sparse call always, a dense one under atomic), and the error names the skipped patch by
    its position."""
    for atomic in (False, True):
        layer = NamedLayer(NAMED_ZOO["skips-unknown-names"])
        before = layer.weight.detach().clone()
        good = _sparse("weight", (4, 6), torch.float32, [9.0])
        typo = _sparse("wieght", (4, 6), torch.float32, [9.0])
        with pytest.raises(InvalidPatchError, match=r"patches\[1\] 'wieght': no loader call"):
            load_checkpoint_weight_patches(layer, [good, typo], atomic=atomic)
        assert torch.equal(layer.weight.detach(), before)


def test_a_non_atomic_call_says_which_names_it_left_written() -> None:
    layer = NamedLayer(NAMED_ZOO["raises-for-unknown-names"])
    patches = [
        _sparse("weight", (4, 6), torch.float32, [9.0]),
        _dense("norm", (6,), torch.float32),
        _sparse("unknown", (4, 6), torch.float32, [1.0]),
    ]
    with pytest.raises(LoaderError) as raised:
        load_checkpoint_weight_patches(layer, patches, max_chunk_bytes=1)
    error = raised.value
    assert isinstance(error.__cause__, KeyError)
    assert error.names == ("unknown",) and error.written == ("weight", "norm")
    assert "patches[2] 'unknown'" in str(error) and "'weight', 'norm'" in str(error)
    assert layer.weight.view(-1)[0] == 9.0  # written, as the error says
    # The same call with atomic=True leaves nothing written, and says so.
    layer = NamedLayer(NAMED_ZOO["raises-for-unknown-names"])
    before = layer.weight.detach().clone()
    with pytest.raises(LoaderError, match="nothing was written") as raised:
        load_checkpoint_weight_patches(layer, patches, max_chunk_bytes=1, atomic=True)
    assert raised.value.written == () and torch.equal(layer.weight.detach(), before)


def test_casts_across_kinds_are_refused_before_any_write_and_float_casts_stay() -> None:
    layer = NamedLayer(NAMED_ZOO["raises-for-unknown-names"])
    norm = layer.norm.detach().clone()
    # Values of another kind than the patch's dtype: at validation, before any write.
    ints = CheckpointWeightPatch("norm", (6,), torch.float32, torch.ones(6, dtype=torch.int32))
    with pytest.raises(CastKindError, match=r"patches\[0\] 'norm': its values are integer"):
        load_checkpoint_weight_patches(layer, [ints])
    assert isinstance(CastKindError("x"), TypeError)
    # A bool patch into a float weight (it would set the norm to 1.0): at the write.
    mask = CheckpointWeightPatch("norm", (6,), torch.bool, torch.ones(6, dtype=torch.bool))
    with pytest.raises(CastKindError, match=r"'norm' \(bool\) would be cast into a float"):
        load_checkpoint_weight_patches(layer, [mask])
    assert torch.equal(layer.norm.detach(), norm)
    load_checkpoint_weight_patches(layer, [mask], kind_casts=True)
    assert layer.norm.tolist() == [1.0] * 6
    # float64 into a float32 weight: a float cast, as a dense load makes it.
    wide = CheckpointWeightPatch(
        "norm", (6,), torch.float64, torch.full((6,), 0.1, dtype=torch.float64)
    )
    load_checkpoint_weight_patches(layer, [wide])
    assert torch.equal(layer.norm.detach(), torch.full((6,), 0.1, dtype=torch.float64).float())


def test_a_known_route_into_a_weight_of_another_kind_is_refused_before_any_write() -> None:
    layer = NamedLayer(NAMED_ZOO["skips-unknown-names"])
    routes = RouteCache()
    flags = _sparse("norm", (6,), torch.int8, [3.0])  # int8 codes into the float norm
    load_checkpoint_weight_patches(layer, [flags], routes=routes, kind_casts=True)  # learnt
    assert "norm" in routes
    before = layer.norm.detach().clone()
    first = _sparse("weight", (4, 6), torch.float32, [5.0])
    with pytest.raises(CastKindError, match="nothing was written"):
        load_checkpoint_weight_patches(layer, [first, flags], routes=routes)
    assert torch.equal(layer.norm.detach(), before) and layer.weight.view(-1)[0] != 5.0


def test_audit_never_calls_a_skipped_name_replayable() -> None:
    layer = NamedLayer(NAMED_ZOO["skips-unknown-names"])
    report = audit(layer, [("weight", (4, 6), torch.float32), ("wieght", (4, 6), torch.float32)])
    rows = {row.name: row for row in report.rows}
    assert rows["weight"].status == "replayable"
    assert rows["wieght"].status == "unsupported" and "writes nothing" in rows["wieght"].reason


class _LoaderOfATiedCopy(nn.Module):
    """Reads the value out (``item()``) and fills the weight itself: consumed all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, tensor in weights:
            self.scale.data.fill_(tensor.item())
        return {"scale"}


@pytest.mark.parametrize("sparse", [False, True])
def test_a_value_the_loader_reads_out_and_writes_itself_counts_as_consumed(sparse: bool) -> None:
    model = _LoaderOfATiedCopy()
    indices = torch.tensor([0]) if sparse else None
    patch = CheckpointWeightPatch("s", (1,), torch.float32, torch.tensor([4.0]), indices)
    load_checkpoint_weight_patches(model, [patch])
    assert model.scale.item() == 4.0


def test_every_error_of_a_call_is_a_patch_error_with_the_cause() -> None:
    layer = NamedLayer(NAMED_ZOO["checks-shapes-copies-rows"])
    with pytest.raises(PatchError) as raised:
        load_checkpoint_weight_patches(layer, [_dense("norm", (7,), torch.float32)])
    assert isinstance(raised.value, LoaderError) and isinstance(raised.value.__cause__, ValueError)
    assert "patches[0] 'norm'" in str(raised.value)
