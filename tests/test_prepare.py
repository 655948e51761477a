"""`prepare`: a process's first patch load costs its own work only once it has been called.

Each test runs in a fresh interpreter (a subprocess): the one-time costs are per process, and
this test process paid them long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import patchctx

_MODEL = """
import json, sys
import torch
import patchctx
from patchctx import CheckpointWeightPatch, RouteCache, load_checkpoint_weight_patches

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 8), requires_grad=False)

    def load_weights(self, weights):
        for _, tensor in weights:
            self.w.data[8:24, 0].copy_(tensor[1])
        return {"w"}

def first_load():
    model, routes = Model(), RouteCache()
    sparse = CheckpointWeightPatch(
        "w", (4, 16), torch.float32, torch.tensor([5.0, 7.0]), torch.tensor([17, 40])
    )
    load_checkpoint_weight_patches(model, [sparse], routes=routes)
    dense = CheckpointWeightPatch("w", (4, 16), torch.float32, torch.arange(64.0))
    load_checkpoint_weight_patches(model, [dense], routes=routes)
    return model.w[8:24, 0].tolist()
"""


def _run(body: str) -> dict[str, object]:
    script = _MODEL + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def test_after_prepare_the_first_load_imports_nothing() -> None:
    answer = _run(
        """
        spent = patchctx.prepare()
        before = set(sys.modules)
        values = first_load()
        print(json.dumps({"new": sorted(set(sys.modules) - before), "values": values,
                          "spent": spent}))
        """
    )
    assert answer["new"] == []
    assert answer["values"] == [*map(float, range(16, 32))]
    assert isinstance(answer["spent"], float) and answer["spent"] > 0


def test_patch_loads_never_import_dynamo() -> None:
    answer = _run(
        """
        values = first_load()
        print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "values": values}))
        """
    )
    assert answer == {"dynamo": False, "values": [*map(float, range(16, 32))]}


def test_loads_are_the_same_once_dynamo_is_imported() -> None:
    # A process that uses torch.compile: the guard's handler then runs under dynamo.disable.
    answer = _run(
        """
        import torch._dynamo
        values = first_load()
        print(json.dumps({"values": values}))
        """
    )
    assert answer == {"values": [*map(float, range(16, 32))]}


def test_prepare_in_a_prepared_process_is_cheap() -> None:
    patchctx.prepare()
    assert patchctx.prepare() < 1.0


_FILLING = """
class Filling(torch.nn.Module):
    # Takes every tensor before writing, and pads `w` with a constant fill: whose fill it is
    # shows only in a dry run of each name alone, which the first call of both runs.
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in list(weights):
            if name == "embed":
                self.w.data[:4].copy_(tensor)
                self.w.data[4:].fill_(0.0)
            else:
                self.o.data.copy_(tensor)
        return {"w", "o"}

def filled_load():
    model, routes = Filling(), RouteCache()
    patches = [
        CheckpointWeightPatch("embed", (4, 4), torch.float32, torch.tensor([5.0]),
                              torch.tensor([3])),
        CheckpointWeightPatch("other", (3, 2), torch.float32, torch.tensor([2.0]),
                              torch.tensor([1])),
    ]
    load_checkpoint_weight_patches(model, patches, routes=routes)
    return sorted(routes), model.w.flatten().tolist(), model.o.flatten().tolist()
"""


def test_import_loads_no_dry_run_trainer_or_storage_and_prepare_pays_the_dry_run_too() -> None:
    """``import patchctx`` is the core; the dry run a first update may need comes with prepare.

    A first update whose loader makes a constant fill needs the loader's dry run to learn whose
    fill it is: after `prepare`, even that update imports nothing.
    """
    answer = _run(
        _FILLING
        + textwrap.dedent(
            """
        optional = ("patchctx._warm", "patchctx._diff", "patchctx._storage", "patchctx._audit")
        at_import = sorted(m for m in optional if m in sys.modules)
        patchctx.prepare()
        before = set(sys.modules)
        routes, w, o = filled_load()
        print(json.dumps({"at_import": at_import, "new": sorted(set(sys.modules) - before),
                          "routes": routes, "w": w, "o": o}))
        """
        )
    )
    assert answer["at_import"] == []
    assert answer["new"] == []
    assert answer["routes"] == ["embed", "other"]  # both learnt: the dry run ran
    assert answer["w"] == [0.0, 0.0, 0.0, 5.0] + [0.0] * 20
    assert answer["o"] == [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]
