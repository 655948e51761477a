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
from tests.support.models import ToyModel, packed_tp_model, random_checkpoint

ANCHOR_EVERY = 4
KEEP_ANCHORS = 2
# version -> fault injected when it is published (repaired after the worker refuses it)
FAULTS = {3: "torn-manifest", 6: "missing-file", 8: "corrupted-chunk", 13: "out-of-order"}
TIMEOUT = 90.0


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


def _folder(store: Path, version: int) -> Path:
    return store / f"v{version:08d}"


def trainer(store: Path, control: Path, first: int, last: int) -> None:
    state = (
        initial_state()
        if first == 1
        else load_file(str(control / f"truth-{first - 1}.safetensors"))  # a restart
    )
    publisher = StoragePublisher(store, anchor_every=ANCHOR_EVERY, keep_anchors=KEEP_ANCHORS)
    assert publisher.version == first - 1, (publisher.version, first)
    version = first
    while version <= last:
        if version > 1:
            train_step(state, version)
        save_file(state, str(control / f"truth-{version}.safetensors"))
        fault = FAULTS.get(version)
        if fault == "out-of-order":  # version k + 1 becomes visible before version k
            publisher.publish(state)
            hidden = store / f".held-{version}"
            _folder(store, version).rename(hidden)
            train_step(state, version + 1)
            save_file(state, str(control / f"truth-{version + 1}.safetensors"))
            publisher.publish(state)
            _wait_for_refusal(control, f"broken at version {version}")
            hidden.rename(_folder(store, version))
            version += 2
            continue
        publisher.publish(state)
        folder = _folder(store, version)
        if fault == "torn-manifest":
            manifest = folder / "manifest.json"
            good = manifest.read_bytes()
            manifest.write_bytes(good[: len(good) // 3])
            _wait_for_refusal(control, "not valid JSON")
            manifest.write_bytes(good)
        elif fault == "missing-file":
            (data,) = folder.glob("*.safetensors")
            good = data.read_bytes()
            data.unlink()
            _wait_for_refusal(control, "missing (the manifest names it)")
            data.write_bytes(good)
        elif fault == "corrupted-chunk":
            (data,) = folder.glob("*.safetensors")
            good = data.read_bytes()
            bad = bytearray(good)
            bad[-5] ^= 0x01
            data.write_bytes(bytes(bad))
            _wait_for_refusal(control, "SHA-256")
            data.write_bytes(good)
        version += 1
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
