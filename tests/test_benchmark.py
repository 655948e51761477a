"""The benchmark runs end to end in a tiny configuration (a smoke test, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_runs_and_all_methods_agree_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.patch_bench",
            "--hidden",
            "256",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "baseline = vLLM's" in result.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    methods = {row["method"] for row in rows}
    assert {"baseline", "patchctx", "patchctx+routes", "lower-bound", "dense-reload"} <= methods
    assert any(m.startswith("route recording") for m in methods)
    measured = [row for row in rows if row["identical"] is not None]
    assert len(measured) == 2 * 3 * 5  # dtypes x densities x methods
    assert all(row["identical"] for row in measured)
    assert all(row["peak_extra_mib"] is not None for row in measured)  # memory is measured
    assert report["settings"]["hidden"] == 256
