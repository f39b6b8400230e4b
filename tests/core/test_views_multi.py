"""Views of several sources: ``tied.view((a, b, ...), fn)`` stands for ``fn(a, b, ...)``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

import tied
from tied.nn import Dense

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (5, 3))


def scaled_rows(w, s, k):
    """A float table ``w`` (4, 3) scaled per row by ``s`` (4,), rows picked by integers ``k``."""
    return (w * s[:, None])[k]


@tied.register
class Two:
    def __init__(self, first, second, plain):
        self.first, self.second, self.plain = first, second, plain

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x))) + self.plain(x)


def make():
    k1, k2, k3 = jax.random.split(KEY, 3)
    w = jax.random.normal(k1, (4, 3))
    s = jax.random.uniform(k2, (4,), minval=0.5, maxval=1.5)
    k = jnp.array([0, 1, 3], jnp.int32)  # an integer source: carried, never differentiated
    v = tied.view((w, s, k), scaled_rows)  # (3, 3), one object at two places
    plain = Dense(w[:3], None)  # a separate array (not tied)
    plain.weight = jnp.asarray(np.asarray(w[:3]) + 1.0)
    model = Two(Dense(v, None), Dense(v, jax.random.normal(k3, (3,))), plain)
    model.extra = w  # the float source also stands at a place of its own
    return model


def loss(m):
    return ((m(X) - 1.0) ** 2).mean() + (m.extra**2).sum() * 0.1


def hand_loss(w, s, b, p):
    """The same loss written by hand: each use of w and s spelled out."""
    k = jnp.array([0, 1, 3])
    v1, v2 = (w * s[:, None])[k], (w * s[:, None])[k]
    y = jnp.tanh(X @ v1.T) @ v2.T + b + X @ p.T
    return ((y - 1.0) ** 2).mean() + (w**2).sum() * 0.1


def test_sources_are_places_of_their_own_and_the_view_is_one_node():
    m = make()
    leaves, gdef = tied.flatten(m)
    w, s, k = m.first.weight.source
    assert m.second.weight is m.first.weight
    assert [x is y for x, y in zip(leaves[:3], (w, s, k))] == [True] * 3
    assert tied.ties(m) == [(".first.weight", ".second.weight"), (".first.weight.source[0]", ".extra")]
    (info,) = gdef.views()
    assert info.paths == (".first.weight", ".second.weight") and info.source == ".first.weight.source"
    want = (np.asarray(w) * np.asarray(s)[:, None])[[0, 1, 3]]
    np.testing.assert_allclose(tied.materialize(m.first.weight), want)
    assert m.first.weight.shape == (3, 3) and m.first.weight.dtype == jnp.float32


def test_gradients_equal_plain_jax_grad_written_by_hand():
    m = make()
    w, s, _ = m.first.weight.source
    g = tied.grad(loss)(m)
    ref = jax.grad(hand_loss, argnums=(0, 1, 2, 3))(w, s, m.second.bias, m.plain.weight)
    gv = g.first.weight
    assert isinstance(gv, tied.View) and g.second.weight is gv  # one gradient node at both places
    gw, gs, gk = gv.source
    assert gk is None  # the integer source gets no gradient
    assert g.extra is gw  # the float source's total, aliased at its own place
    for got, want in zip((gw, gs, g.second.bias, g.plain.weight), ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_under_jit_the_view_stays_a_view_and_values_match():
    m = make()
    seen = []

    @tied.jit
    def f(model):
        seen.append(type(model.first.weight))
        return loss(model), tied.grad(loss)(model)

    value, g = f(m)
    assert seen == [tied.View]
    w, s, _ = m.first.weight.source
    np.testing.assert_allclose(value, hand_loss(w, s, m.second.bias, m.plain.weight), rtol=1e-6)
    ref = jax.grad(hand_loss, argnums=(0, 1))(w, s, m.second.bias, m.plain.weight)
    np.testing.assert_allclose(g.extra, ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.first.weight.source[1], ref[1], rtol=1e-5, atol=1e-6)
    assert g.second.weight is g.first.weight and g.first.weight.source[0] is g.extra


def test_adam_steps_the_float_sources_once_and_keeps_every_tie():
    m = make()
    tx = optax.adam(0.1)
    state = tied.optim.setup(tx, m)
    w, s, k = m.first.weight.source
    params = {"w": w, "s": s, "b": m.second.bias, "p": m.plain.weight}
    ref_state = tx.init(params)
    for _ in range(3):
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        grads = dict(zip("wsbp", jax.grad(hand_loss, argnums=(0, 1, 2, 3))(*(params[c] for c in "wsbp"))))
        upd, ref_state = tx.update(grads, ref_state)
        params = optax.apply_updates(params, upd)
    nw, ns, nk = m.first.weight.source
    assert m.second.weight is m.first.weight and m.extra is nw and nk is k  # ties kept, k untouched
    np.testing.assert_allclose(nw, params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ns, params["s"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.second.bias, params["b"], rtol=1e-5, atol=1e-6)


def test_save_and_load_store_each_source_once(tmp_path):
    m = make()
    path = str(tmp_path / "m.safetensors")
    tied.save(path, m)
    with safe_open(path, "numpy") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    w, s, k = m.first.weight.source
    assert len(stored) == len(tied.flatten(m)[0]) == 5  # w, s, k, second.bias, plain.weight: once each
    assert sum(x.shape == (4, 3) for x in stored.values()) == 1  # w once, for three places
    like = make()
    back = tied.load(path, like)
    assert back.second.weight is back.first.weight and back.extra is back.first.weight.source[0]
    for got, want in zip(back.first.weight.source, (w, s, k)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    np.testing.assert_allclose(back(X), m(X), rtol=1e-6)


def test_keeps_view_functions_reach_the_loss_as_views_with_cheap_reads():
    class Rows:
        keeps_view = True
        frozen_sources = (1,)

        def __call__(self, w, s):
            return w * s[:, None]

        def take(self, ids, w, s):
            return jnp.take(w, ids, axis=0) * jnp.take(s, ids)[..., None]

    w, s = jnp.arange(12.0).reshape(4, 3), jnp.array([1.0, 2.0, 3.0, 4.0])
    emb = tied.nn.Embedding(tied.view((w, s), Rows()))
    ids = jnp.array([3, 0])
    got = []

    def f(e):
        got.append(type(e.weight))
        return (e(ids) ** 2).sum()

    g = tied.grad(f)(emb)
    assert got == [tied.View]
    assert g.weight.source[1] is None  # frozen by default: no gradient, no optimiser state
    assert tied.param_count(emb) == 12
    ref = jax.grad(lambda w: ((w[ids] * s[ids][:, None]) ** 2).sum())(w)
    np.testing.assert_allclose(g.weight.source[0], ref)
    g2 = tied.grad(f, trainable=lambda p, x: True)(emb)  # unless trainable= says so
    ref_s = jax.grad(lambda s: ((w[ids] * s[ids][:, None]) ** 2).sum())(s)
    np.testing.assert_allclose(g2.weight.source[1], ref_s)


def test_bad_sources_are_refused():
    with pytest.raises(TypeError, match=r"sources\[1\].*got int"):
        tied.view((jnp.ones(2), 3), lambda a, b: a)
    with pytest.raises(TypeError, match="at least one source"):
        tied.view((), lambda: 0)


def test_sources_on_different_devices_are_refused():
    code = (
        "import jax, jax.numpy as jnp, tied\n"
        "a = jax.device_put(jnp.ones(2), jax.devices()[0])\n"
        "b = jax.device_put(jnp.ones(2), jax.devices()[1])\n"
        "try:\n"
        "    tied.view((a, b), lambda a, b: a + b)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sources[1] is on ['cpu:1'] but sources[0] on ['cpu:0']" in out.stdout, out.stdout
    assert "jax.device_put(sources[1], sources[0].sharding)" in out.stdout
