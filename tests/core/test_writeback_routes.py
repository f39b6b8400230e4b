"""The write-back's two routes, the compiled one and the general walk (`slots`), write alike.

* A list of 40 blocks (read by a loop in the compiled plans: over `loops.LOOP_PLACES` places),
  each with its own call counter and all sharing one norm: the compiled route writes every
  place, the shared norm's state once for all its places, against a numpy replay; with the
  walk switched off it still writes (the compiled route was taken).
* Arrays in tuples (a view's sources, a namedtuple) and in a cell's value (a tuple, a dict
  holding a list) are written by rebuilding their containers, as eager code and `slots` do;
  from the third call by the compiled route alone.
* On each route, a model changed while the call ran (a host callback assigning to it) is
  refused, nothing written. ``TIED_CHECK_PLANS=1`` (the suite's setting) compares the compiled
  route with `slots` at every call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RunningNorm, changing_during_the_call

import tied
from tied._core import writeback as _writeback
from tied._core.plans import loops as _loops

N_BLOCKS = 40


@tied.register
class Block:
    def __init__(self, norm, k):
        self.w = jnp.eye(2) * (0.5 + 0.01 * k)
        self.calls = tied.State(jnp.zeros((), jnp.int32))
        self.norm = norm
        self.extra = [jnp.zeros(1) for _ in range(24)]  # enough places for the loops

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return jnp.tanh(self.norm(x @ self.w))


def blocks(tag=None):
    norm = RunningNorm(2)
    if tag is not None:  # a static of its own: a structure no other test has written back
        norm.tag = tag
    return [Block(norm, k) for k in range(N_BLOCKS)], norm


def run(m, x):
    for b in m:
        x = b(x)
    return x.sum()


X = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2) / 5.0


def replay(steps):
    """The shared norm's running mean after ``steps`` calls, in numpy (float64)."""
    mean = np.zeros(2)
    ws = [np.eye(2) * (0.5 + 0.01 * k) for k in range(N_BLOCKS)]
    for _ in range(steps):
        h = np.asarray(X, np.float64)
        for w in ws:
            h = h @ w
            mean = 0.9 * mean + 0.1 * h.mean(0)
            h = np.tanh(h - mean)
    return mean


def _compiled(root):
    _, gdef = tied.flatten(root)
    return [f for f in gdef.memo.write_backs.values() if f]


def test_the_blocks_are_read_by_a_loop():
    m, _ = blocks()
    _, gdef = tied.flatten(((m, X), {}))
    assert gdef.num_leaves > _loops.LOOP_PLACES // 30
    assert _loops.layout(gdef).runs, "the blocks make a run: the plans read them by a loop"


@pytest.mark.parametrize("check", [True, False])
def test_forty_blocks_sharing_one_norm_are_written_by_the_compiled_route(monkeypatch, check):
    m, norm = blocks()
    step = tied.jit(run)
    for _ in range(3):
        step(m, X)
    assert _compiled(((m, X), {})), "the compiled write-back is made for a list read by a loop"
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    if not check:  # the walk switched off: only the compiled route can write

        def no_walk(*a, **k):
            raise AssertionError("slots() walked the model")

        monkeypatch.setattr(_writeback, "slots", no_walk)
    for _ in range(2):
        step(m, X)
    assert all(b.norm is norm for b in m) and all(b.norm.mean is norm.mean for b in m)
    assert [int(b.calls.value) for b in m] == [5] * N_BLOCKS
    np.testing.assert_allclose(np.asarray(norm.mean.value), replay(5), rtol=1e-4, atol=1e-6)


def _block_mutations():
    def new_cell_value(m, norm):  # a looped block's written cell given an equal array
        m[20].calls.value = jnp.array(m[20].calls.value)

    def blocks_swapped(m, norm):
        m[3], m[4] = m[4], m[3]

    def tie_cut(m, norm):  # one block given its own norm
        twin = RunningNorm(2)
        twin.scale, twin.mean = norm.scale, norm.mean
        m[30].norm = twin

    return [new_cell_value, blocks_swapped, tie_cut]


@pytest.mark.parametrize("warm", [0, 3], ids=["slots", "compiled"])  # calls before: the route
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("mutate", _block_mutations(), ids=lambda f: f.__name__)
def test_forty_blocks_changed_during_the_call_are_refused_with_nothing_written(
    monkeypatch, check, mutate, warm
):
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    m, norm = blocks(f"{mutate.__name__}-{check}" if not warm else None)
    armed = {"on": False}
    step = changing_during_the_call(run, armed, lambda: mutate(m, norm))
    for _ in range(warm):
        step(m, X)
    assert bool(_compiled(((m, X), {}))) == bool(warm)
    cells = [b.calls for b in m]
    mean = norm.mean.value
    armed["on"] = True
    with pytest.raises(tied.ModelChangedError, match="while the call ran"):
        step(m, X)
        jax.effects_barrier()
    assert all(int(c.value) == warm for c in cells)  # nothing written
    assert norm.mean.value is mean


Pair = __import__("collections").namedtuple("Pair", "x y")


def tuples():
    """A tuple at two places, a tuple held twice by a namedtuple that a dict holds, a view of
    two sources, a cell holding a tuple and one holding a dict holding a list."""
    pair, inner = (jnp.arange(2.0), jnp.ones(2)), (jnp.full(2, 3.0),)
    return {
        "a": pair,
        "b": pair,
        "nest": Pair(inner, inner),
        "v": tied.View((jnp.ones(2), jnp.zeros(2)), jnp.add),
        "c": tied.State((jnp.zeros(2), jnp.ones(2))),
        "d": tied.State({"n": [jnp.zeros(2), jnp.ones(2)], "k": jnp.ones(2)}),
    }


def bump(m, x):
    w, s = m["a"]
    m["a"] = m["b"] = (w + x, s)
    inner = (m["nest"].x[0] * 0.5,)
    m["nest"] = Pair(inner, inner)
    a, b = m["v"].source
    m["v"].source = (a * 2.0, b)
    a, b = m["c"].value
    m["c"].value = (a + x, b)
    d = m["d"].value
    m["d"].value = {"n": [d["n"][0] - x, d["n"][1]], "k": d["k"]}
    return w.sum()


@pytest.mark.parametrize("check", [True, False])
def test_places_in_tuples_and_in_cells_values_are_written_as_eagerly(monkeypatch, check):
    x = jnp.array([1.0, 2.0])
    ref, m = tuples(), tuples()
    step = tied.jit(bump)
    snapshot = m["d"].value  # a cell's old value is the caller's: never changed in place
    old = (snapshot, snapshot["n"], list(snapshot["n"]))
    for k in range(4):
        if k == 2:  # the compiled write-back is made: from now on it alone writes
            assert _compiled(((m, x), {})), "the compiled write-back is made for tuples and cells"
            monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
            if not check:

                def no_walk(*a, **k):
                    raise AssertionError("slots() walked the model")

                monkeypatch.setattr(_writeback, "slots", no_walk)
        want = bump(ref, x)
        np.testing.assert_allclose(step(m, x), want)
    assert m["a"] is m["b"]  # one new tuple at both places, as the eager assignment makes
    assert m["nest"].x is m["nest"].y and type(m["nest"]) is Pair
    for got, want in zip(tied.flatten(m)[0], tied.flatten(ref)[0], strict=True):
        np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(m["a"][0], np.arange(2.0) + 4 * np.array([1.0, 2.0]))
    np.testing.assert_allclose(m["nest"].x[0], np.full(2, 3.0 / 16))
    np.testing.assert_allclose(m["v"].source[0], np.full(2, 16.0))
    np.testing.assert_allclose(m["c"].value[0], 4 * np.array([1.0, 2.0]))
    np.testing.assert_allclose(m["d"].value["n"][0], -4 * np.array([1.0, 2.0]))
    assert old[0] is snapshot and old[1] is snapshot["n"] and old[2] == snapshot["n"]
    np.testing.assert_allclose(snapshot["n"][0], np.zeros(2))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("what", ["tuple", "cell"])
def test_tuples_changed_during_the_call_are_refused_with_nothing_written(monkeypatch, what, check):
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    m = tuples()
    armed = {"on": False}

    def change():
        if what == "tuple":
            m["a"] = m["b"] = (jnp.array(m["a"][0]), m["a"][1])
        else:
            m["c"].value = (jnp.array(m["c"].value[0]), m["c"].value[1])

    step = changing_during_the_call(bump, armed, change)
    x = jnp.array([1.0, 2.0])
    for _ in range(3):
        step(m, x)
    assert _compiled(((m, x), {}))
    armed["on"] = True
    with pytest.raises(tied.ModelChangedError, match="while the call ran"):
        step(m, x)
        jax.effects_barrier()
    armed_state = (m["a"], m["c"].value)
    np.testing.assert_allclose(armed_state[0][0], np.arange(2.0) + 3 * np.array([1.0, 2.0]))
    np.testing.assert_allclose(armed_state[1][0], 3 * np.array([1.0, 2.0]))
    assert m["a"] is m["b"]


# ---------------------------------------------------------------- a structure with no flatten plan


@tied.register
class Named:
    """A counter and a tuple, with a name of its own (no two alike: no loop, a line per place)."""

    def __init__(self, name, shared):
        self.name, self.shared = name, shared
        self.calls = tied.State(jnp.zeros((), jnp.int32))
        self.pair = (jnp.zeros(2), jnp.ones(2))

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        a, b = self.pair
        self.pair = (a + x, b)
        return self.shared(x[None])


def _unplanned(monkeypatch, tag):
    from tied._core import graph as _graph
    from tied._core.plans import compile as _plan

    for mod in (_graph, _plan):  # over the plan bound, and never seen often enough for a large plan
        monkeypatch.setattr(mod, "MAX_PLAN_LINES", 50)
        monkeypatch.setattr(mod, "LARGE_PLAN_SIGHTINGS", 10_000)
    norm = RunningNorm(2)
    return [Named(f"{tag}{k}", norm) for k in range(6)], norm


def _run_named(m, x):
    return sum(layer(x).sum() for layer in m)


@pytest.mark.parametrize("check", [True, False])
def test_a_structure_without_a_flatten_plan_is_written_by_the_compiled_writes(monkeypatch, check):
    m, norm = _unplanned(monkeypatch, f"unplanned-{check}-")
    x = jnp.array([1.0, 2.0])
    step = tied.jit(_run_named)
    for _ in range(2):
        step(m, x)
    _, gdef = tied.flatten(((m, x), {}))
    assert not gdef.memo.flatten_plan and not _compiled(((m, x), {}))
    assert [f for f in gdef.memo.writes_alone.values() if f], "the compiled writes are made"
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    if not check:

        def no_walk(*a, **k):
            raise AssertionError("slots() walked the model")

        monkeypatch.setattr(_writeback, "slots", no_walk)
    for _ in range(2):
        step(m, x)
    assert [int(layer.calls.value) for layer in m] == [4] * 6
    for layer in m:
        np.testing.assert_allclose(layer.pair[0], 4 * np.asarray(x))
        np.testing.assert_allclose(layer.pair[1], np.ones(2))
    assert all(layer.shared is norm for layer in m)
    mean = np.zeros(2)
    for _ in range(4 * 6):  # the shared norm, called by each layer, on the same input
        mean = 0.9 * mean + 0.1 * np.asarray(x)
    np.testing.assert_allclose(norm.mean.value, mean, rtol=1e-5)


@pytest.mark.parametrize("check", [True, False])
def test_a_structure_without_a_flatten_plan_changed_during_the_call_is_refused(monkeypatch, check):
    m, norm = _unplanned(monkeypatch, f"unplanned-changed-{check}-")
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    armed = {"on": False}

    def change():  # a new array at a written place
        m[2].pair = (jnp.array(m[2].pair[0]), m[2].pair[1])

    step = changing_during_the_call(_run_named, armed, change)
    x = jnp.array([1.0, 2.0])
    for _ in range(3):
        step(m, x)
    pairs, mean = [layer.pair for layer in m], norm.mean.value
    armed["on"] = True
    with pytest.raises(tied.ModelChangedError, match="while the call ran"):
        step(m, x)
        jax.effects_barrier()
    assert all(int(layer.calls.value) == 3 for layer in m)  # nothing written
    assert norm.mean.value is mean
    assert all(layer.pair is p for k, (layer, p) in enumerate(zip(m, pairs)) if k != 2)
    np.testing.assert_allclose(m[2].pair[0], 3 * np.asarray(x))  # the callback's copy, as it left it
