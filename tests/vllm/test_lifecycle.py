"""The backend's update lifecycle as a transaction: two trainers against one engine.

Two trainer engines (`PatchctxTrainerEngine`) drive one worker engine through a client that
does what vLLM 0.32's worker does with the weight-update calls (``LocalClient``: a start
while a session is active is refused, a failed chunk ends the session, the version is
recorded only when finish returns). Their steps (init, start, each chunk, finish) are
interleaved in every order, for updates of two and three chunks, and the first trainer is
also killed after every one of its steps. A trainer stops at its first refused step, as a
real one would; a refused init is retried once as a takeover (the documented recovery).

After every schedule: the weights are exactly one committed state (the base, or the one
update whose finish returned), the version the client reports names it, the worker agrees,
nothing is left in the shared-memory directory, and a third trainer can still update.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from patchctx import CheckpointWeightPatch, PatchError
from patchctx.vllm import (
    PatchctxTrainerEngine,
    PatchctxTrainerInitInfo,
    PatchctxWeightTransferEngine,
    UpdateConflictError,
    WeightVersionError,
)
from tests.vllm.test_backend import LocalClient, Model, worker_engine

Step = tuple[str, int]  # (trainer, step number)


def chunks_of(trainer: str, count: int) -> list[list[CheckpointWeightPatch]]:
    """`count` chunks of one update: each writes its own element of ``w`` (A: row 0, B: row 1)."""
    row = 0 if trainer == "A" else 1
    return [
        [
            CheckpointWeightPatch(
                "w",
                (4, 4),
                torch.float32,
                torch.tensor([float(10 * (row + 1) + k)]),
                torch.tensor([4 * row + k]),
            )
        ]
        for k in range(count)
    ]


def applied(updates: list[list[list[CheckpointWeightPatch]]]) -> torch.Tensor:
    """The weights after `updates`, in order, on the start weights."""
    weights = Model().w.detach().clone()
    for update in updates:
        for chunk in update:
            for patch in chunk:
                assert patch.indices is not None
                weights.view(-1)[patch.indices] = patch.values
    return weights


class Trainer:
    """One trainer's steps: init, start, its chunks, finish; it stops at the first refusal."""

    def __init__(
        self, name: str, client: LocalClient, shm: Path, count: int, landed: list[str]
    ) -> None:
        self.name, self.client, self.shm, self.landed = name, client, shm, landed
        self.update = chunks_of(name, count)
        self.engine: PatchctxTrainerEngine | None = None
        self.stopped = False
        self.finished = False
        self.errors: list[BaseException] = []
        self.update_id: str | None = None  # the id its chunks carried

    def steps(self) -> int:
        return 3 + len(self.update)

    def init(self, *, takeover: bool) -> None:
        info = PatchctxTrainerInitInfo(
            transport="shm", rank=0, shm_dir=str(self.shm), inline_below=0, takeover=takeover
        )
        self.engine = PatchctxTrainerEngine.trainer_init(info, client=self.client)

    def step(self, number: int) -> None:
        if self.stopped:
            return
        try:
            if number == 0:
                try:
                    self.init(takeover=False)
                except UpdateConflictError:
                    self.init(takeover=True)  # the documented recovery: roll the other back
            elif number == 1:
                self.client.start_weight_update()
            elif number < self.steps() - 1:
                assert self.engine is not None
                k = number - 2
                if self.engine._session is not None:
                    self.update_id = self.engine._session[0]
                self.engine.send_weight_chunk(self.update[k], last=k == len(self.update) - 1)
                if self.update_id is None and self.engine._session is not None:
                    self.update_id = self.engine._session[0]
            else:
                assert self.engine is not None
                self.client.finish_weight_update(self.engine.version)
                self.finished = True
                self.landed.append(self.name)
        except PatchError as error:
            self.errors.append(error)
            self.stopped = True
        except RuntimeError as error:  # vLLM's own refusals of a start or finish out of order
            if "weight_update" not in str(error):
                raise
            self.errors.append(error)
            self.stopped = True


def interleavings(a: int, b: int) -> Iterator[list[Step]]:
    """Every merge of A's steps 0..a-1 and B's 0..b-1, each trainer's in its own order."""
    for slots in itertools.combinations(range(a + b), a):
        chosen = set(slots)
        ia = ib = 0
        order: list[Step] = []
        for position in range(a + b):
            if position in chosen:
                order.append(("A", ia))
                ia += 1
            else:
                order.append(("B", ib))
                ib += 1
        yield order


def run(schedule: list[Step], count: int, shm: Path) -> dict[str, Any]:
    worker = worker_engine()
    client = LocalClient(worker)
    landed: list[str] = []
    trainers = {name: Trainer(name, client, shm, count, landed) for name in "AB"}
    for name, number in schedule:
        trainers[name].step(number)
    return {"worker": worker, "client": client, "trainers": trainers, "landed": landed}


def check(outcome: dict[str, Any], shm: Path, schedule: list[Step]) -> None:
    worker, client, trainers = outcome["worker"], outcome["client"], outcome["trainers"]
    # What the worker applied, in order: each a whole update of one trainer.
    by_trainer = {t.engine.trainer_id: t for t in trainers.values() if t.engine is not None}
    committed = [by_trainer[trainer] for _, trainer, _ in worker.commits]
    expected = applied([t.update for t in committed])
    assert torch.equal(worker.model.w.detach(), expected), (schedule, worker.model.w)
    version = str(len(committed)) if committed else "default"
    assert client.get_weight_version() == version == worker.patcher.version, schedule
    # A finish returned exactly once per applied update. vLLM's finish carries no update id:
    # a trainer displaced by the other's takeover after its own last chunk may make the call
    # that commits the other's (complete) update; it never applies anything of its own.
    assert len(outcome["landed"]) == len(committed), schedule
    assert list(shm.iterdir()) == [], (schedule, list(shm.iterdir()))
    # Not stuck: a third trainer (taking over whatever is left open) updates from here.
    third = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0, takeover=True), client=client
    )
    patch = CheckpointWeightPatch("b", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([2]))
    stats = third.send_weights([patch])
    assert stats is not None and client.get_weight_version() == worker.patcher.version
    assert stats.version == str(len(committed) + 1) and worker.model.b[2] == 7.0
    assert torch.equal(worker.model.w.detach(), expected), schedule


@pytest.mark.parametrize("count", [2, 3])
def test_every_interleaving_of_two_trainers_leaves_one_committed_state(
    count: int, tmp_path: Path
) -> None:
    steps = 3 + count
    schedules = list(interleavings(steps, steps))
    outcomes: dict[str, int] = {}
    for schedule in schedules:
        outcome = run(schedule, count, tmp_path)
        check(outcome, tmp_path, schedule)
        landed = "".join(outcome["landed"]) or "none"
        outcomes[landed] = outcomes.get(landed, 0) + 1
    # One after the other both land; overlapping, one or neither (refused by the other).
    assert set(outcomes) >= {"A", "B", "AB", "BA"}, outcomes
    assert sum(outcomes.values()) == len(schedules) == {2: 252, 3: 924}[count]


@pytest.mark.parametrize("count", [2, 3])
def test_a_trainer_killed_after_any_step_leaves_the_state_before_or_after(
    count: int, tmp_path: Path
) -> None:
    """A dies (no clean-up at all) after each of its steps; B's steps come in every order."""
    steps = 3 + count
    runs, landed = 0, {"": 0, "A": 0, "B": 0, "AB": 0, "BA": 0}
    for killed_after in range(steps + 1):
        for schedule in interleavings(killed_after, steps):
            outcome = run(schedule, count, tmp_path)
            check(outcome, tmp_path, schedule)
            if killed_after < steps:  # A never finished: only B can have landed
                assert not outcome["trainers"]["A"].finished
            landed["".join(outcome["landed"])] += 1
            runs += 1
    assert runs == {2: 462, 3: 1716}[count]  # C(2 * steps + 1, steps) schedules
    assert landed["B"] > 0 and landed[""] > 0 and landed["A"] > 0, landed


def test_a_stale_resumed_trainer_is_refused_at_init_and_versions_never_repeat() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    first = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    update = chunks_of("A", 1)[0]
    assert first.send_weights(update) is not None and worker.patcher.version == "1"
    before = worker.model.w.detach().clone()
    # A trainer resumed from the checkpoint it had at "default" declares that base: refused.
    with pytest.raises(WeightVersionError, match="declares its state at weight version"):
        PatchctxTrainerEngine.trainer_init(
            PatchctxTrainerInitInfo(transport="inline", rank=0, base_version="default"),
            client=client,
        )
    # A trainer that says it is at "1" (the served version) connects; its update lands.
    resumed = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0, base_version="1"), client=client
    )
    assert resumed.send_weights(chunks_of("B", 1)[0]) is not None
    assert worker.patcher.version == client.get_weight_version() == "2"
    # A version these weights were at before is never a target again.
    resumed.version = "2"
    with pytest.raises(WeightVersionError, match=r"one these weights were at"):
        resumed.send_weights(chunks_of("A", 1)[0], target_version="1")
    assert worker.patcher.version == client.get_weight_version() == "2"
    assert not torch.equal(worker.model.w.detach(), before)


def test_a_finish_before_the_last_chunk_applies_nothing_and_records_no_version() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    client.start_weight_update()
    trainer.send_weight_chunk(chunks_of("A", 2)[0], last=False)
    with pytest.raises(UpdateConflictError, match="not its last one yet"):
        client.finish_weight_update("1")  # the version it names is not recorded
    assert client.get_weight_version() == "default" == worker.patcher.version
    assert not worker.model.w.any() and not client.active  # the session ended
    # The update stays open for its trainer: in a new session it sends the rest, and the
    # finish applies the whole update.
    client.start_weight_update()
    trainer.send_weight_chunk(chunks_of("A", 2)[1], last=True)
    client.finish_weight_update(trainer.version)
    assert torch.equal(worker.model.w.detach(), applied([chunks_of("A", 2)]))
    assert client.get_weight_version() == "1" == worker.patcher.version
    # Nothing received at all: a finish that would only rename the weights is refused too.
    client.start_weight_update()
    with pytest.raises(UpdateConflictError, match="no chunk arrived"):
        client.finish_weight_update("renamed")
    assert client.get_weight_version() == "1"


def test_a_chunk_out_of_order_or_after_the_last_is_refused() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    client.start_weight_update()
    trainer._session = ("u-skip", 1)  # chunk 0 never sent: chunk 1 arrives first
    with pytest.raises(UpdateConflictError, match="where chunk 0 was due"):
        trainer.send_weight_chunk(chunks_of("A", 2)[1], last=True)
    assert worker.update is None and not worker.model.w.any()
    client.start_weight_update()
    trainer.send_weight_chunk(chunks_of("A", 1)[0], last=True)
    trainer._session = (worker.update.update_id if worker.update else "", 1)
    with pytest.raises(UpdateConflictError, match="is complete"):
        trainer.send_weight_chunk(chunks_of("B", 1)[0], last=True)
    assert not worker.model.w.any()


def test_proof_of_landing_reads_back_and_a_mismatch_rolls_the_update_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before committing, the worker reads back through the routes what each patch wrote and
    compares it with what was sent: a write no guard sees (here a replay kernel that writes
    other values) fails the finish, the update is undone and the version stays."""
    from patchctx import _load, _routes

    worker = worker_engine()
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    assert trainer.send_weights(chunks_of("A", 1)[0]) is not None  # learns the route of w
    assert worker.last_stats is not None
    assert worker.last_stats["landing"] == {"verified": 1, "elements": 1, "unverified": 0}
    before = worker.model.w.detach().clone()
    real = _routes.replay  # the replay the load runs; the stand-in below is a bad kernel

    def wrong_kernel(route: Any, indices: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
        return real(route, indices, values * 2, *args, **kwargs)

    monkeypatch.setattr(_load, "replay", wrong_kernel)
    with pytest.raises(PatchError, match=r"proof of landing failed.*'w'"):
        trainer.send_weights(chunks_of("B", 2)[0])
    assert torch.equal(worker.model.w.detach(), before)
    assert client.get_weight_version() == worker.patcher.version == "1"
    monkeypatch.undo()
    assert trainer.send_weights(chunks_of("B", 2)[0]) is not None
    assert client.get_weight_version() == worker.patcher.version == "2"


def test_a_foreign_or_unreadable_chunk_leaves_the_open_update_as_it_was() -> None:
    worker = worker_engine()
    client = LocalClient(worker)
    owner = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    client.start_weight_update()
    owner.send_weight_chunk(chunks_of("A", 2)[0], last=False)
    held = worker.pending
    for foreign in (
        {"nbytes": "garbage"},  # cannot even be read: its owner is unknown
        {"nbytes": 0, "sha256": "", "update_id": "other", "trainer_id": "intruder"},
        {"nbytes": 0, "sha256": "", "update_id": "other", "trainer_id": owner.trainer_id + "x"},
    ):
        if not client.active:  # (vLLM ended the session at the previous refusal)
            client.start_weight_update()
        with pytest.raises(PatchError):
            client.update_weights(foreign)
        assert worker.pending == held  # the open update is untouched
    client.start_weight_update()  # its owner sends the rest in a new session
    owner.send_weight_chunk(chunks_of("A", 2)[1], last=True)
    client.finish_weight_update(owner.version)
    assert torch.equal(worker.model.w.detach(), applied([chunks_of("A", 2)]))


class Shaped(torch.nn.Module):
    """Weights laid out as vLLM lays them: q, k and v packed in one parameter, a weight kept
    transposed, a tensor-parallel shard (columns 2..5 of the checkpoint's 8), a bf16 copy of
    an fp32 checkpoint tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.up_t = torch.nn.Parameter(torch.zeros(5, 3), requires_grad=False)
        self.shard = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.low = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name in ("q", "k", "v"):
                start = {"q": 0, "k": 4, "v": 8}[name]
                self.qkv.narrow(0, start, 4).copy_(tensor)
            elif name == "up":
                self.up_t.copy_(tensor.t())
            elif name == "shard":
                self.shard.copy_(tensor.narrow(1, 2, 4))
            else:
                self.low.copy_(tensor)
            loaded.add(name)
        return loaded


SHAPES = {"q": (4, 4), "k": (4, 4), "v": (4, 4), "up": (3, 5), "shard": (6, 8), "half": (7,)}


def dense_update(seed: int) -> list[CheckpointWeightPatch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        CheckpointWeightPatch(
            name, shape, torch.float32, torch.randn(*shape, generator=generator).reshape(-1)
        )
        for name, shape in SHAPES.items()
    ]


def test_a_dense_update_is_read_back_view_by_view_and_a_wrong_byte_rolls_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dense patches through packed, transposed, sliced and cast weights: the proof of landing
    compares every element each route wrote (the shard's 24 of its checkpoint's 48), and a
    replay that gets one element of one segment wrong fails the finish with nothing kept."""
    from patchctx import _load, _routes

    parallel = SimpleNamespace(rank=0, pipeline_parallel_size=1)
    config = SimpleNamespace(parallel_config=parallel, model_config=None)
    worker = PatchctxWeightTransferEngine(None, config, torch.device("cpu"), Shaped())
    client = LocalClient(worker)
    trainer = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(transport="inline", rank=0), client=client
    )
    written = 16 * 3 + 15 + 24 + 7
    for seed in (1, 2):  # the first learns the routes, the second replays them
        patches = dense_update(seed)
        assert trainer.send_weights(patches) is not None
        assert worker.last_stats is not None
        assert worker.last_stats["landing"] == {"verified": 6, "elements": written, "unverified": 0}
        reference = Shaped()
        reference.load_weights((p.name, p.values.view(p.shape)) for p in patches)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(worker.model.state_dict()[name], tensor), name
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    real = _routes.replay_dense

    def one_wrong(route: Any, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        real(route, values, *args, **kwargs)
        if route.segments[0].tensor_name == "shard":  # the last element it wrote, changed
            worker.model.shard.data[-1, -1] += 1.0

    monkeypatch.setattr(_load, "replay_dense", one_wrong)
    with pytest.raises(PatchError, match=r"proof of landing failed.*'shard'"):
        trainer.send_weights(dense_update(3))
    for name, tensor in worker.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert client.get_weight_version() == worker.patcher.version == "2"
