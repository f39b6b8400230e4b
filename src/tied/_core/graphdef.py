"""The GraphDef: the structure of an object graph, its one traversal, and its readers.

A GraphDef holds one record ``(kind, meta, child_refs)`` per unique container
node, in first-seen order; a child reference is a number that names a leaf, a node
or a static and which one (the encoding is `refs`'), so a shared object is a number
that occurs twice. Records and references are read in the core only (`graph`,
`plans`, `read` and this module); everything above asks the GraphDef by name.

`_traverse` is the one traversal: every place in walk order with its parent
node and its position there. The walk of places (`GraphDef.walk_places`, with
each place's parent and JAX key), the paths (`place_paths`), the tree unrolling
(`expand`), the rebuild order (`rebuild_order`) and the mirror reader
(`read_places`, in `_read`) all go through it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .errors import where
from .kinds import _MUTABLE, KINDS, VIEW, GraphError, _as_is
from .refs import LEAF, NODE, STATIC, TAGS, split_ref
from .strict import _strict

# Kinds whose meta is its own strict key (types, str names, int lengths): a GraphDef of
# those alone keys on its records as they are.
_META_AS_IS = frozenset(k.index for k in KINDS if type(k).strict_meta is _as_is)
_first = operator.itemgetter(0)

__all__ = ["GraphDef", "Place", "StateClash", "ViewInfo", "expand", "place_paths", "rebuild_order"]


class ViewInfo(NamedTuple):
    """A view of a graph: ``paths`` (its places), ``fn``, ``source`` (the first path of
    its source) and ``leaf`` (the source's unique-array index, None for a view of a view)."""

    paths: tuple[str, ...]
    fn: Callable[[Any], Any]
    source: str | None
    leaf: int | None


class Place(NamedTuple):
    """One place of a graph, as `GraphDef.walk_places` yields it.

    ``kind`` is ``"array"``, ``"static"`` or a node kind's name (``"list"``,
    ``"dict"``, ``"object"``, ``"dataclass"``, ``"tuple"``, ``"namedtuple"``,
    ``"pytree"``, ``"view"``, ...). ``index`` numbers the unique object of that
    sort (unique arrays in `flatten` order, nodes, statics). ``first`` is False at
    a later place of a shared object (whose children are then not visited again,
    unless the walk expands shared nodes). ``type`` is the node's Python type,
    ``value`` the static's value or a view's function. ``parent`` is the node index
    of the container holding the place (-1 for the root) and ``key`` the place's JAX
    key in it (``GetAttrKey``, ``DictKey``, ``SequenceKey``, ...; None for the root):
    ``path`` is the parent's path followed by ``jax.tree_util.keystr((key,))``.
    """

    path: str
    depth: int
    kind: str
    index: int
    first: bool
    type: Any
    value: Any
    parent: int = -1
    key: Any = None


# ---------------------------------------------------------------- the GraphDef


class Memo:
    """What is derived from one structure, kept on its GraphDef under a name each: a GraphDef is
    immutable, so nothing here goes stale. The GraphDef's readers fill the first group; the
    walk (`post`), the plans (`graph.py` and `plans/`) and the write-back (`writeback.py`) fill
    theirs, each only its own fields."""

    __slots__ = (
        # the GraphDef's readers
        "keys",  # each node's children's JAX keys
        "place_leaves",  # (path, unique index) of every array place
        "state_leaves",  # per unique array: below a state cell?
        "state_nodes",  # per node: a state cell?
        "places",  # `place_paths`
        "expanded",  # `expand`
        "expanded_with_state",  # `expand(keep_state=True)`
        # the build order: the walk's post order, and `rebuild_order`'s answer
        "post",
        "order",
        # the plans
        "layout",  # `plans.loops.layout`: runs of identical layers
        "sightings",  # flattens seen of this structure (a large one is planned late)
        "flatten_plan",  # the compiled flatten; False: none can be made
        "unflatten_uses",  # unflattens seen
        "unflatten_plans",  # materialize -> the compiled unflatten; False: walked
        "writes",  # written leaves -> their places as one `slots` run found them; None: slots only
        "write_backs",  # written leaves -> the compiled re-check and write; False: none
        "writes_alone",  # written leaves -> the compiled writes, after the walk's re-check
    )

    def __init__(self) -> None:
        self.keys = self.place_leaves = self.state_leaves = self.state_nodes = None
        self.places = self.expanded = self.expanded_with_state = None
        self.post = self.order = self.layout = self.flatten_plan = None
        self.sightings, self.unflatten_uses = 1, 0
        self.unflatten_plans: dict = {}
        self.writes: dict = {}
        self.writes_alone: dict = {}
        self.write_backs: dict = {}


class GraphDef:
    """The structure of an object graph: node types, static leaves and every sharing.

    Produced by `flatten`, consumed by `unflatten`. Hashable; two graphs with the
    same structure, sharing pattern and identical static leaves (same type, same
    bits: ``-0.0`` differs from ``0.0``) give equal GraphDefs.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones((2, 2))
        >>> leaves, gdef = tied.flatten({"embed": w, "head": w, "bias": jnp.zeros(2)})
        >>> gdef
        GraphDef(num_leaves=2, num_nodes=1)
        >>> gdef.leaf_paths()
        (("['bias']",), ("['embed']", "['head']"))
        >>> v = jnp.zeros((2, 2))                     # the same structure and tie, new arrays
        >>> gdef == tied.flatten({"embed": v, "head": v, "bias": w})[1]
        True
        >>> gdef == tied.flatten({"embed": v, "head": w, "bias": w})[1]   # the tie differs
        False
    """

    __slots__ = ("records", "statics", "root", "num_leaves", "_hash", "_k", "memo")

    def __init__(self, records: tuple, statics: tuple, root: int, num_leaves: int):
        self.records = records  # tuple of (kind, meta, child_refs) in first-seen order
        self.statics = statics  # static leaves, by value
        self.root = root
        self.num_leaves = num_leaves
        self._hash: int | None = None
        self._k: Any = None
        self.memo = Memo()  # what is derived from this structure once, by name

    @property
    def num_nodes(self) -> int:
        return len(self.records)

    def _key(self):
        k = self._k
        if k is None:
            records = self.records
            if not _META_AS_IS.issuperset(map(_first, records)):  # a meta that needs its key
                records = tuple((kind, KINDS[kind].strict_meta(meta), refs) for kind, meta, refs in records)
            k = self._k = (self.root, self.num_leaves, records, tuple(map(_strict, self.statics)))
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
            return bool(self._key() == other._key())
        except Exception:  # a static whose __eq__ fails or is ambiguous (an array)
            return False

    def _unhashable_error(self) -> GraphError:
        paths = place_paths(self)
        for k, s in enumerate(self.statics):
            try:
                hash(s)
            except TypeError:
                return GraphError(
                    f"static field of type {type(s).__name__} is not "
                    "hashable, but tied.jit and tied.Graph key their cache on static fields. Make it "
                    "hashable (a tuple instead of a list, a frozen dataclass), or hold it as an "
                    "array if it is data.",
                    paths.statics[k],
                )
        return GraphError("a node's static metadata is not hashable; tied.jit needs it hashable.")

    def __repr__(self) -> str:
        return f"GraphDef(num_leaves={self.num_leaves}, num_nodes={self.num_nodes})"

    # ------------------------------------------------ what the layers above may read
    # Everything outside the core reads a GraphDef through these names only.

    def walk_places(
        self, *, expand_shared: bool = False, cut_cycles: bool = False, paths: bool = True
    ) -> Iterator[Place]:
        """Every place of the graph in walk order (depth first, children in order).

        By default a shared node's children are visited under its first place
        only (its later places are yielded with ``first=False``); with
        ``expand_shared=True`` they are visited at every place, as in a tree
        (a reference cycle is then a `GraphError`, or with ``cut_cycles`` a reference back
        to a node entered above is yielded but not followed). With ``paths=False`` each
        place's path is ``""`` (its ``parent`` and ``key`` say where it is): the walk then
        costs the same at any depth, where full paths grow with the square of the depth.
        """
        records, keys = self.records, self._keys()
        for path, depth, r, first, parent, i in _traverse(self, expand_shared, cut_cycles, paths):
            key = keys[parent][i] if parent >= 0 else None
            q, tag = divmod(r, TAGS)
            if tag == LEAF:
                yield Place(path, depth, "array", q, first, None, None, parent, key)
            elif tag == STATIC:
                yield Place(path, depth, "static", q, True, None, self.statics[q], parent, key)
            else:
                kind, meta, _ = records[q]
                k = KINDS[kind]
                yield Place(path, depth, k.name, q, first, k.type_of(meta), k.place_value(meta), parent, key)

    def children(self, j: int) -> tuple[tuple[Any, str, int], ...]:
        """The children of node ``j`` (a `Place.index` or `Place.parent`), in order.

        Args:
            j: the node's index.

        Returns:
            One ``(key, kind, index)`` per child: its JAX key object, ``"array"``,
            ``"static"`` or its node kind's name, and its index among those.

        Examples:
            >>> import jax.numpy as jnp, tied
            >>> w = jnp.ones(2)
            >>> _, gdef = tied.flatten({"a": w, "b": [w, 1.0]})
            >>> [(str(k), kind, i) for k, kind, i in gdef.children(0)]
            [("['a']", 'array', 0), ("['b']", 'list', 1)]
            >>> [(str(k), kind, i) for k, kind, i in gdef.children(1)]   # the tie: array 0 again
            [('[0]', 'array', 0), ('[1]', 'static', 0)]
        """
        out = []
        for key, r in zip(self._keys()[j], self.records[j][2]):
            tag, q = split_ref(r)
            name = "array" if tag == LEAF else "static" if tag == STATIC else KINDS[self.records[q][0]].name
            out.append((key, name, q))
        return tuple(out)

    def _node_key(self, j: int) -> tuple:
        """Node ``j``'s kind and meta as GraphDefs compare them (its keys or fields, their
        order and exact types): equal for two nodes of one layout."""
        kind, meta, _ = self.records[j]
        return kind, KINDS[kind].strict_meta(meta)

    def _keys(self) -> list[tuple]:
        """For each node, the JAX keys of its children (made once per GraphDef)."""
        keys = self.memo.keys
        if keys is None:
            keys = self.memo.keys = [
                tuple(KINDS[kind].jax_key(meta, i, len(refs)) for i in range(len(refs)))
                for kind, meta, refs in self.records
            ]
        return keys

    def leaf_paths(self) -> tuple[tuple[str, ...], ...]:
        """For each unique array (in `flatten` order), the keystr paths of its places in
        walk order, entering each shared node once (the places below a shared node are
        listed under its first place; `place_leaves` lists every place). The root's own
        path is ``""``."""
        return tuple(tuple(p) for p in place_paths(self).leaves)

    def node_paths(self) -> tuple[tuple[str, ...], ...]:
        """For each node (in `walk_places` index order), the keystr paths of its places."""
        return tuple(tuple(p) for p in place_paths(self).nodes)

    def shared_node_paths(self) -> list[tuple[str, ...]]:
        """The places of every container node reached from two or more places, in walk order."""
        return [tuple(p) for p in place_paths(self).nodes if len(p) > 1]

    def views(self) -> list[ViewInfo]:
        """Every `View` of the graph: its places, its function and where its source sits."""
        places = place_paths(self)
        out = []
        for j, (kind, meta, refs) in enumerate(self.records):
            if kind == VIEW and places.nodes[j]:
                tag, q = split_ref(refs[0])
                if tag == LEAF:
                    source, leaf = places.leaves[q][0], q
                elif tag == NODE:
                    source, leaf = places.nodes[q][0], None
                else:
                    source, leaf = None, None
                out.append(ViewInfo(tuple(places.nodes[j]), meta, source, leaf))
        return out

    def layouts(self) -> list[tuple[int, Any]]:
        """Every node whose static data says what the arrays below it mean, with that description.

        A type says so with a ``__tied_layout__(static)`` static method, given the node's own
        static data (a pytree's aux data) and returning plain data (JSON-able dicts, lists, str,
        int), or None for nothing: a `tied.Stack` describes which places of its member are
        stacked, and ``n``; a `tied.optim.OptState`, the Stacks of the model it was set up for. Two
        graphs whose places, shapes and dtypes agree but whose layouts differ hold arrays of
        different meaning; a strict checkpoint load compares them.

        Returns:
            One ``(j, layout)`` per such node, in index order: ``j`` the node's index (its places
            are ``node_paths()[j]``).
        """
        out = []
        for j, (kind, meta, _) in enumerate(self.records):
            k = KINDS[kind]
            describe = getattr(k.type_of(meta), "__tied_layout__", None)
            layout = None if describe is None else describe(k.user_static(meta))
            if layout is not None:  # None: nothing to record for this node
                out.append((j, layout))
        return out

    def expand(self, *, keep_state: bool = False) -> tuple[GraphDef, tuple[int, ...]]:
        """The graph unrolled into a tree: one node or leaf per *place*, no sharing left.

        Returns the tree's GraphDef and, for each of its leaves (one per array place, in
        walk order), the index of the unique array that stands there. ``tied.unflatten(
        tree_def, [leaves[i] for i in place_leaf])`` builds the model as a plain pytree
        holds it: every place its own container (a reference cycle is a `GraphError`).
        With ``keep_state``, a state cell stays one node at all its places (state is one
        object, never a per-place copy). Kept on the GraphDef: a second call costs nothing.

        Examples:
            >>> import jax.numpy as jnp, tied
            >>> w = jnp.ones(2)
            >>> leaves, gdef = tied.flatten({"a": w, "b": w})
            >>> tree_def, place_leaf = gdef.expand()
            >>> place_leaf, tree_def.num_leaves
            ((0, 0), 2)
            >>> cell = tied.State(w)
            >>> tied.flatten({"a": cell, "b": cell})[1].expand(keep_state=True)[1]   # one cell
            (0,)
        """
        return expand(self, keep_state=keep_state)

    def place_leaves(self) -> tuple[tuple[str, int], ...]:
        """Every array *place* in walk order (a tie counted at each of its places), as
        ``(path, unique leaf index)``; places below a shared node are listed at every
        place of that node. On a reference cycle, a reference back to a node entered
        above is not followed again (the cycle's places are listed once round)."""
        out = self.memo.place_leaves
        if out is None:
            out = self.memo.place_leaves = tuple(
                (path, r // TAGS) for path, _, r, _, _, _ in _traverse(self, True, True) if r % TAGS == LEAF
            )
        return out

    def state_leaves(self) -> tuple[bool, ...]:
        """For each unique array (in `flatten` order), whether it is *state*: it sits below
        a state cell (`tied.State`, a class given to `tied.register_state`, a Flax NNX
        ``Variable`` that is not a ``Param``). State is never a parameter. State is shared
        by cell, never by the array a cell holds: in a walk's GraphDef each place of an
        array below a cell is a unique array of its own (two cells given one array are two
        such arrays, which may be one object), never an array tie.

        Raises:
            GraphError: one array is both state (below a cell) and held at a place
                outside every cell; the message names both places.
        """
        out = self.memo.state_leaves
        if out is None:
            out = self.memo.state_leaves = _state_leaves(self)
        return out

    def state_nodes(self) -> tuple[bool, ...]:
        """For each node (in `walk_places` index order), whether it is a state cell."""
        out = self.memo.state_nodes
        if out is None:
            out = self.memo.state_nodes = tuple(KINDS[kind].is_state(meta) for kind, meta, _ in self.records)
        return out


class StateClash(GraphError):
    """One array both below a state cell and at a parameter place: ``.path`` is the parameter
    place, ``.state`` the state place, and the message names both (`named` writes them
    another way: as a call's arguments, say)."""

    def __init__(self, param: str, state: str, name: Callable[[str], str] = where):
        self.state = state
        super().__init__(
            f"one array is both a parameter place and a state place (below a state cell at "
            f"{name(state)}). State changes when the model runs and is never trained, so the two "
            "cannot be one object: give the state its own array (e.g. jnp.array(x) copies it).",
            param,
            name=lambda p: f"{name(p)} and {name(state)}",
        )

    def named(self, name: Callable[[str], str]) -> StateClash:
        return StateClash(self.path, self.state, name)

    def __reduce__(self):
        return (StateClash, (self.path, self.state))


def _state_leaves(gdef: GraphDef) -> tuple[bool, ...]:
    cells = gdef.state_nodes()
    if not any(cells):
        return (False,) * gdef.num_leaves
    state: list[Any] = [None] * gdef.num_leaves  # None: not met; else (is state, first path)
    inside: list[bool] = []  # by depth: whether the node open at that depth is in a cell
    for path, depth, r, _, _, _ in _traverse(gdef, True, True):
        del inside[depth:]
        q, tag = divmod(r, TAGS)
        above = inside[depth - 1] if depth else False
        if tag == NODE:
            inside.append(above or cells[q])
        elif tag == LEAF:
            seen = state[q]
            if seen is None:
                state[q] = (above, path)
            elif seen[0] != above:
                s, p = (seen[1], path) if seen[0] else (path, seen[1])
                raise StateClash(p, s)
    return tuple(bool(s and s[0]) for s in state)


def check_state(gdef: GraphDef, leaves: list, memo: dict, cells: tuple[list, list]) -> None:
    """Record on ``gdef`` which unique arrays are state. An array below a state cell that
    also sits at a place outside every cell (itself, or below a node met in both contexts)
    is a `StateClash` naming both places: state is never a parameter."""
    cell_leaves, moved = cells
    for q in cell_leaves:
        r = memo.get(id(leaves[q]))  # the same array (alive in `leaves`) outside every cell
        if r is not None:
            paths = place_paths(gdef).leaves
            _, outside = split_ref(r)
            raise StateClash(paths[outside][0], paths[q][0])
    if moved:  # the traversal of every place decides (and raises on a clash)
        gdef.state_leaves()
        return
    state = [False] * len(leaves)
    for q in cell_leaves:
        state[q] = True
    gdef.memo.state_leaves = tuple(state)


def untracked(record: tuple) -> bool:
    """Whether a node record stands for one place only: a tuple of static values."""
    kind, _, refs = record
    return KINDS[kind].value_when_static and all(r % TAGS == STATIC for r in refs)


# ---------------------------------------------------------------- the one traversal of a GraphDef


def _traverse(
    gdef: GraphDef, expand_shared: bool = False, cut_cycles: bool = False, paths: bool = True
) -> Iterator[tuple]:
    """``(path, depth, ref, first, parent, position)`` for every place of ``gdef``, in the
    walk's order (the root has parent -1): the one traversal of a GraphDef.

    A node's children are visited at its first place only, unless ``expand_shared``
    (then at every place; a cycle is a `GraphError`, or with ``cut_cycles`` a reference
    back to a node entered above is yielded but not followed). Without ``paths`` the
    path is ``""`` (for readers that render one only on error). Iterative, so any depth.
    """
    records = gdef.records
    seen: set[int] = set()
    on_path: set[int] = set()
    root = gdef.root
    yield "", 0, root, True, -1, 0
    if root % TAGS != NODE:
        return
    seen.add(root)
    on_path.add(root)
    # A frame: [node, next child, path, depth of its children].
    stack: list[list] = [[root // TAGS, 0, "", 1]]
    tags, leaf, node, static = TAGS, LEAF, NODE, STATIC  # locals: read once per place below
    while stack:
        frame = stack[-1]
        j, i, path, depth = frame
        kind, meta, refs = records[j]
        if i >= len(refs):
            stack.pop()
            on_path.discard(tags * j + node)
            continue
        frame[1] = i + 1
        r = refs[i]
        child = path + KINDS[kind].key(meta, i, len(refs)) if paths else ""
        tag = r % tags
        if tag == static:
            yield child, depth, r, True, j, i
            continue
        first = r not in seen
        seen.add(r)
        if tag == leaf:
            yield child, depth, r, first, j, i
            continue
        if expand_shared and r in on_path:
            if cut_cycles:
                yield child, depth, r, first, j, i
                continue
            raise GraphError(
                "this node is on a reference cycle, so it has infinitely many places "
                "and per-place values cannot be formed. Use the aliased totals "
                "(per_location=False).",
                child,
            )
        yield child, depth, r, first, j, i
        if first or expand_shared:
            on_path.add(r)
            stack.append([r // tags, 0, child, depth + 1])


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
    if graphdef.memo.places is not None:
        return graphdef.memo.places
    leaf_paths: list[list[str]] = [[] for _ in range(graphdef.num_leaves)]
    node_paths: list[list[str]] = [[] for _ in graphdef.records]
    static_paths: list[str] = [""] * len(graphdef.statics)
    order: list[int] = []
    for path, _, r, _, _, _ in _traverse(graphdef):
        q, tag = divmod(r, TAGS)
        if tag == STATIC:
            static_paths[q] = path
            continue
        lst = leaf_paths[q] if tag == LEAF else node_paths[q]
        if not lst:
            order.append(r)
        lst.append(path)
    result = _Places(leaf_paths, node_paths, static_paths, order)
    graphdef.memo.places = result
    return result


def expand(graphdef: GraphDef, *, keep_state: bool = False) -> tuple[GraphDef, tuple[int, ...]]:
    """The graph unrolled into a tree: one node or leaf per *place*.

    Returns the tree's GraphDef and, for each of its leaves (one per place of an
    array), the index of the unique array that stands there. Used for
    per-place gradients and for reading a tree shaped like the model. With
    ``keep_state`` a state cell stays one node at all its places (state is one
    object, never a per-place copy).
    """
    cached = graphdef.memo.expanded_with_state if keep_state else graphdef.memo.expanded
    if cached is not None:
        return cached
    records = graphdef.records
    cells = graphdef.state_nodes() if keep_state else ()
    new_records: list = []
    new_refs: list[list] = []
    place_leaf: list[int] = []
    emitted: dict[int, int] = {}  # a kept state cell -> its one new reference
    skip_below: int | None = None  # inside a kept cell met again: its subtree is not repeated
    # The pre-order of `_traverse` with expand_shared: a node's children follow it, so a
    # stack of the open new nodes (by depth) tells each place's parent.
    open_nodes: list[int] = []
    root_ref = None
    for _, depth, r, _, _, _ in _traverse(graphdef, expand_shared=True):
        if skip_below is not None:
            if depth > skip_below:
                continue
            skip_below = None
        del open_nodes[depth:]
        q, tag = divmod(r, TAGS)
        again = tag == NODE and q in emitted
        if tag == LEAF:
            ref = TAGS * len(place_leaf)  # LEAF is 0
            place_leaf.append(q)
        elif tag == STATIC:
            ref = r
        elif again:
            ref, skip_below = emitted[q], depth
        else:
            ref = TAGS * len(new_records) + NODE
            kind, meta, _ = records[q]
            new_records.append((kind, meta))
            new_refs.append([])
            if keep_state and cells[q]:
                emitted[q] = ref
        if depth == 0:
            root_ref = ref
        else:
            new_refs[open_nodes[depth - 1]].append(ref)
        if tag == NODE and not again:
            open_nodes.append(ref // TAGS)
    records_out = tuple((k, meta, tuple(refs)) for (k, meta), refs in zip(new_records, new_refs))
    out = (GraphDef(records_out, graphdef.statics, root_ref, len(place_leaf)), tuple(place_leaf))
    if keep_state:
        graphdef.memo.expanded_with_state = out
    else:
        graphdef.memo.expanded = out
    return out


# ---------------------------------------------------------------- rebuilding


def rebuild_order(gdef: GraphDef) -> tuple:
    """Orders for `unflatten`: the mutable nodes (their empty shells are made first, so a
    cycle can point back at them) and every node in post order (children before their
    parent), so that a node is filled or built only once its children are complete: a
    JAX pytree that reads a list child while it is constructed sees it filled. The post
    order is the traversal's: a node is complete when the walk leaves its depth."""
    plan = gdef.memo.order
    if plan is None:
        post = gdef.memo.post  # the walk records it as it completes nodes
        if post is None:
            post = post_order(gdef)
        mutable = tuple(j for j, rec in enumerate(gdef.records) if rec[0] in _MUTABLE)
        plan = gdef.memo.order = (mutable, post)
    return plan


def post_order(gdef: GraphDef) -> tuple:
    """Every node, children before their parent, found by a search over first places (for a
    GraphDef the walk did not make, and to check the walk's)."""
    records = gdef.records
    post: list[int] = []
    if gdef.root % TAGS == NODE:  # depth first over first places; a node is done after its children
        seen = bytearray(len(records))
        root = gdef.root // TAGS
        seen[root] = 1
        stack = [(root, iter(records[root][2]))]
        tags, node = TAGS, NODE  # locals: read once per reference below
        while stack:
            j, refs = stack[-1]
            for r in refs:
                if r % tags == node and not seen[r // tags]:
                    seen[r // tags] = 1
                    stack.append((r // tags, iter(records[r // tags][2])))
                    break
            else:
                stack.pop()
                post.append(j)
    if len(post) != len(records):  # every record of a walk or an expansion is reachable
        raise GraphError(f"{gdef}: {len(records) - len(post)} node records unreachable from the root.")
    return tuple(post)


def _view_error(fn, source, e) -> GraphError:
    name = getattr(fn, "__name__", repr(fn))
    if type(source) is tuple:  # a view of several sources
        shape = tuple(getattr(s, "shape", None) for s in source)
        what = "sources of shapes"
    else:
        shape, what = getattr(source, "shape", None), "source of shape"
    return GraphError(
        f"the view function {name} failed on its {what} {shape}: "
        f"{type(e).__name__}: {e}. Give tied.view a function that accepts the source array."
    )


def view_failed(gdef: GraphDef, j: int, fn: Any, source: Any, e: Exception) -> GraphError:
    """The error for view node ``j`` whose function failed, naming the view's path."""
    return GraphError(_view_error(fn, source, e), place_paths(gdef).nodes[j][0])
