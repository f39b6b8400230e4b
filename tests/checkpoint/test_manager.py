"""tied.CheckpointManager: resume exactly after SIGKILL, no race with donation, directory hygiene,
bad input refused.

References are independent of the manager's reader: host copies (numpy) of the arrays
taken before each save, compared bit for bit; a run that was never killed (the same
script, in its own process); the directory listed with ``os.listdir``. Several
processes are covered by tests/test_multiprocess.py.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import same_bits
from processes import FAST_COMPILE, cpu_env, start_logged, wait_or_kill

import tied
from tied.nn import Dense, Embedding

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resumable_training.py"
TX = optax.adam(1e-2)


def host(tree) -> list[np.ndarray]:
    """Every unique array of ``tree`` copied to the host: the reference for what a step holds."""
    return [np.array(x, copy=True) for x in tied.flatten(tree)[0]]


def make(seed: int = 0) -> dict:
    """An embedding at two places (input and head), a Dense, an Adam state, a random stream, a numpy array."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    emb = Embedding(6, 4, key=k1)
    model = {"embed": emb, "head": emb, "out": Dense(4, 4, key=k2)}
    return {
        "model": model,
        "opt": tied.optim.setup(TX, model),
        "rng": tied.Rng(jax.random.PRNGKey(seed)),
        "stats": np.arange(3.0) + seed,
    }


X = jnp.arange(3)


def loss(m):
    h = m["embed"](X)
    return jnp.sum(jnp.tanh(m["out"](h)) * m["head"].attend(h)[:, :4])


def check_ties(run: dict) -> None:
    m = run["model"]
    assert m["embed"] is m["head"]
    assert set(run["opt"].inner_state[0].mu) == {"['embed'].weight", "['out'].weight", "['out'].bias"}


def steps_on_disk(path) -> list[str]:
    return sorted(os.listdir(path))


# ---------------------------------------------------------------- resume is exact


def _example(*args: str, log: Path) -> subprocess.Popen:
    return start_logged([sys.executable, str(EXAMPLE), *args], log, cpu_env(FAST_COMPILE))


def test_a_run_killed_at_random_steps_resumes_bit_for_bit(tmp_path):
    """examples/resumable_training.py: 40 steps, an async save every 5, SIGKILLed after a random step
    (seeded; one of them a multiple of 5, so the kill lands while that step's save is in flight), then
    started again: the final model, Adam state and random stream equal, bit for bit, those of a run that
    was never killed (the same script in its own process)."""
    r = random.Random(21)
    kills = sorted({r.randrange(1, 40), 5 * r.randint(1, 7)})
    ref = _example(
        "--dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.npz"), log=tmp_path / "ref.txt"
    )
    killed = {
        k: _example("--dir", str(tmp_path / f"k{k}"), "--kill-at", str(k), log=tmp_path / f"k{k}.txt")
        for k in kills
    }
    latest = {}
    for k, p in killed.items():
        assert wait_or_kill(p) == -9, p.log.read_text()[-3000:]  # type: ignore[attr-defined]
        with tied.CheckpointManager(tmp_path / f"k{k}", async_save=False) as listed:
            steps = listed.all_steps()
        # Only complete steps are listed: due ones, no later than the kill; the save of the last due
        # step may have been in flight (killed mid-write), then the one before is the latest.
        assert all(s % 5 == 0 and s <= k for s in steps) and len(steps) <= 2, (k, steps)
        assert not steps or steps[-1] >= k - k % 5 - 5, (k, steps)
        latest[k] = steps[-1] if steps else None
    assert wait_or_kill(ref) == 0, ref.log.read_text()[-3000:]  # type: ignore[attr-defined]
    resumed = {
        k: _example(
            "--dir", str(tmp_path / f"k{k}"), "--out", str(tmp_path / f"k{k}.npz"), log=tmp_path / f"r{k}.txt"
        )
        for k in kills
    }
    for k, p in resumed.items():
        assert wait_or_kill(p) == 0, p.log.read_text()[-3000:]  # type: ignore[attr-defined]
        if latest[k] is not None:
            assert f"resumed from step {latest[k]} " in p.log.read_text()  # type: ignore[attr-defined]
        # No unfinished save is left behind, and the kept steps are the last two.
        assert steps_on_disk(tmp_path / f"k{k}") == ["35", "40"]
    with np.load(tmp_path / "ref.npz") as f:
        want = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert len(want) > 10
    for k in kills:
        with np.load(tmp_path / f"k{k}.npz") as f:
            got = [f[f"arr_{i}"] for i in range(len(f.files))]
        assert len(got) == len(want)
        assert all(same_bits(a, b) for a, b in zip(got, want)), k


# ---------------------------------------------------------------- no race


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_then_at_once_donation_and_inplace_updates_do_not_reach_the_saved_step(
    tmp_path, async_save, slow_writes
):
    """Step k is saved, and at once the numpy array is changed in place, the random stream drawn
    from, the model updated in place (`update_inplace`) and stepped twice under tied.jit with the
    model and Adam state donated: the restored step k equals host copies taken before the save, bit
    for bit, ties held."""
    run = make(0)
    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(loss)(m))[::-1], donate_argnums=(0, 1))
    run["opt"], run["model"] = step(run["model"], run["opt"])
    want = host(run)
    with tied.CheckpointManager(tmp_path / "c", async_save=async_save) as mngr:
        assert mngr.save(1, run, {"k": 1})
        run["stats"][:] = -1.0
        run["rng"]()  # the stream's counter moves on
        model, opt = run["model"], run["opt"]
        saved_weight = model["embed"].weight
        opt = tied.optim.update_inplace(opt, model, tied.grad(loss)(model))  # written into run["model"]
        assert model["embed"].weight is not saved_weight and run["model"]["head"] is model["embed"]
        for _ in range(2):
            opt, model = step(model, opt)
        mngr.wait()
        back = mngr.restore(make(5))
    check_ties(back)
    got = tied.flatten(back)[0]
    assert len(got) == len(want)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert isinstance(back["stats"], np.ndarray) and isinstance(back["model"]["out"].bias, jax.Array)
    assert int(back["rng"].count.value) == 0
    # The run did move on: the restored values are step k's, not the live ones.
    assert not same_bits(model["embed"].weight, back["model"]["embed"].weight)


def test_each_saved_step_holds_its_own_values(tmp_path, slow_writes):
    """Three steps saved in the background one after the other (the staging buffers reused): each
    restores to its own values, onto an abstract like too."""
    run, wants = make(0), {}
    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(loss)(m)), donate_argnums=(0, 1))
    with tied.CheckpointManager(tmp_path / "c", max_to_keep=None) as mngr:
        for k in (1, 2, 3):
            run["model"], run["opt"] = step(run["model"], run["opt"])
            run["stats"] = run["stats"] + 1
            wants[k] = host(run)
            mngr.save(k, run, {"k": k})
        mngr.wait()
        assert mngr.all_steps() == [1, 2, 3]
        leaves, gdef = tied.flatten(make(1))
        abstract = tied.unflatten(
            gdef, [x if isinstance(x, np.ndarray) else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        )
        for k in (1, 2, 3):
            back = mngr.restore(abstract, k)
            check_ties(back)
            assert all(same_bits(a, b) for a, b in zip(tied.flatten(back)[0], wants[k])), k
            assert mngr.metadata(k) == {"k": k}
        assert mngr.metadata() == {"k": 3}
    # The latest step is also what tied.load reads from the directory, and one step by its path.
    assert all(same_bits(a, b) for a, b in zip(tied.flatten(tied.load(tmp_path / "c", make(2)))[0], wants[3]))
    assert all(
        same_bits(a, b) for a, b in zip(tied.flatten(tied.load(tmp_path / "c" / "2", make(2)))[0], wants[2])
    )


# ---------------------------------------------------------------- directory hygiene


def foreign(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    (path / "logs").mkdir()
    (path / "logs" / "events").write_text("1")
    (path / "999").mkdir()  # a directory named by digits, not a tied step


@pytest.mark.parametrize("interval, kept", [(5, [10, 20, 25]), (1, [10, 20, 24, 25])])
def test_max_to_keep_and_keep_every_leave_the_stated_steps_and_other_files(tmp_path, interval, kept):
    """max_to_keep=2, keep_every=10 over steps 1..25: the last 2 complete steps and every step divisible
    by 10; files and directories that are not tied steps stay, untouched."""
    path = tmp_path / "c"
    foreign(path)
    w = jnp.ones((2, 2))
    with tied.CheckpointManager(path, max_to_keep=2, keep_every=10, save_interval_steps=interval) as mngr:
        assert mngr.latest_step() is None and mngr.all_steps() == []
        saved = [s for s in range(1, 26) if mngr.save(s, {"a": w, "b": w})]
        assert saved == list(range(interval, 26, interval))
        mngr.wait()
        assert mngr.all_steps() == kept and mngr.latest_step() == 25
    assert steps_on_disk(path) == sorted([*map(str, kept), "999", "logs", "notes.txt"])
    assert (path / "notes.txt").read_text() == "keep me" and (path / "logs" / "events").read_text() == "1"


def test_old_steps_are_deleted_only_after_a_newer_one_is_complete(tmp_path, monkeypatch):
    """A save that fails after writing its arrays (as a crash would) is never listed and deletes
    nothing; a manager opened on the directory afterwards removes it, and its next save proceeds."""
    path = tmp_path / "c"
    w = jnp.ones(2)
    with tied.CheckpointManager(path, max_to_keep=1, async_save=False) as mngr:
        mngr.save(1, {"w": w})
        original = ocp.CompositeCheckpointHandler.save

        def save_then_fail(self, *args, **kwargs):
            original(self, *args, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(ocp.CompositeCheckpointHandler, "save", save_then_fail)
        with pytest.raises(KeyboardInterrupt):
            mngr.save(2, {"w": w + 1})
        monkeypatch.undo()
        assert mngr.all_steps() == [1]  # step 1 is still there: step 2 never completed
    entries = steps_on_disk(path)
    assert "1" in entries and any("tmp" in e for e in entries), entries
    with tied.CheckpointManager(path, max_to_keep=1) as mngr:
        assert mngr.latest_step() == 1
        assert float(mngr.restore({"w": w})["w"][0]) == 1.0
        mngr.save(3, {"w": w + 2})
        mngr.wait()
    assert steps_on_disk(path) == ["3"]


def test_a_directory_without_a_complete_step(tmp_path):
    path = tmp_path / "c"
    foreign(path)
    with tied.CheckpointManager(path) as mngr:
        assert mngr.latest_step() is None and mngr.all_steps() == []
        with pytest.raises(
            tied.CheckpointError,
            match=r"c holds no complete step to read \(latest_step\(\) "
            r"is None\)",
        ):
            mngr.restore(make(0))
        with pytest.raises(tied.CheckpointError, match=r"no complete step"):
            mngr.metadata()
        with pytest.raises(tied.CheckpointError, match=r"c/999 exists and is not a complete tied step"):
            mngr.save(999, {"w": jnp.ones(2)})
    assert steps_on_disk(path) == ["999", "logs", "notes.txt"] and os.listdir(path / "999") == []


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "step, match",
    [
        (-1, r"a step is not negative, got -1"),
        (True, r"a step is an int, got True \(bool\)"),
        (np.bool_(True), r"a step is an int, got .*bool"),
        (2.0, r"a step is an int, got 2\.0 \(float\)"),
        ("3", r"a step is an int, got '3' \(str\)"),
        (5, r"step 5 is not greater than the latest step saved to .*c, 5\. Steps only go up"),
        (4, r"step 4 is not greater than the latest step saved to .*c, 5"),
    ],
)
@pytest.mark.parametrize("force", [False, True])
def test_bad_steps_are_refused_and_nothing_is_written(tmp_path, step, match, force):
    path = tmp_path / "c"
    with tied.CheckpointManager(path, async_save=False) as mngr:
        mngr.save(5, {"w": jnp.ones(2)})
        before = steps_on_disk(path)
        with pytest.raises(tied.CheckpointError, match=match):
            mngr.save(step, {"w": jnp.zeros(2)}, force=force)
        assert steps_on_disk(path) == before == ["5"]
    assert steps_on_disk(path) == ["5"]


def test_numpy_integer_steps_and_force(tmp_path):
    with tied.CheckpointManager(tmp_path / "c", save_interval_steps=10) as mngr:
        assert mngr.save(np.int64(10), {"w": jnp.ones(2)}) is True
        assert mngr.save(11, {"w": jnp.ones(2)}) is False
        assert mngr.save(12, {"w": jnp.ones(2)}, force=True) is True
        mngr.wait()
        assert mngr.all_steps() == [10, 12]


def test_a_like_that_does_not_match_is_refused_naming_the_path(tmp_path):
    with tied.CheckpointManager(tmp_path / "c") as mngr:
        mngr.save(1, make(0))
        other = make(0)
        other["model"]["head"] = Embedding(6, 4, key=jax.random.key(3))  # the tie cut
        with pytest.raises(tied.CheckpointError, match=r"the sharing differs at \['model'\]\['embed'\]"):
            mngr.restore(other)
        bigger = make(0)
        bigger["stats"] = np.arange(4.0)
        with pytest.raises(tied.CheckpointError, match=r"the shape differs at \['stats'\]"):
            mngr.restore(bigger)
        with pytest.raises(
            tied.CheckpointError, match=r"step 7 is not a complete step of .*\(complete steps: 1\)"
        ):
            mngr.restore(make(0), 7)
        with pytest.raises(tied.CheckpointError, match=r"restore\(strict=False\)"):
            mngr.restore(make(0), strict=False)


def test_bad_arrays_and_metadata_are_refused_before_writing(tmp_path):
    path = tmp_path / "c"
    with tied.CheckpointManager(path) as mngr:
        with pytest.raises(tied.CheckpointError, match=r"\['w'\] is a ShapeDtypeStruct"):
            mngr.save(1, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
        with pytest.raises(tied.CheckpointError, match=r"must be JSON-serialisable"):
            mngr.save(1, {"w": jnp.ones(2)}, {"x": object()})
        mngr.wait()
        assert mngr.all_steps() == [] and steps_on_disk(path) == []
        assert mngr.save(1, {"w": jnp.ones(2)})  # step 1 was never taken


def test_bad_options_and_a_closed_manager(tmp_path):
    for kwargs, match in [
        ({"max_to_keep": 0}, r"max_to_keep=\.\.\.\) takes a positive int or None, got 0"),
        ({"keep_every": 2.5}, r"keep_every"),
        ({"save_interval_steps": None}, r"save_interval_steps=\.\.\.\) takes a positive int,"),
        ({"save_interval_steps": True}, r"save_interval_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            tied.CheckpointManager(tmp_path / "x", **kwargs)
    (tmp_path / "file").write_text("x")
    with pytest.raises(tied.CheckpointError, match=r"file is a file"):
        tied.CheckpointManager(tmp_path / "file")
    mngr = tied.CheckpointManager(tmp_path / "c")
    mngr.save(1, {"w": jnp.ones(2)})
    mngr.close()
    mngr.close()
    assert mngr.all_steps() == [1]
    with pytest.raises(tied.CheckpointError, match=r"the manager of .*c is closed"):
        mngr.save(2, {"w": jnp.ones(2)})
    with pytest.raises(tied.CheckpointError, match=r"the manager of .*c is closed"):
        mngr.restore({"w": jnp.ones(2)})
    with pytest.raises(tied.CheckpointError, match=r"c/1 is one saved step; open the directory"):
        tied.CheckpointManager(tmp_path / "c" / "1")


def test_a_random_stream_with_a_typed_key_is_one_stream_after_restore(tmp_path):
    """tied.Rng(0) (a typed key and a counter cell) at two places: restored as one stream whose key is
    jax.random.key(0) and whose counter is where the saved run left it."""
    rng = tied.Rng(0)
    rng(), rng()
    with tied.CheckpointManager(tmp_path / "c") as mngr:
        mngr.save(1, {"a": rng, "b": rng})
        rng()  # moves on after the save
        fresh = tied.Rng(9)
        back = mngr.restore({"a": fresh, "b": fresh})
    assert back["a"] is back["b"] and back["a"] is not fresh
    assert jax.dtypes.issubdtype(back["a"].key.dtype, jax.dtypes.prng_key)
    assert same_bits(jax.random.key_data(back["a"].key), jax.random.key_data(jax.random.key(0)))
    assert int(back["a"].count.value) == 2
    assert same_bits(
        jax.random.key_data(back["a"]()), jax.random.key_data(jax.random.fold_in(jax.random.key(0), 2))
    )
