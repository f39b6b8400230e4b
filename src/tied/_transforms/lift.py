"""One lift: how a tied transform runs a function on a rebuilt copy of its tied arguments.

Every lifted transform (`tied.scan`, `tied.vmap`, `tied.remat`) goes through the same steps,
and says only what is its own (how JAX is called, which arrays are mapped, stacked or static):

1. flatten the arguments once (sharing is decided by the core walk) and hand JAX the unique
   arrays;
2. inside the traced body, rebuild a copy from JAX's tracers and call the function on it, with
   the `checks` scope open (`call_on_copy`);
3. read what the function wrote into the copy: new values at existing places, a change of
   structure refused by path (`read_writes`);
4. carry out of JAX, beside the arrays, what the body learnt (the places written, the checks
   made, the output's structure and which of its arrays are tied's totals) as a `Learnt`: a
   pytree node with no leaves whose static auxiliary data is all of it, as `tied.jit` carries
   its `_Output`, never through a dict the body closes over;
5. after the call, run the checks, write the new values into the caller's objects
   (`write_back`) and rebuild the output (`output_of`).

`tied.jit` carries its output the same way (`learn_output`, `output_of`, its own `_Output` as
the static data, since it also donates and shards); `tied.grad` carries which inputs its loss
wrote as a leafless node of its own (`grad._Written`), since `lift` imports `grad`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core import GraphDef, GraphError, flatten, rebuild
from .checks import check_scope, run_checks
from .escapes import write_back_checked
from .grad import is_total, mark_total
from .writes import structure_error

__all__ = ["Learnt", "call_on_copy", "read_writes", "learn_output", "output_of", "finish"]


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


def call_on_copy(gdef: GraphDef, given: list, call: Callable[[Any], Any], scope: list) -> tuple:
    """Rebuild a copy of ``gdef`` from ``given`` (the body's tracers) and run ``call(copy)``
    with the checks of the tracers ``scope`` carried out: ``(copy, result, checks)``."""
    copy = rebuild(gdef, given)
    with check_scope(scope) as checks:
        result = call(copy)
    return copy, result, checks


def read_writes(who: str, gdef: GraphDef, given: list, copy: Any, name: Callable[[str], str]) -> tuple:
    """``(arrays, written)``: the unique arrays of ``copy`` (rebuilt from ``given``) after the
    call, and the indices of those the function put at existing places; a change of structure
    is a `GraphError` naming the first difference."""
    after_leaves, after = flatten(copy)
    if after != gdef:
        raise structure_error(
            gdef,
            after,
            f"{who}: the function",
            out_of="the transform",
            advice="Write new values only into existing places (a tied.State's .value), or change "
            "the model outside.",
            name=name,
        )
    return after_leaves, [q for q, (a, b) in enumerate(zip(after_leaves, given)) if a is not b]


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
    learnt: Learnt, checked: Any, at: tuple, values: list, who: str, name: Any = None, written: Any = None
):
    """After the transform: every check's flags (per step or example), then the new ``values``
    of the unique arrays ``written`` (``learnt.written`` unless given) put at every place of
    the caller's objects, ``at`` = ``(root, gdef, leaves)`` (``root``'s flatten gave ``gdef``
    and ``leaves``), as `tied.jit` writes back; an error's place is shown through ``name``."""
    run_checks(learnt.checks, list(checked))
    written = learnt.written if written is None else written
    if not written:
        return
    root, gdef, leaves = at
    try:
        write_back_checked(root, gdef, tuple(written), values, who, leaves, who)
    except GraphError as e:
        raise (e if name is None or e.path is None else e.named(name)) from None
