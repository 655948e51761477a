"""A smoke run of the storage path's row through ``vllm serve`` (``benchmarks.engine_storage``,
``./dev bench --engine --storage``) on a tiny model: every step is timed, the bare apply
replays as many routes as the pause, and the table, the walks and the verdict come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def test_the_storage_row_times_each_step_against_a_bare_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.engine_bench import main as engine_main
    from benchmarks.engine_storage import STEPS

    out = tmp_path / "storage.json"
    tiny = ["--hidden", "128", "--layers", "1", "--vocab", "1024", "--repeats", "2"]
    assert engine_main([*tiny, "--storage", "--json", str(out)]) == 0  # the engine bench's flag
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [row["density"] for row in report["rows"]] == [0.001, 0.01, 0.1]
    for row in report["rows"]:
        for step in STEPS:
            low, middle = row[step]
            assert 0 < low <= middle, (step, row)
        assert row["replayed"] > 0  # the pause replayed learnt routes
        assert row["window"][0] >= row["apply"][0]  # the window holds the apply
        assert 0 < row["apply_share"] < row["window_share"] < 1
    assert "apply/bare" in text and "verdict (medians)" in text and "transformed_weights" in text
