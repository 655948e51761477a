"""benchmarks.diff_bench as a tool: a small run prints its table and legend and writes JSON in
which both diffs agreed (a smoke test, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.diff_bench import METHODS

ROOT = Path(__file__).resolve().parent.parent


def test_a_small_run_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "diff.json"
    command = [sys.executable, "-m", "benchmarks.diff_bench", "--elements", "50000"]
    command += ["--rounds", "1", "--densities", "0.01,0.5", "--json", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].endswith("done")
    legend = result.stdout.split("methods:")[1]
    for method in METHODS:
        assert f"\n  {method} " in legend, method
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(row["source"], row["method"]) for row in rows} == {
        (source, method) for source in ("fp32", "bf16") for method in METHODS
    }
    assert all(row["min_ms"] <= row["median_ms"] for row in rows)
    assert all(row["ratio_min"] == 1.0 for row in rows if row["method"] == "copy")
    diffs = [row for row in rows if row["method"] in ("before", "now")]
    assert all(row["patches_mib"] is not None for row in diffs)
    assert report["settings"]["elements"] == 50_000
