"""The documentation site: it builds strictly and offline, its links resolve, it covers the API.

The site is built once per session into a temporary folder (the `site` fixture of
`tests/support/site.py`), in a subprocess whose every network access is refused, so a plugin,
theme or inventory that reaches for the network fails the build here before it fails in CI.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import TypeVar
from urllib.parse import unquote, urljoin, urlsplit

import pytest
from typing_extensions import ParamSpec

from tests.support.public_api import public_names
from tests.support.site import NETWORK_GUARD

API_PAGES = ("api/",)  # site paths of the API reference (a page or a folder of pages)

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Page:
    """What the link checks need from one built HTML page."""

    path: str  # relative to the site root, e.g. "api/index.html"
    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # src of every <img>
    # identifiers of cross-references that autorefs could not resolve (rendered as plain text)
    unresolved: list[str] = field(default_factory=list)


class _Scanner(HTMLParser):
    def __init__(self, page: Page) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if (anchor := values.get("id")) is not None:
            self.page.ids.add(anchor)
        if tag == "a" and (name := values.get("name")) is not None:
            self.page.ids.add(name)
        if tag == "img" and (image := values.get("src")) is not None:
            self.page.images.append(image)
        for attribute in ("href", "src"):
            if (target := values.get(attribute)) is not None and tag in ("a", "link", "img"):
                self.page.links.append(target)
        if tag == "script" and (source := values.get("src")) is not None:
            self.page.links.append(source)
        # autorefs renders an optional cross-reference it could not resolve as a bare span
        if tag == "span" and len(attrs) == 1 and attrs[0][0] == "title" and attrs[0][1]:
            self.page.unresolved.append(attrs[0][1])


def scan(site: Path) -> dict[str, Page]:
    pages = {}
    for html in sorted(site.rglob("*.html")):
        page = Page(html.relative_to(site).as_posix())
        _Scanner(page).feed(html.read_text(encoding="utf-8"))
        pages[page.path] = page
    return pages


@pytest.fixture(scope="session")
def pages(site: Path) -> dict[str, Page]:
    return scan(site)


def internal_target(page: str, link: str) -> tuple[str, str] | None:
    """(site path of the target file, fragment) of an internal link, or None for an external."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith("//"):
        return None
    base = "http://site.invalid/"
    absolute = urlsplit(urljoin(base + page, link))
    path = unquote(absolute.path.removeprefix("/"))
    if path == "" or path.endswith("/"):
        path += "index.html"
    return path, unquote(absolute.fragment)


def test_internal_links_and_anchors_resolve(site: Path, pages: dict[str, Page]) -> None:
    broken = []
    for page in pages.values():
        for link in page.links:
            target = internal_target(page.path, link)
            if target is None:
                continue
            path, fragment = target
            if (site / path).is_dir():
                path += "/index.html"
            if not (site / path).is_file():
                broken.append(f"{page.path}: {link} -> no file {path}")
            elif fragment and (path not in pages or fragment not in pages[path].ids):
                broken.append(f"{page.path}: {link} -> no #{fragment} in {path}")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


# A link target that is a picture: it must have become an <img>, whatever the Markdown around it.
IMAGE = re.compile(r"\]\((?P<src>[^)\s]+\.(?:svg|png))\)")


def test_every_image_of_a_page_renders_as_an_image(pages: dict[str, Page]) -> None:
    # Markdown image syntax breaks silently (brackets in the alt text make it a link).
    missing = []
    for markdown in sorted((ROOT / "docs").rglob("*.md")):
        relative = markdown.relative_to(ROOT / "docs").with_suffix("")
        html = "index.html" if relative.name == "index" else f"{relative.as_posix()}/index.html"
        for match in IMAGE.finditer(markdown.read_text(encoding="utf-8")):
            name = match["src"].rsplit("/", 1)[-1]
            if not any(image.endswith("/" + name) for image in pages[html].images):
                missing.append(f"{markdown.relative_to(ROOT)}: {match['src']} is not an <img>")
    assert not missing, "\n".join(missing)


def test_the_link_checker_sees_pages_links_and_anchors(pages: dict[str, Page]) -> None:
    # Guards the checker itself: an HTML layout change must not leave it checking nothing.
    assert {"index.html", "api/index.html"} <= set(pages)
    links = [link for page in pages.values() for link in page.links]
    assert any("#patchctx." in link for link in links), "no link into the API reference"
    assert internal_target("a/index.html", "../b/#x") == ("b/index.html", "x")
    assert internal_target("a/index.html", "https://docs.python.org/3/") is None


def public_symbols() -> list[str]:
    return [f"{module}.{name}" for module, names in public_names().items() for name in names]


@pytest.mark.parametrize("symbol", public_symbols())
def test_api_reference_documents(symbol: str, pages: dict[str, Page]) -> None:
    api = [p for path, p in pages.items() if path.startswith(API_PAGES)]
    assert any(symbol in page.ids for page in api), (
        f"{symbol} is public (in __all__) but has no entry in the API reference: add "
        f"`::: {symbol}` to docs/api.md"
    )


def _is_type_parameter(identifier: str) -> bool:
    module_name, _, name = identifier.rpartition(".")
    if not module_name.startswith("patchctx"):
        return False
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError:
        return False
    return isinstance(getattr(module, name, None), (TypeVar, ParamSpec))


def test_cross_references_resolve(pages: dict[str, Page]) -> None:
    """Every name rendered as a reference links somewhere: our API or the Python/torch docs.

    Allowed to stay plain text: attributes documented in their class's Attributes table (the
    class itself has an entry), and type parameters (``P``, ``R``) of generic signatures.
    """
    unresolved = set()
    ids = {anchor for page in pages.values() for anchor in page.ids}
    for page in pages.values():
        for identifier in page.unresolved:
            parent = identifier.rpartition(".")[0]
            if identifier.startswith("patchctx.") and parent in ids:
                continue  # an attribute listed in its documented parent's table
            if _is_type_parameter(identifier):
                continue
            unresolved.add(f"{page.path}: {identifier}")
    assert not unresolved, (
        "cross-references that resolve nowhere (an external name: add it to the table in "
        "docs/inventories/inventories.py and rerun that script):\n" + "\n".join(sorted(unresolved))
    )


def test_docstring_examples_render_as_code(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "<blockquote" not in api, "a docstring's >>> lines rendered as quotes, not code"
    assert api.count('class="language-pycon highlight"') >= len(public_symbols()) - 2


def test_python_and_torch_names_link_to_their_docs(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'href="https://docs.pytorch.org/docs/stable/tensors.html#torch.Tensor"' in api
    assert 'href="https://docs.python.org/3/library/exceptions.html#ValueError"' in api


def load_inventories_module() -> ModuleType:
    path = ROOT / "docs" / "inventories" / "inventories.py"
    spec = importlib.util.spec_from_file_location("docs_inventories", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_inventories_are_written_from_the_table(tmp_path: Path) -> None:
    inventories = load_inventories_module()
    for path in inventories.write_all(tmp_path):
        committed = ROOT / "docs" / "inventories" / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.relative_to(ROOT)} is out of date: run "
            "python docs/inventories/inventories.py"
        )


def inventory_urls() -> Iterator[tuple[str, str]]:
    inventories = load_inventories_module()
    for source in inventories.SOURCES:
        for name, _, uri in source.entries:
            yield name, source.base_url + uri


def test_inventory_urls_point_into_the_official_docs() -> None:
    for name, url in inventory_urls():
        parts = urlsplit(url)
        assert parts.scheme == "https", url
        assert parts.netloc in {"docs.python.org", "docs.pytorch.org", "docs.vllm.ai"}, url
        assert parts.fragment, f"{name}: {url} has no #anchor"
        # vLLM's site (mkdocs) serves each page as a directory
        assert parts.path.endswith("/" if parts.netloc == "docs.vllm.ai" else ".html"), url


def test_the_network_guard_refuses_connections() -> None:
    # The guard the `site` fixture builds behind does refuse a connection (and DNS).
    probe = NETWORK_GUARD + (
        "import socket\n"
        "for address in [('192.0.2.1', 80), ('docs.python.org', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(address, timeout=1)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(len(attempts))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "2", result.stderr


def test_api_entries_are_not_private(pages: dict[str, Page]) -> None:
    # filters: ["!^_"] keeps private members out of the reference.
    api = pages["api/index.html"]
    private = sorted(
        anchor
        for anchor in api.ids
        if anchor.startswith("patchctx.")
        and any(part.startswith("_") for part in anchor.split(".")[1:])
        and anchor != "patchctx.__version__"
    )
    assert not private, f"private names in the API reference: {private}"
