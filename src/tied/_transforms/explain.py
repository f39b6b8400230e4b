"""Why `tied.jit` compiled again: the structure, the static arguments, or shapes and dtypes.

A `tied.jit` function keeps one entry per input structure (the arguments' `GraphDef`, ties
and static fields included) and static arguments; each entry is a `jax.jit` function, which
compiles once more for every new set of shapes and dtypes (weak types included). With JAX's
own switch on (``JAX_EXPLAIN_CACHE_MISSES=1``, or ``jax.config.update("jax_explain_cache_misses",
True)``) every call that compiles logs one warning on the ``tied.jit`` logger saying which of
the three changed since the call before it, and where: the first place added or removed, the
static field or argument that changed (old and new value), the tie cut or made, or the first
arrays whose shape or dtype changed. `Jitted.cache_size` counts the compiled entries.

A call that compiles is known by the entry being new or JAX's own cache growing, so every
compile that adds a version logs its line whenever the switch is on, turned on after the first
call too, and for a new placement of the same shapes (an input committed to a device, another
sharding). What changed is named against the calls made while the switch was on: only those are
remembered (the arguments' signature, not the arrays), per `Jitted`, and only while it lives.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import jax

from .._core import GraphDef
from .writes import place_name

__all__ = ["cache_size", "enabled", "explain"]

log = logging.getLogger("tied.jit")

# Jitted -> {cache key: [signature of each set of shapes and dtypes seen, in call order]}, and the
# key of the call before (what a new entry is compared with).
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHOWN = 3  # arrays named in one message


def cache_size(self: Any) -> int:
    """How many compiled versions this `tied.jit` function holds, as ``jax.jit(f)._cache_size()``
    counts them: one per input structure (ties and static fields included) and static arguments,
    times the shapes and dtypes each was called with. ``JAX_EXPLAIN_CACHE_MISSES=1`` logs why each
    new one was made (docs/api/jit.md). It is ``Jitted.cache_size``.

    Returns:
        The number of compiled versions.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> f = tied.jit(lambda m, x: m(x).sum())
        >>> _ = f(Chain(d, d), jnp.ones((1, 2))), f(Chain(d, d), jnp.ones((1, 2)))
        >>> f.cache_size()                                  # the same structure: compiled once
        1
        >>> _ = f(Chain(d, Dense(d.weight, d.bias)), jnp.ones((1, 2)))   # another tie pattern
        >>> _ = f(Chain(d, d), jnp.ones((5, 2)))            # another shape
        >>> f.cache_size()
        3
    """
    return sum(entry.fn._cache_size() for entry in list(self._compiled.values()))


def enabled() -> bool:
    """Whether JAX's ``jax_explain_cache_misses`` switch is on (tied.jit follows it)."""
    return bool(jax.config.jax_explain_cache_misses)


def _signature(leaves: list) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))) for x in leaves)


def _aval(sig: tuple) -> str:
    shape, dtype, weak = sig
    return f"{dtype}[{','.join(map(str, shape))}]" + (" (weak type)" if weak else "")


def explain(jitted: Any, key: tuple, leaves: list, fresh: bool, compiled: bool = False) -> str | None:
    """Record a call of ``jitted`` and, if it compiled, log and return why.

    Args:
        jitted: the `Jitted` called.
        key: its cache key, ``(GraphDef, static arguments)``.
        leaves: the call's unique input arrays.
        fresh: whether ``key`` made a new entry (a new structure or new static arguments).
        compiled: whether the call added a compiled version to an existing entry (JAX's own
            cache grew: new shapes, dtypes, or placements).

    Returns:
        The message logged, or None when the call compiled nothing.
    """
    sig = _signature(leaves)
    per_key, last = _seen.get(jitted, ({}, None))
    seen = per_key.setdefault(key, [])
    name = getattr(jitted.fun, "__qualname__", repr(jitted.fun))
    if fresh:
        if last is not None:
            reason = _new_entry(last, key)
        elif len(jitted._compiled) > 1:
            reason = (
                "new arguments' structure or static arguments (the calls before were made with the "
                "switch off: nothing is known to compare with)"
            )
        else:
            reason = "its first call (nothing compiled yet)"
    elif not compiled:
        reason = None
    elif not seen:
        reason = (
            "new shapes, dtypes or placements of the arguments (the calls before were made with the "
            "switch off: nothing is known to compare with)"
        )
    elif sig in seen:
        reason = (
            "the same structure, static arguments, shapes and dtypes as an earlier call: the "
            "arguments are placed otherwise (their shardings, devices or committedness)"
        )
    else:
        reason = _new_shapes(key[0], seen[-1], sig)
    if sig not in seen:
        seen.append(sig)
    _seen[jitted] = (per_key, key)
    if reason is None:
        return None
    message = f"tied.jit({name}) compiles a new entry: {reason}"
    log.warning(message)
    return message


def _new_entry(old: tuple, new: tuple) -> str:
    # statics first: a static argument given or left out also moves the dynamic ones' places
    (old_gdef, (old_pos, old_kw)), (new_gdef, (new_pos, new_kw)) = old, new
    if old_pos != new_pos:  # ((position, value), ...)
        return f"the static arguments changed: {_short(old_pos)} -> {_short(new_pos)}"
    if old_kw != new_kw:  # ((name, value), ...)
        return f"the static keyword arguments changed: {_short(old_kw)} -> {_short(new_kw)}"
    if old_gdef != new_gdef:
        return "the arguments' structure changed: " + _structure_change(old_gdef, new_gdef)
    return "an entry made anew for arguments equal to the last call's"


def _places(gdef: GraphDef) -> dict[str, tuple]:
    """Every place of a graph: what sits there (a static's value, a node's type, an array),
    and the path of the first place of the object it holds (a tie: another path)."""
    out: dict[str, tuple] = {}
    first: dict[tuple, str] = {}
    for p in gdef.walk_places():
        obj = (p.kind, p.index) if p.kind in ("array", "static") else ("node", p.index)
        origin = first.setdefault(obj, p.path) if p.kind != "static" else p.path
        what = ("static", type(p.value).__name__, repr(p.value)) if p.kind == "static" else (p.kind, p.type)
        out[place_name(p.path)] = (what, place_name(origin))
    return out


def _structure_change(old: GraphDef, new: GraphDef) -> str:
    before, after = _places(old), _places(new)
    for path, (what, origin) in after.items():  # in walk order: the outermost change first
        if path not in before:
            return f"a place was added: {path}"
        was, was_origin = before[path]
        if was != what:
            return f"{path} was {_what(was)}, is {_what(what)}"
        if was_origin != origin:
            if origin != path:
                return f"{path} is now the same object as {origin} (a new tie)"
            return f"{path} is no longer the same object as {was_origin} (a tie was cut)"
    for path in before:
        if path not in after:
            return f"a place was removed: {path}"
    return "the GraphDefs differ in a way no place shows"


def _what(what: tuple) -> str:
    if what[0] == "static":
        return f"the static {what[2][:60]}"
    return "an array" if what[0] == "array" else f"a {getattr(what[1], '__name__', what[0])}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _new_shapes(gdef: GraphDef, old: tuple, new: tuple) -> str:
    paths = gdef.leaf_paths()
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    shown = [f"{place_name(paths[i][0])} {_aval(old[i])} -> {_aval(new[i])}" for i in changed[:_SHOWN]]
    more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
    arrays = "1 array" if len(changed) == 1 else f"{len(changed)} arrays"
    return f"shapes or dtypes changed ({arrays}): {', '.join(shown)}{more}"
