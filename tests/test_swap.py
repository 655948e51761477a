"""The swap: install on first entry, exact restore on last exit, thread-scoped dispatch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from patchctx import NaNMask, _swap, masked_copy

ORIGINAL = torch.Tensor.copy_
NAN = float("nan")


def staged_nan(n: int = 8) -> torch.Tensor:
    """A plain tensor in NaNMask's convention (vLLM's): 1.0 at 0, NaN ("keep") elsewhere.

    Plain on purpose: data staged by patchctx carries its own mask in every thread, so the
    region's own business (which threads it affects) shows only with plain data."""
    staged = torch.full((n,), float("nan"))
    staged[0] = 1.0
    return staged


def test_install_on_entry_and_exact_restore_on_exit() -> None:
    assert not _swap.is_installed()
    with masked_copy():
        assert _swap.is_installed()
        assert torch.Tensor.copy_ is not ORIGINAL
        with masked_copy():  # nested: still installed, depth 2
            assert _swap.is_installed()
        assert _swap.is_installed()
    assert torch.Tensor.copy_ is ORIGINAL
    assert "copy_" not in torch.Tensor.__dict__


def test_restore_when_the_body_raises() -> None:
    with pytest.raises(ZeroDivisionError), masked_copy():
        _ = 1 / 0
    assert torch.Tensor.copy_ is ORIGINAL


def test_restore_on_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt), masked_copy():
        raise KeyboardInterrupt
    assert torch.Tensor.copy_ is ORIGINAL
    # The lock was released: another thread can enter immediately.
    entered = threading.Event()

    def other() -> None:
        with masked_copy(timeout=1):
            entered.set()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert entered.is_set()


def test_entry_failing_half_way_restores_and_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    class Boom(Exception):
        pass

    class ExplodingVar:
        def get(self) -> tuple[object, ...]:
            return ()

        def set(self, value: object) -> None:
            raise Boom

    monkeypatch.setattr(_swap, "_stack", ExplodingVar())
    with pytest.raises(Boom), masked_copy():
        pass  # pragma: no cover - never reached
    monkeypatch.undo()
    assert torch.Tensor.copy_ is ORIGINAL
    assert _swap.holder() is None


def test_a_previous_replacement_is_restored_by_identity() -> None:
    calls: list[int] = []

    def theirs(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(1)
        return ORIGINAL(self, src, non_blocking)

    setattr(torch.Tensor, "copy_", theirs)  # noqa: B010
    try:
        with masked_copy():
            # Outside the region's thread-local scope (a plain copy made by patchctx itself)
            # goes to what was there before.
            _swap.plain_copy(torch.zeros(2), torch.ones(2))
        assert torch.Tensor.__dict__["copy_"] is theirs
        assert calls == [1]
    finally:
        del torch.Tensor.copy_


def test_foreign_replacement_during_a_region_is_not_clobbered() -> None:
    def theirs(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return ORIGINAL(self, src, non_blocking)

    try:
        with (
            pytest.warns(RuntimeWarning, match="replaced by other code"),
            masked_copy(),
        ):
            setattr(torch.Tensor, "copy_", theirs)  # noqa: B010
        assert torch.Tensor.__dict__["copy_"] is theirs
    finally:
        del torch.Tensor.copy_


def test_foreign_wrapper_of_ours_does_not_recurse() -> None:
    """A wrapper that captured our copy_ and is later restored as "previous" must not loop."""
    calls: list[int] = []
    holder: list[object] = []

    def wrapper(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(1)
        ours = holder[0]
        assert callable(ours)
        result = ours(self, src, non_blocking)
        assert isinstance(result, torch.Tensor)
        return result

    region = masked_copy()
    region.__enter__()
    holder.append(torch.Tensor.copy_)  # ours, captured by the foreign wrapper
    setattr(torch.Tensor, "copy_", wrapper)  # noqa: B010
    with pytest.warns(RuntimeWarning, match="replaced by other code"):
        region.__exit__(None, None, None)
    try:
        assert torch.Tensor.__dict__["copy_"] is wrapper
        destination = torch.zeros(8)
        with masked_copy():  # installs over the wrapper, whose captured "ours" is ours again
            assert _swap.is_installed()
            results: list[bool] = []

            def other_thread() -> None:  # no region here: previous (the wrapper) -> ours -> plain
                d = torch.zeros(8)
                results.append(bool(torch.isnan(d.copy_(staged_nan())).sum() == 7))

            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
            destination.copy_(staged_nan())  # masked in this thread
        assert results == [True]
        assert calls == [1]
        assert destination[0] == 1.0 and not torch.isnan(destination).any()
        assert torch.Tensor.__dict__["copy_"] is wrapper
    finally:
        del torch.Tensor.copy_


def test_outside_a_region_copy_keeps_its_signature_and_return_value() -> None:
    a = torch.zeros(3)
    with masked_copy():
        pass
    out = a.copy_(torch.tensor([NAN, 1.0, 2.0]), non_blocking=False)
    assert out is a
    assert torch.isnan(a[0])


def test_other_threads_copy_plainly_while_a_region_is_active() -> None:
    """Thread A sits inside a masked region; thread B copies NaN in a loop and gets every NaN."""
    inside = threading.Event()
    release = threading.Event()
    b_results: list[bool] = []
    errors: list[BaseException] = []

    def thread_a() -> None:
        try:
            with masked_copy(strategy=NaNMask()):
                destination = torch.zeros(8)
                destination.copy_(staged_nan())  # masked in A
                assert destination[0] == 1.0 and not torch.isnan(destination).any()
                inside.set()
                assert release.wait(10)
                destination.copy_(staged_nan())
                assert not torch.isnan(destination).any()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            inside.set()

    def thread_b() -> None:
        assert inside.wait(10)
        source = torch.full((8,), NAN)
        for _ in range(500):
            destination = torch.zeros(8)
            returned = destination.copy_(source)
            b_results.append(returned is destination and bool(torch.isnan(destination).all()))

    a = threading.Thread(target=thread_a)
    b = threading.Thread(target=thread_b)
    a.start()
    b.start()
    b.join()
    assert _swap.is_installed() or errors  # A still holds its region while B copied
    release.set()
    a.join()
    assert not errors
    assert len(b_results) == 500 and all(b_results)


def test_regions_in_two_threads_take_turns() -> None:
    order: list[str] = []
    a_inside = threading.Event()

    def a() -> None:
        with masked_copy():
            order.append("a-in")
            a_inside.set()
            time.sleep(0.2)
            order.append("a-out")

    def b() -> None:
        assert a_inside.wait(10)
        with masked_copy():
            order.append("b-in")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["a-in", "a-out", "b-in"]


def test_timeout_expires_raises_and_changes_nothing() -> None:
    holding = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with masked_copy():
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="nothing was changed"), masked_copy(timeout=0.1):
            pass  # pragma: no cover - never reached
        assert 0.09 <= time.monotonic() - started < 5
        assert _swap.active_interceptor() is None  # nothing pushed in this thread
        assert _swap.holder() not in (None, threading.get_ident())  # only the holder's region
    finally:
        release.set()
        thread.join()
    assert torch.Tensor.copy_ is ORIGINAL


def test_timeout_zero_succeeds_when_free() -> None:
    with masked_copy(timeout=0):
        assert _swap.is_installed()


def test_nested_regions_stack_and_the_innermost_applies() -> None:
    class Recording:
        def __init__(self, tag: str, log: list[str]) -> None:
            self.tag, self.log = tag, log

        def unsupported_reason(self, dtype: torch.dtype) -> str | None:
            return None

        def reserved_values(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=torch.bool)

        def describe_reserved(self, dtype: torch.dtype) -> str:
            return "nothing"

        def stage(
            self,
            shape: object,
            dtype: torch.dtype,
            indices: torch.Tensor,
            values: torch.Tensor,
        ) -> torch.Tensor:
            raise NotImplementedError

        def merge(
            self, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False
        ) -> torch.Tensor:
            self.log.append(self.tag)
            return destination.copy_(source)  # a plain copy from inside a strategy

    log: list[str] = []
    outer, inner = masked_copy(Recording("outer", log)), masked_copy(Recording("inner", log))
    x = torch.zeros(2)
    with outer:
        x.copy_(torch.ones(2))
        with inner:
            x.copy_(torch.ones(2))
            with outer:  # the same instance again, nested
                x.copy_(torch.ones(2))
            x.copy_(torch.ones(2))
        x.copy_(torch.ones(2))
    x.copy_(torch.ones(2))
    assert log == ["outer", "inner", "outer", "inner", "outer"]


def test_leaving_out_of_order_is_an_error() -> None:
    first, second = masked_copy(), masked_copy()
    first.__enter__()
    second.__enter__()
    try:
        with pytest.raises(RuntimeError, match="reverse order"):
            first.__exit__(None, None, None)
    finally:
        second.__exit__(None, None, None)
        first.__exit__(None, None, None)
    assert torch.Tensor.copy_ is ORIGINAL


@pytest.fixture
def busy_region() -> Iterator[threading.Event]:
    release = threading.Event()
    holding = threading.Event()

    def holder() -> None:
        with masked_copy():
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(10)
    yield release
    release.set()
    thread.join()


def test_a_waiting_thread_enters_once_the_holder_leaves(busy_region: threading.Event) -> None:
    entered = threading.Event()

    def waiter() -> None:
        with masked_copy(timeout=10):
            entered.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    assert not entered.is_set()
    busy_region.set()
    thread.join()
    assert entered.is_set()
