"""Every example a reader sees runs: Markdown pages, docstrings, the demo script.

Markdown pages (README, CONTRIBUTING, docs/**) run through `tests.support.examples` (the
``# >`` output convention is described there and in CONTRIBUTING.md). Docstring examples are
doctests run by ``--doctest-modules``; the tests below make sure every public class and function
has one and that no docstring hides code that is not a doctest.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.examples import (
    CODE_WIDTH,
    ROOT,
    ExampleError,
    display,
    markdown_files,
    parse_fences,
    run_page,
    wrap_output,
)
from tests.support.public_api import public_names


@pytest.mark.parametrize("path", markdown_files(), ids=display)
def test_markdown_examples_run_and_show_their_output(path: Path) -> None:
    run_page(path)


def docs_pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("path", docs_pages(), ids=display)
def test_docs_code_fits_the_content_column(path: Path) -> None:
    # What the site shows in a code block scrolls sideways past CODE_WIDTH characters
    # (tests/test_docs_browser.py checks the rendered pages themselves).
    too_wide = [
        f"{display(path)}:{fence.first_line + offset}: {len(line)} characters: {line.strip()}"
        for fence in parse_fences(path)
        for offset, line in enumerate(fence.lines)
        if len(line) > CODE_WIDTH
    ]
    assert not too_wide, (
        f"code lines wider than {CODE_WIDTH} characters (reflow the code; ruff format does it "
        "for Python, docs/ruff.toml sets the width; UPDATE_EXAMPLES=1 wraps # > output):\n"
        + "\n".join(too_wide)
    )


# ------------------------------------------------------------------------------ the harness


def write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_harness_blocks_share_a_namespace_and_output_is_checked(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "Text.\n\n```python\nx = 2\nprint(x)\n#> 2\n```\n\nMore.\n\n"
        "```python\nfor i in range(x):\n    print(i, x)\n    # > 0 2\n    # > 1 2\n```\n",
    )
    run_page(page, update=False)


def test_harness_joins_output_lines_continued_with_a_backslash(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "```python\nprint('a long line, ' * 3)\n# > a long line, a \\\n# > long line, a long "
        "line,\n```\n",
    )
    run_page(page, update=False)


def test_harness_update_mode_wraps_output_wider_than_the_column(tmp_path: Path) -> None:
    page = write(tmp_path, "```python\nif True:\n    print('word ' * 40)\n```\n")
    run_page(page, update=True)
    lines = page.read_text().splitlines()
    assert max(len(line) for line in lines) <= CODE_WIDTH
    assert sum(line.endswith("\\") for line in lines) >= 2
    run_page(page, update=False)


def test_wrapped_output_joins_back_to_the_line() -> None:
    for text in ["x" * 200, "a b " * 50, "short", "ab " + "c" * 100]:
        pieces = wrap_output(text, 30)
        assert all(len(piece) <= 30 for piece in pieces)
        assert "".join(piece.removesuffix("\\") for piece in pieces[:-1]) + pieces[-1] == text


def test_harness_refuses_unshown_output(tmp_path: Path) -> None:
    page = write(tmp_path, "```python\nprint('hello')\n```\n")
    with pytest.raises(ExampleError, match=r"page.md:2: the output under this line differs"):
        run_page(page, update=False)


def test_harness_refuses_output_shown_but_not_printed(tmp_path: Path) -> None:
    page = write(tmp_path, "```python\nx = 1\n#> 1\n```\n")
    with pytest.raises(ExampleError, match="printed:\n    \\(nothing\\)"):
        run_page(page, update=False)


def test_harness_refuses_stdout_written_around_print(tmp_path: Path) -> None:
    page = write(tmp_path, "```python\nimport sys\n_ = sys.stdout.write('x')\n```\n")
    with pytest.raises(ExampleError, match="other than through print"):
        run_page(page, update=False)


def test_harness_reports_errors_at_the_markdown_line(tmp_path: Path) -> None:
    page = write(tmp_path, "# Title\n\n```python\nx = 1\nraise KeyError(x)\n```\n")
    with pytest.raises(KeyError) as info:
        run_page(page, update=False)
    assert info.traceback[-1].lineno + 1 == 5  # pytest counts from 0
    assert info.traceback[-1].path == page


def test_harness_skips_marked_blocks_and_ignores_other_languages(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        '```python test="skip"\nraise SystemExit\n```\n\n```bash\nexit 1\n```\n\n'
        "````markdown\n```python\nraise SystemExit\n```\n````\n",
    )
    run_page(page, update=False)
    assert [f.lang for f in parse_fences(page)] == ["python", "bash", "markdown"]


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("```pycon", "never runs"),
        ('```python test="skip" title="x.py"', "cannot be combined"),
        ('```python test="later"', "is not understood"),
        ('```python tset="skip"', "unknown fence option"),
    ],
)
def test_harness_refuses_headers_it_would_mishandle(
    tmp_path: Path, header: str, message: str
) -> None:
    page = write(tmp_path, f"{header}\nx = 1\n```\n")
    with pytest.raises(ExampleError, match=message):
        run_page(page, update=False)


def test_harness_update_mode_rewrites_the_output_lines(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "- item\n\n    ```python\n    print(1)\n    #> 7\n    for i in range(2):\n"
        "        print(i)\n    ```\n",
    )
    run_page(page, update=True)
    assert page.read_text() == (
        "- item\n\n    ```python\n    print(1)\n    # > 1\n    for i in range(2):\n"
        "        print(i)\n        # > 0\n        # > 1\n    ```\n"
    )
    run_page(page, update=False)


# ---------------------------------------------------------------------------- docstrings


def public_modules() -> list[tuple[ModuleType, list[str]]]:
    """The public modules that import here, with their ``__all__``."""
    found = []
    for module_name, names in public_names().items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:  # an integration whose optional dependency is missing
            if error.name == module_name:
                raise
            continue
        found.append((module, names))
    return found


def public_objects() -> list[tuple[str, object]]:
    return [
        (f"{module.__name__}.{name}", getattr(module, name))
        for module, names in public_modules()
        for name in names
    ]


def documented_members(obj: object) -> list[tuple[str, str]]:
    """(qualified name, docstring) of `obj` and its public methods and properties."""
    docs = [(getattr(obj, "__qualname__", repr(obj)), inspect.getdoc(obj) or "")]
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            target = member.fget if isinstance(member, property) else member
            target = getattr(target, "__func__", target)
            if inspect.isfunction(target) and target.__doc__:
                docs.append((f"{obj.__qualname__}.{name}", inspect.cleandoc(target.__doc__)))
    return docs


CALLABLES = [(n, o) for n, o in public_objects() if inspect.isclass(o) or inspect.isfunction(o)]


@pytest.mark.parametrize(("name", "obj"), CALLABLES, ids=[n for n, _ in CALLABLES])
def test_public_classes_and_functions_have_a_doctest(name: str, obj: object) -> None:
    examples = doctest.DocTestParser().get_examples(inspect.getdoc(obj) or "")
    assert examples, f"{name}: add an Example section with a doctest (>>> lines and output)"


def test_docstrings_hold_no_code_that_is_not_a_doctest() -> None:
    texts = [(module.__name__, module.__doc__ or "") for module, _ in public_modules()]
    for _, obj in public_objects():
        texts += documented_members(obj)
    untested = re.compile(r"^\s*(```|~~~)|::\s*$", re.MULTILINE)
    offenders = [name for name, text in texts if untested.search(text)]
    assert not offenders, (
        f"code blocks in docstrings that do not run (use >>> doctests): {offenders}"
    )


def test_docstring_examples_are_under_an_examples_heading() -> None:
    # griffe renders a Google "Example:" section as an admonition whose >>> lines become nested
    # quotes; "Examples:" is rendered as highlighted code.
    singular = re.compile(r"^\s*Example:\s*$", re.MULTILINE)
    offenders = [
        name
        for _, obj in public_objects()
        for name, text in documented_members(obj)
        if singular.search(text)
    ]
    assert not offenders, f"write 'Examples:' instead of 'Example:' in: {offenders}"


# ------------------------------------------------------------------- tests cited by the docs

CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:::(\w+))?")


def cited_tests() -> list[tuple[str, str, str | None]]:
    found = set()
    for page in markdown_files():
        for match in CITATION.finditer(page.read_text(encoding="utf-8")):
            found.add((match[1], match[2], match[3]))
    return sorted(found, key=str)


@pytest.mark.parametrize(
    ("file", "first", "second"),
    cited_tests(),
    ids=["::".join(x for x in c if x) for c in cited_tests()],
)
def test_tests_cited_by_the_docs_exist(file: str, first: str, second: str | None) -> None:
    path = ROOT / file
    assert path.is_file(), f"the docs cite {file}, which does not exist"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scope: list[ast.stmt] = tree.body
    for name in (first, second):
        if name is None:
            break
        nodes = [
            n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name
        ]
        assert nodes, f"the docs cite {file}::{name}, which does not exist"
        scope = nodes[0].body


def test_the_docs_cite_tests() -> None:
    assert cited_tests(), "the Concepts page names the test behind each guarantee"


# ------------------------------------------------------------------------------- the demo


def test_demo_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--changed", "5"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "all 5 changes landed once across 2 ranks" in result.stdout
