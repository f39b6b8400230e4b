"""Defects found at the seams of the lifted transforms (issue 34), each against an independent
reference: plain JAX on an untied copy of the arrays, written out by hand."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied

# ---------------------------------------------------------------- 1: a per-member view of one
# broadcast array, inside tied.grad (which materialises views in its copy)


def _views_stack():
    w = jax.random.normal(jax.random.key(0), (3, 3))
    vs = [jnp.full((3,), float(i + 1)) for i in range(3)]
    return w, vs, tied.stack([{"wt": tied.transpose(w), "v": v} for v in vs])


def _step(h, layer, x):
    return jnp.tanh(h * (tied.materialize(layer["wt"]) @ layer["v"])), None


def _by_hand_scan(w, vs, h0):
    h = h0
    for i in range(vs.shape[0]):
        h = jnp.tanh(h * (w.T @ vs[i]))
    return h.sum()


def _by_hand_vmap(w, vs, h0):
    return sum((h0 * (w.T @ vs[i])).sum() for i in range(vs.shape[0]))


def _check_grad(g, value, ref_fn, w, vs, h0):
    ref_value, (gw, gv) = jax.value_and_grad(ref_fn, argnums=(0, 1))(w, jnp.stack(vs), h0)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(g.member["v"], gv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.member["wt"].source, gw, rtol=1e-5, atol=1e-6)


def test_scan_in_grad_keeps_a_per_member_transpose_of_a_broadcast_array_whole():
    w, vs, s = _views_stack()
    h0 = jnp.ones((2, 3))
    loss = lambda s: tied.scan(_step, h0, s)[0].sum()  # noqa: E731
    np.testing.assert_allclose(loss(s), _by_hand_scan(w, jnp.stack(vs), h0), rtol=1e-5)
    value, g = tied.value_and_grad(loss)(s)
    _check_grad(g, value, _by_hand_scan, w, vs, h0)


def test_vmap_in_grad_keeps_a_per_member_transpose_of_a_broadcast_array_whole():
    w, vs, s = _views_stack()
    h0 = jnp.ones((2, 3))
    per_member = lambda m: (h0 * (tied.materialize(m["wt"]) @ m["v"])).sum()  # noqa: E731
    loss = lambda s: tied.vmap(per_member)(s).sum()  # noqa: E731
    value, g = tied.value_and_grad(loss)(s)
    _check_grad(g, value, _by_hand_vmap, w, vs, h0)
    g2 = tied.grad(loss)(s)
    np.testing.assert_allclose(g2.member["v"], g.member["v"], rtol=1e-6)


def test_unstack_of_a_grad_copy_gives_every_member_the_whole_transpose():
    w, vs, s = _views_stack()
    h0 = jnp.ones((2, 3))

    def loss(s):
        h = h0
        for m in tied.unstack(s):
            h, _ = _step(h, m, None)
        return h.sum()

    value, g = tied.value_and_grad(loss)(s)
    _check_grad(g, value, _by_hand_scan, w, vs, h0)


# ---------------------------------------------------------------- 2: one array in two elements of
# a tuple output with different out_axes


def _twice(x):
    y = jnp.sin(x) * 2
    return y, {"a": y, "b": y}


def test_vmap_gives_each_element_of_a_tuple_output_its_own_out_axis():
    x = jnp.arange(9.0).reshape(3, 3)  # square: a wrong axis would still have the right shape
    ref = jax.vmap(lambda x: (jnp.sin(x) * 2, {"a": jnp.sin(x) * 2, "b": jnp.sin(x) * 2}), out_axes=(0, 1))(x)
    first, second = tied.vmap(_twice, out_axes=(0, 1))(x)
    np.testing.assert_allclose(first, ref[0], rtol=1e-6)
    np.testing.assert_allclose(second["a"], ref[1]["a"], rtol=1e-6)
    assert second["a"] is second["b"]  # a tie inside one element is kept
    assert not np.allclose(first, second["a"])


def test_vmap_keeps_one_array_across_elements_of_one_out_axis():
    x = jnp.arange(6.0).reshape(2, 3)
    first, second = tied.vmap(_twice, out_axes=(1, 1))(x)
    np.testing.assert_allclose(first, jax.vmap(lambda x: jnp.sin(x) * 2, out_axes=1)(x), rtol=1e-6)
    assert first is second["a"] and first is second["b"]


# ---------------------------------------------------------------- 5: vmap over a Stack whose
# arrays are all broadcast


def _apply(m, x):
    return jnp.tanh(m["w"] @ x + m["c"])


@pytest.mark.parametrize("n", [1, 3])
def test_vmap_maps_a_stack_of_one_object_over_its_length(n):
    w, c, x = jnp.arange(4.0).reshape(2, 2) / 4, jnp.array([0.5, -1.0]), jnp.array([1.0, 2.0])
    b = {"w": w, "c": c}
    s = tied.stack([b] * n)
    out = tied.vmap(_apply, in_axes=(0, None))(s, x)
    np.testing.assert_allclose(out, jnp.stack([jnp.tanh(w @ x + c)] * n), rtol=1e-6)  # the loop
    g = tied.grad(lambda s: tied.vmap(_apply, in_axes=(0, None))(s, x).sum())(s)
    gw, gc = jax.grad(lambda w, c: n * jnp.tanh(w @ x + c).sum(), argnums=(0, 1))(w, c)
    np.testing.assert_allclose(g.member["w"], gw, rtol=1e-5)
    np.testing.assert_allclose(g.member["c"], gc, rtol=1e-5)


def test_vmap_refuses_stacks_of_two_lengths_naming_them():
    b = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"give \[2, 3\] examples"):
        tied.vmap(lambda s, t: s["w"] + t["w"])(tied.stack([b, b]), tied.stack([b, b, b]))


# ---------------------------------------------------------------- 4: a write into a static
# argument: refused naming the place, and the caller's objects hold no tracer after it


def _no_tracer(obj) -> bool:
    leaves = jax.tree_util.tree_leaves(vars(obj), is_leaf=lambda x: isinstance(x, tied.State))
    values = [x.value if isinstance(x, tied.State) else x for x in leaves]
    return not any(isinstance(v, jax.core.Tracer) for v in values)


def test_remat_refuses_a_batchnorm_written_as_a_static_argument_and_puts_it_back():
    bn = tied.nn.BatchNorm(3)
    mean, var = bn.running_mean.value, bn.running_var.value
    x = jnp.arange(6.0).reshape(2, 3)
    f = tied.remat(lambda x, bn: bn(x), static_argnums=(1,))
    with pytest.raises(tied.GraphError, match=r"args\[1\]\.running_mean\.value: .*static.*put back"):
        f(x, bn)
    assert bn.running_mean.value is mean and bn.running_var.value is var
    assert _no_tracer(bn)
    np.testing.assert_array_equal(bn.running_mean.value, np.zeros(3))


class _Cfg:  # registered with nothing: tied's walk does not enter it
    def __init__(self):
        self.calls = tied.State(jnp.zeros((), jnp.int32))
        self.scale = 2.0


def _count(x, cfg):
    cfg.calls.value = cfg.calls.value + 1
    return x * cfg.scale


def _stash(x, cfg):
    cfg.seen = x  # a new field of an object the walk does not enter
    return x * cfg.scale


@pytest.mark.parametrize(
    "transform",
    [lambda f: tied.jit(f, static_argnums=1), lambda f: tied.remat(f, static_argnums=(1,))],
    ids=["jit", "remat"],
)
def test_a_state_cell_inside_an_unregistered_static_argument_is_refused_and_put_back(transform):
    cfg = _Cfg()
    calls = cfg.calls.value
    with pytest.raises(
        tied.GraphError, match=r"args\[1\]\.calls\.value: .*static_argnums.*put back as it was"
    ):
        transform(_count)(jnp.ones(2), cfg)
    assert cfg.calls.value is calls and int(cfg.calls.value) == 0
    assert _no_tracer(cfg)
    with pytest.raises(tied.GraphError, match=r"args\[1\]\.seen: .*traced value.*put back as it was"):
        transform(_stash)(jnp.ones(2), cfg)
    assert not hasattr(cfg, "seen") and cfg.scale == 2.0 and _no_tracer(cfg)


# ---------------------------------------------------------------- 11: every compile logs its line
# while jax_explain_cache_misses is on, however the switch stood before


@pytest.fixture
def switch(caplog):
    before = jax.config.jax_explain_cache_misses
    caplog.set_level(logging.WARNING, logger="tied.jit")
    try:
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "tied.jit"]
    finally:
        jax.config.update("jax_explain_cache_misses", before)


def _calls_and_lines(f, logged, xs):
    """Per call: (how many compiled versions it added, the lines it logged)."""
    out = []
    for x in xs:
        size, lines = f.cache_size(), len(logged())
        f(*x)
        out.append((f.cache_size() - size, logged()[lines:]))
    return out


def test_a_compile_after_the_switch_is_turned_on_logs_its_line(switch):
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    f = tied.jit(lambda m, x: m(x).sum())
    f(d, jnp.ones((1, 2)))  # switch off: nothing known of this call
    jax.config.update("jax_explain_cache_misses", True)
    x5 = jnp.ones((5, 2))
    steps = _calls_and_lines(
        f,
        switch,
        [
            (d, x5),  # new shapes for a known structure
            (d, x5),  # nothing new
            (tied.nn.Chain(d, d), x5),  # a new structure
            (d, jax.device_put(x5, jax.devices()[0])),  # the same shapes, committed: JAX compiles again
        ],
    )
    assert [added for added, _ in steps] == [1, 0, 1, 1]
    for added, lines in steps:
        assert len(lines) == added
    assert "new shapes, dtypes or placements" in steps[0][1][0]
    assert "its first call" not in steps[2][1][0] and "structure" in steps[2][1][0]
    assert "placed otherwise" in steps[3][1][0]
