"""Dense, Chain and Embedding: weights that share by reference (a tied head is `Dense(embedding.weight)`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from .._core import materialize, matmul_t, take
from .._tree import register
from ._checks import _is_arraylike, _is_size, _shape


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
        y = matmul_t(x, self.weight)  # a quantized weight computes it from its integers
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
        return take(self.weight, ids)  # a quantized table gathers only these rows

    def attend(self, h: Any) -> Any:
        """Scores of ``h`` against every row: ``h @ weight.T`` (a tied output head)."""
        return matmul_t(h, self.weight)
