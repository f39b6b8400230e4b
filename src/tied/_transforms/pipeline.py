"""Pipeline parallelism: `pipeline`, the stages of a `tied.Stack` one per device, a GPipe schedule.

The stages' stacked arrays are split along one mesh axis, one stage per device; the
batch is cut into microbatches, which flow from each stage to the next through
``jax.lax.ppermute`` (a collective-permute between neighbours only), inside one
``jax.shard_map``. An object every stage shares (a LayerNorm, broadcast by the Stack) is
one replicated input of the ``shard_map``: its gradient is summed over the stages by
JAX's own transpose of the ``shard_map``, never by an all-reduce written here, and it
stays one parameter. What the stages share with the model outside (the tied embedding
and head) is the same object there, so `tied.grad` sums its one total as anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .._core import rebuild
from .checks import check, check_scope
from .stack import Stack, layout

__all__ = ["pipeline"]


def _checked(init: Any, stages: Any, mesh: Any, axis: Any, microbatches: Any) -> tuple[list, int]:
    """The leaves of ``init`` and the batch size, or a ValueError naming the argument at fault."""
    if not isinstance(stages, Stack):
        how = (
            " A list of stages becomes one with tied.stack(stages), which names the first place where "
            "two stages differ in structure."
            if isinstance(stages, (list, tuple))
            else ""
        )
        raise ValueError(
            f"tied.pipeline: stages must be a tied.Stack of the pipeline's stages (one per device along "
            f"the axis), got {type(stages).__name__}.{how}"
        )
    if not isinstance(mesh, Mesh):
        raise ValueError(f"tied.pipeline: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis not in mesh.shape:
        raise ValueError(
            f"tied.pipeline: axis {axis!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}."
        )
    if len(stages) != mesh.shape[axis]:
        raise ValueError(
            f"tied.pipeline: stages holds {len(stages)} stages but the mesh axis {axis!r} has "
            f"{mesh.shape[axis]} devices: one stage per device. Stack {mesh.shape[axis]} stages (a stage "
            "may itself hold a tied.Stack of layers), or build the mesh to match."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"tied.pipeline: microbatches must be a positive int, got {microbatches!r}.")
    xs = jax.tree_util.tree_leaves(init)
    if not xs or any(jnp.ndim(x) == 0 for x in xs):
        raise ValueError(
            "tied.pipeline: init must be a pytree of arrays with a leading batch axis (the microbatches "
            "are cut from it)."
        )
    batch = {jnp.shape(x)[0] for x in xs}
    if len(batch) != 1:
        raise ValueError(
            f"tied.pipeline: init's arrays have leading (batch) axes {sorted(batch)}: one batch."
        )
    (b,) = batch
    if b % microbatches:
        raise ValueError(
            f"tied.pipeline: init's batch of {b} does not split into microbatches={microbatches} equal "
            "parts. Pick a number of microbatches that divides the batch."
        )
    return xs, b


def _keeps_h(f: Callable, gdef: Any, s_idx: list, b_idx: list, leaves: list, tree: Any, cut: list) -> tuple:
    """Refuse, before anything runs, a stage whose output is not of ``h``'s structure, shapes
    and dtypes (abstractly, on one stage and one microbatch): each stage's output is the next
    stage's input, as a scan's carry. Returns the checks a stage makes (`checks.check`):
    ``((fail, number of operands), ...)`` and the shapes of their flags and operands."""
    shape = jax.ShapeDtypeStruct
    made: list = []

    def one(s_leaves: list, b_leaves: list, mb: list) -> Any:
        full: list = [None] * gdef.num_leaves
        for q, x in zip(s_idx, s_leaves):
            full[q] = x
        for q, x in zip(b_idx, b_leaves):
            full[q] = x
        with check_scope([*s_leaves, *b_leaves, *mb]) as scope:
            out = f(jax.tree_util.tree_unflatten(tree, mb), rebuild(gdef, full))
        made.append((tuple(scope.checks), [shape(jnp.shape(v), jnp.result_type(v)) for v in scope.values]))
        return out

    mb = [shape(jnp.shape(x)[1:], x.dtype) for x in cut]
    out = jax.eval_shape(
        one,
        [shape(jnp.shape(leaves[q])[1:], leaves[q].dtype) for q in s_idx],
        [shape(jnp.shape(leaves[q]), leaves[q].dtype) for q in b_idx],
        mb,
    )
    want = jax.tree_util.tree_unflatten(tree, mb)
    if jax.tree_util.tree_structure(out) != tree:
        raise ValueError(
            f"tied.pipeline: f returned {jax.tree_util.tree_structure(out)} for h of structure {tree}: each "
            "stage's output is the next stage's h, so f must return h's structure, shapes and dtypes."
        )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(out)):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(
                f"tied.pipeline: f turns h{jax.tree_util.keystr(path)} of shape {a.shape} and dtype "
                f"{a.dtype} (one microbatch) into shape {b.shape} and dtype {b.dtype}: each stage's output "
                "is the next stage's h, so f must keep h's structure, shapes and dtypes (cast or reshape "
                "back inside f)."
            )
    return made[0]


def _record_checks(scope: Any, learnt: tuple, records: list, real: Any) -> list:
    """The checks one tick's stage made (``scope``), kept where the tick is a real one for this
    device (``real``: not a bubble, whose stage runs on a value no stage gave it), each check's
    first failing flag and operands in ``records``."""
    if len(scope.checks) != len(learnt[0]):
        raise ValueError(
            f"tied.pipeline: f made {len(scope.checks)} checks in a stage where it made "
            f"{len(learnt[0])} when traced first: a stage's checks must not depend on Python state."
        )
    out, at = [], 0
    for _, n in learnt[0]:
        new, old = scope.values[at : at + 1 + n], records[at : at + 1 + n]
        hit = real & jnp.any(new[0]) & ~jnp.any(old[0])
        out += [jnp.where(hit, jnp.asarray(v, o.dtype), o) for v, o in zip(new, old)]
        at += 1 + n
    return out


def _raise_checks(learnt: tuple, records: list) -> None:
    """The stages' checks after the pipeline (one flag and operands per device: its first
    failing tick's), made again where the pipeline was called (`checks.check`)."""
    at = 0
    for fail, n in learnt[0]:
        check(records[at], fail, *records[at + 1 : at + 1 + n])
        at += 1 + n


def pipeline(
    f: Callable[[Any, Any], Any], init: Any, stages: Stack, *, mesh: Mesh, axis: str, microbatches: int
) -> Any:
    """Run ``f(h, stage)`` through the stages of a `tied.Stack`, one stage per device, as a GPipe pipeline.

    Returns what ``tied.scan(lambda h, s, _: (f(h, s), None), init, stages)[0]`` returns, in
    values and gradients: the batch is cut into ``microbatches`` along its leading axis, and
    at each of ``microbatches + stages - 1`` ticks every device runs its stage on the
    microbatch it holds and hands the result to the next device (``jax.lax.ppermute``
    between neighbours only). The stages' stacked arrays are split along ``axis`` (one
    stage's arrays per device); an object every stage shares (broadcast by the Stack, such
    as one LayerNorm) is one parameter on every device, whose gradient JAX sums over the
    stages. Everything outside the call (a tied embedding and head) is the model's own, as
    in any `tied.grad`. The bubble (the ticks a device waits) is ``(stages - 1) /
    (microbatches + stages - 1)`` of the schedule.

    Args:
        f: ``(h, stage) -> h``: one stage (a member of ``stages``, itself possibly holding a
            `tied.Stack` of layers run with `tied.scan`); ``h`` keeps its structure, shapes and
            dtypes (checked abstractly before anything runs).
            It may not write state (a BatchNorm's statistics): such stages are refused.
            A run-time check it makes (a cache's position) is carried out of the pipeline
            and raised after it, for the real microbatches only (a device waiting in the
            bubble runs its stage on a value no stage gave it, and its checks are dropped).
        init: a pytree of arrays whose leading axis is the batch.
        stages: a `tied.Stack` of ``mesh.shape[axis]`` stages.
        mesh: the device mesh.
        axis: the mesh axis the stages are spread over.
        microbatches: how many parts the batch is cut into (it must divide the batch).

    Returns:
        The last stage's output for the whole batch (as ``init``, replicated over ``axis``).

    Raises:
        ValueError: ``stages`` not a `tied.Stack` (a list of stages of different structure),
            a stage count other than the axis size, ``axis`` not in ``mesh``, a batch that
            ``microbatches`` does not divide, ``init`` without a batch axis, stages with state,
            an ``f`` that changes ``h``'s structure, a shape or a dtype (naming the leaf).

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, tied
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
        >>> norm = tied.nn.LayerNorm(4)                        # one norm in every stage
        >>> stages = tied.stack([{"d": tied.nn.Dense(4, 4, key=jax.random.key(0)), "norm": norm}])
        >>> f = lambda h, s: s["norm"](jnp.tanh(s["d"](h)))
        >>> h = jnp.ones((4, 4))
        >>> out = tied.pipeline(f, h, stages, mesh=mesh, axis="stage", microbatches=2)
        >>> want = tied.scan(lambda h, s, _: (f(h, s), None), h, stages)[0]
        >>> bool(jnp.allclose(out, want, atol=1e-6)), stages.member["norm"] is norm
        (True, True)
    """
    xs, b = _checked(init, stages, mesh, axis, microbatches)
    leaves, gdef, stacked = layout(stages)
    if any(gdef.state_leaves()):
        path = next(p for p, s in zip(gdef.leaf_paths(), gdef.state_leaves()) if s)[0]
        raise ValueError(
            f"tied.pipeline: stages holds state at stages.member{path} (a running statistic, a random "
            "stream): a pipeline runs each stage on several microbatches at once and does not carry "
            "state writes out. Keep state outside the pipelined stages."
        )
    n, m = len(stages), microbatches
    s_idx = [q for q, s in enumerate(stacked) if s]
    b_idx = [q for q, s in enumerate(stacked) if not s]
    tree = jax.tree_util.tree_structure(init)
    cut = [jnp.reshape(x, (m, b // m, *jnp.shape(x)[1:])) for x in xs]

    def local(s_leaves: list, b_leaves: list, mbs: list) -> list:
        full: list = [None] * gdef.num_leaves
        for q, x in zip(s_idx, s_leaves):
            full[q] = x[0]  # this device's stage: its slice of each stacked array
        for q, x in zip(b_idx, b_leaves):
            full[q] = x
        stage = rebuild(gdef, full)
        me = jax.lax.axis_index(axis)
        forward = [(i, i + 1) for i in range(n - 1)]

        def tick(c: tuple, t: Any) -> tuple:
            held, outs, records = c
            first = [jax.lax.dynamic_index_in_dim(x, jnp.minimum(t, m - 1), keepdims=False) for x in mbs]
            h = [jnp.where(me == 0, a, h) for a, h in zip(first, held)]
            with check_scope(h) as scope:
                y = jax.tree_util.tree_leaves(f(jax.tree_util.tree_unflatten(tree, h), stage))
            records = _record_checks(scope, learnt, records, (t >= me) & (t < me + m))
            k = t - (n - 1)  # the microbatch the last stage finishes at this tick
            done = (me == n - 1) & (k >= 0)
            outs = [
                jax.lax.dynamic_update_index_in_dim(
                    o, jnp.where(done, v, o[jnp.maximum(k, 0)]), jnp.maximum(k, 0), 0
                )
                for o, v in zip(outs, y)
            ]
            held = [jax.lax.ppermute(v, axis, forward) for v in y]
            return (held, outs, records), None

        # A device waiting in the bubble still runs its stage, on the first microbatch, not on
        # zeros: its output is dropped, but a stage undefined at zero (x / |x|) would give NaN
        # gradients through the dropped branch (0 * inf) where the sequential scan has none.
        records = [jnp.zeros(r.shape, r.dtype) for r in learnt[1]]  # the checks' first failures
        start = jax.lax.pcast(
            ([x[0] for x in mbs], [jnp.zeros_like(x) for x in mbs], records), (axis,), to="varying"
        )
        (_, outs, records), _ = jax.lax.scan(tick, start, jnp.arange(m + n - 1))
        # The outputs sit on the last stage's device: every other device adds its zeros.
        outs = [jax.lax.psum(jnp.where(me == n - 1, o, jnp.zeros_like(o)), axis) for o in outs]
        return outs + [r[None] for r in records]  # one record per device

    learnt = _keeps_h(f, gdef, s_idx, b_idx, leaves, tree, cut)
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            [PartitionSpec(axis)] * len(s_idx),
            [PartitionSpec()] * len(b_idx),
            [PartitionSpec()] * len(cut),
        ),
        out_specs=[PartitionSpec()] * len(cut) + [PartitionSpec(axis)] * len(learnt[1]),
        axis_names=frozenset({axis}),
    )
    outs = run([leaves[q] for q in s_idx], [leaves[q] for q in b_idx], cut)
    outs, records = outs[: len(cut)], outs[len(cut) :]
    _raise_checks(learnt, records)
    return jax.tree_util.tree_unflatten(tree, [jnp.reshape(o, (b, *jnp.shape(o)[2:])) for o in outs])
