"""What must not escape a tied transform: traced values left in objects that outlive the trace.

Three scopes, each a thread-local stack the transforms open around a traced call:

* the copy a tied transform writes back itself (`own_copy`: `tied.grad`'s copy of the model,
  whose undifferentiated cells hold concrete arrays), so that a write into it from a lifted
  transform inside the loss is not taken for one into an object outside the trace
  (`escaping_tracer`, `write_back_checked`);
* the static arguments of `tied.jit` and `tied.remat`, the caller's own objects, passed as they
  are into the traced function: a write into one is refused and put back, and no tracer is
  left in one, checked (`static_snapshot`, `refuse_static_writes`);
* the copies a plain JAX transform rebuilt from a `tied.Graph` inside a tied transform
  (`copy_scope`, `note_copy`, `note_carried`): state written on one and not carried out would be
  dropped (`refuse_dropped`).

(The third scope of the house, that of run-time checks, is `checks.py`'s.) It imports `_core`
only, and is imported by `grad`, `jit`, `lift`, `lifted`, `checks` and `implicit`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Any

import jax
import numpy as np

from .._core import (
    GraphDef,
    GraphError,
    first_difference,
    flatten,
    live_lock,
    node_objects,
    slots,
    walkable_below,
    write,
    write_back,
)
from .writes import place_name

__all__ = [
    "CopyScope",
    "copy_scope",
    "escaping_tracer",
    "first_trace",
    "note_carried",
    "note_copy",
    "own_copy",
    "refuse_dropped",
    "refuse_new_static_arrays",
    "static_record",
    "refuse_static_ties",
    "refuse_static_writes",
    "static_snapshot",
    "trace_of",
    "write_back_checked",
]


def write_back_checked(
    root: Any, gdef: GraphDef, written: tuple, values: list, action: str, inputs: list, who: str
) -> None:
    """`write_back` for a transform that ran ``who`` ("the loss", "the function") on a copy:
    first a value traced by a transform that encloses the caller's objects (they are not
    traced themselves) is refused, since it would stay in them as a dead traced value.
    `tied.jit` does not ask: inside another tied transform its arguments may be that
    transform's concrete copy (a state cell `tied.grad` does not differentiate), which the
    enclosing transform writes back itself."""
    escaping = escaping_tracer(gdef, inputs, written, values, who, "nothing was written", root)
    if escaping is not None:
        raise escaping
    write_back(root, gdef, written, values, action, inputs, name=place_name)


def escaping_tracer(
    gdef: GraphDef, leaves: list, at: Any, values: list, who: str, after: str, root: Any = None
):
    """The error for state computed inside an enclosing transform that would be written into
    a model living outside it (where it would stay a dead traced value), or None. ``leaves``
    are the model's arrays before the call, ``at`` the indices written, ``who`` what wrote
    ("the loss", "fun") and ``after`` what became of the model. Given ``root`` (the objects
    written into), a place inside the copy an enclosing tied transform made in that value's
    trace (`own_copy`: `tied.grad`'s copy, whose undifferentiated cells hold concrete arrays) is
    not outside: that transform carries the value out and writes it back itself."""
    owned = None
    for q, v in zip(at, values):
        if isinstance(v, jax.core.Tracer) and not isinstance(leaves[q], jax.core.Tracer):
            if root is not None:
                if owned is None:
                    owned = _Owned(root, gdef)
                if owned.holds(q, v):
                    continue
            return GraphError(
                f"{who} wrote state computed inside an "
                "enclosing transform (jax.vmap, jax.jit, tied.jit over a function that captures "
                f"the model) into a model that lives outside it, where it would stay a dead traced "
                f"value; {after}. Pass the model as an argument of the transform "
                "(tied.jit(step)(model, x)), or compute the state update outside it (an object "
                "made inside tied.grad's loss counts as outside: make it before and pass it in).",
                gdef.leaf_paths()[q][0],
            )
    return None


# ---------------------------------------------------------------- copies a tied transform writes back itself
#
# `tied.grad` runs the loss on a copy of the model built inside its trace; a cell it does not
# differentiate holds the caller's concrete array there, so "the array given was concrete" does
# not tell a place of that copy (which `tied.grad` carries out and writes back) from a place of
# an object outside the trace (where a traced value would stay dead). The copy is registered
# with the trace it was built in; a lifted transform inside the loss asks whether the places it
# writes are the copy's, by object, and the value is of that very trace.

_owners = threading.local()


def trace_of(x: Any) -> Any:
    """The JAX trace a tracer belongs to (JAX keeps it in the private ``_trace``), None for
    anything else."""
    return getattr(x, "_trace", None) if isinstance(x, jax.core.Tracer) else None


def first_trace(leaves: Any) -> Any:
    """The trace of the first tracer among ``leaves``, or None."""
    return next((t for t in map(trace_of, leaves) if t is not None), None)


@contextlib.contextmanager
def own_copy(copy: Any, gdef: GraphDef, leaves: list):
    """While the body runs, ``copy`` (a model an enclosing tied transform built inside its trace,
    of structure ``gdef`` and arrays ``leaves``, which that transform writes back itself) may
    receive values of its trace (its traced leaves') or of the traces of copies registered
    around it. Its node objects are taken now, before the body can put other objects into it,
    and only where a leaf is concrete (no place of a copy traced throughout is ever asked)."""
    trace = first_trace(leaves)
    needed = trace is not None and not all(isinstance(x, jax.core.Tracer) for x in leaves)
    stack = _owners.__dict__.setdefault("stack", [])
    stack.append((node_objects(gdef, copy) if needed else [], trace))
    try:
        yield
    finally:
        stack.pop()


class _Owned:
    """Which places of ``root`` lie in a copy registered by `own_copy` (read only when asked)."""

    def __init__(self, root: Any, gdef: GraphDef):
        self.root, self.gdef = root, gdef
        self.parents: dict[int, list[int]] | None = None
        self.objs: list = []

    def holds(self, q: int, v: Any) -> bool:
        """Whether every place of unique array ``q`` sits in a node of one copy registered by
        `own_copy`, and ``v`` is a tracer of that copy's trace or of the trace of a copy
        registered around it (a trace the copy lives in), with no plain transform in between."""
        trace = trace_of(v)
        stack = getattr(_owners, "stack", None)
        if trace is None or not stack:
            return False
        if self.parents is None:
            self.parents = {}
            for p in self.gdef.walk_places(paths=False):
                if p.kind == "array":
                    self.parents.setdefault(p.index, []).append(p.parent)
            self.objs = node_objects(self.gdef, self.root)
        at = [self.objs[j] if j >= 0 else None for j in self.parents.get(q, [])]
        if not at or any(x is None for x in at):
            return False
        for k, (nodes, _) in enumerate(stack):
            ids = {id(x) for x in nodes}
            if all(id(x) in ids for x in at):  # the copy holding the places, and the traces around it
                return any(t is trace for _, t in stack[: k + 1])
        return False


def static_snapshot(statics: tuple, kw_static: tuple) -> tuple[list, list]:
    """What the static arguments of a call (``(position, value)``, ``(name, value)``) hold
    before it runs: ``(path, object, arrays, GraphDef)`` for each graph tied can walk in them
    that holds arrays, found through unregistered objects too (``path`` is its place in
    ``(args, kwargs)``), and the arguments themselves ``(path, value)``."""
    parts = []
    named = [(f"[0][{i}]", v) for i, v in statics] + [(f"[1][{k!r}]", v) for k, v in kw_static]
    named = _through_callables(named)  # a static callable: what it holds
    holders: list = []
    for path, v in named:
        for sub, x in walkable_below(v, holders):
            try:
                leaves, gdef = flatten(x)
            except GraphError:  # not a graph tied walks: looked at again for tracers after the call
                continue
            if leaves:
                parts.append((path + sub, x, leaves, gdef))
    fields = [(h, dict(h.__dict__)) for h in holders if isinstance(getattr(h, "__dict__", None), dict)]
    return parts, named, fields


def _through_callables(named: list) -> list:
    """``named`` with each static callable replaced by what it holds: a bound method's object,
    a ``functools.partial``'s function and arguments, a function's closure cells and defaults
    (the compiled function reads them as constants, and may write into them, as into any
    static argument). Iterative and identity-memoised, so a function that refers to itself ends."""
    out: list = []
    seen: dict[int, Any] = {}  # id -> object, held so that ids stay unique
    stack = list(reversed(named))
    while stack:
        path, v = stack.pop()
        held = _held_by_callable(v)
        if held is None:
            out.append((path, v))
        elif id(v) not in seen:
            seen[id(v)] = v
            stack.extend(reversed([(path + p, x) for p, x in held]))
    return out


def _held_by_callable(v: Any) -> list | None:
    """What a bound method, a partial or a Python function holds, with paths; None for
    anything else."""
    if isinstance(v, types.MethodType):
        return [(".__self__", v.__self__), (".__func__", v.__func__)]
    if isinstance(v, functools.partial):
        return [(".func", v.func), (".args", v.args), (".keywords", v.keywords)]
    if isinstance(v, types.FunctionType):
        held = [(".__defaults__", v.__defaults__ or ()), (".__kwdefaults__", v.__kwdefaults__ or {})]
        for i, cell in enumerate(v.__closure__ or ()):
            try:
                held.append((f".__closure__[{i}].cell_contents", cell.cell_contents))
            except ValueError:  # an empty cell (a name not yet bound)
                pass
        return held
    return None


def refuse_static_ties(
    held: tuple,
    root: Any,
    gdef: GraphDef,
    who: str,
    what: str = "a static argument (static_argnums / static_argnames)",
) -> None:
    """Refuse, before the call, a node (a state cell, a layer) held both by an argument passed
    as it is (``held`` from `static_snapshot`; ``what`` says which) and by the traced arguments
    (``root``, whose flatten gave ``gdef``): inside the transform the traced one is a rebuilt
    copy and the other the caller's object, so a write through one would silently not be seen
    through the other."""
    shared = {}  # id -> (path, object) of each mutable node the untraced arguments hold
    for path, x, _, g in held[0]:
        objs = None
        for p in g.walk_places():
            if p.kind in ("array", "static", "tuple", "namedtuple") or not p.first:
                continue  # an immutable node shared is one value either way
            objs = node_objects(g, x) if objs is None else objs
            if objs[p.index] is not None:
                shared.setdefault(id(objs[p.index]), (path + p.path, objs[p.index]))
    if not shared:
        return
    for o in node_objects(gdef, root):
        if o is not None and shared.get(id(o), (None, None))[1] is o:
            raise GraphError(
                f"{who}: this object is held by {what} and by a traced argument; inside the "
                "transform they would be two objects (the traced one a rebuilt copy), so a write "
                "through one would not be seen through the other. Nothing was run. Pass it "
                "through the traced argument only.",
                shared[id(o)][0],
                name=place_name,
            )


def static_record(parts: list) -> list:
    """What `refuse_new_static_arrays` compares later calls with: the graphs `static_snapshot`
    found in the static arguments (``parts``), each with a copy of its numpy arrays' values
    (a numpy array can be changed in place, keeping its identity)."""
    return [
        (path, x, leaves, gdef, {q: a.copy() for q, a in enumerate(leaves) if isinstance(a, np.ndarray)})
        for path, x, leaves, gdef in parts
    ]


def refuse_new_static_arrays(traced: list | None, now: list, who: str = "tied.jit") -> None:
    """Refuse a call whose static arguments hold other arrays than when the function was
    traced (``traced``: `static_record` of that call's; ``now``: the graphs `static_snapshot`
    finds in this call's, ``(path, object, arrays, GraphDef)``), or a numpy array there whose
    values changed in place. A static argument is a constant of the compiled function: a state
    cell set between two calls, or an equal argument holding other arrays, would be silently
    read as it was. ``traced`` holds the arrays it names, so an id is never reused."""
    if traced is None:
        return
    was = {path: (leaves, gdef, copies) for path, _, leaves, gdef, copies in traced}
    for path, _, leaves, gdef in now:
        old = was.pop(path, None)
        if old is None:
            raise _new_static(who, "this static argument now holds arrays here", path)
        if old[1] != gdef:
            inner, how = first_difference(old[1], gdef)
            raise _new_static(who, how, path + inner)
        for q, (a, b) in enumerate(zip(old[0], leaves)):
            if a is not b:
                raise _new_static(who, "this array was replaced", path + gdef.leaf_paths()[q][0])
        for q, values in old[2].items():
            if not np.array_equal(values, leaves[q], equal_nan=values.dtype.kind in "fc"):
                raise _new_static(
                    who, "this numpy array was changed in place", path + gdef.leaf_paths()[q][0]
                )
    if was:
        raise _new_static(who, "this static argument no longer holds its arrays here", next(iter(was)))


def _new_static(who: str, how: str, path: str) -> GraphError:
    return GraphError(
        f"{how}, since the function was compiled with this static argument (static_argnums / "
        "static_argnames), or an equal argument holding other arrays was passed. "
        f"{who} makes a static argument a constant of the compiled function (its arrays "
        "are read once, when it is traced), so the new value would be silently ignored. Nothing "
        "was run. Pass the object as a traced argument (leave it out of static_argnums), or keep "
        "the arrays of a static argument as they were.",
        path,
        name=place_name,
    )


def refuse_static_writes(held: tuple[list, list, list], name: Any = None, who: str = "tied.jit") -> None:
    """Refuse a function that wrote into a static argument (``held`` from `static_snapshot`),
    after putting back what it held where that can be done: a static argument is the
    caller's own object, passed as it is into the traced function (and, for `tied.jit`, a
    constant of the compiled function), so what the function put there would stay a traced
    value, and a later call (which does not trace) would not write it at all. After it, no
    static argument holds a tracer it did not hold before, checked."""
    name = name or place_name
    parts, named, fields = held
    for path, v, leaves, gdef in parts:
        try:
            now, now_gdef = flatten(v)
        except GraphError as e:  # made unwalkable: say where it was written, all the same
            now, now_gdef = [], e
        if now_gdef == gdef:
            changed = [q for q, (a, b) in enumerate(zip(leaves, now)) if a is not b]
            if not changed:
                continue
            at_path, how = path + gdef.leaf_paths()[changed[0]][0], "the function wrote a new value here"
            try:
                with live_lock:
                    at = slots(v, gdef, changed, action=who, frozen_ok=True)
                    write(at, [leaves[q] for q in changed])
                undone = "it was put back as it was"
            except GraphError:
                undone = "it could not be put back: assign arrays to those places again"
        else:
            if isinstance(now_gdef, GraphError):
                at_path, how = path, f"the function changed this argument ({now_gdef})"
            else:
                inner, how = first_difference(gdef, now_gdef)
                at_path = path + inner
            undone = "that change could not be undone: build the argument again"
        raise _static_write(who, how, undone, at_path, name)
    before = {id(x): x for _, _, leaves, _ in parts for x in leaves}
    for path, v in named:
        at = _new_tracer(v, before)
        if at is not None:
            for h, d in fields:  # the fields of unregistered objects, as they were
                now = h.__dict__
                if len(now) != len(d) or any(now.get(k, now) is not x for k, x in d.items()):
                    now.clear()
                    now.update(d)
            undone = "it could not be put back" if _new_tracer(v, before) else "it was put back as it was"
            raise _static_write(who, "the function put a traced value here", undone, path + at, name)


def _new_tracer(v: Any, before: dict) -> str | None:
    """The path in ``v`` of a tracer not among ``before`` (by identity), or None."""
    for sub, x in walkable_below(v):
        if isinstance(x, jax.core.Tracer):
            if before.get(id(x)) is not x:
                return sub
            continue
        try:
            leaves, gdef = flatten(x)
        except GraphError:
            continue
        for q, y in enumerate(leaves):
            if isinstance(y, jax.core.Tracer) and before.get(id(y)) is not y:
                return sub + gdef.leaf_paths()[q][0]
    return None


def _static_write(who: str, how: str, undone: str, at_path: str, name: Any) -> GraphError:
    return GraphError(
        f"{how}, in an argument given as static (static_argnums / static_argnames); {undone}. "
        f"{who} passes a static argument as it is into the traced function (tied.jit: as a "
        "constant of the compiled function): a value written into it would stay a traced value "
        "in your object (and under tied.jit a later call, which does not trace again, would write "
        f"nothing). Pass the argument as a traced one (leave it out of static_argnums), so that "
        f"{who} writes its new values back after each call.",
        at_path,
        name=name,
    )


# ---------------------------------------------------------------- writes a plain JAX transform would drop
#
# `tied.Graph(m)` hands a model to any JAX function, which rebuilds it (``.value``) from its
# own tracers inside a body (jax.lax.scan, jax.vmap, jax.checkpoint, jax.lax.cond). State
# written on that copy stays there unless the body carries the copy out, and a body that
# closes over the model writes tracers of a finished transform into it. The enclosing tied
# transform (`tied.jit`, `tied.grad`) opens a scope; `Graph` reports the copies JAX rebuilt and
# the graphs made from tracers (carried out); the scope's owner refuses what was dropped.

_scopes = threading.local()


class CopyScope:
    """The copies a plain JAX transform rebuilt inside one tied transform, and the arrays
    carried out of bodies (kept alive, so an id is never reused while the scope lives)."""

    __slots__ = ("copies", "carried")

    def __init__(self):
        self.copies: list = []
        self.carried: dict[int, Any] = {}


@contextlib.contextmanager
def copy_scope():
    """Open a scope in which `note_copy` and `note_carried` record (one per traced call)."""
    stack = _scopes.__dict__.setdefault("stack", [])
    scope = CopyScope()
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()


def note_copy(value: Any, gdef: GraphDef, leaves: list) -> None:
    """A graph JAX rebuilt from tracers (a `Graph`'s ``.value`` inside a body), as it was."""
    stack = getattr(_scopes, "stack", None)
    if stack:
        stack[-1].copies.append((value, gdef, list(leaves)))


def note_carried(leaves: list) -> None:
    """Arrays a `Graph` made from tracers holds: what a body carries out of a transform."""
    stack = getattr(_scopes, "stack", None)
    if stack:
        stack[-1].carried.update((id(x), x) for x in leaves)


def refuse_dropped(
    scope: CopyScope, gdef: GraphDef, written: Any, leaves: list, who: str, name: Any = None
) -> None:
    """Raise what `dead_tracer` or `dropped_write` finds for a traced call of a tied transform
    that wrote ``written`` (its new values the last ``len(written)`` of ``leaves``, the arrays
    it returns or writes back)."""
    new = leaves[len(leaves) - len(written) :]
    error = dead_tracer(gdef, written, new, who, name) or dropped_write(scope, leaves, who)
    if error is not None:
        raise error


def dropped_write(scope: CopyScope, kept: list, who: str) -> GraphError | None:
    """The error for state written on a copy JAX rebuilt and not carried out of its body
    (not in a `Graph` made from it, nor among ``kept``: the arrays the tied transform
    returns or writes back), or None."""
    carried = dict(scope.carried)
    carried.update((id(x), x) for x in kept)
    for value, gdef, leaves in scope.copies:
        try:
            now, now_gdef = flatten(value)
        except GraphError:
            continue
        if now_gdef != gdef:
            continue
        state = gdef.state_leaves()
        for q, (a, b) in enumerate(zip(now, leaves)):
            if a is not b and state[q] and carried.get(id(a)) is not a:
                return GraphError(
                    f"tied.Graph(...).value{gdef.leaf_paths()[q][0]}: {who}: state was written on a "
                    "copy of a model that a plain JAX transform (jax.lax.scan, jax.vmap, "
                    "jax.checkpoint, jax.lax.cond) rebuilt from a tied.Graph, and the copy was not "
                    "carried out of that transform, so the write would be silently dropped. Nothing "
                    "was written into your objects. Use the tied transform, which carries state "
                    "writes out: tied.scan over a tied.stack of the layers, tied.vmap, tied.remat; "
                    "or return tied.Graph(copy) from the body and write its state back yourself."
                )
    return None


def dead_tracer(gdef: GraphDef, written: Any, values: list, who: str, name: Any = None) -> GraphError | None:
    """The error for a new value that is a tracer of a transform that has finished (state a
    body that closes over the model wrote into it), or None."""
    for q, v in zip(written, values):
        if isinstance(v, jax.core.Tracer) and not _live(v):
            path = (name or place_name)(gdef.leaf_paths()[q][0])
            return GraphError(
                f"{path}: {who}: state was written inside a plain JAX transform (jax.checkpoint, "
                "jax.vmap, jax.lax.scan, jax.lax.cond) whose function closes over the model: the "
                "new value is a tracer of that finished transform and cannot leave it. Nothing was "
                "written into your objects. Use tied.remat, tied.vmap or tied.scan, which take the "
                "model as an argument and carry its state writes out (for tied.scan, hold the object "
                "in every stacked member, where it is broadcast, instead of closing over it)."
            )
    return None


def _live(tracer: Any) -> bool:
    """Whether ``tracer`` belongs to the trace running now or one it runs inside. JAX keeps
    no public answer (a finished jax.checkpoint's trace still says it is valid), so the
    chain of running traces is read through JAX's private ``trace_ctx``; where it cannot
    be read to its end, the tracer counts as live (never a false refusal)."""
    trace = getattr(tracer, "_trace", None)
    is_valid = getattr(trace, "is_valid", None)
    if is_valid is not None and not is_valid():
        return False
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover - JAX moved its internals
        return True
    cur = getattr(getattr(core, "trace_ctx", None), "trace", None)
    for _ in range(1000):
        if cur is None:
            return True
        if cur is trace:
            return True
        parent = getattr(cur, "parent_trace", None)
        if parent is None:
            return not isinstance(cur, getattr(core, "EvalTrace", ()))  # the chain's end
        cur = parent
    return True
