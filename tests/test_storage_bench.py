"""A smoke run of benchmarks.storage_bench: every density, every column, and the table."""

from __future__ import annotations

from benchmarks.storage_bench import DENSITIES, storage_rows, table


def test_the_storage_bench_measures_each_step_at_each_density() -> None:
    rows = storage_rows(hidden=128, rounds=2)
    assert [row["density"] for row in rows] == list(DENSITIES)
    for row in rows:
        for step in ("publish", "background", "pause", "bare"):
            assert 0 < row[f"{step}_min_ms"] <= row[f"{step}_median_ms"]
        assert 0 < row["pause_share"] < 1
    assert rows[0]["nnz"] < rows[1]["nnz"] < rows[2]["nnz"]
    assert table(rows).count("\n") == len(rows) + 1
