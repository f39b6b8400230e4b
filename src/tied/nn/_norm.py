"""Normalisation: `LayerNorm`, `RMSNorm` and `BatchNorm` (running statistics as `tied.State`, PyTorch's
conventions: the semantics page says why)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from .._core import State, materialize
from .._tree import register
from ._checks import _check_size, _features


@register
class LayerNorm:
    """Layer normalisation over the last axis, with a learned scale and shift.

    ``(x - mean) / sqrt(var + eps) * weight + bias``; ``weight`` starts at ones,
    ``bias`` at zeros (no key needed).

    Args:
        dim: the size of the last axis.
        eps: added to the variance.
        use_weight: whether to learn a scale.
        use_bias: whether to learn a shift.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense, LayerNorm
        >>> ln = LayerNorm(16)
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> model = Chain(Dense(16, 16, key=k1), ln, Dense(16, 16, key=k2), ln)   # one norm, twice
        >>> tied.ties(model)
        [('.layers[1]', '.layers[3]')]
        >>> y = ln(jnp.arange(16.0))
        >>> bool(jnp.allclose(y.mean(), 0.0, atol=1e-6)), bool(jnp.allclose(y.std(), 1.0, atol=1e-3))
        (True, True)
    """

    weight: Any
    bias: Any
    eps: float

    def __init__(self, dim: int, *, eps: float = 1e-5, use_weight: bool = True, use_bias: bool = True):
        self.weight = jnp.ones((dim,)) if use_weight else None
        self.bias = jnp.zeros((dim,)) if use_bias else None
        self.eps = float(eps)

    def __call__(self, x: Any) -> Any:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * materialize(self.weight)
        if self.bias is not None:
            y = y + materialize(self.bias)
        return y


@register
class BatchNorm:
    """Batch normalisation over every axis but the last, with running statistics as state.

    In training mode (``training=True``, the default) the batch is normalised with its
    own mean and biased variance, and the running statistics move as in PyTorch:
    ``running = (1 - momentum) * running + momentum * batch``, the variance unbiased
    (times ``n / (n - 1)``), and ``num_batches_tracked`` counts the calls. In eval mode
    (`tied.nn.mode` ``(model, False)``) the running statistics are used and nothing
    changes. The statistics are `tied.State`: never trained, never in an optimiser; a
    BatchNorm used at two places is one set of statistics, updated at each call.

    Args:
        num_features: the size of the last axis.
        momentum: the weight of the new batch in the running statistics.
        eps: added to the variance.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> bn = tied.nn.BatchNorm(2)
        >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
        >>> y = bn(x)                                   # normalised with the batch's statistics
        >>> bn.running_mean.value, bn.running_var.value, int(bn.num_batches_tracked.value)
        (Array([0.1, 0.3], dtype=float32), Array([1.1, 1.7], dtype=float32), 1)
        >>> tied.is_state(bn, ".running_mean.value"), tied.param_count(bn)   # weight and bias
        (True, 4)
    """

    weight: Any
    bias: Any
    running_mean: State
    running_var: State
    num_batches_tracked: State
    momentum: float
    eps: float
    training: bool

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5):
        n = _check_size("BatchNorm", "num_features", num_features)
        if not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"BatchNorm: momentum must be in [0, 1], got {momentum!r}.")
        self.weight = jnp.ones((n,))
        self.bias = jnp.zeros((n,))
        self.running_mean = State(jnp.zeros((n,)))
        self.running_var = State(jnp.ones((n,)))
        self.num_batches_tracked = State(jnp.zeros((), jnp.int32))
        self.momentum = float(momentum)
        self.eps = float(eps)
        self.training = True

    @property
    def num_features(self) -> int:
        return tuple(self.running_mean.value.shape)[0]

    def __call__(self, x: Any) -> Any:
        n = self.num_features
        _features("BatchNorm", x, n)
        if self.training:
            count = math.prod(x.shape[:-1])
            if count < 2:
                raise ValueError(
                    f"BatchNorm({n}): training needs more than one value per feature, got an input "
                    f"of shape {tuple(x.shape)}. Use a larger batch, or eval mode "
                    "(tied.nn.mode(model, False)) to use the running statistics."
                )
            axes = tuple(range(x.ndim - 1))
            mean = jnp.mean(x, axis=axes)
            var = jnp.mean(jnp.square(x - mean), axis=axes)  # biased: what normalises the batch
            m = self.momentum
            old_mean, old_var = self.running_mean.value, self.running_var.value
            self.running_mean.value = ((1 - m) * old_mean + m * mean).astype(old_mean.dtype)
            unbiased = var * (count / (count - 1))
            self.running_var.value = ((1 - m) * old_var + m * unbiased).astype(old_var.dtype)
            self.num_batches_tracked.value = self.num_batches_tracked.value + 1
        else:
            mean, var = self.running_mean.value, self.running_var.value
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return y * materialize(self.weight) + materialize(self.bias)


@register
class RMSNorm:
    """Root-mean-square normalisation over the last axis: ``x / sqrt(mean(x**2) + eps) * weight``.

    ``weight`` starts at ones; there is no shift and no mean is subtracted.

    Args:
        dim: the size of the last axis.
        eps: added to the mean square.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> y = tied.nn.RMSNorm(4)(jnp.array([1.0, -1.0, 3.0, -3.0]))   # mean square 5
        >>> bool(jnp.allclose(y, jnp.array([1.0, -1.0, 3.0, -3.0]) / jnp.sqrt(5.0)))
        True
    """

    weight: Any
    eps: float

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((_check_size("RMSNorm", "dim", dim),))
        self.eps = float(eps)

    def __call__(self, x: Any) -> Any:
        w = materialize(self.weight)
        _features("RMSNorm", x, w.shape[0])
        return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps) * w
