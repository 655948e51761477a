"""The built site in a real browser: every page loads without an error, search finds things,
code and tables fit the content column, and the home page is kept as a screenshot.

The browser is the Chromium of the Debian package ``chromium-headless-shell``, driven through
Playwright (from PyPI, in the docs group); Playwright's own browser download is never used.
``./dev test`` installs the package when it is missing. Elsewhere the tests skip, saying so,
when no Chromium is found; ``PATCHCTX_REQUIRE_BROWSER=1`` (set by ``./dev test``) turns that
skip into a failure. The site is served from 127.0.0.1 (search runs in a web worker, which a
``file://`` page may not start); every other request is refused and reported.

The screenshot lands in ``build/docs-browser/home.png`` (``build/`` is ignored by git).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "docs-browser"
CHROMIUM_NAMES = ("chromium-headless-shell", "chromium", "chromium-browser")
# A desktop window just wide enough for both sidebars: the narrowest content column a
# desktop reader gets.
VIEWPORT = {"width": 1280, "height": 900}


def find_chromium() -> str | None:
    """The Chromium binary to drive: $PATCHCTX_CHROMIUM, else the first of CHROMIUM_NAMES."""
    if configured := os.environ.get("PATCHCTX_CHROMIUM"):
        return configured
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("PATCHCTX_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (PATCHCTX_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(reason)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The site over HTTP on 127.0.0.1, at a free port."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Visit:
    """What one page did in the browser."""

    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions
    refused: list[str] = field(default_factory=list)  # requests that left the machine


@pytest.fixture(scope="module")
def browser(served: str) -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (the docs dependency group has it)")
    executable = find_chromium()
    if executable is None:
        _unavailable(
            "no Chromium found: install the Debian package chromium-headless-shell "
            "(./dev test does) or set PATCHCTX_CHROMIUM"
        )
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield instance
        finally:
            instance.close()


def watch(page: Any, base: str) -> Visit:
    """Record `page`'s errors from now on, and refuse its requests that leave `base`."""
    visit = Visit()

    def console(message: Any) -> None:
        if message.type == "error":
            visit.errors.append(f"console: {message.text}")

    def route(request_route: Any) -> None:
        if request_route.request.url.startswith(base):
            request_route.continue_()
        else:
            visit.refused.append(request_route.request.url)
            request_route.abort()

    page.on("console", console)
    page.on("pageerror", lambda error: visit.errors.append(f"exception: {error}"))
    page.route("**/*", route)
    return visit


def open_page(browser: Any, url: str, base: str) -> tuple[Any, Visit]:
    """A new page at `url`, watched (see `watch`), once it and its requests have settled."""
    page = browser.new_page(viewport=VIEWPORT)
    visit = watch(page, base)
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    return page, visit


def site_pages(site: Path) -> list[str]:
    return sorted(
        path.relative_to(site).as_posix()
        for path in site.rglob("*.html")
        if path.name != "404.html"
    )


# Code blocks (and tables of code) wider than their column: they would scroll sideways.
OVERFLOWING_CODE = """
() => Array.from(document.querySelectorAll(".md-content pre > code"))
    .filter((code) => code.scrollWidth > code.clientWidth + 1)
    .map((code) => code.textContent.split("\\n")
        .reduce((a, b) => (b.length > a.length ? b : a), ""))
"""


# Tables wider than the column (the theme wraps each in a box that scrolls sideways).
OVERFLOWING_TABLES = """
() => Array.from(document.querySelectorAll(".md-content .md-typeset__scrollwrap"))
    .filter((box) => box.scrollWidth > box.clientWidth + 1)
    .map((box) => box.querySelector("tr").innerText.replace(/\\s+/g, " "))
"""


# Images that did not load (a wrong path, an SVG the browser cannot parse).
BROKEN_IMAGES = """
() => Array.from(document.images)
    .filter((image) => !image.complete || image.naturalWidth === 0)
    .map((image) => image.getAttribute("src"))
"""


def test_every_page_loads_without_errors_and_its_code_fits(
    browser: Any, served: str, site: Path
) -> None:
    problems = []
    for path in site_pages(site):
        page, visit = open_page(browser, served + path, served)
        problems += [f"{path}: {error}" for error in visit.errors]
        problems += [f"{path}: requested {url}, outside the site" for url in visit.refused]
        problems += [f"{path}: image {src} did not load" for src in page.evaluate(BROKEN_IMAGES)]
        if not path.startswith("api/"):  # rendered signatures are mkdocstrings' to wrap
            problems += [
                f"{path}: a code block scrolls sideways; its longest line is {line!r}"
                for line in page.evaluate(OVERFLOWING_CODE)
            ]
            problems += [
                f"{path}: a table scrolls sideways; its header is {header!r}"
                for header in page.evaluate(OVERFLOWING_TABLES)
            ]
        page.close()
    assert len(site_pages(site)) >= 10
    assert not problems, "\n".join(problems)


def test_search_returns_results_and_the_home_page_is_kept_as_a_screenshot(
    browser: Any, served: str
) -> None:
    page, visit = open_page(browser, served, served)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "home.png"), full_page=True)
    query = page.locator("input.md-search__input")
    query.click()
    query.press_sequentially("RouteCache")  # typed, as a reader would
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=15_000)
    titles = results.all_inner_texts()
    page.screenshot(path=str(ARTIFACTS / "search.png"))
    page.close()
    assert titles, "search for 'RouteCache' returned nothing"
    assert any("RouteCache" in title for title in titles)
    assert not visit.errors and not visit.refused, visit
    assert (ARTIFACTS / "home.png").stat().st_size > 10_000


def test_the_checks_see_errors_requests_and_wide_code(browser: Any, served: str) -> None:
    # Guards the checks above against a browser set-up that would see nothing.
    page = browser.new_page(viewport=VIEWPORT)
    visit = watch(page, served)
    page.set_content(
        '<div class="md-content"><pre><code style="display:block; overflow:auto; width:50px">'
        + "x" * 200
        + '</code></pre><div class="md-typeset__scrollwrap" style="overflow:auto; width:50px">'
        + "<table><tr><th>"
        + "y" * 100
        + "</th></tr></table></div></div>"
        + '<img src="https://example.invalid/x.png">'
        + "<script>console.error('logged'); undefined_name;</script>"
    )
    page.wait_for_load_state("networkidle")
    overflowing = page.evaluate(OVERFLOWING_CODE)
    broken = page.evaluate(BROKEN_IMAGES)
    tables = page.evaluate(OVERFLOWING_TABLES)
    page.close()
    assert broken == ["https://example.invalid/x.png"]
    assert overflowing == ["x" * 200]
    assert tables == ["y" * 100]
    assert any("logged" in error for error in visit.errors)
    assert any("undefined_name" in error for error in visit.errors)
    assert visit.refused == ["https://example.invalid/x.png"]
