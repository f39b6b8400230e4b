"""Fast paths of the host side: each gives exactly what the slow path gives, or gives up.

* The write-back of `tied.jit` writes through a compiled write-back kept on the GraphDef
  (made from where one `slots` run found the places, checking the live objects each call)
  instead of walking the whole model: a layer replaced between calls by another object of
  the same structure must receive the write; any difference makes it give up, having
  written nothing.
* Checked against a numpy replay (never against tied), and under ``TIED_CHECK_PLANS=1``
  (the suite's setting) every plan result is compared with `tied._core.live.slots`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RunningNorm as Norm
from helpers import changing_during_the_call

import tied
from tied._core import graph as _graph
from tied._core import live as _live
from tied._core import writeback as _writeback


@tied.register
class Net:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


X = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 7.0


def replay(means, x, steps):
    """The running means of a chain of Norms (scale 1) after ``steps`` calls, in numpy."""
    means = [np.asarray(m, np.float32) for m in means]
    for _ in range(steps):
        h = np.asarray(x, np.float32)
        for k in range(len(means)):
            means[k] = np.float32(0.9) * means[k] + np.float32(0.1) * h.mean(0)
            h = np.tanh(h - means[k])
    return means


def test_check_mode_is_on():
    assert _graph.CHECK_PLANS, "the suite runs with TIED_CHECK_PLANS=1 (tests/conftest.py)"


def test_write_back_reaches_a_layer_replaced_between_calls_and_leaves_the_old_one():
    net = Net([Norm(3), Norm(3), Norm(3)])
    step = tied.jit(lambda m, x: m(x))
    for _ in range(3):
        step(net, X)
    expect = replay([0, 0, 0], X, 3)
    old = net.layers[1]
    old_mean = np.asarray(old.mean.value)
    np.testing.assert_allclose(old_mean, expect[1], rtol=1e-6)
    # Same structure, new objects: the plan navigates to them, nothing retraces.
    net.layers[1] = Norm(3)
    net.layers = list(net.layers)  # the list itself replaced too
    for _ in range(2):
        step(net, X)
    np.testing.assert_array_equal(np.asarray(old.mean.value), old_mean)  # untouched
    means = [np.asarray(layer.mean.value) for layer in net.layers]
    # layers 0 and 2 carried on for 5 calls; layer 1 restarted from zero after 3
    h = np.asarray(X, np.float32)
    ref0 = replay([0], X, 5)[0]
    np.testing.assert_allclose(means[0], ref0, rtol=1e-5)
    # replay the chain by hand from the state after 3 calls, layer 1 reset
    ms = [expect[0], np.zeros(3, np.float32), expect[2]]
    for _ in range(2):
        h = np.asarray(X, np.float32)
        for k in range(3):
            ms[k] = np.float32(0.9) * ms[k] + np.float32(0.1) * h.mean(0)
            h = np.tanh(h - ms[k])
    for got, want in zip(means, ms):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_write_back_into_a_shared_layer_replaced_at_both_places_keeps_the_tie():
    shared = Norm(3)
    net = Net([shared, Norm(3), shared])
    step = tied.jit(lambda m, x: m(x))
    step(net, X)
    step(net, X)
    new = Norm(3)
    net.layers[0] = net.layers[2] = new
    step(net, X)
    assert net.layers[0] is net.layers[2] is new
    assert net.layers[0].mean is net.layers[2].mean
    # the new shared layer was called twice in the third call, from zero
    h = np.asarray(X, np.float32)
    m0 = np.float32(0.1) * h.mean(0)
    h = np.tanh(h - m0)
    m1 = np.asarray(net.layers[1].mean.value)
    h = np.tanh(h - m1)
    m2 = np.float32(0.9) * m0 + np.float32(0.1) * h.mean(0)
    np.testing.assert_allclose(np.asarray(new.mean.value), m2, rtol=1e-5)
    assert not np.allclose(np.asarray(shared.mean.value), 0)  # the old one kept its two calls


def _write_back_of(net, which):
    """The compiled write-back of ``net``'s state cells ``which``, made as the write-back makes
    it: from where one `slots` run found the places."""
    from tied._core.plans import compile_flatten

    leaves, gdef = tied.flatten(net)
    record: list = []
    _live.slots(net, gdef, which, action="test", frozen_ok=True, rebuild=True, _record=record)
    writes = _live.recorded_writes(record)
    assert writes is not None
    return leaves, compile_flatten(gdef, writes=writes)


def test_the_compiled_write_back_gives_up_on_any_difference_on_the_way_writing_nothing():
    net = Net([Norm(3), {"a": Norm(3)}])
    leaves, gdef = tied.flatten(net)
    which = tuple(i for i, s in enumerate(gdef.state_leaves()) if s)
    _, fused = _write_back_of(net, which)

    @tied.register
    class Other(Norm):
        pass

    fields = Net([Norm(3), {"a": Norm(3)}])
    fields.layers[0].extra = 1.0
    # a list made longer, a dict key renamed, a layer of another class, a field added: None,
    # nothing written, never a guess
    for other in (
        Net([Norm(3), {"a": Norm(3)}, Norm(3)]),
        Net([Norm(3), {"b": Norm(3)}]),
        Net([Other(3), {"a": Norm(3)}]),
        fields,
    ):
        given, _ = tied.flatten(other)
        cells = [c for c in _cells(other)]
        kept = [c.value for c in cells]
        assert fused(other, given, [jnp.ones(3)] * len(which)) is None
        assert all(c.value is k for c, k in zip(cells, kept))
    # other arrays than the call was given: None, nothing written
    other = Net([Norm(3), {"a": Norm(3)}])
    kept = [c.value for c in _cells(other)]
    assert fused(other, leaves, [jnp.ones(3)] * len(which)) is None
    assert all(c.value is k for c, k in zip(_cells(other), kept))
    # the model it was made for: every place written
    assert fused(net, leaves, [jnp.ones(3), 2 * jnp.ones(3)]) is True
    assert float(net.layers[0].mean.value[0]) == 1.0 and float(net.layers[1]["a"].mean.value[0]) == 2.0


def _cells(net):
    return [layer.mean for layer in (net.layers[0], *net.layers[1].values())]


def test_a_compiled_write_back_that_disagrees_with_slots_fails_in_check_mode():
    from tied._core.plans import compile_flatten

    net = Net([Norm(3), Norm(3)])
    step = tied.jit(lambda m, x: m(x))
    for _ in range(4):  # from the third call on, the call's GraphDef is its plan's (interned)
        step(net, X)
    _, gdef = _graph.flatten_with(((net, X), {}), step._plans)
    ((key, writes),) = gdef.memo.writes.items()
    fused = gdef.memo.write_backs[key]
    assert fused and len(writes) == 2
    # a lying write-back: the two arrays' places swapped
    (n0, *rest0), (n1, *rest1) = writes
    gdef.memo.write_backs[key] = compile_flatten(gdef, writes=((n1, *rest0), (n0, *rest1)))
    try:
        with pytest.raises(_graph.PlanMismatch, match="wrote other places than slots finds"):
            step(net, X)
    finally:
        gdef.memo.write_backs[key] = fused
    step(net, X)


def test_state_inside_a_tuple_held_by_a_cell_is_written_by_the_compiled_route():
    cell = tied.State((jnp.zeros(2), jnp.ones(2)))

    @tied.jit
    def bump(c):
        a, b = c.value
        c.value = (a + 1, b)

    for _ in range(4):
        bump(cell)
    np.testing.assert_array_equal(np.asarray(cell.value[0]), np.full(2, 4.0))
    np.testing.assert_array_equal(np.asarray(cell.value[1]), np.ones(2))
    _, gdef = tied.flatten(((cell,), {}))
    assert all(gdef.memo.write_backs.values()) and gdef.memo.write_backs, "the compiled write-back wrote"


def test_errors_still_come_from_slots_by_path():
    # a place in a tuple that no container can take a new tuple into (the tuple is the root)
    model = (jnp.zeros(2), {"w": jnp.ones(2)})
    leaves, gdef = tied.flatten(model)
    message = r"^m\[0\]: test writes new arrays .* held by no container"
    for _ in range(2):  # as the first run and after it
        with pytest.raises(tied.GraphError, match=message):
            _writeback.write_back(model, gdef, (0, 1), [jnp.ones(2)] * 2, "test", leaves, name="m".__add__)
    assert model[1]["w"] is leaves[1]  # nothing written


def test_once_planned_the_write_back_does_not_walk_the_model(monkeypatch):
    net = Net([Norm(3) for _ in range(4)])
    step = tied.jit(lambda m, x: m(x))
    for _ in range(3):
        step(net, X)

    def no_walk(*a, **k):
        raise AssertionError("slots() walked the model")

    monkeypatch.setattr(_writeback, "CHECK_PLANS", False)
    monkeypatch.setattr(_writeback, "slots", no_walk)
    for _ in range(2):
        step(net, X)
    means = replay([0, 0, 0, 0], X, 5)
    for layer, want in zip(net.layers, means):
        np.testing.assert_allclose(np.asarray(layer.mean.value), want, rtol=1e-5, atol=1e-7)


def test_a_graph_over_the_plan_bound_gets_its_plan_after_enough_sightings(monkeypatch):
    from tied._core.plans import compile as _plan

    @tied.register
    class Cell:
        def __init__(self, w, b, name):
            self.w, self.b, self.name = w, b, name

    shared = jnp.zeros(2)
    weights = [jnp.full((2,), float(i)) for i in range(40)]
    # every cell's static differs, so no two share a layout: no loop, a line per place
    model = [Cell(w, shared, f"cell{i}") for i, w in enumerate(weights)]
    for mod in (_graph, _plan):
        monkeypatch.setattr(mod, "MAX_PLAN_LINES", 50)
        monkeypatch.setattr(mod, "LARGE_PLAN_SIGHTINGS", 5)
    planned = []
    for _ in range(8):
        leaves, gdef = tied.flatten(model)
        # the walk's answer, whoever gave it: every weight once, the shared bias once
        assert len(leaves) == 41 and leaves[0] is weights[0] and leaves[1] is shared
        assert all(a is b for a, b in zip(leaves[2:], weights[1:]))
        out = tied.unflatten(gdef, leaves)
        assert all(c.b is out[0].b for c in out) and out[3].w is weights[3]
        planned.append(bool(gdef.memo.flatten_plan))
    # no plan at the second sighting (too large), one from the fifth on
    assert planned == [False, False, False, False, True, True, True, True]


def test_without_check_mode_the_plan_writes_into_a_replaced_layer(monkeypatch):
    net = Net([Norm(3), Norm(3)])
    step = tied.jit(lambda m, x: m(x))
    for _ in range(3):
        step(net, X)
    monkeypatch.setattr(_writeback, "CHECK_PLANS", False)
    old = net.layers[0]
    before = np.asarray(old.mean.value)
    net.layers[0] = Norm(3)
    step(net, X)
    np.testing.assert_array_equal(np.asarray(old.mean.value), before)
    m0 = np.float32(0.1) * np.asarray(X, np.float32).mean(0)
    np.testing.assert_allclose(np.asarray(net.layers[0].mean.value), m0, rtol=1e-6)


# ---------------------------------------------------------------- the compiled write-back


@tied.register
class _Lin:
    """A parameter and a call counter (State)."""

    def __init__(self, w):
        self.w = w
        self.calls = tied.State(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return jnp.tanh(x @ self.w)


def _tied_lins():
    a = _Lin(jnp.eye(3) * 0.5)
    b = _Lin(jnp.ones((3, 3)) * 0.1)
    return Net([a, b, a, {"first": a, "last": b}]), a, b


def _fused_plans(gdef):
    return list(gdef.memo.write_backs.values())


@pytest.mark.parametrize("check", [True, False])
def test_compiled_write_back_matches_a_numpy_replay_and_keeps_ties(monkeypatch, check):
    # update_inplace with Adam through the compiled write-back, against plain numpy Adam on
    # the two unique weights; the tied layers stay one object at both places
    import optax

    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    net, a, b = _tied_lins()
    tx = optax.adam(0.05)
    state = tied.optim.setup(tx, net)

    def loss(m, x):
        h = x
        for layer in (m.layers[0], m.layers[1], m.layers[2], m.layers[3]["last"]):
            h = layer(h)
        return jnp.sum(h**2)

    step = tied.jit(lambda m, s, x: tied.optim.update_inplace(s, m, tied.grad(loss)(m, x)))

    def np_loss_grads(wa, wb, x):
        # forward a, b, a, b with tanh; gradients by hand (backprop in numpy)
        hs, ws = [x], [wa, wb, wa, wb]
        for w in ws:
            hs.append(np.tanh(hs[-1] @ w))
        g = 2 * hs[-1]
        grads = [np.zeros_like(wa), np.zeros_like(wb)]
        for k in range(3, -1, -1):
            pre = g * (1 - hs[k + 1] ** 2)
            grads[k % 2] += hs[k].T @ pre
            g = pre @ ws[k].T
        return grads

    wa, wb = np.asarray(a.w, np.float64), np.asarray(b.w, np.float64)
    mom = [np.zeros_like(wa), np.zeros_like(wb)]
    vel = [np.zeros_like(wa), np.zeros_like(wb)]
    x = np.asarray(X[:, :3], np.float64)
    for t in range(1, 6):
        state = step(net, state, X[:, :3])
        grads = np_loss_grads(wa, wb, x)
        for k, g in enumerate(grads):
            mom[k] = 0.9 * mom[k] + 0.1 * g
            vel[k] = 0.999 * vel[k] + 0.001 * g**2
            upd = 0.05 * (mom[k] / (1 - 0.9**t)) / (np.sqrt(vel[k] / (1 - 0.999**t)) + 1e-8)
            if k == 0:
                wa = wa - upd
            else:
                wb = wb - upd
    assert _fused_plans(tied.flatten(((net, state, X[:, :3]), {}))[1]), "the compiled write-back ran"
    assert net.layers[0] is net.layers[2] is a and net.layers[3]["last"] is net.layers[1] is b
    np.testing.assert_allclose(np.asarray(a.w), wa, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(b.w), wb, rtol=2e-4, atol=1e-6)
    assert int(a.calls.value) == int(b.calls.value) == 10  # two calls a step, five steps


def _mutations():
    def look_alike(net, a, b):  # one place of a shared layer: a new layer holding the same
        twin = _Lin(a.w)
        twin.calls = tied.State(a.calls.value)
        net.layers[2] = twin

    def new_array(net, a, b):  # a parameter (never written) replaced
        a.w = jnp.array(a.w)

    def new_cell_value(net, a, b):  # the written cell's value replaced by an equal array
        b.calls.value = jnp.array(b.calls.value)

    def attribute_added(net, a, b):
        b.extra = 1

    def tie_made(net, a, b):
        net.layers[3]["last"] = a

    def tie_cut(net, a, b):
        net.layers[3] = {"first": a, "last": _Lin(b.w)}

    def keys_reordered(net, a, b):  # the same dict, its keys in another order
        d = net.layers[3]
        d["first"] = d.pop("first")

    return [look_alike, new_array, new_cell_value, attribute_added, tie_made, tie_cut, keys_reordered]


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_compiled_write_back_refuses_a_model_changed_during_the_call(monkeypatch, check, mutate):
    monkeypatch.setattr(_writeback, "CHECK_PLANS", check)
    net, a, b = _tied_lins()
    armed = {"on": False}

    def run(m, x):
        return m.layers[3]["last"](m.layers[2](m.layers[1](m.layers[0](x)))).sum()

    step = changing_during_the_call(run, armed, lambda: mutate(net, a, b))
    x = X[:, :3]
    for _ in range(3):
        step(net, x)
    assert _fused_plans(tied.flatten(((net, x), {}))[1]), "the compiled write-back is in place"
    assert int(a.calls.value) == int(b.calls.value) == 6
    cells = [layer.calls for layer in (net.layers[0], net.layers[1], net.layers[2], net.layers[3]["last"])]
    armed["on"] = True
    with pytest.raises(tied.ModelChangedError, match="while the call ran") as err:
        step(net, x)
        jax.effects_barrier()
    if mutate.__name__ == "keys_reordered":  # named where it happened
        assert str(err.value).startswith("args[0].layers[3]: its keys or fields")
        assert err.value.path == "[0][0].layers[3]"  # the core's path, carried apart from the message
    # nothing written: every cell the call was given keeps the count from before it
    assert all(int(c.value) == 6 for c in cells)
