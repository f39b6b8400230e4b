"""What a call does to the objects it was given: donation, and writing new values back.

`tied.jit` (and `tied.grad` for its loss) runs a function on a rebuilt copy of its
arguments; afterwards the copy is compared with what was given. New values at
existing places are written into the caller's own objects (through `_live`); a
change of structure is refused by path; a donated argument that is not handed
back stays usable. Core layer: it reads GraphDefs by name only.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any

import jax

from ._graph import CHECK_PLANS, GraphDef, GraphError, PlanMismatch, flatten, place_paths
from ._live import WritePlan, lock, slots, write, write_plan
from ._plan import compile_flatten


def arguments(gdef: GraphDef, n_args: int, kw_order: tuple) -> list[set]:
    """For each unique leaf of ``(args, kwargs)``, the arguments (an int position or a str
    keyword) holding it at any place, below shared nodes too. The root is the pair, so the
    places at depth 2 are the arguments themselves, in order (kwargs in the dict's order)."""
    owners: list[set] = [set() for _ in range(gdef.num_leaves)]
    names = [None, list(range(n_args)), sorted(kw_order)]
    side = arg = None
    count = [0, 0, 0]
    for place in gdef.walk_places(expand_shared=True, cut_cycles=True):
        if place.depth == 1:
            side = 1 if count[0] == 0 else 2
            count[0] += 1
            continue
        if place.depth == 2:
            arg = names[side][count[side]]
            count[side] += 1
        if place.depth >= 2 and place.kind == "array":
            owners[place.index].add(arg)
    return owners


def is_donated(a: Any, n_args: int, nums: frozenset, names: frozenset) -> bool:
    if isinstance(a, int):
        return a in nums or a - n_args in nums
    return a in names


def donation(gdef: GraphDef, n_args: int, kw_order: tuple, nums: frozenset, names: frozenset):
    """Which unique leaves are donated: those held only by donated arguments (every place
    counts, below shared nodes too)."""
    if not (nums or names):
        return (), tuple(range(gdef.num_leaves))

    owners = arguments(gdef, n_args, kw_order)
    donated = tuple(
        q for q, own in enumerate(owners) if own and all(is_donated(a, n_args, nums, names) for a in own)
    )
    gone = set(donated)
    return donated, tuple(q for q in range(gdef.num_leaves) if q not in gone)


def first_difference(before: GraphDef, after: GraphDef, name: Any = None) -> str:
    """The path where two structures first differ, and how (for a write-back refusal); ``name``
    renders a path (default: as an argument of a call)."""
    name = name or place_name
    a = list(before.walk_places())
    b = list(after.walk_places())
    meta = None
    for p, q in zip(a, b):
        if p.path != q.path:
            return f"{name(min(p.path, q.path))}: a place was added or removed there"
        if p.kind != q.kind:
            return f"{name(p.path)}: a {p.kind} became a {q.kind}"
        if p.type is not q.type:
            return f"{name(p.path)}: a {p.type.__name__} became a {q.type.__name__}"
        if meta is None and p.kind not in ("array", "static") and p.first and q.first:
            if before._node_key(p.index) != after._node_key(q.index):  # named if nothing else differs
                meta = f"{name(p.path)}: its keys or fields, their order or their types changed"
        if p.first != q.first or p.index != q.index:
            return f"{name(p.path)}: the sharing changed there (a tie was cut or made)"
        if p.kind == "static" and before.statics[p.index] is not after.statics[q.index]:
            return f"{name(p.path)}: a static value changed"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return f"{name(longer[min(len(a), len(b))].path)}: a place was added or removed there"
    return meta or "<root>: the structure changed"


def structure_error(before: GraphDef, after: GraphDef, where: str) -> GraphError:
    return GraphError(
        f"{first_difference(before, after)}. {where} changed the structure of an argument "
        "(a tie cut, an attribute added or removed, a static changed), which cannot be "
        "carried out of a compiled function; nothing was written into your objects. Build "
        "and return a new model instead (tied.replace, tied.tie and tied.optim.update "
        "return new graphs) and rebind it, or make the change outside the compiled function."
    )


def returns_copy(out_gdef: GraphDef, out: Any, arg: Any) -> bool:
    """Whether ``out`` holds a graph with the structure of ``arg`` (the root or a node one or
    two levels down): a donated argument's updated copy, which the caller rebinds."""
    target = flatten(arg)[1]
    if out_gdef == target:
        return True
    level = [out]
    for _ in range(2):
        nxt = []
        for x in level:
            if isinstance(x, (tuple, list)):
                nxt.extend(x)
            elif isinstance(x, dict):
                nxt.extend(x.values())
        for x in nxt:
            if isinstance(x, (list, tuple, dict)) or hasattr(x, "__dict__") or hasattr(x, "__slots__"):
                try:
                    if flatten(x)[1] == target:
                        return True
                except GraphError:
                    pass
        level = nxt
    return False


def write_back(
    root: Any, gdef: GraphDef, written: tuple, values: list, action: str, inputs: list | None = None
) -> None:
    """Put ``values[n]`` at every place of unique leaf ``written[n]`` in the caller's objects:
    one write per unique container, under `tied.live_lock`. Every place is found (by the
    `WritePlan` kept on ``gdef`` for these leaves, else by `slots`) and checked before
    anything is written: writable, and, given ``inputs`` (the leaves flattened before the
    call), the arguments still of the structure and arrays the call was given, so a model
    changed while the call ran (by another thread, or a callback inside it) is refused,
    never half-updated."""
    with lock:
        if inputs is not None and _fused(root, gdef, written, values, inputs, action):
            return
        if inputs is not None:  # every place still holds what the call was given, or nothing
            _unchanged_since_the_call(root, gdef, inputs, written, action)
        plan = gdef._plans.get(("write", written, True))
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
    plans = gdef._plans
    fused = plans.get(("write-back", written))
    if fused is None:
        plan = plans.get(("write", written, True))
        if not isinstance(plan, WritePlan) or not plans.get("flatten plan") or len(inputs) != gdef.num_leaves:
            return False
        fused = plans[("write-back", written)] = compile_flatten(gdef, writes=plan.writes) or False
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
        raise GraphError(_argument_message(str(e))) from None


def _unchanged_since_the_call(root: Any, gdef: GraphDef, inputs: list, written: tuple, action: str) -> None:
    """Refuse, before anything is written, a model whose structure or arrays changed while
    the call ran (a host callback inside it, another thread without the lock): written into,
    a shared node replaced at one of its places by a look-alike would be cut from its tie."""
    now, now_gdef = flatten(root)  # a plan's work: the structure is the one just flattened
    if now_gdef is not gdef and now_gdef != gdef:
        raise GraphError(
            f"{first_difference(gdef, now_gdef)}. {action}: the arguments' structure changed while "
            "the call ran (another thread, or a callback inside the function, assigned to the "
            "model), so its new values have no sure place to go. Nothing was written. Change the "
            "model between calls, or under tied.live_lock."
        )
    if len(now) != len(inputs) or any(map(operator.is_not, now, inputs)):
        changed = [k for k, (a, b) in enumerate(zip(now, inputs)) if a is not b]
        q = next((k for k in written if k in set(changed)), changed[0])  # a written place first
        raise _changed_error(place_paths(gdef).leaves[q][0], action)


def _changed_error(path: str, action: str) -> GraphError:
    return GraphError(
        f"{place_name(path)}: {action}: this place was changed while the call ran (another "
        "thread, or a callback inside the function, assigned to the model), so the new value "
        "has no place to go. Nothing was written. Change the model between calls, or under "
        "tied.live_lock."
    )


def _argument_message(message: str) -> str:
    """A message that starts with a path of ``(args, kwargs)``, with that path as an argument's."""
    path, sep, rest = message.partition(": ")
    if sep and (path.startswith("[0][") or path.startswith("[1][")):
        return place_name(path) + sep + rest
    return message


def find_places(root: Any, gdef: GraphDef, which: tuple, *, action: str, frozen_ok: bool) -> list:
    """`slots(root, gdef, which, ...)`, through a `WritePlan` kept on ``gdef`` per ``which``
    made by the first `slots` run. ``gdef`` is that of a flatten of ``root`` just taken.
    Under ``TIED_CHECK_PLANS=1`` the plan's slots are compared with `slots`' (a difference,
    or a plan that gives up on a model of its own GraphDef, is a `PlanMismatch`)."""
    key = ("write", which, frozen_ok)
    plan = gdef._plans.get(key)
    if plan is None:
        at, plan = write_plan(root, gdef, which, action=action, frozen_ok=frozen_ok)
        gdef._plans[key] = _NO_PLAN if plan is None else plan
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
    return path or "<root>"


def escaping_tracer(gdef: GraphDef, leaves: list, at: Any, values: list, who: str, after: str):
    """The error for state computed inside an enclosing transform that would be written into
    a model living outside it (where it would stay a dead traced value), or None. ``leaves``
    are the model's arrays before the call, ``at`` the indices written, ``who`` what wrote
    ("the loss", "fun") and ``after`` what became of the model."""
    for q, v in zip(at, values):
        if isinstance(v, jax.core.Tracer) and not isinstance(leaves[q], jax.core.Tracer):
            return GraphError(
                f"{gdef.leaf_paths()[q][0] or '<root>'}: {who} wrote state computed inside an "
                "enclosing transform (jax.vmap, jax.jit, tied.jit over a function that captures "
                f"the model) into a model that lives outside it, where it would stay a dead traced "
                f"value; {after}. Pass the model as an argument of the transform "
                "(tied.jit(step)(model, x)), or compute the state update outside it."
            )
    return None


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
