"""BatchNorm under data parallelism: 8 fake CPU devices, in a process of their own.

Run by tests/nn/test_nn_state.py as ``python -m pytest tests/multidevice/batchnorm.py``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Three Adam steps with a
BatchNorm used at two places, the batch split over 8 devices by `tied.data_parallel`:
the batch mean and variance are over the global batch, so the running statistics (and
the parameters) equal those of the same steps on one device (themselves checked
against numpy and PyTorch in tests/nn/test_nn_state.py).
"""

import eight_devices  # noqa: F401  (first: 8 fake CPU devices, set before JAX is imported)

# isort: split

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied


def make():
    k1, k2 = jax.random.split(jax.random.key(0))
    bn = tied.nn.BatchNorm(4)
    conv = tied.nn.Conv2d(2, 4, 3, padding=1, key=k1, use_bias=False)  # BatchNorm follows
    return {"conv": conv, "bn": bn, "head": tied.nn.Dense(4, 3, key=k2), "again": bn}


def loss(m, x, y):
    h = jax.nn.relu(m["bn"](m["conv"](x)))
    h = m["again"](h)  # the shared BatchNorm, a second update in the same step
    logits = m["head"](h.mean((1, 2)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def step(m, s, x, y):
    # The forward pass inside the gradient updates the running statistics (twice: one
    # BatchNorm at two places); tied.value_and_grad writes them into the model once.
    value, g = tied.value_and_grad(loss)(m, x, y)
    m, s = tied.optim.update(s, m, g)
    return m, s, value


def run(shardings):
    model = make()
    state = tied.optim.setup(optax.adam(1e-2, eps=1e-5), model)  # eps: see tests/multidevice/sharded.py
    if shardings is None:
        f = tied.jit(step)
    else:
        dp = shardings
        model, state = tied.device_put((model, state), dp.replicated)
        f = tied.jit(
            step, in_shardings=(dp.replicated, dp.replicated, dp.batch, dp.batch), out_shardings=dp.replicated
        )
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = jnp.asarray(rng.normal(1.0, 2.0, (16, 5, 5, 2)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 3, 16))
        if shardings is not None:
            x, y = tied.device_put(x, dp.batch), tied.device_put(y, dp.batch)
        model, state, _ = f(model, state, x, y)
    return model


def test_data_parallel_running_statistics_equal_one_device():
    one = run(None)
    dp = tied.data_parallel()
    eight = run(dp)
    assert eight["bn"] is eight["again"]
    assert len(eight["bn"].running_mean.value.sharding.device_set) == 8
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(
            np.asarray(getattr(eight["bn"], name).value),
            np.asarray(getattr(one["bn"], name).value),
            atol=1e-5,
        )
    assert int(eight["bn"].num_batches_tracked.value) == int(one["bn"].num_batches_tracked.value) == 6
    assert not np.allclose(np.asarray(one["bn"].running_mean.value), 0.0)
    np.testing.assert_allclose(
        np.asarray(eight["conv"].weight), np.asarray(one["conv"].weight), rtol=1e-4, atol=1e-5
    )
