"""The data plane's lifetimes and integrity settings, through a real worker engine.

A worker decodes a shared-memory payload as views of the trainer's file, so the bytes it
checked must not change before it applies them: the trainer writes a pooled file again only
after the finish of the update that read it, deletes pooled files after a failed update, and
with ``integrity="sha256"`` (an untrusted link) the worker reads a private copy instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from patchctx import CheckpointWeightPatch, InvalidPatchError
from patchctx.vllm import PatchctxTrainerEngine, PatchctxTrainerInitInfo, encode_patches
from patchctx.vllm._codec import plan_payload
from tests.vllm.test_backend import LocalClient, worker_engine


def sparse(name: str, shape: tuple[int, ...], values: list[float], indices: list[int]) -> Any:
    return CheckpointWeightPatch(
        name, shape, torch.float32, torch.tensor(values), torch.tensor(indices)
    )


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def trainer_for(client: LocalClient, folder: Path, **options: Any) -> PatchctxTrainerEngine:
    info = PatchctxTrainerInitInfo(
        transport="shm", rank=0, shm_dir=str(folder), inline_below=0, **options
    )
    return PatchctxTrainerEngine.trainer_init(info, client=client)


def test_a_pooled_file_is_written_again_only_after_the_finish_that_read_it(
    tmp_path: Path,
) -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = trainer_for(client, tmp_path, chunk_bytes=8)  # one patch per chunk
    seen: list[dict[str, str]] = []  # each chunk's file as its update_weights read it
    update, finish = client.update_weights, client.finish_weight_update

    def on_update(info: dict[str, Any]) -> None:
        update(info)
        seen.append({info["shm"]: files(tmp_path)[info["shm"]]})

    def on_finish(weight_version: str | None = None) -> None:
        # Every file a worker still holds views of is as it was when that worker read it.
        now = files(tmp_path)
        for earlier in seen:
            assert {k: now.get(k) for k in earlier} == earlier, "a file changed before finish"
        finish(weight_version)
        seen.clear()

    client.update_weights = on_update  # type: ignore[method-assign,assignment]
    client.finish_weight_update = on_finish  # type: ignore[method-assign]
    first = [sparse("w", (4, 4), [1.0], [0]), sparse("w", (4, 4), [2.0], [5])]
    trainer.send_weights(first)
    pooled = set(files(tmp_path))
    assert len(pooled) == 2 and all("-pool-" in name for name in pooled)  # one per chunk
    second = [sparse("w", (4, 4), [3.0], [0]), sparse("w", (4, 4), [4.0], [15])]
    trainer.send_weights(second)
    assert set(files(tmp_path)) == pooled  # the same files, written again after the finish
    assert worker.model.w.view(-1)[[0, 5, 15]].tolist() == [3.0, 2.0, 4.0]
    trainer.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_after_a_refused_update_no_pooled_file_is_reused(tmp_path: Path) -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = trainer_for(client, tmp_path)
    trainer.send_weights([sparse("w", (4, 4), [1.0], [0])])
    [pooled] = files(tmp_path)
    with pytest.raises(InvalidPatchError, match="out of range"):
        trainer.send_weights([sparse("w", (4, 4), [9.0], [99])])
    assert pooled not in files(tmp_path)  # deleted, not kept for the next update
    trainer.send_weights([sparse("w", (4, 4), [2.0], [1])])
    assert worker.model.w.view(-1)[:2].tolist() == [1.0, 2.0]
    trainer.shutdown()


def test_caller_owned_chunks_get_fresh_files_the_worker_deletes(tmp_path: Path) -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = trainer_for(client, tmp_path)
    client.start_weight_update()
    trainer.send_weight_chunk([sparse("w", (4, 4), [1.0], [3])], last=False)
    assert list(tmp_path.iterdir()) == []  # read, then deleted: the worker's views stay valid
    trainer.send_weight_chunk([sparse("b", (4,), [2.0], [1])], last=True)
    client.finish_weight_update(trainer.version)
    assert worker.model.w.view(-1)[3] == 1.0 and worker.model.b[1] == 2.0


def test_an_untrusted_link_applies_what_was_checked_though_the_file_changes_after(
    tmp_path: Path,
) -> None:
    """A hostile writer rewrites the payload file between the check and the apply: with
    integrity='sha256' the worker read a private copy, so it applies what it checked."""
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = trainer_for(client, tmp_path, integrity="sha256")
    assert worker.integrity == "sha256"
    update = client.update_weights
    checksums: list[str] = []

    def tampered(info: dict[str, Any]) -> None:
        update(info)
        checksums.append(info["checksum"])
        path = tmp_path / info["shm"]
        forged = encode_patches([sparse("w", (4, 4), [666.0], [0])])
        if len(forged) == path.stat().st_size:
            path.write_bytes(forged)
        else:
            raw = bytearray(path.read_bytes())
            raw[-4:] = torch.tensor([666.0]).numpy().tobytes()
            path.write_bytes(bytes(raw))

    client.update_weights = tampered  # type: ignore[method-assign,assignment]
    trainer.send_weights([sparse("w", (4, 4), [1.5], [0])])
    assert checksums[0].startswith("sha256:")
    assert worker.model.w.view(-1)[0] == 1.5
    trainer.shutdown()


def test_each_transport_requires_its_checksum(tmp_path: Path) -> None:
    """Defaults: XXH3 over shared memory, SHA-256 inline; integrity='sha256' everywhere."""
    patch = sparse("w", (4, 4), [1.0], [0])

    def chunk(algorithm: str, **where: Any) -> dict[str, Any]:
        plan = plan_payload([patch], base_version="default", target_version="1")
        buffer = bytearray(plan.nbytes)
        sealed = plan.write_into(buffer, algorithm=algorithm)
        return {
            "nbytes": plan.nbytes,
            "checksum": sealed.checksum,
            "intent": sealed.intent,
            "update_id": "u1",
            "payload": bytes(buffer),
            **where,
        }

    import base64

    def send(worker: Any, info: dict[str, Any]) -> None:
        payload = info.pop("payload")
        if info.pop("via") == "inline":
            info["inline"] = base64.b64encode(payload).decode()
        else:
            name = f"patchctx-test-{info['checksum'][:8]}"
            (tmp_path / name).write_bytes(payload)
            info["shm"] = name
        client = LocalClient(worker)
        client.start_weight_update()
        client.update_weights(info)
        client.finish_weight_update("1")

    for integrity, via, algorithm, accepted in (
        (None, "shm", "xxh3_128", True),
        (None, "inline", "xxh3_128", False),
        (None, "inline", "sha256", True),
        ("sha256", "shm", "xxh3_128", False),
        ("sha256", "shm", "sha256", True),
        ("xxh3_128", "inline", "xxh3_128", True),
    ):
        worker = worker_engine()
        init = {"transport": "shm", "shm_dir": str(tmp_path), "integrity": integrity}
        worker.init_transfer_engine(worker.parse_init_info(init))
        info = chunk(algorithm, via=via)
        if accepted:
            send(worker, info)
            assert worker.model.w.view(-1)[0] == 1.0, (integrity, via)
        else:
            with pytest.raises(InvalidPatchError, match="requires a sha256 checksum"):
                send(worker, info)
            assert worker.model.w.view(-1)[0] == 0.0


def test_the_next_chunk_is_written_while_the_workers_take_this_one(tmp_path: Path) -> None:
    """Chunks pipeline: while chunk k's update_weights runs, chunk k+1 is written; the update
    is still applied whole at its finish, in order."""
    import time

    worker = worker_engine()
    client = LocalClient(worker)
    trainer = trainer_for(client, tmp_path, chunk_bytes=8)  # one patch per chunk
    update = client.update_weights
    overlapped: list[bool] = []
    before = [worker.model.w.clone()]  # the weights when the update started

    def slow(info: dict[str, Any]) -> None:
        deadline = time.monotonic() + 10
        wanted = min(info["chunk"] + 2, 3)  # this chunk's file and the next one's
        while len(list(tmp_path.iterdir())) < wanted and time.monotonic() < deadline:
            time.sleep(0.01)
        overlapped.append(len(list(tmp_path.iterdir())) >= wanted)
        assert torch.equal(worker.model.w, before[0])  # nothing applied before the finish
        update(info)

    client.update_weights = slow  # type: ignore[method-assign,assignment]
    patches = [sparse("w", (4, 4), [float(i + 1)], [i]) for i in range(3)]
    stats = trainer.send_weights(patches)
    assert overlapped == [True, True, True] and stats is not None
    assert worker.model.w.view(-1)[:3].tolist() == [1.0, 2.0, 3.0]
    # A chunk the trainer cannot encode, after one already in flight: the update is ended
    # (nothing of it applied) and its files deleted.
    before[0] = worker.model.w.clone()
    bad = [
        sparse("w", (4, 4), [9.0], [5]),
        CheckpointWeightPatch("b", (2,), torch.float32, torch.ones(3)),
    ]
    with pytest.raises(InvalidPatchError, match="needs 2 values"):
        trainer.send_weights(bad)
    assert worker.model.w.view(-1)[5] == 0.0
    trainer.send_weights([sparse("w", (4, 4), [7.0], [6])])
    assert worker.model.w.view(-1)[6] == 7.0
    trainer.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_a_trainer_that_exits_without_closing_its_sender_leaves_no_pooled_file(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from patchctx import CheckpointWeightPatch\n"
        "from patchctx.vllm import SharedMemoryTransport, plan_payload\n"
        "sender = SharedMemoryTransport(sys.argv[1], owner='gone')\n"
        "plan = plan_payload([CheckpointWeightPatch('w', (4,), torch.float32, torch.ones(4))])\n"
        "sender.write(plan, algorithm='xxh3_128', pooled=True)\n"
        "sender.release(reuse=True)\n"
        "print(len(list(__import__('pathlib').Path(sys.argv[1]).iterdir())))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert done.stdout.strip() == "1"  # the pooled file, while the trainer lived
    assert list(tmp_path.iterdir()) == []  # deleted when it exited
