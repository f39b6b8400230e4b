"""Compiled plans with loops over runs of identical layers (`tied._core.plans.loops`).

A run of layers of one layout is read and rebuilt by one loop, so a plan's size no
longer grows with the model's depth. Every test here compares the planned result
with the plain walk *and* with the independent path walker of ``helpers``, after
mutations inside a run that a loop could miss: a tie made or cut in one element,
one element twice, a field order, a static, a class, a field added. The suite runs
with ``TIED_CHECK_PLANS=1`` too, so each plan is also checked inside the library.

Loops are used for graphs of more than `_loops.LOOP_PLACES` places; the fixture
``loops`` lowers that bound to 0 so that small models get them too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Box,
    coefficients,
    is_array,
    is_tracked_node,
    models,
    places,
    reference_partials,
    sharing_groups,
    untied_copy,
    weighted_loss,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied._core import graph as _graph
from tied._core.plans import loops as _loops


@tied.register
class Layer:
    _test_registered = True

    def __init__(self, weight, bias, activation=jnp.tanh):
        self.weight, self.bias, self.activation = weight, bias, activation

    def __call__(self, x):
        y = x @ self.weight.T + self.bias
        return y if self.activation is None else self.activation(y)


@tied.register
class Other:
    _test_registered = True

    def __init__(self, weight, bias, activation=jnp.tanh):
        self.weight, self.bias, self.activation = weight, bias, activation


@pytest.fixture
def loops(monkeypatch):
    monkeypatch.setattr(_loops, "LOOP_PLACES", 0)
    _graph._clear_plans()
    yield
    _graph._clear_plans()


def _arrays_in_walk_order(tree) -> list:
    seen: set[int] = set()
    out = []
    for _, x in places(tree, into_shared=False):
        if is_array(x) and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def agree(model, *, planned: bool = True):
    """Flatten ``model`` until its plans exist; check the plans against the walk and the
    independent walker; return the planned (leaves, graphdef)."""
    for _ in range(3):
        leaves, gdef = tied.flatten(model)
        tied.unflatten(gdef, leaves)
    if planned:
        assert gdef.memo.flatten_plan and gdef.memo.unflatten_plans.get(False)
    walked, wgdef = _graph._walk(model)
    assert wgdef == gdef
    assert len(leaves) == len(walked) and all(a is b for a, b in zip(leaves, walked))
    reference = _arrays_in_walk_order(model)
    assert [id(x) for x in leaves] == [id(x) for x in reference]
    new = [jnp.asarray(x) + 1 for x in leaves]
    out = tied.unflatten(gdef, new)
    assert [p for p, _ in places(out)] == [p for p, _ in places(model)]
    assert sharing_groups(out, is_tracked_node) == sharing_groups(model, is_tracked_node)
    assert sharing_groups(out, is_array) == sharing_groups(model, is_array)
    position = {id(x): i for i, x in enumerate(leaves)}
    for (_, a), (_, b) in zip(places(model), places(out)):
        if is_array(a):
            assert b is new[position[id(a)]]
        elif not is_tracked_node(a):
            assert type(a) is type(b)
    return leaves, gdef


def chain(n: int, *, seed: int = 0, shared_bias: bool = True) -> list:
    rng = np.random.default_rng(seed)
    bias = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    return [
        Layer(
            jnp.asarray(rng.normal(size=(3, 3)), jnp.float32),
            bias if shared_bias else jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        )
        for _ in range(n)
    ]


def _source(gdef) -> str:
    return gdef.memo.flatten_plan.__tied_source__ + gdef.memo.unflatten_plans[False].__tied_source__


def test_a_run_of_layers_is_read_and_built_by_one_loop(loops):
    model = chain(12)
    _, gdef = agree(model)
    src = _source(gdef)
    assert "for x_ in" in src and "for lv0" in src
    # the plan is as long for 12 layers as for 120
    _, big = agree(chain(120, seed=1))
    assert len(_source(big).splitlines()) == len(src.splitlines())


def _del_and_readd(layer):
    w = layer.weight
    del layer.weight
    layer.weight = w


MUTATIONS = {
    "new weight": lambda m: setattr(m[5], "weight", jnp.ones((3, 3))),
    "weight tied to another layer's": lambda m: setattr(m[5], "weight", m[2].weight),
    "weight tied to the shared bias's place": lambda m: setattr(m[5], "weight", m[0].bias),
    "bias untied": lambda m: setattr(m[7], "bias", jnp.zeros(3)),
    "one layer twice": lambda m: m.__setitem__(6, m[3]),
    "first layer twice": lambda m: m.__setitem__(9, m[0]),
    "static changed": lambda m: setattr(m[4], "activation", None),
    "static of equal value, other type": lambda m: (
        setattr(m[4], "activation", 1.0) or setattr(m[5], "activation", 1)
    ),
    "field order": lambda m: _del_and_readd(m[8]),
    "other class": lambda m: m.__setitem__(5, Other(m[5].weight, m[5].bias)),
    "field added": lambda m: setattr(m[5], "extra", 3),
    "numpy weight": lambda m: setattr(m[5], "weight", np.ones((3, 3), np.float32)),
    "weight a static": lambda m: setattr(m[5], "weight", 3.0),
    "weight a node": lambda m: setattr(m[5], "weight", [m[5].weight]),
    "layer dropped": lambda m: m.pop(5),
    "layer added": lambda m: m.append(Layer(jnp.ones((3, 3)), m[0].bias)),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_mutation_inside_a_run_is_noticed(loops, name):
    model = chain(12, seed=3)
    before, gdef = agree(model)
    MUTATIONS[name](model)
    after, new_gdef = agree(model)
    if name in ("new weight", "numpy weight"):  # a new array at the same place: same structure
        assert new_gdef is gdef and after[1 + 5] is model[5].weight
    else:
        assert new_gdef != gdef


def test_a_run_inside_a_tuple_and_a_run_of_nested_blocks(loops):
    rng = np.random.default_rng(4)
    shared = jnp.asarray(rng.normal(size=(3,)), jnp.float32)

    def block():
        def arr(*shape):
            return jnp.asarray(rng.normal(size=shape), jnp.float32)

        return {
            "attn": Layer(arr(3, 3), arr(3)),
            "mlp": [Layer(arr(3, 3), shared), Layer(arr(3, 3), arr(3), None)],
            "norm": (arr(3), arr(3)),
            "cfg": Box(shared, "gelu"),  # holds no array of its own
        }

    blocks = tuple(block() for _ in range(7))
    model = {"blocks": blocks, "head": Layer(jnp.ones((3, 3)), shared)}
    _, gdef = agree(model)
    assert "for x_ in" in _source(gdef)
    # a node holding no array of its own, shared between two elements: only its identity tells
    m2 = {"blocks": tuple(dict(b) for b in blocks), "head": model["head"]}
    m2["blocks"][4]["cfg"] = m2["blocks"][3]["cfg"]
    _, g2 = agree(m2)
    assert g2 != gdef
    # an inner layer shared between two elements
    m3 = {"blocks": tuple(dict(b) for b in blocks), "head": model["head"]}
    m3["blocks"][5]["mlp"] = [m3["blocks"][2]["mlp"][0], m3["blocks"][5]["mlp"][1]]
    _, g3 = agree(m3)
    assert g3 != gdef
    # an element's inner layer is the head (a node outside the run)
    m4 = {"blocks": tuple(dict(b) for b in blocks), "head": model["head"]}
    m4["blocks"][6]["attn"] = m4["head"]
    agree(m4)


def test_elements_without_arrays_of_their_own_stay_distinct(loops):
    shared = jnp.ones(2)
    model = [Box(shared, i % 1) for i in range(8)]  # equal statics, only the shared array
    _, gdef = agree(model)
    model[5] = model[2]
    _, g2 = agree(model)
    assert g2 != gdef


def test_bulk_reads_of_dicts_and_lists_of_arrays(loops):
    rng = np.random.default_rng(5)
    keys = [f"p{i}" for i in rng.permutation(20)]  # inserted out of sorted order
    d = {k: jnp.asarray(rng.normal(size=(2,)), jnp.float32) for k in keys}
    lst = [jnp.asarray(rng.normal(size=(2,)), jnp.float32) for _ in range(12)]
    model = {"d": d, "l": lst, "t": tuple(lst[:9])}
    _, gdef = agree(model)
    out = tied.unflatten(gdef, tied.flatten(model)[0])
    assert list(out["d"]) == keys  # the model's insertion order
    for mutate in (
        lambda m: m["d"].__setitem__("p3", m["d"]["p4"]),  # a tie inside the dict
        lambda m: m["d"].pop("p7"),
        lambda m: m["d"].__setitem__("p8", m["d"].pop("p8")),  # same keys, other order
        lambda m: m["l"].__setitem__(4, m["l"][2]),
        lambda m: m["l"].__setitem__(4, 1.5),
        lambda m: m.__setitem__("d", {**m["d"], "a0": jnp.ones(2)}),
    ):
        mutate(model)
        agree(model)


def test_a_reference_cycle_inside_an_element_is_rebuilt(loops):
    items = []
    for i in range(6):
        box = Box(jnp.full((2,), float(i)), None)
        box.b = box  # the element points at itself
        items.append(box)
    for _ in range(3):
        leaves, gdef = tied.flatten(items)
        out = tied.unflatten(gdef, leaves)
    assert gdef.memo.flatten_plan and gdef.memo.unflatten_plans.get(False)
    walked, wgdef = _graph._walk(items)
    assert wgdef == gdef and all(a is b for a, b in zip(leaves, walked))
    assert [id(x) for x in leaves] == [id(b.a) for b in items]
    assert all(b.b is b and b.a is x for b, x in zip(out, leaves))
    assert len({id(b) for b in out}) == 6
    items[3].b = items[2]  # the cycle now passes through two elements
    leaves, g2 = tied.flatten(items)
    assert g2 != gdef and tied.unflatten(g2, leaves)[3].b is not None


@settings(max_examples=25, deadline=None)
@given(models(max_depth=3), st.integers(4, 7), st.integers(0, 2**16))
def test_random_layers_repeated_and_mutated_agree_with_the_walk(template, n, seed):
    _loops.LOOP_PLACES, old = 0, _loops.LOOP_PLACES
    _graph._clear_plans()
    try:
        rng = np.random.default_rng(seed)
        model = [untied_copy(template) for _ in range(n)]
        agree(model, planned=False)
        # tie one array of one element to an array of another, or repeat an element
        arrays = [(i, p) for i, m in enumerate(model) for p, x in places(m) if is_array(x)]
        if rng.integers(2) and len(model) > 2:
            model[int(rng.integers(1, n))] = model[0]
        elif arrays:
            (i, _), (j, _) = arrays[int(rng.integers(len(arrays)))], arrays[int(rng.integers(len(arrays)))]
            a = next(x for _, x in places(model[j]) if is_array(x))
            model[i] = [model[i], a]
        agree(model, planned=False)
    finally:
        _loops.LOOP_PLACES = old
        _graph._clear_plans()


def test_a_deep_model_gets_its_plans_at_the_second_call_without_forcing():
    model = chain(3000, seed=6)
    leaves, gdef = tied.flatten(model)
    assert not gdef.memo.flatten_plan
    agree(model)
    assert len(gdef.memo.flatten_plan.__tied_source__.splitlines()) < 100


def test_adam_on_a_looped_chain_with_a_shared_bias_matches_optax_on_the_untied_arrays(loops):
    model = chain(10, seed=7)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 3)), jnp.float32)
    tx = optax.adam(0.05)

    def loss(m):
        h = x
        for layer in m:
            h = layer(h)
        return jnp.sum(h**2)

    @tied.jit
    def step(m, s):
        g = tied.grad(loss)(m)
        return tied.optim.update(s, m, g)

    # the reference: plain arrays, the shared bias once, optax on a dict
    params = {"b": model[0].bias, **{f"w{i}": layer.weight for i, layer in enumerate(model)}}

    def ref_loss(p):
        h = x
        for i in range(10):
            h = jnp.tanh(h @ p[f"w{i}"].T + p["b"])
        return jnp.sum(h**2)

    state = tied.optim.setup(tx, model)
    ref_state = tx.init(params)
    for _ in range(4):
        model, state = step(model, state)
        updates, ref_state = tx.update(jax.grad(ref_loss)(params), ref_state, params)
        params = optax.apply_updates(params, updates)
    assert all(layer.bias is model[0].bias for layer in model)
    np.testing.assert_allclose(model[0].bias, params["b"], rtol=1e-5, atol=1e-6)
    for i, layer in enumerate(model):
        np.testing.assert_allclose(layer.weight, params[f"w{i}"], rtol=1e-5, atol=1e-6)


def test_per_place_gradients_of_one_block_at_six_places_with_loops(loops):
    # the expanded (per-place) structure numbers its statics by the model's: no loop may
    # read it as a walk's numbering (this once built a one-layer list, silently)
    a, b = chain(2, seed=9, shared_bias=False)
    blk = {"attn": a, "mlp": [b, Layer(a.weight, b.bias, None)]}
    model = [blk] * 6
    coefs = coefficients(model)
    loss = weighted_loss(coefs)
    ref = reference_partials(model, coefs)
    for _ in range(3):  # plans on the second and third calls
        per = tied.grad(loss, per_location=True)(model)
        assert len(per) == 6 and len({id(b) for b in per}) == 6
        got = {p: x for p, x in places(per) if is_array(x)}
        assert set(got) == set(ref)
        for p, want in ref.items():
            np.testing.assert_allclose(got[p], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- found by review, kept fixed


def test_a_node_tie_is_not_read_as_an_array_tie_by_a_loop(loops):
    # a layer whose own array also sits elsewhere (an array tie) must still have its identity
    # checked: the same layer at both places reads that array at both, as the array tie does
    layers = chain(8, seed=10)  # a shared bias: each layer's weight is its only own array
    model = {"layers": layers, "z": Layer(layers[3].weight, layers[0].bias)}
    agree(model)
    model["z"] = layers[3]  # the layer itself at a second place
    _, gdef = agree(model)
    out = tied.unflatten(gdef, tied.flatten(model)[0])
    assert out["z"] is out["layers"][3]
    assert ("['layers'][3]", "['z']") in tied.ties(model)


def test_a_node_tie_inside_pairs_of_one_array_is_noticed(loops):
    pairs = []
    for i in range(8):
        a = jnp.full((2,), float(i))
        pairs.append([Box(a, "x"), Box(a, "x")])  # two boxes holding one array
    agree(pairs)
    pairs[5][1] = pairs[5][0]  # now one box at two places
    _, gdef = agree(pairs)
    out = tied.unflatten(gdef, tied.flatten(pairs)[0])
    assert out[5][1] is out[5][0] and out[4][1] is not out[4][0]


def test_an_equinox_layer_tie_in_a_second_model_of_the_same_types():
    import equinox as eqx

    class Lin(eqx.Module):
        w: jax.Array

    def make(node_tie):
        layers = [Lin(np.full((2,), float(i), np.float32)) for i in range(600)]  # over 1,000 places
        return {"layers": layers, "z": layers[5] if node_tie else Lin(layers[5].w)}

    agree(make(node_tie=False))
    b = make(node_tie=True)
    leaves, gdef = tied.flatten(b)
    assert gdef == _graph._walk(b)[1]
    out = tied.unflatten(gdef, leaves)
    assert out["z"] is out["layers"][5]


class Tag(str):
    pass


class _Holder:
    def method(self):
        return 1


@pytest.mark.parametrize("with_loops", [True, False])
@pytest.mark.parametrize(
    "make", [lambda h: Tag("relu"), lambda h: h.method], ids=["str subclass", "bound method"]
)
def test_an_equal_static_of_identity_keyed_type_is_a_new_static(monkeypatch, with_loops, make):
    # the GraphDef compares such statics by identity, so the plans must too
    monkeypatch.setattr(_loops, "LOOP_PLACES", 0 if with_loops else 10**9)
    _graph._clear_plans()
    holder = _Holder()
    model = chain(10, seed=11)
    for layer in model:
        layer.activation = make(holder)
    agree(model)
    model[5].activation = make(holder)  # == the old one, but another object
    leaves, gdef = tied.flatten(model)
    assert gdef == _graph._walk(model)[1]
    assert tied.unflatten(gdef, leaves)[5].activation is model[5].activation
    _graph._clear_plans()


def test_deeply_nested_lists_are_not_compared_level_by_level(monkeypatch):
    calls = []
    element = _loops._element
    monkeypatch.setattr(_loops, "_element", lambda *a: calls.append(1) or element(*a))
    node: list = []
    for _ in range(2000):
        node = [np.zeros(1, np.float32), np.zeros(1, np.float32), "s", node]
    leaves, gdef = tied.flatten(node)
    assert _loops.layout(gdef).runs == {} and calls == []  # no run of four like subtrees anywhere
    assert len(leaves) == 4000


class _WithAttrs(tuple):
    pass


def _tagged(items, tag):
    t = _WithAttrs(items)
    t.tag = tag
    return t


@pytest.mark.parametrize(
    "first, second",
    [
        (np.datetime64(1, "D"), np.datetime64(1, "s")),  # the same bytes, another unit
        (np.timedelta64(5, "ms"), np.timedelta64(5, "h")),
        (range(0, 3, 2), range(0, 4, 2)),  # == each other
        (range(0), range(5, 5)),
        (slice(0, 1), slice(0.0, 1)),
        (np.dtype("f4"), np.dtype("f4", metadata={"k": 1})),
        (_tagged((1, 2), "a"), _tagged((1, 2), "b")),  # a tuple subclass with attributes
    ],
    ids=[
        "datetime64 unit",
        "timedelta64 unit",
        "range",
        "empty range",
        "slice",
        "dtype metadata",
        "tuple attrs",
    ],
)
def test_statics_equal_by_eq_but_rebuilt_differently_are_different_statics(first, second):
    # found by review: the plans and the GraphDef took these for the same static, and the
    # rebuild put the first model's value into the second
    w = jnp.ones(2)
    m1, m2 = Box(w, first), Box(w, second)
    for _ in range(3):
        tied.flatten(m1)
    leaves, gdef = tied.flatten(m2)
    assert gdef != _graph._walk(m1)[1]
    rebuilt = tied.unflatten(gdef, leaves).b
    assert rebuilt is second


# ---------------------------------------------------------------- one emitter per kind (plans/emit.py)


def _dict_checks(src: str) -> set[str]:
    """The lines that check a dict, its locals and constants renamed alike."""
    lines = {line.strip() for line in src.splitlines() if "is not dict" in line}
    return {re.sub(r"\b(?:n\d+|x_|xy\d+)\b", "D", re.sub(r"\bKI\d+\b", "KI", line)) for line in lines}


@pytest.mark.parametrize("with_loops", [True, False])
def test_a_dict_is_read_alike_in_straight_plans_and_loop_bodies_and_an_equal_str_subclass_key_is_seen(
    monkeypatch, with_loops
):
    # one emitter writes a kind's lines for both generators: a run of dicts read by a loop is
    # checked by the line a straight-line plan checks a dict with, and both give up on a key
    # that equals the recorded one but is a str subclass (the walk keeps its type)
    monkeypatch.setattr(_loops, "LOOP_PLACES", 0 if with_loops else 10**9)
    _graph._clear_plans()
    model = [{"w": jnp.full((2,), float(i)), "s": "tanh"} for i in range(6)]
    _, gdef = agree(model)
    src = gdef.memo.flatten_plan.__tied_source__
    assert ("for x_ in" in src) is with_loops
    assert _dict_checks(src) == {
        "if type(D) is not dict or len(D) != 2 or (not all(map(is_, D, KI)) and "
        "(tuple(D) != KI or not STR.issuperset(map(type, D)))): raise M"
    }
    model[3] = {Tag("w"): model[3]["w"], "s": "tanh"}
    leaves, new = tied.flatten(model)
    assert new != gdef and new == _graph._walk(model)[1]
    assert type(next(iter(tied.unflatten(new, leaves)[3]))) is Tag
    _graph._clear_plans()
