"""The core walk: flatten, unflatten, ties, GraphDef, cycles and errors.

References are computed without `tied`: the path walker in helpers.py records
places, identity classes and keystr paths independently.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    Box,
    Chain,
    Dense,
    EqxPair,
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

import tied

K = jax.tree_util


def reference_ties(tree: Any) -> list[tuple[str, ...]]:
    """Objects (arrays, nodes) met at two or more places, entering each node once."""
    paths: dict[int, list[str]] = {}
    for p, x in places(tree, into_shared=False):
        if is_array(x) or is_tracked_node(x) or isinstance(x, tied.View):
            paths.setdefault(id(x), []).append(p or "<root>")
    return [tuple(ps) for ps in paths.values() if len(ps) > 1]


def distinct_arrays(tree: Any) -> list:
    seen: dict[int, Any] = {}
    for _, x in places(tree):
        if is_array(x):
            seen.setdefault(id(x), x)
    return list(seen.values())


# ---------------------------------------------------------------- properties


@given(models())
def test_leaves_are_the_distinct_arrays_in_first_seen_order(model):
    expected = distinct_arrays(model)
    first = None
    for _ in range(3):  # a structure met twice gets a compiled plan, used from the third time
        leaves, gdef = tied.flatten(model)
        assert len(leaves) == len(expected) == gdef.num_leaves
        assert all(a is b for a, b in zip(leaves, expected))
        assert first is None or gdef == first
        first = gdef


@given(models())
def test_round_trip_keeps_types_statics_and_sharing(model):
    leaves, gdef = tied.flatten(model)
    for _ in range(2):  # the second unflatten may run a compiled plan
        back = tied.unflatten(gdef, leaves)
        orig, new = list(places(model)), list(places(back))
        assert [p for p, _ in orig] == [p for p, _ in new]
        for (path, x), (_, y) in zip(orig, new):
            assert type(x) is type(y), path
            if children(x) is None:  # arrays and statics: the very same objects
                assert x is y, path
        for pred in (is_array, is_tracked_node):
            assert sharing_groups(back, pred) == sharing_groups(model, pred)


@given(models())
def test_unflatten_with_new_leaves_puts_one_new_array_at_every_place(model):
    leaves, gdef = tied.flatten(model)
    new_leaves = [jnp.asarray(x) * 2 if tied.is_param(x) else jnp.asarray(x) + 1 for x in leaves]
    back = tied.unflatten(gdef, new_leaves)
    new_of = {id(old): new for old, new in zip(leaves, new_leaves)}
    for (path, x), (_, y) in zip(places(model), places(back)):
        if is_array(x):
            assert y is new_of[id(x)], path
            factor = 2 if tied.is_param(x) else None
            ref = np.asarray(x) * 2 if factor else np.asarray(x) + 1
            np.testing.assert_allclose(np.asarray(y), ref, err_msg=path)
    assert sharing_groups(back, is_tracked_node) == sharing_groups(model, is_tracked_node)


@given(models())
def test_ties_match_the_sharing_found_independently(model):
    assert tied.ties(model) == reference_ties(model)


@given(models())
def test_graphdef_equality_follows_structure_and_sharing(model):
    leaves, gdef = tied.flatten(model)
    for _ in range(2):  # the last one may run a compiled plan: it must guard the sharing
        _, again = tied.flatten(model)
        assert again == gdef and hash(again) == hash(gdef)
    # Same structure and sharing, new arrays: an equal GraphDef.
    copy = tied.unflatten(gdef, [jnp.array(x) for x in leaves])
    _, gcopy = tied.flatten(copy)
    assert gcopy == gdef and hash(gcopy) == hash(gdef)
    # The same values with every place its own object: equal only if nothing was shared.
    _, guntied = tied.flatten(untied_copy(model))
    assert (guntied == gdef) == (reference_ties(model) == [])


# ---------------------------------------------------------------- sharing, by hand


def test_seed_model_structure_and_ties():
    d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    c = Chain(d1, Dense(d1.weight, d1.bias), d1)
    leaves, gdef = tied.flatten(c)
    assert len(leaves) == 2 and leaves[0] is d1.weight and leaves[1] is d1.bias
    assert tied.ties(c) == [
        (".layers[0]", ".layers[2]"),
        (".layers[0].weight", ".layers[1].weight"),
        (".layers[0].bias", ".layers[1].bias"),
    ]
    back = tied.unflatten(gdef, [leaves[0] + 1, leaves[1]])
    assert back.layers[0] is back.layers[2] and back.layers[0] is not back.layers[1]
    assert back.layers[0].weight is back.layers[1].weight
    np.testing.assert_allclose(back.layers[1].weight, 2 * np.ones((2, 2)))
    assert type(back) is Chain and type(back.layers[1]) is Dense


def test_equal_values_in_distinct_arrays_never_tie():
    w = jnp.ones(3)
    model = {"a": w, "b": jnp.ones(3), "c": w}
    leaves, _ = tied.flatten(model)
    assert len(leaves) == 2
    assert tied.ties(model) == [("['a']", "['c']")]


def test_static_leaves_never_tie_and_come_back_as_themselves():
    fn = jnp.tanh
    model = [1, 1, "s", "s", None, None, fn, fn, 2.5, True]
    leaves, gdef = tied.flatten(model)
    assert leaves == [] and tied.ties(model) == []
    back = tied.unflatten(gdef, [])
    assert back == model and all(a is b for a, b in zip(back, model))


def test_numpy_and_integer_arrays_are_leaves():
    model = {"f": np.ones(2, np.float32), "i": jnp.arange(3), "b": np.array([True])}
    leaves, gdef = tied.flatten(model)
    assert [type(x) for x in leaves] == [np.ndarray, np.ndarray, type(model["i"])]
    back = tied.unflatten(gdef, leaves)
    assert all(back[k] is model[k] for k in model)


def test_ordered_dict_and_frozen_dataclass_round_trip():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        w: Any
        name: str

    w = jnp.ones(2)
    model = OrderedDict(z=Cfg(w, "a"), a=[w])
    leaves, gdef = tied.flatten(model)
    back = tied.unflatten(gdef, [w * 3])
    assert type(back) is OrderedDict and list(back) == ["z", "a"]
    assert type(back["z"]) is Cfg and back["z"].name == "a"
    assert back["z"].w is back["a"][0]
    np.testing.assert_allclose(back["a"][0], 3 * np.ones(2))


def test_registered_class_is_rebuilt_without_calling_init():
    calls = []

    @tied.register
    class Odd:
        def __init__(self, n):
            calls.append(n)
            self.w = jnp.full(n, 1.0)
            self.n = n

    model = Odd(3)
    leaves, gdef = tied.flatten(model)
    back = tied.unflatten(gdef, [leaves[0] + 1])
    assert calls == [3]
    assert type(back) is Odd and back.n == 3
    np.testing.assert_allclose(back.w, 2 * np.ones(3))


def test_pytree_children_made_on_the_fly_are_not_read_as_shared():
    # A pytree whose flatten returns a new tuple each time: once freed, its id may be
    # reused by the next one; the walk must not take that for sharing.
    class Pair:
        def __init__(self, w, b):
            self.w, self.b = w, b

    K.register_pytree_node(Pair, lambda p: (((p.w, p.b),), None), lambda _, ch: Pair(*ch[0]))
    model = [Pair(jnp.full(2, float(i)), jnp.full(2, -float(i))) for i in range(6)]
    for _ in range(3):  # the walk, then a compiled plan
        leaves, gdef = tied.flatten(model)
        assert len(leaves) == 12 and tied.ties(model) == []
        back = tied.unflatten(gdef, leaves)
        assert [float(p.w[0]) for p in back] == [float(i) for i in range(6)]
        assert [float(p.b[0]) for p in back] == [-float(i) for i in range(6)]


def test_views_are_nodes_with_the_source_listed_once():
    w = jnp.arange(6.0).reshape(2, 3)
    model = {"enc": w, "dec": tied.transpose(w)}
    leaves, gdef = tied.flatten(model)
    assert len(leaves) == 1 and leaves[0] is w
    assert tied.ties(model) == [("['dec'].source", "['enc']")]
    back = tied.unflatten(gdef, [w + 1])
    assert type(back["dec"]) is tied.View and back["dec"].source is back["enc"]
    np.testing.assert_allclose(tied.materialize(back["dec"]), (w + 1).T)


def test_unflatten_with_the_wrong_number_of_leaves_is_an_error():
    _, gdef = tied.flatten([jnp.ones(1), jnp.ones(1)])
    with pytest.raises(ValueError, match="2 unique arrays but 1 leaves were given"):
        tied.unflatten(gdef, [jnp.ones(1)])


# ---------------------------------------------------------------- cycles


def _round_trip(model):
    """Flatten and unflatten three times (the walk, then compiled plans), doubling the arrays."""
    leaves, gdef = tied.flatten(model)
    for _ in range(2):
        again, gagain = tied.flatten(model)
        assert gagain == gdef and all(a is b for a, b in zip(again, leaves))
        tied.unflatten(gdef, leaves)
    return leaves, tied.unflatten(gdef, [x * 2 for x in leaves])


def test_list_containing_itself():
    w = jnp.ones(2)
    a = [w]
    a.append(a)
    leaves, back = _round_trip(a)
    assert len(leaves) == 1
    assert type(back) is list and back[1] is back and back is not a
    np.testing.assert_allclose(back[0], 2 * np.ones(2))
    assert tied.ties(a) == [("<root>", "[1]")]


def test_registered_child_pointing_back_to_its_parent():
    @tied.register
    class Parent:
        def __init__(self):
            self.w = jnp.ones(2)
            self.child = Box(self, jnp.zeros(1))

    p = Parent()
    leaves, back = _round_trip(p)
    assert len(leaves) == 2
    assert type(back) is Parent and type(back.child) is Box
    assert back.child.a is back
    np.testing.assert_allclose(back.w, 2 * np.ones(2))
    assert tied.ties(p) == [("<root>", ".child.a")]


def test_dict_cycle():
    w = jnp.ones(3)
    d = {"w": w, "sub": {"w": w}}
    d["sub"]["up"] = d
    leaves, back = _round_trip(d)
    assert len(leaves) == 1
    assert back["sub"]["up"] is back and back["w"] is back["sub"]["w"]
    assert tied.ties(d) == [("<root>", "['sub']['up']"), ("['sub']['w']", "['w']")]


def test_cycle_through_a_tuple_entered_at_the_list_is_rebuilt():
    a = []
    a.append((a, jnp.ones(1)))
    leaves, back = _round_trip(a)
    assert back[0][0] is back and type(back[0]) is tuple
    np.testing.assert_allclose(back[0][1], 2 * np.ones(1))


def test_cycle_that_cannot_be_rebuilt_names_the_path():
    t = ([],)
    t[0].append(t)
    with pytest.raises(tied.GraphError, match=r"^\[0\]\[0\]: a reference cycle passes through .*tuple"):
        tied.flatten(t)
    m = {"m": EqxPair([], 1)}
    m["m"].a.append(m["m"])
    with pytest.raises(tied.GraphError, match=r"^\['m'\]\.a\[0\]: a reference cycle .*pytree"):
        tied.flatten(m)


def test_deep_nesting_is_an_error_not_a_crash():
    x: Any = jnp.ones(1)
    for _ in range(20000):
        x = [x]
    with pytest.raises(tied.GraphError, match=r"^\[0\]\[0\].*nested too deeply"):
        tied.flatten(x)


# ---------------------------------------------------------------- unregistered objects


class Unregistered:
    def __init__(self, w):
        self.w = w


def test_unregistered_object_with_arrays_names_path_class_and_fix():
    model = {"layers": [Dense(jnp.ones(1), jnp.ones(1)), Unregistered(jnp.ones(2))]}
    with pytest.raises(
        tied.GraphError,
        match=r"^\['layers'\]\[1\]: an object of unregistered class .*test_graph\.Unregistered"
        r".*tied\.register",
    ):
        tied.flatten(model)


def test_unregistered_wrapper_around_registered_layers_is_an_error():
    # The arrays sit two levels down, inside a registered layer: still never dropped.
    model = Chain(Unregistered([Dense(jnp.ones(1), jnp.ones(1))]))
    with pytest.raises(tied.GraphError, match=r"^\.layers\[0\]: .*Unregistered.*tied\.register"):
        tied.flatten(model)


def test_unregistered_object_without_arrays_is_a_static_leaf_even_on_a_cycle():
    u = Unregistered([1])
    u.w.append(u.w)  # a cycle inside an object the walk does not enter
    model = {"u": u, "w": jnp.ones(1)}
    leaves, gdef = tied.flatten(model)
    assert len(leaves) == 1 and gdef.statics == (u,)
    assert tied.unflatten(gdef, leaves)["u"] is u


# ---------------------------------------------------------------- GraphDef


def test_graphdef_equal_structure_equal_hash():
    a = Chain(Dense(jnp.ones(2), jnp.zeros(2)))
    b = Chain(Dense(jnp.zeros(2), jnp.ones(2)))
    ga, gb = tied.flatten(a)[1], tied.flatten(b)[1]
    assert ga == gb and hash(ga) == hash(gb)
    assert len({ga, gb}) == 1


def test_graphdef_differs_with_sharing():
    w = jnp.ones(2)
    d = Dense(w, w)
    shared_node = tied.flatten([d, d])[1]
    shared_array = tied.flatten([Dense(w, w), Dense(w, w)])[1]
    untied = tied.flatten([Dense(jnp.ones(2), jnp.ones(2)), Dense(jnp.ones(2), jnp.ones(2))])[1]
    assert len({shared_node, shared_array, untied}) == 3
    assert shared_node != shared_array != untied != shared_node


def test_graphdef_statics_compare_with_their_type():
    g1, gtrue, g1f = (tied.flatten([jnp.ones(1), s])[1] for s in (1, True, 1.0))
    assert g1 != gtrue and g1 != g1f and gtrue != g1f
    assert g1 == tied.flatten([jnp.zeros(1), 1])[1]
    assert tied.flatten({"a": "x"})[1] != tied.flatten({"a": "y"})[1]
    assert tied.flatten({"a": 1})[1] != tied.flatten({"b": 1})[1]


def test_unhashable_static_names_its_path_when_hashed():
    class Config:
        __hash__ = None

        def __eq__(self, other):
            return isinstance(other, Config)

    model = {"w": jnp.ones(2), "cfg": [Box(Config(), 1)]}
    _, gdef = tied.flatten(model)
    assert gdef == tied.flatten(model)[1]  # equality still works
    with pytest.raises(
        tied.GraphError, match=r"^\['cfg'\]\[0\]\.a: static field of type Config is not hashable"
    ):
        hash(gdef)


# ---------------------------------------------------------------- paths


class NTup(NamedTuple):
    first: Any
    second: Any


class Mod(eqx.Module):
    weight: Any
    bias: Any


def _keystr_paths(tree):
    return [K.keystr(p) for p, _ in K.tree_flatten_with_path(tree)[0]]


def test_tie_paths_are_keystr_for_jax_known_containers():
    w = jnp.ones(2)
    jax_tree = {"enc": [NTup(w, 1.0), Mod(jnp.zeros(1), w)], "dec": (w, {"x": w})}
    # JAX sees one leaf per place: its paths of w, in order, are the tie tuple.
    expected = tuple(
        K.keystr(p) for p, x in K.tree_flatten_with_path(jax_tree)[0] if x is w
    )
    assert expected == ("['dec'][0]", "['dec'][1]['x']", "['enc'][0].first", "['enc'][1].bias")
    assert tied.ties(jax_tree) == [expected]


def test_tie_paths_for_attributes_are_keystr_of_attribute_keys():
    @dataclasses.dataclass
    class Holder:
        inner: Any

    w = jnp.ones(2)
    model = Chain(Dense(w, jnp.zeros(2)), Holder({"k": [w]}))
    ga, da, sk = K.GetAttrKey, K.DictKey, K.SequenceKey
    expected = (
        K.keystr((ga("layers"), sk(0), ga("weight"))),
        K.keystr((ga("layers"), sk(1), ga("inner"), da("k"), sk(0))),
    )
    assert tied.ties(model) == [expected]
    assert expected == (".layers[0].weight", ".layers[1].inner['k'][0]")


@given(models())
def test_compiled_plans_never_return_a_stale_structure(model):
    for _ in range(3):
        tied.flatten(model)  # now a compiled plan exists for this structure
    leaves, gdef = tied.flatten(model)
    one = jnp.ones(())
    variants = [
        tied.unflatten(gdef, [jnp.array(x) for x in leaves]),  # same structure and sharing
        untied_copy(model),  # no sharing at all
        rebuild(model, lambda p, x: one if tied.is_param(x) else x),  # one array everywhere
        rebuild(model, lambda p, x: x if is_array(x) else "changed"),  # other statics
    ]
    for v in variants:
        vleaves, vgdef = tied.flatten(v)
        expected = distinct_arrays(v)
        assert len(vleaves) == len(expected) and all(a is b for a, b in zip(vleaves, expected))
        assert tied.ties(v) == reference_ties(v)
        back = tied.unflatten(vgdef, vleaves)
        for pred in (is_array, is_tracked_node):
            assert sharing_groups(back, pred) == sharing_groups(v, pred)
        assert [x for _, x in places(back) if children(x) is None and not is_array(x)] == [
            x for _, x in places(v) if children(x) is None and not is_array(x)
        ]


def test_tuples_of_static_values_are_values_not_ties():
    w = jnp.ones(2)
    shape = (2, 2)  # one object at two places, as Python reuses constant tuples
    model = [{"w": w, "shape": shape, "none": ()}, {"w": jnp.zeros(2), "shape": shape, "none": ()}]
    assert tied.ties(model) == []
    assert tied.flatten(model)[1] == tied.flatten(
        [{"w": w, "shape": (2, int("2")), "none": ()}, {"w": jnp.zeros(2), "shape": (2, 2), "none": ()}]
    )[1]
    g = tied.grad(lambda m: sum(jnp.sum(d["w"]) for d in m))(model)
    assert g[0]["shape"] == (None, None) and g[0]["none"] == ()
    pair = (w, 3)  # a tuple holding an array is a node: its identity is sharing
    assert tied.ties([pair, pair]) == [("[0]", "[1]")]


def test_unregistered_list_subclass_holding_arrays_is_refused():
    class Layers(list):
        pass

    with pytest.raises(tied.GraphError, match=r"\['a'\]: .*Layers holds arrays.*subclasses list"):
        tied.flatten({"a": Layers([jnp.ones(2)])})
