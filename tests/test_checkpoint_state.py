"""Checkpoints of state, typed keys, deep models and odd places (issues 15 and 17).

References are independent of tied's reader: values are compared bit for bit with
the arrays that were saved (numpy), a run resumed from a checkpoint with the same run
uninterrupted (plain JAX by hand), and files are opened with the safetensors library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

import tied
from tied import _safetensors
from tied.nn import Chain, Dense


def _bits(x):
    """The bytes of an array (a typed key's key data), with its dtype: equal means bit for bit."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(x.dtype), np.asarray(jax.random.key_data(x)).tobytes())
    return (np.dtype(x.dtype).name, tuple(x.shape), np.asarray(x).tobytes())


def _header_doc(path):
    with safetensors.safe_open(path, framework="np") as f:
        return json.loads(f.metadata()["tied"])


# ---------------------------------------------------------------- issue 17.3: strict=False, every place


def test_keys_below_a_shared_node_with_two_values_are_refused_naming_both(tmp_path):
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    like = Chain(d, d)  # one layer at two places: .layers[1].weight is a place of it
    f = str(tmp_path / "hf.safetensors")
    w0, w1 = np.full((2, 2), 1.0, np.float32), np.full((2, 2), 2.0, np.float32)
    b = np.zeros(2, np.float32)
    save_file({".layers[0].weight": w0, ".layers[1].weight": w1, ".layers[0].bias": b}, f)
    for extra in (False, True):
        with pytest.raises(
            tied.CheckpointError,
            match=r"'\.layers\[0\]\.weight' and '\.layers\[1\]\.weight' hold "
            r"different values",
        ):
            tied.load(f, like, strict=False, allow_extra=extra)


def test_a_key_below_a_shared_node_fills_the_parameter(tmp_path):
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    like = Chain(d, d)
    f = str(tmp_path / "hf.safetensors")
    w = np.arange(4, dtype=np.float32).reshape(2, 2)
    b = np.array([5.0, 6.0], np.float32)
    save_file({".layers[1].weight": w, ".layers[0].bias": b, ".layers[1].bias": b}, f)
    back = tied.load(f, like, strict=False)  # no "keys that name no place": both are places
    assert back.layers[0] is back.layers[1]
    assert _bits(back.layers[0].weight) == _bits(w) and _bits(back.layers[1].bias) == _bits(b)


# ---------------------------------------------------------------- issue 17.4: a deep model


def _deep(n, offset=0.0):
    cell = {"w": np.full((1,), offset, np.float32)}
    for i in range(1, n):
        cell = {"w": np.full((1,), i + offset, np.float32), "next": cell}
    return cell


def test_a_deep_chain_saves_and_loads(tmp_path):
    n = 3500
    f = str(tmp_path / "deep.safetensors")
    model = _deep(n)
    tied.save(f, model)
    back = tied.load(f, like=_deep(n, offset=0.5))
    with open(f, "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
    assert header < 4_000_000, header  # linear in the places (names elided), not quadratic (~150 MB)
    a, b = model, back
    for _ in range(n - 1):
        assert _bits(a["w"]) == _bits(b["w"])
        a, b = a["next"], b["next"]
    assert _bits(a["w"]) == _bits(b["w"]) and "next" not in b
    # The safetensors library reads the file too.
    with safetensors.safe_open(f, framework="np") as sf:
        assert len(list(sf.keys())) == n


def test_a_tampered_place_table_is_refused(tmp_path):
    f = str(tmp_path / "deep.safetensors")
    tied.save(f, _deep(3500))
    doc = _header_doc(f)
    assert "place_table" in doc and "places" not in doc["arrays"][0]
    doc["place_table"][5][0] = 7  # a parent after its child
    with pytest.raises(tied.CheckpointError, match=r"place 5 names parent 7"):
        tied._manifest.validate(doc, f)


def test_a_place_table_that_unfolds_into_too_much_is_refused_before_it_is_unfolded():
    """5,000 places of 100 characters, each below the last: 1.25e9 characters of paths."""
    table = [[-1, ""]] + [[t, "x" * 100] for t in range(5000)]
    doc = {"format": "tied", "version": 3, "place_table": table, "arrays": [], "shared_at": [], "views": []}
    # Counted in bytes, not timed: refused before a single path is built (unfolded, 1.25 GB).
    tracemalloc.start()
    try:
        with pytest.raises(tied.CheckpointError, match=r"its places unfold into 1,250,250,000 characters"):
            tied._manifest.validate(doc, "hostile")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak


# ---------------------------------------------------------------- issue 17.11: keys that print alike


def test_two_nan_keys_are_refused_at_save_naming_the_path(tmp_path):
    f = str(tmp_path / "nan.safetensors")
    model = {float("nan"): np.ones(2, np.float32), float("nan"): np.zeros(2, np.float32)}
    assert len(model) == 2
    with pytest.raises(tied.CheckpointError, match=r"\[nan\]: two places .* written alike .* float\('nan'\)"):
        tied.save(f, model)
    assert not os.path.exists(f)


# ---------------------------------------------------------------- issue 17.12: an indivisible sharding

_SHARDING_SCRIPT = """
import os, sys, tempfile
import jax, numpy as np, tied
from jax.sharding import NamedSharding, PartitionSpec as P
assert jax.device_count() == 2
mesh = jax.make_mesh((2,), ("x",))
f = os.path.join(tempfile.mkdtemp(), "m.safetensors")
tied.save(f, {"a": np.ones(3, np.float32)})
like = {"a": jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(mesh, P("x")))}
try:
    tied.load(f, like)
except tied.CheckpointError as e:
    print("ERROR", e)
"""


def test_an_indivisible_sharding_is_a_checkpoint_error_naming_the_path():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [x for x in env.get("XLA_FLAGS", "").split() if "device_count" not in x]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=2"])
    out = subprocess.run(
        [sys.executable, "-c", _SHARDING_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR" in out.stdout and "['a']" in out.stdout and "cannot split evenly" in out.stdout, out.stdout


# ---------------------------------------------------------------- issue 15.10: typed keys


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_round_trip_bit_for_bit(tmp_path, impl):
    key = jax.random.key(7, impl=impl)
    keys = jax.random.split(key, 3)
    model = {"k": key, "ks": keys, "cell": tied.State(jax.random.key(9, impl=impl)), "w": jnp.ones(2)}
    f = str(tmp_path / "keys.safetensors")
    tied.save(f, model)
    doc = _header_doc(f)
    entries = {a["places"][0]: a for a in doc["arrays"]}
    assert entries["['k']"]["key"] == impl and entries["['k']"]["dtype"] == "uint32"
    assert entries["['cell'].value"]["state"] is True and "state" not in entries["['w']"]
    like = {
        "k": jax.random.key(0, impl=impl),
        "ks": jax.random.split(jax.random.key(1, impl=impl), 3),
        "cell": tied.State(jax.random.key(2, impl=impl)),
        "w": jnp.zeros(2),
    }
    back = tied.load(f, like)
    for got, want in [(back["k"], key), (back["ks"], keys), (back["cell"].value, model["cell"].value)]:
        assert got.dtype == want.dtype and _bits(got) == _bits(want)
    # Abstract like works as well.
    abstract = tied.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
    again = tied.load(f, abstract)
    assert _bits(again["ks"]) == _bits(keys)


def test_a_key_loaded_into_a_plain_array_place_is_refused_naming_the_path(tmp_path):
    f = str(tmp_path / "keys.safetensors")
    tied.save(f, {"k": jax.random.key(0)})
    with pytest.raises(
        tied.CheckpointError, match=r"kind of array differs at \['k'\]: the file has a typed key"
    ):
        tied.load(f, {"k": np.zeros(2, np.uint32)})


# ---------------------------------------------------------------- issue 15.11: state, resumed bit for bit


class Model:
    def __init__(self, seed):
        k = jax.random.key(seed)
        self.w = jax.random.normal(k, (3,))
        self.steps = tied.State(jnp.zeros((), jnp.int32))
        self.rng = tied.Rng(seed)
        self.avg = tied.State(jnp.zeros(3))


tied.register(Model)


def _step(m):
    """One step by hand: a noisy update of w, a running average (state), a counter, a draw."""
    noise = jax.random.normal(m.rng(), (3,))
    m.w = m.w - 0.1 * (m.w + noise)
    m.avg.value = 0.9 * m.avg.value + 0.1 * m.w
    m.steps.value = m.steps.value + 1


def test_a_save_after_step_3_resumes_bit_identically(tmp_path):
    straight = Model(0)
    for _ in range(6):
        _step(straight)
    first = Model(0)
    for _ in range(3):
        _step(first)
    f = str(tmp_path / "ckpt.safetensors")
    tied.save(f, first)
    doc = _header_doc(f)
    state_places = sorted(p for a in doc["arrays"] if a.get("state") for p in a["places"])
    assert state_places == [".avg.value", ".rng.count.value", ".steps.value"]
    resumed = tied.load(f, like=Model(1))
    assert int(resumed.rng.count.value) == 3 and int(resumed.steps.value) == 3
    draws_resumed = [resumed.rng() for _ in range(2)]
    draws_straight = [jax.random.fold_in(jax.random.key(0), i) for i in (3, 4)]
    assert [_bits(k) for k in draws_resumed] == [_bits(k) for k in draws_straight]
    resumed.rng.count.value = resumed.rng.count.value - 2  # give the two draws back
    for _ in range(3):
        _step(resumed)
    for name in ("w",):
        assert _bits(getattr(resumed, name)) == _bits(getattr(straight, name))
    for get in (
        lambda m: m.avg.value,
        lambda m: m.steps.value,
        lambda m: m.rng.count.value,
        lambda m: m.rng.key,
    ):
        assert _bits(get(resumed)) == _bits(get(straight))


def test_a_shared_state_is_stored_once_and_loads_as_one_object(tmp_path):
    s = tied.State(jnp.arange(3.0))
    model = {"a": {"stat": s}, "b": {"stat": s}, "w": jnp.ones(3)}
    f = str(tmp_path / "shared.safetensors")
    tied.save(f, model)
    with safetensors.safe_open(f, framework="np") as sf:
        assert len(list(sf.keys())) == 2
    t = tied.State(jnp.zeros(3))
    back = tied.load(f, like={"a": {"stat": t}, "b": {"stat": t}, "w": jnp.zeros(3)})
    assert back["a"]["stat"] is back["b"]["stat"] and back["a"]["stat"] is not t
    assert _bits(back["b"]["stat"].value) == _bits(s.value)


def test_state_in_the_file_but_a_parameter_in_like_is_refused(tmp_path):
    f = str(tmp_path / "s.safetensors")
    tied.save(f, {"x": tied.State(jnp.zeros(2))})

    @tied.register
    class Plain:
        def __init__(self, value):
            self.value = value

    with pytest.raises(
        tied.CheckpointError, match=r"\['x'\]\.value is state in the file but a parameter in like"
    ):
        tied.load(f, {"x": Plain(jnp.zeros(2))})


def test_a_file_written_before_state_was_marked_still_loads(tmp_path):
    """Version 2 documents have no state marks and inline places; they load unchanged."""
    f = str(tmp_path / "v2.safetensors")
    model = {"x": tied.State(jnp.arange(2.0)), "w": jnp.ones(2)}
    leaves, doc = tied._manifest.describe(model)
    doc = tied._manifest.pack(doc)
    doc["version"] = 2
    for a in doc["arrays"]:
        a.pop("state", None)
    _safetensors.write(f, leaves, doc)
    back = tied.load(f, like={"x": tied.State(jnp.zeros(2)), "w": jnp.zeros(2)})
    assert _bits(back["x"].value) == _bits(model["x"].value)
