"""Shardings with ties: device_put, sharding_tree, data_parallel, tied.jit's in/out_shardings.

This process keeps one device: the tests here use one-device meshes (a spec that
differs is still a conflict there, so the errors are checked here too). The
several-device checks (8 fake CPU devices) run in a separate process, started by
`test_eight_fake_devices` below.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Chain, Dense, models, places, rebuild, sharing_groups
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from processes import pytest_on_fake_devices

import tied
from tied._core.graph import read_places

DEV = jax.devices()[0]
MESH_A = Mesh(np.array([DEV]), ("a",))
MESH_B = Mesh(np.array([DEV]), ("b",))
A = NamedSharding(MESH_A, P())  # a one-device mesh named "a"
B = NamedSharding(MESH_B, P())  # the same device, another mesh: a different sharding
ROWS = NamedSharding(MESH_A, P("a"))  # rows split over "a" (one device here)


def test_eight_fake_devices():
    """tests/multidevice/sharded.py under 8 fake CPU devices, in its own process."""
    code, report = pytest_on_fake_devices("tests/multidevice/sharded.py")
    assert code == 0, report
    assert "6 passed" in report, report


def seed_model():
    d1 = Dense(jnp.ones((3, 3)), jnp.arange(3.0))
    return Chain(d1, Dense(d1.weight, d1.bias), d1)


def test_device_put_keeps_ties_and_places_each_array_once():
    m = seed_model()
    out = tied.device_put(m, ROWS)
    assert out.layers[0] is out.layers[2]
    assert out.layers[0].weight is out.layers[1].weight and out.layers[0].bias is out.layers[1].bias
    assert len(tied.flatten(out)[0]) == 2
    assert out.layers[1].weight.sharding == ROWS and out.layers[1].bias.sharding == ROWS
    np.testing.assert_array_equal(out.layers[1].bias, np.arange(3.0))
    assert m.layers[1].weight is m.layers[0].weight  # the input is untouched


def test_a_sharding_at_a_node_applies_to_its_subtree_and_none_leaves_an_array_alone():
    enc = Dense(jnp.ones((2, 3)), jnp.zeros(2))
    x = jnp.arange(4.0)
    tree = {"enc": enc, "dec": Dense(jnp.ones((3, 2)), None), "x": x}
    out = tied.device_put(tree, {"enc": ROWS, "dec": A, "x": None})
    assert out["enc"].weight.sharding == ROWS and out["enc"].bias.sharding == ROWS
    assert out["dec"].weight.sharding == A
    assert out["x"] is x  # None: not moved
    # A whole-tree None keeps every array; a Device places on it.
    assert tied.device_put(tree, None)["x"] is x
    assert tied.device_put(tree, DEV)["enc"].weight.devices() == {DEV}


def test_sharding_tree_calls_fn_at_every_place_with_its_path():
    m = seed_model()
    seen = []

    def fn(path, x):
        seen.append((path, x))
        return A if path.endswith("weight") else None

    specs = tied.sharding_tree(m, fn)
    want = [(p, x) for p, x in places(m) if isinstance(x, jax.Array)]  # independent walker
    assert [p for p, _ in seen] == [p for p, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(seen, want))
    assert specs.layers[2].weight is A and specs.layers[2].bias is None
    assert specs.layers[0] is not specs.layers[2]  # one node per place
    out = tied.device_put(m, specs)
    assert out.layers[0].weight.sharding == A and out.layers[0] is out.layers[2]


def is_arr(x):
    return isinstance(x, (jax.Array, np.ndarray))


@given(models(), st.integers(0, 2**16))
def test_device_put_random_sharing_one_sharding_per_array_or_the_conflict(tree, seed):
    """Random specs per place; independent reference: group places by identity by hand."""
    rng = np.random.default_rng(seed)
    choices = {}

    def pick(path, x):
        if not is_arr(x):
            return x
        choices[path] = [None, A, B][rng.integers(0, 3)]
        return choices[path]

    specs = rebuild(tree, pick)
    by_object: dict = {}
    for path, x in places(tree):
        if is_arr(x):
            by_object.setdefault(id(x), []).append((path, choices[path]))
    conflict = any(len({id(s) for _, s in group if s is not None}) > 1 for group in by_object.values())
    event("conflict" if conflict else "no conflict")
    if conflict:
        with pytest.raises(ValueError, match="hold one shared array, but it is given two different"):
            tied.device_put(tree, specs)
        return
    out = tied.device_put(tree, specs)
    assert sharing_groups(out, is_arr) == sharing_groups(tree, is_arr)
    for (path, x), (_, y) in zip(places(tree), places(out)):
        if is_arr(x):
            wanted = [s for _, s in by_object[id(x)] if s is not None]
            if wanted:
                assert y.sharding == wanted[0], path
            else:
                assert y is x, path
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_conflicting_shardings_name_both_paths_in_device_put_and_jit():
    m = seed_model()
    specs = tied.sharding_tree(m, lambda path, x: ROWS if path == ".layers[1].weight" else A)
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.weight and \.layers\[1\]\.weight hold one shared"):
        tied.device_put(m, specs)
    # Equal specs written two ways are one sharding, not a conflict.
    same = tied.sharding_tree(m, lambda path, x: NamedSharding(MESH_A, P(None)) if "[1]" in path else A)
    assert tied.device_put(m, same).layers[1].weight.sharding == A
    # Across two arguments of tied.jit: the bias is in both.
    f = tied.jit(lambda m, b: m(b), in_shardings=(A, B))
    with pytest.raises(ValueError, match=r"args\[0\]\.layers\[0\]\.bias and args\[1\] hold one shared"):
        f(m, m.layers[0].bias)
    # In the output: one array returned at two places, given two shardings.
    g = tied.jit(lambda w: {"x": w + 1, "y": [None]}, out_shardings={"x": A, "y": B})
    assert g(jnp.ones(2))["x"].sharding == A
    h = tied.jit(lambda w: (lambda y: {"x": y, "y": y})(w + 1), out_shardings={"x": A, "y": B})
    with pytest.raises(ValueError, match=r"output\['x'\] and output\['y'\] hold one shared array"):
        h(jnp.ones(2))


def test_jit_with_shardings_equals_jit_without_and_keeps_ties():
    m = seed_model()
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

    traces = []

    def step(m, x):
        traces.append(1)
        return m, tied.grad(lambda m: jnp.sum(m(x) ** 2))(m)

    plain = tied.jit(step)(m, x)
    f = tied.jit(step, in_shardings=(tied.sharding_tree(m, lambda p, x: A), None), out_shardings=A)
    # Placed as in_shardings asks (as jax.jit, a new input sharding would trace again).
    sharded = f(tied.device_put(m, A), x)
    f(sharded[0], x)
    assert len(traces) == 2  # one trace each: the second sharded call is served from the cache
    for a, b in zip(tied.flatten(plain)[0], tied.flatten(sharded)[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    out_m, g = sharded
    assert out_m.layers[0] is out_m.layers[2] and out_m.layers[0].weight is out_m.layers[1].weight
    assert g.layers[0].weight is g.layers[1].weight
    assert all(leaf.sharding == A for leaf in tied.flatten(sharded)[0])


def test_in_shardings_errors_name_the_argument():
    m = seed_model()
    f = tied.jit(lambda m, x: m(x), in_shardings=(A,))
    with pytest.raises(ValueError, match="in_shardings has 1 entries but the call has 2 positional"):
        f(m, jnp.ones((1, 3)))
    # Static arguments are left out, as in jax.jit.
    g = tied.jit(lambda m, k, x: m(x) * k, static_argnums=1, in_shardings=(A, None))
    np.testing.assert_allclose(g(m, 2, jnp.ones((1, 3))), 2 * m(jnp.ones((1, 3))), rtol=1e-6)
    bad = tied.jit(lambda m, x: m(x), in_shardings=({"w": A}, None))
    with pytest.raises(tied.GraphError, match=r"args\[0\]: .*shardings tree does not mirror"):
        bad(m, jnp.ones((1, 3)))
    arrays = tied.jit(lambda m, x: m(x), in_shardings=(m, None))  # the model, not its shardings
    with pytest.raises(tied.GraphError, match=r"args\[0\]\.layers\[0\]\.weight: expected a jax.sharding"):
        arrays(m, jnp.ones((1, 3)))


def test_data_parallel_shardings_and_axis_error():
    dp = tied.data_parallel()
    assert dp.mesh.axis_names == ("data",) and dp.mesh.devices.size == jax.device_count()
    assert dp.replicated.spec == P() and dp.batch.spec == P("data")
    dp2 = tied.data_parallel(MESH_A, axis="a")
    assert dp2.mesh is MESH_A and dp2.batch == ROWS
    with pytest.raises(ValueError, match=r"the mesh has axes \('a',\), not 'data'"):
        tied.data_parallel(MESH_A)


def test_a_sharding_over_a_subtree_with_a_reference_cycle():
    """read_places broadcasting (None or a sharding) through a cycle ends (it recursed)."""
    a = [jnp.ones(2)]
    a.append(a)
    _, gdef = tied.flatten({"m": a})
    assert read_places(gdef, {"m": None}) == [[None]]
    out = tied.device_put({"m": a, "n": jnp.zeros(1)}, {"m": A, "n": None})
    assert out["m"][1] is out["m"] and out["m"][0].sharding == A


def test_a_wrong_sharding_at_a_later_place_of_a_shared_node_in_a_graph_with_a_cycle_is_named():
    """The places named are those of the shardings tree as read (every place of a shared node,
    the cycle once round), not the first places only (an IndexError before)."""
    shared = {"w": jnp.ones(2)}
    a = [shared, shared]
    a.append(a)
    with pytest.raises(tied.GraphError, match=r"^tied\.device_put: \[1\]\['w'\]: expected a jax\.sharding"):
        tied.device_put(a, [{"w": A}, {"w": "A"}, None])
    with pytest.raises(ValueError, match=r"^tied\.device_put: \[0\]\['w'\] and \[1\]\['w'\] hold one shared"):
        tied.device_put(a, [{"w": A}, {"w": B}, None])
    out = tied.device_put(a, [{"w": A}, None, None])
    assert out[0] is out[1] and out[2] is out and out[0]["w"].sharding == A
