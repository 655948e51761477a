"""The vLLM lane: tests against vLLM's real layers, models and engine.

Every test in this folder is marked ``vllm``. Without vLLM installed (the core environment)
each test module skips at import (``pytest.importorskip``). In the vLLM lane the test command
sets ``PATCHCTX_REQUIRE_VLLM=1``: then the run fails if any test here was skipped or none ran.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REQUIRE_VLLM = os.environ.get("PATCHCTX_REQUIRE_VLLM") == "1"

# The support modules import patchctx.vllm, which needs vLLM: without it, --doctest-modules
# must not import them.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["support"]


class _LaneCheck:
    def __init__(self) -> None:
        self.ran = 0
        self.skipped: list[str] = []


_lane = _LaneCheck()


def _in_this_folder(path: object) -> bool:
    try:
        return Path(str(path)).resolve().is_relative_to(HERE)
    except (OSError, ValueError):
        return False


@pytest.hookimpl(tryfirst=True)  # before `-m vllm` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_this_folder(item.path):
            item.add_marker(pytest.mark.vllm)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and _in_this_folder(report.fspath):
        _lane.skipped.append(report.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "vllm" not in report.keywords or hasattr(report, "wasxfail"):
        return
    if report.skipped:
        _lane.skipped.append(report.nodeid)
    elif report.when == "call":
        _lane.ran += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if REQUIRE_VLLM and (_lane.skipped or not _lane.ran):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REQUIRE_VLLM:
        return
    if _lane.skipped or not _lane.ran:
        terminalreporter.write_line(
            f"vLLM lane FAILED: PATCHCTX_REQUIRE_VLLM=1, but {_lane.ran} vllm tests ran and "
            f"{len(_lane.skipped)} were skipped: {_lane.skipped[:5]}",
            red=True,
        )
    else:
        terminalreporter.write_line(f"vLLM lane: {_lane.ran} vllm tests ran, none skipped")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per architecture, written by ``transformers`` for this session."""
    from tests.vllm.support.checkpoints import ARCHITECTURES, write_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: write_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture
def single_rank() -> None:
    """This process as a TP=1 vLLM world (kept across tests; engines tear it down)."""
    from tests.vllm.support.dist import ensure_single_rank

    ensure_single_rank()
