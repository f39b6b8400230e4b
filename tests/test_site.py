"""The documentation site, built with mkdocs, works opened from disk (``file://``).

Builds the site into a temporary folder (as ``make docs`` does) and checks, without a
browser, what a reader who opens ``site/index.html`` meets: every relative link and
asset of every page names a file on disk (not a folder, which a browser would show as a
directory listing), search is set up to run without a server, "API reference" appears
once in the navigation, and long code lines wrap. Needs the ``docs`` extra
(``pip install -e ".[docs]"``, or ``make docs``); skipped without it.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

for _module in ("mkdocs", "material", "mkdocstrings"):
    pytest.importorskip(
        _module, reason=f"{_module} is not installed: the docs extra (pip install -e '.[docs]')"
    )

LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']*)["']""")


def pages(site: Path) -> list[Path]:
    out = sorted(site.rglob("*.html"))
    assert len(out) >= 10, out  # the home page, semantics, examples and the API pages
    return out


def relative_links(html: str) -> list[str]:
    links = []
    for link in LINK.findall(html):
        parts = urlsplit(link)
        if parts.scheme or parts.netloc or link.startswith("#") or not parts.path:
            continue  # another site, or a place on this page
        links.append(unquote(parts.path))
    return links


def test_every_relative_link_of_every_page_is_a_file_on_disk(site):
    broken, checked = [], 0
    for page in pages(site):
        for link in relative_links(page.read_text()):
            target = (site / link.lstrip("/")) if link.startswith("/") else (page.parent / link)
            checked += 1
            if not target.resolve().is_file():  # a folder opens as a listing from file://
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert checked > 100
    assert not broken, f"{len(broken)} links that are not files: {broken[:20]}"


def test_pages_are_files_not_folders(site):
    # use_directory_urls: false: api/grad.html, not api/grad/index.html
    assert (site / "api" / "grad.html").is_file() and (site / "semantics.html").is_file()
    home = (site / "index.html").read_text()
    assert 'href="semantics.html"' in home and 'href="api/index.html"' in home


def test_search_runs_without_a_server(site):
    # material's offline plugin: the index ships as a script and the worker runs in an
    # iframe, so search initialises from file:// (a fetch of search_index.json would not)
    assert (site / "search" / "search_index.js").is_file()
    for page in pages(site):
        if page.name != "404.html":
            assert "iframe-worker" in page.read_text(), page


def test_the_navigation_shows_api_reference_once(site):
    html = (site / "index.html").read_text()
    # a section's label and its pages' links (the mobile drill-down title aside)
    nav_links = re.findall(r'<(a|label) [^>]*class="md-nav__link[^"]*"[^>]*>(.*?)</\1>', html, flags=re.S)
    labels = [" ".join(re.sub(r"<[^>]+>", " ", t).split()) for _, t in nav_links]
    assert labels.count("API reference") == 1, labels
    assert {"Home", "Semantics", "The graph", "Optimisers"} <= set(labels)


def test_long_code_lines_wrap(site):
    css = [link for link in relative_links((site / "index.html").read_text()) if link.endswith("extra.css")]
    assert css, "the extra stylesheet is not linked"
    rules = (site / css[0]).read_text()
    assert re.search(r"pre\s*>\s*code\s*\{[^}]*white-space:\s*pre-wrap", rules), rules
