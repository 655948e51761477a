"""The storage transport: version chains, anchors, garbage collection, and faults refused whole.

The worker's model is a tensor-parallel rank of a packed model (`tests.support.models`), its
truth a fresh model that loaded the trainer's full checkpoint densely: after every sync the
worker equals one published version bit for bit, and after every refusal it is unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from patchctx import (
    PatchError,
    StorageFollower,
    StoragePublisher,
    StoredUpdateError,
    read_manifest,
)
from tests.support import sync
from tests.support.models import ToyModel
from tests.support.sync import initial_state, reference_digest, state_digest, train_step

ROOT = Path(__file__).resolve().parents[1]


def run(publisher: StoragePublisher, state: dict[str, torch.Tensor], versions: int) -> list[str]:
    """Publish `versions` steps; the truth digest of each published version (index = version)."""
    truths = [""] * (publisher.version + 1)
    for _ in range(versions):
        train_step(state, publisher.version + 1)
        published = publisher.publish(state)
        truths.append(reference_digest(state))
        assert published.version == len(truths) - 1
    return truths


def versions_in(store: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in store.glob("v*"))


def test_a_follower_keeps_equal_to_the_published_versions(tmp_path: Path) -> None:
    publisher = StoragePublisher(tmp_path, anchor_every=3, keep_anchors=10)
    follower = StorageFollower(tmp_path, sync.model())
    state = initial_state()
    assert follower.poll() is None and follower.sync() is None
    for step in range(1, 8):
        truths = run(publisher, state, 1)
        assert follower.sync() == step
        assert state_digest(follower.model) == truths[-1]
        assert follower.sync() is None  # nothing new
    kinds = [read_manifest(tmp_path / f"v{k:08d}").base_version for k in range(1, 8)]
    assert kinds == [None, 1, 2, None, 4, 5, None]  # an anchor every 3 versions
    assert follower.routes.stats.replayed > 0  # deltas replayed along learnt routes


def test_a_follower_catches_up_over_many_versions_in_one_apply(tmp_path: Path) -> None:
    publisher = StoragePublisher(tmp_path, anchor_every=100)
    follower = StorageFollower(tmp_path, sync.model())
    state = initial_state()
    run(publisher, state, 1)
    follower.sync()
    truths = run(publisher, state, 5)
    prepared = follower.prepare()
    assert prepared is not None
    assert (prepared.base_version, prepared.chain, prepared.target_version) == (
        1,
        (2, 3, 4, 5, 6),
        6,
    )
    assert len({p.name for p in prepared.patches}) == len(prepared.patches)  # merged per tensor
    before = state_digest(follower.model)
    assert before != truths[6]  # preparing changed nothing
    assert follower.apply(prepared) == 6
    assert state_digest(follower.model) == truths[6]


def test_garbage_collection_keeps_what_a_late_worker_needs(tmp_path: Path) -> None:
    publisher = StoragePublisher(tmp_path, anchor_every=3, keep_anchors=2)
    state = initial_state()
    early = StorageFollower(tmp_path, sync.model())
    run(publisher, state, 2)
    early.sync()
    truths = run(publisher, state, 8)  # anchors at 1, 4, 7, 10
    assert versions_in(tmp_path) == [7, 8, 9, 10]  # everything from the 2nd newest anchor
    assert early.sync() == 10  # version 2 is gone: the chain restarts at anchor 10
    assert state_digest(early.model) == truths[10]
    fresh = StorageFollower(tmp_path, sync.model())  # version unknown
    prepared = fresh.prepare()
    assert prepared is not None and prepared.chain == (10,) and prepared.base_version is None


def test_a_restarted_publisher_continues_with_an_anchor(tmp_path: Path) -> None:
    state = initial_state()
    run(StoragePublisher(tmp_path, anchor_every=50), state, 3)
    follower = StorageFollower(tmp_path, sync.model())
    follower.sync()
    restarted = StoragePublisher(tmp_path, anchor_every=50)
    assert restarted.version == 3
    truths = run(restarted, state, 2)
    assert read_manifest(tmp_path / "v00000004").base_version is None
    assert read_manifest(tmp_path / "v00000005").base_version == 4
    assert follower.sync() == 5 and state_digest(follower.model) == truths[5]


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_urls(tmp_path: Path, scheme: str) -> None:
    url = f"file://{tmp_path}" if scheme == "file" else f"memory://sync-{tmp_path.name}"
    publisher = StoragePublisher(url, anchor_every=2, keep_anchors=1)
    follower = StorageFollower(url, sync.model())
    state = initial_state()
    for _ in range(4):
        truths = run(publisher, state, 1)
        assert follower.sync() == publisher.version
        assert state_digest(follower.model) == truths[-1]


@contextmanager
def unchanged(follower: StorageFollower[ToyModel]) -> Iterator[None]:
    before, version = state_digest(follower.model), follower.version
    with pytest.raises(StoredUpdateError) as caught:
        yield
    assert isinstance(caught.value, PatchError)
    assert state_digest(follower.model) == before and follower.version == version


def _setup(
    tmp_path: Path,
) -> tuple[StoragePublisher, StorageFollower[ToyModel], dict[str, torch.Tensor]]:
    publisher = StoragePublisher(tmp_path, anchor_every=100)
    follower = StorageFollower(tmp_path, sync.model())
    state = initial_state()
    run(publisher, state, 2)
    follower.sync()
    return publisher, follower, state


def _data(tmp_path: Path, version: int) -> Path:
    (data,) = (tmp_path / f"v{version:08d}").glob("*.safetensors")
    return data


def test_faults_are_refused_with_nothing_applied(tmp_path: Path) -> None:
    publisher, follower, state = _setup(tmp_path)
    truths = run(publisher, state, 3)  # 3, 4, 5; the follower holds 2
    manifest = tmp_path / "v00000004" / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[:40])  # torn
    with unchanged(follower):
        follower.sync()
    manifest.write_bytes(good)
    data = _data(tmp_path, 3)
    raw = data.read_bytes()
    data.unlink()  # missing
    with unchanged(follower):
        follower.sync()
    data.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # corrupted
    with unchanged(follower):
        follower.sync()
    data.write_bytes(raw)
    (tmp_path / "v00000004").rename(tmp_path / "held")  # a missing link
    with unchanged(follower):
        follower.sync()
    (tmp_path / "held").rename(tmp_path / "v00000004")
    assert follower.sync() == 5 and state_digest(follower.model) == truths[5]


def test_a_stale_prepared_update_is_refused(tmp_path: Path) -> None:
    publisher, follower, state = _setup(tmp_path)
    run(publisher, state, 1)
    prepared = follower.prepare()
    assert prepared is not None
    run(publisher, state, 1)
    follower.sync()  # another apply moved the model on
    with unchanged(follower):
        follower.apply(prepared)


def test_mismatched_versions_are_refused(tmp_path: Path) -> None:
    publisher, follower, state = _setup(tmp_path)
    run(publisher, state, 1)
    folder = tmp_path / "v00000003"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["target_version"] = 9  # an update copied into the wrong folder
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with unchanged(follower):
        follower.sync()
    manifest["target_version"], manifest["base_version"] = 3, 1  # skips a version
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with unchanged(follower):
        follower.sync()


def test_a_pause_wraps_only_the_apply(tmp_path: Path) -> None:
    events: list[str] = []

    @contextmanager
    def pause() -> Iterator[None]:
        events.append("pause")
        yield
        events.append("resume")

    publisher = StoragePublisher(tmp_path)
    follower = StorageFollower(tmp_path, sync.model(), pause=pause)
    state = initial_state()
    run(publisher, state, 2)
    prepared = follower.prepare()
    assert events == []  # fetching, decoding and route learning happen outside the pause
    assert prepared is not None
    follower.apply(prepared)
    assert events == ["pause", "resume"]


def test_a_trainer_and_a_worker_process_with_faults_and_restarts(tmp_path: Path) -> None:
    """20 versions; a torn manifest, a missing file, a corrupted chunk, an out-of-order
    version; the trainer restarts after version 10 and the worker after reaching 10."""
    store, control = tmp_path / "store", tmp_path / "control"
    store.mkdir()
    control.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def start(*args: object) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "tests.support.sync", *map(str, args)]
        return subprocess.Popen(command, cwd=ROOT, env=env)

    for first, last, stop in ((1, 10, 10), (11, 20, None)):
        trainer = start("trainer", store, control, first, last)
        worker = start("worker", store, control, 20, *([] if stop is None else [stop]))
        try:
            assert trainer.wait(timeout=300) == 0
            assert worker.wait(timeout=300) == 0
        finally:
            for process in (trainer, worker):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    events = [json.loads(line) for line in (control / "worker.jsonl").read_text().splitlines()]
    truths = {
        k: reference_digest(load_file(str(control / f"truth-{k}.safetensors")))
        for k in range(1, 21)
    }
    applied = [e for e in events if e["event"] == "applied"]
    refused = [e for e in events if e["event"] == "refused"]
    for event in applied:  # always one published version, bit for bit
        assert event["digest"] == truths[event["version"]], event
    assert all(event["unchanged"] for event in refused)
    for pid in {e["pid"] for e in applied}:
        mine = [e["version"] for e in applied if e["pid"] == pid]
        assert mine == sorted(set(mine))  # versions never repeat or go back
    assert len({e["pid"] for e in applied}) == 2 and applied[-1]["version"] == 20
    reasons = " ".join(str(e["error"]) for e in refused)
    for needle in ("not valid JSON", "missing (the manifest", "SHA-256", "broken at version 13"):
        assert needle in reasons
