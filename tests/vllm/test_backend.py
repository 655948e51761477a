"""The ``patchctx`` backend without a server: the worker engine on a small model, the trainer
engine against it through an in-process client, every transport (NCCL through a loopback
communicator that stands for a NCCL group on CPU), chunks, refusals, the error marks."""

from __future__ import annotations

import queue
import threading
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from patchctx import (
    CheckpointWeightPatch,
    InvalidPatchError,
    LoaderContractError,
    PatchError,
    UpdateCost,
    diff_state_dicts,
)
from patchctx.vllm import (
    NCCLTransport,
    PatchctxInitInfo,
    PatchctxTrainerEngine,
    PatchctxTrainerInitInfo,
    PatchctxWeightTransferEngine,
    SharedMemoryTransport,
    UpdateConflictError,
    WeightVersionError,
    encode_patches,
)
from patchctx.vllm._backend import raise_worker_error, worker_error
from patchctx.vllm._plugin import register
from patchctx.vllm._transport import digest


class Model(torch.nn.Module):
    """Two parameters; `load_weights` knows their names and skips ``skipped``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "skipped":
                continue
            getattr(self, name).copy_(tensor)
            loaded.add(name)
        return loaded


def worker_engine() -> PatchctxWeightTransferEngine:
    parallel = SimpleNamespace(rank=0, pipeline_parallel_size=1)
    config = SimpleNamespace(parallel_config=parallel, model_config=None)
    return PatchctxWeightTransferEngine(None, config, torch.device("cpu"), Model())


class LocalClient:
    """vLLM's weight-sync client protocol, calling a worker engine in this process the way
    vLLM 0.32's worker does (``vllm/v1/worker/gpu_worker.py``): a start while a session is
    active is refused; a failed update_weights ends the session; a finish that raises leaves
    vLLM's flag as the engine left it, and the version is set only when finish returns."""

    def __init__(self, engine: PatchctxWeightTransferEngine) -> None:
        self.engine = engine
        engine.worker = self  # the engine ends the session on vLLM's worker, as there
        self.version = "default"
        self._weight_update_active = False
        self.unmatched = 0  # finish_weight_update calls without an active update

    @property
    def active(self) -> bool:
        return self._weight_update_active

    @active.setter
    def active(self, value: bool) -> None:
        self._weight_update_active = value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is active")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.active:  # vLLM's worker raises, and a multi-worker engine goes astray
            self.unmatched += 1
            raise RuntimeError("finish_weight_update called without a matching start")
        self.engine.finish_weight_update()
        self.active = False
        if weight_version is not None:
            self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version


def sparse(name: str, shape: tuple[int, ...], values: list[float], indices: list[int]) -> Any:
    return CheckpointWeightPatch(
        name, shape, torch.float32, torch.tensor(values), torch.tensor(indices)
    )


def test_the_plugin_registers_both_engines_once() -> None:
    register()
    register()
    assert WeightTransferEngineFactory._registry["patchctx"]() is PatchctxWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["patchctx"]() is PatchctxTrainerEngine
    info = PatchctxTrainerInitInfo(transport="inline", rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LocalClient(worker_engine()))
    assert isinstance(engine, PatchctxTrainerEngine)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_updates_through_the_trainer_engine(transport: str, tmp_path: Any) -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    info = PatchctxTrainerInitInfo(
        transport=transport, rank=0, shm_dir=str(tmp_path), inline_below=0
    )
    trainer = PatchctxTrainerEngine.trainer_init(info, client=client)
    stats = trainer.send_weights([sparse("w", (4, 4), [1.0, 2.0], [0, 15])])
    assert stats is not None and stats.transport == transport and stats.version == "1"
    stats = trainer.send_weights([sparse("w", (4, 4), [3.0], [5])])  # replayed
    assert worker.last_stats is not None and worker.last_stats["replayed"] == 1
    assert worker.model.w.view(-1)[[0, 5, 15]].tolist() == [1.0, 3.0, 2.0]
    assert (worker.patcher.version, client.version) == ("2", "2")
    # Both updates went through one pooled file (written again only after the first one's
    # finish returned); the trainer deletes it at shutdown.
    if transport == "shm":
        [pooled] = tmp_path.iterdir()
        assert "-pool-" in pooled.name
    trainer.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_on_the_worker_changes_nothing_and_names_class_and_rank() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    good = sparse("w", (4, 4), [1.0], [3])
    with pytest.raises(InvalidPatchError, match=r"^\[patchctx rank 0: InvalidPatchError\] "):
        trainer.send_weights([good, sparse("skipped", (4,), [1.0], [0])])
    with pytest.raises(PatchError, match=r"out of range"):
        trainer.send_weights([good, sparse("b", (4,), [1.0], [4])])
    assert not worker.model.w.any() and worker.patcher.version == "default"
    assert client.unmatched == 0  # vLLM ended those updates itself: not ended again
    trainer.version = "elsewhere"
    with pytest.raises(WeightVersionError):
        trainer.send_weights([good])
    assert not worker.model.w.any()


def test_a_send_that_fails_on_the_trainer_ends_the_update_and_the_next_one_lands() -> None:
    """A patch the codec cannot encode (complex64) fails after the update started: the update
    must end on the workers (vLLM refuses to start another while one is active), without a
    version, so that the next send goes through."""
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0, chunk_bytes=1), client=client
    )
    unencodable = CheckpointWeightPatch(
        "z", (2,), torch.complex64, torch.ones(2, dtype=torch.complex64)
    )
    with pytest.raises(InvalidPatchError, match="cannot be encoded"):
        # The first chunk is held by the worker; the second cannot be encoded.
        trainer.send_weights([sparse("w", (4, 4), [1.0], [3]), unencodable])
    assert not client.active and client.unmatched == 0
    assert not worker.model.w.any()
    assert (worker.patcher.version, client.version, trainer.version) == ("default",) * 3
    stats = trainer.send_weights([sparse("w", (4, 4), [2.0], [5])])
    assert stats is not None and stats.version == "1"
    assert worker.model.w.view(-1)[[3, 5]].tolist() == [0.0, 2.0]


def test_the_trainer_remembers_integer_tensors_exactly_whatever_its_float_dtype() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0, dtype=torch.bfloat16), client=client
    )
    trainer.remember({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(4), "steps": torch.tensor([257])}
    trainer.remember(state)
    assert trainer.sent["steps"].dtype == torch.int64 and trainer.sent["steps"].item() == 257
    assert trainer.sent["w"].dtype == torch.bfloat16
    changed = dict(state, steps=torch.tensor([256]), w=torch.ones(4, 4))
    diff = [p.name for p in diff_state_dicts(trainer.sent, changed, dtype=torch.bfloat16)]
    assert sorted(diff) == ["steps", "w"]  # 257 -> 256 is seen (bf16 would round both to 256)


def test_chunks_apply_together_with_the_last_and_not_without_it() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    client.start_weight_update()
    trainer.send_weight_chunk([sparse("w", (4, 4), [1.0], [0])], last=False)
    assert not worker.model.w.any()  # held, not applied
    trainer.send_weight_chunk([sparse("b", (4,), [2.0], [1])], last=True)
    client.finish_weight_update(trainer.version)
    assert worker.model.w[0, 0] == 1.0 and worker.model.b[1] == 2.0
    # An update whose last chunk never comes (its trainer died): a new trainer's init is
    # refused while it is open; a takeover rolls it back (nothing was written) and the new
    # trainer updates as usual.
    client.start_weight_update()
    trainer.send_weight_chunk([sparse("w", (4, 4), [9.0], [1])], last=False)
    with pytest.raises(UpdateConflictError, match="takeover=True"):
        PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
        )
    assert len(worker.pending) == 1 and client.active
    again = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0, takeover=True), client=client
    )
    assert worker.pending == [] and worker.model.w[0, 1] == 0.0 and not client.active
    assert again.send_weights([sparse("w", (4, 4), [5.0], [2])]) is not None
    assert worker.model.w[0, 1] == 0.0 and worker.model.w[0, 2] == 5.0


def test_malformed_update_info_and_payloads_are_invalid_patch_errors() -> None:
    worker = worker_engine()
    worker.init_transfer_engine(PatchctxInitInfo(transport="inline"))
    payload = encode_patches([sparse("w", (4, 4), [1.0], [0])], base_version="default")
    for info in (
        {"nbytes": "3", "sha256": "x", "inline": ""},
        {"nbytes": 1, "sha256": "x", "unknown": 1},
        {"nbytes": len(payload), "sha256": digest(payload)},  # no transport but inline
        {"nbytes": len(payload), "sha256": digest(payload), "inline": "not base64!"},
        {
            "nbytes": len(payload),
            "sha256": "0" * 64,
            "inline": __import__("base64").b64encode(payload).decode(),
        },
    ):
        worker.start_weight_update()
        with pytest.raises(InvalidPatchError, match=r"^\[patchctx rank 0: InvalidPatchError\]"):
            worker.update_weights(info)
    assert not worker.model.w.any()


class Loopback:
    """Stands for a NCCL group of two ranks on CPU: what rank 0 broadcasts, the other
    receives (each side holds one end)."""

    def __init__(self, wire: queue.Queue[torch.Tensor], sender: bool) -> None:
        self.wire, self.sender, self.device = wire, sender, torch.device("cpu")
        self.destroyed = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0
        if self.sender:
            self.wire.put(tensor.clone())
        else:
            tensor.copy_(self.wire.get(timeout=30))

    def destroy(self) -> None:
        self.destroyed = True


class ThreadedClient(LocalClient):
    """vLLM's RPC on another thread, as over HTTP: update_weights blocks in the receive
    until the trainer's concurrent transmit."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        errors: list[BaseException] = []

        def call() -> None:
            try:
                LocalClient.update_weights(self, update_info)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive()
        if errors:
            raise errors[0]


def test_nccl_transport_broadcasts_while_update_weights_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.weight_transfer import nccl_common

    wire: queue.Queue[torch.Tensor] = queue.Queue()
    seen: dict[str, Any] = {}

    def worker_group(info: Any, parallel_config: Any) -> Loopback:
        seen["worker"] = (info.master_address, info.master_port, info.rank_offset, info.world_size)
        return Loopback(wire, sender=False)

    def trainer_group(rendezvous: Any) -> Loopback:
        seen["trainer"] = (rendezvous.master_address, rendezvous.master_port, rendezvous.world_size)
        return Loopback(wire, sender=True)

    monkeypatch.setattr(nccl_common, "worker_init_process_group", worker_group)
    monkeypatch.setattr(nccl_common, "trainer_init", trainer_group)
    worker = worker_engine()
    info = PatchctxTrainerInitInfo(
        transport="nccl",
        rank=0,
        master_address="127.0.0.1",
        master_port=29555,
        world_size=2,
        inline_below=0,
    )
    trainer = PatchctxTrainerEngine.trainer_init(info, client=ThreadedClient(worker))
    # The rendezvous vLLM's sparse_nccl uses: the trainer is rank 0, workers from 1.
    assert seen == {"worker": ("127.0.0.1", 29555, 1, 2), "trainer": ("127.0.0.1", 29555, 2)}
    assert isinstance(worker.transport, NCCLTransport)
    stats = trainer.send_weights([sparse("w", (4, 4), [7.0, 8.0], [1, 2])])
    assert stats is not None and stats.transport == "nccl"
    assert worker.model.w.view(-1)[:3].tolist() == [0.0, 7.0, 8.0]
    trainer.shutdown()
    worker.shutdown()
    assert worker.transport is None


def test_shared_memory_reads_refuse_links_and_other_names(tmp_path: Any) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"secret")
    (tmp_path / "patchctx-link").symlink_to(target)
    transport = SharedMemoryTransport(tmp_path)
    for name in ("patchctx-link", "secret", "patchctx-missing", "../patchctx-x", None):
        with pytest.raises(InvalidPatchError):
            transport.receive({"shm": name})


@pytest.mark.parametrize(
    "error",
    [
        InvalidPatchError("bad"),
        LoaderContractError("refused"),
        WeightVersionError("stale", expected="1", found="2"),
        RuntimeError("boom"),
    ],
)
def test_error_marks_survive_vllms_text_wrapping(error: Exception) -> None:
    marked = worker_error(error, rank=3)
    text = (
        "Call to collective_rpc method failed: Worker failed with error "
        f"'{marked}', please check the stack trace above for the root cause"
    )
    expected = type(error) if isinstance(error, PatchError) else PatchError
    with pytest.raises(expected) as raised:
        raise_worker_error(text)
    assert type(raised.value) is expected
    assert str(raised.value) == f"[patchctx rank 3: {type(error).__name__}] {error}"


def test_a_weight_source_is_diffed_against_what_was_last_sent() -> None:
    from vllm.distributed.weight_transfer import ModuleSource

    worker = worker_engine()
    trainer_model = Model()  # the trainer's copy, in step with the worker's
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0),
        client=LocalClient(worker),
        source=ModuleSource(trainer_model),
    )
    with torch.no_grad():
        trainer_model.w[1, 2] = 0.5  # a training step
    stats = trainer.send_weights()
    assert stats is not None and stats.patches == 1 and stats.diff_ms > 0
    assert torch.equal(worker.model.w, trainer_model.w)
    assert trainer.send_weights() is not None and worker.patcher.version == "2"  # nothing new


def test_the_trainer_chooses_sparse_or_dense_by_its_cost_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 4x4 weight with one change: by wire bytes it goes sparse, by the default cost model
    # (one more dense patch costs less than one more sparse one) dense; the worker ends with
    # the same weights either way, and the stats say which form it sent.
    from patchctx.vllm import _sending

    encoded: list[Any] = []

    plan = _sending.plan_payload  # type: ignore[attr-defined]  # (the name the trainer calls)

    def spy(patches: Any, **kwargs: Any) -> Any:
        encoded.append(list(patches))
        return plan(patches, **kwargs)

    monkeypatch.setattr(_sending, "plan_payload", spy)
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    for cost, sparse in ((None, True), (UpdateCost(), False)):
        worker = worker_engine()
        trainer = PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(transport="inline", rank=0, cost=cost),
            client=LocalClient(worker),
        )
        trainer.remember(state)
        changed = dict(state, w=state["w"].clone())
        changed["w"][1, 2] = 0.5
        stats = trainer.send_state_dict(changed)
        assert stats is not None
        [patch] = encoded[-1]
        assert (patch.indices is not None) is sparse, cost
        # the stats say what went whole: the 16 fp32 values of a dense patch, else nothing
        assert stats.dense_nbytes == (0 if sparse else 16 * 4), stats
        assert torch.equal(worker.model.w, changed["w"])


@pytest.mark.parametrize(("transport", "dense"), [("shm", True), ("inline", False)])
def test_the_trainers_cost_model_prices_positions_as_its_transport_sends_them(
    transport: str, dense: bool, tmp_path: Any
) -> None:
    # 10 of a 4x4 fp32 weight's 16 elements changed, only payload bytes costing. Inline the
    # positions travel smallest (a 2-byte bitmask: 42 bytes against 64 dense): sparse. Over
    # shared memory they travel flat (int32: 80 bytes): dense, and the worker ends the same.
    free = {f.name: 0.0 for f in fields(UpdateCost) if f.name != "link_bytes_per_second"}
    cost = UpdateCost(**{**free, "payload_seconds_per_byte": 1e-9, "link_bytes_per_second": 1e12})
    worker = worker_engine()
    info = PatchctxTrainerInitInfo(
        transport=transport, rank=0, shm_dir=str(tmp_path), inline_below=0, cost=cost
    )
    trainer = PatchctxTrainerEngine.trainer_init(info, client=LocalClient(worker))
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    trainer.remember(state)
    changed = dict(state, w=state["w"].clone())
    changed["w"].view(-1)[:10] = torch.arange(1.0, 11.0)
    stats = trainer.send_state_dict(changed)
    assert stats is not None and stats.transport == transport
    assert stats.dense_nbytes == (16 * 4 if dense else 0), stats
    assert torch.equal(worker.model.w, changed["w"])
    trainer.shutdown()


def test_an_update_in_chunks_is_applied_once_with_its_last_chunk() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        # each patch is 6 bytes on the wire (an fp32 value, a 2-byte bitmask): one per chunk
        PatchctxTrainerInitInfo(transport="inline", rank=0, chunk_bytes=8),
        client=client,
    )
    calls: list[bool] = []
    before = worker.model.w.clone()
    update = client.update_weights

    def spy(info: dict[str, Any]) -> None:
        calls.append(bool(info["last"]))
        assert torch.equal(worker.model.w, before)  # nothing applied before the last
        update(info)

    client.update_weights = spy  # type: ignore[method-assign,assignment]
    patches = [sparse("w", (4, 4), [float(i + 1)], [i]) for i in range(3)]
    stats = trainer.send_weights(patches)
    assert calls == [False, False, True] and stats is not None and stats.patches == 3
    assert worker.model.w.view(-1)[:3].tolist() == [1.0, 2.0, 3.0]
    assert worker.last_stats is not None and worker.last_stats["chunks"] == 3
    # A bad last chunk: the whole update is refused, the earlier chunks included.
    bad = [sparse("w", (4, 4), [9.0], [5]), sparse("b", (4,), [9.0], [7])]
    before = worker.model.w.clone()
    with pytest.raises(InvalidPatchError, match="out of range"):
        trainer.send_weights(bad)
    assert worker.model.w.view(-1)[5] == 0.0


def test_every_transport_carries_every_position_encoding(tmp_path: Any) -> None:
    """A payload with flat, gap-coded and bitmask positions (and a dense patch) arrives
    through inline, shared memory and NCCL (a loopback pair) and decodes to the same patches."""
    from patchctx import WireEncoding, wire_encoding
    from patchctx.vllm import decode_patches
    from patchctx.vllm._transport import InlineTransport, check_received

    numel = 2**20
    patches = [
        CheckpointWeightPatch(
            f"w{every}",
            (numel,),
            torch.bfloat16,
            torch.full((len(range(1, numel, every)),), 0.5, dtype=torch.bfloat16),
            torch.arange(1, numel, every, dtype=torch.int32),
        )
        for every in (2**17, 100, 3)  # escaped gaps, short gaps, a dense bitmask
    ]
    patches.append(CheckpointWeightPatch("b", (4,), torch.float32, torch.arange(4.0)))
    assert [wire_encoding(p) for p in patches] == [*list(WireEncoding)[1:], WireEncoding.DENSE]
    payload = encode_patches(patches, target_version="9")
    wire: queue.Queue[torch.Tensor] = queue.Queue()
    pairs: list[tuple[Any, Any]] = [
        (InlineTransport(limit=4 << 20), InlineTransport(limit=4 << 20)),
        (SharedMemoryTransport(str(tmp_path)), SharedMemoryTransport(str(tmp_path))),
        (NCCLTransport(Loopback(wire, sender=True)), NCCLTransport(Loopback(wire, sender=False))),
    ]
    for sender, receiver in pairs:
        descriptor = {**sender.describe(payload), "nbytes": len(payload)}
        descriptor["sha256"] = digest(payload)
        sender.transmit(payload)
        received = check_received(receiver.receive(descriptor), descriptor)
        sender.release()
        for got, sent in zip(decode_patches(received), patches, strict=True):
            assert got.name == sent.name and torch.equal(got.values, sent.values)
            assert (got.indices is None) == (sent.indices is None)
            if got.indices is not None and sent.indices is not None:
                assert torch.equal(got.indices, sent.indices), got.name


def test_bool_and_integer_patches_into_float_weights_are_refused_float64_is_cast() -> None:
    """The issue's case: int32, float64 and bool patches into a float weight were applied
    with a cast (a bool patch set a norm to all 1.0). Casts across kinds are refused with
    nothing written; a float-to-float cast is made as a dense load makes it."""
    from patchctx import CastKindError

    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    flags = CheckpointWeightPatch("b", (4,), torch.bool, torch.ones(4, dtype=torch.bool))
    codes = CheckpointWeightPatch("b", (4,), torch.int32, torch.arange(4, dtype=torch.int32))
    for patch in (flags, codes):
        with pytest.raises(CastKindError, match=r"\[patchctx rank 0: CastKindError\].*'b'"):
            trainer.send_weights([patch])
        assert not worker.model.b.any() and client.get_weight_version() == "default"
    wide = CheckpointWeightPatch(
        "b", (4,), torch.float64, torch.tensor([0.1, 0.2, 0.3, 0.4]).double()
    )
    assert trainer.send_weights([wide]) is not None
    assert torch.equal(worker.model.b.detach(), torch.tensor([0.1, 0.2, 0.3, 0.4]).double().float())
