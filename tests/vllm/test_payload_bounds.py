"""Payloads a worker only has to read, never to believe: bounded before staging, fuzzed.

Every header field and block of a real payload is mutated the way a forger would (the
checksum recomputed to match), and random bytes are sent too, to a worker engine over its
``update_weights``. Each case is refused with a `PatchError` and no weight changes; nothing
is unpickled; the worker's peak memory never grows by more than a small multiple of the
payload (shapes up to 2**62 elements are declared, and never allocated). The shared-memory
transport refuses a FIFO named like a payload without waiting on it, and checks a file's size
before reading it; the NCCL receive never allocates more than the worker's limit.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import pickle
import resource
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from patchctx import CheckpointWeightPatch, InvalidPatchError, PatchError
from patchctx.vllm import NCCLTransport, SharedMemoryTransport, encode_patches
from patchctx.vllm._codec import plan_payload
from patchctx.vllm._transport import digest
from tests.vllm.test_backend import LocalClient, worker_engine

PATCHES = [
    CheckpointWeightPatch(
        "w", (4, 4), torch.float32, torch.tensor([1.5, -2.0]), torch.tensor([1, 9])
    ),
    CheckpointWeightPatch("b", (4,), torch.float32, torch.tensor([0.5, 1.0, 2.0, 4.0])),
]
GOOD = encode_patches(PATCHES, base_version="default", target_version="1")
# What the trainer meant: each patch's digest, as it wrote them (the same bytes as GOOD).
INTENT = (
    plan_payload(PATCHES, base_version="default", target_version="1")
    .write_into(bytearray(len(GOOD)))
    .intent
)


def split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """The payload's header, its manifest opened up: versions, patches and tensors."""
    (length,) = struct.unpack_from("<Q", payload, 0)
    header = json.loads(payload[8 : 8 + length])
    metadata = header.pop("__metadata__")
    manifest = json.loads(metadata["manifest"])
    return {**manifest, "tensors": header}, payload[8 + length :]


def join(header: dict[str, Any], data: bytes) -> bytes:
    opened = dict(header)
    tensors = opened.pop("tensors")
    manifest = json.dumps(opened)
    metadata = {"format": "patchctx.patches", "payload_version": "3", "manifest": manifest}
    text = json.dumps({"__metadata__": metadata, **tensors}).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def send(payload: bytes, *, intent: list[str] | None) -> BaseException | None:
    """One update with `payload` (its checksum recomputed); the error, or `None` if it landed."""
    worker = worker_engine()
    client = LocalClient(worker)
    before = {name: t.detach().clone() for name, t in worker.model.named_parameters()}
    info: dict[str, Any] = {
        "nbytes": len(payload),
        "sha256": digest(payload),
        "update_id": "fuzz",
        "inline": base64.b64encode(payload).decode(),
    }
    if intent is not None:
        info["intent"] = intent
    error: BaseException | None = None
    client.start_weight_update()
    try:
        client.update_weights(info)
        client.finish_weight_update("1")
    except BaseException as caught:
        error = caught
    if error is not None:
        assert isinstance(error, PatchError), repr(error)
        for name, tensor in worker.model.named_parameters():
            assert torch.equal(tensor, before[name]), f"{name} changed by a refused update"
    return error


# Structured mutations of every header field and block: (what, edit of the header).
def _mutations() -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    value: Any

    def at(*path: Any) -> Any:
        def edit(value: Any) -> Any:
            def apply(header: dict[str, Any]) -> None:
                target = header
                for key in path[:-1]:
                    target = target[key]
                target[path[-1]] = value

            return apply

        return edit

    huge = [2**31, 2**31]
    for value in (
        huge,
        [2**62],
        [2**62, 1],
        [32768, 32768],
        [-1, 16],
        [True, 4],
        [4.0, 4],
        [1] * 65,
    ):
        out.append((f"sparse shape {value}", at("patches", 0, "shape")(value)))
        out.append((f"dense shape {value}", at("patches", 1, "shape")(value)))
    for value in ("w2", "", "x" * 10000, None, 7):
        out.append((f"name {value!r:.20}", at("patches", 0, "name")(value)))
    for value in ("float64", "int32", "bool", "bfloat16", "complex64", "nope"):
        out.append((f"dtype {value}", at("patches", 0, "dtype")(value)))
    for value in ("F64", "I32", "BOOL", "BF16", "C64", "nope"):
        out.append((f"values dtype {value}", at("tensors", "0.values", "dtype")(value)))
    for value in ([-8, 0], [0, 2**40], [2**62, 2**62 + 8], [1, 9], [3, 11], [8, 0]):
        out.append((f"values offsets {value}", at("tensors", "0.values", "data_offsets")(value)))
        out.append(
            (f"dense values offsets {value}", at("tensors", "1.values", "data_offsets")(value))
        )
    for value in ([1], [3], [2**40], [2, 2], []):
        out.append((f"values shape {value}", at("tensors", "0.values", "shape")(value)))
        out.append((f"dense values shape {value}", at("tensors", "1.values", "shape")(value)))
    for value in ([24, 26], [24, 24], [0, 2], [24, 2**40], [26, 28]):
        out.append(
            (f"positions offsets {value}", at("tensors", "0.bitmask", "data_offsets")(value))
        )
    for value in ([0], [1], [3], [2**40]):
        out.append((f"positions shape {value}", at("tensors", "0.bitmask", "shape")(value)))
    for value in ("int64", "int32", "gaps", "bitmask", "zip"):
        out.append((f"encoding {value}", at("patches", 0, "positions", "encoding")(value)))
    for value in (0, 1, 3, 2**40, -1, True):
        out.append((f"count {value}", at("patches", 0, "positions", "count")(value)))
    out.append(("zstd positions", at("patches", 0, "positions", "compression")("zstd")))
    out.append(
        (
            "positions on the dense patch",
            at("patches", 1, "positions")(
                {"encoding": "int32", "count": 4, "tensors": ["1.values"], "compression": None}
            ),
        )
    )
    out.append(("the sparse patch made dense", at("patches", 0, "positions")(None)))
    out.append(("the values of another patch", at("patches", 0, "values")("1.values")))
    for key in ("base_version", "target_version"):
        for value in (1.5, [], {"a": 1}, "stale", 2**70):
            out.append((f"{key} {value!r}", at(key)(value)))

    def overlap(header: dict[str, Any]) -> None:  # two values tensors share bytes
        tensors = header["tensors"]
        tensors["1.values"]["data_offsets"] = tensors["0.values"]["data_offsets"]

    def overlap_positions(header: dict[str, Any]) -> None:
        tensors = header["tensors"]
        begin = tensors["0.values"]["data_offsets"][0]
        tensors["0.bitmask"]["data_offsets"] = [begin, begin + 2]

    out.append(("two values blocks overlap", overlap))
    out.append(("positions overlap values", overlap_positions))
    out.append(
        ("a patch duplicated", lambda h: h["patches"].append(copy.deepcopy(h["patches"][0])))
    )
    out.append(("an extra key", lambda h: h.update(extra=1)))
    out.append(
        (
            "an extra tensor",
            lambda h: h["tensors"].update(x={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
        )
    )
    return out


MUTATIONS = _mutations()


@pytest.mark.parametrize(("what", "edit"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_every_mutated_header_field_is_refused_with_nothing_written(what: str, edit: Any) -> None:
    header, data = split(GOOD)
    edit(header)
    forged = join(header, data)
    peak = max_rss()
    # The trainer's intent travels with the descriptor: a payload that decodes to anything
    # else than what the trainer meant is refused, however consistent it is.
    error = send(forged, intent=INTENT)
    meaning_kept = forged == join(*split(GOOD)) or what.startswith(
        ("target_version", "base_version")
    )  # (an edit to the value it had, or versions: what the digests do not cover)
    if error is None:
        assert meaning_kept, f"{what}: accepted"
    # A forger who writes the descriptor too: refused by the bounds, or harmless.
    send(forged, intent=None)
    assert max_rss() - peak < 2 * len(forged) + (64 << 20), f"{what}: memory grew"


def test_a_declared_shape_of_2_62_elements_is_refused_before_any_allocation() -> None:
    """The issue's case: a tiny payload declaring (32768, 32768) made the worker stage 4 GiB
    before refusing it. Now the worker bounds it by what it knows, first."""
    for shape in ((32768, 32768), (2**31, 2**31), (2**62,)):
        patch = CheckpointWeightPatch(
            "w", shape, torch.float32, torch.tensor([1.0]), torch.tensor([3])
        )
        payload = encode_patches([patch], base_version="default", target_version="1")
        peak = max_rss()
        error = send(payload, intent=None)
        assert isinstance(error, InvalidPatchError), (shape, error)
        assert "more than the whole model holds" in str(error)
        assert max_rss() - peak < 64 << 20, shape
    # With the checkpoint's specs known, a name or shape it does not have is refused too.
    worker = worker_engine()
    worker.receiver.specs = {"w": ((4, 4), torch.float32), "b": ((4,), torch.float32)}
    unknown = CheckpointWeightPatch("w_typo", (4, 4), torch.float32, torch.ones(16))
    reshaped = CheckpointWeightPatch("w", (8, 2), torch.float32, torch.ones(16))
    with pytest.raises(InvalidPatchError) as raised:
        worker.receiver.bound([unknown, reshaped])
    assert "patches[0] 'w_typo': is not a tensor of the checkpoint" in str(raised.value)
    assert "patches[1] 'w': declares shape [8, 2]" in str(raised.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_bytes_and_random_edits_are_refused_or_harmless(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["random", "edit", "splice"]))
    if kind == "random":
        payload = data.draw(st.binary(max_size=400))
    elif kind == "edit":
        raw = bytearray(GOOD)
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        payload = bytes(raw)
    else:
        cut = data.draw(st.integers(0, len(GOOD)))
        payload = GOOD[:cut] + data.draw(st.binary(max_size=64))
    error = send(payload, intent=INTENT)
    if error is None:  # only the untouched meaning lands
        assert payload == GOOD or kind != "random"


def test_a_pickle_in_a_payload_is_never_unpickled(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[str] = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: called.append("loads"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append("torch.load"))
    blob = pickle.dumps({"w": torch.ones(4)})
    for payload in (blob, GOOD[:16] + blob, join(split(GOOD)[0], blob)):
        assert isinstance(send(payload, intent=None), PatchError)
    assert called == []


def test_a_fifo_named_like_a_payload_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "patchctx-fifo"
    os.mkfifo(fifo)
    transport = SharedMemoryTransport(str(tmp_path), limit=1 << 20)
    done: list[BaseException] = []

    def receive() -> None:
        try:
            transport.receive({"shm": fifo.name, "nbytes": 8})
        except BaseException as error:
            done.append(error)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "receive waited on a FIFO"
    assert isinstance(done[0], InvalidPatchError) and "not a regular file" in str(done[0])
    directory = tmp_path / "patchctx-dir"
    directory.mkdir()
    with pytest.raises(InvalidPatchError):
        transport.receive({"shm": directory.name, "nbytes": 8})


def test_a_payload_file_of_another_size_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "patchctx-big"
    with open(big, "wb") as file:
        file.truncate(1 << 30)  # sparse: 1 GiB declared by the file, nothing on disk
    transport = SharedMemoryTransport(str(tmp_path), limit=1 << 40)
    peak = max_rss()
    with pytest.raises(InvalidPatchError, match="holds 1073741824 bytes, 96 announced"):
        transport.receive({"shm": big.name, "nbytes": 96})
    assert max_rss() - peak < 64 << 20  # nothing of it was read
    with pytest.raises(InvalidPatchError, match="over this worker's limit"):
        SharedMemoryTransport(str(tmp_path), limit=1 << 20).receive(
            {"shm": big.name, "nbytes": 1 << 30}
        )


def test_nccl_receive_never_allocates_more_than_the_limit() -> None:
    class Communicator:
        device = torch.device("cpu")

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            raise AssertionError("never reached: refused before allocating")

    transport = NCCLTransport(Communicator(), limit=1 << 20)
    peak = max_rss()
    with pytest.raises(InvalidPatchError, match="over this worker's limit"):
        transport.receive({"nbytes": 1 << 34})
    assert max_rss() - peak < 64 << 20


def test_the_worker_deletes_a_payload_file_once_read(tmp_path: Path) -> None:
    from patchctx.vllm import PatchctxTrainerEngine, PatchctxTrainerInitInfo

    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="shm", rank=0, shm_dir=str(tmp_path), inline_below=0),
        client=client,
    )
    trainer.sender.release = lambda: None  # type: ignore[method-assign,union-attr]  # (a trainer that dies)
    client.start_weight_update()
    trainer.send_weight_chunk([PATCHES[0]], last=False)
    assert list(tmp_path.iterdir()) == []  # the worker removed it after reading
    # A file a dead trainer wrote but never sent is swept when another trainer takes over.
    stale = tmp_path / f"patchctx-{trainer.trainer_id}-stale"
    stale.write_bytes(b"x")
    PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="shm", rank=0, shm_dir=str(tmp_path), takeover=True),
        client=client,
    )
    assert not stale.exists()
