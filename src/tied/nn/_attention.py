"""Attention and caches: `CausalSelfAttention`, `MLP`, `TransformerBlock` and the `KVCache` a decoder
writes (its overflow is an error eagerly and under `tied.jit`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import State
from .._transforms import check
from .._tree import register
from ._checks import _check_size
from ._dense import Dense
from ._norm import LayerNorm


@register
class KVCache:
    """The keys and values a decoder layer has seen, for `CausalSelfAttention.decode`.

    ``keys`` and ``values`` are `tied.State` of shape ``(max_len, *batch_shape,
    num_heads, head_dim)``; ``position`` (a `tied.State` int32) counts the positions
    written. One cache per layer *place*: a block shared by two layers (ALBERT) has
    one set of weights but sees two different sequences of keys, so it gets two
    caches. A new cache (or one with ``position`` set back to 0) starts a new sequence.

    A write past ``max_len`` is an error, never a wrong answer: a ``ValueError``, eagerly and
    from a `tied.jit` call (which reads the program's overflow flag after the call, before
    writing back; also through `tied.scan`), and the caller's cache is left as it was; inside
    a program tied.jit does not own (``jax.jit``), a callback raises JAX's runtime error with
    the same message.

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


def _overflow(bad: Any, pos: Any, *, seq: int, max_len: int) -> None:
    """Raise when ``seq`` more positions after ``pos`` do not fit in the cache. ``bad`` and ``pos``
    may hold one value per example (``vmap``) or per step (carried out of ``tied.scan``): the
    position named is the first one that overflowed."""
    b = np.asarray(bad)
    if np.any(b):
        p = np.asarray(pos)
        first = int(p.reshape(-1)[np.argmax(b.reshape(-1))]) if p.shape == b.shape else int(np.max(p))
        raise ValueError(
            f"KVCache: {first} positions are written and {seq} more do not fit in max_len="
            f"{max_len}. Make a larger cache, or a new one to start a new sequence."
        )


def _attend_cached(q: Any, k: Any, v: Any, cache: KVCache) -> Any:
    """Write ``k``, ``v`` (``(*lead, seq, heads, hd)``) at the cache's position and attend
    ``q`` to every cached position up to its own; advances ``position`` by ``seq``."""
    *lead, seq, heads, hd = q.shape
    pos = cache.position.value
    # Traced, the position is known only when the program runs, where a write past the end would
    # be clamped onto the last rows (a wrong answer that raises nothing): checked then, before
    # anything is written back (eagerly at once; see `tied._transforms.checks`).
    if seq > cache.max_len:  # never fits, wherever the cache stands (JAX would refuse the slice)
        raise ValueError(
            f"KVCache: {seq} positions at once do not fit in max_len={cache.max_len}, whatever is "
            "written. Make a larger cache."
        )
    check(pos + seq > cache.max_len, functools.partial(_overflow, seq=seq, max_len=cache.max_len), pos)
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


@register
class CausalSelfAttention:
    """Causal multi-head self-attention: each position attends to itself and earlier ones.

    ``qkv`` (a `Dense` ``dim -> 3 dim``) gives queries, keys and values, split
    into ``num_heads`` heads of size ``dim // num_heads``; scores are scaled by
    ``1/sqrt(head size)``, masked above the diagonal, and the heads' outputs go
    through ``proj`` (a `Dense` ``dim -> dim``).

    Args:
        dim: the model width; a multiple of ``num_heads``.
        num_heads: the number of heads.
        key: a JAX PRNG key.
        use_bias: whether the projections have biases.

    Input ``(..., seq, dim)``, output the same shape.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import CausalSelfAttention
        >>> attn = CausalSelfAttention(16, 4, key=jax.random.key(0))
        >>> jax.eval_shape(attn, jnp.ones((2, 5, 16))).shape   # attn(x), shapes only
        (2, 5, 16)
        >>> tied.param_count(attn)          # qkv: 16*48 + 48, proj: 16*16 + 16
        1088
    """

    qkv: Dense
    proj: Dense
    num_heads: int

    def __init__(self, dim: int, num_heads: int, *, key: Any, use_bias: bool = True):
        if dim % num_heads:
            raise ValueError(f"CausalSelfAttention: dim={dim} is not a multiple of num_heads={num_heads}.")
        k1, k2 = jax.random.split(key)
        self.qkv = Dense(dim, 3 * dim, key=k1, use_bias=use_bias)
        self.proj = Dense(dim, dim, key=k2, use_bias=use_bias)
        self.num_heads = int(num_heads)

    def __call__(self, x: Any) -> Any:
        *lead, seq, dim = x.shape
        heads = self.num_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (t.reshape(*lead, seq, heads, dim // heads) for t in (q, k, v))
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(dim // heads)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(*lead, seq, dim)
        return self.proj(out)

    def decode(self, x: Any, cache: KVCache) -> Any:
        """The next positions of a sequence whose earlier keys and values are in ``cache``.

        ``x`` is ``(..., seq, dim)``, the new positions only (``seq`` is 1 when generating
        token by token); their keys and values are written into ``cache`` (a `KVCache`)
        and its position advances by ``seq``. The result equals the rows of ``self(x_all)``
        for those positions, where ``x_all`` is the whole sequence so far. Shapes never
        change, so a decode step compiles once under `tied.jit`.

        Raises:
            ValueError: the positions do not fit in the cache (``position + seq > max_len``),
                eagerly at once. Under `tied.jit` (or any JAX transform that traces the
                position) the same check runs when the compiled program does: the call fails
                with JAX's runtime error carrying this message, and nothing is written back
                into the caller's cache. Never a silently clamped write.
        """
        *lead, seq, dim = x.shape
        heads = self.num_heads
        q, k, v = (t.reshape(*lead, seq, heads, dim // heads) for t in jnp.split(self.qkv(x), 3, -1))
        return self.proj(_attend_cached(q, k, v, cache).reshape(*lead, seq, dim))

    def cache(self, max_len: int, batch_shape: tuple = (), dtype: Any = jnp.float32) -> KVCache:
        """A new, empty `KVCache` for `decode`, with room for ``max_len`` positions."""
        dim = self.proj.out_size
        return KVCache(max_len, self.num_heads, dim // self.num_heads, batch_shape=batch_shape, dtype=dtype)


@register
class MLP:
    """The feed-forward block of a transformer: ``fc2(activation(fc1(x)))``.

    Args:
        dim: input and output size.
        hidden: the hidden size (a transformer uses ``4 * dim``).
        key: a JAX PRNG key.
        activation: applied between the two layers (default ``jax.nn.gelu``).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import MLP
        >>> mlp = MLP(16, 64, key=jax.random.key(0))
        >>> jax.eval_shape(mlp, jnp.ones((3, 16))).shape   # mlp(x), shapes only
        (3, 16)
        >>> mlp
        MLP(
          fc1=Dense(
            weight=f32[64,16],
            bias=f32[64],
            activation=<function gelu>,
          ),
          fc2=Dense(
            weight=f32[16,64],
            bias=f32[16],
            activation=None,
          ),
        )
    """

    fc1: Dense
    fc2: Dense

    def __init__(self, dim: int, hidden: int, *, key: Any, activation: Callable = jax.nn.gelu):
        k1, k2 = jax.random.split(key)
        self.fc1 = Dense(dim, hidden, key=k1, activation=activation)
        self.fc2 = Dense(hidden, dim, key=k2)

    def __call__(self, x: Any) -> Any:
        return self.fc2(self.fc1(x))


@register
class TransformerBlock:
    """A pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Args:
        dim: the model width.
        num_heads: attention heads.
        key: a JAX PRNG key.
        hidden: the MLP's hidden size (default ``4 * dim``).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, TransformerBlock
        >>> block = TransformerBlock(16, 2, key=jax.random.key(0))
        >>> albert = Chain(*[block] * 6)      # ALBERT: one block, six places
        >>> tied.param_count(albert) == tied.param_count(block)
        True
        >>> tied.param_count(albert, per_place=True) == 6 * tied.param_count(block)
        True
        >>> jax.eval_shape(albert, jnp.ones((2, 5, 16))).shape   # albert(x), shapes only
        (2, 5, 16)
    """

    ln1: LayerNorm
    attn: CausalSelfAttention
    ln2: LayerNorm
    mlp: MLP

    def __init__(self, dim: int, num_heads: int, *, key: Any, hidden: int | None = None):
        k1, k2 = jax.random.split(key)
        self.ln1 = LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads, key=k1)
        self.ln2 = LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim if hidden is None else hidden, key=k2)

    def __call__(self, x: Any) -> Any:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: Any, cache: KVCache) -> Any:
        """``self(x)`` for the next positions only, the earlier ones read from ``cache``
        (see `CausalSelfAttention.decode`; a cache that overflows raises, under `tied.jit` too)."""
        x = x + self.attn.decode(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))
