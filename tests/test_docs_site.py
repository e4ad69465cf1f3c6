"""The documentation site as a reader sees it: built with mkdocs and rendered in headless
Chromium (tests/browser.py).

The API reference shows no raw Sphinx role (``:func:`x```), every signature fits its box
(formatted over several lines, nothing cut at the right edge), the ``gatherstore`` page
lists what a user calls first, in the groups of the getting-started page, the errors and
the Store after them, and the home page's example fits without horizontal scrolling.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Browser, chromium

import gatherstore as gs

ROOT = Path(__file__).resolve().parents[1]
#: A Sphinx role as a page shows it: ``:func:`x``` renders as ":func:" and a code span.
ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const|ref|doc):\S")
#: The reference's groups, in order, and the first names of each.
GROUPS = [
    ("Launching a job", ["launch", "init_from_env", "shutdown"]),
    ("Ranks and topology", ["get_rank", "get_world_size", "is_main_process"]),
    ("Gathering objects", ["collect_results", "gather_object", "all_gather_object"]),
    ("Result sets", ["ResultSet"]),
    ("Tensors and numbers", ["all_reduce"]),
    ("Synchronising and rank filters", ["barrier"]),
    ("Stores", ["open_store", "set_default_store", "register_store"]),
    ("Errors", ["GatherError"]),
    ("The Store base class", ["Store"]),
]
#: Each element that holds code, with how much of it is hidden past its right edge.
OVERFLOW = """
const found = [];
for (const el of document.querySelectorAll(arguments[0])) {
    const box = el.querySelector('code') || el;
    found.push({text: box.innerText.slice(0, 120), hidden: box.scrollWidth - box.clientWidth});
}
return found;
"""


def test_the_reference_page_lists_every_public_name_once() -> None:
    page = (ROOT / "docs" / "reference" / "gatherstore.md").read_text()
    listed = re.findall(r"^### ::: gatherstore\.(\w+)$", page, re.MULTILINE)
    assert sorted(listed) == sorted(set(gs.__all__) - {"__version__"})


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, built as .ci/test builds it, served on a loopback port; its base URL."""
    directory = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-4000:]
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium(width=1280, height=900) as opened:
        yield opened


REFERENCE = ["reference/gatherstore/", "reference/stores/", "reference/testing/"]


@pytest.mark.timeout(600)
def test_the_reference_shows_no_raw_role(site: str, browser: Browser) -> None:
    roles = []
    for page in REFERENCE + _compat_pages():
        browser.open(f"{site}/{page}")
        text = browser.run("return document.querySelector('article').innerText;")
        roles += [f"{page}: {text[m.start() - 40 : m.end() + 30]!r}" for m in ROLE.finditer(text)]
    assert roles == []


@pytest.mark.timeout(600)
def test_the_reference_signatures_are_whole(site: str, browser: Browser) -> None:
    cut, signatures = [], 0
    for page in REFERENCE + _compat_pages():
        browser.open(f"{site}/{page}")
        found = browser.run(OVERFLOW, ".doc-signature")
        signatures += len(found)
        cut += [f"{page}: {s['text']!r} hides {s['hidden']} px" for s in found if s["hidden"] > 0]
    assert cut == [], "mkdocstrings formats signatures with ruff (the docs extra installs it)"
    assert signatures > 100  # every page's functions were found and measured


def _compat_pages() -> list[str]:
    pages = (ROOT / "docs" / "reference" / "compat").glob("*.md")
    return sorted(f"reference/compat/{'' if p.stem == 'index' else p.stem + '/'}" for p in pages)


@pytest.mark.timeout(300)
def test_the_reference_lists_functions_first_then_errors_then_the_store(
    site: str, browser: Browser
) -> None:
    browser.open(f"{site}/reference/gatherstore/")
    headings = browser.run(
        "return [...document.querySelectorAll('article h2, article h3')]"
        ".map(h => [h.tagName, h.innerText.replace(/[\\s\\u00b6]+$/, '')]);"
    )
    groups = [text for tag, text in headings if tag == "H2"]
    assert groups == [title for title, _ in GROUPS]
    for title, first in GROUPS:
        start = headings.index(["H2", title])
        names = [text for tag, text in headings[start + 1 : start + 1 + len(first)]]
        assert names == first, title


@pytest.mark.timeout(300)
def test_the_home_page_example_fits_without_scrolling(site: str, browser: Browser) -> None:
    browser.open(f"{site}/")
    blocks = browser.run(OVERFLOW, "article pre")
    assert blocks, "the home page shows its example"
    assert [b for b in blocks if b["hidden"] > 0] == []
