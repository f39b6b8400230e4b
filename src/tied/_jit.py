"""Sharing across JAX transforms: `Graph` (a pytree of unique arrays) and `jit`."""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._graph import GraphDef, GraphError, _unflatten, flatten

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

    Example:
        >>> g = tied.Graph(Chain(d1, Dense(d1.weight, d1.bias)))
        >>> len(jax.tree_util.tree_leaves(g))      # weight and bias once
        2
        >>> out = jax.jit(lambda g: g)(g).value
        >>> out.layers[0].weight is out.layers[1].weight
        True
    """

    __slots__ = ("leaves", "graphdef", "_value")

    def __init__(self, value: Any):
        self.leaves, self.graphdef = flatten(value)
        self._value = value

    @property
    def value(self) -> Any:
        """The wrapped object graph (rebuilt, with its ties, from the leaves when needed)."""
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


def _normalise(nums: int | Sequence[int]) -> tuple[int, ...]:
    return (nums,) if isinstance(nums, int) else tuple(nums)


class _Compiled:
    """What one input structure compiles to: the jitted function and how to read its output."""

    __slots__ = ("fn", "donated", "kept", "out", "lock")

    def __init__(self):
        self.out: dict = {}  # input avals -> output GraphDef (usually one entry)
        self.lock = threading.Lock()


def jit(
    fun: Callable,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
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
        static_argnums, static_argnames: arguments hashed into the cache key
            instead of traced, as in `jax.jit`.
        donate_argnums, donate_argnames: arguments whose buffers may be reused
            for outputs, as in `jax.jit`.
        **jax_jit_kwargs: passed to `jax.jit` (e.g. ``inline``, ``keep_unused``).

    Returns:
        The compiled function.

    Example:
        >>> @tied.jit
        ... def step(model, x):
        ...     return tied.grad(lambda m: m(x).sum())(model)
        >>> g = step(Chain(d1, Dense(d1.weight, d1.bias)), x)
        >>> g.layers[0].weight is g.layers[1].weight
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
        args_ref, kwargs_ref = gdef.records[gdef.root // 3][2]
        arg_refs = gdef.records[args_ref // 3][2]
        kw_refs = gdef.records[kwargs_ref // 3][2] if kw_names else ()
        kw_sorted = gdef.records[kwargs_ref // 3][1] if kw_names else ()
        donated_refs, kept_refs = [], []
        for i, r in enumerate(arg_refs):
            is_donated = i in donate_nums or i - n_args in donate_nums
            (donated_refs if is_donated else kept_refs).append(r)
        for k, r in zip(kw_sorted, kw_refs):
            (donated_refs if k in donate_names else kept_refs).append(r)
        held_by_kept = _reachable_leaves(gdef, kept_refs)
        donated = sorted(_reachable_leaves(gdef, donated_refs) - held_by_kept)
        kept = [q for q in range(gdef.num_leaves) if q not in set(donated)]
        return tuple(donated), tuple(kept)

    def compile_for(key, gdef: GraphDef, n_args: int, kw_names: tuple) -> _Compiled:
        entry = _Compiled()
        entry.donated, entry.kept = donation(gdef, n_args, kw_names)
        (statics, kw_static) = key[1]
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
            avals = tuple((x.shape, x.dtype) for x in leaves)
            with entry.lock:
                entry.out[avals] = out_gdef
            return out_leaves

        entry.fn = jax.jit(
            flat_fun, donate_argnums=(0,) if entry.donated else (), **jax_jit_kwargs
        )
        return entry

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        static_key, dyn_args, dyn_kwargs = split(args, kwargs)
        leaves, gdef = flatten((dyn_args, dyn_kwargs))
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
                    entry = cache[key] = compile_for(key, gdef, len(args), tuple(dyn_kwargs))
        if entry.donated:
            out_leaves = entry.fn([leaves[q] for q in entry.donated], [leaves[q] for q in entry.kept])
        else:
            out_leaves = entry.fn((), leaves)
        outs = entry.out
        if len(outs) == 1:
            (out_gdef,) = outs.values()
        else:  # the output structure depends on input shapes: look it up by them
            out_gdef = outs[tuple((x.shape, x.dtype) for x in leaves)]
        return _unflatten(out_gdef, out_leaves)

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


def _reachable_leaves(gdef: GraphDef, refs: Sequence[int]) -> set[int]:
    """The unique leaves reachable from some references of a GraphDef."""
    out: set[int] = set()
    seen: set[int] = set()
    stack = list(refs)
    while stack:
        q, m = divmod(stack.pop(), 3)
        if m == 0:
            out.add(q)
        elif m == 1 and q not in seen:
            seen.add(q)
            stack.extend(gdef.records[q][2])
    return out


class _StaticMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<static>"


_STATIC = _StaticMarker()
