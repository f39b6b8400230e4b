"""Compiled plans: straight-line Python for one GraphDef's flatten and unflatten.

The generic walk in `_graph` dispatches on every object it meets. Once a
structure has been seen twice, we generate code that does exactly that
structure's work: for flatten, a *guarded* plan that checks every fact the walk
would have established (each node's type, arity and keys, each static's value,
which places hold the same object and that all others are distinct) and gives
up (returns None) at the first difference, so a plan can never hand back a
stale structure; for unflatten, the constructor calls in build order.

This file decides nothing about sharing: it replays decisions recorded in a
GraphDef by the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _graph as g
from ._view import View


class _Miss(Exception):
    """The graph differs from the plan's GraphDef."""


_FAIL = (KeyError, AttributeError, TypeError, IndexError, ValueError, _Miss)


def _walk_order(gdef: g.GraphDef) -> list[tuple[int, int, int]]:
    """(parent node, child position, ref) for every place, in the walk's order."""
    records = gdef.records
    out: list[tuple[int, int, int]] = []
    seen: set[int] = set()
    stack: list[tuple[int, int]] = []
    root = gdef.root
    out.append((-1, 0, root))
    if root % 3 == 1:
        seen.add(root // 3)
        stack.append((root // 3, 0))
    while stack:
        j, i = stack.pop()
        refs = records[j][2]
        if i < len(refs):
            stack.append((j, i + 1))
            r = refs[i]
            out.append((j, i, r))
            if r % 3 == 1 and r // 3 not in seen:
                seen.add(r // 3)
                stack.append((r // 3, 0))
    return out


def compile_flatten(gdef: g.GraphDef) -> Callable[[Any], list | None] | None:
    """A guarded flatten for graphs of exactly this GraphDef, or None if none can be made."""
    for s in gdef.statics:
        if g._type_cache.get(type(s)) is not g._STATIC:
            return None  # an object whose arrays the walk must look for each time
    records = gdef.records
    ns: dict[str, Any] = {"AT": g._array_types, "M": _Miss}
    ns["FOL"] = g._registry.flatten_one_level
    lines = ["def plan(root):", " out = []", " A = out.append", " N = []", " B = N.append"]
    emit = lines.append
    counter = [0]

    def const(value: Any, prefix: str) -> str:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        ns[name] = value
        return name

    # Expression yielding child i of node j, given node j lives in local n{j}.
    child_expr: dict[int, list[str]] = {}
    seen_leaf: set[int] = set()
    seen_node: set[int] = set()
    shared_leaf = {q for q, n in enumerate(_leaf_place_counts(gdef)) if n > 1}
    for parent, i, r in _walk_order(gdef):
        expr = "root" if parent < 0 else child_expr[parent][i]
        q, m = divmod(r, 3)
        if m == 2:
            s = gdef.statics[q]
            name = const(s, "S")
            tname = const(type(s), "ST")
            emit(f" x = {expr}")
            emit(f" if type(x) is not {tname} or (x is not {name} and not (x == {name})): raise M")
        elif m == 0:
            if q in seen_leaf:
                emit(f" if {expr} is not l{q}: raise M")
            else:
                seen_leaf.add(q)
                target = f"l{q}" if q in shared_leaf else "x"
                emit(f" {target} = {expr}")
                emit(f" if type({target}) not in AT: raise M")
                emit(f" A({target})")
        elif q in seen_node:  # a later place of a node: the same object
            emit(f" if {expr} is not n{q}: raise M")
        else:
            seen_node.add(q)
            kind, meta, refs = records[q]
            n = len(refs)
            v = f"n{q}"
            emit(f" {v} = {expr}")
            if not g.untracked(records[q]):
                emit(f" B({v})")
            if kind == g.LIST or kind == g.TUPLE:
                typ = "list" if kind == g.LIST else "tuple"
                emit(f" if type({v}) is not {typ} or len({v}) != {n}: raise M")
                child_expr[q] = [f"{v}[{k}]" for k in range(n)]
            elif kind == g.DICT:
                keys = const(meta, "K")
                emit(f" if type({v}) is not dict or len({v}) != {n}: raise M")
                child_expr[q] = [f"{v}[{keys}[{k}]]" for k in range(n)]
            elif kind == g.OBJ:
                t = const(meta[0], "T")
                emit(f" if type({v}) is not {t}: raise M")
                emit(f" d{q} = {v}.__dict__")
                emit(f" if len(d{q}) != {n}: raise M")
                child_expr[q] = [f"d{q}[{name!r}]" for name in meta[1]]
            elif kind == g.SLOTS:
                t = const(meta[0], "T")
                emit(f" if type({v}) is not {t}: raise M")
                child_expr[q] = [f"getattr({v}, {name!r})" for name in meta[1]]
            elif kind == g.NAMEDTUPLE:
                t = const(meta, "T")
                emit(f" if type({v}) is not {t} or len({v}) != {n}: raise M")
                child_expr[q] = [f"{v}[{k}]" for k in range(n)]
            elif kind == g.PYTREE:
                t = const(meta[0], "T")
                aux = const(meta[1], "AUX")
                emit(f" if type({v}) is not {t}: raise M")
                emit(f" c{q}, a{q} = FOL({v})")
                emit(f" if len(c{q}) != {n} or (a{q} is not {aux} and not (a{q} == {aux})): raise M")
                child_expr[q] = [f"c{q}[{k}]" for k in range(n)]
            else:  # VIEW
                fn = const(meta, "FN")
                emit(f" if type({v}) is not View or ({v}.fn is not {fn} and not ({v}.fn == {fn})): raise M")
                ns["View"] = View
                child_expr[q] = [f"{v}.source"]
    emit(f" if len(set(map(id, out))) != {gdef.num_leaves}: raise M")
    tracked = sum(1 for rec in records if not g.untracked(rec))
    emit(f" if len(set(map(id, N))) != {tracked}: raise M")
    emit(" return out")
    body = "\n".join(lines)
    wrapper = (
        f"{body}\n"
        "def guarded(root):\n"
        " try:\n"
        "  return plan(root)\n"
        " except FAIL:\n"
        "  return None\n"
    )
    ns["FAIL"] = _FAIL
    exec(compile(wrapper, f"<tied flatten plan {id(gdef):x}>", "exec"), ns)
    return ns["guarded"]


def _leaf_place_counts(gdef: g.GraphDef) -> list[int]:
    counts = [0] * gdef.num_leaves
    for _, _, r in _walk_order(gdef):
        if r % 3 == 0:
            counts[r // 3] += 1
    return counts


def compile_unflatten(gdef: g.GraphDef, materialize: bool) -> Callable[[Any, Any], Any]:
    """Straight-line construction of one GraphDef's graph from leaves ``L`` and statics ``S``."""
    records = gdef.records
    mutable, post = g._rebuild_plan(gdef)
    ns: dict[str, Any] = {"new": object.__new__, "View": View, "setattr": object.__setattr__}
    lines = ["def build(L, S):"]
    emit = lines.append

    def ref(r: int) -> str:
        q, m = divmod(r, 3)
        return ("L[{}]", "n{}", "S[{}]")[m].format(q)

    for j in mutable:
        kind, meta, _ = records[j]
        if kind == g.LIST:
            emit(f" n{j} = []")
        elif kind == g.DICT:
            emit(f" n{j} = {{}}")
        else:
            ns[f"T{j}"] = meta[0]
            emit(f" n{j} = new(T{j})")
    for j in post:
        kind, meta, refs = records[j]
        args = ", ".join(ref(r) for r in refs)
        if kind == g.TUPLE:
            emit(f" n{j} = ({args}{',' if len(refs) == 1 else ''})")
        elif kind == g.NAMEDTUPLE:
            ns[f"T{j}"] = meta
            emit(f" n{j} = T{j}({args})")
        elif kind == g.PYTREE:
            ns[f"P{j}"] = g._pytree_def(meta, len(refs))
            emit(f" n{j} = P{j}.unflatten(({args}{',' if len(refs) == 1 else ''}))")
        else:  # VIEW
            ns[f"F{j}"] = meta
            emit(f" n{j} = F{j}({args})" if materialize else f" n{j} = View({args}, F{j})")
    for j in mutable:
        kind, meta, refs = records[j]
        if not refs:
            continue
        if kind == g.LIST:
            emit(f" n{j}.extend(({', '.join(ref(r) for r in refs)},))")
        elif kind == g.DICT:
            ns[f"K{j}"] = meta
            emit(f" n{j}.update(zip(K{j}, ({', '.join(ref(r) for r in refs)},)))")
        elif kind == g.OBJ:
            items = ", ".join(f"{name!r}: {ref(r)}" for name, r in zip(meta[1], refs))
            emit(f" n{j}.__dict__.update({{{items}}})")
        else:
            for name, r in zip(meta[1], refs):
                emit(f" setattr(n{j}, {name!r}, {ref(r)})")
    emit(f" return {ref(gdef.root)}")
    exec(compile("\n".join(lines), f"<tied unflatten plan {id(gdef):x}>", "exec"), ns)
    return ns["build"]
