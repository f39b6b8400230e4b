"""Multi-process training on one machine: 2 JAX processes of 4 fake CPU devices each.

tests/multiprocess/worker.py is started as 2 processes that meet through
`jax.distributed.initialize` on 127.0.0.1 (CPU collectives through gloo), 8 devices
in all, and train the tied LM of examples/tied_lm.py data-parallel over all of
them, the tied embedding split by vocabulary rows. The reference is the same
program as one process with 8 fake devices. Each worker asserts its ties and
shardings after every step and writes its losses and final arrays; this file
compares them. The 2 processes also save an Orbax checkpoint after step 2, restore
it into a fresh abstract ``like`` and step it beside the live run, then save again
and process 1 is killed mid-save: the previous checkpoint must still load (here,
into this one-device process). examples/multihost.py ``--local 2`` runs beside them.

Every worker runs in its own process group, killed in a ``finally`` (a failed or
hung run leaves nothing behind), under a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from processes import FAST_COMPILE, cpu_env, kill_group, start_logged

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "worker.py"
DEADLINE = 150  # seconds for one job (all its processes); all jobs together take ~35-60 s on 2 cores
STEPS, SAVE_AT = 4, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Worker processes, each in its own process group; `stop` kills whatever is left."""

    def __init__(self, out: Path, n: int, *extra: str, devices: int | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.logs = [out / f"log-{i}.txt" for i in range(n)]
        port = free_port() if n > 1 else 0
        self.procs = []
        for i in range(n):
            argv = [
                sys.executable,
                str(WORKER),
                "--out",
                str(out),
                "--steps",
                str(STEPS),
                "--devices",
                str(devices or 8 // n),
                *extra,
            ]
            if n > 1:
                argv += ["--port", str(port), "--process-id", str(i), "--num-processes", str(n)]
            self.procs.append(start_logged(argv, self.logs[i], cpu_env(FAST_COMPILE)))
        self.started = time.monotonic()

    def wait(self, *, expect_killed: int | None = None, grace: float = 5.0) -> list[int]:
        """Wait for every process; once one fails, the others get ``grace`` seconds, then are killed.

        ``expect_killed``: the index of a worker that is meant to die by SIGKILL; the
        others (blocked in a collective with it) are then killed at once.
        """
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
                if expect_killed is not None and codes[expect_killed] == -signal.SIGKILL:
                    failed_at -= grace
            now = time.monotonic()
            if now - self.started > DEADLINE or (failed_at is not None and now - failed_at > grace):
                self.stop()
                return [p.wait() for p in self.procs]
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            kill_group(p)

    def report(self) -> str:
        return "\n".join(
            f"--- worker {i} ---\n" + log.read_text(errors="replace")[-4000:]
            for i, log in enumerate(self.logs)
        )

    def results(self) -> list[dict]:
        return [json.loads((self.out / f"result-{i}.json").read_text()) for i in range(len(self.procs))]

    def params(self, i: int, name: str = "params") -> list[np.ndarray]:
        with np.load(self.out / f"{name}-{i}.npz") as f:
            return [f[f"arr_{k}"] for k in range(len(f.files))]


class Example:
    """``examples/multihost.py --local 2`` (a launcher and its 2 processes, one process group)."""

    def __init__(self, log: Path):
        self.log = log
        self.proc = start_logged(
            [sys.executable, str(ROOT / "examples" / "multihost.py"), "--local", "2", "--steps", "3"],
            log,
            cpu_env(FAST_COMPILE),
        )
        self.started = time.monotonic()

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()

    def stop(self) -> None:
        kill_group(self.proc)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two jobs side by side: 2 processes train 4 steps, saving an Orbax checkpoint after step 2,
    restoring it into a fresh abstract like and stepping that copy beside the live run, then save
    again and process 1 is killed mid-save; and the 1-process reference with 8 devices."""
    base = tmp_path_factory.mktemp("multiprocess")
    ckpt = base / "ckpt"
    t = time.monotonic()
    multi = Job(base / "multi", 2, "--ckpt", str(ckpt), "--save-at", str(SAVE_AT), "--crash-save")
    single = Job(base / "single", 1, devices=8)
    example = Example(base / "example.txt")  # beside them: the CPUs are shared, the waits are not
    try:
        codes = multi.wait(expect_killed=1), single.wait()
        example.wait()
    finally:
        multi.stop()
        single.stop()
        example.stop()
    assert codes[1] == [0], single.report()
    # Process 1 killed itself with its shards written; process 0, waiting for it, was killed here.
    assert codes[0][1] == -signal.SIGKILL and "killed mid-save" in multi.logs[1].read_text(), multi.report()
    assert codes[0][0] == -signal.SIGKILL, multi.report()
    return {
        "multi": multi,
        "single": single,
        "example": example,
        "ckpt": ckpt,
        "seconds": time.monotonic() - t,
    }


def test_two_processes_of_four_devices_make_one_mesh_of_eight(runs):
    r0, r1 = runs["multi"].results()
    assert (r0["process"], r1["process"]) == (0, 1)
    assert r0["processes"] == r1["processes"] == 2
    assert r0["devices"] == r1["devices"] == 8 and r0["local_devices"] == r1["local_devices"] == 4
    # Each process fed only its own rows of the global batch of 16: those its devices hold.
    assert r0["local_rows"] == list(range(8)) and r1["local_rows"] == list(range(8, 16))
    # The tied embedding is split over both processes: no process holds all of it.
    assert r0["embedding_fully_addressable"] is False and r1["embedding_fully_addressable"] is False
    # Each worker asserted, after every step, ties by `is` and one sharding per unique array.
    assert r0["checked_steps"] == r1["checked_steps"] == STEPS


def test_every_process_sees_the_same_loss(runs):
    r0, r1 = runs["multi"].results()
    (ref,) = runs["single"].results()
    assert len(r0["losses"]) == STEPS
    assert r0["losses"] == r1["losses"]  # bit for bit: one replicated array
    # Against one process: the all-reduce sums in another order (gloo across processes),
    # so the mean loss may differ in its last bits (observed: 1 ulp, ~5e-7).
    np.testing.assert_allclose(r0["losses"], ref["losses"], rtol=1e-5)
    assert r0["losses"][-1] < r0["losses"][0]  # it trains


def test_parameters_equal_the_single_process_run(runs):
    """Every unique array of (model, Adam state) after the last step, gathered from both processes.

    Tolerance: both runs compile the same 8-device program; only the order of the
    cross-device sums differs, so gradients differ by a few float32 ulps (~1e-7
    relative). Adam (eps 1e-5) maps that to parameter differences of at most a few
    1e-7 after 4 steps (observed max 5e-7). atol=2e-5, rtol=1e-4 allow 40x that and
    are 500x below one Adam step (lr = 1e-2): a cut tie, a gradient counted twice or
    a missing shard would move a parameter by about lr at the first step.
    """
    multi, single = runs["multi"], runs["single"]
    r0, r1 = multi.results()
    (ref,) = single.results()
    assert r0["paths"] == r1["paths"] == ref["paths"]  # one structure, the tie listed once
    assert ref["paths"][0] == ["[0].embed.weight", "[0].head.weight"]
    p0, p1, want = multi.params(0), multi.params(1), single.params(0)
    assert len(p0) == len(want) == len(ref["paths"])
    for path, a, b, w in zip(ref["paths"], p0, p1, want):
        np.testing.assert_array_equal(a, b, err_msg=path[0])  # both processes gathered the same
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=2e-5, err_msg=path[0])
    # Both started from one initial model, and it moved: most arrays by far more than the tolerance.
    for a, b in zip(multi.params(0, "init"), single.params(0, "init")):
        np.testing.assert_array_equal(a, b)
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(want, single.params(0, "init"))]
    assert sum(m > 1e-3 for m in moved) > len(moved) // 2, moved


def test_restored_from_the_checkpoint_the_run_goes_on_bit_for_bit(runs):
    """Steps 3 and 4 from the checkpoint (restored into a fresh abstract like, onto the same
    shardings) equal steps 3 and 4 of the uninterrupted run, to the bit."""
    multi = runs["multi"]
    for r in multi.results():
        assert r["restored_losses"] == r["losses"][SAVE_AT:] and len(r["restored_losses"]) == STEPS - SAVE_AT
    paths = multi.results()[0]["paths"]
    for i in (0, 1):
        for path, a, b in zip(paths, multi.params(i, "restored"), multi.params(0)):
            np.testing.assert_array_equal(a, b, err_msg=path[0])
    # And the checkpoint held step 2, not a copy of the final state.
    assert any(not np.array_equal(a, b) for a, b in zip(multi.params(0, "saved"), multi.params(0)))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(runs):
    """Process 1 died mid-save: its shards were in Orbax's temporary directory, never finalised.
    Loading the checkpoint directory gives the step-2 checkpoint (here in this one-device process,
    onto an abstract like); loading the unfinished directory itself is refused."""
    import jax

    import tied

    lm = _lm()
    ckpt = runs["ckpt"]
    entries = sorted(os.listdir(ckpt))
    unfinished = [e for e in entries if "tmp" in e]
    assert len(unfinished) == 1 and entries == sorted(["0", *unfinished]), entries
    assert tied.load_metadata(ckpt) == {"step": SAVE_AT}
    like = lm.abstract_like(lambda path, x: jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    model, state = tied.load(ckpt, like)
    lm.check_ties(model, state)
    saved = runs["multi"].params(0, "saved")
    for x, want in zip(tied.flatten((model, state))[0], saved):
        np.testing.assert_array_equal(np.asarray(x), want)
    with pytest.raises(tied.CheckpointError, match="an unfinished save .* was interrupted"):
        tied.load(ckpt / unfinished[0], like)


def test_example_multihost_runs_as_two_local_processes(runs):
    """examples/multihost.py --local 2: both processes train, save, restore and agree."""
    example = runs["example"]
    out = example.output()
    # Both processes write to one pipe (and gloo to stderr), so lines may interleave: search, not split.
    assert example.proc.returncode == 0, out[-5000:]
    assert sorted(re.findall(r"\[process (\d)\] ok\b", out)) == ["0", "1"], out[-5000:]
    losses = dict(re.findall(r"\[process (\d)\] loss ([0-9.]+ -> [0-9.]+ -> [0-9.]+)", out))
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], out[-5000:]  # one loss, seen by both
    assert len(re.findall(r"this process holds 32 of 64 rows", out)) == 2, out[-5000:]


def _lm():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multiprocess_lm", WORKER.parent / "lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- tied.CheckpointManager, two processes


class ManagerJob(Job):
    """tests/multiprocess/manager_worker.py as 2 processes of 4 devices (the machinery of `Job`)."""

    def __init__(self, out: Path, ckpt: Path, *extra: str):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.logs = [out / f"log-{i}.txt" for i in range(2)]
        port = free_port()
        self.procs = []
        for i in range(2):
            argv = [
                sys.executable,
                str(WORKER.parent / "manager_worker.py"),
                "--out",
                str(out),
                "--ckpt",
                str(ckpt),
                "--devices",
                "4",
                "--steps",
                "6",
                "--save-every",
                "2",
                "--port",
                str(port),
                "--process-id",
                str(i),
                "--num-processes",
                "2",
                *extra,
            ]
            self.procs.append(start_logged(argv, self.logs[i], cpu_env(FAST_COMPILE)))
        self.started = time.monotonic()


def test_a_two_process_run_killed_resumes_bit_for_bit(tmp_path):
    """2 processes x 4 devices train 6 steps with a tied.CheckpointManager (an async save every 2
    steps, the tied embedding split over both processes). One run goes straight through; another,
    beside it, has process 1 SIGKILLed after a random step (seeded), and is started again: it
    resumes from its latest complete step and ends with every array (model and Adam state,
    gathered from both processes) bit-identical to the uninterrupted run's."""
    import random

    kill_at = random.Random(21).randint(3, 5)
    ref = ManagerJob(tmp_path / "ref", tmp_path / "ref-ckpt")
    killed = ManagerJob(tmp_path / "killed", tmp_path / "ckpt", "--kill-at", str(kill_at))
    try:
        codes = ref.wait(), killed.wait(expect_killed=1)
    finally:
        ref.stop()
        killed.stop()
    assert codes[0] == [0, 0], ref.report()
    assert codes[1][1] == -signal.SIGKILL and "manager worker: killed" in killed.logs[1].read_text(), (
        killed.report()
    )
    resumed = ManagerJob(tmp_path / "resumed", tmp_path / "ckpt")
    try:
        assert resumed.wait() == [0, 0], resumed.report()
    finally:
        resumed.stop()
    r0, r1 = resumed.results()
    # Resumed from a complete step no later than the kill (the last due one may have been in flight).
    assert r0 == r1 and r0["resumed_from"] in (kill_at - kill_at % 2, kill_at - kill_at % 2 - 2), r0
    assert r0["steps"] == [4, 6] and ref.results()[0]["steps"] == [4, 6]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "6"]  # the killed save's directory is gone
    for i in (0, 1):
        with np.load(ref.out / f"final-{i}.npz") as f, np.load(resumed.out / f"final-{i}.npz") as g:
            assert len(f.files) == len(g.files) > 10
            for k in f.files:
                assert f[k].dtype == g[k].dtype and f[k].tobytes() == g[k].tobytes(), k
