"""Test configuration: hypothesis profiles (a fast default, a derandomized one for CI); the built
documentation site, for the tests of the site, built once and its tests kept on one xdist worker."""

import os
import subprocess
import sys
from pathlib import Path

# Every compiled flatten/unflatten plan is checked against the plain walk (set before tied
# is imported; the core reads it once).
os.environ.setdefault("TIED_CHECK_PLANS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None, max_examples=30)
settings.register_profile("ci", deadline=None, max_examples=50, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto --dist loadgroup``), every test of the built site
    goes to one worker, so the site is built once (a session fixture is per worker)."""
    for item in items:
        if "site" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("site"))


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The documentation site built with mkdocs (``--strict``, as ``make docs`` does) into a temporary
    folder, once per test session (per xdist worker; the site's tests share one worker)."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
