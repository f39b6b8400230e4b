"""tied.optim against optax stepped by hand on the unique parameters.

The reference never goes through `tied`: it writes the model's forward pass as a
function of one argument per *place*, takes per-place partials with plain
`jax.grad`, sums them per tied array by hand, and steps a dict of the unique
arrays with the same optax rule.
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
from helpers import Chain, Dense

import tied

NAMES = ("w", "b", "b2", "hw", "hb")


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
    return dict(
        w=m.layers[0].weight,
        b=m.layers[0].bias,
        b2=m.layers[1].bias,
        hw=m.layers[3].weight,
        hb=m.layers[3].bias,
    )


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
    args = (p["w"], p["b"], p["w"], p["b2"], p["w"], p["b"], p["hw"], p["hb"])
    return jax.grad(_loss_places, argnums=tuple(range(8)))(*args, x, y)


def ref_totals(p: dict, x=X, y=Y) -> dict:
    gw0, gb0, gw1, gb2, gw2, gb1, ghw, ghb = ref_partials(p, x, y)
    return dict(w=gw0 + gw1 + gw2, b=gb0 + gb1, b2=gb2, hw=ghw, hb=ghb)


def ref_loss(p: dict, x=X, y=Y):
    return _loss_places(p["w"], p["b"], p["w"], p["b2"], p["w"], p["b"], p["hw"], p["hb"], x, y)


def ref_run(tx, steps: int, p: dict | None = None) -> list[dict]:
    """Optax stepped by hand on the dict of unique parameters with the summed gradient."""
    p = dict(as_dict(make_model())) if p is None else p
    s = tx.init(p)
    out = []
    for _ in range(steps):
        u, s = tx.update(ref_totals(p), s, p)
        p = optax.apply_updates(p, u)
        out.append(p)
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
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=atol, err_msg=k)


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
    assert len(state.params) == len(NAMES)
    for want in ref_run(tx, 10):
        before = as_dict(m)
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert_ties(m, ids)
        assert_close(as_dict(m), want)
        assert all(before[k] is not as_dict(m)[k] for k in NAMES)
    assert ref_loss(as_dict(m)) < ref_loss(as_dict(make_model()))


def test_state_count_is_unique_params_for_adam():
    m = make_model()
    state = tied.optim.setup(optax.adam(1e-2), m)
    adam = state.inner_state[0]
    assert len(adam.mu) == len(adam.nu) == 5  # w has three places, b two: still 5 entries
    assert [x.shape for x in adam.mu] == [as_dict(m)[k].shape for k in NAMES]
    assert all(p is q for p, q in zip(state.params, [as_dict(m)[k] for k in NAMES]))


def test_per_place_stepping_would_be_caught():
    """The reference separates the right step from a per-place Adam step, by a margin."""
    tx = optax.adam(0.05)
    m = make_model()
    p = as_dict(m)
    parts = ref_partials(p)
    per_place = [p["w"], p["b"], p["w"], p["b2"], p["w"], p["b"], p["hw"], p["hb"]]
    u, _ = tx.update(list(parts), tx.init(per_place), per_place)
    naive_w = per_place[0] + u[0] + u[2] + u[4]  # each place's step applied to the tie
    want = ref_run(tx, 1)[0]
    assert float(jnp.max(jnp.abs(naive_w - want["w"]))) > 1e-2
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
        "aliased by hand": (_grad_tree([(tw, tb), (tw, gb2), (tw, tb), (ghw, ghb)]), "auto"),
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
        assert_close(as_dict(m1), want[0])
        # second step with the convention recomputed at the new model: state is right too
        g2, conv2 = conventions(m1)[name]
        m2, _ = tied.optim.update(state, m1, g2, convention=conv2)
        assert_close(as_dict(m2), want[1])


def test_aliased_total_is_never_double_counted():
    """With plain SGD, counting the total once per place would step w by 3x."""
    m = make_model()
    g = tied.grad(loss_fn)(m)
    assert g.layers[0].weight is g.layers[1].weight is g.layers[2].weight
    m1, _ = tied.optim.update(tied.optim.setup(optax.sgd(1.0), m), m, g)
    total = ref_totals(as_dict(m))["w"]
    np.testing.assert_allclose(m1.layers[0].weight, m.layers[0].weight - total, atol=1e-6)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(m1.layers[0].weight, m.layers[0].weight - 3 * total, atol=1e-6)


def test_global_norm_clipping_sees_each_total_once():
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1.0))
    m = make_model()
    p = as_dict(m)
    want = ref_run(tx, 1)[0]
    totals = ref_totals(p)
    assert float(optax.tree.norm(totals)) > 0.05  # clipping is active
    for g, conv in [(tied.grad(loss_fn)(m), "auto"),
                    (tied.grad(loss_fn, per_location=True)(m), "auto")]:
        m1, _ = tied.optim.update(tied.optim.setup(tx, m), m, g, convention=conv)
        assert_close(as_dict(m1), want, atol=1e-6)
    # A per-place norm (each partial once, as plain jax.grad gives) would clip differently.
    per_place_norm = optax.tree.norm(list(ref_partials(p)))
    assert abs(float(per_place_norm) - float(optax.tree.norm(totals))) > 1e-3


def test_shape_mismatch_and_wrong_model_errors():
    m = make_model()
    state = tied.optim.setup(optax.adam(1e-2), m)
    small = tied.optim.setup(optax.adam(1e-2), [m.layers[0], m.layers[3]])
    with pytest.raises(ValueError, match="5 unique trainable arrays.*set up for 4"):
        tied.optim.update(small, m, None)
    other = make_model()
    other.layers[3].weight = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match=r"\.layers\[3\]\.weight: .*shape \(3, 4\).*\(2, 4\)"):
        tied.optim.update(state, other, tied.grad(loss_fn)(m))
    bad = tied.grad(loss_fn)(m)
    bad.layers[3].bias = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"\.layers\[3\]\.bias: the gradient has shape \(3,\)"):
        tied.optim.update(state, m, bad)
    with pytest.raises(tied.GraphError, match=r"<root>: the gradient does not mirror the model"):
        tied.optim.update(state, m, {"layers": 3})


# ---------------------------------------------------------------- None gradients, freezing


def test_none_gradient_on_one_branch_keeps_param_and_state():
    tx = optax.adam(0.05)
    m = make_model()
    state = tied.optim.setup(tx, m)
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    head_mu = [state.inner_state[0].mu[k] for k in (3, 4)]
    g = tied.grad(loss_fn)(m)
    g.layers[3] = None  # no gradient for the head at all
    head = m.layers[3]
    m2, state2 = tied.optim.update(state, m, g)
    assert m2.layers[3].weight is head.weight and m2.layers[3].bias is head.bias
    assert all(a is b for a, b in zip(head_mu, [state2.inner_state[0].mu[k] for k in (3, 4)]))
    # the others take a normal Adam step from the same state: reference by hand
    p = as_dict(m)
    full = ref_totals(p)
    rs = optax.adam(0.05).init({k: p[k] for k in NAMES[:3]})
    rs = rs[0]._replace(
        count=state.inner_state[0].count,
        mu={k: state.inner_state[0].mu[i] for i, k in enumerate(NAMES[:3])},
        nu={k: state.inner_state[0].nu[i] for i, k in enumerate(NAMES[:3])},
    ), rs[1]
    u, _ = tx.update({k: full[k] for k in NAMES[:3]}, rs, {k: p[k] for k in NAMES[:3]})
    assert_close(as_dict(m2), {k: p[k] + u[k] for k in NAMES[:3]})
    assert_ties(m2)


def test_none_at_every_place_of_a_tied_param():
    m = make_model()
    state = tied.optim.setup(optax.sgd(0.1, momentum=0.9), m)
    g = tied.grad(loss_fn)(m)
    w = m.layers[0].weight
    g.layers[0].weight = g.layers[1].weight = None  # every place (layers[2] is layers[0])
    m2, state2 = tied.optim.update(state, m, g)
    assert m2.layers[0].weight is w and m2.layers[1].weight is w
    assert state2.inner_state[0].trace[0] is state.inner_state[0].trace[0]
    assert m2.layers[0].bias is not m.layers[0].bias
    # one present place out of three is the total for that place only: it is used
    g = tied.grad(loss_fn)(m)
    g.layers[1].weight = None
    g.layers[0].weight = g.layers[0].weight * 0 + 1.0
    m3, _ = tied.optim.update(tied.optim.setup(optax.sgd(0.1), m), m, g)
    np.testing.assert_allclose(m3.layers[1].weight, w - 0.1, atol=1e-6)


def test_all_none_gradient_changes_nothing():
    m = make_model()
    state = tied.optim.setup(optax.adam(0.1), m)
    m2, state2 = tied.optim.update(state, m, None)
    assert all(as_dict(m2)[k] is as_dict(m)[k] for k in NAMES)
    assert state2.inner_state is state.inner_state
    assert_ties(m2)


def test_freeze_through_one_place_with_adam_then_thaw():
    tx = optax.adam(0.05)
    m = make_model()
    state = tied.optim.setup(tx, m)
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    w = m.layers[1].weight  # the second place of the weight (d2's), frozen through it
    state = tied.optim.freeze(state, m.layers[1].weight)
    assert state.frozen == (True, False, False, False, False)
    mu_w, nu_w = state.inner_state[0].mu[0], state.inner_state[0].nu[0]
    # the others against optax by hand on the other four, from the same moments
    p = {k: as_dict(m)[k] for k in NAMES[1:]}
    adam = state.inner_state[0]
    rs = (adam._replace(mu={k: adam.mu[i + 1] for i, k in enumerate(NAMES[1:])},
                        nu={k: adam.nu[i + 1] for i, k in enumerate(NAMES[1:])}),
          optax.EmptyState())
    for _ in range(3):
        full = ref_totals({**p, "w": w})
        u, rs = tx.update({k: full[k] for k in NAMES[1:]}, rs, p)
        p = optax.apply_updates(p, u)
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        assert m.layers[0].weight is w and m.layers[2].weight is w and m.layers[1].weight is w
        assert state.inner_state[0].mu[0] is mu_w and state.inner_state[0].nu[0] is nu_w
        assert_close({k: as_dict(m)[k] for k in NAMES[1:]}, p)
        assert_ties(m)
    # thaw through another place: Adam resumes from the kept moments
    state = tied.optim.thaw(state, m.layers[0].weight)
    assert state.frozen == (False,) * 5
    g_w = ref_totals(as_dict(m))["w"]
    m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
    np.testing.assert_allclose(state.inner_state[0].mu[0], 0.9 * mu_w + 0.1 * g_w, atol=1e-6)
    assert m.layers[0].weight is not w
    assert_ties(m)


def test_freeze_by_view_and_errors():
    enc = Dense(jnp.ones((3, 2)), jnp.zeros(3), jnp.tanh)
    dec = Dense(tied.transpose(enc.weight), jnp.zeros(2))
    m = Chain(enc, dec)
    state = tied.optim.setup(optax.sgd(0.1), m)
    assert len(state.params) == 3  # enc.weight, enc.bias, dec.bias: the view is no parameter
    frozen = tied.optim.freeze(state, dec.weight)  # a View: freezes its source
    assert frozen.frozen == (True, False, False)
    assert state.frozen == (False,) * 3  # functional
    x = jnp.ones((2, 2))
    m2, _ = tied.optim.update(frozen, m, tied.grad(lambda m: m(x).sum())(m))
    assert m2.layers[0].weight is enc.weight and m2.layers[1].weight.source is enc.weight
    m3, _ = tied.optim.update(state, m, tied.grad(lambda m: m(x).sum())(m))
    assert m3.layers[1].weight.source is m3.layers[0].weight
    assert m3.layers[0].weight is not enc.weight
    with pytest.raises(ValueError, match=r"freeze: argument 0 \(ArrayImpl of shape \(3, 2\).*identity"):
        tied.optim.freeze(state, jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"thaw: argument 1 .*model=model"):
        tied.optim.thaw(state, enc.bias, jnp.arange(2))
    # with model=: looked up in the model (e.g. after plain jax.jit made new arrays)
    leaves, gdef = tied.flatten(m)
    copy = tied.unflatten(gdef, [jnp.array(a) for a in leaves])
    assert tied.optim.freeze(state, copy.layers[0].bias, model=copy).frozen == (False, True, False)


# ---------------------------------------------------------------- masked and multi_transform


def test_masked_and_multi_transform_take_lists_in_params_order():
    m = make_model()
    ps = tied.params(m)
    names = [k for p in ps for k in NAMES if as_dict(m)[k] is p]
    assert names == list(NAMES)
    mask = [p.ndim > 1 for p in ps]
    tx = optax.masked(optax.adam(0.05), mask)
    m1, _ = tied.optim.update(tied.optim.setup(tx, m), m, tied.grad(loss_fn)(m))
    p = as_dict(m)
    ref_tx = optax.masked(optax.adam(0.05), {k: p[k].ndim > 1 for k in NAMES})
    u, _ = ref_tx.update(ref_totals(p), ref_tx.init(p), p)
    assert_close(as_dict(m1), optax.apply_updates(p, u))
    assert m1.layers[0].bias is not p["b"]  # masked-out: optax passes the raw gradient through

    labels = ["decay" if p.ndim > 1 else "plain" for p in ps]
    tx = optax.multi_transform(
        {"decay": optax.adamw(0.05, weight_decay=0.1), "plain": optax.sgd(0.1, momentum=0.9)},
        labels,
    )
    ref_tx = optax.multi_transform(
        {"decay": optax.adamw(0.05, weight_decay=0.1), "plain": optax.sgd(0.1, momentum=0.9)},
        {k: "decay" if p[k].ndim > 1 else "plain" for k in NAMES},
    )
    state, rp, rs = tied.optim.setup(tx, m), p, ref_tx.init(p)
    for _ in range(3):
        m, state = tied.optim.update(state, m, tied.grad(loss_fn)(m))
        u, rs = ref_tx.update(ref_totals(rp), rs, rp)
        rp = optax.apply_updates(rp, u)
        assert_close(as_dict(m), rp)
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
        # one buffer for the model's array and the state's reference to it
        assert all(a is b for a, b in zip(state.params, [as_dict(m)[k] for k in NAMES]))
        assert_close(as_dict(m), want[i], atol=2e-5)
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
        assert state.params[0] is m.layers[0].weight
        assert_close(as_dict(m), want[i])
    assert len(traces) == 1
    assert len(jax.tree_util.tree_leaves(graph)) == len(jax.tree_util.tree_leaves(graph.leaves))


def test_optstate_is_a_pytree_and_round_trips_through_flatten():
    m = make_model()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    state = tied.optim.freeze(tied.optim.setup(tx, m), m.layers[3].bias)
    leaves, gdef = tied.flatten(state)
    back = tied.unflatten(gdef, [jnp.asarray(x) + 0 for x in leaves])
    assert type(back) is tied.optim.OptState and back.tx is tx and back.frozen == state.frozen
    a = jax.tree_util.tree_leaves(state)
    b = jax.tree_util.tree_leaves(back)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert ".params[0]" in paths and any(p.startswith(".inner_state") for p in paths)
    # with the model: the state's params are the model's arrays, stored once
    all_leaves, _ = tied.flatten((m, state))
    assert len(all_leaves) == len(tied.flatten(m)[0]) + len(tied.flatten(state.inner_state)[0])
    # and it goes through jax.jit as a pytree
    out = jax.jit(lambda s: s)(state)
    assert out.frozen == state.frozen and out.tx is tx


# ---------------------------------------------------------------- update_inplace


def test_update_inplace_keeps_outside_references_current():
    tx = optax.adam(0.05)
    m = make_model()
    d1, d2, head, layers = m.layers[0], m.layers[1], m.layers[3], m.layers
    ids = m.ids
    state = tied.optim.setup(tx, m)
    fm = make_model()  # the functional path, on an equal model
    fstate = tied.optim.setup(tx, fm)
    for want in ref_run(tx, 3):
        state = tied.optim.update_inplace(state, m, tied.grad(loss_fn)(m))
        fm, fstate = tied.optim.update(fstate, fm, tied.grad(loss_fn)(fm))
        assert m.layers is layers and layers[0] is d1 and layers[2] is d1 and layers[1] is d2
        assert d2.weight is d1.weight and head is m.layers[3]
        assert state.params[0] is d1.weight and m.ids is ids
        assert_close(as_dict(m), want)
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
        (lambda w: {"ok": [w], "pair": (w, jnp.zeros(2))}, r"\['pair'\]\[0\]"),
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

    p = {"w": a.weight, "ba": a.bias, "bb": b.bias}
    rs = tx.init(p)
    state = tied.optim.setup(tx, m)
    assert len(state.params) == 3
    for _ in range(3):
        gwa, gba, gwb, gbb = jax.grad(places_loss, argnums=(0, 1, 2, 3))(p["w"], p["ba"], p["w"], p["bb"])
        u, rs = tx.update({"w": gwa + gwb, "ba": gba, "bb": gbb}, rs, p)
        p = optax.apply_updates(p, u)
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        assert m.a.weight is m.b.weight
        assert_close({"w": m.a.weight, "ba": m.a.bias, "bb": m.b.bias}, p)
