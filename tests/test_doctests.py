"""Every ``>>>`` example in the package's docstrings runs as written.

Each docstring's examples run in a fresh namespace (not the module's globals), so an
example that forgets an import or a definition fails here, as it would for a reader
who pastes it. These are the examples the API reference (``make docs``) shows.
"""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tied

MODULES = ["tied"] + sorted(f"tied.{m.name}" for m in pkgutil.iter_modules(tied.__path__))
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
    assert {"tied.nn.Dense", "tied._graph.flatten", "tied.optim.setup"} <= names


# A lock object's docstring is Python's own; what tied.live_lock guards is documented in tied._live.
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


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_page_python_blocks_run(page):
    # The site's own pages (the API pages are docstrings, run above); each page's blocks in order.
    namespace: dict = {"__name__": "__docs__"}
    for block in re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M):
        exec(compile(block, str(DOCS / page), "exec"), namespace)


def test_docstring_example_sections_are_named_examples():
    # The API site (mkdocstrings, Google style) renders an "Examples:" section as code; a section
    # headed "Example:" becomes an admonition in which every ">>>" line is a nested quote.
    src = Path(tied.__file__).resolve().parent
    bad = [
        f"{p.name}:{i}"
        for p in sorted(src.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.strip() == "Example:"
    ]
    assert not bad, f"name these docstring sections 'Examples:': {bad}"


def test_every_example_script_is_on_the_examples_page():
    page = (DOCS / "examples.md").read_text()
    scripts = sorted(p.name for p in (DOCS.parent / "examples").glob("*.py"))
    assert scripts and [s for s in scripts if f'--8<-- "examples/{s}"' not in page] == []
