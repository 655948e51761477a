"""Build hook: compile patchctx's C kernel (`patchctx/_ckernel.c`) into the wheel.

The kernel is optional: where no C compiler works, the wheel is built without it and patchctx
takes its Python and numpy passes instead (`patchctx/_kernel.py` says which ran). Set
``PATCHCTX_REQUIRE_KERNEL=1`` to make a failed compilation fail the build (the test command
does, where a compiler is found). An editable install compiles the module next to its source,
where the import finds it; a wheel carries it as ``patchctx/_ckernel<EXT_SUFFIX>``.

The module is compiled with the SHA-256 of its source as ``SOURCE``: `patchctx._kernel` does
not use a module built from another version of the file (an editable tree after an edit).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("patchctx") / "_ckernel.c"


def compile_kernel(root: Path, output: Path) -> Path:
    """Compile the kernel's source under `root` into the directory `output`; its path."""
    source = root / SOURCE
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    built = output / f"_ckernel{suffix}"
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    # Warnings are errors where the kernel is required (the test command): a user's newer
    # compiler warning about something harmless should not cost them the kernel.
    strict = ["-Werror"] if os.environ.get("PATCHCTX_REQUIRE_KERNEL") == "1" else []
    command = [
        *compiler,
        "-O3",
        "-std=c99",
        "-fPIC",
        "-shared",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        *strict,
        f"-I{sysconfig.get_paths()['include']}",
        f'-DPATCHCTX_SOURCE="{digest}"',
        str(source),
        "-o",
        str(built),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return built


class KernelBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compile the C kernel for wheels and editable installs; skip it where that fails."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Compile, and mark the wheel as platform-specific when the module is in it."""
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        editable = version == "editable"
        output = root / "patchctx" if editable else Path(tempfile.mkdtemp(prefix="patchctx-"))
        try:
            built = compile_kernel(root, output)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            message = f"patchctx: the C kernel was not compiled ({detail.strip()})"
            if os.environ.get("PATCHCTX_REQUIRE_KERNEL") == "1":
                raise RuntimeError(message) from error
            print(f"{message}; building without it", file=sys.stderr)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if not editable:
            build_data["force_include"][str(built)] = f"patchctx/{built.name}"
