"""A trainer and a worker for the storage-transport tests, in-process or as processes.

``python -m tests.support.sync trainer STORE CONTROL FIRST LAST`` publishes versions FIRST to
LAST of a deterministic training run (restarting from the checkpoint of version FIRST - 1 when
FIRST > 1) and injects faults at the versions `FAULTS` names, each repaired once the worker has
reported a refusal because of it. ``python -m tests.support.sync worker STORE CONTROL LAST
[STOP]`` follows until it holds version LAST (or STOP, then exits: a restart), logging every
applied version with the digest of its weights and every refusal to CONTROL/worker.jsonl.
The trainer saves the truth of every version to CONTROL/truth-<k>.safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from patchctx import StorageFollower, StoragePublisher, StoredUpdateError
from patchctx._storage._files import LocalStore
from tests.support.models import ToyModel, packed_tp_model, random_checkpoint

ANCHOR_EVERY = 4
KEEP_ANCHORS = 2
# version -> fault injected when it is published (repaired after the worker refuses it)
FAULTS = {3: "torn-manifest", 6: "missing-file", 8: "corrupted-chunk", 13: "out-of-order"}
TIMEOUT = 240.0


def model() -> ToyModel:
    return packed_tp_model(tp_rank=1)


def initial_state() -> dict[str, torch.Tensor]:
    return random_checkpoint(model().checkpoint_specs(), seed=7)


def train_step(state: dict[str, torch.Tensor], step: int, density: float = 0.05) -> None:
    """Change about `density` of every tensor, deterministically per step (in place)."""
    generator = torch.Generator().manual_seed(1000 + step)
    for name in sorted(state):
        flat = state[name].view(-1)
        chosen = torch.rand(flat.numel(), generator=generator) < density
        noise = torch.randn(flat.numel(), generator=generator).to(flat.dtype)
        flat[chosen] += noise[chosen]


def state_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def reference_digest(checkpoint: dict[str, torch.Tensor]) -> str:
    """The digest of a fresh model that loaded `checkpoint` densely."""
    reference = model()
    reference.load_weights(checkpoint.items())
    return state_digest(reference)


def _log(control: Path, **event: object) -> None:
    with open(control / "worker.jsonl", "a") as file:
        file.write(json.dumps(event) + "\n")


def _events(control: Path) -> list[dict[str, object]]:
    try:
        lines = (control / "worker.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _wait_for_refusal(control: Path, needle: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if any(e["event"] == "refused" and needle in str(e["error"]) for e in _events(control)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"the worker never refused {needle!r}")


class FaultyStore(LocalStore):
    """The publisher's directory, with one fault injected into the writes of one version.

    ``torn-manifest`` writes a third of the manifest, ``missing-file`` skips the data file,
    ``corrupted-chunk`` flips a bit of it, ``out-of-order`` holds every write of the version
    back (so the next one is visible first). Each is in place before the version's manifest
    appears, so a worker cannot see the version whole first. `repair` writes what was held.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fault: tuple[int, str] | None = None
        self.held: list[tuple[str, bytes]] = []

    def write(self, name: str, data: bytes) -> None:
        if self.fault is None or not name.startswith(f"v{self.fault[0]:08d}/"):
            super().write(name, data)
            return
        kind = self.fault[1]
        if kind == "out-of-order":
            self.held.append((name, data))
        elif kind == "torn-manifest" and name.endswith("manifest.json"):
            self.held.append((name, data))
            super().write(name, data[: len(data) // 3])
        elif kind == "missing-file" and name.endswith(".safetensors"):
            self.held.append((name, data))
        elif kind == "corrupted-chunk" and name.endswith(".safetensors"):
            self.held.append((name, data))
            super().write(name, data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        else:
            super().write(name, data)

    def repair(self) -> None:
        self.fault = None
        for name, data in self.held:
            super().write(name, data)
        self.held = []


NEEDLES = {
    "torn-manifest": "not valid JSON",
    "missing-file": "missing (the manifest names it)",
    "corrupted-chunk": "SHA-256",
}


def trainer(store: Path, control: Path, first: int, last: int) -> None:
    state = (
        initial_state()
        if first == 1
        else load_file(str(control / f"truth-{first - 1}.safetensors"))  # a restart
    )
    publisher = StoragePublisher(store, anchor_every=ANCHOR_EVERY, keep_anchors=KEEP_ANCHORS)
    assert publisher.version == first - 1, (publisher.version, first)
    faulty = FaultyStore(store)
    publisher.store = faulty
    for version in range(first, last + 1):
        if version > 1:
            train_step(state, version)
        save_file(state, str(control / f"truth-{version}.safetensors"))
        fault = FAULTS.get(version)
        faulty.fault = None if fault is None else (version, fault)
        publisher.publish(state)
        if fault == "out-of-order":  # version k + 1 is visible, version k not yet
            continue
        if FAULTS.get(version - 1) == "out-of-order":
            _wait_for_refusal(control, f"broken at version {version - 1}")
            faulty.repair()
        elif fault is not None:
            _wait_for_refusal(control, NEEDLES[fault])
            faulty.repair()
        time.sleep(0.01)


def worker(store: Path, control: Path, last: int, stop: int | None) -> None:
    follower = StorageFollower(store, model())  # a fresh model: its version is unknown
    deadline = time.monotonic() + TIMEOUT
    while follower.version != last and time.monotonic() < deadline:
        if stop is not None and follower.version is not None and follower.version >= stop:
            return  # a restart: the next worker process starts over
        before = state_digest(follower.model)
        try:
            applied = follower.sync()
        except StoredUpdateError as error:
            after = state_digest(follower.model)
            _log(
                control,
                event="refused",
                error=str(error),
                unchanged=before == after,
                version=follower.version,
            )
            time.sleep(0.01)
            continue
        if applied is None:
            time.sleep(0.01)
            continue
        _log(
            control,
            event="applied",
            version=applied,
            digest=state_digest(follower.model),
            pid=os.getpid(),
        )
    if follower.version != last:
        raise TimeoutError(f"the worker reached version {follower.version}, not {last}")


def main(argv: list[str]) -> None:
    role, store, control = argv[0], Path(argv[1]), Path(argv[2])
    torch.set_num_threads(1)
    if role == "trainer":
        trainer(store, control, int(argv[3]), int(argv[4]))
    else:
        worker(store, control, int(argv[3]), int(argv[4]) if len(argv) > 4 else None)


if __name__ == "__main__":
    main(sys.argv[1:])
