"""Surgery by path: `tie`, `untie` and `replace` return a new model with its places edited.

None of them touches the model it is given. Each one flattens the model (the core
walk decides all sharing), rebuilds a fresh copy with `unflatten` (new containers,
the same arrays, the same ties), and edits that copy's containers at the places
named. Editing a place of a shared container edits the container, so the edit is
seen at every place of it.

Paths are keystr strings, as `tied.ties` and `tied.summary` print them
(``'.layers[0].weight'``; ``''`` or ``'<root>'`` for the model itself). A valid path
is a place of an array or of a container that holds arrays.

Below a `tied.Stack`'s member every edit ends with the core's `renew`: the Stack's layout
is made true of its arrays again, as unstack, edit every member, restack would make it, or
the edit is refused naming the place (`Stack.__tied_renew__`).

Places and their steps come from `GraphDef.walk_places`; no path is parsed. The two
helpers that read and write one child of a container (`child`, `with_child`) use the
core's node kinds; they write only into the fresh copy (and, for `tied.map`'s
``is_leaf``, read the user's objects without changing them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core import (
    LEAF_KINDS,
    GraphError,
    PathError,
    Places,
    flatten,
    get,
    is_array,
    is_prefix,
    put,
    rebuild,
    renew,
    unflatten,
    where,
)

__all__ = ["PathError", "replace", "tie", "untie"]


# ---------------------------------------------------------------- copies and checks


def _copy_array(x: Any) -> Any:
    return x.copy()  # numpy and JAX arrays alike: a new array object, equal values


def deep_copy(obj: Any) -> Any:
    """A copy of an array or of a whole subgraph: new containers and new arrays with equal
    values; ties inside it are kept, static values are shared (they are values)."""
    if is_array(obj):
        return _copy_array(obj)
    leaves, gdef = flatten(obj)
    return unflatten(gdef, [_copy_array(x) for x in leaves])


def _describe_value(x: Any) -> str:
    if is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__module__}.{type(x).__qualname__}"


def _signature(node: Any) -> dict[str, tuple]:
    leaves, gdef = flatten(node)
    return {p: (tuple(leaves[i].shape), np.dtype(leaves[i].dtype)) for p, i in Places(gdef).leaf_of.items()}


def _check_tieable(p0: str, o0: Any, p: str, o: Any) -> None:
    def fail(what: str) -> ValueError:
        return ValueError(
            f"tied.tie: {where(p)} cannot hold the object at {where(p0)}: {what}. Tie places "
            "that hold arrays of one shape and dtype, or containers of one type with arrays of "
            "the same shapes and dtypes at the same paths."
        )

    if is_array(o0) != is_array(o) or (not is_array(o) and type(o) is not type(o0)):
        raise fail(f"{where(p0)} holds {_describe_value(o0)}, {where(p)} holds {_describe_value(o)}")
    if is_array(o):
        if tuple(o.shape) != tuple(o0.shape) or np.dtype(o.dtype) != np.dtype(o0.dtype):
            raise fail(f"{where(p0)} holds {_describe_value(o0)}, {where(p)} holds {_describe_value(o)}")
        return
    s0, s = _signature(o0), _signature(o)
    for rel in list(s0) + [r for r in s if r not in s0]:
        a, b = s0.get(rel), s.get(rel)
        if a != b:
            what = lambda v: "no array" if v is None else f"an array of shape {v[0]} and dtype {v[1]}"
            raise fail(f"{where(p0 + rel)} holds {what(a)}, {where(p + rel)} holds {what(b)}")


# ---------------------------------------------------------------- the public functions


def _refuse_static(places: Places, path: str, who: str, why: str) -> None:
    if places.kind[path] == "static":
        raise ValueError(
            f"{who}: {where(path)} holds a static value (a number, string, None, a function), "
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
                f"tied.tie: {where(p)} is an array below a state cell, and state is shared by cell, "
                "never by the array a cell holds (two cells holding one array are two states). "
                "Tie the cells themselves: give the places of the cells (without '.value')."
            )
    steps = [places.steps[p] for p in paths]
    for a in range(len(steps)):
        for b in range(len(steps)):
            if is_prefix(steps[a], steps[b]):
                raise ValueError(
                    f"tied.tie: {where(paths[b])} lies inside {where(paths[a])}; a place cannot "
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
    return renew(tree, fresh, how="tie", edited=paths[1:], gdef=after.gdef)


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
            q for q in places.same_object(inner) if q != inner and not is_prefix(steps[:k], places.steps[q])
        ]
        if others:
            raise ValueError(
                f"tied.untie: {where(path)} lies inside {where(inner)}, a container shared with "
                f"{', '.join(where(q) for q in others)}, so it is one place with "
                f"{others[0]}{path[len(inner) :]}. Untie the container first: "
                f"tied.untie(tree, {inner!r})."
            )
    _refuse_copying_above(places, path)
    fresh = unflatten(gdef, leaves)
    fresh = put(fresh, steps, deep_copy(get(fresh, steps, places)), places)
    after = Places(flatten(fresh)[1])
    if path and (path not in after.kind or after.same_object(path) != (path,)):
        raise _not_kept("tied.untie", path, "untie it")
    return renew(tree, fresh, how="untie", edited=(path,), gdef=after.gdef)


def _refuse_copying_above(places: Places, path: str) -> None:
    """A container whose contents reach a container above it (a child's ``.parent``) cannot be
    copied alone: the copy would hold a copy of the model around it."""
    steps = places.steps[path]
    if places.kind[path] in LEAF_KINDS:
        return
    above = {places.index["".join(steps[:k])]: "".join(steps[:k]) for k in range(len(steps))}
    for q, kind in places.kind.items():
        if kind not in LEAF_KINDS and places.index[q] in above and is_prefix(steps, places.steps[q]):
            top = above[places.index[q]]
            raise ValueError(
                f"tied.untie: the container at {where(path)} reaches {where(top)} again at "
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

    Below a `tied.Stack`'s member, an array put at a stacked place stays stacked if its
    leading axis is the stack's length and is one array for every member otherwise; a new
    array elsewhere whose leading axis is the stack's length is refused (say which it is
    with `Stack.map`).

    Raises:
        PathError: the path names no place.
        ValueError: below a `tied.Stack`, a layout that cannot be told or cannot hold
            (naming the place).

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
    joint = None if is_array(value) else _joint(tree, value)
    if joint is None and places.kind[path] == "array":
        new = list(leaves)
        new[places.leaf_of[path]] = value
        # fresh containers, as tie and untie give: a result that shared the input's untouched
        # layers would carry a later in-place write (a state cell, an attribute) into the input
        out = rebuild(gdef, new)
        return renew(tree, out, how="replace", edited=places.same_object(path), gdef=gdef)
    fresh, value = joint if joint is not None else (unflatten(gdef, leaves), value)
    targets = sorted(places.same_object(path), key=len, reverse=True)
    if "" in targets:  # the root itself (it may also sit below itself, on a cycle)
        return value
    for q in targets:
        fresh = put(fresh, places.steps[q], value, places)
    for q in targets:
        if get(fresh, places.steps[q], places) is not value:
            raise _not_kept("tied.replace", q, "put an object there")
    return renew(tree, fresh, how="replace", edited=tuple(targets))


def _not_kept(who: str, path: str, what: str) -> GraphError:
    return GraphError(
        f"{who}: {where(path)} did not keep what was written there: a container above it is "
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
