"""tied.optim against optax stepped by hand on the unique parameters.

The reference never goes through `tied`: it writes the model's forward pass as a
function of one argument per *place*, takes per-place partials with plain
`jax.grad`, sums them per tied array by hand, and steps a dict of the unique
arrays, keyed by the path of each one's first place (what optax sees through
`tied.optim`), with the same optax rule.
"""

from __future__ import annotations

import dataclasses
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
    coefficients,
    grouped_totals,
    is_param,
    models,
    places,
    rebuild,
    reference_partials,
    sharing_groups,
    weighted_loss,
)
from hypothesis import given
from safetensors import safe_open

import tied

# The unique parameters of make_model(), by the path of their first place.
W, B, B2 = ".layers[0].weight", ".layers[0].bias", ".layers[1].bias"
HW, HB = ".layers[3].weight", ".layers[3].bias"
NAMES = (W, B, B2, HW, HB)


def make_model(seed: int = 0) -> Chain:
    """Chain(d1, d2, d1, head): d1 is one node at two places, and d2 shares d1's weight,
    so the weight has three places and d1's bias two. Plus a static tag and an int array."""
    k = jax.random.split(jax.random.key(seed), 3)
    w = 0.5 * jax.random.normal(k[0], (4, 4))
    d1 = Dense(w, 0.1 * jax.random.normal(k[1], (4,)), jnp.tanh)
    d2 = Dense(w, jnp.full((4,), 0.05, jnp.float32), jnp.tanh)
    head = Dense(0.5 * jax.random.normal(k[2], (2, 4)), jnp.zeros(2))
    c = Chain(d1, d2, d1, head)
    c.tag = "mlp"
    c.ids = jnp.arange(3)
    return c


def data(seed: int = 1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (8, 4)), jax.random.normal(k2, (8, 2))


X, Y = data()


def loss_fn(m, x=X, y=Y):
    return jnp.mean((m(x) - y) ** 2)


def as_dict(m: Chain) -> dict:
    return {
        W: m.layers[0].weight,
        B: m.layers[0].bias,
        B2: m.layers[1].bias,
        HW: m.layers[3].weight,
        HB: m.layers[3].bias,
    }


def _forward_places(w_a, b_a, w_b, b2, w_c, b_c, hw, hb, x):
    h = jnp.tanh(x @ w_a.T + b_a)
    h = jnp.tanh(h @ w_b.T + b2)
    h = jnp.tanh(h @ w_c.T + b_c)
    return h @ hw.T + hb


def _loss_places(*args):
    *ps, x, y = args
    return jnp.mean((_forward_places(*ps, x) - y) ** 2)


def ref_partials(p: dict, x=X, y=Y) -> tuple:
    """Per-place partials: (w@0, b@0, w@1, b2, w@2, b@2, hw, hb)."""
    args = (p[W], p[B], p[W], p[B2], p[W], p[B], p[HW], p[HB])
    return jax.grad(_loss_places, argnums=tuple(range(8)))(*args, x, y)


def ref_totals(p: dict, x=X, y=Y) -> dict:
    gw0, gb0, gw1, gb2, gw2, gb1, ghw, ghb = ref_partials(p, x, y)
    return {W: gw0 + gw1 + gw2, B: gb0 + gb1, B2: gb2, HW: ghw, HB: ghb}


def ref_loss(p: dict, x=X, y=Y):
    return _loss_places(p[W], p[B], p[W], p[B2], p[W], p[B], p[HW], p[HB], x, y)


def ref_run(tx, steps: int, p: dict | None = None) -> list[tuple[dict, Any]]:
    """Optax stepped by hand on the dict of unique parameters with the summed gradient:
    (parameters, optax state) after each step."""
    p = dict(as_dict(make_model())) if p is None else p
    s = tx.init(p)
    out = []
    for _ in range(steps):
        u, s = tx.update(ref_totals(p), s, p)
        p = optax.apply_updates(p, u)
        out.append((p, s))
    return out


def assert_ties(m: Chain, ids=None) -> None:
    assert m.layers[0] is m.layers[2]
    assert m.layers[1].weight is m.layers[0].weight
    assert m.layers[1] is not m.layers[0]
    assert m.tag == "mlp"
    assert m.layers[0].activation is jnp.tanh and m.layers[3].activation is None
    if ids is not None:
        assert m.ids is ids


def assert_close(got: dict, want: dict, atol=1e-5) -> None:
    assert set(got) >= set(want)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=atol, err_msg=k)


def assert_states_close(got: Any, want: Any, atol=1e-5) -> None:
    """Two optax states: the same structure (dicts keyed by the same paths), close values."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


# ---------------------------------------------------------------- against the hand reference


@pytest.mark.parametrize(
    "tx, slots",
    [(optax.sgd(0.1, momentum=0.9), 1), (optax.adam(0.05), 2)],
    ids=["momentum", "adam"],
)
def test_stateful_rules_ten_steps_match_hand_reference(tx, slots):
    m = make_model()
    ids = m.ids
    state = tied.optim.setup(tx, m)
    # One optax entry per unique parameter (trace; or mu and nu), however many places.
    per_param = [x for x in jax.tree_util.tree_leaves(state.inner_state) if x.ndim > 0]
    assert len(per_param) == slots * len(NAMES)
    assert state.paths == NAMES
    for want, want_state in ref_run(tx, 10):
        before = as_dict(m)
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert_ties(m, ids)
        assert_close(as_dict(m), want)
        assert_states_close(state.inner_state, want_state)  # the optax state itself, by path
        assert all(before[k] is not as_dict(m)[k] for k in NAMES)
    assert ref_loss(as_dict(m)) < ref_loss(as_dict(make_model()))


def test_state_holds_no_parameter_arrays_seed_model():
    """The README's seed model under Adam: the state's leaves are the optax state alone,
    mu and nu, 2 x 6 numbers (plus Adam's step count)."""
    d1 = Dense(jax.random.normal(jax.random.key(0), (2, 2)), jnp.zeros(2))
    c = Chain(d1, Dense(d1.weight, d1.bias))
    x = jnp.ones((1, 2))
    state = tied.optim.setup(optax.adam(1e-2), c)
    for _ in range(2):
        leaves = jax.tree_util.tree_leaves(state)
        inner = jax.tree_util.tree_leaves(state.inner_state)
        assert len(leaves) == len(inner) and all(a is b for a, b in zip(leaves, inner))
        floats = [a for a in leaves if jnp.issubdtype(a.dtype, jnp.floating)]
        assert sum(a.size for a in floats) == 2 * 6
        model_arrays = tied.flatten(c)[0]
        assert not any(a is p for a in leaves for p in model_arrays)
        assert (
            set(state.inner_state[0].mu)
            == set(state.inner_state[0].nu)
            == {
                ".layers[0].weight",
                ".layers[0].bias",
            }
        )
        c, state = tied.optim.update(state, c, tied.grad(lambda m: m(x).sum())(c))
        assert c.layers[0].weight is c.layers[1].weight


def test_per_place_stepping_would_be_caught():
    """The reference separates the right step from a per-place Adam step, by a margin."""
    tx = optax.adam(0.05)
    m = make_model()
    p = as_dict(m)
    parts = ref_partials(p)
    per_place = [p[W], p[B], p[W], p[B2], p[W], p[B], p[HW], p[HB]]
    u, _ = tx.update(list(parts), tx.init(per_place), per_place)
    naive_w = per_place[0] + u[0] + u[2] + u[4]  # each place's step applied to the tie
    want = ref_run(tx, 1)[0][0]
    assert float(jnp.max(jnp.abs(naive_w - want[W]))) > 1e-2
    m2, _ = tied.optim.update(tied.optim.setup(tx, m), m, tied.grad(loss_fn)(m))
    assert_close(as_dict(m2), want)


def test_input_model_untouched():
    m = make_model()
    before = {k: np.asarray(v) for k, v in as_dict(m).items()}
    objs = as_dict(m)
    layers = list(m.layers)
    tied.optim.update(tied.optim.setup(optax.adam(0.1), m), m, tied.grad(loss_fn)(m))
    assert all(as_dict(m)[k] is objs[k] for k in NAMES)
    assert all(a is b for a, b in zip(m.layers, layers))
    for k in NAMES:
        np.testing.assert_array_equal(np.asarray(as_dict(m)[k]), before[k])


@given(models())
def test_adam_on_random_sharing_patterns_matches_optax_by_hand(model):
    """Random DAGs: optax sees each unique parameter once, under its first place's path;
    two Adam steps match optax stepped by hand, and every tie (arrays and nodes) holds."""
    first: dict[int, str] = {}
    for path, x in places(model):
        if is_param(x):
            first.setdefault(id(x), path)
    coefs = coefficients(model)
    loss = weighted_loss(coefs)
    tx = optax.adam(0.1)
    ref = {first[id(x)]: x for _, x in places(model) if is_param(x)}
    rs = tx.init(ref)
    state = tied.optim.setup(tx, model)
    assert set(state.paths) == set(ref)
    m = model
    for _ in range(2):
        at_ref = rebuild(model, lambda p, x, ref=ref: ref[first[id(x)]] if is_param(x) else x)
        totals = grouped_totals(at_ref, reference_partials(at_ref, coefs))
        u, rs = tx.update({k: totals[k] for k in ref}, rs, ref)
        ref = optax.apply_updates(ref, u)
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        for (path, x), (_, y) in zip(places(model), places(m)):
            if is_param(x):
                np.testing.assert_allclose(
                    np.asarray(y), np.asarray(ref[first[id(x)]]), atol=1e-5, err_msg=path
                )
        assert sharing_groups(m, is_param) == sharing_groups(model, is_param)
        assert_states_close(state.inner_state, rs)


# ---------------------------------------------------------------- gradient conventions


def _grad_tree(gs: list, cls=Chain):
    """A gradient shaped like make_model(): one Dense per place, arrays or None."""
    g = cls(*(Dense(w, b) for w, b in gs))
    g.tag = g.ids = None
    return g


def conventions(m: Chain) -> dict[str, tuple[Any, str]]:
    p = as_dict(m)
    gw0, gb0, gw1, gb2, gw2, gb1, ghw, ghb = ref_partials(p)
    tw, tb = gw0 + gw1 + gw2, gb0 + gb1
    return {
        "aliased (tied.grad)": (tied.grad(loss_fn)(m), "auto"),
        "per_location=True": (tied.grad(loss_fn, per_location=True)(m), "auto"),
        "partials by hand": (
            _grad_tree([(gw0, gb0), (gw1, gb2), (gw2, gb1), (ghw, ghb)]),
            "auto",
        ),
        "total at first": (_grad_tree([(tw, tb), (None, gb2), (None, None), (ghw, ghb)]), "auto"),
        "total repeated, distinct": (
            _grad_tree([(tw, tb), (tw + 0, gb2), (tw * 1, tb + 0), (ghw, ghb)]),
            "total",
        ),
        # one object at every place, not made by tied: the caller says what it is
        "aliased by hand": (_grad_tree([(tw, tb), (tw, gb2), (tw, tb), (ghw, ghb)]), "total"),
        "accumulate(partials)": (
            tied.accumulate(m, _grad_tree([(gw0, gb0), (gw1, gb2), (gw2, gb1), (ghw, ghb)])),
            "auto",
        ),
    }


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9)], ids=["sgd", "mom"])
def test_every_convention_gives_the_same_update(tx):
    m = make_model()
    want = ref_run(tx, 2)
    for name, (g, conv) in conventions(m).items():
        state = tied.optim.setup(tx, m)
        m1, state = tied.optim.update(state, m, g, convention=conv)
        assert_ties(m1)
        assert_close(as_dict(m1), want[0][0])
        # second step with the convention recomputed at the new model: state is right too
        g2, conv2 = conventions(m1)[name]
        m2, _ = tied.optim.update(state, m1, g2, convention=conv2)
        assert_close(as_dict(m2), want[1][0])


def test_aliased_by_hand_is_refused_under_auto():
    m = make_model()
    g, _ = conventions(m)["aliased by hand"]
    state = tied.optim.setup(optax.sgd(0.1), m)
    with pytest.raises(
        ValueError,
        match=r"^\.layers\[0\]\.weight: the gradient holds one array object "
        r"at 3 places.*convention='partials'.*convention='total'",
    ):
        tied.optim.update(state, m, g)


def test_plain_jax_grad_aliased_cotangent_steps_the_full_total():
    """Issue 10, finding 6: for sum(m["a"] + m["b"]) with {"a": w, "b": w}, eager jax.grad
    hands one cotangent object to both places; the total is 2, and SGD must move by 2."""
    w = jnp.array([0.5, -1.0, 2.0])
    m = {"a": w, "b": w}
    loss = lambda m: jnp.sum(m["a"] + m["b"])
    g = jax.grad(loss)(m)
    assert g["a"] is g["b"]  # the case itself: one object, two partials
    # reference: plain jax.grad on an untied copy, summed by hand
    untied = jax.grad(loss)({"a": jnp.array(w), "b": jnp.array(w)})
    total = untied["a"] + untied["b"]
    np.testing.assert_allclose(total, 2 * np.ones(3))
    state = tied.optim.setup(optax.sgd(0.1), m)
    with pytest.raises(
        ValueError,
        match=r"^\['a'\]: the gradient holds one array object at 2 places.*"
        r"convention='partials' if each place got its own use's gradient",
    ):
        tied.optim.update(state, m, g)
    m1, _ = tied.optim.update(state, m, g, convention="partials")
    assert m1["a"] is m1["b"]
    np.testing.assert_allclose(m1["a"], w - 0.1 * total, atol=1e-6)
    # tied's own gradient of the same loss is a total tied made: "auto" takes it once
    tg = tied.grad(loss)(m)
    np.testing.assert_allclose(tg["a"], total)
    m2, _ = tied.optim.update(state, m, tg)
    np.testing.assert_allclose(m2["a"], w - 0.1 * total, atol=1e-6)
    assert m2["a"] is m2["b"]


def test_gradient_and_update_inside_one_tied_jit_trace():
    """Inside a trace the totals are tracers, which tied marks as its own as well."""
    w = jnp.array([0.5, -1.0])
    m = {"a": w, "b": w}
    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(lambda m: jnp.sum(m["a"] + m["b"]))(m)))
    m1, _ = step(m, tied.optim.setup(optax.sgd(0.1), m))
    assert m1["a"] is m1["b"]
    np.testing.assert_allclose(m1["a"], w - 0.2, atol=1e-6)


def test_aliased_total_is_never_double_counted():
    """With plain SGD, counting the total once per place would step w by 3x."""
    m = make_model()
    g = tied.grad(loss_fn)(m)
    assert g.layers[0].weight is g.layers[1].weight is g.layers[2].weight
    m1, _ = tied.optim.update(tied.optim.setup(optax.sgd(1.0), m), m, g)
    total = ref_totals(as_dict(m))[W]
    np.testing.assert_allclose(m1.layers[0].weight, m.layers[0].weight - total, atol=1e-6)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(m1.layers[0].weight, m.layers[0].weight - 3 * total, atol=1e-6)


def test_global_norm_clipping_sees_each_total_once():
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0))
    m = make_model()
    p = as_dict(m)
    want = ref_run(tx, 1)[0][0]
    totals = ref_totals(p)
    assert float(optax.tree.norm(totals)) > 0.05  # clipping is active
    for g, conv in [(tied.grad(loss_fn)(m), "auto"), (tied.grad(loss_fn, per_location=True)(m), "auto")]:
        m1, _ = tied.optim.update(tied.optim.setup(tx, m), m, g, convention=conv)
        assert_close(as_dict(m1), want, atol=1e-6)
    # A per-place norm (each partial once, as plain jax.grad gives) would clip differently.
    per_place_norm = optax.tree.norm(list(ref_partials(p)))
    assert abs(float(per_place_norm) - float(optax.tree.norm(totals))) > 1e-3


# ---------------------------------------------------------------- the state lines up with the model by path


def _refused(state, model, match):
    with pytest.raises(ValueError, match=match):
        tied.optim.update(state, model, None)


def test_model_that_does_not_line_up_is_refused_naming_the_path():
    m = make_model()
    state = tied.optim.setup(optax.adam(1e-2), m)
    fix = r".*tied\.optim\.setup\(tx, model\)"
    # fewer parameters: the state's head is missing
    small = Chain(m.layers[0], m.layers[1])
    _refused(
        state,
        small,
        r"^\.layers\[3\]\.weight: the optimiser state has a parameter here, but the "
        r"model has no array here" + fix,
    )
    # more parameters: a new layer
    big = Chain(*m.layers, Dense(jnp.ones((2, 2)), jnp.zeros(2)))
    _refused(
        state,
        big,
        r"^\.layers\[4\]\.weight: the model has a trainable parameter here that the "
        r"optimiser state was not set up for",
    )
    # a shape, a dtype
    other = make_model()
    other.layers[3].weight = jnp.zeros((3, 4))
    _refused(state, other, r"^\.layers\[3\]\.weight: .*shape \(3, 4\).*set up for shape \(2, 4\)")
    other = make_model()
    other.layers[3].bias = jnp.zeros(2, jnp.float16)
    _refused(state, other, r"^\.layers\[3\]\.bias: .*dtype float16.*dtype float32")
    # a tie cut, and a tie made
    cut = make_model()
    cut.layers[1].weight = jnp.array(cut.layers[1].weight)
    _refused(
        state,
        cut,
        r"^\.layers\[0\]\.weight: the optimiser state was set up for a parameter at the "
        r"places \['\.layers\[0\]\.weight', '\.layers\[1\]\.weight'.*a tie was made or cut",
    )
    made = make_model()
    made.layers[1].bias = made.layers[0].bias
    _refused(state, made, r"^\.layers\[0\]\.bias: .*places .*a tie was made or cut")
    # a parameter that became an integer array
    other = make_model()
    other.layers[1].bias = jnp.zeros(4, jnp.int32)
    _refused(state, other, r"^\.layers\[1\]\.bias: .*not trainable \(dtype int32\)")
    # nothing was changed on the way
    assert_ties(m)
    with pytest.raises(TypeError, match="expected the OptState"):
        tied.optim.update(optax.adam(1e-2).init(as_dict(m)), m, None)


def test_gradient_shape_and_structure_errors():
    m = make_model()
    state = tied.optim.setup(optax.adam(1e-2), m)
    bad = tied.grad(loss_fn)(m)
    bad.layers[3].bias = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"\.layers\[3\]\.bias: the gradient has shape \(3,\)"):
        tied.optim.update(state, m, bad)
    with pytest.raises(tied.GraphError, match=r"<root>: the gradient does not mirror the model"):
        tied.optim.update(state, m, {"layers": 3})


def test_state_is_matched_by_path_not_by_position():
    """Issue 10, finding 7: the same parameters in another flatten order (dict insertion
    order) line up by path; a frozen one stays frozen, the other moves."""
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    m1 = {"a": a, "b": b}
    state = tied.optim.freeze(tied.optim.setup(optax.adam(0.1), m1), "['a']")
    m2 = {"b": b, "a": a}  # other insertion order, same places
    g = {"b": jnp.ones(2), "a": jnp.ones(2)}
    new, state2 = tied.optim.update(state, m2, g)
    assert new["a"] is a and new["b"] is not b
    ref_tx = optax.adam(0.1)
    ref_p = {"b": b}
    u, _ = ref_tx.update({"b": jnp.ones(2)}, ref_tx.init(ref_p), ref_p)
    np.testing.assert_allclose(new["b"], b + u["b"], atol=1e-6)
    assert list(state2.frozen) == ["['a']"]

    @tied.register
    class Pair:
        def __init__(self, w, order):
            for k in order:
                setattr(self, k, w)

    w = jnp.array([1.0, -1.0])
    first, second = Pair(w, "ab"), Pair(w, "ba")  # one tie, met in the other order
    state = tied.optim.setup(optax.sgd(1.0), first)
    new, _ = tied.optim.update(state, second, tied.grad(lambda m: jnp.sum(m.a * m.b))(second))
    assert new.a is new.b
    np.testing.assert_allclose(new.a, w - 2 * w)


def test_two_parameters_with_one_path_are_refused():
    @tied.register
    class Odd:
        def __init__(self):
            self.enc = {"w": jnp.ones(2)}
            setattr(self, "enc['w']", jnp.zeros(2))  # reads as the same keystr path

    with pytest.raises(ValueError, match=r"^\.enc\['w'\]: two different parameters have this same path"):
        tied.optim.setup(optax.sgd(0.1), Odd())


# ---------------------------------------------------------------- None gradients, freezing


def test_none_gradient_on_one_branch_keeps_param_and_state():
    tx = optax.adam(0.05)
    m = make_model()
    state = tied.optim.setup(tx, m)
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    head_mu = [state.inner_state[0].mu[k] for k in (HW, HB)]
    g = tied.grad(loss_fn)(m)
    g.layers[3] = None  # no gradient for the head at all
    head = m.layers[3]
    m2, state2 = tied.optim.update(state, m, g)
    assert m2.layers[3].weight is head.weight and m2.layers[3].bias is head.bias
    assert all(a is b for a, b in zip(head_mu, [state2.inner_state[0].mu[k] for k in (HW, HB)]))
    # the others take a normal Adam step from the same state: reference by hand
    p = as_dict(m)
    full = ref_totals(p)
    rest = (W, B, B2)
    adam = state.inner_state[0]
    rs = (
        adam._replace(mu={k: adam.mu[k] for k in rest}, nu={k: adam.nu[k] for k in rest}),
        optax.EmptyState(),
    )
    u, _ = tx.update({k: full[k] for k in rest}, rs, {k: p[k] for k in rest})
    assert_close(as_dict(m2), {k: p[k] + u[k] for k in rest})
    assert_ties(m2)


def test_none_at_every_place_of_a_tied_param():
    m = make_model()
    state = tied.optim.setup(optax.sgd(0.1, momentum=0.9), m)
    g = tied.grad(loss_fn)(m)
    w = m.layers[0].weight
    g.layers[0].weight = g.layers[1].weight = None  # every place (layers[2] is layers[0])
    m2, state2 = tied.optim.update(state, m, g)
    assert m2.layers[0].weight is w and m2.layers[1].weight is w
    assert state2.inner_state[0].trace[W] is state.inner_state[0].trace[W]
    assert m2.layers[0].bias is not m.layers[0].bias
    # one present place out of three is the total for that place only: it is used
    g = tied.grad(loss_fn)(m)
    g.layers[1].weight = None
    g.layers[0].weight = g.layers[0].weight * 0 + 1.0  # at .layers[0] and .layers[2]: one node
    with pytest.raises(ValueError, match=r"one array object at 2 places"):
        tied.optim.update(tied.optim.setup(optax.sgd(0.1), m), m, g)  # made by hand: ambiguous
    m3, _ = tied.optim.update(tied.optim.setup(optax.sgd(0.1), m), m, g, convention="total")
    np.testing.assert_allclose(m3.layers[1].weight, w - 0.1, atol=1e-6)


def test_all_none_gradient_changes_nothing():
    m = make_model()
    state = tied.optim.setup(optax.adam(0.1), m)
    m2, state2 = tied.optim.update(state, m, None)
    assert all(as_dict(m2)[k] is as_dict(m)[k] for k in NAMES)
    assert state2.inner_state is state.inner_state
    assert_ties(m2)


def _frozen_reference(state, m, tx, frozen_key, steps):
    """Optax by hand on the parameters other than ``frozen_key``, from the state's moments."""
    rest = [k for k in NAMES if k != frozen_key]
    adam = state.inner_state[0]
    rs = (
        adam._replace(mu={k: adam.mu[k] for k in rest}, nu={k: adam.nu[k] for k in rest}),
        optax.EmptyState(),
    )
    p = {k: as_dict(m)[k] for k in rest}
    fixed = as_dict(m)[frozen_key]
    out = []
    for _ in range(steps):
        full = ref_totals({**p, frozen_key: fixed})
        u, rs = tx.update({k: full[k] for k in rest}, rs, p)
        p = optax.apply_updates(p, u)
        out.append(p)
    return out


@pytest.mark.parametrize("how", ["path of another place", "array with model="])
def test_freeze_through_one_place_with_adam_then_thaw(how):
    tx = optax.adam(0.05)
    m = make_model()
    state = tied.optim.setup(tx, m)
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    w = m.layers[1].weight  # the second place of the weight (d2's), frozen through it
    if how == "array with model=":
        state = tied.optim.freeze(state, m.layers[1].weight, model=m)
    else:
        state = tied.optim.freeze(state, ".layers[1].weight")
    assert list(state.frozen) == [W]
    mu_w, nu_w = state.inner_state[0].mu[W], state.inner_state[0].nu[W]
    for want in _frozen_reference(state, m, tx, W, 3):
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert m.layers[0].weight is w and m.layers[2].weight is w and m.layers[1].weight is w
        assert state.inner_state[0].mu[W] is mu_w and state.inner_state[0].nu[W] is nu_w
        assert_close(as_dict(m), want)
        assert_ties(m)
    # thaw through another place: Adam resumes from the kept moments
    state = tied.optim.thaw(state, ".layers[0].weight")
    assert state.frozen == {}
    g_w = ref_totals(as_dict(m))[W]
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    np.testing.assert_allclose(state.inner_state[0].mu[W], 0.9 * mu_w + 0.1 * g_w, atol=1e-6)
    assert m.layers[0].weight is not w
    assert_ties(m)


def test_frozen_survives_jax_jit_tied_jit_and_save_load(tmp_path):
    tx = optax.adam(0.05)
    m = make_model()
    state = tied.optim.freeze(tied.optim.setup(tx, m), ".layers[3].bias")
    hb = m.layers[3].bias
    # plain jax.jit of the state alone
    state = jax.jit(lambda s: s)(state)
    assert list(state.frozen) == [HB]
    # tied.jit steps
    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(loss_fn)(m)))
    wants = _frozen_reference(state, m, tx, HB, 4)
    for want in wants[:2]:
        m, state = step(m, state)
        assert list(state.frozen) == [HB]
        np.testing.assert_array_equal(m.layers[3].bias, hb)
        assert_close(as_dict(m), want)
        assert_ties(m)
    # save and load, into a like frozen the same way
    path = tmp_path / "ckpt.safetensors"
    tied.save(path, (m, state))
    like = (make_model(), tied.optim.freeze(tied.optim.setup(tx, make_model()), ".layers[3].bias"))
    m, state = tied.load(path, like=like)
    assert list(state.frozen) == [HB]
    for want in wants[2:]:
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        np.testing.assert_array_equal(m.layers[3].bias, hb)
        assert_close(as_dict(m), want)
    # a like that is not frozen does not silently unfreeze: the load is refused
    with pytest.raises(tied.CheckpointError, match=r"frozen\['\.layers\[3\]\.bias'\]"):
        tied.load(path, like=(make_model(), tied.optim.setup(tx, make_model())))


def test_freeze_by_view_and_errors():
    enc = Dense(jnp.ones((3, 2)), jnp.zeros(3), jnp.tanh)
    dec = Dense(tied.transpose(enc.weight), jnp.zeros(2))
    m = Chain(enc, dec)
    state = tied.optim.setup(optax.sgd(0.1), m)
    assert state.paths == (".layers[0].weight", ".layers[0].bias", ".layers[1].bias")  # no view
    by_view = tied.optim.freeze(state, dec.weight, model=m)  # a View: freezes its source
    assert list(by_view.frozen) == [".layers[0].weight"]
    assert list(tied.optim.freeze(state, ".layers[1].weight").frozen) == [".layers[0].weight"]
    assert state.frozen == {}  # functional
    x = jnp.ones((2, 2))
    m2, _ = tied.optim.update(by_view, m, tied.grad(lambda m: m(x).sum())(m))
    assert m2.layers[0].weight is enc.weight and m2.layers[1].weight.source is enc.weight
    m3, _ = tied.optim.update(state, m, tied.grad(lambda m: m(x).sum())(m))
    assert m3.layers[1].weight.source is m3.layers[0].weight
    assert m3.layers[0].weight is not enc.weight
    with pytest.raises(
        ValueError,
        match=r"freeze: argument 0 is an array, but the optimiser state holds "
        r"no parameter arrays.*model=model.*'\.layers\[0\]\.weight'",
    ):
        tied.optim.freeze(state, enc.weight)
    with pytest.raises(ValueError, match=r"freeze: argument 0 \(ArrayImpl of shape \(3, 2\).*identity"):
        tied.optim.freeze(state, jnp.ones((3, 2)), model=m)
    with pytest.raises(
        ValueError,
        match=r"thaw: argument 1 \('\.layers\[0\]\.wieght'\) is not a place.*"
        r"Nearest places: '\.layers\[0\]\.weight'",
    ):
        tied.optim.thaw(state, ".layers[0].bias", ".layers[0].wieght")
    with pytest.raises(TypeError, match=r"freeze: argument 0 is a int"):
        tied.optim.freeze(state, 3)
    # with model=: looked up in the model (e.g. after plain jax.jit made new arrays)
    leaves, gdef = tied.flatten(m)
    copy = tied.unflatten(gdef, [jnp.array(a) for a in leaves])
    assert list(tied.optim.freeze(state, copy.layers[0].bias, model=copy).frozen) == [".layers[0].bias"]


# ---------------------------------------------------------------- trainable=


@tied.register
class Norm:
    """Scales by a learned weight and subtracts a running mean (a buffer, not trained)."""

    def __init__(self, weight, running_mean):
        self.weight = weight
        self.running_mean = running_mean

    def __call__(self, x):
        return (x - self.running_mean) * self.weight


def _norm_model():
    k = jax.random.split(jax.random.key(4), 2)
    d = Dense(0.5 * jax.random.normal(k[0], (4, 4)), jnp.zeros(4), jnp.tanh)
    stats = jnp.array([0.3, -0.2, 0.1, 0.5])
    n1 = Norm(jnp.ones(4), stats)
    n2 = Norm(1.5 * jnp.ones(4), stats)  # the same buffer at two places: a tie among the rejected
    head = Dense(0.5 * jax.random.normal(k[1], (2, 4)), jnp.zeros(2))
    return Chain(d, n1, d, n2, head)


def _norm_loss(p, stats):
    h = jnp.tanh(X @ p["dw"].T + p["db"])
    h = (h - stats) * p["n1"]
    h = jnp.tanh(h @ p["dw"].T + p["db"])
    h = (h - stats) * p["n2"]
    return jnp.mean((h @ p["hw"].T + p["hb"] - Y) ** 2)


def _norm_dict(m):
    return dict(
        dw=m.layers[0].weight,
        db=m.layers[0].bias,
        n1=m.layers[1].weight,
        n2=m.layers[3].weight,
        hw=m.layers[4].weight,
        hb=m.layers[4].bias,
    )


def test_trainable_keeps_a_running_buffer_fixed_under_adam_for_ten_steps():
    m = _norm_model()
    stats = m.layers[1].running_mean
    not_running = lambda path, x: "running" not in path
    loss = lambda m: jnp.mean((m(X) - Y) ** 2)
    # the buffer would get a gradient if it were trained
    assert float(jnp.abs(jax.grad(_norm_loss, argnums=1)(_norm_dict(m), stats)).sum()) > 1e-3
    g = tied.grad(loss, trainable=not_running)(m)
    assert g.layers[1].running_mean is None and g.layers[3].running_mean is None
    tx = optax.adam(0.05)
    state = tied.optim.setup(tx, m, trainable=not_running)
    assert not any("running" in p for p in state.paths)
    assert len(state.paths) == 6
    # reference: optax by hand on the six trained arrays; the buffer is a constant
    rp = _norm_dict(m)
    rs = tx.init(rp)
    for _ in range(10):
        u, rs = tx.update(jax.grad(_norm_loss)(rp, stats), rs, rp)
        rp = optax.apply_updates(rp, u)
        m, state = tied.optim.update(state, m, tied.grad(loss, trainable=not_running)(m))
        assert m.layers[1].running_mean is stats and m.layers[3].running_mean is stats
        assert m.layers[0] is m.layers[2]
        assert_close(_norm_dict(m), rp)
    # a full gradient (the buffer has one) changes nothing for it either
    m2, _ = tied.optim.update(state, m, tied.grad(loss)(m))
    assert m2.layers[1].running_mean is stats and m2.layers[3].running_mean is stats
    assert all(
        ".running_mean" not in jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(state)
    )


def test_trainable_holds_at_any_place_and_must_return_a_bool():
    w = jnp.array([1.0, -2.0])
    m = {"enc": w, "head": w, "other": jnp.array([0.5])}
    only_head = lambda path, x: path.startswith("['head']")
    state = tied.optim.setup(optax.sgd(1.0), m, trainable=only_head)
    assert state.paths == ("['enc']",)  # w holds at head, so it is trainable; keyed by first place
    g = tied.grad(lambda m: jnp.sum(m["enc"] * m["head"]) + jnp.sum(m["other"]), trainable=only_head)(m)
    assert g["other"] is None and g["enc"] is g["head"]
    np.testing.assert_allclose(g["enc"], 2 * w)
    new, _ = tied.optim.update(state, m, g)
    assert new["enc"] is new["head"] and new["other"] is m["other"]
    np.testing.assert_allclose(new["enc"], w - 2 * w)
    with pytest.raises(TypeError, match=r"^\['enc'\]: trainable\(path, array\) returned ArrayImpl, not a "):
        tied.optim.setup(optax.sgd(1.0), m, trainable=lambda p, x: jnp.all(x > 0))
    with pytest.raises(TypeError, match=r"trainable= takes a function"):
        tied.grad(lambda m: 0.0, trainable=[True])(m)


# ---------------------------------------------------------------- optax masks and labels, by path


def test_masked_weight_decay_by_path_with_adam():
    decay = lambda p: {k: k.endswith("weight") for k in p}
    make_tx = lambda: optax.chain(optax.masked(optax.add_decayed_weights(1e-1), decay), optax.adam(0.05))
    tx, ref_tx = make_tx(), make_tx()
    m = make_model()
    state = tied.optim.setup(tx, m)
    rp = as_dict(m)
    rs = ref_tx.init(rp)
    assert decay(rp) == {W: True, B: False, B2: False, HW: True, HB: False}
    first = True
    for _ in range(3):
        u, rs = ref_tx.update(ref_totals(rp), rs, rp)
        rp = optax.apply_updates(rp, u)
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert_ties(m)
        assert_close(as_dict(m), rp)
        assert_states_close(state.inner_state, rs)
        if first:  # Adam's first moment after one step: decayed by path, weights only
            p0, g0 = as_dict(make_model()), ref_totals(as_dict(make_model()))
            mu = state.inner_state[1][0].mu
            for k, decayed in decay(p0).items():
                want = 0.1 * (g0[k] + 0.1 * p0[k]) if decayed else 0.1 * g0[k]
                np.testing.assert_allclose(mu[k], want, atol=1e-6, err_msg=k)
            first = False


def test_multi_transform_labels_by_path_with_adam_and_weight_decay():
    labels = lambda p: {k: "head" if k.startswith(".layers[3]") else "body" for k in p}
    make_tx = lambda: optax.multi_transform(
        {"body": optax.adamw(0.05, weight_decay=0.1), "head": optax.sgd(0.1, momentum=0.9)}, labels
    )
    tx, ref_tx = make_tx(), make_tx()
    m = make_model()
    state = tied.optim.setup(tx, m)
    rp = as_dict(m)
    rs = ref_tx.init(rp)
    for _ in range(3):
        u, rs = ref_tx.update(ref_totals(rp), rs, rp)
        rp = optax.apply_updates(rp, u)
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert_ties(m)
        assert_close(as_dict(m), rp)
        assert_states_close(state.inner_state, rs)


def test_a_list_mask_in_the_old_style_says_what_optax_sees():
    m = make_model()
    with pytest.raises(ValueError) as e:
        tied.optim.setup(optax.masked(optax.adam(0.1), [True] * 5), m)
    notes = " ".join(getattr(e.value, "__notes__", []))
    assert "optax sees the parameters as a dict from path to array ({'.layers[0].weight'" in notes


def test_inject_hyperparams_rate_is_read_and_set_on_the_inner_state():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    m = make_model()
    state = tied.optim.setup(tx, m)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.01)
    p = as_dict(m)
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    totals = ref_totals(p)
    assert_close(as_dict(m), {k: p[k] - 0.01 * totals[k] for k in NAMES}, atol=1e-6)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.01)
    assert_ties(m)


# ---------------------------------------------------------------- the optax table, jitted


def _table():
    return {
        "sgd": optax.sgd(0.1),
        "momentum": optax.sgd(0.05, momentum=0.9),
        "adam": optax.adam(0.02),
        "adamw": optax.adamw(0.02, weight_decay=1e-3),
        "lion": optax.lion(3e-3),
        "adafactor": optax.adafactor(0.02),
        "chain+clip": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.02)),
        "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=0.02),
        "MultiSteps": optax.MultiSteps(optax.adam(0.02), every_k_schedule=2),
    }


@pytest.mark.parametrize("name", list(_table()))
def test_optax_table_under_tied_jit(name):
    tx = _table()[name]
    traces = []

    @tied.jit
    def step(model, state, x, y):
        traces.append(1)
        loss, g = tied.value_and_grad(loss_fn)(model, x, y)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    m = make_model()
    state = tied.optim.setup(tx, m)
    want = ref_run(tx, 6)
    losses = []
    for i in range(6):
        m, state, loss = step(m, state, X, Y)
        losses.append(float(loss))
        assert_ties(m)
        assert_close(as_dict(m), want[i][0], atol=2e-5)
        assert_states_close(state.inner_state, want[i][1], atol=2e-5)
    assert len(traces) == 1, f"{name} retraced: {len(traces)} traces"
    assert float(loss_fn(m)) < losses[0]


def test_under_jax_jit_with_graph_arguments():
    tx = optax.adam(0.05)
    traces = []

    @jax.jit
    def step(graph, x, y):
        traces.append(1)
        model, state = graph.value
        model, state = tied.optim.update(state, model, tied.grad(loss_fn)(model, x, y))
        return tied.Graph((model, state))

    m = make_model()
    graph = tied.Graph((m, tied.optim.setup(tx, m)))
    want = ref_run(tx, 3)
    for i in range(3):
        graph = step(graph, X, Y)
        m, state = graph.value
        assert_ties(m)
        assert_close(as_dict(m), want[i][0])
        assert_states_close(state.inner_state, want[i][1])
    assert len(traces) == 1
    assert len(jax.tree_util.tree_leaves(graph)) == len(jax.tree_util.tree_leaves(graph.leaves))


def test_optstate_is_a_pytree_keyed_by_parameter_paths(tmp_path):
    m = make_model()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    state = tied.optim.freeze(tied.optim.setup(tx, m), ".layers[3].bias")
    leaves, gdef = tied.flatten(state)
    back = tied.unflatten(gdef, [jnp.asarray(x) + 0 for x in leaves])
    assert type(back) is tied.optim.OptState and back.tx is tx and list(back.frozen) == [HB]
    a = jax.tree_util.tree_leaves(state)
    b = jax.tree_util.tree_leaves(back)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert ".inner_state[1][0].mu['.layers[0].weight']" in paths
    assert ".frozen['.layers[3].bias']" in paths
    # with the model: nothing in the state is a model array
    all_leaves, _ = tied.flatten((m, state))
    assert len(all_leaves) == len(tied.flatten(m)[0]) + len(leaves)
    # it goes through jax.jit as a pytree
    out = jax.jit(lambda s: s)(state)
    assert list(out.frozen) == [HB] and out.tx is tx and out.spec == state.spec
    # checkpoints and summaries show the moments under the parameters' paths
    path = tmp_path / "s.safetensors"
    tied.save(path, (m, state))
    with safe_open(str(path), "numpy") as f:
        keys = set(f.keys())
    assert "[1].inner_state[1][0].mu['.layers[0].weight']" in keys
    assert "[1].inner_state[1][0].nu['.layers[3].bias']" in keys
    assert "mu['.layers[0].weight']" in tied.summary((m, state))


# ---------------------------------------------------------------- update_inplace


def test_update_inplace_keeps_outside_references_current():
    tx = optax.adam(0.05)
    m = make_model()
    d1, d2, head, layers = m.layers[0], m.layers[1], m.layers[3], m.layers
    ids = m.ids
    state = tied.optim.setup(tx, m)
    fm = make_model()  # the functional path, on an equal model
    fstate = tied.optim.setup(tx, fm)
    for want, want_state in ref_run(tx, 3):
        state = tied.optim.update_inplace(state, m, tied.grad(loss_fn)(m))
        fm, fstate = tied.optim.update(fstate, fm, tied.grad(loss_fn)(fm))
        assert m.layers is layers and layers[0] is d1 and layers[2] is d1 and layers[1] is d2
        assert d2.weight is d1.weight and head is m.layers[3] and m.ids is ids
        assert_close(as_dict(m), want)
        assert_states_close(state.inner_state, want_state)
        assert_close(as_dict(m), as_dict(fm), atol=1e-6)


def test_update_inplace_with_dicts_and_dataclasses():
    @dataclasses.dataclass
    class Lin:
        w: Any
        b: Any

    w = jnp.ones((2, 2))
    lin = Lin(w, jnp.zeros(2))
    model = {"a": lin, "b": [w, {"c": w}], "view": tied.transpose(w)}
    state = tied.optim.setup(optax.sgd(1.0), model)
    g = tied.accumulate(model, {"a": Lin(jnp.ones((2, 2)), None), "b": None, "view": None})
    tied.optim.update_inplace(state, model, g)
    new = lin.w
    assert new is not w and model["b"][0] is new and model["b"][1]["c"] is new
    assert model["view"].source is new
    np.testing.assert_allclose(new, jnp.zeros((2, 2)))


@pytest.mark.parametrize(
    "make, path",
    [
        # a tuple held by a mutable container is written as a new tuple; one that is the model is not
        (lambda w: (w, {"ok": [w]}), r"\[0\]"),
        (lambda w: [w, eqx.nn.Linear(2, 2, key=jax.random.key(0))], r"\[1\]\.weight"),
    ],
    ids=["tuple", "equinox"],
)
def test_update_inplace_immutable_place_errors_before_writing(make, path):
    w = jnp.ones((2, 2))
    model = make(w)
    state = tied.optim.setup(optax.sgd(1.0), model)
    g = tied.grad(lambda m: sum(jnp.sum(x) for x in tied.flatten(m)[0]))(model)
    leaves_before = tied.flatten(model)[0]
    with pytest.raises(tied.GraphError, match=path + r": tied\.optim\.update_inplace .*optim\.update"):
        tied.optim.update_inplace(state, model, g)
    assert all(a is b for a, b in zip(tied.flatten(model)[0], leaves_before))


def test_update_inplace_refuses_frozen_dataclass():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        w: Any

    model = [Frozen(jnp.ones(2))]
    state = tied.optim.setup(optax.sgd(1.0), model)
    with pytest.raises(tied.GraphError, match=r"\[0\]\.w: .*frozen dataclass"):
        tied.optim.update_inplace(state, model, [Frozen(jnp.ones(2))])
    new, _ = tied.optim.update(state, model, [Frozen(jnp.ones(2))])
    np.testing.assert_allclose(new[0].w, jnp.zeros(2))


def test_update_inplace_refuses_a_model_that_does_not_line_up_before_writing():
    m = make_model()
    state = tied.optim.setup(optax.sgd(0.1), m)
    other = make_model()
    other.layers[1].weight = jnp.array(other.layers[1].weight)  # a cut tie
    before = tied.flatten(other)[0]
    with pytest.raises(ValueError, match=r"^\.layers\[0\]\.weight: .*a tie was made or cut"):
        tied.optim.update_inplace(state, other, tied.grad(loss_fn)(other))
    assert all(a is b for a, b in zip(tied.flatten(other)[0], before))


class EqxPair(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda v: self.b(jnp.tanh(self.a(v))))(x)


def test_equinox_model_with_a_tied_weight_keeps_it_through_adam():
    ka, kb = jax.random.split(jax.random.key(3))
    a = eqx.nn.Linear(4, 4, key=ka)
    b = eqx.tree_at(lambda lin: lin.weight, eqx.nn.Linear(4, 4, key=kb), a.weight)
    m = EqxPair(a, b)
    assert m.a.weight is m.b.weight
    tx = optax.adam(0.05)
    loss = lambda mm: jnp.mean((mm(X) - 1.0) ** 2)

    def places_loss(wa, ba, wb, bb):
        h = jnp.tanh(X @ wa.T + ba)
        return jnp.mean((h @ wb.T + bb - 1.0) ** 2)

    p = {".a.weight": a.weight, ".a.bias": a.bias, ".b.bias": b.bias}
    rs = tx.init(p)
    state = tied.optim.setup(tx, m)
    assert set(state.paths) == set(p)
    for _ in range(3):
        gwa, gba, gwb, gbb = jax.grad(places_loss, argnums=(0, 1, 2, 3))(
            p[".a.weight"], p[".a.bias"], p[".a.weight"], p[".b.bias"]
        )
        u, rs = tx.update({".a.weight": gwa + gwb, ".a.bias": gba, ".b.bias": gbb}, rs, p)
        p = optax.apply_updates(p, u)
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        assert m.a.weight is m.b.weight
        assert_close({".a.weight": m.a.weight, ".a.bias": m.a.bias, ".b.bias": m.b.bias}, p)
        assert_states_close(state.inner_state, rs)


# ---------------------------------------------------------------- the example


def test_example_optax_by_path():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "optax_by_path.py"
    spec = importlib.util.spec_from_file_location("examples_optax_by_path", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(steps=60, verbose=False)
    assert r["keys"] == [".embed.weight", ".ln.weight", ".ln.bias", ".mlp.weight", ".mlp.bias"]
    assert module.decay_mask(dict.fromkeys(r["keys"])) == {
        ".embed.weight": True,
        ".ln.weight": False,
        ".ln.bias": False,
        ".mlp.weight": True,
        ".mlp.bias": False,
    }
    assert r["tied"] and r["buffer_kept"] and r["frozen_kept"] and r["embed_moved"]
    assert r["loss_after"] < r["loss_before"] / 3
    m, state = r["model"], r["state"]
    assert m.head.weight is m.embed.weight and state.frozen == {}
    assert ".stats" not in state.paths
    mu = state.inner_state[1].inner_states["embed"].inner_state[0].mu
    assert set(mu) == set(r["keys"])


def test_update_keeps_a_static_field_bit_for_bit_whatever_was_seen_before():
    # Finding 5 of the core issue: after {"s": 0.0} had been seen, update turned -0.0 into +0.0.
    w = jnp.ones(2)
    seen = {"w": w, "s": 0.0}
    for _ in range(3):
        tied.unflatten(*reversed(tied.flatten(seen)))
    model = {"w": w, "s": -0.0, 1.0: w}
    state = tied.optim.setup(optax.sgd(0.5), model)
    for _ in range(3):
        g = tied.grad(lambda m: jnp.sum(m["w"] * m[1.0]))(model)
        model, state = tied.optim.update(state, model, g)
        assert np.signbit(model["s"]) and type(model["s"]) is float
        assert [type(k) for k in model] == [str, str, float]
        assert model["w"] is model[1.0]


# ---------------------------------------------------------------- freezing by prefix, node, tied.under


def _dense(seed: int, n_in: int = 3, n_out: int = 3) -> Dense:
    k = jax.random.split(jax.random.key(seed), 2)
    return Dense(
        0.5 * jax.random.normal(k[0], (n_out, n_in)), 0.1 * jax.random.normal(k[1], (n_out,)), jnp.tanh
    )


X3 = jax.random.normal(jax.random.key(7), (5, 3))


def _shared_then_head():
    """Chain(d, d, head): d is one node at .layers[0] and .layers[1]."""
    d, head = _dense(1), _dense(2, 3, 2)
    return Chain(d, d, head), d, head


def _chain_loss(m):
    return jnp.sum(m(X3) ** 2)


def _head_reference(d, head, tx, steps):
    """Adam on the head alone, d fixed: plain jax.grad of the loss written out by hand."""

    def f(hw, hb):
        h = jnp.tanh(jnp.tanh(X3 @ d.weight.T + d.bias) @ d.weight.T + d.bias)
        return jnp.sum(jnp.tanh(h @ hw.T + hb) ** 2)

    p = {"w": head.weight, "b": head.bias}
    s = tx.init(p)
    for _ in range(steps):
        gw, gb = jax.grad(f, argnums=(0, 1))(p["w"], p["b"])
        u, s = tx.update({"w": gw, "b": gb}, s, p)
        p = optax.apply_updates(p, u)
    return p


@pytest.mark.parametrize("where", [".layers[1]", ".layers[0]", ".layers[1].weight+.layers[1].bias", "node"])
def test_freeze_a_whole_shared_layer_by_any_place_or_by_the_node_with_adam(where):
    tx = optax.adam(0.05)
    m, d, head = _shared_then_head()
    state = tied.optim.setup(tx, m)
    if where == "node":
        state = tied.optim.freeze(state, m.layers[1], model=m)
    else:
        state = tied.optim.freeze(state, *where.split("+"))
    assert sorted(state.frozen) == [".layers[0].bias", ".layers[0].weight"]
    cur = m
    for _ in range(3):
        cur, state = tied.optim.update(state, cur, tied.grad(_chain_loss)(cur))
    assert cur.layers[0] is cur.layers[1]
    assert cur.layers[0].weight is d.weight and cur.layers[1].bias is d.bias  # not moved
    want = _head_reference(d, head, tx, 3)
    np.testing.assert_allclose(cur.layers[2].weight, want["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cur.layers[2].bias, want["b"], rtol=1e-5, atol=1e-6)
    thawed = tied.optim.thaw(state, ".layers[1]")
    assert thawed.frozen == {}


def test_freeze_any_place_below_shared_nodes_issue_17_point_10():
    d = _dense(3)
    c = Chain(d, d)
    state = tied.optim.setup(optax.adam(0.1), c)
    assert list(tied.optim.freeze(state, ".layers[1].weight").frozen) == [".layers[0].weight"]
    outer = Chain(c, c)  # d at four places, below two shared nodes
    state = tied.optim.setup(optax.adam(0.1), outer)
    assert list(tied.optim.freeze(state, ".layers[1].layers[1].bias").frozen) == [".layers[0].layers[0].bias"]
    assert len(tied.optim.freeze(state, ".layers[1]").frozen) == 2
    assert (
        list(
            tied.optim.thaw(
                tied.optim.freeze(state, ".layers[0].layers[0].bias"), ".layers[1].layers[1].bias"
            ).frozen
        )
        == []
    )


def test_a_prefix_matches_at_a_segment_boundary_only():
    layers = [_dense(i, 2, 2) for i in range(11)]
    m = {"layers": layers, "enc": _dense(20, 2, 2), "enc1": _dense(21, 2, 2)}
    state = tied.optim.setup(optax.sgd(0.1), m)
    assert sorted(tied.optim.freeze(state, "['layers'][1]").frozen) == [
        "['layers'][1].bias",
        "['layers'][1].weight",
    ]
    assert sorted(tied.optim.freeze(state, "['enc']").frozen) == ["['enc'].bias", "['enc'].weight"]
    assert len(tied.optim.freeze(state, "['layers']").frozen) == 22
    assert len(tied.optim.freeze(state, "<root>").frozen) == 26
    sel = tied.optim.setup(optax.sgd(0.1), m, trainable=tied.under("['layers'][1]", "['enc']"))
    assert sorted(sel.paths) == [
        "['enc'].bias",
        "['enc'].weight",
        "['layers'][1].bias",
        "['layers'][1].weight",
    ]
    with pytest.raises(
        ValueError, match=r"argument 0 \(\"\['enc2'\]\"\) is not a place of a trainable parameter.*Nearest"
    ):
        tied.optim.freeze(state, "['enc2']")


def test_under_as_trainable_in_grad_and_param_count_against_jax_grad():
    m, d, head = _shared_then_head()
    only_d = tied.under(".layers[1]")  # d, through its second place
    g = tied.grad(_chain_loss, trainable=only_d)(m)
    assert g.layers[2].weight is None and g.layers[0].weight is g.layers[1].weight

    def f(w0, b0, w1, b1):  # the two places of d as separate arguments: partials summed by hand
        h = jnp.tanh(jnp.tanh(X3 @ w0.T + b0) @ w1.T + b1)
        return jnp.sum(jnp.tanh(h @ head.weight.T + head.bias) ** 2)

    gw0, _, gw1, _ = jax.grad(f, argnums=(0, 1, 2, 3))(d.weight, d.bias, d.weight, d.bias)
    np.testing.assert_allclose(g.layers[0].weight, gw0 + gw1, rtol=1e-5, atol=1e-6)
    assert tied.param_count(m, trainable=only_d) == 12
    assert tied.under(".a") == tied.under(".a") and repr(tied.under(".a", "[0]")) == "tied.under('.a', '[0]')"
    assert tied.under("<root>")(".x", None) and tied.under("")("", None)
    with pytest.raises(ValueError, match=r"'enc1' is not a keystr path.*'\.enc1'"):
        tied.under("enc1")
    with pytest.raises(TypeError, match=r"a prefix is a keystr path \(a str"):
        tied.under(1)


def test_a_trainable_that_selects_nothing_warns_naming_it():
    m, _, _ = _shared_then_head()
    with pytest.warns(
        UserWarning, match=r"trainable=<function .*selects none of the model's 4 parameters.*'\.value'"
    ):
        tied.optim.setup(optax.adam(0.1), m, trainable=lambda k, x: k.endswith("kernel"))
    with pytest.warns(UserWarning, match=r"trainable=tied\.under\('\.enc1'\) selects none"):
        tied.optim.setup(optax.adam(0.1), m, trainable=tied.under(".enc1"))


def test_freeze_a_node_errors():
    m, d, head = _shared_then_head()
    state = tied.optim.setup(optax.adam(0.1), m)
    with pytest.raises(
        ValueError, match=r"argument 0 is a Dense node, but the optimiser state holds no model.*model=model"
    ):
        tied.optim.freeze(state, head)
    with pytest.raises(
        ValueError, match=r"argument 0 \(a Dense node\) holds no trainable parameter of the model"
    ):
        tied.optim.freeze(state, _dense(9), model=m)
    with pytest.raises(TypeError, match=r"argument 0 is a NoneType"):
        tied.optim.freeze(state, None)


@tied.register
class StatNorm:
    """A parameter and a state cell (running statistics), as in a BatchNorm."""

    def __init__(self, n):
        self.weight = jnp.linspace(0.5, 1.5, n)
        self.running_mean = tied.State(jnp.zeros(n))

    def __call__(self, x):
        self.running_mean.value = 0.9 * self.running_mean.value + 0.1 * x.mean(0)
        return x * self.weight


@pytest.mark.parametrize("inplace", [False, True])
def test_state_is_never_frozen_nor_stepped_with_adam(inplace):
    bn = StatNorm(3)
    m = {"bn": bn, "bn2": bn, "head": _dense(5)}  # the norm at two places
    before = np.asarray(bn.running_mean.value).copy()
    tx = optax.adam(0.1)
    state = tied.optim.setup(tx, m)
    assert all("running_mean" not in p for s in state.spec for p in s.places)
    assert state.paths == ("['bn'].weight", "['head'].weight", "['head'].bias")
    for where in ("['bn'].running_mean.value", "['bn2'].running_mean", "['bn'].running_mean"):
        with pytest.raises(
            ValueError, match=r"selects only state \(\"\['bn'\]\.running_mean\.value\"\).*never trained"
        ):
            tied.optim.freeze(state, where)
    with pytest.raises(ValueError, match=r"argument 0 \(a State node\) selects only state"):
        tied.optim.freeze(state, bn.running_mean, model=m)
    with pytest.raises(ValueError, match=r"argument 0 \(an array of shape \(3,\)\) selects only state"):
        tied.optim.thaw(state, bn.running_mean.value, model=m)
    assert sorted(tied.optim.freeze(state, "['bn2']").frozen) == ["['bn'].weight"]  # the parameter only

    def loss(mod):
        return jnp.sum((mod["head"](X3 * mod["bn"].weight)) ** 2)

    g = tied.grad(loss)(m)
    p = {"w": bn.weight, "hw": m["head"].weight, "hb": m["head"].bias}
    ref = optax.apply_updates(
        p, tx.update({"w": g["bn"].weight, "hw": g["head"].weight, "hb": g["head"].bias}, tx.init(p), p)[0]
    )
    if inplace:
        tied.optim.update_inplace(state, m, g)
        out = m
    else:
        out, _ = tied.optim.update(state, m, g)
    assert out["bn2"] is out["bn"] and out["bn2"].running_mean is out["bn"].running_mean  # one state
    np.testing.assert_array_equal(np.asarray(out["bn"].running_mean.value), before)  # bit for bit
    assert out["bn"].running_mean.value is bn.running_mean.value
    np.testing.assert_allclose(out["bn"].weight, ref["w"], rtol=1e-6)
    np.testing.assert_allclose(out["head"].weight, ref["hw"], rtol=1e-6)


def test_dir_of_tied_optim_shows_public_names_only():
    names = dir(tied.optim)
    assert names == sorted(tied.optim.__all__)
    assert not {"Any", "Callable", "NamedTuple", "jax", "jnp", "optax", "difflib", "annotations"} & set(names)


def _below(path: str, prefix: str) -> bool:
    return path == prefix or (path.startswith(prefix) and path[len(prefix)] in ".[")


@given(models())
def test_freeze_by_any_place_on_random_sharing_patterns(model):
    """Random DAGs: freezing a place (a node's or an array's, through any of its places in the
    unrolled tree) freezes exactly the parameters with a place at or below it, found here by
    walking the unrolled tree with plain prefix tests; tied.under selects the same."""
    first: dict[int, str] = {}
    for path, x in places(model):
        if is_param(x):
            first.setdefault(id(x), path)
    state = tied.optim.setup(optax.adam(0.1), model)
    array_places = [(p, x) for p, x in places(model) if is_param(x)]
    for prefix, _ in list(places(model))[:40]:
        want = sorted({first[id(x)] for p, x in array_places if _below(p, prefix)})
        if not want:
            with pytest.raises(ValueError, match=r"is not a place of a trainable parameter"):
                tied.optim.freeze(state, prefix)
            continue
        assert sorted(tied.optim.freeze(state, prefix).frozen) == want, prefix
        assert sorted(tied.optim.setup(optax.sgd(0.1), model, trainable=tied.under(prefix)).paths) == want


@tied.register
class Cell:
    def __init__(self, w):
        self.w, self.kids, self.parent = w, [], None


def test_freeze_below_a_node_with_a_back_reference_stops_at_the_cycle():
    root, kid = Cell(jnp.ones(2)), Cell(jnp.zeros(2))
    kid.parent = root
    root.kids.append(kid)
    state = tied.optim.setup(optax.adam(0.1), root)
    assert list(tied.optim.freeze(state, ".kids[0].parent.w").frozen) == [".w"]  # the root's, by the cycle
    assert list(tied.optim.freeze(state, ".kids[0]").frozen) == [".kids[0].w"]  # not the parent above it
    assert tied.optim.setup(optax.adam(0.1), root, trainable=tied.under(".kids[0]")).paths == (".kids[0].w",)
    assert sorted(tied.optim.freeze(state, "").frozen) == [".kids[0].w", ".w"]


def test_an_optax_mask_or_label_that_selects_nothing_warns():
    m, _, _ = _shared_then_head()
    kernel = optax.masked(optax.adam(0.1), lambda p: {k: k.endswith("kernel") for k in p})  # NNX's name
    with pytest.warns(UserWarning, match=r"mask or labels at state\[0\] select none of the 4 parameters"):
        tied.optim.setup(optax.chain(kernel, optax.sgd(0.1)), m)
    labels = optax.multi_transform(
        {"fast": optax.adam(0.1), "slow": optax.sgd(0.1, momentum=0.9)}, lambda p: {k: "fast" for k in p}
    )
    with pytest.warns(UserWarning, match=r"at state\.inner_states\['slow'\] select none"):
        tied.optim.setup(labels, m)
    ok = optax.masked(optax.adam(0.1), lambda p: {k: k.endswith("weight") for k in p})
    tied.optim.setup(ok, m)  # selects something: no warning (warnings are errors here)
