"""Dense, Embedding, LayerNorm, attention, MLP and TransformerBlock layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import View, materialize
from .._tree import register
from ._stateful import KVCache, _attend_cached


def _is_size(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, View))


def _shape(x: Any) -> tuple:
    return tuple(x.shape)


@register
class Dense:
    """A fully connected layer: ``activation(x @ weight.T + bias)``.

    Two ways to build one:

    * ``Dense(in_size, out_size, *, key, activation=None, use_bias=True)``: new
      parameters, weight and bias uniform in ``±1/sqrt(in_size)`` (as PyTorch and
      Equinox initialise them);
    * ``Dense(weight, bias=None, *, activation=None)``: from existing arrays (or
      views), which is how a layer shares another's parameters.

    Args:
        in_or_weight: the input size, or the weight array of shape ``(out, in)``.
        out_or_bias: the output size, or the bias array of shape ``(out,)`` (None: no bias).
        key: a JAX PRNG key, needed when building from sizes.
        activation: a function applied to the output (a static field), or None.
        use_bias: with sizes: whether to create a bias.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> d2 = Dense(d1.weight, d1.bias)            # tied to d1 by reference
        >>> tied.ties(Chain(d1, d2))
        [('.layers[0].weight', '.layers[1].weight'), ('.layers[0].bias', '.layers[1].bias')]
        >>> Chain(d1, d2)                              # the tie, as repr shows it
        Chain(
          layers=[
            Dense(
              weight=f32[2,2],
              bias=f32[2],
              activation=None,
            ),
            Dense(
              weight=<tied: same as .layers[0].weight>,
              bias=<tied: same as .layers[0].bias>,
              activation=None,
            ),
          ],
        )
        >>> d1(jnp.ones((3, 2))).shape
        (3, 2)
    """

    weight: Any
    bias: Any
    activation: Callable | None

    def __init__(
        self,
        in_or_weight: Any,
        out_or_bias: Any = None,
        *,
        key: Any = None,
        activation: Callable | None = None,
        use_bias: bool = True,
    ):
        if activation is not None and not callable(activation):
            raise TypeError(f"Dense: activation must be callable or None, got {activation!r}.")
        if _is_size(in_or_weight):
            if not _is_size(out_or_bias):
                raise TypeError(
                    f"Dense(in_size, out_size, key=...): out_size must be an int, got "
                    f"{out_or_bias!r}. To build from arrays, pass Dense(weight, bias)."
                )
            if key is None:
                raise TypeError(
                    "Dense(in_size, out_size) needs an explicit key: "
                    "Dense(in_size, out_size, key=jax.random.key(0))."
                )
            n_in, n_out = int(in_or_weight), int(out_or_bias)
            wkey, bkey = jax.random.split(key)
            lim = 1.0 / math.sqrt(n_in)
            self.weight = jax.random.uniform(wkey, (n_out, n_in), minval=-lim, maxval=lim)
            self.bias = jax.random.uniform(bkey, (n_out,), minval=-lim, maxval=lim) if use_bias else None
        elif _is_arraylike(in_or_weight):
            if key is not None:
                raise TypeError(
                    "Dense(weight, bias): key is only used by Dense(in_size, out_size, key=...); "
                    "drop it when building from arrays."
                )
            if len(_shape(in_or_weight)) != 2:
                raise ValueError(
                    f"Dense(weight, bias): weight must have shape (out, in), got shape "
                    f"{_shape(in_or_weight)}."
                )
            if out_or_bias is not None and not _is_arraylike(out_or_bias):
                raise TypeError(f"Dense(weight, bias): bias must be an array or None, got {out_or_bias!r}.")
            if out_or_bias is not None and _shape(out_or_bias) != _shape(in_or_weight)[:1]:
                raise ValueError(
                    f"Dense(weight, bias): bias must have shape (out,) = "
                    f"{_shape(in_or_weight)[:1]}, got {_shape(out_or_bias)}."
                )
            self.weight = in_or_weight
            self.bias = out_or_bias
        else:
            raise TypeError(
                "Dense takes (in_size, out_size, key=...) or (weight, bias=None); got a first "
                f"argument of type {type(in_or_weight).__name__}."
            )
        self.activation = activation

    @property
    def in_size(self) -> int:
        return _shape(self.weight)[1]

    @property
    def out_size(self) -> int:
        return _shape(self.weight)[0]

    def __call__(self, x: Any) -> Any:
        y = x @ materialize(self.weight).T
        if self.bias is not None:
            y = y + materialize(self.bias)
        if self.activation is not None:
            y = self.activation(y)
        return y


@register
class Chain:
    """Layers applied one after the other; any callable is a layer.

    ``layers`` is a list. A plain function (``jnp.tanh``) is a static leaf of the
    model; a layer object (a `Dense`, an ``eqx.nn.Linear``, another Chain) is a
    node, and the same object may appear several times: it is one layer with
    several places.

    Args:
        *layers: callables, applied in order.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(4, 4, key=jax.random.key(0), activation=jnp.tanh)
        >>> c = Chain(d, d, d)                 # one layer used three times
        >>> tied.ties(c)[0]
        ('.layers[0]', '.layers[1]', '.layers[2]')
        >>> c
        Chain(
          layers=[
            Dense(
              weight=f32[4,4],
              bias=f32[4],
              activation=<function tanh>,
            ),
            <tied: same as .layers[0]>,
            <tied: same as .layers[0]>,
          ],
        )
        >>> bool(jnp.allclose(c(jnp.ones(4)), d(d(d(jnp.ones(4))))))
        True
    """

    layers: list

    def __init__(self, *layers: Callable):
        for i, layer in enumerate(layers):
            if not callable(layer):
                raise TypeError(
                    f"Chain: layer [{i}] is a {type(layer).__name__}, which is not callable. "
                    "Every layer of a Chain must be a function or an object with __call__."
                )
        self.layers = list(layers)

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Any:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)


@register
class Embedding:
    """A lookup table: ``weight[ids]``, with ``attend`` for a tied output head.

    ``Embedding(vocab, dim, *, key)`` draws ``weight`` of shape ``(vocab, dim)``
    from a normal of standard deviation ``1/sqrt(dim)`` (Flax's default, which
    keeps tied output logits of order one); ``Embedding(weight)`` wraps an
    existing array or view.

    Args:
        vocab_or_weight: the vocabulary size, or the weight array ``(vocab, dim)``.
        dim: the embedding size (with a vocabulary size).
        key: a JAX PRNG key (with sizes).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Dense, Embedding
        >>> emb = Embedding(100, 16, key=jax.random.key(0))
        >>> h = emb(jnp.array([[3, 1, 4]]))  # (batch, seq) ids -> (batch, seq, dim)
        >>> h.shape
        (1, 3, 16)
        >>> emb.attend(h).shape             # h @ emb.weight.T: the head is the embedding
        (1, 3, 100)
        >>> head = Dense(emb.weight)        # the same tie, as a layer (weight (vocab, dim))
        >>> tied.ties({"embed": emb, "head": head})
        [("['embed'].weight", "['head'].weight")]
    """

    weight: Any

    def __init__(self, vocab_or_weight: Any, dim: int | None = None, *, key: Any = None):
        if _is_size(vocab_or_weight):
            if not _is_size(dim) or key is None:
                raise TypeError(
                    "Embedding(vocab, dim, key=...) needs an int dim and an explicit key, "
                    "e.g. Embedding(100, 16, key=jax.random.key(0))."
                )
            self.weight = jax.random.normal(key, (int(vocab_or_weight), int(dim))) / math.sqrt(dim)
        elif _is_arraylike(vocab_or_weight):
            if len(_shape(vocab_or_weight)) != 2 or dim is not None or key is not None:
                raise TypeError(
                    "Embedding(weight): weight must have shape (vocab, dim), with no dim or key; "
                    f"got shape {_shape(vocab_or_weight)}."
                )
            self.weight = vocab_or_weight
        else:
            raise TypeError(
                "Embedding takes (vocab, dim, key=...) or (weight,); got a first argument of "
                f"type {type(vocab_or_weight).__name__}."
            )

    def __call__(self, ids: Any) -> Any:
        return jnp.take(materialize(self.weight), ids, axis=0)

    def attend(self, h: Any) -> Any:
        """Scores of ``h`` against every row: ``h @ weight.T`` (a tied output head)."""
        return h @ materialize(self.weight).T


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
