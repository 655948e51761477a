"""``vllm serve`` at tensor-parallel size 2 with the ``patchctx`` backend: two workers.

Each worker receives the same payload (one shared-memory file, or inline) and applies it to
its own shard through the model's loaders. After each update the greedy completions equal
``transformers`` on the patched checkpoint, and the checksums of both shards equal what
vLLM's own ``reload_weights`` of the patched checkpoint gives on the same server (a fresh
load by vLLM's loaders, at the same sharding). A refusal on the workers names the rank and
leaves both shards as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from patchctx import InvalidPatchError
from patchctx.vllm import (
    HTTPWeightSyncClient,
    PatchctxTrainerEngine,
    PatchctxTrainerInitInfo,
    UpdateConflictError,
    WeightVersionError,
)
from tests.vllm.support.checkpoints import (
    checkpoint_aliases,
    read_checkpoint,
    write_checkpoint,
    write_checkpoint_tensors,
)
from tests.vllm.support.engine import assert_same_generations, hf_greedy
from tests.vllm.support.patches import apply_to_checkpoint, dense, sparse
from tests.vllm.support.serve import (
    Server,
    checksums,
    completions,
    post,
    vllm_serve,
    write_tokenizer,
)


@pytest.fixture(scope="module")
def server_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("serve-tp2")
    source = write_checkpoint("qwen2", root / "qwen2", seed=3)
    write_tokenizer(source)
    # No layout switch: both workers keep vLLM's prepacked kernels and repack after patches.
    with vllm_serve(
        source, root / "server.log", tensor_parallel_size=2, keep_layout=False
    ) as server:
        yield server, source


def reload(server: Server, directory: Path) -> None:
    status, answer = post(
        f"{server.url}/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
    )
    assert status == 200, answer


def test_two_workers_apply_updates_over_http(
    server_tp2: tuple[Server, Path], tmp_path: Path
) -> None:
    server, source = server_tp2
    client = HTTPWeightSyncClient(server.url, timeout=120)
    keys = checksums(server)
    assert {key.split(":")[3] for key in keys} == {"tp0", "tp1"}
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, inline_below=4096), client=client
    )
    truth = read_checkpoint(source)
    aliases = checkpoint_aliases(truth)
    names = sorted(truth)
    shapes = {n: tuple(truth[n].shape) for n in names}
    matrices = [n for n in names if len(shapes[n]) > 1]
    updates = [
        [sparse(n, shapes[n], density=0.03, seed=20 + i) for i, n in enumerate(matrices)],
        [dense(n, shapes[n], seed=40 + i) for i, n in enumerate(names) if len(shapes[n]) == 1]
        + [sparse("lm_head.weight", shapes["model.embed_tokens.weight"], density=0.2, seed=60)],
    ]
    for step, patches in enumerate(updates, start=1):
        stats = trainer.send_weights(patches)
        assert stats is not None and stats.version == str(step)
        truth = apply_to_checkpoint(truth, patches, aliases)
        expected = write_checkpoint_tensors(source, truth, tmp_path / f"step-{step}")
        assert_same_generations(completions(server), hf_greedy(expected))
        patched = checksums(server)
        reload(server, expected)  # vLLM's own fresh load of the patched checkpoint
        assert checksums(server) == patched
    # A refusal: both workers refuse before writing; the error names a rank.
    baseline = checksums(server)
    trainer.version = "stale"
    with pytest.raises(WeightVersionError, match=r"\[patchctx rank [01]: WeightVersionError\]"):
        trainer.send_weights(updates[0])
    assert checksums(server) == baseline
    trainer.version = "2"
    with pytest.raises(InvalidPatchError, match=r"\[patchctx rank [01]: InvalidPatchError\]"):
        trainer.send_weights([dense("model.layers.5.mlp.down_proj.weight", (64, 128), seed=1)])
    assert checksums(server) == baseline
    assert client.get_weight_version() == "2"
    # vLLM answers every later request with its own answer (refusals are raised by the last
    # worker only: see patchctx.vllm._backend.agree), and the next update applies.
    stats = trainer.send_weights(updates[0][:2])
    assert stats is not None and client.get_weight_version() == "3"
    assert checksums(server) != baseline
    # A trainer that dies after the first chunk of an update: the next one's init is refused
    # on both workers while it is open; a takeover ends it on both (nothing of it written)
    # and updates as usual.
    baseline = checksums(server)
    client.start_weight_update()
    trainer.send_weight_chunk(updates[1][:3], last=False)
    with pytest.raises(UpdateConflictError, match="takeover=True"):
        PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(rank=0, inline_below=4096), client=client
        )
    assert checksums(server) == baseline
    successor = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, inline_below=4096, takeover=True), client=client
    )
    assert checksums(server) == baseline and successor.version == "3"
    stats = successor.send_weights(updates[0][2:4])
    assert stats is not None and client.get_weight_version() == "4"
