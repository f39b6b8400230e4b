"""State: places whose value changes when the model runs, never by an optimiser.

A `State` is a cell node whose ``.value`` holds an array (or a pytree of arrays):
running statistics, a step counter, a cache. `Rng` is a random stream: a fixed key
and a `State` counter. Other libraries' cells count as state too (every Flax NNX
``Variable`` that is not a ``Param``; Equinox's ``eqx.nn.State``), and `tied.register_state` (in `_classify`,
beside `register`) declares a user's own.

The core walk reads `is_state_type` to mark the arrays below a state cell
(`GraphDef.state_leaves`); everything above it (gradients, optimisers, jit's
write-back, checkpoints, inspection) asks the GraphDef, never this module's types.
This module sits at the bottom of the house beside `_view`: it imports no other
part of `tied`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["State", "Rng", "is_state_type", "is_nnx_variable"]

_state_types: set[type] = set()  # classes given to register_state (State included)
_state_cache: dict[type, bool] = {}
_lock = threading.Lock()


def is_state_type(t: type) -> bool:
    """Whether instances of ``t`` are state cells: `State`, a class given to
    `register_state`, a Flax NNX ``Variable`` that is not an ``nnx.Param``, or
    Equinox's ``eqx.nn.State``."""
    r = _state_cache.get(t)
    if r is None:
        r = _classify_state(t)
        with _lock:
            _state_cache[t] = r
    return r


_nnx_cache: dict[type, bool] = {}


def is_nnx_variable(t: type) -> bool:
    """Whether ``t`` is a Flax NNX ``Variable`` (a cell whose value can be set in place)."""
    r = _nnx_cache.get(t)
    if r is None:
        nnx = sys.modules.get("flax.nnx")  # never import flax: only a model holding it has it
        variable = getattr(nnx, "Variable", None) if nnx is not None else None
        r = isinstance(variable, type) and issubclass(t, variable)
        if nnx is not None:
            _nnx_cache[t] = r
    return r


def equinox_state_type() -> type | None:
    """Equinox's ``eqx.nn.State`` (the state ``eqx.nn.make_with_state`` returns), if Equinox is imported."""
    eqx_nn = sys.modules.get("equinox.nn")  # never import equinox: only a model holding it has it
    state = getattr(eqx_nn, "State", None) if eqx_nn is not None else None
    return state if isinstance(state, type) else None


def _classify_state(t: type) -> bool:
    if any(b in _state_types for b in t.__mro__):
        return True
    eqx_state = equinox_state_type()
    if eqx_state is not None and issubclass(t, eqx_state):
        return True  # running statistics and the like, keyed by Equinox's StateIndex
    nnx = sys.modules.get("flax.nnx")  # never import flax: only a model holding it has it
    if nnx is not None:
        variable, param = getattr(nnx, "Variable", None), getattr(nnx, "Param", None)
        if isinstance(variable, type) and issubclass(t, variable):
            return not (isinstance(param, type) and issubclass(t, param))
    return False


def _check_value(new: Any, old: Any) -> Any:
    """``new`` as a state value: arrays only, stop-gradiented, and (when ``old`` is set)
    of ``old``'s structure, shapes and dtypes."""
    leaves, tdef = jax.tree_util.tree_flatten(new)
    for x in leaves:
        if not isinstance(x, (jax.Array, np.ndarray)) and not _is_tracer(x):
            raise TypeError(
                f"tied.State holds arrays, got {type(x).__name__} ({x!r}). Wrap a number as an "
                f"array so it can change under jit: tied.State(jnp.asarray({x!r}))."
            )
    old_leaves: list = []
    if old is not None:
        old_leaves, old_def = jax.tree_util.tree_flatten(old)
        if old_def != tdef:
            raise ValueError(
                f"tied.State: the new value's structure {tdef} differs from the state's {old_def}. "
                "State keeps its structure; make a new tied.State for a different one."
            )
        for a, b in zip(old_leaves, leaves):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"tied.State: a value of shape {tuple(b.shape)} and dtype {b.dtype} cannot "
                    f"replace one of shape {tuple(a.shape)} and dtype {a.dtype}: a state keeps its "
                    "shape and dtype (so a compiled step never retraces). Cast or reshape the new "
                    "value, or make a new tied.State."
                )
    # a leaf kept as it was stays the very object (stop-gradiented when it was stored): a call
    # that rewrites one part of a cell's value does not make the others new arrays
    kept = [a is x for a, x in zip(old_leaves, leaves)] if old_leaves else [False] * len(leaves)
    return jax.tree_util.tree_unflatten(
        tdef, [x if k or not _inexact(x) else jax.lax.stop_gradient(x) for k, x in zip(kept, leaves)]
    )


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


class State:
    """A state cell: ``.value`` is an array (or a pytree of arrays) that changes when the
    model runs, never by an optimiser.

    Writing ``.value`` stores ``jax.lax.stop_gradient(new)`` (state is never
    differentiated) and refuses a change of shape or dtype; a part of a pytree value
    written back as it was (``s.value = (new, s.value[1])``) stays the very array. A `State` is a node
    walked through ``.value`` (path ``.running_mean.value``) and shared by
    reference: one `State` reachable from two places is one state, written once.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> steps = tied.State(jnp.zeros((), jnp.int32))
        >>> model = {"a": {"w": jnp.ones(2), "steps": steps}, "b": {"steps": steps}}
        >>> tied.ties(model)
        [("['a']['steps']", "['b']['steps']")]
        >>> @tied.jit
        ... def count(m):
        ...     m["a"]["steps"].value = m["a"]["steps"].value + 1    # written back after the call
        >>> count(model); count(model)
        >>> int(steps.value), model["b"]["steps"] is steps
        (2, True)
        >>> tied.grad(lambda m: (m["a"]["w"] ** 2).sum())(model)["a"]["steps"].value is None
        True
    """

    def __init__(self, value: Any):
        object.__setattr__(self, "value", _check_value(value, None))

    def __setattr__(self, name: str, new: Any) -> None:
        if name == "value":
            new = _check_value(new, self.__dict__.get("value"))
        object.__setattr__(self, name, new)

    def __repr__(self) -> str:
        v = self.__dict__.get("value")
        if isinstance(v, (jax.Array, np.ndarray)) or _is_tracer(v):
            return f"State({v.dtype}{list(v.shape)})"
        return f"State({type(v).__name__})"


def _as_key(seed_or_key: Any) -> Any:
    x = seed_or_key
    if isinstance(x, (bool, np.bool_)) or isinstance(x, (float, complex, np.floating)):
        raise TypeError(
            f"tied.Rng takes an int seed or a JAX key, got {type(x).__name__} {x!r}. Use "
            "tied.Rng(0), tied.Rng(jax.random.key(0)) or a raw uint32 key."
        )
    if isinstance(x, (int, np.integer)):
        return jax.random.key(int(x))
    if isinstance(x, (jax.Array, np.ndarray)) or _is_tracer(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            if x.shape != ():
                raise ValueError(f"tied.Rng takes one key, got a key array of shape {x.shape}.")
            return x
        if x.dtype == jnp.uint32 and x.ndim == 1:
            return jnp.asarray(x)  # a raw key (jax.random.PRNGKey)
        raise TypeError(
            f"tied.Rng takes an int seed or a JAX key, got an array of dtype {x.dtype} and shape "
            f"{tuple(x.shape)}. Use jax.random.key(seed) or jax.random.PRNGKey(seed)."
        )
    raise TypeError(f"tied.Rng takes an int seed or a JAX key, got {type(x).__name__}.")


class Rng:
    """A random stream: a fixed key and a `State` counter; each draw folds the count in.

    ``rng()`` returns ``jax.random.fold_in(key, count)`` and advances the
    counter by one; ``rng.split(n)`` returns ``n`` keys (for ``vmap`` or
    ``scan``) and advances it once. One `Rng` shared by several layers is one
    stream: under `tied.jit` its counter is written back after each call, so the
    next call draws new numbers without retracing. Typed keys
    (``jax.random.key``) and raw ``uint32`` keys both work.

    Args:
        seed_or_key: an int seed (the stream starts from ``jax.random.key(seed)``)
            or a key.

    Examples:
        >>> import jax, tied
        >>> rng = tied.Rng(0)
        >>> k0, k1 = rng(), rng()
        >>> bool((jax.random.key_data(k1) == jax.random.key_data(
        ...     jax.random.fold_in(jax.random.key(0), 1))).all())
        True
        >>> int(rng.count.value)
        2
    """

    def __init__(self, seed_or_key: Any):
        self.key = _as_key(seed_or_key)
        self.count = State(jnp.zeros((), jnp.uint32))

    def __call__(self) -> Any:
        count = self.count.value
        key = jax.random.fold_in(self.key, count)
        self.count.value = count + jnp.uint32(1)
        return key

    def split(self, n: int) -> Any:
        """``n`` keys drawn at once (the counter advances by one)."""
        return jax.random.split(self(), n)

    def __repr__(self) -> str:
        return "Rng()"
