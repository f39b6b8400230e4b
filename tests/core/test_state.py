"""State: `tied.State` and `tied.Rng` cells, and the write-back of `tied.jit` and `tied.grad`.

`tied.jit(f)(model)` must behave like `f(model)` run eagerly, mutations included, so
every test here runs the same function eagerly on an independent copy of the model
(built by hand, never by tied) and compares; statistics are replayed in numpy.
"""

import copy
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tied


@tied.register
class Norm:
    """A BatchNorm-like layer: a parameter and running statistics as State."""

    def __init__(self, n):
        self.scale = jnp.ones(n)
        self.mean = tied.State(jnp.zeros(n))
        self.calls = tied.State(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.mean.value = 0.9 * self.mean.value + 0.1 * x.mean(0)
        self.calls.value = self.calls.value + 1
        return (x - self.mean.value) * self.scale


@tied.register
class Net:
    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


X = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 7.0


def numpy_replay(n_calls_per_step, steps, x, scale=1.0):
    """Running mean of a Norm called ``n_calls_per_step`` times per step, replayed in numpy."""
    mean = np.zeros(3, np.float32)
    for _ in range(steps):
        h = np.asarray(x, np.float32)
        for k in range(n_calls_per_step):
            mean = np.float32(0.9) * mean + np.float32(0.1) * h.mean(0)
            h = (h - mean) * scale
            if k == 0:
                h = np.tanh(h)
    return mean


def loss(model, x=X):
    return jnp.sum(model(x) ** 2)


# ---------------------------------------------------------------- the cells


def test_state_refuses_python_numbers_and_shape_or_dtype_changes():
    with pytest.raises(TypeError, match=r"tied.State holds arrays, got int .*jnp.asarray\(3\)"):
        tied.State(3)
    s = tied.State(jnp.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(4,\).*float32.*shape \(3,\)"):
        s.value = jnp.zeros(4)
    with pytest.raises(ValueError, match=r"dtype int32 .*dtype float32"):
        s.value = jnp.zeros(3, jnp.int32)
    np.testing.assert_array_equal(s.value, np.zeros(3))  # nothing half-written


def test_state_value_is_never_differentiated():
    s = tied.State(jnp.zeros(()))

    def f(w):
        s.value = w * 3.0
        return s.value * w

    assert float(jax.grad(f)(jnp.float32(2.0))) == pytest.approx(6.0)  # d(stop(3w) * w)/dw = 3w


def test_rng_takes_ints_and_keys_refuses_floats():
    typed, raw = tied.Rng(jax.random.key(3)), tied.Rng(jax.random.PRNGKey(3))
    ref = jax.random.fold_in(jax.random.key(3), 0)
    np.testing.assert_array_equal(jax.random.key_data(typed()), jax.random.key_data(ref))
    np.testing.assert_array_equal(raw(), jax.random.fold_in(jax.random.PRNGKey(3), 0))
    for bad in (1.5, True, jnp.ones(2)):
        with pytest.raises(TypeError, match="tied.Rng takes an int seed or a JAX key"):
            tied.Rng(bad)


def test_state_is_never_a_parameter_nor_trained_and_paths_say_so():
    norm = Norm(3)
    model = Net(norm, norm)
    leaves, gdef = tied.flatten(model)
    paths = gdef.leaf_paths()
    state = dict(zip((p[0] for p in paths), gdef.state_leaves()))
    assert state == {".first.scale": False, ".first.mean.value": True, ".first.calls.value": True}
    assert tied.is_state(model, ".second.mean.value") and not tied.is_state(model, ".first.scale")
    assert tied.is_state(model, ".first.mean")
    g = tied.grad(loss)(model)
    assert g.first.mean.value is None and g.first.calls.value is None
    opt = tied.optim.setup(optax.adam(1e-2), model)
    assert all("mean" not in p and "calls" not in p for p in opt.paths)
    # trainable= never sees a state array
    seen = []
    tied.grad(loss, trainable=lambda p, x: seen.append(p) or True)(model)
    assert seen and all("mean" not in p and "calls" not in p for p in seen)


def test_one_array_as_parameter_and_state_is_refused_naming_both():
    w = jnp.ones(3)
    with pytest.raises(tied.GraphError, match=r"\['w'\] and \['s'\]\.value: one array is both"):
        tied.grad(lambda m: m["w"].sum())({"w": w, "s": tied.State(w)})


# ---------------------------------------------------------------- tied.jit writes back


def count_traces(fun):
    traces = []

    def counted(*a, **k):
        traces.append(1)
        return fun(*a, **k)

    return counted, traces


def test_shared_norm_called_twice_under_jit_updates_once_per_call_in_order():
    norm = Norm(3)
    model = Net(norm, norm)
    body, traces = count_traces(lambda m, x: tied.grad(loss)(m, x))
    step = tied.jit(body)
    for _ in range(3):
        g = step(model, X)
    assert len(traces) == 1  # a value change never retraces
    assert model.first is model.second is norm
    np.testing.assert_allclose(norm.mean.value, numpy_replay(2, 3, X), rtol=1e-5, atol=1e-6)
    assert int(norm.calls.value) == 6
    assert g.first.scale is g.second.scale


def test_state_written_in_grads_loss_applies_exactly_once_eager_and_jitted():
    for wrap in (lambda f: f, tied.jit):
        norm = Norm(3)
        model = Net(norm, Norm(3))
        vg = wrap(lambda m: tied.value_and_grad(loss)(m))
        vg(model)
        assert int(model.first.calls.value) == 1 and int(model.second.calls.value) == 1
        np.testing.assert_allclose(model.first.mean.value, 0.1 * np.asarray(X).mean(0), rtol=1e-6)


def test_parameter_replaced_inside_jit_is_written_back_as_eagerly():
    def f(m):
        m["a"]["w"] = m["a"]["w"] * 2.0  # the array is replaced at the place both dicts share
        return m["b"]["w"].sum()

    shared = {"w": jnp.arange(3.0)}
    eager = {"a": {"w": jnp.arange(3.0)}}
    eager["b"] = eager["a"]
    model = {"a": shared, "b": shared}
    out = tied.jit(f)(model)
    ref = f(eager)
    assert float(out) == float(ref) == 6.0
    assert model["a"] is model["b"]
    np.testing.assert_array_equal(model["b"]["w"], eager["b"]["w"])


def test_array_level_tie_given_one_new_array_stays_tied():
    w = jnp.ones(2)
    model = {"enc": {"w": w}, "dec": {"w": w}}

    def f(m):
        new = m["enc"]["w"] + 1
        m["enc"]["w"] = new
        m["dec"]["w"] = new

    tied.jit(f)(model)
    assert model["enc"]["w"] is model["dec"]["w"]
    np.testing.assert_array_equal(model["enc"]["w"], 2 * np.ones(2))


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda m: m["a"].__setitem__("w", m["a"]["w"] + 1), r"args\[0\]\['b'\]\['w'\]: the sharing changed"),
        (lambda m: m["a"].__setitem__("extra", jnp.ones(1)), r"args\[0\]\['a'\]\['extra'\]"),
        (lambda m: m["cfg"].__setitem__("k", 2), r"args\[0\]\['cfg'\]\['k'\]: a static value changed"),
    ],
)
def test_structure_changes_inside_jit_are_refused_with_the_caller_untouched(change, where):
    w = jnp.ones(2)
    model = {"a": {"w": w}, "b": {"w": w}, "cfg": {"k": 1}, "s": tied.State(jnp.zeros(()))}

    def f(m):
        m["s"].value = m["s"].value + 1  # a write that must not land either
        change(m)

    with pytest.raises(tied.GraphError, match=where + ".*nothing was written"):
        tied.jit(f)(model)
    assert model["a"]["w"] is w and model["b"]["w"] is w and model["cfg"] == {"k": 1}
    assert set(model["a"]) == {"w"} and float(model["s"].value) == 0.0


def test_an_exception_inside_f_leaves_the_callers_state_untouched():
    norm = Norm(3)

    def f(m, fail):
        m(X)
        if fail:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tied.jit(f, static_argnums=1)(norm, True)
    assert float(jnp.abs(norm.mean.value).sum()) == 0.0 and int(norm.calls.value) == 0
    tied.jit(f, static_argnums=1)(norm, False)
    assert int(norm.calls.value) == 1


def test_update_inplace_under_jit_trains_the_callers_model_like_optax_by_hand():
    w = jnp.array([[0.5, -0.3], [0.2, 0.1]])
    model = {"enc": {"w": w}, "dec": {"w": w}, "steps": tied.State(jnp.zeros((), jnp.int32))}

    def lossm(m):
        return jnp.sum((m["dec"]["w"] @ (m["enc"]["w"] @ X[:, :2].T)) ** 2)

    opt = tied.optim.setup(optax.adam(1e-2), model)

    @tied.jit
    def step(m, s):
        m["steps"].value = m["steps"].value + 1
        return tied.optim.update_inplace(s, m, tied.grad(lossm)(m))  # the model is not returned

    ref_w, tx = np.asarray(w), optax.adam(1e-2)
    ref_state = tx.init(jnp.asarray(ref_w))
    for _ in range(3):
        opt = step(model, opt)
        gw = jax.grad(lambda a: jnp.sum((a @ (a @ X[:, :2].T)) ** 2))(jnp.asarray(ref_w))
        upd, ref_state = tx.update(gw, ref_state)
        ref_w = np.asarray(optax.apply_updates(jnp.asarray(ref_w), upd))
    assert model["enc"]["w"] is model["dec"]["w"]
    np.testing.assert_allclose(model["enc"]["w"], ref_w, rtol=1e-5, atol=1e-6)
    assert int(model["steps"].value) == 3


def test_rng_shared_by_two_users_is_one_stream_across_calls():
    rng = tied.Rng(7)
    model = {"a": {"rng": rng}, "b": {"rng": rng}}
    body, traces = count_traces(lambda m: (m["a"]["rng"](), m["b"]["rng"]()))
    draw = tied.jit(body)
    key = jax.random.key(7)
    for call in range(5):
        ka, kb = draw(model)
        for k, i in ((ka, 2 * call), (kb, 2 * call + 1)):
            ref = jax.random.fold_in(key, i)
            np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(ref))
    assert len(traces) == 1 and int(rng.count.value) == 10


# ---------------------------------------------------------------- donation


def test_donated_argument_updated_in_place_stays_usable_and_matches_no_donation():
    def make():
        return {"w": jnp.arange(3.0), "keep": jnp.ones(2), "s": tied.State(jnp.zeros(3))}

    def f(m):
        m["s"].value = m["s"].value + m["w"]
        return m["keep"].sum()

    plain, donated = make(), make()
    for _ in range(3):
        a = tied.jit(f)(plain)
        b = tied.jit(f, donate_argnums=0)(donated)
        assert float(a) == float(b)
    np.testing.assert_array_equal(donated["s"].value, plain["s"].value)
    assert not donated["keep"].is_deleted() and not donated["w"].is_deleted()
    np.testing.assert_array_equal(donated["keep"], np.ones(2))


def test_donation_reads_every_place_so_a_kept_argument_keeps_a_shared_layer():
    d = {"weight": jnp.ones(3)}
    f = tied.jit(lambda a, b: a["layer"]["weight"] + b["layer"]["weight"], donate_argnums=0)
    out = f({"layer": d, "x": jnp.ones(3)}, {"layer": d})
    np.testing.assert_array_equal(out, 2 * np.ones(3))
    assert not d["weight"].is_deleted()


def test_donate_argnums_names_the_argument_however_it_is_passed():
    model = {"w": jnp.ones(3)}

    def f(m, x):
        return {"w": m["w"] * x}

    out = tied.jit(f, donate_argnums=0)(m=model, x=2.0)
    np.testing.assert_array_equal(out["w"], 2 * np.ones(3))
    assert model["w"].is_deleted()  # handed back as an updated copy: given up, as jax.jit does


# ---------------------------------------------------------------- the wrapper


def test_lower_and_methods():
    @tied.register
    class Layer:
        def __init__(self):
            self.w = jnp.ones(3)

        @tied.jit
        def apply(self, x):
            return self.w * x

    layer = Layer()
    np.testing.assert_array_equal(layer.apply(2.0), 2 * np.ones(3))
    lowered = tied.jit(lambda m, x: m.w * x).lower(layer, 2.0)
    assert "multiply" in lowered.as_text()
    assert lowered.compile().cost_analysis() is not None


def test_block_until_ready_reads_a_tied_model():
    d = {"w": jnp.ones(2)}
    model = [d, d]
    assert tied.block_until_ready(model) is model
    with pytest.raises(TypeError, match="tied.block_until_ready"):
        jax.block_until_ready(tied.nn.Chain(tied.nn.Dense(2, 2, key=jax.random.key(0))))


# ---------------------------------------------------------------- against the eager run, at random


@st.composite
def programs(draw):
    n_cells = draw(st.integers(1, 4))
    places = draw(st.lists(st.integers(0, n_cells - 1), min_size=n_cells, max_size=8))
    write = st.tuples(st.integers(0, len(places) - 1), st.floats(-2, 2, width=32))
    writes = draw(st.lists(write, max_size=6))
    order = draw(st.permutations(range(len(places))))
    return n_cells, places, writes, order


@given(programs())
def test_jit_write_back_equals_the_eager_run_on_random_sharing(program):
    n_cells, places, writes, order = program

    def build():
        cells = [tied.State(jnp.full((2,), float(i))) for i in range(n_cells)]
        model = {}
        for k in order:  # random key order
            model[f"p{k}"] = cells[places[k]]
        return model, cells

    def f(m):
        for place, c in writes:
            cell = m[f"p{place}"]
            cell.value = cell.value * c + 1.0

    eager, eager_cells = build()
    jitted, cells = build()
    jf = tied.jit(f)
    for _ in range(3):  # history: later calls run the compiled function (and write-back) on new values
        f(eager)
        jf(jitted)
    for k in range(len(places)):
        np.testing.assert_allclose(jitted[f"p{k}"].value, eager[f"p{k}"].value, rtol=1e-6, atol=1e-6)
        assert jitted[f"p{k}"] is cells[places[k]]


def test_readers_in_other_threads_see_whole_writes():
    """Issue 17, point 5: tied's own readers wait for a write in progress, without the
    caller taking tied.live_lock: never a tracer (tied.gradient), never a cut tie
    (update_inplace), never a half-written state (tied.jit's write-back)."""
    norm = Norm(3)
    w = jnp.ones((3, 3))
    model = {"net": Net(norm, norm), "enc": {"w": w}, "dec": {"w": w}}

    def lossm(m):
        return loss(m["net"]) + jnp.sum(m["enc"]["w"] * m["dec"]["w"])

    step = tied.jit(lambda m: tied.grad(lossm)(m))
    opt = tied.optim.setup(optax.adam(1e-2), model)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            snap = tied.map(lambda x: x, model)
            leaves, _ = tied.flatten(model)
            if any(isinstance(x, jax.core.Tracer) for x in leaves):
                bad.append("tracer")
            if snap["enc"]["w"] is not snap["dec"]["w"]:
                bad.append("tie cut")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(10):
            step(model)
            tied.gradient(lambda: lossm(model), tied.params(model))
            opt = tied.optim.update_inplace(opt, model, tied.grad(lossm)(model))
    finally:
        stop.set()
        t.join()
    assert not bad and int(norm.calls.value) == 60


def test_copy_of_a_model_keeps_its_own_state():
    norm = Norm(3)
    other = copy.deepcopy(norm)
    tied.jit(lambda m: m(X))(norm)
    assert int(norm.calls.value) == 1 and int(other.calls.value) == 0


def test_implicit_gradient_writes_state_back_concretely_and_restores_it_on_failure():
    norm = Norm(3)
    model = Net(norm, Norm(3))
    params = tied.params(model)
    grads = tied.gradient(lambda: loss(model), params)
    assert not any(isinstance(x, jax.core.Tracer) for x in tied.flatten(model)[0])
    assert int(norm.calls.value) == 1
    np.testing.assert_allclose(norm.mean.value, 0.1 * np.asarray(X).mean(0), rtol=1e-6)
    ref = tied.grad(loss)(copy.deepcopy(Net(Norm(3), Norm(3))))  # same values, fresh state
    np.testing.assert_allclose(grads[model.first.scale], ref.first.scale, rtol=1e-5)

    def failing():
        loss(model)
        raise RuntimeError("boom")

    before = np.asarray(norm.mean.value)
    with pytest.raises(RuntimeError, match="boom"):
        tied.gradient(failing, tied.params(model))
    assert not any(isinstance(x, jax.core.Tracer) for x in tied.flatten(model)[0])
    np.testing.assert_array_equal(norm.mean.value, before)


def test_a_loss_that_changes_the_models_structure_is_refused_naming_the_place():
    model = {"w": jnp.ones(2), "s": tied.State(jnp.zeros(()))}

    def lossf(m):
        m["s"].value = m["s"].value + 1
        m["extra"] = m["w"] * 2
        return m["w"].sum()

    message = r"^\['extra'\]: a place was added.*tied.grad: the loss changed"
    with pytest.raises(tied.GraphError, match=message):
        tied.grad(lossf)(model)
    assert set(model) == {"w", "s"} and float(model["s"].value) == 0.0


def test_a_state_holding_a_tuple_is_written_back_whole():
    s = tied.State((jnp.zeros(2), jnp.ones(2)))
    model = {"a": s, "b": [s]}

    @tied.jit
    def f(m):
        first, second = m["a"].value
        m["b"][0].value = (first + 1, second)

    f(model)
    f(model)
    assert model["a"] is model["b"][0] is s
    np.testing.assert_array_equal(s.value[0], 2 * np.ones(2))
    np.testing.assert_array_equal(s.value[1], np.ones(2))


def test_nnx_batch_stats_and_rng_counts_are_written_back_like_nnx_jit():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    ours, ref = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
    x = jnp.arange(6.0).reshape(2, 3)
    ours_step = tied.jit(lambda m: tied.grad(lambda m: m(x).sum())(m))
    ref_step = nnx.jit(lambda m: nnx.grad(lambda m: m(x).sum())(m))
    for _ in range(3):
        ours_step(ours)
        ref_step(ref)
    for kind in (nnx.BatchStat, nnx.RngCount):
        ours_v = jax.tree_util.tree_leaves(nnx.state(ours, kind))
        ref_v = jax.tree_util.tree_leaves(nnx.state(ref, kind))
        for a, b in zip(ours_v, ref_v, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(ours.drop.rngs.count[...]) == 3


def test_implicit_gradient_inside_an_outer_jit_over_a_captured_model_refuses_and_restores():
    norm = Norm(3)
    model = Net(norm, Norm(3))
    with pytest.raises(tied.GraphError, match="enclosing transform"):
        jax.jit(lambda x: tied.gradient(lambda: loss(model, x), tied.params(model))[model.first.scale])(X)
    assert not any(isinstance(x, jax.core.Tracer) for x in tied.flatten(model)[0])
    assert int(norm.calls.value) == 0
