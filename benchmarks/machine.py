"""Is the machine quiet enough to measure on? A concurrent-load check for the benchmarks.

`other_load` samples ``/proc/stat`` while this process sleeps: whatever keeps the CPUs busy
then is other work (the benchmark's own server is idle between its requests). A benchmark
takes one sample before it starts and one after it ends, prints both, and says the machine
was loaded when either is above `LOADED` of its CPUs, instead of printing numbers that
contradict themselves without saying why.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOADED", "LoadSample", "other_load", "verdict_line"]

LOADED = 0.25
"""The busy fraction of all CPUs, while the benchmark is idle, above which it says "loaded"."""


@dataclass(frozen=True)
class LoadSample:
    """Other work on the machine during one idle second of the benchmark."""

    busy: float
    """Fraction of all CPUs busy (0 to 1); NaN where ``/proc/stat`` cannot be read."""
    cpus: int
    """Logical CPUs."""
    loadavg: float
    """The 1-minute load average (runnable processes, ours included)."""

    def describe(self) -> str:
        """One line: busy CPUs, load average."""
        return (
            f"{self.busy * self.cpus:.1f} of {self.cpus} CPUs busy with other work "
            f"({self.busy:.0%}), load average {self.loadavg:.1f}"
        )


def _cpu_times() -> tuple[int, int] | None:
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def other_load(seconds: float = 1.0) -> LoadSample:
    """Sample the CPUs' busy fraction while this process sleeps for `seconds`."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    cpus = os.cpu_count() or 1
    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if before is None or after is None or after[1] == before[1]:
        return LoadSample(float("nan"), cpus, loadavg)
    busy = (after[0] - before[0]) / (after[1] - before[1])
    return LoadSample(max(0.0, min(1.0, busy)), cpus, loadavg)


def verdict_line(before: LoadSample, after: LoadSample) -> str:
    """What the two samples say about the run's numbers."""
    loaded = [s for s in (before, after) if s.busy > LOADED]
    if not loaded:
        return f"machine quiet: before the run {before.describe()}; after {after.describe()}"
    return (
        f"MACHINE LOADED (other work above {LOADED:.0%} of the CPUs): before the run "
        f"{before.describe()}; after {after.describe()}. Times swing with the load; ratios of "
        "methods interleaved in one process hold better than absolute times, and rows may "
        "contradict each other"
    )
