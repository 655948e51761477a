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
