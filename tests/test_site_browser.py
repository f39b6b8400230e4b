"""The built site in a real browser, opened from disk (``file://``) with no network.

A headless Chromium (Debian's ``chromium`` and ``chromium-driver``; ``make test`` installs them
where missing) opens ``site/index.html`` as a reader who downloaded the site would: search
must initialise and find "donate", and every page must load with nothing in the browser
console at level error (a script or stylesheet fetched from the web fails here, as it would
for an offline reader). It also takes screenshots of the home page and one API page: into
the folder ``TIED_SCREENSHOTS`` names (``make test-site`` sets ``docs/screenshots``, where they are
committed, to be looked at when the site's look changes), else into pytest's temporary folder.

Skipped, with the reason, only when the browser, its driver or selenium is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

for _module in ("mkdocs", "material", "mkdocstrings"):
    pytest.importorskip(
        _module, reason=f"{_module} is not installed: the docs extra (pip install -e '.[docs]')"
    )
pytest.importorskip("selenium", reason="selenium is not installed: the test extra (pip install -e '.[test]')")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

# Chromium as root in a container with no network: no sandbox, no GPU, nothing fetched in the background.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,1000", "--hide-scrollbars",
]  # fmt: skip


def _binary(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser():
    chromium = _binary("chromium", "chromium-browser", "google-chrome")
    driver_path = _binary("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip(
            "no headless Chromium here (apt-get install chromium chromium-driver; make test installs "
            f"them as root): chromium={chromium}, chromedriver={driver_path}"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="tied-chromium-")  # a new, empty profile each run
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _loaded(driver) -> None:
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")


def _errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_search_works_from_disk(site, browser):
    browser.get((site / "index.html").as_uri())
    load_errors = _errors(browser)  # reading the log empties it; every page's load is checked below
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")  # in the header, 1280 wide
    try:  # Material shows the box once its search worker has started
        WebDriverWait(browser, 30).until(lambda d: box.is_displayed())
    except TimeoutException:
        pytest.fail(
            "the search box is still hidden 30 s after the page loaded from file://: the search never "
            f"initialised; console errors: {load_errors + _errors(browser)}"
        )
    box.click()
    box.send_keys("donate")
    meta = browser.find_element(By.CSS_SELECTOR, ".md-search-result__meta")
    try:
        WebDriverWait(browser, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        )
    except TimeoutException:
        pytest.fail(
            f"no search results for 'donate' from file:// after 30 s; the search says {meta.text!r}; "
            f"console errors: {load_errors + _errors(browser)}"
        )
    results = browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
    assert re.search(r"\d+ matching document", meta.text), meta.text
    assert any("donat" in r.text.lower() for r in results), [r.text[:80] for r in results]
    assert _errors(browser) == []


def test_every_page_loads_with_no_console_error(site, browser):
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 20, pages
    found = {}
    for page in pages:
        browser.get(page.as_uri())
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script("return document.readyState") == "complete"
        )
        errors = _errors(browser)
        if errors:
            found[str(page.relative_to(site))] = errors
    assert found == {}, f"console errors on {len(found)} of {len(pages)} pages: {found}"


def test_screenshots_of_the_home_page_and_an_api_page(site, browser, tmp_path):
    """The pictures a reviewer looks at (docs/screenshots/), 1280 wide: the home page from its top,
    the jit page at its first parameter table (names must not break mid-word), the gradients page
    from its top and the lifted page at `tied.stack` (each public function under its public name,
    not its private module's)."""
    folder = Path(os.environ.get("TIED_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    shots = (
        ("home.png", "index.html", None, 2200),
        ("api_jit.png", "api/jit.html", "table", 1000),
        ("api_grad.png", "api/grad.html", None, 1600),
        ("api_stack.png", "api/lifted.html", 'h2[id="tied.stack"]', 1600),
    )
    for name, page, anchor, height in shots:
        browser.set_window_size(1280, height)
        browser.get((site / page).as_uri())
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script("return document.readyState") == "complete"
        )
        if anchor:  # the table's header row just under the page's header bar, once it has settled
            browser.execute_script(
                f"document.querySelector('article {anchor}').scrollIntoView(); window.scrollBy(0, -120)"
            )
            time.sleep(1.0)  # the header's title slides to the page's title when scrolled
        path = folder / name
        assert browser.save_screenshot(str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    browser.set_window_size(1280, 1000)


def test_the_pictures_load_and_parameter_names_stay_whole(site, browser):
    browser.get((site / "index.html").as_uri())
    _loaded(browser)
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('article img'))"
        ".map(i => [i.getAttribute('src'), i.naturalWidth, i.getBoundingClientRect().width])"
    )
    srcs = {src for src, _, _ in images}
    assert {"seed_dag.svg", "demo_loss.png"} <= srcs, images
    assert all(natural > 0 and shown > 0 for _, natural, shown in images), images  # none broken
    browser.get((site / "api" / "jit.html").as_uri())
    # every parameter name in the first column of an API table is laid out on one line
    heights = browser.execute_script(
        "return Array.from(document.querySelectorAll('tr.doc-section-item > td:first-child code'))"
        ".map(c => [c.textContent, c.getClientRects().length])"
    )
    assert any(name == "static_argnums" for name, _ in heights), heights
    assert [h for h in heights if h[1] != 1] == [], heights
