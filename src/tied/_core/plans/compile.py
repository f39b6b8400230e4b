"""Compiled plans: straight-line Python for one GraphDef's flatten and unflatten.

The generic walk in `_graph` dispatches on every object it meets. Once a
structure has been seen twice, we generate code that does exactly that
structure's work: for flatten, a *guarded* plan that checks every fact the walk
would have established (each node's type, arity, keys and their order, each
static's type and bits, which places hold the same object and that all others
are distinct) and gives up (returns None) at the first difference, so a plan can
never hand back a stale structure; for unflatten, the constructor calls in build
order.

The generated source is kept on the function (``__tied_source__``) and
registered with `linecache`, so a traceback through a plan shows its lines.
Compiling Python costs far more per line than walking a place (some 20 to 50
times), so plans are bounded: a structure gets its plan on its second sighting
up to `MAX_PLAN_LINES`, and a larger one (up to `MAX_LARGE_PLAN_LINES`) only
once it has been seen `LARGE_PLAN_SIGHTINGS` times, when the walks it has cost
already match the compile (a rent-or-buy rule: a one-off never stalls on a
compile, a training loop over a huge graph gets its plan after a few steps). With
``TIED_CHECK_PLANS=1`` (the test suite sets it) `_graph` checks every plan
against the plain walk.

This file decides nothing about sharing: it replays decisions recorded in a
GraphDef by the walk. It imports only the core below it (`_kinds`, `_classify`,
`_graphdef`); `_graph` calls it. A kind with no faster emission here is handled
through its own ``children``, ``make``, ``shell`` and ``fill``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import linecache
import operator
from collections.abc import Callable
from typing import Any

from ..classify import _STATIC, _array_types, _type_cache
from ..graphdef import GraphDef, _traverse, rebuild_order, untracked, view_failed
from ..kinds import (
    _MUTABLE,
    DICT,
    KINDS,
    LIST,
    NAMEDTUPLE,
    OBJ,
    PYTREE,
    SLOTS,
    TUPLE,
    VIEW,
    _pytree_def,
    _registry,
)
from ..refs import LEAF, NODE, STATIC, TAGS, split_ref
from ..strict import _same_strict, _strict
from ..view import View
from .loops import (
    EXACT_EQ,
    Layout,
    Run,
    flatten_lines,
    flatten_loop,
    layout,
    layout_and_order,
    plain_attributes,
    unflatten_lines,
    unflatten_loop,
    walk_order,
)

# Python's compile() costs some 20 to 50 times a walk step per generated line, so the
# graphs worth a plan are bounded: a plan of more lines than this (some 0.1 to 0.3 s of
# compiling) is not made, and such a graph is always walked. (Compiling a long plan in
# segments, one per call, was tried: a plan whose segments share a namespace dict runs
# no faster than the walk.)
MAX_PLAN_LINES = 8000
# Measured on 10,000 / 30,000 / 100,000 two-array modules (5 flatten and 4 unflatten
# lines each): compiling both costs 25-26 walks of the graph (0.9 s / 3.3 s / 12 s), the
# plans run 5.5x / 3.3x / 2.7x faster than the walk, and compiling peaks at some 2.5 KB
# of memory per line (+230 MB / +690 MB / +2.4 GB). So: after 32 sightings, up to 60,000
# lines (some 12,000 such modules, under 300 MB); beyond, always the walk.
LARGE_PLAN_SIGHTINGS = 32
MAX_LARGE_PLAN_LINES = 60_000


def plan_bound(sightings: int) -> int:
    """The most generated lines worth compiling for a structure seen ``sightings`` times."""
    return MAX_LARGE_PLAN_LINES if sightings >= LARGE_PLAN_SIGHTINGS else MAX_PLAN_LINES


class _Miss(Exception):
    """The graph differs from the plan's GraphDef."""


# What reading a changed graph with an old plan can raise (a missing key or
# attribute, indexing the wrong type); anything else is a bug and propagates.
_FAIL = (KeyError, AttributeError, TypeError, IndexError, ValueError, _Miss)

_counter = itertools.count()

# Kinds whose children a plan reads by key or index (no call that could hand back new objects).
_READ_BY_KEY = frozenset({LIST, TUPLE, DICT, NAMEDTUPLE} | {k.index for k in KINDS if k.fields_in_dict})


def _register_source(source: str, name: str) -> str:
    filename = f"<tied {name} plan {next(_counter)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return filename


def _compile(source: str, name: str, ns: dict, fn: str) -> Callable:
    exec(compile(source, _register_source(source, name), "exec"), ns)
    out = ns[fn]
    out.__tied_source__ = source
    return out


def _constants(ns: dict, sep: str = "") -> Callable[[Any, str], str]:
    """A namer of constants for generated code: ``const(value, prefix)`` binds ``value`` in
    ``ns`` under a fresh name (the prefix, ``sep``, a count) and returns that name."""
    count = itertools.count()

    def const(value: Any, prefix: str) -> str:
        name = f"{prefix}{sep}{next(count)}"
        ns[name] = value
        return name

    return const


def _walk_order(gdef: GraphDef) -> list[tuple[int, int, int]]:
    """(parent node, child position, ref) for every place, in the walk's order."""
    order = walk_order(gdef)  # a replay of the records, for a GraphDef numbered as a walk numbers
    if order is not None:
        return order
    return [(parent, i, r) for _, _, r, _, parent, i in _traverse(gdef, paths=False)]


# A generated-code emitter: one straight-line plan, emitted by `_FlattenEmitter` in named
# pieces (the reading per kind of node, then each check, then the guard or the writes).
def compile_flatten(
    gdef: GraphDef, max_lines: int = MAX_PLAN_LINES, writes: tuple | None = None, order: list | None = None
) -> Callable[..., Any] | None:
    """A guarded flatten for graphs of exactly this GraphDef, or None if none can be made
    (a static the walk must look into, or a graph too large to be worth compiling).

    Given ``writes`` (``(n, j, i)``: the n-th new value goes to child ``i`` of node
    record ``j``, for every place of the written arrays), it is instead a guarded
    write-back, ``f(root, inputs, values)``: the same reading and checks, and the leaves
    must be ``inputs`` themselves (so they are distinct); only then every place is
    written, and it returns True (None, having written nothing, where the model is not
    of this GraphDef or holds other arrays). None is returned, instead of a function,
    when a written container is read in a loop. ``order`` is the walk order, where the
    caller has it at hand (`layout_and_order`, whose replay of the records makes it).

    The code reads every place into a local, then checks what the walk would have
    established, mostly in a few C-level comparisons at the end: the types of the
    leaves and of the attribute-holding nodes, their field names in order, the
    static values (type and bits), and that the objects that were distinct are
    still distinct. Reading before checking only ever indexes a dict or a list, or
    reads ``__dict__``: nodes whose reading could run user code (slotted classes,
    JAX-registered nodes, views) are type-checked before.
    """
    for s in gdef.statics:
        if _type_cache.get(type(s)) is not _STATIC:
            return None  # an object whose arrays the walk must look for each time
    lay, found = layout_and_order(gdef)
    if flatten_lines(gdef, lay) > max_lines:
        return None
    plan = _FlattenEmitter(gdef, lay)
    plan.read(order or found or _walk_order(gdef))
    plan.check_objects()
    plan.check_statics()
    plan.check_leaves(writes is not None)
    plan.check_nodes()
    plan.ns["FAIL"] = _FAIL
    if len(plan.lines) > max_lines:
        return None
    if writes is None:
        return plan.guarded()
    return plan.write_back(writes)


class _FlattenEmitter:
    """The source of one flatten plan (`compile_flatten`), emitted piece by piece into
    ``lines``, its constants bound in ``ns``: `read` reads every place into a local (a
    reader per kind of node, a loop per run of identical layers), the ``check_*`` methods
    emit the checks of what the walk established, and `guarded` or `write_back` finishes
    the function. The pieces share what has been read so far (the attributes below)."""

    def __init__(self, gdef: GraphDef, lay: Layout) -> None:
        self.gdef, self.lay, self.records = gdef, lay, gdef.records
        ns: dict[str, Any] = {"AT": _array_types, "M": _Miss, "View": View, "STRICT": _strict}
        ns["SAME"] = _same_strict
        ns["is_"], ns["is_not"] = operator.is_, operator.is_not
        ns["FOL"] = _registry.flatten_one_level
        ns["chain"] = itertools.chain
        ns["compress"] = itertools.compress
        ns["STR"] = frozenset((str,))
        self.ns = ns
        self.lines = ["def plan(root):"]
        self.emit = self.lines.append
        self.const = _constants(ns)
        # Expression yielding child i of node q, once node q sits in local n{q}.
        self.child_expr: dict[int, list[str]] = {}
        self.seen_leaf: set[int] = set()
        self.seen_node: set[int] = set()
        self.statics: list[str] = []  # locals holding static values, in order
        self.static_values: list[Any] = []
        self.tracked_nodes: list[tuple[str, tuple]] = []  # (local, record): nodes whose identity is sharing
        self.objects: list[tuple[str, str, Any, tuple]] = []  # (node local, dict local, type, names)
        self.bulk: set[int] = set()  # sequences of arrays whose places were read in one statement
        # Arrays read in bulk or in loops: [first, end) held by a sequence local, in walk order.
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.holders: list[str] = []
        # A node read by key or index (not through a call) that holds an array no other record
        # holds needs no identity check (as in loops, see _loops.flatten_loop): were it another
        # node's object, the other's child at that key (read too: every record's children are)
        # would be that array, which the GraphDef puts there for no other record, so the arrays'
        # distinct check, a static's check or a node's type check fails. ``own``: those arrays.
        tags, leaf = TAGS, LEAF  # locals: read once per reference below
        places = collections.Counter(r for _, _, rs in self.records for r in rs if r % tags == leaf)
        # An array below a state cell may be the very object of another such place (two cells
        # given one array are two states): it tells no node apart, and is not checked distinct.
        self.state = state = gdef.state_leaves()
        self.own = frozenset(r for r, c in places.items() if c == 1 and not state[r // tags])
        self.looped_nodes = 0  # tracked nodes read in loops (the elements, and those inside them in TN)
        self.element_slices: list[str] = []

    def leaf(self, q: int) -> str:
        """The expression of array ``q``, once read: its local, or its item in a sequence."""
        starts = self.starts
        k = bisect.bisect_right(starts, q) - 1
        if k >= 0 and q < self.ends[k]:
            return f"{self.holders[k]}[{q - starts[k]}]"
        return f"l{q}"

    def held(self, first: int, end: int, holder: str) -> None:
        """Arrays ``first`` to ``end`` are read, held by the sequence in local ``holder``."""
        self.starts.append(first)
        self.ends.append(end)
        self.holders.append(holder)
        self.seen_leaf.update(range(first, end))

    # ------------------------------------------------ reading every place

    def read(self, order: list) -> None:
        """Every place into a local, in the walk's ``order``: an array or a static at its place,
        a node with its kind's checks, a later place of either by identity."""
        emit, child_expr, seen_leaf = self.emit, self.child_expr, self.seen_leaf
        run_at = {(run.parent, run.start): run for runs in self.lay.runs.values() for run in runs}
        if run_at:  # nodes read in loops whose identity must be checked (see _loops.flatten_loop)
            emit(" TN = []")
            emit(" tn = TN.extend")
        skip = 0
        for parent, i, r in order:
            if skip:
                skip -= 1
                continue
            if parent in self.bulk:
                continue
            expr = "root" if parent < 0 else child_expr[parent][i]
            run = run_at.get((parent, i))
            if run is not None:  # a run of identical layers: one loop
                skip = self.loop(parent, run)
                continue
            q, tag = divmod(r, TAGS)  # split_ref's arithmetic, inline: once per place
            if tag == STATIC:
                self.statics.append(f"s{q}")
                self.static_values.append(self.gdef.statics[q])
                emit(f" s{q} = {expr}")
            elif tag == LEAF:
                if q in seen_leaf:
                    emit(f" if {expr} is not {self.leaf(q)}: raise M")
                else:
                    seen_leaf.add(q)
                    emit(f" l{q} = {expr}")
            elif q in self.seen_node:  # a later place of a node: the same object
                emit(f" if {expr} is not n{q}: raise M")
            else:
                self.node(q, expr)

    def loop(self, parent: int, run: Run) -> int:
        """The elements of ``run`` (children of node ``parent``) read by one loop; returns how
        many places of the order the loop has read past the first."""
        k = len(self.holders)
        body, per, check_elements = flatten_loop(self.gdef, run, k, f"n{parent}", self.leaf, self.const)
        self.lines.extend(body)
        self.held(run.lo, run.lo + run.count * run.leaves, f"R{k}")
        self.looped_nodes += per * run.count
        if check_elements and not untracked(self.records[run.first]):  # no unique array of
            # their own tells the elements apart: their identities, a slice of the sequence
            self.element_slices.append(f"n{parent}[{run.start}:{run.start + run.count}]")
            self.looped_nodes += run.count
        return run.count * run.places - 1

    def node(self, q: int, expr: str) -> None:
        """Node ``q``'s first place, read from ``expr`` into local ``n{q}`` and checked as its
        kind says; its children's expressions kept for their places."""
        self.seen_node.add(q)
        record = self.records[q]
        kind, meta, refs = record
        v = f"n{q}"
        self.emit(f" {v} = {expr}")
        if not untracked(record) and not (kind in _READ_BY_KEY and any(map(self.own.__contains__, refs))):
            self.tracked_nodes.append((v, record))
        if kind == LIST or kind == TUPLE:
            children = self.read_sequence(q, v, kind, refs)
        elif kind == DICT:
            children = self.read_dict(q, v, meta, refs)
        elif KINDS[kind].fields_in_dict:
            self.objects.append((v, f"d{q}", meta[0], meta[1]))
            self.emit(f" d{q} = {v}.__dict__")
            children = [f"d{q}[{name!r}]" for name in meta[1]]
        elif kind == NAMEDTUPLE:
            t = self.const(meta, "T")
            self.emit(f" if type({v}) is not {t} or len({v}) != {len(refs)}: raise M")
            children = [f"{v}[{k}]" for k in range(len(refs))]
        elif kind == PYTREE:
            children = self.read_by_call(q, v, len(refs), meta[0], None, meta[1], ("AUX", "SAUX"))
        elif kind == VIEW:
            fn = self.const(meta, "FN")
            sfn = self.const(_strict(meta), "SFN")
            self.emit(
                f" if type({v}) is not View or ({v}.fn is not {fn} and STRICT({v}.fn) != {sfn}): raise M"
            )
            children = [f"{v}.source"]
        else:  # any other kind: its own children(), its meta compared strictly
            t = KINDS[kind].type_of(meta)
            children = self.read_by_call(q, v, len(refs), t, KINDS[kind].children, meta, ("MT", "SM"))
        self.child_expr[q] = children

    def read_sequence(self, q: int, v: str, kind: int, refs: tuple) -> list[str]:
        """A list or tuple: its type and length; its arrays in one statement where it can."""
        emit, seen_leaf, n = self.emit, self.seen_leaf, len(refs)
        emit(f" if type({v}) is not {'list' if kind == LIST else 'tuple'} or len({v}) != {n}: raise M")
        leaf_qs = [c // TAGS for c in refs if c % TAGS == LEAF]
        if q in self.lay.bulk:  # arrays all seen here first: the sequence holds them
            self.held(leaf_qs[0], leaf_qs[0] + n, v)
            self.bulk.add(q)
        elif n > 1 and len(leaf_qs) == n:  # a sequence of arrays: one statement for all
            if all(c in seen_leaf for c in leaf_qs):  # all met before: same objects
                known = _tup([self.leaf(c) for c in leaf_qs])
                emit(f" if not all(map(is_, {v}, {known})): raise M")
                self.bulk.add(q)
            elif not seen_leaf.intersection(leaf_qs) and len(set(leaf_qs)) == n:
                emit(f" {', '.join(f'l{c}' for c in leaf_qs)}, = {v}")
                seen_leaf.update(leaf_qs)
                self.bulk.add(q)
        return [f"{v}[{k}]" for k in range(n)]

    def read_dict(self, q: int, v: str, meta: Any, refs: tuple) -> list[str]:
        """A dict: its type and its keys in the model's insertion order (which the rebuilt dict
        keeps), exact where they are not all str; its arrays in one statement where it can."""
        emit, const, n = self.emit, self.const, len(refs)
        keys, order = meta
        ks = const(keys, "K")
        inserted = const(keys if order is None else order, "KI")
        str_keys = all(type(k) is str for k in keys)
        if n and str_keys:
            # At once when they are the very keys recorded (a dict tied rebuilt, or keyed by
            # the same strings): those are exact str. Else equal, and checked exact str here.
            emit(
                f" if type({v}) is not dict or len({v}) != {n} or (not all(map(is_, {v}, {inserted}))"
                f" and (tuple({v}) != {inserted} or not STR.issuperset(map(type, {v})))): raise M"
            )
        else:
            emit(f" if type({v}) is not dict or tuple({v}) != {inserted}: raise M")
        if q in self.lay.bulk:  # arrays all seen here first: read them in one statement
            _, first = split_ref(refs[0])
            read = f"tuple({v}.values())" if order is None else f"tuple(map({v}.__getitem__, {ks}))"
            emit(f" RD{q} = {read}")
            self.held(first, first + n, f"RD{q}")
            self.bulk.add(q)
        if not str_keys:  # 1 == 1.0 == True: compare the keys themselves, type and bits
            sk = const(tuple(map(_strict, keys if order is None else order)), "SK")
            emit(f" if tuple(map(STRICT, {v})) != {sk}: raise M")
        return [f"{v}[{ks}[{k}]]" for k in range(n)]

    def read_by_call(
        self, q: int, v: str, n: int, typ: type, children: Any, meta: Any, prefixes: tuple[str, str]
    ) -> list[str]:
        """A node whose children come from a call (``children``: the kind's own; None for a JAX
        pytree, flattened one level by JAX), checked by type first (the call may run user
        code), then its arity and its meta (a pytree's aux data) compared strictly; the meta
        and its strict key are bound under ``prefixes``."""
        const, emit = self.const, self.emit
        t = const(typ, "T")
        call = "FOL" if children is None else const(children, "CH")
        expected, strict = const(meta, prefixes[0]), const(_strict(meta), prefixes[1])
        emit(f" if type({v}) is not {t}: raise M")
        emit(f" c{q}, a{q} = {call}({v})")
        emit(f" if len(c{q}) != {n} or not SAME(a{q}, {expected}, {strict}): raise M")
        return [f"c{q}[{k}]" for k in range(n)]

    # ------------------------------------------------ the checks, once every place is read

    def check_objects(self) -> None:
        """The attribute-holding nodes: their types, and their field names in order."""
        objects, const = self.objects, self.const
        if not objects:
            return
        types = const(tuple(t for _, _, t, _ in objects), "TYPES")
        self.emit(f" if tuple(map(type, {_tup([v for v, _, _, _ in objects])})) != {types}: raise M")
        # The fields in their order (the walk lists them in assignment order), all dicts'
        # keys in one list (a display: no call per dict): each dict holds its names (read
        # above), and the same total sequence then means the same keys in the same order in each.
        names = const([n for _, _, _, nm in objects for n in nm], "NAMES")
        self.emit(f" if [{', '.join(f'*{d}' for _, d, _, _ in objects)}] != {names}: raise M")

    def check_statics(self) -> None:
        """The statics: the very objects recorded, or of their types and values."""
        statics, static_values, const = self.statics, self.static_values, self.const
        if not statics:
            return
        values = const(tuple(static_values), "SV")
        self.emit(f" sv = {_tup(statics)}")
        # An identical object is the same static; anything else must match in type, and in
        # value: by == where == is exact (str, int, bool, None), by the strict key elsewhere
        # (floats: -0.0 == 0.0; tuples holding them; numpy scalars; and objects the GraphDef
        # compares by identity: a str subclass, a bound method made anew, a user's class).
        types = const(tuple(type(x) for x in static_values), "ST")
        plain = [k for k, x in enumerate(static_values) if type(x) in EXACT_EQ]
        bits = [k for k in range(len(static_values)) if k not in set(plain)]
        checks = [f"tuple(map(type, sv)) != {types}"]
        if plain:
            pv = const(tuple(static_values[k] for k in plain), "PV")
            checks.append(f"{_tup([statics[k] for k in plain])} != {pv}")
        if bits:
            bv = const(tuple(_strict(static_values[k]) for k in bits), "BV")
            checks.append(f"tuple(map(STRICT, {_tup([statics[k] for k in bits])})) != {bv}")
        self.emit(f" if any(map(is_not, sv, {values})) and ({' or '.join(checks)}): raise M")

    def check_leaves(self, writes: bool) -> None:
        """The list ``out`` of the arrays; they are arrays and distinct (those outside state
        cells), or, for a write-back, the very arrays the call was given."""
        emit, state, num_leaves = self.emit, self.state, self.gdef.num_leaves
        emit(f" out = [{', '.join(_segments(num_leaves, self.starts, self.ends, self.holders))}]")
        if writes:  # the very arrays the call was given (distinct, of array types): nothing else
            emit(" if any(map(is_not, out, INP)): raise M")
            return
        emit(" if not AT.issuperset(map(type, out)): raise M")
        if any(state):  # the others distinct, and none of them below a cell too
            n_params = state.count(False)
            outside = self.const(bytes(not s for s in state), "OUT")
            inside = self.const(bytes(state), "IN")
            emit(f" ids = set(map(id, compress(out, {outside})))")
            emit(f" if len(ids) != {n_params} or not ids.isdisjoint(map(id, compress(out, {inside}))):")
            emit("  raise M")
        else:
            emit(f" if len(set(map(id, out))) != {num_leaves}: raise M")

    def check_nodes(self) -> None:
        """Distinct nodes stay distinct. Types are checked above, so objects of the two groups
        cannot coincide; those hashed by identity go into a set as they are."""
        emit, tracked_nodes = self.emit, self.tracked_nodes
        by_identity = [v for v, rec in tracked_nodes if _identity_hashed(rec)]
        by_id = [v for v, rec in tracked_nodes if not _identity_hashed(rec)]
        if self.looped_nodes:  # with the nodes read in loops that hold no array of their own: all by id
            total = len(tracked_nodes) + self.looped_nodes
            looped = ", ".join(["TN", *self.element_slices])
            emit(f" if len(set(map(id, chain({_tup(by_identity + by_id)}, {looped})))) != {total}: raise M")
            return
        if len(by_identity) > 1:
            emit(f" if len(set({_tup(by_identity)})) != {len(by_identity)}: raise M")
        if len(by_id) > 1:
            emit(f" if len(set(map(id, {_tup(by_id)}))) != {len(by_id)}: raise M")

    # ------------------------------------------------ the function

    def guarded(self) -> Callable[..., Any]:
        """The flatten plan: the list of arrays, or None at the first difference."""
        lines = self.lines
        lines.append(" return out")
        lines += ["def guarded(root):", " try:", "  return plan(root)", " except FAIL:", "  return None", ""]
        return _compile("\n".join(lines), "flatten", self.ns, "guarded")

    def write_back(self, writes: tuple) -> Callable[..., Any] | None:
        """The write-back: the reading and checks, then the ``writes`` (None where a written
        container is read in a loop). The writes run once every check has passed, outside the
        guard: a setter that raises (a state cell refusing its value) is an error, never a
        miss after half a write."""
        lines, const, records = self.lines, self.const, self.records
        lines[0] = "def plan(root, INP):"
        held_locals: list[str] = []
        puts: list[str] = []
        setters: dict[int, str] = {}
        for n, j, i in writes:
            if j not in self.seen_node:  # read in a loop: no local holds it
                return None
            kind, meta, _ = records[j]
            by_dict = KINDS[kind].fields_in_dict and type(KINDS[kind]).setter is type(KINDS[OBJ]).setter
            if kind in (LIST, DICT) or by_dict:
                # its reading expression is the item its setter assigns (a list's, a dict's, a
                # __dict__'s: a registered class and a state cell write there)
                held_locals.append(f"n{j}" if kind in (LIST, DICT) else f"d{j}")
                puts.append(f" {self.child_expr[j][i]} = V[{n}]")
            else:  # the kind's own setter (a state cell checks its value)
                held_locals.append(f"n{j}")
                if kind not in setters:
                    setters[kind] = const(KINDS[kind].setter, "SET")
                puts.append(f" {setters[kind]}({const(meta, 'MT')}, n{j}, {i})(V[{n}])")
        held_locals = list(dict.fromkeys(held_locals))
        lines.append(f" return {_tup(held_locals)}")
        lines += ["def guarded(root, INP, V):", " try:", "  C = plan(root, INP)", " except FAIL:"]
        lines += ["  return None", f" {_tup(held_locals)[1:-1]} = C"]
        lines += puts
        lines += [" return True", ""]
        return _compile("\n".join(lines), "write-back", self.ns, "guarded")


def _tup(names: list[str]) -> str:
    """A tuple display of ``names`` (``()`` for none, ``(x, )`` for one)."""
    return "(" + "".join(f"{x}, " for x in names) + ")"


def _segments(n: int, starts: list[int], ends: list[int], holders: list[str]) -> list[str]:
    """The items of the list of all ``n`` arrays: ``l{q}`` locals, ``*holder`` sequences."""
    out: list[str] = []
    q = 0
    for first, end, holder in zip(starts, ends, holders):
        out.extend(f"l{x}" for x in range(q, first))
        out.append(f"*{holder}")
        q = end
    out.extend(f"l{x}" for x in range(q, n))
    return out


def _identity_hashed(record: tuple) -> bool:
    """An attribute-holding node whose class hashes and compares by identity."""
    if not KINDS[record[0]].fields_in_dict:
        return False
    cls = record[1][0]
    return cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__


# How a built plan names a child, by its reference's tag: the leaves in L, the nodes in locals
# n{j}, the statics in S.
_REF_EXPR = {LEAF: "L[{}]", NODE: "n{}", STATIC: "S[{}]"}


# A generated-code emitter (as `compile_flatten`): the constructor calls in build order.
def compile_unflatten(
    gdef: GraphDef, materialize: bool, max_lines: int = MAX_PLAN_LINES
) -> Callable[[Any, Any], Any] | None:
    """Straight-line construction of one GraphDef's graph from leaves ``L`` and statics ``S``
    (None for a graph too large to be worth compiling: `unflatten` then walks)."""
    records = gdef.records
    if unflatten_lines(gdef) > max_lines:
        return None
    mutable, post = rebuild_order(gdef)
    ns: dict[str, Any] = {"new": object.__new__, "View": View, "setattr": object.__setattr__}
    ns["VF"], ns["G"] = view_failed, gdef
    lines = ["def build(L, S):"]
    emit = lines.append
    lay = layout(gdef)
    looped = {
        j
        for runs in lay.runs.values()
        for run in runs
        for j in range(run.first, run.first + run.count * run.nodes)
    }
    const = _constants(ns, "_")  # "_": apart from the names below (T{j}, K{j}...)

    def ref(r: int) -> str:
        q, tag = divmod(r, TAGS)  # split_ref's arithmetic, inline: once per place
        return _REF_EXPR[tag].format(q)

    def args(refs: tuple, j: int = -1) -> str:
        """A tuple display of ``refs``: a run's elements as ``*B{k}``, four or more
        consecutive arrays as one slice of ``L``."""
        items: list[str] = []
        starts = {run.start: run for run in lay.runs.get(j, ())}
        i = 0
        while i < len(refs):
            run = starts.get(i)
            if run is not None:
                items.append(f"*B{run.first}")
                i += run.count
                continue
            r, e = refs[i], i + 1
            if r % TAGS == LEAF:  # consecutive arrays: references TAGS apart
                while e < len(refs) and refs[e] == refs[e - 1] + TAGS and (j < 0 or e not in starts):
                    e += 1
            if e - i >= 4:
                q = r // TAGS
                items.append(f"*L[{q}:{q + e - i}]")
            else:
                items.extend(ref(x) for x in refs[i:e])
            i = e
        return "(" + "".join(f"{x}, " for x in items) + ")"

    for j in mutable:
        if j in looped:
            continue
        kind, meta, _ = records[j]
        if kind == LIST:
            emit(f" n{j} = []")
        elif kind == DICT:
            emit(f" n{j} = {{}}")
        elif KINDS[kind].fields_in_dict or kind == SLOTS:
            ns[f"T{j}"] = meta[0]
            emit(f" n{j} = new(T{j})")
        else:
            ns[f"SH{j}"], ns[f"M{j}"] = KINDS[kind].shell, meta
            emit(f" n{j} = SH{j}(M{j})")

    def fill(j: int, kind: int, meta: Any, refs: tuple) -> None:
        if kind == LIST:
            emit(f" n{j}.extend({args(refs, j)})")
        elif kind == DICT:
            keys, order = meta
            if len(refs) > 8 and all(type(k) is str for k in keys):
                # The keys in the model's order first, from a dict made once (its table copied,
                # no resizing as keys are added; a str's hash never changes), then the values.
                ns[f"KD{j}"] = dict.fromkeys(keys if order is None else order)
                emit(f" n{j}.update(KD{j})")
            elif order is not None and j in lay.bulk:  # keys in the model's order, then values
                ns[f"KI{j}"] = order
                emit(f" n{j}.update(dict.fromkeys(KI{j}))")
            elif order is not None:  # fill in the model's insertion order
                position = {k: i for i, k in enumerate(keys)}
                keys, refs = order, tuple(refs[position[k]] for k in order)
            ns[f"K{j}"] = keys
            emit(f" n{j}.update(zip(K{j}, {args(refs)}))")
        elif KINDS[kind].fields_in_dict and plain_attributes(meta[0], meta[1]):
            for name, r in zip(meta[1], refs):  # the fastest way to fill a fresh __dict__
                emit(f" n{j}.{name} = {ref(r)}")
        elif KINDS[kind].fields_in_dict:
            ns[f"N{j}"] = meta[1]
            emit(f" n{j}.__dict__.update(zip(N{j}, {args(refs)}))")
        else:
            ns[f"FL{j}"], ns[f"M{j}"] = KINDS[kind].fill, meta
            emit(f" FL{j}(M{j}, n{j}, list({args(refs)}))")

    # Children before parents: a mutable node is filled, an immutable one built, once
    # its children are complete (shells above stand in on a cycle).
    for j in post:
        if j in looped:
            continue
        kind, meta, refs = records[j]
        for run in lay.runs.get(j, ()):  # runs of identical layers: one loop each
            lines.extend(unflatten_loop(gdef, run, run.first, const))
        if kind in _MUTABLE:
            if refs:
                fill(j, kind, meta, refs)
        elif kind == TUPLE:
            emit(f" n{j} = {args(refs, j)}")
        elif kind == NAMEDTUPLE:
            ns[f"T{j}"] = meta
            emit(f" n{j} = T{j}(*{args(refs)})")
        elif kind == PYTREE:
            ns[f"P{j}"] = _pytree_def(meta, len(refs))
            emit(f" n{j} = P{j}.unflatten({args(refs)})")
        elif materialize and KINDS[kind].materializes:
            ns[f"MZ{j}"], ns[f"M{j}"] = KINDS[kind].materialize, meta
            emit(f" s{j} = {ref(refs[0])}")
            emit(" try:")
            emit(f"  n{j} = MZ{j}(M{j}, [s{j}])")
            emit(" except Exception as e:")
            emit(f"  raise VF(G, {j}, M{j}, s{j}, e) from e")
        elif kind == VIEW:
            ns[f"F{j}"] = meta
            emit(f" n{j} = View({ref(refs[0])}, F{j})")
        else:
            ns[f"MK{j}"], ns[f"M{j}"] = KINDS[kind].make, meta
            emit(f" n{j} = MK{j}(M{j}, list({args(refs)}))")
    if len(lines) > max_lines:
        return None
    emit(f" return {ref(gdef.root)}")
    return _compile("\n".join(lines) + "\n", "unflatten", ns, "build")
