"""The docstring rules of ``tests/test_examples.py`` for ``patchctx.vllm``, whose import needs
vLLM (the core suite skips it): every public class and function has a doctest, and no
docstring holds code that does not run. The doctests themselves run in this lane
(``--doctest-modules`` over ``patchctx/vllm``)."""

from __future__ import annotations

import doctest
import inspect
import re

import pytest

pytest.importorskip("vllm")

import patchctx.vllm
from tests.test_examples import documented_members

PUBLIC = [(f"patchctx.vllm.{n}", getattr(patchctx.vllm, n)) for n in patchctx.vllm.__all__]
CALLABLES = [(n, o) for n, o in PUBLIC if inspect.isclass(o) or inspect.isfunction(o)]


@pytest.mark.parametrize(("name", "obj"), CALLABLES, ids=[n for n, _ in CALLABLES])
def test_public_classes_and_functions_have_a_doctest(name: str, obj: object) -> None:
    examples = doctest.DocTestParser().get_examples(inspect.getdoc(obj) or "")
    assert examples, f"{name}: add an Examples section with a doctest"


def test_docstrings_hold_no_code_that_is_not_a_doctest() -> None:
    texts = [("patchctx.vllm", patchctx.vllm.__doc__ or "")]
    for _, obj in PUBLIC:
        texts += documented_members(obj)
    untested = re.compile(r"^\s*(```|~~~)|::\s*$", re.MULTILINE)
    offenders = [name for name, text in texts if untested.search(text)]
    assert not offenders, f"code blocks in docstrings that do not run: {offenders}"
    assert not [n for n, t in texts if re.search(r"^\s*Example:\s*$", t, re.MULTILINE)]
