"""Reading a tree shaped like the model (a gradient, a sharding tree) at every place.

`read_places` walks the GraphDef's one traversal (`_graphdef._traverse`) and the
mirror tree side by side; each node kind says how to read its mirror
(`Kind.mirror`). Core: imported by `_graph`, which re-exports it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from .graphdef import GraphDef, _traverse
from .kinds import KINDS, GraphError, _Mismatch
from .refs import LEAF, NODE, TAGS, split_ref

__all__ = ["node_objects", "read_places"]


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
    ``hint`` name the tree in error messages. Iterative, so any depth.
    """
    found: list[list] = [[] for _ in range(graphdef.num_leaves)]
    # By depth, for the node whose children are being read: its mirror's children (or a
    # _Broadcast) and the node; `on_path` holds those nodes (a cycle is read once round).
    mirrors: list[Any] = []
    nodes: list[int] = []
    on_path: set[int] = set()
    for n, (_, depth, r, _, _, i) in enumerate(_traverse(graphdef, True, True, paths=False)):
        while len(nodes) > depth:
            on_path.discard(nodes.pop())
            mirrors.pop()
        if depth == 0:
            obj = other
        else:
            children = mirrors[-1]
            obj = children.obj if type(children) is _Broadcast else children[i]
        q, tag = divmod(r, TAGS)
        if tag == LEAF:
            found[q].append(obj)
        elif tag == NODE and q not in on_path:
            mirrors.append(_mirror(graphdef, q, obj, broadcast, what, hint, n))
            nodes.append(q)
            on_path.add(q)
    return found


def _mirror(gdef: GraphDef, q: int, obj: Any, broadcast: Any, what: str, hint: str, n: int) -> Any:
    """The children of ``obj`` read as node ``q`` (the ``n``-th place), or a `_Broadcast`."""
    if obj is None or (broadcast is not None and broadcast(obj)):
        return _Broadcast(obj)
    kind, meta, refs = gdef.records[q]
    k = KINDS[kind]
    try:
        children = k.mirror(meta, obj, len(refs))
    except _Mismatch as e:
        expected = e.expected
    except (KeyError, AttributeError, TypeError, IndexError) as e:
        if isinstance(e, GraphError):
            raise
        expected = f"{_article(k.name)} like the model's"
    else:
        if len(children) == len(refs):
            return children
        expected = f"{_article(k.name)} with {len(refs)} children"
    at = next(itertools.islice(_traverse(gdef, True, True), n, None))[0]  # rendered on error only
    raise GraphError(
        f"the {what} does not mirror the model here: expected "
        f"{expected}, found {type(obj).__name__}. Pass a {what} shaped like the model "
        f"({hint}).",
        at,
    )


class _Broadcast:
    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj


# The state cells of `_state`: walked as registered objects (path ``.value``), marked as state.


def node_objects(graphdef: GraphDef, model: Any) -> list:
    """The live object of each node of ``model``, by node index (a `Place.index`), read along
    ``graphdef`` (a `flatten` of ``model`` taken just before): a node's object is its first
    place's child in the node holding it (records are in first-seen order, so that node comes
    first). A kind that builds its children anew (`Kind.fresh_children`) gives this read's."""
    records = graphdef.records
    objs: list = [None] * len(records)
    if not objs:
        return objs
    objs[0] = model  # the root is the first node met
    for j, (kind, _, refs) in enumerate(records):
        obj = objs[j]
        if obj is None:
            continue
        for child, r in zip(KINDS[kind].children(obj)[0], refs):
            tag, q = split_ref(r)
            if tag == NODE and objs[q] is None:
                objs[q] = child
    return objs


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun
