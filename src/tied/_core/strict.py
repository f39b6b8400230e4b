"""Strict keys of static values: equal only for values that rebuild identically.

A GraphDef depends only on the graph, so its statics compare by type and bits
(``-0.0`` is not ``0.0``, ``1.0`` is not ``1``); these keys are what GraphDefs,
kinds' metas and compiled plans compare. Imports nothing of `tied`.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import types
from typing import Any

import numpy as np


def _strict(v: Any) -> Any:
    """A key that is equal only for values that rebuild identically: the type and, for
    numbers, the bits (``-0.0`` differs from ``0.0``, ``1.0`` from ``1``, a NaN equals
    itself). Tuples, lists and dicts are compared element by element, a dataclass whose
    ``__eq__`` is the generated one and compares every field by its fields; any other
    object whose ``==`` cannot be trusted to mean "rebuilds identically" (a user's
    ``__eq__``, a field left out of comparison) by identity."""
    t = type(v)
    if t is str or t is int or v is None or t is bool:
        return (t, v)
    how = _by_type.get(t)
    if how is not None:  # a type met before that is compared by identity, or as it is
        return (t, _Identity(v)) if how else (t, v)
    if t is float:
        return (t, _pack_d(v))
    if t is tuple or t is list:
        return (t, tuple(map(_strict, v)))
    if t is complex:
        return (t, _pack_d(v.real), _pack_d(v.imag))
    if isinstance(v, np.generic):  # the dtype too: datetime64(1, "D") and (1, "s") share bytes
        return (t, v.dtype.str, v.tobytes())
    if t is dict:
        return (t, tuple((_strict(k), _strict(x)) for k, x in v.items()))
    if isinstance(v, tuple) and t.__eq__ is tuple.__eq__ and not getattr(v, "__dict__", None):
        return (t, tuple(map(_strict, v)))  # a namedtuple (no attributes of its own): as a tuple
    if t is range:  # range(0) == range(5, 5), but they rebuild differently
        return (t, v.start, v.stop, v.step)
    if t is slice:  # slice(0.0, 1) == slice(0, 1)
        return (t, _strict(v.start), _strict(v.stop), _strict(v.step))
    if t is np.dtype:  # == ignores metadata and compares structured dtypes by layout
        return (t, v.str, v.descr, repr(v.metadata))
    if t is frozenset:
        return (t, frozenset(map(_strict, v)))
    if t in _EXACT or isinstance(v, _EXACT_BASES):
        if v.__class__ is t:
            _by_type[t] = False
        return (t, v)
    fields = _compared_fields(t)
    if fields is not None:
        return (t, tuple(_strict(getattr(v, name)) for name in fields))
    # Every test above depends on the type alone (unless the object says it is of another
    # class: a proxy); remembering the answer spares the isinstance calls, which are slow for
    # objects that forward attribute reads.
    if v.__class__ is t:
        _by_type[t] = True
    return (t, _Identity(v))


class _Identity:
    """Stands for an object compared by identity (its ``==`` is not trusted): a static's key
    here, and the aux data of a tied node that Equinox's constructor flattens (`classify`)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Identity and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


# Types whose `==` is identity or exact value equality of things already strict.
_EXACT = {bytes, type, type(Ellipsis), types.FunctionType, types.BuiltinFunctionType}
_EXACT_BASES = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)

_fields_cache: dict[type, Any] = {}
# Types whose key is the value itself (False) or its identity (True), once met.
_by_type: dict[type, bool] = {}


def _compared_fields(t: type) -> tuple[str, ...] | None:
    """The fields a dataclass's generated ``__eq__`` compares, when it compares all of them
    and nothing overrides it; else None (compare by identity)."""
    try:
        return _fields_cache[t]
    except KeyError:
        pass
    out = None
    params = getattr(t, "__dataclass_params__", None)
    if params is not None and params.eq and dataclasses.is_dataclass(t):
        eq = t.__dict__.get("__eq__")
        code = getattr(eq, "__code__", None)
        fields = dataclasses.fields(t)
        generated = code is not None and code.co_filename == "<string>"
        if generated and all(f.compare for f in fields):
            out = tuple(f.name for f in fields)
    _fields_cache[t] = out
    return out


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
