"""tied.CheckpointManager shared: several managers and processes on one directory, saves pending at exit,
deletion that a crash cannot leave half-listed.

References are independent of the manager: the values each step must hold (a function of the step,
compared bit for bit), the directory listed with ``os.listdir``, the exit status of a process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from processes import FAST_COMPILE, cpu_env, start_logged, wait_or_kill

import tied

ROOT = Path(__file__).resolve().parents[2]
RW = ROOT / "tests" / "multiprocess" / "manager_rw.py"


def _env() -> dict:
    env = cpu_env(FAST_COMPILE)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _start(*args: str, log: Path) -> subprocess.Popen:
    return start_logged([sys.executable, str(RW), *args], log, _env())


def want(step: int) -> dict:
    """What step ``step`` holds (tests/multiprocess/manager_rw.py's tree, computed here with numpy)."""
    w = np.full((8, 64), float(step), np.float32) + np.arange(64, dtype=np.float32) / 1000
    return {"weight": w, "bias": np.full((64,), -float(step), np.float32), "count": np.array([step])}


def check_step(path: Path, step: int) -> None:
    like = {"embed": {"weight": jnp.zeros((8, 64))}, "bias": jnp.zeros(64), "count": np.array([0])}
    like["head"] = like["embed"]
    back = tied.load(path / str(step), like)
    ref = want(step)
    assert back["head"] is back["embed"]
    assert np.array_equal(np.asarray(back["embed"]["weight"]), ref["weight"])
    assert np.array_equal(np.asarray(back["bias"]), ref["bias"])
    assert np.array_equal(back["count"], ref["count"])


# ---------------------------------------------------------------- two processes


def test_a_writer_and_a_reader_process_on_one_directory_for_30_steps(tmp_path):
    """A writer saves every step 1..30 asynchronously (keeping the last 4 and every 3rd) and exits without
    close(); a reader process opens a manager, lists and restores the latest step in a loop meanwhile.
    Neither fails; every restore is a complete step with its own values and its tie; the reader sees
    step 30; afterwards the directory holds exactly the steps to keep, each complete, and nothing else."""
    d = tmp_path / "run"
    d.mkdir()
    ready = str(tmp_path / "reader-ready")
    reader = _start(
        "reader",
        str(d),
        "--steps",
        "30",
        "--out",
        str(tmp_path / "seen.json"),
        "--ready",
        ready,
        log=tmp_path / "r.txt",
    )
    writer = _start(
        "writer",
        str(d),
        "--steps",
        "30",
        "--max-to-keep",
        "4",
        "--keep-every",
        "3",
        "--pause",
        "0.05",
        "--start-after",
        ready,
        log=tmp_path / "w.txt",
    )
    code_w, code_r = wait_or_kill(writer), wait_or_kill(reader)
    wlog, rlog = writer.log.read_text(), reader.log.read_text()  # type: ignore[attr-defined]
    assert code_w == 0 and "writer: saved 30 steps" in wlog, wlog[-3000:]
    assert "cannot schedule" not in wlog and "Traceback" not in wlog, wlog[-3000:]
    assert code_r == 0, rlog[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["seen"] and seen["seen"][-1] == 30, seen["seen"]
    assert seen["seen"] == sorted(seen["seen"])  # the latest only goes up
    assert len(set(seen["seen"])) >= 5  # it read while the writer wrote (about 20 distinct steps here)
    kept = sorted({*range(3, 31, 3), 27, 28, 29, 30})
    assert sorted(os.listdir(d), key=lambda n: (len(n), n)) == [str(s) for s in kept]
    with tied.CheckpointManager(d) as mngr:
        assert mngr.all_steps() == kept
    for s in kept:
        check_step(d, s)


def test_a_script_that_ends_without_wait_or_close_keeps_every_step(tmp_path):
    """Point 12: saves 1..3 in the background, then the script ends normally: exit status 0, every step
    listed and complete, no temporary directory or marker left, no error printed."""
    d = tmp_path / "run"
    p = _start("writer", str(d), "--steps", "3", log=tmp_path / "w.txt")
    code, log = wait_or_kill(p), p.log.read_text()  # type: ignore[attr-defined]
    assert code == 0 and "cannot schedule" not in log and "Traceback" not in log, log[-3000:]
    assert sorted(os.listdir(d)) == ["1", "2", "3"]
    for s in (1, 2, 3):
        check_step(d, s)


def test_a_save_that_fails_at_exit_makes_the_exit_status_1(tmp_path):
    """A pending save that fails while the interpreter exits is reported on stderr and the process ends
    with status 1, never 0 with the step missing."""
    d = tmp_path / "run"
    script = (
        "import jax.numpy as jnp, orbax.checkpoint as ocp, tied\n"
        "async def boom(*a, **k):\n"
        "    raise OSError('disk full')\n"
        "ocp.type_handlers.NumpyHandler._background_serialize = boom\n"
        f"m = tied.CheckpointManager({str(d)!r})\n"
        "m.save(1, {'w': jnp.ones(3)})\n"
        "print('returned', flush=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "returned" in r.stdout
    assert f"a save to {d} pending at exit failed" in r.stderr
    with tied.CheckpointManager(d) as mngr:
        assert mngr.all_steps() == []


# ---------------------------------------------------------------- two managers, one process


def test_a_reader_opened_during_a_save_never_removes_it(tmp_path, slow_writes):
    """Point 13: manager B opened (and used to list and restore) while A's save of step 2 is in flight
    leaves A's temporary directory alone; A's wait succeeds and step 2 is complete."""
    d = tmp_path / "c"
    a = tied.CheckpointManager(d)
    a.save(1, {"w": jnp.ones(3)})
    a.wait()
    a.save(2, {"w": jnp.full(3, 2.0)})
    assert any("tmp" in n for n in os.listdir(d))  # in flight
    with tied.CheckpointManager(d) as b:
        assert b.all_steps() == [1]
        assert float(b.restore({"w": jnp.zeros(3)})["w"][0]) == 1.0
    assert any("tmp" in n for n in os.listdir(d))  # still there
    a.wait()
    assert a.all_steps() == [1, 2]
    assert float(a.restore({"w": jnp.zeros(3)})["w"][0]) == 2.0
    a.close()
    assert sorted(os.listdir(d)) == ["1", "2"]


def test_a_second_writer_never_removes_a_save_in_flight_and_is_refused_its_step(tmp_path, slow_writes):
    """A second manager that saves while A's step 3 is in flight: its cleaning spares A's directory (A is
    alive), and a save of step 3 or lower is refused naming A's process; A's step completes."""
    d = tmp_path / "c"
    a = tied.CheckpointManager(d)
    a.save(1, {"w": jnp.ones(3)})
    a.wait()
    a.save(3, {"w": jnp.full(3, 3.0)})
    b = tied.CheckpointManager(d)
    with pytest.raises(
        tied.CheckpointError, match=rf"step 3 is being saved to .* by another manager \(process {os.getpid()}"
    ):
        b.save(2, {"w": jnp.zeros(3)})
    a.wait()
    assert a.all_steps() == [1, 3]
    b.close()
    a.close()


def test_abandoned_saves_are_removed_by_the_next_writer_only(tmp_path):
    """A temporary directory whose marker names a process that is gone (or no marker at all) is removed
    by the next manager that saves, never by one that only reads; one whose marker names another host
    is never removed (nothing proves it abandoned) and blocks a save of its step, named."""
    d = tmp_path / "c"
    with tied.CheckpointManager(d, async_save=False) as m:
        m.save(1, {"w": jnp.ones(3)})
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    for step, owner in [(5, {"host": socket.gethostname(), "pid": dead_pid}), (6, None)]:
        shutil.copytree(d / "1", d / f"{step}.orbax-checkpoint-tmp")
        if owner is not None:
            (d / f".tied-saving-{step}-x").write_text(json.dumps({**owner, "token": "x", "step": step}))
    with tied.CheckpointManager(d) as reader:
        assert reader.all_steps() == [1]
    assert {"5.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp", ".tied-saving-5-x"} <= set(os.listdir(d))
    with tied.CheckpointManager(d, async_save=False) as writer:
        writer.save(2, {"w": jnp.ones(3)})
    assert sorted(os.listdir(d)) == ["1", "2"]
    shutil.copytree(d / "1", d / "7.orbax-checkpoint-tmp")
    far = {"host": "another-host.example", "pid": 1, "token": "y", "step": 7}
    (d / ".tied-saving-7-y").write_text(json.dumps(far))
    with tied.CheckpointManager(d, async_save=False) as writer:
        with pytest.raises(
            tied.CheckpointError, match=r"step 7 is being saved .* on host another-host\.example"
        ):
            writer.save(7, {"w": jnp.ones(3)})
    assert "7.orbax-checkpoint-tmp" in os.listdir(d)


def test_each_save_checks_the_directory_not_what_it_held_at_opening(tmp_path):
    """Point 14: B opened before A saved 5; B.save(3) is refused (steps only go up, in the directory),
    and nothing is written. Point 15: B.save(5) says that step 5 exists and is complete."""
    d = tmp_path / "c"
    a = tied.CheckpointManager(d, async_save=False)
    a.save(1, {"w": jnp.ones(3)})
    b = tied.CheckpointManager(d, async_save=False)
    a.save(5, {"w": jnp.full(3, 5.0)})
    with pytest.raises(
        tied.CheckpointError, match=r"step 3 is not greater than the latest step saved to .*c, 5"
    ):
        b.save(3, {"w": jnp.zeros(3)})
    with pytest.raises(tied.CheckpointError, match=r"Step 5 exists there and is complete"):
        b.save(5, {"w": jnp.zeros(3)})
    assert sorted(os.listdir(d)) == ["1", "5"]
    assert float(b.restore({"w": jnp.zeros(3)})["w"][0]) == 5.0
    a.close()
    b.close()


# ---------------------------------------------------------------- a step is listed only when complete


def test_a_step_missing_its_array_files_is_not_listed(tmp_path):
    """Point 16: a step whose arrays are gone but whose manifest and commit marker are left (a crash in
    the middle of deleting it) is not listed, and the latest complete step is read instead."""
    d = tmp_path / "c"
    with tied.CheckpointManager(d, async_save=False, max_to_keep=None) as m:
        m.save(1, {"w": jnp.ones(3)})
        m.save(2, {"w": jnp.full(3, 2.0)})
    shutil.rmtree(d / "2" / "arrays")
    assert (d / "2" / "tied" / "metadata").exists() and (d / "2" / "commit_success.txt").exists()
    with tied.CheckpointManager(d) as m:
        assert m.all_steps() == [1] and m.latest_step() == 1
        assert float(m.restore({"w": jnp.zeros(3)})["w"][0]) == 1.0
    # tied.load of the directory reads its newest finalised save, and names the damage.
    with pytest.raises(tied.CheckpointError, match=r"c/2 .*missing or damaged; nothing was loaded"):
        tied.load(d, {"w": jnp.zeros(3)})
    manifest = (d / "1" / "tied" / "metadata").read_text()
    (d / "1" / "tied" / "metadata").write_text("{not json")  # there but damaged: listed, and named
    with tied.CheckpointManager(d) as m:
        assert m.all_steps() == [1]
        with pytest.raises(tied.CheckpointError, match=r"its manifest .* cannot be read"):
            m.restore({"w": jnp.zeros(3)})
    (d / "1" / "tied" / "metadata").write_text(manifest)
    (d / "1" / "arrays" / "_METADATA").unlink()  # Orbax's array metadata gone: not complete
    with tied.CheckpointManager(d) as m:
        assert m.all_steps() == []


def test_a_crash_in_the_middle_of_deleting_an_old_step_never_leaves_it_listed(tmp_path, monkeypatch):
    """max_to_keep=1: the deletion of step 1 dies after removing its arrays (every rmtree does). Step 1
    is never listed afterwards, and the next manager that saves removes what was left."""
    d = tmp_path / "c"
    real = shutil.rmtree

    def dies_midway(path, *args, **kwargs):
        if os.path.isdir(os.path.join(path, "arrays")):
            real(os.path.join(path, "arrays"))
        raise KeyboardInterrupt("killed while deleting")

    with tied.CheckpointManager(d, async_save=False, max_to_keep=1) as m:
        m.save(1, {"w": jnp.ones(3)})
        monkeypatch.setattr(shutil, "rmtree", dies_midway)
        try:
            m.save(2, {"w": jnp.full(3, 2.0)})
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
    with tied.CheckpointManager(d) as m:
        assert m.all_steps() == [2]
    assert "1" not in os.listdir(d)
    with tied.CheckpointManager(d, async_save=False, max_to_keep=1) as m:
        m.save(3, {"w": jnp.full(3, 3.0)})
    assert sorted(os.listdir(d)) == ["3"]


def test_restoring_the_latest_step_while_a_writer_deletes_it_reads_the_new_latest(tmp_path, monkeypatch):
    """A reader starts reading step 2; before it reads a byte, the writer saves step 3 and (max_to_keep=1)
    deletes step 2. The read of step 2 fails (its files were renamed away), and restore() reads step 3,
    whole; an explicit restore of step 2 says it is not a complete step."""
    from tied._checkpoint import orbax_format as _orbax

    d = tmp_path / "c"
    writer = tied.CheckpointManager(d, max_to_keep=1, async_save=False)
    writer.save(2, {"w": jnp.full(3, 2.0)})
    reader = tied.CheckpointManager(d)
    real, calls = _orbax.load, []

    def load_after_the_writer_moved_on(path, like, **kw):
        calls.append(os.path.basename(path))
        if len(calls) == 1:
            writer.save(3, {"w": jnp.full(3, 3.0)})
        return real(path, like, **kw)

    monkeypatch.setattr(_orbax, "load", load_after_the_writer_moved_on)
    back = reader.restore({"w": jnp.zeros(3)})
    assert calls == ["2", "3"] and np.array_equal(np.asarray(back["w"]), np.full(3, 3.0, np.float32))
    with pytest.raises(
        tied.CheckpointError, match=r"step 2 is not a complete step of .*\(complete steps: 3\)"
    ):
        reader.restore({"w": jnp.zeros(3)}, 2)
    reader.close()
    writer.close()
    assert sorted(os.listdir(d)) == ["3"]
