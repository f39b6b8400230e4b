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


# ---------------------------------------------------------------- arrays in static data (point 1)


class Holder(eqx.Module):
    layer: tied.nn.Dense = eqx.field(static=True)
    lin: eqx.nn.Linear


def test_a_tied_layer_in_an_equinox_static_field_is_refused_naming_its_path():
    dense = tied.nn.Dense(2, 2, key=jax.random.key(0))
    h = Holder(dense, eqx.nn.Linear(2, 2, key=jax.random.key(1)))
    message = r"<root>: the static \(auxiliary\) data of this Holder holds arrays or a tied layer"
    for use in (tied.param_count, lambda m: tied.grad(lambda m: m.lin(jnp.ones(2)).sum())(m), tied.flatten):
        with pytest.raises(tied.GraphError, match=message):
            use(h)
    with pytest.raises(tied.GraphError, match=r"^\['h'\]: the static"):
        tied.flatten({"h": h})


def test_an_equinox_layer_in_a_static_field_is_refused_too():
    class H(eqx.Module):
        inner: eqx.nn.Linear = eqx.field(static=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox's own "JAX array set as static" warning
        h = H(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    with pytest.raises(tied.GraphError, match="drop eqx.field\\(static=True\\)"):
        tied.flatten(h)


def test_equinox_modules_may_hold_tied_layers_as_regular_fields():
    class Wrap(eqx.Module):
        layer: tied.nn.Dense
        scale: float = eqx.field(static=True, default=2.0)

        def __call__(self, x):
            return self.scale * self.layer(x)

    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    model = [Wrap(d), Wrap(d)]
    g = tied.grad(lambda m: (m[0](jnp.ones(2)) + m[1](jnp.ones(2))).sum())(model)
    ref = jax.grad(lambda w: 2 * (2.0 * (jnp.ones(2) @ w.T + d.bias)).sum())(d.weight)
    assert g[0].layer.weight is g[1].layer.weight
    np.testing.assert_allclose(g[0].layer.weight, ref, rtol=1e-6)


def test_plain_jax_inside_a_modules_own_init_still_refuses_a_tied_layer():
    seen = []

    class Init(eqx.Module):
        layer: tied.nn.Dense

        def __init__(self, layer):
            try:
                jax.tree_util.tree_leaves(layer)
            except TypeError as e:
                seen.append(str(e))
            self.layer = layer

    class Check(eqx.Module):
        layer: tied.nn.Dense

        def __check_init__(self):
            try:
                jax.tree_util.tree_leaves(self.layer)
            except TypeError as e:
                seen.append(str(e))

    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    Init(d)
    Check(d)
    assert len(seen) == 2 and all("tied.grad" in m for m in seen)
