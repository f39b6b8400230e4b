"""Differential test of the core: random models mutated in place between calls.

A model is driven through a random sequence of in-place mutations (replace an array,
tie, untie, swap layers, grow and shrink lists, re-add fields in another order,
replace a weight by a view, change a static, drop objects so that CPython reuses
their ids). After every mutation, `tied.flatten` (which runs compiled plans once a
structure has been seen twice), `tied.jit` and `tied.grad` are compared with the
uncached walk, with the independent path walker of ``helpers`` and with plain
`jax.grad` on an untied copy. The test suite also runs with ``TIED_CHECK_PLANS=1``,
so each plan result is compared with the walk inside the library as well.
"""

from __future__ import annotations

import gc

import jax.numpy as jnp
import numpy as np
from helpers import (
    coefficients,
    grouped_totals,
    is_array,
    is_param,
    places,
    reference_partials,
    weighted_loss,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied._core import graph as _graph


@tied.register
class Layer:
    _test_registered = True

    def __init__(self, weight, bias, order="wb"):
        for name in order:
            setattr(self, {"w": "weight", "b": "bias"}[name], {"w": weight, "b": bias}[name])
        self.scale = 1.0


@tied.register
class Net:
    _test_registered = True

    def __init__(self, layers, blocks):
        self.layers = layers
        self.blocks = blocks


N = 3


def new_layer(rng, order="wb"):
    w = jnp.asarray(rng.normal(size=(N, N)), jnp.float32)
    return Layer(w, jnp.asarray(rng.normal(size=(N,)), jnp.float32), order)


def all_layers(net):
    return list(net.layers) + list(net.blocks.values())


def mutate(net, op: int, a: int, b: int, rng) -> None:
    layers = all_layers(net)
    la, lb = layers[a % len(layers)], layers[b % len(layers)]
    if op == 0:  # replace an array
        la.weight = jnp.asarray(rng.normal(size=(N, N)), jnp.float32)
    elif op == 1:  # tie two arrays
        la.bias = lb.bias if not isinstance(lb.bias, tied.View) else la.bias
    elif op == 2:  # untie
        la.weight = jnp.array(tied.materialize(la.weight))
    elif op == 3 and len(net.layers) > 1:  # swap layers
        i, j = a % len(net.layers), b % len(net.layers)
        net.layers[i], net.layers[j] = net.layers[j], net.layers[i]
    elif op == 4:  # grow: a new layer, or a layer met before (a shared node)
        net.layers.append(new_layer(rng) if a % 2 else lb)
    elif op == 5 and len(net.layers) > 1:  # shrink
        net.layers.pop(a % len(net.layers))
    elif op == 6:  # fields re-added in the other order
        w, bias, scale = la.weight, la.bias, la.scale
        del la.weight, la.bias, la.scale
        if a % 2:
            la.bias, la.weight = bias, w
        else:
            la.scale, la.weight, la.bias = scale, w, bias
        la.scale = scale
    elif op == 7 and not isinstance(lb.weight, tied.View) and la is not lb:  # a derived tie
        la.weight = tied.transpose(lb.weight)
    elif op == 8:  # a static changes bits but not value
        la.scale = -la.scale if la.scale != 0.0 else (0.0 if np.signbit(la.scale) else -0.0)
    elif op == 9:  # keys of the block dict re-inserted in another order
        items = list(net.blocks.items())
        net.blocks.clear()
        for k, v in reversed(items):
            net.blocks[k] = v
    elif op == 10:  # drop objects and make new ones: CPython may hand out the old ids
        name = f"b{a % 3}"
        net.blocks.pop(name, None)
        gc.collect()
        net.blocks[name] = new_layer(rng, "bw" if b % 2 else "wb")


def forward(net, x):
    for layer in all_layers(net):
        x = jnp.tanh(x @ tied.materialize(layer.weight).T + layer.bias) * (1.0 + layer.scale)
    return jnp.sum(x**2)


def check(net, jitted, x) -> None:
    # flatten (plans included) against the uncached walk and the independent walker
    leaves, gdef = tied.flatten(net)
    walk_leaves, walk_gdef = _graph._walk(net)
    assert gdef == walk_gdef
    assert [id(v) for v in leaves] == [id(v) for v in walk_leaves]
    distinct: dict[int, object] = {}
    ref_paths: dict[int, list[str]] = {}
    for p, v in places(net, into_shared=False):
        if is_array(v):
            distinct.setdefault(id(v), v)
            ref_paths.setdefault(id(v), []).append(p)
    assert [id(v) for v in leaves] == list(distinct)
    assert gdef.leaf_paths() == tuple(tuple(ps) for ps in ref_paths.values())
    every_place = [(p, id(v)) for p, v in places(net) if is_array(v)]
    assert [(p, id(leaves[i])) for p, i in gdef.place_leaves()] == every_place
    rebuilt = tied.unflatten(gdef, leaves)
    assert tied.flatten(rebuilt)[1] == gdef
    for (p, v), (q, w) in zip(places(net), places(rebuilt)):
        assert p == q and type(v) is type(w)
        if not is_array(v) and not hasattr(v, "__dict__") and not isinstance(v, (list, dict, tied.View)):
            assert np.array(v).tobytes() == np.array(w).tobytes()  # statics, bit for bit
    # tied.jit against eager
    np.testing.assert_allclose(jitted(net, x), forward(net, x), rtol=2e-5, atol=1e-6)
    # gradients against plain jax.grad on an untied copy, summed per tie by hand
    coefs = coefficients(net)
    for p in list(coefs):  # tied.grad hands the function views materialised: one coefficient
        if p.endswith(".source"):
            coefs[p[: -len(".source")]] = coefs[p]
    g = tied.grad(weighted_loss(coefs))(net)
    totals = grouped_totals(net, reference_partials(net, coefs))
    got = {p: v for p, v in places(g) if is_array(v)}
    assert set(got) == {p for p, v in places(net) if is_param(v)}
    for p, v in got.items():
        np.testing.assert_allclose(v, totals[p], rtol=1e-5, atol=1e-6)


OPS = st.lists(st.tuples(st.integers(0, 10), st.integers(0, 7), st.integers(0, 7)), max_size=12)


@settings(max_examples=15)
@given(st.integers(0, 2**16), OPS)
def test_flatten_jit_and_grad_agree_with_the_walk_through_in_place_mutations(seed, ops):
    rng = np.random.default_rng(seed)
    shared = new_layer(rng)
    net = Net([new_layer(rng), shared, new_layer(rng, "bw"), shared], {"b0": new_layer(rng), "b1": shared})
    jitted = tied.jit(forward)
    x = jnp.ones((2, N))
    for _ in range(3):  # the walk, then compiled plans
        check(net, jitted, x)
    for op, a, b in ops:
        mutate(net, op, a, b, rng)
        check(net, jitted, x)
        check(net, jitted, x)  # the same structure again: a plan may serve it now


def test_threads_flattening_models_of_one_type_in_other_orders_each_get_their_own_walk():
    import threading

    rng = np.random.default_rng(0)
    nets = []
    for k in range(6):
        layers = [new_layer(rng, "wb" if (k + i) % 2 else "bw") for i in range(3)]
        nets.append(Net(layers + layers[:1], {"b0": layers[k % 3], "b1": new_layer(rng)}))
    expected = [(_graph._walk(n)[1], [id(x) for x in _graph._walk(n)[0]]) for n in nets]
    errors: list = []

    def worker(k: int) -> None:
        try:
            for _ in range(60):
                leaves, gdef = tied.flatten(nets[k])
                assert gdef == expected[k][0] and [id(x) for x in leaves] == expected[k][1]
                out = tied.unflatten(gdef, leaves)
                assert out.layers[0] is out.layers[3]
        except BaseException as e:  # reported below: a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_ids_reused_after_garbage_collection_are_not_read_as_sharing():
    rng = np.random.default_rng(1)
    for _ in range(30):
        a = Net([new_layer(rng), new_layer(rng)], {})
        for _ in range(3):
            leaves, gdef = tied.flatten(a)
        assert len(leaves) == 4 and tied.ties(a) == []
        b = Net([new_layer(rng)], {})
        b.layers.append(b.layers[0])  # now tied: the same object at two places
        del a
        gc.collect()
        leaves, gdef = tied.flatten(b)
        assert len(leaves) == 2 and tied.ties(b) == [(".layers[0]", ".layers[1]")]
