"""The structure report (tools/structure.py) counts what it says, on packages made to order."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools import structure


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "patchctx" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def _figures(root: Path) -> dict[str, int]:
    figures = structure.measure(root)["figures"]
    assert isinstance(figures, dict)
    return figures


def test_closures_follow_eager_and_lazy_imports_but_not_type_checking(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from patchctx._load import load\n",
            "_load.py": (
                "from typing import TYPE_CHECKING\n"
                "from patchctx._errors import E\n"
                "if TYPE_CHECKING:\n"
                "    from patchctx._swap import S\n"
                "def load():\n"
                "    from patchctx._routes import R\n"
                "    return R\n"
            ),
            "_errors.py": "E = 1\n",
            "_swap.py": "S = 1\n" * 50,
            "_routes.py": "R = 1\n" * 10,
        },
    )
    figures = _figures(root)
    # import patchctx: __init__ (1) + _load (7) + _errors (1); _routes is imported lazily
    assert figures["eager lines of `import patchctx`"] == 1 + 7 + 1
    # the call's closure: _load + _errors + _routes, never the TYPE_CHECKING-only _swap
    assert figures["full lines of load_checkpoint_weight_patches"] == 7 + 1 + 10


def test_circles_upward_imports_and_private_names(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_errors.py": "from patchctx._load import _helper\n",  # values -> load: upward
            "_load.py": "from patchctx import _errors\nX = _errors._hidden\n",
            "_routes.py": "def f(other):\n    return other._state, g()\ndef g(): ...\n",
        },
    )
    report = structure.measure(root)
    figures = report["figures"]
    assert isinstance(figures, dict)
    assert report["circles"] == [["_errors", "_load"]]
    assert figures["modules in import circles"] == 2
    assert report["upward imports"] == ["_errors (0) -> _load (4)"]
    assert sorted(report["private imports"]) == [  # type: ignore[call-overload]
        "_errors <- _load._helper",
        "_load <- _errors._hidden",
    ]
    assert report["private reads"] == ["_routes:2 ._state"]


def test_sizes_leave_docstrings_aside(tmp_path: Path) -> None:
    body = "    x = 1\n" * 85
    doc = '    """' + "line\n" * 40 + '    """\n'
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_load.py": f"def long():\n{body}\ndef documented():\n{doc}{'    x = 1' + chr(10)}",
        },
    )
    report = structure.measure(root)
    assert report["big functions"] == ["_load:long 86"]


def test_docs_words_count_user_pages_only_and_tokens_with_a_letter_or_digit(
    tmp_path: Path,
) -> None:
    docs = tmp_path / "docs"
    (docs / "api").mkdir(parents=True)
    (docs / "page.md").write_text("# Two words\n\n| a | b-2 |\n| --- | --- |\n- `x::y` …\n")
    (docs / "api.md").write_text("::: patchctx.Thing\n")  # the API reference is not counted
    (docs / "api" / "more.md").write_text("many words here\n")
    (docs / "changelog.md").write_text("one two three\n")
    # "Two", "words", "a", "b-2", "`x::y`": the heading mark, rules, bullet and ellipsis are not
    assert structure.docs_words(tmp_path) == {"page.md": 5}
    figures = _figures(_package(tmp_path, {"__init__.py": ""}))
    assert figures["words of the user docs"] == 5
    assert figures["words of the changelog"] == 3


def test_the_repository_is_within_its_ceilings() -> None:
    figures = _figures(structure.ROOT)
    over = {name: value for name, value in figures.items() if value > structure.CEILINGS[name]}
    assert over == {}, f"over the ceilings of tools/structure.py: {over}"
    assert structure.measure()["unplaced modules"] == []
