"""Strict keys of static values: equal only for values that rebuild identically.

A GraphDef depends only on the graph, so its statics compare by type and bits
(``-0.0`` is not ``0.0``, ``1.0`` is not ``1``); these keys are what GraphDefs,
kinds' metas and compiled plans compare. Imports nothing of `tied`.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

import numpy as np


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
