"""Sharing-aware optimisers over optax: one state and one step per unique parameter.

The rule is any optax ``GradientTransformation`` (``optax.adam``, ``chain``,
``clip_by_global_norm``, ``inject_hyperparams``, ``masked``,
``multi_transform``, ``MultiSteps`` ...), used unchanged. `setup` gives it the
model's unique trainable arrays, each once however many places hold it;
`update` first forms each parameter's total gradient, runs the rule once over
those totals, and rebuilds the model with every tie kept.

What optax sees, in optax's own conventions: a flat ``dict`` from the keystr
path of each unique trainable array's *first* place to the array (the
gradients and updates likewise). So masks and labels are ordinary optax
pytrees, or functions of that dict, as in optax's documentation (see the
examples below).

State belongs to a parameter's place, as in optax and Optimisers.jl: the
per-parameter entries of the optax state (Adam's ``mu`` and ``nu``) are dicts
keyed by those paths, so a checkpoint of the state shows
``inner_state[0].mu['.layers[0].weight']``. The state holds no parameter
arrays, and `update` refuses a model whose trainable parameters no longer line
up with it (a path, shape, dtype or tie that differs), naming the first
difference.

Total gradients: the first pass of `update` is `tied.accumulate`, which turns a
gradient in any convention (per-place partials, total at the first place, or
the aliased total of `tied.grad`) into one total per parameter. Call it yourself
when you want the totals (to log their norms, say).

Examples:
    >>> import jax, jax.numpy as jnp, optax, tied
    >>> from tied.nn import Chain, Dense
    >>> d1 = Dense(2, 2, key=jax.random.key(0))
    >>> c, x = Chain(d1, Dense(d1.weight, d1.bias)), jnp.ones((1, 2))
    >>> state = tied.optim.setup(optax.adam(1e-3), c)
    >>> g = tied.grad(lambda m: m(x).sum())(c)
    >>> c, state = tied.optim.update(state, c, g)
    >>> c.layers[0].weight is c.layers[1].weight
    True
    >>> sorted(state.inner_state[0].mu)
    ['.layers[0].bias', '.layers[0].weight']

    Weight decay masked by path, and labels by path (here the biases are not moved):

    >>> tx = optax.chain(
    ...     optax.masked(optax.add_decayed_weights(1e-4), lambda p: {k: k.endswith("weight") for k in p}),
    ...     optax.multi_transform(
    ...         {"fast": optax.adam(1e-2), "fixed": optax.set_to_zero()},
    ...         lambda p: {k: "fixed" if k.endswith("bias") else "fast" for k in p},
    ...     ),
    ... )
    >>> state = tied.optim.setup(tx, c)
    >>> c2, state = tied.optim.update(state, c, tied.grad(lambda m: m(x).sum())(c))
    >>> c2.layers[1].weight is c2.layers[0].weight, c2.layers[1].bias is c2.layers[0].bias
    (True, True)
    >>> bool((c2.layers[0].bias == c.layers[0].bias).all())         # "fixed": not moved
    True
    >>> bool((c2.layers[0].weight != c.layers[0].weight).all())     # "fast": moved
    True
"""

from ._update import (
    OptState,
    ParamSpec,
    freeze,
    setup,
    thaw,
    update,
    update_inplace,
)

__all__ = [
    "OptState",
    "ParamSpec",
    "setup",
    "update",
    "update_inplace",
    "freeze",
    "thaw",
]


def __dir__() -> list[str]:
    # the public names only (not the modules inside the package)
    return sorted(__all__)
