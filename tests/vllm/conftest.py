"""The vLLM lane: tests against vLLM's real layers, models and engine (fixtures).

Every test in this folder is marked ``vllm`` (by the root ``conftest.py``, which also holds
the lane's accounting). Without vLLM installed (the core environment) each test module skips
at import (``pytest.importorskip``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The support modules import patchctx.vllm, which needs vLLM: without it, --doctest-modules
# must not import them.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["support"]


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
