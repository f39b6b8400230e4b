# Each target creates or reuses .venv and installs what it needs by itself: `make demo` only the
# package and its demo extra, `make docs` the docs extra, `make test` everything it tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONHASHSEED := 0

.PHONY: demo test test-site test-min bench docs docs-serve clean

$(VENV)/.made:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

# The demo's own stamp: the core dependencies and the demo extra (no PyTorch, Flax, Equinox or docs tools).
$(VENV)/.demo: pyproject.toml $(VENV)/.made
	$(PIP) install -q -e ".[demo]"
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.made
	$(PIP) install -q -e ".[test,demo,docs]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[bench]"
	touch $@

$(VENV)/.docs: pyproject.toml $(VENV)/.made
	$(PIP) install -q -e ".[docs]"
	touch $@

# A system package installed only where it is missing, as root, with apt-get, after saying so; a target
# that can run without it goes on (the demo writes model.dot but no picture; the browser test skips).
# $(call SYSTEM_PACKAGE,command,package,what it is for)
define SYSTEM_PACKAGE
	@command -v $(1) >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "make $@: installing $(2) with the system's package manager (apt-get install $(2)): $(3)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null 2>&1; } || \
	    echo "make $@: could not install $(2); going on without it"; \
	  else echo "make $@: $(1) is not installed (apt-get install $(2), as root): $(3); going on without it"; fi; }
endef

demo: $(VENV)/.demo
	$(call SYSTEM_PACKAGE,dot,graphviz,Graphviz's dot draws the model's DAG)
	$(PY) -m tied.demo

test: $(VENV)/.base
	$(call SYSTEM_PACKAGE,dot,graphviz,the docs draw the seed example's DAG)
	$(call SYSTEM_PACKAGE,chromedriver,chromium chromium-driver,tests/test_site_browser.py drives a headless Chromium)
	$(PY) -m ruff check src tests examples benchmarks docs/_hooks
	$(PY) -m ruff format --check src tests examples benchmarks docs/_hooks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n auto --dist loadgroup

# The site alone: built, checked from disk, then opened in a headless Chromium (search, every page's console);
# its screenshots go to docs/screenshots/ (committed: look at them when the site's look changes).
test-site: $(VENV)/.base
	$(call SYSTEM_PACKAGE,dot,graphviz,the docs draw the seed example's DAG)
	$(call SYSTEM_PACKAGE,chromedriver,chromium chromium-driver,tests/test_site_browser.py drives a headless Chromium)
	TIED_SCREENSHOTS=docs/screenshots $(PY) -m pytest tests/test_site.py tests/test_site_browser.py

# The lowest declared versions, in a venv of its own (.venv-min, made anew when pyproject.toml changes):
# every direct dependency (pyproject's dependencies and the test extra) pinned to its `>=` bound (an `==`
# pin kept), the installed versions printed, then the core subset: every test file but those of the
# docs, README, examples, demo, memory figures and multiple processes (TEST_MIN_SKIP).
VENV_MIN := .venv-min
PY_MIN := $(VENV_MIN)/bin/python
TEST_MIN_SKIP := tests/test_demo.py tests/test_examples.py tests/test_readme.py tests/test_doctests.py \
	tests/test_memory.py tests/test_multiprocess.py tests/multidevice tests/multiprocess

define MIN_CONSTRAINTS
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(>=|==)\s*([^,;\s]+)", req.strip())
    if not m:
        raise SystemExit(f"make test-min: {req!r} has no lower bound to test")
    print(f"{m[1]}=={m[4]}")
endef
export MIN_CONSTRAINTS

$(VENV_MIN)/.base: pyproject.toml
	rm -rf $(VENV_MIN)
	$(PYTHON) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install -q --upgrade pip
	$(PY_MIN) -c "$$MIN_CONSTRAINTS" > $(VENV_MIN)/constraints.txt
	$(PY_MIN) -m pip install -q -c $(VENV_MIN)/constraints.txt -e ".[test]"
	touch $@

test-min: $(VENV_MIN)/.base
	@echo "make test-min: the lowest declared versions, on $$($(PY_MIN) -c 'import sys; print(sys.version.split()[0])'):"
	@$(PY_MIN) -c 'import sys, importlib.metadata as md; \
		names = [l.split("==")[0] for l in open(sys.argv[1]) if "==" in l] + ["jaxlib"]; \
		print("  " + " ".join(f"{n}=={md.version(n)}" for n in names))' $(VENV_MIN)/constraints.txt
	$(PY_MIN) -m pytest -n auto --dist loadgroup $(addprefix --ignore=,$(TEST_MIN_SKIP))

bench: $(VENV)/.bench
	$(PY) -m benchmarks.run

# The API reference: mkdocs-material, with mkdocstrings reading the docstrings; into site/.
docs: $(VENV)/.docs
	$(call SYSTEM_PACKAGE,dot,graphviz,the home page draws the seed example's DAG)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The site served with live reload (http://127.0.0.1:8000); the built site/ also works opened from disk.
docs-serve: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) $(VENV_MIN) runs site .pytest_cache .hypothesis
