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


def test_any_depth_that_flatten_accepts_every_entry_point_accepts():
    # 20,000 levels: far past Python's recursion limit. Every traversal is iterative.
    x: Any = {"w": jnp.ones(1)}
    for i in range(20000):  # lists, registered objects and dicts in turn
        x = [x] if i % 3 == 0 else Box(x, 1.0) if i % 3 == 1 else {"k": x}
    for _ in range(3):  # the walk, then a compiled plan
        leaves, gdef = tied.flatten(x)
        assert len(leaves) == 1
    rebuilt = tied.unflatten(gdef, [2 * leaves[0]])
    _, again = tied.flatten(rebuilt)
    assert again == gdef
    # Each kind comes back as itself: the outermost levels are Box(list(dict(...))).
    assert type(rebuilt) is Box and type(rebuilt.a) is list and type(rebuilt.a[0]) is dict
    assert rebuilt.b == 1.0 and type(rebuilt.a[0]["k"]) is Box
    (path,) = gdef.leaf_paths()[0]
    assert path.startswith(".a[0]['k'].a[0]['k']") and path.endswith("['k'].a[0]['w']")
    assert path.count(".a") == path.count("[0]") == path.count("['k']") + 1 == 6667
    assert tied.ties(x) == []
    g = tied.grad(lambda m: jnp.sum(tied.flatten(m)[0][0] * 3.0))(x)
    assert float(tied.flatten(g)[0][0][0]) == 3.0
    gp = tied.grad(lambda m: jnp.sum(tied.flatten(m)[0][0] * 3.0), per_location=True)(x)
    assert float(tied.flatten(gp)[0][0][0]) == 3.0


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


def test_a_static_with_its_own_eq_is_compared_by_identity_even_when_unhashable():
    """Issue 17, point 2: a user's __eq__ cannot be trusted to mean "rebuilds identically",
    so such a static is compared (and hashed) by identity."""

    class Config:
        __hash__ = None

        def __eq__(self, other):
            return isinstance(other, Config)

    cfg = Config()
    model = {"w": jnp.ones(2), "cfg": [Box(cfg, 1)]}
    _, gdef = tied.flatten(model)
    assert gdef == tied.flatten(model)[1] and hash(gdef) == hash(tied.flatten(model)[1])
    other = tied.flatten({"w": jnp.ones(2), "cfg": [Box(Config(), 1)]})[1]
    assert gdef != other  # equal by its __eq__, but another object
    leaves, gdef = tied.flatten(model)
    assert tied.unflatten(gdef, leaves)["cfg"][0].a is cfg


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
    expected = tuple(K.keystr(p) for p, x in K.tree_flatten_with_path(jax_tree)[0] if x is w)
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
    assert (
        tied.flatten(model)[1]
        == tied.flatten(
            [{"w": w, "shape": (2, int("2")), "none": ()}, {"w": jnp.zeros(2), "shape": (2, 2), "none": ()}]
        )[1]
    )
    g = tied.grad(lambda m: sum(jnp.sum(d["w"]) for d in m))(model)
    assert g[0]["shape"] == (None, None) and g[0]["none"] == ()
    pair = (w, 3)  # a tuple holding an array is a node: its identity is sharing
    assert tied.ties([pair, pair]) == [("[0]", "[1]")]


def test_unregistered_list_subclass_holding_arrays_is_refused():
    class Layers(list):
        pass

    with pytest.raises(tied.GraphError, match=r"\['a'\]: .*Layers holds arrays.*subclasses list"):
        tied.flatten({"a": Layers([jnp.ones(2)])})


# ---------------------------------------------------------------- results never depend on history


@tied.register
class YZ:
    """Fields in the order they were assigned, which differs between instances."""

    def __init__(self, y, z, order):
        for name in order:
            setattr(self, name, {"y": y, "z": z}[name])


def test_leaf_order_follows_each_objects_own_field_order_whatever_was_flattened_before():
    y, z = jnp.ones(1), jnp.zeros(2)
    first = YZ(y, z, "yz")
    for _ in range(3):  # compiles a plan for the y-then-z structure
        assert [id(x) for x in tied.flatten(first)[0]] == [id(y), id(z)]
    y2, z2 = jnp.ones(1), jnp.zeros(2)
    other = YZ(y2, z2, "zy")
    for _ in range(3):
        leaves, gdef = tied.flatten(other)
        assert [id(x) for x in leaves] == [id(z2), id(y2)]  # the walk's order: z, then y
        assert gdef.leaf_paths() == ((".z",), (".y",))
        assert [id(p) for p in tied.params(other)] == [id(z2), id(y2)]


def test_unsortable_dict_keys_keep_each_dicts_own_order():
    a, b = jnp.ones(1), jnp.zeros(1)
    for _ in range(3):
        tied.flatten({1: a, "x": b})
    leaves, gdef = tied.flatten({"x": b, 1: a})
    assert [id(x) for x in leaves] == [id(b), id(a)]
    assert gdef.leaf_paths() == (("['x']",), ("[1]",))


@pytest.mark.parametrize(
    "seen, model",
    [
        ({"w": 1, "s": 0.0}, {"w": 1, "s": -0.0}),
        ({"w": 1, "s": 1}, {"w": 1, "s": 1.0}),
        ({"w": 1, "s": 1}, {"w": 1, "s": True}),
        ({"w": 1, "s": float("nan")}, {"w": 1, "s": -float("nan")}),
        ({"w": 1, 1: 0}, {"w": 1, 1.0: 0}),
        ({"w": 1, 1: 0}, {"w": 1, True: 0}),
    ],
)
def test_a_rebuilt_static_is_the_models_own_value_in_type_and_bits(seen, model):
    w = jnp.ones(2)
    seen, model = ({k: (w if k == "w" else v) for k, v in d.items()} for d in (seen, model))
    for _ in range(3):
        tied.flatten(seen)
        tied.unflatten(*reversed(tied.flatten(seen)))
    for _ in range(3):
        leaves, gdef = tied.flatten(model)
        out = tied.unflatten(gdef, leaves)
        assert [type(k) for k in out] == [type(k) for k in model]
        for k in model:
            if k != "w":
                (k2,) = [x for x in out if x != "w"]
                assert type(k2) is type(k)
                assert np.array(out[k2]).tobytes() == np.array(model[k]).tobytes()
                assert type(out[k2]) is type(model[k])


def test_equal_statics_of_other_bits_give_unequal_graphdefs():
    w = jnp.ones(1)
    assert tied.flatten({"w": w, "s": 0.0})[1] != tied.flatten({"w": w, "s": -0.0})[1]
    assert tied.flatten({"w": w, 1: 0})[1] != tied.flatten({"w": w, 1.0: 0})[1]
    nan = tied.flatten({"w": w, "s": float("nan")})[1]
    assert nan == tied.flatten({"w": w, "s": float("nan")})[1]  # the same bits: equal, no retrace


# ---------------------------------------------------------------- every holder of arrays is walked or refused


@tied.register
class Layers(list):
    """A registered list subclass with a field of its own."""


@tied.register
class Params(dict):
    pass


@tied.register
class Slotted:
    __slots__ = ("w", "b", "unset")

    def __init__(self, w, b):
        self.w, self.b = w, b


def test_registered_list_and_dict_subclasses_are_walked_items_and_fields():
    w, b = jnp.ones(2), jnp.zeros(2)
    layers = Layers([Dense(w, b), Dense(w, b)])
    layers.name = "stack"
    layers.extra = w
    p = Params(a=w, c=b)
    p.scale = jnp.ones(())
    model = {"layers": layers, "p": p}
    for _ in range(3):
        leaves, gdef = tied.flatten(model)
        assert [id(x) for x in leaves] == [id(w), id(b), id(p.scale)]
        assert gdef.leaf_paths()[0] == (
            "['layers'][0].weight",
            "['layers'][1].weight",
            "['layers'].extra",
            "['p']['a']",
        )
        out = tied.unflatten(gdef, [x + 1 for x in leaves])
        assert type(out["layers"]) is Layers and type(out["p"]) is Params
        assert out["layers"].name == "stack" and out["layers"].extra is out["p"]["a"]
        assert out["layers"][0].weight is out["layers"][1].weight is out["p"]["a"]
        assert list(out["p"]) == ["a", "c"] and float(out["p"].scale) == 2.0
    g = tied.grad(lambda m: jnp.sum(m["layers"][0].weight * 2) + jnp.sum(m["p"]["a"]) + m["p"].scale)(model)
    assert g["layers"][0].weight is g["p"]["a"]
    np.testing.assert_allclose(g["p"]["a"], 3.0)
    assert float(g["p"].scale) == 1.0


def test_registered_slotted_class_walks_its_set_slots():
    w, b = jnp.ones(2), jnp.zeros(2)
    s = Slotted(w, b)
    for _ in range(3):
        leaves, gdef = tied.flatten([s, s])
        assert [id(x) for x in leaves] == [id(w), id(b)]
        assert tied.ties([s, s]) == [("[0]", "[1]")]
    out = tied.unflatten(gdef, [w + 1, b])
    assert out[0] is out[1] and float(out[0].w[0]) == 2.0 and not hasattr(out[0], "unset")
    s2 = Slotted(w, b)
    s2.unset = jnp.zeros(3)  # a slot set now: a new field, never read by the old plan
    leaves, _ = tied.flatten([s2, s2])
    assert len(leaves) == 3


class PlainSlots:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


class SlotList(list):
    __slots__ = ()


class SlotDict(dict):
    __slots__ = ()


@pytest.mark.parametrize(
    "holder, name",
    [
        (lambda w: PlainSlots(w), "PlainSlots"),
        (lambda w: SlotList([w]), "SlotList"),
        (lambda w: SlotDict(a=w), "SlotDict"),
        (lambda w: __import__("collections").deque([w]), "deque"),
        (lambda w: {"q": PlainSlots([w])}, "PlainSlots"),
    ],
)
def test_arrays_in_unwalkable_holders_are_refused_with_the_path_and_the_fix(holder, name):
    w = jnp.ones(2)
    model = {"net": [holder(w)]}
    with pytest.raises(tied.GraphError, match=rf"^\['net'\]\[0\].*{name} holds arrays.*(register|hold)"):
        tied.flatten(model)


def test_register_refuses_what_it_cannot_rebuild():
    class T(tuple):
        pass

    with pytest.raises(TypeError, match=r"tied.register\(.*T\): a subclass of tuple"):
        tied.register(T)


# ---------------------------------------------------------------- plans that cannot lie


def test_a_very_wide_model_never_stalls_on_compiling_a_plan(monkeypatch):
    """Compiling a plan for 60,000 arrays in a dict once took 8 s where the walk took 0.3 s: the plan
    had a line per array. Counted, not timed: the plans are made once, at the second call, each a few
    lines (the arrays read and built in one statement); from the third call on nothing walks."""
    from tied._core import graph as _graph
    from tied._core.plans import compile as _plan

    # counted as users run it: the check mode walks again after every plan, by design
    monkeypatch.setattr(_graph, "CHECK_PLANS", False)
    walks, compiled = [0], []
    walk, compile_ = _graph._walk, _plan._compile

    def counted_walk(tree):
        walks[0] += 1
        return walk(tree)

    def counted_compile(source, name, ns, fn):
        compiled.append((name, len(source.splitlines())))
        return compile_(source, name, ns, fn)

    monkeypatch.setattr(_graph, "_walk", counted_walk)
    monkeypatch.setattr(_plan, "_compile", counted_compile)
    model = {f"w{i:06d}": np.full((1,), i, np.float32) for i in range(60000)}
    per_call = []
    for _ in range(4):
        before = walks[0]
        leaves, gdef = tied.flatten(model)
        tied.unflatten(gdef, leaves)
        per_call.append(walks[0] - before)
        assert len(leaves) == 60000 and leaves[12345] is model["w012345"]
    assert per_call == [1, 1, 0, 0], per_call  # walked twice, then the plan serves
    assert [name for name, _ in compiled] == ["flatten", "unflatten"], compiled  # once each
    assert all(lines < 40 for _, lines in compiled), compiled  # not a line per array
    assert gdef.memo.flatten_plan and gdef.memo.unflatten_plans.get(False)
    walked, _ = walk(model)
    assert all(a is b for a, b in zip(leaves, walked)) and len(leaves) == len(walked)
    out = tied.unflatten(gdef, leaves)
    assert list(out) == list(model) and all(out[k] is model[k] for k in model)


def test_plan_source_is_kept_and_shown_in_tracebacks():
    import linecache

    from tied._core import graph as _graph

    m = {"a": jnp.ones(1), "b": [jnp.ones(2)]}
    for _ in range(3):
        tied.flatten(m)
    (_, plan), *_ = _graph._flatten_plans[dict]
    src = plan.__tied_source__
    assert "def plan(root):" in src
    filename = plan.__code__.co_filename
    assert linecache.getline(filename, 1).startswith("def plan")


def test_plan_check_mode_is_on_in_the_test_suite():
    from tied._core import graph as _graph

    assert _graph.CHECK_PLANS


# ---------------------------------------------------------------- plain JAX on a tied node


def test_plain_jax_on_a_tied_node_says_what_to_do():
    import optax

    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    model = Chain(d, d)
    fix = r"tied\.grad.*tied\.jit.*tied\.map.*tied\.Graph\(model\)"
    calls = [
        lambda: jax.tree_util.tree_map(lambda x: x, model),
        lambda: jax.tree_util.tree_leaves(model),
        lambda: jax.jit(lambda m: m)(model),
        lambda: jax.grad(lambda m: jnp.sum(m.layers[0].weight))(model),
        lambda: jax.vmap(lambda m: m)(model),
        lambda: optax.adam(1e-3).init(model),
        lambda: jax.tree_util.tree_map(lambda x: x, {"net": [d]}),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=rf"helpers\.(Chain|Dense) is a tied node.*{fix}"):
            call()
    # The tied way works, and an Equinox module may still hold a tied layer.
    assert len(jax.tree_util.tree_leaves(tied.Graph(model))) == 2
    pair = EqxPair(d, jnp.ones(1))
    leaves, _ = tied.flatten(pair)
    assert len(leaves) == 3


def test_a_rebuilt_dict_iterates_in_the_models_insertion_order():
    a, b = jnp.ones(1), 2 * jnp.ones(1)
    for _ in range(3):
        tied.flatten({"a": a, "b": b})
        tied.unflatten(*reversed(tied.flatten({"a": a, "b": b})))
    model = {"b": b, "a": a}  # leaves still come in sorted key order
    for _ in range(3):
        leaves, gdef = tied.flatten(model)
        assert [id(x) for x in leaves] == [id(a), id(b)]
        assert list(tied.unflatten(gdef, leaves)) == ["b", "a"]
    first = tied.jit(lambda d: next(iter(d.values())))
    assert float(first(model)[0]) == 2.0 and float(first({"a": a, "b": b})[0]) == 1.0


@jax.tree_util.register_pytree_node_class
class ReadsItsListChild:
    """A JAX pytree whose constructor reads its list child at once."""

    def __init__(self, items):
        self.items = tuple(items)

    def tree_flatten(self):
        return [list(self.items)], None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def test_a_pytree_reading_a_list_child_at_construction_sees_it_filled():
    w1, w2 = jnp.ones(1), jnp.zeros(2)
    model = {"r": ReadsItsListChild([w1, w2])}
    for _ in range(3):  # the walk, then a compiled plan
        leaves, gdef = tied.flatten(model)
        out = tied.unflatten(gdef, leaves)
        assert out["r"].items[0] is w1 and out["r"].items[1] is w2
    g = tied.grad(lambda m: jnp.sum(m["r"].items[0]) + 2 * jnp.sum(m["r"].items[1]))(model)
    np.testing.assert_allclose(g["r"].items[1], 2.0)


class ScaledLinear(eqx.Module):
    weight: Any
    scale: float = eqx.field(static=True)


def test_a_pytree_static_field_of_other_bits_is_not_served_by_an_old_plan():
    w = jnp.ones(2)
    for _ in range(3):
        tied.flatten([ScaledLinear(w, 0.0)])
    leaves, gdef = tied.flatten([ScaledLinear(w, -0.0)])
    out = tied.unflatten(gdef, leaves)
    assert np.signbit(out[0].scale)
    leaves, gdef = tied.flatten([ScaledLinear(w, 1)])  # equal to 1.0, another type
    assert type(tied.unflatten(gdef, leaves)[0].scale) is int


# ---------------------------------------------------------------- places know their parent and key


def reference_places(tree: Any) -> list[tuple[str, str | None, Any]]:
    """Every place of the unrolled tree: (path, parent's path, JAX key), by the helpers' walker."""
    out: list[tuple[str, str | None, Any]] = []
    stack: list[tuple[Any, tuple, str | None, Any]] = [(tree, (), None, None)]
    while stack:
        x, path, parent, key = stack.pop()
        out.append((K.keystr(path), parent, key))
        kids = children(x) or []
        stack.extend((c, path + (k,), K.keystr(path), k) for k, c in reversed(kids))
    return out


@given(models())
def test_each_place_carries_its_parent_node_and_its_jax_key(model):
    _, gdef = tied.flatten(model)
    walk = list(gdef.walk_places(expand_shared=True))
    ref = reference_places(model)
    assert [(p.path, p.key) for p in walk] == [(path, key) for path, _, key in ref]
    index_at = {p.path: p.index for p in walk if p.kind not in ("array", "static")}
    for p, (_, parent_path, _) in zip(walk, ref):
        assert p.parent == (-1 if parent_path is None else index_at[parent_path])
        if p.parent >= 0:  # the GraphDef answers by name what the node holds
            assert (p.key, p.kind, p.index) in gdef.children(p.parent)


def test_keys_are_jax_key_objects_and_children_lists_a_node_in_order():
    w = jnp.ones(2)
    pair = EqxPair(w, 1.0)
    model = {"a": [w, pair], "b": Box(pair, "s")}
    _, gdef = tied.flatten(model)
    keys = {p.path: p.key for p in gdef.walk_places()}
    assert keys["['a'][1]"] == K.SequenceKey(1) and keys["['b'].a"] == K.GetAttrKey("a")
    assert keys["['a']"] == K.DictKey("a") and keys[""] is None
    assert keys["['a'][1].a"] == K.GetAttrKey("a")  # a JAX pytree's own key
    root = next(p for p in gdef.walk_places() if p.path == "")
    kinds = [(str(k), kind) for k, kind, _ in gdef.children(root.index)]
    assert kinds == [("['a']", "list"), ("['b']", "object")]


# ---------------------------------------------------------------- the state kind


def test_a_state_cell_is_its_own_kind_walked_through_value_and_marked_as_state():
    cell = tied.State(jnp.zeros(2))
    model = {"bn": cell, "again": cell, "w": jnp.ones(2), "rng": tied.Rng(0)}
    for _ in range(3):  # the walk, then compiled plans
        leaves, gdef = tied.flatten(model)
        back = tied.unflatten(gdef, leaves)
    by_path = {p.path: p for p in gdef.walk_places()}
    assert by_path["['bn']"].kind == "state" and by_path["['bn']"].type is tied.State
    assert by_path["['again'].value"].key == K.GetAttrKey("value")  # keys sorted: 'again' first
    assert by_path["['rng'].count"].kind == "state" and by_path["['rng']"].kind == "object"
    assert tied.ties(model) == [("['again']", "['bn']")]
    assert type(back["bn"]) is tied.State and back["bn"] is back["again"]
    assert back["bn"].value is cell.value and back["bn"] is not cell
    state = dict(zip([p[0] for p in gdef.leaf_paths()], gdef.state_leaves()))
    assert state == {
        "['again'].value": True,
        "['rng'].count.value": True,
        "['rng'].key": False,
        "['w']": False,
    }
    with pytest.raises(TypeError, match=r"tied\.grad"):
        jax.tree_util.tree_leaves(cell)


def test_a_register_state_class_stays_an_object_and_is_a_state_node():
    @tied.register_state
    class Counter:
        def __init__(self):
            self.value = jnp.zeros((), jnp.int32)

    model = [Counter(), jnp.ones(1)]
    _, gdef = tied.flatten(model)
    kinds = {p.path: p.kind for p in gdef.walk_places()}
    assert kinds["[0]"] == "object" and gdef.state_nodes() == (False, True)
    assert gdef.state_leaves() == (True, False)


# ---------------------------------------------------------------- the cyclic collector


def test_the_collector_is_paused_for_large_walks_and_rebuilds_and_restored_after(monkeypatch):
    import gc

    from tied._core import graph as _graph

    states = []
    monkeypatch.setattr(_graph, "CHECK_PLANS", False)  # its own walks are the check's, not paused
    tied.register(_GcLayer)
    layers = [_GcLayer(jnp.full((2,), float(i))) for i in range(_graph.PAUSE_GC_NODES + 10)]
    model = {"layers": layers}
    real_walk = _graph._walk

    def spy(tree):
        states.append(gc.isenabled())
        return real_walk(tree)

    monkeypatch.setattr(_graph, "_walk", spy)
    assert gc.isenabled()
    for _ in range(3):  # walked, walked and planned, planned
        leaves, gdef = tied.flatten(model)
        out = tied.unflatten(gdef, [x + 1 for x in leaves])
        assert gc.isenabled()
    assert states and not any(states)  # the collector was off during every walk
    # the result is the walk's: every layer rebuilt with its own new array, in order
    assert [float(layer.w[0]) for layer in out["layers"]] == [i + 1.0 for i in range(len(layers))]
    # a walk that fails still gives the collector back
    cycle = ([jnp.ones(2)],)
    cycle[0].append(cycle)  # a cycle through a tuple: refused
    with pytest.raises(tied.GraphError, match="cycle"):
        tied.flatten({"layers": layers, "bad": cycle})
    assert gc.isenabled()
    # a collector the user turned off stays off
    gc.disable()
    try:
        tied.flatten(model)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _GcLayer:
    def __init__(self, w):
        self.w = w
