"""The benchmark as a tool: it runs end to end in its quick mode (a smoke test, not a timing),
reports progress, prints a table whose every column has a legend, writes JSON and a PNG chart;
and the docs' charts are exactly what `benchmarks.charts` draws from the committed report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import charts
from benchmarks.patch_bench import METHODS, Row, _without_output, main, table
from benchmarks.wire_bench import METHODS as WIRE_METHODS

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reports_progress_a_table_json_and_a_chart(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [sys.executable, "-m", "benchmarks.patch_bench", "--quick"]
    result = subprocess.run(
        [*command, "--json", str(out), "--plot", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # progress on stderr: both runs, every configuration, with the time elapsed
    progress = result.stderr.splitlines()
    assert all(re.match(r"\[ *\d+\.\d s\] ", line) for line in progress), result.stderr
    for expected in ("run 1 of 2", "run 2 of 2", "times: bf16 0.100%", "memory: fp32 10.000%"):
        assert any(expected in line for line in progress), f"no progress line {expected!r}"
    assert progress[-1].endswith("done")
    # the table, then a legend naming every column and method
    assert "baseline: vLLM's" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("dtype"))
    legend = result.stdout.split("columns:")[1]
    for column in ("dtype", "patches", "density", "method", "min ms", "vs base", "MiB", "B/chg"):
        assert column in header and f"\n  {column}" in legend, column
    for method in METHODS:
        assert f"\n  {method} " in legend.split("methods:")[1], method
    # the JSON: every method, bit-identical results, min <= median <= max, measured memory
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {row["method"] for row in rows} >= set(METHODS)
    assert any(row["method"].startswith("route recording") for row in rows)
    measured = [row for row in rows if row["identical"] is not None]
    assert len(measured) == 2 * 3 * 5  # dtypes x densities x methods
    assert all(row["identical"] for row in measured)
    assert all(row["min_ms"] <= row["median_ms"] <= row["max_ms"] for row in measured)
    assert all(row["peak_extra_mib"] is not None for row in measured)  # memory is measured
    assert report["settings"]["hidden"] == 256 and report["settings"]["repeats"] == 2
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_json_alone_prints_the_report_instead_of_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATCHCTX_BENCH_T0", str(time.time()))  # restored afterwards
    argv = ["--quick", "--measure", "time", "--dtypes", "fp32", "--densities", "0.01", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON and nothing else
    assert {row["method"] for row in report["rows"]} >= set(METHODS)
    assert "fp32 1.000%: 2 rounds x 5 methods" in captured.err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("4096", "0.001,0.01,0.1", "bf16,fp32", "1e-6,1e-7", "5", "auto"):
        assert f"(default: {default})" in text, default
    assert text.count("(default:") >= 12


def test_the_parent_run_keeps_its_output_options_to_itself() -> None:
    kept = _without_output(["--hidden", "8", "--json", "--quiet", "--plot", "x.png"])
    assert kept == ["--hidden", "8"]
    assert _without_output(["--json", "out.json", "--measure=time", "--tp", "1"]) == ["--tp", "1"]


def test_table_shows_min_median_max_and_blank_cells_for_what_was_not_measured() -> None:
    report = json.loads((ROOT / "docs" / "assets" / "bench-reference.json").read_text())
    row = {**report["rows"][1], "min_ms": 1.0, "median_ms": 2.0, "max_ms": 30.0}
    text = table([Row(**row)], report["settings"])
    line = next(line for line in text.splitlines() if line.startswith("bf16"))
    assert re.search(r"baseline +1\.00 +2\.00 +30\.00 ", line), line
    # a row without min and max (a report from an older run) still prints its median
    older = {k: v for k, v in report["rows"][1].items() if k not in ("min_ms", "max_ms")}
    assert f"{older['median_ms']:.2f}" in table([Row(**older)], report["settings"])


def test_docs_charts_are_drawn_from_the_committed_report() -> None:
    report = json.loads(charts.REFERENCE.read_text())
    for name, data in charts.docs_charts(report).items():
        committed = charts.ASSETS / name
        assert committed.read_bytes() == data, (
            f"{committed.relative_to(ROOT)} is not what {charts.REFERENCE.name} draws: run "
            "python -m benchmarks.charts"
        )


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout (git archive)")
def test_versus_runs_a_revision_against_this_one_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "versus.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.versus",
            "--base",
            "HEAD",
            "--rounds",
            "1",
            "--hidden",
            "256",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "bit-identical after every round" in result.stdout
    for kind in ("replay", "loader"):
        assert len(re.findall(rf"%\s+{kind}\s", result.stdout)) == 3  # three densities
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report) == {"0.1%", "1.0%", "10.0%"}
    assert all(len(times) == 1 for row in report.values() for times in row.values())
    many = subprocess.run(
        [sys.executable, "-m", "benchmarks.versus", "--base", "HEAD", "--many", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert many.returncode == 0, many.stderr
    assert "replay, per tensor" in many.stdout and "dense reload, per tensor" in many.stdout


def test_replay_bench_quick_prints_its_six_tables_and_json(tmp_path: Path) -> None:
    from benchmarks import replay_bench

    out = tmp_path / "replay.json"
    assert replay_bench.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    tables = {row["table"] for row in report["rows"]}
    assert tables == {"sweep", "row", "fixed", "warm", "cold", "contention"}
    methods = {row["method"] for row in report["rows"] if row["table"] == "sweep"}
    replays = {"replay", "replay, one element each"}
    warm = {row["method"] for row in report["rows"] if row["table"] == "warm"}
    assert warm == {"replay", "validation"}
    assert methods == {"index_copy_", "scatter_", "dense"} | replays
    assert all(row["min_us"] > 0 and row["median_us"] >= row["min_us"] for row in report["rows"])
    for row in report["rows"]:
        if row["table"] == "sweep" and row["method"] == "replay":
            assert re.fullmatch(
                r"[\d.]+x index_copy_; -?[\d.]+x beyond its own fixed cost; "
                r"[\d.]+x the goal's budget",
                row["note"],
            ), row["note"]


def test_wire_bench_quick_run_prints_both_tables_and_json(tmp_path: Path) -> None:
    """A smoke run of benchmarks.wire_bench: every method and encoding in its JSON, identical
    weights after every method, the choice's ratios present (a smoke test, not a timing)."""
    out = tmp_path / "wire.json"
    command = [sys.executable, "-m", "benchmarks.wire_bench", "--quick", "--densities", "0.01,0.3"]
    result = subprocess.run(
        [*command, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Wire bytes of one tensor's update" in result.stdout
    assert "Total update time" in result.stdout
    report = json.loads(out.read_text())
    assert {row["chosen"] for row in report["bytes"]} <= {"indices", "gaps", "bitmask"}
    for row in report["bytes"]:
        sizes = (row["indices"], row["gaps"], row["bitmask"])
        assert row["chosen_over_dense"] * row["dense"] == pytest.approx(min(sizes))
    assert {row["method"] for row in report["time"]} == set(WIRE_METHODS)
    assert all(row["identical"] is not False for row in report["time"])
    choices = [row for row in report["time"] if row["method"] == "choice"]
    assert choices and all(row["ratio_median"] > 0 and row["own_median"] > 0 for row in choices)
