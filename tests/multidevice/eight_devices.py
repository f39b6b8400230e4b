"""Imported first by every file of tests/multidevice: 8 fake CPU devices for this process.

Sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (and ``JAX_PLATFORMS=cpu``)
before JAX is imported, so that a file here also runs on its own (``python -m pytest
tests/multidevice/rules.py``), then checks that JAX sees 8 devices: a process that imported
JAX before this file (the main test process, which never imports these files: their names do
not match ``test_*.py``) keeps its own count. The tests that start them are in
tests/transforms, tests/nn and tests/checkpoint (`processes.pytest_on_fake_devices`).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if jax.device_count() != 8:
    raise RuntimeError(
        f"tests/multidevice needs 8 devices, found {jax.device_count()}: run it through the test that "
        "starts it (processes.pytest_on_fake_devices), or with XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 set before JAX is imported."
    )
