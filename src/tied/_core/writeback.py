"""What a call does to the objects it was given: new values written back, changes refused.

`tied.jit` (and `tied.grad` for its loss) runs a function on a rebuilt copy of its
arguments; afterwards the copy is compared with what was given. New values at
existing places are written into the caller's own objects (through `_live`); a
change of structure is refused by path; a donated argument that is not handed
back stays usable (donation itself is `tied.jit`'s, in `_transforms/jit.py`).
Core layer: it reads GraphDefs by name only.
"""

from __future__ import annotations

import operator
from typing import Any

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
) -> None:
    """Put ``values[n]`` at every place of unique leaf ``written[n]`` in the caller's objects:
    one write per unique container, under `tied.live_lock`. Every place is found (by the
    `WritePlan` kept on ``gdef`` for these leaves, else by `slots`) and checked before
    anything is written: writable, and, given ``inputs`` (the leaves flattened before the
    call), the arguments still of the structure and arrays the call was given, so a model
    changed while the call ran (by another thread, or a callback inside it) is refused,
    never half-updated. (A traced value that would stay in the caller's objects is the
    transforms' to refuse before: `_transforms/escapes.py`.)"""
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
    or a plan that gives up on a model of its own GraphDef, is a `PlanMismatch`). A place in
    a tuple is written by putting a new tuple at every place of it (`slots`' ``rebuild``)."""
    key = (which, frozen_ok)
    plan = gdef.memo.write_plans.get(key)
    if plan is None:
        at, plan = write_plan(root, gdef, which, action=action, frozen_ok=frozen_ok, rebuild=True)
        gdef.memo.write_plans[key] = _NO_PLAN if plan is None else plan
        return at
    if plan is _NO_PLAN:
        return slots(root, gdef, which, action=action, frozen_ok=frozen_ok, rebuild=True)
    at = plan.find(root)
    if CHECK_PLANS:
        _check_places(at, slots(root, gdef, which, action=action, frozen_ok=frozen_ok, rebuild=True), gdef)
    if at is None:
        return slots(root, gdef, which, action=action, frozen_ok=frozen_ok, rebuild=True)
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


def flatten_arguments(root: Any, cache: Any = None) -> tuple[list, GraphDef]:
    """`flatten` of a call's ``(args, kwargs)`` (with the plans of ``cache``), a `StateClash`
    naming its places as the arguments (``args[0]['w']``), as `tied.grad` names the model's."""
    try:
        return flatten(root) if cache is None else flatten_with(root, cache)
    except StateClash as e:
        raise e.named(place_name) from None
