"""tied.jit and tied.Graph: ties survive JAX transforms; caches never go stale."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Chain, Dense

import tied


def dense(key, n_in=3, n_out=3, activation=jnp.tanh):
    kw, kb = jax.random.split(key)
    return Dense(jax.random.normal(kw, (n_out, n_in)), jax.random.normal(kb, (n_out,)), activation)


def seed_model():
    d1 = dense(jax.random.key(0))
    return Chain(d1, Dense(d1.weight, d1.bias, jnp.tanh), d1)


def loss(m, x):
    return jnp.sum(m(x) ** 2)


def untied_reference_grad(model, x):
    """Per-place gradients of an untied copy from plain jax.grad, summed per tie by hand."""
    layers = [(jnp.array(layer.weight), jnp.array(layer.bias)) for layer in model.layers]

    def f(layers):
        h = x
        for (w, b), layer in zip(layers, model.layers):
            h = layer.activation(h @ w.T + b)
        return jnp.sum(h**2)

    per_place = jax.grad(f)(layers)
    groups = {}
    for (gw, gb), layer in zip(per_place, model.layers):
        groups[id(layer.weight)] = groups.get(id(layer.weight), 0) + gw
        groups[id(layer.bias)] = groups.get(id(layer.bias), 0) + gb
    return groups


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


def test_jit_gradient_equals_reference_and_keeps_ties():
    model = seed_model()
    g = tied.jit(lambda m, x: tied.grad(loss)(m, x))(model, X)
    ref = untied_reference_grad(model, X)
    assert g.layers[0].weight is g.layers[1].weight
    assert g.layers[0] is g.layers[2]
    np.testing.assert_allclose(g.layers[0].weight, ref[id(model.layers[0].weight)], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g.layers[1].bias, ref[id(model.layers[0].bias)], rtol=1e-4, atol=1e-6)
    eager = tied.grad(loss)(model, X)
    np.testing.assert_allclose(g.layers[0].weight, eager.layers[0].weight, rtol=1e-4, atol=1e-6)


def test_outputs_are_one_dag_with_one_buffer_per_array():
    model = seed_model()
    out = tied.jit(lambda m: (m, m.layers[0].weight * 2))(model)
    new, doubled = out
    assert new.layers[0].weight is new.layers[1].weight
    assert new.layers[0] is new.layers[2]
    assert new.layers[0].activation is jnp.tanh
    np.testing.assert_allclose(doubled, model.layers[0].weight * 2)
    # the same output array returned at two places is one object
    a, b = tied.jit(lambda x: (x + 1, x + 1))(jnp.ones(2))
    assert a is not b  # two computations, two arrays
    y = tied.jit(lambda x: [x + 1] * 3)(jnp.ones(2))
    assert y[0] is y[1] is y[2]


def test_array_shared_across_arguments_is_one_input():
    w = jnp.arange(4.0)
    seen = []

    @tied.jit
    def f(a, b):
        seen.append(a["w"] is b[0])
        return a["w"] * 2, b[0]

    out_a, out_b = f({"w": w}, [w])
    assert seen == [True]  # one tracer: one input
    np.testing.assert_allclose(out_a, 2 * w)
    np.testing.assert_allclose(out_b, w)


def test_no_retrace_on_same_structure_and_retrace_on_new_sharing():
    traces = []

    @tied.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    model = seed_model()
    y1 = f(model, X)
    y2 = f(seed_model(), X)  # new arrays, same structure
    assert len(traces) == 1
    np.testing.assert_allclose(y1, y2)
    np.testing.assert_allclose(y1, model(X), rtol=1e-4, atol=1e-6)
    untied = Chain(
        *[Dense(jnp.array(layer.weight), jnp.array(layer.bias), jnp.tanh) for layer in model.layers]
    )
    y3 = f(untied, X)
    assert len(traces) == 2
    np.testing.assert_allclose(y3, y1, rtol=1e-4, atol=1e-6)


def test_donation_of_a_tied_model_works():
    model = seed_model()
    w0 = np.array(model.layers[0].weight, copy=True)  # np.asarray would pin the buffer

    def scale(m):
        leaves, gdef = tied.flatten(m)
        return tied.unflatten(gdef, [2 * x for x in leaves])

    donating = tied.jit(scale, donate_argnums=0)
    out = donating(model)
    np.testing.assert_allclose(out.layers[1].weight, 2 * w0)
    assert out.layers[0].weight is out.layers[1].weight
    assert model.layers[0].weight.is_deleted()  # donated once, no "donate twice" error
    other = seed_model()
    w = other.layers[0].weight
    again = tied.jit(lambda t: [2 * t[0]] * 2, donate_argnums=0)([w, w])  # one input, donated once
    assert again[0] is again[1] and w.is_deleted()


def test_array_also_held_by_a_kept_argument_is_not_donated():
    w = jnp.ones(3)
    f = tied.jit(lambda a, b: a[0] + b[0], donate_argnums=0)
    np.testing.assert_allclose(f([w], [w]), 2 * np.ones(3))
    assert not w.is_deleted()


def test_static_argnums_and_kwargs():
    traces = []

    def f(x, n, *, scale):
        traces.append(n)
        return x * n * scale

    g = tied.jit(f, static_argnums=1)
    np.testing.assert_allclose(g(jnp.ones(2), 3, scale=jnp.float32(2)), 6 * np.ones(2))
    np.testing.assert_allclose(g(jnp.ones(2), 3, scale=jnp.float32(5)), 15 * np.ones(2))
    np.testing.assert_allclose(g(jnp.ones(2), 4, scale=jnp.float32(1)), 4 * np.ones(2))
    assert traces == [3, 4]


def test_a_static_with_its_own_eq_is_keyed_by_identity():
    class Config:
        __hash__ = None

        def __eq__(self, other):
            return isinstance(other, Config)

    traces = []

    def f(m):
        traces.append(m["cfg"])
        return m["w"] * 2

    g = tied.jit(f)
    cfg = Config()
    g({"w": jnp.ones(2), "cfg": cfg})
    g({"w": jnp.zeros(2), "cfg": cfg})
    assert len(traces) == 1 and traces[0] is cfg
    g({"w": jnp.ones(2), "cfg": Config()})  # another object: its own trace, never the old one's
    assert len(traces) == 2 and traces[1] is not cfg


# ---------------------------------------------------------------- tied.Graph through JAX transforms


def test_graph_leaves_are_unique_and_jit_keeps_ties():
    model = seed_model()
    graph = tied.Graph(model)
    assert len(jax.tree_util.tree_leaves(graph)) == 2
    # A snapshot: the value is rebuilt from the arrays JAX sees, never the object passed in.
    assert graph.value is not model and graph.value.layers[0].weight is model.layers[0].weight
    out = jax.jit(lambda g: g)(graph).value
    assert out.layers[0].weight is out.layers[1].weight
    assert out.layers[0] is out.layers[2]
    assert jax.tree_util.tree_structure(graph) == jax.tree_util.tree_structure(tied.Graph(seed_model()))


def test_graph_jax_grad_gives_aliased_totals():
    model = seed_model()
    g = jax.grad(lambda gr: loss(gr.value, X))(tied.Graph(model)).value
    ref = untied_reference_grad(model, X)
    assert g.layers[0].weight is g.layers[1].weight
    np.testing.assert_allclose(g.layers[0].weight, ref[id(model.layers[0].weight)], rtol=1e-4, atol=1e-6)
    inside = jax.jit(lambda gr: tied.Graph(tied.grad(loss)(gr.value, X)))(tied.Graph(model)).value
    assert inside.layers[0].weight is inside.layers[1].weight
    np.testing.assert_allclose(inside.layers[0].weight, g.layers[0].weight, rtol=1e-4, atol=1e-6)


def test_graph_vmap_batched_copies_keep_ties_within_each_copy():
    keys = jax.random.split(jax.random.key(1), 4)

    def make(key):
        return tied.Graph(Chain(*([dense(key)] * 2)))

    batched = jax.vmap(make)(keys)
    assert batched.value.layers[0] is batched.value.layers[1]
    assert batched.value.layers[0].weight.shape == (4, 3, 3)
    ys = jax.vmap(lambda g, x: g.value(x), in_axes=(0, None))(batched, X)
    for i, key in enumerate(keys):
        np.testing.assert_allclose(ys[i], make(key).value(X), rtol=1e-4, atol=1e-6)


def test_graph_as_scan_carry_keeps_ties():
    graph = tied.Graph(seed_model())

    def body(g, _):
        m = g.value
        grads = tied.grad(loss)(m, X)
        leaves, gdef = tied.flatten(m)
        new = tied.unflatten(gdef, [p - 0.1 * d for p, d in zip(leaves, tied.flatten(grads)[0])])
        return tied.Graph(new), loss(m, X)

    final, losses = jax.lax.scan(body, graph, None, length=5)
    m = final.value
    assert m.layers[0].weight is m.layers[1].weight and m.layers[0] is m.layers[2]
    assert losses[-1] < losses[0]
    # the same five steps eagerly
    ref = seed_model()
    for _ in range(5):
        grads = tied.grad(loss)(ref, X)
        leaves, gdef = tied.flatten(ref)
        ref = tied.unflatten(gdef, [p - 0.1 * d for p, d in zip(leaves, tied.flatten(grads)[0])])
    np.testing.assert_allclose(m.layers[0].weight, ref.layers[0].weight, rtol=1e-4, atol=1e-6)


def test_graph_checkpoint_and_device_put():
    model = seed_model()
    f = jax.checkpoint(lambda g: loss(g.value, X))
    g = jax.grad(f)(tied.Graph(model)).value
    assert g.layers[0].weight is g.layers[1].weight
    ref = untied_reference_grad(model, X)
    np.testing.assert_allclose(g.layers[0].weight, ref[id(model.layers[0].weight)], rtol=1e-4, atol=1e-6)
    put = jax.device_put(tied.Graph(model), jax.devices()[0]).value
    assert put.layers[0].weight is put.layers[1].weight and put.layers[0] is put.layers[2]


# ---------------------------------------------------------------- caches never go stale


def test_stale_cache_structure_changes_are_followed():
    calls = []

    @tied.jit
    def f(m, x):
        calls.append(1)
        return tied.grad(loss)(m, x), m(x)

    model = seed_model()
    for _ in range(3):  # warm every cache, compiled plans included
        g, y = f(model, X)
    assert g.layers[0].weight is g.layers[1].weight
    # untie: a fresh copy of the weight at the second place
    model.layers[1] = Dense(jnp.array(model.layers[0].weight) + 1.0, model.layers[0].bias, jnp.tanh)
    g, y = f(model, X)
    assert g.layers[0].weight is not g.layers[1].weight
    np.testing.assert_allclose(y, model(X), rtol=1e-4, atol=1e-6)
    ref = untied_reference_grad(model, X)
    np.testing.assert_allclose(g.layers[1].weight, ref[id(model.layers[1].weight)], rtol=1e-4, atol=1e-6)
    # re-tie the other way and replace a layer
    model.layers[2] = model.layers[1]
    g, y = f(model, X)
    assert g.layers[1] is g.layers[2] and g.layers[0] is not g.layers[2]
    np.testing.assert_allclose(y, model(X), rtol=1e-4, atol=1e-6)
    model.layers[0].activation = jax.nn.relu  # a static field
    g, y = f(model, X)
    np.testing.assert_allclose(y, model(X), rtol=1e-4, atol=1e-6)
    # in-place value change with the same structure: new values, no retrace
    n = len(calls)
    model.layers[0].weight = model.layers[0].weight * 0.5
    g, y = f(model, X)
    np.testing.assert_allclose(y, model(X), rtol=1e-4, atol=1e-6)
    assert len(calls) == n


def test_flatten_plan_follows_every_kind_of_change():
    @dataclasses.dataclass
    class Box:
        a: object
        b: object

    def check(tree):
        leaves, gdef = tied.flatten(tree)
        ref_leaves, ref_gdef = tied._core.graph._walk(tree)
        assert gdef == ref_gdef
        assert [id(x) for x in leaves] == [id(x) for x in ref_leaves]
        rebuilt = tied.unflatten(gdef, leaves)
        assert tied.ties(rebuilt) == tied.ties(tree)

    w, v = jnp.ones(2), jnp.zeros(2)
    tree = {"x": [w, w, Box(v, 1)], "y": (v, "s")}
    for _ in range(3):
        check(tree)
    tree["x"][1] = jnp.ones(2)  # untie
    check(tree)
    tree["x"][1] = v  # tie to another array
    check(tree)
    tree["x"][2].b = 2  # static value
    check(tree)
    tree["x"][2].b = True  # equal to 1 but another type
    check(tree)
    tree["x"].append(w)  # arity
    check(tree)
    tree["x"][2] = [v]  # node type
    check(tree)
    tree["y"] = tree["x"]  # node shared
    check(tree)
    tree["x"].append(tree)  # cycle
    check(tree)
    tree["z"] = 3  # new key
    check(tree)
    # two distinct nodes holding the same arrays, then one node at both places:
    # the arrays alone cannot tell, the nodes' identity must
    pair = [Box(w, 1), Box(w, 1)]
    for _ in range(3):
        check(pair)
    pair[1] = pair[0]
    check(pair)
    assert tied.ties(pair) == [("[0]", "[1]")]


def test_equal_graphdefs_are_the_same_jax_type_so_jax_jit_does_not_retrace():
    traces = []

    @jax.jit
    def f(graph):
        traces.append(1)
        return graph.value(X).sum()

    a, b = seed_model(), seed_model()
    b.layers[0].weight = b.layers[0].weight + 1.0  # new values, same structure...
    b.layers[1].weight = b.layers[0].weight  # ...and the same sharing
    np.testing.assert_allclose(f(tied.Graph(a)), a(X).sum(), rtol=1e-5)
    np.testing.assert_allclose(f(tied.Graph(b)), b(X).sum(), rtol=1e-5)
    assert len(traces) == 1
    c = seed_model()
    c.layers[1] = Dense(c.layers[0].weight + 0.0, c.layers[0].bias, jnp.tanh)  # a tie cut
    np.testing.assert_allclose(f(tied.Graph(c)), c(X).sum(), rtol=1e-5)
    assert len(traces) == 2


def test_graph_is_a_snapshot_so_jax_and_value_always_agree():
    model = seed_model()
    x = jnp.ones((3, model.layers[0].weight.shape[1]))
    loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
    graph = tied.Graph(model)
    before = float(loss(model))
    state = tied.optim.setup(optax.sgd(0.1), model)
    g = tied.grad(loss)(model)
    tied.optim.update_inplace(state, model, g)  # the model changes in place after the Graph was made
    assert float(loss(model)) != before
    jitted = float(jax.jit(lambda G: loss(G.value))(graph))
    assert jitted == pytest.approx(float(loss(graph.value)), rel=1e-6) == pytest.approx(before, rel=1e-6)
    assert graph.value.layers[0].weight is graph.value.layers[1].weight


def test_a_nested_jit_writes_a_cell_inside_a_gradient_as_the_eager_loss_does():
    # Found by review: the write-back's escaping-tracer check, once shared with tied.jit, took the
    # gradient's own concrete copy of an undifferentiated cell for an object outside the trace.
    @tied.register_state
    class Ema:
        def __init__(self, n):
            self.value = jnp.zeros(n)

    def fwd(m, x):
        y = m["w"] * x
        m["ema"].value = 0.9 * m["ema"].value + 0.1 * y  # not stop-gradiented: a traced value
        return (y**2).sum()

    def build():
        return {"w": jnp.arange(3.0) + 1, "ema": Ema(3)}

    x = jnp.ones(3)
    eager, nested = build(), build()
    g_ref = tied.grad(fwd)(eager, x)
    g = tied.grad(lambda m, x: tied.jit(fwd)(m, x))(nested, x)
    np.testing.assert_allclose(g["w"], 2 * (np.arange(3.0) + 1))  # d/dw sum((w x)^2), by hand
    np.testing.assert_allclose(g["w"], g_ref["w"])
    np.testing.assert_allclose(nested["ema"].value, eager["ema"].value)
    np.testing.assert_allclose(nested["ema"].value, 0.1 * (np.arange(3.0) + 1))
    assert not isinstance(nested["ema"].value, jax.core.Tracer)
