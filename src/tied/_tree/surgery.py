"""Surgery by path: `tie`, `untie` and `replace` return a new model with its places edited.

None of them touches the model it is given. Each one flattens the model (the core
walk decides all sharing), rebuilds a fresh copy with `unflatten` (new containers,
the same arrays, the same ties), and edits that copy's containers at the places
named. Editing a place of a shared container edits the container, so the edit is
seen at every place of it.

Paths are keystr strings, as `tied.ties` and `tied.summary` print them
(``'.layers[0].weight'``; ``''`` or ``'<root>'`` for the model itself). A valid path
is a place of an array or of a container that holds arrays.

Places and their steps come from `GraphDef.walk_places`; no path is parsed. The two
helpers that read and write one child of a container (`child`, `with_child`) use the
core's node kinds; they write only into the fresh copy (and, for `tied.map`'s
``is_leaf``, read the user's objects without changing them).
"""

from __future__ import annotations

import difflib
from typing import Any

import jax
import numpy as np

from .._core import KIND_BY_NAME, GraphDef, GraphError, Located, flatten, unflatten

__all__ = ["PathError", "replace", "tie", "untie"]


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


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _show(path: str) -> str:
    return path or "<root>"


# ---------------------------------------------------------------- places and steps
_LEAF_KINDS = ("array", "static")


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
            if place.kind not in _LEAF_KINDS:
                open_nodes.append((place.path, steps))
        self.leaf_of = {p: i for p, i in self.index.items() if self.kind[p] == "array"}

    def nodes(self) -> list[str]:
        """The places of nodes, in walk order (parents first)."""
        return [p for p, k in self.kind.items() if k not in _LEAF_KINDS]

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
            near = difflib.get_close_matches(path, [_show(p) for p in self.steps], n=5, cutoff=0.0)
            raise PathError(
                f"{who}: {path!r} is not a place of the model. Nearest valid paths: "
                f"{', '.join(near) or 'none'}. Paths are written as tied.ties and tied.summary "
                "print them."
            )
        if path in self.alike:
            shown = " and ".join("(" + ", ".join(repr(k) for k in steps) + ")" for steps in self.alike[path])
            raise ValueError(
                f"{who}: {_show(path)} names {len(self.alike[path])} places of the model, whose keys (keystr "
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


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
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


# ---------------------------------------------------------------- copies and checks


def _copy_array(x: Any) -> Any:
    return x.copy()  # numpy and JAX arrays alike: a new array object, equal values


def deep_copy(obj: Any) -> Any:
    """A copy of an array or of a whole subgraph: new containers and new arrays with equal
    values; ties inside it are kept, static values are shared (they are values)."""
    if _is_array(obj):
        return _copy_array(obj)
    leaves, gdef = flatten(obj)
    return unflatten(gdef, [_copy_array(x) for x in leaves])


def _describe_value(x: Any) -> str:
    if _is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__module__}.{type(x).__qualname__}"


def _signature(node: Any) -> dict[str, tuple]:
    leaves, gdef = flatten(node)
    return {p: (tuple(leaves[i].shape), np.dtype(leaves[i].dtype)) for p, i in Places(gdef).leaf_of.items()}


def _check_tieable(p0: str, o0: Any, p: str, o: Any) -> None:
    def fail(what: str) -> ValueError:
        return ValueError(
            f"tied.tie: {_show(p)} cannot hold the object at {_show(p0)}: {what}. Tie places "
            "that hold arrays of one shape and dtype, or containers of one type with arrays of "
            "the same shapes and dtypes at the same paths."
        )

    if _is_array(o0) != _is_array(o) or (not _is_array(o) and type(o) is not type(o0)):
        raise fail(f"{_show(p0)} holds {_describe_value(o0)}, {_show(p)} holds {_describe_value(o)}")
    if _is_array(o):
        if tuple(o.shape) != tuple(o0.shape) or np.dtype(o.dtype) != np.dtype(o0.dtype):
            raise fail(f"{_show(p0)} holds {_describe_value(o0)}, {_show(p)} holds {_describe_value(o)}")
        return
    s0, s = _signature(o0), _signature(o)
    for rel in list(s0) + [r for r in s if r not in s0]:
        a, b = s0.get(rel), s.get(rel)
        if a != b:
            what = lambda v: "no array" if v is None else f"an array of shape {v[0]} and dtype {v[1]}"
            raise fail(f"{_show(p0 + rel)} holds {what(a)}, {_show(p + rel)} holds {what(b)}")


# ---------------------------------------------------------------- the public functions


def _refuse_static(places: Places, path: str, who: str, why: str) -> None:
    if places.kind[path] == "static":
        raise ValueError(
            f"{who}: {_show(path)} holds a static value (a number, string, None, a function), "
            f"which is never tied, {why}. Give the place of an array or of a container."
        )


def tie(tree: Any, *paths: str) -> Any:
    """A new model in which every given place holds the object at the first path.

    The object is an array or a whole container (a layer). Arrays must agree in shape
    and dtype; containers must be of one type and hold arrays of the same shapes and
    dtypes at the same relative paths. A place inside a shared container is a place of
    that container: the tie is seen at all of its places. ``tree`` is not changed.

    Args:
        tree: the model.
        *paths: two or more keystr paths, as `tied.ties` prints them. No path may lie
            inside another.

    Returns:
        The new model (new containers; arrays are the model's own).

    Raises:
        PathError: a path names no place; the message lists the nearest valid ones.
        ValueError: shapes, dtypes or types differ (naming both paths), one path lies
            inside another, or a path holds a static value.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> model = {"embed": jnp.ones((4, 2)), "head": jnp.zeros((4, 2))}
        >>> model = tied.tie(model, "['embed']", "['head']")   # Hugging Face tie_weights
        >>> model["head"] is model["embed"]
        True
    """
    if len(paths) < 2:
        raise TypeError(
            "tied.tie(tree, *paths) needs two or more paths: the first names the object, the "
            "others the places that should hold it."
        )
    leaves, gdef = flatten(tree)
    places = Places(gdef)
    paths = tuple(places.resolve(p, who="tied.tie") for p in paths)
    state = gdef.state_leaves()
    for p in paths:
        _refuse_static(places, p, "tied.tie", "so it cannot be tied")
        if places.kind[p] == "array" and state[places.leaf_of[p]]:
            raise GraphError(
                f"tied.tie: {_show(p)} is an array below a state cell, and state is shared by cell, "
                "never by the array a cell holds (two cells holding one array are two states). "
                "Tie the cells themselves: give the places of the cells (without '.value')."
            )
    steps = [places.steps[p] for p in paths]
    for a in range(len(steps)):
        for b in range(len(steps)):
            if _is_prefix(steps[a], steps[b]):
                raise ValueError(
                    f"tied.tie: {_show(paths[b])} lies inside {_show(paths[a])}; a place cannot "
                    "be tied to a place inside itself. Give places that do not contain each other."
                )
    fresh = unflatten(gdef, leaves)
    objs = [get(fresh, s, places) for s in steps]
    for p, o in zip(paths[1:], objs[1:]):
        _check_tieable(paths[0], objs[0], p, o)
    for s in steps[1:]:
        fresh = put(fresh, s, objs[0], places)
    after = Places(flatten(fresh)[1])
    for p in paths[1:]:
        if (after.kind.get(p), after.index.get(p)) != (after.kind[paths[0]], after.index[paths[0]]):
            raise _not_kept("tied.tie", p, "tie it")
    return fresh


def untie(tree: Any, path: str) -> Any:
    """A new model in which the place ``path`` holds its own copy of its object.

    The copy is deep: a container (a shared layer) is copied with new arrays of equal
    values, so the place shares nothing with any other place afterwards (ties inside the
    copied container are kept). The other places keep the object. ``tree`` is not changed.

    Args:
        tree: the model.
        path: a keystr path of an array or a container, as `tied.ties` prints it.

    Returns:
        The new model.

    Raises:
        PathError: the path names no place.
        ValueError: the place lies inside a shared container, so it is one place with that
            container's other places (the message names the container to untie instead),
            or it holds a static value.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> model = tied.untie({"a": w, "b": w}, "['b']")
        >>> model["a"] is w, model["b"] is w, bool((model["b"] == w).all())
        (True, False, True)
    """
    leaves, gdef = flatten(tree)
    places = Places(gdef)
    path = places.resolve(path, who="tied.untie")
    _refuse_static(places, path, "tied.untie", "so there is nothing to untie")
    steps = places.steps[path]
    for k in range(len(steps)):
        inner = "".join(steps[:k])
        # A place of the container below itself is a reference back up a cycle (a child's
        # `.parent`): the same place seen again, not another place sharing it.
        others = [
            q for q in places.same_object(inner) if q != inner and not _is_prefix(steps[:k], places.steps[q])
        ]
        if others:
            raise ValueError(
                f"tied.untie: {_show(path)} lies inside {_show(inner)}, a container shared with "
                f"{', '.join(_show(q) for q in others)}, so it is one place with "
                f"{others[0]}{path[len(inner) :]}. Untie the container first: "
                f"tied.untie(tree, {inner!r})."
            )
    _refuse_copying_above(places, path)
    fresh = unflatten(gdef, leaves)
    fresh = put(fresh, steps, deep_copy(get(fresh, steps, places)), places)
    after = Places(flatten(fresh)[1])
    if path and (path not in after.kind or after.same_object(path) != (path,)):
        raise _not_kept("tied.untie", path, "untie it")
    return fresh


def _refuse_copying_above(places: Places, path: str) -> None:
    """A container whose contents reach a container above it (a child's ``.parent``) cannot be
    copied alone: the copy would hold a copy of the model around it."""
    steps = places.steps[path]
    if places.kind[path] in _LEAF_KINDS:
        return
    above = {places.index["".join(steps[:k])]: "".join(steps[:k]) for k in range(len(steps))}
    for q, kind in places.kind.items():
        if kind not in _LEAF_KINDS and places.index[q] in above and _is_prefix(steps, places.steps[q]):
            top = above[places.index[q]]
            raise ValueError(
                f"tied.untie: the container at {_show(path)} reaches {_show(top)} again at "
                f"{q} (a reference back up the graph), so a copy of it would copy the model around it. "
                f"Untie the arrays inside it instead (tied.untie(tree, {path!r} + '.weight'), say)."
            )


def replace(tree: Any, path: str, value: Any) -> Any:
    """A new model in which the object at ``path`` is ``value`` at every place that holds it.

    The places tied to ``path`` stay tied: they all hold ``value``. For an array that is
    the source of a `tied.View`, the view reads ``value``. A static value (an activation
    function, say) is replaced at its one place. Shapes are not checked (as with
    ``equinox.tree_at``). ``value`` is put in as it is, unless it holds containers of
    the model (a wrapper around a layer, say): then it goes in as a copy whose
    containers are the result's own, so that its ties with the rest of the model are
    kept (its arrays are never copied). ``tree`` is not changed.

    Args:
        tree: the model.
        path: a keystr path, as `tied.ties` prints it.
        value: the new object (an array, a layer, anything).

    Returns:
        The new model.

    Raises:
        PathError: the path names no place.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> model = tied.replace({"a": w, "b": w}, "['b']", jnp.zeros(3))
        >>> model["a"] is model["b"], float(model["a"].sum())
        (True, 0.0)
    """
    leaves, gdef = flatten(tree)
    places = Places(gdef)
    path = places.resolve(path, who="tied.replace")
    joint = None if _is_array(value) else _joint(tree, value)
    if joint is None and places.kind[path] == "array":
        new = list(leaves)
        new[places.leaf_of[path]] = value
        return unflatten(gdef, new)
    fresh, value = joint if joint is not None else (unflatten(gdef, leaves), value)
    targets = sorted(places.same_object(path), key=len, reverse=True)
    if "" in targets:  # the root itself (it may also sit below itself, on a cycle)
        return value
    for q in targets:
        fresh = put(fresh, places.steps[q], value, places)
    for q in targets:
        if get(fresh, places.steps[q], places) is not value:
            raise _not_kept("tied.replace", q, "put an object there")
    return fresh


def _not_kept(who: str, path: str, what: str) -> GraphError:
    return GraphError(
        f"{who}: {_show(path)} did not keep what was written there: a container above it is "
        "made anew each time the model is walked (the flatten of a JAX pytree node builds it "
        f"from other data), so tied cannot {what} by reference. Let the pytree's flatten "
        "return the containers it stores."
    )


def _joint(tree: Any, value: Any) -> tuple[Any, Any] | None:
    """Fresh copies of ``tree`` and ``value`` made in one walk, when ``value`` holds a
    container of ``tree`` (so the copies share it); None when they share no container."""
    leaves, gdef = flatten((tree, value))
    for group in gdef.shared_node_paths():
        if any(p.startswith("[0]") for p in group) and any(p.startswith("[1]") for p in group):
            return unflatten(gdef, leaves)
    return None
