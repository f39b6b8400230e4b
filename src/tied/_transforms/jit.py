"""Sharing across JAX transforms: `Graph` (a pytree of unique arrays) and `jit`."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .._core import (
    GraphDef,
    GraphError,
    flatten,
    plan_cache,
    rebuild,
    write_back,
)
from . import explain
from .checks import run_checks
from .escapes import (
    note_carried,
    note_copy,
    refuse_new_static_arrays,
    refuse_static_ties,
    refuse_static_writes,
    static_record,
    static_snapshot,
)
from .lift import call_on_copy, learn_output, output_of, read_writes, refusing_drops
from .sharding import _describe_sharding, _same_layout, copy_shardings, leaf_shardings
from .totals import is_total, mark_total
from .writes import flatten_arguments, place_name

__all__ = ["Graph", "Jitted", "jit", "block_until_ready"]

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

        Such a gradient is one total per tie, and tied knows it: `tied.optim.update`
        takes it as it is (no ``convention``):

        >>> import optax
        >>> model = g.value
        >>> state = tied.optim.setup(optax.adam(1e-2), model)
        >>> new, state = tied.optim.update(state, model, grads)
        >>> new.layers[0].weight is new.layers[1].weight
        True

        ``Graph(x)`` is for a model or tied's own gradients: a Graph made inside a
        transform from plain ``jax.grad`` partials that share one object is refused as
        ambiguous, but one made outside any transform from such partials and rebuilt by
        JAX would be read as a total too.
    """

    __slots__ = ("leaves", "graphdef", "_value", "_trusted", "_made")

    def __init__(self, value: Any):
        self.leaves, self.graphdef = flatten(value)
        self._value = _MISSING  # a snapshot: never the object passed in, which may change
        self._made = True
        # A Graph made inside a transform from computed values whose ties are not tied's own
        # totals (plain jax.grad's aliased partials, say) must not pass them off as totals.
        traced = any(isinstance(x, jax.core.Tracer) for x in self.leaves)
        self._trusted = not traced or not any(
            isinstance(x, jax.core.Tracer) and len(paths) > 1 and not is_total(x)
            for x, paths in zip(self.leaves, self.graphdef.leaf_paths())
        )  # the places are read only for a Graph made inside a transform
        if traced:  # what a body carries out of a plain JAX transform (see note_copy)
            note_carried(self.leaves)

    @property
    def value(self) -> Any:
        """The wrapped object graph as it was when the Graph was made: rebuilt, with its
        ties, from the same arrays JAX sees (never the object passed in, which may have
        been changed in place since)."""
        v = self._value
        if v is _MISSING:
            v = self._value = rebuild(self.graphdef, self.leaves)
            if not self._made and any(isinstance(x, jax.core.Tracer) for x in self.leaves):
                note_copy(v, self.graphdef, self.leaves)  # rebuilt by JAX inside a transform
            if not self._made and self._trusted:
                # Rebuilt by JAX from one array per tie: a gradient that came back through a
                # Graph (jax.grad of a function of it) is a total at every place, known as one.
                for x in self.leaves:
                    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
                        mark_total(x)
        return v

    def tree_flatten(self):
        return self.leaves, _GraphAux(self.graphdef, self._trusted)

    @classmethod
    def tree_unflatten(cls, aux: _GraphAux, leaves) -> Graph:
        g = object.__new__(cls)
        g.leaves = list(leaves)
        g.graphdef, g._trusted = aux.graphdef, aux.trusted
        g._value = _MISSING
        g._made = False
        return g

    def __repr__(self) -> str:
        return f"Graph({self.graphdef.num_leaves} unique arrays, {self.graphdef.num_nodes} nodes)"


class _GraphAux:
    """A Graph's static data: its GraphDef (what JAX compares: two Graphs of one structure
    are one JAX type) and whether its arrays may be read as totals when JAX rebuilds it."""

    __slots__ = ("graphdef", "trusted")

    def __init__(self, graphdef: GraphDef, trusted: bool):
        self.graphdef, self.trusted = graphdef, trusted

    def __eq__(self, other: object) -> bool:
        return type(other) is _GraphAux and other.graphdef == self.graphdef

    def __hash__(self) -> int:
        return hash(self.graphdef)

    def __repr__(self) -> str:
        return repr(self.graphdef)


@jax.tree_util.register_pytree_node_class
class _Output:
    """What the traced function of `tied.jit` returns: the unique output arrays, with the
    output's GraphDef and the positions of tied's total gradients as static auxiliary data."""

    __slots__ = ("leaves", "graphdef", "totals", "written", "checks")

    def __init__(self, leaves: list, graphdef: GraphDef, totals: tuple[int, ...], written: Any, checks=()):
        self.leaves, self.graphdef, self.totals, self.written = leaves, graphdef, totals, written
        self.checks = checks  # `checks.check`s made in the trace: their values end ``leaves``

    def tree_flatten(self):
        return self.leaves, (self.graphdef, self.totals, self.written, self.checks)

    @classmethod
    def tree_unflatten(cls, aux, leaves) -> _Output:
        return cls(list(leaves), *aux)


def _normalise(nums: int | Sequence[int]) -> tuple[int, ...]:
    return (nums,) if isinstance(nums, int) else tuple(nums)


# ---------------------------------------------------------------- one compiled structure


class _Compiled:
    """What one input structure compiles to: the jitted function, which unique leaves are
    donated, and (learnt when it is traced) which input leaves it writes back."""

    __slots__ = ("fn", "donated", "kept", "in_specs", "cells", "statics")


class _Written:
    """Static auxiliary data of the traced function's output: which unique input leaves it
    wrote (new values at existing places of the arguments, or donated arrays handed back)."""

    __slots__ = ("indices",)

    def __init__(self, indices: tuple[int, ...]):
        self.indices = indices

    def __eq__(self, other: object) -> bool:
        return type(other) is _Written and other.indices == self.indices

    def __hash__(self) -> int:
        return hash(self.indices)


# ---------------------------------------------------------------- donation


def arguments(gdef: GraphDef, n_args: int, kw_order: tuple) -> list[set]:
    """For each unique leaf of ``(args, kwargs)``, the arguments (an int position or a str
    keyword) holding it at any place, below shared nodes too. The root is the pair, so the
    places at depth 2 are the arguments themselves, in order (kwargs in the dict's order)."""
    owners: list[set] = [set() for _ in range(gdef.num_leaves)]
    names = [None, list(range(n_args)), sorted(kw_order)]
    side = arg = None
    count = [0, 0, 0]
    for place in gdef.walk_places(expand_shared=True, cut_cycles=True):
        if place.depth == 1:
            side = 1 if count[0] == 0 else 2
            count[0] += 1
            continue
        if place.depth == 2:
            arg = names[side][count[side]]
            count[side] += 1
        if place.depth >= 2 and place.kind == "array":
            owners[place.index].add(arg)
    return owners


def is_donated(a: Any, n_args: int, nums: frozenset, names: frozenset) -> bool:
    if isinstance(a, int):
        return a in nums or a - n_args in nums
    return a in names


def donation(gdef: GraphDef, n_args: int, kw_order: tuple, nums: frozenset, names: frozenset):
    """Which unique leaves are donated: those held only by donated arguments (every place
    counts, below shared nodes too)."""
    if not (nums or names):
        return (), tuple(range(gdef.num_leaves))

    owners = arguments(gdef, n_args, kw_order)
    donated = tuple(
        q for q, own in enumerate(owners) if own and all(is_donated(a, n_args, nums, names) for a in own)
    )
    gone = set(donated)
    return donated, tuple(q for q in range(gdef.num_leaves) if q not in gone)


def distinct_donations(donated: list, kept: list) -> list:
    """The donated inputs, each buffer given once: state cells given one array are two
    unique arrays of one object, and XLA refuses a buffer donated twice or donated and
    passed too, so a later one is a copy (the state it stands for is written back apart)."""
    seen = {id(x) for x in kept}
    out = []
    for x in donated:
        if id(x) in seen and isinstance(x, jax.Array):
            x = jnp.copy(x)
        seen.add(id(x))
        out.append(x)
    return out


def returns_copy(out_gdef: GraphDef, out: Any, arg: Any) -> bool:
    """Whether ``out`` holds a graph with the structure of ``arg`` (the root or a node one or
    two levels down): a donated argument's updated copy, which the caller rebinds."""
    target = flatten(arg)[1]
    if out_gdef == target:
        return True
    level = [out]
    for _ in range(2):
        nxt = []
        for x in level:
            if isinstance(x, (tuple, list)):
                nxt.extend(x)
            elif isinstance(x, dict):
                nxt.extend(x.values())
        for x in nxt:
            if isinstance(x, (list, tuple, dict)) or hasattr(x, "__dict__") or hasattr(x, "__slots__"):
                try:
                    if flatten(x)[1] == target:
                        return True
                except GraphError:
                    pass
        level = nxt
    return False


# ---------------------------------------------------------------- the traced function


def _trace_body(
    fun, gdef, statics, kw_static, donate_nums, donate_names, out_shardings_fn, inverse, given, traced_statics
):
    """The function `jax.jit` traces for one input structure: rebuild the arguments, run
    ``fun``, and return its output's unique arrays plus the new values ``fun`` put at
    existing places of its arguments (written back by the caller)."""

    def call(root):
        dyn_args, dyn_kwargs = root
        args = list(dyn_args)
        for i, v in statics:
            args[i] = v
        return fun(*args, **dyn_kwargs, **dict(kw_static))

    def traced(donated_leaves, kept_leaves):
        both = list(donated_leaves) + list(kept_leaves)
        leaves = [both[p] for p in inverse]
        held = static_snapshot(statics, kw_static)  # the caller's own objects: never written
        if traced_statics() is not None:  # JAX traces again (a weak type, a new placement):
            # the statics it reads are the first call's objects, which may have changed since
            refuse_new_static_arrays(traced_statics(), held[0], "tied.jit")
        # checks' values are read after the call (a cache's position)
        copy, out, checks = call_on_copy(gdef, leaves, call, both)
        dyn_args, dyn_kwargs = copy.value
        out_leaves, out_gdef, totals = learn_output(out)  # which are tied's totals: static data
        if out_shardings_fn is not None:
            out_leaves = out_shardings_fn(out_gdef, out_leaves)
        elif given is not None and len(given) == len(leaves):
            out_leaves = _keep_input_shardings(
                [*dyn_args, *dyn_kwargs.values()], out, leaves, out_leaves, given
            )
        refuse_static_writes(held)
        # What fun wrote into its arguments: the same structure, new objects at some places.
        after_leaves, written = read_writes("tied.jit", copy, place_name, refusal={}, flat=flatten_arguments)
        n_donated = len(donated_leaves)
        if n_donated:
            # A donated argument that is not handed back as an updated copy stays usable:
            # its donated arrays come back (aliased, no copy) and are written back too.
            owners = arguments(gdef, len(dyn_args), tuple(dyn_kwargs))
            given_up = set()
            for a in set().union(*owners):
                arg = dyn_args[a] if isinstance(a, int) else dyn_kwargs[a]
                if is_donated(a, len(dyn_args), donate_nums, donate_names) and returns_copy(
                    out_gdef, out, arg
                ):
                    given_up.add(a)
            seen = set(written)
            for q, pos in enumerate(inverse):
                if pos < n_donated and q not in seen and not (owners[q] & given_up):
                    seen.add(q)
            written = sorted(seen)
        new_values = [after_leaves[q] for q in written]
        # The output's structure, which of its arrays are tied's own total gradients, and
        # what was written travel back through JAX as static auxiliary data.
        return _Output(
            out_leaves + new_values + checks.values,
            out_gdef,
            totals,
            _Written(tuple(written)),
            tuple(checks.checks),
        )

    def kept(out: _Output) -> tuple:  # the arrays returned and written back, not the checks'
        return out.written.indices, out.leaves[: len(out.leaves) - sum(1 + n for _, n in out.checks)]

    # state a plain JAX transform inside fun dropped: refused
    return refusing_drops(traced, gdef, "tied.jit", kept)


def _given_shardings(leaves: list) -> tuple | None:
    """The shardings of a call's arrays when one is spread over devices, else None: part of the
    cache key of a plain `tied.jit`, since JAX does not trace again when only an input's
    sharding changes (it compiles the jaxpr traced for the first placement), and the body bakes
    these shardings into the updated copies it returns."""
    if jax.device_count() == 1:  # nothing can be spread (the common case: no work per array)
        return None
    shardings = tuple(
        x.sharding if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None
        for x in leaves
    )
    return shardings if any(_spread(s) for s in shardings) else None


def _placement_key(given: tuple) -> tuple:
    """``given`` as a cache key: one entry per placement, whichever way a spec is written
    (XLA hands ``P(None,)`` back as ``P()``); shardings on one device are not constrained."""
    out = []
    for s in given:
        if not _spread(s):
            out.append(None)
        elif isinstance(s, NamedSharding):
            spec = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in s.spec]
            while spec and spec[-1] is None:
                spec.pop()
            out.append((s.mesh, tuple(spec), s.memory_kind))
        else:
            out.append(s)
    return tuple(out)


def _spread(s: Any) -> bool:
    return s is not None and type(s) is not SingleDeviceSharding and len(s.device_set) > 1


def _keep_input_shardings(args: list, out: Any, leaves: list, out_leaves: list, given: list) -> list:
    """With no ``out_shardings`` given, an updated copy of an argument (a training step's new
    model and optimiser state) leaves the program sharded as the argument came in, never as
    XLA chose (a replicated bias handed back split); other outputs are left to XLA."""
    of = {id(t): s for t, s in zip(leaves, given)}
    wanted = copy_shardings(args, out, lambda x: of.get(id(x)))
    return [jax.lax.with_sharding_constraint(x, s) if _spread(s) else x for x, s in zip(out_leaves, wanted)]


class Jitted:
    """A function compiled by `tied.jit`: call it, ``.lower(*args)`` it, bind it as a method."""

    def __init__(self, fun: Callable, options: dict):
        functools.update_wrapper(self, fun)
        self.fun = fun
        o = options
        static_nums = _normalise(o["static_argnums"])
        sn = o["static_argnames"]
        static_names = (sn,) if isinstance(sn, str) else tuple(sn)
        donate_nums = _normalise(o["donate_argnums"])
        dn = o["donate_argnames"]
        donate_names = (dn,) if isinstance(dn, str) else tuple(dn)
        try:
            self._signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self._signature = None
        params = list(self._signature.parameters.values()) if self._signature else []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._bind = self._signature is not None and not any(p.kind == p.VAR_KEYWORD for p in params)
        # jax.jit's convention: a static or donated argument may be named by position or name.
        static_nums += tuple(positional.index(n) for n in static_names if n in positional)
        donate_nums += tuple(positional.index(n) for n in donate_names if n in positional)
        static_names += tuple(positional[i] for i in static_nums if 0 <= i < len(positional))
        donate_names += tuple(positional[i] for i in donate_nums if 0 <= i < len(positional))
        self._static_nums, self._static_names = frozenset(static_nums), frozenset(static_names)
        self._donate_nums, self._donate_names = frozenset(donate_nums), frozenset(donate_names)
        self._in_shardings = o["in_shardings"]
        self._out_shardings = o["out_shardings"]
        self._jax_kwargs = o["jax_jit_kwargs"]
        self._compiled: dict = {}
        self._plans = plan_cache()
        self._lock = threading.Lock()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<tied.jit of {getattr(self.fun, '__qualname__', self.fun)!r}>"

    # ------------------------------------------------ calling
    def _prepare(self, args: tuple, kwargs: dict):
        if kwargs and self._bind:
            # Arguments given by keyword are placed by the signature, so that static_argnums
            # and donate_argnums name the same argument however it is passed.
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError:
                pass
            else:
                args, kwargs = bound.args, bound.kwargs
        static_key, dyn_args, dyn_kwargs = _split(args, kwargs, self._static_nums, self._static_names)
        root = (dyn_args, dyn_kwargs)
        leaves, gdef = flatten_arguments(root, self._plans)
        key = (gdef, static_key)
        given = _given_shardings(leaves) if self._out_shardings is None else None
        ckey = key if given is None else (*key, _placement_key(given))
        try:
            entry = self._compiled.get(ckey)
        except GraphError as e:  # an unhashable static field: say which argument holds it
            raise e.named(place_name) from None
        except TypeError:
            raise TypeError(
                "tied.jit: a static argument (static_argnums/static_argnames) is not hashable; "
                "pass a hashable value (a tuple instead of a list), or make it a traced argument."
            ) from None
        fresh = False
        if entry is None:
            with self._lock:
                entry = self._compiled.get(ckey)
                if entry is None:
                    entry = self._compiled[ckey] = self._compile(
                        key, gdef, leaves, len(args), tuple(dyn_kwargs), given
                    )
                    # new to explain only if no other placement made an entry for this key
                    fresh = not any(k[:2] == key for k in self._compiled if k is not ckey)
        return root, leaves, gdef, entry, (key, fresh)

    def _inputs(self, entry: _Compiled, leaves: list) -> tuple:
        if entry.donated:
            donated, kept = [leaves[q] for q in entry.donated], [leaves[q] for q in entry.kept]
            return (distinct_donations(donated, kept) if entry.cells else donated), kept
        return (), leaves

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        root, leaves, gdef, entry, (key, fresh) = self._prepare(args, kwargs)
        self._check_statics(key, root, gdef, entry)
        watch = explain.enabled()  # JAX_EXPLAIN_CACHE_MISSES: say why a call compiled
        size = entry.fn._cache_size() if watch else 0
        try:
            out = entry.fn(*self._inputs(entry, leaves))
        except ValueError as e:
            if entry.in_specs is None or "does not match the sharding" not in str(e):
                raise
            better = _placement_error(gdef, leaves, entry.in_specs)
            if better is None:
                raise
            raise better from e
        finally:
            if watch:  # every call that added a compiled version, whatever the switch saw before
                explain.explain(self, key, leaves, fresh, entry.fn._cache_size() > size)
        written = out.written.indices
        out_leaves = out.leaves
        if out.checks:  # before anything is written back: a failed check leaves the caller as it was
            n_checked = len(out_leaves) - sum(1 + n for _, n in out.checks)
            try:
                run_checks(out.checks, out_leaves[n_checked:])
            except Exception as e:
                if entry.donated:
                    e.add_note(
                        "tied.jit: the arrays of the arguments donated to this call (donate_argnums) are "
                        "gone (JAX took their buffers when the program started); nothing was written back."
                    )
                raise
            out_leaves = out_leaves[:n_checked]
        if written:
            n_out = len(out_leaves) - len(written)
            write_back(root, gdef, written, out_leaves[n_out:], "tied.jit", leaves, name=place_name)
            out_leaves = out_leaves[:n_out]
        return output_of(out.graphdef, out_leaves, out.totals)  # tied's totals known again

    cache_size = explain.cache_size  # the number of compiled versions (src/tied/explain.py)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lower for these arguments, as ``jax.jit(f).lower``: JAX's ``Lowered`` (read its
        HLO with ``.as_text()``, compile it, ask ``.cost_analysis()``)."""
        root, leaves, gdef, entry, (key, _) = self._prepare(args, kwargs)
        self._check_statics(key, root, gdef, entry)  # JAX keeps this trace for later calls
        return entry.fn.lower(*self._inputs(entry, leaves))

    def _check_statics(self, key: tuple, root: Any, gdef: GraphDef, entry: _Compiled) -> None:
        """Before a call or a lowering: refuse a static argument that holds a node the traced
        ones hold too, or other arrays than the call that made this version (``entry.statics``,
        compared again whenever JAX traces the version anew)."""
        if key[1] == ((), ()):
            return
        held = static_snapshot(*key[1])  # one object in a static and a traced argument: two inside
        refuse_static_ties(held, root, gdef, "tied.jit")
        refuse_new_static_arrays(entry.statics, held[0], "tied.jit")

    # ------------------------------------------------ compiling
    def _compile(self, key, gdef: GraphDef, leaves: list, n_args: int, kw_order: tuple, given) -> _Compiled:
        entry = _Compiled()
        # the arrays the statics hold now, which the body's trace reads (as constants): taken
        # here, by the call that made the entry, so that no other call's statics are recorded
        entry.statics = static_record(static_snapshot(*key[1])[0]) if key[1] != ((), ()) else None
        entry.donated, entry.kept = donation(gdef, n_args, kw_order, self._donate_nums, self._donate_names)
        entry.cells = any(gdef.state_leaves())  # two cells may hold one array: donate it once
        statics, kw_static = key[1]
        entry.in_specs = None
        shardings = {}
        if self._in_shardings is not None:
            specs = entry.in_specs = _input_specs(self._in_shardings, gdef, leaves, n_args, statics)
            shardings["in_shardings"] = (
                [specs[q] for q in entry.donated] if entry.donated else (),
                [specs[q] for q in entry.kept],
            )
        order = entry.donated + entry.kept
        inverse = [0] * len(order)
        for pos, q in enumerate(order):
            inverse[q] = pos
        constrain = None
        if self._out_shardings is not None:
            out_shardings = self._out_shardings

            def constrain(out_gdef, out_leaves):
                return _constrain_outputs(out_shardings, out_gdef, out_leaves)

        body = _trace_body(
            self.fun,
            gdef,
            statics,
            kw_static,
            self._donate_nums,
            self._donate_names,
            constrain,
            inverse,
            given,
            lambda: entry.statics,
        )
        entry.fn = jax.jit(
            body, donate_argnums=(0,) if entry.donated else (), **shardings, **self._jax_kwargs
        )
        return entry


def _split(args: tuple, kwargs: dict, static_nums: frozenset, static_names: frozenset):
    """The static arguments (hashed into the cache key) and the dynamic ones (flattened)."""
    n = len(args)
    if static_nums:
        statics = tuple((i, args[i]) for i in range(n) if i in static_nums or i - n in static_nums)
        dyn_args = tuple(
            _STATIC if (i in static_nums or i - n in static_nums) else a for i, a in enumerate(args)
        )
    else:
        statics, dyn_args = (), tuple(args)
    if kwargs:
        kw_static = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_names))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
    else:
        kw_static, dyn_kwargs = (), {}
    return (statics, kw_static), dyn_args, dyn_kwargs


def _input_specs(in_shardings: Any, gdef: GraphDef, leaves: list, n_args: int, statics: tuple) -> list:
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
            gdef, spec, [x.ndim for x in leaves], label="tied.jit in_shardings", name=place_name
        )
    except GraphError as e:
        raise (e if e.path is None else e.named(place_name)) from None


def _constrain_outputs(out_shardings: Any, out_gdef: GraphDef, out_leaves: list) -> list:
    specs = leaf_shardings(
        out_gdef,
        out_shardings,
        [x.ndim for x in out_leaves],
        label="tied.jit out_shardings",
        name=lambda p: "output" + p,
    )
    return [x if s is None else jax.lax.with_sharding_constraint(x, s) for x, s in zip(out_leaves, specs)]


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
) -> Jitted:
    """Like `jax.jit`, with all arguments one DAG and all outputs one DAG.

    An array shared between places (within one argument or across several) is one
    input of the compiled function; an array returned at several places is one
    buffer, the same object at each place; a container node returned twice is one
    object. Donating a model with ties works (each unique buffer is donated once;
    an array also held by an argument that is not donated is not donated). A
    second call with the same structure, sharing and static fields does not
    retrace; a changed sharing pattern does.

    ``f`` behaves as if run eagerly, mutations included: every new value it puts
    at an existing place of its arguments (a `tied.State` written, a parameter
    replaced, as `tied.optim.update_inplace` does) is written into your own
    objects after the call, once per unique object, under `tied.live_lock`. A
    change of structure that cannot leave a compiled function (a tie cut, an
    attribute added, a static changed) is a `GraphError` naming the path, with
    your objects untouched. A donated argument that ``f`` does not hand back as
    an updated copy stays usable: its arrays come back aliased (no copy).

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
        The compiled function (``.lower(*args)`` gives JAX's ``Lowered``).

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

        State written inside reaches your objects, as if run eagerly:

        >>> calls = tied.State(jnp.zeros((), jnp.int32))
        >>> @tied.jit
        ... def count(c):
        ...     c.value = c.value + 1
        >>> count(calls); count(calls)
        >>> int(calls.value)
        2
    """
    return Jitted(
        fun,
        dict(
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            jax_jit_kwargs=jax_jit_kwargs,
        ),
    )


def block_until_ready(tree: Any) -> Any:
    """Wait until every array of an object graph is computed; returns ``tree``.

    ``jax.block_until_ready`` walks its argument as a pytree, which a tied node
    refuses (walking it leaf by leaf would cut its ties); this reads each unique
    array once.

    Examples:
        >>> import jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> model = tied.block_until_ready(Chain(d, d))
        >>> model.layers[0] is model.layers[1]
        True
    """
    leaves, _ = flatten(tree)
    jax.block_until_ready([x for x in leaves if isinstance(x, jax.Array)])
    return tree


def _placement_error(gdef: GraphDef, leaves: list, specs: list) -> ValueError | None:
    """Which committed input is placed otherwise than ``in_shardings`` asks, by path."""
    for i, (x, s) in enumerate(zip(leaves, specs)):
        if s is None or not isinstance(x, jax.Array) or not getattr(x, "committed", True):
            continue
        if isinstance(s, PartitionSpec) or _same_layout(x.sharding, s, x.ndim):
            continue
        where = place_name(gdef.leaf_paths()[i][0])
        return ValueError(
            f"tied.jit in_shardings: the input at {where} is already placed as "
            f"{_describe_sharding(x.sharding)}, but in_shardings asks for {_describe_sharding(s)}. "
            "JAX does not move a committed array implicitly: "
            f"place the inputs first, tied.device_put(tree, in_sharding), or change in_shardings."
        )
    return None


class _StaticMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<static>"


_STATIC = _StaticMarker()
