"""``vllm serve`` with the ``patchctx`` weight-transfer backend, driven over HTTP.

One real server per module (``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1,
a tiny Qwen2 with tied embeddings, TP=1), started with nothing but
``--weight-transfer-config '{"backend": "patchctx"}'``: the backend comes from patchctx's
``vllm.general_plugins`` entry point. This test process is the trainer
(`PatchctxTrainerEngine` with `HTTPWeightSyncClient`); payloads travel through shared memory
or inline in the request. After every update, greedy completions from ``/v1/completions``
equal ``transformers`` on the patched checkpoint, and ``/weight_checker`` ``compare`` passes
against the checksums of the patched checkpoint freshly loaded by vLLM. Refused updates leave
the served weights as they were, by checksum.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from patchctx import InvalidPatchError, PatchError
from patchctx.vllm import (
    HTTPWeightSyncClient,
    PatchctxTrainerEngine,
    PatchctxTrainerInitInfo,
    UpdateConflictError,
    WeightVersionError,
    encode_patches,
)
from patchctx.vllm._transport import digest
from tests.vllm.support.checkpoints import (
    checkpoint_aliases,
    read_checkpoint,
    write_checkpoint,
    write_checkpoint_tensors,
)
from tests.vllm.support.engine import assert_same_generations, differ, hf_greedy
from tests.vllm.support.patches import Patch, apply_to_checkpoint, dense, sparse
from tests.vllm.support.serve import (
    Server,
    checksums,
    compare,
    completions,
    post,
    reference_checksums,
    vllm_serve,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    """The server, the checkpoint it started from, and what it should hold now."""

    server: Server
    source: Path
    work: Path
    truth: dict[str, torch.Tensor]
    aliases: dict[str, str]
    steps: int = 0
    transports: set[str] = field(default_factory=set)

    def client(self) -> HTTPWeightSyncClient:
        return HTTPWeightSyncClient(self.server.url, timeout=120)

    def trainer(self, **options: Any) -> PatchctxTrainerEngine:
        info = PatchctxTrainerInitInfo(rank=0, inline_below=4096, **options)
        return PatchctxTrainerEngine.trainer_init(info, client=self.client())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.truth[self.aliases.get(name, name)].shape)

    def expected(self, patches: list[Patch]) -> Path:
        """Apply `patches` to the truth and write it as a checkpoint (returned)."""
        self.truth = apply_to_checkpoint(self.truth, patches, self.aliases)
        self.steps += 1
        return write_checkpoint_tensors(self.source, self.truth, self.work / f"step-{self.steps}")

    def check(self, expected: Path) -> None:
        """The server serves the checkpoint at `expected`: completions and checksums."""
        assert_same_generations(completions(self.server), hf_greedy(expected))
        result = compare(self.server, reference_checksums(expected))
        assert result["match"], result["mismatches"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve")
    source = write_checkpoint("qwen2", root / "qwen2")
    write_tokenizer(source)
    # As the docs start it: no layout switch (vLLM's prepacked kernels, repacked after patches).
    with vllm_serve(source, root / "server.log", keep_layout=False) as server:
        yield Served(
            server=server,
            source=source,
            work=root,
            truth=read_checkpoint(source),
            aliases=checkpoint_aliases(read_checkpoint(source)),
        )


def test_updates_over_http_equal_transformers_and_a_fresh_load(served: Served) -> None:
    client = served.client()
    assert client.get_weight_version() == "default"
    assert_same_generations(completions(served.server), hf_greedy(served.source))
    trainer = served.trainer()
    names = sorted(served.truth)
    matrices = [n for n in names if served.truth[n].ndim > 1]
    vectors = [n for n in names if served.truth[n].ndim == 1]
    updates: list[tuple[str, list[Patch]]] = [
        (
            "sparse",
            [sparse(n, served.shape(n), density=0.02, seed=i) for i, n in enumerate(matrices)],
        ),
        ("dense", [dense(n, served.shape(n), seed=100 + i) for i, n in enumerate(vectors)]),
        (
            "mixed",
            [dense(matrices[1], served.shape(matrices[1]), seed=200)]
            + [
                sparse(n, served.shape(n), density=0.1, seed=300 + i)
                for i, n in enumerate(matrices[2:6])
            ]
            + [dense(vectors[0], served.shape(vectors[0]), seed=400)],
        ),
        # the LM head of a tied model: loaded under the embedding's name, small enough to
        # travel inline in the request
        ("tied", [sparse("lm_head.weight", served.shape("lm_head.weight"), density=0.005, seed=5)]),
    ]
    before = completions(served.server)
    # The mixed update goes in several update_weights chunks, applied whole at its finish.
    for step, (kind, patches) in enumerate(updates, start=1):
        trainer.init_info.chunk_bytes = 2048 if kind == "mixed" else None
        stats = trainer.send_weights(patches)
        assert stats is not None and stats.version == str(step), (kind, stats)
        served.transports.update(stats.transport.split("+"))
        assert client.get_weight_version() == str(step)
        served.check(served.expected(patches))
        print(
            f"{kind}: {stats.patches} patches, {stats.nbytes} B by {stats.transport}, "
            f"update {stats.update_ms:.1f} ms"
        )
    # Step 5: the trainer's diff of two state dicts (bf16-free here: float32 both sides).
    trainer.remember(served.truth)
    trained = {name: tensor.clone() for name, tensor in served.truth.items()}
    generator = torch.Generator().manual_seed(6)
    for name in matrices[::3]:
        mask = torch.rand(trained[name].shape, generator=generator) < 0.03
        trained[name] += mask * torch.randn(trained[name].shape, generator=generator)
    stats = trainer.send_state_dict(trained)
    assert stats is not None and stats.patches == len(matrices[::3]) and stats.diff_ms > 0
    served.truth = trained
    served.steps += 1
    served.check(write_checkpoint_tensors(served.source, trained, served.work / "step-diff"))
    assert served.transports == {"shm", "inline"}
    assert differ(completions(served.server), before)


def rewrite_header(payload: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The payload with its safetensors header edited (the data kept as it is)."""
    (length,) = struct.unpack_from("<Q", payload)
    header = json.loads(payload[8 : 8 + length])
    data = payload[8 + length :]
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def test_refused_updates_leave_the_served_weights_unchanged(served: Served) -> None:
    client = served.client()
    baseline, version = checksums(served.server), client.get_weight_version()
    served_before = completions(served.server)
    trainer = served.trainer(transport="shm")
    norm = dense("model.norm.weight", served.shape("model.norm.weight"), seed=7)
    qkv = "model.layers.0.self_attn.q_proj.weight"

    def unchanged() -> None:
        assert checksums(served.server) == baseline
        assert client.get_weight_version() == version

    def raw_update(payload: bytes, **info: Any) -> None:
        """One update whose descriptor the test writes itself (as the connected trainer)."""
        client.start_weight_update()
        try:
            client.update_weights(
                {
                    "nbytes": len(payload),
                    "sha256": digest(payload),
                    "update_id": f"raw-{len(payload)}",
                    "trainer_id": trainer.trainer_id,
                    **info,
                }
            )
        finally:
            # vLLM ends the update when update_weights fails: then this fails too
            with contextlib.suppress(Exception):
                client.finish_weight_update()

    # A stale base version: made against weights the server no longer holds.
    trainer.version = "stale"
    with pytest.raises(WeightVersionError, match=r"^\[patchctx rank 0: WeightVersionError\]"):
        trainer.send_weights([norm])
    unchanged()
    trainer.version = version

    good = encode_patches([norm], base_version=version, target_version="never")
    inline = {"inline": base64.b64encode(good).decode()}
    cut = good[:-9]
    retyped = rewrite_header(good, lambda h: h["0.values"].update(dtype="F16"))
    tied_bias = dense("lm_head.bias", (200,), seed=9)
    out_of_range = Patch(qkv, served.shape(qkv), torch.float32, torch.ones(1), torch.tensor([4096]))
    # Truncated in transit: the digest no longer matches, or the payload ends too early.
    cases: list[tuple[str, Callable[[], object], type[Exception], str]] = [
        (
            "truncated",
            lambda: raw_update(cut, inline=base64.b64encode(cut).decode()),
            InvalidPatchError,
            "malformed patch payload",
        ),
        (
            "corrupt",
            lambda: raw_update(good, sha256="0" * 64, **inline),
            InvalidPatchError,
            "SHA-256",
        ),
        (
            "wrong dtype in the header",
            lambda: raw_update(retyped, inline=base64.b64encode(retyped).decode()),
            InvalidPatchError,
            "",
        ),
        (
            "unknown name",
            lambda: trainer.send_weights(
                [sparse("model.layers.7.mlp.up_proj.weight", (128, 64), density=0.1, seed=8)]
            ),
            InvalidPatchError,
            "'model.layers.7.mlp.up_proj.weight': is not a tensor of the checkpoint",
        ),
        (
            "a name the model skips",
            lambda: trainer.send_weights([norm, tied_bias]),
            InvalidPatchError,
            "'lm_head.bias': is not a tensor of the checkpoint",
        ),
        (
            "wrong shape",
            lambda: trainer.send_weights([norm, dense("model.norm.weight", (65,), seed=10)]),
            PatchError,
            "",
        ),
        (
            "index out of range",
            lambda: trainer.send_weights([norm, out_of_range]),
            InvalidPatchError,
            "out of range",
        ),
    ]
    for what, call, error, fragment in cases:
        with pytest.raises(error, match=r"\[patchctx rank 0: \w+\]") as raised:
            call()
        assert fragment in str(raised.value), (what, str(raised.value))
        unchanged()
    # A payload file cut short (a trainer that died while writing it): refused.
    path = Path("/dev/shm") / "patchctx-test-cut-short"
    path.write_bytes(good[: len(good) // 2])
    try:
        with pytest.raises(InvalidPatchError, match="truncated"):
            raw_update(b"", shm=path.name, nbytes=len(good), sha256=digest(good))
    finally:
        gone = not path.exists()  # the worker deletes a payload file once read
        path.unlink(missing_ok=True)
    assert gone
    unchanged()
    assert_same_generations(completions(served.server), served_before, atol=1e-6)


def test_a_trainer_killed_mid_update_changes_nothing(served: Served) -> None:
    client = served.client()
    baseline, version = checksums(served.server), client.get_weight_version()
    qkv = "model.layers.1.self_attn.q_proj.weight"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.vllm.support.trainer_job",
            served.server.url,
            qkv,
            json.dumps(served.shape(qkv)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert job.returncode == -9 and "first chunk sent" in job.stdout, job.stdout + job.stderr
    assert checksums(served.server) == baseline
    assert client.get_weight_version() == version
    # The next trainer cannot connect while the dead one's update is open; taking over rolls
    # it back (none of it was applied) and it updates as usual.
    with pytest.raises(UpdateConflictError, match="takeover=True"):
        served.trainer()
    assert checksums(served.server) == baseline
    trainer = served.trainer(takeover=True)
    patches = [sparse(qkv, served.shape(qkv), density=0.05, seed=11)]
    stats = trainer.send_weights(patches)
    assert stats is not None and stats.version == client.get_weight_version()
    served.check(served.expected(patches))


def test_one_owner_per_update_over_http_and_a_trainer_killed_before_its_finish(
    served: Served,
) -> None:
    """Two trainers against one server: the second cannot join or end the first's open
    update, takes it over explicitly (rolled back whole), and the first's last chunk is then
    refused; a trainer killed after its last chunk, before its finish, changes nothing and
    leaves nothing in /dev/shm. ``/weight_info`` names the served weights throughout."""
    client = served.client()
    qkv = "model.layers.1.self_attn.q_proj.weight"
    norm = "model.norm.weight"
    baseline, version = checksums(served.server), client.get_weight_version()
    shm_before = set(Path("/dev/shm").glob("patchctx-*"))

    def unchanged() -> None:
        assert checksums(served.server) == baseline
        assert client.get_weight_version() == version

    first = served.trainer(transport="shm")
    client.start_weight_update()
    first.send_weight_chunk([sparse(qkv, served.shape(qkv), density=0.05, seed=21)], last=False)
    with pytest.raises(UpdateConflictError, match=r"\[patchctx rank 0: UpdateConflictError\]"):
        served.trainer()
    unchanged()
    second = served.trainer(takeover=True)
    # The first trainer's session ended with the takeover: vLLM refuses its chunk itself
    # (were a session open, the worker would: not the connected trainer).
    with pytest.raises((UpdateConflictError, RuntimeError), match=r"start_weight_update|connect"):
        first.send_weight_chunk([dense(norm, served.shape(norm), seed=22)], last=True)
    unchanged()
    patches = [sparse(qkv, served.shape(qkv), density=0.05, seed=23)]
    stats = second.send_weights(patches)
    assert stats is not None and client.get_weight_version() == stats.version
    served.check(served.expected(patches))
    baseline, version = checksums(served.server), client.get_weight_version()
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.vllm.support.trainer_job",
            served.server.url,
            qkv,
            json.dumps(served.shape(qkv)),
            "last",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert job.returncode == -9 and "last chunk sent" in job.stdout, job.stdout + job.stderr
    unchanged()  # its update was complete, but never finished: nothing applied
    assert set(Path("/dev/shm").glob("patchctx-*")) <= shm_before  # nothing left behind
    third = served.trainer(takeover=True)
    patches = [dense(norm, served.shape(norm), seed=24)]
    stats = third.send_weights(patches)
    assert stats is not None and client.get_weight_version() == stats.version
    served.check(served.expected(patches))


def test_patches_after_vllms_own_reload_weights(served: Served) -> None:
    client = served.client()
    # vLLM reloads the original checkpoint in place (layerwise reload under the hood) ...
    status, answer = post(
        f"{served.server.url}/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(served.source)}},
    )
    assert status == 200, answer
    served.truth = read_checkpoint(served.source)
    assert compare(served.server, reference_checksums(served.source))["match"]
    client.request("update_weight_version", {"new_version": "reloaded"})
    # ... and patches keep working: no weight is mistaken for one the engine transformed,
    # and the layout switch outlived start-up. The workers' record still names the weights
    # before the reload: the trainer declares the reload's version as theirs (adopt).
    with pytest.raises(WeightVersionError, match="declares its state"):
        served.trainer()
    trainer = served.trainer(adopt_version=True)
    assert trainer.version == "reloaded"
    # Every tensor: the norms are the weights a reload used to make look replaced.
    patches = [
        sparse(n, served.shape(n), density=0.02, seed=600 + i)
        if served.truth[n].ndim > 1
        else dense(n, served.shape(n), seed=600 + i)
        for i, n in enumerate(sorted(served.truth))
    ]
    stats = trainer.send_weights(patches)
    assert stats is not None and stats.version == "reloaded.1"
    served.check(served.expected(patches))


def test_the_first_example_of_the_vllm_page_runs_against_a_server(served: Served) -> None:
    """docs/vllm.md's first Python block, run as written against this module's server (its
    URL substituted), on the weights the server started with; the output it shows."""
    from tests.support.examples import OUTPUT, parse_fences

    fence = next(f for f in parse_fences(ROOT / "docs" / "vllm.md") if f.lang == "python")
    code = "\n".join(fence.lines).replace("http://127.0.0.1:8000", served.server.url)
    shown = [m.group("text") or "" for line in fence.lines if (m := OUTPUT.match(line))]
    status, answer = post(
        f"{served.server.url}/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(served.source)}},
    )
    assert status == 200, answer
    served.client().request("update_weight_version", {"new_version": "default"})
    served.trainer(adopt_version=True)  # the reload's version, declared to the workers
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, fence.where, "exec"), {"checkpoint_dir": str(served.source)})
    assert output.getvalue().splitlines() == shown
