"""Shared helpers for tests that start Python processes.

The environment a child runs in (the CPU, XLA flags of its own), a child whose output
goes to a log file, in its own process group so that nothing it starts outlives a
failed or hung test, and a pytest file run under several fake CPU devices.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Programs that run a few steps: compiling, not running, is most of their time; skip LLVM's optimisations.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def cpu_env(*flags: str) -> dict:
    """This process's environment for a child on the CPU: ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS``
    without any device count of this process, then ``flags``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*kept, *flags])
    return env


def start_logged(argv: Sequence[str], log: Path, env: dict) -> subprocess.Popen:
    """``argv`` started in ROOT in its own process group, stdout and stderr to ``log`` (kept as
    ``proc.log``), no stdin."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group of ``proc`` (started by `start_logged`) if it still runs; then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_or_kill(proc: subprocess.Popen, timeout: float = 120) -> int:
    """The exit status of ``proc`` (started by `start_logged`); past ``timeout`` (or on any error) its
    group is killed and the error raised."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        kill_group(proc)


def pytest_on_fake_devices(path: str, *flags: str, devices: int = 8) -> tuple[int, str]:
    """The pytest file ``path`` (from ROOT) run in its own process on ``devices`` fake CPU devices, with
    the extra XLA ``flags``: its exit status and the tail of its output."""
    env = cpu_env(f"--xla_force_host_platform_device_count={devices}", *flags)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout[-6000:] + proc.stderr[-3000:]
