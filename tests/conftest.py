"""Test configuration: hypothesis profiles (a fast default, a derandomized one for CI)."""

import os

from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=30)
settings.register_profile("ci", deadline=None, max_examples=50, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
