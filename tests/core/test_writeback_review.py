"""An adversarial review of the write-back's two routes (issue 34): `tied.jit` against the same
function run eagerly on a deep copy of the model, call after call.

The reference is independent of the write-back: ``copy.deepcopy`` of the model before, the
function run on it in plain Python; after every call the two models must have one structure
(every tie where eager code leaves one, by `is`) and equal arrays at every place. Each test
runs with ``TIED_CHECK_PLANS`` on (the compiled route compared with `slots`) and off (what
users run: the compiled route alone from the third call).

* Random graphs of blocks (hypothesis): lists long enough to be read by a loop, runs of
  blocks sharing one cell, one block at two indices, a tuple of blocks, tuples, namedtuples,
  cells holding a tuple or a dict holding a list, random subsets written, random key order;
  between calls, the same changes made to both models (blocks swapped or moved, a block
  rebuilt after its old one was collected, a tuple or a cell replaced by a look-alike).
* A `tied.Stack` of members holding a BatchNorm, a shared one and a cell holding a tuple,
  under `tied.scan` eagerly and inside `tied.jit`, against the unrolled loop on a copy.
* Changes made while the call ran, at places only the new coverage writes (a tuple inside a
  looped block, a dict inside a looped block's cell): refused, nothing written, on each route.
"""

import collections
import contextlib
import copy
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import changing_during_the_call
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tied
from tied._core import graph as _graph
from tied._core import writeback as _writeback
from tied._core.plans import compile as _plan
from tied._core.plans import loops as _loops

Pair = collections.namedtuple("Pair", "a b")
FLAGS = ("own", "cell", "pair", "np", "cv", "cd", "w")
X = jnp.array([0.3, -0.2])


@tied.register
class Block:
    """A block that writes, on each call, the places its (static) ``flags`` name."""

    def __init__(self, k, flags, cell, pad):
        self.flags = flags
        self.w = jnp.full(2, 0.5 + 0.01 * k)
        self.own = tied.State(jnp.zeros(2))
        self.cell = cell  # shared by a run of blocks
        self.pair = (jnp.full(2, float(k)), jnp.ones(2))
        self.np = Pair(jnp.zeros(2), jnp.full(2, 2.0))
        self.cv = tied.State((jnp.zeros(2), jnp.ones(2)))
        self.cd = tied.State({"z": jnp.zeros(2), "a": [jnp.ones(2), jnp.zeros(1)]})
        self.extra = [jnp.zeros(1) for _ in range(pad)]  # places enough for the loops

    def __call__(self, x):
        f = self.flags
        if "own" in f:
            self.own.value = self.own.value + x
        if "cell" in f:
            self.cell.value = self.cell.value * 0.9 + x
        if "pair" in f:
            a, b = self.pair
            self.pair = (a + 1.0, b)
        if "np" in f:
            self.np = Pair(self.np.a, self.np.b * 0.5)
        if "cv" in f:
            v, s = self.cv.value
            self.cv.value = (v + s, s)
        if "cd" in f:
            d = self.cd.value
            self.cd.value = {"z": d["z"], "a": [d["a"][0] - x, d["a"][1]]}
        if "w" in f:
            self.w = self.w * 0.99
        return x * self.w


def build(spec):
    ncells, blocks, dups, order, pad, tuple_at, _ = spec
    cells = [tied.State(jnp.full(2, float(c))) for c in range(ncells)]
    bl = [Block(k, fl, cells[c % ncells], pad) for k, (fl, c) in enumerate(blocks)]
    for i, j in dups:
        if i < len(bl) and j < len(bl):
            bl[i] = bl[j]
    items = {"cells": cells, "blocks": bl}
    if tuple_at is not None and len(bl) > tuple_at + 1:
        items["tup"] = (bl[tuple_at], bl[tuple_at + 1])
    return {k: items[k] for k in [list(items)[i] for i in order if i < len(items)]}


def run(m, x):
    for b in m["blocks"]:
        x = b(x)
    if "tup" in m:
        x = m["tup"][0](x) + m["tup"][1](x)
    return x.sum()


def change(m, how, i, j):
    """The same change between calls, made to either model (by position)."""
    bl = m["blocks"]
    i, j = i % len(bl), j % len(bl)
    if how == "swap":
        bl[i], bl[j] = bl[j], bl[i]
    elif how == "move":  # one block at two indices
        bl[i] = bl[j]
    elif how == "rebuilt":  # the old block collected first: its ids may be reused
        flags, cell, pad = bl[i].flags, bl[i].cell, len(bl[i].extra)
        bl[i] = None
        gc.collect()
        bl[i] = Block(i, flags, cell, pad)
    elif how == "tuple":  # a look-alike tuple, the same arrays
        bl[i].pair = tuple(bl[i].pair)[:1] + tuple(bl[i].pair)[1:]
    elif how == "cell":  # a new cell object, the same value
        bl[i].own = tied.State(bl[i].own.value)
    elif how == "dict":  # a look-alike dict in a cell, keys in another order
        d = bl[i].cd.value
        bl[i].cd.value = {"a": list(d["a"]), "z": d["z"]}


def same(got, want, label):
    la, ga = tied.flatten(got)
    lb, gb = tied.flatten(want)
    if ga != gb:
        raise AssertionError(f"{label}: {_writeback.first_difference(gb, ga)}")
    for x, y, paths in zip(la, lb, ga.leaf_paths(), strict=True):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=f"{label} {paths}"
        )


flagsets = st.frozensets(st.sampled_from(FLAGS), min_size=1).map(lambda s: tuple(sorted(s)))
changes = st.tuples(
    st.sampled_from(["swap", "move", "rebuilt", "tuple", "cell", "dict"]),
    st.integers(0, 99),
    st.integers(0, 99),
)


@st.composite
def specs(draw):
    ncells = draw(st.integers(1, 3))
    n = draw(st.integers(1, 30))
    patterns = draw(st.lists(flagsets, min_size=1, max_size=3))
    run_length = draw(st.integers(1, 12))
    blocks = [(patterns[(k // run_length) % len(patterns)], (k // run_length) % ncells) for k in range(n)]
    dups = draw(st.lists(st.tuples(st.integers(0, 29), st.integers(0, 29)), max_size=2))
    order = draw(st.permutations(range(3)))
    pad = draw(st.sampled_from([0, 40]))  # 40: over `loops.LOOP_PLACES`, the blocks read by a loop
    tuple_at = draw(st.one_of(st.none(), st.integers(0, 28)))
    between = draw(st.lists(st.one_of(st.none(), changes), min_size=3, max_size=3))
    return ncells, blocks, dups, order, pad, tuple_at, between


@contextlib.contextmanager
def route(check, alone):
    """``TIED_CHECK_PLANS`` as ``check``; with ``alone``, no structure gets a flatten plan (the
    compiled writes alone, `compile_writes`, after the walk's re-check)."""
    mods = (_graph, _plan)
    saved = _writeback.CHECK_PLANS, [(m.MAX_PLAN_LINES, m.LARGE_PLAN_SIGHTINGS) for m in mods]
    _writeback.CHECK_PLANS = check
    if alone:
        for m in mods:
            m.MAX_PLAN_LINES, m.LARGE_PLAN_SIGHTINGS = 50, 10_000
    try:
        yield
    finally:
        _writeback.CHECK_PLANS = saved[0]
        for m, (lines, sightings) in zip(mods, saved[1]):
            m.MAX_PLAN_LINES, m.LARGE_PLAN_SIGHTINGS = lines, sightings


@pytest.mark.parametrize("alone", [False, True], ids=["plan", "alone"])
@pytest.mark.parametrize("check", [True, False])
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=specs())
def test_random_graphs_of_blocks_are_written_as_eagerly(check, alone, spec):
    with route(check, alone):
        m = build(spec)
        if alone:  # a structure of its own: never one a plan was made for
            m["route"] = "alone"
        ref = copy.deepcopy(m)
        step = tied.jit(run)
        for k, between in enumerate([None, *spec[-1]]):
            if between is not None:
                change(m, *between)
                change(ref, *between)
            np.testing.assert_allclose(step(m, X), run(ref, X), rtol=1e-5, atol=1e-6)
            same(m, ref, f"call {k}")
            bl, rb = m["blocks"], ref["blocks"]
            for i in range(len(bl)):  # the ties, by identity, where eager code leaves them
                for j in range(i):
                    assert (bl[i] is bl[j]) == (rb[i] is rb[j])
                    assert (bl[i].cell is bl[j].cell) == (rb[i].cell is rb[j].cell)


def test_a_loop_of_blocks_is_read_by_a_loop_and_written_by_the_compiled_route(monkeypatch):
    """The long lists above do reach the new coverage: a loop, and the compiled write-back."""
    spec = (2, [(FLAGS, k // 8) for k in range(24)], [], (0, 1, 2), 40, None, [None] * 3)
    m = build(spec)
    monkeypatch.setattr(_writeback, "CHECK_PLANS", False)
    ref = copy.deepcopy(m)
    step = tied.jit(run)
    for k in range(4):
        np.testing.assert_allclose(step(m, X), run(ref, X), rtol=1e-5, atol=1e-6)
        same(m, ref, f"call {k}")
    _, gdef = tied.flatten(((m, X), {}))
    assert _loops.layout(gdef).runs, "the blocks are read by a loop"
    assert [f for f in gdef.memo.write_backs.values() if f], "the compiled write-back was made"
    assert all(b.cell is m["cells"][(k // 8) % 2] for k, b in enumerate(m["blocks"]))
    np.testing.assert_allclose(m["blocks"][0].cd.value["a"][0], np.ones(2) - 4 * np.asarray(X))


# ---------------------------------------------------------------- a Stack under scan, eagerly and in jit


def stacked():
    shared = tied.nn.BatchNorm(2)
    keys = jax.random.split(jax.random.key(0), 5)
    members = [
        {
            "d": tied.nn.Dense(2, 2, key=k),
            "bn": tied.nn.BatchNorm(2),
            "sbn": shared,
            "c": tied.State((jnp.zeros(2), jnp.ones(2))),
        }
        for k in keys
    ]
    return {"pre": shared, "s": tied.stack(members)}


def body(h, layer, x):
    h = layer["sbn"](layer["bn"](layer["d"](h)))
    a, b = layer["c"].value
    layer["c"].value = (a + h.mean(0), b)
    return h, None


def scanned(m, x):
    h, _ = tied.scan(body, x, m["s"])
    return h.sum()


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_a_stack_written_by_scan_equals_the_unrolled_loop(monkeypatch, check, jit):
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    m = stacked()
    ref = copy.deepcopy(m)
    x = jnp.arange(8.0).reshape(4, 2) / 3
    fn = tied.jit(scanned) if jit else scanned
    for k in range(3):
        got = fn(m, x)
        layers = tied.unstack(ref["s"])  # the reference: unrolled on the copy, restacked
        h = x
        for layer in layers:
            h, _ = body(h, layer, None)
        ref = {"pre": ref["pre"], "s": tied.stack(layers)}
        np.testing.assert_allclose(got, h.sum(), rtol=1e-5, atol=1e-5)
        same(m, ref, f"call {k}")


# ---------------------------------------------------------------- changed while the call ran


def _during(m, what):
    b = m["blocks"][9]
    if what == "tuple":  # the unwritten array of a written tuple in a looped block: a new one
        b.pair = (b.pair[0], jnp.array(b.pair[1]))
    elif what == "dict":  # an unwritten array in a written cell's dict
        d = b.cd.value
        b.cd.value = {"z": jnp.array(d["z"]), "a": list(d["a"])}
    elif what == "static":  # a static of a looped block
        b.flags = tuple(b.flags)[::-1]


def changing_step(m, armed, change, warm):
    """`tied.jit` of `run` with a host callback that calls ``change()`` once ``armed["on"]``
    is set (while the call runs), after ``warm`` calls of it on ``m``."""

    step = changing_during_the_call(run, armed, change)
    for _ in range(warm):
        step(m, X)
    return step


@pytest.mark.parametrize("warm", [0, 3], ids=["slots", "compiled"])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("what", ["tuple", "dict", "static"])
def test_a_looped_block_changed_during_the_call_is_refused_with_nothing_written(
    monkeypatch, warm, check, what
):
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    tag = ("pair", "cd", "own", f"t-{what}-{check}-{warm}")  # a structure of its own per case
    m = build((1, [(tag, 0)] * 16, [], (0, 1, 2), 40, None, None))
    armed = {"on": False}
    step = changing_step(m, armed, lambda: _during(m, what), warm)
    before = [(b.pair, b.cd.value, b.own.value) for b in m["blocks"]]
    armed["on"] = True
    with pytest.raises(tied.ModelChangedError, match="while the call ran"):
        step(m, X)
        jax.effects_barrier()
    for k, (b, (pair, cd, own)) in enumerate(zip(m["blocks"], before)):
        assert b.own.value is own  # nothing written
        if k != 9:
            assert b.pair is pair and b.cd.value is cd
    np.testing.assert_allclose(m["blocks"][9].pair[0], np.full(2, 9.0 + warm))


def _change_during(m, what, i, j):
    """A change of an array or of the structure, made while the call runs; False where this
    graph has nothing to change that way."""
    bl = m["blocks"]
    i, j = i % len(bl), j % len(bl)
    b = bl[i]
    if what == "swap":
        if bl[i] is bl[j]:
            return False
        bl[i], bl[j] = bl[j], bl[i]
    elif what == "tuple":
        b.pair = (b.pair[0], jnp.array(b.pair[1]))
    elif what == "namedtuple":
        b.np = Pair(jnp.array(b.np.a), b.np.b)
    elif what == "cell":
        b.own.value = jnp.array(b.own.value)
    elif what == "cell tuple":
        b.cv.value = (b.cv.value[0], jnp.array(b.cv.value[1]))
    elif what == "cell dict":
        d = b.cd.value
        b.cd.value = {"z": d["z"], "a": [d["a"][0], jnp.array(d["a"][1])]}
    elif what == "static":
        b.flags = (*b.flags, "none")
    elif what == "tie cut":
        b.cell = tied.State(b.cell.value)
    elif what == "tie made":
        if b.cell is bl[j].cell:
            return False
        b.cell = bl[j].cell
    return True


@pytest.mark.parametrize("check", [True, False])
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    spec=specs(),
    what=st.sampled_from(
        ["swap", "tuple", "namedtuple", "cell", "cell tuple", "cell dict", "static", "tie cut", "tie made"]
    ),
    i=st.integers(0, 99),
    j=st.integers(0, 99),
    warm=st.sampled_from([0, 1, 3]),
)
def test_random_graphs_changed_during_the_call_are_refused_with_nothing_written(
    check, spec, what, i, j, warm
):
    with route(check, alone=False):
        m = build(spec)
        armed = {"on": False}

        def change_it():
            armed["changed"] = _change_during(m, what, i, j)
            armed["after"] = tied.flatten(m)  # the model as the change left it

        step = changing_step(m, armed, change_it, warm)
        armed["on"] = True
        try:
            step(m, X)
            jax.effects_barrier()
        except tied.ModelChangedError:
            refused = True
        else:
            refused = False
        if not armed["changed"]:
            return
        assert refused, "a model changed while the call ran was written into"
        leaves, gdef = tied.flatten(m)
        assert gdef == armed["after"][1]
        assert all(a is b for a, b in zip(leaves, armed["after"][0], strict=True)), "something was written"
