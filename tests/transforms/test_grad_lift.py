"""`tied.grad` on the one lift: totals, per-place partials, trainable parameters, state written in
the loss, refusals, and checks made inside the loss.

References: plain `jax.grad` of a hand-written untied function (the uses of a tied parameter
summed by hand), a BatchNorm written out in jnp as PyTorch defines it, and optax stepped by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied._transforms import check

X = jnp.array([[0.5, -1.0], [2.0, 0.25], [-1.5, 1.0]])


def _bn_ref(x, w, b, mean, var, momentum=0.1, eps=1e-5):
    """PyTorch's BatchNorm in training mode, by hand: the output and the new running stats."""
    mu = x.mean(0)
    v = ((x - mu) ** 2).mean(0)
    n = x.shape[0]
    new = ((1 - momentum) * mean + momentum * mu, (1 - momentum) * var + momentum * v * n / (n - 1))
    return (x - mu) / jnp.sqrt(v + eps) * w + b, new


def _model():
    """One Dense whose weight is also the head's (a tie), and one BatchNorm at two places."""
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    bn = tied.nn.BatchNorm(2)
    return {"d": d, "bn1": bn, "head": tied.nn.Dense(d.weight, d.bias), "bn2": bn}


def _loss(m):
    h = m["bn1"](m["d"](X))
    return jnp.sum(jnp.tanh(m["bn2"](m["head"](h))) ** 2)


def _ref_loss(w1, b1, w2, b2, bw1, bb1, bw2, bb2):
    """`_loss` untied: each use of a tied array its own argument; the running stats as given."""
    zeros, ones = jnp.zeros(2), jnp.ones(2)
    h, s1 = _bn_ref(X @ w1.T + b1, bw1, bb1, zeros, ones)
    y, s2 = _bn_ref(h @ w2.T + b2, bw2, bb2, *s1)
    return jnp.sum(jnp.tanh(y) ** 2), s2


def _ref_partials(m):
    args = (m["d"].weight, m["d"].bias) * 2 + (m["bn1"].weight, m["bn1"].bias) * 2
    value, stats = _ref_loss(*args)
    parts = jax.grad(lambda *a: _ref_loss(*a)[0], argnums=tuple(range(8)))(*args)
    return value, stats, parts


def test_totals_equal_plain_jax_summed_by_hand_state_written_twice_in_order_and_adam_keeps_the_tie():
    m = _model()
    value_ref, (mean_ref, var_ref), p = _ref_partials(m)
    value, g = tied.value_and_grad(_loss)(m)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    assert g["d"].weight is g["head"].weight and g["bn1"] is g["bn2"]
    np.testing.assert_allclose(g["d"].weight, p[0] + p[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["d"].bias, p[1] + p[3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["bn1"].weight, p[4] + p[6], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["bn1"].bias, p[5] + p[7], rtol=1e-5, atol=1e-6)
    # the one BatchNorm updated at both calls, in call order, in the caller's own object
    np.testing.assert_allclose(m["bn1"].running_mean.value, mean_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["bn2"].running_var.value, var_ref, rtol=1e-5, atol=1e-6)
    assert int(m["bn1"].num_batches_tracked.value) == 2
    # Adam on the total, once per unique parameter, the tie kept
    w = m["d"].weight
    state = tied.optim.setup(optax.adam(0.1), m)
    new, _ = tied.optim.update(state, m, g)
    tx = optax.adam(0.1)
    upd, _ = tx.update(p[0] + p[2], tx.init(w))
    assert new["d"].weight is new["head"].weight
    np.testing.assert_allclose(new["d"].weight, w + upd, rtol=1e-5, atol=1e-6)


def test_per_location_gives_each_place_its_own_partial_and_writes_the_state_once_per_call():
    m = _model()
    _, (mean_ref, _), p = _ref_partials(m)
    g = tied.grad(_loss, per_location=True)(m)
    assert g["d"].weight is not g["head"].weight
    for got, ref in zip(
        (g["d"].weight, g["d"].bias, g["head"].weight, g["head"].bias, g["bn1"].weight, g["bn2"].bias),
        (p[0], p[1], p[2], p[3], p[4], p[7]),
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["bn2"].running_mean.value, mean_ref, rtol=1e-5, atol=1e-6)
    assert int(m["bn1"].num_batches_tracked.value) == 2


def test_trainable_gives_the_selected_totals_and_momentum_steps_the_tie_once():
    m = _model()
    _, _, p = _ref_partials(m)
    only = lambda path, a: path.endswith("weight")  # noqa: E731
    g = tied.grad(_loss, trainable=only)(m)
    assert g["d"].bias is None and g["head"].bias is None and g["bn1"].bias is None
    assert g["d"].weight is g["head"].weight
    np.testing.assert_allclose(g["head"].weight, p[0] + p[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["bn2"].weight, p[4] + p[6], rtol=1e-5, atol=1e-6)
    w = m["d"].weight
    state = tied.optim.setup(optax.sgd(0.1, momentum=0.9), m, trainable=only)
    new, state = tied.optim.update(state, m, g)
    new, _ = tied.optim.update(state, new, g)
    tx = optax.sgd(0.1, momentum=0.9)
    ref_state = tx.init(w)
    u1, ref_state = tx.update(p[0] + p[2], ref_state)
    u2, _ = tx.update(p[0] + p[2], ref_state)
    assert new["d"].weight is new["head"].weight
    np.testing.assert_allclose(new["head"].weight, w + u1 + u2, rtol=1e-5, atol=1e-6)


def test_a_write_at_a_views_place_is_refused_and_nothing_is_written():
    w = jnp.arange(4.0).reshape(2, 2)
    cell = tied.State(jnp.zeros(()))
    m = {"w": w, "v": tied.view(w, lambda s: s.T), "n": cell}

    def loss(m):
        m["n"].value = m["n"].value + 1.0
        m["v"] = m["v"] * 2
        return m["w"].sum()

    with pytest.raises(tied.GraphError, match=r"^tied\.grad: the loss wrote a new value at a view's place"):
        tied.grad(loss)(m)
    assert float(cell.value) == 0.0 and m["w"] is w and isinstance(m["v"], tied.View)


def test_a_change_of_structure_in_the_loss_is_refused_naming_the_transform():
    m = {"w": jnp.ones(2)}

    def loss(m):
        m["extra"] = jnp.zeros(1)
        return m["w"].sum()

    with pytest.raises(tied.GraphError, match=r"tied\.value_and_grad: the loss changed the structure"):
        tied.value_and_grad(loss)(m)
    assert list(m) == ["w"]


# ---------------------------------------------------------------- checks made inside the loss


def _too_big(bad, s):
    if np.any(bad):
        raise ValueError(f"check: the loss reached {float(np.max(s)):.1f}, over the limit")


def _checked_loss(m):
    s = jnp.sum(m["d"](X) ** 2) + jnp.sum(m["head"].weight ** 2)
    m["bn"](X)  # state written before the check fails: never written back
    check(s > 1.0, _too_big, s)
    return s


@pytest.mark.parametrize("jit", [False, True])
def test_a_failed_check_on_a_traced_value_in_the_loss_raises_its_own_error_and_writes_nothing(jit):
    """A check whose flag depends on the parameters (traced by the gradient): its own ValueError,
    eagerly and under tied.jit, with the BatchNorm's state left as it was (on main: JAX's raw
    'CpuCallback error' from a host callback)."""
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    m = {"d": d, "head": tied.nn.Dense(d.weight), "bn": tied.nn.BatchNorm(2)}
    mean = m["bn"].running_mean.value
    s = float(jnp.sum(d(X) ** 2) + jnp.sum(d.weight**2))
    assert s > 1.0
    fn = tied.grad(_checked_loss)
    fn = tied.jit(fn) if jit else fn
    with pytest.raises(ValueError, match=rf"^check: the loss reached {s:.1f}, over the limit$"):
        jax.block_until_ready(fn(m))
    assert m["bn"].running_mean.value is mean and int(m["bn"].num_batches_tracked.value) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_a_passing_check_in_the_loss_changes_nothing(jit):
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    m = {"d": d, "head": tied.nn.Dense(d.weight), "bn": tied.nn.BatchNorm(2)}
    w, b = d.weight, d.bias

    def loss(m):
        s = jnp.sum(m["d"](X) ** 2) + jnp.sum(m["head"].weight ** 2)
        m["bn"](X)
        check(s > 1e6, _too_big, s)
        return s

    fn = tied.grad(loss)
    g = (tied.jit(fn) if jit else fn)(m)
    ref = jax.grad(lambda w1, b, w2: jnp.sum((X @ w1.T + b) ** 2) + jnp.sum(w2**2), argnums=(0, 1, 2))(
        w, b, w
    )
    assert g["d"].weight is g["head"].weight
    np.testing.assert_allclose(g["d"].weight, ref[0] + ref[2], rtol=1e-5)
    np.testing.assert_allclose(g["d"].bias, ref[1], rtol=1e-5)
    np.testing.assert_allclose(m["bn"].running_mean.value, 0.1 * X.mean(0), rtol=1e-5)


def test_a_kv_cache_overflow_inside_a_jitted_gradient_raises_and_leaves_the_cache():
    """The cache's position is state (not differentiated): under tied.jit its check is jit's,
    made inside the loss; the step that does not fit raises the eager message."""
    attn = tied.nn.CausalSelfAttention(8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 8))
    cache = tied.nn.KVCache(4, 2, 4, batch_shape=(1,))
    step = tied.jit(tied.grad(lambda a, c, xt: a.decode(xt, c).sum()))
    step(attn, cache, x[:, :3])
    keys = cache.keys.value
    with pytest.raises(
        ValueError, match=r"KVCache: 3 positions are written and 3 more do not fit in max_len=4"
    ):
        jax.block_until_ready(step(attn, cache, x[:, :3]))
    assert int(cache.position.value) == 3 and cache.keys.value is keys


@pytest.mark.parametrize("jit", [False, True])
def test_a_failed_check_in_a_scan_step_inside_the_loss_raises_its_own_error(jit):
    """A step's check on the parameters' tracers, carried out of tied.scan per step, is the
    gradient's around it (on main: JAX's raw 'CpuCallback error')."""
    keys = jax.random.split(jax.random.key(0), 3)
    blocks = tied.stack([tied.nn.Dense(2, 2, key=k) for k in keys])
    h0 = X
    hs = [h0]
    for d in tied.unstack(blocks):
        hs.append(jnp.tanh(d(hs[-1])))
    peak = max(float(jnp.sum(h**2)) for h in hs[1:])

    def step(h, layer, _):
        h = jnp.tanh(layer(h))
        s = jnp.sum(h**2)
        check(s > 0.5 * peak, _too_big, s)
        return h, None

    fn = tied.grad(lambda s: tied.scan(step, h0, s)[0].sum())
    fn = tied.jit(fn) if jit else fn
    with pytest.raises(ValueError, match=rf"^check: the loss reached {peak:.1f}, over the limit$"):
        jax.block_until_ready(fn(blocks))


@pytest.mark.parametrize("inner", ["jit", "remat", "vmap"])
def test_a_failed_check_in_a_lifted_transform_inside_the_loss_raises_its_own_error(inner):
    """The check made inside tied.jit / tied.remat / tied.vmap in the loss: its flag comes out
    concrete (a comparison of the gradient's tracers), its operand traced; the gradient checks it
    (on main: JAX's TracerArrayConversionError)."""
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    m = {"d": d, "head": tied.nn.Dense(d.weight)}
    xs = jnp.stack([X * 0.01, X])
    s_ref = [float(jnp.sum((d(x) @ d.weight.T) ** 2)) for x in xs]  # the head has no bias
    limit = (s_ref[0] + s_ref[1]) / 2

    def f(m, x):
        s = jnp.sum(m["head"](m["d"](x)) ** 2)
        check(s > limit, _too_big, s)
        return s

    if inner == "vmap":
        fn, x = lambda m, x: tied.vmap(f, in_axes=(None, 0))(m, x).sum(), xs
    else:
        fn, x = (tied.jit(f) if inner == "jit" else tied.remat(f)), xs[1]
    with pytest.raises(ValueError, match=rf"^check: the loss reached {s_ref[1]:.1f}, over the limit$"):
        tied.grad(fn)(m, x)


# ---------------------------------------------------------------- tied.jit on the same lift


def test_tied_jit_refuses_a_dead_tracer_written_as_state_also_when_the_function_makes_a_check():
    """State written inside a plain jax.checkpoint that closes over the model: tied's GraphError
    naming the place, with or without a check in the function (on main, with a check, the
    dead tracer was looked for among the check's values: JAX's raw UnexpectedTracerError)."""
    for with_check in (False, True):
        cell = tied.State(jnp.zeros(2))
        m = {"w": jnp.ones(2), "s": cell}

        def f(m, x, with_check=with_check):
            def body(y):
                m["s"].value = m["s"].value + y  # closes over the model
                return y * 2

            out = jax.checkpoint(body)(x)
            if with_check:
                check(x.sum() > 100.0, _too_big, x)
            return out.sum()

        with pytest.raises(
            tied.GraphError, match=r"^args\[0\]\['s'\]\.value: tied\.jit: state was written inside"
        ):
            tied.jit(f)(m, jnp.ones(2))
        assert np.array_equal(cell.value, np.zeros(2))
