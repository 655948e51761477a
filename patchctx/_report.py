"""The per-name reports of `audit` and `RouteCache.warm`: counting and printing their rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["status_counts", "status_table"]


class _Row(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str: ...


def status_counts(rows: Iterable[_Row], statuses: Sequence[str]) -> dict[str, int]:
    """How many rows have each of `statuses` (every one present, in that order)."""
    counted = Counter(row.status for row in rows)
    return {status: counted.get(status, 0) for status in statuses}


def status_table(rows: Sequence[_Row], counts: dict[str, int]) -> str:
    """The rows as a table (name, status, reason), then a line of the counts."""
    width = max([len("name"), *(len(row.name) for row in rows)])
    lines = [f"{'name':<{width}}  {'status':<11}  reason", f"{'-' * width}  {'-' * 11}  ------"]
    lines += [f"{row.name:<{width}}  {row.status:<11}  {row.reason}".rstrip() for row in rows]
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    return "\n".join(lines)
