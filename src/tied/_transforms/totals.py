"""Gradients tied vouches for: `mark_total` and `is_total`, by identity.

Plain jax.grad may hand one cotangent object to two places (both operands of ``a + b``), which
looks exactly like tied's aliased total but is two partials. So an array found at several places
of a tie is read as a total only when tied made it one. Arrays are marked by a weak reference,
so a marked array that dies is forgotten and a new object reusing its id is never taken for it.

Its own module so that every transform that hands totals on (`grad`, `jit`, `lift`) reads the
marks without importing another transform.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["is_total", "mark_total"]


class _Mark(weakref.ref):
    __slots__ = ("key",)


_totals: dict[int, _Mark] = {}


def _forget(ref: _Mark) -> None:
    if _totals.get(ref.key) is ref:
        _totals.pop(ref.key, None)


def mark_total(x: Any) -> None:
    """Record that ``x`` is a total gradient made by tied (so an aliased ``x`` counts once).

    For layers that hand tied's totals on (`tied.jit` rebuilding its outputs).
    Anything that cannot be weakly referenced (None, a View) is ignored.
    """
    if x is None or isinstance(x, (int, float, complex)):
        return
    try:
        ref = _Mark(x, _forget)
    except TypeError:
        return
    ref.key = id(x)
    _totals[id(x)] = ref


def is_total(x: Any) -> bool:
    """Whether ``x`` is a total gradient tied made (`mark_total`), by identity."""
    ref = _totals.get(id(x))
    return ref is not None and ref() is x
