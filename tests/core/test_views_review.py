"""A review of views under the lifted transforms: found defects, each against the unrolled loop."""

import jax
import jax.numpy as jnp
import numpy as np

import tied
from tied.nn import Dense


def test_grad_of_scan_over_members_that_each_transpose_one_broadcast_array():
    w = jax.random.normal(jax.random.key(0), (5, 4))
    keys = jax.random.split(jax.random.key(1), 3)
    model = {
        "blocks": tied.stack([{"d": Dense(tied.transpose(w)), "o": Dense(4, 4, key=k)} for k in keys]),
        "w": w,
    }

    def step(h, layer, x):
        return jnp.tanh(layer["o"](h)) + layer["d"](jnp.ones(5)), None

    def scanned(m):
        return (tied.scan(step, jnp.zeros((2, 4)), m["blocks"])[0] ** 2).sum()

    def hand(w, os):  # the unrolled loop in plain JAX, the weight used transposed by every member
        h = jnp.zeros((2, 4))
        for ow, ob in os:
            h = jnp.tanh(h @ ow.T + ob) + jnp.ones(5) @ w
        return (h**2).sum()

    members = [(m["o"].weight, m["o"].bias) for m in tied.unstack(model["blocks"])]
    np.testing.assert_allclose(scanned(model), hand(w, members), rtol=1e-5)
    g = tied.grad(scanned)(model)
    np.testing.assert_allclose(g["w"], jax.grad(hand)(w, members), rtol=1e-4, atol=1e-5)
