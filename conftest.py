"""Collection rules for the whole repository (pytest reads this before anything under it).

The vLLM lane is ``tests/vllm`` and the doctests of ``patchctx/vllm``: every item there is
marked ``vllm`` here. ``patchctx/vllm`` needs vLLM: without it (the core environment) its
modules are not collected for ``--doctest-modules``, since importing them raises ImportError by
design, and the tests in ``tests/vllm`` skip at import. With it, vLLM is imported once before
collection with its import-time warnings ignored. The lane's test command sets
``PATCHCTX_REQUIRE_VLLM=1``: then the run fails if any lane item was skipped or none ran.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
LANE = (ROOT / "tests" / "vllm", ROOT / "patchctx" / "vllm")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("PATCHCTX_REQUIRE_VLLM") == "1"

collect_ignore = [] if HAVE_VLLM else ["patchctx/vllm"]

# Warnings that vLLM and its dependencies raise from their own code on import or at engine
# start; none is about patchctx. Everything else still fails the run (filterwarnings=error).
VLLM_WARNING_FILTERS = ("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",)

# Imported once, warnings ignored, before any test module: vLLM and torch modules it pulls in
# warn at import time (e.g. torch.utils.mkldnn's `torch.jit.script_method` deprecation).
WARM_IMPORTS = (
    "vllm",
    "vllm.config",
    "vllm.distributed",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
    "vllm.model_executor.model_loader.checkpoint_weight_patch",
    "vllm.model_executor.model_loader.utils",
    "transformers",
)


def pytest_configure(config: pytest.Config) -> None:
    """Add vLLM's warning filters and import it once, quietly, when it is installed."""
    if not HAVE_VLLM:
        return
    for line in VLLM_WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in WARM_IMPORTS:
            try:
                importlib.import_module(module)
            except Exception:  # a broken install shows up as the test modules' skips
                return


def _in_lane(path: object) -> bool:
    try:
        resolved = Path(str(path)).resolve()
    except (OSError, ValueError):
        return False
    return any(resolved.is_relative_to(folder) for folder in LANE)


class _LaneCheck:
    def __init__(self) -> None:
        self.ran = 0
        self.skipped: list[str] = []


_lane = _LaneCheck()


@pytest.hookimpl(tryfirst=True)  # before `-m vllm` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every item of the lane ``vllm``."""
    for item in items:
        if _in_lane(item.path):
            item.add_marker(pytest.mark.vllm)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Remember lane modules skipped at collection (vLLM missing)."""
    if report.skipped and _in_lane(report.fspath):
        _lane.skipped.append(report.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count the lane items that ran and those skipped."""
    if "vllm" not in report.keywords or hasattr(report, "wasxfail"):
        return
    if report.skipped:
        _lane.skipped.append(report.nodeid)
    elif report.when == "call":
        _lane.ran += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``PATCHCTX_REQUIRE_VLLM=1``, fail a run that skipped lane items or ran none."""
    if REQUIRE_VLLM and (_lane.skipped or not _lane.ran):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how many lane items ran (``PATCHCTX_REQUIRE_VLLM=1`` only)."""
    if not REQUIRE_VLLM:
        return
    if _lane.skipped or not _lane.ran:
        terminalreporter.write_line(
            f"vLLM lane FAILED: PATCHCTX_REQUIRE_VLLM=1, but {_lane.ran} vllm items ran and "
            f"{len(_lane.skipped)} were skipped: {_lane.skipped[:5]}",
            red=True,
        )
    else:
        terminalreporter.write_line(f"vLLM lane: {_lane.ran} vllm items ran, none skipped")
