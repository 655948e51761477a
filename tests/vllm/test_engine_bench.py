"""Smoke runs of the vLLM benches (``./dev bench --engine``, ``--serving``, ``--dataplane``) on a
tiny model: every method's row, the verdict and the JSON come out, and the numbers are sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

TINY = ["--hidden", "128", "--layers", "1", "--vocab", "1024"]


def test_the_engine_bench_prints_every_method_a_verdict_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.engine_bench import METHODS, main

    out = tmp_path / "engine.json"
    arguments = [*TINY, "--densities", "0.01", "--repeats", "1", "--links", "0", "1.25e8"]
    assert main([*arguments, "--no-calibrate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [(r["link"], r["method"]) for r in report["rows"]] == [
        (link, method) for link in (0.0, 1.25e8) for method in METHODS
    ]
    for row in report["rows"]:
        assert row["nbytes"] > 0 and 0 < row["total_ms"][0] <= row["total_ms"][1]
    dense = {r["link"]: r["nbytes"] for r in report["rows"] if r["method"] == "patchctx dense"}
    sparse = {r["link"]: r["nbytes"] for r in report["rows"] if r["method"] == "patchctx sparse"}
    assert all(sparse[link] < dense[link] for link in dense)  # 1% sent sparse is smaller
    assert "verdict (on each row" in text and "first update of a fresh engine" in text
    assert "than vllm reload" in text and ("machine quiet" in text or "MACHINE LOADED" in text)


def test_the_serving_bench_decodes_with_and_without_patchctx(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.serving_bench import main

    out = tmp_path / "serving.json"
    arguments = [*TINY, "--tokens", "4", "--repeats", "1", "--rounds", "1"]
    assert main([*arguments, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    methods = [r["method"] for r in rows]
    assert methods[:4] == ["vllm", "patchctx", "kept layout", "patchctx, after an update"]
    assert rows[0]["ratio"] == [1.0, 1.0]
    assert "| patchctx |" in capsys.readouterr().out


def test_the_dataplane_bench_measures_every_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.dataplane_bench import main

    out = tmp_path / "dataplane.json"
    assert main(["--numel", "65536", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"dense", "sparse 1%", "sparse 1%, gap-coded"}
    for rows in report.values():
        assert rows[0]["memcpys"] == [1.0, 1.0]
        assert rows[-1]["stage"].startswith("whole path")
    assert "the whole path costs" in capsys.readouterr().out
