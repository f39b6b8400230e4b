"""The node kinds: every sort of container the walk enters, as one table.

A `Kind` says everything the core needs about one sort of node: its children
and the meta data that rebuilds it, the key of each child (a JAX key object,
`jax_key`, rendered as a keystr piece by `key` only at the edges), how to
rebuild it (``make``, or ``shell`` then ``fill`` for a mutable kind, so a
cycle can point back at it), how to read a tree that mirrors it (a gradient),
how to write one child of a live object, and the special cases as properties
(``fresh_children``, ``value_when_static``, ``materializes``, ``fields_in_dict``,
``is_state``). Records store a kind's index in `KINDS`; the index names below
are read from the table by name, so a new kind is one entry in `KINDS` (plus
its rule in `_classify`).

This module also holds the strict keys of static values (`_strict`) that make a
GraphDef depend only on the graph. It imports nothing of `tied` but `_view` and
`_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from .errors import Located
from .state import is_nnx_variable, is_state_type
from .strict import _strict
from .view import View
from .view import call as call_view

_registry = jax.tree_util.default_registry
_GetAttrKey = jax.tree_util.GetAttrKey
_DictKey = jax.tree_util.DictKey
_SequenceKey = jax.tree_util.SequenceKey
_slotted_dataclasses: set[type] = set()  # filled by `_classify`: dataclasses with __slots__


class GraphError(Located, TypeError):
    """A model that `tied` cannot walk or rebuild; the message names the path and the fix
    (``.path`` and ``.reason`` carry them apart, see `_core/errors.py`).

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> class Opaque:                             # not given to tied.register
        ...     pass
        >>> layer = Opaque()
        >>> layer.weight = jnp.ones(2)
        >>> try:
        ...     tied.flatten({"layer": layer})
        ... except tied.GraphError as e:
        ...     print(e)
        ['layer']: an object of unregistered class ...Opaque holds arrays, and tied would drop
        them as a static leaf. Register the class so tied walks it: decorate it with @tied.register, or
        call tied.register(Opaque) (a dataclass, an Equinox module or a JAX-registered pytree needs
        nothing).
    """


class _WalkError(Exception):
    """An error met in the walk; the walk adds the path before raising it."""

    def __init__(self, reason: str, exc_type: type = GraphError):
        self.reason = reason
        self.exc_type = exc_type

    def finish(self, path: str) -> Exception:
        return self.exc_type(self.reason, path)


class _Mismatch(Exception):
    """A mirror tree (a gradient) is not shaped like the node; carries what was expected."""

    def __init__(self, expected: str):
        self.expected = expected


# ---------------------------------------------------------------- node kinds
#
# Every container the walk enters is one `Kind`. Its special cases are properties
# here, read by the walk, the rebuild, the readers and the plans; no code outside
# this table asks which kind a node is to decide how to treat it (a compiled plan
# may add a faster emission for a kind, keyed on its index).


class Kind:
    """How the walk, the rebuild, the mirror reader and the plans treat one sort of node."""

    name = "node"
    index = -1  # its position in `KINDS` (what records store), set by the table
    mutable = False  # mutable kinds are built empty first and filled last (cycles)
    writable = False  # a child of a live object can be replaced in place
    fresh_children = False  # `children` builds new objects (kept alive through the walk)
    # Its children are the objects it stores, though it cannot be written in place (a tuple):
    # a compiled write-back may step through it, since the object at a position now is the one a walk finds.
    stores_children = False
    value_when_static = False  # holding only statics, it is a value: one record per place
    materializes = False  # `unflatten(..., materialize=True)` replaces it by `materialize`
    fields_in_dict = False  # children are exactly the ``__dict__`` values, in order
    counts_as_arrays = False  # an unwalkable holder of it holds arrays (a view's source)
    sequence_keys = False  # `jax_key` is `SequenceKey(i)` (its keystr made faster)
    may_be_state = True  # False: `is_state` is False whatever the meta (the walk skips asking)

    def children(self, x: Any) -> tuple[list, Any]:
        raise NotImplementedError

    def jax_key(self, meta: Any, i: int, n: int) -> Any:
        """The JAX key object of child ``i`` of ``n`` (`SequenceKey`, `DictKey`, `GetAttrKey`)."""
        return _SequenceKey(i)

    def key(self, meta: Any, i: int, n: int) -> str:
        """The keystr piece of child ``i``: `jax_key` rendered (a kind may say it faster)."""
        return f"[{i}]" if self.sequence_keys else str(self.jax_key(meta, i, n))

    def place_value(self, meta: Any) -> Any:
        """What `GraphDef.walk_places` reports as a node's ``value`` (a view's function)."""
        return None

    def materialize(self, meta: Any, children: list) -> Any:
        raise NotImplementedError

    def is_state(self, meta: Any) -> bool:
        """Whether the node is a state cell (the arrays below it are state): the unit of
        state sharing, read by the walk and by the write-back alike for every cell class."""
        return is_state_type(self.type_of(meta))

    # immutable kinds
    def make(self, meta: Any, children: list) -> Any:
        raise NotImplementedError

    # mutable kinds
    def shell(self, meta: Any) -> Any:
        raise NotImplementedError

    def fill(self, meta: Any, obj: Any, children: list) -> None:
        raise NotImplementedError

    def mirror(self, meta: Any, obj: Any, n: int) -> list:
        """The children of ``obj``, a tree shaped like this node (a gradient)."""
        return list(self.children(obj)[0])

    def setter(self, meta: Any, obj: Any, i: int) -> Callable[[Any], None]:
        raise NotImplementedError

    def can_write(self, meta: Any) -> bool:
        """Whether a child of a live node with this meta can be replaced in place."""
        return self.writable

    def user_static(self, meta: Any) -> Any:
        """The part of ``meta`` that is the user's own static data (a pytree's aux data),
        which must hold no arrays; None when the kind keeps none."""
        return None

    def type_of(self, meta: Any) -> type:
        return meta[0]

    def strict_meta(self, meta: Any) -> Any:
        """A key of ``meta`` equal only for metas that rebuild identically (see `_strict`)."""
        return _strict(meta)

    def __repr__(self) -> str:
        return f"<tied kind {self.name}>"


def _as_is(self: Kind, meta: Any) -> Any:
    return meta  # types compare by identity, names are str, lengths int: already strict


class _List(Kind):
    name, mutable, writable, sequence_keys = "list", True, True, True
    may_be_state = False

    def children(self, x):
        return list(x), None

    def shell(self, meta):
        return []

    def fill(self, meta, obj, children):
        obj.extend(children)

    def mirror(self, meta, obj, n):
        return _sequence(obj, n)

    def setter(self, meta, obj, i):
        return lambda v: obj.__setitem__(i, v)

    def type_of(self, meta):
        return list

    def is_state(self, meta):
        return False

    strict_meta = _as_is


def _sequence(obj: Any, n: int) -> list:
    children = list(obj)
    if len(children) != n:
        raise _Mismatch(f"a sequence of length {n}")
    return children


def _dict_keys(x: Any) -> tuple:
    try:
        return tuple(sorted(x))
    except TypeError:  # keys of mixed types: insertion order
        return tuple(x)


class _Dict(Kind):
    """A dict. Children in sorted key order (insertion order for keys that cannot be
    sorted), so leaf order does not depend on how the dict was built; meta is
    ``(keys, order)``, ``order`` the insertion order when it differs, so the rebuilt
    dict iterates as the model's did."""

    name, mutable, writable = "dict", True, True
    may_be_state = False

    def children(self, x):
        keys = _dict_keys(x)
        order = tuple(x)
        return [x[k] for k in keys], (keys, None if order == keys else order)

    def jax_key(self, meta, i, n):
        return _DictKey(meta[0][i])

    def key(self, meta, i, n):
        return f"[{meta[0][i]!r}]"

    def shell(self, meta):
        return {}

    def fill(self, meta, obj, children):
        keys, order = meta
        if order is None:
            obj.update(zip(keys, children))
        else:
            by_key = dict(zip(keys, children))
            obj.update((k, by_key[k]) for k in order)

    def mirror(self, meta, obj, n):
        return [obj[k] for k in meta[0]]

    def setter(self, meta, obj, i):
        key = meta[0][i]
        return lambda v: obj.__setitem__(key, v)

    def type_of(self, meta):
        return dict

    def is_state(self, meta):
        return False


class _Object(Kind):
    """A registered class (or a dataclass) whose instances keep their fields in ``__dict__``."""

    name, mutable, writable, fields_in_dict = "object", True, True, True

    def children(self, x):
        d = x.__dict__
        return list(d.values()), (type(x), tuple(d))

    def jax_key(self, meta, i, n):
        return _GetAttrKey(meta[1][i])

    def key(self, meta, i, n):
        return f".{meta[1][i]}"

    def shell(self, meta):
        return object.__new__(meta[0])

    def fill(self, meta, obj, children):
        obj.__dict__.update(zip(meta[1], children))

    def mirror(self, meta, obj, n):
        return [getattr(obj, name) for name in meta[1]]

    def setter(self, meta, obj, i):
        name, d = meta[1][i], obj.__dict__
        return lambda v: d.__setitem__(name, v)

    strict_meta = _as_is


def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for c in reversed(cls.__mro__):
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


_MISSING = object()


def _attribute_names(x: Any) -> tuple[str, ...]:
    """Fields of a registered class that uses ``__slots__``: the slots that are set (in
    class order), then the ``__dict__`` entries if it has one."""
    names = [n for n in _slot_names(type(x)) if getattr(x, n, _MISSING) is not _MISSING]
    d = getattr(x, "__dict__", None)
    if d:
        names.extend(k for k in d if k not in names)
    return tuple(names)


class _Slots(Kind):
    """A slotted dataclass (its fields), or a registered class with ``__slots__``."""

    name, mutable, writable = "dataclass", True, True

    def children(self, x):
        t = type(x)
        if t in _slotted_dataclasses:
            names = tuple(f.name for f in dataclasses.fields(x))
        else:
            names = _attribute_names(x)
        return [getattr(x, n) for n in names], (t, names)

    def jax_key(self, meta, i, n):
        return _GetAttrKey(meta[1][i])

    def shell(self, meta):
        return object.__new__(meta[0])

    def fill(self, meta, obj, children):
        for name, c in zip(meta[1], children):
            object.__setattr__(obj, name, c)

    def mirror(self, meta, obj, n):
        return [getattr(obj, name) for name in meta[1]]

    def setter(self, meta, obj, i):
        name = meta[1][i]
        return lambda v: object.__setattr__(obj, name, v)


class _ListSubclass(Kind):
    """A registered subclass of list: its items, then its ``__dict__`` fields."""

    name, mutable, writable = "list subclass", True, True

    def children(self, x):
        d = getattr(x, "__dict__", None) or {}
        items = list.__iter__(x)
        return [*items, *d.values()], (type(x), list.__len__(x), tuple(d))

    def jax_key(self, meta, i, n):
        return _SequenceKey(i) if i < meta[1] else _GetAttrKey(meta[2][i - meta[1]])

    def shell(self, meta):
        return list.__new__(meta[0])

    def fill(self, meta, obj, children):
        n = meta[1]
        list.extend(obj, children[:n])
        if meta[2]:
            obj.__dict__.update(zip(meta[2], children[n:]))

    def mirror(self, meta, obj, n):
        if isinstance(obj, list):
            d = getattr(obj, "__dict__", None) or {}
            return [*list.__iter__(obj), *(d[k] for k in meta[2])]
        return _sequence(obj, n)

    def setter(self, meta, obj, i):
        if i < meta[1]:
            return lambda v: list.__setitem__(obj, i, v)
        name, d = meta[2][i - meta[1]], obj.__dict__
        return lambda v: d.__setitem__(name, v)


class _DictSubclass(Kind):
    """A registered subclass of dict: its values (keys as for a dict), then its ``__dict__``."""

    name, mutable, writable = "dict subclass", True, True

    def children(self, x):
        keys = _dict_keys(dict.keys(x))
        order = tuple(dict.keys(x))
        d = getattr(x, "__dict__", None) or {}
        get = dict.__getitem__
        meta = (type(x), keys, tuple(d), None if order == keys else order)
        return [*(get(x, k) for k in keys), *d.values()], meta

    def jax_key(self, meta, i, n):
        keys = meta[1]
        return _DictKey(keys[i]) if i < len(keys) else _GetAttrKey(meta[2][i - len(keys)])

    def shell(self, meta):
        return dict.__new__(meta[0])

    def fill(self, meta, obj, children):
        _, keys, names, order = meta
        by_key = dict(zip(keys, children))
        dict.update(obj, ((k, by_key[k]) for k in (keys if order is None else order)))
        if names:
            obj.__dict__.update(zip(names, children[len(keys) :]))

    def mirror(self, meta, obj, n):
        d = getattr(obj, "__dict__", None) or {}
        return [*(obj[k] for k in meta[1]), *(d[k] if d else getattr(obj, k) for k in meta[2])]

    def setter(self, meta, obj, i):
        keys = meta[1]
        if i < len(keys):
            key = keys[i]
            return lambda v: dict.__setitem__(obj, key, v)
        name, d = meta[2][i - len(keys)], obj.__dict__
        return lambda v: d.__setitem__(name, v)


class _Tuple(Kind):
    name, value_when_static, sequence_keys = "tuple", True, True
    stores_children = True
    may_be_state = False

    def children(self, x):
        return list(x), len(x)

    def make(self, meta, children):
        return tuple(children)

    strict_meta = _as_is

    def mirror(self, meta, obj, n):
        return _sequence(obj, n)

    def type_of(self, meta):
        return tuple

    def is_state(self, meta):
        return False


class _NamedTuple(Kind):
    name, value_when_static = "namedtuple", True
    stores_children = True

    def children(self, x):
        return list(x), type(x)

    def jax_key(self, meta, i, n):
        return _GetAttrKey(meta._fields[i])

    def make(self, meta, children):
        return meta(*children)

    strict_meta = _as_is

    def mirror(self, meta, obj, n):
        return _sequence(obj, n)

    def type_of(self, meta):
        return meta


class _Pytree(Kind):
    """A node of JAX's pytree registry (an Equinox module, say): one level of its flatten."""

    name, fresh_children = "pytree", True  # its flatten may build its children anew

    def children(self, x):
        children, aux = _registry.flatten_one_level(x)
        return list(children), (type(x), aux)

    def jax_key(self, meta, i, n):
        return _pytree_keys(meta, n)[0][i]

    def key(self, meta, i, n):
        return _pytree_keys(meta, n)[1][i]

    def make(self, meta, children):
        return _pytree_def(meta, len(children)).unflatten(children)

    def mirror(self, meta, obj, n):
        children = list(_registry.flatten_one_level(obj)[0])
        if len(children) != n:
            raise _Mismatch(f"a {meta[0].__name__} with {n} children")
        return children

    def user_static(self, meta):
        return meta[1]

    def can_write(self, meta):
        return is_nnx_variable(meta[0])  # a Flax NNX Variable's value can be set in place

    def setter(self, meta, obj, i):
        set_value = getattr(obj, "set_value", None)
        if set_value is not None:
            return set_value
        return lambda v: setattr(obj, "value", v)


class _View(Kind):
    name, writable = "view", True  # its source slot can be replaced in a live view
    may_be_state = False
    materializes = counts_as_arrays = True

    def children(self, x):
        return [x.source], x.fn

    def jax_key(self, meta, i, n):
        return _GetAttrKey("source")

    def place_value(self, meta):
        return meta

    def materialize(self, meta, children):
        # Several sources are one tuple child (`fn(*sources)`). A function that reads its
        # array piece by piece (`fn.keeps_view`: an integer table's rows) stays a view.
        if getattr(meta, "keeps_view", False):
            return View(children[0], meta)
        return call_view(meta, children[0])

    def make(self, meta, children):
        return View(children[0], meta)

    def mirror(self, meta, obj, n):
        if type(obj) is not View:
            raise _Mismatch("a tied.View (the gradient of a view's source)")
        return [obj.source]

    def setter(self, meta, obj, i):
        return lambda v: object.__setattr__(obj, "source", v)

    def type_of(self, meta):
        return View

    def is_state(self, meta):
        return False


class _StateCell(_Object):
    """A `tied.State` cell: an object whose ``.value`` holds state (never a parameter)."""

    name = "state"

    def is_state(self, meta):
        return True


# The table. Records store the index (a small int, fast to compare and to hash). A new
# kind is one entry here and its rule in `_classify`; everything below is read from it.
KINDS: tuple[Kind, ...] = (
    _List(),
    _Dict(),
    _Object(),
    _Slots(),
    _ListSubclass(),
    _DictSubclass(),
    _Tuple(),
    _NamedTuple(),
    _Pytree(),
    _View(),
    _StateCell(),
)
for _k, _kind in enumerate(KINDS):
    _kind.index = _k
KIND_BY_NAME = {kind.name: kind for kind in KINDS}
_KIND_NAMES = tuple(kind.name for kind in KINDS)
_MUTABLE = frozenset(kind.index for kind in KINDS if kind.mutable)


def _index(name: str) -> int:
    return KIND_BY_NAME[name].index


# Index names for the kinds that the classifier, `register` and the plans' faster
# emissions name; read from the table, so they never go out of step with it.
LIST, DICT, OBJ, SLOTS = _index("list"), _index("dict"), _index("object"), _index("dataclass")
LISTSUB, DICTSUB, TUPLE = _index("list subclass"), _index("dict subclass"), _index("tuple")
NAMEDTUPLE, PYTREE, VIEW, STATE = _index("namedtuple"), _index("pytree"), _index("view"), _index("state")


_pytree_key_cache: dict = {}


def _pytree_keys(meta: Any, n: int) -> tuple[list, list[str]]:
    """Keys of a JAX-registered node's children (JAX key objects, and as keystr pieces),
    read from a stand-in rebuilt from meta."""
    try:
        return _pytree_key_cache[(meta, n)]
    except (KeyError, TypeError):
        pass
    keys: list = [_SequenceKey(i) for i in range(n)]
    try:
        stand_in = _pytree_def(meta, n).unflatten([0] * n)
        with_keys = _registry.flatten_one_level_with_keys(stand_in)
        if with_keys is not None and len(with_keys[0]) == n:
            keys = [k for k, _ in with_keys[0]]
    except Exception:  # a node that cannot be rebuilt around stand-ins: positional keys
        pass
    out = (keys, [jax.tree_util.keystr((k,)) for k in keys])
    try:
        _pytree_key_cache[(meta, n)] = out
    except TypeError:
        pass
    return out


_leaf_def = jax.tree_util.tree_structure(0)


def _pytree_def(meta: Any, n: int):
    return jax.tree_util.PyTreeDef.from_node_data_and_children(_registry, meta, [_leaf_def] * n)
