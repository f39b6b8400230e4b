"""tied.map against independent references.

The references never go through `tied`: `helpers.rebuild` maps every place of the
unrolled tree (its own walker), `jax.tree_util.tree_map` maps trees without ties, and
sharing is read from object identity with `helpers.places`.

(`tied.map` is imported from its module until `tied/__init__.py` exports it.)
"""

from __future__ import annotations

import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Chain,
    Dense,
    assert_trees_close,
    children,
    is_array,
    is_tracked_node,
    models,
    places,
    rebuild,
    sharing_groups,
    untied_copy,
)
from hypothesis import given
from hypothesis import strategies as st

import tied
from tied._tree.map import map as tmap

K = jax.tree_util


def snapshot(tree: Any) -> list:
    """Every place of an acyclic tree: its path, its object, the objects of its children,
    and a copy of an array's values."""
    out = []
    for p, x in places(tree):
        kids = children(x)
        kids = None if kids is None else tuple(c for _, c in kids)
        out.append((p, x, kids, np.array(x) if is_array(x) else None))
    return out


def assert_unchanged(tree: Any, snap: list) -> None:
    now = snapshot(tree)
    assert [p for p, *_ in now] == [p for p, *_ in snap]
    for (p, x, kids, val), (_, x0, kids0, val0) in zip(now, snap):
        assert x is x0, p
        if kids0 is not None:
            assert len(kids) == len(kids0) and all(a is b for a, b in zip(kids, kids0)), p
        if val0 is not None:
            np.testing.assert_array_equal(val, val0, err_msg=p)


def unique_arrays(tree: Any) -> list:
    """The distinct array objects of a tree, in first-seen order (by identity)."""
    seen: dict[int, Any] = {}
    for _, x in places(tree):
        if is_array(x):
            seen.setdefault(id(x), x)
    return list(seen.values())


def assert_same_ties(a: Any, b: Any) -> None:
    assert sharing_groups(a, is_array) == sharing_groups(b, is_array)
    assert sharing_groups(a, is_tracked_node) == sharing_groups(b, is_tracked_node)


def as_array(like, y):
    """numpy turns 0-d results into scalars; keep arrays arrays."""
    return np.asarray(y) if isinstance(like, np.ndarray) else y


def affine(x):
    return as_array(x, x * 2 + 1) if np.issubdtype(x.dtype, np.inexact) else x


def blend(e, p):
    return as_array(e, 0.9 * e + 0.1 * p) if np.issubdtype(e.dtype, np.inexact) else e


def tied_model():
    """Chain(d1, d2, d1, head): d1 at two places, d2 shares d1's weight, a static activation."""
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (3, 3))
    d1 = Dense(w, jax.random.normal(k[1], (3,)), jnp.tanh)
    d2 = Dense(w, jnp.zeros(3))
    head = Dense(jax.random.normal(k[2], (2, 3)), jnp.ones(2))
    return Chain(d1, d2, d1, head)


# ---------------------------------------------------------------- random sharing patterns


@given(models())
def test_map_matches_the_unrolled_reference_and_keeps_every_tie(tree):
    snap = snapshot(tree)
    calls = []

    def f(x):
        calls.append(x)
        return affine(x)

    out = tmap(f, tree)
    assert_trees_close(out, rebuild(tree, lambda p, x: affine(x) if is_array(x) else x))
    assert_same_ties(out, tree)
    uniq = unique_arrays(tree)
    assert len(calls) == len(uniq)  # once per unique array (a Functors.jl fmap cache)
    assert {id(x) for x in calls} == {id(x) for x in uniq}
    assert_unchanged(tree, snap)


@given(models())
def test_with_path_gets_the_first_place_of_each_array(tree):
    seen: dict[int, str] = {}
    for p, x in places(tree):
        if is_array(x):
            seen.setdefault(id(x), p)
    got = []
    out = tmap(lambda p, x: got.append((p, id(x))) or p, tree, with_path=True)
    assert got == [(p, i) for i, p in seen.items()]
    for (p, x), (q, y) in zip(places(tree), places(out)):  # the path stands at every place
        assert p == q
        if is_array(x):
            assert y == seen[id(x)], p


@given(models())
def test_several_trees_are_zipped_at_the_same_places(tree):
    other = tmap(affine, tree)
    out = tmap(blend, tree, other)

    def ref(path, x):
        return blend(x, affine(x)) if is_array(x) else x

    assert_trees_close(out, rebuild(tree, ref))
    assert_same_ties(out, tree)


def pytrees():
    rng = np.random.default_rng(0)
    leaf = st.sampled_from([(), (2,), (2, 3)]).map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32))
    scalar = st.sampled_from([None, 3, "s"])
    return st.recursive(
        leaf | scalar,
        lambda kids: (
            st.lists(kids, min_size=1, max_size=3)
            | st.lists(kids, min_size=1, max_size=3).map(tuple)
            | st.dictionaries(st.sampled_from("abc"), kids, min_size=1)
            | st.tuples(kids, kids).map(lambda ab: EqxPairLike(*ab))
        ),
        max_leaves=8,
    )


class EqxPairLike(eqx.Module):
    a: Any
    b: Any


@given(pytrees())
def test_on_a_tree_without_ties_it_is_jax_tree_map(tree):
    tree = untied_copy(tree)  # distinct arrays at every place
    out = tmap(affine, tree)
    ref = K.tree_map(lambda x: affine(x) if is_array(x) else x, tree)  # tied keeps non-arrays
    assert K.tree_structure(out) == K.tree_structure(ref)
    for a, b in zip(K.tree_leaves(out), K.tree_leaves(ref)):
        assert is_array(a) == is_array(b) and (np.array_equal(a, b) if is_array(a) else a == b)
    several = tmap(lambda x, y: x - y, tree, out)
    ref2 = K.tree_map(lambda x, y: x - y if is_array(x) else x, tree, ref)
    for a, b in zip(K.tree_leaves(several), K.tree_leaves(ref2)):
        assert is_array(a) == is_array(b) and (np.allclose(a, b) if is_array(a) else a == b)


# ---------------------------------------------------------------- fixed cases


def test_cast_to_bfloat16_keeps_ties_statics_and_integer_arrays():
    m = tied_model()
    m.ids = jnp.arange(3)
    half = tmap(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, m)
    assert half.layers[0] is half.layers[2]
    assert half.layers[0].weight is half.layers[1].weight
    assert half.layers[0].weight.dtype == jnp.bfloat16 and half.ids.dtype == jnp.int32
    assert half.ids is m.ids  # f returned it unchanged
    assert half.layers[0].activation is jnp.tanh and half.layers[1].activation is None
    np.testing.assert_array_equal(
        np.asarray(half.layers[3].weight, np.float32),
        np.asarray(m.layers[3].weight.astype(jnp.bfloat16), np.float32),
    )


def test_ema_of_a_tied_model_over_adam_steps_matches_a_hand_written_ema():
    m = tied_model()
    x = jnp.ones((4, 3))
    loss = lambda m: jnp.sum(m(x) ** 2)
    state = tied.optim.setup(optax.adam(1e-1), m)
    ema = tmap(jnp.copy, m)
    ref = {i: np.array(w) for i, w in enumerate(tied.flatten(m)[0])}
    for _ in range(3):
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        ema = tmap(lambda e, p: 0.9 * e + 0.1 * p, ema, m)
        for i, w in enumerate(tied.flatten(m)[0]):
            ref[i] = 0.9 * ref[i] + 0.1 * np.asarray(w)
        assert ema.layers[0] is ema.layers[2] and ema.layers[1].weight is ema.layers[0].weight
    for i, e in enumerate(tied.flatten(ema)[0]):
        np.testing.assert_allclose(np.asarray(e), ref[i], rtol=1e-6)


def test_functors_fmap_cache_and_several_trees():
    x = jnp.arange(3.0)
    y = jnp.ones(2)
    tree = {"a": x, "b": (x, y), "c": [y, x]}
    calls = []
    out = tmap(lambda v: calls.append(v) or v * 10, tree)
    assert len(calls) == 2
    assert out["a"] is out["b"][0] is out["c"][1] and out["b"][1] is out["c"][0]
    other = tmap(lambda v: v + 1, tree)
    both = tmap(lambda u, v: (u, v), tree, other)  # f may return any object: it stands at every place
    assert both["a"] is both["b"][0] is both["c"][1]
    np.testing.assert_array_equal(both["a"][1], x + 1)


def test_views_map_their_source_and_stay_views():
    enc_w = jnp.arange(6.0).reshape(2, 3)
    m = {"enc": Dense(enc_w, jnp.zeros(2)), "dec": Dense(tied.transpose(enc_w), jnp.zeros(3))}
    out = tmap(lambda v: v * 2, m)
    assert isinstance(out["dec"].weight, tied.View)
    assert out["dec"].weight.source is out["enc"].weight
    assert out["dec"].weight.fn is m["dec"].weight.fn
    np.testing.assert_array_equal(tied.materialize(out["dec"].weight), (enc_w * 2).T)


def test_a_cycle_is_mapped_and_kept():
    w = jnp.ones(2)
    a = [w]
    a.append(a)  # a list that holds itself
    out = tmap(lambda v: v + 1, a)
    assert out[1] is out and out is not a
    np.testing.assert_array_equal(out[0], w + 1)
    assert a[1] is a and a[0] is w


def test_under_tied_jit():
    m = tied_model()
    out = tied.jit(lambda m: tmap(lambda v: v * 3, m))(m)
    assert out.layers[0] is out.layers[2] and out.layers[0].weight is out.layers[1].weight
    np.testing.assert_allclose(out.layers[3].weight, 3 * m.layers[3].weight, rtol=1e-6)


def test_a_root_array_and_threads():
    x = jnp.ones(3)
    assert tmap(lambda p, v: p, x, with_path=True) == ""
    m = tied_model()
    results = [None] * 8

    def work(k):
        results[k] = tmap(lambda v: v * k, m)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, out in enumerate(results):
        assert out.layers[0] is out.layers[2]
        np.testing.assert_allclose(out.layers[3].bias, k * m.layers[3].bias)


# ---------------------------------------------------------------- is_leaf (PyTorch module.apply)


def test_is_leaf_passes_each_unique_layer_once_like_module_apply():
    m = tied_model()
    m.layers[1] = Dense(jnp.full((3, 3), 2.0), jnp.zeros(3))  # no longer shares d1's weight
    snap = snapshot(m)
    seen = []

    def init(path, layer):  # a torch-style init_weights: zero the bias, scale the weight
        seen.append((path, layer))
        return Dense(0.5 * layer.weight, jnp.zeros_like(layer.bias), layer.activation)

    out = tmap(init, m, with_path=True, is_leaf=lambda x: isinstance(x, Dense))
    assert [p for p, _ in seen] == [".layers[0]", ".layers[1]", ".layers[3]"]
    assert seen[0][1] is m.layers[0]  # the user's own object, not a copy
    assert out.layers[0] is out.layers[2]
    for i in (0, 1, 3):
        np.testing.assert_allclose(out.layers[i].weight, 0.5 * m.layers[i].weight)
        assert not np.any(np.asarray(out.layers[i].bias))
    assert_unchanged(m, snap)


def test_is_leaf_refuses_to_cut_a_tie_through_the_container():
    m = tied_model()  # d2 (at .layers[1]) shares d1's weight
    with pytest.raises(
        ValueError,
        match=r"container at \.layers\[0\].*\.layers\[0\]\.weight is also at "
        r"\.layers\[1\]\.weight.*tie would be cut",
    ):
        tmap(lambda d: d, m, is_leaf=lambda x: isinstance(x, Dense) and x.activation is not None)


def test_is_leaf_with_several_trees_and_on_the_root():
    m = tied_model()
    m.layers[1] = Dense(jnp.full((3, 3), 2.0), jnp.zeros(3))
    other = tmap(lambda v: v + 1, m)
    out = tmap(
        lambda a, b: Dense(a.weight - b.weight, a.bias, None),
        m,
        other,
        is_leaf=lambda x: isinstance(x, Dense),
    )
    assert out.layers[0] is out.layers[2]
    np.testing.assert_allclose(out.layers[3].weight, -np.ones((2, 3)))
    assert tmap(lambda c: "whole", m, is_leaf=lambda x: isinstance(x, Chain)) == "whole"


# ---------------------------------------------------------------- errors


def test_rest_with_different_ties_is_refused_naming_the_places():
    m = tied_model()
    snap = snapshot(m)
    with pytest.raises(
        ValueError,
        match=r"rest\[0\].*\.layers\[0\]\.weight and \.layers\[1\]\.weight "
        r"hold one array in the first tree but two",
    ):
        tmap(lambda a, b: a, m, untied_copy(m))
    assert_unchanged(m, snap)


def test_rest_with_a_missing_array_or_another_shape_is_refused():
    m = tied_model()
    short = tied_model()
    short.layers[3] = Dense(short.layers[3].weight, None)
    with pytest.raises(ValueError, match=r"rest\[0\].*\.layers\[3\]\.bias holds an array in the first tree"):
        tmap(lambda a, b: a, m, short)
    wide = tmap(lambda v: jnp.zeros((5,) + v.shape), m)
    with pytest.raises(
        ValueError,
        match=r"rest\[1\].*\.layers\[0\]\.weight has shape \(5, 3, 3\), "
        r"expected \(3, 3\)",
    ):
        tmap(lambda a, b, c: a, m, m, wide)
    other = tied_model()
    other.layers[0].activation = jax.nn.relu  # a static differs
    other.layers[2] = other.layers[0]
    with pytest.raises(ValueError, match=r"rest\[0\].*a container type or a static value"):
        tmap(lambda a, b: a, m, other)


# ---------------------------------------------------------------- state
# `tied.map(only=...)` over parameters or state, and `is_leaf` against back-references (issues 15, 17).


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
