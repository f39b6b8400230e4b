"""Mixed precision through `tied.map(..., only="params")` (issue 36, item 2): float32 masters,
bfloat16 compute, float32 statistics written through the bfloat16 copy into the model, and one
float32 total gradient per tie.

References: the same model trained in float32 (statistics), and plain `jax.grad` of a function of
untied arrays written by hand, summed over the tie's two places by hand (gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied.nn import BatchNorm


def _model():
    emb = jax.random.normal(jax.random.key(0), (6, 4))
    return {"emb": emb, "bn": BatchNorm(4), "head": emb}  # the head tied to the embedding


def _loss(compute):
    def loss(m, ids, labels):
        h = tied.map(lambda x: x.astype(compute), m, only="params")  # state cells: the model's own
        z = h["bn"](h["emb"][ids])
        logits = (z @ h["head"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def _batches():
    keys = jax.random.split(jax.random.key(1), 3)
    return [(jax.random.randint(k, (8,), 0, 6), jax.random.randint(k, (8,), 0, 6)[::-1]) for k in keys]


def _hand_loss(e_in, e_head, w, b, ids, labels, compute):
    """The loss of one batch from untied arrays, BatchNorm written out (PyTorch's training mode)."""
    c = lambda x: x.astype(compute)
    x = c(e_in)[ids]
    mean = x.mean(0)
    var = jnp.square(x - mean).mean(0)
    z = (x - mean) * jax.lax.rsqrt(var + 1e-5) * c(w) + c(b)
    logits = (z @ c(e_head).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("route", ["eager", "grad", "jit"])
def test_bfloat16_compute_keeps_float32_state_moving_and_one_float32_total_per_tie(route):
    runs = {}
    for compute in (jnp.bfloat16, jnp.float32):
        model = _model()
        loss = _loss(compute)
        step = {"eager": loss, "grad": tied.grad(loss), "jit": tied.jit(tied.grad(loss))}[route]
        opt = tied.optim.setup(optax.adam(1e-2), model)
        for ids, labels in _batches():
            e, w, b = model["emb"], model["bn"].weight, model["bn"].bias
            out = step(model, ids, labels)
            if route == "eager":
                continue
            g = out
            assert g["emb"] is g["head"] and g["emb"].dtype == jnp.float32  # one float32 total
            gi, gh, gw, gb = jax.grad(_hand_loss, argnums=(0, 1, 2, 3))(e, e, w, b, ids, labels, compute)
            tol = 3e-2 if compute == jnp.bfloat16 else 1e-5
            np.testing.assert_allclose(g["emb"], gi + gh, rtol=tol, atol=tol)  # summed by hand
            np.testing.assert_allclose(g["bn"].weight, gw, rtol=tol, atol=tol)
            model, opt = tied.optim.update(opt, model, g)
            assert model["head"] is model["emb"] and model["emb"].dtype == jnp.float32
        bn = model["bn"]
        assert int(bn.num_batches_tracked.value) == 3  # written through the bfloat16 copy
        assert bn.running_mean.value.dtype == bn.running_var.value.dtype == jnp.float32
        assert not np.allclose(bn.running_mean.value, 0.0) and not np.allclose(bn.running_var.value, 1.0)
        runs[compute] = model
    lo, hi = runs[jnp.bfloat16]["bn"], runs[jnp.float32]["bn"]
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(lo, name).value, getattr(hi, name).value, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(runs[jnp.bfloat16]["emb"], runs[jnp.float32]["emb"], rtol=5e-2, atol=5e-2)


def test_an_unfiltered_cast_would_not_reach_the_model_and_only_params_keeps_the_cells():
    model = _model()
    half = tied.map(lambda x: x.astype(jnp.bfloat16), model, only="params")
    bn = model["bn"]
    assert half["bn"] is not bn and half["bn"].weight.dtype == jnp.bfloat16
    assert (
        half["bn"].running_mean is bn.running_mean
        and half["bn"].num_batches_tracked is bn.num_batches_tracked
    )
    assert half["emb"] is half["head"]
    everything = tied.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, model)
    assert everything["bn"].running_mean is not bn.running_mean  # new arrays: new cells
    assert everything["bn"].running_mean.value.dtype == jnp.bfloat16
