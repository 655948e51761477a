"""Delta sync through storage on ``vllm serve``: prepare while generating, apply in a pause.

A real server (a tiny Qwen2 with tied embeddings, TP=1) runs with `StorageWorkerExtension`;
this process is the trainer (`StoragePublisher` into a directory) and the driver. Requests
sent while the workers prepare are served, from the old weights; the pause
(``pause_generation(mode="keep")``) holds only the apply, and a request running across it
finishes; after the resume, completions equal ``transformers`` on the new checkpoint and
``/weight_checker`` matches a fresh load of it. A corrupted update is refused with nothing
applied.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from patchctx import StoragePublisher, StoredUpdateError
from patchctx.vllm import sync_server
from tests.vllm.support.checkpoints import (
    read_checkpoint,
    write_checkpoint,
    write_checkpoint_tensors,
)
from tests.vllm.support.engine import assert_same_generations, differ, hf_greedy
from tests.vllm.support.serve import (
    Server,
    compare,
    completions,
    post,
    reference_checksums,
    vllm_serve,
    write_tokenizer,
)


def rpc(server: Server, method: str, *args: Any) -> list[Any]:
    status, answer = post(f"{server.url}/collective_rpc", {"method": method, "args": list(args)})
    assert status == 200, answer
    results = answer["results"]
    assert isinstance(results, list)
    return results


def trained(truth: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step: about 3 % of every matrix changes."""
    generator = torch.Generator().manual_seed(seed)
    state = {name: tensor.clone() for name, tensor in truth.items()}
    for tensor in state.values():
        if tensor.ndim > 1:
            mask = torch.rand(tensor.shape, generator=generator) < 0.03
            tensor += mask * torch.randn(tensor.shape, generator=generator)
    if "lm_head.weight" in state:  # tied: one tensor under two names
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def test_a_sync_prepared_while_serving_and_applied_in_a_short_pause(tmp_path: Path) -> None:
    source = write_checkpoint("qwen2", tmp_path / "qwen2")
    write_tokenizer(source)
    store = tmp_path / "store"
    truth = read_checkpoint(source)
    publisher = StoragePublisher(store, anchor_every=100)
    publisher.publish(truth)  # version 1: an anchor, the checkpoint the server loads
    extension = ["--worker-extension-cls", "patchctx.vllm.StorageWorkerExtension"]
    # ... and the pause, the apply and the resume in one request, inside the server
    extension += ["--middleware", "patchctx.vllm.paused_apply"]
    with vllm_serve(source, tmp_path / "server.log", extra_args=extension) as server:
        first = sync_server(server.url, str(store))
        assert first["version"] == 1
        assert 0 < first["server_window_ms"] <= first["pause_seconds"] * 1e3
        old = completions(server)
        assert_same_generations(old, hf_greedy(source))

        # Version 2, prepared while the server keeps generating.
        new_state = trained(truth, seed=3)
        publisher.publish(new_state)
        expected = write_checkpoint_tensors(source, new_state, tmp_path / "step-2")
        (started,) = rpc(server, "patchctx_storage_prepare", str(store))
        assert started["state"] == "preparing" and started["version"] == 1
        during = completions(server)  # served while (or after) the workers prepare
        assert_same_generations(during, old)  # preparing changed no weight
        while rpc(server, "patchctx_storage_status")[0]["state"] == "preparing":
            time.sleep(0.01)
        (status,) = rpc(server, "patchctx_storage_status")
        assert status["state"] == "prepared" and status["chain"] == [2], status

        # A long request runs across the pause: "keep" freezes it, resume finishes it.
        long_answer: dict[str, Any] = {}

        def long_request() -> None:
            long_answer["status"], long_answer["body"] = post(
                f"{server.url}/v1/completions",
                {
                    "model": server.model,
                    "prompt": [1, 2, 3],
                    "max_tokens": 48,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )

        runner = threading.Thread(target=long_request)
        runner.start()
        time.sleep(0.2)
        paused = time.perf_counter()
        assert post(f"{server.url}/pause?mode=keep", {})[0] == 200
        (applied,) = rpc(server, "patchctx_storage_apply", 60.0)
        assert post(f"{server.url}/resume", {})[0] == 200
        pause_seconds = time.perf_counter() - paused
        runner.join(timeout=120)
        assert applied["ok"] and applied["version"] == 2, applied
        assert applied["replayed"] > 0  # routes learnt while preparing: replayed in the pause
        assert applied["wait_ms"] < 100  # prepared before the pause: nothing left to wait for
        apply_seconds = applied["milliseconds"] / 1e3
        print(
            f"prepare {status['prepare_seconds'] * 1e3:.1f} ms (background), "
            f"apply {apply_seconds * 1e3:.1f} ms, paused window {pause_seconds * 1e3:.1f} ms"
        )
        assert apply_seconds <= pause_seconds < apply_seconds + 5.0  # HTTP round trips
        assert long_answer["status"] == 200, long_answer
        assert long_answer["body"]["usage"]["completion_tokens"] == 48  # not aborted

        after = completions(server)
        assert_same_generations(after, hf_greedy(expected))
        assert differ(after, old)
        result = compare(server, reference_checksums(expected))
        assert result["match"], result["mismatches"]

        # Version 3 with a corrupted data file: refused, nothing applied, then repaired.
        publisher.publish(trained(new_state, seed=4))
        (data,) = (store / "v00000003").glob("*.safetensors")
        good = data.read_bytes()
        data.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(StoredUpdateError, match="SHA-256"):
            sync_server(server.url, str(store))
        with urllib.request.urlopen(f"{server.url}/is_paused", timeout=30) as answer:
            assert json.loads(answer.read())["is_paused"] is False  # resumed after the refusal
        assert rpc(server, "patchctx_weight_version") == ["2"]  # the endpoint sends str()
        assert compare(server, reference_checksums(expected))["match"]
        data.write_bytes(good)
        repaired = sync_server(server.url, str(store))
        assert repaired["version"] == 3 and repaired["server_window_ms"] is not None


class Stream:
    """Greedy streamed completions sent back to back from a thread, each chunk timed."""

    def __init__(self, server: Server, max_tokens: int = 32) -> None:
        self.server, self.max_tokens = server, max_tokens
        self.arrivals: list[float] = []  # time.time() of every streamed chunk (new tokens)
        self.finished: list[int] = []  # tokens of every finished request
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        body = {
            "model": self.server.model,
            "prompt": [1, 2, 3],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            f"{self.server.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        tokens = 0
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[6:])
                if chunk["choices"]:  # one or more new tokens
                    self.arrivals.append(time.time())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        self.finished.append(tokens)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._one()
            except Exception as error:  # reported by the test
                self.errors.append(repr(error))
                return

    def between(self, start: float, end: float) -> int:
        return sum(start < t < end for t in self.arrivals)

    def largest_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in itertools.pairwise(inside)), default=0.0)


def test_generation_goes_on_while_a_sync_is_prepared_and_stops_only_for_the_pause(
    tmp_path: Path,
) -> None:
    """Requests stream tokens all along: during the prepare of a 20-version chain they keep
    arriving (from the old weights), during the paused window none is scheduled, and the
    engine's stall seen from the stream is about the window; afterwards completions are the
    new checkpoint's."""
    source = write_checkpoint("qwen2", tmp_path / "qwen2")
    write_tokenizer(source)
    store = tmp_path / "store"
    truth = read_checkpoint(source)
    publisher = StoragePublisher(store, anchor_every=100)
    publisher.publish(truth)
    extension = ["--worker-extension-cls", "patchctx.vllm.StorageWorkerExtension"]
    with vllm_serve(source, tmp_path / "server.log", extra_args=extension) as server:
        first = sync_server(server.url, str(store))  # no paused_apply: three requests
        assert first["version"] == 1 and first["server_window_ms"] is None
        state = truth
        for seed in range(20):  # versions 2 to 21: one chain for the workers to prepare
            state = trained(state, seed=100 + seed)
            publisher.publish(state)
        expected = write_checkpoint_tensors(source, state, tmp_path / "step-21")
        stream = Stream(server)
        stream.thread.start()
        deadline = time.monotonic() + 60
        while len(stream.arrivals) < 5:  # generating
            assert not stream.errors and time.monotonic() < deadline, stream.errors
            time.sleep(0.01)
        (started,) = rpc(server, "patchctx_storage_prepare", str(store))
        assert started["state"] == "preparing"
        while rpc(server, "patchctx_storage_status")[0]["state"] == "preparing":
            time.sleep(0.01)
        (status,) = rpc(server, "patchctx_storage_status")
        assert status["state"] == "prepared" and status["chain"] == list(range(2, 22)), status
        began, ended = status["prepare_began_at"], status["prepare_ended_at"]
        during_prepare = stream.between(began, ended)
        time.sleep(0.5)
        paused_at = time.time()
        before_pause = stream.between(paused_at - 0.5, paused_at)
        assert post(f"{server.url}/pause?mode=keep", {})[0] == 200
        pause_answered = time.time()
        (applied,) = rpc(server, "patchctx_storage_apply", 60.0)
        time.sleep(0.5)  # held paused longer than the apply: nothing may be generated
        resume_sent = time.time()
        assert post(f"{server.url}/resume", {})[0] == 200
        resumed = time.time()
        time.sleep(0.3)
        stream.stop.set()
        stream.thread.join(timeout=120)
        assert not stream.errors, stream.errors
        assert applied["ok"] and applied["version"] == 21, applied
        assert applied["wait_ms"] < 100 and applied["replayed"] > 0, applied
        window = resumed - paused_at
        print(
            f"prepare {ended - began:.3f} s in the background, {during_prepare} tokens "
            f"streamed meanwhile; apply {applied['milliseconds']:.1f} ms, window {window:.3f} s"
        )
        # Generation went on while the chain was prepared.
        assert during_prepare >= 1, (ended - began, stream.arrivals[-20:])
        # Inside the window nothing is scheduled: in half a second of pause at most the
        # outputs already on their way arrive (vLLM waits 20 ms for them before it answers;
        # this process's reader may lag), against the tokens of the half second before.
        assert before_pause >= 5, before_pause
        assert stream.between(pause_answered, resume_sent) <= 2
        # The stall the stream saw is the window, not the prepare: its largest gap around the
        # pause spans the apply and is at most the window plus one token's scheduling.
        gap = stream.largest_gap(paused_at - 5.0, resumed + 5.0)
        assert applied["milliseconds"] / 1e3 <= gap < window + 1.0, (gap, window)
        assert window < applied["milliseconds"] / 1e3 + 0.5 + 5.0  # the sleep, HTTP round trips
        # Every request finished whole (those frozen by the pause too).
        assert stream.finished and all(n == stream.max_tokens for n in stream.finished)
        after = completions(server)
        assert_same_generations(after, hf_greedy(expected))
        assert compare(server, reference_checksums(expected))["match"]
