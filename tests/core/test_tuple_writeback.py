"""New arrays written into a tuple the model holds: a new tuple at every place of the old one.

`tied.jit`'s write-back (a donated argument, or a function that assigned new arrays) and
`tied.optim.update_inplace` write into the caller's objects; a tuple cannot be written in
place, so its holders get a new tuple (one for all of its places: a tie is kept), as eager
code that assigns a new tuple does. References: the same step run eagerly on a model built
alike, and Adam written out by hand.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied


@tied.register
class Holder:
    """A plain object holding a tuple."""

    def __init__(self, pair):
        self.pair = pair


def build():
    """A tuple held at three places (two dict keys and an object's field), and a tuple holding
    another tuple that is also held by the dict."""
    t = (jnp.arange(3.0), jnp.ones(2))
    inner = (jnp.full(2, 2.0),)
    return {"a": t, "b": t, "o": Holder(t), "nest": (inner, jnp.zeros(1)), "inner": inner}


def step(m, x):
    """What a training step does with tuples: new tuples put where the old ones were."""
    w, s = m["a"]
    new = (w * x, s + 1.0)
    m["a"] = m["b"] = new
    m["o"].pair = new
    inner = (m["inner"][0] - x[:2],)
    m["nest"] = (inner, m["nest"][1] + 2.0)
    m["inner"] = inner
    return (w * s[0]).sum()


def check_like_eager(m, ref):
    assert m["a"] is m["b"] is m["o"].pair
    assert m["nest"][0] is m["inner"]
    for got, want in zip(tied.flatten(m)[0], tied.flatten(ref)[0], strict=True):
        np.testing.assert_allclose(got, want)
    assert ref["a"] is ref["b"] is ref["o"].pair and ref["nest"][0] is ref["inner"]  # the eager ties


@pytest.mark.parametrize("donate", [(), 0])
def test_tuples_written_by_tied_jit_are_new_tuples_at_every_place_as_eagerly(donate):
    x = jnp.array([2.0, 3.0, 4.0])
    ref = build()
    want = step(ref, x)
    m = build()
    old = m["a"]
    f = tied.jit(step, donate_argnums=donate)
    np.testing.assert_allclose(f(m, x), want)
    check_like_eager(m, ref)
    assert m["a"] is not old and len(old) == 2  # the old tuple, a value, is left as it was
    np.testing.assert_allclose(f(m, x), step(ref, x))  # a second call (no trace) writes alike
    check_like_eager(m, ref)


def test_a_donated_model_holding_a_shared_tuple_keeps_its_tie_and_values():
    t = (jnp.arange(3.0), jnp.ones(2))
    m = {"a": t, "o": Holder(t)}
    want = [np.asarray(t[0]), np.asarray(t[1])]
    y = tied.jit(lambda m: m["a"][0].sum() + m["o"].pair[1].sum(), donate_argnums=0)(m)
    np.testing.assert_allclose(y, want[0].sum() + want[1].sum())
    assert m["a"] is m["o"].pair
    np.testing.assert_allclose(m["a"][0], want[0])
    np.testing.assert_allclose(m["a"][1], want[1])


def test_update_inplace_writes_a_shared_tuple_once_for_all_its_places_with_adam():
    m = build()
    x = jnp.array([2.0, 3.0, 4.0])
    leaves = [np.asarray(v, np.float64) for v in tied.flatten(m)[0]]

    def loss(m):
        w, s = m["a"]
        return (w * x).sum() * s.sum() + (m["nest"][0][0] ** 2).sum() + m["nest"][1].sum()

    state = tied.optim.setup(optax.adam(0.1), m)
    tied.optim.update_inplace(state, m, tied.grad(loss)(m))
    # by hand: d/dw = x * sum(s), d/ds = sum(w * x), d/dinner = 2 inner, d/dz = 1; Adam's first
    # step moves every element by lr * sign(g) (up to eps)
    w, s, inner, z = leaves
    grads = [x * s.sum(), np.full(2, (w * x).sum()), 2 * inner, np.ones(1)]
    want = [p - 0.1 * g / (np.abs(g) + 1e-8) for p, g in zip([w, s, inner, z], grads)]
    assert m["a"] is m["b"] is m["o"].pair and m["nest"][0] is m["inner"]
    got = [m["a"][0], m["a"][1], m["inner"][0], m["nest"][1]]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_a_tuple_held_twice_by_one_tuple_gets_one_new_tuple():
    t = (jnp.ones(2),)
    m = {"p": (t, t)}
    state = tied.optim.setup(optax.sgd(1.0), m)
    tied.optim.update_inplace(state, m, tied.grad(lambda m: 3.0 * m["p"][1][0].sum())(m))
    assert m["p"][0] is m["p"][1] and m["p"][0] is not t
    np.testing.assert_allclose(m["p"][0][0], [-2.0, -2.0])


@dataclasses.dataclass(frozen=True)
class Frozen:
    pair: Any


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda w: (w, jnp.zeros(2)), r"\[0\]: .*tuple \(tuple\) held by no container"),
        (
            lambda w: {"ok": (w,), "f": Frozen((w,))},
            r"\['f'\]\.pair: .*frozen dataclass \(Frozen\) "
            r"\(this tuple holds the array written at \['f'\]\.pair\[0\]\)",
        ),
    ],
    ids=["the-model-is-a-tuple", "a-tuple-also-held-by-a-frozen-dataclass"],
)
def test_a_tuple_with_a_place_that_takes_no_new_tuple_is_refused_before_writing(make, path):
    w = jnp.ones(2)
    m = make(w)
    if isinstance(m, dict):
        m["f"] = Frozen(m["ok"])  # the one tuple at both places
    before = tied.flatten(m)[0]
    held = m["ok"] if isinstance(m, dict) else None
    state = tied.optim.setup(optax.sgd(1.0), m)
    g = tied.grad(lambda m: sum(jnp.sum(x) for x in tied.flatten(m)[0]))(m)
    with pytest.raises(tied.GraphError, match=path):
        tied.optim.update_inplace(state, m, g)
    assert all(a is b for a, b in zip(tied.flatten(m)[0], before))
    if held is not None:
        assert m["ok"] is held  # nothing half-done: the dict's place was not written either


def test_tied_gradient_still_refuses_a_tuple_it_would_have_to_rebuild():
    m = {"a": (jnp.ones(2),)}
    t = m["a"]
    with pytest.raises(tied.GraphError, match=r"\['a'\]\[0\]: .*cannot be changed in place"):
        tied.gradient(lambda: m["a"][0].sum(), tied.params(m))
    assert m["a"] is t


def test_a_view_whose_sources_are_reassigned_under_tied_jit_is_written_as_eagerly():
    def make():
        a, b = jnp.arange(4.0).reshape(2, 2), jnp.array([1.0, 2.0])
        v = tied.view((a, b), lambda a, b: a * b[:, None])
        return {"v": v, "again": v}

    def f(m):
        a, b = m["v"].source
        m["v"].source = (a + 1.0, b * 3.0)
        return tied.materialize(m["v"]).sum()

    ref, m = make(), make()
    want = f(ref)
    np.testing.assert_allclose(tied.jit(f)(m), want)
    assert m["v"] is m["again"]
    for got, exp in zip(m["v"].source, ref["v"].source):
        np.testing.assert_allclose(got, exp)
