"""vLLM is optional: the core never imports it, and ``patchctx.vllm`` says clearly that it needs it.

Both run in fresh interpreters, so they hold whether or not vLLM is installed here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_core_never_imports_vllm() -> None:
    result = run(
        "import pkgutil, importlib, sys\n"
        "import patchctx\n"
        "for info in pkgutil.walk_packages(patchctx.__path__, 'patchctx.'):\n"
        "    if not info.name.startswith('patchctx.vllm'):\n"
        "        importlib.import_module(info.name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "print(len(list(pkgutil.walk_packages(patchctx.__path__))), loaded)\n"
    )
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(" ", 1)
    assert int(count) > 10 and loaded.strip() == "[]"


def test_importing_patchctx_vllm_without_vllm_raises_a_clear_import_error() -> None:
    result = run(
        "import sys\n"
        "sys.modules['vllm'] = None  # as if vLLM were not installed\n"
        "try:\n"
        "    import patchctx.vllm\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error.name, '|', error)\n"
        "import patchctx\n"
        "print(patchctx.load_checkpoint_weight_patches.__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()
    assert first.startswith("ImportError vllm | patchctx.vllm needs vLLM, which is not installed")
    assert "pip install 'patchctx[vllm]'" in first
    assert second == "load_checkpoint_weight_patches"
