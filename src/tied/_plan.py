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

import keyword
import operator
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
    """A guarded flatten for graphs of exactly this GraphDef, or None if none can be made.

    The code reads every place into a local, then checks what the walk would have
    established, mostly in a few C-level comparisons at the end: the types of the
    leaves and of the attribute-holding nodes, the sizes of their ``__dict__``, the
    static values (and their types), and that the objects that were distinct are
    still distinct. Reading before checking only ever indexes a dict or a list, or
    reads ``__dict__``: nodes whose reading could run user code (slotted
    dataclasses, JAX-registered nodes, views) are type-checked before.
    """
    for s in gdef.statics:
        if g._type_cache.get(type(s)) is not g._STATIC:
            return None  # an object whose arrays the walk must look for each time
    records = gdef.records
    ns: dict[str, Any] = {"AT": g._array_types, "M": _Miss, "View": View}
    ns["is_"], ns["is_not"] = operator.is_, operator.is_not
    ns["FOL"] = g._registry.flatten_one_level
    lines = ["def plan(root):"]
    emit = lines.append
    counter = [0]

    def const(value: Any, prefix: str) -> str:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        ns[name] = value
        return name

    # Expression yielding child i of node q, once node q sits in local n{q}.
    child_expr: dict[int, list[str]] = {}
    seen_leaf: set[int] = set()
    seen_node: set[int] = set()
    statics: list[str] = []  # locals holding static values, in order
    static_values: list[Any] = []
    tracked_nodes: list[tuple[str, tuple]] = []  # (local, record): nodes whose identity is sharing
    deferred_types: list[tuple[str, Any]] = []  # (local, expected type) for OBJ nodes
    deferred_lens: list[tuple[str, int]] = []
    bulk: set[int] = set()  # sequences of arrays whose places were read in one statement

    def tup(names: list[str]) -> str:
        return "(" + "".join(f"{x}, " for x in names) + ")"

    for parent, i, r in _walk_order(gdef):
        if parent in bulk:
            continue
        expr = "root" if parent < 0 else child_expr[parent][i]
        q, m = divmod(r, 3)
        if m == 2:
            statics.append(f"s{q}")
            static_values.append(gdef.statics[q])
            emit(f" s{q} = {expr}")
        elif m == 0:
            if q in seen_leaf:
                emit(f" if {expr} is not l{q}: raise M")
            else:
                seen_leaf.add(q)
                emit(f" l{q} = {expr}")
        elif q in seen_node:  # a later place of a node: the same object
            emit(f" if {expr} is not n{q}: raise M")
        else:
            seen_node.add(q)
            kind, meta, refs = records[q]
            n = len(refs)
            v = f"n{q}"
            emit(f" {v} = {expr}")
            if not g.untracked(records[q]):
                tracked_nodes.append((v, records[q]))
            if kind == g.LIST or kind == g.TUPLE:
                typ = "list" if kind == g.LIST else "tuple"
                emit(f" if type({v}) is not {typ} or len({v}) != {n}: raise M")
                child_expr[q] = [f"{v}[{k}]" for k in range(n)]
                leaf_qs = [c // 3 for c in refs if c % 3 == 0]
                if n > 1 and len(leaf_qs) == n:  # a sequence of arrays: one statement for all
                    if all(c in seen_leaf for c in leaf_qs):  # all met before: same objects
                        known = tup([f"l{c}" for c in leaf_qs])
                        emit(f" if not all(map(is_, {v}, {known})): raise M")
                        bulk.add(q)
                    elif not seen_leaf.intersection(leaf_qs) and len(set(leaf_qs)) == n:
                        emit(f" {', '.join(f'l{c}' for c in leaf_qs)}, = {v}")
                        seen_leaf.update(leaf_qs)
                        bulk.add(q)
            elif kind == g.DICT:
                keys = const(meta, "K")
                emit(f" if type({v}) is not dict or len({v}) != {n}: raise M")
                child_expr[q] = [f"{v}[{keys}[{k}]]" for k in range(n)]
            elif kind == g.OBJ:
                deferred_types.append((v, meta[0]))
                deferred_lens.append((f"d{q}", n))
                emit(f" d{q} = {v}.__dict__")
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
                child_expr[q] = [f"{v}.source"]

    if deferred_types:
        types = const(tuple(t for _, t in deferred_types), "TYPES")
        emit(f" if tuple(map(type, {tup([v for v, _ in deferred_types])})) != {types}: raise M")
        lens = const(tuple(n for _, n in deferred_lens), "LENS")
        emit(f" if tuple(map(len, {tup([d for d, _ in deferred_lens])})) != {lens}: raise M")
    if statics:
        values = const(tuple(static_values), "SV")
        stypes = const(tuple(type(x) for x in static_values), "ST")
        emit(f" sv = {tup(statics)}")
        # Equal values of another type (1 and True) differ; an identical object cannot.
        retype = f"tuple(map(type, sv)) != {stypes}"
        emit(f" if sv != {values} or (any(map(is_not, sv, {values})) and {retype}): raise M")
    emit(f" out = [{', '.join(f'l{q}' for q in range(gdef.num_leaves))}]")
    emit(" if not AT.issuperset(map(type, out)): raise M")
    emit(f" if len(set(map(id, out))) != {gdef.num_leaves}: raise M")
    # Distinct nodes stay distinct. Types are checked above, so objects of the two
    # groups cannot coincide; those hashed by identity go into a set as they are.
    by_identity = [v for v, rec in tracked_nodes if _identity_hashed(rec)]
    by_id = [v for v, rec in tracked_nodes if not _identity_hashed(rec)]
    if len(by_identity) > 1:
        emit(f" if len(set({tup(by_identity)})) != {len(by_identity)}: raise M")
    if len(by_id) > 1:
        emit(f" if len(set(map(id, {tup(by_id)}))) != {len(by_id)}: raise M")
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


def _identity_hashed(record: tuple) -> bool:
    """An attribute-holding node whose class hashes and compares by identity."""
    if record[0] != g.OBJ:
        return False
    cls = record[1][0]
    return cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__


def _plain_attributes(cls: type, names: tuple) -> bool:
    """Whether ``obj.name = value`` on a fresh instance only stores into its ``__dict__``:
    no custom ``__setattr__`` (frozen dataclasses have one), no descriptor of that name."""
    if getattr(cls, "__setattr__", None) is not object.__setattr__:
        return False
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()) or keyword.iskeyword(name):
            return False
        if name.startswith("__"):
            return False
        if hasattr(type(getattr(cls, name, None)), "__set__"):
            return False
    return True


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
        elif kind == g.OBJ and _plain_attributes(meta[0], meta[1]):
            for name, r in zip(meta[1], refs):  # the fastest way to fill a fresh __dict__
                emit(f" n{j}.{name} = {ref(r)}")
        elif kind == g.OBJ:
            items = ", ".join(f"{name!r}: {ref(r)}" for name, r in zip(meta[1], refs))
            emit(f" n{j}.__dict__.update({{{items}}})")
        else:
            for name, r in zip(meta[1], refs):
                emit(f" setattr(n{j}, {name!r}, {ref(r)})")
    emit(f" return {ref(gdef.root)}")
    exec(compile("\n".join(lines), f"<tied unflatten plan {id(gdef):x}>", "exec"), ns)
    return ns["build"]
