"""Places by path: `Places` (every place of a graph, from `GraphDef.walk_places`, with its steps),
`get` and `put` (read and write one place of a fresh copy), and `PathError` for a path that names
no place. Used by surgery (`tied.tie`, `tied.untie`, `tied.replace`), `tied.stack` and the layers
that write their caches; no path is parsed.
"""

from __future__ import annotations

import difflib
from typing import Any

import jax
import numpy as np

from .errors import Located, where
from .graph import KIND_BY_NAME, KINDS, GraphDef, GraphError, flatten

__all__ = [
    "LEAF_KINDS",
    "PathError",
    "Places",
    "child",
    "get",
    "is_array",
    "is_prefix",
    "put",
    "renew",
    "with_child",
]


class PathError(Located, KeyError):
    """A path that names no place of the model; the message lists the nearest valid paths.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones(2)
        >>> try:
        ...     tied.untie({"embed": w, "head": w}, "['embd']")
        ... except tied.PathError as e:
        ...     print(e)
        tied.untie: "['embd']" is not a place of the model. Nearest valid paths: ['embed'], ['head'], <root>.
        Paths are written as tied.ties and tied.summary print them.
    """

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


# ---------------------------------------------------------------- places and steps
LEAF_KINDS = ("array", "static")


class Places:
    """Every place of a graph, from `GraphDef.walk_places`: its *steps* (the keystr pieces
    from the root, so ``''.join(steps)`` is the path), what it holds (``"array"``,
    ``"static"`` or a node kind's name) and the index of that array or node.

    Places below a shared node are listed at every place of it (for a graph with a
    reference cycle, only below each node's first place). No path is ever parsed: each
    step is the part of a place's path after its container's path.
    """

    def __init__(self, gdef: GraphDef):
        self.gdef = gdef
        try:
            walk = list(gdef.walk_places(expand_shared=True))
        except GraphError:  # a reference cycle: infinitely many places; the first ones
            walk = list(gdef.walk_places())
        self.steps: dict[str, tuple[str, ...]] = {}
        self.kind: dict[str, str] = {}
        self.index: dict[str, int] = {}
        # Paths that two places write alike (an attribute named "a.b" beside a.b): their steps.
        self.alike: dict[str, list[tuple[str, ...]]] = {}
        open_nodes: list[tuple[str, tuple[str, ...]]] = []  # (path, steps) of the open node at each depth
        for place in walk:
            del open_nodes[place.depth :]
            if place.depth:
                parent, parent_steps = open_nodes[place.depth - 1]
                steps = parent_steps + (jax.tree_util.keystr((place.key,)),)
            else:
                steps = ()
            if place.path not in self.steps:
                self.steps[place.path] = steps
                self.kind[place.path] = place.kind
                self.index[place.path] = place.index
            else:  # each place is walked once: a path met again is a second place written alike
                self.alike.setdefault(place.path, [self.steps[place.path]]).append(steps)
            if place.kind not in LEAF_KINDS:
                open_nodes.append((place.path, steps))
        self.leaf_of = {p: i for p, i in self.index.items() if self.kind[p] == "array"}

    def nodes(self) -> list[str]:
        """The places of nodes, in walk order (parents first)."""
        return [p for p, k in self.kind.items() if k not in LEAF_KINDS]

    def resolve(self, path: Any, *, who: str) -> str:
        """``path`` itself (``'<root>'`` read as ``''``), or a `PathError` listing the nearest
        valid paths."""
        if not isinstance(path, str):
            raise TypeError(
                f"{who}: paths are keystr strings such as '.layers[0].weight' (as tied.ties prints "
                f"them), got {type(path).__name__} {path!r}."
            )
        if path == "<root>":
            path = ""
        if path not in self.steps:
            near = difflib.get_close_matches(path, [where(p) for p in self.steps], n=5, cutoff=0.0)
            raise PathError(
                f"{who}: {path!r} is not a place of the model. Nearest valid paths: "
                f"{', '.join(near) or 'none'}. Paths are written as tied.ties and tied.summary "
                "print them."
            )
        if path in self.alike:
            shown = " and ".join("(" + ", ".join(repr(k) for k in steps) + ")" for steps in self.alike[path])
            raise ValueError(
                f"{who}: {where(path)} names {len(self.alike[path])} places of the model, whose keys (keystr "
                f"pieces from the root) are {shown}: an attribute or key whose name holds a '.' or brackets "
                "is written like a path below it. Rename that attribute so each place has its own path."
            )
        return path

    def same_object(self, path: str) -> tuple[str, ...]:
        """Every place of the array or node at ``path`` (through the first place of each
        shared container, as the core lists them); a static's own place only."""
        kind, i = self.kind[path], self.index[path]
        if kind == "array":
            return self.gdef.leaf_paths()[i]
        if kind == "static":
            return (path,)
        return self.gdef.node_paths()[i]

    def container_kind(self, steps: tuple[str, ...]) -> Any:
        return KIND_BY_NAME[self.kind["".join(steps)]]


def is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def child(x: Any, kind: Any, step: str) -> Any:
    """The child of node ``x`` (of the given kind) at ``step``."""
    children, meta = kind.children(x)
    n = len(children)
    for i in range(n):
        if kind.key(meta, i, n) == step:
            return children[i]
    raise GraphError(f"the {kind.name} has no child {step}: the graph changed while being read.")


def with_child(x: Any, kind: Any, step: str, value: Any) -> Any:
    """``x`` with ``value`` at ``step``: ``x`` itself, changed in place, for a kind that can
    be written (a list, dict, object, View), else a new node of the same kind. Only ever
    called on the nodes of a fresh copy."""
    children, meta = kind.children(x)
    n = len(children)
    i = next(i for i in range(n) if kind.key(meta, i, n) == step)
    if kind.writable:
        kind.setter(meta, x, i)(value)
        return x
    children[i] = value
    return kind.make(meta, children)


def get(root: Any, steps: tuple[str, ...], places: Places) -> Any:
    """The object at ``steps`` below ``root``, a graph with the structure ``places`` reads."""
    for k in range(len(steps)):
        root = child(root, places.container_kind(steps[:k]), steps[k])
    return root


def put(root: Any, steps: tuple[str, ...], value: Any, places: Places) -> Any:
    """Put ``value`` at the place ``steps`` of the fresh graph ``root`` (whose structure
    ``places`` reads); return the root (a new one when the root itself was rebuilt).

    A container that cannot change in place (a tuple, a JAX pytree) is rebuilt and put
    at every place of the old one, so a shared container stays one object."""
    if not steps:
        return value
    parent = get(root, steps[:-1], places)
    kind = places.container_kind(steps[:-1])
    if child(parent, kind, steps[-1]) is value:
        return root
    new = with_child(parent, kind, steps[-1], value)
    if new is parent:
        if len(steps) > 1 and get(root, steps[:-1], places) is not parent:
            # the parent is made anew each time its own container is read (a pytree whose
            # flatten builds a list): write the changed one into that container
            return put(root, steps[:-1], parent, places)
        return root
    now = Places(flatten(root)[1])  # the root still holds the old parent at all its places
    for q in sorted(now.same_object("".join(steps[:-1])), key=len, reverse=True):
        root = put(root, now.steps[q], new, now)
    return root


# ---------------------------------------------------------------- after an edit


def renew(before: Any, after: Any, *, how: str, edited: tuple = (), gdef: GraphDef | None = None) -> Any:
    """``after`` (a fresh result of the edit ``how`` of ``before``: ``"replace"``, ``"tie"``,
    ``"untie"``, ``"map"``) with the static data of its nodes made true again.

    A node type whose static data says what the arrays below it mean (a `tied.Stack`: which places
    of its member are stacked) may define ``__tied_renew__(old, new, *, at, how, outside,
    enclosing)``: ``new`` the node as the edit rebuilt it (its static data as it was), ``old`` the
    node at the same place of ``before`` (None if there was none), ``at`` its path, ``outside`` the
    arrays (``id`` to a path) that ``after`` also holds outside it, ``enclosing`` how many such
    nodes hold it, ``edited`` the places the edit put an object at (``"replace"``, ``"tie"``,
    ``"untie"``). It returns the node to put there (``new`` itself when nothing changes) or
    raises ``ValueError`` naming the place. A node that is ``old`` itself
    (nothing below it changed) is not asked. Inner nodes are asked first. ``gdef``: ``after``'s
    GraphDef, if known (a graph without such a type is returned as it is, unwalked).
    """
    if gdef is None:
        gdef = flatten(after)[1]
    if not any(hasattr(KINDS[k].type_of(meta), "__tied_renew__") for k, meta, _ in gdef.records):
        return after
    old_places = Places(flatten(before)[1])
    done: set[str] = set()
    while True:
        leaves, g = flatten(after)
        places = Places(g)
        renewing = [
            p
            for p in reversed(places.nodes())
            if hasattr(get(after, places.steps[p], places), "__tied_renew__")
        ]
        todo = [p for p in renewing if p not in done]
        if not todo:
            return after
        at = todo[0]
        enclosing = sum(1 for q in renewing if is_prefix(places.steps[q], places.steps[at]))
        done.update(places.same_object(at))
        new = get(after, places.steps[at], places)
        old = None
        if at in old_places.steps and old_places.kind[at] == places.kind[at]:
            old = get(before, old_places.steps[at], old_places)
        if old is new:
            continue
        mine = [places.steps[q] for q in places.same_object(at)]
        outside: dict[int, str] = {}
        for path, q in g.place_leaves():
            if not any(s == places.steps[path] or is_prefix(s, places.steps[path]) for s in mine):
                outside.setdefault(id(leaves[q]), path)
        out = type(new).__tied_renew__(
            old, new, at=at, how=how, outside=outside, enclosing=enclosing, edited=edited
        )
        if out is not new:
            for q in sorted(places.same_object(at), key=len, reverse=True):
                after = put(after, places.steps[q], out, places)
