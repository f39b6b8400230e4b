"""Test configuration: hypothesis profiles (a fast default, a derandomized one for CI)."""

import os

# Every compiled flatten/unflatten plan is checked against the plain walk (set before tied
# is imported; the core reads it once).
os.environ.setdefault("TIED_CHECK_PLANS", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None, max_examples=30)
settings.register_profile("ci", deadline=None, max_examples=50, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
