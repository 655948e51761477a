"""The engine bench's own tools: its link simulation, its load check and its verdict.

The benches themselves run in the vLLM lane (``tests/vllm/test_engine_bench.py``); these
pieces run anywhere.
"""

from __future__ import annotations

import math
import time

import pytest

from benchmarks.engine_bench import METHODS, TokenBucket, verdict
from benchmarks.machine import LOADED, LoadSample, other_load, verdict_line


def test_a_token_bucket_admits_bytes_no_faster_than_its_rate() -> None:
    rate = 4e6  # 4 MB/s: 200 KB take 50 ms, less the 64 KiB burst
    bucket = TokenBucket(rate)
    started = time.perf_counter()
    bucket.admit(200_000)
    first = time.perf_counter() - started
    assert first >= (200_000 - (64 << 10)) / rate * 0.99
    bucket.admit(100_000)  # the burst is spent: the whole payload waits
    assert time.perf_counter() - started >= (300_000 - (64 << 10)) / rate * 0.99


def test_a_small_payload_crosses_within_the_burst_at_once() -> None:
    bucket = TokenBucket(1.0)  # one byte a second: anything but the burst would take hours
    started = time.perf_counter()
    bucket.admit(1000)
    assert time.perf_counter() - started < 1.0


def test_the_load_check_reads_the_cpus() -> None:
    sample = other_load(0.2)
    assert sample.cpus >= 1
    assert math.isnan(sample.busy) or 0.0 <= sample.busy <= 1.0
    assert "CPUs busy with other work" in sample.describe()


@pytest.mark.parametrize(("busy", "loaded"), [(0.0, False), (LOADED + 0.01, True)])
def test_the_verdict_says_when_the_machine_was_loaded(busy: float, loaded: bool) -> None:
    quiet = LoadSample(0.0, 2, 0.1)
    line = verdict_line(quiet, LoadSample(busy, 2, 1.0))
    assert line.startswith("MACHINE LOADED") is loaded
    assert ("machine quiet" in line) is not loaded


def _row(
    method: str, total: float, nbytes: int = 1_000, density: float = 0.01
) -> dict[str, object]:
    return {
        "tp": 1,
        "link": 0.0,
        "density": density,
        "method": method,
        "nbytes": nbytes,
        "total_ms": (total, 9 * total),
    }


_DENSE_BYTES = {"patchctx dense": 100_000, "vllm reload": 100_000}


def test_the_verdict_compares_with_vllms_reload_and_the_better_path() -> None:
    times = {"patchctx": 10.0, "patchctx sparse": 10.0, "patchctx dense": 40.0}
    rows = [_row(m, times.get(m, 30.0), _DENSE_BYTES.get(m, 1_000)) for m in METHODS]
    [line] = verdict({"rows": rows})
    assert line.startswith("TP=1")
    assert "3.00x faster than vllm reload" in line and "sent sparse (1.00x sparse)" in line
    # Twice the better path's time, having sent the other form: the model's choice was wrong.
    wrong = {"patchctx": (60.0, 100_000)}
    slow = [_row(m, *wrong.get(m, (30.0, _DENSE_BYTES.get(m, 1_000)))) for m in METHODS]
    [line] = verdict({"rows": slow})
    assert "2.00x SLOWER than vllm reload" in line and "dense (2.00x sparse, OVER 1.05)" in line
    # The same time gap having sent the better path's form is the machine's noise: "same".
    noisy = [_row(m, {"patchctx": 60.0}.get(m, 30.0), _DENSE_BYTES.get(m, 1_000)) for m in METHODS]
    [line] = verdict({"rows": noisy})
    assert "sparse (2.00x sparse, same)" in line


def test_the_verdict_tells_the_forms_apart_by_their_dense_bytes_when_sizes_match() -> None:
    # Over shared memory at 50% (fp32, flat positions) a sparse payload is as large as the
    # dense one: the rows' dense bytes say which form the model sent.
    dense_bytes = {"patchctx": 100_000, "patchctx sparse": 0, "patchctx dense": 100_000}
    times = {"patchctx": 30.0, "patchctx sparse": 60.0, "patchctx dense": 30.0}
    rows = []
    for method in METHODS:
        row = _row(method, times.get(method, 20.0), 100_000, density=0.5)
        if method in dense_bytes:
            row["dense_nbytes"] = dense_bytes[method]
        rows.append(row)
    [line] = verdict({"rows": rows})
    assert "sent dense (1.00x dense)" in line, line
