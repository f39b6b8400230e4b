"""Implicit mode: tied.params, tied.gradient, Params and Grads.

References never go through `tied`: per-place partials from plain `jax.grad` on
a function with one argument per place, summed by hand per tied array.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Chain, Dense

import tied


def seed():
    d1 = Dense(jax.random.normal(jax.random.key(0), (2, 2)), jnp.zeros(2))
    d2 = Dense(d1.weight, d1.bias)
    return d1, d2, Chain(d1, d2), jnp.ones((1, 2))


def seed_reference(w, b, x):
    """Plain jax.grad with one argument per place, summed by hand."""
    f = lambda w1, b1, w2, b2: ((x @ w1.T + b1) @ w2.T + b2).sum()
    gw1, gb1, gw2, gb2 = jax.grad(f, argnums=(0, 1, 2, 3))(w, b, w, b)
    return gw1 + gw2, gb1 + gb2


def leaves_of(m):
    return tied.flatten(m)[0]


# ---------------------------------------------------------------- the seed, both modes


def test_seed_example_both_modes():
    d1, d2, c, x = seed()
    g = tied.grad(lambda m: m(x).sum())(c)
    gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
    want_w, want_b = seed_reference(d1.weight, d1.bias, x)
    np.testing.assert_allclose(gs[d1.weight], want_w, rtol=1e-6)
    np.testing.assert_allclose(gs[d2.bias], want_b, rtol=1e-6)
    np.testing.assert_allclose(gs[d1.weight], g.layers[0].weight, rtol=1e-6)
    assert g.layers[0].weight is g.layers[1].weight
    assert x not in gs and len(gs) == 2
    assert list(gs) == [d1.weight, d1.bias] and all(a is b for a, b in zip(gs, [d1.weight, d1.bias]))
    with pytest.raises(KeyError, match="keyed by identity"):
        gs[x]
    # the model is back as it was: same objects at every place
    assert c.layers[0] is d1 and d1.weight is d2.weight and type(d1.weight) is type(x)
    # to_tree is the explicit gradient, aliased the same way
    t = gs.to_tree(c)
    assert t.layers[0].weight is t.layers[1].weight is gs[d1.weight]
    np.testing.assert_allclose(t.layers[1].bias, g.layers[1].bias, rtol=1e-6)


def test_params_len_iter_in_and_paths():
    d1, d2, c, x = seed()
    c.steps = jnp.arange(3)  # an integer array: carried, not a parameter
    head = Dense(jnp.ones((1, 2)), jnp.zeros(1))
    c.layers.append(head)
    ps = tied.params(c)
    assert len(ps) == 4
    assert [p is q for p, q in zip(ps, [d1.weight, d1.bias, head.weight, head.bias])] == [True] * 4
    assert d2.weight in ps and head.bias in ps
    assert jnp.array(d1.weight) not in ps  # an equal copy is another object
    assert c.steps not in ps and x not in ps
    assert ps.paths(d2.weight) == [".layers[0].weight", ".layers[1].weight"]
    assert ps.paths(head.weight) == [".layers[2].weight"]
    with pytest.raises(KeyError, match="identity"):
        ps.paths(c.steps)
    assert ps[2] is head.weight


def test_params_is_live_after_update_inplace():
    d1, d2, c, x = seed()
    ps = tied.params(c)
    old = d1.weight
    state = tied.optim.setup(optax.sgd(0.1), c)
    tied.optim.update_inplace(state, c, tied.gradient(lambda: c(x).sum(), ps))
    assert old not in ps and d1.weight in ps and d2.weight is d1.weight
    want_w, _ = seed_reference(old, jnp.zeros(2), x)
    np.testing.assert_allclose(d1.weight, old - 0.1 * want_w, rtol=1e-6)


# ---------------------------------------------------------------- Grads algebra


def test_grads_arithmetic_and_items():
    d1, d2, c, x = seed()
    ps = tied.params(c)
    g1 = tied.gradient(lambda: c(x).sum(), ps)
    g2 = tied.gradient(lambda: (c(x) ** 2).sum(), ps)
    w, b = d1.weight, d1.bias
    for got, want in [
        (g1 + g2, lambda k: g1[k] + g2[k]),
        (g1 - g2, lambda k: g1[k] - g2[k]),
        (0.5 * g1, lambda k: 0.5 * g1[k]),
        (g1 * 2, lambda k: 2 * g1[k]),
        (g1 / 4, lambda k: g1[k] / 4),
        (-g1, lambda k: -g1[k]),
    ]:
        assert isinstance(got, tied.Grads) and list(got) == [w, b]
        for k in (w, b):
            np.testing.assert_allclose(got[k], want(k), rtol=1e-6)
    items = list(g1.items())
    assert items[0][0] is w and items[1][0] is b and items[0][1] is g1[w]
    # keys missing on one side count as zero
    other = tied.Grads([x], [jnp.full((1, 2), 3.0)])
    s = g1 - other
    assert len(s) == 3 and x in s
    np.testing.assert_allclose(s[x], -3.0)
    np.testing.assert_allclose(s[w], g1[w])
    with pytest.raises(TypeError):
        g1 * g2
    assert g1 == g1 and g1 != g2


def test_grads_to_tree_with_views_and_missing_keys():
    enc = Dense(jax.random.normal(jax.random.key(1), (3, 2)), jnp.zeros(3))
    dec = Dense(tied.transpose(enc.weight), jnp.zeros(2))
    m = Chain(enc, jnp.tanh, dec)
    x = jnp.ones((4, 2))
    gs = tied.gradient(lambda: (m(x) ** 2).sum(), tied.params(m))
    g = tied.grad(lambda mm: (mm(x) ** 2).sum())(m)
    assert len(gs) == 3  # enc.weight, enc.bias, dec.bias: the view is no parameter
    t = gs.to_tree(m)
    assert isinstance(t.layers[2].weight, tied.View) and t.layers[2].weight.source is t.layers[0].weight
    for a, b in zip(leaves_of(t), leaves_of(g)):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert dec.weight.source is enc.weight  # the view is back on the original array
    # by hand: loss = sum((tanh(x W^T + b) W + c)^2), W used twice
    w, b = enc.weight, enc.bias
    f = lambda w1, w2: ((jnp.tanh(x @ w1.T + b) @ w2 + dec.bias) ** 2).sum()
    gw1, gw2 = jax.grad(f, argnums=(0, 1))(w, w)
    np.testing.assert_allclose(gs[w], gw1 + gw2, rtol=1e-5)
    partial = tied.Grads([w], [gs[w]])
    pt = partial.to_tree(m)
    assert pt.layers[0].bias is None and pt.layers[0].weight is pt.layers[2].weight.source


# ---------------------------------------------------------------- containers


@dataclasses.dataclass
class Lin:
    w: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class FrozenLin:
    w: Any
    b: Any


@dataclasses.dataclass(slots=True)
class SlotLin:
    w: Any
    b: Any


@pytest.mark.parametrize("cls", [Lin, FrozenLin, SlotLin], ids=["dataclass", "frozen", "slots"])
def test_dicts_lists_and_dataclasses_match_explicit_mode(cls):
    w = jax.random.normal(jax.random.key(2), (2, 2))
    b = jnp.ones(2)
    model = {"a": cls(w, b), "b": [w, {"c": cls(w, 2 * b)}]}
    x = jnp.arange(4.0).reshape(2, 2)

    def loss(m):
        h = x @ m["a"].w + m["a"].b
        h = jnp.sin(h @ m["b"][0])
        return (h @ m["b"][1]["c"].w + m["b"][1]["c"].b).sum()

    gs = tied.gradient(lambda: loss(model), tied.params(model))
    g = tied.grad(loss)(model)
    assert len(gs) == 3
    np.testing.assert_allclose(gs[w], g["a"].w, rtol=1e-5)
    np.testing.assert_allclose(gs[b], g["a"].b, rtol=1e-5)
    assert model["a"].w is w and model["b"][0] is w and model["b"][1]["c"].w is w
    f = lambda w1, w2, w3: loss({"a": cls(w1, b), "b": [w2, {"c": cls(w3, 2 * b)}]})
    np.testing.assert_allclose(gs[w], sum(jax.grad(f, argnums=(0, 1, 2))(w, w, w)), rtol=1e-5)


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda w: {"ok": [w], "pair": (w, jnp.zeros(2))}, r"\['pair'\]\[0\]"),
        (lambda w: [eqx.nn.Linear(2, 2, key=jax.random.key(0))], r"\[0\]\.weight"),
    ],
    ids=["tuple", "equinox"],
)
def test_immutable_place_gives_clear_error_and_touches_nothing(make, path):
    w = jnp.ones((2, 2))
    model = make(w)
    before = leaves_of(model)
    called = []
    with pytest.raises(tied.GraphError, match=path + r": tied\.gradient .*explicit mode.*tied\.grad"):
        tied.gradient(lambda: called.append(1) or 0.0, tied.params(model))
    assert not called and all(a is b for a, b in zip(leaves_of(model), before))


# ---------------------------------------------------------------- restoring, threads


def test_model_restored_after_exception_inside_fun():
    d1, d2, c, x = seed()
    w, b = d1.weight, d1.bias
    seen = []

    def fun():
        seen.append(type(d1.weight))
        y = c(x).sum()
        raise ValueError("boom")
        return y

    with pytest.raises(ValueError, match="boom"):
        tied.gradient(fun, tied.params(c))
    assert seen and seen[0] is not type(w)  # fun did see traced values
    assert d1.weight is w and d2.weight is w and d1.bias is b and d2.bias is b
    # and a later gradient is still right
    gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
    np.testing.assert_allclose(gs[w], seed_reference(w, b, x)[0], rtol=1e-6)


def test_two_threads_on_one_model_do_not_corrupt_it():
    d1, d2, c, x = seed()
    w, b = d1.weight, d1.bias
    want = {1.0: seed_reference(w, b, x)[0], 2.0: 2 * seed_reference(w, b, x)[0]}
    results: dict = {1.0: [], 2.0: []}
    errors: list = []

    def work(scale):
        try:
            for _ in range(15):
                gs = tied.gradient(lambda: scale * c(x).sum(), tied.params(c))
                results[scale].append(gs[w])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for s in (1.0, 2.0):
        assert len(results[s]) == 15
        for r in results[s]:
            np.testing.assert_allclose(r, want[s], rtol=1e-6)
    assert d1.weight is w and d2.weight is w and d1.bias is b


# ---------------------------------------------------------------- under jit, and with optim


def test_inside_tied_jit_and_jax_jit_on_graph():
    d1, d2, c, x = seed()
    want_w, want_b = seed_reference(d1.weight, d1.bias, x)
    traces = []

    @tied.jit
    def tree_grad(m, x):
        traces.append(1)
        return tied.gradient(lambda: m(x).sum(), tied.params(m)).to_tree(m)

    for _ in range(2):
        t = tree_grad(c, x)
        assert t.layers[0].weight is t.layers[1].weight
        np.testing.assert_allclose(t.layers[0].weight, want_w, rtol=1e-6)
    assert len(traces) == 1

    @jax.jit
    def graph_grad(graph, x):
        m = graph.value
        gs = tied.gradient(lambda: m(x).sum(), tied.params(m))
        return gs[m.layers[0].weight], gs[m.layers[1].bias]

    gw, gb = graph_grad(tied.Graph(c), x)
    np.testing.assert_allclose(gw, want_w, rtol=1e-6)
    np.testing.assert_allclose(gb, want_b, rtol=1e-6)
    assert d1.weight is d2.weight and type(d1.weight) is type(x)


def test_grads_drive_the_optimiser_like_explicit_gradients():
    tx = optax.adam(0.1)
    d1, d2, c, x = seed()
    head = Dense(jnp.ones((1, 2)), jnp.zeros(1))
    c.layers.append(head)
    ec = tied.unflatten(*reversed(tied.flatten(c)))  # an equal model for the explicit path
    loss = lambda m: (m(x) ** 2).sum()
    s_i, s_e = tied.optim.setup(tx, c), tied.optim.setup(tx, ec)
    for _ in range(3):
        gs = tied.gradient(functools.partial(loss, c), tied.params(c))
        c, s_i = tied.optim.update(s_i, c, gs)
        ec, s_e = tied.optim.update(s_e, ec, tied.grad(loss)(ec))
        assert c.layers[0] is not c.layers[1] and c.layers[0].weight is c.layers[1].weight
        for a, b in zip(leaves_of(c), leaves_of(ec)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    # a Grads without some parameter leaves it unchanged
    gs = tied.gradient(lambda: loss(c), tied.params(c))
    partial = tied.Grads([c.layers[2].weight], [gs[c.layers[2].weight]])
    c2, _ = tied.optim.update(s_i, c, partial)
    assert c2.layers[0].weight is c.layers[0].weight and c2.layers[2].weight is not c.layers[2].weight


def test_errors_for_bad_arguments():
    d1, d2, c, x = seed()
    with pytest.raises(TypeError, match=r"params must be tied\.params\(model\)"):
        tied.gradient(lambda: c(x).sum(), [d1.weight])
    with pytest.raises(tied.GraphError, match="bare array"):
        tied.gradient(lambda: d1.weight.sum(), tied.params(d1.weight))
