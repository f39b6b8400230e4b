"""Structural gradients with shared parameters: tied.grad, value_and_grad, accumulate.

Every reference is plain `jax.grad` on an untied copy of the model (each place its
own array), with the per-place gradients summed by hand over each tie group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Box,
    Chain,
    Dense,
    coefficients,
    grouped_totals,
    is_array,
    is_node,
    is_param,
    is_tracked_node,
    models,
    places,
    rebuild,
    reference_partials,
    weighted_loss,
)
from hypothesis import given

import tied


def identity_classes(objs: list) -> list[int]:
    ids: dict[int, int] = {}
    return [ids.setdefault(id(x), len(ids)) for x in objs]


def check_gradient(model: Any, g: Any, expected: dict[str, Any]) -> None:
    """``g`` mirrors ``model``: same paths and node types, ``expected[path]`` at every
    parameter place, None at every other leaf."""
    mp, gp = list(places(model)), list(places(g))
    assert [p for p, _ in mp] == [p for p, _ in gp]
    for (path, x), (_, y) in zip(mp, gp):
        if is_param(x):
            assert is_array(y), path
            np.testing.assert_allclose(
                np.asarray(y), np.asarray(expected[path]), rtol=1e-5, atol=1e-6, err_msg=path
            )
        elif is_node(x):
            assert type(y) is type(x), path
        else:
            assert y is None, path


def check_aliasing(model: Any, g: Any) -> None:
    """Identity in ``g`` holds exactly where the model shares: arrays and nodes."""
    pairs = list(zip((x for _, x in places(model)), (y for _, y in places(g))))
    for pred in (is_param, is_tracked_node):
        kept = [(x, y) for x, y in pairs if pred(x)]
        assert identity_classes([y for _, y in kept]) == identity_classes([x for x, _ in kept])


def check_distinct(model: Any, g: Any) -> None:
    """Every place of ``g`` holds its own object: no identity anywhere."""
    pairs = list(zip((x for _, x in places(model)), (y for _, y in places(g))))
    for pred in (is_param, is_tracked_node):
        ys = [y for x, y in pairs if pred(x)]
        assert len({id(y) for y in ys}) == len(ys)


# ---------------------------------------------------------------- the seed example


def test_seed_example():
    d1 = Dense(jax.random.normal(jax.random.key(0), (2, 2)), jnp.zeros(2))
    d2 = Dense(d1.weight, d1.bias)
    c = Chain(d1, d2)
    x = jnp.ones((1, 2))
    g = tied.grad(lambda m: m(x).sum())(c)
    assert g.layers[0].weight is g.layers[1].weight  # one object, the accumulated total
    p = tied.grad(lambda m: m(x).sum(), per_location=True)(c)
    assert jnp.allclose(p.layers[0].weight + p.layers[1].weight, g.layers[0].weight)

    # Reference: plain jax.grad on an untied copy, each place its own array.
    untied = Chain(*(Dense(jnp.array(d.weight), jnp.array(d.bias)) for d in c.layers))

    def plain(params):
        (w0, b0), (w1, b1) = params
        return Chain(Dense(w0, b0), Dense(w1, b1))(x).sum()

    (gw0, gb0), (gw1, gb1) = jax.grad(plain)([(d.weight, d.bias) for d in untied.layers])
    np.testing.assert_allclose(g.layers[0].weight, gw0 + gw1, rtol=1e-6)
    np.testing.assert_allclose(g.layers[0].bias, gb0 + gb1, rtol=1e-6)
    assert g.layers[0].bias is g.layers[1].bias
    assert g.layers[0] is not g.layers[1] and type(g) is Chain and type(g.layers[0]) is Dense
    # per_location: distinct arrays, equal to the untied reference place by place.
    assert p.layers[0].weight is not p.layers[1].weight
    for got, want in (
        (p.layers[0].weight, gw0),
        (p.layers[1].weight, gw1),
        (p.layers[0].bias, gb0),
        (p.layers[1].bias, gb1),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(gw0, gw1)  # the places really do get different partials


def test_shared_node_gives_one_gradient_node():
    d = Dense(jnp.array([[1.0, 2.0], [3.0, -1.0]]), jnp.array([0.5, -0.5]))
    c = Chain(d, d)
    x = jnp.array([[1.0, -2.0]])
    g = tied.grad(lambda m: jnp.sum(jnp.tanh(m(x))))(c)
    assert g.layers[0] is g.layers[1]
    p = tied.grad(lambda m: jnp.sum(jnp.tanh(m(x))), per_location=True)(c)
    assert p.layers[0] is not p.layers[1] and p.layers[0].weight is not p.layers[1].weight

    def plain(params):
        (w0, b0), (w1, b1) = params
        return jnp.sum(jnp.tanh(Chain(Dense(w0, b0), Dense(w1, b1))(x)))

    copies = [(jnp.array(d.weight), jnp.array(d.bias)) for _ in range(2)]
    (gw0, gb0), (gw1, gb1) = jax.grad(plain)(copies)
    np.testing.assert_allclose(g.layers[0].weight, gw0 + gw1, rtol=1e-6)
    np.testing.assert_allclose(g.layers[0].bias, gb0 + gb1, rtol=1e-6)
    np.testing.assert_allclose(p.layers[0].weight, gw0, rtol=1e-6)
    np.testing.assert_allclose(p.layers[1].weight, gw1, rtol=1e-6)


# ---------------------------------------------------------------- properties


@given(models())
def test_aliased_gradient_is_the_grouped_sum_of_reference_partials(model):
    coefs = coefficients(model)
    totals = grouped_totals(model, reference_partials(model, coefs))
    loss = weighted_loss(coefs)
    value, g = tied.value_and_grad(loss)(model)
    check_gradient(model, g, totals)
    check_aliasing(model, g)
    np.testing.assert_allclose(value, loss(model), rtol=1e-5)


@given(models())
def test_per_location_is_the_reference_place_by_place(model):
    coefs = coefficients(model)
    partials = reference_partials(model, coefs)
    p = tied.grad(weighted_loss(coefs), per_location=True)(model)
    check_gradient(model, p, partials)
    check_distinct(model, p)


@given(models())
def test_accumulate_reads_every_convention(model):
    coefs = coefficients(model)
    partials = reference_partials(model, coefs)
    totals = grouped_totals(model, partials)
    first: dict[int, str] = {}
    for path, x in places(model):
        if is_param(x):
            first.setdefault(id(x), path)

    def tree(at):
        return rebuild(model, lambda path, x: at(path, x) if is_param(x) else None)

    conventions = {
        "partials": (tree(lambda p, x: partials[p]), "auto"),
        "partials, forced": (tree(lambda p, x: partials[p]), "partials"),
        "total at first": (tree(lambda p, x: totals[p] if first[id(x)] == p else None), "auto"),
        # one object at every place, made by hand: "auto" cannot vouch for it, "total" says so
        "aliased totals": (tree(lambda p, x: totals[p]), "total"),
        "repeated totals": (tree(lambda p, x: jnp.array(totals[p])), "total"),
        "tied.grad's own totals": (tied.grad(weighted_loss(coefs))(model), "auto"),
    }
    for name, (grads, convention) in conventions.items():
        acc = tied.accumulate(model, grads, convention=convention)
        check_gradient(model, acc, totals)
        check_aliasing(model, acc)
        if name in ("total at first", "aliased totals"):  # a present total is taken as is
            for (path, x), (_, y) in zip(places(model), places(acc)):
                if is_param(x):
                    assert y is totals[path], (name, path)
        # accumulate's result is a total tied made: reading it again changes nothing
        again = tied.accumulate(model, acc)
        for (path, x), (_, y), (_, z) in zip(places(model), places(acc), places(again)):
            if is_param(x):
                assert z is y, (name, path)
    # hand-made aliasing under "auto" is refused exactly where a tie has 2+ places
    counts: dict[int, int] = {}
    for _, x in places(model):
        if is_param(x):
            counts[id(x)] = counts.get(id(x), 0) + 1
    refused = any(n > 1 for n in counts.values())
    grads = tree(lambda p, x: totals[p])
    try:
        acc = tied.accumulate(model, grads)
    except ValueError as e:
        assert refused and "is not a total made by tied.grad" in str(e)
    else:
        check_gradient(model, acc, totals)


# ---------------------------------------------------------------- leaves without gradients


def test_integer_arrays_and_static_leaves_get_none():
    def fn(v):
        return v

    model = {
        "w": jnp.array([1.0, 2.0]),
        "ids": jnp.array([0, 1]),
        "mask": np.array([True, False]),
        "n": 3,
        "name": "enc",
        "act": fn,
        "nothing": None,
        "np": np.array([0.5], np.float32),
    }

    def loss(m):
        return jnp.sum(m["act"](m["w"])[m["ids"]] ** 2 * m["n"]) + jnp.sum(m["np"] ** 3)

    g = tied.grad(loss)(model)
    assert set(g) == set(model)
    for k in ("ids", "mask", "n", "name", "act", "nothing"):
        assert g[k] is None, k
    ref = jax.grad(lambda w, v: jnp.sum(w[jnp.array([0, 1])] ** 2 * 3) + jnp.sum(v**3), argnums=(0, 1))(
        jnp.array([1.0, 2.0]), jnp.array([0.5])
    )
    np.testing.assert_allclose(g["w"], ref[0])
    np.testing.assert_allclose(g["np"], ref[1])


def test_model_without_parameters_gives_all_none():
    model = [jnp.arange(3), "s", Box(1, jnp.array([True]))]
    g = tied.grad(lambda m: jnp.sum(m[0]) * 0.0)(model)
    assert g[0] is None and g[1] is None and type(g[2]) is Box
    assert g[2].a is None and g[2].b is None


def test_complex_parameters_get_the_plain_jax_gradient():
    z = jnp.array([1.0 + 2.0j, -0.5j])
    model = {"z": z, "again": z}
    loss = lambda m: jnp.sum(jnp.abs(m["z"]) ** 2) + jnp.sum(jnp.real(m["again"]) * 3.0)
    g = tied.grad(loss)(model)
    assert g["z"] is g["again"]
    za, zb = jnp.array(z), jnp.array(z)
    ra, rb = jax.grad(lambda a, b: loss({"z": a, "again": b}), argnums=(0, 1))(za, zb)
    np.testing.assert_allclose(g["z"], ra + rb)


# ---------------------------------------------------------------- argnums and aux


def test_argnums_tuple_shares_across_arguments():
    w = jnp.array([[1.0, -1.0], [0.5, 2.0]])
    enc = Dense(w, jnp.zeros(2))
    head = {"w": w, "scale": 2.0}
    x = jnp.array([[1.0, 3.0]])

    def loss(e, h, x):
        return jnp.sum(jnp.sin(e(x) @ h["w"])) * h["scale"]

    ge, gh = tied.grad(loss, argnums=(0, 1))(enc, head, x)
    assert ge.weight is gh["w"] and gh["scale"] is None
    wa, wb = jnp.array(w), jnp.array(w)
    ra, rb, rbias = jax.grad(lambda a, b, c: jnp.sum(jnp.sin((x @ a.T + c) @ b)) * 2.0, argnums=(0, 1, 2))(
        wa, wb, jnp.zeros(2)
    )
    np.testing.assert_allclose(ge.weight, ra + rb, rtol=1e-6)
    np.testing.assert_allclose(ge.bias, rbias, rtol=1e-6)
    # The argument not differentiated is passed through untouched.
    value, (ge2, gh2) = tied.value_and_grad(loss, argnums=(0, 1))(enc, head, x)
    np.testing.assert_allclose(value, loss(enc, head, x))
    np.testing.assert_allclose(ge2.weight, ge.weight)
    # argnums=1 alone: w is the only parameter, one place.
    gh1 = tied.grad(loss, argnums=1)(enc, head, x)
    np.testing.assert_allclose(gh1["w"], rb, rtol=1e-6)


def test_argnums_must_name_arguments():
    with pytest.raises(TypeError, match=r"argnums=\(0, 3\) names argument 3.*2 positional"):
        tied.grad(lambda a, b: a + b, argnums=(0, 3))(jnp.ones(()), jnp.ones(()))
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty tuple"):
        tied.grad(lambda a: a, argnums=())


def test_has_aux():
    w = jnp.array([1.0, 2.0, 3.0])
    model = [w, {"again": w}]

    def loss(m):
        out = jnp.sum(m[0] ** 2) + jnp.sum(jnp.cos(m[1]["again"]))
        return out, {"out": out, "tag": "x"}

    g, aux = tied.grad(loss, has_aux=True)(model)
    (value, aux2), g2 = tied.value_and_grad(loss, has_aux=True)(model)
    ref = jax.grad(lambda a, b: loss([a, {"again": b}])[0], argnums=(0, 1))(jnp.array(w), jnp.array(w))
    np.testing.assert_allclose(g[0], ref[0] + ref[1], rtol=1e-6)
    assert g[0] is g[1]["again"]
    assert aux["tag"] == "x" and aux2["tag"] == "x"
    np.testing.assert_allclose(aux["out"], loss(model)[0])
    np.testing.assert_allclose(value, loss(model)[0])
    np.testing.assert_allclose(g2[0], g[0])


# ---------------------------------------------------------------- identity of gradient objects


def test_distinct_parameters_get_distinct_gradient_objects():
    # Eager JAX hands both operands of a + b the same cotangent object.
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    g = tied.grad(lambda m: jnp.sum(m["a"] + m["b"]))(model)
    assert g["a"] is not g["b"]
    np.testing.assert_allclose(g["a"], np.ones(2))
    np.testing.assert_allclose(g["b"], np.ones(2))
    w = jnp.ones(2)
    p = tied.grad(lambda m: jnp.sum(m[0] + m[1]), per_location=True)([w, w])
    assert p[0] is not p[1]
    np.testing.assert_allclose(p[0], np.ones(2))
    t = tied.grad(lambda m: jnp.sum(m[0] + m[1]))([w, w])
    assert t[0] is t[1]
    np.testing.assert_allclose(t[0], 2 * np.ones(2))


# ---------------------------------------------------------------- views


def test_view_gradient_is_a_view_of_the_source_total():
    w = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.8, -1.0]])
    model = {"enc": Dense(w, jnp.zeros(2)), "dec": Dense(tied.transpose(w), jnp.zeros(3))}
    x = jnp.array([[1.0, 2.0, -1.0]])
    loss = lambda m: jnp.sum(jnp.sin(m["dec"](m["enc"](x))))

    g = tied.grad(loss)(model)
    assert type(g["dec"].weight) is tied.View
    assert g["dec"].weight.source is g["enc"].weight
    assert g["dec"].weight.fn is model["dec"].weight.fn

    # By hand: the decoder's own weight is w.T, so its gradient goes back transposed.
    def plain(we, wd):
        return jnp.sum(jnp.sin(Dense(wd, jnp.zeros(3))(Dense(we, jnp.zeros(2))(x))))

    ge, gd = jax.grad(plain, argnums=(0, 1))(jnp.array(w), jnp.array(w.T))
    np.testing.assert_allclose(g["enc"].weight, ge + gd.T, rtol=1e-6)
    np.testing.assert_allclose(tied.materialize(g["dec"].weight), (ge + gd.T).T, rtol=1e-6)

    p = tied.grad(loss, per_location=True)(model)
    assert type(p["dec"].weight) is tied.View
    np.testing.assert_allclose(p["enc"].weight, ge, rtol=1e-6)
    np.testing.assert_allclose(p["dec"].weight.source, gd.T, rtol=1e-6)

    acc = tied.accumulate(model, p)
    assert acc["dec"].weight.source is acc["enc"].weight
    np.testing.assert_allclose(acc["enc"].weight, ge + gd.T, rtol=1e-6)
    again = tied.accumulate(model, g)
    assert again["enc"].weight is g["enc"].weight


def test_failing_view_function_names_the_view():
    w = jnp.ones((2, 3))
    model = {"w": w, "v": tied.view(w, lambda s: s.reshape(7))}
    for _ in range(2):  # the walk, then a compiled plan
        with pytest.raises(
            tied.GraphError,
            match=r"^\['v'\]: the view function <lambda> failed .*"
            r"shape \(2, 3\).*cannot reshape",
        ):
            tied.grad(lambda m: jnp.sum(tied.materialize(m["v"])))(model)


# ---------------------------------------------------------------- errors and cycles


class Unregistered:
    def __init__(self, w):
        self.w = w


def test_errors_under_grad_name_the_models_own_path():
    model = {"u": Unregistered(jnp.ones(2)), "w": jnp.ones(2)}
    with pytest.raises(
        tied.GraphError,
        match=r"^\['u'\]: an object of unregistered class "
        r".*Unregistered.*tied\.register",
    ):
        tied.grad(lambda m: jnp.sum(m["w"]))(model)


def test_accumulate_checks_its_input():
    model = {"a": [jnp.ones(2), jnp.ones(2)], "b": jnp.ones(1)}
    with pytest.raises(ValueError, match="convention must be"):
        tied.accumulate(model, model, convention="sum")
    with pytest.raises(
        tied.GraphError,
        match=r"^\['a'\]: the gradient does not mirror the model.*"
        r"length 2",
    ):
        tied.accumulate(model, {"a": [jnp.ones(2)], "b": None})
    # None stands for a whole subtree.
    acc = tied.accumulate(model, {"a": None, "b": jnp.full(1, 4.0)})
    assert acc["a"] == [None, None]
    np.testing.assert_allclose(acc["b"], [4.0])


def test_gradient_of_a_model_with_a_cycle():
    @tied.register
    class Node:
        def __init__(self, w):
            self.w = w
            self.me = [self]

    w = jnp.array([1.0, 2.0])
    model = Node(w)
    g = tied.grad(lambda m: jnp.sum(m.me[0].w ** 2))(model)
    assert type(g) is Node and g.me[0] is g
    np.testing.assert_allclose(g.w, 2 * w)
    with pytest.raises(tied.GraphError, match=r"^(<root>|\.me\[0\]): this node is on a reference cycle"):
        tied.grad(lambda m: jnp.sum(m.w), per_location=True)(model)
    # accumulate follows the cycle once, also where None stands for the whole gradient.
    acc = tied.accumulate(model, g)
    assert acc.w is g.w and acc.me[0] is acc
    none = tied.accumulate(model, None)
    assert none.w is None and none.me[0] is none


# ---------------------------------------------------------------- which aliasing "auto" trusts


def test_plain_jax_grad_aliased_cotangent_is_summed_or_refused_never_counted_once():
    """Issue 10, finding 6: for sum(m["a"] + m["b"]) with {"a": w, "b": w}, eager jax.grad
    returns one object at both places; the total is 2, not 1."""
    w = jnp.array([0.5, -1.0, 2.0])
    m = {"a": w, "b": w}
    loss = lambda m: jnp.sum(m["a"] + m["b"])
    g = jax.grad(loss)(m)
    assert g["a"] is g["b"]  # the case itself
    untied = jax.grad(loss)({"a": jnp.array(w), "b": jnp.array(w)})  # the reference
    total = untied["a"] + untied["b"]
    with pytest.raises(
        ValueError,
        match=r"^\['a'\]: the gradient holds one array object at 2 places of "
        r"this tied parameter.*convention='partials' if each place got its own use's "
        r"gradient.*convention='total' if the one object already is the whole gradient",
    ):
        tied.accumulate(m, g)
    acc = tied.accumulate(m, g, convention="partials")
    assert acc["a"] is acc["b"]
    np.testing.assert_allclose(acc["a"], total)
    np.testing.assert_allclose(acc["a"], 2 * np.ones(3))
    # what tied made itself is trusted: its total, counted once
    tg = tied.grad(loss)(m)
    np.testing.assert_allclose(tg["a"], total)
    assert tied.accumulate(m, tg)["a"] is tg["a"]
    # and the per-place partials of tied are distinct objects, summed
    p = tied.grad(loss, per_location=True)(m)
    np.testing.assert_allclose(tied.accumulate(m, p)["a"], total)


def test_implicit_to_tree_is_a_total_tied_made():
    w = jnp.array([1.0, 2.0])
    m = {"a": w, "b": [w]}
    gs = tied.gradient(lambda: jnp.sum(m["a"] * m["b"][0]), tied.params(m))
    g = gs.to_tree(m)
    assert g["a"] is g["b"][0]
    assert tied.accumulate(m, g)["a"] is g["a"]
    np.testing.assert_allclose(g["a"], 2 * w)


def test_a_reused_id_is_never_taken_for_a_total():
    """Totals are recognised by a weak reference to the object itself: when a total dies
    and a new array gets its id, the new one is not vouched for."""
    import gc

    w = np.array([1.0, 2.0], np.float32)
    m = {"a": w, "b": w}
    reused = 0
    for _ in range(50):
        t = tied.accumulate(m, {"a": np.ones(2, np.float32), "b": None})["a"]  # a total tied made
        assert tied.accumulate(m, {"a": t, "b": t})["a"] is t
        ident = id(t)
        del t
        gc.collect()
        # CPython hands a freed id out again: catch a new array that got it
        fresh = [np.full(2, 3.0, np.float32) for _ in range(50)]
        same = [f for f in fresh if id(f) == ident]
        reused += len(same)
        for f in same[:1] + fresh[:1]:
            with pytest.raises(ValueError, match="is not a total made by tied.grad"):
                tied.accumulate(m, {"a": f, "b": f})
    assert reused > 0  # the case did happen


def test_tied_grad_through_jit_is_right_or_refused():
    """A total that comes back from a jitted function is new objects: counted once where tied
    knows it made them, otherwise refused; never summed as if it were partials."""
    w = jnp.array([0.5, -1.0])
    m = {"a": w, "b": w}
    loss = lambda m: jnp.sum(m["a"] * m["b"])
    total = 2 * w
    out = tied.jit(lambda m: tied.grad(loss)(m))(m)
    assert out["a"] is out["b"]
    # tied.jit carries tied's marks back through JAX: the total is recognised, counted once.
    np.testing.assert_allclose(tied.accumulate(m, out)["a"], total)
    sgd = tied.optim.setup(optax.sgd(1.0), m)
    stepped, _ = tied.optim.update(sgd, m, out)
    np.testing.assert_allclose(stepped["a"], w - total)
    # A plain jitted function returning a partial twice is not a total: refused, not halved.
    plain = tied.jit(lambda m: jax.grad(lambda m: jnp.sum(m["a"] + m["b"]))(m))(m)
    with pytest.raises(ValueError, match="convention='partials'"):
        tied.accumulate(m, plain)
    graph = jax.jit(lambda G: tied.Graph(tied.grad(loss)(G.value)))(tied.Graph(m))
    g = graph.value
    assert g["a"] is g["b"]
    # one array per tie through a Graph: a total, known as one (issue 20, point 1)
    np.testing.assert_allclose(tied.accumulate(m, g)["a"], total)
    np.testing.assert_allclose(tied.accumulate(m, g, convention="total")["a"], total)
    # but plain jax.grad's aliased partials wrapped into a Graph inside jit are not: refused
    wrapped = jax.jit(lambda G: tied.Graph(jax.grad(lambda m: jnp.sum(m["a"] + m["b"]))(G.value)))
    p = wrapped(tied.Graph(m)).value
    with pytest.raises(ValueError, match="convention='partials'"):
        tied.accumulate(m, p)


def test_jax_grad_through_graph_updates_without_a_convention_like_optax_by_hand():
    """Issue 20, point 1: the refusal's old advice (partials) doubled this gradient."""
    w = jnp.array([0.5, -1.0])
    m = {"a": w, "b": w}
    loss = lambda m: jnp.sum(m["a"] * m["b"] + jnp.sin(m["b"]))
    g = jax.grad(lambda G: loss(G.value))(tied.Graph(m)).value
    state = tied.optim.setup(optax.adam(0.1), m)
    new, state = tied.optim.update(state, m, g)
    tx = optax.adam(0.1)
    ref_g = 2 * w + jnp.cos(w)
    upd, _ = tx.update(ref_g, tx.init(w))
    assert new["a"] is new["b"]
    np.testing.assert_allclose(new["a"], w + upd, rtol=1e-6)


def test_totals_made_in_many_threads_are_each_recognised():
    import threading

    w = jnp.array([1.0, -1.0])
    m = {"a": w, "b": w}
    errors: list = []

    def work(k):
        try:
            for _ in range(20):
                g = tied.grad(lambda m: jnp.sum(m["a"] * m["b"]) * k)(m)
                acc = tied.accumulate(m, g)
                assert acc["a"] is g["a"]
                np.testing.assert_allclose(acc["a"], 2 * k * w)
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------- trainable=


def test_trainable_gives_none_to_rejected_parameters_and_the_rest_as_plain_jax():
    w, s = jnp.array([[1.0, -2.0], [0.5, 3.0]]), jnp.array([0.2, -0.1])
    m = {"enc": Dense(w, jnp.zeros(2)), "head": Dense(w, jnp.ones(2)), "stats": s, "again": s}
    x = jnp.array([[1.0, 2.0]])

    def loss(m):
        h = jnp.tanh(m["enc"](x) - m["stats"])
        return jnp.sum(m["head"](h) * m["again"])

    keep = lambda path, a: "stats" not in path and "again" not in path and not path.endswith("bias")
    value, g = tied.value_and_grad(loss, trainable=keep)(m)
    np.testing.assert_allclose(value, loss(m))
    assert g["stats"] is None and g["again"] is None
    assert g["enc"].bias is None and g["head"].bias is None
    assert g["enc"].weight is g["head"].weight

    def plain(wa, wb):  # the untied reference: w at both places, everything else constant
        h = jnp.tanh(x @ wa.T - s)
        return jnp.sum((h @ wb.T + 1.0) * s)

    ra, rb = jax.grad(plain, argnums=(0, 1))(jnp.array(w), jnp.array(w))
    np.testing.assert_allclose(g["enc"].weight, ra + rb, rtol=1e-6)
    # per place: the same selection, each place its own partial
    p = tied.grad(loss, per_location=True, trainable=keep)(m)
    assert p["stats"] is None and p["enc"].bias is None
    np.testing.assert_allclose(p["enc"].weight, ra, rtol=1e-6)
    np.testing.assert_allclose(p["head"].weight, rb, rtol=1e-6)
    # a parameter is trainable when the predicate holds at any one of its places
    only_head = lambda path, a: path.startswith("['head']")
    g2 = tied.grad(loss, trainable=only_head)(m)
    assert g2["enc"].weight is g2["head"].weight and g2["enc"].bias is None
    np.testing.assert_allclose(g2["enc"].weight, ra + rb, rtol=1e-6)


def test_trainable_mask_is_the_shared_rule():
    from tied._transforms.grad import trainable_mask

    w = jnp.ones(2)
    m = {"a": w, "b": [w], "i": jnp.arange(2), "c": jnp.zeros(3)}
    leaves, gdef = tied.flatten(m)
    seen = []

    def pred(path, x):
        seen.append(path)
        return path == "['b'][0]"

    mask = trainable_mask(gdef, leaves, pred)
    assert [bool(v) for v in mask] == [x is w for x in leaves]
    assert "['i']" not in seen  # integer arrays are never parameters, never asked about
    assert trainable_mask(gdef, leaves, None) == [tied.is_param(x) for x in leaves]
    with pytest.raises(TypeError, match=r"^\['a'\]: trainable\(path, array\) returned str"):
        trainable_mask(gdef, leaves, lambda p, x: "yes")
