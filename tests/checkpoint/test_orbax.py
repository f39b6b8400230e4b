"""Orbax checkpoint directories: ties kept, the previous checkpoint kept through a failed save, bad
input refused.

This process has one device. Sharded arrays (8 fake CPU devices: restore onto
other shardings, a sharding that does not fit) are tested by
tests/multidevice/orbax_devices.py in a process of its own (`test_eight_fake_devices`),
and several processes by tests/test_multiprocess.py.

References are independent of tied's reader: the arrays saved, compared bit for bit;
Orbax's own reader (``StandardCheckpointer``, which knows nothing of ties) on the
arrays item; the JSON manifest read as a file; an optax step taken by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import DTYPE_CASES, models, places, same_bits, sharing_groups
from hypothesis import given
from processes import FAST_COMPILE, pytest_on_fake_devices

import tied
from tied.nn import Chain, Dense, Embedding

ROOT = Path(__file__).resolve().parents[2]


@tied.register
class Box:
    def __init__(self, content, tag="box"):
        self.content = content
        self.tag = tag


@dataclasses.dataclass
class DC:
    x: object
    y: object


def every_kind(seed: int):
    """Array ties, a shared node, a view, a cycle, numpy, ints, bfloat16, a scalar, an empty array."""
    r = np.random.default_rng(seed)
    w = jnp.asarray(r.normal(size=(3, 2)), jnp.float32)
    e = jnp.asarray(r.normal(size=(4, 3)), jnp.bfloat16)
    shared = Box([w, jnp.asarray(r.normal(size=(2,)), jnp.float32)])
    loop = {"w": w}
    loop["self"] = loop
    return {
        "dense": Dense(w, None),
        "dc": DC(shared, [e, tied.transpose(w)]),
        "other": Box(shared, tag="other"),
        "emb": Embedding(e),
        "np64": np.asarray(r.normal(size=(2, 2)), np.float64),
        "count": jnp.asarray(r.integers(0, 9, size=(2,)), jnp.int32),
        "scalar": jnp.float32(r.normal()),
        "empty": jnp.zeros((0, 3)),
        "loop": loop,
    }


def check_every_kind(m, ref):
    w = m["dense"].weight
    assert same_bits(w, ref["dense"].weight)
    assert m["dc"].y[1].source is w and m["loop"]["w"] is w and m["dc"].x.content[0] is w
    assert m["dc"].y[1].fn is ref["dc"].y[1].fn
    assert m["dc"].x is m["other"].content and m["other"].tag == "other"
    assert m["dc"].y[0] is m["emb"].weight and same_bits(m["emb"].weight, ref["emb"].weight)
    assert same_bits(m["dc"].x.content[1], ref["dc"].x.content[1])
    assert isinstance(m["np64"], np.ndarray) and same_bits(m["np64"], ref["np64"])
    assert same_bits(m["count"], ref["count"]) and same_bits(m["scalar"], ref["scalar"])
    assert m["empty"].shape == (0, 3) and m["empty"].dtype == jnp.float32
    assert m["loop"]["self"] is m["loop"]


def step_dirs(path) -> list[str]:
    return sorted(os.listdir(path))


# ---------------------------------------------------------------- round trips


def test_round_trip_keeps_every_tie(tmp_path):
    src = every_kind(0)
    tied.save(tmp_path / "ckpt", src, {"step": 7}, format="orbax")
    assert step_dirs(tmp_path / "ckpt") == ["0"]
    back = tied.load(tmp_path / "ckpt", like=every_kind(1))
    check_every_kind(back, src)
    assert tied.ties(back) == tied.ties(src)
    assert tied.load_metadata(tmp_path / "ckpt") == {"step": 7}
    # One saved checkpoint inside the directory loads too.
    check_every_kind(tied.load(tmp_path / "ckpt" / "0", like=every_kind(2)), src)


def test_each_unique_array_is_stored_once_under_its_first_path(tmp_path):
    """Orbax's own reader, which knows nothing of ties, finds each unique array once; the manifest is JSON."""
    src = every_kind(0)
    tied.save(tmp_path / "ckpt", src, format="orbax")
    with ocp.StandardCheckpointer() as c:
        stored = c.restore(tmp_path / "ckpt" / "0" / "arrays")
    leaves, gdef = tied.flatten(src)
    first = {ps[0]: x for x, ps in zip(leaves, gdef.leaf_paths()) if x.size}  # the empty array: shape only
    assert sorted(stored) == sorted(first)
    assert all(same_bits(stored[k], first[k]) for k in first)
    doc = json.loads((tmp_path / "ckpt" / "0" / "tied" / "metadata").read_text())
    assert [a["places"] for a in doc["arrays"]] == [list(ps) for ps in gdef.leaf_paths()]
    assert doc["views"] == [{"places": ["['dc'].y[1]"], "fn": "transpose", "source": "['dc'].x.content[0]"}]


@pytest.mark.parametrize("dt, kind", DTYPE_CASES, ids=str)
def test_dtypes_round_trip_bit_for_bit(tmp_path, dt, kind):
    raw = np.random.default_rng(0).integers(0, 256, size=(3, 4 * dt.itemsize), dtype=np.uint8)
    x = raw[:, :4] % 2 == 1 if dt.kind == "b" else raw.view(dt)  # NaN payloads, -0.0, inf included
    scalar = x.reshape(-1)[:1].reshape(())
    tree = {"x": x, "again": x, "scalar": scalar}
    if kind == "jax":
        tree = {"x": jnp.asarray(x), "scalar": jnp.asarray(scalar)}
        tree["again"] = tree["x"]
    tied.save(tmp_path / "d", tree, format="orbax")
    back = tied.load(tmp_path / "d", tree)
    assert back["again"] is back["x"]
    assert same_bits(back["x"], x) and same_bits(back["scalar"], scalar)
    assert isinstance(back["x"], np.ndarray if kind == "numpy" else jax.Array)


def test_big_endian_numpy_arrays_keep_their_values(tmp_path):
    x = np.arange(6).astype(">f4").reshape(2, 3) * 3 - 1
    tied.save(tmp_path / "be", {"x": x, "again": x}, format="orbax")
    back = tied.load(tmp_path / "be", {"x": x, "again": x})
    assert back["x"] is back["again"]
    np.testing.assert_array_equal(back["x"], x)


@given(models())
def test_random_models_round_trip(tmp_path_factory, model):
    """Random containers and random sharing of arrays and nodes (tests/helpers.py); the reference is
    the independent walker of helpers.py: the same places, the same identity classes, the same bits."""
    path = tmp_path_factory.mktemp("h") / "ckpt"
    tied.save(path, model, format="orbax")
    leaves, gdef = tied.flatten(model)
    like = tied.unflatten(gdef, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    back = tied.load(path, like)

    def is_arr(x):
        return isinstance(x, (jax.Array, np.ndarray))

    assert sharing_groups(back, is_arr) == sharing_groups(model, is_arr)
    got, want = list(places(back)), list(places(model))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, a), (_, b) in zip(got, want):
        if is_arr(b):
            assert same_bits(a, b), p
            assert isinstance(a, jax.Array)  # a ShapeDtypeStruct without a sharding: a JAX array
        elif not hasattr(b, "__dict__") and not isinstance(b, (list, dict, tuple)):
            assert a is b or a == b, p


def test_abstract_like_without_sharding_gives_uncommitted_arrays_as_the_single_file_does(tmp_path):
    d = Dense(jnp.arange(4.0).reshape(2, 2), jnp.ones(2))
    m = Chain(d, Dense(d.weight, d.bias))
    tied.save(tmp_path / "o", m, format="orbax")
    tied.save(tmp_path / "f.safetensors", m)
    _, gdef = tied.flatten(m)
    dev = jax.devices()[0]
    like = tied.unflatten(
        gdef,
        [
            jax.ShapeDtypeStruct((2, 2), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev)),
            jax.ShapeDtypeStruct((2,), jnp.float32),
        ],
    )
    for back in (tied.load(tmp_path / "o", like), tied.load(tmp_path / "f.safetensors", like)):
        assert back.layers[0].weight is back.layers[1].weight
        w = back.layers[0].weight
        assert w.committed and w.sharding == like.layers[0].weight.sharding
        assert not back.layers[0].bias.committed
        assert same_bits(back.layers[1].bias, d.bias)


@tied.register
class Odd:
    """An attribute whose name holds a dot, beside a layer whose weight has the same keystr."""

    def __init__(self, w, v):
        setattr(self, "encoder.weight", w)
        self.encoder = Dense(v, None)


def test_two_places_written_alike_are_two_arrays(tmp_path):
    w, v = jnp.arange(4.0).reshape(2, 2), -jnp.arange(4.0).reshape(2, 2)
    tied.save(tmp_path / "odd", Odd(w, v), format="orbax")
    back = tied.load(tmp_path / "odd", Odd(jnp.zeros((2, 2)), jnp.zeros((2, 2))))
    assert same_bits(getattr(back, "encoder.weight"), w) and same_bits(back.encoder.weight, v)
    with ocp.StandardCheckpointer() as c:
        assert len(c.restore(tmp_path / "odd" / "0" / "arrays")) == 2  # two names for two arrays


def test_the_checkpoint_holds_the_values_at_save_time(tmp_path):
    """A numpy array changed in place after the save (or between two saves) does not reach the file."""
    x = np.arange(4.0)
    tied.save(tmp_path / "c", {"x": x, "y": x}, format="orbax")
    x[0] = 99.0
    back = tied.load(tmp_path / "c", {"x": x, "y": x})
    assert back["x"] is back["y"] and back["x"][0] == 0.0
    back["x"][1] = -1.0  # the loaded array is the caller's own
    assert tied.load(tmp_path / "c", {"x": x, "y": x})["x"][1] == 1.0


# ---------------------------------------------------------------- training state


def test_optimiser_state_round_trip_and_training_resumes_bit_for_bit(tmp_path):
    """Adam state saved beside the model and restored into a fresh (model, state): the steps after the
    restore equal those of the uninterrupted run, and all of it equals optax stepped by hand on the
    unique parameters (the tied embedding's gradient being the sum over both its uses)."""
    x = jnp.arange(3)

    def make(seed):
        emb = Embedding(6, 4, key=jax.random.key(seed))
        return {"embed": emb, "head": emb, "out": Dense(4, 4, key=jax.random.key(seed + 1))}

    def loss(m):
        h = m["embed"](x)
        return jnp.sum(jnp.tanh(m["out"](h)) * m["head"].attend(h)[:, :4])

    tx = optax.adam(1e-2)
    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(loss)(m)))
    model = make(0)
    p = {"e": model["embed"].weight, "w": model["out"].weight, "b": model["out"].bias}
    state = tied.optim.setup(tx, model)
    model, state = step(model, state)
    tied.save(tmp_path / "ckpt", (model, state), format="orbax")
    fresh = make(5)
    m2, s2 = tied.load(tmp_path / "ckpt", (fresh, tied.optim.setup(tx, fresh)))
    assert m2["embed"] is m2["head"]
    for _ in range(2):
        model, state = step(model, state)
        m2, s2 = step(m2, s2)
        assert m2["embed"].weight is m2["head"].weight
    for a, b in zip(tied.flatten((model, state))[0], tied.flatten((m2, s2))[0]):
        assert same_bits(a, b)

    def plain(p):  # no ties: the embedding is one entry, read twice
        h = p["e"][x]
        return jnp.sum(jnp.tanh(h @ p["w"].T + p["b"]) * (h @ p["e"].T)[:, :4])

    @jax.jit
    def by_hand(p, opt):
        updates, opt = tx.update(jax.grad(plain)(p), opt, p)
        return optax.apply_updates(p, updates), opt

    opt = tx.init(p)
    for _ in range(3):
        p, opt = by_hand(p, opt)
    for got, want in [(m2["head"].weight, p["e"]), (m2["out"].weight, p["w"]), (m2["out"].bias, p["b"])]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- atomic saves


def fail_after_writing(monkeypatch, exc=KeyboardInterrupt):
    """Make the next save write every shard, then fail before Orbax finalises it (as a crash would)."""
    original = ocp.CompositeCheckpointHandler.save

    def save_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise exc()

    monkeypatch.setattr(ocp.CompositeCheckpointHandler, "save", save_then_fail)


def tied_pair(v):
    w = jnp.full((4, 2), float(v))
    return {"embed": w, "head": w}


def test_a_save_interrupted_before_it_is_final_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    tied.save(path, tied_pair(1), {"step": 1}, format="orbax")
    tied.save(path, tied_pair(2), {"step": 2}, format="orbax")
    assert step_dirs(path) == ["1"]  # the previous checkpoint is removed once the new one is final
    fail_after_writing(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        tied.save(path, tied_pair(3), {"step": 3}, format="orbax")
    monkeypatch.undo()
    unfinished = [e for e in step_dirs(path) if e != "1"]
    assert len(unfinished) == 1 and ocp.step.is_path_temporary(path / unfinished[0])
    items = {e.split(".")[0]: path / unfinished[0] / e for e in os.listdir(path / unfinished[0])}
    assert os.listdir(items["arrays"])  # the shards were written (into Orbax's temporary item directory)
    back = tied.load(path, tied_pair(0))
    assert back["embed"] is back["head"] and float(back["embed"][0, 0]) == 2.0
    assert tied.load_metadata(path) == {"step": 2}
    with pytest.raises(
        tied.CheckpointError,
        match=r"ckpt/2\.orbax-checkpoint-tmp.*: an unfinished save "
        r".*interrupted before Orbax finalised it.*Load the checkpoint directory",
    ):
        tied.load(path / unfinished[0], tied_pair(0))
    # The next save removes the unfinished one and replaces the checkpoint.
    tied.save(path, tied_pair(4), {"step": 4}, format="orbax")
    assert step_dirs(path) == ["2"] and tied.load_metadata(path) == {"step": 4}
    assert float(tied.load(path, tied_pair(0))["head"][0, 0]) == 4.0


def test_a_first_save_interrupted_leaves_nothing_loadable_and_says_so(tmp_path, monkeypatch):
    fail_after_writing(monkeypatch, OSError)
    with pytest.raises(OSError):
        tied.save(tmp_path / "ckpt", tied_pair(1), format="orbax")
    monkeypatch.undo()
    with pytest.raises(tied.CheckpointError, match=r"no finalised checkpoint, only an unfinished save \(0\."):
        tied.load(tmp_path / "ckpt", tied_pair(0))
    with pytest.raises(tied.CheckpointError, match=r"no finalised checkpoint"):
        tied.load_metadata(tmp_path / "ckpt")


def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path):
    """A real crash: a process SIGKILLed between writing its shards and finalising."""
    path = tmp_path / "ckpt"
    tied.save(path, tied_pair(1), {"step": 1}, format="orbax")
    script = (
        "import os, signal, jax.numpy as jnp, orbax.checkpoint as ocp, tied\n"
        "orig = ocp.CompositeCheckpointHandler.save\n"
        "def die(self, *a, **k):\n"
        "    orig(self, *a, **k); os.kill(os.getpid(), signal.SIGKILL)\n"
        "ocp.CompositeCheckpointHandler.save = die\n"
        "w = jnp.full((4, 2), 9.0)\n"
        f"tied.save({str(path)!r}, {{'embed': w, 'head': w}}, {{'step': 9}}, format='orbax')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    assert len(step_dirs(path)) == 2
    assert tied.load_metadata(path) == {"step": 1}
    assert float(tied.load(path, tied_pair(0))["embed"][0, 0]) == 1.0


# ---------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize("damage", ["shards", "manifest_json", "manifest_missing", "manifest_format"])
def test_damaged_checkpoints_are_refused_clearly(tmp_path, damage):
    path = tmp_path / "ckpt"
    tied.save(path, tied_pair(1), format="orbax")
    saved = path / "0"
    if damage == "shards":
        for root, _, files in os.walk(saved / "arrays"):
            for f in files:
                if "ocdbt" in root or root.endswith("/d"):
                    os.remove(os.path.join(root, f))
        match = r"Orbax could not read the arrays .* missing or damaged; nothing was loaded"
    elif damage == "manifest_json":
        (saved / "tied" / "metadata").write_text("{not json")
        match = r"not a readable tied checkpoint: its manifest .* cannot be read"
    elif damage == "manifest_missing":
        (saved / "tied" / "metadata").unlink()
        match = r"not a readable tied checkpoint: its manifest .* cannot be read"
    else:
        doc = json.loads((saved / "tied" / "metadata").read_text())
        doc["arrays"][0]["shape"] = "big"
        (saved / "tied" / "metadata").write_text(json.dumps(doc))
        match = r"the 'tied' metadata is malformed: array .* invalid shape"
    with pytest.raises(tied.CheckpointError, match=match):
        tied.load(path, tied_pair(0))


@pytest.mark.parametrize(
    "field, value, like_shape, like_dtype",
    [
        ("shape", [2, 2], (2, 2), jnp.float32),  # Orbax would truncate (4, 2) to (2, 2)
        ("dtype", "int32", (4, 2), jnp.int32),  # Orbax would cast float32 to int32
        ("name", "['other']", (4, 2), jnp.float32),
    ],
)
def test_a_manifest_that_disagrees_with_the_stored_arrays_is_refused(
    tmp_path, field, value, like_shape, like_dtype
):
    """Orbax restores onto whatever shape and dtype it is asked for; the manifest, which says what to
    ask for, is checked against Orbax's own metadata of the stored arrays first."""
    w = jnp.arange(8.0).reshape(4, 2)
    tied.save(tmp_path / "ckpt", {"a": w, "b": w}, format="orbax")
    f = tmp_path / "ckpt" / "0" / "tied" / "metadata"
    doc = json.loads(f.read_text())
    doc["arrays"][0][field] = value
    f.write_text(json.dumps(doc))
    s = jnp.zeros(like_shape, like_dtype)
    with pytest.raises(tied.CheckpointError, match=r"not a readable tied checkpoint: the manifest"):
        tied.load(tmp_path / "ckpt", {"a": s, "b": s})


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(tied.CheckpointError, match=r"empty: not a tied checkpoint"):
        tied.load(tmp_path / "empty", tied_pair(0))


# ---------------------------------------------------------------- the same checks as the single file


def test_like_that_differs_is_refused_naming_the_path(tmp_path):
    d = Dense(jnp.ones((2, 3)), jnp.zeros(2))
    model = Chain(d, Dense(d.weight, d.bias))
    tied.save(tmp_path / "ckpt", model, format="orbax")
    b = Dense(jnp.ones((3, 3)), jnp.zeros(3))
    bigger = Chain(b, Dense(b.weight, b.bias))
    with pytest.raises(tied.CheckpointError, match=r"the shape differs at \.layers\[0\]\.weight"):
        tied.load(tmp_path / "ckpt", bigger)
    e = Dense(jnp.ones((2, 3)), jnp.zeros(2))
    cut = Chain(e, Dense(jnp.ones((2, 3)), e.bias))
    with pytest.raises(tied.CheckpointError, match=r"the sharing differs at \.layers\[0\]\.weight"):
        tied.load(tmp_path / "ckpt", cut)
    with pytest.raises(tied.CheckpointError, match=r"places in like but not in the file: \.layers\[2\]"):
        tied.load(tmp_path / "ckpt", Chain(d, Dense(d.weight, d.bias), Dense(d.weight, d.bias)))
    with pytest.raises(tied.CheckpointError, match=r"strict=False reads single safetensors files"):
        tied.load(tmp_path / "ckpt", model, strict=False)


# ---------------------------------------------------------------- bad input leaves nothing behind


def test_saving_over_something_else_is_refused_and_leaves_it(tmp_path):
    other = tmp_path / "data"
    (other / "1").mkdir(parents=True)
    (other / "2").mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(
        tied.CheckpointError,
        match=r"data is a directory that holds other things \(1, 2, "
        r"notes.txt\), not a tied Orbax checkpoint",
    ):
        tied.save(other, tied_pair(1), format="orbax")
    assert step_dirs(other) == ["1", "2", "notes.txt"] and (other / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(tied.CheckpointError, match=r"file is a file; an Orbax checkpoint is a directory"):
        tied.save(tmp_path / "file", tied_pair(1), format="orbax")
    tied.save(tmp_path / "ckpt", tied_pair(1), format="orbax")
    with pytest.raises(tied.CheckpointError, match=r"ckpt/0 is one saved checkpoint .* save to that dir"):
        tied.save(tmp_path / "ckpt" / "0", tied_pair(2), format="orbax")
    assert step_dirs(tmp_path / "ckpt") == ["0"]


def test_arrays_that_cannot_be_saved_are_refused_before_writing(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(tied.CheckpointError, match=r"\['q'\] has dtype uint4, which Orbax's storage"):
        tied.save(path, {"w": jnp.ones(2), "q": jnp.ones(2, jnp.uint4)}, format="orbax")
    with pytest.raises(tied.CheckpointError, match=r"\['w'\] is a ShapeDtypeStruct; the Orbax format saves"):
        tied.save(path, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, format="orbax")
    with pytest.raises(tied.CheckpointError, match=r"must be JSON-serialisable"):
        tied.save(path, tied_pair(1), {"w": object()}, format="orbax")

    @jax.jit
    def inside(w):
        tied.save(path, {"w": w}, format="orbax")
        return w

    with pytest.raises(tied.CheckpointError, match=r"\['w'\] is a tracer: save outside jit"):
        inside(jnp.ones(2))
    w = jnp.ones(3)
    jax.jit(lambda w: w + 1, donate_argnums=0)(w)
    if w.is_deleted():  # CPU may ignore donation
        with pytest.raises(tied.CheckpointError, match=r"\['w'\] has been deleted"):
            tied.save(path, {"w": w}, format="orbax")
    assert not path.exists()


def test_threads_saving_and_loading_at_once(tmp_path):
    """Saves and loads from several threads (Orbax's barriers are per process: one at a time)."""
    errors: list = []

    def work(i):
        try:
            for k in range(3):
                p = tmp_path / f"c{i}"
                tied.save(p, tied_pair(10 * i + k), {"k": k}, format="orbax")
                back = tied.load(p, tied_pair(0))
                assert back["embed"] is back["head"] and float(back["embed"][0, 0]) == 10 * i + k
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [tied.load_metadata(tmp_path / f"c{i}") for i in range(3)] == [{"k": 2}] * 3


# ---------------------------------------------------------------- several devices


def test_eight_fake_devices():
    """tests/multidevice/orbax_devices.py under 8 fake CPU devices, in its own process."""
    # Compiling, not running, is most of these few training steps: FAST_COMPILE.
    code, report = pytest_on_fake_devices("tests/multidevice/orbax_devices.py", FAST_COMPILE)
    assert code == 0, report
    assert "4 passed" in report, report
