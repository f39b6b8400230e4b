"""What a call does to the objects it was given: new values written back, changes refused.

`tied.jit` (and `tied.grad` for its loss, and the lifted transforms) runs a function on a
rebuilt copy of its arguments; afterwards the new values at existing places are written
into the caller's own objects by `write_back`, one of two ways: the compiled write-back
(generated code that writes every place where one `slots` run found them, once the model is
checked of the structure and holding the very arrays the call was given), or the general
walk (`live.slots`), which also names what cannot be written or what changed while the call
ran. The refusals of a
change of structure, and what must not escape a transform, are `_transforms/`'s
(`writes.py`, `escapes.py`). Core layer: it reads GraphDefs by name only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from .errors import ModelChangedError, where
from .graph import CHECK_PLANS, GraphDef, GraphError, PlanMismatch, flatten, place_paths
from .live import live_lock, recorded_writes, slots, write
from .plans import compile_flatten, compile_writes


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
                meta = p.path, _meta_change(p, q)
        if p.first != q.first or p.index != q.index:
            return p.path, "the sharing changed there (a tie was cut or made)"
        if p.kind == "static" and before.statics[p.index] is not after.statics[q.index]:
            return p.path, "a static value changed"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return longer[min(len(a), len(b))].path, "a place was added or removed there"
    return meta or ("", "the structure changed")


def _meta_change(p: Any, q: Any) -> str:
    """How two nodes of one kind and type at one place differ in their own data."""
    if p.kind == "view" and p.value is not q.value:
        a, b = (getattr(v, "__qualname__", type(v).__name__) for v in (p.value, q.value))
        return (
            f"its view's function is another object ({a} and {b}: a function made anew for each, such as "
            "a lambda, is another function); make the views with one function object"
        )
    return "its keys or fields, their order or their types changed"


def write_back(
    root: Any,
    gdef: GraphDef,
    written: tuple,
    values: list,
    action: str,
    inputs: list | None = None,
    *,
    name: Callable[[str], str] = where,
) -> None:
    """Put ``values[n]`` at every place of unique leaf ``written[n]`` in the caller's objects:
    one write per unique container, under `tied.live_lock`. Two ways, one result. The
    compiled write-back: generated code that writes where one `slots` run found the places,
    checked first by its own generated re-check where the structure has its flatten plan
    (`_compiled`), else by the walk's (`_unchanged_since_the_call`, then `_written_alone`).
    The general walk (`slots`), for the first write-back of these leaves and where only it
    can write: it checks every place before anything is written (writable: a frozen or
    immutable container refused by path) and writes a place in a tuple or inside a cell's
    value by rebuilding it. Given
    ``inputs`` (the leaves flattened before the call), the arguments must still be of the
    structure and hold the arrays the call was given, so a model changed while the call ran
    (by another thread, or a callback inside it) is refused, never half-updated. ``name``
    shows a path in an error as the caller knows it (`tied.jit`: ``args[0]...``). (A traced
    value that would stay in the caller's objects is the transforms' to refuse before:
    `_transforms/escapes.py`.)"""
    with live_lock:
        if inputs is not None:
            if _compiled(root, gdef, written, values, inputs, action, name):
                return
            _unchanged_since_the_call(root, gdef, inputs, written, action, name)
            if _written_alone(root, gdef, written, values, action, name):
                return
        write(_slots(root, gdef, written, action, name), values)


def _slots(root: Any, gdef: GraphDef, written: tuple, action: str, name: Callable[[str], str]) -> list:
    """`slots` of the written leaves (a place in a tuple written by rebuilding it). The first
    run for these leaves keeps in ``gdef.memo.writes`` what the compiled write-back needs:
    where the places are, as `recorded_writes` (None where only `slots` can write them)."""
    writes = gdef.memo.writes
    record: list | None = [] if written not in writes else None
    try:
        at = slots(root, gdef, written, action=action, frozen_ok=True, rebuild=True, _record=record)
    except GraphError as e:
        raise (e if e.path is None else e.named(name)) from None
    if record is not None:
        writes[written] = recorded_writes(record)
    return at


def _compiled(
    root: Any, gdef: GraphDef, written: tuple, values: list, inputs: list, action: str, name: Callable
) -> bool:
    """The re-check and the writes in one generated function (`compile_flatten` given the
    places one `slots` run recorded), once the structure has its flatten plan; False where
    there is none, or where it misses, having written nothing (the caller then re-checks
    and names what changed, and writes by `slots`). Under ``TIED_CHECK_PLANS=1`` its
    verdict is compared with `_unchanged_since_the_call`'s, and every place `slots` finds
    must hold its new value after it wrote."""
    memo = gdef.memo
    fused = memo.write_backs.get(written)
    if fused is None:
        writes = memo.writes.get(written)
        if writes is None or not memo.flatten_plan or len(inputs) != gdef.num_leaves:
            return False
        fused = memo.write_backs[written] = compile_flatten(gdef, writes=writes) or False
    if not fused:
        return False
    if not CHECK_PLANS:
        return fused(root, inputs, values) is not None
    try:
        _unchanged_since_the_call(root, gdef, inputs, written, action, name)
        changed = None
        at = _slots(root, gdef, written, action, name)
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


def _written_alone(
    root: Any, gdef: GraphDef, written: tuple, values: list, action: str, name: Callable
) -> bool:
    """The compiled route where the structure has no compiled re-check (no flatten plan, or
    one over the plan bound): the walk has just re-checked the model
    (`_unchanged_since_the_call`), and the compiled writes alone (`compile_writes`) reach and
    write the places one `slots` run recorded; False where none were recorded (the first
    write-back) or only `slots` can write them. Under
    ``TIED_CHECK_PLANS=1`` every place `slots` finds must hold its new value after."""
    fn = gdef.memo.writes_alone.get(written)
    if fn is None:
        writes = gdef.memo.writes.get(written)
        if writes is None:
            return False
        fn = gdef.memo.writes_alone[written] = compile_writes(gdef, writes)
    at = _slots(root, gdef, written, action, name) if CHECK_PLANS else ()
    if fn(root, None, values) is None:  # nothing written
        if CHECK_PLANS:
            raise PlanMismatch(f"the compiled writes missed on a model of their structure ({gdef})")
        return False
    if any(slot.get() is not v for places, v in zip(at, values) for slot in places):
        raise PlanMismatch(f"the compiled writes wrote other places than slots finds ({gdef})")
    return True


def _unchanged_since_the_call(
    root: Any, gdef: GraphDef, inputs: list, written: tuple, action: str, name: Callable[[str], str]
) -> None:
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
            name=name,
        )
    if len(now) != len(inputs) or any(map(operator.is_not, now, inputs)):
        changed = [k for k, (a, b) in enumerate(zip(now, inputs)) if a is not b]
        q = next((k for k in written if k in set(changed)), changed[0])  # a written place first
        raise _changed_error(place_paths(gdef).leaves[q][0], action, name)


def _changed_error(path: str, action: str, name: Callable[[str], str]) -> ModelChangedError:
    return ModelChangedError(
        f"{action}: this place was changed while the call ran (another "
        "thread, or a callback inside the function, assigned to the model), so the new value "
        "has no place to go. Nothing was written. Change the model between calls, or under "
        "tied.live_lock.",
        path,
        name=name,
    )
