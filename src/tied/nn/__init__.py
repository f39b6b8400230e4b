"""Layers: small plain classes that share by reference.

Every layer here is a plain Python class given to `tied.register`, so the core
walk sees its arrays through ``__dict__`` and no framework base class is
needed. Sharing is done the way one writes it: pass the same array (or the same
layer) to two places.

Conventions (JAX's, PyTorch's and Equinox's): inputs are batch first (any
number of leading axes), a `Dense` holds ``weight`` of shape ``(out, in)`` and
computes ``x @ weight.T + bias``, and every random initialisation takes an
explicit ``key``. Layers read their arrays through `tied.materialize`, so any
array place may hold a `tied.view` (``Dense(tied.transpose(enc.weight))``),
eagerly and under `tied.grad`/`tied.jit` alike.

Layers with state (`BatchNorm`'s running statistics, `Dropout`'s random stream, a
decoder's `KVCache`) hold it as `tied.State`, and those with a train/eval behaviour
have a static ``training`` flag, set for a whole model by `mode`.

Examples:
    >>> import jax, jax.numpy as jnp, tied
    >>> enc = tied.nn.Dense(8, 3, key=jax.random.key(0))
    >>> dec = tied.nn.Dense(tied.transpose(enc.weight))    # a derived tie
    >>> model = tied.nn.Chain(enc, jnp.tanh, dec)
    >>> len(tied.flatten(model)[0])                # enc.weight and enc.bias only
    2
    >>> tied.ties(model)
    [('.layers[0].weight', '.layers[2].weight.source')]
    >>> model(jnp.ones((5, 8))).shape
    (5, 8)
"""

from ._attention import MLP, CausalSelfAttention, KVCache, TransformerBlock
from ._conv import Conv2d
from ._dense import Chain, Dense, Embedding
from ._dropout import Dropout, mode
from ._lora import LoRA, adapters, lora, merge
from ._norm import BatchNorm, LayerNorm, RMSNorm
from ._quant import quantize

__all__ = [
    "Dense",
    "Chain",
    "Embedding",
    "LayerNorm",
    "CausalSelfAttention",
    "MLP",
    "TransformerBlock",
    "BatchNorm",
    "Dropout",
    "Conv2d",
    "RMSNorm",
    "KVCache",
    "mode",
    "quantize",
    "LoRA",
    "lora",
    "adapters",
    "merge",
]


def __dir__() -> list[str]:
    # the public names only (not the modules inside the package)
    return sorted(__all__)
