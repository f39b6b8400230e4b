"""The core walk: structure, sharing and paths of an object graph.

This is the one place where sharing is decided. Everything else in `tied`
(gradients, jit, optimisers, checkpoints, inspection) goes through `flatten`,
`unflatten` and the few readers of a `GraphDef` defined here.

A graph is walked depth first. Every object met is one of:

* an *array* (``jax.Array``, ``numpy.ndarray``): a leaf, tracked by identity;
* a *node* (list, tuple, dict, namedtuple, anything in JAX's pytree registry,
  a dataclass, a class given to `register`, a `View`): tracked by identity,
  its children walked in order;
* a *static* (anything else): stored by value in the `GraphDef`, never tied.

The `GraphDef` holds one record per unique node, in first-seen order; a record
refers to its children by reference numbers (leaf ``i`` -> ``3 * i``, node ``j``
-> ``3 * j + 1``, static ``k`` -> ``3 * k + 2``), so a shared object is simply a
number that occurs twice.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from ._view import View

__all__ = [
    "GraphDef",
    "GraphError",
    "flatten",
    "unflatten",
    "register",
    "ties",
]

_registry = jax.tree_util.default_registry

# Node kinds. Mutable kinds are created empty first and filled last, so they
# can sit on a reference cycle; immutable kinds are built from finished children.
LIST, DICT, OBJ, SLOTS = 0, 1, 2, 3  # mutable
TUPLE, NAMEDTUPLE, PYTREE, VIEW = 4, 5, 6, 7  # immutable
_MUTABLE = (LIST, DICT, OBJ, SLOTS)
_KIND_NAMES = ("list", "dict", "object", "dataclass", "tuple", "namedtuple", "pytree", "view")

# Classification of a type (cached): array, static, a node kind, or unknown.
_ARRAY, _STATIC, _UNKNOWN = "array", "static", "unknown"


class ViewInfo(NamedTuple):
    """A view of a graph: ``paths`` (its places), ``fn``, ``source`` (the first path of
    its source) and ``leaf`` (the source's unique-array index, None for a view of a view)."""

    paths: tuple[str, ...]
    fn: Callable[[Any], Any]
    source: str | None
    leaf: int | None


class GraphError(TypeError):
    """A model that `tied` cannot walk or rebuild; the message names the path and the fix."""


_registered: set[type] = set()
_array_types: set[type] = set()  # every array type met so far (compiled plans test against it)
_type_cache: dict[type, Any] = {}
_cache_lock = threading.Lock()


def register(cls: type) -> type:
    """Let `tied` walk instances of a plain Python class through their ``__dict__``.

    Instances are rebuilt without calling ``__init__`` (``object.__new__`` and the
    attributes put back), so any constructor signature works. Usable as a class
    decorator. JAX's pytree registry, dataclasses and Equinox modules need no
    registration.

    Args:
        cls: the class to walk.

    Returns:
        ``cls`` itself.

    Example:
        >>> @tied.register
        ... class Dense:
        ...     def __init__(self, weight, bias):
        ...         self.weight, self.bias = weight, bias
        >>> d1 = Dense(w, b); d2 = Dense(d1.weight, d1.bias)   # tied by reference
    """
    if not isinstance(cls, type):
        raise TypeError(f"tied.register expects a class, got {cls!r}.")
    with _cache_lock:
        _registered.add(cls)
        _type_cache.clear()
        for cache in _plan_caches:
            cache.clear()
    return cls


_STATIC_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.ModuleType,
    np.dtype,
    np.generic,
    type(jax.numpy.tanh),  # jitted functions such as jnp.tanh
    type(jax.nn.relu),  # custom_jvp functions such as jax.nn.relu
    type(Ellipsis),
    range,
    slice,
)


def _classify(x: Any) -> Any:
    t = type(x)
    if t in _registered:
        return OBJ
    if t is View:
        return VIEW
    if isinstance(x, (jax.Array, np.ndarray)):
        return _ARRAY
    if isinstance(x, _STATIC_TYPES) and t not in (list, tuple, dict):
        return _STATIC
    if t is list:
        return LIST
    if t is tuple:
        return TUPLE
    if t is dict:
        return DICT
    if isinstance(x, tuple) and hasattr(t, "_fields") and _registry.is_node(t):
        return NAMEDTUPLE
    if _registry.is_node(t):
        return PYTREE
    if dataclasses.is_dataclass(t):
        return OBJ if hasattr(x, "__dict__") else SLOTS
    return _UNKNOWN


def _kind(x: Any) -> Any:
    t = type(x)
    k = _type_cache.get(t)
    if k is None:
        k = _classify(x)
        if k is not _UNKNOWN:
            _type_cache[t] = k
        if k is _ARRAY:
            _array_types.add(t)
    return k


# Errors raised deep in the walk carry the keys of the path as they unwind.
class _WalkError(Exception):
    def __init__(self, make_message: Callable[[str], str], exc_type: type = GraphError):
        self.keys: list[str] = []
        self.make_message = make_message
        self.exc_type = exc_type

    def finish(self) -> Exception:
        path = "".join(reversed(self.keys))
        return self.exc_type(self.make_message(path or "<root>"))


def _has_arrays(obj: Any) -> bool:
    """Whether arrays sit anywhere below an unwalkable object, looking through the nodes
    and the ``__dict__`` of unregistered objects it holds (a registered layer inside an
    unregistered wrapper too). Iterative and identity-memoised, so cycles end."""
    seen: dict[int, Any] = {}  # id -> object, held so that ids stay unique
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen[id(x)] = x
        k = _kind(x)
        if k is _ARRAY or k == VIEW:
            return True
        if k is _STATIC:
            continue
        if k is _UNKNOWN or k == OBJ:
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            if isinstance(x, (list, tuple)):  # an unregistered subclass of a container
                stack.extend(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
        else:
            stack.extend(_node_children(k, x)[0])
    return False


def _unknown_static(x: Any) -> None:
    if hasattr(x, "__dict__") and _has_arrays(x):
        cls = type(x)
        name = f"{cls.__module__}.{cls.__qualname__}"
        base = next((b.__name__ for b in (list, tuple, dict) if isinstance(x, b)), None)
        if base is not None:
            fix = (
                f"it subclasses {base}, which tied would rebuild as a plain {base}: register "
                f"it with jax.tree_util.register_pytree_node (or hold a plain {base})."
            )
        else:
            fix = (
                f"decorate it with @tied.register, or call tied.register({cls.__qualname__}) "
                "(a dataclass, an Equinox module or a JAX-registered pytree needs nothing)."
            )

        def message(path: str) -> str:
            return (
                f"{path}: an object of unregistered class {name} holds arrays, and tied would "
                f"drop them as a static leaf. Register the class so tied walks it: {fix}"
            )

        raise _WalkError(message)


def _pytree_children(x: Any):
    children, aux = _registry.flatten_one_level(x)
    return list(children), (type(x), aux)


def _node_children(kind: int, x: Any) -> tuple[list, Any]:
    """The children of node ``x`` in walk order, and the meta data that rebuilds it."""
    if kind == LIST:
        return list(x), None
    if kind == TUPLE:
        return list(x), len(x)
    if kind == DICT:
        try:
            keys = tuple(sorted(x))
        except TypeError:
            keys = tuple(x)
        return [x[k] for k in keys], keys
    if kind == OBJ:
        d = x.__dict__
        return list(d.values()), (type(x), tuple(d))
    if kind == NAMEDTUPLE:
        return list(x), type(x)
    if kind == PYTREE:
        return _pytree_children(x)
    if kind == VIEW:
        return [x.source], x.fn
    # SLOTS dataclass
    names = tuple(f.name for f in dataclasses.fields(x))
    return [getattr(x, n) for n in names], (type(x), names)


class GraphDef:
    """The structure of an object graph: node types, static leaves and every sharing.

    Produced by `flatten`, consumed by `unflatten`. Hashable; two graphs with the
    same structure, sharing pattern and equal static leaves give equal GraphDefs.
    """

    __slots__ = (
        "records",
        "statics",
        "root",
        "num_leaves",
        "_hash",
        "_k",
        "_plans",
        "_places",
        "_expanded",
    )

    def __init__(self, records: tuple, statics: tuple, root: int, num_leaves: int):
        self.records = records  # tuple of (kind, meta, child_refs) in first-seen order
        self.statics = statics  # static leaves, by value
        self.root = root
        self.num_leaves = num_leaves
        self._hash: int | None = None
        self._k: Any = None
        self._plans: dict = {}  # compiled rebuild plans and orders, see _plan.py
        self._places: Any = None
        self._expanded: Any = None

    @property
    def num_nodes(self) -> int:
        return len(self.records)

    def _key(self):
        k = self._k
        if k is None:
            k = self._k = (
                self.root,
                self.num_leaves,
                self.records,
                tuple((type(s), s) for s in self.statics),
            )
        return k

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            try:
                h = hash(self._key())
            except TypeError:
                raise self._unhashable_error() from None
            self._hash = h
        return h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, GraphDef):
            return NotImplemented
        if self._hash is not None and other._hash is not None and self._hash != other._hash:
            return False
        try:
            return self._key() == other._key()
        except Exception:  # a static whose __eq__ fails or is ambiguous (an array)
            return False

    def _unhashable_error(self) -> GraphError:
        paths = place_paths(self)
        for k, s in enumerate(self.statics):
            try:
                hash(s)
            except TypeError:
                return GraphError(
                    f"{paths.statics[k]}: static field of type {type(s).__name__} is not hashable, "
                    "but tied.jit and tied.Graph key their cache on static fields. Make it "
                    "hashable (a tuple instead of a list, a frozen dataclass), or hold it as an "
                    "array if it is data."
                )
        return GraphError("a node's static metadata is not hashable; tied.jit needs it hashable.")

    def __repr__(self) -> str:
        return f"GraphDef(num_leaves={self.num_leaves}, num_nodes={self.num_nodes})"

    # ------------------------------------------------ what the layers above may read
    # Everything outside the core reads a GraphDef through these names only.

    def leaf_paths(self) -> tuple[tuple[str, ...], ...]:
        """For each unique array (in `flatten` order), the keystr paths of all its places,
        in walk order. The root's own path is ``""``."""
        return tuple(tuple(p) for p in place_paths(self).leaves)

    def shared_node_paths(self) -> list[tuple[str, ...]]:
        """The places of every container node reached from two or more places, in walk order."""
        return [tuple(p) for p in place_paths(self).nodes if len(p) > 1]

    def views(self) -> list[ViewInfo]:
        """Every `View` of the graph: its places, its function and where its source sits."""
        places = place_paths(self)
        out = []
        for j, (kind, meta, refs) in enumerate(self.records):
            if kind == VIEW and places.nodes[j]:
                q, m = divmod(refs[0], 3)
                if m == 0:
                    source, leaf = places.leaves[q][0], q
                elif m == 1:
                    source, leaf = places.nodes[q][0], None
                else:
                    source, leaf = None, None
                out.append(ViewInfo(tuple(places.nodes[j]), meta, source, leaf))
        return out

    def place_leaves(self) -> tuple[tuple[str, int], ...]:
        """Every array *place* in walk order (a tie counted at each of its places), as
        ``(path, unique leaf index)``; places below a shared node are listed at every
        place of that node. Raises `GraphError` on a reference cycle through arrays."""
        tree_def, place_leaf = expand(self)
        paths = place_paths(tree_def).leaves
        return tuple((paths[k][0], i) for k, i in enumerate(place_leaf))


def flatten(tree: Any) -> tuple[list, GraphDef]:
    """Split an object graph into its unique arrays and its structure.

    Args:
        tree: any object graph: containers, dataclasses, JAX pytrees (Equinox
            modules too), classes given to `tied.register`; it may share arrays
            and nodes and may hold reference cycles through mutable containers.

    Returns:
        ``(leaves, graphdef)``: every array leaf (any dtype) exactly once, in
        first-seen depth-first order however many places hold it, and the
        `GraphDef` recording structure, static leaves and sharing.

    Raises:
        GraphError: an unregistered object holds arrays, or a reference cycle
            passes through an immutable node; the message names the path.

    Example:
        >>> d1 = Dense(w, b); d2 = Dense(d1.weight, d1.bias)
        >>> leaves, gdef = tied.flatten([d1, d2])
        >>> len(leaves)            # w and b, once each
        2
    """
    return flatten_with(tree, _flatten_plans)


class PlanCache(dict):
    """Compiled flatten plans by root type, most recent first. `flatten` shares one;
    `tied.jit` keeps one per function, so that busy programs do not evict its plans."""

    __hash__ = object.__hash__  # by identity, to live in a WeakSet
    __eq__ = object.__eq__


_plan_caches: weakref.WeakSet = weakref.WeakSet()  # cleared when a class is registered


def plan_cache() -> PlanCache:
    cache = PlanCache()
    _plan_caches.add(cache)
    return cache


_flatten_plans = plan_cache()


def flatten_with(tree: Any, cache: PlanCache) -> tuple[list, GraphDef]:
    """`flatten`, trying the compiled plans of ``cache`` first (see _plan.py)."""
    plans = cache.get(type(tree))
    if plans:
        for gdef, plan in plans:
            leaves = plan(tree)
            if leaves is not None:
                return leaves, gdef
    leaves, gdef = _walk(tree)
    return leaves, _maybe_plan(tree, gdef, cache)


# A structure gets a plan the second time the walk meets it; `_seen_once` also
# interns GraphDefs, so equal structures give the very same GraphDef object.
_seen_once: dict[GraphDef, GraphDef] = {}
_MAX_PLANS_PER_TYPE = 8


def _maybe_plan(tree: Any, gdef: GraphDef, cache: PlanCache) -> GraphDef:
    """Count a sighting of ``gdef``; on the second, compile its plan. Returns the
    first-seen equal GraphDef, so that caches keyed on it compare by identity."""
    from ._plan import compile_flatten

    try:
        first = _seen_once.get(gdef)
    except GraphError:  # unhashable static: no plan, the walk stays in charge
        return gdef
    if first is None:
        if len(_seen_once) > 1024:
            _seen_once.clear()
        _seen_once[gdef] = gdef
        return gdef
    plan = compile_flatten(first)
    if plan is not None:
        with _cache_lock:
            _seen_once.pop(first, None)
            old = cache.get(type(tree), ())
            cache[type(tree)] = ((first, plan),) + old[: _MAX_PLANS_PER_TYPE - 1]
    return first


def _walk(tree: Any) -> tuple[list, GraphDef]:
    leaves: list = []
    records: list = []
    statics: list = []
    memo: dict[int, int] = {}
    open_immutable: set[int] = set()
    # Children made on the fly by a pytree's flatten are held here: once freed, their
    # ids could be reused by later objects and read as sharing through `memo`.
    alive: list = []
    kind_of = _kind
    get = memo.get

    def visit(x: Any) -> int:
        k = kind_of(x)
        if k is _ARRAY:
            r = get(id(x))
            if r is None:
                r = 3 * len(leaves)
                memo[id(x)] = r
                leaves.append(x)
            return r
        if k is _STATIC or k is _UNKNOWN:
            if k is _UNKNOWN:
                _unknown_static(x)
            statics.append(x)
            return 3 * len(statics) - 1
        if (k is TUPLE or k is NAMEDTUPLE) and all(kind_of(c) is _STATIC for c in x):
            # A tuple of static values is a value: Python reuses such tuples (`()`,
            # constants), so their identity says nothing. One record per place.
            j = len(records)
            records.append((k, *_node_children(k, x)[1:], tuple(visit(c) for c in x)))
            return 3 * j + 1
        r = get(id(x))
        if r is not None:
            if r in open_immutable:
                _cycle_error(k)
            return r
        j = len(records)
        r = 3 * j + 1
        memo[id(x)] = r
        records.append(None)
        children, meta = _node_children(k, x)
        if k == PYTREE:
            alive.append(children)
        if k >= TUPLE:
            open_immutable.add(r)
        refs = []
        for i, c in enumerate(children):
            try:
                refs.append(visit(c))
            except _WalkError as e:
                e.keys.append(_child_key(k, meta, i, len(children)))
                raise
            except RecursionError:
                raise _WalkError(_too_deep) from None
        if k >= TUPLE:
            open_immutable.discard(r)
        records[j] = (k, meta, tuple(refs))
        return r

    try:
        root = visit(tree)
    except _WalkError as e:
        raise e.finish() from None
    return leaves, GraphDef(tuple(records), tuple(statics), root, len(leaves))


def untracked(record: tuple) -> bool:
    """Whether a node record stands for one place only: a tuple of static values."""
    kind, _, refs = record
    return (kind == TUPLE or kind == NAMEDTUPLE) and all(r % 3 == 2 for r in refs)


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _too_deep(path: str) -> str:
    return f"{path}: the graph is nested too deeply for Python's recursion limit."


def _cycle_error(kind: int) -> None:
    name = _KIND_NAMES[kind]

    def message(path: str) -> str:
        return (
            f"{path}: a reference cycle passes through an immutable node (a {name}), "
            "which cannot be rebuilt since it must exist before its own child. Let the "
            "cycle pass through a mutable container instead (a list, dict, or a "
            "class given to tied.register)."
        )

    raise _WalkError(message)


def _child_key(kind: int, meta: Any, i: int, n: int) -> str:
    """The keystr piece for child ``i`` of a node, as ``jax.tree_util.keystr`` writes it."""
    if kind in (LIST, TUPLE):
        return f"[{i}]"
    if kind == DICT:
        return f"[{meta[i]!r}]"
    if kind in (OBJ, SLOTS):
        return f".{meta[1][i]}"
    if kind == NAMEDTUPLE:
        return f".{meta._fields[i]}"
    if kind == VIEW:
        return ".source"
    return _pytree_keys(meta, n)[i]


_pytree_key_cache: dict = {}


def _pytree_keys(meta: Any, n: int) -> list[str]:
    """Keys of a JAX-registered node's children, read from a stand-in rebuilt from meta."""
    try:
        return _pytree_key_cache[(meta, n)]
    except (KeyError, TypeError):
        pass
    keys = [f"[{i}]" for i in range(n)]
    try:
        stand_in = _pytree_def(meta, n).unflatten([0] * n)
        with_keys = _registry.flatten_one_level_with_keys(stand_in)
        if with_keys is not None and len(with_keys[0]) == n:
            keys = [jax.tree_util.keystr((k,)) for k, _ in with_keys[0]]
    except Exception:
        pass
    try:
        _pytree_key_cache[(meta, n)] = keys
    except TypeError:
        pass
    return keys


_leaf_def = jax.tree_util.tree_structure(0)


def _pytree_def(meta: Any, n: int):
    return jax.tree_util.PyTreeDef.from_node_data_and_children(_registry, meta, [_leaf_def] * n)


# ---------------------------------------------------------------- rebuilding


def _rebuild_plan(gdef: GraphDef) -> tuple:
    """Orders for `unflatten`: mutable nodes (shells first, filled last) and
    immutable nodes in post order, so that each is built after its children."""
    plan = gdef._plans.get("order")
    if plan is not None:
        return plan
    records = gdef.records
    mutable = [j for j, rec in enumerate(records) if rec[0] in _MUTABLE]
    post: list[int] = []
    seen: set[int] = set()
    # An explicit stack: the post order of immutable nodes reachable from each record.
    for start in range(len(records)):
        if start in seen:
            continue
        stack = [(start, 0)]
        seen.add(start)
        while stack:
            j, i = stack.pop()
            refs = records[j][2]
            while i < len(refs):
                r = refs[i]
                i += 1
                if r % 3 == 1 and (r // 3) not in seen:
                    stack.append((j, i))
                    seen.add(r // 3)
                    stack.append((r // 3, 0))
                    break
            else:
                if records[j][0] not in _MUTABLE:
                    post.append(j)
    plan = (tuple(mutable), tuple(post))
    gdef._plans["order"] = plan
    return plan


def _make(kind: int, meta: Any, children: list, materialize: bool) -> Any:
    if kind == TUPLE:
        return tuple(children)
    if kind == NAMEDTUPLE:
        return meta(*children)
    if kind == PYTREE:
        return _pytree_def(meta, len(children)).unflatten(children)
    # VIEW
    if materialize:
        try:
            return meta(children[0])
        except Exception as e:
            raise _view_error(meta, children[0], e) from e
    return View(children[0], meta)


def _view_error(fn, source, e) -> GraphError:
    name = getattr(fn, "__name__", repr(fn))
    shape = getattr(source, "shape", None)
    return GraphError(
        f"the view function {name} failed on its source of shape {shape}: "
        f"{type(e).__name__}: {e}. Give tied.view a function that accepts the source array."
    )


def _shell(kind: int, meta: Any) -> Any:
    if kind == LIST:
        return []
    if kind == DICT:
        return {}
    return object.__new__(meta[0])


def _fill(kind: int, meta: Any, obj: Any, children: list) -> None:
    if kind == LIST:
        obj.extend(children)
    elif kind == DICT:
        obj.update(zip(meta, children))
    elif kind == OBJ:
        obj.__dict__.update(zip(meta[1], children))
    else:
        for name, c in zip(meta[1], children):
            object.__setattr__(obj, name, c)


def unflatten(graphdef: GraphDef, leaves: Any) -> Any:
    """Rebuild an object graph from its `GraphDef` and (new) unique arrays.

    Types, static fields and sharing are those recorded: where the original had
    one object at several places, the result has one object there too, and
    distinct objects stay distinct. Views come back as views.

    Args:
        graphdef: from `tied.flatten`.
        leaves: one value per unique array, in the order `flatten` gave them.

    Returns:
        The rebuilt graph.

    Example:
        >>> leaves, gdef = tied.flatten(model)
        >>> new = tied.unflatten(gdef, [2 * x for x in leaves])
        >>> new.layers[0].weight is new.layers[1].weight   # the tie is kept
        True
    """
    return _unflatten(graphdef, leaves)


def _unflatten(graphdef: GraphDef, leaves: Any, *, statics: Any = None, materialize: bool = False) -> Any:
    leaves = list(leaves)
    if len(leaves) != graphdef.num_leaves:
        raise ValueError(
            f"tied.unflatten: the GraphDef has {graphdef.num_leaves} unique arrays but "
            f"{len(leaves)} leaves were given."
        )
    if statics is None:
        statics = graphdef.statics
    plans = graphdef._plans
    build = plans.get(materialize)
    if build is None:
        count = plans.get("uses", 0) + 1
        plans["uses"] = count
        if count >= 2:
            from ._plan import compile_unflatten

            build = plans[materialize] = compile_unflatten(graphdef, materialize)
    if build is not None:
        try:
            return build(leaves, statics)
        except Exception:
            pass  # a view function failed: the walk below names the path
    records = graphdef.records
    built: list = [None] * len(records)
    mutable, post = _rebuild_plan(graphdef)

    def value(r: int) -> Any:
        q, m = divmod(r, 3)
        if m == 0:
            return leaves[q]
        if m == 1:
            return built[q]
        return statics[q]

    for j in mutable:
        kind, meta, _ = records[j]
        built[j] = _shell(kind, meta)
    for j in post:
        kind, meta, refs = records[j]
        try:
            built[j] = _make(kind, meta, [value(r) for r in refs], materialize)
        except GraphError as e:  # a failing view function: say where the view sits
            where = place_paths(graphdef).nodes[j][0] or "<root>"
            raise GraphError(f"{where}: {e}") from e.__cause__
    for j in mutable:
        kind, meta, refs = records[j]
        _fill(kind, meta, built[j], [value(r) for r in refs])
    return value(graphdef.root)


# ---------------------------------------------------------------- places and paths


class _Places:
    """Every place of a graph, in walk order: where each leaf, node and static sits."""

    __slots__ = ("leaves", "nodes", "statics", "order")

    def __init__(self, leaves, nodes, statics, order):
        self.leaves = leaves  # leaf index -> list of paths
        self.nodes = nodes  # node index -> list of paths
        self.statics = statics  # static index -> path
        self.order = order  # refs in first-seen order (leaves and nodes)


def place_paths(graphdef: GraphDef) -> _Places:
    """All places of every leaf, node and static of a graph, as keystr paths."""
    if graphdef._places is not None:
        return graphdef._places
    records = graphdef.records
    leaf_paths: list[list[str]] = [[] for _ in range(graphdef.num_leaves)]
    node_paths: list[list[str]] = [[] for _ in records]
    static_paths: list[str] = [""] * len(graphdef.statics)
    order: list[int] = []

    def place(r: int, path: str) -> bool:
        q, m = divmod(r, 3)
        if m == 2:
            static_paths[q] = path
            return False
        lst = leaf_paths[q] if m == 0 else node_paths[q]
        if not lst:
            order.append(r)
        lst.append(path)
        return m == 1 and len(lst) == 1

    # Depth first with an explicit stack, children in order, as the walk went.
    root = graphdef.root
    stack: list[tuple[int, int, str]] = []
    if place(root, ""):
        stack.append((root // 3, 0, ""))
    while stack:
        j, i, path = stack.pop()
        kind, meta, refs = records[j]
        if i < len(refs):
            stack.append((j, i + 1, path))
            child_path = path + _child_key(kind, meta, i, len(refs))
            if place(refs[i], child_path):
                stack.append((refs[i] // 3, 0, child_path))
    result = _Places(leaf_paths, node_paths, static_paths, order)
    graphdef._places = result
    return result


def ties(tree: Any) -> list[tuple[str, ...]]:
    """The sharing in a graph: one tuple per object reached from two or more places.

    Arrays and container nodes both count; static leaves never tie. Paths are
    written as ``jax.tree_util.keystr`` writes key paths, in first-seen order.
    The places of a shared node's children are listed under its first place.

    Example:
        >>> d = Dense(w, b)
        >>> tied.ties(Chain(d, d))
        [('.layers[0]', '.layers[1]')]
    """
    _, gdef = flatten(tree)
    places = place_paths(gdef)
    out = []
    for r in places.order:
        q, m = divmod(r, 3)
        paths = places.leaves[q] if m == 0 else places.nodes[q]
        if len(paths) > 1:
            out.append(tuple(p or "<root>" for p in paths))
    return out


# ---------------------------------------------------------------- the expanded tree


def expand(graphdef: GraphDef) -> tuple[GraphDef, tuple[int, ...]]:
    """The graph unrolled into a tree: one node or leaf per *place*.

    Returns the tree's GraphDef and, for each of its leaves (one per place of an
    array), the index of the unique array that stands there. Used for
    per-place gradients and for reading a tree shaped like the model.
    """
    if graphdef._expanded is not None:
        return graphdef._expanded
    records = graphdef.records
    new_records: list = []
    place_leaf: list[int] = []
    open_nodes: set[int] = set()

    def walk(r: int) -> int:
        q, m = divmod(r, 3)
        if m == 0:
            place_leaf.append(q)
            return 3 * (len(place_leaf) - 1)
        if m == 2:
            return r
        if q in open_nodes:
            raise GraphError(
                f"{place_paths(graphdef).nodes[q][0] or '<root>'}: this node is on a reference "
                "cycle, so it has infinitely many places and per-place values cannot be "
                "formed. Use the aliased totals (per_location=False)."
            )
        open_nodes.add(q)
        kind, meta, refs = records[q]
        j = len(new_records)
        new_records.append(None)
        new_refs = tuple(walk(c) for c in refs)
        new_records[j] = (kind, meta, new_refs)
        open_nodes.discard(q)
        return 3 * j + 1

    root = walk(graphdef.root)
    tree_def = GraphDef(tuple(new_records), graphdef.statics, root, len(place_leaf))
    graphdef._expanded = (tree_def, tuple(place_leaf))
    return graphdef._expanded


def read_places(
    graphdef: GraphDef,
    other: Any,
    *,
    what: str = "gradient",
    hint: str = "as tied.grad returns it",
    broadcast: Callable[[Any], bool] | None = None,
) -> list[list]:
    """Read a tree shaped like the graph (a gradient, say) at every place.

    ``other`` mirrors the graph: same node kinds, with anything at leaf places
    (``None`` included), ``None`` standing for a whole subtree, and a `View` (or
    ``None``) at a view's place. It may share nodes or not. Returns, for each
    unique array of the graph, the objects found at its places in walk order.
    Reference cycles are followed once. An object for which ``broadcast`` is
    true stands, like ``None``, for a whole subtree: it is found at every array
    place below (a sharding given for a whole layer, say). ``what`` and
    ``hint`` name the tree in error messages.
    """
    records = graphdef.records
    found: list[list] = [[] for _ in range(graphdef.num_leaves)]
    open_nodes: set[int] = set()
    paths = None

    def path_of(j: int, i: int) -> str:
        nonlocal paths
        paths = paths or place_paths(graphdef)
        kind, meta, refs = records[j]
        return (paths.nodes[j][0] if paths.nodes[j] else "") + _child_key(kind, meta, i, len(refs))

    def mismatch(where: str, expected: str, got: Any) -> GraphError:
        return GraphError(
            f"{where or '<root>'}: the {what} does not mirror the model here: expected "
            f"{expected}, found {type(got).__name__}. Pass a {what} shaped like the model "
            f"({hint})."
        )

    def visit(r: int, obj: Any, where: Callable[[], str]) -> None:
        q, m = divmod(r, 3)
        if m == 2:
            return
        if m == 0:
            found[q].append(obj)
            return
        if q in open_nodes:  # a cycle: its places were read on the way in
            return
        kind, meta, refs = records[q]
        if obj is None or (broadcast is not None and broadcast(obj)):
            open_nodes.add(q)  # a cycle below ends here too
            for c in refs:
                visit(c, obj, where)
            open_nodes.discard(q)
            return
        try:
            if kind in (LIST, TUPLE, NAMEDTUPLE):
                children = list(obj)
                if len(children) != len(refs):
                    raise mismatch(where(), f"a sequence of length {len(refs)}", obj)
            elif kind == DICT:
                children = [obj[k] for k in meta]
            elif kind in (OBJ, SLOTS):
                children = [getattr(obj, n) for n in meta[1]]
            elif kind == VIEW:
                if type(obj) is not View:
                    raise mismatch(where(), "a tied.View (the gradient of a view's source)", obj)
                children = [obj.source]
            else:
                children = list(_registry.flatten_one_level(obj)[0])
                if len(children) != len(refs):
                    raise mismatch(where(), f"a {meta[0].__name__} with {len(refs)} children", obj)
        except (KeyError, AttributeError, TypeError) as e:
            if isinstance(e, GraphError):
                raise
            raise mismatch(where(), f"{_article(_KIND_NAMES[kind])} like the model's", obj) from None
        open_nodes.add(q)
        for i, (c, x) in enumerate(zip(refs, children)):
            visit(c, x, lambda q=q, i=i: path_of(q, i))
        open_nodes.discard(q)

    visit(graphdef.root, other, lambda: "")
    return found
