"""State is shared by cell, never by the array a cell holds (issue 27, points 1 to 8).

`tied.State(x)` keeps the caller's array, so two cells may hold one array. They are two
states: written apart under `tied.jit`, inside `tied.grad`'s loss and eagerly alike, never a
tie. One cell at two places is one state. Every test runs the same code eagerly on a
separately built copy of the model (eager Python is the reference) and compares values; a
checkpoint is compared with the values saved, restored into a freshly built model.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tied


def bump(cell, by=1):
    cell.value = cell.value + jnp.asarray(by, cell.value.dtype)


# ---------------------------------------------------------------- point 1: two cells, one array


def two_cells(dtype=jnp.float32):
    z = jnp.zeros((), dtype)
    return {"w": jnp.ones(3), "cells": [tied.State(z), tied.State(z)]}


def bump_first(m):
    bump(m["cells"][0])
    return (m["w"] ** 2).sum()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_two_cells_given_one_array_are_written_apart_under_jit(dtype):
    eager, jitted = two_cells(dtype), two_cells(dtype)
    for _ in range(2):
        bump_first(eager)
        tied.jit(bump_first)(jitted)
    assert [int(c.value) for c in eager["cells"]] == [2, 0]  # eager Python, the reference
    assert [int(c.value) for c in jitted["cells"]] == [2, 0]
    assert jitted["cells"][0] is not jitted["cells"][1]


def test_two_cells_given_one_array_are_written_apart_inside_grad():
    eager, model = two_cells(), two_cells()
    bump_first(eager)
    g = tied.grad(bump_first)(model)
    assert [float(c.value) for c in model["cells"]] == [float(c.value) for c in eager["cells"]] == [1.0, 0.0]
    np.testing.assert_allclose(g["w"], 2 * np.ones(3))  # d/dw sum(w**2), by hand
    assert g["cells"][0].value is None and g["cells"][1].value is None


def test_one_cell_at_two_places_is_one_state():
    def build():
        c = tied.State(jnp.zeros(()))
        return {"a": c, "b": [c]}

    def f(m):
        bump(m["a"])
        bump(m["b"][0])

    eager, jitted, graded = build(), build(), build()
    f(eager)
    tied.jit(f)(jitted)
    tied.grad(lambda m: (f(m), jnp.zeros(()))[1])(graded)
    for m in (eager, jitted, graded):
        assert m["a"] is m["b"][0]
        assert float(m["a"].value) == 2.0
    assert tied.ties(jitted) == [("['a']", "['b'][0]")]


def test_ties_report_no_tie_between_cells_given_one_array():
    z = jnp.zeros(2)
    model = {"p": tied.State(z), "q": tied.State(z)}
    assert tied.ties(model) == []
    leaves, _ = tied.flatten(model)
    assert len(leaves) == 2 and leaves[0] is leaves[1] is z  # two states, one object


# ---------------------------------------------------------------- point 2: two BatchNorms reset with one z


def two_batchnorms():
    return tied.nn.Chain(
        tied.nn.BatchNorm(3), tied.nn.Dense(3, 3, key=jax.random.key(0)), tied.nn.BatchNorm(3)
    )


def reset(model):
    z = jnp.zeros(3)
    for bn in (model.layers[0], model.layers[2]):
        bn.running_mean.value = z
        bn.running_var.value = z


X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [0.0, 1.0, 1.0]])


def step(model, x):
    return tied.value_and_grad(lambda m: (m(x) ** 2).sum())(model)


def test_batchnorms_reset_with_one_array_train_under_jit_as_eagerly():
    eager, jitted = two_batchnorms(), two_batchnorms()
    reset(eager)
    reset(jitted)
    jstep = tied.jit(step)
    for _ in range(2):
        le, ge = step(eager, X)
        lj, gj = jstep(jitted, X)
        np.testing.assert_allclose(lj, le, rtol=1e-5)
        np.testing.assert_allclose(gj.layers[1].weight, ge.layers[1].weight, rtol=1e-4, atol=1e-5)
    for i in (0, 2):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            np.testing.assert_allclose(
                getattr(jitted.layers[i], name).value, getattr(eager.layers[i], name).value, rtol=1e-5
            )
    # the two BatchNorms saw different batches: their statistics differ
    assert not np.allclose(jitted.layers[0].running_mean.value, jitted.layers[2].running_mean.value)


# ---------------------------------------------------------------- point 3: no dependence on the dtype


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.bfloat16])
def test_cells_given_one_array_inside_jit_do_not_depend_on_the_dtype(dtype):
    def f(a, b):
        z = jnp.zeros((), dtype)
        a.value = z
        b.value = z

    def build():
        return tied.State(jnp.ones((), dtype)), tied.State(jnp.ones((), dtype))

    ea, eb = build()
    f(ea, eb)
    ja, jb = build()
    tied.jit(f)(ja, jb)
    tied.jit(lambda a: bump(a))(ja)  # written apart afterwards too
    bump(ea)
    assert (float(ja.value), float(jb.value)) == (float(ea.value), float(eb.value)) == (1.0, 0.0)


# ---------------------------------------------------------------- point 4: checkpoints


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_checkpoint_after_a_reset_with_one_array_restores_into_a_fresh_model(tmp_path, fmt):
    model = two_batchnorms()
    reset(model)
    tied.jit(step)(model, X)
    assert tied.ties(model) == []  # no tie between the two BatchNorms
    path = tmp_path / ("ckpt.safetensors" if fmt == "safetensors" else "ckpt")
    tied.save(path, model, format=fmt)
    restored = tied.load(path, like=two_batchnorms())
    for i in (0, 2):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            np.testing.assert_array_equal(
                getattr(restored.layers[i], name).value, getattr(model.layers[i], name).value
            )
    np.testing.assert_array_equal(restored.layers[1].weight, model.layers[1].weight)


def test_checkpoint_of_cells_given_one_array_before_any_write(tmp_path):
    model = two_batchnorms()
    reset(model)  # the two BatchNorms hold the very same arrays
    tied.save(tmp_path / "c.safetensors", model)
    restored = tied.load(tmp_path / "c.safetensors", like=two_batchnorms())
    assert restored.layers[0].running_mean is not restored.layers[2].running_mean
    np.testing.assert_array_equal(restored.layers[2].running_var.value, np.zeros(3))


# ---- point 5: an array below a cell and at a parameter place


def test_an_array_below_a_cell_and_at_a_parameter_place_is_refused_alike():
    w = jnp.ones(3)
    model = {"w": w, "ema": tied.State(w)}
    with pytest.raises(tied.GraphError) as by_grad:
        tied.grad(lambda m: m["w"].sum())(model)
    with pytest.raises(tied.GraphError) as by_jit:
        tied.jit(lambda m: m["w"].sum())(model)
    both = "one array is both a parameter place and a state place"
    assert both in str(by_grad.value) and both in str(by_jit.value)
    assert str(by_grad.value).startswith("['w'] and ['ema'].value: ")
    assert str(by_jit.value).startswith("args[0]['w'] and args[0]['ema'].value: ")
    assert str(by_jit.value).replace("args[0]", "") == str(by_grad.value)
    assert model["ema"].value is w  # nothing changed


def test_an_array_below_a_cell_and_at_a_parameter_place_is_refused_in_either_order():
    w = jnp.ones(3)
    with pytest.raises(tied.GraphError, match=r"\['b'\] and \['a'\].value: one array is both"):
        tied.flatten({"a": tied.State(w), "b": w})


def test_a_node_below_a_cell_and_outside_every_cell_is_refused():
    layer = {"w": jnp.ones(2)}

    @tied.register_state
    class Holder:
        def __init__(self, v):
            self.value = v

    with pytest.raises(tied.GraphError, match="one array is both a parameter place and a state place"):
        tied.grad(lambda m: m["layer"]["w"].sum())({"layer": layer, "cell": Holder(layer)})


# ---------------------------------------------------------------- point 6: static arguments


@tied.register
class Net:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = tied.State(jnp.zeros((), jnp.int32))


def test_state_written_through_a_static_argument_is_refused_and_left_as_it_was():
    net = Net()
    before = net.count.value

    def f(m, x):
        bump(m.count)
        return x * m.w

    with pytest.raises(tied.GraphError, match=r"args\[0\]\.count\.value: .*static_argnums") as e:
        tied.jit(f, static_argnums=0)(net, jnp.ones(2))
    assert "as a traced one" in str(e.value)
    assert net.count.value is before  # never a tracer left in the caller's object
    assert not isinstance(net.count.value, jax.core.Tracer)
    # passed as a traced argument, the same function writes back as eagerly
    tied.jit(f)(net, jnp.ones(2))
    assert int(net.count.value) == 1


def test_a_static_argument_given_a_new_attribute_is_refused():
    net = Net()

    def f(m, x):
        m.cache = x * 2  # a traced value put into the caller's object
        return x

    with pytest.raises(tied.GraphError, match=r"args\[0\]\.cache: a place was added .*static_argnums"):
        tied.jit(f, static_argnums=0)(net, jnp.ones(2))


def test_a_static_argument_only_read_is_fine():
    net = Net()
    out = tied.jit(lambda m, x: x * m.w, static_argnums=0)(net, jnp.full(2, 3.0))
    np.testing.assert_array_equal(out, np.full(2, 3.0))


def test_state_written_through_a_static_keyword_argument_is_refused():
    net = Net()
    before = net.count.value

    def f(x, **kw):
        bump(kw["m"].count)
        return x

    with pytest.raises(tied.GraphError, match=r"kwargs\['m'\]\.count\.value"):
        tied.jit(f, static_argnames="m")(jnp.ones(2), m=net)
    assert net.count.value is before


# ---- points 7 and 8: every state cell class alike


@tied.register_state
class Stats:
    def __init__(self):
        self.value = {"m": jnp.zeros(2), "n": jnp.zeros((), jnp.int32)}


@tied.register
class MyState(tied.State):
    pass


@tied.register_state
@dataclasses.dataclass
class SlotStats:
    __slots__ = ("value",)
    value: tuple


def new_value(v):
    return {"m": v["m"] + 1.0, "n": v["n"] + 1}


@pytest.mark.parametrize("make", [Stats, lambda: MyState({"m": jnp.zeros(2), "n": jnp.zeros((), jnp.int32)})])
def test_a_cell_holding_a_dict_gets_a_new_dict_under_jit_as_eagerly(make):
    def f(s):
        s.value = new_value(s.value)

    eager, jitted = make(), make()
    old_eager, old_jitted = eager.value, jitted.value
    f(eager)
    tied.jit(f)(jitted)
    for m, old in ((eager, old_eager), (jitted, old_jitted)):
        np.testing.assert_array_equal(old["m"], np.zeros(2))  # the old dict is as it was
        assert int(old["n"]) == 0
        assert m.value is not old
        np.testing.assert_array_equal(m.value["m"], np.ones(2))
        assert int(m.value["n"]) == 1


@pytest.mark.parametrize(
    "make", [lambda: MyState((jnp.zeros(2), jnp.ones(2))), lambda: SlotStats((jnp.zeros(2), jnp.ones(2)))]
)
def test_a_cell_class_holding_a_tuple_is_written_as_state_is(make):
    def f(s):
        s.value = (s.value[0] + 1.0, s.value[1])

    eager, jitted, graded = make(), make(), make()
    f(eager)
    tied.jit(f)(jitted)
    tied.grad(lambda s: (f(s), jnp.zeros(()))[1])(graded)
    for m in (jitted, graded):
        assert type(m.value) is tuple
        for a, b in zip(m.value, eager.value):
            np.testing.assert_array_equal(a, b)


def test_a_container_shared_by_two_cells_is_refused_when_written_not_cut():
    shared = {"m": jnp.zeros(2)}
    a, b = Stats(), Stats()
    a.value = b.value = shared

    def f(a, b):
        a.value["m"] = a.value["m"] + 1.0

    with pytest.raises(tied.GraphError, match="also held at another place"):
        tied.jit(f)(a, b)
    assert a.value is b.value is shared
    np.testing.assert_array_equal(shared["m"], np.zeros(2))


# ---- downstream of two leaves that are one object


def test_donating_cells_given_one_array_donates_each_buffer_once():
    def build():
        z = jnp.zeros(3)
        return [tied.State(z), tied.State(z)]

    def f(c, x):
        c[0].value = c[0].value + x
        return x * 2

    eager, jitted = build(), build()
    g = tied.jit(f, donate_argnums=0)
    for _ in range(3):
        f(eager, jnp.ones(3))
        g(jitted, jnp.ones(3))
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(a.value, b.value)
    np.testing.assert_array_equal(jitted[1].value, np.zeros(3))


def test_optimiser_never_steps_cells_given_one_array_and_map_sees_two_states():
    model = two_cells()
    state = tied.optim.setup(optax.adam(0.1), model)
    g = tied.grad(lambda m: (m["w"] ** 2).sum())(model)
    new, _ = tied.optim.update(state, model, g)
    assert (
        new["cells"][0].value is model["cells"][0].value and new["cells"][1].value is model["cells"][1].value
    )
    bumped = tied.map(lambda x: x + 1, model, only="state")
    assert bumped["cells"][0] is not bumped["cells"][1]
    assert [float(c.value) for c in bumped["cells"]] == [1.0, 1.0]
    assert bumped["cells"][0].value is not bumped["cells"][1].value  # two states, each its own
    g = tied.Graph(model)
    out = jax.jit(lambda g: g)(g).value
    assert out["cells"][0] is not out["cells"][1]


# ---------------------------------------------------------------- random models


@tied.register
class Model:
    def __init__(self, w, places):
        self.w, self.places = w, places


def build_random(recipe):
    """``recipe``: (dtype of each array, which array each cell holds, which cell each place holds)."""
    dtypes, holds, at = recipe
    arrays = [jnp.full((2,), k + 1, dt) for k, dt in enumerate(dtypes)]
    cells = [tied.State(arrays[a]) for a in holds]
    return Model(jnp.arange(1.0, 3.0), [cells[c] for c in at])


def run_writes(m, writes):
    """The writes, then a loss of the parameter and the state (state is a constant)."""
    for p, by in writes:
        bump(m.places[p], by)
    s = sum(c.value.astype(jnp.float32).sum() for c in m.places)
    return (m.w * jax.lax.stop_gradient(s)).sum() + (m.w**2).sum()


@st.composite
def recipes(draw):
    n_arrays = draw(st.integers(1, 3))
    dtypes = [draw(st.sampled_from([jnp.float32, jnp.int32])) for _ in range(n_arrays)]
    holds = draw(st.lists(st.integers(0, n_arrays - 1), min_size=1, max_size=4))
    at = draw(st.lists(st.integers(0, len(holds) - 1), min_size=1, max_size=6))
    writes = draw(st.lists(st.tuples(st.integers(0, len(at) - 1), st.integers(1, 3)), max_size=5))
    return (dtypes, holds, at), writes


def assert_same_state(m, ref):
    assert len(m.places) == len(ref.places)
    for a, b in zip(m.places, ref.places):
        assert a.value.dtype == b.value.dtype
        np.testing.assert_array_equal(a.value, b.value)
    # the same cells at the same places: one cell at two places stays one object
    ids_m = [next(k for k, c in enumerate(m.places) if c is a) for a in m.places]
    ids_r = [next(k for k, c in enumerate(ref.places) if c is a) for a in ref.places]
    assert ids_m == ids_r


@settings(max_examples=25, deadline=None)
@given(recipes(), st.sampled_from(["jit", "grad", "eager"]))
def test_random_cells_written_under_jit_and_grad_as_eagerly_and_checkpointed(tmp_path_factory, case, how):
    recipe, writes = case
    ref = build_random(recipe)
    loss_ref = run_writes(ref, writes)  # eager: the reference
    s_ref = sum(c.value.astype(jnp.float32).sum() for c in ref.places)
    model = build_random(recipe)
    if how == "jit":
        loss = tied.jit(run_writes, static_argnums=1)(model, tuple(writes))
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    elif how == "grad":
        g = tied.grad(run_writes)(model, writes)
        np.testing.assert_allclose(g.w, s_ref + 2 * np.arange(1.0, 3.0), rtol=1e-6)  # by hand
    else:
        run_writes(model, writes)
    assert_same_state(model, ref)
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    tied.save(path, model)
    restored = tied.load(path, like=build_random(recipe))
    assert_same_state(restored, ref)
    np.testing.assert_array_equal(restored.w, model.w)


# ---- compiled plans (checked against the walk under TIED_CHECK_PLANS=1, as the suite sets)


def test_repeated_jitted_writes_to_cells_given_one_array_match_eager():
    eager, jitted = two_cells(jnp.int32), two_cells(jnp.int32)
    f = tied.jit(bump_first)
    for _ in range(5):  # the walk (recording the places), then the compiled write-back
        bump_first(eager)
        f(jitted)
    assert [int(c.value) for c in jitted["cells"]] == [int(c.value) for c in eager["cells"]] == [5, 0]


def layers(n, z):
    return [{"w": jnp.full((2,), float(k)), "s": tied.State(z)} for k in range(n)]


def test_plans_over_many_cells_given_one_array_follow_the_walk():
    z = jnp.zeros(())
    model = layers(300, z)  # over a thousand places: read in loops
    for _ in range(3):
        leaves, gdef = tied.flatten(model)
        assert len(leaves) == 600 and tied.ties(model) == []
    model[7]["s"] = model[6]["s"]  # one cell at two places now: a tie, which the plan must see
    leaves, gdef = tied.flatten(model)
    assert len(leaves) == 599
    assert tied.ties(model) == [("[6]['s']", "[7]['s']")]
    model[7]["s"] = tied.State(model[7]["w"])  # an array both below a cell and a parameter
    with pytest.raises(tied.GraphError, match=r"\[7\]\['w'\] and \[7\]\['s'\]\.value: one array is both"):
        tied.flatten(model)


def test_jitted_writes_over_many_cells_given_one_array_match_eager():
    def f(m):
        for layer in m[::3]:
            bump(layer["s"])

    z = jnp.zeros(())
    eager, jitted = layers(300, z), layers(300, z)
    g = tied.jit(f)
    for _ in range(3):
        f(eager)
        g(jitted)
    for a, b in zip(jitted, eager):
        assert float(a["s"].value) == float(b["s"].value)
    assert float(jitted[0]["s"].value) == 3.0 and float(jitted[1]["s"].value) == 0.0


def test_a_plan_of_two_cells_misses_when_one_cell_stands_at_both_places():
    model = {"a": tied.State(jnp.zeros(2)), "b": tied.State(jnp.ones(2))}
    for _ in range(3):  # a compiled plan from the second flatten on
        assert len(tied.flatten(model)[0]) == 2
    model["b"] = model["a"]
    leaves, _ = tied.flatten(model)
    assert len(leaves) == 1 and tied.ties(model) == [("['a']", "['b']")]
    z = jnp.zeros(2)
    model["b"] = tied.State(z)
    model["a"] = tied.State(z)
    assert len(tied.flatten(model)[0]) == 2 and tied.ties(model) == []


def test_tying_two_cells_values_is_refused_tying_the_cells_is_one_state():
    model = {"a": tied.State(jnp.zeros(2)), "b": tied.State(jnp.ones(2))}
    with pytest.raises(tied.GraphError, match="state is shared by cell"):
        tied.tie(model, "['a'].value", "['b'].value")
    tied_model = tied.tie(model, "['a']", "['b']")
    assert tied_model["a"] is tied_model["b"]
    tied.jit(lambda m: bump(m["a"]))(tied_model)
    np.testing.assert_array_equal(tied_model["b"].value, np.ones(2))  # zeros + 1, one state


@pytest.mark.parametrize("route", ["eager", "jit"])
def test_a_part_of_a_cells_value_kept_as_it_was_stays_the_very_array(route):
    # under tied.jit the untouched part came back as a copy (stop_gradient made a new tracer,
    # so it counted as written): another cell holding that array no longer held the same one
    s = jnp.arange(2.0)
    m = {"a": tied.State((jnp.zeros(2), s)), "b": tied.State(s)}

    def f(m, x):
        v, kept = m["a"].value
        m["a"].value = (v + x, kept)
        return x.sum()

    (f if route == "eager" else tied.jit(f))(m, jnp.ones(2))
    assert m["a"].value[1] is s and m["b"].value is s
    np.testing.assert_array_equal(m["a"].value[0], np.ones(2))
    # a state value stays out of gradients, kept part or new part
    c = tied.State(jnp.ones(2))

    def g(w):
        c.value = c.value * w
        c.value = c.value
        return c.value.sum()

    np.testing.assert_array_equal(jax.grad(g)(jnp.ones(2)), np.zeros(2))
