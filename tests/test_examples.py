"""Every fenced Python example in the README runs (docs pages join in the docs' own test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "README.md"))))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = python_blocks(ROOT / "README.md")[index]
    exec(compile(code, f"README.md[{index}]", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out  # each README example shows its result


def test_demo_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--changed", "5"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "all 5 changes landed once across 2 ranks" in result.stdout
