"""The docs and the tests behind their guarantees match one to one.

`tests/test_examples.py` checks one direction: every test a page names exists. These check the
other: every test of a guarantee file is named on its page, and the write-path table of the
Concepts page lists exactly the catalogue `tests/test_guard.py` runs, with the same outcomes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.examples import ROOT
from tests.test_guard import MASKED, REFUSED

CONCEPTS = ROOT / "docs" / "concepts.md"
CATALOGUE_MARKER = "<!-- write-path catalogue: tests/test_guard.py MASKED and REFUSED -->"

# Test file -> the page that must name every one of its tests (None: any page of the docs).
GUARANTEE_FILES: dict[str, str | None] = {
    "tests/test_validation.py": "docs/concepts.md",
    "tests/test_guard.py": "docs/concepts.md",
    "tests/test_in_place.py": "docs/concepts.md",
    "tests/test_atomic.py": "docs/concepts.md",
    "tests/test_swap.py": "docs/concepts.md",
    "tests/test_routes.py": "docs/routes.md",
    "tests/test_audit.py": "docs/routes.md",
    "tests/test_diff.py": "docs/trainer.md",
    "tests/test_load.py": None,
}


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table that follows `marker`, header included."""
    lines = text.splitlines()
    assert marker in lines, f"{CONCEPTS.relative_to(ROOT)} lost the line {marker!r}"
    rows = []
    for line in lines[lines.index(marker) + 1 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if not all(set(cell) <= {"-", " ", ":"} for cell in row)]


def write_paths_on_the_page() -> dict[str, str]:
    header, *rows = _table_after(CONCEPTS.read_text(encoding="utf-8"), CATALOGUE_MARKER)
    outcome = header.index("Outcome")
    paths = {}
    for row in rows:
        path_id = row[0]
        assert path_id.startswith("`") and path_id.endswith("`"), f"not a `test id`: {row[0]}"
        assert path_id[1:-1] not in paths, f"{path_id} is listed twice"
        paths[path_id[1:-1]] = row[outcome]
    return paths


def test_the_write_path_table_matches_the_guard_catalogue_one_to_one() -> None:
    catalogue = {path: "masked" for path, _ in MASKED} | {path: "refused" for path, _ in REFUSED}
    page = write_paths_on_the_page()
    missing = sorted(set(catalogue) - set(page))
    extra = sorted(set(page) - set(catalogue))
    wrong = sorted(
        f"{path}: the page says {page[path]!r}, the test {catalogue[path]!r}"
        for path in set(page) & set(catalogue)
        if page[path] != catalogue[path]
    )
    assert not (missing or extra or wrong), (
        "docs/concepts.md (table 'Every write path') and tests/test_guard.py (MASKED, REFUSED) "
        f"differ:\n  in the tests only: {missing}\n  on the page only: {extra}\n  "
        f"outcome differs: {wrong}"
    )


def test_the_table_reader_sees_the_table() -> None:
    # Guards the check above against a reader that finds nothing (and so compares nothing).
    page = write_paths_on_the_page()
    assert page["copy_"] == "masked" and page["param.data-rebind"] == "refused"


def _test_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


def _docs_text(page: str | None) -> str:
    if page is not None:
        return (ROOT / page).read_text(encoding="utf-8")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in pages)


@pytest.mark.parametrize(("test_file", "page"), list(GUARANTEE_FILES.items()))
def test_every_test_of_a_guarantee_file_is_named_in_the_docs(
    test_file: str, page: str | None
) -> None:
    text = _docs_text(page)
    named = _test_functions(ROOT / test_file)
    unnamed = [name for name in named if f"{test_file}::{name}" not in text]
    assert not unnamed, (
        f"{page or 'the docs'} must name every test of {test_file} next to the guarantee it "
        f"proves; not named: {unnamed}"
    )
