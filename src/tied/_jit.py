"""Sharing across JAX transforms: `Graph` (a pytree of unique arrays) and `jit`."""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ._grad import is_total, mark_total
from ._graph import GraphDef, GraphError, _unflatten, flatten, flatten_with, plan_cache
from ._sharding import _describe, _same_layout, leaf_shardings

__all__ = ["Graph", "jit"]

_MISSING = object()


@jax.tree_util.register_pytree_node_class
class Graph:
    """A pytree node wrapping an object graph: JAX sees each distinct array once.

    The graph's `GraphDef` is the static auxiliary data, so ``jax.jit``,
    ``jax.grad``, ``jax.vmap``, ``jax.lax.scan`` (as carry), ``jax.checkpoint``
    and ``jax.device_put`` keep every tie of ``Graph(model)``: a shared array is
    one input, one tracer, one gradient, one buffer. Two Graphs with equal
    GraphDefs are the same JAX type, so nothing retraces.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> g = tied.Graph(Chain(d1, Dense(d1.weight, d1.bias)))
        >>> len(jax.tree_util.tree_leaves(g))      # weight and bias once
        2
        >>> out = jax.jit(lambda g: g)(g).value
        >>> out.layers[0].weight is out.layers[1].weight
        True

        Plain ``jax.grad`` of a function of the Graph gives one gradient per tie:

        >>> x = jnp.ones((1, 2))
        >>> grads = jax.grad(lambda g: g.value(x).sum())(g).value
        >>> grads.layers[0].weight is grads.layers[1].weight
        True
        >>> ref = tied.grad(lambda m: m(x).sum())(g.value)
        >>> bool(jnp.allclose(grads.layers[0].weight, ref.layers[0].weight))
        True
    """

    __slots__ = ("leaves", "graphdef", "_value")

    def __init__(self, value: Any):
        self.leaves, self.graphdef = flatten(value)
        self._value = _MISSING  # a snapshot: never the object passed in, which may change

    @property
    def value(self) -> Any:
        """The wrapped object graph as it was when the Graph was made: rebuilt, with its
        ties, from the same arrays JAX sees (never the object passed in, which may have
        been changed in place since)."""
        v = self._value
        if v is _MISSING:
            v = self._value = _unflatten(self.graphdef, self.leaves)
        return v

    def tree_flatten(self):
        return self.leaves, self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef: GraphDef, leaves) -> Graph:
        g = object.__new__(cls)
        g.leaves = list(leaves)
        g.graphdef = graphdef
        g._value = _MISSING
        return g

    def __repr__(self) -> str:
        return f"Graph({self.graphdef.num_leaves} unique arrays, {self.graphdef.num_nodes} nodes)"


@jax.tree_util.register_pytree_node_class
class _Output:
    """What the traced function of `tied.jit` returns: the unique output arrays, with the
    output's GraphDef and the marks of tied's total gradients as static auxiliary data."""

    __slots__ = ("leaves", "graphdef", "totals")

    def __init__(self, leaves: list, graphdef: GraphDef, totals: tuple[bool, ...]):
        self.leaves, self.graphdef, self.totals = leaves, graphdef, totals

    def tree_flatten(self):
        return self.leaves, (self.graphdef, self.totals)

    @classmethod
    def tree_unflatten(cls, aux, leaves) -> _Output:
        return cls(list(leaves), *aux)


def _normalise(nums: int | Sequence[int]) -> tuple[int, ...]:
    return (nums,) if isinstance(nums, int) else tuple(nums)


class _Compiled:
    """What one input structure compiles to: the jitted function and how to read its output."""

    __slots__ = ("fn", "donated", "kept", "in_specs")


def jit(
    fun: Callable,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    **jax_jit_kwargs: Any,
) -> Callable:
    """Like `jax.jit`, with all arguments one DAG and all outputs one DAG.

    An array shared between places (within one argument or across several) is one
    input of the compiled function; an array returned at several places is one
    buffer, the same object at each place; a container node returned twice is one
    object. Donating a model with ties works (each unique buffer is donated once;
    an array also held by an argument that is not donated is not donated). A
    second call with the same structure, sharing and static fields does not
    retrace; a changed sharing pattern does.

    Args:
        fun: the function to compile; arguments and outputs may be any object
            graph `tied.flatten` accepts.
        static_argnums: positional arguments hashed into the cache key instead
            of traced, as in `jax.jit`.
        static_argnames: the same, by name.
        donate_argnums: positional arguments whose buffers may be reused for
            outputs, as in `jax.jit`.
        donate_argnames: the same, by name.
        in_shardings: how the inputs are laid out over devices, as in `jax.jit`:
            one `jax.sharding.Sharding` for every argument, or a tuple with one
            entry per positional argument (static ones left out, as in
            `jax.jit`; keyword arguments get no preference), each a sharding,
            ``None`` (JAX chooses: an input already placed stays as it is) or a
            tree of them shaped like the argument, where a sharding at a node's
            place applies to the whole subtree (`tied.sharding_tree` builds
            one). An array shared by several places, in one argument or
            across arguments, is one input with one sharding; two different
            shardings for it raise an error naming both paths. A committed
            input placed differently raises an error naming its path (place
            it first with `tied.device_put`).
        out_shardings: how the outputs are laid out: one sharding for every
            output array, or a tree shaped like the output (a sharding at a
            node applies to its subtree, ``None``: XLA chooses). As `jax.jit`
            documents for its own, this is `jax.lax.with_sharding_constraint`
            on the output, applied here to each unique output array inside the
            compiled function (the output's structure is only known once
            traced); a shared output array given two shardings is an error.
        **jax_jit_kwargs: passed to `jax.jit` (e.g. ``inline``, ``keep_unused``).

    Returns:
        The compiled function.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> @tied.jit
        ... def step(model, x):
        ...     return tied.grad(lambda m: m(x).sum())(model)
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> model, x = Chain(d1, Dense(d1.weight, d1.bias)), jnp.ones((1, 2))
        >>> g = step(model, x)
        >>> g.layers[0].weight is g.layers[1].weight
        True

        Outputs keep their ties too, with one buffer per shared array:

        >>> same = tied.jit(lambda m: m)(model)
        >>> same.layers[0].weight is same.layers[1].weight
        True
    """
    static_nums = _normalise(static_argnums)
    static_names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    donate_nums = _normalise(donate_argnums)
    donate_names = (donate_argnames,) if isinstance(donate_argnames, str) else tuple(donate_argnames)
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    # Keep jax.jit's convention: a static or donated argument may be named by position or name.
    static_nums += tuple(positional.index(n) for n in static_names if n in positional)
    donate_nums += tuple(positional.index(n) for n in donate_names if n in positional)
    static_names += tuple(positional[i] for i in static_nums if 0 <= i < len(positional))
    donate_names += tuple(positional[i] for i in donate_nums if 0 <= i < len(positional))
    static_nums, static_names = frozenset(static_nums), frozenset(static_names)
    donate_nums, donate_names = frozenset(donate_nums), frozenset(donate_names)
    cache: dict = {}
    plans = plan_cache()
    lock = threading.Lock()

    def split(args: tuple, kwargs: dict):
        n = len(args)
        if static_nums:
            statics = tuple(
                (i, args[i]) for i in range(n) if i in static_nums or i - n in static_nums
            )
            dyn_args = tuple(
                _STATIC if (i in static_nums or i - n in static_nums) else a
                for i, a in enumerate(args)
            )
        else:
            statics, dyn_args = (), args
        if kwargs:
            kw_static = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_names))
            dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
        else:
            kw_static, dyn_kwargs = (), kwargs
        return (statics, kw_static), dyn_args, dyn_kwargs

    def donation(gdef: GraphDef, n_args: int, kw_names: tuple) -> tuple[tuple, tuple]:
        """Which unique leaves are donated: those held only by donated arguments."""
        if not (donate_nums or donate_names):
            return (), tuple(range(gdef.num_leaves))
        donated, kept = set(), set()
        for q, paths in enumerate(gdef.leaf_paths()):
            for path in paths:
                a = _argument_of(path)
                donated_place = (a is not None and (a in donate_nums or a - n_args in donate_nums)) or (
                    _keyword_of(path) in donate_names
                )
                (donated if donated_place else kept).add(q)
        donated -= kept  # an array also held by a kept argument is never donated
        return tuple(sorted(donated)), tuple(q for q in range(gdef.num_leaves) if q not in donated)

    def compile_for(key, gdef: GraphDef, leaves: list, n_args: int, kw_names: tuple) -> _Compiled:
        entry = _Compiled()
        entry.donated, entry.kept = donation(gdef, n_args, kw_names)
        (statics, kw_static) = key[1]
        entry.in_specs = None
        shardings = {}
        if in_shardings is not None:
            specs = entry.in_specs = input_specs(gdef, leaves, n_args, statics)
            shardings["in_shardings"] = (
                [specs[q] for q in entry.donated] if entry.donated else (),
                [specs[q] for q in entry.kept],
            )
        order = entry.donated + entry.kept
        inverse = [0] * len(order)
        for pos, q in enumerate(order):
            inverse[q] = pos

        def flat_fun(donated_leaves, kept_leaves):
            both = list(donated_leaves) + list(kept_leaves)
            leaves = [both[p] for p in inverse]
            dyn_args, dyn_kwargs = _unflatten(gdef, leaves)
            args = list(dyn_args)
            for i, v in statics:
                args[i] = v
            out = fun(*args, **dyn_kwargs, **dict(kw_static))
            out_leaves, out_gdef = flatten(out)
            if out_shardings is not None:
                out_leaves = constrain_outputs(out_gdef, out_leaves)
            # The output's structure, and which of its arrays are tied's own total gradients,
            # travel back through JAX as static auxiliary data.
            return _Output(out_leaves, out_gdef, tuple(map(is_total, out_leaves)))

        entry.fn = jax.jit(
            flat_fun, donate_argnums=(0,) if entry.donated else (), **shardings, **jax_jit_kwargs
        )
        return entry

    def input_specs(gdef: GraphDef, leaves: list, n_args: int, statics: tuple) -> list:
        """One sharding (or None) per unique input leaf, from the per-argument ``in_shardings``."""
        spec: Any = in_shardings
        if isinstance(in_shardings, (tuple, list)) and not isinstance(in_shardings, PartitionSpec):
            static_at = {i for i, _ in statics}
            dynamic = [i for i in range(n_args) if i not in static_at]
            if len(in_shardings) != len(dynamic):
                raise ValueError(
                    f"tied.jit: in_shardings has {len(in_shardings)} entries but the call has "
                    f"{len(dynamic)} positional arguments that are not static. Give one entry per "
                    "such argument (None: no preference), or one sharding for all of them."
                )
            per_arg: list = [None] * n_args
            for i, s in zip(dynamic, in_shardings):
                per_arg[i] = s
            spec = (tuple(per_arg), None)
        try:
            return leaf_shardings(
                gdef, spec, [x.ndim for x in leaves], label="tied.jit in_shardings", name=_place_name
            )
        except GraphError as e:
            raise GraphError(_argument_path(str(e))) from None

    def constrain_outputs(out_gdef: GraphDef, out_leaves: list) -> list:
        specs = leaf_shardings(
            out_gdef,
            out_shardings,
            [x.ndim for x in out_leaves],
            label="tied.jit out_shardings",
            name=lambda p: "output" + p,
        )
        return [
            x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(out_leaves, specs)
        ]

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        static_key, dyn_args, dyn_kwargs = split(args, kwargs)
        leaves, gdef = flatten_with((dyn_args, dyn_kwargs), plans)
        key = (gdef, static_key)
        try:
            entry = cache.get(key)
        except GraphError as e:  # an unhashable static field: say which argument holds it
            raise GraphError(_argument_path(str(e))) from None
        except TypeError:
            raise TypeError(
                "tied.jit: a static argument (static_argnums/static_argnames) is not hashable; "
                "pass a hashable value (a tuple instead of a list), or make it a traced argument."
            ) from None
        if entry is None:
            with lock:
                entry = cache.get(key)
                if entry is None:
                    entry = cache[key] = compile_for(key, gdef, leaves, len(args), tuple(dyn_kwargs))
        try:
            if entry.donated:
                out = entry.fn([leaves[q] for q in entry.donated], [leaves[q] for q in entry.kept])
            else:
                out = entry.fn((), leaves)
        except ValueError as e:
            if entry.in_specs is None or "does not match the sharding" not in str(e):
                raise
            better = _placement_error(gdef, leaves, entry.in_specs)
            if better is None:
                raise
            raise better from e
        if any(out.totals):  # the output holds tied's own total gradients: keep them known
            for x, total in zip(out.leaves, out.totals):
                if total:
                    mark_total(x)
        return _unflatten(out.graphdef, out.leaves)

    wrapped._cache = cache  # for tests and introspection
    return wrapped


def _argument_path(message: str) -> str:
    """Write a path relative to ``(args, kwargs)`` as ``args[i]...`` or ``kwargs['k']...``."""
    m = re.match(r"\[0\]\[(\d+)\]|\[1\]\[", message)
    if m is None:
        return message
    if m.group(1) is not None:
        return f"argument {m.group(1)}: " + message[m.end():]
    return "keyword argument " + message[m.end() - 1:]


def _place_name(path: str) -> str:
    """A path of ``(args, kwargs)`` written as ``args[0].embed.weight`` or ``kwargs['x']``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path or "<root>"


def _placement_error(gdef: GraphDef, leaves: list, specs: list) -> ValueError | None:
    """Which committed input is placed otherwise than ``in_shardings`` asks, by path."""
    for i, (x, s) in enumerate(zip(leaves, specs)):
        if s is None or not isinstance(x, jax.Array) or not getattr(x, "committed", True):
            continue
        if isinstance(s, PartitionSpec) or _same_layout(x.sharding, s, x.ndim):
            continue
        where = _place_name(gdef.leaf_paths()[i][0])
        return ValueError(
            f"tied.jit in_shardings: the input at {where} is already placed as {_describe(x.sharding)}, "
            f"but in_shardings asks for {_describe(s)}. JAX does not move a committed array implicitly: "
            f"place the inputs first, tied.device_put(tree, in_sharding), or change in_shardings."
        )
    return None


def _argument_of(path: str) -> int | None:
    """The positional argument a path of ``(args, kwargs)`` lies in."""
    if not path.startswith("[0]["):
        return None
    end = path.index("]", 4)
    return int(path[4:end])


def _keyword_of(path: str) -> str | None:
    """The keyword argument a path of ``(args, kwargs)`` lies in."""
    if not path.startswith("[1]["):
        return None
    import ast

    end = path.index("]", 4)
    while True:  # a key's repr may hold "]": take the shortest prefix that parses
        try:
            return ast.literal_eval(path[4:end])
        except (SyntaxError, ValueError):
            end = path.index("]", end + 1)


class _StaticMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<static>"


_STATIC = _StaticMarker()
