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
    arguments = [*TINY, "--tp", "1", "--densities", "0.01", "--repeats", "1"]
    server_env = ["--server-env", "MALLOC_ARENA_MAX=2"]  # the server's environment only
    links = ["--links", "0", "1.25e8"]
    assert main([*arguments, *links, *server_env, "--no-calibrate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["model"].endswith("; servers with MALLOC_ARENA_MAX=2")
    assert [(r["tp"], r["link"], r["method"]) for r in report["rows"]] == [
        (1, link, method) for link in (0.0, 1.25e8) for method in METHODS
    ]
    for row in report["rows"]:
        assert row["nbytes"] > 0 and 0 < row["total_ms"][0] <= row["total_ms"][1]
        parts = sum(row[key][0] for key in ("trainer_ms", "wire_ms", "worker_ms"))
        assert parts == pytest.approx(row["total_ms"][0], rel=1e-6)  # one update, split
    by = {(r["link"], r["method"]): r for r in report["rows"]}
    for link in (0.0, 1.25e8):  # 1% sent sparse is smaller
        assert by[link, "patchctx sparse"]["nbytes"] < by[link, "patchctx dense"]["nbytes"]
        # what each sent whole: the forced dense row every value, the sparse one less
        dense, sparse = by[link, "patchctx dense"], by[link, "patchctx sparse"]
        assert 0 < dense["dense_nbytes"] <= dense["nbytes"]
        assert sparse["dense_nbytes"] < dense["dense_nbytes"]
    # The bucket charges every method's bytes alike: at least its bytes over the rate (less
    # the 64 KiB burst), and not much more (sleeps overrun on a loaded machine).
    for method in METHODS:
        row, least = by[1.25e8, method], (by[1.25e8, method]["nbytes"] - 65536) / 1.25e5
        assert least <= row["wire_ms"][0] <= 1.5 * least + 50, method
        assert by[0.0, method]["wire_ms"][0] == 0
    assert "verdict (on each row" in text and "first update of a fresh engine" in text
    # two untimed warm-up updates of each kind (the default) before the rows, reported apart
    warmed = report["first_update"]["warmup"]["1"]
    assert [len(warmed[name]) for name in ("patchctx", "vllm reload")] == [2, 2]
    assert all(ms > 0 for times in warmed.values() for ms in times)
    assert "warm-up updates at TP=1" in text
    assert "than vllm reload" in text and ("machine quiet" in text or "MACHINE LOADED" in text)
    assert "the cost model sent" in text and "token bucket" in text


def test_the_engine_bench_calibrates_through_this_trees_data_plane() -> None:
    from benchmarks.engine_bench import local_plane
    from patchctx import UpdateCost

    # A million elements, fastest of 3: the slope per byte is a difference of two timings,
    # and at 64K elements once each the machine's noise could exceed the payload's cost.
    cost = UpdateCost.calibrate(numel=2**20, repeats=3, payload=local_plane())
    assert 0 < cost.payload_seconds_per_byte < 1e-6
    assert 0 <= cost.plane_seconds_per_element < 1e-5
    assert "payload, per byte" in cost.describe()


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
    assert set(report) == {
        "fixed cost",
        "dense",
        "sparse 1%",
        "sparse 1%, gap-coded",
        "sparse 10%",
    }
    fixed = report["fixed cost"][-1]["ms"]
    for name, rows in report.items():
        assert rows[0]["memcpys"] == [1.0, 1.0]
        whole = rows[-1]
        assert whole["stage"].startswith("whole path")
        assert all(row["page faults"] >= 0 for row in rows)
        if name != "fixed cost":  # the payload's own cost: its whole path less the fixed one
            unit = rows[0]["ms"]
            assert whole["memcpys less the fixed cost"] == pytest.approx(
                [(whole["ms"][i] - fixed[i]) / unit[i] for i in (0, 1)]
            )
    text = capsys.readouterr().out
    assert "the whole path costs" in text
    assert "less the fixed cost of an update" in text
