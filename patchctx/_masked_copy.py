"""`masked_copy`: a context manager and decorator that makes ``copy_`` keep masked positions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar, cast, overload

import torch
from typing_extensions import ParamSpec, Self

from patchctx import _swap
from patchctx._arguments import seconds
from patchctx._errors import InvalidPatchTypeError
from patchctx._staged import StagedTensor
from patchctx._strategies import CopyStrategy, NaNMask, as_strategy

__all__ = ["MaskedCopy", "masked_copy"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _StrategyInterceptor:
    """Performs every ``copy_`` of a region as the strategy's masked merge."""

    strategy: CopyStrategy

    def copy_(
        self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool
    ) -> torch.Tensor:
        if isinstance(source, StagedTensor):
            # Data staged by patchctx carries its own mask, whatever this region's strategy:
            # its copy_ is the masked merge already.
            return _swap.plain_copy(destination, source, non_blocking)
        return self.strategy.merge(destination, source, non_blocking=non_blocking)


class MaskedCopy:
    """A masked region: inside it, this thread's ``Tensor.copy_`` calls the strategy's merge.

    Returned by `masked_copy`; use it as a ``with`` block or as a decorator. It holds no state
    of its own between uses, so one instance may be reused, shared across threads and nested.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask, masked_copy
        >>> region = masked_copy(strategy=NaNMask(), timeout=5)
        >>> region
        masked_copy(strategy=NaNMask(), timeout=5.0)
        >>> weight = torch.zeros(3)
        >>> with region:
        ...     _ = weight.copy_(torch.tensor([1.0, float("nan"), 3.0]))
        >>> weight
        tensor([1., 0., 3.])
        >>> with region:  # reusable: nothing is left on the instance between uses
        ...     _ = weight.copy_(torch.tensor([float("nan"), 2.0, float("nan")]))
        >>> weight
        tensor([1., 2., 3.])
    """

    __slots__ = ("_strategy", "_timeout")

    def __init__(self, strategy: CopyStrategy | None = None, *, timeout: float | None = None):
        self._strategy = as_strategy(strategy, NaNMask(), "masked_copy")
        self._timeout = seconds(timeout, "masked_copy(timeout=...)")

    @property
    def strategy(self) -> CopyStrategy:
        """The strategy whose merge replaces ``copy_`` inside the region."""
        return self._strategy

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for the global lock on entry (`None`: wait forever)."""
        return self._timeout

    def __repr__(self) -> str:
        timeout = "" if self._timeout is None else f", timeout={self._timeout!r}"
        return f"masked_copy(strategy={self._strategy!r}{timeout})"

    def __enter__(self) -> Self:
        region = _swap.Region(self, _StrategyInterceptor(self._strategy))
        try:
            _swap.enter(region, timeout=self._timeout)  # closes the region if it fails
            return self
        except BaseException:  # an asynchronous exception right after entering
            _swap.leave(region)
            raise

    def __exit__(self, *exc_info: object) -> None:
        region: _swap.Region | None = None
        try:
            region = _swap.innermost(self)
            _swap.leave(region)
        finally:
            # A second attempt, for one cut short (`leave` is idempotent), the lookup too.
            if region is None:
                region = _swap.innermost(self)
            _swap.leave(region)

    def _run(self, body: Callable[[], R]) -> R:
        """`body()` in a region of its own, closed on every exit, even an asynchronous one.

        The decorators use it instead of ``with self:``: an exception raised between a
        ``with`` body's last line and ``__exit__`` would skip the exit. Here the close is
        attempted twice on every path, at different lines, and is idempotent.
        """
        region = _swap.Region(self, _StrategyInterceptor(self._strategy))
        try:
            _swap.enter(region, timeout=self._timeout)
            try:
                result = body()
            except BaseException:
                _swap.leave(region)
                raise
            _swap.leave(region)
            return result
        finally:
            _swap.leave(region)

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Decorate `func` so that each call (each resume, for a generator) runs in the region."""
        if isinstance(func, type):
            raise InvalidPatchTypeError(
                f"masked_copy cannot decorate a class (you supplied {func!r}); decorate the "
                "method that loads weights (e.g. load_weights), or wrap the call in "
                "`with masked_copy(...):`"
            )
        if not callable(func):
            raise InvalidPatchTypeError(f"masked_copy decorates functions; you supplied {func!r}")
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise InvalidPatchTypeError(
                f"masked_copy cannot decorate the async function {func!r}: the region holds a "
                "process-wide lock and must not stay open across an await; use "
                "`with masked_copy(...):` around the synchronous loading code"
            )
        if inspect.isgeneratorfunction(func):
            return cast("Callable[P, R]", self._wrap_generator(func))

        @functools.wraps(func)
        def call_in_region(*args: P.args, **kwargs: P.kwargs) -> R:
            return self._run(lambda: func(*args, **kwargs))

        return call_in_region

    def _wrap_generator(
        self, func: Callable[P, Generator[Any, Any, Any]]
    ) -> Callable[P, Generator[Any, Any, Any]]:
        @functools.wraps(func)
        def resume_in_region(*args: P.args, **kwargs: P.kwargs) -> Generator[Any, Any, Any]:
            generator = func(*args, **kwargs)  # runs no code until the first send
            try:
                item = self._run(functools.partial(generator.send, None))
                while True:
                    try:
                        sent = yield item
                    except GeneratorExit:
                        self._run(generator.close)
                        raise
                    except BaseException as error:
                        item = self._run(functools.partial(generator.throw, error))
                    else:
                        item = self._run(functools.partial(generator.send, sent))
            except StopIteration as stop:
                return stop.value

        return resume_in_region


@overload
def masked_copy(func: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def masked_copy(
    strategy: CopyStrategy | None = None, *, timeout: float | None = None
) -> MaskedCopy: ...


def masked_copy(
    strategy: CopyStrategy | Callable[..., Any] | None = None, *, timeout: float | None = None
) -> MaskedCopy | Callable[..., Any]:
    """Make ``Tensor.copy_`` keep the destination wherever the source says "keep".

    Use it as a context manager around any ``load_weights`` call, or as a decorator
    (``@masked_copy`` or ``@masked_copy(strategy=...)``) on functions, methods and generator
    functions. Inside the region every ``copy_`` made by this thread keeps the destination
    where the source says "keep": a tensor a strategy staged by its own mask, whatever the
    region's strategy, and a plain tensor as the region's strategy reads it (NaN under
    `NaNMask`; `BoolMask` refuses one). **Other threads are never affected**: they keep plain
    ``copy_`` while regions run, and regions in different threads take turns on one
    process-wide lock. Regions nest in one thread; the innermost strategy applies.

    Args:
        strategy: How a plain (unstaged) source marks unchanged positions. Defaults to
            `NaNMask()`.
        timeout: Seconds to wait for the process-wide lock; `None` waits forever. On expiry
            `TimeoutError` is raised and nothing has changed.

    Returns:
        A reusable `MaskedCopy` (or, used bare as ``@masked_copy``, the decorated function).

    Raises:
        TypeError: `strategy` is not a strategy instance, or a class or async function was
            decorated.
        ValueError: `timeout` is negative.

    Examples:
        >>> import torch
        >>> from patchctx import NaNMask, masked_copy
        >>> weight = torch.zeros(4)
        >>> staged = NaNMask().stage((4,), torch.float32, torch.tensor([1, 3]),
        ...                          torch.tensor([5.0, 6.0]))
        >>> with masked_copy(strategy=NaNMask()):
        ...     _ = weight.copy_(staged)   # what a model's load_weights does
        >>> weight
        tensor([0., 5., 0., 6.])
    """
    if strategy is not None and callable(strategy) and not isinstance(strategy, CopyStrategy):
        if isinstance(strategy, type) and issubclass(strategy, CopyStrategy):
            as_strategy(strategy, NaNMask(), "masked_copy")  # raises: instantiate it
        return MaskedCopy(timeout=timeout)(strategy)
    return MaskedCopy(strategy, timeout=timeout)
