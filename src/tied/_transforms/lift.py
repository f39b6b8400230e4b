"""One lift: how a tied transform runs a function on a rebuilt copy of its tied arguments.

Every lifted transform (`tied.grad`/`value_and_grad`, `tied.scan`, `tied.vmap`, `tied.remat`)
goes through the same steps, and says only what is its own (how JAX is called, which arrays are
differentiated, mapped, stacked or static):

1. flatten the arguments once (sharing is decided by the core walk) and hand JAX the unique
   arrays;
2. inside the traced body, rebuild a copy from JAX's tracers and call the function on it, with
   the `checks` scope open (`call_on_copy`; `tied.grad` asks for views materialised and for
   its copy to be its own, `escapes.own_copy`);
3. read what the function wrote into the copy: new values at existing places, a change of
   structure or a write at a view's place refused (`read_writes`);
4. carry out of JAX, beside the arrays, what the body learnt (the places written, the checks
   made, the output's structure and which of its arrays are tied's totals) as a `Learnt`: a
   pytree node with no leaves whose static auxiliary data is all of it, as `tied.jit` carries
   its `_Output`, never through a dict the body closes over;
5. after the call, run the checks, write the new values into the caller's objects
   (`write_back`) and rebuild the output (`output_of`).

`tied.jit` runs its function the same way (`call_on_copy`, `read_writes`, `learn_output`,
`output_of`), with its own `_Output` as the static data and its own write-back after the call,
since it also donates and shards and its call is the hot path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax

from .._core import GraphDef, GraphError, flatten, rebuild
from .checks import check_scope, run_checks
from .escapes import copy_scope, own_copy, refuse_dropped, write_back_checked
from .totals import is_total, mark_total
from .writes import structure_error

__all__ = [
    "Copy",
    "Learnt",
    "call_on_copy",
    "read_writes",
    "refusing_drops",
    "learn_output",
    "output_of",
    "finish",
]


@jax.tree_util.register_pytree_node_class
class Learnt:
    """What a traced body learnt, carried out of a JAX transform as static auxiliary data: a
    pytree node with no leaves. ``written``: the unique input arrays it wrote; ``checks``: the
    `checks.check`s made (their values travel as arrays beside it); ``out``: the output's
    GraphDef; ``totals``: the output arrays that are tied's total gradients; ``more``: what
    is the transform's own (a scan's broadcast writes, a vmap's output layout)."""

    __slots__ = ("written", "checks", "out", "totals", "more")

    def __init__(self, written=(), checks=(), out=None, totals=(), more=None):
        self.written, self.checks, self.out, self.totals, self.more = written, checks, out, totals, more

    def tree_flatten(self):
        return (), (self.written, self.checks, self.out, self.totals, self.more)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> Learnt:
        return cls(*aux)


class Copy:
    """The copy a body runs on: ``value`` rebuilt from ``given`` (the body's arrays, one per
    input), whose flatten is ``gdef`` and ``leaves`` (``given``'s own structure and arrays,
    unless views were materialised or one object stands at several inputs)."""

    __slots__ = ("value", "gdef", "leaves", "given", "same")

    def __init__(self, value: Any, gdef: GraphDef, leaves: list, given: list, same: bool):
        self.value, self.gdef, self.leaves, self.given, self.same = value, gdef, leaves, given, same


def call_on_copy(
    gdef: GraphDef,
    given: list,
    call: Callable[[Any], Any],
    scope: list,
    *,
    materialize: bool = False,
    own: bool = False,
) -> tuple[Copy, Any, Any]:
    """Rebuild a copy of ``gdef`` from ``given`` (the body's tracers) and run ``call(copy)``
    with the checks of the tracers ``scope`` carried out: ``(copy, result, checks)``.

    ``materialize``: views become arrays in the copy (`tied.grad`'s loss sees plain arrays);
    ``own``: the copy is one the caller writes back itself (`escapes.own_copy`), so a lifted
    transform inside may write this trace's values into it."""
    value = rebuild(gdef, given, materialize=materialize)
    if materialize:  # the copy's own structure: views are arrays, an object at two inputs one
        leaves, seen = flatten(value)
        copy = Copy(value, seen, leaves, given, same=False)
    else:
        copy = Copy(value, gdef, given, given, same=True)
    with contextlib.ExitStack() as stack:
        if own:
            stack.enter_context(own_copy(value, copy.gdef, copy.leaves))
        checks = stack.enter_context(check_scope(scope))
        result = call(value)
    return copy, result, checks


_ADVICE = "Write new values only into existing places (a tied.State's .value), or change the model outside."


def read_writes(
    who: str,
    copy: Copy,
    name: Callable[[str], str],
    *,
    what: str = "the function",
    refusal: dict | None = None,
    flat: Callable[[Any], tuple[list, GraphDef]] = flatten,
) -> tuple[list, list[int]]:
    """``(now, written)``: per input, its array after the call (read by ``flat``), and the
    indices of the inputs the function (``what``) put a new value at; a change of structure is
    a `GraphError` naming the first difference (``refusal``: its ``out_of`` and ``advice``, the
    lifted transforms' unless given), and so is a write at a view's place (a materialised view
    is no input)."""
    after_leaves, after = flat(copy.value)
    if after != copy.gdef:
        why = {"out_of": "the transform", "advice": _ADVICE} if refusal is None else refusal
        raise structure_error(copy.gdef, after, f"{who}: {what}", name=name, **why)
    if copy.same:
        return after_leaves, [q for q, (a, b) in enumerate(zip(after_leaves, copy.given)) if a is not b]
    # One object may stand at several inputs: cells given one array are two states, each its
    # own unique array, met in the same order in ``given`` and in the walk of the copy.
    given = copy.given
    index: dict[int, list[int]] = {}
    for i, x in enumerate(given):
        index.setdefault(id(x), []).append(i)
    met: dict[int, int] = {}
    now, written = list(given), []
    for b, a in zip(copy.leaves, after_leaves):
        n = met[id(b)] = met.get(id(b), -1) + 1
        if a is b:
            continue
        at = index.get(id(b), ())
        i = at[min(n, len(at) - 1)] if at else None
        if i is None or given[i] is not b:
            raise GraphError(
                f"{who}: {what} wrote a new value at a view's place; a view is a function of "
                "its source and cannot be written. Write into the source's place instead."
            )
        now[i] = a
        written.append(i)
    return now, written


def refusing_drops(
    traced: Callable, gdef: GraphDef, who: str, kept: Callable[[Any], tuple], name: Any = None
) -> Callable:
    """``traced`` (a transform's traced body over a copy of ``gdef``'s arguments), refusing
    state that a plain JAX transform inside it wrote on a copy and dropped, or wrote as a tracer
    of a finished transform (`escapes.refuse_dropped`). ``kept(result)`` gives ``(written,
    arrays)``: the inputs written and the arrays the transform returns or writes back, ending
    with the written ones' new values."""

    def f(*args: Any) -> Any:
        with copy_scope() as scope:
            result = traced(*args)
        written, arrays = kept(result)
        refuse_dropped(scope, gdef, written, arrays, who, name)
        return result

    return f


def learn_output(out: Any) -> tuple[list, GraphDef, tuple[int, ...]]:
    """The function's output as JAX carries it: its unique arrays, its GraphDef, and which of
    them are tied's total gradients (marked again after the transform)."""
    out_leaves, out_gdef = flatten(out)
    return out_leaves, out_gdef, tuple(i for i, x in enumerate(out_leaves) if is_total(x))


def output_of(out_gdef: GraphDef, out_leaves: list, totals: tuple) -> Any:
    """The output rebuilt, with ties, from what the transform returned; its totals marked."""
    for i in totals:
        mark_total(out_leaves[i])
    return rebuild(out_gdef, out_leaves)


def finish(
    learnt: Learnt,
    checked: Any,
    at: tuple,
    values: list,
    who: str,
    name: Any = None,
    written: Any = None,
    by: str | None = None,
):
    """After the transform: every check's flags (per step or example), then the new ``values``
    of the unique arrays ``written`` (``learnt.written`` unless given) put at every place of
    the caller's objects, ``at`` = ``(root, gdef, leaves)`` (``root``'s flatten gave ``gdef``
    and ``leaves``), as `tied.jit` writes back; an error's place is shown through ``name``, and
    ``by`` (``who`` unless given) is what wrote a traced value that would escape."""
    run_checks(learnt.checks, list(checked))
    written = learnt.written if written is None else written
    if not written:
        return
    root, gdef, leaves = at
    try:
        write_back_checked(root, gdef, tuple(written), values, who, leaves, by or who)
    except GraphError as e:
        raise (e if name is None or e.path is None else e.named(name)) from None
