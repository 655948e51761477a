"""The public API, read from the source: public modules and the names in their ``__all__``.

Read statically (no import), so an integration module whose optional dependency is missing
(``patchctx.vllm`` without vLLM) still counts: its reference page is built from source too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent.parent / "patchctx"


def public_modules() -> list[str]:
    """Dotted names of the modules under ``patchctx`` with no ``_private`` part."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))
    return found


def module_path(module: str) -> Path:
    """The source file of a module under ``patchctx``."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    package = base / "__init__.py"
    return package if package.exists() else base.with_suffix(".py")


def public_names() -> dict[str, list[str]]:
    """Each public module's ``__all__`` (a literal list or tuple of strings)."""
    names = {}
    for module in public_modules():
        tree = ast.parse(module_path(module).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names[module] = [str(x) for x in ast.literal_eval(node.value)]
                break
        else:
            raise AssertionError(f"{module} has no literal __all__: say what is public")
    return names
