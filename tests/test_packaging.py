"""The package as a user gets it: the sdist carries its tests' files, the README is a PyPI page.

The sdist is built with the build backend itself (hatchling, pinned in the test group), as
``python -m build --sdist`` would. Its tests run from the unpacked sdist (`README.md` of the
repository says how; it is too slow for every run of the suite): here, the sdist is checked to
hold every file the suite reads or imports.
"""

from __future__ import annotations

import ast
import re
import tarfile
from pathlib import Path

import pytest

from tests.support.examples import ROOT

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> tarfile.TarFile:
    hatchling_build = pytest.importorskip("hatchling.build")
    out = tmp_path_factory.mktemp("sdist")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        name = hatchling_build.build_sdist(str(out))
    return tarfile.open(out / name)


def _members(sdist: tarfile.TarFile) -> set[str]:
    """Paths in the sdist, relative to its top folder."""
    return {member.name.split("/", 1)[1] for member in sdist.getmembers() if "/" in member.name}


def _tracked_under(folder: str, suffixes: tuple[str, ...]) -> set[str]:
    return {
        str(path.relative_to(ROOT))
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts
    }


def _imported_top_level_folders() -> set[str]:
    """Top-level folders of the repository that the tests import from (``benchmarks``, ...)."""
    folders = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                folders.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                folders.update(alias.name.split(".")[0] for alias in node.names)
    return {name for name in folders if (ROOT / name).is_dir()}


def test_the_sdist_carries_every_file_its_tests_need(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    needed = {"pyproject.toml", "conftest.py", "dev", "README.md", "CONTRIBUTING.md", "LICENSE"}
    needed |= {"mkdocs.yml", "patchctx/py.typed"}
    for folder in _imported_top_level_folders() | {"docs", "examples", "tests"}:
        needed |= _tracked_under(folder, (".py", ".md", ".svg", ".inv", ".json"))
    assert "benchmarks" in _imported_top_level_folders()  # the check above is not empty
    missing = sorted(needed - members)
    assert not missing, f"add to [tool.hatch.build.targets.sdist] include: {missing}"
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


def test_the_metadata_names_the_license_the_urls_and_the_python_versions(
    sdist: tarfile.TarFile,
) -> None:
    [info] = [m for m in sdist.getmembers() if m.name.endswith("/PKG-INFO")]
    extracted = sdist.extractfile(info)
    assert extracted is not None
    metadata = extracted.read().decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    for label in ("Homepage", "Documentation", "Repository", "Issues", "Changelog"):
        assert f"Project-URL: {label}, https://" in metadata
    low = int(PROJECT["requires-python"].removeprefix(">=3."))
    for minor in range(low, 14):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}" in metadata
    assert "Classifier: License :: OSI Approved :: Apache Software License" in metadata


def test_the_readme_works_as_the_pypi_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sections = re.findall(r"(?m)^## (.+)$", readme)
    assert sections[:2] == ["Install", "Example"]  # what a user runs comes first
    install = readme.split("## Install", 1)[1].split("##", 1)[0]
    assert "pip install patchctx" in install and "pip install 'patchctx[vllm]'" in install
    assert "./dev" not in readme.split("## Contributing", 1)[0]  # contributors' commands later
    contributing = readme.split("## Contributing", 1)[1]
    assert "./dev bench" in contributing and "./dev test" in contributing
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert links, "the README links to the docs"
    repository = PROJECT["urls"]["Repository"]
    relative = [link for link in links if not link.startswith("https://")]
    assert not relative, f"relative links break on PyPI: {relative}"
    for link in links:
        assert link.startswith(repository + "/"), f"{link} is not under {repository}"
        path = link.removeprefix(repository + "/").split("#")[0]
        if path.startswith(("blob/main/", "tree/main/")):
            target = path.split("/", 2)[2]
            assert (ROOT / target).exists(), f"{link} names {target}, which does not exist"


def test_the_dev_script_says_what_the_vllm_lane_costs() -> None:
    script = (ROOT / "dev").read_text(encoding="utf-8")
    assert "builds .venv-vllm" in script and "minutes" in script
    assert "PATCHCTX_SKIP_VLLM_LANE=1 skips it" in script


def test_the_sdist_declares_what_the_tests_import() -> None:
    include = set(PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"])
    assert {"benchmarks", "examples", "tests", "docs", "conftest.py", "dev", "LICENSE"} <= include
    assert Path(ROOT / "examples" / "demo.py").is_file()


def test_the_sdist_carries_no_compiled_module(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    assert not [m for m in members if m.endswith((".so", ".pyd", ".c"))]


def test_the_wheel_is_pure_python(tmp_path: Path) -> None:
    """patchctx has no compiled part (its C kernel was removed: a raw-pointer write cannot be
    memory-safe against another thread's ``resize_`` of the same storage): one wheel for all
    platforms, nothing compiled in it."""
    import zipfile

    hatchling_build = pytest.importorskip("hatchling.build")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        name = hatchling_build.build_wheel(str(tmp_path))
    members = zipfile.ZipFile(tmp_path / name).namelist()
    assert not [m for m in members if m.endswith((".so", ".pyd", ".c", ".pyi"))], members
    assert name.endswith("-py3-none-any.whl"), name
