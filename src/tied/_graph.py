"""The core walk: structure, sharing and paths of an object graph.

This is the one place where sharing is decided. Everything else in `tied`
(gradients, jit, optimisers, checkpoints, inspection) goes through `flatten`,
`unflatten` and the named readers of a `GraphDef` defined here
(`GraphDef.walk_places`, `leaf_paths`, `node_paths`, `shared_node_paths`,
`views`, `place_leaves`, `expand`, `read_places`).

A graph is walked depth first. Every object met is one of:

* an *array* (``jax.Array``, ``numpy.ndarray``): a leaf, tracked by identity;
* a *node*: one of the kinds in the table `KINDS` (list, dict, registered object,
  slotted dataclass, list/dict subclass given to `register`, tuple, namedtuple,
  anything in JAX's pytree registry, `View`): tracked by identity, its children
  walked in order;
* a *static* (anything else): stored by value in the `GraphDef`, never tied; an
  object the walk cannot enter that holds arrays is an error, never dropped.

The `GraphDef` holds one record per unique node, in first-seen order; a record
refers to its children by reference numbers (leaf ``i`` -> ``3 * i``, node ``j``
-> ``3 * j + 1``, static ``k`` -> ``3 * k + 2``), so a shared object is simply a
number that occurs twice. That encoding is read in this module and in `_plan`
only. See ``src/tied/README.md`` for a map of the modules.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import os
import struct
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ._compat import is_pytree_node
from ._state import Rng, State, _state_types, is_state_type
from ._view import View

__all__ = [
    "GraphDef",
    "GraphError",
    "Place",
    "ViewInfo",
    "flatten",
    "is_state",
    "unflatten",
    "register",
    "ties",
]

_registry = jax.tree_util.default_registry


class GraphError(TypeError):
    """A model that `tied` cannot walk or rebuild; the message names the path and the fix.

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
    ``value`` the static's value or a view's function.
    """

    path: str
    depth: int
    kind: str
    index: int
    first: bool
    type: Any
    value: Any


# ---------------------------------------------------------------- node kinds
#
# Every container the walk enters is one `Kind`: how to get its children (and the
# meta data that rebuilds it), the keystr piece of each child, how to rebuild it, how
# to read a tree that mirrors it (a gradient), how to write one child of a live
# object, and what a compiled plan emits for it. Adding a kind is one entry here.


class Kind:
    """How the walk, the rebuild, the mirror reader and the plans treat one sort of node."""

    name = "node"
    mutable = False  # mutable kinds are built empty first and filled last (cycles)
    writable = False  # a child of a live object can be replaced in place

    def children(self, x: Any) -> tuple[list, Any]:
        raise NotImplementedError

    def key(self, meta: Any, i: int, n: int) -> str:
        return f"[{i}]"

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
    name, mutable, writable = "list", True, True

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

    def children(self, x):
        keys = _dict_keys(x)
        order = tuple(x)
        return [x[k] for k in keys], (keys, None if order == keys else order)

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


class _Object(Kind):
    """A registered class (or a dataclass) whose instances keep their fields in ``__dict__``."""

    name, mutable, writable = "object", True, True

    def children(self, x):
        d = x.__dict__
        return list(d.values()), (type(x), tuple(d))

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

    def key(self, meta, i, n):
        return f".{meta[1][i]}"

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

    def key(self, meta, i, n):
        return f"[{i}]" if i < meta[1] else f".{meta[2][i - meta[1]]}"

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

    def key(self, meta, i, n):
        keys = meta[1]
        return f"[{keys[i]!r}]" if i < len(keys) else f".{meta[2][i - len(keys)]}"

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
    name = "tuple"

    def children(self, x):
        return list(x), len(x)

    def make(self, meta, children):
        return tuple(children)

    strict_meta = _as_is

    def mirror(self, meta, obj, n):
        return _sequence(obj, n)

    def type_of(self, meta):
        return tuple


class _NamedTuple(Kind):
    name = "namedtuple"

    def children(self, x):
        return list(x), type(x)

    def key(self, meta, i, n):
        return f".{meta._fields[i]}"

    def make(self, meta, children):
        return meta(*children)

    strict_meta = _as_is

    def mirror(self, meta, obj, n):
        return _sequence(obj, n)

    def type_of(self, meta):
        return meta


class _Pytree(Kind):
    """A node of JAX's pytree registry (an Equinox module, say): one level of its flatten."""

    name = "pytree"

    def children(self, x):
        children, aux = _registry.flatten_one_level(x)
        return list(children), (type(x), aux)

    def key(self, meta, i, n):
        return _pytree_keys(meta, n)[i]

    def make(self, meta, children):
        return _pytree_def(meta, len(children)).unflatten(children)

    def mirror(self, meta, obj, n):
        children = list(_registry.flatten_one_level(obj)[0])
        if len(children) != n:
            raise _Mismatch(f"a {meta[0].__name__} with {n} children")
        return children


class _View(Kind):
    name, writable = "view", True  # its source slot can be replaced in a live view

    def children(self, x):
        return [x.source], x.fn

    def key(self, meta, i, n):
        return ".source"

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


class _Mismatch(Exception):
    """A mirror tree (a gradient) is not shaped like the node; carries what was expected."""

    def __init__(self, expected: str):
        self.expected = expected


# The table. Records store the index (a small int, fast to compare and to hash);
# mutable kinds come first.
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
)
LIST, DICT, OBJ, SLOTS, LISTSUB, DICTSUB, TUPLE, NAMEDTUPLE, PYTREE, VIEW = range(len(KINDS))
_MUTABLE = tuple(k for k, kind in enumerate(KINDS) if kind.mutable)
_KIND_NAMES = tuple(kind.name for kind in KINDS)
KIND_BY_NAME = {kind.name: kind for kind in KINDS}

# Classification of a type (cached): array, static, a node kind, or unknown.
_ARRAY, _STATIC, _UNKNOWN = "array", "static", "unknown"

_registered: dict[type, int] = {}  # class given to `register` -> its kind
_slotted_dataclasses: set[type] = set()
_array_types: set[type] = set()  # every array type met so far (compiled plans test against it)
_type_cache: dict[type, Any] = {}
_cache_lock = threading.Lock()


def _guard_message(cls: type) -> str:
    return (
        f"{cls.__module__}.{cls.__qualname__} is a tied node (given to tied.register), not a JAX "
        "pytree: walking it leaf by leaf would cut its ties (a shared array would become one "
        "copy per place). Use the tied way: tied.grad / tied.value_and_grad for gradients, "
        "tied.jit for jit, tied.map to map over its arrays, tied.optim.setup for an optax "
        "optimiser, or wrap it as tied.Graph(model) to hand it to any JAX function."
    )


class _Opaque:
    """Aux data standing for a whole tied node, equal only to itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Opaque and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _called_from_equinox_init() -> bool:
    """Equinox scans a module's constructor arguments with ``tree_leaves`` (for jitted
    functions stored as fields); a tied layer held by an Equinox module must pass that
    scan, so there it is one leafless node. Every other JAX call is refused."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_name == "__call__" and f.f_code.co_filename.endswith(_EQX_MODULE_FILE):
            return True
        f = f.f_back
    return False


_EQX_MODULE_FILE = os.path.join("equinox", "_module", "_module.py")


def _refuse_jax_flatten(cls: type) -> None:
    """Make JAX's pytree functions (tree_map, jit, grad, vmap, optax's init) refuse ``cls``
    with a message naming the tied way, instead of treating it as an opaque leaf."""
    if is_pytree_node(cls):
        return  # already a JAX pytree (registered by its author): leave JAX's rule alone

    def refuse(x):
        if _called_from_equinox_init():
            return (), _Opaque(x)
        raise TypeError(_guard_message(cls))

    def refuse_unflatten(_aux, _children):
        raise TypeError(_guard_message(cls))

    try:
        jax.tree_util.register_pytree_node(cls, refuse, refuse_unflatten)
    except ValueError:  # registered meanwhile by another thread
        pass


def register(cls: type) -> type:
    """Let `tied` walk instances of a plain Python class: its fields are its children.

    Fields are the ``__dict__`` entries in assignment order (and the ``__slots__``
    that are set, for a class that uses slots). Instances are rebuilt without
    calling ``__init__`` (``object.__new__`` and the fields put back), so any
    constructor signature works. A subclass of ``list`` or ``dict`` is walked
    through its items and then its ``__dict__`` fields. Usable as a class
    decorator. JAX's pytree registry, dataclasses and Equinox modules need no
    registration.

    A registered class is a `tied` node, not a JAX pytree: plain JAX functions
    (``jax.tree_util.tree_map``, ``jax.jit``, ``jax.grad``, an optax ``init``)
    refuse it with a `TypeError` naming the tied way (`tied.grad`, `tied.jit`,
    `tied.map`, ``tied.Graph(model)``), since walking it leaf by leaf would cut
    its ties.

    Args:
        cls: the class to walk.

    Returns:
        ``cls`` itself.

    Raises:
        TypeError: ``cls`` is not a class, or is a kind of object `tied` cannot
            rebuild (a tuple subclass other than a namedtuple, a set, a deque).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> @tied.register
        ... class Dense:
        ...     def __init__(self, weight, bias):
        ...         self.weight, self.bias = weight, bias
        ...     def __call__(self, x):
        ...         return x @ self.weight.T + self.bias
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> d2 = Dense(d1.weight, d1.bias)                      # tied by reference
        >>> tied.ties([d1, d2])
        [('[0].weight', '[1].weight'), ('[0].bias', '[1].bias')]

        Plain JAX refuses it rather than cut the tie:

        >>> try:
        ...     jax.tree_util.tree_leaves([d1, d2])
        ... except TypeError as e:
        ...     print("tied.grad" in str(e), "tied.Graph(model)" in str(e))
        True True
    """
    if not isinstance(cls, type):
        raise TypeError(f"tied.register expects a class, got {cls!r}.")
    name = cls.__qualname__
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return cls  # a namedtuple: walked as one already
    if issubclass(cls, list):
        kind = LISTSUB
    elif issubclass(cls, dict):
        kind = DICTSUB
    elif issubclass(cls, (tuple, set, frozenset, collections.deque, str, bytes)):
        base = next(b for b in cls.__mro__[1:] if b in (tuple, set, frozenset, collections.deque, str, bytes))
        raise TypeError(
            f"tied.register({name}): a subclass of {base.__name__} cannot be rebuilt from its "
            "fields by tied. Hold the arrays in a list, a dict, a namedtuple or a plain "
            "registered class instead."
        )
    else:
        kind = SLOTS if _slot_names(cls) else OBJ
    with _cache_lock:
        _registered[cls] = kind
        _type_cache.clear()
        for cache in _plan_caches:
            cache.clear()
    _refuse_jax_flatten(cls)
    return cls


def is_walkable_type(t: type) -> bool:
    """Whether the walk enters instances of ``t`` as nodes without registration."""
    return (
        t in _registered
        or t is View
        or t in (list, dict, tuple)
        or is_pytree_node(t)
        or dataclasses.is_dataclass(t)
    )


def clear_caches() -> None:
    """Forget every classification and compiled plan (a class's meaning changed)."""
    with _cache_lock:
        _type_cache.clear()
        _seen_once.clear()
        for cache in _plan_caches:
            cache.clear()


_STATIC_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.ModuleType,
    np.dtype,
    np.generic,
    type(jax.numpy.tanh),  # jitted functions such as jnp.tanh
    type(jax.nn.relu),  # custom_jvp functions such as jax.nn.relu
    type(Ellipsis),
    range,
    slice,
)


def _classify(x: Any) -> Any:
    t = type(x)
    k = _registered.get(t)
    if k is not None:
        return k
    if t is View:
        return VIEW
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):  # an abstract array too
        return _ARRAY
    if isinstance(x, _STATIC_TYPES) and not isinstance(x, (list, tuple, dict)):
        return _STATIC
    if t is list:
        return LIST
    if t is tuple:
        return TUPLE
    if t is dict:
        return DICT
    if isinstance(x, tuple) and hasattr(t, "_fields") and is_pytree_node(t):
        return NAMEDTUPLE
    if is_pytree_node(t):
        return PYTREE
    if dataclasses.is_dataclass(t):
        if hasattr(x, "__dict__"):
            return OBJ
        _slotted_dataclasses.add(t)
        return SLOTS
    return _UNKNOWN


def _kind(x: Any) -> Any:
    t = type(x)
    k = _type_cache.get(t)
    if k is None:
        k = _classify(x)
        if k is not _UNKNOWN:
            _type_cache[t] = k
        if k is _ARRAY:
            _array_types.add(t)
    return k


# ---------------------------------------------------------------- unwalkable objects


def _held(x: Any) -> list:
    """What an object that the walk does not enter holds, as far as can be seen without
    running user code: ``__dict__`` values, set slots, and the items of a container."""
    out: list = []
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict):
        out.extend(d.values())
    for name in _slot_names(type(x)):
        v = getattr(x, name, _MISSING)
        if v is not _MISSING:
            out.append(v)
    if isinstance(x, (list, tuple, set, frozenset, collections.deque)):
        out.extend(x)
    elif isinstance(x, dict):
        out.extend(x.values())
    return out


def _has_arrays(obj: Any) -> bool:
    """Whether arrays sit anywhere below an unwalkable object, looking through the nodes
    and the fields of unregistered objects it holds (a registered layer inside an
    unregistered wrapper too). Iterative and identity-memoised, so cycles end."""
    seen: dict[int, Any] = {}  # id -> object, held so that ids stay unique
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen[id(x)] = x
        k = _kind(x)
        if k is _ARRAY or k == VIEW:
            return True
        if k is _STATIC:
            continue
        if k is _UNKNOWN:
            stack.extend(_held(x))
        else:
            stack.extend(KINDS[k].children(x)[0])
    return False


def _unknown_static(x: Any) -> None:
    if not _has_arrays(x):
        return
    cls = type(x)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(x, (list, dict)):
        base = "list" if isinstance(x, list) else "dict"
        fix = (
            f"it subclasses {base}: decorate it with @tied.register (tied then walks its items "
            f"and its fields), or hold a plain {base}."
        )
    elif isinstance(x, (set, frozenset, collections.deque, tuple)):
        fix = (
            f"a {cls.__name__} cannot be walked in a stable order or rebuilt by tied: hold the "
            "arrays in a list, a tuple, a dict or a namedtuple instead."
        )
    else:
        fix = (
            f"decorate it with @tied.register, or call tied.register({cls.__qualname__}) "
            "(a dataclass, an Equinox module or a JAX-registered pytree needs nothing)."
        )

    def message(path: str) -> str:
        return (
            f"{path}: an object of unregistered class {name} holds arrays, and tied would "
            f"drop them as a static leaf. Register the class so tied walks it: {fix}"
        )

    raise _WalkError(message)


class _WalkError(Exception):
    """An error met in the walk; the walk adds the path before raising it."""

    def __init__(self, make_message: Callable[[str], str], exc_type: type = GraphError):
        self.make_message = make_message
        self.exc_type = exc_type

    def finish(self, path: str) -> Exception:
        return self.exc_type(self.make_message(path or "<root>"))


_pytree_key_cache: dict = {}


def _pytree_keys(meta: Any, n: int) -> list[str]:
    """Keys of a JAX-registered node's children, read from a stand-in rebuilt from meta."""
    try:
        return _pytree_key_cache[(meta, n)]
    except (KeyError, TypeError):
        pass
    keys = [f"[{i}]" for i in range(n)]
    try:
        stand_in = _pytree_def(meta, n).unflatten([0] * n)
        with_keys = _registry.flatten_one_level_with_keys(stand_in)
        if with_keys is not None and len(with_keys[0]) == n:
            keys = [jax.tree_util.keystr((k,)) for k, _ in with_keys[0]]
    except Exception:  # a node that cannot be rebuilt around stand-ins: positional keys
        pass
    try:
        _pytree_key_cache[(meta, n)] = keys
    except TypeError:
        pass
    return keys


_leaf_def = jax.tree_util.tree_structure(0)


def _pytree_def(meta: Any, n: int):
    return jax.tree_util.PyTreeDef.from_node_data_and_children(_registry, meta, [_leaf_def] * n)


# ---------------------------------------------------------------- strict equality of statics


def _strict(v: Any) -> Any:
    """A key that is equal only for values that rebuild identically: the type and, for
    numbers, the bits (``-0.0`` differs from ``0.0``, ``1.0`` from ``1``, a NaN equals
    itself). Tuples are compared element by element."""
    t = type(v)
    if t is str or t is int or v is None or t is bool:
        return (t, v)
    if t is float:
        return (t, _pack_d(v))
    if t is tuple:
        return (t, tuple(map(_strict, v)))
    if t is complex:
        return (t, _pack_d(v.real), _pack_d(v.imag))
    if isinstance(v, np.generic):
        return (t, v.tobytes())
    return (t, v)


_pack_d = struct.Struct("<d").pack


def _same_strict(a: Any, b: Any, strict_b: Any) -> bool:
    """Whether ``a`` rebuilds as ``b`` does (``strict_b`` is ``_strict(b)``): at once when
    it is ``b`` or a tuple of the very objects of ``b`` (a pytree's aux data made anew on
    each flatten, say), else by comparing strict keys."""
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) and all(map(operator.is_, a, b)):
        return True
    return _strict(a) == strict_b


# ---------------------------------------------------------------- the GraphDef


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

    __slots__ = ("records", "statics", "root", "num_leaves", "_hash", "_k", "_plans", "_places", "_expanded")

    def __init__(self, records: tuple, statics: tuple, root: int, num_leaves: int):
        self.records = records  # tuple of (kind, meta, child_refs) in first-seen order
        self.statics = statics  # static leaves, by value
        self.root = root
        self.num_leaves = num_leaves
        self._hash: int | None = None
        self._k: Any = None
        self._plans: dict = {}  # compiled rebuild plans and orders, see _plan.py
        self._places: Any = None
        self._expanded: Any = None

    @property
    def num_nodes(self) -> int:
        return len(self.records)

    def _key(self):
        k = self._k
        if k is None:
            k = self._k = (
                self.root,
                self.num_leaves,
                tuple((kind, KINDS[kind].strict_meta(meta), refs) for kind, meta, refs in self.records),
                tuple(map(_strict, self.statics)),
            )
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
                    f"{paths.statics[k] or '<root>'}: static field of type {type(s).__name__} is not "
                    "hashable, but tied.jit and tied.Graph key their cache on static fields. Make it "
                    "hashable (a tuple instead of a list, a frozen dataclass), or hold it as an "
                    "array if it is data."
                )
        return GraphError("a node's static metadata is not hashable; tied.jit needs it hashable.")

    def __repr__(self) -> str:
        return f"GraphDef(num_leaves={self.num_leaves}, num_nodes={self.num_nodes})"

    # ------------------------------------------------ what the layers above may read
    # Everything outside the core reads a GraphDef through these names only.

    def walk_places(self, *, expand_shared: bool = False, cut_cycles: bool = False) -> Iterator[Place]:
        """Every place of the graph in walk order (depth first, children in order).

        By default a shared node's children are visited under its first place
        only (its later places are yielded with ``first=False``); with
        ``expand_shared=True`` they are visited at every place, as in a tree
        (a reference cycle is then a `GraphError`, or with ``cut_cycles`` a reference back
        to a node entered above is yielded but not followed).
        """
        for path, depth, r, first, _, _ in _traverse(self, expand_shared, cut_cycles):
            q, m = divmod(r, 3)
            if m == 0:
                yield Place(path, depth, "array", q, first, None, None)
            elif m == 2:
                yield Place(path, depth, "static", q, True, None, self.statics[q])
            else:
                kind, meta, _ = self.records[q]
                value = meta if kind == VIEW else None
                yield Place(path, depth, KINDS[kind].name, q, first, KINDS[kind].type_of(meta), value)

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
                q, m = divmod(refs[0], 3)
                if m == 0:
                    source, leaf = places.leaves[q][0], q
                elif m == 1:
                    source, leaf = places.nodes[q][0], None
                else:
                    source, leaf = None, None
                out.append(ViewInfo(tuple(places.nodes[j]), meta, source, leaf))
        return out

    def expand(self) -> tuple[GraphDef, tuple[int, ...]]:
        """The graph unrolled into a tree: one node or leaf per *place*, no sharing left.

        Returns the tree's GraphDef and, for each of its leaves (one per array place, in
        walk order), the index of the unique array that stands there. ``tied.unflatten(
        tree_def, [leaves[i] for i in place_leaf])`` builds the model as a plain pytree
        holds it: every place its own container (a reference cycle is a `GraphError`).

        Examples:
            >>> import jax.numpy as jnp, tied
            >>> w = jnp.ones(2)
            >>> leaves, gdef = tied.flatten({"a": w, "b": w})
            >>> tree_def, place_leaf = gdef.expand()
            >>> place_leaf, tree_def.num_leaves
            ((0, 0), 2)
        """
        return expand(self)

    def place_leaves(self) -> tuple[tuple[str, int], ...]:
        """Every array *place* in walk order (a tie counted at each of its places), as
        ``(path, unique leaf index)``; places below a shared node are listed at every
        place of that node. On a reference cycle, a reference back to a node entered
        above is not followed again (the cycle's places are listed once round)."""
        out = self._plans.get("place leaves")
        if out is None:
            out = self._plans["place leaves"] = tuple(
                (path, r // 3) for path, _, r, _, _, _ in _traverse(self, True, True) if r % 3 == 0
            )
        return out


    def state_leaves(self) -> tuple[bool, ...]:
        """For each unique array (in `flatten` order), whether it is *state*: it sits below
        a state cell (`tied.State`, a class given to `tied.register_state`, a Flax NNX
        ``Variable`` that is not a ``Param``). State is never a parameter.

        Raises:
            GraphError: one array is both state (below a cell) and held at a place
                outside every cell; the message names both places.
        """
        out = self._plans.get("state leaves")
        if out is None:
            out = self._plans["state leaves"] = _state_leaves(self)
        return out

    def state_nodes(self) -> tuple[bool, ...]:
        """For each node (in `walk_places` index order), whether it is a state cell."""
        out = self._plans.get("state nodes")
        if out is None:
            out = self._plans["state nodes"] = tuple(
                is_state_type(KINDS[kind].type_of(meta)) if kind not in (TUPLE, LIST, DICT) else False
                for kind, meta, _ in self.records
            )
        return out


def _state_leaves(gdef: GraphDef) -> tuple[bool, ...]:
    cells = gdef.state_nodes()
    if not any(cells):
        return (False,) * gdef.num_leaves
    state: list[Any] = [None] * gdef.num_leaves  # None: not met; else (is state, first path)
    inside: list[bool] = []  # by depth: whether the node open at that depth is in a cell
    for path, depth, r, _, _, _ in _traverse(gdef, True, True):
        del inside[depth:]
        q, m = divmod(r, 3)
        above = inside[depth - 1] if depth else False
        if m == 1:
            inside.append(above or cells[q])
        elif m == 0:
            seen = state[q]
            if seen is None:
                state[q] = (above, path)
            elif seen[0] != above:
                s, p = (seen[1], path) if seen[0] else (path, seen[1])
                raise GraphError(
                    f"{p or '<root>'} and {s or '<root>'}: one array is both a parameter place and "
                    f"a state place (below a state cell at {s or '<root>'}). State changes when "
                    "the model runs and is never trained, so the two cannot be one object: give the "
                    "state its own array (e.g. jnp.array(x) copies it)."
                )
    return tuple(bool(s and s[0]) for s in state)


def is_state(tree: Any, path: str) -> bool:
    """Whether ``path`` is a state place of ``tree``: a state cell, or a place below one.

    Args:
        tree: the model.
        path: a keystr path (``".bn.running_mean.value"``), ``""`` for the root.

    Returns:
        True for a state cell's place and every place below it.

    Raises:
        KeyError: ``path`` is no place of ``tree``.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> bn = tied.nn.BatchNorm(3)
        >>> tied.is_state(bn, ".running_mean.value"), tied.is_state(bn, ".weight")
        (True, False)
    """
    _, gdef = flatten(tree)
    cells = gdef.state_nodes()
    inside: list[bool] = []
    for place in gdef.walk_places(expand_shared=True, cut_cycles=True):
        del inside[place.depth :]
        above = inside[place.depth - 1] if place.depth else False
        here = above or (place.kind not in ("array", "static") and cells[place.index])
        if place.kind not in ("array", "static"):
            inside.append(here)
        if place.path == path:
            return here
    raise KeyError(f"tied.is_state: {path!r} is no place of the model.")


# ---------------------------------------------------------------- flatten


def flatten(tree: Any) -> tuple[list, GraphDef]:
    """Split an object graph into its unique arrays and its structure.

    The result depends only on the graph given, never on what was flattened
    before: leaves come in the walk's order (a registered object's fields in
    assignment order, a dict's keys sorted when they can be), and static leaves
    are recorded as they are (type and bits).

    Args:
        tree: any object graph: containers, dataclasses, JAX pytrees (Equinox
            modules too), classes given to `tied.register`; it may share arrays
            and nodes and may hold reference cycles through mutable containers.

    Returns:
        ``(leaves, graphdef)``: every array leaf (any dtype) exactly once, in
        first-seen depth-first order however many places hold it, and the
        `GraphDef` recording structure, static leaves and sharing.

    Raises:
        GraphError: an object the walk cannot enter holds arrays, or a reference
            cycle passes through an immutable node; the message names the path.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> d2 = Dense(d1.weight, d1.bias)
        >>> leaves, gdef = tied.flatten([d1, d2])
        >>> len(leaves), leaves[0] is d1.weight    # weight and bias, once each
        (2, True)
        >>> gdef.leaf_paths()                      # every place of each
        (('[0].weight', '[1].weight'), ('[0].bias', '[1].bias'))
    """
    return flatten_with(tree, _flatten_plans)


class PlanCache(dict):
    """Compiled flatten plans by root type, most recent first. `flatten` shares one;
    `tied.jit` keeps one per function, so that busy programs do not evict its plans."""

    __hash__ = object.__hash__  # by identity, to live in a WeakSet
    __eq__ = object.__eq__


_plan_caches: weakref.WeakSet = weakref.WeakSet()  # cleared when a class is registered


def plan_cache() -> PlanCache:
    cache = PlanCache()
    _plan_caches.add(cache)
    return cache


_flatten_plans = plan_cache()

# With TIED_CHECK_PLANS=1 (the test suite sets it), every compiled plan's result is
# compared with the plain walk's, and a plan that gives up must be right to.
CHECK_PLANS = os.environ.get("TIED_CHECK_PLANS", "") not in ("", "0")


class PlanMismatch(AssertionError):
    """A compiled plan disagreed with the plain walk (a bug in tied; please report it)."""


def flatten_with(tree: Any, cache: PlanCache) -> tuple[list, GraphDef]:
    """`flatten`, trying the compiled plans of ``cache`` first (see _plan.py)."""
    plans = cache.get(type(tree))
    if plans:
        for gdef, plan in plans:
            leaves = plan(tree)
            if leaves is not None:
                if CHECK_PLANS:
                    _check_plan_hit(tree, leaves, gdef)
                return leaves, gdef
    leaves, gdef = _walk(tree)
    if CHECK_PLANS and plans:
        for pgdef, plan in plans:
            # A first sighting of an array type (a tracer's, say) is a fair miss: the walk
            # has just classified it, so the plan must hit now.
            if pgdef == gdef and plan(tree) is None:
                raise PlanMismatch(
                    f"a compiled flatten plan gave up on a graph of its own structure ({gdef}): "
                    f"{_why_plan_missed(plan, tree)}"
                )
    return leaves, _maybe_plan(tree, gdef, cache)


def _why_plan_missed(plan: Any, tree: Any) -> str:
    import traceback

    try:
        plan.__globals__["plan"](tree)
    except Exception as e:
        return "".join(traceback.format_exception(e)[-3:]) + "\n" + plan.__tied_source__
    return "it did not miss when run again"


def _check_plan_hit(tree: Any, leaves: list, gdef: GraphDef) -> None:
    wl, wg = _walk(tree)
    if not (wg == gdef and len(wl) == len(leaves) and all(a is b for a, b in zip(wl, leaves))):
        raise PlanMismatch(f"a compiled flatten plan disagrees with the walk: {gdef} vs {wg}")


# A structure gets a plan the second time the walk meets it; `_seen_once` also
# interns GraphDefs, so equal structures give the very same GraphDef object.
_seen_once: dict[GraphDef, GraphDef] = {}
_MAX_PLANS_PER_TYPE = 8


def _maybe_plan(tree: Any, gdef: GraphDef, cache: PlanCache) -> GraphDef:
    """Count a sighting of ``gdef``; on the second, compile its plan. Returns the
    first-seen equal GraphDef, so that caches keyed on it compare by identity."""
    from ._plan import compile_flatten

    try:
        first = _seen_once.get(gdef)
    except GraphError:  # unhashable static: no plan, the walk stays in charge
        return gdef
    if first is None:
        with _cache_lock:
            if len(_seen_once) > 1024:
                _seen_once.clear()
            _seen_once[gdef] = gdef
        return gdef
    if first._plans.get("no flatten plan"):
        return first
    plan = compile_flatten(first)
    if plan is None:  # none can be made: never try again for this structure
        first._plans["no flatten plan"] = True
    else:
        with _cache_lock:
            _seen_once.pop(first, None)
            old = cache.get(type(tree), ())
            cache[type(tree)] = ((first, plan),) + old[: _MAX_PLANS_PER_TYPE - 1]
    return first


def _walk(tree: Any) -> tuple[list, GraphDef]:
    """The plain walk, iterative (any depth): the one place where sharing is decided."""
    leaves: list = []
    records: list = []
    statics: list = []
    memo: dict[int, int] = {}
    open_immutable: set[int] = set()
    # Children made on the fly by a pytree's flatten are held here: once freed, their
    # ids could be reused by later objects and read as sharing through `memo`.
    alive: list = []
    kind_of = _kind
    get = memo.get
    # A frame: [record index, kind, meta, children, next child, refs so far].
    stack: list[list] = []

    def enter(x: Any) -> int | None:
        """The reference of ``x`` if it is finished at once, else None (a frame was pushed)."""
        k = kind_of(x)
        if k is _ARRAY:
            r = get(id(x))
            if r is None:
                r = 3 * len(leaves)
                memo[id(x)] = r
                leaves.append(x)
            return r
        if k is _STATIC or k is _UNKNOWN:
            if k is _UNKNOWN:
                _unknown_static(x)
            statics.append(x)
            return 3 * len(statics) - 1
        if (k == TUPLE or k == NAMEDTUPLE) and all(kind_of(c) is _STATIC for c in x):
            # A tuple of static values is a value: Python reuses such tuples (`()`,
            # constants), so their identity says nothing. One record per place.
            j = len(records)
            refs = []
            for c in x:
                statics.append(c)
                refs.append(3 * len(statics) - 1)
            records.append((k, KINDS[k].children(x)[1], tuple(refs)))
            return 3 * j + 1
        r = get(id(x))
        if r is not None:
            if r in open_immutable:
                _cycle_error(k)
            return r
        j = len(records)
        r = 3 * j + 1
        memo[id(x)] = r
        records.append(None)
        children, meta = KINDS[k].children(x)
        if k == PYTREE:
            alive.append(children)
        if k not in _MUTABLE:
            open_immutable.add(r)
        stack.append([j, k, meta, children, 0, []])
        return None

    try:
        result = enter(tree)
        while stack:
            frame = stack[-1]
            children, i = frame[3], frame[4]
            if i < len(children):
                frame[4] = i + 1
                r = enter(children[i])
                if r is not None:
                    frame[5].append(r)
                continue
            stack.pop()
            j, k, meta, _, _, refs = frame
            records[j] = (k, meta, tuple(refs))
            r = 3 * j + 1
            if k not in _MUTABLE:
                open_immutable.discard(r)
            if stack:
                stack[-1][5].append(r)
            else:
                result = r
    except _WalkError as e:
        path = "".join(KINDS[f[1]].key(f[2], f[4] - 1, len(f[3])) for f in stack)
        raise e.finish(path) from None
    return leaves, GraphDef(tuple(records), tuple(statics), result, len(leaves))


def untracked(record: tuple) -> bool:
    """Whether a node record stands for one place only: a tuple of static values."""
    kind, _, refs = record
    return (kind == TUPLE or kind == NAMEDTUPLE) and all(r % 3 == 2 for r in refs)


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _cycle_error(kind: int) -> None:
    name = _KIND_NAMES[kind]

    def message(path: str) -> str:
        return (
            f"{path}: a reference cycle passes through an immutable node (a {name}), "
            "which cannot be rebuilt since it must exist before its own child. Let the "
            "cycle pass through a mutable container instead (a list, dict, or a "
            "class given to tied.register)."
        )

    raise _WalkError(message)


# ---------------------------------------------------------------- the one traversal of a GraphDef


def _traverse(gdef: GraphDef, expand_shared: bool = False, cut_cycles: bool = False) -> Iterator[tuple]:
    """``(path, depth, ref, first, parent, position)`` for every place of ``gdef``, in the
    walk's order (the root has parent -1).

    A node's children are visited at its first place only, unless ``expand_shared``
    (then at every place; a cycle is a `GraphError`, or with ``cut_cycles`` a reference
    back to a node entered above is yielded but not followed). Iterative, so any depth.
    """
    records = gdef.records
    seen: set[int] = set()
    on_path: set[int] = set()
    root = gdef.root
    yield "", 0, root, True, -1, 0
    if root % 3 != 1:
        return
    seen.add(root)
    on_path.add(root)
    # A frame: [node, next child, path, depth of its children].
    stack: list[list] = [[root // 3, 0, "", 1]]
    while stack:
        frame = stack[-1]
        j, i, path, depth = frame
        kind, meta, refs = records[j]
        if i >= len(refs):
            stack.pop()
            on_path.discard(3 * j + 1)
            continue
        frame[1] = i + 1
        r = refs[i]
        child = path + KINDS[kind].key(meta, i, len(refs))
        if r % 3 == 2:
            yield child, depth, r, True, j, i
            continue
        first = r not in seen
        seen.add(r)
        if r % 3 == 0:
            yield child, depth, r, first, j, i
            continue
        if expand_shared and r in on_path:
            if cut_cycles:
                yield child, depth, r, first, j, i
                continue
            raise GraphError(
                f"{child}: this node is on a reference cycle, so it has infinitely many places "
                "and per-place values cannot be formed. Use the aliased totals "
                "(per_location=False)."
            )
        yield child, depth, r, first, j, i
        if first or expand_shared:
            on_path.add(r)
            stack.append([r // 3, 0, child, depth + 1])


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
    if graphdef._places is not None:
        return graphdef._places
    leaf_paths: list[list[str]] = [[] for _ in range(graphdef.num_leaves)]
    node_paths: list[list[str]] = [[] for _ in graphdef.records]
    static_paths: list[str] = [""] * len(graphdef.statics)
    order: list[int] = []
    for path, _, r, _, _, _ in _traverse(graphdef):
        q, m = divmod(r, 3)
        if m == 2:
            static_paths[q] = path
            continue
        lst = leaf_paths[q] if m == 0 else node_paths[q]
        if not lst:
            order.append(r)
        lst.append(path)
    result = _Places(leaf_paths, node_paths, static_paths, order)
    graphdef._places = result
    return result


def ties(tree: Any) -> list[tuple[str, ...]]:
    """The sharing in a graph: one tuple per object reached from two or more places.

    Arrays and container nodes both count; static leaves never tie. Paths are
    written as ``jax.tree_util.keystr`` writes key paths, in first-seen order.
    The places of a shared node's children are listed under its first place.

    Examples:
        >>> import jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> tied.ties(Chain(d, d))                 # one layer at two places
        [('.layers[0]', '.layers[1]')]
        >>> tied.ties(Chain(d, Dense(d.weight)))   # one array at two places
        [('.layers[0].weight', '.layers[1].weight')]
    """
    _, gdef = flatten(tree)
    places = place_paths(gdef)
    out = []
    for r in places.order:
        q, m = divmod(r, 3)
        paths = places.leaves[q] if m == 0 else places.nodes[q]
        if len(paths) > 1:
            out.append(tuple(p or "<root>" for p in paths))
    return out


def expand(graphdef: GraphDef) -> tuple[GraphDef, tuple[int, ...]]:
    """The graph unrolled into a tree: one node or leaf per *place*.

    Returns the tree's GraphDef and, for each of its leaves (one per place of an
    array), the index of the unique array that stands there. Used for
    per-place gradients and for reading a tree shaped like the model.
    """
    if graphdef._expanded is not None:
        return graphdef._expanded
    records = graphdef.records
    new_records: list = []
    new_refs: list[list] = []
    place_leaf: list[int] = []
    # The pre-order of `_traverse` with expand_shared: a node's children follow it, so a
    # stack of the open new nodes (by depth) tells each place's parent.
    open_nodes: list[int] = []
    root_ref = None
    for _, depth, r, _, _, _ in _traverse(graphdef, expand_shared=True):
        del open_nodes[depth:]
        q, m = divmod(r, 3)
        if m == 0:
            ref = 3 * len(place_leaf)
            place_leaf.append(q)
        elif m == 2:
            ref = r
        else:
            ref = 3 * len(new_records) + 1
            kind, meta, _ = records[q]
            new_records.append((kind, meta))
            new_refs.append([])
        if depth == 0:
            root_ref = ref
        else:
            new_refs[open_nodes[depth - 1]].append(ref)
        if m == 1:
            open_nodes.append(ref // 3)
    records_out = tuple((k, meta, tuple(refs)) for (k, meta), refs in zip(new_records, new_refs))
    tree_def = GraphDef(records_out, graphdef.statics, root_ref, len(place_leaf))
    graphdef._expanded = (tree_def, tuple(place_leaf))
    return graphdef._expanded


# ---------------------------------------------------------------- rebuilding


def _rebuild_plan(gdef: GraphDef) -> tuple:
    """Orders for `unflatten`: the mutable nodes (their empty shells are made first, so a
    cycle can point back at them) and every node in post order (children before their
    parent), so that a node is filled or built only once its children are complete: a
    JAX pytree that reads a list child while it is constructed sees it filled."""
    plan = gdef._plans.get("order")
    if plan is not None:
        return plan
    records = gdef.records
    mutable = [j for j, rec in enumerate(records) if rec[0] in _MUTABLE]
    post: list[int] = []
    seen: set[int] = set()
    root = gdef.root
    starts = ([root // 3] if root % 3 == 1 else []) + list(range(len(records)))
    for start in starts:  # the root first: its post order is the walk's
        if start in seen:
            continue
        stack = [(start, 0)]
        seen.add(start)
        while stack:
            j, i = stack.pop()
            refs = records[j][2]
            while i < len(refs):
                r = refs[i]
                i += 1
                if r % 3 == 1 and (r // 3) not in seen:  # a node met before is on a cycle or done
                    stack.append((j, i))
                    seen.add(r // 3)
                    stack.append((r // 3, 0))
                    break
            else:
                post.append(j)
    plan = (tuple(mutable), tuple(post))
    gdef._plans["order"] = plan
    return plan


def _view_error(fn, source, e) -> GraphError:
    name = getattr(fn, "__name__", repr(fn))
    shape = getattr(source, "shape", None)
    return GraphError(
        f"the view function {name} failed on its source of shape {shape}: "
        f"{type(e).__name__}: {e}. Give tied.view a function that accepts the source array."
    )


def view_failed(gdef: GraphDef, j: int, fn: Any, source: Any, e: Exception) -> GraphError:
    """The error for view node ``j`` whose function failed, naming the view's path."""
    where = place_paths(gdef).nodes[j][0] or "<root>"
    return GraphError(f"{where}: {_view_error(fn, source, e)}")


def unflatten(graphdef: GraphDef, leaves: Any) -> Any:
    """Rebuild an object graph from its `GraphDef` and (new) unique arrays.

    Types, static fields and sharing are those recorded: where the original had
    one object at several places, the result has one object there too, and
    distinct objects stay distinct. Views come back as views.

    Args:
        graphdef: from `tied.flatten`.
        leaves: one value per unique array, in the order `flatten` gave them.

    Returns:
        The rebuilt graph.

    Examples:
        >>> import jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))
        >>> leaves, gdef = tied.flatten(model)
        >>> new = tied.unflatten(gdef, [2 * x for x in leaves])
        >>> new.layers[0].weight is new.layers[1].weight   # the tie is kept
        True
        >>> bool((new.layers[1].bias == 2 * d1.bias).all())
        True
    """
    return _unflatten(graphdef, leaves)


def _unflatten(graphdef: GraphDef, leaves: Any, *, statics: Any = None, materialize: bool = False) -> Any:
    leaves = list(leaves)
    if len(leaves) != graphdef.num_leaves:
        raise ValueError(
            f"tied.unflatten: the GraphDef has {graphdef.num_leaves} unique arrays but "
            f"{len(leaves)} leaves were given."
        )
    if statics is None:
        statics = graphdef.statics
    plans = graphdef._plans
    build = plans.get(materialize)
    if build is None:
        count = plans.get("uses", 0) + 1
        plans["uses"] = count
        if count >= 2:
            from ._plan import compile_unflatten

            # None: too large to be worth compiling; remembered as False, and walked
            build = plans[materialize] = compile_unflatten(graphdef, materialize) or False
    if build:
        out = build(leaves, statics)
        if CHECK_PLANS:
            _check_rebuild(graphdef, leaves, statics, materialize, out)
        return out
    return _rebuild(graphdef, leaves, statics, materialize)


def _rebuild(graphdef: GraphDef, leaves: list, statics: Any, materialize: bool) -> Any:
    records = graphdef.records
    built: list = [None] * len(records)
    mutable, post = _rebuild_plan(graphdef)

    def value(r: int) -> Any:
        q, m = divmod(r, 3)
        if m == 0:
            return leaves[q]
        if m == 1:
            return built[q]
        return statics[q]

    for j in mutable:
        kind, meta, _ = records[j]
        built[j] = KINDS[kind].shell(meta)
    for j in post:
        kind, meta, refs = records[j]
        children = [value(r) for r in refs]
        if kind in _MUTABLE:
            KINDS[kind].fill(meta, built[j], children)
        elif kind == VIEW and materialize:
            try:
                built[j] = meta(children[0])
            except Exception as e:
                raise view_failed(graphdef, j, meta, children[0], e) from e
        else:
            built[j] = KINDS[kind].make(meta, children)
    return value(graphdef.root)


def _check_rebuild(graphdef: GraphDef, leaves: list, statics: Any, materialize: bool, out: Any) -> None:
    ref = _rebuild(graphdef, leaves, statics, materialize)
    if materialize or statics is not graphdef.statics:
        return  # materialised views and stand-in statics are not walked back; the build ran
    wl, wg = _walk(out)
    rl, rg = _walk(ref)
    if not (wg == rg and len(wl) == len(rl) and all(a is b for a, b in zip(wl, rl))):
        raise PlanMismatch(f"a compiled unflatten plan disagrees with the walk: {graphdef}")


# ---------------------------------------------------------------- reading a mirror tree


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
    records = graphdef.records
    found: list[list] = [[] for _ in range(graphdef.num_leaves)]
    on_path: set[int] = set()

    def mismatch(where: str, expected: str, got: Any) -> GraphError:
        return GraphError(
            f"{where or '<root>'}: the {what} does not mirror the model here: expected "
            f"{expected}, found {type(got).__name__}. Pass a {what} shaped like the model "
            f"({hint})."
        )

    # A frame: [node, its refs, the mirror's children (or a broadcast object), next, path].
    stack: list[list] = []

    def render(p: Any) -> str:
        keys = []
        while p is not None:
            p, q, i = p
            kind, meta, refs = records[q]
            keys.append(KINDS[kind].key(meta, i, len(refs)))
        return "".join(reversed(keys))

    def visit(r: int, obj: Any, path: Any) -> None:
        q, m = divmod(r, 3)
        if m == 2:
            return
        if m == 0:
            found[q].append(obj)
            return
        if q in on_path:  # a cycle: its places were read on the way in
            return
        kind, meta, refs = records[q]
        if obj is None or (broadcast is not None and broadcast(obj)):
            children: Any = _Broadcast(obj)
        else:
            try:
                children = KINDS[kind].mirror(meta, obj, len(refs))
            except _Mismatch as e:
                raise mismatch(render(path), e.expected, obj) from None
            except (KeyError, AttributeError, TypeError, IndexError) as e:
                if isinstance(e, GraphError):
                    raise
                raise mismatch(render(path), f"{_article(KINDS[kind].name)} like the model's", obj) from None
            if len(children) != len(refs):
                raise mismatch(render(path), f"{_article(KINDS[kind].name)} with {len(refs)} children", obj)
        on_path.add(q)
        stack.append([q, refs, children, 0, path])

    visit(graphdef.root, other, None)
    while stack:
        frame = stack[-1]
        q, refs, children, i, path = frame
        if i >= len(refs):
            stack.pop()
            on_path.discard(q)
            continue
        frame[3] = i + 1
        x = children.obj if type(children) is _Broadcast else children[i]
        visit(refs[i], x, (path, q, i))
    return found


class _Broadcast:
    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj


# The state cells of `_state`: walked as registered objects (path ``.value``), marked as state.
register(State)
register(Rng)
_state_types.add(State)
