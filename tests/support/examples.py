"""Run the fenced Python examples of a Markdown page and check the output they show.

The conventions (CONTRIBUTING.md, "Examples in the docs"):

- Every ```` ```python ```` block runs. The blocks of one page run in order, in one namespace
  (a fresh module per page), so a later block may use what an earlier one defined.
- Output is shown with ``# >`` comments directly under the statement that prints it, as
  pytest-examples does with ``#>`` (ruff format, which formats the examples, writes ``# >``;
  both are read)::

      print(weight)
      # > tensor([0., 5., 0., 6.])

  Every ``print`` must be followed by its ``# >`` lines and every ``# >`` group must be
  printed, line for line (trailing spaces ignored). Anything written to stdout another way
  fails the page.
- A printed line too long for the docs' code column (`CODE_WIDTH` characters, the width of a
  code block on the site) is shown as several ``# >`` lines, each but the last ending with a
  backslash; the check joins them back (the backslash and nothing else is removed), and update
  mode writes them so::

      print(error)
      # > the loader writes staged data of 'w' into 'weight' with \
      # > aten.index_copy_.default, which cannot be masked in place

- ```` ```python test="skip" ```` marks a block that is shown but not run (use it sparingly:
  code that needs hardware or packages the test environment lacks).
- ``UPDATE_EXAMPLES=1 python -m pytest tests/test_examples.py`` rewrites the ``# >`` lines from
  what the examples print; review the diff.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent

OPEN_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*)$")
OPTION = re.compile(r"""(?P<key>[A-Za-z][\w-]*)(?:=(?P<quote>["'])(?P<value>.*?)(?P=quote))?""")
# "# >" is how ruff format (which formats the examples in Markdown) writes pytest-examples' "#>";
# both are read.
OUTPUT = re.compile(r"^[ \t]*# ?>(?: (?P<text>.*))?$")

# Characters of code that fit the content column of the site: 80 at every desktop width with
# mkdocs-material's default fonts (measured in Chromium by tests/test_docs_browser.py).
CODE_WIDTH = 80
CONTINUED = "\\"  # ends a # > line that the next one continues

RUNNABLE = frozenset({"python", "py"})
# Languages that would show Python without running it: write a python block with # > instead.
REFUSED = frozenset({"pycon", "python3", "py3"})
# Options a python fence may carry. superfences (relaxed_headers) drops every option of a fence
# that has one it does not know, so `test` cannot be combined with the others.
HIGHLIGHT_OPTIONS = frozenset({"title", "hl_lines", "linenums"})
TEST_VALUES = frozenset({"skip"})


class ExampleError(AssertionError):
    """A page's examples are malformed, fail, or print something other than they show."""


@dataclass(frozen=True)
class Fence:
    """One fenced code block of a Markdown file."""

    path: Path
    lang: str
    options: dict[str, str]
    first_line: int  # 1-based line number of the first code line in the file
    indent: str  # the fence's own indentation (inside list items), removed from each line
    lines: list[str]  # the code lines, indentation removed, without line ends

    @property
    def where(self) -> str:
        """``file:line`` of the fence's opening line, for messages."""
        return f"{display(self.path)}:{self.first_line - 1}"

    @property
    def skipped(self) -> bool:
        """Whether the block is marked ``test="skip"``."""
        return self.options.get("test") == "skip"


def display(path: Path) -> str:
    """`path` relative to the repository root when it lies inside it."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def parse_fences(path: Path) -> list[Fence]:
    """Every top-level fenced block of `path` (a fence nested in a longer fence is content)."""
    fences = []
    lines = path.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        match = OPEN_FENCE.match(lines[number])
        number += 1
        if match is None:
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        lang, _, rest = info.partition(" ")
        lang = lang.strip("{}.").lower()
        options = {m["key"]: m["value"] or "" for m in OPTION.finditer(rest)}
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        first = number + 1
        while number < len(lines) and not closing.match(lines[number]):
            line = lines[number]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            number += 1
        number += 1  # the closing fence
        fences.append(Fence(path, lang, options, first, indent, body))
    return fences


def check_fence_header(fence: Fence) -> None:
    """Refuse fence languages and options the harness or superfences would mishandle."""
    if fence.lang in REFUSED:
        raise ExampleError(
            f"{fence.where}: a ```{fence.lang} block is Python that never runs; write a "
            "```python block and show its output with # > comments"
        )
    if fence.lang not in RUNNABLE:
        return
    unknown = set(fence.options) - HIGHLIGHT_OPTIONS - {"test"}
    if unknown:
        raise ExampleError(
            f"{fence.where}: unknown fence option(s) {sorted(unknown)}; a python fence takes "
            f"{sorted(HIGHLIGHT_OPTIONS | {'test'})}"
        )
    if "test" in fence.options:
        if fence.options["test"] not in TEST_VALUES:
            raise ExampleError(
                f'{fence.where}: test="{fence.options["test"]}" is not understood; the only '
                'value is test="skip"'
            )
        if len(fence.options) > 1:
            raise ExampleError(
                f'{fence.where}: test="skip" cannot be combined with other fence options '
                "(superfences drops all of them on a fence with an option it does not know)"
            )


@dataclass
class _Printed:
    """What the examples of one page printed, by the line of the ``print`` call in the file."""

    filename: str
    by_line: dict[int, list[str]] = field(default_factory=dict)

    def print(
        self,
        *args: object,
        sep: str | None = " ",
        end: str | None = "\n",
        file: Any = None,
        flush: bool = False,
    ) -> None:
        if file is not None and file is not sys.stdout:
            builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
            return
        buffer = io.StringIO()
        builtins.print(*args, sep=sep, end=end, file=buffer)
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != self.filename:
            frame = frame.f_back
        if frame is None:  # printed from code that is not on the page: no place to show it
            sys.stdout.write(buffer.getvalue())
            return
        self.by_line.setdefault(frame.f_lineno, []).append(buffer.getvalue())


def _statements(tree: ast.AST) -> Iterator[ast.stmt]:
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            yield node


def _anchor(tree: ast.AST, line: int) -> ast.stmt:
    """The innermost statement around `line`: its output goes under its last line."""
    around = [s for s in _statements(tree) if s.lineno <= line <= (s.end_lineno or s.lineno)]
    return min(around, key=lambda s: (s.end_lineno or s.lineno) - s.lineno)


@dataclass
class _Block:
    fence: Fence
    tree: ast.Module
    shown: dict[int, list[str]]  # file line of a statement's last line -> its # > lines
    printed: dict[int, tuple[int, list[str]]] = field(default_factory=dict)  # -> (col, lines)

    @property
    def end(self) -> int:
        """The file line just after the block's last code line."""
        return self.fence.first_line + len(self.fence.lines)


def _shown_output(fence: Fence) -> dict[int, list[str]]:
    shown: dict[int, list[str]] = {}
    anchor = None
    continued = False
    for offset, line in enumerate(fence.lines):
        match = OUTPUT.match(line)
        if match is None:
            if continued:
                raise ExampleError(
                    f"{fence.where}: a # > line ends with {CONTINUED} but no # > line follows"
                )
            if line.strip():
                anchor = fence.first_line + offset
            continue
        if anchor is None:
            raise ExampleError(f"{fence.where}: # > output before any statement")
        text = (match["text"] or "").rstrip()
        lines = shown.setdefault(anchor, [])
        if continued:
            lines[-1] += text
        else:
            lines.append(text)
        continued = text.endswith(CONTINUED)
        if continued:
            lines[-1] = lines[-1].removesuffix(CONTINUED)
    return shown


def wrap_output(text: str, width: int) -> list[str]:
    """`text` in pieces of at most `width` characters, all but the last ending in a backslash.

    A piece ends after a space where there is one to break at, so that joining the pieces
    without their backslashes gives `text` back.
    """
    pieces = []
    while len(text) > width:
        cut = text.rfind(" ", 0, width - len(CONTINUED)) + 1
        if cut <= 0:  # nowhere to break: cut inside the word
            cut = width - len(CONTINUED)
        pieces.append(text[:cut] + CONTINUED)
        text = text[cut:]
    return [*pieces, text]


def _compile(fence: Fence) -> tuple[ast.Module, types.CodeType]:
    # Pad with blank lines so that line numbers in the code (tracebacks, print calls) are the
    # line numbers of the Markdown file.
    source = "\n" * (fence.first_line - 1) + "\n".join(fence.lines) + "\n"
    filename = str(fence.path)
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as error:
        raise ExampleError(f"{fence.where}: the example is not valid Python: {error}") from None
    return tree, compile(tree, filename, "exec")


def run_page(path: Path, *, update: bool | None = None) -> None:
    """Run every python block of `path` in order in one namespace; check the ``# >`` output.

    Args:
        path: The Markdown file.
        update: Rewrite the ``# >`` lines from what the examples print instead of comparing
            (default: the ``UPDATE_EXAMPLES`` environment variable is set and not ``0``).

    Raises:
        ExampleError: A fence is malformed, or an example printed other than it shows.
        Exception: Whatever an example raised, with its traceback into the Markdown file.
    """
    if update is None:
        update = os.environ.get("UPDATE_EXAMPLES", "0") not in ("", "0")
    fences = parse_fences(path)
    for fence in fences:
        check_fence_header(fence)
    runnable = [f for f in fences if f.lang in RUNNABLE and not f.skipped]
    if not runnable:
        return
    printed = _Printed(str(path))
    module_name = "docs_example_" + re.sub(r"\W", "_", display(path).removesuffix(".md"))
    module = types.ModuleType(module_name)
    module.__dict__.update(__file__=str(path), print=printed.print)
    stray = io.StringIO()
    blocks = []
    sys.modules[module_name] = module
    try:
        for fence in runnable:
            tree, code = _compile(fence)
            blocks.append(_Block(fence, tree, _shown_output(fence)))
            with contextlib.redirect_stdout(stray):
                exec(code, module.__dict__)
    finally:
        del sys.modules[module_name]
    for line, texts in printed.by_line.items():
        block = next(b for b in blocks if b.fence.first_line <= line < b.end)
        statement = _anchor(block.tree, line)
        end = statement.end_lineno or statement.lineno
        lines = [x.rstrip() for x in "".join(texts).removesuffix("\n").split("\n")]
        col, previous = block.printed.get(end, (statement.col_offset, []))
        block.printed[end] = (col, previous + lines)
    if stray.getvalue():
        raise ExampleError(
            f"{display(path)}: examples wrote to stdout other than through print() in the page "
            f"(so it cannot be shown with # >):\n{stray.getvalue()}"
        )
    if update:
        _rewrite(path, blocks)
        return
    problems = []
    for block in blocks:
        for line in sorted(set(block.shown) | set(block.printed)):
            shown = block.shown.get(line, [])
            col, actual = block.printed.get(line, (0, []))
            if shown != actual:
                problems.append(
                    f"{display(path)}:{line}: the output under this line differs\n"
                    f"  shown:\n{_as_comments(shown, 4)}\n  printed:\n{_as_comments(actual, 4)}"
                )
    if problems:
        raise ExampleError(
            "\n".join(problems)
            + "\n(UPDATE_EXAMPLES=1 python -m pytest tests/test_examples.py rewrites the # > lines)"
        )


def _as_comments(lines: list[str], col: int) -> str:
    if not lines:
        return " " * col + "(nothing)"
    return "\n".join(" " * col + ("# > " + x if x else "# >") for x in lines)


def _rewrite(path: Path, blocks: list[_Block]) -> None:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    inserts: dict[int, list[str]] = {}
    drop: set[int] = set()
    for block in blocks:
        fence = block.fence
        for offset, line in enumerate(fence.lines):
            if OUTPUT.match(line):
                drop.add(fence.first_line + offset)
        for end, (col, printed_lines) in block.printed.items():
            width = CODE_WIDTH - col - len("# > ")
            wrapped = [piece for x in printed_lines for piece in wrap_output(x, width)]
            inserts[end] = [fence.indent + x for x in _as_comments(wrapped, col).split("\n")]
    out = []
    for number, line in enumerate(lines, start=1):
        if number not in drop:
            out.append(line)
        out.extend(inserts.get(number, []))
    new = "\n".join(out) + ("\n" if text.endswith("\n") else "")
    if new != text:
        path.write_text(new, encoding="utf-8")


def markdown_files() -> list[Path]:
    """The Markdown files whose examples run: the README, CONTRIBUTING and every docs page."""
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]
