"""The trainer's record of what the workers hold (`PatchctxTrainerEngine.sent`) after each
``send_state_dict``: bit for bit what ``remember(state)`` builds, whatever the update held
(NaN, -0.0, a bf16 receiver of fp32 masters, integer tensors, tied names, dense and sparse).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from patchctx import CheckpointWeightPatch, InvalidPatchError
from patchctx.vllm import PatchctxTrainerEngine, PatchctxTrainerInitInfo

pytestmark = pytest.mark.vllm


class Recording:
    """vLLM's weight-sync client protocol with no workers: each update's infos, kept."""

    def __init__(self) -> None:
        self.updates: list[Any] = []
        self.version = "0"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        self.updates.append(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None:
            self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version


def bits(tensor: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(width[tensor.element_size()])


def assert_same_record(engine: PatchctxTrainerEngine, state: dict[str, torch.Tensor]) -> None:
    advanced = engine.sent
    engine.sent = {}  # (else `remember` writes the reference into the record's own tensors)
    engine.remember(state)  # the whole copy, the reference
    assert advanced.keys() == engine.sent.keys()
    for name, tensor in engine.sent.items():
        assert advanced[name].dtype == tensor.dtype, name
        assert torch.equal(bits(advanced[name]), bits(tensor)), name
        # never a view of the trainer's own tensors, which go on stepping in place
        assert advanced[name].untyped_storage().data_ptr() != (
            state[name].untyped_storage().data_ptr()
        )
        for other, held in advanced.items():  # a record never aliases another name's
            assert other == name or held.untyped_storage().data_ptr() != (
                advanced[name].untyped_storage().data_ptr()
            )
    engine.sent = advanced


def step(
    state: dict[str, torch.Tensor], density: float, seed: int, specials: bool
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embed = state["embed.weight"].clone()
    new = {"embed.weight": embed, "lm_head.weight": embed}  # tied: one tensor, two names
    for name, tensor in state.items():
        if name in new:
            continue
        new[name] = tensor.clone()
    for name, tensor in new.items():
        if name == "lm_head.weight":
            continue
        flat = tensor.view(-1)
        chosen = torch.rand(flat.shape, generator=generator) < density
        if tensor.is_floating_point():
            flat[chosen] += torch.randn(int(chosen.sum()), generator=generator)
            if specials and flat.numel() > 3:
                flat[0], flat[1], flat[2] = float("nan"), -0.0, 1e-30  # rounds away in bf16
        else:
            flat[chosen] += 1
    return new


@settings(max_examples=25, deadline=None)
@given(
    densities=st.lists(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]), min_size=1, max_size=4),
    receiver=st.sampled_from([None, torch.bfloat16]),
    specials=st.booleans(),
    seed=st.integers(0, 2**16),
    chunk_bytes=st.sampled_from([None, 1, 3000]),
)
def test_the_record_after_each_update_is_what_a_whole_copy_would_hold(
    densities: list[float],
    receiver: torch.dtype | None,
    specials: bool,
    seed: int,
    chunk_bytes: int | None,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 16, generator=generator)
    state = {
        "lm_head.weight": embed,  # the twin the diff meets first
        "embed.weight": embed,
        "layer.weight": torch.randn(32, 48, generator=generator),
        "layer.bias": torch.randn(32, generator=generator),
        "steps": torch.arange(10, dtype=torch.int64),
    }
    client = Recording()
    info = PatchctxTrainerInitInfo(
        rank=0, transport="inline", dtype=receiver, chunk_bytes=chunk_bytes
    )
    engine = PatchctxTrainerEngine.trainer_init(info, client=client)
    engine.remember(state)
    for number, density in enumerate(densities):
        state = step(state, density, seed + number, specials)
        engine.send_state_dict(state)
        assert_same_record(engine, state)
    assert client.version == str(len(densities))


def test_a_refused_diff_leaves_the_record_as_it_was() -> None:
    client = Recording()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline"), client=client
    )
    engine.remember({"w": torch.zeros(4)})
    with pytest.raises(InvalidPatchError, match="shape differs"):
        engine.send_state_dict({"w": torch.zeros(5)})
    assert torch.equal(engine.sent["w"], torch.zeros(4)) and client.version == "0"


def test_names_over_parts_of_one_buffer_are_recorded_as_a_whole_copy_would() -> None:
    """Two names viewing halves of one fused buffer: not twins, so the record is copied."""
    client = Recording()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline"), client=client
    )
    fused = torch.zeros(2, 500)
    engine.remember({"a": fused[0], "b": fused[1]})
    fused[0, 3] = fused[1, 7] = 2.0
    state = {"a": fused[0], "b": fused[1]}
    engine.send_state_dict(state)
    assert_same_record(engine, state)
    assert engine.sent["a"][3] == engine.sent["b"][7] == 2.0


def test_an_interrupt_while_the_record_advances_leaves_it_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The workers took the update; a KeyboardInterrupt while the trainer writes its record
    of it still leaves the record the state, never half of one and half the other."""
    client = Recording()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline"), client=client
    )
    engine.remember({"w": torch.zeros(1000), "v": torch.zeros(1000)})
    state = {"w": torch.zeros(1000), "v": torch.zeros(1000)}
    state["w"][7] = state["v"][9] = 1.0
    calls = []
    index_put = torch.Tensor.index_put_

    def interrupted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # the first patch written, the second not
            raise KeyboardInterrupt
        return index_put(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_put_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.send_state_dict(state)
    monkeypatch.undo()
    assert len(calls) == 2 and client.version == "1"
    assert_same_record(engine, state)


def test_in_chunks_a_chunk_goes_while_the_next_patches_are_still_being_made() -> None:
    """``chunk_bytes`` with a stream of patches: the first chunk reaches the workers before
    the stream has made its last patch (and `send_state_dict` streams its diff the same way).
    """
    log: list[str] = []

    class Logged(Recording):
        def update_weights(self, update_info: Any) -> None:
            log.append("update")
            super().update_weights(update_info)

    client = Logged()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", chunk_bytes=64), client=client
    )

    def made() -> Any:
        for number in range(6):
            log.append(f"made {number}")
            yield CheckpointWeightPatch(f"w{number}", (16,), torch.float32, torch.ones(16))

    stats = engine.send_weights(made())
    assert stats is not None and stats.patches == 6 and client.version == "1"
    assert len(client.updates) == 6  # 64 bytes of values each: one chunk per patch
    assert log.index("update") < log.index("made 5"), log
    # the diff streams the same way: chunk 0 goes before the last tensor is diffed
    state = {f"w{number}": torch.zeros(16) for number in range(6)}
    engine.remember(state)
    new = {name: torch.ones(16) for name in state}
    before = len(client.updates)
    engine.send_state_dict(new)
    assert len(client.updates) - before == 6
    assert_same_record(engine, new)


def test_a_dense_update_is_recorded_as_the_bytes_sent_whatever_writes_the_state_meanwhile() -> None:
    """The record is what the workers were sent: another thread that writes the trainer's
    tensors while the update travels (here, while the workers take it) changes neither the
    update nor the record, and the trainer's next step in place changes no record either."""
    state = {"w": torch.arange(64.0), "b": torch.ones(8)}  # every element changed: dense
    sent_values = {name: tensor.clone() for name, tensor in state.items()}

    class Meanwhile(Recording):
        def update_weights(self, update_info: Any) -> None:
            super().update_weights(update_info)
            for tensor in state.values():
                tensor.add_(100.0)  # the optimizer's thread, mid-update

    client = Meanwhile()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", inline_below=None), client=client
    )
    engine.remember({"w": torch.zeros(64), "b": torch.zeros(8)})
    stats = engine.send_state_dict(state)
    assert stats is not None and stats.dense_nbytes == 72 * 4
    for name, values in sent_values.items():
        assert torch.equal(engine.sent[name], values), name
    for tensor in state.values():
        tensor.add_(1.0)  # the next step, in place
    for name, values in sent_values.items():
        assert torch.equal(engine.sent[name], values), name


def test_remember_writes_its_record_in_place_and_an_interrupt_leaves_none() -> None:
    client = Recording()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", dtype=torch.bfloat16),
        client=client,
    )
    first = {"w": torch.randn(32, 4), "steps": torch.arange(3)}
    engine.remember(first)
    where = {name: tensor.data_ptr() for name, tensor in engine.sent.items()}
    second = {"w": torch.randn(32, 4), "steps": torch.arange(3) + 7}
    engine.remember(second)
    assert {name: tensor.data_ptr() for name, tensor in engine.sent.items()} == where
    assert torch.equal(engine.sent["w"], second["w"].to(torch.bfloat16))
    assert engine.sent["steps"].dtype == torch.int64  # integers keep their own dtype
    assert torch.equal(engine.sent["steps"], second["steps"])
    # Given its own record, it copies rather than writing a tensor over itself.
    engine.remember(engine.sent)
    assert torch.equal(engine.sent["w"], second["w"].to(torch.bfloat16))
    assert engine.sent["w"].data_ptr() != where["w"]

    class Interrupted(dict[str, torch.Tensor]):
        def items(self) -> Any:
            yield "w", self["w"]
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.remember(Interrupted(first))
    assert engine.sent == {}  # half written would claim what the workers do not hold
    with pytest.raises(InvalidPatchError):
        engine.send_state_dict(first)
    assert client.version == "0"
    engine.remember(first)
    engine.send_state_dict(second)
    assert_same_record(engine, second)


def test_dense_copies_go_into_memory_the_record_held_before_and_a_failed_update_keeps_it() -> None:
    """A CPU tensor sent dense at every step: each diff copies it into the memory the record
    held before the last update (no fresh memory), the record stays what the workers took,
    and an update that fails leaves the record as it was, whatever the copy wrote."""

    class Failing(Recording):
        fail = False

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            if self.fail:
                raise RuntimeError("the workers refused")
            super().finish_weight_update(weight_version)

    client = Failing()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", inline_below=None), client=client
    )
    engine.remember({"w": torch.zeros(4096)})
    held = engine.sent["w"].data_ptr()
    states = [{"w": torch.full((4096,), float(step))} for step in range(1, 5)]
    engine.send_state_dict(states[0])  # every element changed: dense
    first = engine.sent["w"].data_ptr()
    assert first != held and torch.equal(engine.sent["w"], states[0]["w"])
    engine.send_state_dict(states[1])
    assert engine.sent["w"].data_ptr() == held  # the copy went into the memory held before
    assert torch.equal(engine.sent["w"], states[1]["w"])
    client.fail = True
    with pytest.raises(RuntimeError, match="refused"):
        engine.send_state_dict(states[2])  # copied into `first`'s memory, then refused
    assert engine.sent["w"].data_ptr() == held and torch.equal(engine.sent["w"], states[1]["w"])
    client.fail = False
    sent_before = len(client.updates)
    engine.send_state_dict(states[3])
    assert torch.equal(engine.sent["w"], states[3]["w"])
    assert engine.sent["w"].data_ptr() == first
    assert len(client.updates) == sent_before + 1


def test_the_state_itself_is_never_a_dense_copys_destination() -> None:
    """Memory the engine would reuse but the caller now passes as its state (or a view of it)
    is left alone: the copy goes to fresh memory, and the state is not written."""
    client = Recording()
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, transport="inline", inline_below=None), client=client
    )
    engine.remember({"w": torch.zeros(256)})
    engine.send_state_dict({"w": torch.ones(256)})
    spare = engine.spare["w"]
    state = {"w": spare.view(16, 16)[:, :].reshape(256)}  # the spare itself, as a view
    state["w"].fill_(3.0)
    engine.send_state_dict(state)
    assert torch.equal(state["w"], torch.full((256,), 3.0))
    assert torch.equal(engine.sent["w"], torch.full((256,), 3.0))
    assert engine.sent["w"].data_ptr() != spare.data_ptr()
