"""What a call does to the objects it was given: new values written back, changes refused.

`tied.jit` (and `tied.grad` for its loss) runs a function on a rebuilt copy of its
arguments; afterwards the copy is compared with what was given. New values at
existing places are written into the caller's own objects (through `_live`); a
change of structure is refused by path; a donated argument that is not handed
back stays usable (donation itself is `tied.jit`'s, in `_transforms/jit.py`).
Core layer: it reads GraphDefs by name only.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any

import jax

from .classify import walkable_below
from .errors import ModelChangedError, where
from .graph import (
    CHECK_PLANS,
    GraphDef,
    GraphError,
    PlanMismatch,
    StateClash,
    flatten,
    flatten_with,
    place_paths,
)
from .live import WritePlan, live_lock, slots, write, write_plan
from .plans import compile_flatten
from .read import node_objects


def first_difference(before: GraphDef, after: GraphDef) -> tuple[str, str]:
    """``(path, how)``: the place where two structures first differ, and how (for a write-back
    refusal)."""
    a = list(before.walk_places())
    b = list(after.walk_places())
    meta = None
    for p, q in zip(a, b):
        if p.path != q.path:
            return min(p.path, q.path), "a place was added or removed there"
        if p.kind != q.kind:
            return p.path, f"a {p.kind} became a {q.kind}"
        if p.type is not q.type:
            return p.path, f"a {p.type.__name__} became a {q.type.__name__}"
        if meta is None and p.kind not in ("array", "static") and p.first and q.first:
            if before._node_key(p.index) != after._node_key(q.index):  # named if nothing else differs
                meta = p.path, "its keys or fields, their order or their types changed"
        if p.first != q.first or p.index != q.index:
            return p.path, "the sharing changed there (a tie was cut or made)"
        if p.kind == "static" and before.statics[p.index] is not after.statics[q.index]:
            return p.path, "a static value changed"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return longer[min(len(a), len(b))].path, "a place was added or removed there"
    return meta or ("", "the structure changed")


_REBIND = (
    "Build and return a new model instead (tied.replace, tied.tie and tied.optim.update return new "
    "graphs) and rebind it, or make the change outside the compiled function."
)


def structure_error(
    before: GraphDef,
    after: GraphDef,
    who: str,
    *,
    out_of: str = "a compiled function",
    advice: str = _REBIND,
    name: Any = None,
) -> GraphError:
    """The refusal of a call that changed an argument's structure, at the first difference:
    ``who`` changed it, which cannot be carried ``out_of`` what ran; ``advice`` says what to do
    instead; ``name`` shows the path as the caller knows it (by default `tied.jit`'s ``args[0]...``)."""
    path, how = first_difference(before, after)
    return GraphError(
        f"{how}. {who} changed the structure of an argument (a tie cut, an attribute added or "
        f"removed, a static changed), which cannot be carried out of {out_of}; nothing was "
        f"written into your objects. {advice}",
        path,
        name=name or place_name,
    )


def write_back(
    root: Any,
    gdef: GraphDef,
    written: tuple,
    values: list,
    action: str,
    inputs: list | None = None,
    who: str | None = None,
) -> None:
    """Put ``values[n]`` at every place of unique leaf ``written[n]`` in the caller's objects:
    one write per unique container, under `tied.live_lock`. Every place is found (by the
    `WritePlan` kept on ``gdef`` for these leaves, else by `slots`) and checked before
    anything is written: writable, and, given ``inputs`` (the leaves flattened before the
    call), the arguments still of the structure and arrays the call was given, so a model
    changed while the call ran (by another thread, or a callback inside it) is refused,
    never half-updated. Given ``who`` (what wrote: "the loss"), a value traced by a transform
    that encloses the caller's objects (they are not traced themselves) is refused too: it
    would stay in them as a dead traced value. `tied.jit` does not ask: inside another tied
    transform its arguments may be that transform's concrete copy (a state cell `tied.grad`
    does not differentiate), which the enclosing transform writes back itself."""
    if who is not None and inputs is not None:
        escaping = escaping_tracer(gdef, inputs, written, values, who, "nothing was written", root)
        if escaping is not None:
            raise escaping
    with live_lock:
        if inputs is not None and _fused(root, gdef, written, values, inputs, action):
            return
        if inputs is not None:  # every place still holds what the call was given, or nothing
            _unchanged_since_the_call(root, gdef, inputs, written, action)
        plan = gdef.memo.write_plans.get((written, True))
        if isinstance(plan, WritePlan):  # the plan's way: no slots made
            if CHECK_PLANS:  # the plan's places compared with slots'
                _find(root, gdef, written, action)
            if plan.write(root, values):
                return
        write(_find(root, gdef, written, action), values)


def _fused(root: Any, gdef: GraphDef, written: tuple, values: list, inputs: list, action: str) -> bool:
    """The re-check and the writes in one generated function (`compile_flatten` given the
    `WritePlan`'s places), once the structure has its flatten plan and its write plan;
    False where there is none, or where it misses, having written nothing (the caller
    then checks and writes its way, and names what changed). Under ``TIED_CHECK_PLANS=1``
    its verdict is compared with `_unchanged_since_the_call`'s, and every place `slots`
    finds must hold its new value after it wrote."""
    memo = gdef.memo
    fused = memo.write_backs.get(written)
    if fused is None:
        plan = memo.write_plans.get((written, True))
        if not isinstance(plan, WritePlan) or not memo.flatten_plan or len(inputs) != gdef.num_leaves:
            return False
        fused = memo.write_backs[written] = compile_flatten(gdef, writes=plan.writes) or False
    if not fused:
        return False
    if not CHECK_PLANS:
        return fused(root, inputs, values) is not None
    try:
        _unchanged_since_the_call(root, gdef, inputs, written, action)
        changed = None
        at = _find(root, gdef, written, action)
    except GraphError as e:
        changed = e
    wrote = fused(root, inputs, values) is not None
    if changed is not None:
        if wrote:
            raise PlanMismatch(f"a compiled write-back wrote into a model changed during the call: {changed}")
        raise changed
    if not wrote:
        raise PlanMismatch(f"a compiled write-back missed on a model of its own structure ({gdef})")
    if any(slot.get() is not v for places, v in zip(at, values) for slot in places):
        raise PlanMismatch(f"a compiled write-back wrote other places than slots finds ({gdef})")
    return True


def _find(root: Any, gdef: GraphDef, written: tuple, action: str) -> list:
    try:
        return find_places(root, gdef, written, action=action, frozen_ok=True)
    except GraphError as e:
        raise (e if e.path is None else e.named(place_name)) from None


def _unchanged_since_the_call(root: Any, gdef: GraphDef, inputs: list, written: tuple, action: str) -> None:
    """Refuse, before anything is written, a model whose structure or arrays changed while
    the call ran (a host callback inside it, another thread without the live_lock): written into,
    a shared node replaced at one of its places by a look-alike would be cut from its tie."""
    now, now_gdef = flatten(root)  # a plan's work: the structure is the one just flattened
    if now_gdef is not gdef and now_gdef != gdef:
        path, how = first_difference(gdef, now_gdef)
        raise ModelChangedError(
            f"{how}. {action}: the arguments' structure changed while "
            "the call ran (another thread, or a callback inside the function, assigned to the "
            "model), so its new values have no sure place to go. Nothing was written. Change the "
            "model between calls, or under tied.live_lock.",
            path,
            name=place_name,
        )
    if len(now) != len(inputs) or any(map(operator.is_not, now, inputs)):
        changed = [k for k, (a, b) in enumerate(zip(now, inputs)) if a is not b]
        q = next((k for k in written if k in set(changed)), changed[0])  # a written place first
        raise _changed_error(place_paths(gdef).leaves[q][0], action)


def _changed_error(path: str, action: str) -> ModelChangedError:
    return ModelChangedError(
        f"{action}: this place was changed while the call ran (another "
        "thread, or a callback inside the function, assigned to the model), so the new value "
        "has no place to go. Nothing was written. Change the model between calls, or under "
        "tied.live_lock.",
        path,
        name=place_name,
    )


def find_places(root: Any, gdef: GraphDef, which: tuple, *, action: str, frozen_ok: bool) -> list:
    """`slots(root, gdef, which, ...)`, through a `WritePlan` kept on ``gdef`` per ``which``
    made by the first `slots` run. ``gdef`` is that of a flatten of ``root`` just taken.
    Under ``TIED_CHECK_PLANS=1`` the plan's slots are compared with `slots`' (a difference,
    or a plan that gives up on a model of its own GraphDef, is a `PlanMismatch`)."""
    key = (which, frozen_ok)
    plan = gdef.memo.write_plans.get(key)
    if plan is None:
        at, plan = write_plan(root, gdef, which, action=action, frozen_ok=frozen_ok)
        gdef.memo.write_plans[key] = _NO_PLAN if plan is None else plan
        return at
    if plan is _NO_PLAN:
        return slots(root, gdef, which, action=action, frozen_ok=frozen_ok)
    at = plan.find(root)
    if CHECK_PLANS:
        _check_places(at, slots(root, gdef, which, action=action, frozen_ok=frozen_ok), gdef)
    if at is None:
        return slots(root, gdef, which, action=action, frozen_ok=frozen_ok)
    return at


_NO_PLAN = object()  # this structure needs what only `slots` decides: never planned


def _check_places(fast: Any, slow: list, gdef: GraphDef) -> None:
    if fast is None:
        raise PlanMismatch(f"a write plan gave up on a model of its own structure ({gdef})")
    same = len(fast) == len(slow) and all(
        len(a) == len(b)
        and all(
            type(x) is type(y)
            and x.path == y.path
            and x._obj is y._obj
            and x._i == y._i
            and x._meta == y._meta
            for x, y in zip(a, b)
        )
        for a, b in zip(fast, slow)
    )
    if not same:
        raise PlanMismatch(f"a write plan disagrees with the walk of the model ({gdef})")


def place_name(path: str) -> str:
    """A path of ``(args, kwargs)`` written as ``args[0].embed.weight`` or ``kwargs['x']``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return where(path)


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


def flatten_arguments(root: Any, cache: Any = None) -> tuple[list, GraphDef]:
    """`flatten` of a call's ``(args, kwargs)`` (with the plans of ``cache``), a `StateClash`
    naming its places as the arguments (``args[0]['w']``), as `tied.grad` names the model's."""
    try:
        return flatten(root) if cache is None else flatten_with(root, cache)
    except StateClash as e:
        raise e.named(place_name) from None


def static_snapshot(statics: tuple, kw_static: tuple) -> tuple[list, list]:
    """What the static arguments of a call (``(position, value)``, ``(name, value)``) hold
    before it runs: ``(path, object, arrays, GraphDef)`` for each graph tied can walk in them
    that holds arrays, found through unregistered objects too (``path`` is its place in
    ``(args, kwargs)``), and the arguments themselves ``(path, value)``."""
    parts = []
    named = [(f"[0][{i}]", v) for i, v in statics] + [(f"[1][{k!r}]", v) for k, v in kw_static]
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
