"""`tied.map(only=...)` over parameters or state, and `is_leaf` against back-references (issues 15, 17)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied


def model():
    w = jnp.arange(4.0)
    stat = tied.State(jnp.full(3, 2.0))
    return {
        "w": w,
        "head": w,  # tied
        "ids": jnp.arange(3),  # an integer array: neither a parameter nor state
        "bn": {"mean": stat, "scale": jnp.ones(3)},
        "again": stat,  # one state at two places
        "rng": tied.Rng(0),
    }


def test_only_params_maps_the_parameters_and_passes_the_rest_through():
    m = model()
    out = tied.map(lambda x: x * 10, m, only="params")
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(4.0) * 10)
    np.testing.assert_array_equal(np.asarray(out["bn"]["scale"]), np.full(3, 10.0))
    assert out["w"] is out["head"]
    assert out["ids"] is m["ids"]
    assert out["bn"]["mean"].value is m["bn"]["mean"].value and out["again"] is out["bn"]["mean"]
    assert out["rng"].count.value is m["rng"].count.value and out["rng"].key is m["rng"].key


def test_only_state_maps_the_state_once_and_passes_the_parameters_through():
    m = model()
    calls = []
    out = tied.map(lambda p, x: calls.append(p) or x + 1, m, with_path=True, only="state")
    assert sorted(calls) == ["['again'].value", "['rng'].count.value"]  # one call per state
    np.testing.assert_array_equal(np.asarray(out["again"].value), np.full(3, 3.0))
    assert out["bn"]["mean"] is out["again"]
    assert int(out["rng"].count.value) == 1 and out["rng"].count.value.dtype == jnp.uint32
    for k in ("w", "head", "ids"):
        assert out[k] is m[k]
    assert out["bn"]["scale"] is m["bn"]["scale"] and out["rng"].key is m["rng"].key


def test_only_with_more_trees():
    m = model()
    ema = tied.map(jnp.zeros_like, m, only="params")
    new = tied.map(lambda e, p: 0.5 * e + 0.5 * p, ema, m, only="params")
    np.testing.assert_array_equal(np.asarray(new["w"]), 0.5 * np.arange(4.0))
    assert new["again"].value is ema["again"].value  # state of the first tree, untouched


def test_only_all_is_the_default_and_a_wrong_choice_is_refused():
    m = model()
    out = tied.map(lambda x: x, m)
    assert out["ids"] is m["ids"] and out["again"].value is m["again"].value
    with pytest.raises(ValueError, match=r"only='param'\): only is one of 'all', 'params', 'state'"):
        tied.map(lambda x: x, m, only="param")


# ---------------------------------------------------------------- is_leaf and back-references


@tied.register
class Node:
    def __init__(self):
        self.w = jnp.ones(2)
        self.kids = []


@tied.register
class Kid:
    def __init__(self, parent):
        self.parent = parent
        self.v = jnp.zeros(2)


def test_is_leaf_on_a_container_that_reaches_the_root_is_refused():
    root = Node()
    root.kids.append(Kid(root))
    with pytest.raises(
        ValueError,
        match=r"is_leaf holds for the container at \.kids\[0\].*the container at "
        r"\.kids\[0\]\.parent is also at <root>, outside it",
    ):
        tied.map(lambda kid: kid, root, is_leaf=lambda c: isinstance(c, Kid))
    assert root.kids[0].parent is root


def test_is_leaf_on_a_container_without_back_references_still_works():
    root = Node()
    kid = Kid(None)
    root.kids += [kid, kid]

    def f(k):
        if not isinstance(k, Kid):
            return k
        new = Kid(None)
        new.v = k.v + 1
        return new

    out = tied.map(f, root, is_leaf=lambda c: isinstance(c, Kid))
    assert out.kids[0] is out.kids[1] and out.kids[0] is not kid
    np.testing.assert_array_equal(np.asarray(out.kids[0].v), np.ones(2))
    assert out.w is root.w


def test_only_state_of_a_typed_key_model():
    m = {"rng": tied.Rng(jax.random.key(3)), "k": tied.State(jax.random.key(5))}
    out = tied.map(lambda x: x, m, only="state")
    assert out["k"].value is m["k"].value and out["rng"].count.value is m["rng"].count.value
