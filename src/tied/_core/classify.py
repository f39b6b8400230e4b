"""Classification: what the walk makes of each object, by its type (cached).

Every object is an *array* (a leaf tracked by identity), a *static* (kept by
value), a node of one kind of `_kinds.KINDS`, or *unknown* (a static the walk
cannot enter; an error if it holds arrays, never dropped). `register` adds a
user's class; JAX's pytree functions then refuse it (walking it leaf by leaf
would cut its ties). The caches here are cleared by `clear_caches` and by
`register`, together with whatever registered itself in `_on_clear` (the plan
caches of `_graph`).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._compat import is_pytree_node
from .kinds import (
    _KIND_NAMES,
    _MISSING,
    DICT,
    DICTSUB,
    KINDS,
    LIST,
    LISTSUB,
    NAMEDTUPLE,
    OBJ,
    PYTREE,
    SLOTS,
    STATE,
    TUPLE,
    VIEW,
    _slot_names,
    _slotted_dataclasses,
    _WalkError,
)
from .state import Rng, State, _state_cache, _state_types, equinox_state_type
from .state import _lock as _state_lock
from .strict import _Identity
from .view import View

# Classification of a type (cached): array, static, a node kind, or unknown.
_ARRAY, _STATIC, _UNKNOWN = "array", "static", "unknown"

# The kinds known by exact type: a new kind classified by type is one entry here.
_BY_TYPE: dict[type, int] = {list: LIST, dict: DICT, tuple: TUPLE, View: VIEW, State: STATE}
_registered: dict[type, int] = {}  # class given to `register` -> its kind
_array_types: set[type] = set()  # every array type met so far (compiled plans test against it)
_type_cache: dict[type, Any] = {}
_cache_lock = threading.Lock()
_on_clear: list[Callable[[], None]] = []  # run (under the lock) when classifications change


def _guard_message(cls: type) -> str:
    return (
        f"{cls.__module__}.{cls.__qualname__} is a tied node (given to tied.register), not a JAX "
        "pytree: walking it leaf by leaf would cut its ties (a shared array would become one "
        "copy per place). Use the tied way: tied.grad / tied.value_and_grad for gradients, "
        "tied.jit for jit, tied.map to map over its arrays, tied.optim.setup for an optax "
        "optimiser, tied.block_until_ready to wait for its arrays, or wrap it as "
        "tied.Graph(model) to hand it to any JAX function."
    )


def _called_from_equinox_init() -> bool:
    """Whether the JAX call asking to flatten a tied node comes straight from Equinox's own
    constructor checks (`_ModuleMeta.__call__`: its ``tree_leaves`` scan of a module's
    constructor arguments, and its static-field check), recognised by the identity of the
    installed Equinox's code object, past JAX's own frames only. There a tied layer held by
    an Equinox module is one leafless node (a tied layer in a static field is then refused
    by the walk, which checks static data); every other JAX call is refused."""
    codes = _equinox_codes()
    if not codes:
        return False
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith("jax."):
        f = f.f_back
    return f is not None and f.f_code in codes


def _equinox_codes() -> frozenset:
    """The code objects of the installed Equinox's module constructor (None loaded: empty)."""
    codes = []
    for name in ("equinox._module._module", "equinox._module"):
        meta = getattr(sys.modules.get(name), "_ModuleMeta", None)
        call = meta.__dict__.get("__call__") if isinstance(meta, type) else None
        code = getattr(call, "__code__", None)
        if code is not None:
            codes.append(code)
    return frozenset(codes)


def _refuse_jax_flatten(cls: type) -> None:
    """Make JAX's pytree functions (tree_map, jit, grad, vmap, optax's init) refuse ``cls``
    with a message naming the tied way, instead of treating it as an opaque leaf."""
    if is_pytree_node(cls):
        return  # already a JAX pytree (registered by its author): leave JAX's rule alone

    def refuse(x):
        if _called_from_equinox_init():
            return (), _Identity(x)  # aux data: the whole node, equal only to itself
        raise TypeError(_guard_message(cls))

    def refuse_unflatten(_aux, _children):
        raise TypeError(_guard_message(cls))

    try:
        jax.tree_util.register_pytree_node(cls, refuse, refuse_unflatten)
    except ValueError:  # registered meanwhile by another thread
        pass


def register(cls: type) -> type:
    """Let `tied` walk instances of a plain Python class: its fields are its children (the
    ``__dict__`` entries in assignment order, then the ``__slots__`` that are set; a ``list`` or
    ``dict`` subclass's items first), rebuilt without calling ``__init__``, and make plain JAX
    refuse it. The public `tied.register` (`_tree/repr.py`) is this plus a repr; its docstring
    is the reference, with examples."""
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
        for clear in _on_clear:
            clear()
    _refuse_jax_flatten(cls)
    return cls


def is_walkable_type(t: type) -> bool:
    """Whether the walk enters instances of ``t`` as nodes without registration."""
    return t in _registered or t in _BY_TYPE or is_pytree_node(t) or dataclasses.is_dataclass(t)


def clear_caches() -> None:
    """Forget every classification and compiled plan (a class's meaning changed)."""
    with _cache_lock:
        _type_cache.clear()
        for clear in _on_clear:
            clear()


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
    k = _BY_TYPE.get(t)
    if k is not None:
        return k
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):  # an abstract array too
        return _ARRAY
    if isinstance(x, _STATIC_TYPES) and not isinstance(x, (list, tuple, dict)):
        return _STATIC
    if isinstance(x, tuple) and hasattr(t, "_fields") and is_pytree_node(t):
        return NAMEDTUPLE
    if t is equinox_state_type():
        # Walked by its fields (its ``_state`` dict, keyed by Equinox's names of the places,
        # ``'BatchNorm.state_index'``), not as JAX flattens it (``<flat index 1>``); JAX's own
        # flattening is left as Equinox made it, so Equinox code keeps passing it to JAX.
        return OBJ
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


def _held_with_keys(x: Any) -> list:
    """What an object that the walk does not enter holds, as far as can be seen without
    running user code, with a JAX key each: ``__dict__`` values, set slots, and the items
    of a container."""
    out: list = []
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict):
        out.extend((jax.tree_util.GetAttrKey(str(k)), v) for k, v in d.items())
    for name in _slot_names(type(x)):
        v = getattr(x, name, _MISSING)
        if v is not _MISSING:
            out.append((jax.tree_util.GetAttrKey(name), v))
    if isinstance(x, (list, tuple, collections.deque)):
        out.extend((jax.tree_util.SequenceKey(i), v) for i, v in enumerate(x))
    elif isinstance(x, (set, frozenset)):
        out.extend((jax.tree_util.FlattenedIndexKey(i), v) for i, v in enumerate(x))
    elif isinstance(x, dict):
        out.extend((jax.tree_util.DictKey(k), v) for k, v in x.items())
    return out


def _held(x: Any) -> list:
    """`_held_with_keys` without the keys."""
    return [v for _, v in _held_with_keys(x)]


def walkable_below(obj: Any, holders: list | None = None) -> list[tuple[str, Any]]:
    """The objects the walk enters (arrays, nodes) that sit below ``obj`` through objects it
    does not enter (an unregistered class's fields), each with its path from ``obj``
    (``[("", obj)]`` when the walk enters ``obj`` itself): where a function handed such an
    object may have written. The objects not entered are appended to ``holders`` if given.
    Iterative and identity-memoised, so cycles end."""
    seen: dict[int, Any] = {}  # id -> object, held so that ids stay unique
    out = []
    stack = [("", obj)]
    while stack:
        path, x = stack.pop()
        if id(x) in seen:
            continue
        seen[id(x)] = x
        k = _kind(x)
        if k is _STATIC:
            continue
        if k is _UNKNOWN:
            if holders is not None:
                holders.append(x)
            stack.extend((path + jax.tree_util.keystr((key,)), v) for key, v in reversed(_held_with_keys(x)))
        else:
            out.append((path, x))
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
        if k is _ARRAY or (type(k) is int and KINDS[k].counts_as_arrays):
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

    message = (
        f"an object of unregistered class {name} holds arrays, and tied would "
        f"drop them as a static leaf. Register the class so tied walks it: {fix}"
    )

    raise _WalkError(message)


def _arrays_in_static_data(x: Any) -> None:
    name = type(x).__qualname__

    message = (
        f"the static (auxiliary) data of this {name} holds arrays or a tied layer: "
        "JAX and tied treat static data as a constant, so they would get no gradient, no "
        "optimiser step, no place in a checkpoint, and be left behind by every rebuild. "
        "Make it a regular field (for an Equinox module: drop eqx.field(static=True) from it)."
    )

    raise _WalkError(message)


def _cycle_error(kind: int) -> None:
    name = _KIND_NAMES[kind]

    message = (
        f"a reference cycle passes through an immutable node (a {name}), "
        "which cannot be rebuilt since it must exist before its own child. Let the "
        "cycle pass through a mutable container instead (a list, dict, or a "
        "class given to tied.register)."
    )

    raise _WalkError(message)


def register_state(cls: type) -> type:
    """Declare a class of state cells: the arrays below its instances are state.

    State is never a parameter: it gets no gradient, no optimiser state and is
    not counted by `tied.param_count`; `tied.jit` writes its new values back into
    the caller's objects. A class the walk does not enter yet (a plain class) is
    also given to `tied.register`. Usable as a class decorator.

    Args:
        cls: the cell class (typically one holding ``.value``).

    Returns:
        ``cls`` itself.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> @tied.register_state
        ... class Counter:
        ...     def __init__(self):
        ...         self.value = jnp.zeros((), jnp.int32)
        >>> model = {"w": jnp.ones(2), "calls": Counter()}
        >>> tied.is_state(model, "['calls'].value"), tied.is_state(model, "['w']")
        (True, False)
    """
    if not isinstance(cls, type):
        raise TypeError(f"tied.register_state expects a class, got {cls!r}.")
    if not is_walkable_type(cls):  # the walk must be able to enter it
        register(cls)
    with _state_lock:
        _state_types.add(cls)
        _state_cache.clear()
    clear_caches()
    return cls


# The state cells of `_state`. `State` is its own kind (by type, above); `Rng` holds a
# key and a `State` counter, walked as a registered object; JAX refuses both.
_refuse_jax_flatten(State)
register(Rng)
_state_types.add(State)
