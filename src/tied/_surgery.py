"""Surgery by path: `tie`, `untie` and `replace` return a new model with its places edited.

None of them touches the model it is given. Each one flattens the model (the core
walk decides all sharing), rebuilds a fresh copy with `unflatten` (new containers,
the same arrays, the same ties), and edits that copy's containers at the places
named. Editing a place of a shared container edits the container, so the edit is
seen at every place of it.

Paths are keystr strings, as `tied.ties` and `tied.summary` print them
(``'.layers[0].weight'``; ``''`` or ``'<root>'`` for the model itself). A valid path
is a place of an array or of a container that holds arrays.

The few helpers that read and write one child of a container (`child`, `with_child`)
are the only code here that knows container types; they run on the fresh copy or,
for `tied.map`'s ``is_leaf``, read the user's objects without changing them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _graph
from ._graph import GraphDef, GraphError, flatten, unflatten
from ._view import View

__all__ = ["PathError", "replace", "tie", "untie"]

_registry = jax.tree_util.default_registry


class PathError(KeyError):
    """A path that names no place of the model; the message lists the nearest valid paths."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _show(path: str) -> str:
    return path or "<root>"


# ---------------------------------------------------------------- paths


def split_path(path: str) -> tuple[str, ...] | None:
    """The steps of a keystr path: ``'.layers[0].weight'`` -> ``('.layers', '[0]', '.weight')``;
    ``''`` -> ``()``. None when the string is not a sequence of ``.name`` and ``[key]`` steps
    (brackets and quotes inside a dict key's repr are matched)."""
    steps: list[str] = []
    i, n = 0, len(path)
    while i < n:
        c = path[i]
        j = i + 1
        if c == ".":
            while j < n and path[j] not in ".[":
                j += 1
            if j == i + 1:
                return None
        elif c == "[":
            depth, quote = 1, None
            while j < n and depth:
                d = path[j]
                if quote is not None:
                    if d == "\\":
                        j += 1
                    elif d == quote:
                        quote = None
                elif d in "'\"":
                    quote = d
                elif d in "([{":
                    depth += 1
                elif d in ")]}":
                    depth -= 1
                j += 1
            if depth:
                return None
        else:
            return None
        steps.append(path[i:j])
        i = j
    return tuple(steps)


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


class Places:
    """The places of a graph, read from its GraphDef: every array place (with its unique
    array's index) and every place of a container that holds arrays, in walk order.

    Places below a shared container are listed at every place of it, as
    `GraphDef.place_leaves` lists them (for a graph with a reference cycle, only the
    places through each container's first place)."""

    def __init__(self, gdef: GraphDef):
        self.gdef = gdef
        try:
            leaf_of = {p: i for p, i in gdef.place_leaves()}
        except GraphError:  # a reference cycle: infinitely many places; the first ones
            leaf_of = {p: i for i, ps in enumerate(gdef.leaf_paths()) for p in ps}
        self.leaf_of: dict[str, int] = leaf_of
        self.shared_nodes: list[tuple[str, ...]] = gdef.shared_node_paths()
        nodes: dict[str, None] = {}
        if "" not in leaf_of:
            nodes[""] = None
        for p in leaf_of:
            steps = split_path(p)
            for k in range(1, len(steps or ())):
                nodes.setdefault("".join(steps[:k]))
        for group in self.shared_nodes:
            for p in group:
                nodes.setdefault(p)
        self.nodes: dict[str, None] = nodes

    def resolve(self, path: str, *, who: str) -> tuple[str, ...]:
        """The steps of ``path``, or a `PathError` listing the nearest valid paths."""
        if path == "<root>":
            path = ""
        if not isinstance(path, str):
            raise TypeError(
                f"{who}: paths are keystr strings such as '.layers[0].weight' (as tied.ties prints "
                f"them), got {type(path).__name__} {path!r}."
            )
        steps = split_path(path) if (path in self.leaf_of or path in self.nodes) else None
        if steps is None:
            valid = list(self.leaf_of) + [p for p in self.nodes if p not in self.leaf_of]
            near = difflib.get_close_matches(path, [_show(p) for p in valid], n=5, cutoff=0.0)
            raise PathError(
                f"{who}: {path!r} is not a place of the model (a place of an array, or of a "
                f"container that holds arrays). Nearest valid paths: {', '.join(near) or 'none'}. "
                "Paths are written as tied.ties prints them."
            )
        return steps

    def is_array(self, path: str) -> bool:
        return (path if path != "<root>" else "") in self.leaf_of


# ---------------------------------------------------------------- one child of a container
# TODO core: these mirror the core's node kinds from the outside (list, tuple, dict,
# View, JAX-registered pytrees, and plain objects walked through their attributes).
# A core pair `child(node, step)` / `with_child(node, step, value)` keyed on the kind
# table would keep that knowledge in one place.


def _walked_by_attributes(x: Any) -> bool:
    t = type(x)
    # TODO core: read "walked through __dict__" from the core instead of its registry set.
    return t in getattr(_graph, "_registered", ()) or not _registry.is_node(t)


def _one_level(x: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return [(jax.tree_util.keystr(p), c) for p, c in flat], treedef


def _attribute(x: Any, step: str) -> str:
    name = step[1:]
    d = getattr(x, "__dict__", None)
    if step.startswith(".") and (
        (isinstance(d, dict) and name in d)
        or (dataclasses.is_dataclass(x) and name in {f.name for f in dataclasses.fields(x)})
    ):
        return name
    raise LookupError(step)


def child(x: Any, step: str) -> Any:
    """The child of container ``x`` at ``step`` (``'.weight'``, ``'[0]'``, ``"['k']"``)."""
    t = type(x)
    if t is View:
        if step == ".source":
            return x.source
    elif t is list or t is tuple:
        for i, c in enumerate(x):
            if step == f"[{i}]":
                return c
    elif t is dict:
        for k, c in x.items():
            if step == f"[{k!r}]":
                return c
    elif _walked_by_attributes(x):
        return getattr(x, _attribute(x, step))
    else:
        for key, c in _one_level(x)[0]:
            if key == step:
                return c
    raise LookupError(step)


def with_child(x: Any, step: str, value: Any) -> Any:
    """``x`` with ``value`` at ``step``: ``x`` itself, changed in place, when it is mutable
    (a list, dict, View or an object walked through its attributes), else a new container.
    Only ever called on containers of a fresh copy."""
    t = type(x)
    if t is list:
        x[[f"[{i}]" for i in range(len(x))].index(step)] = value
        return x
    if t is dict:
        key = next(k for k in x if step == f"[{k!r}]")
        x[key] = value
        return x
    if t is View:
        x.source = value
        return x
    if t is tuple:
        i = [f"[{i}]" for i in range(len(x))].index(step)
        return x[:i] + (value,) + x[i + 1 :]
    if _walked_by_attributes(x):
        object.__setattr__(x, _attribute(x, step), value)
        return x
    kids, treedef = _one_level(x)
    i = [k for k, _ in kids].index(step)
    return treedef.unflatten([value if j == i else c for j, (_, c) in enumerate(kids)])


def get(root: Any, steps: Sequence[str]) -> Any:
    """The object at ``steps`` below ``root``."""
    for s in steps:
        root = child(root, s)
    return root


def _places_of(root: Any, steps: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every place of the container at ``steps`` in the graph ``root`` (its first places
    through shared ancestors, as the core lists them)."""
    obj = get(root, steps)
    for group in flatten(root)[1].shared_node_paths():
        first = split_path(group[0])
        if first is not None and get(root, first) is obj:
            return [s for s in map(split_path, group) if s is not None]
    return [steps]


def put(root: Any, steps: tuple[str, ...], value: Any) -> Any:
    """Put ``value`` at the place ``steps`` of the fresh graph ``root``; return the root
    (a new one when the root itself was rebuilt). A container that cannot change in place
    (a tuple, a JAX pytree) is rebuilt and put at every place of the old one, so a
    shared container stays one object."""
    if not steps:
        return value
    parent = get(root, steps[:-1])
    if child(parent, steps[-1]) is value:
        return root
    new = with_child(parent, steps[-1], value)
    if new is parent:
        return root
    for place in _places_of(root, steps[:-1]):
        root = put(root, place, new)
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


def _describe(x: Any) -> str:
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
        raise fail(f"{_show(p0)} holds {_describe(o0)}, {_show(p)} holds {_describe(o)}")
    if _is_array(o):
        if tuple(o.shape) != tuple(o0.shape) or np.dtype(o.dtype) != np.dtype(o0.dtype):
            raise fail(f"{_show(p0)} holds {_describe(o0)}, {_show(p)} holds {_describe(o)}")
        return
    s0, s = _signature(o0), _signature(o)
    for rel in list(s0) + [r for r in s if r not in s0]:
        a, b = s0.get(rel), s.get(rel)
        if a != b:
            what = lambda v: "no array" if v is None else f"an array of shape {v[0]} and dtype {v[1]}"
            raise fail(f"{_show(p0 + rel)} holds {what(a)}, {_show(p + rel)} holds {what(b)}")


# ---------------------------------------------------------------- the public functions


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
        ValueError: shapes, dtypes or types differ (naming both paths), or one path lies
            inside another.

    Example:
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
    steps = [places.resolve(p, who="tied.tie") for p in paths]
    for a in range(len(steps)):
        for b in range(len(steps)):
            if a != b and steps[a] != steps[b] and _is_prefix(steps[a], steps[b]):
                raise ValueError(
                    f"tied.tie: {_show(paths[b])} lies inside {_show(paths[a])}; a place cannot "
                    "be tied to a place inside itself. Give places that do not contain each other."
                )
    fresh = unflatten(gdef, leaves)
    objs = [get(fresh, s) for s in steps]
    for p, o in zip(paths[1:], objs[1:]):
        _check_tieable(paths[0], objs[0], p, o)
    for s in steps[1:]:
        fresh = put(fresh, s, objs[0])
    return fresh


def untie(tree: Any, path: str) -> Any:
    """A new model in which the place ``path`` holds its own copy of its object.

    The copy is deep: a container (a shared layer) is copied with new arrays of equal
    values, so the place shares nothing with any other place afterwards (ties inside the
    copied container are kept). The other places keep the object. ``tree`` is not changed.

    Args:
        tree: the model.
        path: a keystr path, as `tied.ties` prints it.

    Returns:
        The new model.

    Raises:
        PathError: the path names no place.
        ValueError: the place lies inside a shared container, so it is one place with that
            container's other places; the message names the container to untie instead.

    Example:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> model = tied.untie({"a": w, "b": w}, "['b']")
        >>> model["a"] is w, model["b"] is w, bool((model["b"] == w).all())
        (True, False, True)
    """
    leaves, gdef = flatten(tree)
    places = Places(gdef)
    steps = places.resolve(path, who="tied.untie")
    fresh = unflatten(gdef, leaves)
    shared = {}
    for group in places.shared_nodes:
        first = split_path(group[0])
        if first is not None:
            shared[id(get(fresh, first))] = group
    for k in range(len(steps)):
        group = shared.get(id(get(fresh, steps[:k])))
        if group is not None:
            inner = "".join(steps[:k])
            others = ", ".join(_show(q) for q in group if q != inner)
            raise ValueError(
                f"tied.untie: {_show(path)} lies inside {_show(inner)}, a container shared "
                f"with {others}, so it is one place with {_show(others.split(', ')[0])}"
                f"{path[len(inner):]}. Untie the container first: "
                f"tied.untie(tree, {_show(inner)!r})."
            )
    return put(fresh, steps, deep_copy(get(fresh, steps)))


def replace(tree: Any, path: str, value: Any) -> Any:
    """A new model in which the object at ``path`` is ``value`` at every place that holds it.

    The places tied to ``path`` stay tied: they all hold ``value``. For an array that is
    the source of a `tied.View`, the view reads ``value``. Shapes are not checked (as
    with ``equinox.tree_at``). ``tree`` is not changed.

    Args:
        tree: the model.
        path: a keystr path of an array or a container, as `tied.ties` prints it.
        value: the new object (an array, a layer, anything).

    Returns:
        The new model.

    Raises:
        PathError: the path names no place.

    Example:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> model = tied.replace({"a": w, "b": w}, "['b']", jnp.zeros(3))
        >>> model["a"] is model["b"], float(model["a"].sum())
        (True, 0.0)
    """
    leaves, gdef = flatten(tree)
    places = Places(gdef)
    steps = places.resolve(path, who="tied.replace")
    if places.is_array(path):
        new = list(leaves)
        new[places.leaf_of[path if path != "<root>" else ""]] = value
        return unflatten(gdef, new)
    fresh = unflatten(gdef, leaves)
    for s in _places_of(fresh, steps):
        fresh = put(fresh, s, value)
    return fresh
