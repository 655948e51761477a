"""Argument validation for every public entry point, in one place.

Each check takes the value a caller passed and the words that name the argument in a message
(``"ByteBudget(max_bytes=...)"``), and returns the value, normalised, or raises:

- `InvalidPatchTypeError` (a `PatchError`, `ValueError` and `TypeError`) for a value of the
  wrong type, a class where an instance is expected included;
- `InvalidPatchError` (a `PatchError` and `ValueError`) for a value of the right type that is
  out of range.

So ``except PatchError`` catches every bad argument, and code that caught vLLM's `TypeError` or
`ValueError` keeps working. Messages quote what the caller supplied and say how to fix it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from numbers import Real
from typing import NoReturn, TypeGuard

from patchctx._errors import InvalidPatchError, InvalidPatchTypeError, PatchProblem

__all__ = [
    "density",
    "flag",
    "instance_of",
    "known_names",
    "name_map",
    "optional_int",
    "positive_int",
    "seconds",
]


def _type_error(reason: str) -> NoReturn:
    raise InvalidPatchTypeError([PatchProblem(None, "", reason, is_type_error=True)])


def _value_error(reason: str) -> NoReturn:
    raise InvalidPatchError([PatchProblem(None, "", reason)])


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: object, where: str) -> int:
    """An int > 0 (a bool is not an int here)."""
    if not _is_int(value):
        _type_error(f"{where} takes an int, got {value!r}")
    if value <= 0:
        _value_error(f"{where} must be positive, got {value!r}")
    return value


def flag(value: object, where: str) -> bool:
    """A bool (an int is not)."""
    if not isinstance(value, bool):
        _type_error(f"{where} takes a bool, got {value!r}")
    return value


def optional_int(value: object, where: str) -> int | None:
    """An int, or `None`."""
    if value is None or _is_int(value):
        return value
    _type_error(f"{where} must be an int or None, got {value!r}")


def seconds(value: object, where: str) -> float | None:
    """A finite number of seconds >= 0, or `None` (wait forever)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        _type_error(f"{where} takes seconds (a number) or None; you supplied {value!r}")
    number = float(value)
    if math.isnan(number) or number < 0:
        _value_error(f"{where} must be >= 0 seconds; you supplied {value!r}")
    if math.isinf(number):
        _value_error(f"{where} must be finite; you supplied {value!r} (None waits forever)")
    return number


def density(value: object, where: str) -> float | None:
    """A fraction in (0, 1], or `None`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        _type_error(f"{where} must be a density in (0, 1] or None, got {value!r}")
    if not 0 < float(value) <= 1:
        _value_error(f"{where} must be a density in (0, 1] or None, got {value!r}")
    return float(value)


def instance_of(value: object, kind: type, where: str, examples: str) -> object:
    """An instance of `kind` (a class or a runtime-checkable protocol), not a class.

    A class passed where an instance is expected is refused with the fix (``Name()``): a
    class has the methods a protocol checks for, so ``isinstance`` alone would accept it.
    """
    if isinstance(value, type):
        _type_error(
            f"{where} takes a {kind.__name__} instance, not a class: you supplied {value!r}; "
            f"write {value.__name__}() instead"
        )
    if not isinstance(value, kind):
        _type_error(
            f"{where} takes a {kind.__name__} instance ({examples}); you supplied {value!r}"
        )
    return value


def name_map(value: object, where: str) -> dict[str, str]:
    """A mapping of str to str, or `None` (empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        _type_error(f"{where} (str -> str); you supplied {value!r}")
    return dict(value)


def known_names(names: Iterable[str], known: Iterable[str], where: str) -> None:
    """Every one of `names` is one of `known` (a typo must not switch a protection off)."""
    pool = list(known)
    available = set(pool)
    problems = []
    for name in names:
        if name in available:
            continue
        close = difflib.get_close_matches(name, pool, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(
            PatchProblem(
                None,
                name,
                f"{where} names {name!r}, which is not a parameter or buffer of the model{hint}",
            )
        )
    if problems:
        raise InvalidPatchError(problems)
