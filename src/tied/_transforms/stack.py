"""Stacks of layers: `Stack` (one node for ``n`` members of one structure), `stack`, `unstack`.

A `Stack` holds one *member* in which every array that differs between the members is
replaced by one array with a leading axis of size ``n`` ("stacked") and every object that
is the very same object in every member is kept once, as itself ("broadcast"). Which
places of the member are stacked is the Stack's static data (paths relative to the
member), carried as a JAX pytree node's auxiliary data, so a gradient, an optimiser's
update, `tied.map` and a checkpoint rebuild a Stack with no special case: the core walk
sees a node with one child, and sharing is decided there as for any other node.
`tied.scan` and `tied.vmap` (`_lifted`) read the layout with `layout`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from .._core import GraphDef, Places, first_difference, flatten, get, put, rebuild, where
from .._core import is_array as _is_array

__all__ = ["Stack", "stack", "unstack", "layout"]

_MEMBER = jax.tree_util.GetAttrKey("member")


class Stack:
    """``n`` members of one structure as one node: stacked arrays and broadcast objects.

    Made by `tied.stack`; read back with `tied.unstack`; run with `tied.scan` (one
    member per step) or `tied.vmap` (an ensemble). ``len(stack)`` is ``n``;
    ``stack.member`` is the member whose stacked arrays have the leading axis ``n``
    and whose broadcast objects are the members' own; ``stack.stacked`` lists the
    places of ``member`` that are stacked (all others are broadcast). A `Stack` is a
    JAX pytree node with ``member`` as its one child, so it keeps its length and
    layout through `tied.grad` (the gradient at a Stack's place is a Stack),
    `tied.optim`, `tied.map` and `tied.save`/`tied.load`.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> norm = tied.nn.LayerNorm(2)                          # one norm for every block
        >>> blocks = [{"w": jnp.full(2, float(i)), "norm": norm} for i in range(3)]
        >>> s = tied.stack(blocks)
        >>> len(s), s.member["w"].shape, s.member["norm"] is norm
        (3, (3, 2), True)
        >>> tied.unstack(s)[2]["norm"] is norm
        True
    """

    __slots__ = ("n", "member", "stacked")

    def __init__(self, n: int, member: Any, stacked: tuple[str, ...]):
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "member", member)
        object.__setattr__(self, "stacked", stacked)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"a tied.Stack is immutable (its layout says which places of its member are stacked): "
            f"build a new one with tied.stack, or change the member's contents ({name!r} not set)."
        )

    def __reduce__(self) -> tuple:
        # `copy` and `pickle` rebuild a Stack through its constructor (the default would set
        # its slots one by one, which an immutable Stack refuses); `copy.deepcopy` copies the
        # member with its memo, so ties inside the member and with the rest of the model hold.
        return (Stack, (self.n, self.member, self.stacked))

    def __len__(self) -> int:
        return self.n

    def map(self, f: Callable[..., Any], *xs: Any) -> Stack:
        """The Stack of ``f(member_i, *xs_i)`` over its members: one change made to every member.

        As `jax.lax.map` (or Equinox's ``jax.vmap`` over a stacked model) maps a function over
        the leading axis, ``f`` gets each member as `tied.unstack` gives it and ``xs_i``, slice
        ``i`` of each array (or pytree of arrays) in ``xs``; the results are stacked again
        (`tied.stack`), so unstack, edit, restack is never written by hand. What ``f`` makes
        anew for each member is stacked, what it closes over is one object for every member
        (broadcast), and a broadcast object of the stack that ``f`` only copies (a fresh copy
        with the very same arrays, as `tied.replace` of a container makes) stays the stack's
        own object, so its ties outside the stack hold.

        Args:
            f: called as ``f(member, *slices)``; returns the new member (all of one structure).
            *xs: arrays, or pytrees of arrays, with the leading axis ``len(self)``.

        Returns:
            The new `Stack` (this one is not changed).

        Raises:
            ValueError: an ``xs`` without the leading axis ``len(self)``, or results that
                `tied.stack` refuses (naming the place).

        Examples:
            >>> import jax.numpy as jnp, tied
            >>> emb = jnp.ones((4, 2))                                   # also the head
            >>> s = tied.stack([{"w": jnp.full(2, float(i)), "emb": emb} for i in range(3)])
            >>> gates = jnp.arange(6.0).reshape(3, 2)                    # one gate per member
            >>> g = s.map(lambda m, gate: {**m, "gate": gate}, gates)
            >>> g.member["gate"].shape, g.member["emb"] is emb, "['gate']" in g.stacked
            ((3, 2), True, True)
        """
        for k, x in enumerate(xs):
            for a in jax.tree_util.tree_leaves(x):
                if getattr(a, "ndim", 0) < 1 or a.shape[0] != self.n:
                    raise ValueError(
                        f"Stack.map: xs[{k}] holds an array of shape {tuple(getattr(a, 'shape', ()))}, but "
                        f"each array in xs needs the leading axis {self.n} (the stack's length): member i "
                        "gets slice i."
                    )
        members = unstack(self)
        outs = [
            f(m, *[jax.tree_util.tree_map(lambda a, i=i: a[i], x) for x in xs]) for i, m in enumerate(members)
        ]
        return stack(_keep_broadcast(self, outs))

    def __getitem__(self, i: int) -> Any:
        return unstack(self)[i]

    def __repr__(self) -> str:
        return f"Stack({self.n} x {type(self.member).__name__})"

    @staticmethod
    def __tied_renew__(
        old: Any, new: Stack, *, at: str, how: str, outside: dict, enclosing: int, edited: tuple
    ) -> Stack:
        """After `tied.replace`, `tie`, `untie` or `map` changed something below a Stack (`renew`):
        the Stack with its layout made true of its member again (`_renewed`)."""
        if not isinstance(old, Stack) or (old.n, old.stacked) != (new.n, new.stacked):
            return new  # a Stack the edit put in: its layout is the caller's
        return _renewed(old, new, at, how, outside, enclosing, set(edited))

    @staticmethod
    def __tied_layout__(aux: tuple) -> dict:
        """What a checkpoint records of a Stack beside its arrays (`GraphDef.layouts`): its length
        and which places of its member are stacked. Two Stacks whose arrays have the same shapes
        can still differ here (a broadcast array whose leading axis happens to be ``n``), so a
        strict `tied.load` compares it."""
        return {"type": "tied.Stack", "n": aux[0], "stacked": sorted(aux[1])}


def _flatten_with_keys(s: Stack):
    return [(_MEMBER, s.member)], (s.n, s.stacked)


def _flatten(s: Stack):
    return [s.member], (s.n, s.stacked)


def _unflatten_stack(aux: tuple, children: Iterable) -> Stack:
    (member,) = children
    return Stack(aux[0], member, aux[1])


jax.tree_util.register_pytree_with_keys(Stack, _flatten_with_keys, _unflatten_stack, _flatten)


# ---------------------------------------------------------------- reading a layout


def _places(gdef: GraphDef) -> list:
    return list(gdef.walk_places(expand_shared=True, cut_cycles=True))


def layout(s: Stack) -> tuple[list, GraphDef, list[bool]]:
    """The member's unique arrays, its GraphDef and, per array, whether it is stacked."""
    if not isinstance(s, Stack):
        raise TypeError(f"expected a tied.Stack, got {type(s).__name__}. Make one with tied.stack(members).")
    leaves, gdef = flatten(s.member)
    stacked = set(s.stacked)
    flags = [False] * gdef.num_leaves
    for path, q in gdef.place_leaves():
        if path in stacked:
            flags[q] = True
    return leaves, gdef, flags


def _stacked_nodes(gdef: GraphDef, paths: set) -> list[bool]:
    flags = [False] * gdef.num_nodes
    for p in _places(gdef):
        if p.kind not in ("array", "static") and p.path in paths:
            flags[p.index] = True
    return flags


def _outer_broadcast(gdef: GraphDef, node_stacked: list[bool]) -> list[str]:
    """The places of broadcast nodes whose container is stacked: where the members' own
    objects go back."""
    out = []
    for p in _places(gdef):
        if p.kind in ("array", "static") or node_stacked[p.index]:
            continue
        if p.parent >= 0 and node_stacked[p.parent]:
            out.append(p.path)
    return out


def _assemble(gdef: GraphDef, leaves: list, source: Any, outer: list[str], places: Places) -> Any:
    """Rebuild ``gdef`` from ``leaves``, then put ``source``'s own objects (of the same
    structure) back at the ``outer`` broadcast places, so they stay the very objects."""
    out = rebuild(gdef, leaves)
    for path in outer:
        steps = places.steps[path]
        out = put(out, steps, get(source, steps, places), places)
    return out


# ---------------------------------------------------------------- stack and unstack


def _members_differ(i: int, g0: GraphDef, gi: GraphDef) -> ValueError:
    path, how = first_difference(g0, gi)
    return ValueError(
        f"tied.stack: members 0 and {i} differ at {where(path)}: {how}. A stack "
        "needs members of one structure: the same classes, fields, static values and tie "
        "pattern. Build every member the same way (only array values may differ)."
    )


def _joint(members: list) -> tuple[dict, list]:
    """Where each object of the members sits: ``at[i][path]`` is the (leaf?, index) in a
    joint flatten of all members, and ``seats[(leaf?, index)]`` every (member, path) of it."""
    _, joint = flatten(tuple(members))
    at: list[dict] = [{} for _ in members]
    seats: dict = {}
    member = -1
    prefix = 0
    for p in _places(joint):
        if p.depth == 0 or p.kind == "static":
            continue
        if p.depth == 1:
            member, prefix = p.key.idx, len(p.path)
        rel = p.path[prefix:]
        obj = (p.kind == "array", p.index)
        at[member][rel] = obj
        seats.setdefault(obj, set()).add((member, rel))
    return at, seats


def _classify(is_leaf: bool, paths: list[str], at: list[dict], seats: dict) -> bool:
    """Whether the object at ``paths`` (its places in one member) is stacked (a distinct
    object per member) or broadcast (one object in every member); anything else is a
    tie between some members, or across places, that neither can keep."""
    n = len(at)
    ids = [at[i][paths[0]] for i in range(n)]
    what = "array" if is_leaf else "object"
    if all(x == ids[0] for x in ids):
        expected = {(i, p) for i in range(n) for p in paths}
        actual, broadcast = seats[ids[0]], True
    elif len(set(ids)) == n:
        for i in range(n):
            expected = {(i, p) for p in paths}
            actual = seats[ids[i]]
            if actual != expected:
                break
        broadcast = False
    else:
        a = next(i for i in range(n) if ids.count(ids[i]) > 1)
        b = next(i for i in range(n) if i != a and ids[i] == ids[a])
        c = next(i for i in range(n) if ids[i] != ids[a])
        raise ValueError(
            f"tied.stack: the {what} at {where(paths[0])} is one object in members {a} and {b} "
            f"but not in member {c}: a tie between some members but not all can be neither "
            "stacked (one per member) nor broadcast (one for all). Share it in every member, "
            "or give each member its own."
        )
    if actual != expected:
        (i, p), (k, r) = sorted(actual - expected)[0], sorted(expected & actual or expected)[0]
        raise ValueError(
            f"tied.stack: member {i}'s {what} at {where(p)} is the same object as member "
            f"{k}'s at {where(r)}: a tie across members at different places can be neither "
            "stacked nor broadcast. Tie the same place in every member, or untie them."
        )
    return not broadcast


def stack(members: Iterable) -> Stack:
    """One `Stack` node from ``n >= 1`` members of one structure.

    Every array that differs between the members becomes one array with a new
    leading axis of size ``n``; a state cell of each member becomes one cell holding
    the stacked value. An object (array, layer, state cell, `tied.Rng`) that is the
    very same object in every member is kept once, as itself ("broadcast"): a
    LayerNorm held by every block stays one LayerNorm, and an embedding also held
    outside the stack stays tied to it. A tie inside each member is kept.

    Args:
        members: the members, all of one structure (the same classes, fields,
            static values and tie pattern; arrays of one shape and dtype at each
            stacked place).

    Returns:
        The `Stack` (``len`` is ``n``).

    Raises:
        ValueError: no member; two members of different structure (naming the
            first differing place and the two members); a tie between some
            members but not all, or across different places (naming both places).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = jnp.ones((4, 2))                                 # also used by the head
        >>> blocks = [{"w": jnp.full((2, 2), float(i)), "emb": emb} for i in range(3)]
        >>> s = tied.stack(blocks)
        >>> s.member["w"].shape, s.member["emb"] is emb            # stacked, broadcast
        ((3, 2, 2), True)
        >>> tied.ties({"stack": s, "head": emb})
        [("['head']", "['stack'].member['emb']")]
    """
    if isinstance(members, (str, bytes)) or not isinstance(members, Iterable):
        raise TypeError(f"tied.stack(members) takes a sequence of members, got {type(members).__name__}.")
    ms = list(members)
    if not ms:
        raise ValueError(
            "tied.stack([]): a stack needs at least one member (its length is the number of "
            "members, and its structure is theirs)."
        )
    flat = [flatten(m) for m in ms]
    leaves0, g0 = flat[0]
    for i in range(1, len(ms)):
        if flat[i][1] != g0:
            raise _members_differ(i, g0, flat[i][1])
    at, seats = _joint(ms)
    places = _places(g0)
    _refuse_alike(places)
    leaf_paths: list[list[str]] = [[] for _ in range(g0.num_leaves)]
    node_paths: list[list[str]] = [[] for _ in range(g0.num_nodes)]
    for p in places:
        if p.kind == "array":
            leaf_paths[p.index].append(p.path)
        elif p.kind != "static":
            node_paths[p.index].append(p.path)
    node_stacked = [_classify(False, ps, at, seats) for ps in node_paths]
    leaf_stacked = [_classify(True, ps, at, seats) for ps in leaf_paths]
    _views_follow_sources(g0, places, node_stacked, leaf_stacked)
    _cells_own_arrays(g0, places, node_stacked, leaf_stacked)
    _views_over_stacked(places, node_stacked)
    new_leaves = []
    for q, x in enumerate(leaves0):
        if leaf_stacked[q]:
            new_leaves.append(_stack_arrays([f[0][q] for f in flat], leaf_paths[q][0]))
        else:
            new_leaves.append(x)
    paths = sorted(
        {p for q, ps in enumerate(leaf_paths) if leaf_stacked[q] for p in ps}
        | {p for j, ps in enumerate(node_paths) if node_stacked[j] for p in ps}
    )
    if places[0].kind == "static":
        raise ValueError(
            f"tied.stack: the members are static values ({type(ms[0]).__name__}), with no arrays "
            "to stack. Stack layers, arrays or containers of them."
        )
    if places[0].kind == "array":  # members that are arrays themselves
        return Stack(len(ms), new_leaves[0], tuple(paths))
    if not node_stacked[g0_root(places)]:
        return Stack(len(ms), ms[0], tuple(paths))  # one object in every member
    member = _assemble(g0, new_leaves, ms[0], _outer_broadcast(g0, node_stacked), Places(g0))
    return Stack(len(ms), member, tuple(paths))


def _refuse_alike(places: list) -> None:
    """A Stack names its stacked places by keystr path (its layout, `tied.unstack`), so two places
    of a member written alike (an attribute named ``"b.c"`` and the attribute ``c`` of ``b``)
    would be taken for one: refused, naming the path."""
    seen: set[str] = set()
    for p in places:
        if p.path in seen:
            raise ValueError(
                f"tied.stack: two places of a member are both written {where(p.path)} (an attribute "
                "whose name holds a '.' or brackets, beside the nested place it spells), and a Stack "
                "names its stacked places by path. Rename that attribute before stacking."
            )
        seen.add(p.path)


def g0_root(places: list) -> int:
    return next(p.index for p in places if p.depth == 0)


def _cells_own_arrays(g0: GraphDef, places: list, node_stacked: list, leaf_stacked: list) -> None:
    """State is shared by cell, never by the array a cell holds: one array held by every
    member's own cell is stacked (each cell keeps its own state)."""
    cells = g0.state_nodes()
    for p in places:
        if p.kind == "array" and p.parent >= 0 and cells[p.parent] and node_stacked[p.parent]:
            leaf_stacked[p.index] = True
    for p in places:
        if p.kind == "array" and leaf_stacked[p.index] and p.parent >= 0 and not node_stacked[p.parent]:
            raise ValueError(
                f"tied.stack: the array at {where(p.path)} is held by a broadcast object and by "
                "each member's own state cell: give each cell its own array."
            )


def _views_follow_sources(g0: GraphDef, places: list, node_stacked: list, leaf_stacked: list) -> None:
    """A view whose sources are all broadcast is broadcast, even where each member holds its own
    view object: a gradient materialises views (an array at the view's place), and the layout
    must then say that array is the one for every member, never slice it per member."""
    for p in places:
        if p.kind != "view" or not node_stacked[p.index]:
            continue
        kids = g0.children(p.index)
        if not any(
            leaf_stacked[i] if k == "array" else k != "static" and node_stacked[i] for _, k, i in kids
        ):
            node_stacked[p.index] = False


def _views_over_stacked(places: list, node_stacked: list) -> None:
    """A view of each member's own array would be applied to the stacked array wherever the
    stack is read whole (a gradient materialises views): only `tied.transpose`, which reads
    the last two axes, gives the same there. Anything else is refused, never misread."""
    for p in places:
        if (
            p.kind == "view"
            and node_stacked[p.index]
            and not getattr(p.value, "maps_over_leading_axes", False)
        ):
            raise ValueError(
                f"tied.stack: the view at {where(p.path)} is each member's own view of its own array; "
                "a view other than tied.transpose cannot be stacked (its function would be applied to "
                "the stacked array). Hold the source array itself in the member and apply the function "
                "in the layer's code, or share one view in every member (broadcast)."
            )


def _stack_arrays(xs: list, path: str) -> Any:
    x0 = xs[0]
    for i, x in enumerate(xs[1:], 1):
        if x.shape != x0.shape or x.dtype != x0.dtype:
            raise ValueError(
                f"tied.stack: the array at {where(path)} has shape {tuple(x0.shape)} and dtype "
                f"{x0.dtype} in member 0 but shape {tuple(x.shape)} and dtype {x.dtype} in member "
                f"{i}: stacked arrays need one shape and dtype. Build every member alike."
            )
    return jnp.stack([jnp.asarray(x) for x in xs])


def unstack(s: Stack) -> list:
    """The ``n`` members of a `Stack`, each with the original structure.

    Member ``i`` holds slice ``i`` of every stacked array; broadcast objects are the
    same object (``is``) in every member and outside the stack. ``unstack(stack(ms))``
    equals ``ms`` in values, statics and tie pattern.

    Args:
        s: the `Stack` (a gradient's Stack too: its stacked gradients are sliced).

    Returns:
        A list of ``len(s)`` members.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> shared = jnp.zeros(2)
        >>> ms = tied.unstack(tied.stack([{"w": jnp.ones(2) * i, "b": shared} for i in range(2)]))
        >>> float(ms[1]["w"][0]), ms[0]["b"] is shared and ms[1]["b"] is shared
        (1.0, True)
    """
    leaves, gdef, leaf_stacked = layout(s)
    paths = set(s.stacked)
    node_stacked = _stacked_nodes(gdef, paths)
    places = _places(gdef)
    if places[0].kind == "array":
        return [leaves[0][i] for i in range(s.n)] if leaf_stacked[0] else [s.member] * s.n
    if not node_stacked[g0_root(places)]:
        return [s.member] * s.n
    outer = _outer_broadcast(gdef, node_stacked)
    seats = Places(gdef)
    return [
        _assemble(gdef, [x[i] if st else x for x, st in zip(leaves, leaf_stacked)], s.member, outer, seats)
        for i in range(s.n)
    ]


# ---------------------------------------------------------------- after surgery


def _renewed(old: Stack, new: Stack, at: str, how: str, outside: dict, enclosing: int, edited: set) -> Stack:
    """``new`` (``old`` after an edit of its member, its layout as it was) with its layout true:
    an array of the old member keeps its layout; a new array at a place that held a stacked array
    is stacked if it has the leading axis ``n`` and otherwise broadcast (one array for every member,
    as unstack, set, restack gives; `tied.map` refuses instead, since it maps the whole array); a
    new array at a broadcast place is broadcast; `tied.untie` gives each member its own copy (as
    untying every member's place gives); a new array at a new place is broadcast unless its leading
    axis is ``n`` (then which it is cannot be told: refused, naming the place). A node is stacked
    when anything below it is, or when it stands where a stacked node stood and the edit did not
    put it there (a member's own container stays its own). A stacked array also held outside the
    stack is refused. A new array of the old one's shape at its place keeps its layout; in a
    Stack inside another (``enclosing``), whose arrays carry the outer axes first, nothing else
    is read: refused."""
    n = new.n
    o_leaves, o_gdef, o_flags = layout(old)
    was = {id(x): f for x, f in zip(o_leaves, o_flags)}
    o_places = {p.path: p for p in _places(o_gdef)}
    leaves, gdef = flatten(new.member)
    places = _places(gdef)
    name = lambda rel: at + ".member" + rel  # noqa: E731 - the place as tied prints it
    flags: list = [None] * gdef.num_leaves
    tile = [False] * gdef.num_leaves
    for p in places:
        if p.kind != "array":
            continue
        x, q = leaves[p.index], p.index
        if id(x) in was:
            here = was[id(x)]
        elif id(x) in outside:
            here = False
        elif (
            (b := o_places.get(p.path)) is not None
            and b.kind == "array"
            and _same_shape(o_leaves[b.index], x)
        ):
            here = o_flags[b.index] if how != "untie" else True
            tile[q] = how == "untie" and not o_flags[b.index]
        elif enclosing:
            raise ValueError(
                f"{_who(how)}: {where(name(p.path))} is in a Stack inside another Stack, whose arrays carry "
                "the outer stack's axis first, so a new array there cannot be read. Edit through both: "
                "outer.map(lambda inner: inner.map(f))."
            )
        else:
            here = _new_array(x, n, b, set(old.stacked), how, name(p.path))
            if how == "untie" and not here:
                here = tile[q] = True
        if flags[q] is not None and flags[q] != here:
            raise ValueError(
                f"{_who(how)}: the new array at {where(name(p.path))} would be stacked at one of its places "
                "and broadcast at another. Edit each member with Stack.map instead."
            )
        flags[q] = here
        if here and id(x) in outside:
            raise ValueError(
                f"{_who(how)}: the stacked array at {where(name(p.path))} (one slice per member) would also "
                f"be held at {where(outside[id(x)])}, outside the stack. Tie places inside each member, "
                "or untie the outside place."
            )
    node_stacked = _node_layout(gdef, places, flags, tile, o_gdef, o_places, set(old.stacked), edited, name)
    _views_over_stacked(places, node_stacked)
    if any(tile):
        new_leaves = [jnp.stack([x] * n) if t else x for x, t in zip(leaves, tile)]
        member = rebuild(gdef, new_leaves, keep=(new.member, leaves))
    else:
        member = new.member
    paths = tuple(
        sorted(
            p.path
            for p in places
            if (p.kind == "array" and flags[p.index])
            or (p.kind not in ("array", "static") and node_stacked[p.index])
        )
    )
    if paths == new.stacked and member is new.member:
        return new
    return Stack(n, member, paths)


def _node_layout(
    gdef: GraphDef,
    places: list,
    flags: list,
    tile: list,
    o_gdef: GraphDef,
    o_places: dict,
    stacked: set,
    edited: set,
    name: Any,
) -> list[bool]:
    """Per node of the renewed member, whether it is stacked (`_renewed`); an array in a stacked
    state cell becomes stacked (``flags`` and ``tile`` updated)."""
    node_stacked = [False] * gdef.num_nodes
    o_nodes = _stacked_nodes(o_gdef, stacked)
    for p in places:  # a member's own container, edited inside, stays its own
        b = o_places.get(p.path)
        if p.kind not in ("array", "static") and name(p.path) not in edited and b is not None:
            node_stacked[p.index] |= b.kind not in ("array", "static") and o_nodes[b.index]
    open_nodes: list[int] = []
    for p in places:  # a node is stacked when anything below it is
        del open_nodes[p.depth :]
        if (p.kind == "array" and flags[p.index]) or (
            p.kind not in ("array", "static") and node_stacked[p.index]
        ):
            for j in open_nodes:
                node_stacked[j] = True
        if p.kind not in ("array", "static"):
            open_nodes.append(p.index)
    cells = gdef.state_nodes()
    for p in places:  # state is shared by cell: each member's own cell holds its own array
        if (
            p.kind == "array"
            and not flags[p.index]
            and p.parent >= 0
            and cells[p.parent]
            and node_stacked[p.parent]
        ):
            flags[p.index] = tile[p.index] = True
    return node_stacked


def _who(how: str) -> str:
    return f"tied.{how} under a tied.Stack"


def _new_array(x: Any, n: int, before: Any, stacked: set, how: str, at: str) -> bool:
    """Whether a new array of a Stack's member is stacked (`_renewed`'s rules)."""
    lead = _is_array(x) and x.ndim >= 1 and x.shape[0] == n
    if before is not None and before.kind == "array":
        if before.path not in stacked or how == "untie":
            return before.path in stacked
        if how == "map" and not lead:
            raise ValueError(
                f"tied.map: the stacked array at {where(at)} (leading axis {n}, one slice per member) came "
                f"back with shape {tuple(x.shape)}, without that axis. To change each member's arrays, map "
                "each member: stack.map(lambda m: tied.map(f, m))."
            )
        return lead
    if lead:
        raise ValueError(
            f"{_who(how)}: the new array at {where(at)} has shape {tuple(x.shape)}, whose leading axis is "
            f"the stack's length {n}: it could be one slice per member (stacked) or one array for every "
            "member (broadcast). Say which with Stack.map: stack.map(lambda m, g: <put g in m>, array) gives "
            "member i the slice array[i]; an array closed over in the function is one array for every member."
        )
    return False


def _keep_broadcast(s: Stack, outs: list) -> list:
    """``outs`` with each broadcast node of ``s`` put back where every member holds a copy of it
    with the very same arrays (the fresh copy a surgery makes): one object again, its ties kept."""
    leaves, gdef, flags = layout(s)
    node_stacked = _stacked_nodes(gdef, set(s.stacked))
    old = Places(gdef)
    flat = [flatten(o) for o in outs]
    if any(f[1] != flat[0][1] for f in flat):
        return outs  # tied.stack names the difference
    places = Places(flat[0][1])
    done: set[int] = set()
    for p in _places(gdef):
        if (
            p.kind in ("array", "static")
            or node_stacked[p.index]
            or p.index in done
            or p.path not in places.steps
        ):
            continue
        done.add(p.index)
        obj = get(s.member, old.steps[p.path], old)
        o_leaves, o_gdef = flatten(obj)
        steps = places.steps[p.path]
        for i, out in enumerate(outs):
            mine = get(out, steps, places)
            if mine is obj:
                continue
            m_leaves, m_gdef = flatten(mine)
            if m_gdef == o_gdef and all(a is b for a, b in zip(m_leaves, o_leaves)):
                outs[i] = put(out, steps, obj, places)
    return outs


def _same_shape(a: Any, b: Any) -> bool:
    return tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ()))
