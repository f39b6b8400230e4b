# Each target creates or reuses .venv and installs what it needs by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONHASHSEED := 0

.PHONY: demo test bench docs clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test,demo]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[bench]"
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PIP) install -q -e ".[docs]"
	touch $@

demo: $(VENV)/.base
	@# Graphviz draws the model's DAG; the demo runs without it, so installing it is best effort.
	@command -v dot >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get install -y -qq graphviz >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq graphviz >/dev/null 2>&1))) || \
		echo "note: Graphviz's dot is not installed; the demo writes model.dot but no picture"
	$(PY) -m tied.demo

test: $(VENV)/.base
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m pytest

bench: $(VENV)/.bench
	$(PY) -m benchmarks.run

# The API reference: mkdocs-material, with mkdocstrings reading the docstrings; into site/.
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis
