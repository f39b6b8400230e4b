"""`tied.map`: `jax.tree_util.tree_map` over the unique arrays of a graph, ties kept.

The core walk finds the unique arrays (`flatten`); ``f`` runs once on each, and
`rebuild` puts each result back at every place of its array, keeping the model's own
container wherever nothing below it changed. With ``is_leaf``,
containers for which it holds are passed to ``f`` whole; their places are found
from the GraphDef and read by path (see `_surgery`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core import GraphDef, flatten, is_param, rebuild, renew, unflatten
from .surgery import Places, get, put

__all__ = ["map"]


def map(  # noqa: A001 - the name is the contract: tied.map, like jax.tree_util.tree_map
    f: Callable[..., Any],
    tree: Any,
    *rest: Any,
    with_path: bool = False,
    is_leaf: Callable[[Any], bool] | None = None,
    only: str = "all",
) -> Any:
    """Apply ``f`` to every unique array of ``tree``; the result keeps the structure and ties.

    Like `jax.tree_util.tree_map`, but over the graph: ``f`` is called once per unique
    array (however many places hold it), and its result stands at every place of that
    array, one object. Arrays of every dtype are passed (filter inside ``f``, or with
    ``only``). Static
    values (numbers, strings, None, functions) are kept as they are. A `tied.View` keeps
    its function and reads the mapped source.

    Args:
        f: called as ``f(x, *ys)``, or ``f(path, x, *ys)`` with ``with_path=True``.
        tree: the model.
        *rest: more models with ``tree``'s GraphDef (the same containers, statics and
            ties) and arrays of the same shapes; ``ys`` are their arrays at the same places.
        with_path: pass the keystr path of the array's first place (``''`` for the root).
        is_leaf: a predicate asked of every container of the graph, parents first (not
            of arrays or static values). A container for which it holds is passed to ``f``
            whole, once however many places hold it, and the result stands at all its
            places; nothing inside it is mapped. An array inside such a container that
            is also held outside it (or inside another one) is an error, since the tie
            would be cut, and so is a container passed whole that reaches a container also
            held outside it (a ``.parent`` back to the root, say). Containers that hold no
            arrays are kept as they are.
        only: which arrays ``f`` gets: ``"all"``, ``"params"`` (parameters: inexact arrays
            that are not state) or ``"state"`` (the arrays below a `tied.State` or another
            state cell). The others stay as they are, the same objects. Containers passed
            whole by ``is_leaf`` are passed whatever they hold.

    Returns:
        A new model: ``tree``'s structure, ties and statics, with ``f``'s results. Every
        container below which ``f`` changed nothing (returned each array itself, or left it
        out through ``only``) is ``tree``'s own object: with ``only="params"`` the state cells
        are the model's, so state written through the result (a BatchNorm's statistics in a
        bfloat16 copy made inside the loss) reaches the model, eagerly and under `tied.grad`
        and `tied.jit`. Containers with a new array below them are new (``tree`` is never
        changed). With ``is_leaf``, every container is new.

    Raises:
        ValueError: a tree in ``rest`` differs from ``tree``; the message names the first
            differing path. Or ``is_leaf`` would cut a tie, or ``only`` is not one of the three.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones((2, 2))
        >>> model = {"embed": w, "head": w, "bias": jnp.zeros(2)}
        >>> calls = []
        >>> half = tied.map(lambda x: calls.append(x) or x.astype(jnp.bfloat16), model)
        >>> half["embed"] is half["head"], half["head"].dtype, len(calls)
        (True, dtype(bfloat16), 2)
        >>> ema = tied.map(lambda e, p: 0.9 * e + 0.1 * p, model, model)
        >>> ema["embed"] is ema["head"]
        True
        >>> model = {"w": w, "steps": tied.State(jnp.zeros((), jnp.int32))}
        >>> bumped = tied.map(lambda x: x + 1, model, only="state")   # parameters untouched
        >>> int(bumped["steps"].value), bumped["w"] is w
        (1, True)
        >>> half = tied.map(lambda x: x.astype(jnp.bfloat16), model, only="params")
        >>> half["steps"] is model["steps"]                              # the model's own cell
        True
    """
    if only not in _ONLY:
        raise ValueError(
            f"tied.map(only={only!r}): only is one of {', '.join(repr(o) for o in _ONLY)}: every array, the "
            "parameters (inexact arrays that are not state), or the state."
        )
    leaves, gdef = flatten(tree)
    others = []
    for k, r in enumerate(rest):
        r_leaves, r_gdef = flatten(r)
        problem = _difference(gdef, leaves, r_gdef, r_leaves)
        if problem is not None:
            raise ValueError(
                f"tied.map: rest[{k}] is not shaped and tied like the first tree: {problem}. "
                "Every tree after the first needs the first's GraphDef (containers, static values "
                "and ties) and arrays of the same shapes; make it from the first, e.g. "
                "ema = tied.map(jnp.copy, model)."
            )
        others.append(r_leaves)
    first = [ps[0] for ps in gdef.leaf_paths()] if with_path else None

    def call(path: str, x: Any, ys: list) -> Any:
        return f(path, x, *ys) if with_path else f(x, *ys)

    chosen = _chosen(only, leaves, gdef)

    def mapped(i: int) -> Any:
        if not chosen[i]:
            return leaves[i]
        return call(first[i] if with_path else "", leaves[i], [o[i] for o in others])

    if is_leaf is not None:
        return renew(tree, _map_with_leaves(call, mapped, tree, rest, leaves, gdef, is_leaf), how="map")
    return renew(
        tree,
        rebuild(gdef, [mapped(i) for i in range(len(leaves))], keep=(tree, leaves)),
        how="map",
        gdef=gdef,
    )


_ONLY = ("all", "params", "state")


def _chosen(only: str, leaves: list, gdef: GraphDef) -> list[bool]:
    """For each unique array, whether ``f`` gets it."""
    if only == "all":
        return [True] * len(leaves)
    state = gdef.state_leaves()
    if only == "state":
        return list(state)
    return [is_param(x) and not st for x, st in zip(leaves, state)]


def _map_with_leaves(call, mapped, tree, rest, leaves, gdef, is_leaf) -> Any:
    places = Places(gdef)
    # TODO core: `flatten(tree, is_leaf=...)` (such a container an opaque, identity-tracked
    # leaf of the walk) would make this read of the containers by path unnecessary.
    whole: dict[int, tuple[Any, list[str]]] = {}  # id -> (the container, its places)
    covers: dict[str, int] = {}  # place of such a container -> its id

    def around(steps: tuple[str, ...]) -> str | None:
        """The place of a container passed whole that holds the place ``steps``."""
        return next((q for q in ("".join(steps[:k]) for k in range(len(steps))) if q in covers), None)

    for p in places.nodes():
        if around(places.steps[p]) is not None:
            continue
        obj = get(tree, places.steps[p], places)
        if is_leaf(obj):
            whole.setdefault(id(obj), (obj, []))[1].append(p)
            covers[p] = id(obj)
    if not whole:
        return rebuild(gdef, [mapped(i) for i in range(len(leaves))], keep=(tree, leaves))
    if "" in covers:
        return call("", tree, list(rest))

    # For each unique array: {the container around a place, or None: (that place, the
    # container's place)}.
    # The same for every node: a container passed whole that reaches a node also held
    # outside it (a `.parent` back to the root) would give the result that node twice.
    inside: dict[tuple[str, int], dict[Any, tuple[str, str]]] = {}
    for p, kind in places.kind.items():
        if kind == "static":
            continue
        q = around(places.steps[p])
        what = ("array" if kind == "array" else "container", places.index[p])
        inside.setdefault(what, {}).setdefault(None if q is None else covers[q], (p, q or ""))
    new = list(leaves)
    for (what, i), owners in inside.items():
        if len(owners) > 1:
            (a, ca), (b, cb) = sorted(owners.values(), key=lambda v: not v[1])[:2]
            also = f"inside the container at {cb or '<root>'}" if cb else "outside it"
            raise ValueError(
                f"tied.map: is_leaf holds for the container at {ca}, so f gets it whole, but "
                f"the {what} at {a or '<root>'} is also at {b or '<root>'}, {also}: f would see "
                f"the {what} twice and the tie would be cut. Let is_leaf hold for a container "
                f"that holds every place of the {what}, or for none of them."
            )
        if what == "array" and None in owners:
            new[i] = mapped(i)
    out = unflatten(gdef, new)
    for obj, where in whole.values():
        steps = places.steps[where[0]]
        result = call(where[0], obj, [get(r, steps, places) for r in rest])
        for p in where:
            out = put(out, places.steps[p], result, places)
    return out


def _difference(ga: GraphDef, la: list, gb: GraphDef, lb: list) -> str | None:
    """Where graph b first differs from graph a (walk order of a), or None if they agree
    in GraphDef and array shapes."""
    if ga == gb:
        for i, (x, y) in enumerate(zip(la, lb)):
            if x.shape != y.shape:
                p = ga.leaf_paths()[i][0]
                return f"{p or '<root>'} has shape {tuple(y.shape)}, expected {tuple(x.shape)}"
        return None
    pa, pb = Places(ga).leaf_of, Places(gb).leaf_of  # every array place, in walk order
    for p in pa:
        if p not in pb:
            return f"{p or '<root>'} holds an array in the first tree but not here"
    for p in pb:
        if p not in pa:
            return f"{p or '<root>'} holds an array here but not in the first tree"
    a_to_b: dict[int, tuple[int, str]] = {}
    b_to_a: dict[int, tuple[int, str]] = {}
    for p, i in pa.items():
        j = pb[p]
        j0, q = a_to_b.setdefault(i, (j, p))
        if j0 != j:
            return f"{q} and {p} hold one array in the first tree but two different ones here"
        i0, q = b_to_a.setdefault(j, (i, p))
        if i0 != i:
            return f"{q} and {p} hold one array here but two different ones in the first tree"
        if la[i].shape != lb[j].shape:
            return f"{p or '<root>'} has shape {tuple(lb[j].shape)}, expected {tuple(la[i].shape)}"
    na, nb = set(ga.shared_node_paths()), set(gb.shared_node_paths())
    for group in ga.shared_node_paths() + gb.shared_node_paths():
        if (group in na) != (group in nb):
            where = "the first tree" if group in na else "here"
            return f"the container at {group[0] or '<root>'} is shared by {', '.join(group)} only in {where}"
    return "a container type or a static value (not an array) differs"
