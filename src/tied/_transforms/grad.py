"""Structural gradients that accumulate shared parameters, and `accumulate`."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .._core import (
    GraphDef,
    GraphError,
    Trainable,
    flatten,
    is_param,
    read_places,
    rebuild,
    trainable_mask,
    warn_none_selected,
    where,
)
from .escapes import refuse_static_ties, static_snapshot
from .lift import Learnt, call_on_copy, finish, learn_output, output_of, read_writes, refusing_drops
from .totals import is_total, mark_total

__all__ = ["grad", "value_and_grad", "accumulate", "is_param", "trainable_mask"]


def _gradient_tree(structure: GraphDef, grads: list, *, totals: bool = True) -> Any:
    """The model's structure with ``grads`` at its array places and None at every static.

    With ``totals`` the arrays are marked as tied's totals (see `is_total`).
    """
    if totals:
        for g in grads:
            if g is not None:
                mark_total(g)
    # None at every static: a gradient holds nothing at a static place (the core's rebuild
    # takes the statics to put back as an argument).
    return rebuild(structure, grads, statics=(None,) * len(structure.statics))


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
    trainable: Trainable | None = None,
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
        has_aux: whether ``fun`` returns ``(value, aux)``. The aux comes back as
            `tied.jit` returns an output: tied nodes (the model, a layer) with their ties,
            and tied's own total gradients still known as totals.
        per_location: return the per-place partial gradients instead: a distinct
            array at each place (and a distinct node at each place of a shared
            node), summing to the total over each tie group. For diagnostics:
            it costs memory per place, not per parameter.
        trainable: ``(path, array) -> bool``, decided from the keystr path
            (``""`` for the root), shape and dtype. A parameter is trainable
            when it holds at *any* of its places; the others are constants to
            ``fun`` and get ``None`` at every place. None: every parameter.

    Returns:
        A function returning ``(value, grads)``, or ``((value, aux), grads)``.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))      # weight and bias at two places each
        >>> x = jnp.ones((1, 2))
        >>> loss, g = tied.value_and_grad(lambda m: m(x).sum())(c)
        >>> g.layers[0].weight is g.layers[1].weight
        True

        The total is the sum of the per-place partials:

        >>> p = tied.grad(lambda m: m(x).sum(), per_location=True)(c)
        >>> bool(jnp.allclose(p.layers[0].weight + p.layers[1].weight, g.layers[0].weight))
        True

        Only the parameters ``trainable`` accepts get a gradient:

        >>> g = tied.grad(lambda m: m(x).sum(), trainable=lambda p, a: a.ndim > 1)(c)
        >>> g.layers[1].bias is None                # the biases are held fixed
        True
    """
    return _differentiate(fun, argnums, has_aux, per_location, trainable, "tied.value_and_grad")


def _differentiate(fun, argnums, has_aux, per_location, trainable, name: str) -> Callable:
    """`value_and_grad`, its arguments as there; ``name`` (``"tied.grad"`` or
    ``"tied.value_and_grad"``) is the transform a refused change of structure names. The copy,
    the read of the loss's writes, its checks and the write-back are the lift's (`lift.py`);
    what is grad's own: which arguments and parameters are differentiated, the places apart
    under ``per_location``, the call of `jax.value_and_grad` and the gradient tree."""
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
        model = args[nums[0]] if single else tuple(args[i] for i in nums)
        leaves, gdef = flatten(model)
        _refuse_shared_others(args, kwargs, nums, single, gdef, name)
        structure, inputs, diff, place_leaf = _inputs(gdef, leaves, trainable, per_location)

        def call(copy):
            new_args = list(args)
            for i, a in zip(nums, (copy,) if single else copy):
                new_args[i] = a
            return fun(*new_args, **kwargs)

        def run(params):
            full = list(inputs)
            for i, p in zip(diff, params):
                full[i] = p
            # tied.scan/remat inside may write this trace's values into the copy (own); the
            # checks made on the parameters' tracers are carried out beside the aux
            copy, out, checks = call_on_copy(structure, full, call, list(params), materialize=True, own=True)
            # State written during the forward pass (or a parameter replaced) goes back to
            # the caller's objects after the call, as if the loss had run on them.
            now, written = read_writes(
                name,
                copy,
                where,  # the model's own paths (the root is what was given, not jit's args)
                what="the loss",
                refusal={"out_of": "the gradient computation", "advice": _ADVICE},
            )
            value, aux = out if has_aux else (out, None)
            # the aux as tied.jit carries its output: its unique arrays through JAX, its
            # structure (ties, tied nodes, which arrays are totals) as static data
            aux_leaves, aux_gdef, aux_totals = learn_output(aux) if has_aux else ([], None, ())
            learnt = Learnt(tuple(written), tuple(checks.checks), aux_gdef, aux_totals)  # as static data
            return value, (aux_leaves, [now[i] for i in written], checks.values, learnt)

        f = refusing_drops(run, structure, "tied.grad", _kept, where)
        (value, (aux, new_values, checked, learnt)), dparams = jax.value_and_grad(f, has_aux=True)(
            [inputs[i] for i in diff]
        )
        aux = output_of(learnt.out, aux, learnt.totals) if has_aux else None
        written = learnt.written
        if per_location and written:
            written, new_values = _one_per_state(gdef, place_leaf, written, new_values)
        # the checks' flags first: a failed one leaves the caller's objects as they were
        finish(
            learnt, checked, (model, gdef, leaves), new_values, "tied.grad", written=written, by="the loss"
        )
        grads: list = [None] * len(inputs)
        seen: set[int] = set()
        for i, g in zip(diff, dparams):
            # Eager JAX may hand one cotangent object to two inputs (both operands of
            # a + b); a copy keeps gradient identity equal to the model's sharing.
            if id(g) in seen:
                g = jnp.copy(g)
            seen.add(id(g))
            grads[i] = g
        return (value, aux) if has_aux else value, _gradient_tree(structure, grads, totals=not per_location)

    return wrapped


_ADVICE = (
    "Change the model outside the loss, or write new values only into existing places "
    "(a tied.State's .value)."
)


def _inputs(gdef: GraphDef, leaves: list, trainable: Any, per_location: bool) -> tuple:
    """``(structure, inputs, diff, place_leaf)``: what the loss's copy is rebuilt from (``gdef``
    and its arrays, or under ``per_location`` one input per place, a state cell one object),
    which inputs are differentiated (the trainable parameters), and each input's unique array."""
    mask = trainable_mask(gdef, leaves, trainable)
    if trainable is not None and not any(mask):
        state = gdef.state_leaves()
        paths = gdef.leaf_paths()
        params = [paths[q][0] for q, x in enumerate(leaves) if is_param(x) and not state[q]]
        warn_none_selected(trainable, params, who="tied.grad", stacklevel=4)
    if not per_location:
        return gdef, leaves, [i for i, m in enumerate(mask) if m], None
    structure, place_leaf = gdef.expand(keep_state=True)  # state: one object
    return (
        structure,
        [leaves[q] for q in place_leaf],
        [k for k, q in enumerate(place_leaf) if mask[q]],
        place_leaf,
    )


def _refuse_shared_others(args: tuple, kwargs: dict, nums: tuple, single: bool, gdef: GraphDef, name: str):
    """The arguments not in ``argnums`` are passed as they are: an object one of them holds that
    the differentiated ones hold too would be two objects in the loss (one a rebuilt copy)."""
    others = tuple((i, a) for i, a in enumerate(args) if i not in nums and i - len(args) not in nums)
    if others or kwargs:
        root = args[nums[0]] if single else tuple(args[i] for i in nums)
        held = static_snapshot(others, tuple(kwargs.items()))
        refuse_static_ties(held, root, gdef, name, "an argument not differentiated (not in argnums)")


def _kept(result: tuple) -> tuple:
    """What the loss's trace keeps (`refusing_drops`): its output and, last, the new values."""
    aux, values, checked, learnt = result[1]
    return list(learnt.written), [result[0], *aux, *checked, *values]


def _one_per_state(gdef: GraphDef, place_leaf: tuple, written: tuple, values: list) -> tuple[list, list]:
    """Under ``per_location`` the loss's writes are per input (per place); each unique array of
    ``gdef`` is written once: a shared state written at two places computed apart is refused."""
    by_leaf: dict[int, Any] = {}
    for i, v in zip(written, values):
        q = place_leaf[i]
        if q in by_leaf:
            raise GraphError(
                f"{gdef.leaf_paths()[q][0] or '<root>'}: the loss wrote this shared state at two "
                "of its places, which per_location=True computes apart; take the gradient "
                "with per_location=False (state is one object at all its places)."
            )
        by_leaf[q] = v
    return list(by_leaf), list(by_leaf.values())


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    per_location: bool = False,
    trainable: Trainable | None = None,
) -> Callable:
    """Like `jax.grad`, for object graphs with shared parameters.

    See `tied.value_and_grad` for the gradient's shape and ``trainable``.
    ``per_location=True`` returns per-place partials (one array per place:
    memory per place, for diagnostics); the default returns the total once per
    unique parameter, the same object at each of its places.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.arange(3.0)
        >>> model = {"enc": w, "dec": w}                  # one array at two places
        >>> g = tied.grad(lambda m: jnp.sum(m["enc"] ** 2 + 3 * m["dec"]))(model)
        >>> g["enc"] is g["dec"]                          # one object: the total
        True
        >>> g["enc"].tolist()                             # 2 * w from one use, 3 from the other
        [3.0, 5.0, 7.0]
    """
    vg = _differentiate(fun, argnums, has_aux, per_location, trainable, "tied.grad")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


def _sum(xs: list) -> Any:
    return functools.reduce(operator.add, xs)


Convention = Literal["auto", "partials", "total"]


def check_convention(convention: Any) -> None:
    if convention not in ("auto", "partials", "total"):
        raise ValueError(f"convention must be 'auto', 'partials' or 'total', got {convention!r}.")


def accumulate(tree: Any, grads: Any, *, convention: Convention = "auto") -> Any:
    """Turn a gradient of ``tree`` in any convention into aliased totals.

    Conventions read: per-place partials (plain `jax.grad`, ``per_location=True``),
    the total at the first place with ``None`` elsewhere, and the same total
    object at every place (`tied.grad`). Per tie group, ``"auto"`` (the default):

    * distinct objects: partials, summed (``None`` counting as zero);
    * one present gradient: taken as it is (partial or total, the sum is the same);
    * one object at two or more places: taken once *if tied made it* (the output
      of `tied.grad`, `tied.value_and_grad`, `tied.accumulate`, ``Grads.to_tree``).
      Otherwise it is refused: plain `jax.grad` hands one cotangent object to
      both operands of ``a + b``, so an aliased object is just as likely two equal
      partials, and identity cannot tell. Say which: ``convention="partials"``
      (plain `jax.grad` output: sum every place) or ``"total"`` (a total you put
      at each place yourself).

    ``"partials"`` always sums; ``"total"`` takes the first present gradient
    (also for a total repeated as distinct equal arrays).

    This is also the "total gradients" step of the optimisers.

    Args:
        tree: the model the gradient belongs to.
        grads: a tree shaped like the model (``None`` may stand for a whole subtree).
        convention: ``"auto"``, ``"partials"`` or ``"total"``, as above.

    Returns:
        The gradient as `tied.grad` returns it: one total per unique parameter,
        the same object at each of its places, ``None`` at non-parameters.

    Raises:
        ValueError: under ``"auto"``, one array object tied did not make stands
            at several places of a tie; the message names the first place.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> m = {"a": w, "b": w}                          # one parameter, two places
        >>> g = jax.grad(lambda m: jnp.sum(m["a"] + m["b"]))(m)
        >>> g["a"] is g["b"]                              # one cotangent, two partials
        True
        >>> t = tied.accumulate(m, g, convention="partials")
        >>> bool(jnp.all(t["a"] == 2.0)) and t["a"] is t["b"]
        True
    """
    check_convention(convention)
    leaves, gdef = flatten(tree)
    return _gradient_tree(gdef, total_of(read_places(gdef, grads), leaves, convention, gdef))


def _ambiguous(gdef: GraphDef, i: int, n: int) -> ValueError:
    path = gdef.leaf_paths()[i][0] or "<root>"
    return ValueError(
        f"{path}: the gradient holds one array object at {n} places of this tied parameter, "
        "and it is not a total made by tied.grad, so it cannot tell an aliased total (count "
        "it once) from plain jax.grad handing one cotangent to two uses (sum them). Say which "
        "it is: convention='partials' if each place got its own use's gradient (plain "
        "jax.grad on the model as a pytree, one entry per place); convention='total' if the "
        "one object already is the whole gradient (you put a total at every place, or it came "
        "through a tied.Graph or jax.jit, which keep one array per tie). Gradients from "
        "tied.grad, tied.jit and tied.Graph(...).value need no convention."
    )


def total_of(found: list, leaves: list, convention: str, gdef: GraphDef) -> list:
    """Per unique array, the total of the gradients read at its places (None: none).

    ``found`` is `read_places`' answer for ``gdef`` (a flatten of the model,
    whose unique arrays are ``leaves``); see `accumulate` for the rule.
    """
    out: list = []
    for i, (x, objs) in enumerate(zip(leaves, found)):
        present = [g for g in objs if g is not None] if is_param(x) else ()
        if not present:
            out.append(None)
            continue
        first = present[0]
        if convention == "total" or len(present) == 1:
            out.append(first)
        elif convention == "auto" and all(g is first for g in present):
            if not is_total(first):
                raise _ambiguous(gdef, i, len(present))
            out.append(first)
        else:
            out.append(_sum(present))
    return out
