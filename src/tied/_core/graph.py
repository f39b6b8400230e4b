"""The core walk: `flatten`, `unflatten`, and the compiled plans that replay them.

This is the one place where sharing is decided. Everything else in `tied`
(gradients, jit, optimisers, checkpoints, inspection) goes through `flatten`,
`unflatten` and the named readers of a `GraphDef` (`_graphdef`).

A graph is walked depth first. Every object met is one of (`_classify`):

* an *array* (``jax.Array``, ``numpy.ndarray``): a leaf, tracked by identity;
* a *node*: one of the kinds in the table `_kinds.KINDS` (list, dict, registered
  object, slotted dataclass, list/dict subclass given to `register`, tuple,
  namedtuple, anything in JAX's pytree registry, `View`, `State`): tracked by
  identity, its children walked in order;
* a *static* (anything else): stored by value in the `GraphDef`, never tied; an
  object the walk cannot enter that holds arrays is an error, never dropped.

A structure seen twice gets compiled plans (`_plan`), kept in the caches here and
checked against the walk under ``TIED_CHECK_PLANS=1``. The core's modules, bottom
up: `_strict`, `_kinds`, `_classify`, `_graphdef`, `_plan`, this one. This module
re-exports the names the rest of `tied` imports from it. See ``src/tied/README.md``.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import classify
from .classify import (
    _ARRAY,
    _STATIC,
    _UNKNOWN,
    _arrays_in_static_data,
    _cache_lock,
    _cycle_error,
    _has_arrays,
    _kind,
    _type_cache,
    _unknown_static,
    clear_caches,
    is_walkable_type,
    register,
)
from .graphdef import (
    GraphDef,
    Place,
    StateClash,
    ViewInfo,
    check_state,
    expand,
    place_paths,
    post_order,
    rebuild_order,
    untracked,
    view_failed,
)
from .kinds import _MUTABLE, KIND_BY_NAME, KINDS, GraphError, Kind, _WalkError
from .plans import (
    LARGE_PLAN_SIGHTINGS,
    MAX_PLAN_LINES,
    compile_flatten,
    compile_unflatten,
    flatten_lines,
    layout_and_order,
    plan_bound,
    unflatten_lines,
)
from .read import node_objects, read_places
from .refs import LEAF, NODE, STATIC, TAGS, split_ref

__all__ = [
    "GraphDef",
    "GraphError",
    "Place",
    "ViewInfo",
    "flatten",
    "is_state",
    "unflatten",
    "register",
    "ties",
]
# Re-exported for the modules above (they import these from `_graph`).
_REEXPORTED = (KIND_BY_NAME, Kind, clear_caches, is_walkable_type)
_REEXPORTED += (expand, place_paths, read_places, untracked, StateClash)


# ---------------------------------------------------------------- flatten


def flatten(tree: Any) -> tuple[list, GraphDef]:
    """Split an object graph into its unique arrays and its structure.

    The result depends only on the graph given, never on what was flattened
    before: leaves come in the walk's order (a registered object's fields in
    assignment order, a dict's keys sorted when they can be), and static leaves
    are recorded as they are (type and bits).

    Args:
        tree: any object graph: containers, dataclasses, JAX pytrees (Equinox
            modules too), classes given to `tied.register`; it may share arrays
            and nodes and may hold reference cycles through mutable containers.

    Returns:
        ``(leaves, graphdef)``: every array leaf (any dtype) exactly once, in
        first-seen depth-first order however many places hold it, and the
        `GraphDef` recording structure, static leaves and sharing.

    Raises:
        GraphError: an object the walk cannot enter holds arrays, or a reference
            cycle passes through an immutable node; the message names the path.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> d2 = Dense(d1.weight, d1.bias)
        >>> leaves, gdef = tied.flatten([d1, d2])
        >>> len(leaves), leaves[0] is d1.weight    # weight and bias, once each
        (2, True)
        >>> gdef.leaf_paths()                      # every place of each
        (('[0].weight', '[1].weight'), ('[0].bias', '[1].bias'))
    """
    return flatten_with(tree, _flatten_plans)


class PlanCache(dict):
    """Compiled flatten plans by root type, most recent first. `flatten` shares one;
    `tied.jit` keeps one per function, so that busy programs do not evict its plans."""

    __hash__ = object.__hash__  # by identity, to live in a WeakSet
    __eq__ = object.__eq__

    def flatten(self, tree: Any, name: Callable[[str], str] | None = None) -> tuple[list, GraphDef]:
        """`flatten`, trying this cache's plans first; a `StateClash` shows its places through
        ``name`` (`tied.jit`: ``args[0]['w']``)."""
        try:
            return flatten_with(tree, self)
        except StateClash as e:
            if name is None:
                raise
            raise e.named(name) from None


_plan_caches: weakref.WeakSet = weakref.WeakSet()  # cleared when a class is registered


def plan_cache() -> PlanCache:
    cache = PlanCache()
    _plan_caches.add(cache)
    return cache


_flatten_plans = plan_cache()

# With TIED_CHECK_PLANS=1 (the test suite sets it), every compiled plan's result is
# compared with the plain walk's, and a plan that gives up must be right to.
CHECK_PLANS = os.environ.get("TIED_CHECK_PLANS", "") not in ("", "0")


class PlanMismatch(AssertionError):
    """A compiled plan disagreed with the plain walk (a bug in tied; please report it)."""


# Writers into live models (implicit mode, `update_inplace`, jit's write-back) hold this
# re-entrant lock (public as `tied.live_lock`); every flatten takes it too, so a reader
# in another thread waits and sees whole writes: never a traced value, never a half-
# written tie. Uncontended it costs a fraction of a microsecond.
live_lock = threading.RLock()


def flatten_with(tree: Any, cache: PlanCache) -> tuple[list, GraphDef]:
    """`flatten`, trying the compiled plans of ``cache`` first (see _plan.py)."""
    with live_lock:
        return _flatten_with(tree, cache)


# Python's cyclic collector runs every 700 new container objects, and every tenth time
# through the young generations, a pass over the whole heap: a walk or rebuild of a large
# graph (every object it makes is kept) would pay for several passes over a heap it only
# grows. The collector is paused for a walk, and for a plan or rebuild over this many nodes.
PAUSE_GC_NODES = 256


def _paused(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with the cyclic collector paused (left as it was if already off).
    A gc.disable() that another thread makes while it runs is undone when it ends: the
    collector is one switch for the process (it changes when garbage is collected, never a
    result)."""
    if not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


def _flatten_with(tree: Any, cache: PlanCache) -> tuple[list, GraphDef]:
    plans = cache.get(type(tree))
    if plans:
        for gdef, plan in plans:
            leaves = plan(tree) if len(gdef.records) < PAUSE_GC_NODES else _paused(plan, tree)
            if leaves is not None:
                if CHECK_PLANS:
                    _check_plan_hit(tree, leaves, gdef)
                return leaves, gdef
    leaves, gdef = _paused(_walk, tree)
    if CHECK_PLANS and plans:
        for pgdef, plan in plans:
            # A first sighting of an array type (a tracer's, say) is a fair miss: the walk
            # has just classified it, so the plan must hit now.
            if pgdef == gdef and plan(tree) is None:
                raise PlanMismatch(
                    f"a compiled flatten plan gave up on a graph of its own structure ({gdef}): "
                    f"{_why_plan_missed(plan, tree)}"
                )
    return leaves, _maybe_plan(tree, gdef, cache)


def _why_plan_missed(plan: Any, tree: Any) -> str:
    import traceback

    try:
        plan.__globals__["plan"](tree)
    except Exception as e:
        return "".join(traceback.format_exception(e)[-3:]) + "\n" + plan.__tied_source__
    return "it did not miss when run again"


def _check_plan_hit(tree: Any, leaves: list, gdef: GraphDef) -> None:
    wl, wg = _walk(tree)
    if not (wg == gdef and len(wl) == len(leaves) and all(a is b for a, b in zip(wl, leaves))):
        raise PlanMismatch(f"a compiled flatten plan disagrees with the walk: {gdef} vs {wg}")


# A structure gets a plan the second time the walk meets it; `_seen_once` also
# interns GraphDefs, so equal structures give the very same GraphDef object.
_seen_once: dict[GraphDef, GraphDef] = {}
_MAX_PLANS_PER_TYPE = 8


def _clear_plans() -> None:
    """Forget every plan (run by `_classify` under its lock when a class's meaning changes)."""
    _seen_once.clear()
    for cache in _plan_caches:
        cache.clear()


classify._on_clear.append(_clear_plans)


def _maybe_plan(tree: Any, gdef: GraphDef, cache: PlanCache) -> GraphDef:
    """Count a sighting of ``gdef``; on the second, compile its plan. Returns the
    first-seen equal GraphDef, so that caches keyed on it compare by identity."""
    try:
        first = _seen_once.get(gdef)
    except GraphError:  # unhashable static: no plan, the walk stays in charge
        return gdef
    if first is None:
        with _cache_lock:
            if len(_seen_once) > 1024:
                _seen_once.clear()
            _seen_once[gdef] = gdef
        return gdef
    memo = first.memo
    if memo.flatten_plan is False:
        return first
    # One plan per structure, shared by every cache: the structure stays interned, so that
    # every later flatten of it (planned or walked, in any cache) gives this very object
    # and the caches keyed on it (tied.jit's compiled functions) hit by identity.
    plan = memo.flatten_plan
    if plan is None:
        # A structure too large for a plan on its second sighting gets one once its walks
        # have cost about what the compile will (see _plan.LARGE_PLAN_SIGHTINGS).
        seen = memo.sightings = memo.sightings + 1
        lay, order = layout_and_order(first)  # the walk order, if the layout's replay just made it
        if seen < LARGE_PLAN_SIGHTINGS and flatten_lines(first, lay) > MAX_PLAN_LINES:
            return first
        plan = compile_flatten(first, plan_bound(seen), order=order)
        if plan is None:  # none can be made: never try again for this structure
            memo.flatten_plan = False
            return first
        memo.flatten_plan = plan
    with _cache_lock:
        old = cache.get(type(tree), ())
        if not any(g is first for g, _ in old):
            cache[type(tree)] = ((first, plan),) + old[: _MAX_PLANS_PER_TYPE - 1]
    return first


_VALUE_KINDS = frozenset(kind.index for kind in KINDS if kind.value_when_static)
_FRESH = frozenset(kind.index for kind in KINDS if kind.fresh_children)
_MAY_BE_STATE = frozenset(kind.index for kind in KINDS if kind.may_be_state)


def _value_record(k: int, x: Any, records: list, statics: list, post: list) -> int:
    """A tuple of static values is a value: Python reuses such tuples (``()``, constants),
    so their identity says nothing. One record per place, its statics recorded."""
    j = len(records)
    post.append(j)  # complete at once: it holds no node
    refs = []
    for c in x:
        refs.append(TAGS * len(statics) + STATIC)
        statics.append(c)
    records.append((k, KINDS[k].children(x)[1], tuple(refs)))
    return TAGS * j + NODE


def _enter(
    leaves: list, records: list, statics: list, memo: dict, stack: list, open_immutable: set, post: list
):
    """The walk's step into one object: ``(enter, cells)``; ``enter(x)`` is the reference of
    ``x`` if it is finished at once, else None (a frame was pushed on ``stack``). ``cells``:
    the arrays met below a state cell, and the nodes met below one and outside every one."""
    # Children made on the fly by a pytree's flatten are held here: once freed, their
    # ids could be reused by later objects and read as sharing through `memo`.
    alive: list = []
    kind_of = _kind
    get = memo.get
    below_cell: list[bool] = []  # by node: whether it was entered below a state cell
    cells: tuple[list, list] = ([], [])
    cell_leaves, moved = cells

    def enter(x: Any) -> int | None:
        k = kind_of(x)
        in_cell = stack[-1][6] if stack else False
        if k is _ARRAY:
            if in_cell:  # state is shared by cell: an array below one is its own at each place
                r = TAGS * len(leaves)  # LEAF is 0
                cell_leaves.append(len(leaves))
                leaves.append(x)
                return r
            r = get(id(x))
            if r is None:
                r = TAGS * len(leaves)
                memo[id(x)] = r
                leaves.append(x)
            return r
        if k is _STATIC or k is _UNKNOWN:
            if k is _UNKNOWN:
                _unknown_static(x)
            r = TAGS * len(statics) + STATIC
            statics.append(x)
            return r
        if k in _VALUE_KINDS and all(kind_of(c) is _STATIC for c in x):
            below_cell.append(in_cell)  # a record of its own (never met again: not in memo)
            return _value_record(k, x, records, statics, post)
        r = get(id(x))
        if r is not None:
            if r in open_immutable:
                _cycle_error(k)
            if below_cell[r // TAGS] != in_cell:
                moved.append(r)  # checked once the walk is done (see _check_state)
            return r
        j = len(records)
        r = TAGS * j + NODE
        memo[id(x)] = r
        records.append(None)
        below_cell.append(in_cell)
        children, meta = KINDS[k].children(x)
        if k in _FRESH:
            alive.append(children)
        aux = KINDS[k].user_static(meta)
        if aux is not None and _has_arrays(aux):
            _arrays_in_static_data(x)
        if k not in _MUTABLE:
            open_immutable.add(r)
        cell = in_cell or (k in _MAY_BE_STATE and KINDS[k].is_state(meta))
        stack.append([j, k, meta, children, 0, [], cell])
        return None

    return enter, cells


def _walk(tree: Any) -> tuple[list, GraphDef]:
    """The plain walk, iterative (any depth): the one place where sharing is decided. State
    is shared by cell, never by the array a cell holds: an array below a state cell is a
    unique array of its own at each place (two cells given one array are two states)."""
    leaves: list = []
    records: list = []
    statics: list = []
    memo: dict[int, int] = {}
    get = memo.get
    # A frame: [record index, kind, meta, children, next child, refs so far, below a cell].
    stack: list[list] = []
    open_immutable: set[int] = set()
    post: list[int] = []  # the nodes as they are completed: the order `unflatten` builds in
    enter, cells = _enter(leaves, records, statics, memo, stack, open_immutable, post)
    cell_leaves = cells[0]
    type_cache = _type_cache
    tags, node, static = TAGS, NODE, STATIC  # locals: read once per place below
    try:
        result = enter(tree)
        while stack:
            frame = stack[-1]
            children, i, refs, in_cell = frame[3], frame[4], frame[5], frame[6]
            n = len(children)
            while i < n:  # arrays and statics of known types inline; the rest through enter
                c = children[i]
                i += 1
                k = type_cache.get(type(c))
                if k is _ARRAY:
                    if in_cell:  # below a state cell: an array of its own at this place
                        cell_leaves.append(len(leaves))
                        refs.append(tags * len(leaves))  # LEAF is 0
                        leaves.append(c)
                        continue
                    r = get(id(c))
                    if r is None:
                        r = tags * len(leaves)
                        memo[id(c)] = r
                        leaves.append(c)
                    refs.append(r)
                elif k is _STATIC:
                    refs.append(tags * len(statics) + static)
                    statics.append(c)
                else:
                    frame[4] = i  # a failure inside names this child's path
                    r = enter(c)
                    if r is None:
                        break  # a node was entered: its frame is on top now
                    refs.append(r)
            else:
                frame[4] = i
            if stack[-1] is not frame:
                continue
            stack.pop()
            j, k, meta, _, _, refs, _ = frame
            records[j] = (k, meta, tuple(refs))
            post.append(j)
            r = tags * j + node
            if k not in _MUTABLE:
                open_immutable.discard(r)
            if stack:
                stack[-1][5].append(r)
            else:
                result = r
    except _WalkError as e:
        path = "".join(KINDS[f[1]].key(f[2], f[4] - 1, len(f[3])) for f in stack)
        raise e.finish(path) from None
    gdef = GraphDef(tuple(records), tuple(statics), result, len(leaves))
    if cell_leaves or cells[1]:
        check_state(gdef, leaves, memo, cells)
    if result % TAGS == NODE:  # the build order (see rebuild_order), known already
        order = gdef.memo.post = tuple(post)
        if CHECK_PLANS and order != post_order(gdef):
            raise PlanMismatch(f"the walk's build order differs from rebuild_order's search: {gdef}")
    return leaves, gdef


def ties(tree: Any) -> list[tuple[str, ...]]:
    """The sharing in a graph: one tuple per object reached from two or more places.

    Arrays and container nodes both count; static leaves never tie. Paths are
    written as ``jax.tree_util.keystr`` writes key paths, in first-seen order.
    The places of a shared node's children are listed under its first place.

    Examples:
        >>> import jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> tied.ties(Chain(d, d))                 # one layer at two places
        [('.layers[0]', '.layers[1]')]
        >>> tied.ties(Chain(d, Dense(d.weight)))   # one array at two places
        [('.layers[0].weight', '.layers[1].weight')]
    """
    _, gdef = flatten(tree)
    places = place_paths(gdef)
    out = []
    for r in places.order:
        tag, q = split_ref(r)
        paths = places.leaves[q] if tag == LEAF else places.nodes[q]
        if len(paths) > 1:
            out.append(tuple(p or "<root>" for p in paths))
    return out


# ---------------------------------------------------------------- rebuilding


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

    Examples:
        >>> import jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))
        >>> leaves, gdef = tied.flatten(model)
        >>> new = tied.unflatten(gdef, [2 * x for x in leaves])
        >>> new.layers[0].weight is new.layers[1].weight   # the tie is kept
        True
        >>> bool((new.layers[1].bias == 2 * d1.bias).all())
        True
    """
    return rebuild(graphdef, leaves)


def rebuild(
    graphdef: GraphDef,
    leaves: Any,
    *,
    statics: Any = None,
    materialize: bool = False,
    keep: tuple[Any, list] | None = None,
) -> Any:
    """`unflatten`, with the core's options. ``keep=(model, model_leaves)``, the model ``graphdef``
    was flattened from and its leaves: every node below which each array is the model's own
    (``is``) stays the model's own object, so a state cell left alone is the model's cell and a
    write into it reaches the model; a node with a new array anywhere below it is made anew (the
    model's objects are never changed)."""
    leaves = list(leaves)
    if len(leaves) != graphdef.num_leaves:
        raise ValueError(
            f"tied.unflatten: the GraphDef has {graphdef.num_leaves} unique arrays but "
            f"{len(leaves)} leaves were given."
        )
    if statics is None:
        statics = graphdef.statics
    if keep is not None:
        kept = _kept(graphdef, leaves, *keep)
        if any(obj is not None for obj in kept):  # else every node is new: the plans build them
            return _rebuild(graphdef, leaves, statics, materialize, kept)
    memo = graphdef.memo
    build = memo.unflatten_plans.get(materialize)
    if build is None:
        count = memo.unflatten_uses = memo.unflatten_uses + 1
        if count >= 2 and (count >= LARGE_PLAN_SIGHTINGS or unflatten_lines(graphdef) <= MAX_PLAN_LINES):
            # None: too large to be worth compiling; remembered as False, and walked
            build = memo.unflatten_plans[materialize] = (
                compile_unflatten(graphdef, materialize, plan_bound(count)) or False
            )
    large = len(graphdef.records) >= PAUSE_GC_NODES
    if build:
        out = _paused(build, leaves, statics) if large else build(leaves, statics)
        if CHECK_PLANS:
            _check_rebuild(graphdef, leaves, statics, materialize, out)
        return out
    if large:
        return _paused(_rebuild, graphdef, leaves, statics, materialize)
    return _rebuild(graphdef, leaves, statics, materialize)


def _kept(graphdef: GraphDef, leaves: list, model: Any, model_leaves: list) -> list:
    """Per node, the model's own object where nothing below it changed, else None."""
    records = graphdef.records
    changed = [False] * len(records)
    parents: list[list[int]] = [[] for _ in records]
    for j, (_, _, refs) in enumerate(records):
        for r in refs:
            tag, q = split_ref(r)
            if tag == LEAF and leaves[q] is not model_leaves[q]:
                changed[j] = True
            elif tag == NODE:
                parents[q].append(j)
    todo = [j for j, c in enumerate(changed) if c]
    while todo:  # up through every place of a node (a cycle included)
        for p in parents[todo.pop()]:
            if not changed[p]:
                changed[p] = True
                todo.append(p)
    objs = node_objects(graphdef, model)
    return [None if c else obj for c, obj in zip(changed, objs)]


def _rebuild(
    graphdef: GraphDef, leaves: list, statics: Any, materialize: bool, keep: list | None = None
) -> Any:
    records = graphdef.records
    # One table indexed by reference (see `refs`), so that a node's children are fetched in
    # one C-level map.
    size = TAGS * max(len(leaves), len(statics), len(records))
    table: list = [None] * size
    table[LEAF : TAGS * len(leaves) + LEAF : TAGS] = leaves
    table[STATIC : TAGS * len(statics) + STATIC : TAGS] = statics
    get = table.__getitem__
    tags, node = TAGS, NODE  # locals: read once per node below
    mutable, post = rebuild_order(graphdef)
    if keep is not None:
        for j, obj in enumerate(keep):
            if obj is not None:
                table[tags * j + node] = obj
        mutable = [j for j in mutable if keep[j] is None]
        post = [j for j in post if keep[j] is None]
    for j in mutable:
        kind, meta, _ = records[j]
        table[tags * j + node] = KINDS[kind].shell(meta)
    for j in post:
        kind, meta, refs = records[j]
        children = list(map(get, refs))
        if kind in _MUTABLE:
            KINDS[kind].fill(meta, table[tags * j + node], children)
        elif materialize and KINDS[kind].materializes:
            try:
                table[tags * j + node] = KINDS[kind].materialize(meta, children)
            except Exception as e:
                raise view_failed(graphdef, j, meta, children[0], e) from e
        else:
            table[tags * j + node] = KINDS[kind].make(meta, children)
    return table[graphdef.root]


def _check_rebuild(graphdef: GraphDef, leaves: list, statics: Any, materialize: bool, out: Any) -> None:
    ref = _rebuild(graphdef, leaves, statics, materialize)
    if materialize or statics is not graphdef.statics:
        return  # materialised views and stand-in statics are not walked back; the build ran
    wl, wg = _walk(out)
    rl, rg = _walk(ref)
    if not (wg == rg and len(wl) == len(rl) and all(a is b for a, b in zip(wl, rl))):
        raise PlanMismatch(f"a compiled unflatten plan disagrees with the walk: {graphdef}")


def is_state(tree: Any, path: str) -> bool:
    """Whether ``path`` is a state place of ``tree``: a state cell, or a place below one.

    Args:
        tree: the model.
        path: a keystr path (``".bn.running_mean.value"``), ``""`` for the root.

    Returns:
        True for a state cell's place and every place below it.

    Raises:
        KeyError: ``path`` is no place of ``tree``.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> bn = tied.nn.BatchNorm(3)
        >>> tied.is_state(bn, ".running_mean.value"), tied.is_state(bn, ".weight")
        (True, False)
    """
    _, gdef = flatten(tree)
    cells = gdef.state_nodes()
    inside: list[bool] = []
    for place in gdef.walk_places(expand_shared=True, cut_cycles=True):
        del inside[place.depth :]
        above = inside[place.depth - 1] if place.depth else False
        here = above or (place.kind not in ("array", "static") and cells[place.index])
        if place.kind not in ("array", "static"):
            inside.append(here)
        if place.path == path:
            return here
    raise KeyError(f"tied.is_state: {path!r} is no place of the model.")
