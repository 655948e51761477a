"""masked_copy as a context manager and as a decorator (functions, methods, generators)."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator

import pytest
import torch

from patchctx import BoolMask, IntSentinel, MaskedCopy, NaNMask, _swap, masked_copy


def staged(values: list[float], positions: list[int], n: int = 4) -> torch.Tensor:
    return NaNMask().stage((n,), torch.float32, torch.tensor(positions), torch.tensor(values))


def test_bare_decorator() -> None:
    @masked_copy
    def load(weight: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        assert _swap.active_interceptor() is not None
        return weight.copy_(source)

    weight = torch.zeros(4)
    assert load(weight, staged([2.0], [1])) is weight
    assert weight.tolist() == [0.0, 2.0, 0.0, 0.0]
    assert load.__name__ == "load"
    assert _swap.active_interceptor() is None


def test_called_decorator_with_a_strategy() -> None:
    @masked_copy(strategy=IntSentinel())
    def load(weight: torch.Tensor, source: torch.Tensor) -> None:
        weight.copy_(source)

    weight = torch.zeros(3, dtype=torch.int8)
    load(weight, IntSentinel().stage((3,), torch.int8, torch.tensor([2]), torch.tensor([9])))
    assert weight.tolist() == [0, 0, 9]


def test_empty_call_decorator_defaults_to_nan_mask() -> None:
    @masked_copy()
    def load(weight: torch.Tensor) -> None:
        weight.copy_(staged([5.0], [0]))

    weight = torch.ones(4)
    load(weight)
    assert weight.tolist() == [5.0, 1.0, 1.0, 1.0]
    assert masked_copy().strategy == NaNMask()


def test_decorated_method() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        @masked_copy(strategy=NaNMask())
        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            for _, tensor in weights:
                self.weight.data.copy_(tensor)
            return {"weight"}

    layer = Layer()
    assert layer.load_weights([("w", staged([3.0, 4.0], [0, 3]))]) == {"weight"}
    assert layer.weight.tolist() == [3.0, 0.0, 0.0, 4.0]


def test_generator_region_is_active_while_running_not_while_suspended() -> None:
    seen: list[bool] = []

    @masked_copy
    def loader(weight: torch.Tensor) -> Generator[str, str, None]:
        seen.append(_swap.active_interceptor() is not None)
        weight.copy_(staged([1.0], [0]))
        sent = yield "first"
        seen.append(_swap.active_interceptor() is not None)
        weight.copy_(staged([float(len(sent))], [1]))
        yield "second"
        return

    weight = torch.zeros(4)
    generator = loader(weight)
    assert next(generator) == "first"
    assert _swap.active_interceptor() is None
    assert not _swap.is_installed()  # the lock is free while suspended
    plain = torch.zeros(4).copy_(torch.full((4,), float("nan")))
    assert torch.isnan(plain).all()  # suspended: plain copy in this thread
    assert generator.send("abc") == "second"
    with pytest.raises(StopIteration):
        next(generator)
    assert seen == [True, True]
    assert weight.tolist() == [1.0, 3.0, 0.0, 0.0]


def test_generator_throw_and_close_run_in_the_region() -> None:
    log: list[str] = []

    @masked_copy
    def loader() -> Generator[int, None, None]:
        try:
            yield 1
        except ValueError:
            log.append(f"caught in region={_swap.active_interceptor() is not None}")
            yield 2
        finally:
            log.append(f"finally in region={_swap.active_interceptor() is not None}")

    generator = loader()
    assert next(generator) == 1
    assert generator.throw(ValueError("x")) == 2
    generator.close()
    assert log == ["caught in region=True", "finally in region=True"]
    assert not _swap.is_installed()


def test_generator_return_value_is_preserved() -> None:
    @masked_copy
    def loader() -> Generator[int, None, str]:
        yield 1
        return "done"

    def outer() -> Iterator[int]:
        result = yield from loader()
        assert result == "done"
        yield 2

    assert list(outer()) == [1, 2]


def test_decorating_a_class_is_refused_with_advice() -> None:
    with pytest.raises(TypeError, match=r"cannot decorate a class.*load_weights"):

        @masked_copy
        class Model:  # pragma: no cover - never created
            pass

    with pytest.raises(TypeError, match="cannot decorate a class"):
        masked_copy(strategy=NaNMask())(type("Model", (), {}))


def test_decorating_an_async_function_is_refused() -> None:
    async def load() -> None:  # pragma: no cover - never awaited
        pass

    with pytest.raises(TypeError, match="async"):
        masked_copy(load)


def test_a_strategy_class_instead_of_an_instance_is_refused() -> None:
    with pytest.raises(TypeError, match=r"write NaNMask\(\) instead"):
        masked_copy(strategy=NaNMask)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"write BoolMask\(\) instead"):
        masked_copy(BoolMask)
    with pytest.raises(TypeError, match="you supplied 'nan'"):
        masked_copy(strategy="nan")  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("timeout", "error"), [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError)]
)
def test_invalid_timeouts(timeout: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout"):
        masked_copy(timeout=timeout)  # type: ignore[call-overload]


def test_one_instance_reused_across_threads_and_calls() -> None:
    region = masked_copy(strategy=NaNMask(), timeout=10)
    assert isinstance(region, MaskedCopy)
    assert repr(region) == "masked_copy(strategy=NaNMask(), timeout=10.0)"
    results: list[list[float]] = []
    lock = threading.Lock()

    def work() -> None:
        weight = torch.zeros(4)
        for _ in range(20):
            with region:
                weight.copy_(staged([1.0], [2]))
        with lock:
            results.append(weight.tolist())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[0.0, 0.0, 1.0, 0.0]] * 4


def test_exceptions_from_merge_propagate_and_leave_no_region() -> None:
    weight = torch.zeros(3)
    with pytest.raises(NotImplementedError), masked_copy():
        weight.copy_(torch.zeros(3, dtype=torch.int64))
    assert not _swap.is_installed()
