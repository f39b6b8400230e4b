"""Dependency versions: the import-time check names a too-old dependency, and its minimums are
pyproject.toml's lower bounds (the versions `make test-min` installs and tests)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from tied import _compat

ROOT = Path(__file__).resolve().parents[1]


def _lower_bounds() -> dict[str, str]:
    """pyproject.toml's core dependencies -> their `>=` bound, parsed here independently."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for req in project["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", req.strip())
        assert m, f"core dependency {req!r} has no plain >= lower bound"
        bounds[m[1]] = m[2]
    return bounds


def test_min_versions_are_pyprojects_lower_bounds():
    assert _compat.MIN_VERSIONS == _lower_bounds()


def test_installed_versions_pass_the_check():
    installed = {name: metadata.version(name) for name in _compat.MIN_VERSIONS}
    _compat.check_versions(installed)  # no error: this environment is supported


@pytest.mark.parametrize(
    ("found", "ok"),
    [
        ("0.4.30", False),
        ("0.9.2", False),
        ("0.10.1", False),
        ("0.10.2rc1", True),
        ("0.10.2", True),
        ("0.11.0", True),
        ("1.0", True),
    ],
)
def test_an_old_jax_is_an_import_error_naming_the_needed_version(found, ok):
    need = _lower_bounds()["jax"]
    if ok:
        _compat.check_versions({"jax": found})
        return
    msg = rf"installed jax {re.escape(found)} \(tied needs jax>={re.escape(need)}\)"
    msg += rf".*pip install -U 'jax>={re.escape(need)}'"
    with pytest.raises(ImportError, match=msg):
        _compat.check_versions({"jax": found})


def test_every_old_dependency_is_named_and_a_missing_one_is_not_judged():
    with pytest.raises(ImportError) as info:
        _compat.check_versions({"numpy": "1.26.4", "optax": "0.2.4", "jax": None, "safetensors": "0.8.0"})
    text = str(info.value)
    assert "numpy 1.26.4 (tied needs numpy>=2.0)" in text
    assert "optax 0.2.4 (tied needs optax>=0.2.5)" in text
    assert "jax" not in text and "safetensors" not in text


def test_import_tied_with_an_old_jax_fails_before_importing_jax():
    # A fresh interpreter whose metadata reports JAX 0.9.2: `import tied` is the ImportError, and JAX
    # itself was not imported (the check runs first, so even a JAX that breaks on import is named).
    code = textwrap.dedent(
        """
        import sys
        from importlib import metadata
        real = metadata.version
        metadata.version = lambda name: "0.9.2" if name == "jax" else real(name)
        try:
            import tied
        except ImportError as e:
            print("ImportError:", e)
        print("jax imported:", "jax" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    need = _lower_bounds()["jax"]
    expected = f"ImportError: tied does not support the installed jax 0.9.2 (tied needs jax>={need})"
    assert expected in out.stdout
    assert "jax imported: False" in out.stdout
