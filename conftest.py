"""Collection rules for the whole repository (pytest reads this before anything under it).

``patchctx/vllm`` needs vLLM. Without it (the core environment) its modules are not collected
for ``--doctest-modules``, since importing them raises ImportError by design. With it (the vLLM
lane) its doctests run, marked ``vllm`` like the tests in ``tests/vllm`` (whose conftest holds
the lane's own rules), and vLLM is imported once before collection with its import-time
warnings ignored.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from pathlib import Path

import pytest

VLLM_PACKAGE = Path(__file__).parent / "patchctx" / "vllm"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

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


@pytest.hookimpl(tryfirst=True)  # before `-m vllm` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the doctests of ``patchctx/vllm`` ``vllm``: they run in the vLLM lane."""
    for item in items:
        if item.path.is_relative_to(VLLM_PACKAGE):
            item.add_marker(pytest.mark.vllm)
