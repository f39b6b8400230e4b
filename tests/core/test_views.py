"""Derived ties: tied.view / tied.transpose as places of the model."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied.nn import Dense

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (5, 4))


@tied.register
class AutoEncoder:
    def __init__(self, enc, dec):
        self.enc, self.dec = enc, dec

    def __call__(self, x):
        return self.dec(jnp.tanh(self.enc(x)))


def make_ae():
    enc = Dense(4, 3, key=KEY)
    return AutoEncoder(enc, Dense(tied.transpose(enc.weight), jnp.zeros(4)))


def loss(m):
    return ((m(X) - X) ** 2).mean()


def untied_loss(w_enc, b_enc, w_dec, b_dec):
    """The same loss with the decoder weight a separate argument (shape (4, 3))."""
    return ((jnp.tanh(X @ w_enc.T + b_enc) @ w_dec.T + b_dec - X) ** 2).mean()


def reference_total(m):
    w, b = m.enc.weight, m.enc.bias
    gw_enc, gb, gw_dec, gbd = jax.grad(untied_loss, argnums=(0, 1, 2, 3))(w, b, w.T, m.dec.bias)
    return gw_enc + gw_dec.T, gb, gbd  # the view's partial flows back through the transpose


def test_one_parameter_and_the_tie_is_listed():
    m = make_ae()
    leaves, _ = tied.flatten(m)
    assert len(leaves) == 3  # enc.weight, enc.bias, dec.bias: the view adds no parameter
    assert leaves[0] is m.enc.weight
    assert tied.ties(m) == [(".enc.weight", ".dec.weight.source")]
    assert m.dec.weight.shape == (4, 3) and m.dec.weight.dtype == jnp.float32
    np.testing.assert_allclose(tied.materialize(m.dec.weight), m.enc.weight.T)


def test_gradient_flows_to_the_source_and_the_view_gradient_aliases_it():
    m = make_ae()
    g = tied.grad(loss)(m)
    assert isinstance(g.dec.weight, tied.View)
    assert g.dec.weight.source is g.enc.weight
    assert g.dec.weight.fn is m.dec.weight.fn
    total_w, total_b, total_bd = reference_total(m)
    np.testing.assert_allclose(g.enc.weight, total_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g.enc.bias, total_b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g.dec.bias, total_bd, rtol=1e-5, atol=1e-7)


def test_per_location_view_gradient_and_accumulate():
    m = make_ae()
    p = tied.grad(loss, per_location=True)(m)
    assert isinstance(p.dec.weight, tied.View)
    assert p.dec.weight.source is not p.enc.weight
    w, b = m.enc.weight, m.enc.bias
    gw_enc, _, gw_dec, _ = jax.grad(untied_loss, argnums=(0, 1, 2, 3))(w, b, w.T, m.dec.bias)
    np.testing.assert_allclose(p.enc.weight, gw_enc, rtol=1e-5, atol=1e-7)
    # the view's partial, taken with respect to the source (shape of enc.weight)
    np.testing.assert_allclose(p.dec.weight.source, gw_dec.T, rtol=1e-5, atol=1e-7)
    a = tied.accumulate(m, p)
    assert a.dec.weight.source is a.enc.weight
    np.testing.assert_allclose(a.enc.weight, reference_total(m)[0], rtol=1e-5, atol=1e-7)


def test_after_unflatten_the_view_follows_the_new_source():
    m = make_ae()
    leaves, gdef = tied.flatten(m)
    new = tied.unflatten(gdef, [2.0 * x for x in leaves])
    assert isinstance(new.dec.weight, tied.View)
    assert new.dec.weight.source is new.enc.weight
    np.testing.assert_allclose(tied.materialize(new.dec.weight), 2.0 * m.enc.weight.T)


def _adam_reference(m, steps, lr=1e-2):
    """Adam stepped by hand (through optax) on the unique parameters with the total gradient."""
    tx = optax.adam(lr)
    params = [m.enc.weight, m.enc.bias, m.dec.bias]
    state = tx.init(params)
    for _ in range(steps):
        cur = AutoEncoder(Dense(params[0], params[1]), Dense(tied.transpose(params[0]), params[2]))
        grads = list(reference_total(cur))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_optimiser_steps_the_source_once_and_the_view_follows():
    m = make_ae()
    tx = optax.adam(1e-2)
    state = tied.optim.setup(tx, m)
    n_unique = len(tied.flatten(m)[0])
    adam = state.inner_state[0]
    assert len(adam.mu) == len(adam.nu) == n_unique == 3  # one entry per unique parameter
    cur = m
    for _ in range(3):
        g = tied.grad(loss)(cur)
        cur, state = tied.optim.update(state, cur, g)
        assert cur.dec.weight.source is cur.enc.weight  # the tie holds after each step
    ref = _adam_reference(m, 3)
    np.testing.assert_allclose(cur.enc.weight, ref[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cur.enc.bias, ref[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cur.dec.bias, ref[2], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tied.materialize(cur.dec.weight), ref[0].T, rtol=1e-5, atol=1e-7)
    # the input model is untouched
    assert m.dec.weight.source is m.enc.weight and m is not cur


def test_jitted_step_with_a_view_matches_eager():
    m = make_ae()
    tx = optax.adam(1e-2)
    state = tied.optim.setup(tx, m)

    @tied.jit
    def step(model, state):
        g = tied.grad(loss)(model)
        return tied.optim.update(state, model, g)

    cur = m
    for _ in range(3):
        cur, state = step(cur, state)
        assert isinstance(cur.dec.weight, tied.View) and cur.dec.weight.source is cur.enc.weight
    ref = _adam_reference(m, 3)
    np.testing.assert_allclose(cur.enc.weight, ref[0], rtol=1e-5, atol=1e-6)


def test_graph_through_jax_jit_keeps_the_view():
    m = make_ae()
    graph = tied.Graph(m)
    assert len(jax.tree_util.tree_leaves(graph)) == 3
    out = jax.jit(lambda gr: gr)(graph).value
    assert out.dec.weight.source is out.enc.weight
    y = jax.jit(lambda gr: gr.value(X))(graph)
    np.testing.assert_allclose(y, m(X), rtol=1e-5, atol=1e-6)


def test_a_source_found_nowhere_else_is_the_parameter():
    """Decision: legal. The walk reaches the source through the view, so it is a parameter
    of the model whose only place is `<view>.source` (a reparametrisation)."""
    raw = jnp.array([-1.0, 0.0, 2.0])
    model = {"scale": tied.view(raw, jax.nn.softplus)}
    leaves, _ = tied.flatten(model)
    assert len(leaves) == 1 and leaves[0] is raw
    assert tied.ties(model) == []
    x = jnp.array([1.0, 2.0, 3.0])
    g = tied.grad(lambda m: (tied.materialize(m["scale"]) * x).sum())(model)
    assert isinstance(g["scale"], tied.View)
    np.testing.assert_allclose(g["scale"].source, jax.nn.sigmoid(raw) * x, rtol=1e-6)
    # a sub-model alone: the decoder of an autoencoder, whose source lives in the encoder
    ae = make_ae()
    assert tied.flatten(ae.dec)[0][0] is ae.enc.weight


def test_replacing_the_source_by_assignment_unties_and_ties_shows_it():
    m = make_ae()
    m.enc.weight = m.enc.weight + 0.0  # a new array: the view still reads the old one
    assert tied.ties(m) == []
    assert len(tied.flatten(m)[0]) == 4


def test_view_of_a_view():
    w = jax.random.normal(KEY, (3, 2))
    twice = tied.transpose(tied.transpose(w))
    np.testing.assert_allclose(tied.materialize(twice), w)
    assert twice.shape == (3, 2)
    model = {"a": w, "b": twice}
    g = tied.grad(lambda m: (m["a"] * tied.materialize(m["b"])).sum())(model)
    assert g["b"].source.source is g["a"]
    np.testing.assert_allclose(g["a"], 2 * w, rtol=1e-6)


def test_a_view_function_failing_on_the_source_shape_names_the_path():
    w = jnp.ones((3, 4))
    model = {"enc": Dense(w), "dec": [tied.view(w, lambda s: s.reshape(5, 7))]}
    with pytest.raises(tied.GraphError, match=r"\['dec'\]\[0\]: .*shape \(3, 4\)"):
        tied.grad(lambda m: m["enc"](jnp.ones(4)).sum())(model)
    # eagerly, a layer given such a view fails at once with JAX's own message
    with pytest.raises(TypeError, match=r"cannot reshape array of shape \(3, 4\)"):
        Dense(tied.view(w, lambda s: s.reshape(5, 7)))


def test_a_view_over_none_names_the_path():
    with pytest.raises(TypeError, match=r"tied.transpose: the source must be an array .* got NoneType"):
        tied.transpose(None)
    model = {
        "dec": tied.View(None, sys.modules["tied._core.view"]._transpose),
        "w": jnp.ones(2),
    }  # built by hand
    with pytest.raises(tied.GraphError, match=r"\['dec'\]: .*transpose"):
        tied.grad(lambda m: m["w"].sum())(model)


def test_a_view_of_a_whole_layer_is_refused_with_the_fix():
    layer = Dense(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"got Dense\. To tie to a whole layer, put the layer"):
        tied.view(layer, lambda d: d)


def test_view_shape_and_dtype_without_computing_and_for_numpy_functions():
    calls = []

    def counted(w):
        calls.append(type(w).__name__)
        return w[:, :2]

    v = tied.view(jnp.ones((3, 4)), counted)
    assert v.shape == (3, 2) and v.dtype == jnp.float32
    assert all("Tracer" in c for c in calls)  # traced by eval_shape, never run on the data
    w = np.ones((2, 3), dtype=np.float32)
    v = tied.view(w, lambda a: np.asarray(a).T)  # not traceable: computed instead
    assert v.shape == (3, 2) and v.dtype == np.float32
    twice = tied.transpose(tied.view(jnp.ones((2, 5)), counted))  # a view of a view
    assert twice.shape == (2, 2)


def test_view_constructor_and_materialize_of_plain_values():
    with pytest.raises(TypeError, match=r"fn must be callable"):
        tied.view(jnp.ones(2), "transpose")
    x = jnp.ones(2)
    assert tied.materialize(x) is x
    assert "transpose" in repr(tied.transpose(jnp.ones((2, 3))))


# ---------------------------------------------------------------- a view acts as its array


@tied.register
class Careless:
    """A layer that never calls tied.materialize: it uses its weight as an array."""

    def __init__(self, w, u):
        self.w, self.u = w, u

    def __call__(self, x):
        w = self.w  # may be a View
        h = jnp.tanh(x @ w.T + 1) * jax.nn.relu(w[0] - 0.5).sum()  # .T, +, indexing, -, .sum()
        h = h + (2.0 * w).mean() / w.shape[0] + w.ndim + (w > 0).astype(w.dtype).sum()
        return (self.u @ h.T).sum() + (-w).max() + abs(w).min() + (w**2).sum() / w.size + jnp.sum(w @ w.T)


def _careless_model():
    u = jax.random.normal(jax.random.key(3), (3, 4))
    return Careless(tied.transpose(u), u), u  # w is u.T: one parameter at two places


def _careless_reference(u):
    """The loss with the two places of u as separate arrays: plain jax.grad, summed by hand."""

    def f(w_place, u_place):
        w = w_place
        h = jnp.tanh(X[:, :3] @ w.T + 1) * jax.nn.relu(w[0] - 0.5).sum()
        h = h + (2.0 * w).mean() / w.shape[0] + w.ndim + (w > 0).astype(w.dtype).sum()
        return (u_place @ h.T).sum() + (-w).max() + abs(w).min() + (w**2).sum() / w.size + jnp.sum(w @ w.T)

    gw, gu = jax.grad(f, argnums=(0, 1))(u.T, u)
    return f(u.T, u), gu + gw.T


def test_a_view_acts_as_its_array_outside_and_inside_every_transform():
    m, u = _careless_model()
    x = X[:, :3]
    want_value, want_grad = _careless_reference(u)
    loss_fn = lambda mod: mod(x)  # noqa: E731
    # eagerly, outside any transform: the layer code that works inside tied.grad works here too
    np.testing.assert_allclose(loss_fn(m), want_value, rtol=1e-5)
    # inside tied.grad (views materialised) and tied.jit (views over traced sources)
    g = tied.grad(loss_fn)(m)
    np.testing.assert_allclose(g.u, want_grad, rtol=1e-5, atol=1e-6)
    assert g.w.source is g.u  # the view's gradient is a view of the one total
    value, gj = tied.jit(tied.value_and_grad(loss_fn))(m)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    np.testing.assert_allclose(gj.u, want_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tied.jit(loss_fn)(m), want_value, rtol=1e-5)
    # plain jax.grad and jax.jit over tied.Graph: the view is a View of a tracer there
    gg = jax.jit(jax.grad(lambda G: loss_fn(G.value)))(tied.Graph(m)).value
    np.testing.assert_allclose(gg.u, want_grad, rtol=1e-5, atol=1e-6)


def test_view_operators_on_both_sides_match_the_array():
    u = jnp.arange(6.0).reshape(2, 3) - 2.0
    v, a = tied.transpose(u), u.T
    cases = {
        "v + 1": (v + 1, a + 1), "1 + v": (1 + v, 1 + a), "v - a": (v - a, a - a), "2 - v": (2 - v, 2 - a),
        "v * v": (v * v, a * a), "3 * v": (3 * v, 3 * a), "v / 2": (v / 2, a / 2),
        "1 / (v + 5)": (1 / (v + 5), 1 / (a + 5)),
        "v // 2": (v // 2, a // 2), "v % 2": (v % 2, a % 2), "v ** 2": (v**2, a**2), "2 ** v": (2**v, 2**a),
        "v @ x": (v @ jnp.ones(2), a @ jnp.ones(2)), "x @ v": (jnp.ones(3) @ v, jnp.ones(3) @ a),
        "v.T": (v.T, a.T), "v[1:, 0]": (v[1:, 0], a[1:, 0]), "v[v > 0]": (v[v > 0], a[a > 0]),
        "v < 0": (v < 0, a < 0), "0 < v": (0 < v, 0 < a), "v >= 1": (v >= 1, a >= 1), "-v": (-v, -a),
        "abs(v)": (abs(v), abs(a)), "np + v": (np.ones(2) + v, np.ones(2) + a),
        "relu": (jax.nn.relu(v), jax.nn.relu(a)),
        "reshape": (v.reshape(-1), a.reshape(-1)), "astype": (v.astype(jnp.int32), a.astype(jnp.int32)),
    }  # fmt: skip
    for name, (got, want) in cases.items():
        assert not isinstance(got, tied.View), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert (v.shape, v.dtype, v.ndim, v.size, len(v)) == (a.shape, a.dtype, a.ndim, a.size, len(a))
    assert float(tied.view(jnp.array(2.0), jnp.square)) == 4.0
    assert [np.asarray(r).tolist() for r in v] == np.asarray(a).tolist()
    # == stays identity: a View is a node of the graph (compare values through tied.materialize)
    assert (v == v) is True and (v != tied.transpose(u)) is True and {v: 1}[v] == 1


def test_what_a_view_cannot_do_names_materialize():
    v = tied.transpose(jnp.ones((2, 3)))
    with pytest.raises(AttributeError, match=r"no attribute 'at'.*tied\.materialize\(x\)\.at"):
        v.at[0].set(1.0)
    with pytest.raises(AttributeError, match=r"no attribute 'block_until_ready'.*tied\.materialize"):
        v.block_until_ready()
    # a jitted jnp function abstracts its arguments, which JAX refuses for __jax_array__ objects
    with pytest.raises(
        ValueError, match=r"tied\.View .* passed to a jitted jax function.*tied\.materialize\(view\)"
    ):
        jnp.tanh(v)
    np.testing.assert_array_equal(jnp.tanh(tied.materialize(v)), jnp.tanh(jnp.ones((3, 2))))


def test_a_view_copies_and_pickles():
    import copy
    import pickle

    v = tied.transpose(jnp.arange(6.0).reshape(2, 3))
    for w in (copy.copy(v), copy.deepcopy(v), pickle.loads(pickle.dumps(v))):
        assert type(w) is tied.View and w.shape == (3, 2)
        np.testing.assert_array_equal(tied.materialize(w), np.arange(6.0).reshape(2, 3).T)
