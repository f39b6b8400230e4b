# Each target creates or reuses .venv and installs what it needs by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONHASHSEED := 0

.PHONY: demo test lint bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test,demo]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[bench]"
	touch $@

demo: $(VENV)/.base
	$(PY) -m tied.demo

test: $(VENV)/.base
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m pytest

bench: $(VENV)/.bench
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
