"""Layers with state or a train/eval mode, and two stateless ones; re-exported by `tied.nn`.

`BatchNorm` (running statistics as `tied.State`), `Dropout` (draws from a
`tied.Rng`), `KVCache` (keys and values of a decoder, for
`CausalSelfAttention.decode`), `Conv2d` and `RMSNorm`, and `mode`, which sets every
``training`` flag of a model. Features last (NHWC for images), as in the rest of
`tied.nn`. Conventions follow PyTorch for BatchNorm and Flax NNX for Dropout's mask;
the semantics page says why.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import Places, Rng, State, View, flatten, get, materialize, put, rebuild
from .._tree import register

__all__ = ["BatchNorm", "Dropout", "Conv2d", "RMSNorm", "KVCache", "mode"]


def _is_size(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, View))


def _check_size(who: str, name: str, x: Any) -> int:
    if not _is_size(x) or x < 1:
        raise TypeError(f"{who}: {name} must be a positive int, got {x!r}.")
    return int(x)


def _features(who: str, x: Any, n: int) -> None:
    if x.ndim < 1 or x.shape[-1] != n:
        raise ValueError(
            f"{who}: the input's last axis (features) has size {x.shape[-1] if x.ndim else None}, "
            f"expected {n}. tied.nn is features last: images are (batch, height, width, channels)."
        )


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
class Dropout:
    """Inverted dropout drawing from a `tied.Rng`: identity in eval mode.

    In training mode each call draws one key from ``rng`` and keeps ``x`` where
    ``jax.random.bernoulli(key, 1 - rate, x.shape)``, divided by ``1 - rate`` (Flax
    NNX's mask); elsewhere it is zero. In eval mode it returns ``x`` and draws
    nothing (the stream does not advance). One `tied.Rng` given to several layers is
    one stream: each call takes the next key.

    Args:
        rate: the probability of dropping a value, in ``[0, 1]``.
        rng: the random stream, a `tied.Rng`.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> rng = tied.Rng(0)
        >>> d1, d2 = tied.nn.Dropout(0.5, rng), tied.nn.Dropout(0.5, rng)   # one stream
        >>> y = d2(d1(jnp.ones(1000)))
        >>> sorted(set(y.tolist())), int(rng.count.value)     # dropped, or kept times 2 twice
        ([0.0, 4.0], 2)
        >>> tied.nn.mode(d1, training=False)(jnp.ones(3)), int(rng.count.value)
        (Array([1., 1., 1.], dtype=float32), 2)
    """

    rate: float
    rng: Rng
    training: bool

    def __init__(self, rate: float, rng: Rng):
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
            raise TypeError(f"Dropout: rate must be a number in [0, 1], got {rate!r}.")
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"Dropout: rate must be in [0, 1], got {rate!r}.")
        if not isinstance(rng, Rng):
            raise TypeError(
                f"Dropout(rate, rng): rng must be a tied.Rng, got {type(rng).__name__}. Pass a "
                "stream, e.g. Dropout(0.1, tied.Rng(0)); give the same Rng to several layers for "
                "one stream."
            )
        self.rate = float(rate)
        self.rng = rng
        self.training = True

    def __call__(self, x: Any) -> Any:
        if not self.training or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.rng(), keep, x.shape)
        return jax.lax.select(mask, x / keep, jnp.zeros_like(x))


def _pair(who: str, name: str, v: Any) -> tuple[int, int]:
    if _is_size(v):
        return int(v), int(v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_size(u) for u in v):
        return int(v[0]), int(v[1])
    raise TypeError(f"{who}: {name} must be an int or a pair of ints, got {v!r}.")


def _padding(v: Any) -> Any:
    if isinstance(v, str):
        if v.upper() not in ("SAME", "VALID"):
            raise ValueError(f"Conv2d: padding must be an int, a pair, 'SAME' or 'VALID', got {v!r}.")
        return v.upper()
    ph, pw = _pair("Conv2d", "padding", v)
    if ph < 0 or pw < 0:
        raise ValueError(f"Conv2d: padding must not be negative, got {v!r}.")
    return ph, pw


@register
class Conv2d:
    """A 2-d convolution on NHWC input with an HWIO ``weight`` (`jax.lax.conv_general_dilated`).

    Two ways to build one, as with `Dense`:

    * ``Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, *, key)``:
      new parameters, weight ``(kh, kw, in, out)`` and bias ``(out,)`` uniform in
      ``±1/sqrt(in * kh * kw)`` (PyTorch's default);
    * ``Conv2d(weight, bias=None, stride=1, padding=0)``: from existing arrays (or
      views), which is how two convolutions share a kernel.

    Args:
        in_channels: the input channels, or the weight array ``(kh, kw, in, out)``.
        out_channels: the output channels, or the bias array ``(out,)`` (None: no bias).
        kernel_size: an int or a pair (with sizes only).
        stride: an int or a pair.
        padding: an int or a pair (zeros on both sides), ``"SAME"`` or ``"VALID"``.
        key: a JAX PRNG key (with sizes).
        use_bias: with sizes: whether to create a bias.

    Input ``(..., height, width, in)``, output ``(..., height', width', out)``.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> conv = tied.nn.Conv2d(3, 8, 3, padding=1, key=jax.random.key(0))
        >>> conv(jnp.ones((2, 5, 5, 3))).shape
        (2, 5, 5, 8)
        >>> down = tied.nn.Conv2d(conv.weight, conv.bias, stride=2, padding=1)   # one kernel
        >>> down(jnp.ones((2, 5, 5, 3))).shape, tied.ties([conv, down])[0]
        ((2, 3, 3, 8), ('[0].weight', '[1].weight'))
    """

    weight: Any
    bias: Any
    stride: tuple
    padding: Any

    def __init__(
        self,
        in_channels: Any,
        out_channels: Any = None,
        kernel_size: Any = None,
        stride: Any = 1,
        padding: Any = 0,
        *,
        key: Any = None,
        use_bias: bool = True,
    ):
        if _is_size(in_channels):
            n_in = _check_size("Conv2d", "in_channels", in_channels)
            n_out = _check_size("Conv2d", "out_channels", out_channels)
            if kernel_size is None or key is None:
                raise TypeError(
                    "Conv2d(in_channels, out_channels, kernel_size, key=...) needs a kernel size and "
                    "an explicit key, e.g. Conv2d(3, 8, 3, key=jax.random.key(0))."
                )
            kh, kw = _pair("Conv2d", "kernel_size", kernel_size)
            wkey, bkey = jax.random.split(key)
            lim = 1.0 / math.sqrt(n_in * kh * kw)
            self.weight = jax.random.uniform(wkey, (kh, kw, n_in, n_out), minval=-lim, maxval=lim)
            self.bias = jax.random.uniform(bkey, (n_out,), minval=-lim, maxval=lim) if use_bias else None
        elif _is_arraylike(in_channels):
            if kernel_size is not None or key is not None:
                raise TypeError(
                    "Conv2d(weight, bias): the kernel size comes from the weight and no key is used; "
                    "drop kernel_size and key when building from arrays."
                )
            if len(tuple(in_channels.shape)) != 4:
                raise ValueError(
                    f"Conv2d(weight, bias): weight must have shape (kh, kw, in, out) (HWIO), got "
                    f"shape {tuple(in_channels.shape)}."
                )
            if out_channels is not None and (
                not _is_arraylike(out_channels) or tuple(out_channels.shape) != tuple(in_channels.shape)[3:]
            ):
                raise ValueError(
                    f"Conv2d(weight, bias): bias must be None or an array of shape (out,) = "
                    f"{tuple(in_channels.shape)[3:]}, got {out_channels!r}."
                )
            self.weight, self.bias = in_channels, out_channels
        else:
            raise TypeError(
                "Conv2d takes (in_channels, out_channels, kernel_size, key=...) or (weight, bias=None); "
                f"got a first argument of type {type(in_channels).__name__}."
            )
        self.stride = _pair("Conv2d", "stride", stride)
        self.padding = _padding(padding)

    def __call__(self, x: Any) -> Any:
        w = materialize(self.weight)
        _features("Conv2d", x, w.shape[2])
        if x.ndim < 3:
            raise ValueError(f"Conv2d: the input must be (..., height, width, channels), got {x.shape}.")
        lead = x.shape[:-3]
        pad = self.padding if isinstance(self.padding, str) else tuple((p, p) for p in self.padding)
        y = jax.lax.conv_general_dilated(
            x.reshape((-1, *x.shape[-3:])), w, self.stride, pad, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        if self.bias is not None:
            y = y + materialize(self.bias)
        return y.reshape(*lead, *y.shape[1:])


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


@register
class KVCache:
    """The keys and values a decoder layer has seen, for `CausalSelfAttention.decode`.

    ``keys`` and ``values`` are `tied.State` of shape ``(max_len, *batch_shape,
    num_heads, head_dim)``; ``position`` (a `tied.State` int32) counts the positions
    written. One cache per layer *place*: a block shared by two layers (ALBERT) has
    one set of weights but sees two different sequences of keys, so it gets two
    caches. A new cache (or one with ``position`` set back to 0) starts a new sequence.

    A write past ``max_len`` is an error, never a wrong answer: eagerly a ``ValueError``;
    under `tied.jit` (the position traced) a callback in the compiled program raises (as
    Equinox's ``eqx.error_if``): the call fails with JAX's runtime error carrying the same
    message, and the caller's cache is left as it was.

    Args:
        max_len: the most positions the cache holds.
        num_heads: attention heads.
        head_dim: the size of one head.
        batch_shape: the leading axes of the decoder's input (``()`` for one sequence).
        dtype: of keys and values.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> attn = tied.nn.CausalSelfAttention(8, 2, key=jax.random.key(0))
        >>> cache = tied.nn.KVCache(5, 2, 4, batch_shape=(1,))
        >>> x = jax.random.normal(jax.random.key(1), (1, 3, 8))
        >>> steps = [attn.decode(x[:, t : t + 1], cache) for t in range(3)]   # one token a time
        >>> bool(jnp.allclose(jnp.concatenate(steps, axis=1), attn(x), atol=1e-5))
        True
        >>> int(cache.position.value), cache.keys.value.shape
        (3, (5, 1, 2, 4))
    """

    keys: State
    values: State
    position: State

    def __init__(
        self,
        max_len: int,
        num_heads: int,
        head_dim: int,
        *,
        batch_shape: tuple = (),
        dtype: Any = jnp.float32,
    ):
        shape = (
            _check_size("KVCache", "max_len", max_len),
            *(_check_size("KVCache", "batch_shape", b) for b in batch_shape),
            _check_size("KVCache", "num_heads", num_heads),
            _check_size("KVCache", "head_dim", head_dim),
        )
        self.keys = State(jnp.zeros(shape, dtype))
        self.values = State(jnp.zeros(shape, dtype))
        self.position = State(jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return tuple(self.keys.value.shape)[0]


def _overflow(bad: Any, pos: Any, seq: int, max_len: int) -> None:
    """Raise when ``seq`` more positions after ``pos`` do not fit in the cache (batched under vmap)."""
    if np.any(bad):
        first = int(np.max(np.asarray(pos)))
        raise ValueError(
            f"KVCache: {first} positions are written and {seq} more do not fit in max_len="
            f"{max_len}. Make a larger cache, or a new one to start a new sequence."
        )


def _attend_cached(q: Any, k: Any, v: Any, cache: KVCache) -> Any:
    """Write ``k``, ``v`` (``(*lead, seq, heads, hd)``) at the cache's position and attend
    ``q`` to every cached position up to its own; advances ``position`` by ``seq``."""
    *lead, seq, heads, hd = q.shape
    pos = cache.position.value
    if not isinstance(pos, jax.core.Tracer):
        _overflow(int(pos) + seq > cache.max_len, pos, seq, cache.max_len)
    else:
        # Traced (under tied.jit, jax.jit, scan): the position is known only when the program runs,
        # where a write past the end would be clamped onto the last rows, a wrong answer that
        # raises nothing. So the check runs then, as a callback that raises (Equinox's error_if
        # does the same with its own machinery): the call fails, and nothing is written back.
        jax.debug.callback(_overflow, pos + seq > cache.max_len, pos, seq, cache.max_len)
    if tuple(cache.keys.value.shape[1:]) != (*lead, heads, hd):
        raise ValueError(
            f"KVCache: the cache holds keys of shape {tuple(cache.keys.value.shape)} = (max_len, "
            f"*batch_shape, heads, head_dim), but the layer gives {(*lead, heads, hd)}; make it with "
            f"KVCache(max_len, {heads}, {hd}, batch_shape={tuple(lead)})."
        )
    keys_all, values_all = cache.keys.value, cache.values.value
    dt = keys_all.dtype
    keys_all = jax.lax.dynamic_update_slice_in_dim(keys_all, jnp.moveaxis(k, -3, 0).astype(dt), pos, 0)
    values_all = jax.lax.dynamic_update_slice_in_dim(values_all, jnp.moveaxis(v, -3, 0).astype(dt), pos, 0)
    cache.keys.value, cache.values.value = keys_all, values_all
    cache.position.value = pos + seq
    scores = jnp.einsum("...qhd,k...hd->...hqk", q, keys_all.astype(q.dtype)) / math.sqrt(hd)
    seen = jnp.arange(keys_all.shape[0])[None, :] <= (pos + jnp.arange(seq))[:, None]
    scores = jnp.where(seen, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...hqk,k...hd->...qhd", weights, values_all.astype(q.dtype))


_TRAINING = jax.tree_util.GetAttrKey("training")
_INFERENCE = jax.tree_util.GetAttrKey("inference")  # Equinox's flag: True in eval mode
_NNX_FLAGS = ("deterministic", "use_running_average")  # Flax NNX's: True in eval mode


def mode(model: Any, training: bool) -> Any:
    """The model with every ``training`` flag set: train mode (True) or eval mode (False).

    Returns the same graph: every array and every state object (`tied.State`,
    `tied.Rng`, a `KVCache`) is the input's own object, so running either model
    updates the same statistics and streams, and ties are kept. Only the layers that
    hold a ``training`` flag (and the containers above them) are new objects; a model
    without flags, or already in that mode, is returned as it is. The flag is static,
    so each mode compiles once under `tied.jit`.

    Other libraries' layers get their own flags, set as their own functions set them:
    a Flax NNX module's ``deterministic`` and ``use_running_average`` (``True`` in
    eval mode, as ``model.eval()`` sets them, ``False`` as ``model.train()`` does), and
    an Equinox module's ``inference`` (as ``eqx.nn.inference_mode`` sets it). Those
    modules are fresh copies too (the caller's NNX model is not switched in place, as
    ``.eval()`` would), holding the caller's own Variables and arrays.

    Args:
        model: any graph; every object attribute named ``training`` holding a bool is set,
            and the NNX and Equinox flags above.
        training: True for train mode, False for eval mode.

    Returns:
        The model in that mode.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> bn = tied.nn.BatchNorm(2)
        >>> net = tied.nn.Chain(tied.nn.Dense(2, 2, key=jax.random.key(0)), bn, bn)   # one norm, twice
        >>> ev = tied.nn.mode(net, training=False)
        >>> ev[1].training, ev[1] is ev[2], net[1].training
        (False, True, True)
        >>> ev[1].running_mean is bn.running_mean, ev[0] is net[0]    # state and arrays shared
        (True, True)
    """
    if not isinstance(training, bool):
        raise TypeError(f"tied.nn.mode(model, training): training must be a bool, got {training!r}.")
    leaves, gdef = flatten(model)
    statics = list(gdef.statics)
    flagged = [False] * gdef.num_nodes  # nodes with a training flag at or below them
    cells = gdef.state_nodes()
    edges = []
    changed = False
    root = None
    eqx_module = _foreign("equinox", "Module")
    node_type: dict[int, type] = {}
    for place in gdef.walk_places(paths=False):  # each place's container: Place.parent and key
        parent = place.parent
        if place.kind == "static":
            if parent >= 0 and isinstance(place.value, bool) and not cells[parent]:
                want = _flag(place.key, node_type.get(parent), eqx_module, training)
                if want is not None:
                    flagged[parent] = True
                    changed |= place.value != want
                    statics[place.index] = want
        elif place.kind != "array":
            node_type[place.index] = place.type
            if parent < 0:
                root = place.index
            else:
                edges.append((parent, place.index))
    if root is None:
        return model
    places = Places(gdef)
    nnx_flags = _nnx_flags(model, places, node_type)
    for path, attrs in nnx_flags.items():
        flagged[places.index[path]] = True
        changed |= any(v != (not training) for v in attrs.values())
    if not changed:
        return model
    grew = True
    while grew:  # up to every container above a flag, through shared nodes and cycles
        grew = False
        for p, c in edges:
            if flagged[c] and not flagged[p]:
                flagged[p] = grew = True
    fresh = rebuild(gdef, leaves, statics=tuple(statics))
    # Everything without a flag below it goes back as the input's own object: state
    # cells, streams and untouched layers stay shared with the caller's model.
    for path in places.nodes():
        steps = places.steps[path]
        if not steps or flagged[places.index[path]] or not flagged[places.index["".join(steps[:-1])]]:
            continue
        fresh = put(fresh, steps, get(model, steps, places), places)
    for path, attrs in nnx_flags.items():
        # NNX keeps its flags in the module (pytree metadata, not children): set them as
        # ``model.eval()`` / ``model.train()`` do, on this fresh copy only (never the caller's).
        layer = get(fresh, places.steps[path], places)
        for name in attrs:
            setattr(layer, name, not training)
    return fresh


def _foreign(module: str, name: str) -> type | None:
    """A class of another library, if that library is imported (never imported here)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _flag(key: Any, owner: type | None, eqx_module: type | None, training: bool) -> bool | None:
    """The value `mode` gives a bool at ``key`` of a node of type ``owner``, or None (not a flag):
    ``training`` (tied's layers), or Equinox's ``inference`` (as ``eqx.nn.inference_mode`` sets it)."""
    if key == _TRAINING:
        return training
    if key == _INFERENCE and owner is not None and eqx_module is not None and issubclass(owner, eqx_module):
        return not training
    return None


def _nnx_flags(model: Any, places: Places, node_type: dict[int, type]) -> dict[str, dict[str, Any]]:
    """The Flax NNX modules of ``model`` holding ``deterministic`` or ``use_running_average`` (the
    flags ``nnx.Module.eval`` and ``train`` set): ``{path: {name: value}}``, each module once."""
    nnx_module = _foreign("flax.nnx", "Module")
    if nnx_module is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for path in places.nodes():
        i = places.index[path]
        t = node_type.get(i)
        if i in seen or t is None or not issubclass(t, nnx_module):
            continue
        seen.add(i)
        fields = vars(get(model, places.steps[path], places))
        attrs = {name: fields[name] for name in _NNX_FLAGS if name in fields}
        if attrs:
            out[path] = attrs
    return out
