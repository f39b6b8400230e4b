"""Writing into live models: new values at every place of a parameter, in the user's own objects.

Everything else in `tied` builds new objects. Two features write into the
objects the user holds: implicit mode (`tied.gradient` puts traced values at
every place of each parameter for the duration of a call, then the original
arrays back) and `tied.optim.update_inplace` (puts the updated arrays in for
good). Both go through `slots`, which finds every place of the chosen unique
arrays in the live model, from the `GraphDef` of a `flatten` of it, and refuses
a place that cannot be written, naming its path, before anything is written.
`recorded_writes` keeps what one `slots` run found as positions in the GraphDef (node
record, child), which the compiled write-back of `writeback.py` writes at on any later
model of the same structure once its generated code has checked that model (a place in a
tuple or inside a cell's value rebuilt as `slots` rebuilds it).

Threads. While tied writes into a model, other threads that read it directly
would see what is written: traced values during `tied.gradient`, a half-updated
tie during `update_inplace`. Every write happens under one re-entrant lock,
`live_lock` (public as ``tied.live_lock``, defined with the walk in `graph.py`). Every
reader in tied waits for it: each `flatten` takes it, so `tied.flatten`,
`tied.map`, `tied.save`, `tied.grad`, `tied.jit`, `tied.ties` and the rest see
whole writes only. A thread that reads a model with its own code (a forward
pass) while another may be writing into it takes it too::

    with tied.live_lock:
        y = model(x)      # never sees a traced value or a half-written tie

Re-entrant: ``fun`` in `tied.gradient` may itself take a gradient or read
`tied.params`. A lock per model is not enough, since two models may share a
layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .graph import KIND_BY_NAME, GraphDef, GraphError, Kind, flatten, live_lock, place_paths

__all__ = [
    "live_lock",
    "Slot",
    "slots",
    "recorded_writes",
    "write",
    "check_written",
]


class Slot:
    """One place of an array in a live model: the container object and the child's position.

    Calling a slot writes a value there (so a list of slots is a list of setters).
    """

    __slots__ = ("path", "_set", "_obj", "_kind", "_meta", "_i")

    def __init__(self, path: str, kind: Kind, meta: Any, obj: Any, i: int):
        self.path = path
        self._kind, self._meta, self._obj, self._i = kind, meta, obj, i
        self._set = kind.setter(meta, obj, i)

    def __call__(self, value: Any) -> None:
        self._set(value)

    def get(self, cache: dict | None = None) -> Any:
        """What the place holds now, or `CHANGED` if the container no longer has this
        child where it was (a key removed, a list shortened, a field deleted). ``cache``
        keeps each container's children for the slots that share it."""
        read = cache.get(id(self._obj)) if cache is not None else None
        if read is None:
            try:
                read = self._kind.children(self._obj)
            except Exception:
                read = ((), CHANGED)
            if cache is not None:
                cache[id(self._obj)] = read
        children, meta = read
        if meta is CHANGED or meta != self._meta or self._i >= len(children):
            return CHANGED
        return children[self._i]


class _Changed:
    def __repr__(self) -> str:
        return "<place changed>"


CHANGED = _Changed()


# ---------------------------------------------------------------- finding the places


def _is_frozen_dataclass(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def slots(
    model: Any,
    gdef: GraphDef,
    which: Sequence[int],
    *,
    action: str,
    frozen_ok: bool,
    rebuild: bool = False,
    _record: Any = None,
) -> list[list[Slot]]:
    """For each unique array index in ``which``, a `Slot` for every place of it in ``model``.

    ``gdef`` is the GraphDef of a `flatten` of ``model`` taken just before (under
    `live_lock`). Places are those of `GraphDef.walk_places`: every (container, child)
    pair, so a place below a shared node is one slot (writing it reaches all the
    node's places).

    With ``rebuild``, a place in a tuple or namedtuple (a view's sources) is written by
    putting a new tuple into the nearest containers that can be written, at every place
    of that tuple (one new tuple for all of them: a tie is kept), as eager code that
    assigns a new tuple does (`_RebuiltSlot`). Without it (`tied.gradient`, which must
    put back the very objects it found) such a place is refused.

    Raises:
        GraphError: before anything is written, naming the path of the first
            place that cannot be written: the model is a bare array; the place
            is in a tuple, namedtuple or JAX pytree node (an Equinox module); it
            is in a frozen dataclass (unless ``frozen_ok``); or its container is
            made anew each time the model is walked (a pytree whose flatten
            builds a list), so writing into it would not reach the model. With
            ``rebuild``, a tuple is refused only where one of its places (or that of a
            tuple holding it) is not in a container that can be written.
    """
    wanted = {q: n for n, q in enumerate(which)}
    out: list[list[Slot]] = [[] for _ in which]
    if not wanted:
        return out
    # Each place names its container (`Place.parent`); a node's children are visited at
    # its first place only, in order, so a counter per open node gives each position.
    opened: dict[int, _Open] = {}
    state = gdef.state_leaves()
    shared: list = []  # the nodes of two or more places, found when a cell's value is written
    holders: dict[int, list] = {}  # a tuple's index: (the node holding it, position) per place
    rebuilt: list = []  # the `_RebuiltSlot`s, checked once every place of their tuples is known
    for place in gdef.walk_places():
        if rebuild and place.kind in _REBUILT:
            parent = opened[place.parent] if place.parent >= 0 else None
            holders.setdefault(place.index, []).append((parent, parent.next if parent else -1, place.path))
        if place.parent < 0:
            obj, twin, node, pos = model, None, None, -1
            if place.kind == "array" and place.index in wanted:
                raise GraphError(
                    f"{action} writes new arrays into the model's containers, but the "
                    "model is a bare array. Hold it in a container (a list, dict or "
                    "registered class).",
                    "",
                )
        else:
            node = opened[place.parent]
            i = node.next
            node.next = i + 1
            obj = node.children[i]
            pos = i
            twin = node.twins[i] if node.twins is not None else None
            if place.kind == "array" and place.index in wanted:
                kind = node.kind
                slot: Any = None
                in_value = state[place.index] and not kind.is_state(node.meta)
                if not kind.can_write(node.meta) or in_value:
                    # Below a state cell's value: the cell gets a rebuilt value, so a container
                    # of the old value (a snapshot the caller kept) is never changed in place.
                    slot = _cell_slot(place, node, i, gdef, shared) if in_value else None
                    if slot is None and rebuild and kind.name in _REBUILT:
                        slot = _RebuiltSlot(place.path, node, i, holders)
                        rebuilt.append(slot)
                    if slot is None:
                        raise _immutable_error(place.path, kind, node.obj, action)
                elif not frozen_ok and _is_frozen_dataclass(node.obj):
                    raise _immutable_error(place.path, kind, node.obj, action)
                if node.twin is not None:
                    raise _transient_error(place.path, node.obj, action)
                if slot is None:
                    slot = Slot(place.path, kind, node.meta, node.obj, i)
                if _record is not None:
                    _record.append((wanted[place.index], place.parent, i, slot))
                out[wanted[place.index]].append(slot)
                continue
        if place.kind in ("array", "static") or not place.first:
            continue
        opened[place.index] = new = _Open(obj, KIND_BY_NAME[place.kind], twin, place, node)
        new.pos = pos
    checked: set[int] = set()
    for slot in rebuilt:
        _check_rebuilt(slot.path, slot._node, holders, checked, action, frozen_ok)
    if _record is not None:
        _record.append(opened)
    return out


_REBUILT = ("tuple", "namedtuple")  # immutable kinds that store their children: rebuilt when written


def _holds_in_place(node: _Open) -> bool:
    """Whether ``node`` (a holder of a rebuilt tuple) takes the new tuple in place."""
    return node.kind.name not in _REBUILT


class _RebuiltSlot:
    """A place in a tuple (or namedtuple) the model holds, written by putting a new tuple,
    with the new value at this position, into every place of the old one (tuples holding
    it are rebuilt in turn up to the containers that can be written): every place gets the
    one new tuple, so a tie is kept. Each write reads what the places hold now, so two
    writes into one tuple make one tuple with both values."""

    __slots__ = ("path", "_node", "_i", "_holders")

    def __init__(self, path: str, node: _Open, i: int, holders: dict):
        self.path, self._node, self._i, self._holders = path, node, i, holders

    def __call__(self, value: Any) -> None:
        _put(self._node, _with(self._node, _now(self._node, self._holders), self._i, value), self._holders)

    def get(self, cache: dict | None = None) -> Any:
        try:
            children, meta = self._node.kind.children(_now(self._node, self._holders))
        except Exception:
            return CHANGED
        if meta != self._node.meta or self._i >= len(children):
            return CHANGED
        return children[self._i]


def _now(node: _Open, holders: dict) -> Any:
    """What the first place of the tuple ``node`` holds now."""
    up, pos, _ = holders[node.place.index][0]
    held = up.obj if _holds_in_place(up) else _now(up, holders)
    return up.kind.children(held)[0][pos]


def _with(node: _Open, tup: Any, i: int, value: Any) -> Any:
    children = list(node.kind.children(tup)[0])
    children[i] = value
    return node.kind.make(node.meta, children)


def _put(node: _Open, new: Any, holders: dict) -> None:
    """Put the tuple ``new`` at every place of the tuple ``node``."""
    for up, pos, _ in holders[node.place.index]:
        if _holds_in_place(up):
            up.kind.setter(up.meta, up.obj, pos)(new)
        else:
            _put(up, _with(up, _now(up, holders), pos, new), holders)


def _check_rebuilt(path: str, node: _Open, holders: dict, checked: set, action: str, frozen_ok: bool) -> None:
    """Refuse, before anything is written, a tuple (at the array place ``path``) with a place
    that takes no new tuple: the model itself, a container that cannot be written, one made
    anew by each walk."""
    if node.place.index in checked:
        return
    if node.twin is not None:
        raise _transient_error(path, node.obj, action)
    for up, _, at in holders[node.place.index]:
        if up is None:
            raise _immutable_error(
                path, node.kind, node.obj, action, " held by no container that can be written"
            )
        if not _holds_in_place(up):
            _check_rebuilt(path, up, holders, checked, action, frozen_ok)
        elif not up.kind.can_write(up.meta) or (not frozen_ok and _is_frozen_dataclass(up.obj)):
            how = f" (this {node.kind.name} holds the array written at {path or '<root>'})"
            raise _immutable_error(at, up.kind, up.obj, action, how)
        elif up.twin is not None:
            raise _transient_error(at, up.obj, action)
    checked.add(node.place.index)


class _CellSlot:
    """A place inside the containers of a state cell's field (a tuple, a dict, ...): written by
    putting a rebuilt value into the cell's field (a cell's value is its own: a container of
    the old value, a snapshot the caller kept, is never changed), as eager code that assigns
    a new value to the cell leaves the old one as it was. Any state cell class alike."""

    __slots__ = ("path", "_kind", "_meta", "_cell", "_pos", "_steps")

    def __init__(self, path: str, cell: _Open, pos: int, steps: tuple):
        self.path = path
        self._kind, self._meta, self._cell, self._pos = cell.kind, cell.meta, cell.obj, pos
        self._steps = steps  # (kind, position) from the field's value down to the array's container

    def _field(self) -> Any:
        return self._kind.children(self._cell)[0][self._pos]

    def __call__(self, value: Any) -> None:
        self._kind.setter(self._meta, self._cell, self._pos)(_rebuilt(self._field(), self._steps, value))

    def get(self, cache: dict | None = None) -> Any:
        try:
            x = self._field()
            for kind, i in self._steps:
                x = kind.children(x)[0][i]
        except Exception:
            return CHANGED
        return x


def _rebuilt(x: Any, steps: tuple, value: Any) -> Any:
    """A copy of the containers along ``steps`` from ``x`` down, with ``value`` at the end."""
    if not steps:
        return value
    (kind, i), rest = steps[0], steps[1:]
    children, meta = kind.children(x)
    children = list(children)
    children[i] = _rebuilt(children[i], rest, value)
    if not kind.mutable:
        return kind.make(meta, children)
    new = kind.shell(meta)
    kind.fill(meta, new, children)
    return new


def _cell_slot(place: Any, node: _Open, i: int, gdef: GraphDef, shared: list) -> _CellSlot:
    """The `_CellSlot` of an array place below a state cell: child ``i`` of ``node``, a
    container of the cell's value. A container on the way that is held at another place
    too is refused: a rebuilt value would cut that tie."""
    way = [node]  # the containers, from the array's up to the cell's field
    while not way[-1].up.kind.is_state(way[-1].up.meta):
        way.append(way[-1].up)
    cell = way[-1].up
    if not cell.kind.can_write(cell.meta):
        return None  # the cell's own field cannot be set: refused as any such place
    if not shared:
        shared.append({j for j, paths in enumerate(place_paths(gdef).nodes) if len(paths) > 1})
    for inner in way:
        if inner.place.index in shared[0]:
            raise GraphError(
                f"{inner.place.path or '<root>'}: this container inside the state cell at "
                f"{cell.place.path or '<root>'} is also held at another place "
                f"({place_paths(gdef).nodes[inner.place.index][1] or '<root>'}); a state cell's "
                "value is rebuilt when it is written, which would cut that tie. Nothing was "
                "written. Give each cell a value of its own (state is shared by cell: share the "
                "cell itself)."
            )
    positions = [i] + [n.pos for n in way[:-1]]
    steps = tuple((n.kind, p) for n, p in zip(way, positions))
    return _CellSlot(place.path, cell, way[-1].pos, tuple(reversed(steps)))


class _Open:
    """A node whose children the walk is visiting: the live object and its live children.

    A kind that cannot be written may make its children on the fly (a pytree's
    flatten builds a list): a child that is not the same object when the children
    are asked for again is made anew, and so is anything below it that differs
    between the two copies. ``twin`` is the other copy of a node made anew (None
    for a node the model stores); ``twins[i]``, that of child i.
    """

    __slots__ = ("obj", "kind", "children", "meta", "next", "twin", "twins", "place", "up", "pos")

    def __init__(self, obj: Any, kind: Kind, twin: Any, place: Any = None, up: Any = None):
        self.obj, self.kind, self.twin, self.next = obj, kind, twin, 0
        self.place, self.up = place, up  # its own place, and the node holding it
        self.children, self.meta = kind.children(obj)
        self.twins = None
        if twin is not None:
            again = kind.children(twin)[0]
        elif not kind.can_write(self.meta):
            again = kind.children(obj)[0]
        else:
            return
        if len(again) != len(self.children):  # a flatten that changes its mind: all made anew
            again = [object()] * len(self.children)
        self.twins = [b if a is not b else None for a, b in zip(self.children, again)]


def _immutable_error(path: str, kind: Kind, obj: Any, action: str, how: str = "") -> GraphError:
    what = "frozen dataclass" if kind.writable else kind.name
    if action == "tied.gradient":
        fix = (
            "Use explicit mode, which needs no writing: g = tied.grad(lambda m: loss(m))(model), "
            "or hold the parameter in a mutable container (a list, dict, dataclass or a "
            "class given to tied.register)."
        )
    else:
        fix = (
            "Use tied.optim.update, which returns a new model with every tie kept, or hold the "
            "parameter in a mutable container (a list, dict, non-frozen dataclass or a class "
            "given to tied.register)."
        )
    return GraphError(
        f"{action} writes new arrays into the model's own containers, "
        f"but this place is in a {what} ({type(obj).__name__}){how}, which cannot be "
        f"changed in place. Nothing was written. {fix}",
        path,
    )


def _transient_error(path: str, obj: Any, action: str) -> GraphError:
    return GraphError(
        f"{action} writes new arrays into the model's own containers, "
        f"but the {type(obj).__name__} holding this parameter place is made anew each time "
        "the model is walked (the flatten of the JAX pytree node above it builds it), so a "
        "write into it would not reach the model. Nothing was written. Use tied.grad and "
        "tied.optim.update, which build a new model, or let the pytree's flatten return the "
        "container it stores.",
        path,
    )


# ---------------------------------------------------------------- the writes a plan makes


def recorded_writes(record: list) -> tuple | None:
    """The writes of one `slots` run (its ``_record``) as a compiled write-back makes them
    (`plans.compile_flatten(gdef, writes=...)`): ``(n, j, i)``, the n-th value put at child
    ``i`` of node record ``j``, for every place (a place in a tuple, or inside a state cell's
    value, written by rebuilding it, as `slots` does); the same for any later model of the
    GraphDef. None where a container on the way to a place (or to a place of a tuple rebuilt)
    is made anew by each walk or read through a call (a JAX pytree node): its children may
    not be the objects it stores, which only `slots` checks."""
    if not record:  # nothing wanted
        return ()
    opened = record.pop()
    writes = []
    seen: set[int] = set()

    def stored(j: int) -> bool:  # every node from ``j`` up to the root stores its children
        while j >= 0 and j not in seen:
            node = opened[j]
            if node.twin is not None or node.twins is not None and any(t is not None for t in node.twins):
                return False
            if not node.kind.stores_children and (not node.kind.writable or node.kind.fresh_children):
                return False
            seen.add(j)
            j = node.place.parent
        return True

    for n, j, i, slot in record:
        if not stored(j):
            return None
        if type(slot) is _RebuiltSlot:  # every place of the tuple, and of the tuples holding it
            tuples = [slot._node]
            while tuples:
                for up, _, _ in slot._holders[tuples.pop().place.index]:
                    if up is None or not stored(up.place.index):
                        return None
                    if not _holds_in_place(up):
                        tuples.append(up)
        writes.append((n, j, i))
    return tuple(writes)


# ---------------------------------------------------------------- writing


def write(places: list[list[Callable[[Any], None]]], values: Sequence[Any]) -> None:
    """Put ``values[n]`` at every place in ``places[n]``."""
    for at, v in zip(places, values):
        for set_place in at:
            set_place(v)


def check_written(model: Any, gdef: GraphDef, expected: list, places: list[list[Slot]], *, why: str) -> None:
    """Check that a walk of ``model`` now finds ``expected`` (by identity) with ``gdef``.

    For writes that every reader of the model must see. Raises a `GraphError`
    naming the first place that does not show what was written, followed by
    ``why`` (what that means to the caller).
    """
    leaves, now = flatten(model)
    if now == gdef and len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected)):
        return
    by_id = {id(x): k for k, x in enumerate(expected)}
    shown: dict[int, set[str]] = {}
    for x, paths in zip(leaves, now.leaf_paths()):
        k = by_id.get(id(x))
        if k is not None and expected[k] is x:
            shown.setdefault(k, set()).update(paths)
    cache: dict = {}
    for at in places:
        for slot in at:
            k = by_id.get(id(slot.get(cache)))
            if k is None or slot.path not in shown.get(k, ()):
                raise GraphError(why, slot.path)
    for k, (x, paths) in enumerate(zip(leaves, now.leaf_paths())):
        if k >= len(expected) or x is not expected[k]:
            raise GraphError(why, paths[0])
    raise GraphError(why, "")
