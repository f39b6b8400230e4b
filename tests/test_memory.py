"""Memory: one gradient and one optimiser state per unique parameter, never one per place.

Measured from the bytes of distinct device buffers (an aliased gradient counts once),
against the same model as a plain pytree (one array per place), built here by hand.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import tied
from tied.nn import Chain, Dense

LAYERS = 12


def distinct_bytes(arrays) -> int:
    """Bytes of distinct device buffers among ``arrays`` (aliased arrays counted once)."""
    seen, total = set(), 0
    for a in arrays:
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact):
            ptr = a.unsafe_buffer_pointer()
            if ptr not in seen:
                seen.add(ptr)
                total += a.nbytes
    return total


def albert(key):
    block = Dense(16, 16, key=key, activation=jnp.tanh)
    return Chain(*([block] * LAYERS))  # one block at every layer


def loss(model, x):
    return jnp.sum(model(x) ** 2)


@pytest.fixture(scope="module")
def measured():
    model = albert(jax.random.key(0))
    x = jnp.ones((4, 16))
    leaves, _ = tied.flatten(model)
    unique = distinct_bytes(leaves)
    grads = tied.jit(tied.grad(loss))(model, x)
    state = tied.optim.setup(optax.adam(1e-3), model)
    tied_bytes = distinct_bytes(tied.flatten(grads)[0]) + distinct_bytes(
        jax.tree_util.tree_leaves(state.inner_state)
    )
    # The naive pytree: every place its own weight and bias, as jax.tree_util would hold it.
    block = model.layers[0]
    naive = [(jnp.array(block.weight), jnp.array(block.bias)) for _ in range(LAYERS)]

    def naive_loss(params, x):
        for w, b in params:
            x = jnp.tanh(x @ w.T + b)
        return jnp.sum(x**2)

    naive_grads = jax.jit(jax.grad(naive_loss))(naive, x)
    naive_state = optax.adam(1e-3).init(naive)
    naive_bytes = distinct_bytes(jax.tree_util.tree_leaves(naive_grads)) + distinct_bytes(
        jax.tree_util.tree_leaves(naive_state)
    )
    return unique, tied_bytes, naive_bytes


def test_adam_memory_is_three_times_the_unique_parameters(measured):
    unique, tied_bytes, naive_bytes = measured
    assert tied_bytes == 3 * unique  # one gradient, one mu, one nu per unique parameter
    assert naive_bytes == 3 * LAYERS * unique  # the same at every place


def test_the_gradient_of_a_shared_block_is_one_buffer():
    model = albert(jax.random.key(1))
    g = tied.jit(tied.grad(loss))(model, jnp.ones((2, 16)))
    weights = [layer.weight for layer in g.layers]
    assert all(w is weights[0] for w in weights)
    assert distinct_bytes(weights) == model.layers[0].weight.nbytes
