"""audit(): replayable / masked / unsupported per name, and no weight changes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from patchctx import audit
from tests.support.models import (
    CastLinear,
    ContiguousLinear,
    IntLinear,
    PaddedEmbedding,
    ToyModel,
    assert_same_state,
    packed_tp_model,
    random_checkpoint,
    state,
)
from tests.test_atomic import Lazy
from tests.test_atomic import Model as WritePathModel
from tests.test_guard import MASKED, REFUSED


def specs_of(model: ToyModel) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, spec.shape, spec.dtype) for name, spec in model.checkpoint_specs().items()]


def test_every_name_of_the_packed_tp_model_is_replayable() -> None:
    model = packed_tp_model(tp_size=4, tp_rank=3, kv_heads=1)
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    before = state(model)
    report = audit(model, specs_of(model))
    assert report.counts() == {
        "replayable": len(model.checkpoint_specs()),
        "masked": 0,
        "unsupported": 0,
    }
    assert_same_state(state(model), before)


def test_statuses_and_reasons() -> None:
    model = ToyModel(
        {
            "c": ContiguousLinear(3, 5),
            "x": CastLinear(2, 4),
            "e": PaddedEmbedding(5, 2),
            "q": IntLinear(2, 3),
        }
    )
    model.load_weights(random_checkpoint(model.checkpoint_specs()).items())
    before = state(model)
    specs = [*specs_of(model), ("flags", (4,), torch.bool)]
    report = audit(model, specs)
    assert_same_state(state(model), before)
    assert report.names("masked") == ["c.proj.weight"]
    assert report.names("unsupported") == ["flags"]
    assert set(report.names("replayable")) == {
        "x.proj.weight",
        "e.embed.weight",
        "q.qweight.weight",
        "q.scale.weight",
    }
    rows = {row.name: row for row in report.rows}
    assert "computed copy" in rows["c.proj.weight"].reason
    assert "BoolMask" in rows["flags"].reason
    text = str(report)
    assert text.splitlines()[0].split() == ["name", "status", "reason"]
    assert text.splitlines()[-1] == "4 replayable, 1 masked, 1 unsupported"


def test_audit_undoes_the_loaders_own_writes_and_reports_refusals() -> None:
    paths = {
        "w0": dict(MASKED)["copy_"],
        "w1": dict(REFUSED)["mul_0-then-add_"],  # zeroes the weight, then refused
        "w2": dict(REFUSED)["param.data-rebind"],
        "w3": dict(MASKED)["copy-of-cat"],
        "w4": dict(MASKED)["setitem-advanced-index"],
    }
    model = WritePathModel(paths)
    before = state(model)
    report = audit(model, [(f"w{i}", (3, 4), torch.float32) for i in range(5)])
    assert_same_state(state(model), before)
    assert [row.status for row in report.rows] == [
        "replayable",
        "unsupported",
        "unsupported",
        "masked",
        "masked",
    ]
    assert "reads or accumulates" in report.rows[1].reason
    assert "replaced, reshaped or added" in report.rows[2].reason


def test_a_loader_that_raises_is_unsupported() -> None:
    model = WritePathModel()
    model.fail_after = 0
    report = audit(model, [("w0", (3, 4), torch.float32)])
    assert report.rows[0].status == "unsupported"
    assert "RuntimeError" in report.rows[0].reason


def test_names_whose_loader_writes_a_protected_tensor_are_unsupported() -> None:
    from tests.test_guard import TwoWeights

    model = TwoWeights()
    specs = [("a", (2, 3), torch.float32), ("b", (2, 3), torch.float32)]
    report = audit(model, specs, protect={"b": "repacked by the engine"})
    assert report.names("replayable") == ["a"]
    assert report.names("unsupported") == ["b"]
    assert "protected tensor 'b' (repacked by the engine)" in report.rows[1].reason
    assert not model.a.any() and not model.b.any()


def test_a_loader_that_reads_a_scalar_out_of_torch_is_masked_not_unsupported() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.scale.data.fill_(tensor.item())  # vLLM's default_weight_loader
            return {"scale"}

    model = Scaled()
    (row,) = audit(model, [("s", (1,), torch.float32)]).rows
    assert row.status == "masked" and ".item()" in row.reason
    assert model.scale.item() == 1.0


def test_audit_takes_any_model_load_checkpoint_weight_patches_takes() -> None:
    """A plain adapter (load_weights + named_parameters), not a torch.nn.Module."""
    weight = torch.zeros(2, 3)

    class Adapter:
        def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
            return [("w", weight)]

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                weight.copy_(tensor)
            return {"w"}

    (row,) = audit(Adapter(), [("w", (2, 3), torch.float32)]).rows
    assert row.status == "replayable"
    assert not weight.any()


def test_a_generator_loader_is_audited_inside_the_load_and_changes_nothing() -> None:
    spec = [("w", (4, 6), torch.float32)]
    for count, status, reason in ((False, "replayable", ""), (True, "masked", "aten.add_")):
        model = Lazy(count=count)
        before = state(model)
        (row,) = audit(model, spec).rows
        assert row.status == status, row
        assert reason in row.reason and "writes nothing" not in row.reason, row
        assert_same_state(state(model), before)
