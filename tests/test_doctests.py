"""Every ``>>>`` example in the package's docstrings runs as written.

Each docstring's examples run in a fresh namespace (not the module's globals), so an
example that forgets an import or a definition fails here, as it would for a reader
who pastes it. These are the examples the API reference (``make docs``) shows.
"""

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tied

MODULES = ["tied"] + sorted(m.name for m in pkgutil.walk_packages(tied.__path__, "tied."))  # folders too
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in MODULES:
        module = importlib.import_module(name)
        tests += [t for t in finder.find(module, name, globs={"__name__": "__doctest__"}) if t.examples]
    return sorted(tests, key=lambda t: t.name)


TESTS = _docstring_tests()


@pytest.mark.parametrize("test", TESTS, ids=[t.name for t in TESTS])
def test_docstring_example(test: doctest.DocTest):
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_the_examples_are_found():
    # A finder that silently found nothing would make every test above vacuous.
    names = {t.name for t in TESTS}
    assert {"tied.nn._dense.Dense", "tied._core.graph.flatten", "tied.optim._update.setup"} <= names


# A lock object's docstring is Python's own; what tied.live_lock guards is documented in tied._core.live.
NO_EXAMPLE_NEEDED = {"tied.live_lock"}


def test_every_public_name_has_an_example():
    missing = []
    for module in (tied, tied.nn, tied.optim):
        for name in module.__all__:
            full = f"{module.__name__}.{name}"
            if full not in NO_EXAMPLE_NEEDED and ">>>" not in (getattr(module, name).__doc__ or ""):
                missing.append(full)
    assert not missing, f"public names whose docstring has no >>> example: {missing}"


DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def page_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


def multi_device(block: str) -> bool:
    # the same rule as tests/test_readme.py: these run with 8 fake CPU devices
    return "data_parallel(" in block or "Mesh(" in block


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_python_blocks_run(page, tmp_path, monkeypatch):
    # The site's own pages (the API pages are docstrings, run above); each page's blocks in order,
    # in one namespace. A page with a multi-device block runs in a process with 8 fake devices.
    blocks = [b.replace("/tmp/", f"{tmp_path}/") for b in page_blocks(page)]
    monkeypatch.chdir(tmp_path)  # files the blocks write land here
    if not any(map(multi_device, blocks)):
        namespace: dict = {"__name__": "__docs__"}
        for block in blocks:
            exec(compile(block, str(DOCS / page), "exec"), namespace)
        return
    body = "\n".join(f"exec(compile({b!r}, {str(DOCS / page)!r}, 'exec'), ns)" for b in blocks)
    script = tmp_path / "page.py"
    script.write_text(
        "import jax\nassert jax.device_count() == 8, jax.devices()\nns = {'__name__': '__docs__'}\n" + body
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]


def test_the_guide_pages_have_their_blocks():
    # the README's reference moved here: a page that lost its blocks would pass vacuously
    counts = {p: len(page_blocks(p)) for p in ("guide.md", "checkpoints.md", "interop.md", "performance.md")}
    assert min(counts.values()) >= 2, counts
    assert sum(map(multi_device, page_blocks("performance.md"))) >= 2


def test_docstring_example_sections_are_named_examples():
    # The API site (mkdocstrings, Google style) renders an "Examples:" section as code; a section
    # headed "Example:" becomes an admonition in which every ">>>" line is a nested quote.
    src = Path(tied.__file__).resolve().parent
    bad = [
        f"{p.name}:{i}"
        for p in sorted(src.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.strip() == "Example:"
    ]
    assert not bad, f"name these docstring sections 'Examples:': {bad}"


def test_every_example_script_is_on_the_examples_page():
    page = (DOCS / "examples.md").read_text()
    scripts = sorted(p.name for p in (DOCS.parent / "examples").glob("*.py"))
    assert scripts and [s for s in scripts if f'--8<-- "examples/{s}"' not in page] == []
