"""Structural gradients that accumulate shared parameters, and `accumulate`."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ._graph import GraphDef, _unflatten, expand, flatten, read_places

__all__ = ["grad", "value_and_grad", "accumulate", "is_param"]

_inexact: dict = {}


def is_param(x: Any) -> bool:
    """Whether an array is a parameter: an array of inexact (float or complex) dtype."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return False
    r = _inexact.get(dt)
    if r is None:
        r = _inexact[dt] = bool(jnp.issubdtype(dt, jnp.inexact))
    return r


def _gradient_tree(structure: GraphDef, grads: list) -> Any:
    """The model's structure with ``grads`` at its array places and None at every static."""
    return _unflatten(structure, grads, statics=(None,) * len(structure.statics))


def _argnums(argnums: int | Sequence[int]) -> tuple[tuple[int, ...], bool]:
    if isinstance(argnums, int):
        return (argnums,), True
    nums = tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}.")
    return nums, False


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    per_location: bool = False,
) -> Callable:
    """Like `jax.value_and_grad`, for object graphs with shared parameters.

    The arguments named by ``argnums`` are one graph together (an array shared
    between two of them is one parameter). The gradient mirrors them: the same
    container types, a gradient array at every inexact-dtype array place and
    ``None`` at every other leaf. A shared array's gradient is the total over all
    its uses, computed once, and that one object stands at each of its places; a
    shared node gives one gradient node at all its places. Views (`tied.view`)
    are materialised for ``fun``; the gradient at a view's place is a `View` of
    the source's total.

    Args:
        fun: the function to differentiate; returns a scalar (and aux if has_aux).
        argnums: an int or a tuple of ints, as in JAX.
        has_aux: whether ``fun`` returns ``(value, aux)``.
        per_location: return the per-place partial gradients instead: a distinct
            array at each place (and a distinct node at each place of a shared
            node), summing to the total over each tie group. For diagnostics:
            it costs memory per place, not per parameter.

    Returns:
        A function returning ``(value, grads)``, or ``((value, aux), grads)``.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> loss, g = tied.value_and_grad(lambda m: m(x).sum())(c)
        >>> g.layers[0].weight is g.layers[1].weight
        True
    """
    nums, single = _argnums(argnums)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        for i in nums:
            if not -len(args) <= i < len(args):
                raise TypeError(
                    f"argnums={argnums!r} names argument {i}, but the function was called "
                    f"with {len(args)} positional arguments."
                )
        # A single argument is flattened alone, so that error paths are the model's own.
        leaves, gdef = flatten(args[nums[0]] if single else tuple(args[i] for i in nums))
        if per_location:
            structure, place_leaf = expand(gdef)
            inputs = [leaves[q] for q in place_leaf]
        else:
            structure, inputs = gdef, leaves
        diff = [i for i, x in enumerate(inputs) if is_param(x)]

        def f(params):
            full = list(inputs)
            for i, p in zip(diff, params):
                full[i] = p
            selected = _unflatten(structure, full, materialize=True)
            if single:
                selected = (selected,)
            new_args = list(args)
            for i, a in zip(nums, selected):
                new_args[i] = a
            return fun(*new_args, **kwargs)

        value, dparams = jax.value_and_grad(f, has_aux=has_aux)([inputs[i] for i in diff])
        grads: list = [None] * len(inputs)
        seen: set[int] = set()
        for i, g in zip(diff, dparams):
            # Eager JAX may hand one cotangent object to two inputs (both operands of
            # a + b); a copy keeps gradient identity equal to the model's sharing.
            if id(g) in seen:
                g = jnp.copy(g)
            seen.add(id(g))
            grads[i] = g
        return value, _gradient_tree(structure, grads)

    return wrapped


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    per_location: bool = False,
) -> Callable:
    """Like `jax.grad`, for object graphs with shared parameters.

    See `tied.value_and_grad` for the gradient's shape. ``per_location=True``
    returns per-place partials (one array per place: memory per place, for
    diagnostics); the default returns the total once per unique parameter, the
    same object at each of its places.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> g = tied.grad(lambda m: m(x).sum())(c)
        >>> g.layers[0].weight is g.layers[1].weight    # one object: the total
        True
    """
    vg = value_and_grad(fun, argnums, has_aux, per_location=per_location)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


def _sum(xs: list) -> Any:
    return functools.reduce(operator.add, xs)


def accumulate(
    tree: Any,
    grads: Any,
    *,
    convention: Literal["auto", "partials", "total"] = "auto",
) -> Any:
    """Turn a gradient of ``tree`` in any convention into aliased totals.

    Conventions read: per-place partials (plain `jax.grad`, ``per_location=True``),
    the total at the first place with ``None`` elsewhere, and the same total
    object at every place (`tied.grad`). Rule per tie group: where every present
    gradient is one object, take it once; otherwise sum the present ones, ``None``
    counting as zero. ``convention="partials"`` always sums; ``"total"`` takes the
    first present one (for a total repeated as distinct equal arrays).

    This is also the "total gradients" step of the optimisers.

    Args:
        tree: the model the gradient belongs to.
        grads: a tree shaped like the model (``None`` may stand for a whole subtree).
        convention: how to read a tie group whose gradients are distinct objects.

    Returns:
        The gradient as `tied.grad` returns it: one total per unique parameter,
        the same object at each of its places, ``None`` at non-parameters.

    Example:
        >>> p = tied.grad(loss, per_location=True)(c)
        >>> g = tied.accumulate(c, p)
        >>> g.layers[0].weight is g.layers[1].weight
        True
    """
    if convention not in ("auto", "partials", "total"):
        raise ValueError(f"convention must be 'auto', 'partials' or 'total', got {convention!r}.")
    leaves, gdef = flatten(tree)
    return _gradient_tree(gdef, total_of(read_places(gdef, grads), leaves, convention))


def _combine(objs: list, convention: str) -> Any:
    present = [g for g in objs if g is not None]
    if not present:
        return None
    first = present[0]
    if convention == "total":
        return first
    if convention == "auto" and all(g is first for g in present):
        return first
    return _sum(present)


def total_of(found: list, leaves: list, convention: str = "auto") -> list:
    """Per unique array, the total of the gradients read at its places (None: none)."""
    return [_combine(objs, convention) if is_param(x) else None for x, objs in zip(leaves, found)]

