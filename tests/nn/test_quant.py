"""tied.nn.quantize: weight-only integer tables with per-row scales, a tied table quantized once."""

import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

import tied
from tied.nn import Dense, Embedding, LayerNorm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2_from_transformers.py"
CONFIG = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
IDS = jnp.array([[1, 5, 9, 63, 0, 7]])


@pytest.fixture(scope="module")
def gpt2():
    spec = importlib.util.spec_from_file_location("gpt2_from_transformers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numpy_quantized(w, bits):
    """Symmetric per-row quantization written by hand: qwix's absmax (bound = qmax + 0.5)."""
    w = np.asarray(w, np.float32)
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / (qmax + 0.5), 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -qmax - 1, qmax).astype(np.int8)
    return q, scale


def check_integers(got, w, bits):
    """``got`` (the int8 values) against `numpy_quantized`: equal, except where ``w / scale`` is
    exactly half-way between two integers (a row's largest ``-w`` lands on ``-qmax - 0.5``), which
    float32 may round either way (both are half a step from ``w``). Returns ``got`` as numpy."""
    rq, rs = numpy_quantized(w, bits)
    got = np.asarray(got)
    halfway = np.abs(np.abs(np.asarray(w, np.float32) / rs[:, None]) % 1 - 0.5) < 1e-4
    np.testing.assert_array_equal(got[~halfway], rq[~halfway])
    assert np.abs(got[halfway].astype(int) - rq[halfway]).max(initial=0) <= 1
    assert got.min() >= -(2 ** (bits - 1)) and got.max() <= 2 ** (bits - 1) - 1
    return got


def numpy_packed(q):
    """Two 4-bit values a byte, the even column in the low nibble, by hand."""
    if q.shape[1] % 2:
        q = np.pad(q, ((0, 0), (0, 1)))
    lo, hi = q[:, 0::2].astype(np.uint8) & 0xF, q[:, 1::2].astype(np.uint8) << 4
    return (lo | hi).view(np.int8)


def tied_models(vocab=40, dim=7):
    """The two tie styles: one Embedding at both places (head.attend), and Dense(embed.weight)."""
    emb = Embedding(vocab, dim, key=jax.random.key(0))
    mid = Dense(dim, dim, key=jax.random.key(1))
    one = {"embed": emb, "mid": mid, "head": emb}
    two = {"embed": Embedding(emb.weight), "mid": mid, "head": Dense(emb.weight)}
    return one, two


def run(m, ids):
    h = jnp.tanh(m["mid"](m["embed"](ids)))
    head = m["head"]
    return head.attend(h) if isinstance(head, Embedding) else head(h)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_tables_equal_the_numpy_reference(bits):
    w = jax.random.normal(jax.random.key(3), (6, 5)) * jnp.arange(1.0, 7.0)[:, None]
    w = w.at[2].set(0.0)  # a row of zeros: scale 1, integers 0
    q = tied.nn.quantize({"d": Dense(w)}, "['d']", bits=bits)
    table, scale = q["d"].weight.source
    rq, rs = numpy_quantized(w, bits)
    assert table.dtype == jnp.int8 and scale.dtype == jnp.float32
    assert table.shape == ((6, 5) if bits == 8 else (6, 3))  # 4 bits: half the bytes
    rq = check_integers(q["d"].weight.fn.integers(table), w, bits)
    # the bytes stored are those values (packed by hand for 4 bits)
    np.testing.assert_array_equal(table, rq if bits == 8 else numpy_packed(rq))
    np.testing.assert_allclose(scale, rs, rtol=1e-6)
    np.testing.assert_allclose(tied.materialize(q["d"].weight), rq * rs[:, None], rtol=1e-6)
    x = jax.random.normal(jax.random.key(4), (3, 5))
    np.testing.assert_allclose(q["d"](x), x @ (rq * rs[:, None]).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", [0, 1])
def test_a_tied_table_is_quantized_once_and_read_at_both_places(style):
    m = tied_models()[style]
    q = tied.nn.quantize(m, "['head']")  # selecting one place quantizes the array at all of its
    assert q["embed"].weight is q["head"].weight
    leaves = tied.flatten(q)[0]
    assert sum(x.dtype == jnp.int8 for x in leaves) == 1
    table, scale = q["embed"].weight.source
    rq = check_integers(table, m["embed"].weight, 8)
    rs = numpy_quantized(m["embed"].weight, 8)[1]
    np.testing.assert_allclose(scale, rs, rtol=1e-6)
    ids = jnp.array([3, 0, 39])
    w = rq * rs[:, None]
    h = np.tanh(np.asarray(m["mid"](jnp.asarray(w[[3, 0, 39]]))))
    np.testing.assert_allclose(run(q, ids), h @ w.T, rtol=1e-4, atol=1e-5)
    assert m["embed"].weight is tied.flatten(m)[0][0] and type(m["head"].weight) is not tied.View  # unchanged


@pytest.mark.parametrize("style", [0, 1])
def test_no_float_table_is_made_by_the_lookup_or_the_head(style):
    m = tied.nn.quantize(tied_models(vocab=40, dim=7)[style], "['embed']")
    leaves, gdef = tied.flatten(m)
    ids = jnp.array([3, 0])

    def shapes(f):
        jaxpr = jax.make_jaxpr(f)(leaves)
        return {(tuple(v.aval.shape), v.aval.dtype.name) for e in jaxpr.eqns for v in e.outvars}

    lookup = shapes(lambda xs: tied.unflatten(gdef, xs)["embed"](ids))
    whole = shapes(lambda xs: run(tied.unflatten(gdef, xs), ids))
    assert ((40, 7), "float32") not in lookup | whole
    assert ((2, 7), "float32") in lookup  # the two rows, dequantized
    grads = shapes(
        lambda xs: tied.grad(lambda mm: run(mm, ids).sum())(tied.unflatten(gdef, xs))["mid"].weight
    )
    assert ((40, 7), "float32") not in grads  # tied.grad hands the loss the view, not the table
    # the reference: materialising the view makes the table
    assert ((40, 7), "float32") in shapes(
        lambda xs: tied.materialize(tied.unflatten(gdef, xs)["embed"].weight)
    )


def test_int8_gpt2_logits_within_two_percent(gpt2):
    model = gpt2.GPT2(CONFIG, key=jax.random.key(0))
    q = tied.nn.quantize(model, lambda path, layer: True)  # every Dense and Embedding
    assert q.head.weight is q.wte.weight and isinstance(q.wte.weight, tied.View)
    assert sum(x.dtype == jnp.int8 for x in tied.flatten(q)[0]) == 2 + 4 * CONFIG["n_layer"]  # wte once
    want, got = model(IDS), q(IDS)
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 0.02
    np.testing.assert_allclose(tied.jit(lambda m: m(IDS))(q), got, rtol=1e-5, atol=1e-5)


def test_the_checkpoint_holds_the_integer_table_once(gpt2, tmp_path):
    model = gpt2.GPT2(CONFIG, key=jax.random.key(0))
    q = tied.nn.quantize(model, ".head")
    path = str(tmp_path / "q.safetensors")
    tied.save(path, q)
    vocab, dim = CONFIG["vocab_size"], CONFIG["n_embd"]
    with safe_open(path, "numpy") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    tables = [k for k, x in stored.items() if x.dtype == np.int8]
    assert len(tables) == 1 and stored[tables[0]].shape == (vocab, dim)
    assert sum(x.nbytes for x in stored.values() if x.shape == (vocab, dim)) == vocab * dim  # no float copy
    float_path = str(tmp_path / "f.safetensors")
    tied.save(float_path, model)
    saved = os.path.getsize(float_path) - os.path.getsize(path)
    assert saved >= vocab * dim * 3 - vocab * 4 - 1024  # 4 bytes -> 1 a value, minus scales and manifest
    back = tied.load(path, q)
    assert back.head.weight is back.wte.weight
    np.testing.assert_array_equal(back.wte.weight.source[0], q.wte.weight.source[0])
    np.testing.assert_allclose(back(IDS), q(IDS), rtol=1e-6)


def test_integers_and_scales_are_not_trained_unless_trainable_says_so():
    m = tied_models()[1]
    q = tied.nn.quantize(m, "['embed']")
    table, scale = q["embed"].weight.source
    assert tied.param_count(q) == tied.param_count(m) - 40 * 7  # neither counts
    ids = jnp.array([3, 0, 39])

    def loss(mm):
        return (run(mm, ids) ** 2).mean()

    tx = optax.adam(0.05)
    state = tied.optim.setup(tx, q)
    q2 = q
    for _ in range(3):
        q2, state = tied.optim.update(state, q2, tied.grad(loss)(q2))
    assert q2["embed"].weight.source[0] is table and q2["embed"].weight.source[1] is scale
    assert q2["head"].weight is q2["embed"].weight
    assert not np.allclose(q2["mid"].weight, q["mid"].weight)  # the float layer did train
    # scales selected by trainable=: their gradient is plain JAX's, by hand
    g = tied.grad(loss, trainable=lambda p, x: p.endswith(".source[1]"))(q)
    w, b = q["mid"].weight, q["mid"].bias
    t = np.asarray(table, np.float32)

    def hand(s):
        rows = t[np.asarray(ids)] * s[ids][:, None]
        return ((jnp.tanh(rows @ w.T + b) @ (t * s[:, None]).T) ** 2).mean()

    np.testing.assert_allclose(g["embed"].weight.source[1], jax.grad(hand)(scale), rtol=1e-5, atol=1e-7)
    assert g["embed"].weight.source[0] is None and g["mid"].weight is None


def test_bad_input_names_the_place_and_leaves_the_model_alone():
    m = {
        "embed": Embedding(jnp.arange(12).reshape(4, 3)),
        "ln": LayerNorm(3),
        "head": Dense(3, 4, key=jax.random.key(0)),
        "cell": tied.State(jnp.ones((2, 2))),
    }
    before = tied.flatten(m)[0]
    with pytest.raises(ValueError, match=r"bits=3; use bits=8"):
        tied.nn.quantize(m, "['head']", bits=3)
    with pytest.raises(ValueError, match=r"\['embed'\]\.weight has dtype int32; only float weights"):
        tied.nn.quantize(m, "['embed']")
    with pytest.raises(ValueError, match=r"\['head'\]\.bias has shape \(4,\); only 2-D weights"):
        tied.nn.quantize(m, ["['head']", "['head'].bias"])
    with pytest.raises(ValueError, match=r"\['ln'\] is a LayerNorm; only the weight of a Dense"):
        tied.nn.quantize(m, "['ln']")
    with pytest.raises(ValueError, match=r"\['cell'\]\.value is state .*not a weight"):
        tied.nn.quantize(m, "['cell'].value")
    with pytest.raises(ValueError, match=r"selects no place.*\['head'\]"):
        tied.nn.quantize(m, lambda path, layer: False)
    with pytest.raises(ValueError, match=r"selects no place"):
        tied.nn.quantize(m, [])
    with pytest.raises(KeyError, match=r"'\.nope' is not a place of the model"):
        tied.nn.quantize(m, ".nope")
    after = tied.flatten(m)[0]
    assert len(after) == len(before) and all(a is b for a, b in zip(before, after))


def test_a_large_table_is_multiplied_a_block_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(tied.nn._quant.Dequantize, "ROWS", 4)  # 11 rows: 2 blocks of 4 and 3 rows
    w = jax.random.normal(jax.random.key(5), (11, 6))
    q = tied.nn.quantize({"d": Dense(w)}, "['d']")
    table, scale = q["d"].weight.source
    h = jax.random.normal(jax.random.key(6), (2, 3, 6))
    dense = np.asarray(table, np.float32) * np.asarray(scale)[:, None]  # by hand
    np.testing.assert_allclose(q["d"](h), np.asarray(h) @ dense.T, rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda t, s: q["d"].weight.fn.matmul_t(h, t, s))(table, scale)
    floats = [v.aval.shape for e in jaxpr.jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float32]
    assert (11, 6) not in floats and (12, 6) not in floats
    g = jax.grad(lambda h: (q["d"](h) ** 2).sum())(h)
    np.testing.assert_allclose(g, 2 * (np.asarray(h) @ dense.T) @ dense, rtol=1e-4, atol=1e-4)
