"""An optimiser state knows the Stack layout of the model it was set up for.

Shapes cannot tell a stacked array from a broadcast one whose leading axis is ``n``: an Adam
state set up for one layout would step the arrays of the other with the wrong moments, or load
into the state of the other, with no error. References: the layouts each test built (which
arrays it shared), and optax stepped by hand on the unrolled arrays.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied

N, D = 3, 3


def model(broadcast_b: bool):
    b = jnp.arange(N * D, dtype=jnp.float32).reshape(N, D)
    return tied.stack(
        [{"b": b if broadcast_b else jnp.full(D, float(i)), "w": jnp.full(D, float(i))} for i in range(N)]
    )


def loss(s):
    return (s.member["b"] ** 2).sum() + (s.member["w"] ** 3).sum()


def test_a_state_is_refused_for_a_model_stacked_otherwise():
    state = tied.optim.setup(optax.adam(0.1), model(True))
    other = model(False)
    with pytest.raises(
        ValueError, match=r"<root>: the optimiser state was set up for a model whose layout here"
    ):
        tied.optim.update(state, other, tied.grad(loss)(other))


def test_the_same_layout_steps_as_optax_on_the_arrays():
    m = model(True)
    state = tied.optim.setup(optax.adam(0.1), m)
    ref_params = {"b": m.member["b"], "w": m.member["w"]}
    tx = optax.adam(0.1)
    ref_state = tx.init(ref_params)
    for _ in range(3):
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        g = {"b": 2 * ref_params["b"], "w": 3 * ref_params["w"] ** 2}  # by hand
        u, ref_state = tx.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    np.testing.assert_allclose(m.member["b"], ref_params["b"], rtol=1e-6)
    np.testing.assert_allclose(m.member["w"], ref_params["w"], rtol=1e-6)
    assert all(layer["b"] is m.member["b"] for layer in tied.unstack(m))  # still one broadcast array


def test_a_state_saved_alone_is_refused_into_the_state_of_a_model_stacked_otherwise(tmp_path):
    m = model(True)
    state = tied.optim.setup(optax.adam(0.1), m)
    _, state = tied.optim.update(state, m, tied.grad(loss)(m))
    tied.save(tmp_path / "opt.safetensors", state)
    with pytest.raises(tied.CheckpointError, match=r"the layout at <root> differs: like has \{\"stacks\""):
        tied.load(tmp_path / "opt.safetensors", like=tied.optim.setup(optax.adam(0.1), model(False)))
    back = tied.load(tmp_path / "opt.safetensors", like=tied.optim.setup(optax.adam(0.1), model(True)))
    np.testing.assert_array_equal(
        back.inner_state[0].mu[".member['b']"], state.inner_state[0].mu[".member['b']"]
    )


def test_a_state_without_stacks_records_no_layout(tmp_path):
    # A model without a Stack: nothing recorded, so files without layouts load without a warning.
    state = tied.optim.setup(optax.adam(0.1), {"w": jnp.ones(2)})
    tied.save(tmp_path / "opt.safetensors", state)
    assert tied.flatten(state)[1].layouts() == []
    tied.load(tmp_path / "opt.safetensors", like=state)
