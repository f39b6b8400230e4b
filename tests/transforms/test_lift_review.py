"""An adversarial review of the shared lift (issue 34): each defect found, against an
independent reference (plain `jax.vmap`, the unrolled eager loop)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied

_NT = collections.namedtuple("_NT", "a b")


def test_vmap_out_axes_over_a_namedtuple_output_is_refused_not_a_stop_iteration():
    # a StopIteration escaping tied.vmap silently ended a surrounding map(): [] for 2 calls
    sq = jnp.arange(9.0).reshape(3, 3)
    f = tied.vmap(lambda x: _NT(x, x), 0, (0, 1))
    with pytest.raises(ValueError, match=r"plain tuple output.*_NT"):
        f(sq)
    # a plain tuple of its elements gives what jax.vmap gives
    a, b = tied.vmap(lambda x: tuple(_NT(x, x)), 0, (0, 1))(sq)
    ra, rb = jax.vmap(lambda x: (x, x), 0, (0, 1))(sq)
    np.testing.assert_array_equal(a, ra)
    np.testing.assert_array_equal(b, rb)


@pytest.mark.parametrize("out_axes", [{0: 1, 1: 0}, ((0, 1), 0), (0, [1])])
def test_vmap_out_axes_other_than_ints_per_element_are_refused(out_axes):
    # a dict's keys were read as the axes ({0: 1, 1: 0} gave (0, 1)): the transpose of what it says
    with pytest.raises(ValueError, match=r"out_axes must be an int, None, or a tuple of ints"):
        tied.vmap(lambda x: (x, 2 * x), 0, out_axes)


def _read_through_static(m, h):
    m.value = m.value + 1.0  # written through the traced argument
    return h.s.value * 1.0  # read through the static one: the same cell


class _Holder:  # an unregistered class, hashable by identity: a valid static argument
    def __init__(self, s):
        self.s = s


@pytest.mark.parametrize(
    "transform",
    [lambda f: tied.jit(f, static_argnums=1), lambda f: tied.remat(f, static_argnums=(1,))],
    ids=["jit", "remat"],
)
def test_a_cell_held_by_a_traced_and_a_static_argument_is_refused_not_read_stale(transform):
    # the plain walk reads 1.0 (one object, read after its write); the transforms read 0.0 silently
    eager_cell = tied.State(jnp.zeros(()))
    assert float(_read_through_static(eager_cell, _Holder(eager_cell))) == 1.0
    cell = tied.State(jnp.zeros(()))
    with pytest.raises(
        tied.GraphError, match=r"^args\[1\]\.s: tied\.(jit|remat): this object is held by a static"
    ):
        transform(_read_through_static)(cell, _Holder(cell))
    np.testing.assert_array_equal(cell.value, 0.0)  # nothing run, nothing written
    # a static argument holding another cell is still passed as it is
    other = tied.State(jnp.full((), 5.0))
    np.testing.assert_array_equal(transform(_read_through_static)(cell, _Holder(other)), 5.0)
    np.testing.assert_array_equal(cell.value, 1.0)


def test_jit_refuses_a_static_argument_whose_state_cell_was_set_since_it_compiled():
    # jit keyed a static argument by its hash (its identity), so the cell's value was a constant
    # of the compiled function: set between two calls, the second call read the old value silently
    x = jnp.ones(2)
    h = _Holder(tied.State(jnp.float32(1.0)))
    f = tied.jit(lambda x, h: x * h.s.value, static_argnums=1)
    np.testing.assert_array_equal(f(x, h), x * 1.0)
    first = h.s.value
    h.s.value = jnp.float32(5.0)  # set eagerly between the calls: the plain walk gives x * 5
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.s\.value: this array was replaced, since"):
        f(x, h)
    h.s.value = first  # the arrays it was compiled with: runs again
    np.testing.assert_array_equal(f(x, h), x * 1.0)
    # the cell passed as a traced argument reads each call's value
    h.s.value = jnp.float32(5.0)
    np.testing.assert_array_equal(tied.jit(lambda x, s: x * s.value)(x, h.s), x * 5.0)


class _SameKey:  # equal and of one hash whatever it holds: two of them are one static key
    def __init__(self, w):
        self.w = w

    def __eq__(self, other):
        return type(other) is _SameKey

    def __hash__(self):
        return 0


def test_jit_refuses_an_equal_static_argument_holding_other_arrays():
    # the second object hit the first one's compiled version: x * 1 silently, where the plain walk gives x * 3
    x = jnp.ones(2)
    f = tied.jit(lambda x, c: x * c.w, static_argnums=1)
    np.testing.assert_array_equal(f(x, _SameKey(jnp.float32(1.0))), x * 1.0)
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.w: this array was replaced.*equal argument"):
        f(x, _SameKey(jnp.float32(3.0)))


def _bump_and_read(m, h):
    m["s"].value = m["s"].value + 1.0  # written through the differentiated argument
    return (m["w"] * h["s"].value).sum()  # read through the other: the same cell


@pytest.mark.parametrize("jit", [False, True])
def test_grad_refuses_a_cell_held_by_a_differentiated_and_an_other_argument(jit):
    # the plain walk reads the written cell (1.0), so d/dw = [1, 1]; the copy read 0.0 silently
    w = jnp.ones(2)
    eager = tied.State(jnp.zeros(()))
    ref = jax.grad(lambda w: _bump_and_read({"w": w, "s": eager}, {"s": eager}))(w)
    np.testing.assert_array_equal(ref, [1.0, 1.0])
    cell = tied.State(jnp.zeros(()))
    g = tied.grad(_bump_and_read)
    with pytest.raises(
        tied.GraphError, match=r"^args\[1\]\['s'\]: tied\.grad: this object is held by an argument not"
    ):
        (tied.jit(g) if jit else g)({"w": w, "s": cell}, {"s": cell})
    np.testing.assert_array_equal(cell.value, 0.0)  # nothing run, nothing written
    # another cell there is passed as it is
    got = g({"w": w, "s": cell}, {"s": tied.State(jnp.full((), 3.0))})
    np.testing.assert_array_equal(got["w"], [3.0, 3.0])
    np.testing.assert_array_equal(cell.value, 1.0)
