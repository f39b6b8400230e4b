"""Other libraries' state and flags: Equinox's ``eqx.nn.State`` is state, never a parameter; `tied.nn.mode`
switches Flax NNX and Equinox layers as their own libraries do.

References are the peer libraries themselves: parameters counted with ``eqx.filter(model,
eqx.is_inexact_array)``, an optax rule stepped by hand on the Equinox parameters only, the names
Equinox prints for its state, NNX's own ``.eval()`` / ``.train()`` on a clone, Equinox's own
``eqx.nn.inference_mode``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")

X = jax.random.normal(jax.random.key(7), (5, 3))


def eqx_model():
    """A Linear, tanh, then a BatchNorm (running statistics in an ``eqx.nn.State``), as Equinox's docs
    make it."""
    return eqx.nn.make_with_state(
        lambda: eqx.nn.Sequential(
            [
                eqx.nn.Linear(3, 3, key=jax.random.key(0)),
                eqx.nn.Lambda(jnp.tanh),  # so that the Linear's bias has a gradient through the norm
                eqx.nn.BatchNorm(3, "batch", mode="ema"),
            ]
        )
    )()


def forward(model, state, x):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]


# ---------------------------------------------------------------- point 9: eqx.nn.State is state


def test_equinox_state_is_not_counted_as_parameters_and_reads_as_equinox_names_it():
    model, state = eqx_model()
    want = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert want == 3 * 3 + 3 + 3 + 3
    assert tied.param_count((model, state)) == want
    _, gdef = tied.flatten((model, state))
    paths = [p for ps in gdef.leaf_paths() for p in ps]
    is_state = [tied.is_state((model, state), p) for p in paths]
    state_paths = [p for p, s in zip(paths, is_state) if s]
    assert len(state_paths) == len(jax.tree_util.tree_leaves(state))
    assert all(p.startswith("[1]") for p in state_paths) and not any(
        s for p, s in zip(paths, is_state) if p.startswith("[0]")
    )
    # Each path names its entry as Equinox prints the state (its StateIndex's name), not a flat index.
    shown = repr(state)
    assert all("flat index" not in p for p in paths)
    for p in state_paths:
        name = p.split("['", 1)[1].split("']", 1)[0]
        assert f"{name}=" in shown, (p, shown)
    rows = {line.split()[0]: line for line in tied.summary((model, state)).splitlines()[1:] if line.strip()}
    for p in state_paths:
        assert rows[p].split()[2] == "state", rows[p]


def test_an_optimiser_steps_the_equinox_parameters_only():
    """adamw over (model, state): the parameters move exactly as optax stepped by hand on
    eqx.filter(model, eqx.is_inexact_array) moves them; the running statistics stay, bit for bit."""
    model, state = eqx_model()
    model, state = model, forward(model, state, X)[1]  # running statistics that are not zeros and ones
    before = arrays(state)

    def loss(pair):
        m, s = pair
        out, _ = forward(m, s, X)
        return jnp.sum(jnp.tanh(out) ** 2)

    tx = optax.adamw(0.1)
    opt = tied.optim.setup(tx, (model, state))
    pair = (model, state)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    ref_state = tx.init(params)
    for _ in range(2):
        grads = tied.grad(loss)(pair)
        pair, opt = tied.optim.update(opt, pair, grads)
        g_ref = jax.grad(lambda p: loss((eqx.combine(p, static), state)))(params)
        updates, ref_state = tx.update(g_ref, ref_state, params)
        params = optax.apply_updates(params, updates)
    new_model, new_state = pair
    for got, want in zip(arrays(eqx.filter(new_model, eqx.is_inexact_array)), arrays(params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(new_state), before))
    assert not any(np.array_equal(a, b) for a, b in zip(arrays(new_model.layers[0]), arrays(model.layers[0])))
    assert tied.param_count(pair) == tied.param_count(new_model)


def test_a_jitted_equinox_training_step_carries_its_state_and_steps_only_parameters():
    """One tied.jit step: loss and new running statistics from the forward pass, momentum on the rest;
    equals the same step eagerly (tied.grad, tied.optim) and the state equals Equinox's own."""
    model, state = eqx_model()
    tx = optax.sgd(0.05, momentum=0.9)

    def step(pair, opt):
        m, s = pair

        def loss(m):
            out, new_s = forward(m, s, X)
            return jnp.sum(out**2), new_s

        (_, new_s), g = tied.value_and_grad(loss, has_aux=True)(m)
        m, opt = tied.optim.update(opt, m, g)
        return (m, new_s), opt

    opt = tied.optim.setup(tx, model)
    jitted = tied.jit(step)((model, state), opt)
    eager = step((model, state), opt)
    for a, b in zip(arrays(jitted), arrays(eager)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # XLA reorders float32 sums
    own = forward(model, state, X)[1]  # Equinox's own update of the running statistics
    for a, b in zip(arrays(jitted[0][1]), arrays(own)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_equinox_state_saves_and_restores(tmp_path):
    model, state = eqx_model()
    state = forward(model, state, X)[1]
    tied.save(str(tmp_path / "m.safetensors"), (model, state))
    fresh = eqx_model()
    back = tied.load(str(tmp_path / "m.safetensors"), fresh)
    assert type(back[1]) is type(state)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(back), arrays((model, state))))
    out, _ = forward(back[0], back[1], X)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(forward(model, state, X)[0]))


# ---------------------------------------------------------------- point 11: mode on NNX and Equinox


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.drop(self.lin(x)))


def test_mode_switches_nnx_dropout_and_batchnorm_off_as_eval_does():
    m = Net(nnx.Rngs(0))
    m(X)  # the running statistics move off their start
    ref = nnx.clone(m)
    ref.eval()
    ev = tied.nn.mode(m, False)
    np.testing.assert_array_equal(np.asarray(ev(X)), np.asarray(ref(X)))
    np.testing.assert_array_equal(np.asarray(ev(X)), np.asarray(ref(X)))  # no randomness: twice alike
    assert ev.drop.deterministic is True and ev.bn.use_running_average is True
    # The caller's model is not switched; its Variables are shared with the eval copy.
    assert m.drop.deterministic is False and m.bn.use_running_average is False
    assert ev.lin.kernel is m.lin.kernel and ev.bn.mean is m.bn.mean and ev.lin is m.lin


def test_mode_back_to_training_matches_nnx_train():
    m = Net(nnx.Rngs(1))
    m.eval()
    ref = nnx.clone(m)
    ref.train()
    tr = tied.nn.mode(m, True)
    assert tr.drop.deterministic is False and m.drop.deterministic is True
    np.testing.assert_allclose(np.asarray(tr(X)), np.asarray(ref(X)), rtol=1e-6)  # one dropout mask
    np.testing.assert_allclose(np.asarray(m.bn.mean[...]), np.asarray(ref.bn.mean[...]), rtol=1e-6)
    assert tied.nn.mode(tr, True) is tr  # already in that mode: the model itself


def test_mode_sets_equinox_inference_as_inference_mode_does():
    em = eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Dropout(0.5)])
    ev = tied.nn.mode(em, False)
    ref = eqx.nn.inference_mode(em)
    key = jax.random.key(3)
    out = jax.vmap(lambda x: ev(x, key=key))(X)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.vmap(lambda x: ref(x, key=key))(X)))
    assert ev.layers[1].inference is True and em.layers[1].inference is False
    assert ev.layers[0] is em.layers[0]
    back = tied.nn.mode(ev, True)
    assert back.layers[1].inference is False
    own = eqx.nn.inference_mode(ref, value=False)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda x: back(x, key=key))(X)),
        np.asarray(jax.vmap(lambda x: own(x, key=key))(X)),
    )


class Counter(eqx.Module):
    """A layer that calls ``state.set`` itself (not under vmap): Equinox then invalidates the old State."""

    index: eqx.nn.StateIndex
    lin: eqx.nn.Linear

    def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.zeros(()))
        self.lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))

    def __call__(self, x, state):
        c = state.get(self.index)
        return self.lin(x) * c, state.set(self.index, c + 1)


def test_equinox_state_set_under_tied_jit_is_refused_clearly_or_works_on_a_clone():
    """Equinox's State.set invalidates the State it was called on. Given as an argument to tied.jit, that
    is a change of the argument's structure: refused, naming the place, the caller's state still valid.
    Cloned first (Equinox's own advice), the step runs and counts as Equinox does eagerly."""
    model, state = eqx.nn.make_with_state(Counter)()
    x = jnp.ones(2)
    with pytest.raises(tied.GraphError, match=r"args\[1\]\._state: a dict became"):
        tied.jit(lambda m, s: m(x, s))(model, state)
    assert float(state.get(model.index)) == 0.0  # untouched, still usable
    step = tied.jit(lambda m, s: m(x, jax.tree_util.tree_map(lambda a: a, s)))
    _, eager = model(x, jax.tree_util.tree_map(lambda a: a, state))
    out, s1 = step(model, state)
    out, s2 = step(model, s1)
    assert float(s2.get(model.index)) == 2.0 and float(eager.get(model.index)) == 1.0
    np.testing.assert_allclose(np.asarray(out), np.asarray(model.lin(x)), rtol=1e-6)
