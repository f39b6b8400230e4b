"""Sharing-aware optimisers over optax: one state and one step per unique parameter.

The rule is any optax ``GradientTransformation`` (``optax.adam``, ``chain``,
``clip_by_global_norm``, ``inject_hyperparams``, ``masked``,
``multi_transform``, ``MultiSteps`` ...), used unchanged. `setup` gives it the
model's unique trainable arrays (inexact dtype), each once however many places
hold it; `update` first forms each parameter's total gradient, runs the rule
once over those totals, and rebuilds the model with every tie kept.

Total gradients: the first pass of `update` is `tied.accumulate`, which turns a
gradient in any convention (per-place partials, total at the first place, or
the aliased total of `tied.grad`) into one total per parameter. Call it yourself
when you want the totals (to log their norms, say); there is no separate
``total_gradients``.

What optax sees: the list of unique trainable arrays in `tied.params` order. A
mask for ``optax.masked`` or labels for ``optax.multi_transform`` are a list in
that order, or a function of that list::

    ps = tied.params(model)
    labels = ["decay" if p.ndim > 1 else "none" for p in ps]
    tx = optax.multi_transform({"decay": optax.adamw(1e-3), "none": optax.adam(1e-3)}, labels)

Example:
    >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
    >>> state = tied.optim.setup(optax.adam(1e-3), c)
    >>> g = tied.grad(lambda m: m(x).sum())(c)
    >>> c, state = tied.optim.update(state, c, g)
    >>> c.layers[0].weight is c.layers[1].weight
    True
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from ._grad import is_param, total_of
from ._graph import GraphDef, flatten, place_paths, read_places, unflatten
from ._implicit import Grads, _lock, _place_setters
from ._view import View

__all__ = ["OptState", "setup", "update", "update_inplace", "freeze", "thaw"]

Convention = Literal["auto", "partials", "total"]


@jax.tree_util.register_pytree_with_keys_class
class OptState:
    """The optimiser state of a model: one optax state entry per unique trainable parameter.

    A JAX pytree, so it passes through ``jax.jit``, `tied.jit`, `tied.Graph` and
    `tied.flatten` (and so `tied.save`). Its children are:

    * ``inner_state``: the optax state, built by ``tx.init`` on the list of
      unique trainable arrays;
    * ``params``: those arrays as the state last saw them (the model's own
      buffers, not copies), so that `freeze` and `thaw` can find a parameter by
      identity.

    The rule ``tx`` and the ``frozen`` flags (one per parameter) are static.

    Keeping the state's ``params`` and the model's arrays one buffer: `tied.jit`
    and `tied.Graph` deduplicate them (return ``(model, state)`` from one
    `tied.jit` function, or ``tied.Graph((model, state))`` from ``jax.jit``);
    plain ``jax.jit`` returning them as separate outputs copies them. Save them
    together too: ``tied.save(path, (model, state))`` stores each array once.
    """

    __slots__ = ("inner_state", "params", "tx", "frozen")

    def __init__(self, inner_state: Any, params: tuple, tx: Any, frozen: tuple[bool, ...]):
        # Stored as given: JAX's tree_unflatten may pass placeholders, not arrays.
        self.inner_state = inner_state
        self.params = params
        self.tx = tx
        self.frozen = frozen

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        children = ((keys("inner_state"), self.inner_state), (keys("params"), self.params))
        return children, (self.tx, self.frozen)

    def tree_flatten(self):
        return (self.inner_state, self.params), (self.tx, self.frozen)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> OptState:
        inner_state, params = children
        tx, frozen = aux
        return cls(inner_state, params, tx, frozen)

    def __repr__(self) -> str:
        n_frozen = sum(self.frozen)
        extra = f", {n_frozen} frozen" if n_frozen else ""
        return f"OptState({len(self.params)} unique parameters{extra})"


def _trainable(leaves: list) -> list[int]:
    return [i for i, x in enumerate(leaves) if is_param(x)]


def setup(tx: optax.GradientTransformation, model: Any) -> OptState:
    """Initialise ``tx`` for ``model``: one state entry per unique trainable array.

    Args:
        tx: an optax ``GradientTransformation`` (any optimiser or combinator).
        model: any object graph `tied.flatten` accepts. Its trainable
            parameters are its unique arrays of inexact dtype; integer arrays
            are carried but not optimised.

    Returns:
        An `OptState`.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> len(state.inner_state[0].mu)       # weight and bias: one moment each
        2
    """
    leaves, _ = flatten(model)
    params = [leaves[i] for i in _trainable(leaves)]
    return OptState(tx.init(list(params)), tuple(params), tx, (False,) * len(params))


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _check(state: OptState, leaves: list, gdef: GraphDef, train: list[int]) -> None:
    if not isinstance(state, OptState):
        raise TypeError(
            f"expected the OptState from tied.optim.setup(tx, model), got {type(state).__name__}."
        )
    if len(train) != len(state.params):
        raise ValueError(
            f"the model has {len(train)} unique trainable arrays but the optimiser state was "
            f"set up for {len(state.params)}. Pass the model the state was set up for, or "
            "call tied.optim.setup(tx, model) for this one."
        )
    for k, (i, p) in enumerate(zip(train, state.params)):
        x = leaves[i]
        if x.shape != p.shape or x.dtype != p.dtype:
            path = place_paths(gdef).leaves[i][0] or "<root>"
            raise ValueError(
                f"{path}: the model's parameter has {_describe(x)} but the optimiser state's "
                f"parameter {k} has {_describe(p)}. Pass the model the state was set up for, "
                "or call tied.optim.setup(tx, model) for this one."
            )


def _totals(
    grads: Any, gdef: GraphDef, leaves: list, train: list[int], convention: Convention
) -> list:
    """One total gradient (or None) per trainable parameter."""
    if isinstance(grads, Grads):
        return [grads._lookup(leaves[i]) for i in train]
    if convention not in ("auto", "partials", "total"):
        raise ValueError(f"convention must be 'auto', 'partials' or 'total', got {convention!r}.")
    totals = total_of(read_places(gdef, grads), leaves, convention)
    out = [totals[i] for i in train]
    for i, g in zip(train, out):
        if g is not None and getattr(g, "shape", None) != leaves[i].shape:
            path = place_paths(gdef).leaves[i][0] or "<root>"
            raise ValueError(
                f"{path}: the gradient has shape {getattr(g, 'shape', None)} but the parameter "
                f"has shape {tuple(leaves[i].shape)}. Pass a gradient of this model "
                "(as tied.grad returns it)."
            )
    return out


def _hold(old: Any, new: Any, hold: list[bool]) -> Any:
    """``new`` optax state, with the per-parameter entries of held parameters taken from ``old``.

    Optax builds per-parameter state by mapping over the parameter list, so
    every list of that length in its state is one entry per parameter. Global
    entries (step counters, hyperparameters) come from ``new``.
    """
    n = len(hold)

    def per_param(x: Any) -> bool:
        return type(x) is list and len(x) == n

    def pick(o: Any, nw: Any) -> Any:
        if per_param(o):
            return [a if h else b for a, b, h in zip(o, nw, hold)]
        return nw

    return jax.tree_util.tree_map(pick, old, new, is_leaf=per_param)


def _step(
    state: OptState, model: Any, grads: Any, convention: Convention, extra_args: dict
) -> tuple[list, GraphDef, list[int], list, OptState]:
    leaves, gdef = flatten(model)
    train = _trainable(leaves)
    _check(state, leaves, gdef, train)
    totals = _totals(grads, gdef, leaves, train, convention)
    params = [leaves[i] for i in train]
    hold = [f or g is None for f, g in zip(state.frozen, totals)]
    if all(hold):  # nothing to step: no rule runs, no counter advances
        return leaves, gdef, train, params, OptState(
            state.inner_state, tuple(params), state.tx, state.frozen
        )
    # Frozen parameters and parameters without a gradient contribute zeros to
    # global transforms (a clipping norm) and are neither moved nor re-stated.
    g = [jnp.zeros_like(p) if h else t for p, t, h in zip(params, totals, hold)]
    updates, inner = state.tx.update(g, state.inner_state, params, **extra_args)
    stepped = optax.apply_updates(params, updates)
    new_params = [p if h else s for p, s, h in zip(params, stepped, hold)]
    inner = _hold(state.inner_state, inner, hold)
    new_state = OptState(inner, tuple(new_params), state.tx, state.frozen)
    return leaves, gdef, train, new_params, new_state


def update(
    state: OptState,
    model: Any,
    grads: Any,
    *,
    convention: Convention = "auto",
    **extra_args: Any,
) -> tuple[Any, OptState]:
    """One optimiser step: total gradients, the rule once per unique parameter, ties kept.

    Args:
        state: from `setup` (or a previous `update`).
        model: the model the state was set up for (or its updated successor).
        grads: a gradient of ``model`` in any convention `tied.accumulate`
            reads (the aliased totals of `tied.grad`, per-place partials,
            total at the first place), ``None`` standing for a subtree without
            gradient; or a `tied.Grads` from `tied.gradient`.
        convention: how to read a tie group whose gradients are distinct
            objects, as in `tied.accumulate`.
        **extra_args: passed on to ``tx.update`` (e.g. ``value=`` for rules that
            need the loss).

    Returns:
        ``(new_model, new_state)``. Every tie of ``model`` is kept (arrays and
        container nodes), static fields are unchanged, and ``model`` itself is
        untouched. A parameter whose gradient is ``None`` at every place, or
        that is frozen, is the same object as before, and its per-parameter
        optax state is kept (global counters still advance).

    Works eagerly, inside `tied.jit` (return ``(model, state)`` from the
    compiled function), and under ``jax.jit`` on `tied.Graph` arguments.

    Example:
        >>> state = tied.optim.setup(optax.adam(1e-3), c)       # c = Chain(d, d)
        >>> c2, state = tied.optim.update(state, c, tied.grad(loss)(c))
        >>> c2.layers[0] is c2.layers[1]
        True
    """
    leaves, gdef, train, new_params, new_state = _step(state, model, grads, convention, extra_args)
    new_leaves = list(leaves)
    for i, p in zip(train, new_params):
        new_leaves[i] = p
    return unflatten(gdef, new_leaves), new_state


def update_inplace(
    state: OptState,
    model: Any,
    grads: Any,
    *,
    convention: Convention = "auto",
    **extra_args: Any,
) -> OptState:
    """Like `update`, writing each new array into every place of the existing model.

    For mutable models (lists, dicts, classes given to `tied.register`,
    non-frozen dataclasses): outside references to the model, or to any of its
    layers, see the update. Eager only (under a JAX transform, write nothing
    into Python objects: use `update`).

    Args:
        state, model, grads, convention, extra_args: as in `update`.

    Returns:
        The new `OptState`.

    Raises:
        GraphError: a parameter place sits in an immutable container (a tuple,
            namedtuple, frozen dataclass or JAX-registered node such as an
            Equinox module); the message names the path. Raised before
            anything is written.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> state = tied.optim.update_inplace(state, c, tied.grad(loss)(c))
        >>> d1.weight is c.layers[1].weight     # d1 now holds the new array
        True
    """
    with _lock:
        leaves, gdef = flatten(model)
        train = _trainable(leaves)
        setters = _place_setters(
            model, gdef, train, action="tied.optim.update_inplace", frozen_ok=False
        )
        _, _, _, new_params, new_state = _step(state, model, grads, convention, extra_args)
        for places, old, new in zip(setters, (leaves[i] for i in train), new_params):
            if new is not old:
                for set_place in places:
                    set_place(new)
    return new_state


def _positions(state: OptState, arrays: tuple, model: Any, fn: str) -> set[int]:
    if model is None:
        pool = list(state.params)
        where = "the optimiser state's parameters"
    else:
        leaves, gdef = flatten(model)
        train = _trainable(leaves)
        _check(state, leaves, gdef, train)
        pool = [leaves[i] for i in train]
        where = "the model's trainable parameters"
    out = set()
    for n, a in enumerate(arrays):
        target = a.source if isinstance(a, View) else a
        k = next((k for k, p in enumerate(pool) if p is target), None)
        if k is None:
            shape, dtype = getattr(target, "shape", None), getattr(target, "dtype", None)
            hint = (
                " If the model came out of jax.jit, its arrays are new objects: pass it, "
                f"tied.optim.{fn}(state, array, model=model)."
                if model is None
                else ""
            )
            raise ValueError(
                f"tied.optim.{fn}: argument {n} ({type(target).__name__} of shape {shape}, dtype "
                f"{dtype}) is not one of {where}, matched by identity. Pass the array the model "
                f"holds at any one of its places (e.g. model.layers[1].weight).{hint}"
            )
        out.add(k)
    return out


def freeze(state: OptState, *arrays: Any, model: Any = None) -> OptState:
    """Stop updating some parameters; functional (returns a new state).

    A parameter is named by the array object itself, taken from any one of its
    places (or a `tied.View` of it), so freezing it through one place freezes it
    everywhere. A frozen parameter is not moved, its optax state is kept as it
    was, and it contributes zeros to global transforms such as clipping norms.

    Args:
        state: the current `OptState`; arrays are looked up among
            ``state.params`` (the arrays of the model returned with it).
        *arrays: the parameters to freeze.
        model: look the arrays up in this model instead (needed when the model
            came out of ``jax.jit`` as separate outputs, which are new objects).

    Returns:
        A new `OptState` with those parameters frozen.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> state = tied.optim.freeze(state, c.layers[1].weight)   # also c.layers[0].weight
    """
    ks = _positions(state, arrays, model, "freeze")
    frozen = tuple(f or k in ks for k, f in enumerate(state.frozen))
    return OptState(state.inner_state, state.params, state.tx, frozen)


def thaw(state: OptState, *arrays: Any, model: Any = None) -> OptState:
    """Update some frozen parameters again; functional (returns a new state).

    Args and lookup as in `freeze`.

    Returns:
        A new `OptState` with those parameters no longer frozen.

    Example:
        >>> state = tied.optim.thaw(state, c.layers[0].weight)   # both places again
    """
    ks = _positions(state, arrays, model, "thaw")
    frozen = tuple(f and k not in ks for k, f in enumerate(state.frozen))
    return OptState(state.inner_state, state.params, state.tx, frozen)
