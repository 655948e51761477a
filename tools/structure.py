"""The core's shape, measured from the code's own AST: sizes, import closures, layering.

    .venv/bin/python tools/structure.py            # the report (a table), against the targets
    .venv/bin/python tools/structure.py --json F   # the same figures as JSON
    .venv/bin/python tools/structure.py --check    # exit 1 if a figure is over its ceiling

Nothing of patchctx is imported or run: every figure comes from parsing the files under
``patchctx/``. What it counts:

- *closures*: the modules a starting module imports, transitively, and their lines. ``eager``
  follows only module-level imports (what ``import`` loads); ``full`` follows function-level
  imports too (what a call may load). Imports under ``if TYPE_CHECKING:`` are never followed.
- *sizes*: the longest classes and functions, docstrings aside (a class counts its methods).
- *private names across files*: ``from patchctx._a import _b`` and ``module._b`` where
  ``module`` is an imported patchctx module; and attributes ``x._y`` read off anything but
  ``self``/``cls`` (reaching into another object's private state), but a named tuple's
  public methods (``_replace``, ``_asdict``: `NAMEDTUPLE_API`). Of those, the ones whose
  attribute no class of the reading module defines (its ``__slots__``, class-level names and
  ``self._x`` assignments) are counted again apart: private state that crosses a file, the
  issue's "no private name crosses a file" (torch's own, ``module._parameters``, among them).
- *circles*: groups of modules that import each other (strongly connected components).
- *upward imports*: imports from a module to one on a higher floor of ``LAYERS``.
- *words of the user docs*: the words of every page under ``docs/`` but the API reference and
  the changelog (``docs_words``): whitespace-separated tokens of the Markdown source with a
  letter or a digit in them (code and test ids included; table rules and bullets are not words).
  The changelog's words are counted the same way, as a figure of their own.

``--check`` compares each figure with its ceiling in ``CEILINGS`` (today's value once a step of
the restructuring has landed: a ratchet, so no change makes the shape worse unseen) and prints
the issue's targets beside them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "patchctx"

# Floors, bottom up: a module may import only its own floor and those below. A module that is
# in none of them is reported (the map must name every module of the core); a subpackage named
# here puts all its modules on that floor, and one named nowhere (``vllm``) sits above them all.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "values",
        (
            "_errors",
            "_tuning",
            "_arguments",
            "_report",
            "_grad",
            "_blocks",
            "_bits",
            "_model",
            "_kinds",
            "_tied",
            "_by_name",
            "_swap",
            "_staged",  # the value a strategy stages: it reads only this floor (Ledger inverts)
            "_strategies",
            "_masked_copy",
            "_chunking",
            "_ordering",
            "_patch",
            "_snapshot",
            "_cpu_passes",
            "_ops",
        ),
    ),
    (
        "dispatch",
        (
            "_dispatch_mode",
            "_geometry",
            "_frame",
            "_writes",
            "_guard",
            "_recording",
            "_undo",
        ),
    ),
    ("loader call", ("_session",)),
    ("routes", ("_routes",)),
    ("load", ("_load", "_warm", "_audit", "_prepare")),
    (
        "trainer",
        (
            "_encoding",
            "_changes",
            "_choose",
            "_cost",
            "_shards",
            "_diff",
            "_lowbyte",
            "testing",
        ),
    ),
    ("storage", ("_storage",)),  # a subpackage: its modules share its floor
    ("public face", ("__init__",)),
)

# Each figure's ceiling (the ratchet: lower it as a figure falls; line counts are rounded up to
# the next 50) and the target of issue 30.
CEILINGS: dict[str, int] = {
    "eager lines of `import patchctx`": 9_300,
    "full lines of load_checkpoint_weight_patches": 9_350,
    "full lines of masked_copy + strategies + swap + errors": 3_200,
    "classes over 150 lines": 0,
    "functions over 80 lines": 0,
    "private names imported across files": 0,
    "private attributes read off other objects": 107,
    "private attributes of another file's classes read": 6,
    "modules in import circles": 0,
    "upward imports": 0,
    "words of the user docs": 20_000,
    "words of the changelog": 3_000,
}
TARGETS: dict[str, int] = {
    "eager lines of `import patchctx`": 7_000,
    "full lines of load_checkpoint_weight_patches": 6_000,
    "full lines of masked_copy + strategies + swap + errors": 1_500,
    "classes over 150 lines": 0,
    "functions over 80 lines": 0,
    "private names imported across files": 0,
    "private attributes read off other objects": 0,
    "private attributes of another file's classes read": 0,
    "modules in import circles": 0,
    "upward imports": 0,
    "words of the user docs": 20_000,
    "words of the changelog": 3_000,
}

# Pages (or folders) of docs/ that are not user pages: the API reference, generated from the
# docstrings, and the changelog, which has a figure of its own.
NOT_USER_DOCS = ("api", "changelog")
CHANGELOG = Path("docs") / "changelog.md"
WORD = re.compile(r"\S*[^\W_]\S*")  # a token with a letter or a digit in it


@dataclass
class Module:
    """One parsed module of the package."""

    name: str  # dotted, relative to the package: "_load", "vllm._codec", "__init__"
    path: Path
    lines: int
    tree: ast.Module
    eager: set[str] = field(default_factory=set)  # modules imported at module level
    lazy: set[str] = field(default_factory=set)  # modules imported inside functions
    private_imports: list[str] = field(default_factory=list)
    private_reads: list[str] = field(default_factory=list)
    owns: set[str] = field(default_factory=set)  # private attributes its own classes define


# The methods `typing.NamedTuple` documents as its public API, underscored only so that they
# cannot clash with a field. (``_make`` is one too, but here it is also `CheckedPatch`'s private
# factory, so it stays counted.)
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_field_defaults"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """Ids of the statements under ``if TYPE_CHECKING:`` (never imported at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def _resolve(module: str, node: ast.ImportFrom, own: str) -> str | None:
    """The package-relative module an ``ImportFrom`` names, or None outside the package."""
    if node.level:
        parts = own.split(".")[:-1] if own != "__init__" else []
        parts = parts[: len(parts) - node.level + 1] if node.level > 1 else parts
        base = ".".join(parts)
        target = f"{base}.{module}" if base and module else (module or base)
        return target or "__init__"
    if module == PACKAGE:
        return "__init__"
    if module.startswith(PACKAGE + "."):
        return module[len(PACKAGE) + 1 :]
    return None


def parse(root: Path) -> dict[str, Module]:
    """Every module under ``root / patchctx``, with its imports and private reads."""
    modules: dict[str, Module] = {}
    base = root / PACKAGE
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        name = ".".join(parts)
        text = path.read_text(encoding="utf-8")
        modules[name] = Module(name, path, text.count("\n"), ast.parse(text))
    for module in modules.values():
        _read_imports(module, modules)
    return modules


def _package_dir(module: Module) -> Path:
    """The folder of the top package, ``patchctx/``, seen from `module`'s file."""
    depth = module.name.count(".") + (
        module.path.name == "__init__.py" and module.name != "__init__"
    )
    folder = module.path.parent
    for _ in range(depth):
        folder = folder.parent
    return folder


def _read_imports(module: Module, modules: dict[str, Module]) -> None:
    skipped = _type_checking_blocks(module.tree)
    module_level = {id(node) for node in module.tree.body}
    aliases: set[str] = set()  # local names bound to a patchctx module
    for node in ast.walk(module.tree):
        if id(node) in skipped:
            continue
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target = alias.name[len(PACKAGE) + 1 :] or "__init__"
                    targets.append((target, []))
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            resolved = _resolve(node.module or "", node, module.name)
            if resolved is not None:
                target = resolved
                names = [alias.name for alias in node.names]
                for alias in node.names:  # `from patchctx import _x` imports a module
                    sub = f"{target}.{alias.name}" if target != "__init__" else alias.name
                    folder = module.path.parent if node.level else _package_dir(module)
                    if sub in modules:
                        targets.append((sub, []))
                        aliases.add(alias.asname or alias.name)
                        names.remove(alias.name)
                    elif any(folder.glob(f"{alias.name}.*")):  # a compiled module: not measured
                        names.remove(alias.name)
                if names or not node.names:
                    targets.append((target, names))
        for target, names in targets:
            if target not in modules or target == module.name:
                continue
            (module.eager if id(node) in module_level else module.lazy).add(target)
            module.private_imports.extend(
                f"{module.name} <- {target}.{name}" for name in names if _is_private(name)
            )
    external: set[str] = set()  # names bound to modules outside the package: torch, ...
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            external.update(
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if not alias.name.startswith(PACKAGE)
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and not (node.module or "").startswith(PACKAGE)
        ):
            external.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            root = owner
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(owner, ast.Name) and owner.id in aliases:
                module.private_imports.append(f"{module.name} <- {owner.id}.{node.attr}")
            elif isinstance(root, ast.Name) and root.id in external:
                continue  # torch's own internals: another project's business
            elif node.attr in NAMEDTUPLE_API:
                continue  # a named tuple's public methods (`CheckpointWeightPatch._replace`)
            elif not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                module.private_reads.append(f"{module.name}:{node.lineno} .{node.attr}")
    module.lazy -= module.eager
    module.owns = _owned_attributes(module.tree)


def _owned_attributes(tree: ast.Module) -> set[str]:
    """The private attribute names the classes of a module define.

    Their ``__slots__``, their methods and class-level names, and what their methods assign on
    ``self`` (``self._x = ...``, ``object.__setattr__(self, "_x", ...)``).
    """
    owned: set[str] = set()
    for klass in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        owned.update(
            node.name
            for node in klass.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name)
        )
        for node in ast.walk(klass):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        value = node.value
                        if isinstance(value, (ast.Tuple, ast.List)):
                            owned.update(
                                e.value
                                for e in value.elts
                                if isinstance(e, ast.Constant) and isinstance(e.value, str)
                            )
                    elif isinstance(target, ast.Name) and _is_private(target.id):
                        owned.add(target.id)
                    elif (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                        and _is_private(target.attr)
                    ):
                        owned.add(target.attr)
    for node in ast.walk(tree):  # object.__setattr__(obj, "_x", value), as frozen classes set
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__setattr__"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            owned.add(node.args[1].value)
    return owned


def closure(modules: dict[str, Module], start: str, *, full: bool) -> set[str]:
    """The modules `start` imports, transitively (itself included).

    ``patchctx/__init__.py``, which Python runs before any ``patchctx._x``, is counted only
    where it is imported by name: the closure says what a module's own code needs.
    """
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        module = modules[name]
        todo.extend(module.eager)
        if full:
            todo.extend(module.lazy)
        if "." in name:  # importing a.b runs the subpackage's a/__init__.py first
            todo.append(name.rsplit(".", 1)[0])
    return seen


def _docstring_lines(node: ast.AST) -> int:
    """Lines of the docstrings inside `node` (its own and its methods')."""
    total = 0
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = inner.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first = body[0]
                total += (first.end_lineno or first.lineno) - first.lineno + 1
    return total


def sizes(modules: dict[str, Module]) -> Iterator[tuple[str, str, int]]:
    """(kind, qualified name, lines without docstrings) of every class and function."""

    def visit(node: ast.AST, prefix: str, module: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                lines -= _docstring_lines(child)
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                qualified = f"{prefix}{child.name}"
                yield kind, f"{module}:{qualified}", lines
                yield from visit(child, qualified + ".", module)

    for module in modules.values():
        yield from visit(module.tree, "", module.name)


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan), imports of any level."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(name: str) -> None:
        nonlocal counter
        index[name] = low[name] = counter
        counter += 1
        stack.append(name)
        on_stack.add(name)
        module = modules[name]
        for target in sorted(module.eager | module.lazy):
            if target not in index:
                connect(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == name:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for name in sorted(modules):
        if name not in index:
            connect(name)
    return found


def floors(modules: dict[str, Module]) -> tuple[list[str], list[str]]:
    """(upward imports, core modules on no floor); ``vllm`` and other subpackages sit on top."""
    named = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}
    floor_of = {name: named.get(name, named.get(name.split(".")[0], -1)) for name in modules}
    floor_of = {name: level for name, level in floor_of.items() if level >= 0}
    top = len(LAYERS)
    unplaced = sorted(
        name
        for name, module in modules.items()
        if "." not in name and module.path.name != "__init__.py" and name not in floor_of
    )
    unplaced += ["__init__"] if "__init__" not in floor_of else []
    upward = []
    for module in modules.values():
        own = floor_of.get(module.name, top)
        for target in sorted(module.eager | module.lazy):
            theirs = floor_of.get(target, top)
            if theirs > own:
                upward.append(f"{module.name} ({own}) -> {target} ({theirs})")
    return upward, unplaced


def words(text: str) -> int:
    """Whitespace-separated tokens of `text` with a letter or a digit in them."""
    return len(WORD.findall(text))


def docs_words(root: Path = ROOT) -> dict[str, int]:
    """Words of each user page under ``root / docs`` (see the module docstring), by path."""
    counts = {}
    for path in sorted((root / "docs").rglob("*.md")):
        relative = path.relative_to(root / "docs")
        if relative.parts[0].removesuffix(".md") in NOT_USER_DOCS:
            continue
        counts[relative.as_posix()] = words(path.read_text(encoding="utf-8"))
    return counts


def measure(root: Path = ROOT) -> dict[str, object]:
    """Every figure of the report, as plain data."""
    modules = parse(root)

    def lines_of(names: set[str]) -> int:
        return sum(modules[name].lines for name in names)

    eager = closure(modules, "__init__", full=False)
    load = closure(modules, "_load", full=True) if "_load" in modules else set()
    region = set()
    for start in ("_masked_copy", "_strategies", "_swap", "_errors"):
        if start in modules:
            region |= closure(modules, start, full=True)
    every = sorted(sizes(modules), key=lambda row: -row[2])
    big_classes = [
        f"{name} {lines}" for kind, name, lines in every if kind == "class" and lines > 150
    ]
    big_functions = [
        f"{name} {lines}" for kind, name, lines in every if kind == "function" and lines > 80
    ]
    private_imports = [line for m in modules.values() for line in m.private_imports]
    private_reads = [line for m in modules.values() for line in m.private_reads]
    across = [
        line
        for m in modules.values()
        for line in m.private_reads
        if line.rsplit(" .", 1)[1] not in m.owns
    ]
    groups = circles(modules)
    upward, unplaced = floors(modules)
    pages = docs_words(root)
    changelog = root / CHANGELOG
    figures = {
        "eager lines of `import patchctx`": lines_of(eager),
        "full lines of load_checkpoint_weight_patches": lines_of(load),
        "full lines of masked_copy + strategies + swap + errors": lines_of(region),
        "classes over 150 lines": len(big_classes),
        "functions over 80 lines": len(big_functions),
        "private names imported across files": len(private_imports),
        "private attributes read off other objects": len(private_reads),
        "private attributes of another file's classes read": len(across),
        "modules in import circles": sum(len(group) for group in groups),
        "upward imports": len(upward),
        "words of the user docs": sum(pages.values()),
        "words of the changelog": (
            words(changelog.read_text(encoding="utf-8")) if changelog.exists() else 0
        ),
    }
    return {
        "figures": figures,
        "modules": {"import patchctx": len(eager), "load_checkpoint_weight_patches": len(load)},
        "big classes": big_classes,
        "big functions": big_functions,
        "private imports": private_imports,
        "private reads": private_reads,
        "private reads across files": across,
        "circles": groups,
        "upward imports": upward,
        "unplaced modules": unplaced,
        "words per page": pages,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the report; with ``--check``, fail when a figure is over its ceiling."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 over a ceiling")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--verbose", action="store_true", help="list every offender")
    args = parser.parse_args(argv)
    report = measure()
    figures = report["figures"]
    assert isinstance(figures, dict)
    print(f"{'figure':56} {'now':>8} {'ceiling':>8} {'target':>8}")
    over = []
    for name, value in figures.items():
        mark = ""
        if value > CEILINGS[name]:
            over.append(name)
            mark = "  OVER CEILING"
        elif value <= TARGETS[name]:
            mark = "  target met"
        print(f"{name:56} {value:>8,} {CEILINGS[name]:>8,} {TARGETS[name]:>8,}{mark}")
    if report["unplaced modules"]:
        over.append("unplaced modules")
        print(f"core modules on no floor of LAYERS: {report['unplaced modules']}")
    if args.verbose:
        for key in ("big classes", "big functions", "circles", "upward imports", "private imports"):
            print(f"\n{key}:")
            for line in report[key]:  # type: ignore[attr-defined]
                print(f"  {line}")
        print("\nwords per page:")
        for page, count in report["words per page"].items():  # type: ignore[attr-defined]
            print(f"  {page:40} {count:>7,}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.check and over:
        print(f"over the ceiling: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
