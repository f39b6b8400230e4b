"""A review of `tied.nn.quantize` and views of several sources: summaries, freezing, and attacks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied.nn import Dense, Embedding


def tied_lm(vocab=6, dim=4):
    """An embedding tied to its head (``Dense(embed.weight)``) and a float layer between."""
    emb = Embedding(vocab, dim, key=jax.random.key(0))
    return {"embed": emb, "mid": Dense(dim, dim, key=jax.random.key(1)), "head": Dense(emb.weight)}


def rows(text):
    """The summary's rows by path: the cells split on runs of two or more spaces."""
    out = {}
    for line in text.splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        out[cells[0]] = cells
    return out


def test_summary_shows_a_quantized_views_shape_and_sources_and_counts_as_param_count():
    m = tied_lm()
    q = tied.nn.quantize(m, "['head']")
    r = rows(tied.summary(q))
    src = "(['embed'].weight.source[0], ['embed'].weight.source[1])"
    # the view stands for the float table: its shape and dtype, by hand from the model
    assert r["['embed'].weight"][1:] == ["View", "(6, 4)", "float32", "0", f"dequantize8 of {src}"]
    assert r["['head'].weight"][-1] == f"dequantize8 of {src}, tied to ['embed'].weight"
    assert r["['embed'].weight.source[0]"][1:] == ["Array", "(6, 4)", "int8", "0"]
    # the scales are a constant (not trained unless trainable= says so): not counted
    assert r["['embed'].weight.source[1]"][1:] == ["Array", "frozen", "(6,)", "float32", "0"]
    mid = 4 * 4 + 4  # the only parameters left, counted by hand
    assert tied.param_count(q) == mid
    assert tied.summary(q).splitlines()[-2] == (
        f"parameters: {mid} unique, {mid} per place (the params column counts per place)"
    )
    assert r["<root>"][-1] == str(mid)


def test_summary_of_a_view_of_two_float_sources_and_of_a_view_of_it():
    a, b = jnp.ones((2, 3)), jnp.ones(3)
    v = tied.view((a, b), lambda a, b: (a * b).T)
    vv = tied.view(v, lambda x: x[:1])  # a view of a view of several sources
    r = rows(tied.summary({"v": v, "vv": vv, "b": b}))
    # a dict's keys are walked sorted: b is first met at ['b']
    assert r["['v']"][1:] == ["View", "(3, 2)", "float32", "9", "<lambda> of (['v'].source[0], ['b'])"]
    assert r["['vv']"][1:4] == ["View", "(1, 2)", "float32"]
    assert tied.param_count({"v": v, "vv": vv, "b": b}) == 6 + 3


def freeze_case():
    q = tied.nn.quantize(tied_lm(), ["['head']", "['mid']"])
    scales = lambda p, x: not jnp.issubdtype(x.dtype, jnp.integer)  # noqa: E731  (train the scales)
    return q, scales


def adam_by_hand(params, grads, steps, lr=0.1):
    """Adam written out (optax's defaults: b1 0.9, b2 0.999, eps 1e-8)."""
    m = {k: np.zeros_like(v) for k, v in params.items()}
    s = {k: np.zeros_like(v) for k, v in params.items()}
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for t in range(1, steps + 1):
        for k in p:
            g = np.asarray(grads[k], np.float64)
            m[k] = 0.9 * m[k] + 0.1 * g
            s[k] = 0.999 * s[k] + 0.001 * g * g
            p[k] = p[k] - lr * (m[k] / (1 - 0.9**t)) / (np.sqrt(s[k] / (1 - 0.999**t)) + 1e-8)
    return p


def test_freeze_by_a_quantized_view_freezes_its_trained_scales_at_every_place():
    q, scales = freeze_case()
    tx = optax.adam(0.1)
    state = tied.optim.setup(tx, q, trainable=scales)
    frozen = tied.optim.freeze(state, q["head"].weight, model=q)  # the head's view: the tied table's
    by_path = tied.optim.freeze(state, "['embed'].weight.source[1]")
    assert dict(frozen.frozen).keys() == dict(by_path.frozen).keys() == {"['embed'].weight.source[1]"}
    g = tied.map(lambda x: jnp.ones_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else None, q)
    new, _ = tied.optim.update(frozen, q, g, convention="total")
    # the frozen table's scales did not move; the mid layer's scales and bias moved by Adam's step
    assert new["embed"].weight.source[1] is q["embed"].weight.source[1]
    assert new["head"].weight is new["embed"].weight
    want = adam_by_hand({"s": q["mid"].weight.source[1]}, {"s": np.ones(4)}, 1)["s"]
    np.testing.assert_allclose(new["mid"].weight.source[1], want, rtol=1e-5, atol=1e-6)
    thawed = tied.optim.thaw(frozen, q["embed"].weight, model=q)
    assert not any(bool(v) for v in dict(thawed.frozen).values())


def test_freeze_by_a_quantized_view_with_nothing_trainable_is_refused_naming_its_sources():
    q, _ = freeze_case()
    state = tied.optim.setup(optax.adam(0.1), q)  # the default: integers and scales not trained
    with pytest.raises(
        ValueError,
        match=r"tied.View of 2 sources\) holds no trainable.*\['embed'\]\.weight\.source\[0\] \(int8\)",
    ):
        tied.optim.freeze(state, q["head"].weight, model=q)


def floats(p, x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def test_a_weight_also_used_transposed_is_quantized_once_and_differentiates_through_both():
    enc = Dense(3, 5, key=jax.random.key(0))
    m = {"enc": enc, "dec": Dense(tied.transpose(enc.weight))}  # the decoder reads enc.weight.T
    q = tied.nn.quantize(m, "['enc']")
    assert q["dec"].weight.source is q["enc"].weight  # the tie is kept: transpose of the quantized table
    table, scale = q["enc"].weight.source
    x = jnp.arange(3.0) / 3

    def loss(mm):
        return (mm["dec"](jnp.tanh(mm["enc"](x))) ** 2).sum()

    def hand(s):  # the table by hand from its integers, used at both places
        w = np.asarray(table, np.float32) * s[:, None]
        return ((jnp.tanh(x @ w.T + q["enc"].bias) @ w) ** 2).sum()

    np.testing.assert_allclose(loss(q), hand(scale), rtol=1e-6)
    g = tied.grad(loss, trainable=floats)(q)  # a view over a view that stays a view under tied.grad
    np.testing.assert_allclose(g["enc"].weight.source[1], jax.grad(hand)(scale), rtol=1e-5, atol=1e-6)
    assert g["dec"].weight.source is g["enc"].weight
    np.testing.assert_allclose(tied.jit(loss)(q), hand(scale), rtol=1e-6)


def test_a_4_bit_file_of_another_column_count_is_refused_not_loaded(tmp_path):
    # 6 and 5 columns pack into 3 bytes a row: the sources have one shape, the tables do not
    six = jax.random.normal(jax.random.key(0), (3, 6))
    q6 = tied.nn.quantize({"d": Dense(six)}, "['d']", bits=4)
    q5 = tied.nn.quantize({"d": Dense(six[:, :5])}, "['d']", bits=4)
    assert q6["d"].weight.source[0].shape == q5["d"].weight.source[0].shape == (3, 3)
    path = tmp_path / "q6.safetensors"
    tied.save(path, q6)
    with pytest.raises(tied.CheckpointError, match=r"view at \['d'\]\.weight differs.*cols5.*cols6"):
        tied.load(path, q5)
    back = tied.load(path, q6)  # the same layout still loads, the table as saved (by hand: 6 columns)
    np.testing.assert_array_equal(tied.materialize(back["d"].weight), tied.materialize(q6["d"].weight))
    assert tied.materialize(back["d"].weight).shape == six.shape


def test_a_quantized_model_can_be_donated_to_tied_jit():
    q = tied.nn.quantize(Dense(4, 3, key=jax.random.key(1)), "")
    want = np.asarray(tied.materialize(q.weight)) @ np.ones(4) + np.asarray(q.bias)
    y = tied.jit(lambda m, x: m(x), donate_argnums=0)(q, jnp.ones(4))
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(q(jnp.ones(4)), want, rtol=1e-6)  # still usable: not rebound


def test_scales_trained_in_place_by_update_inplace():
    q = tied.nn.quantize({"d": Dense(3, 2, key=jax.random.key(0))}, "['d']")
    table, scale = q["d"].weight.source
    x, b = jnp.arange(3.0), q["d"].bias

    def hand(s):
        return ((x @ (np.asarray(table, np.float32) * s[:, None]).T + b) ** 2).sum()

    state = tied.optim.setup(optax.adam(0.1), q, trainable=floats)
    grads = tied.grad(lambda m: (m["d"](x) ** 2).sum(), trainable=floats)(q)
    tied.optim.update_inplace(state, q, grads)
    want = adam_by_hand({"s": scale}, {"s": jax.grad(hand)(scale)}, 1)["s"]
    np.testing.assert_allclose(q["d"].weight.source[1], want, rtol=1e-5, atol=1e-6)
