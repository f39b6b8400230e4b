"""Checkpoints: save/load keep every tie, refuse mismatches and hostile files, resume training bit for bit.

References are independent of tied's reader: values are compared byte for byte
with the arrays that were saved, and the files are opened with the safetensors
library's own (Rust) parser.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import tracemalloc
import zlib
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors
import safetensors.numpy
from helpers import DTYPE_CASES, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import cpu_env
from safetensors.numpy import save_file

import tied
from tied._checkpoint import safetensors_format as _safetensors
from tied.nn import Chain, Dense, Embedding


class NT(NamedTuple):
    a: object
    b: object


@dataclasses.dataclass
class DC:
    x: object
    y: object
    name: str = "dc"


@dataclasses.dataclass(frozen=True)
class FrozenDC:
    x: object
    scale: float = 2.0


@tied.register
class Box:
    def __init__(self, content, tag="box"):
        self.content = content
        self.tag = tag


class EqxPair(eqx.Module):
    left: object
    right: object


def seed_model(key=0):
    d1 = Dense(jax.random.normal(jax.random.key(key), (2, 2)), jnp.zeros(2))
    return Chain(d1, Dense(d1.weight, d1.bias))


def every_kind(seed: int):
    """Every container kind, and every sharing kind: arrays, nodes, a view, a cycle."""
    r = np.random.default_rng(seed)
    w = jnp.asarray(r.normal(size=(3, 2)), jnp.float32)
    e = jnp.asarray(r.normal(size=(4, 3)), jnp.bfloat16)
    c = jnp.asarray(r.integers(0, 9, size=(2,)), jnp.int32)
    shared = Box([w, jnp.asarray(r.normal(size=(2,)), jnp.float32)])  # a shared node
    loop = {"w": w}
    loop["self"] = loop  # a reference cycle through a dict
    return {
        "dense": Dense(w, None),
        "nt": NT(w, (e, c)),
        "dc": DC(shared, [e, tied.transpose(w)]),
        "frozen": FrozenDC(np.asarray(r.normal(size=(2, 2)), np.float64)),
        "eqx": EqxPair(shared, Embedding(e)),
        "loop": loop,
        "count": c,
    }


def check_every_kind(m, ref):
    assert same_bits(m["dense"].weight, ref["dense"].weight)
    w = m["dense"].weight
    assert m["nt"].a is w and m["dc"].y[1].source is w and m["loop"]["w"] is w
    assert m["dc"].y[1].fn is ref["dc"].y[1].fn  # the view's function comes from `like`
    assert m["dc"].x is m["eqx"].left and m["dc"].x.content[0] is w
    assert same_bits(m["dc"].x.content[1], ref["dc"].x.content[1])
    assert m["nt"].b[0] is m["dc"].y[0] is m["eqx"].right.weight
    assert same_bits(m["nt"].b[0], ref["nt"].b[0]) and m["nt"].b[0].dtype == jnp.bfloat16
    assert m["nt"].b[1] is m["count"] and same_bits(m["count"], ref["count"])
    assert isinstance(m["frozen"].x, np.ndarray) and same_bits(m["frozen"].x, ref["frozen"].x)
    assert m["frozen"].scale == 2.0 and m["dc"].name == "dc" and m["dc"].x.tag == "box"
    assert m["loop"]["self"] is m["loop"]
    assert type(m["eqx"]) is EqxPair and type(m["nt"]) is NT and type(m["frozen"]) is FrozenDC


# ---------------------------------------------------------------- round trips


def test_seed_model_round_trip(tmp_path):
    m = seed_model()
    f = tmp_path / "seed.safetensors"
    tied.save(f, m)
    back = tied.load(f, like=seed_model(key=1))
    assert back.layers[0].weight is back.layers[1].weight
    assert back.layers[0].bias is back.layers[1].bias
    assert same_bits(back.layers[0].weight, m.layers[0].weight)
    assert same_bits(back.layers[0].bias, m.layers[0].bias)
    assert isinstance(back.layers[0].weight, jax.Array)
    # The plain safetensors reader sees each unique array once, under its first path.
    plain = safetensors.numpy.load_file(f)
    assert sorted(plain) == [".layers[0].bias", ".layers[0].weight"]
    assert same_bits(plain[".layers[0].weight"], m.layers[0].weight)
    assert os.path.getsize(f) < 24 + 4096  # 24 bytes of data, once, plus the header


def test_every_container_and_sharing_kind(tmp_path):
    src = every_kind(0)
    f = tmp_path / "m.safetensors"
    tied.save(f, src)
    back = tied.load(f, like=every_kind(1))
    check_every_kind(back, src)
    assert tied.ties(back) == tied.ties(src)
    # Each unique array is stored once: w, e, c, the shared node's second array, frozen.x.
    with safetensors.safe_open(f, framework="np") as sf:
        names = list(sf.keys())
        assert len(names) == 5
        doc = json.loads(sf.metadata()["tied"])
    assert {tuple(v["places"]) for v in doc["views"]} == {("['dc'].y[1]",)}
    assert doc["views"][0] == {"places": ["['dc'].y[1]"], "fn": "transpose", "source": "['dc'].x.content[0]"}
    assert sorted(map(sorted, doc["shared_nodes"])) == [
        ["['dc'].x", "['eqx'].left"],
        ["['loop']", "['loop']['self']"],
    ]


def test_views_store_only_the_source(tmp_path):
    enc = Dense(jnp.arange(6.0).reshape(3, 2), jnp.ones(3))
    model = Chain(enc, Dense(tied.transpose(enc.weight), None))
    tied.save(tmp_path / "ae.safetensors", model)
    plain = safetensors.numpy.load_file(tmp_path / "ae.safetensors")
    assert sorted(plain) == [".layers[0].bias", ".layers[0].weight"]
    back = tied.load(tmp_path / "ae.safetensors", like=model)
    assert back.layers[1].weight.source is back.layers[0].weight
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(back(x), model(x))


@pytest.mark.parametrize("dt, kind", DTYPE_CASES, ids=lambda c: str(c))
def test_dtypes_round_trip_bit_for_bit(tmp_path, dt, kind):
    r = np.random.default_rng(0)
    raw = r.integers(0, 256, size=(3, 4 * dt.itemsize), dtype=np.uint8)
    if dt.kind == "b":
        x = raw[:, :4] % 2 == 1
    else:  # arbitrary bit patterns: NaN payloads, -0.0, infinities included
        x = raw.view(dt)
    scalar, empty = x.reshape(-1)[:1].reshape(()), x[:0]
    tree = [x, {"again": x, "scalar": scalar}, (empty,)]
    if kind == "jax":
        tree = jax.tree_util.tree_map(jnp.asarray, tree)
        tree[1]["again"] = tree[0]
    f = tmp_path / "d.safetensors"
    tied.save(f, tree)
    back = tied.load(f, like=tree)
    assert back[1]["again"] is back[0]
    for got, want in [(back[0], x), (back[1]["scalar"], scalar), (back[2][0], empty)]:
        assert same_bits(got, want)
        assert isinstance(got, np.ndarray if kind == "numpy" else jax.Array)
    # The safetensors library's own parser (Rust, which checks the layout) reads the same bytes.
    ref = dict(safetensors.deserialize(f.read_bytes()))
    assert sorted(ref) == ["[0]", "[1]['scalar']", "[2][0]"]
    assert ref["[0]"]["shape"] == list(x.shape) and bytes(ref["[0]"]["data"]) == x.tobytes()
    assert ref["[0]"]["dtype"] == _safetensors._TAGS[dt.name]
    if not dt.name.startswith("float8"):  # safetensors' numpy frontend has no float8 types
        with safetensors.safe_open(f, framework="np") as sf:
            assert same_bits(sf.get_tensor("[0]"), x)


def test_loaded_numpy_arrays_are_fresh_and_writable(tmp_path):
    x = np.arange(4.0)
    tied.save(tmp_path / "n.safetensors", {"x": x})
    back = tied.load(tmp_path / "n.safetensors", like={"x": np.zeros(4)})
    back["x"][0] = 7.0
    assert x[0] == 0.0 and back["x"][1] == 1.0


def test_unsupported_dtype_is_refused_before_writing(tmp_path):
    f = tmp_path / "c.safetensors"
    with pytest.raises(tied.CheckpointError, match=r"\['z'\]: an array of dtype complex128 cannot be stored"):
        tied.save(f, {"a": np.ones(2), "z": np.ones(2, np.complex128)})
    assert os.listdir(tmp_path) == []


def test_metadata_round_trip_and_errors(tmp_path):
    f = tmp_path / "m.safetensors"
    tied.save(f, seed_model(), metadata={"step": 5, "config": {"lr": 0.1, "name": "ü"}})
    assert tied.load_metadata(f) == {"step": 5, "config": {"lr": 0.1, "name": "ü"}}
    with pytest.raises(tied.CheckpointError, match=r"must be JSON-serialisable"):
        tied.save(f, seed_model(), metadata={"w": object()})
    with pytest.raises(tied.CheckpointError, match=r"mapping with string keys"):
        tied.save(f, seed_model(), metadata={1: "a"})
    assert tied.load_metadata(f)["step"] == 5  # the failed saves left the file alone


# ---------------------------------------------------------------- random models


@st.composite
def random_models(draw):
    """Random nesting of every container kind over a small pool of arrays, with random sharing."""
    n = draw(st.integers(1, 4))
    pool = [np.full((draw(st.integers(0, 3)), 2), float(i), np.float32) for i in range(n)]
    pool.append(np.array([1, 2], np.int32))
    nodes: list = []

    def build(depth):
        choice = draw(st.integers(0, 9 if depth < 3 else 1))
        if choice == 0:
            return draw(st.sampled_from(pool))
        if choice == 1:
            return draw(st.sampled_from(["s", 3, None]))
        if choice == 2 and nodes:
            return draw(st.sampled_from(nodes))  # a shared node
        if choice == 3:
            return tied.transpose(draw(st.sampled_from(pool[:n])))
        a, b = build(depth + 1), build(depth + 1)
        node = [
            lambda: [a, b],
            lambda: {"k": a, "j": b},
            lambda: (a, b),
            lambda: NT(a, b),
            lambda: DC(a, b),
            lambda: Box([a, b]),
        ][choice - 4]()
        nodes.append(node)
        return node

    return [build(0), build(0)]


@given(random_models())
def test_random_models_round_trip(tmp_path_factory, model):
    leaves, gdef = tied.flatten(model)
    like = tied.unflatten(gdef, [np.zeros_like(x) for x in leaves])
    f = tmp_path_factory.mktemp("h") / "r.safetensors"
    tied.save(f, model)
    back = tied.load(f, like=like)
    back_leaves, back_gdef = tied.flatten(back)
    assert back_gdef == gdef  # same structure, statics and sharing
    assert all(same_bits(a, b) for a, b in zip(back_leaves, leaves))
    assert len(safetensors.numpy.load_file(f)) == len(leaves)
    # The same into an abstract like: JAX arrays come back, with the same ties and values.
    abstract_like = tied.unflatten(gdef, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    back_leaves, back_gdef = tied.flatten(tied.load(f, abstract_like))
    assert back_gdef == gdef and all(isinstance(x, jax.Array) for x in back_leaves)
    assert all(same_bits(a, b) for a, b in zip(back_leaves, leaves))


# ---------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_save_leaves_the_old_checkpoint_untouched(tmp_path, monkeypatch, exc):
    f = tmp_path / "ckpt.safetensors"
    tied.save(f, seed_model(0), metadata={"step": 1})
    before = f.read_bytes()
    calls = []

    def failing_write(fh, data):
        calls.append(len(data))
        if len(calls) == 2:  # half of the second array reaches the disk, then the disk is full
            fh.write(data[: len(data) // 2])
            raise exc
        fh.write(data)

    monkeypatch.setattr(_safetensors, "_write_array", failing_write)
    with pytest.raises(type(exc)):
        tied.save(f, seed_model(1), metadata={"step": 2})
    assert len(calls) == 2
    assert f.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]  # no temporary file left behind
    monkeypatch.undo()
    back = tied.load(f, like=seed_model(1))
    assert same_bits(back.layers[0].weight, seed_model(0).layers[0].weight)


def test_save_replaces_with_the_usual_file_mode(tmp_path):
    f = tmp_path / "ckpt.safetensors"
    tied.save(f, seed_model(0))
    tied.save(f, seed_model(1))
    umask = os.umask(0)
    os.umask(umask)
    assert f.stat().st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert same_bits(tied.load(f, like=seed_model(0)).layers[1].bias, seed_model(1).layers[0].bias)


# ---------------------------------------------------------------- mismatches with `like`


@pytest.fixture
def seed_file(tmp_path):
    f = tmp_path / "seed.safetensors"
    tied.save(f, seed_model())
    return f


def test_shape_differs(seed_file):
    d = Dense(jnp.zeros((2, 3)), jnp.zeros(2))
    with pytest.raises(
        tied.CheckpointError,
        match=r"shape differs at \.layers\[0\]\.weight: the file has \(2, 2\) float32, "
        r"like has \(2, 3\) float32",
    ):
        tied.load(seed_file, like=Chain(d, Dense(d.weight, d.bias)))


def test_dtype_differs(seed_file):
    d = Dense(jnp.zeros((2, 2), jnp.bfloat16), jnp.zeros(2))
    with pytest.raises(
        tied.CheckpointError,
        match=r"dtype differs at \.layers\[0\]\.weight: the file has \(2, 2\) float32, "
        r"like has \(2, 2\) bfloat16",
    ):
        tied.load(seed_file, like=Chain(d, Dense(d.weight, d.bias)))


def test_place_missing_in_the_file(seed_file):
    m = seed_model()
    m.layers.append(Dense(jnp.ones((2, 2)), None))
    with pytest.raises(
        tied.CheckpointError, match=r"places in like but not in the file: \.layers\[2\]\.weight\."
    ):
        tied.load(seed_file, like=m)


def test_place_missing_in_like(seed_file):
    d = Dense(jnp.zeros((2, 2)), None)
    with pytest.raises(
        tied.CheckpointError,
        match=r"places in the file but not in like: \.layers\[0\]\.bias, \.layers\[1\]\.bias\.",
    ):
        tied.load(seed_file, like=Chain(d, Dense(d.weight, None)))


def test_array_tied_in_the_file_but_not_in_like(seed_file):
    d = Dense(jnp.zeros((2, 2)), jnp.zeros(2))
    like = Chain(d, Dense(d.weight, jnp.zeros(2)))
    with pytest.raises(
        tied.CheckpointError,
        match=r"sharing differs at \.layers\[0\]\.bias: in like, \.layers\[0\]\.bias is not tied to "
        r"another place; in the file, \.layers\[0\]\.bias and \.layers\[1\]\.bias are one array",
    ):
        tied.load(seed_file, like=like)


def test_array_tied_in_like_but_not_in_the_file(tmp_path):
    f = tmp_path / "untied.safetensors"
    tied.save(f, Chain(Dense(jnp.ones((2, 2)), jnp.zeros(2)), Dense(jnp.ones((2, 2)), jnp.zeros(2))))
    with pytest.raises(
        tied.CheckpointError,
        match=r"sharing differs at \.layers\[0\]\.weight: in like, \.layers\[0\]\.weight and "
        r"\.layers\[1\]\.weight are one array; in the file, \.layers\[0\]\.weight is not tied",
    ):
        tied.load(f, like=seed_model())


def test_node_sharing_differs(seed_file):
    d = Dense(jnp.zeros((2, 2)), jnp.zeros(2))
    with pytest.raises(
        tied.CheckpointError,
        match=r"sharing differs at \.layers\[0\]: in like, \.layers\[0\] and \.layers\[1\] are one node; "
        r"in the file, \.layers\[0\] is not tied",
    ):
        tied.load(seed_file, like=Chain(d, d))


def test_view_differs(tmp_path):
    enc = Dense(jnp.ones((3, 2)), None)
    f = tmp_path / "v.safetensors"
    tied.save(f, Chain(enc, Dense(tied.transpose(enc.weight), None)))
    with pytest.raises(
        tied.CheckpointError,
        match=r"\.layers\[1\]\.weight is a view \(transpose of \.layers\[0\]\.weight\) in the file "
        r"but not in like",
    ):
        tied.load(f, like=Chain(enc, Dense(jnp.ones((2, 3)), None)))
    negate = tied.view(enc.weight, jnp.negative)
    with pytest.raises(
        tied.CheckpointError,
        match=r"view at \.layers\[1\]\.weight differs: like has negative of \.layers\[0\]\.weight, "
        r"the file has transpose of \.layers\[0\]\.weight",
    ):
        tied.load(f, like=Chain(enc, Dense(negate, None)))


def test_a_plain_safetensors_file_is_refused_clearly(tmp_path):
    f = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({".layers[0].weight": np.ones((2, 2), np.float32)}, f)
    with pytest.raises(tied.CheckpointError, match=r"without tied's metadata"):
        tied.load(f, like=seed_model())


# ---------------------------------------------------------------- corrupt and hostile files


def read_parts(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_parts(path, header, data, length=None):
    head = json.dumps(header).encode()
    path.write_bytes((len(head) if length is None else length).to_bytes(8, "little") + head + data)


def with_doc(header, change):
    doc = json.loads(header["__metadata__"]["tied"])
    change(doc)
    header["__metadata__"]["tied"] = json.dumps(doc)
    return header


def test_every_truncation_is_refused(seed_file):
    raw = seed_file.read_bytes()
    like = seed_model()
    for n in range(len(raw)):
        seed_file.write_bytes(raw[:n])
        with pytest.raises(tied.CheckpointError, match=r"seed.safetensors: not a readable tied checkpoint"):
            tied.load(seed_file, like=like)


def test_flipped_data_bits_are_detected(seed_file):
    raw = bytearray(seed_file.read_bytes())
    raw[-3] ^= 0x10
    seed_file.write_bytes(bytes(raw))
    with pytest.raises(tied.CheckpointError, match=r"do not match their CRC-32C checksum"):
        tied.load(seed_file, like=seed_model())


HOSTILE = {
    "huge header length": (lambda h: h, 2**63, r"the header claims 9223372036854775808 bytes"),
    "header past the end": (lambda h: h, 10_000, r"the header claims 10000 bytes but the file has"),
    "huge tensor": (
        lambda h: h[".layers[0].weight"].update(shape=[10**9, 10**9], data_offsets=[0, 4 * 10**18]),
        None,
        r"its data ends at byte 4000000000000000000 of the data section, which has only 24 bytes",
    ),
    "offsets past the end": (
        lambda h: h[".layers[0].weight"].update(data_offsets=[100, 116]),
        None,
        r"data ends at byte 116",
    ),
    "offsets against shape": (
        lambda h: h[".layers[0].weight"].update(shape=[3, 3]),
        None,
        r"offsets \[\d+, \d+\] do not span the 36 bytes",
    ),
    "object dtype": (lambda h: h[".layers[0].weight"].update(dtype="O"), None, r"unknown dtype 'O'"),
    "pickle dtype": (lambda h: h[".layers[0].weight"].update(dtype="pickle"), None, r"unknown dtype"),
    "negative shape": (lambda h: h[".layers[0].bias"].update(shape=[-2]), None, r"invalid shape \[-2\]"),
    "boolean shape": (lambda h: h[".layers[0].bias"].update(shape=[True, True]), None, r"invalid shape"),
    "overlap": (
        lambda h: h[".layers[0].bias"].update(data_offsets=[8, 16]),
        None,
        r"overlap or leave gaps",
    ),
    "non-JSON metadata": (
        lambda h: h["__metadata__"].update(tied="{'arrays': pickle.loads}"),
        None,
        r"the metadata entry 'tied' is not JSON",
    ),
    "metadata not a string": (lambda h: h["__metadata__"].update(tied=[1]), None, r"is not a string"),
    "metadata wrong types": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(places=".layers[0].weight")),
        None,
        r"places is not a non-empty list of paths",
    ),
    "unknown tensor name": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(name="os.system")),
        None,
        r"names tensor 'os.system', which the file does not hold",
    ),
    "dtype disagrees": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(dtype="bfloat16")),
        None,
        r"disagree with the header",
    ),
    "newer version": (lambda h: with_doc(h, lambda d: d.update(version=99)), None, r"version 99"),
    "private attribute": (
        lambda h: with_doc(h, lambda d: d["arrays"][0]["places"].append(".layers[0].__class__")),
        None,
        r"places in the file but not in like: \.layers\[0\]\.__class__\. A path naming a private attribute",
    ),
    "private attribute _secret": (
        lambda h: with_doc(h, lambda d: d["arrays"][1]["places"].append("._secret")),
        None,
        r"not in like: \._secret\. A path naming a private attribute",
    ),
    "view naming a module": (
        lambda h: with_doc(
            h, lambda d: d["views"].append({"places": [".layers[1]"], "fn": "evil_mod.run", "source": ""})
        ),
        None,
        r"\.layers\[1\] is a view \(evil_mod.run of <root>\) in the file but not in like",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_files_are_refused(seed_file, case):
    change, length, message = HOSTILE[case]
    header, data = read_parts(seed_file)
    change(header)
    write_parts(seed_file, header, data, length)
    like = seed_model()
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(seed_file, like=like)
    assert "evil_mod" not in sys.modules
    assert not hasattr(like.layers[0], "_secret")


def test_headers_that_are_not_json_objects(seed_file):
    _, data = read_parts(seed_file)
    for head, message in [
        (b"\xff\xfe{", r"the header is not JSON \(UnicodeDecodeError\)"),
        (b"[1, 2]", r"not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, r"the header is not JSON \(RecursionError\)"),
        (b'{"a": NaN', r"the header is not JSON"),
    ]:
        seed_file.write_bytes(len(head).to_bytes(8, "little") + head + data)
        with pytest.raises(tied.CheckpointError, match=message):
            tied.load(seed_file, like=seed_model())


# ---------------------------------------------------------------- optimiser states


def test_optax_state_round_trip(tmp_path):
    """A bare optax state (as in any JAX code base): moments and the int32 step count come back exactly."""
    w = jnp.linspace(-1, 1, 6).reshape(3, 2)
    params = {"w": w, "b": jnp.zeros(2)}
    tx = optax.adam(1e-2)
    state = tx.init(params)
    for _ in range(3):
        g = jax.tree_util.tree_map(lambda p: jnp.cos(p) + 1.0, params)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    f = tmp_path / "opt.safetensors"
    tied.save(f, state)
    back = tied.load(f, like=tx.init(params))
    assert back[0].count.dtype == jnp.int32 and int(back[0].count) == 3
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        assert same_bits(a, b)


def tied_lm(key):
    """A tied-embedding language model: the output head is the embedding transposed."""
    k1, k2 = jax.random.split(key)
    emb = Embedding(11, 4, key=k1)
    hidden = Dense(4, 4, key=k2, activation=jnp.tanh)
    return Chain(emb, hidden, hidden, Dense(emb.weight, jnp.zeros(11)))


def test_training_resumes_bit_for_bit(tmp_path):
    tokens = jnp.array([1, 5, 2, 9, 3])
    targets = jnp.array([5, 2, 9, 3, 1])

    def loss(m):
        logits = m(tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=1))

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-2))

    @tied.jit
    def step(model, state):
        return tied.optim.update(state, model, tied.grad(loss)(model))

    def train(model, state, steps):
        for _ in range(steps):
            model, state = step(model, state)
        return model, state

    model = tied_lm(jax.random.key(0))
    model, state = train(model, tied.optim.setup(tx, model), 5)
    f = tmp_path / "run.safetensors"
    tied.save(f, (model, state), metadata={"step": 5})
    straight, straight_state = train(model, state, 5)

    fresh = tied_lm(jax.random.key(1))
    model2, state2 = tied.load(f, like=(fresh, tied.optim.setup(tx, fresh)))
    assert tied.load_metadata(f) == {"step": 5}
    assert model2.layers[0].weight is model2.layers[3].weight  # the tied head
    assert model2.layers[1] is model2.layers[2]  # the shared block
    assert state2.inner_state[1][0].count.dtype == jnp.int32 and int(state2.inner_state[1][0].count) == 5
    resumed, resumed_state = train(model2, state2, 5)

    a_leaves, a_def = tied.flatten((straight, straight_state))
    b_leaves, b_def = tied.flatten((resumed, resumed_state))
    assert a_def == b_def
    assert all(same_bits(a, b) for a, b in zip(a_leaves, b_leaves))
    assert float(loss(resumed)) < float(loss(tied_lm(jax.random.key(0))))


def test_view_function_names_are_stable(tmp_path):
    """A partial has no __name__ and its repr holds an address: the file records a stable name."""
    import functools

    w = jnp.arange(6.0).reshape(2, 3)
    model = {"w": w, "rolled": tied.view(w, functools.partial(jnp.roll, shift=1))}
    f = tmp_path / "p.safetensors"
    tied.save(f, model)
    with safetensors.safe_open(f, framework="np") as sf:
        assert json.loads(sf.metadata()["tied"])["views"][0]["fn"] == "partial(roll)"
    z = jnp.zeros((2, 3))
    like = {"w": z, "rolled": tied.view(z, functools.partial(jnp.roll, shift=1))}
    back = tied.load(f, like=like)
    assert back["rolled"].source is back["w"] and same_bits(back["w"], w)


# ---------------------------------------------------------------- the call forms and formats


def test_metadata_is_positional_or_keyword_and_format_is_checked(tmp_path):
    f = tmp_path / "m.safetensors"
    tied.save(f, seed_model(), {"step": 1})
    assert tied.load_metadata(f) == {"step": 1}
    tied.save(f, seed_model(), metadata={"step": 2}, format="safetensors")
    assert tied.load_metadata(f) == {"step": 2}
    back = tied.load(f, seed_model(1))  # like positional too
    assert same_bits(back.layers[1].weight, seed_model().layers[0].weight)
    with pytest.raises(tied.CheckpointError, match=r"format='npz'.*'safetensors', 'orbax'"):
        tied.save(f, seed_model(), format="npz")
    with pytest.raises(tied.CheckpointError, match=r"rename=.*pass strict=False"):
        tied.load(f, seed_model(), rename={"a": ".b"})


def test_an_array_split_over_processes_is_refused_with_the_fix(tmp_path, monkeypatch):
    """One process cannot write an array it cannot read whole: the error says format='orbax'."""
    x = jnp.ones((2, 2))

    class Remote(np.ndarray):  # stands in for a jax.Array whose shards live on other hosts
        is_fully_addressable = False

    monkeypatch.setattr(_safetensors.jax, "Array", (jax.Array, Remote))
    f = tmp_path / "r.safetensors"
    with pytest.raises(
        tied.CheckpointError,
        match=r"\['emb'\]: this array is split over several processes .* Pass format='orbax'",
    ):
        tied.save(f, {"w": x, "emb": np.zeros((3, 2), np.float32).view(Remote)})
    assert os.listdir(tmp_path) == []


def test_an_abstract_tree_is_not_saved(tmp_path):
    with pytest.raises(tied.CheckpointError, match=r"\['w'\]: a jax.ShapeDtypeStruct describes an array"):
        tied.save(tmp_path / "a.safetensors", {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- abstract `like`


def abstract(tree):
    """``tree`` with a ShapeDtypeStruct for each unique array, ties kept (one struct per array)."""
    leaves, gdef = tied.flatten(tree)
    return tied.unflatten(gdef, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])


def test_load_into_shape_dtype_structs(tmp_path):
    src = every_kind(0)
    f = tmp_path / "m.safetensors"
    tied.save(f, src)
    like = every_kind(1)
    like["frozen"] = FrozenDC(np.zeros((2, 2)))  # float64: JAX would hold it only with x64, so numpy here
    leaves, gdef = tied.flatten(like)
    like = tied.unflatten(
        gdef, [x if isinstance(x, np.ndarray) else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    )
    assert tied.ties(like) == tied.ties(src)
    back = tied.load(f, like)
    check_every_kind(back, src)
    assert isinstance(back["dense"].weight, jax.Array) and not back["dense"].weight.committed


def test_load_onto_the_sharding_of_a_shape_dtype_struct(tmp_path):
    m = seed_model()
    f = tmp_path / "s.safetensors"
    tied.save(f, m)
    dev = jax.devices()[-1]
    sharding = jax.sharding.SingleDeviceSharding(dev)

    def like(w_shape=(2, 2), tie=True):
        w = jax.ShapeDtypeStruct(w_shape, jnp.float32, sharding=sharding)
        b = jax.ShapeDtypeStruct((2,), jnp.float32)
        if tie:
            return tied.unflatten(tied.flatten(m)[1], [w, b])
        d = Dense(jnp.ones((2, 2)), jnp.ones(2))
        _, gdef = tied.flatten(Chain(d, Dense(jnp.ones((2, 2)), d.bias)))
        return tied.unflatten(gdef, [w, b, jax.ShapeDtypeStruct(w_shape, jnp.float32)])

    back = tied.load(f, like())
    assert back.layers[0].weight is back.layers[1].weight
    assert back.layers[0].weight.committed and back.layers[0].weight.sharding == sharding
    assert not back.layers[0].bias.committed
    assert same_bits(back.layers[0].weight, m.layers[0].weight)
    with pytest.raises(tied.CheckpointError, match=r"shape differs at \.layers\[0\]\.weight.*has \(3, 2\)"):
        tied.load(f, like((3, 2)))
    with pytest.raises(tied.CheckpointError, match=r"sharing differs at \.layers\[0\]\.weight"):
        tied.load(f, like(tie=False))


def test_a_64_bit_shape_dtype_struct_says_what_to_do(tmp_path):
    f = tmp_path / "i.safetensors"
    tied.save(f, {"n": np.arange(3, dtype=np.int64)})
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on")
    with pytest.raises(tied.CheckpointError, match=r"int64 at \['n'\].*only with jax_enable_x64"):
        tied.load(f, {"n": jax.ShapeDtypeStruct((3,), np.int64)})


# ---------------------------------------------------------------- issue 10, finding 10


@pytest.mark.parametrize("dt", [">f4", ">i8", ">f8", ">c8", ">u2"])
def test_big_endian_arrays_are_stored_little_endian(tmp_path, dt):
    x = np.arange(6).astype(dt).reshape(2, 3) * 3 - 1
    f = tmp_path / "be.safetensors"
    tied.save(f, {"x": x, "again": x})
    back = tied.load(f, {"x": x, "again": x})
    assert back["x"] is back["again"] and back["x"].dtype.isnative
    np.testing.assert_array_equal(back["x"], x)  # values, whatever the byte order
    ref = safetensors.numpy.load_file(f)["['again']"]  # the reference reader agrees on the values
    np.testing.assert_array_equal(ref, x)
    if jax.dtypes.canonicalize_dtype(np.dtype(dt)) == np.dtype(dt).newbyteorder("="):
        j = tied.load(f, {"x": jnp.zeros(x.shape, x.dtype.newbyteorder("=")), "again": None} | {})
        np.testing.assert_array_equal(np.asarray(j["x"]), x)


@tied.register
class Odd:
    """A model with an attribute whose name holds a dot, beside a layer of the same keystr."""

    def __init__(self, first_odd, w, v):
        if first_odd:
            setattr(self, "encoder.weight", w)
            self.encoder = Dense(v, None)
        else:
            self.encoder = Dense(v, None)
            setattr(self, "encoder.weight", w)


def test_an_attribute_named_like_a_path_saves_and_loads(tmp_path):
    w, v = jnp.arange(4.0).reshape(2, 2), -jnp.arange(4.0).reshape(2, 2)
    f = tmp_path / "odd.safetensors"
    for first_odd in (True, False):
        tied.save(f, Odd(first_odd, w, v))
        back = tied.load(f, Odd(first_odd, jnp.zeros((2, 2)), jnp.zeros((2, 2))))
        assert same_bits(getattr(back, "encoder.weight"), w) and same_bits(back.encoder.weight, v)
        names = sorted(safetensors.numpy.load_file(f))
        assert len(names) == 2 and len(set(names)) == 2  # two tensors, two names


def test_an_attribute_named_like_a_path_is_found_whatever_the_order(tmp_path):
    """The two places written .encoder.weight are told apart by their keys, not by their order."""
    w, v = jnp.arange(4.0).reshape(2, 2), -jnp.arange(4.0).reshape(2, 2)
    f = tmp_path / "odd.safetensors"
    tied.save(f, Odd(True, w, v))
    with safetensors.safe_open(f, framework="np") as sf:
        doc = json.loads(sf.metadata()["tied"])
    keys = sorted(a["place_keys"] for a in doc["arrays"])
    assert keys == [[[".encoder", ".weight"]], [[".encoder.weight"]]]
    back = tied.load(f, Odd(False, jnp.zeros((2, 2)), jnp.zeros((2, 2))))
    assert same_bits(getattr(back, "encoder.weight"), w) and same_bits(back.encoder.weight, v)
    # like without the odd attribute: one place short, named with its keys.
    plain = Odd(False, jnp.zeros((2, 2)), jnp.zeros((2, 2)))
    del plain.__dict__["encoder.weight"]
    with pytest.raises(
        tied.CheckpointError,
        match=r"in like but not in the file: \.encoder\.weight\. The file has places written "
        r"\.encoder\.weight too, with other keys",
    ):
        tied.load(f, plain)


MALFORMED = {
    "dtype tag a list": (lambda h: h[".layers[0].weight"].update(dtype=["F32"]), r"unknown dtype \['F32'\]"),
    "dtype tag an object": (lambda h: h[".layers[0].weight"].update(dtype={"a": 1}), r"unknown dtype"),
    "tensor name a list": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(name=[".layers[0].weight"])),
        r"array 0 has no tensor name \(found list\)",
    ),
    "tensor name an object": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(name={"x": 1})),
        r"array 0 has no tensor name",
    ),
    "view without source": (
        lambda h: with_doc(h, lambda d: d["views"].append({"places": [".layers[1]"], "fn": "f"})),
        r"a view's source is not a path",
    ),
    "view places a string": (
        lambda h: with_doc(h, lambda d: d["views"].append({"places": ".x", "fn": "f", "source": None})),
        r"a view's places is not a non-empty list",
    ),
    "arrays an object": (lambda h: with_doc(h, lambda d: d.update(arrays={})), r"'arrays' is not a list"),
    "shared nodes of ints": (
        lambda h: with_doc(h, lambda d: d.update(shared_nodes=[[1, 2]])),
        r"a shared node's places is not",
    ),
    "user a list": (lambda h: with_doc(h, lambda d: d.update(user=[1])), r"'user' is not an object"),
    "version a string": (lambda h: with_doc(h, lambda d: d.update(version="2")), r"version '2'"),
    "version a list": (lambda h: with_doc(h, lambda d: d.update(version=[2])), r"version \[2\]"),
    "checksum unknown": (lambda h: with_doc(h, lambda d: d.update(checksum="md5")), r"checksum 'md5'"),
    "checksum a list": (lambda h: with_doc(h, lambda d: d.update(checksum=["crc32c"])), r"unknown checksum"),
    "crc a string": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(crc32c="12")),
        r"has no crc32c",
    ),
    "crc too big": (lambda h: with_doc(h, lambda d: d["arrays"][0].update(crc32c=2**40)), r"has no crc32c"),
    "metadata a list": (lambda h: h.update(__metadata__=[1]), r"__metadata__ is not an object"),
    "shape of floats": (
        lambda h: with_doc(h, lambda d: d["arrays"][0].update(shape=[2.0, 2])),
        r"invalid shape",
    ),
    "place listed twice": (
        lambda h: with_doc(h, lambda d: d["arrays"][1]["places"].append(".layers[0].weight")),
        r"the place \.layers\[0\]\.weight is listed twice, without keys",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata_raises_checkpoint_error(seed_file, case):
    change, message = MALFORMED[case]
    header, data = read_parts(seed_file)
    change(header)
    write_parts(seed_file, header, data)
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(seed_file, like=seed_model())


def fuzz_model():
    w = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)
    block = Dense(jnp.ones((2, 2), jnp.bfloat16), None)
    enc = Dense(w, jnp.arange(3, dtype=jnp.int32))
    odd = Odd(True, jnp.ones(2), jnp.zeros((2, 2)))  # places written alike: the file records their keys
    return {"enc": enc, "dec": tied.transpose(w), "blocks": [block, block], "odd": odd}


@functools.cache
def fuzz_file() -> bytes:
    path = os.path.join(tempfile.mkdtemp(), "fuzz.safetensors")
    tied.save(path, fuzz_model(), {"step": 1})
    with open(path, "rb") as fh:
        return fh.read()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _mutate_json(data, doc):
    """Replace or delete one value somewhere in a JSON document, chosen by hypothesis."""
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return
        k = data.draw(st.sampled_from(keys))
        child = node[k]
        if isinstance(child, (dict, list)) and child and data.draw(st.booleans()):
            node = child
            continue
        if isinstance(node, dict) and data.draw(st.booleans()):
            del node[k]
        else:
            node[k] = data.draw(json_values)
        return


def load_fuzzed(path):
    """Load a fuzzed file: only a CheckpointError, or the saved values with their ties, may come out."""
    try:
        back = tied.load(path, fuzz_model())
    except tied.CheckpointError:
        return
    ref = fuzz_model()
    assert back["dec"].source is back["enc"].weight and back["blocks"][0] is back["blocks"][1]
    for a, b in zip(tied.flatten(back)[0], tied.flatten(ref)[0]):
        assert same_bits(a, b)
    try:
        assert isinstance(tied.load_metadata(path), dict)
    except tied.CheckpointError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_bytes_raise_only_checkpoint_error(tmp_path_factory, data):
    raw = bytearray(fuzz_file())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    path.write_bytes(bytes(raw))
    load_fuzzed(path)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_metadata_raises_only_checkpoint_error(tmp_path_factory, data):
    raw = fuzz_file()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if data.draw(st.booleans()):  # the tied manifest inside the header
        doc = json.loads(header["__metadata__"]["tied"])
        _mutate_json(data, doc)
        header["__metadata__"]["tied"] = json.dumps(doc)
    else:  # the safetensors header itself
        _mutate_json(data, header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n :])
    load_fuzzed(path)


# ---------------------------------------------------------------- killed saves


KILLED_SAVE = """
import sys, time
import numpy as np
import tied
from tied._checkpoint import safetensors_format as _safetensors

real = _safetensors._write_array
calls = []

def stall(f, data):
    real(f, data)
    calls.append(1)
    if len(calls) == 2:  # the header's room and the first array are on disk: wait to be killed
        f.flush()
        print("writing", flush=True)
        time.sleep(600)

_safetensors._write_array = stall
tied.save(sys.argv[1], {"w": np.full((64, 64), 2.0, np.float32), "b": np.ones(64, np.float32)})
"""


def start_stalled_save(path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert proc.stdout.readline() == "writing\n"
    return proc


def leftovers(folder):
    return sorted(n for n in os.listdir(folder) if ".tied-tmp-" in n or n.endswith(".tmp"))


def test_a_killed_save_leaves_the_old_file_and_the_next_save_cleans_up(tmp_path):
    f = tmp_path / "ckpt.safetensors"
    tied.save(f, seed_model(0), {"step": 1})
    before = f.read_bytes()
    old = ".ckpt.safetensors.0123456789ab.tmp"  # what a killed save of tied 0.1 left
    other = ".other.safetensors.tied-tmp-00"  # another file's: not ours to touch
    (tmp_path / old).write_bytes(b"x" * 100)
    (tmp_path / other).write_bytes(b"x")
    victims = []
    try:
        dead = start_stalled_save(f)
        victims.append(dead)
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(timeout=60)
        assert f.read_bytes() == before  # the old checkpoint is whole
        dead_tmp = [n for n in leftovers(tmp_path) if n.startswith(".ckpt.safetensors.tied-tmp-")]
        assert len(dead_tmp) == 1 and (tmp_path / dead_tmp[0]).stat().st_size > 64 * 64 * 4
        live = start_stalled_save(f)  # a save in progress: it removed the dead ones as it began
        victims.append(live)
        live_tmp = [n for n in leftovers(tmp_path) if n.startswith(".ckpt.safetensors.tied-tmp-")]
        assert len(live_tmp) == 1 and live_tmp != dead_tmp
        assert leftovers(tmp_path) == sorted([live_tmp[0], other])
        tied.save(f, seed_model(1), {"step": 2})  # the live save's file, locked, is left alone
        assert leftovers(tmp_path) == sorted([live_tmp[0], other])
        assert tied.load_metadata(f) == {"step": 2}
        os.kill(live.pid, signal.SIGKILL)
        live.wait(timeout=60)
        tied.save(f, seed_model(1), {"step": 3})
        assert leftovers(tmp_path) == [other]
        assert tied.load_metadata(f) == {"step": 3}
        back = tied.load(f, seed_model(0))
        assert same_bits(back.layers[1].weight, seed_model(1).layers[0].weight)
    finally:
        for p in victims:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)
            p.stdout.close()


def test_files_of_the_first_format_still_load(tmp_path):
    """Version 1 files (tied 0.1: zlib CRC-32 under "crc32", no "checksum" entry) load, checked."""
    m = seed_model()
    w, b = np.asarray(m.layers[0].weight), np.asarray(m.layers[0].bias)
    places = [".layers[0].weight", ".layers[1].weight"], [".layers[0].bias", ".layers[1].bias"]
    doc = {
        "format": "tied",
        "version": 1,
        "arrays": [
            {"name": p[0], "dtype": "float32", "shape": list(x.shape), "places": p, "crc32": zlib.crc32(x)}
            for p, x in zip(places, (w, b))
        ],
        "shared_nodes": [],
        "views": [],
        "user": {"step": 7},
    }
    header = {
        "__metadata__": {"format": "tied", "tied": json.dumps(doc)},
        ".layers[0].weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        ".layers[0].bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    }
    f = tmp_path / "v1.safetensors"
    write_parts(f, header, w.tobytes() + b.tobytes())
    back = tied.load(f, seed_model(1))
    assert back.layers[0].weight is back.layers[1].weight and same_bits(back.layers[1].weight, w)
    assert same_bits(back.layers[1].bias, b) and tied.load_metadata(f) == {"step": 7}
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(tied.CheckpointError, match=r"'\.layers\[0\]\.bias' do not match their CRC-32 "):
        tied.load(f, seed_model(1))


def test_a_loaded_model_does_not_change_with_its_file(tmp_path):
    """The file is read into the model's own memory: rewriting the file in place (same inode) later,
    as a tool that is not tied.save might, changes nothing loaded (JAX on CPU would adopt a mapping)."""
    big = {"w": jnp.arange(1 << 16, dtype=jnp.float32).reshape(256, 256), "n": np.arange(4096.0)}
    f = tmp_path / "in_place.safetensors"
    tied.save(f, big)
    back = tied.load(f, big)
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n :] = bytes(len(raw) - 8 - n)  # zeros over every array, written into the same file
    with open(f, "r+b") as fh:
        fh.write(raw)
    assert same_bits(back["w"], big["w"]) and same_bits(back["n"], big["n"])
    assert back["n"].flags.writeable


# ---------------------------------------------------------------- strict=False: plain safetensors files


def hf_lm(key=0):
    """Embedding tied to the output head, as a Hugging Face model holds it."""
    r = np.random.default_rng(key)
    emb = Embedding(jnp.asarray(r.normal(size=(11, 4)), jnp.float32))
    w, b = r.normal(size=(4, 4)), r.normal(size=4)
    hidden = Dense(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
    return Chain(emb, hidden, Dense(emb.weight, None))


HF_NAMES = {
    "model.embed_tokens.weight": ".layers[0].weight",
    "model.hidden.weight": ".layers[1].weight",
    "model.hidden.bias": ".layers[1].bias",
}


def hf_file(tmp_path, **extra):
    """A file as transformers writes a tied LM: the embedding once (no lm_head.weight), HF names."""
    r = np.random.default_rng(5)
    arrays = {
        "model.embed_tokens.weight": r.normal(size=(11, 4)).astype(np.float32),
        "model.hidden.weight": r.normal(size=(4, 4)).astype(np.float32),
        "model.hidden.bias": r.normal(size=4).astype(np.float32),
        **extra,
    }
    f = tmp_path / "hf.safetensors"
    safetensors.numpy.save_file(arrays, f, metadata={"format": "pt"})
    return f, arrays


def test_a_plain_file_storing_a_tie_once_fills_both_places(tmp_path):
    f, arrays = hf_file(tmp_path)
    back = tied.load(f, hf_lm(), strict=False, rename=HF_NAMES)
    assert back.layers[2].weight is back.layers[0].weight  # the tie comes from like
    assert same_bits(back.layers[0].weight, arrays["model.embed_tokens.weight"])
    assert same_bits(back.layers[1].weight, arrays["model.hidden.weight"])
    assert same_bits(back.layers[1].bias, arrays["model.hidden.bias"])
    assert back.layers[2].bias is None and isinstance(back.layers[0].weight, jax.Array)
    # The same with a function for rename, and with the head's place named instead of the embedding's.
    head = {"model.embed_tokens.weight": ".layers[2].weight"}
    back = tied.load(f, hf_lm(), strict=False, rename=lambda k: head.get(k, HF_NAMES[k]))
    assert back.layers[2].weight is back.layers[0].weight
    assert same_bits(back.layers[2].weight, arrays["model.embed_tokens.weight"])


def test_a_plain_file_keyed_by_paths_needs_no_rename(tmp_path):
    m = hf_lm(1)
    f = tmp_path / "paths.safetensors"
    safetensors.numpy.save_file(
        {
            ".layers[2].weight": np.asarray(m.layers[0].weight),
            ".layers[1].weight": np.ones((4, 4), np.float32),
            ".layers[1].bias": np.zeros(4, np.float32),
        },
        f,
    )
    back = tied.load(f, hf_lm(2), strict=False)
    assert back.layers[0].weight is back.layers[2].weight
    assert same_bits(back.layers[0].weight, m.layers[0].weight)
    assert same_bits(back.layers[1].weight, np.ones((4, 4), np.float32))


def test_a_plain_file_missing_an_array_names_its_places(tmp_path):
    f, _ = hf_file(tmp_path)
    names = {k: v for k, v in HF_NAMES.items() if "embed" not in k}
    with pytest.raises(
        tied.CheckpointError,
        match=r"no key of the file holds the array at \.layers\[0\]\.weight / \.layers\[2\]\.weight",
    ):
        tied.load(f, hf_lm(), strict=False, rename=names, allow_extra=True)


def test_a_plain_file_with_extra_keys(tmp_path):
    extra = {"model.rotary.inv_freq": np.ones(2, np.float32), "x.y": np.ones(1, np.int8)}
    f, arrays = hf_file(tmp_path, **extra)
    with pytest.raises(
        tied.CheckpointError,
        match=r"keys that name no place of like: 'model.rotary.inv_freq', 'x.y'\. .*allow_extra=True",
    ):
        tied.load(f, hf_lm(), strict=False, rename=HF_NAMES)
    back = tied.load(f, hf_lm(), strict=False, rename=HF_NAMES, allow_extra=True)
    assert same_bits(back.layers[2].weight, arrays["model.embed_tokens.weight"])


def test_a_plain_file_is_checked_for_shapes_dtypes_and_disagreeing_copies(tmp_path):
    f, arrays = hf_file(tmp_path, **{"lm_head.weight": np.zeros((11, 4), np.float32)})
    names = {**HF_NAMES, "lm_head.weight": ".layers[2].weight"}
    with pytest.raises(
        tied.CheckpointError,
        match=r"'model.embed_tokens.weight' and 'lm_head.weight' hold different values, but in like they are "
        r"places of one array \(\.layers\[0\]\.weight, \.layers\[2\]\.weight\)",
    ):
        tied.load(f, hf_lm(), strict=False, rename=names)
    same = np.random.default_rng(5).normal(size=(11, 4)).astype(np.float32)  # hf_file's embedding
    f, arrays = hf_file(tmp_path, **{"lm_head.weight": same})
    back = tied.load(f, hf_lm(), strict=False, rename=names)  # a tie stored twice, equal: fine
    assert back.layers[0].weight is back.layers[2].weight
    f, _ = hf_file(tmp_path, **{"model.hidden.bias": np.zeros(4, np.float16)})
    with pytest.raises(
        tied.CheckpointError, match=r"dtype differs at \.layers\[1\]\.bias: the file has \(4,\) float16"
    ):
        tied.load(f, hf_lm(), strict=False, rename=HF_NAMES)
    f, _ = hf_file(tmp_path, **{"model.hidden.bias": np.zeros(5, np.float32)})
    with pytest.raises(tied.CheckpointError, match=r"shape differs at \.layers\[1\]\.bias"):
        tied.load(f, hf_lm(), strict=False, rename=HF_NAMES)
    with pytest.raises(
        tied.CheckpointError,
        match=r"keys 'model.hidden.bias' and 'model.hidden.weight' both name the place \.layers\[1\]\.weight",
    ):
        tied.load(f, hf_lm(), strict=False, rename={**HF_NAMES, "model.hidden.bias": ".layers[1].weight"})
    with pytest.raises(tied.CheckpointError, match=r"rename failed on the file key .*KeyError"):
        tied.load(f, hf_lm(), strict=False, rename=lambda k: {}[k])
    with pytest.raises(tied.CheckpointError, match=r"rename turned the file key .* into 3"):
        tied.load(f, hf_lm(), strict=False, rename=lambda k: 3)
    with pytest.raises(tied.CheckpointError, match=r"rename=\.\.\.\) takes a mapping or a function"):
        tied.load(f, hf_lm(), strict=False, rename=["a"])


def test_a_tied_file_read_by_its_keys(tmp_path):
    """strict=False reads a tied file like any other (its checksums still checked); ties come from like."""
    m = seed_model(3)
    f = tmp_path / "t.safetensors"
    tied.save(f, m)
    back = tied.load(f, seed_model(), strict=False)
    assert back.layers[0].weight is back.layers[1].weight
    assert same_bits(back.layers[1].weight, m.layers[0].weight)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 4
    f.write_bytes(bytes(raw))
    with pytest.raises(tied.CheckpointError, match=r"do not match their CRC-32C checksum"):
        tied.load(f, seed_model(), strict=False)


def test_strict_false_refuses_a_path_like_writes_twice(tmp_path):
    f = tmp_path / "odd.safetensors"
    safetensors.numpy.save_file({".encoder.weight": np.ones((2, 2), np.float32)}, f)
    with pytest.raises(tied.CheckpointError, match=r"like has two places written \.encoder\.weight"):
        tied.load(f, Odd(True, jnp.zeros((2, 2)), jnp.zeros((2, 2))), strict=False, allow_extra=True)


def test_threads_saving_to_one_path_leave_one_whole_file(tmp_path):
    """Saves racing on one path: each writes its own locked temporary file, none removes another's,
    and the file is always one of the saved models, whole."""
    f = tmp_path / "race.safetensors"
    models = [{"w": np.full((128, 128), float(i), np.float32), "i": np.array([i])} for i in range(6)]
    errors = []

    def save(m):
        try:
            for _ in range(3):
                tied.save(f, m, {"i": int(m["i"][0])})
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(tmp_path) == ["race.safetensors"]
    back = tied.load(f, models[0])
    i = int(back["i"][0])
    assert tied.load_metadata(f) == {"i": i} and same_bits(back["w"], models[i]["w"])


def test_saving_over_a_directory_is_refused(tmp_path):
    with pytest.raises(tied.CheckpointError, match=r"is a directory.*format='orbax'"):
        tied.save(tmp_path, seed_model())


# ---------------------------------------------------------------- state
# Checkpoints of state, typed keys, deep models and odd places (issues 15 and 17).
#
# References are independent of tied's reader: values are compared bit for bit with
# the arrays that were saved (numpy), a run resumed from a checkpoint with the same run
# uninterrupted (plain JAX by hand), and files are opened with the safetensors library.


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
        tied._checkpoint.document.validate(doc, f)


def test_a_place_table_that_unfolds_into_too_much_is_refused_before_it_is_unfolded():
    """5,000 places of 100 characters, each below the last: 1.25e9 characters of paths."""
    table = [[-1, ""]] + [[t, "x" * 100] for t in range(5000)]
    doc = {"format": "tied", "version": 3, "place_table": table, "arrays": [], "shared_at": [], "views": []}
    # Counted in bytes, not timed: refused before a single path is built (unfolded, 1.25 GB).
    tracemalloc.start()
    try:
        with pytest.raises(tied.CheckpointError, match=r"its places unfold into 1,250,250,000 characters"):
            tied._checkpoint.document.validate(doc, "hostile")
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
    env = cpu_env("--xla_force_host_platform_device_count=2")
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
    leaves, doc = tied._checkpoint.manifest.describe(model)
    doc = tied._checkpoint.document.pack(doc)
    doc["version"] = 2
    for a in doc["arrays"]:
        a.pop("state", None)
    _safetensors.write(f, leaves, doc)
    back = tied.load(f, like={"x": tied.State(jnp.zeros(2)), "w": jnp.zeros(2)})
    assert _bits(back["x"].value) == _bits(model["x"].value)
