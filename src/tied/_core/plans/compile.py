"""Compiled plans: straight-line Python for one GraphDef's flatten and unflatten.

The generic walk in `graph.py` dispatches on every object it meets. Once a
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
``TIED_CHECK_PLANS=1`` (the test suite sets it) `graph` checks every plan
against the plain walk.

This file decides nothing about sharing: it replays decisions recorded in a
GraphDef by the walk. It imports only the core below it (`kinds`, `classify`,
`graphdef`) and the other plan modules; `graph` calls it. The lines of each kind of
node come from its emitter (`emit.py`, shared with the loop bodies of `loops.py`);
the lines of the plan itself from the templates below.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import linecache
import operator
from collections.abc import Callable
from functools import partial
from typing import Any

from ..classify import _STATIC, _array_types, _type_cache
from ..graphdef import GraphDef, _traverse, rebuild_order, untracked, view_failed
from ..kinds import (
    _MUTABLE,
    DICT,
    KINDS,
    LIST,
    NAMEDTUPLE,
    TUPLE,
)
from ..refs import LEAF, NODE, STATIC, TAGS
from ..strict import _strict
from .emit import (
    BUILD_NAMES,
    CHECK_ALL_SAME,
    CHECK_SAME,
    EMITTERS,
    EXACT_EQ,
    READ_NAMES,
    UNPACK,
    Code,
    Miss,
    tup,
)
from .loops import (
    Layout,
    Run,
    flatten_lines,
    flatten_loop,
    layout,
    layout_and_order,
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


# ---------------------------------------------------------------- templates: a plan's own lines
# (the lines of each kind of node are `emit.py`'s). A flatten plan is ``plan(root)``: every
# place read into a local, then these checks of what the walk established; ``guarded`` turns
# a miss into None.

CHECK_OBJECT_TYPES = "if tuple(map(type, {nodes})) != {types}: raise M"
CHECK_OBJECT_FIELDS = "if [{dicts}] != {names}: raise M"
READ_STATICS = "sv = {statics}"
CHECK_STATICS = "if any(map(is_not, sv, {values})) and ({unequal}): raise M"
STATIC_TYPES = "tuple(map(type, sv)) != {types}"
STATIC_VALUES = "{statics} != {values}"
STATIC_KEYS = "tuple(map(STRICT, {statics})) != {keys}"
LEAVES = "out = [{items}]"
CHECK_GIVEN = "if any(map(is_not, out, INP)): raise M"
CHECK_ARRAYS = "if not AT.issuperset(map(type, out)): raise M"
CHECK_DISTINCT = "if len(set(map(id, out))) != {n}: raise M"
CHECK_DISTINCT_OUTSIDE_CELLS = """\
ids = set(map(id, compress(out, {outside})))
if len(ids) != {n} or not ids.isdisjoint(map(id, compress(out, {inside}))):
 raise M"""
CHECK_NODES_AND_LOOPED = "if len(set(map(id, chain({nodes}, {looped})))) != {n}: raise M"
CHECK_NODES_HASHED = "if len(set({nodes})) != {n}: raise M"
CHECK_NODES_BY_ID = "if len(set(map(id, {nodes}))) != {n}: raise M"
GUARDED = """\
 return out
def guarded(root):
 try:
  return plan(root)
 except FAIL:
  return None
"""
# A write-back plan: ``plan(root, INP, V)`` reads and checks, then (every check passed) reaches
# the containers a loop read by their first places (REACH) and builds the containers rebuilt
# (a tuple, a cell's value: the emitters' ``make``, ``shell``, ``fill``), handing out those
# and the containers the writes go through; ``guarded`` makes the writes.
REACH = "n{j} = {expr}"
WRITE_BACK = """\
 return {held}
def guarded(root, INP, V):
 try:
  C = plan(root, INP, V)
 except FAIL:
  return None
 {unpacked} = C
{puts}
 return True
"""
# An unflatten plan: ``build(L, S)`` from the leaves and the statics.
BUILD = "def build(L, S):"
RETURN = "return {root}"


def plan_bound(sightings: int) -> int:
    """The most generated lines worth compiling for a structure seen ``sightings`` times."""
    return MAX_LARGE_PLAN_LINES if sightings >= LARGE_PLAN_SIGHTINGS else MAX_PLAN_LINES


# What reading a changed graph with an old plan can raise (a missing key or
# attribute, indexing the wrong type); anything else is a bug and propagates.
_FAIL = (KeyError, AttributeError, TypeError, IndexError, ValueError, Miss)

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
    of this GraphDef or holds other arrays). Once every check has passed, a written
    container that a loop read is reached by its first place, and a place in a tuple or
    inside a state cell's value is written as `live.slots` writes it: its containers
    rebuilt, put where the old ones were. ``order`` is the walk order, where the caller
    has it at hand (`layout_and_order`, whose replay of the records makes it).

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


def compile_writes(gdef: GraphDef, writes: tuple) -> Callable[..., Any]:
    """The writes of a write-back alone, ``f(root, None, values)`` (True once written), for a
    model that the walk has just found of exactly this GraphDef, holding the very arrays the
    call was given (the write-back's re-check, where the structure has no flatten plan: over
    the plan bound): each written container reached from the root by its first place, the
    containers rebuilt and the places written as `compile_flatten`'s write-back does, with
    none of its reading and checks."""
    lay, found = layout_and_order(gdef)
    plan = _FlattenEmitter(gdef, lay)
    plan.order = found or _walk_order(gdef)
    plan.child_expr[-1] = ["root"]  # the root's place: reached from there
    plan.ns["FAIL"] = _FAIL
    return plan.write_back(writes)


class _FlattenEmitter:
    """The source of one flatten plan (`compile_flatten`), emitted piece by piece into
    ``lines``, its constants bound in ``ns``: `read` reads every place into a local (a
    reader per kind of node, a loop per run of identical layers), the ``check_*`` methods
    emit the checks of what the walk established, and `guarded` or `write_back` finishes
    the function. The pieces share what has been read so far (the attributes below)."""

    def __init__(self, gdef: GraphDef, lay: Layout) -> None:
        self.gdef, self.lay, self.records = gdef, lay, gdef.records
        ns: dict[str, Any] = {**READ_NAMES, "AT": _array_types, "is_not": operator.is_not}
        ns["chain"], ns["compress"] = itertools.chain, itertools.compress
        self.ns = ns
        self.lines = ["def plan(root):"]
        self.const = _constants(ns)
        self.code = Code(self.lines, " ", self.const)
        self.emit = self.code.emit
        # Expression yielding child i of node q, once node q sits in local n{q}.
        self.child_expr: dict[int, list[str]] = {}
        self.seen_leaf: set[int] = set()
        self.seen_node: set[int] = set()
        self.statics: list[str] = []  # locals holding static values, in order
        self.static_values: list[Any] = []
        self.tracked_nodes: list[tuple[str, tuple]] = []  # (local, record): nodes whose identity is sharing
        # (node local, dict local, type, names): checked at once (`check_objects`)
        self.objects: list[tuple[str, str, Any, tuple]] = []
        self.code.objects = self.objects
        self.bulk: set[int] = set()  # sequences of arrays whose places were read in one statement
        self.order: list = []  # the places in the walk's order (`read`)
        self.places: dict[int, list[tuple[int, int]]] | None = None  # node -> [(parent, position)]
        # Arrays read in bulk or in loops: [first, end) held by a sequence local, in walk order.
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.holders: list[str] = []
        # A node read by key or index (not through a call) that holds an array no other record
        # holds needs no identity check (as in loops, see loops.flatten_loop): were it another
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
        self.order = order
        run_at = {(run.parent, run.start): run for runs in self.lay.runs.values() for run in runs}
        if run_at:  # nodes read in loops whose identity must be checked (see loops.flatten_loop)
            emit("TN = []")
            emit("tn = TN.extend")
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
                emit(f"s{q} = {expr}")
            elif tag == LEAF:
                if q in seen_leaf:
                    emit(CHECK_SAME, expr=expr, known=self.leaf(q))
                else:
                    seen_leaf.add(q)
                    emit(f"l{q} = {expr}")
            elif q in self.seen_node:  # a later place of a node: the same object
                emit(CHECK_SAME, expr=expr, known=f"n{q}")
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
        kind's emitter says; its children's expressions kept for their places."""
        self.seen_node.add(q)
        record = self.records[q]
        kind, meta, refs = record
        v, n = f"n{q}", len(refs)
        self.emit(f"{v} = {expr}")
        if not untracked(record) and not (kind in _READ_BY_KEY and any(map(self.own.__contains__, refs))):
            self.tracked_nodes.append((v, record))
        emitter = EMITTERS[kind]
        if q not in self.lay.bulk:
            self.child_expr[q] = emitter.read(self.code, v, meta, n, str(q))
            if emitter.unpacks and n > 1:
                self.arrays(q, v, refs)
            return
        # arrays all seen here first: the node holds them (a sequence), or one statement reads them
        holder = v if emitter.unpacks else f"RD{q}"
        self.child_expr[q] = emitter.read(self.code, v, meta, n, str(q), None if emitter.unpacks else holder)
        first = refs[0] // TAGS
        self.held(first, first + n, holder)
        self.bulk.add(q)

    def arrays(self, q: int, v: str, refs: tuple) -> None:
        """A sequence of arrays only, read in one statement: all the very arrays met before,
        or all new ones unpacked."""
        leaf_qs = [c // TAGS for c in refs if c % TAGS == LEAF]
        if len(leaf_qs) != len(refs):
            return
        seen_leaf = self.seen_leaf
        if all(c in seen_leaf for c in leaf_qs):  # all met before: same objects
            self.emit(CHECK_ALL_SAME, v=v, known=tup([self.leaf(c) for c in leaf_qs]))
            self.bulk.add(q)
        elif not seen_leaf.intersection(leaf_qs) and len(set(leaf_qs)) == len(refs):
            self.emit(UNPACK, targets=", ".join(f"l{c}" for c in leaf_qs), v=v)
            seen_leaf.update(leaf_qs)
            self.bulk.add(q)

    # ------------------------------------------------ the checks, once every place is read

    def check_objects(self) -> None:
        """The attribute-holding nodes: their types, and their field names in order."""
        objects, const = self.objects, self.const
        if not objects:
            return
        types = const(tuple(t for _, _, t, _ in objects), "TYPES")
        self.emit(CHECK_OBJECT_TYPES, nodes=tup([v for v, _, _, _ in objects]), types=types)
        # The fields in their order (the walk lists them in assignment order), all dicts'
        # keys in one list (a display: no call per dict): each dict holds its names (read
        # above), and the same total sequence then means the same keys in the same order in each.
        names = const([n for _, _, _, nm in objects for n in nm], "NAMES")
        self.emit(CHECK_OBJECT_FIELDS, dicts=", ".join(f"*{d}" for _, d, _, _ in objects), names=names)

    def check_statics(self) -> None:
        """The statics: the very objects recorded, or of their types and values."""
        statics, static_values, const = self.statics, self.static_values, self.const
        if not statics:
            return
        values = const(tuple(static_values), "SV")
        self.emit(READ_STATICS, statics=tup(statics))
        # An identical object is the same static; anything else must match in type, and in
        # value: by == where == is exact (str, int, bool, None), by the strict key elsewhere
        # (floats: -0.0 == 0.0; tuples holding them; numpy scalars; and objects the GraphDef
        # compares by identity: a str subclass, a bound method made anew, a user's class).
        types = const(tuple(type(x) for x in static_values), "ST")
        plain = [k for k, x in enumerate(static_values) if type(x) in EXACT_EQ]
        bits = [k for k in range(len(static_values)) if k not in set(plain)]
        checks = [STATIC_TYPES.format(types=types)]
        if plain:
            pv = const(tuple(static_values[k] for k in plain), "PV")
            checks.append(STATIC_VALUES.format(statics=tup([statics[k] for k in plain]), values=pv))
        if bits:
            bv = const(tuple(_strict(static_values[k]) for k in bits), "BV")
            checks.append(STATIC_KEYS.format(statics=tup([statics[k] for k in bits]), keys=bv))
        self.emit(CHECK_STATICS, values=values, unequal=" or ".join(checks))

    def check_leaves(self, writes: bool) -> None:
        """The list ``out`` of the arrays; they are arrays and distinct (those outside state
        cells), or, for a write-back, the very arrays the call was given."""
        emit, state, num_leaves = self.emit, self.state, self.gdef.num_leaves
        emit(LEAVES, items=", ".join(_segments(num_leaves, self.starts, self.ends, self.holders)))
        if writes:  # the very arrays the call was given (distinct, of array types): nothing else
            emit(CHECK_GIVEN)
            return
        emit(CHECK_ARRAYS)
        if any(state):  # the others distinct, and none of them below a cell too
            n_params = state.count(False)
            outside = self.const(bytes(not s for s in state), "OUT")
            inside = self.const(bytes(state), "IN")
            emit(CHECK_DISTINCT_OUTSIDE_CELLS, outside=outside, n=n_params, inside=inside)
        else:
            emit(CHECK_DISTINCT, n=num_leaves)

    def check_nodes(self) -> None:
        """Distinct nodes stay distinct. Types are checked above, so objects of the two groups
        cannot coincide; those hashed by identity go into a set as they are."""
        emit, tracked_nodes = self.emit, self.tracked_nodes
        by_identity = [v for v, rec in tracked_nodes if _identity_hashed(rec)]
        by_id = [v for v, rec in tracked_nodes if not _identity_hashed(rec)]
        if self.looped_nodes:  # with the nodes read in loops that hold no array of their own: all by id
            total = len(tracked_nodes) + self.looped_nodes
            looped = ", ".join(["TN", *self.element_slices])
            emit(CHECK_NODES_AND_LOOPED, nodes=tup(by_identity + by_id), looped=looped, n=total)
            return
        if len(by_identity) > 1:
            emit(CHECK_NODES_HASHED, nodes=tup(by_identity), n=len(by_identity))
        if len(by_id) > 1:
            emit(CHECK_NODES_BY_ID, nodes=tup(by_id), n=len(by_id))

    # ------------------------------------------------ the function

    def guarded(self) -> Callable[..., Any]:
        """The flatten plan: the list of arrays, or None at the first difference."""
        return _compile("\n".join(self.lines) + "\n" + GUARDED, "flatten", self.ns, "guarded")

    def write_back(self, writes: tuple) -> Callable[..., Any]:
        """The write-back: the reading and checks, then the ``writes``. A place in a tuple, or
        inside a state cell's value, is written as `live.slots` writes it: the containers are
        rebuilt (`rebuilt`), once every check has passed, and put where the old ones were. The
        writes run once every check has passed, outside the guard: a setter that raises (a
        state cell refusing its value) is an error, never a miss after half a write."""
        self.lines[0] = "def plan(root, INP, V):"
        puts_at, rebuilt = self.rebuilt(writes)
        for j in [j for j, _, _ in puts_at] + list(rebuilt):
            self.reach(j)
        for j, values in rebuilt.items():  # children first: the dict is filled in that order
            kind, meta, refs = self.records[j]
            exprs = [values.get(k, e) for k, e in enumerate(self.child_expr[j])]
            args = partial(_display, exprs)
            emitter, positions = EMITTERS[kind], tuple(range(len(refs)))
            if kind in _MUTABLE:  # a container of a cell's value: a new one, never changed in place
                emitter.shell(self.code, f"r{j}", meta)
                emitter.fill(self.code, f"r{j}", meta, positions, args, exprs.__getitem__)
            else:
                emitter.make(self.code, f"r{j}", meta, positions, args, exprs.__getitem__)
        puts: list[str] = []
        code = Code(puts, " ", self.const)
        held: list[str] = [value for _, _, value in puts_at if value[0] == "r"]
        for j, i, value in puts_at:
            kind, meta, _ = self.records[j]
            held.append(EMITTERS[kind].put(code, f"n{j}", str(j), self.child_expr[j][i], meta, i, value))
        held = tup(list(dict.fromkeys(held)))
        source = WRITE_BACK.format(held=held, unpacked=held[1:-1], puts="\n".join(puts))
        return _compile("\n".join(self.lines) + "\n" + source, "write-back", self.ns, "guarded")

    def rebuilt(self, writes: tuple) -> tuple[list, dict[int, dict[int, str]]]:
        """The puts ``(j, i, value)`` of ``writes``, and the containers rebuilt, children first,
        each with its new children by position: a tuple holding a written place (the new one
        put at every place of it, a tuple holding it rebuilt in turn), and the containers of a
        state cell's value on the way to a written place (the new value put in the cell)."""
        records, state, cells = self.records, self.gdef.state_leaves(), self.gdef.state_nodes()
        self.places_of(0)
        puts: list = []
        new: dict[int, dict[int, str]] = {}
        below: dict[int, list[int]] = {}  # a rebuilt container: the rebuilt ones it holds

        def put(j: int, i: int, value: str, in_cell: bool) -> None:
            kind = records[j][0]
            if in_cell and not cells[j]:  # a container of a cell's value: rebuilt, and so on up
                places = self.places[j][:1]
            elif not in_cell and kind in (TUPLE, NAMEDTUPLE):  # every place of the tuple
                places = self.places[j]
            else:
                puts.append((j, i, value))
                return
            first = j not in new
            new.setdefault(j, {})[i] = value
            if value[0] == "r":
                below.setdefault(j, []).append(int(value[1:]))
            if first:
                for parent, k in places:
                    put(parent, k, f"r{j}", in_cell)

        for n, j, i in writes:
            put(j, i, f"V[{n}]", state[records[j][2][i] // TAGS])
        order: dict[int, dict[int, str]] = {}

        def children_first(j: int) -> None:
            if j not in order:
                for k in below.get(j, ()):
                    children_first(k)
                order[j] = new[j]

        for j in new:
            children_first(j)
        return puts, order

    def places_of(self, j: int) -> list[tuple[int, int]]:
        """Every place of node ``j``: (parent, position), in the walk's order."""
        if self.places is None:
            self.places = {}
            for parent, i, r in self.order:
                if r % TAGS == NODE:
                    self.places.setdefault(r // TAGS, []).append((parent, i))
        return self.places.get(j, [])

    def reach(self, j: int) -> None:
        """Node ``j``, read in a loop (no local holds it), into local ``n{j}``, its children's
        expressions kept: from its first place, its parent reached first. Emitted after every
        check, each step reads what the checks read: the very object the loop checked."""
        if j in self.child_expr:  # read straight: its local holds it
            return
        parent, i = self.places_of(j)[0]
        self.reach(parent)
        kind, meta, refs = self.records[j]
        self.emit(REACH, j=j, expr=self.child_expr[parent][i])
        self.child_expr[j] = EMITTERS[kind].reach(self.code, f"n{j}", meta, len(refs), str(j))


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


def _display(exprs: list[str], positions: tuple) -> str:
    """A tuple display of the expressions at ``positions`` (a rebuilt container's children)."""
    return tup([exprs[k] for k in positions])


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
    ns: dict[str, Any] = {**BUILD_NAMES, "VF": view_failed, "G": gdef}
    lines = [BUILD]
    lay = layout(gdef)
    looped = {
        j
        for runs in lay.runs.values()
        for run in runs
        for j in range(run.first, run.first + run.count * run.nodes)
    }
    const = _constants(ns, "_")  # "_": apart from the plan's own names (n{j}, B{k}, ...)
    code = Code(lines, " ", const)

    def ref(r: int) -> str:
        q, tag = divmod(r, TAGS)  # split_ref's arithmetic, inline: once per place
        return _REF_EXPR[tag].format(q)

    def args(refs: tuple, j: int) -> str:
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
                while e < len(refs) and refs[e] == refs[e - 1] + TAGS and e not in starts:
                    e += 1
            if e - i >= 4:
                q = r // TAGS
                items.append(f"*L[{q}:{q + e - i}]")
            else:
                items.extend(ref(x) for x in refs[i:e])
            i = e
        return tup(items)

    for j in mutable:  # empty first: a cycle may pass through them
        if j not in looped:
            kind, meta, _ = records[j]
            EMITTERS[kind].shell(code, f"n{j}", meta)
    # Children before parents: a mutable node is filled, an immutable one built, once
    # its children are complete (shells above stand in on a cycle).
    for j in post:
        if j in looped:
            continue
        kind, meta, refs = records[j]
        for run in lay.runs.get(j, ()):  # runs of identical layers: one loop each
            lines.extend(unflatten_loop(gdef, run, run.first, const))
        emitter, y = EMITTERS[kind], f"n{j}"
        if kind in _MUTABLE:
            if refs:
                emitter.fill(code, y, meta, refs, partial(args, j=j), ref, bulk=j in lay.bulk)
        elif materialize and KINDS[kind].materializes:
            emitter.materialize(code, y, j, meta, ref(refs[0]))
        else:
            emitter.make(code, y, meta, refs, partial(args, j=j), ref)
    if len(lines) > max_lines:
        return None
    code.emit(RETURN, root=ref(gdef.root))
    return _compile("\n".join(lines) + "\n", "unflatten", ns, "build")
