"""The documentation site, built with mkdocs, works opened from disk (``file://``).

Builds the site into a temporary folder (as ``make docs`` does) and checks, without a
browser, what a reader who opens ``site/index.html`` meets: every relative link and
asset of every page names a file on disk (not a folder, which a browser would show as a
directory listing), search is set up to run without a server, "API reference" appears
once in the navigation, and long code lines wrap. The API reference, read from the
mkdocstrings inventory (``objects.inv``): every name it shows exists at run time under that
name, every public name (each ``__all__`` of ``tied``, ``tied.nn``, ``tied.optim``) is shown
exactly once, and no heading names a private module. Needs the ``docs`` extra
(``pip install -e ".[docs]"``, or ``make docs``); skipped without it.
"""

from __future__ import annotations

import re
import zlib
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


# The API reference, read from the mkdocstrings inventory (objects.inv, Sphinx's format): one entry per
# object shown with a heading (priority 1; the aliases mkdocstrings adds for cross-references are 2).
PUBLIC_MODULES = ("tied", "tied.nn", "tied.optim")


def shown_objects(site: Path) -> list[tuple[str, str, str]]:
    """(name, role, page) of every object the reference shows with a heading."""
    raw = (site / "objects.inv").read_bytes()
    header, _, body = raw.partition(b"zlib.\n")
    assert header.startswith(b"# Sphinx inventory version 2"), header[:80]
    shown = []
    for line in zlib.decompress(body).decode().splitlines():
        m = re.fullmatch(r"(\S+) (\S+) (-?\d+) (\S*) (.*)", line)
        assert m, line
        name, role, priority, uri, _ = m.groups()
        if priority == "1":
            shown.append((name, role, uri.split("#")[0]))
    assert len(shown) > 50, shown
    return shown


def at_run_time(name: str) -> object:
    """The object ``name`` (``tied.grad``, ``tied.nn.Dense.decode``) names, by attribute access from
    ``tied`` as a user's code reaches it; AttributeError if it does not exist under that name."""
    import tied

    first, *rest = name.split(".")
    assert first == "tied", name
    obj: object = tied
    for part in rest:
        obj = getattr(obj, part)
    return obj


def test_no_heading_of_the_reference_names_a_private_module(site):
    def private(name: str) -> bool:
        return any(part.startswith("_") for part in name.split("."))

    named = [(n, page) for n, _, page in shown_objects(site) if private(n)]
    assert named == [], f"headings naming a private module or name: {named}"
    for page in sorted((site / "api").glob("*.html")):
        ids = re.findall(r'<h\d id="([^"]+)" class="doc doc-heading"', page.read_text())
        bad = [i for i in ids if private(i)]
        assert bad == [], f"{page.name}: {bad}"


def test_every_name_the_reference_shows_exists_at_run_time_as_what_it_is_shown(site):
    import types

    wrong = []
    for name, role, page in shown_objects(site):
        if not name.startswith("tied."):
            continue  # (there are none: the reference documents tied alone)
        try:
            obj = at_run_time(name)
        except AttributeError as e:
            wrong.append(f"{page}: {name} ({role}) does not exist at run time: {e}")
            continue
        if (role == "py:module") != isinstance(obj, types.ModuleType):
            wrong.append(f"{page}: {name} is shown as {role} but is {type(obj).__name__} at run time")
        module, _, short = name.rpartition(".")
        if module in PUBLIC_MODULES and short not in at_run_time(module).__all__:
            wrong.append(f"{page}: {name} is shown as a public name but is not in {module}.__all__")
    assert wrong == [], "\n".join(wrong)


def test_every_public_name_is_shown_exactly_once(site):
    import tied

    shown = shown_objects(site)
    classes = {name for name, role, _ in shown if role == "py:class"}
    listings = []  # (short name, full name, page, the object at run time or None) of every non-member
    for name, _, page in shown:
        if name.rpartition(".")[0] in classes:
            continue  # a method or property, listed under its class
        try:
            obj = at_run_time(name)
        except AttributeError:
            obj = None  # no such name at run time (the test above names it): still a listing a reader sees
        listings.append((name.rpartition(".")[2], name, page, obj))
    bad = []
    for module in PUBLIC_MODULES:
        for short in at_run_time(module).__all__:
            obj = getattr(at_run_time(module), short)
            # the same object under another name (tied.view.View for tied.View), or the same name under
            # a name that does not exist (tied.stack.Stack), is a second listing
            where = [f"{n} ({p})" for s, n, p, o in listings if o is obj or (o is None and s == short)]
            if len(where) != 1:
                bad.append(f"{module}.{short} is shown {len(where)} times: {where}")
    assert "grad" in tied.__all__ and bad == [], "\n".join(bad)
