"""Loops in compiled plans: a run of identical layers is read and rebuilt by one loop.

A model of many layers repeats a few layouts: a list of 1,000 blocks, each of the
same classes with the same field names and statics, each holding its own arrays
(and perhaps an array or a node held by all of them: a shared bias, a shared
embedding). A straight-line plan spends a line per place, and compiling Python
costs far more per line than walking a place, so such plans had to be bounded.
Here we find, in a GraphDef, the runs of consecutive children of a list or a tuple
whose subtrees are the same up to where their arrays and statics are numbered;
`compile.py` then emits one loop per run, its body one element's code, each node's lines
written by its kind's emitter (`emit.py`, as in straight-line plans). A plan's size is
then that of the model's distinct layouts, not of its depth.

An element joins a run only if its subtree is *closed* (no node inside it has a
place outside it, so nothing else needs its objects by name), it holds no reference
back to a node still open above it (a cycle), and each of its nodes is of a kind the
loop bodies emit. Its arrays may have places elsewhere too, and it may hold arrays
and nodes from outside: those are references by absolute index, equal in every
element of a run.

This module decides nothing about sharing: it reads what a GraphDef records. Its
only user is `compile.py`, whose plans `graph` checks against the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..graphdef import GraphDef, untracked
from ..kinds import DICT, LIST, TUPLE
from ..refs import LEAF, NODE, STATIC, TAGS, node_ref, split_ref
from .emit import CHECK_SAME, EMITTERS, LOOP_KINDS, Code, static_check, tup

# Fewer elements than this are not worth a loop (straight lines are as short).
LOOP_MIN = 4
# An element of more records than this is not looped (a chain of nested lists would have
# each level's whole subtree compared at every level above it).
MAX_ELEMENT_RECORDS = 512
# A graph of at most this many places is read and built in straight lines, which run some
# 10 to 20% faster than loops; beyond, compiling them would cost more than it saves.
LOOP_PLACES = 1000
# A list, tuple or dict of at least this many arrays seen there first is read in one statement.
BULK_MIN = 8
_LOOP_BUG = "tied: an unflatten plan's loop built a wrong number of layers (a bug in tied; please report it)"


class Run(NamedTuple):
    """Consecutive children of a list or tuple with one layout, read and built by one loop."""

    parent: int  # the list or tuple node
    start: int  # the position of the run's first element among the parent's children
    count: int  # elements
    first: int  # the record of the first element's root
    nodes: int  # records per element
    lo: int  # the first array first seen in the run
    leaves: int  # arrays first seen per element
    slo: int  # the first static of the run
    statics: int  # statics per element
    places: int  # places per element, its own included
    unique: tuple  # per array of its own (in order): whether it has no other place in the graph


class Layout(NamedTuple):
    """What `compile.py` needs of a GraphDef's repeats: its runs, by parent, and its bulk nodes."""

    runs: dict[int, tuple[Run, ...]]
    bulk: frozenset  # lists, tuples and dicts whose children are all arrays seen there first
    places: int  # every place of the graph
    looped_places: int  # places inside runs
    looped_records: int
    looped_leaves: int


def walk_order(gdef: GraphDef) -> list | None:
    """``(parent, position, reference)`` for every place of a walk's GraphDef, in the walk's
    order (None for a GraphDef numbered otherwise)."""
    ext = _extents(gdef)
    return None if ext is None else ext.order


def layout_and_order(gdef: GraphDef) -> tuple[Layout, list | None]:
    """The runs and bulk nodes of ``gdef`` (computed once, kept in its memo), and, when they
    were computed by this call, the walk order that their replay of the records made (the
    replay costs about a µs a place, and a plan compiled right after needs the order); the
    order is handed to the caller, never kept."""
    out = gdef.memo.layout
    if out is not None:
        return out, None
    out, order = _find(gdef)
    gdef.memo.layout = out
    return out, order


def layout(gdef: GraphDef) -> Layout:
    """The runs and bulk nodes of ``gdef`` (computed once, kept in its memo)."""
    return layout_and_order(gdef)[0]


def flatten_lines(gdef: GraphDef, lay: Layout | None = None) -> int:
    """About how many lines a flatten plan of ``gdef`` has (a line or more per place outside
    loops, one loop body per run of identical layers)."""
    lay = lay or layout(gdef)
    bulk = sum(len(gdef.records[j][2]) - 1 for j in lay.bulk)
    bodies = sum(r.places + 4 for runs in lay.runs.values() for r in runs)
    return 1 + lay.places - lay.looped_places - bulk + bodies


def unflatten_lines(gdef: GraphDef) -> int:
    """About how many lines an unflatten plan of ``gdef`` has."""
    lay = layout(gdef)
    bulk = sum(len(gdef.records[j][2]) - 1 for j in lay.bulk)
    bodies = sum(r.nodes + r.leaves + 4 for runs in lay.runs.values() for r in runs)
    straight = len(gdef.records) + gdef.num_leaves - lay.looped_records - lay.looped_leaves
    return straight - bulk + bodies


class _Extents(NamedTuple):
    start: list  # node -> (its first place, leaves and statics seen before it)
    end: list  # node -> (places, records, leaves, statics seen when the walk leaves it)
    refcount: list  # node -> its places
    leaf_places: list  # array -> its places
    bulk: frozenset
    order: list  # (parent, position, reference) for every place, in the walk's order


def _extents(gdef: GraphDef) -> _Extents | None:
    """Replays the walk on the records. In a walk's GraphDef an array or a node is met for
    the first time exactly when its index is the count of those met so far; a GraphDef
    numbered otherwise (an expansion's) gets None: no runs, no bulk reads."""
    records = gdef.records
    n = len(records)
    seen_leaf = bytearray(gdef.num_leaves)
    seen_node = bytearray(n)
    start: list = [None] * n
    end: list = [None] * n
    refcount = [0] * n
    leaf_places = [0] * gdef.num_leaves
    all_new = [True] * n  # every child an array seen there first
    order: list = [(-1, 0, gdef.root)]
    leaves = statics = nodes = 0
    p = 1
    stack: list[list[int]] = []
    tags, leaf, static = TAGS, LEAF, STATIC  # locals: read once per place below
    if gdef.root % TAGS == NODE:
        if gdef.root != node_ref(0):  # a walk numbers the root first
            return None
        refcount[0], start[0], nodes, seen_node[0] = 1, (0, 0, 0), 1, 1
        stack.append([0, 0])
    while stack:
        frame = stack[-1]
        j, i = frame
        refs = records[j][2]
        if i == len(refs):
            stack.pop()
            end[j] = (p, nodes, leaves, statics)
            continue
        frame[1] = i + 1
        r = refs[i]
        order.append((j, i, r))
        p += 1
        x, tag = divmod(r, tags)
        if tag == leaf:
            leaf_places[x] += 1
            if seen_leaf[x]:
                all_new[j] = False
            elif x != leaves:
                return None
            else:
                seen_leaf[x] = 1
                leaves += 1
            continue
        all_new[j] = False
        if tag == static:
            if x != statics:  # statics numbered by place, in walk order
                return None
            statics += 1
            continue
        refcount[x] += 1
        if not seen_node[x]:
            if x != nodes:
                return None
            seen_node[x] = 1
            start[x] = (p - 1, leaves, statics)
            nodes += 1
            stack.append([x, 0])
    kinds = (LIST, TUPLE, DICT)
    bulk = frozenset(
        j
        for j, (k, _, refs) in enumerate(gdef.records)
        if all_new[j] and k in kinds and len(refs) >= BULK_MIN
    )
    return _Extents(start, end, refcount, leaf_places, bulk, order)


def _element(gdef: GraphDef, ext: _Extents, j: int, key: tuple) -> tuple | None:
    """The layout of the subtree at node ``j`` (None if it cannot join a run): its
    records with references renumbered from its own first record, array and static."""
    if ext.refcount[j] != 1 or ext.start[j] is None:
        return None
    p0, lo, slo = ext.start[j]
    p1, ne, hi, shi = ext.end[j]
    if ne - j > MAX_ELEMENT_RECORDS:
        return None
    records, strict_records, strict_statics = gdef.records, key[2], key[3]
    inside = outside_places = 0
    tags, leaf, node = TAGS, LEAF, NODE  # locals: read once per reference below
    # Which of its own arrays have no other place in the whole graph (see flatten_loop).
    unique = _unique(gdef, ext, lo, hi)
    sig: list = [(ne - j, hi - lo, shi - slo, p1 - p0), unique]
    for jj in range(j, ne):
        kind, _, refs = records[jj]
        if kind not in LOOP_KINDS:
            return None
        if jj > j:
            outside_places += ext.refcount[jj]
        mapped = []
        for r in refs:
            x, tag = divmod(r, tags)  # split_ref's arithmetic, inline: once per reference
            if tag == leaf:
                mapped.append(("l", x - lo) if lo <= x < hi else ("L", x))
            elif tag == node:
                if j <= x < ne:
                    if x <= jj:  # back to a node above (a cycle), or shared inside: not looped
                        return None
                    inside += 1
                    mapped.append(("n", x - j))
                else:
                    mapped.append(("N", x))
            else:
                mapped.append(("s", strict_statics[x]))
        sig.append((kind, strict_records[jj][1], tuple(mapped)))
    if inside != outside_places:
        return None  # a node inside has a place outside
    return tuple(sig)


def _find(gdef: GraphDef) -> tuple[Layout, list | None]:
    records = gdef.records
    ext = _extents(gdef)
    if ext is None:
        return Layout({}, frozenset(), sum(len(rec[2]) for rec in records) + 1, 0, 0, 0), None
    key = gdef._key()
    runs: dict[int, tuple[Run, ...]] = {}
    looped = [0, 0, 0]  # places, records, leaves
    places = sum(len(rec[2]) for rec in records) + 1
    for q, (kind, _, refs) in enumerate(records):
        if places <= LOOP_PLACES or kind not in (LIST, TUPLE) or len(refs) < LOOP_MIN:
            continue
        found: list[Run] = []
        members: list[int] = []
        prev = None
        worth = _worth_comparing(ext, refs)
        for i, r in enumerate((*refs, None)):
            sig = _element(gdef, ext, r // TAGS, key) if i in worth else None  # a node's index
            if sig is not None and sig == prev:
                members.append(i)
                continue
            if len(members) >= LOOP_MIN:
                found.append(_run(gdef, ext, q, members, refs))
            members, prev = ([i], sig) if sig is not None else ([], None)
        if found:
            runs[q] = tuple(found)
            for run in found:
                looped[0] += run.count * run.places
                looped[1] += run.count * run.nodes
                looped[2] += run.count * run.leaves
    return Layout(runs, ext.bulk, places, *looped), ext.order


def _worth_comparing(ext: _Extents, refs: tuple) -> set[int]:
    """The positions of children that sit in a run of at least `LOOP_MIN` nodes first met
    there whose subtrees have the same sizes: only those are compared in full."""
    sizes = []
    tags, node = TAGS, NODE  # locals: read once per reference below
    for r in refs:
        j = r // tags
        if r % tags != node or ext.refcount[j] != 1 or ext.start[j] is None:
            sizes.append(None)
            continue
        p0, lo, slo = ext.start[j]
        p1, ne, hi, shi = ext.end[j]
        sizes.append((ne - j, hi - lo, shi - slo, p1 - p0))
    out: set[int] = set()
    i = 0
    while i < len(sizes):
        e = i + 1
        while e < len(sizes) and sizes[i] is not None and sizes[e] == sizes[i]:
            e += 1
        if sizes[i] is not None and e - i >= LOOP_MIN:
            out.update(range(i, e))
        i = e
    return out


def _unique(gdef: GraphDef, ext: _Extents, lo: int, hi: int) -> tuple[bool, ...]:
    """For arrays ``lo`` to ``hi``: whether each has no other place in the graph and is no
    state (an array below a state cell may be the very object of another such place)."""
    state = gdef.state_leaves()
    return tuple(ext.leaf_places[q] == 1 and not state[q] for q in range(lo, hi))


def _run(gdef: GraphDef, ext: _Extents, parent: int, members: list[int], refs: tuple) -> Run:
    _, j = split_ref(refs[members[0]])
    p0, lo, slo = ext.start[j]
    p1, ne, hi, shi = ext.end[j]
    unique = _unique(gdef, ext, lo, hi)
    return Run(parent, members[0], len(members), j, ne - j, lo, hi - lo, slo, shi - slo, p1 - p0, unique)


# ---------------------------------------------------------------- templates: a loop's own lines
# (the lines of each kind of node in its body are `emit.py`'s)

# Reading: the arrays first seen in the elements collected into R{k}, in walk order; the nodes
# that only their identity tells apart into TN (checked distinct with the plan's others).
READ_LOOP = """\
R{k} = []
rx{k} = R{k}.extend
ra{k} = R{k}.append
for x_ in {seq}[{start}:{end}]:"""
READ_STATIC = """\
xs = {expr}
if {unequal}: raise M"""
BIND = "{local} = {expr}"
COLLECT_ONE = "ra{k}({item})"
COLLECT = "rx{k}({items})"
COLLECT_NODES = "tn({items})"
# Building: the elements into B{k}, each from its own arrays and statics (strided slices).
BUILD_LOOP = """\
B{k} = []
ba{k} = B{k}.append
for {targets}, in zip({slices}, strict=True):"""
BUILD_LOOP_BARE = """\
B{k} = []
ba{k} = B{k}.append
for _ in range({count}):"""
BUILT = "ba{k}(yb0)"
CHECK_BUILT = "if len(B{k}) != {count}: raise AssertionError({bug!r})"


# A generated-code emitter (as `compile.compile_flatten`): one element's reading, each node by its emitter.
def flatten_loop(
    gdef: GraphDef, run: Run, k: int, seq: str, leaf: Callable[[int], str], const: Callable[[Any, str], str]
) -> tuple[list[str], int, bool]:
    """Lines reading the elements of ``run`` (the list or tuple in local ``seq``) into ``R{k}``
    (the arrays first seen in them, in walk order), and the nodes inside each element whose
    identity must be checked into ``TN``: the lines, how many such nodes per element, and
    whether the elements themselves must have their identities checked.

    A node holding (below it, in the element) an array of its own that has no other place in
    the graph needs no identity check: were it another place's object, that array would be
    read at two places, and the plan reads it as new at one of them, so the arrays' distinct
    check fails. A node without one is checked by identity."""
    records = gdef.records
    j0, lo, hi = run.first, run.lo, run.lo + run.leaves
    lines: list[str] = []
    Code(lines, " ", const).emit(READ_LOOP, k=k, seq=seq, start=run.start, end=run.start + run.count)
    code = Code(lines, "  ", const, prefix="x")  # locals xc0, xd0...: apart from the plan's
    emit = code.emit
    uses: dict[int, int] = {}
    for jj in range(j0, j0 + run.nodes):
        for tag, x in map(split_ref, records[jj][2]):
            if tag == LEAF:
                uses[x] = uses.get(x, 0) + 1
    new: list[str] = []
    bound: dict[int, str] = {}
    names = {j0: "x_"}
    tracked: list[str] = []  # nodes inside the element (the elements are checked as a slice)

    def enter(j: int, v: str) -> list:
        """Emit the checks of node ``j`` (in local ``v``); the expressions of its children."""
        kind, meta, refs = records[j]
        return EMITTERS[kind].read(code, v, meta, len(refs), str(j - j0))

    # The walk's order, depth first, so that arrays are collected in the order it numbers them.
    # A frame: [children's expressions, refs, next child, local, holds an own array that has
    # no other place in the graph, record].
    stack: list[list] = [[enter(j0, "x_"), records[j0][2], 0, "x_", False, j0]]
    top = stack[0]
    while stack:
        frame = stack[-1]
        exprs, refs, i = frame[:3]
        if i == len(refs):
            stack.pop()
            if frame[4] and stack:
                stack[-1][4] = True
            elif not frame[4] and stack and not untracked(records[frame[5]]):
                # A node holding no array of its own: nothing else tells it apart from
                # another place's object, so its identity is checked. (One holding an own
                # array cannot be another place's object: that array would then be read
                # twice, and the arrays are checked distinct.)
                tracked.append(frame[3])
            continue
        frame[2] = i + 1
        e = exprs[i]
        tag, x = split_ref(refs[i])
        if tag == STATIC:
            emit(READ_STATIC, expr=e, unequal=static_check("xs", gdef.statics[x], const))
        elif tag == LEAF and lo <= x < hi:
            if x in bound:
                emit(CHECK_SAME, expr=e, known=bound[x])
            elif uses[x] > 1:
                bound[x] = f"xe{x - lo}"
                emit(BIND, local=bound[x], expr=e)
                new.append(f"xe{x - lo}")
            else:
                bound[x] = e
                new.append(e)
            if run.unique[x - lo]:
                frame[4] = True
        elif tag == LEAF:
            emit(CHECK_SAME, expr=e, known=leaf(x))
        elif not j0 <= x < j0 + run.nodes:
            emit(CHECK_SAME, expr=e, known=f"n{x}")
        elif x in names:
            emit(CHECK_SAME, expr=e, known=names[x])
        else:
            names[x] = f"xy{x - j0}"
            emit(BIND, local=names[x], expr=e)
            stack.append([enter(x, names[x]), records[x][2], 0, names[x], False, x])
    if len(new) == 1:
        emit(COLLECT_ONE, k=k, item=new[0])
    elif new:
        emit(COLLECT, k=k, items=tup(new))
    if tracked:
        emit(COLLECT_NODES, items=tup(tracked))
    return lines, len(tracked), not top[4]


# A generated-code emitter (as `compile.compile_unflatten`): one element's construction, each node by
# its emitter.
def unflatten_loop(gdef: GraphDef, run: Run, k: int, const: Callable[[Any, str], str]) -> list[str]:
    """Lines building the elements of ``run`` into the list ``B{k}``, in order."""
    records = gdef.records
    j0, lo, hi, slo = run.first, run.lo, run.lo + run.leaves, run.slo
    # Each element's own arrays and statics: one strided slice per position in the element.
    own = [f"L[{lo + i}:{lo + i + run.count * run.leaves}:{run.leaves}]" for i in range(run.leaves)]
    own += [f"S[{slo + i}:{slo + i + run.count * run.statics}:{run.statics}]" for i in range(run.statics)]
    lines: list[str] = []
    head = Code(lines, " ", const)
    if own:
        targets = [f"lv{i}" for i in range(run.leaves)] + [f"sv{i}" for i in range(run.statics)]
        head.emit(BUILD_LOOP, k=k, targets=", ".join(targets), slices=", ".join(own))
    else:
        head.emit(BUILD_LOOP_BARE, k=k, count=run.count)
    code = Code(lines, "  ", const)
    names: dict[int, str] = {}

    def ref(r: int) -> str:
        tag, x = split_ref(r)
        if tag == LEAF:
            return f"lv{x - lo}" if lo <= x < hi else f"L[{x}]"
        if tag == STATIC:
            return f"sv{x - slo}"
        return names[x] if j0 <= x < j0 + run.nodes else f"n{x}"

    def args(refs: tuple) -> str:
        return tup([ref(r) for r in refs])

    # Post order (children first); the element has no cycle, so no shells are needed.
    stack: list[tuple[int, bool]] = [(j0, False)]
    while stack:
        j, ready = stack.pop()
        if j in names:
            continue
        kind, meta, refs = records[j]
        inner = [x for tag, x in map(split_ref, refs) if tag == NODE and j0 <= x < j0 + run.nodes]
        if not ready:
            stack.append((j, True))
            stack.extend((c, False) for c in reversed(inner) if c not in names)
            continue
        y = names[j] = f"yb{j - j0}"
        EMITTERS[kind].whole(code, y, meta, refs, args, ref)
    code.emit(BUILT, k=k)
    head.emit(CHECK_BUILT, k=k, count=run.count, bug=_LOOP_BUG)
    return lines
