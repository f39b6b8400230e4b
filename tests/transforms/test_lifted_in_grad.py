"""`tied.scan` and `tied.remat` inside `tied.grad`'s loss write a cell the gradient does not differentiate.

`tied.grad` runs the loss on a copy built inside its trace, whose undifferentiated cells hold the
caller's concrete arrays; a lifted transform writing a value of that trace there is writing into
the gradient's own copy (carried out and written back by `tied.grad`), not into an object outside
the trace. An object truly outside (closed over, or passed beside the differentiated argument)
is still refused, as is a value of a plain transform in between. References: gradients and cell
values worked out by hand, and the unrolled eager loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied


@tied.register_state
class Ema:
    def __init__(self, n):
        self.value = jnp.zeros(n)


def body(h, layer, x):
    y = layer["w"] * h
    layer["ema"].value = 0.9 * layer["ema"].value + 0.1 * y  # not stop-gradiented: a traced value
    return y, None


def build():
    return tied.stack([{"w": jnp.arange(3.0) + i, "ema": Ema(3)} for i in range(2)])


def scan_loss(s, x):
    h, _ = tied.scan(body, x, s)
    return (h**2).sum()


def test_scan_in_a_gradient_writes_an_undifferentiated_cell_as_the_unrolled_loop():
    s, x = build(), jnp.ones(3)
    g = tied.grad(scan_loss)(s, x)
    w0, w1 = np.arange(3.0), np.arange(3.0) + 1
    # loss = sum((w1 * w0 * x)^2): d/dw0 = 2 w1^2 w0, d/dw1 = 2 w0^2 w1 (by hand)
    np.testing.assert_allclose(g.member["w"], np.stack([2 * w1**2 * w0, 2 * w0**2 * w1]), rtol=1e-6)
    np.testing.assert_allclose(s.member["ema"].value, np.stack([0.1 * w0, 0.1 * w1 * w0]), rtol=1e-6)
    assert not isinstance(s.member["ema"].value, jax.core.Tracer)

    # The unrolled eager loop over the members, its writes read back from the members themselves.
    members = tied.unstack(build())
    h = x
    for layer in members:
        h, _ = body(h, layer, x)
    for i, layer in enumerate(members):
        np.testing.assert_allclose(s.member["ema"].value[i], layer["ema"].value, rtol=1e-6)


def test_remat_in_a_gradient_writes_an_undifferentiated_cell_as_the_eager_loss():
    def f(m, x):
        y = m["w"] * x
        m["ema"].value = 0.9 * m["ema"].value + 0.1 * y
        return (y**2).sum()

    x = jnp.ones(3)
    plain, remat = {"w": jnp.arange(3.0) + 1, "ema": Ema(3)}, {"w": jnp.arange(3.0) + 1, "ema": Ema(3)}
    g_plain = tied.grad(f)(plain, x)
    g = tied.grad(lambda m, x: tied.remat(f)(m, x))(remat, x)
    np.testing.assert_allclose(g["w"], 2 * (np.arange(3.0) + 1))  # d/dw sum((w x)^2)
    np.testing.assert_allclose(g["w"], g_plain["w"])
    np.testing.assert_allclose(remat["ema"].value, 0.1 * (np.arange(3.0) + 1))
    np.testing.assert_allclose(remat["ema"].value, plain["ema"].value)


def test_a_second_gradient_step_reads_the_written_cell():
    s, x = build(), jnp.ones(3)
    tied.grad(scan_loss)(s, x)
    tied.grad(scan_loss)(s, x)
    w0, w1 = np.arange(3.0), np.arange(3.0) + 1
    first = np.stack([0.1 * w0, 0.1 * w1 * w0])
    np.testing.assert_allclose(s.member["ema"].value, 0.9 * first + first, rtol=1e-6)


def _ema_values(s):
    return np.asarray(s.member["ema"].value).copy()


def test_a_closed_over_stack_is_still_refused_and_left_untouched():
    outside, x = build(), jnp.ones(3)
    before = _ema_values(outside)

    def loss(m, x):  # writes values of the gradient's trace into a Stack living outside it
        h, _ = tied.scan(lambda h, layer, x: body(h * m["a"], layer, x), x, outside)
        return (h**2).sum()

    with pytest.raises(tied.GraphError, match=r"tied.scan wrote state computed inside an enclosing"):
        tied.grad(loss)({"a": jnp.ones(3)}, x)
    np.testing.assert_array_equal(_ema_values(outside), before)


def test_a_stack_beside_the_differentiated_argument_is_still_refused():
    model, other, x = {"a": jnp.ones(3)}, build(), jnp.ones(3)
    before = _ema_values(other)

    def loss(m, s, x):  # `s` is the caller's own object (argnums=0 copies only `m`)
        h, _ = tied.scan(lambda h, layer, x: body(h * m["a"], layer, x), x, s)
        return (h**2).sum()

    with pytest.raises(tied.GraphError, match=r"\.member\['ema'\]\.value: tied.scan wrote state"):
        tied.grad(loss)(model, other, x)
    np.testing.assert_array_equal(_ema_values(other), before)


def test_a_plain_vmap_between_the_gradient_and_the_scan_is_still_refused():
    s, xs = build(), jnp.ones((2, 3))
    before = _ema_values(s)

    def loss(s, xs):  # the vmap body closes over the gradient's copy: one write per example
        return jax.vmap(lambda x: scan_loss(s, x))(xs).sum()

    with pytest.raises(tied.GraphError, match=r"wrote state computed inside an enclosing"):
        tied.grad(loss)(s, xs)
    np.testing.assert_array_equal(_ema_values(s), before)


def test_under_jit_the_same_gradient_step_writes_the_same_cell():
    eager, jitted, x = build(), build(), jnp.ones(3)
    g_eager = tied.grad(scan_loss)(eager, x)
    g_jit = tied.jit(tied.grad(scan_loss))(jitted, x)
    np.testing.assert_allclose(g_jit.member["w"], g_eager.member["w"], rtol=1e-6)
    np.testing.assert_allclose(jitted.member["ema"].value, eager.member["ema"].value, rtol=1e-6)


def test_remat_names_a_refused_place_by_its_argument():
    other, x = {"w": jnp.arange(3.0), "ema": Ema(3)}, jnp.ones(3)

    def f(m, a):
        y = m["w"] * a
        m["ema"].value = y
        return y.sum()

    with pytest.raises(tied.GraphError, match=r"^args\[0\]\['ema'\]\.value: tied.remat wrote state computed"):
        tied.grad(lambda a, o: tied.remat(f)(o, a))(x, other)
    np.testing.assert_array_equal(other["ema"].value, np.zeros(3))


def test_an_outside_stack_put_into_the_copy_during_the_loss_is_still_refused():
    # Found by review: the copy's objects were read when the write came, after the loss had put
    # the caller's Stack into it; they are taken before the loss runs.
    outside, x = build(), jnp.ones(3)
    before = _ema_values(outside)

    def loss(m, x):
        m["tmp"] = outside  # into the gradient's copy, and out again: the structure ends unchanged
        h, _ = tied.scan(body, x * m["a"], m["tmp"])
        del m["tmp"]
        return (h**2).sum()

    with pytest.raises(tied.GraphError, match=r"tied.scan wrote state computed inside an enclosing"):
        tied.grad(loss)({"a": jnp.ones(3)}, x)
    np.testing.assert_array_equal(_ema_values(outside), before)


def test_a_value_of_an_outer_gradient_written_into_an_inner_gradients_copy():
    # Found by review: the inner tied.grad differentiates only v, so the scan's write is a value of
    # the outer gradient's trace, written into the inner copy (which lives inside that trace).
    x = jnp.ones(3)

    def inner_loss(m):
        h, _ = tied.scan(body, x, m["stack"])
        return (m["v"] * h).sum()

    def outer(m):
        g = tied.grad(inner_loss, trainable=lambda p, a: p == "['v']")(m)
        return (g["v"] ** 2).sum()  # g.v = h = w1 w0 x

    m = {"stack": build(), "v": jnp.full(3, 2.0)}
    g = tied.grad(outer)(m)
    w0, w1 = np.arange(3.0), np.arange(3.0) + 1
    # sum((w1 w0)^2): d/dw0 = 2 w1^2 w0, d/dw1 = 2 w0^2 w1 (by hand)
    np.testing.assert_allclose(g["stack"].member["w"], np.stack([2 * w1**2 * w0, 2 * w0**2 * w1]), rtol=1e-6)
    np.testing.assert_allclose(m["stack"].member["ema"].value, np.stack([0.1 * w0, 0.1 * w1 * w0]), rtol=1e-6)
