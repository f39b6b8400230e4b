"""Adversarial review of issue 37's sharding (plain `tied.jit` keeping an argument's shardings):
8 fake CPU devices, in a process of their own.

Run by tests/transforms/test_sharding_review.py. Every expected sharding is the one placed by
hand here; every expected value is numpy or the same function under `jax.jit`.
"""

import eight_devices  # noqa: F401  (first: 8 fake CPU devices, set before JAX is imported)

# isort: split

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tied

MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def S(*spec):
    return NamedSharding(MESH, P(*spec))


def params(k):
    return {"w": jnp.arange(32.0).reshape(8, 4) * k, "b": jnp.arange(8.0) * k}


def update(p, k):
    return {"w": p["w"] * k + 1, "b": p["b"] * k + 1}


def placed_as(tree, want):
    """Whether each array of ``tree`` is sharded as ``want`` (a dict of specs) says."""
    return all(x.sharding.is_equivalent_to(S(*want[name]), x.ndim) for name, x in tree.items())


def test_two_arguments_of_one_structure_each_keep_their_own_shardings():
    """A model and its EMA copy: one structure, placed two ways; each updated copy must come
    back as its own argument was placed (it came back with the first argument's)."""
    a = tied.device_put(params(1), {"w": S("model", None), "b": S("model")})
    b = tied.device_put(params(2), {"w": S(None, "model"), "b": S()})
    na, nb = tied.jit(lambda a, b: (update(a, 2), update(b, 3)))(a, b)
    assert placed_as(na, {"w": ("model", None), "b": ("model",)})
    assert placed_as(nb, {"w": (None, "model"), "b": ()})
    np.testing.assert_array_equal(np.asarray(nb["w"]), np.arange(32.0).reshape(8, 4) * 6 + 1)


def test_a_replaced_input_gets_its_new_shardings_back():
    """The same function called again with the same shapes placed otherwise: JAX reuses the
    trace, so the shardings of the first call were baked into the second call's outputs."""
    f = tied.jit(lambda p: update(p, 2))
    first = f(tied.device_put(params(1), {"w": S("model", None), "b": S("model")}))
    assert placed_as(first, {"w": ("model", None), "b": ("model",)})
    again = f(tied.device_put(params(1), {"w": S(None, "model"), "b": S("data")}))
    assert placed_as(again, {"w": (None, "model"), "b": ("data",)})
    np.testing.assert_array_equal(np.asarray(again["b"]), np.arange(8.0) * 2 + 1)
    # Called again as first placed: no new compile.
    f(tied.device_put(params(1), {"w": S("model", None), "b": S("model")}))
    assert f.cache_size() == 2


def test_a_state_beside_two_models_of_one_structure_sharded_otherwise_is_refused():
    """(g, d, state_g, state_d) with g and d of one structure: state_d's moments took g's
    sharding, silently; now the ambiguity is an error, and ((g, sg), (d, sd)) pairs them."""
    g, d = {"w": jnp.ones((8, 8))}, {"w": jnp.ones((8, 8))}
    sg, sd = (tied.optim.setup(optax.adam(1e-3), m) for m in (g, d))
    rules = [(r"^\[0\](\[0\])?\['w'\]", P("model", None)), (r"^\[1\](\[0\])?\['w'\]", P(None, "model"))]
    with pytest.raises(
        ValueError,
        match=r"the optimiser state's \[2\]\.inner_state\[0\]\.mu\[\"\['w'\]\"\] may follow \[0\]\['w'\] or "
        r"\[1\]\['w'\].*Pass each model beside its own state",
    ):
        tied.sharding_tree((g, d, sg, sd), rules, mesh=MESH)
    (_, ssg), (_, ssd) = tied.sharding_tree(((g, sg), (d, sd)), rules, mesh=MESH)
    assert ssg.inner_state[0].mu["['w']"].is_equivalent_to(S("model", None), 2)
    assert ssd.inner_state[0].nu["['w']"].is_equivalent_to(S(None, "model"), 2)
    # A model and its EMA copy sharded alike: no ambiguity.
    same = [(r"\['w'\]", P("model", None))]
    _, _, ss = tied.sharding_tree((g, d, sg), same, mesh=MESH)
    assert ss.inner_state[0].mu["['w']"].is_equivalent_to(S("model", None), 2)


def _unit_rows(h, s):
    """A stage undefined at zero (a row divided by its norm), as a norm without eps is."""
    return jnp.tanh(h @ s["w"]) / jnp.linalg.norm(h, axis=-1, keepdims=True) + 1.0


@pytest.mark.parametrize("microbatches", [1, 2])
def test_pipeline_gradients_of_a_stage_undefined_at_zero_equal_the_unrolled_loop(microbatches):
    """The devices waiting in the bubble ran their stage on zeros: the dropped output's
    gradient was 0 * inf = NaN, where the sequential run is finite."""
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(3, 3)).astype(np.float32) for _ in range(4)]
    x = jnp.asarray(rng.normal(size=(4, 3)) + 3, jnp.float32)

    def unrolled(ws):  # plain JAX, one device
        h = x
        for w in ws:
            h = _unit_rows(h, {"w": w})
        return jnp.sum(h**2)

    want_loss, want = jax.value_and_grad(unrolled)([jnp.asarray(w) for w in ws])
    mesh = Mesh(np.array(jax.devices()[:4]), ("stage",))
    stages = tied.stack([{"w": jnp.asarray(w)} for w in ws])

    def loss(st):
        out = tied.pipeline(_unit_rows, x, st, mesh=mesh, axis="stage", microbatches=microbatches)
        return jnp.sum(out**2)

    got_loss, got = tied.value_and_grad(loss)(stages)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.member["w"]), np.stack(want), rtol=1e-5, atol=1e-6)


def test_a_parameters_rule_that_does_not_fit_its_states_other_arrays_replicates_them():
    """Rules match the state's paths too (they hold the parameter's path): Adafactor's factored
    rows and a count under a prefix rule were refused with a rank error naming the state."""
    model = {"a": {"w": jnp.ones((8, 8))}, "c": jnp.ones((8,))}
    state = tied.optim.setup(optax.adafactor(1e-3, min_dim_size_to_factor=4), model)
    rules = [(r"^\[0\]\['a'\]|\['a'\]\['w'\]", P("model", None)), (r"\['c'\]", P("model"))]
    ms, ss = tied.sharding_tree((model, state), rules, mesh=MESH)
    fac = ss.inner_state[0]
    assert fac.v_row["['a']['w']"].is_equivalent_to(S(), 1)  # (8,): the rule's 2 entries do not fit
    assert fac.v["['c']"].is_equivalent_to(S("model"), 1)  # shaped like its parameter: follows it
    assert ms["a"]["w"].is_equivalent_to(S("model", None), 2)
    # A prefix rule over the whole (model, state) pair: the count is replicated, the moments follow.
    w = {"w": jnp.ones((8, 8))}
    _, ss = tied.sharding_tree(
        (w, tied.optim.setup(optax.adam(1e-3), w)), [("", P("model", None))], mesh=MESH
    )
    assert ss.inner_state[0].count.is_equivalent_to(S(), 0)
    assert ss.inner_state[0].mu["['w']"].is_equivalent_to(S("model", None), 2)
