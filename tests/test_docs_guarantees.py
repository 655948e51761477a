"""The docs and the tests behind their guarantees match one to one.

`tests/test_examples.py` checks one direction: every test a page names exists. These check the
other: every test of a guarantee file is named on the Guarantees page, and the write-path table
there lists exactly the catalogue the guard tests run, with the same outcomes.

The table names its catalogue in the comment line above it, e.g.
``<!-- write-path catalogue: tests/test_guard.py MASKED=masked REFUSED=refused -->``: a test
module and, for each of its catalogue attributes, the outcome every entry of it has, or
``.field`` when each entry carries its own (``ZOO=.outcome``: the entry's ``outcome`` attribute,
or key for a mapping's values; a str or a str-valued Enum). An attribute may be a mapping (its
keys name the entries), or a sequence of ``pytest.param``s (their ids), of objects with an
``id`` or ``name`` (dataclasses, named tuples), of tuples (their first item) or of strings; so
the catalogue may grow or change shape, and only that line changes with it.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.examples import ROOT

GUARANTEES = ROOT / "docs" / "guarantees.md"
CATALOGUE_MARKER = re.compile(
    r"^<!-- write-path catalogue: (?P<module>tests/[\w/]+\.py)(?P<parts>( \w+=\.?[\w-]+)+) -->$"
)

# Test file -> the page that must name every one of its tests (None: any page of the docs).
GUARANTEE_FILES: dict[str, str | None] = {
    "tests/test_validation.py": "docs/guarantees.md",
    "tests/test_guard.py": "docs/guarantees.md",
    "tests/test_in_place.py": "docs/guarantees.md",
    "tests/test_atomic.py": "docs/guarantees.md",
    "tests/test_swap.py": "docs/guarantees.md",
    "tests/test_faults.py": "docs/guarantees.md",
    "tests/test_routes.py": "docs/guarantees.md",
    "tests/test_warm.py": "docs/guarantees.md",
    "tests/test_audit.py": "docs/guarantees.md",
    "tests/test_diff.py": "docs/guarantees.md",
    "tests/test_blocked.py": "docs/guarantees.md",
    "tests/test_encoding.py": "docs/guarantees.md",
    "tests/test_cost.py": "docs/guarantees.md",
    "tests/test_changes.py": "docs/guarantees.md",
    "tests/test_replay_inputs.py": "docs/guarantees.md",
    "tests/test_accounting.py": "docs/guarantees.md",
    "tests/test_load.py": None,
}


def _marker(text: str) -> tuple[int, re.Match[str]]:
    for number, line in enumerate(text.splitlines()):
        if (match := CATALOGUE_MARKER.match(line)) is not None:
            return number, match
    raise AssertionError(
        f"{GUARANTEES.relative_to(ROOT)} lost its catalogue line, e.g. "
        "<!-- write-path catalogue: tests/test_guard.py MASKED=masked REFUSED=refused -->"
    )


def _table_after(text: str, number: int) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table under line `number`, header included."""
    rows = []
    for line in text.splitlines()[number + 1 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if not all(set(cell) <= {"-", " ", ":"} for cell in row)]


def _entry_id(entry: object) -> str:
    if isinstance(entry, str):
        return entry
    for field in ("id", "name"):  # pytest.param(..., id=...), a dataclass or named tuple
        if isinstance(value := getattr(entry, field, None), str):
            return value
    if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
        return entry[0]
    raise AssertionError(f"cannot name the catalogue entry {entry!r}")


def _entry_outcome(entry: object, field: str) -> str:
    value = entry[field] if isinstance(entry, Mapping) else getattr(entry, field, None)
    if isinstance(value, str):
        return value
    if isinstance(getattr(value, "value", None), str):  # an Enum member
        return str(value.value)  # type: ignore[union-attr]
    raise AssertionError(f"the catalogue entry {entry!r} has no str {field!r}")


def entry_outcomes(catalogue: object, outcome: str) -> list[tuple[str, str]]:
    """(name, outcome) of every entry of one catalogue attribute (see the module docstring).

    `outcome` is the outcome of every entry, or ``.field``: each entry's own ``field``
    (an attribute, or a key of a mapping's values).
    """
    if isinstance(catalogue, Mapping):
        entries: list[tuple[str, object]] = [(str(k), v) for k, v in catalogue.items()]
    else:
        entries = [(_entry_id(entry), entry) for entry in catalogue]  # type: ignore[attr-defined]
    if not outcome.startswith("."):
        return [(name, outcome) for name, _ in entries]
    return [(name, _entry_outcome(entry, outcome[1:])) for name, entry in entries]


def entry_ids(catalogue: object) -> list[str]:
    """The entry names of one catalogue attribute."""
    return [name for name, _ in entry_outcomes(catalogue, "any")]


def catalogue_in_the_tests() -> dict[str, str]:
    """Entry -> outcome, from the module and attributes the catalogue line names."""
    _, match = _marker(GUARANTEES.read_text(encoding="utf-8"))
    module = importlib.import_module(match["module"].removesuffix(".py").replace("/", "."))
    found: dict[str, str] = {}
    for part in match["parts"].split():
        attribute, outcome = part.split("=")
        for entry, result in entry_outcomes(getattr(module, attribute), outcome):
            assert entry not in found, f"{entry!r} is in the catalogue twice"
            found[entry] = result
    return found


def write_paths_on_the_page() -> dict[str, str]:
    text = GUARANTEES.read_text(encoding="utf-8")
    header, *rows = _table_after(text, _marker(text)[0])
    outcome = header.index("Outcome")
    paths = {}
    for row in rows:
        path_id = row[0]
        assert path_id.startswith("`") and path_id.endswith("`"), f"not a `test id`: {row[0]}"
        assert path_id[1:-1] not in paths, f"{path_id} is listed twice"
        paths[path_id[1:-1]] = row[outcome]
    return paths


def test_the_write_path_table_matches_the_guard_catalogue_one_to_one() -> None:
    catalogue = catalogue_in_the_tests()
    page = write_paths_on_the_page()
    missing = sorted(set(catalogue) - set(page))
    extra = sorted(set(page) - set(catalogue))
    wrong = sorted(
        f"{path}: the page says {page[path]!r}, the test {catalogue[path]!r}"
        for path in set(page) & set(catalogue)
        if page[path] != catalogue[path]
    )
    assert not (missing or extra or wrong), (
        "docs/guarantees.md (table 'Every write path') and its catalogue in the tests "
        f"differ:\n  in the tests only: {missing}\n  on the page only: {extra}\n  "
        f"outcome differs: {wrong}"
    )


def test_the_table_reader_sees_the_table() -> None:
    # Guards the check above against a reader that finds nothing (and so compares nothing).
    page, catalogue = write_paths_on_the_page(), catalogue_in_the_tests()
    assert len(page) >= 10 and len(catalogue) >= 10
    assert len(set(catalogue.values())) >= 2  # more than one outcome is compared


@dataclass(frozen=True)
class _Loader:
    name: str
    outcome: str


def test_catalogue_entries_are_named_whatever_their_shape() -> None:
    assert entry_ids({"a": 1, "b": 2}) == ["a", "b"]
    assert entry_ids([("a", 1), pytest.param(2, id="b"), "c", _Loader("d", "x")]) == list("abcd")
    with pytest.raises(AssertionError, match="cannot name"):
        entry_ids([3])
    # each entry's own outcome
    zoo = [_Loader("a", "masked"), _Loader("b", "refused")]
    assert entry_outcomes(zoo, ".outcome") == [("a", "masked"), ("b", "refused")]
    assert entry_outcomes({"c": {"outcome": "masked"}}, ".outcome") == [("c", "masked")]
    assert entry_outcomes(zoo, "replayed") == [("a", "replayed"), ("b", "replayed")]
    assert CATALOGUE_MARKER.match("<!-- write-path catalogue: tests/x.py ZOO=.outcome -->")


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
