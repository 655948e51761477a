"""benchmarks.charts draws ./dev bench --engine's report: one panel per engine and link."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from benchmarks import charts

METHODS = ("patchctx", "patchctx sparse", "patchctx dense", "vllm reload")


def report(tps: tuple[int, ...] = (1, 2), links: tuple[float, ...] = (0.0, 1.25e8)) -> Any:
    rows: list[dict[str, object]] = [
        {"tp": tp, "link": link, "density": density, "method": method, "total_ms": [t, t * 1.1]}
        for tp in tps
        for link in links
        for density in (0.001, 0.01, 0.1)
        for t, method in enumerate(METHODS, start=1)
    ]
    rows.append({"tp": 4, "failed": "vllm serve exited"})  # an engine that did not start
    return {"model": "Qwen2, tiny", "rows": rows}


def test_the_engine_chart_is_a_png_with_a_panel_per_engine_and_link(tmp_path: Path) -> None:
    source, out = tmp_path / "engine.json", tmp_path / "engine.png"
    source.write_text(json.dumps(report()))
    assert charts.main([str(source), "--engine", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")  # four panels side by side
    one = tmp_path / "one.png"
    charts.engine_png(report(tps=(1,), links=(0.0,)), one)
    assert width > 3 * int.from_bytes(one.read_bytes()[16:20], "big")
