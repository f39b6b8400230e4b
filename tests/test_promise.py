"""Issue 17's core findings: statics compared so a rebuild is always the model's own,
arrays never hidden in a pytree's static data, and Equinox's constructor scans only."""

import dataclasses
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float
    act: Callable = dataclasses.field(compare=False, default=jnp.tanh)


class Block(eqx.Module):
    w: jax.Array
    cfg: Cfg = eqx.field(static=True)

    def __call__(self, x):
        return self.cfg.act(self.cfg.scale * x @ self.w)


def test_static_config_with_a_field_left_out_of_eq_is_never_taken_from_history():
    w = jnp.array([[0.3, -0.2], [0.1, 0.4]])
    x = jnp.array([[1.0, -1.0]])

    def loss(m):
        return jnp.sum(m(x) ** 2)

    first = tied.grad(loss)(Block(w, Cfg(3.0, jnp.tanh)))
    second_model = Block(w, Cfg(3.0, jax.nn.relu))
    second = tied.grad(loss)(second_model)
    ref = jax.grad(lambda w: jnp.sum(jax.nn.relu(3.0 * x @ w) ** 2))(w)  # plain JAX, by hand
    np.testing.assert_allclose(second.w, ref, rtol=1e-6)
    assert not np.allclose(first.w, second.w)
    jitted = tied.jit(lambda m: m(x))
    np.testing.assert_allclose(jitted(Block(w, Cfg(3.0, jnp.tanh))), jnp.tanh(3.0 * x @ w), rtol=1e-6)
    np.testing.assert_allclose(jitted(second_model), jax.nn.relu(3.0 * x @ w), rtol=1e-6)


def test_static_config_keeps_its_sign_of_zero():
    w = jnp.ones((2, 2))
    tied.flatten(Block(w, Cfg(0.0)))
    leaves, gdef = tied.flatten(Block(w, Cfg(-0.0)))
    out = tied.unflatten(gdef, leaves)
    assert np.signbit(out.cfg.scale)


def test_equal_static_configs_still_share_a_compiled_function():
    @dataclasses.dataclass(frozen=True)
    class Plain:
        scale: float

    class B(eqx.Module):
        w: jax.Array
        cfg: Plain = eqx.field(static=True)

    traces = []

    def f(m):
        traces.append(1)
        return m.w * m.cfg.scale

    g = tied.jit(f)
    g(B(jnp.ones(2), Plain(2.0)))
    g(B(jnp.ones(2), Plain(2.0)))  # a new, equal config: compared field by field
    assert len(traces) == 1
