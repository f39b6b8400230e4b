"""Lifted transforms that know about ties and state: `scan`, `vmap`, `remat`.

Each flattens its tied arguments once (sharing decided by the core walk), hands JAX the
unique arrays, rebuilds the graph inside the traced function, and reads back what that
function wrote into the rebuilt copy (new values at existing places: state cells written,
a parameter replaced). Those writes leave the JAX transform as outputs and are written
into the caller's own objects afterwards, the way `tied.jit` writes back; under an
enclosing `tied.jit` or `tied.grad` the "caller's objects" are that transform's copy, which
it writes back in turn. A write that has no meaning after the transform (state written
into an argument every example of `vmap` shares) is a `GraphError`, never dropped.

`scan` runs a `Stack`'s members in order: stacked arrays are the ``xs`` of
`jax.lax.scan`, broadcast arrays go through the carry (so a broadcast state cell is
updated at every step in order, and the gradient of a broadcast parameter accumulates
over the steps), and each step's writes come out as ``ys`` (stacked) or in the carry
(broadcast).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._core import (
    GraphDef,
    GraphError,
    flatten,
    where,
)
from .escapes import refuse_static_ties, refuse_static_writes, static_snapshot
from .lift import Learnt, call_on_copy, finish, learn_output, output_of, read_writes
from .stack import Stack, layout
from .writes import place_name

__all__ = ["scan", "vmap", "remat"]


# ---------------------------------------------------------------- shared steps


def _leaves_at(n: int, *groups: tuple) -> list:
    """The ``n`` unique arrays of a graph put back together from ``(indices, values)`` groups
    (the stacked and broadcast ones of a scan step, the mapped and shared ones of a vmap)."""
    full: list = [None] * n
    for at, values in groups:
        for q, v in zip(at, values):
            full[q] = v
    return full


# ---------------------------------------------------------------- scan


def _stacks(stack: Any) -> list[Stack]:
    if isinstance(stack, Stack):
        return [stack]
    if isinstance(stack, (tuple, list)) and stack and all(isinstance(s, Stack) for s in stack):
        return list(stack)
    raise TypeError(
        f"tied.scan(f, init, stack, xs): stack must be a tied.Stack (or a tuple or list of "
        f"Stacks of one length), got {type(stack).__name__}. Make one with tied.stack(members)."
    )


def _stacked_flags(stacks: list[Stack], leaves: list, who: str) -> list[bool]:
    """Per unique array of the stacks together, whether it is stacked (one slice per member)."""
    flags: dict[int, bool] = {}
    for s in stacks:
        s_leaves, s_gdef, s_flags = layout(s)
        for q, (x, f) in enumerate(zip(s_leaves, s_flags)):
            if flags.setdefault(id(x), f) != f:
                raise ValueError(
                    f"{who}: the array at .member{s_gdef.leaf_paths()[q][0]} of one Stack is stacked "
                    "in one Stack and broadcast in another; stack each array in one Stack only."
                )
    return [flags[id(x)] for x in leaves]


def _check_xs(xs: Any, n: int) -> None:
    for path, x in jax.tree_util.tree_leaves_with_path(xs):
        shape = getattr(x, "shape", ())
        if not shape or shape[0] != n:
            where = "xs" + jax.tree_util.keystr(path)
            found = f"leading axis {shape[0]}" if shape else "no axis (a scalar)"
            raise ValueError(
                f"tied.scan: {where} has {found}, but the stack has {n} members: xs gives one "
                "slice per member (its leading axis is the number of members)."
            )


def scan(
    f: Callable, init: Any, stack: Any, xs: Any = None, *, reverse: bool = False, unroll: int | bool = 1
) -> tuple[Any, Any]:
    """Run ``f(carry, layer, x)`` once per member of a `Stack`, in one compiled body.

    Equal to the unrolled loop ``for i, layer in enumerate(tied.unstack(stack)):
    carry, y = f(carry, layer, x[i])`` in the carry, the ``ys``, gradients, state
    writes and random draws: ``layer`` holds slice ``i`` of every stacked array
    and the broadcast objects (a rebuilt copy, as `tied.grad` hands its loss one).
    A stacked state cell written at step ``i`` gets slice ``i`` written; a
    broadcast one (one BatchNorm or one `tied.Rng` for every layer) is updated at
    every step in order, through the carry. The writes reach your objects after
    the scan (eagerly, or the copy of an enclosing `tied.jit` or `tied.grad`,
    which writes them back in turn). Under `tied.grad` a broadcast parameter's
    gradient is its total over every step and every place outside the stack.

    Args:
        f: ``(carry, layer, x) -> (carry, y)``; carry, ``x`` and ``y`` are
            pytrees of arrays (wrap a tied graph in `tied.Graph`).
        init: the first carry.
        stack: a `Stack`, or a tuple or list of Stacks of one length (``layer``
            is then the tuple or list of their members).
        xs: a pytree of arrays with leading axis ``len(stack)``, or None.
        reverse: run the members from last to first; ``ys[i]`` still comes from
            member ``i``, as in `jax.lax.scan`.
        unroll: as in `jax.lax.scan`.

    Returns:
        ``(carry, ys)``, as `jax.lax.scan` returns them.

    Raises:
        ValueError: ``xs`` whose leading axis is not the stack's length.
        GraphError: ``f`` changed the structure of ``layer``, replaced a
            broadcast parameter, or wrote a value of another shape.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> norm = tied.nn.LayerNorm(4)                              # one norm, every block
        >>> keys = jax.random.split(jax.random.key(0), 3)
        >>> blocks = tied.stack([{"d": tied.nn.Dense(4, 4, key=k), "norm": norm} for k in keys])
        >>> def step(h, layer, x):
        ...     return layer["norm"](layer["d"](h)), None
        >>> h, _ = tied.scan(step, jnp.ones((2, 4)), blocks)
        >>> g = tied.grad(lambda s: tied.scan(step, jnp.ones((2, 4)), s)[0].sum())(blocks)
        >>> g.member["d"].weight.shape, g.member["norm"].weight.shape    # stacked, total
        ((3, 4, 4), (4,))
    """
    stacks = _stacks(stack)
    n = len(stacks[0])
    if any(len(s) != n for s in stacks):
        raise ValueError(
            f"tied.scan: the stacks have lengths {[len(s) for s in stacks]}; scanning them "
            "together needs one length."
        )
    _check_xs(xs, n)
    leaves, gdef = flatten(stack)
    stacked = _stacked_flags(stacks, leaves, "tied.scan")
    state = gdef.state_leaves()
    s_idx = [q for q, s in enumerate(stacked) if s]
    b_idx = [q for q, s in enumerate(stacked) if not s]

    def body(c, sl):
        given, b = c
        s, x = sl
        full = _leaves_at(gdef.num_leaves, (s_idx, s), (b_idx, b))
        # checks are carried out per step, and checked at the level around
        copy, (carry, y), checks = call_on_copy(gdef, full, lambda copy: f(given, _layer(copy), x), full)
        after, written = read_writes("tied.scan", copy, where)
        for q in written:
            _check_scan_write(gdef, q, stacked[q], state[q], full[q], after[q])
        learnt = Learnt(
            tuple(q for q in written if stacked[q]),
            tuple(checks.checks),
            more=tuple(q for q in written if not stacked[q]),  # broadcast: written through the carry
        )
        return (carry, [after[q] for q in b_idx]), (
            y,
            [after[q] for q in learnt.written],
            checks.values,
            learnt,
        )

    (carry, b_out), (ys, s_out, checked, learnt) = jax.lax.scan(
        body,
        (init, [leaves[q] for q in b_idx]),
        ([leaves[q] for q in s_idx], xs),
        length=n,
        reverse=reverse,
        unroll=unroll,
    )
    pos = {q: k for k, q in enumerate(b_idx)}
    values = list(s_out) + [b_out[pos[q]] for q in learnt.more]
    # every step's flags raised around the scan, then the writes
    finish(learnt, checked, (stack, gdef, leaves), values, "tied.scan", written=learnt.written + learnt.more)
    return carry, ys


def _layer(copy: Any) -> Any:
    """What a step is handed: the member of the Stack (or of each Stack) of ``copy``."""
    return copy.member if isinstance(copy, Stack) else type(copy)(s.member for s in copy)


def _check_scan_write(gdef: GraphDef, q: int, stacked: bool, state: bool, old: Any, new: Any) -> None:
    path = "stack" + gdef.leaf_paths()[q][0]
    if not stacked and not state:
        raise GraphError(
            f"{path}: tied.scan: the body replaced a broadcast parameter (one array for every "
            "member): each step would replace it again. Replace it outside the scan, or keep "
            "per-step values in a tied.State."
        )
    if getattr(new, "shape", None) != old.shape or getattr(new, "dtype", None) != old.dtype:
        raise GraphError(
            f"{path}: tied.scan: the body wrote a value of shape {getattr(new, 'shape', None)} and "
            f"dtype {getattr(new, 'dtype', None)} where the member holds shape {old.shape} and "
            f"dtype {old.dtype}; a place keeps its shape and dtype across the steps."
        )


# ---------------------------------------------------------------- vmap


def _per_arg(spec: Any, n: int, what: str) -> list:
    if spec is None or isinstance(spec, int):
        return [spec] * n
    if isinstance(spec, (tuple, list)) and len(spec) == n:
        return list(spec)
    raise ValueError(
        f"tied.vmap: {what} must be an int, None, or a tuple with one entry per positional "
        f"argument ({n}), got {spec!r}."
    )


def _leaf_axes(args: tuple, axes: list, leaves: list, gdef: GraphDef) -> list:
    """The mapped axis (or None) of each unique array of the arguments: a `Stack` mapped on
    axis 0 maps its stacked arrays and leaves its broadcast objects unmapped."""
    found: dict[int, Any] = {}
    for a, ax in zip(args, axes):
        if ax is not None and not isinstance(ax, int):
            raise ValueError(f"tied.vmap: in_axes entries are ints or None, got {ax!r}.")
        if isinstance(a, Stack) and ax is not None:
            if ax != 0:
                raise ValueError(f"tied.vmap: a Stack is mapped over its members (axis 0), got axis {ax}.")
            a_leaves, _, flags = layout(a)
            pairs = [(x, 0 if f else None) for x, f in zip(a_leaves, flags)]
        else:
            a_leaves, a_gdef = flatten(a)
            if ax is not None and any(p.type is Stack for p in a_gdef.walk_places(paths=False)):
                raise ValueError(
                    "tied.vmap: an argument mapped on an axis holds a tied.Stack below its root, whose "
                    "broadcast objects have no member axis. Pass the Stack as its own argument "
                    "(in_axes=0 maps its members and shares its broadcast objects)."
                )
            pairs = [(x, ax) for x in a_leaves]
        for x, v in pairs:
            if found.setdefault(id(x), v) != v:
                raise ValueError(
                    f"tied.vmap: the array at {_arg_path(gdef, leaves, x)} is mapped in one argument "
                    f"and not (or on another axis) in another: one array has one in_axes."
                )
    return [found[id(x)] for x in leaves]


def _arg_path(gdef: GraphDef, leaves: list, x: Any) -> str:
    q = next(i for i, y in enumerate(leaves) if y is x)
    return _arg_name(gdef.leaf_paths()[q][0])


def vmap(
    f: Callable,
    in_axes: int | None | Sequence = 0,
    out_axes: int | None | Sequence = 0,
    *,
    axis_size: int | None = None,
) -> Callable:
    """`jax.vmap` with tied graphs in the arguments: ties kept, state written per member.

    ``in_axes`` has one entry per positional argument (or one for all): ``None``
    maps nothing (the argument, a model say, is shared by every example), ``0``
    maps a `Stack` over its members (an ensemble: its broadcast objects are
    shared) or every array of any other argument over its leading axis (another
    int: that axis). Ties hold across the arguments: an array held by two
    arguments is one input. The output keeps its ties (in each example, the
    same object at every place of a tie), with the mapped axis at ``out_axes``
    (an int or None for all, or one per element of a tuple output; an array
    returned in two elements of different axes is then two arrays, as `jax.vmap`
    gives them).

    State written into a mapped member is written into its slice of the stacked
    array. State written into an unmapped argument, or into a broadcast object of
    a mapped Stack, is a `GraphError` naming the place (there would be one write
    per example), and nothing is written.

    Args:
        f: the function; positional arguments only.
        in_axes: as above.
        out_axes: as above.
        axis_size: the number of examples, needed when nothing is mapped.

    Returns:
        The mapped function.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(3, 3, key=jax.random.key(0))
        >>> model = Chain(d, Dense(d.weight, d.bias))                # weight tied
        >>> xs = jnp.ones((5, 1, 3))
        >>> loss = lambda m, x: m(x).sum()
        >>> g = tied.vmap(tied.grad(loss), in_axes=(None, 0))(model, xs)   # per example
        >>> g.layers[0].weight.shape, g.layers[0].weight is g.layers[1].weight
        ((5, 3, 3), True)
    """

    if not (
        out_axes is None
        or isinstance(out_axes, int)
        or (type(out_axes) in (tuple, list) and all(a is None or isinstance(a, int) for a in out_axes))
    ):  # a dict's keys or a nested entry would be read as something else
        raise ValueError(
            f"tied.vmap: out_axes must be an int, None, or a tuple of ints and Nones (one per element "
            f"of a tuple output), got {out_axes!r}; return a flat tuple and give one axis per element."
        )

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError("tied.vmap: pass the arguments by position (in_axes names them by position).")
        axes = _per_arg(in_axes, len(args), "in_axes")
        leaves, gdef = flatten(args)
        leaf_axes = _leaf_axes(args, axes, leaves, gdef)
        mapped = [q for q, a in enumerate(leaf_axes) if a is not None]
        fixed = [q for q, a in enumerate(leaf_axes) if a is None]

        def call(copy):  # a mapped Stack is handed over as one member (its slice of each stacked array)
            return f(
                *(c.member if isinstance(c, Stack) and ax is not None else c for c, ax in zip(copy, axes))
            )

        def inner(m_leaves, f_leaves):
            full = _leaves_at(gdef.num_leaves, (mapped, m_leaves), (fixed, f_leaves))
            # checks are carried out per example, and checked around
            copy, out, checks = call_on_copy(gdef, full, call, list(m_leaves))
            after, written = read_writes("tied.vmap", copy, _arg_name)
            for q in written:
                if leaf_axes[q] != 0:
                    raise _unmapped_write(gdef, q, leaf_axes[q])
            out_leaves, out_gdef, totals = learn_output(out)
            parts, layout = _split_out(out, out_leaves, out_gdef, out_axes)
            learnt = Learnt(tuple(written), tuple(checks.checks), out_gdef, totals, layout)
            return parts, [after[q] for q in written], checks.values, learnt

        out_spec = out_axes if out_axes is None or isinstance(out_axes, int) else tuple(out_axes)
        in_spec = ([leaf_axes[q] for q in mapped], None)
        size = _stack_size(args, axes, axis_size)
        mapped_fn = jax.vmap(inner, in_axes=in_spec, out_axes=(out_spec, 0, 0, 0), axis_size=size)
        parts, new, checked, learnt = mapped_fn([leaves[q] for q in mapped], [leaves[q] for q in fixed])
        # every example's flags, before the write-back
        finish(learnt, checked, (args, gdef, leaves), list(new), "tied.vmap", _arg_name)
        return _join_out(parts, learnt)

    return wrapped


def _stack_size(args: tuple, axes: list, axis_size: int | None) -> int | None:
    """The number of examples: a mapped Stack's length (it knows it even when every array of
    it is broadcast, as in ``tied.stack([b, b])``), else ``axis_size``."""
    sizes = {len(a) for a, ax in zip(args, axes) if isinstance(a, Stack) and ax is not None}
    if axis_size is not None:
        sizes.add(axis_size)
    if len(sizes) > 1:
        raise ValueError(
            f"tied.vmap: the mapped Stacks (and axis_size) give {sorted(sizes)} examples; map "
            "Stacks of one length (and give axis_size equal to it, or leave it out)."
        )
    return next(iter(sizes), None)


def _arg_name(path: str) -> str:
    return "args" + path if path else "<root>"


def _unmapped_write(gdef: GraphDef, q: int, axis: Any) -> GraphError:
    path = gdef.leaf_paths()[q][0]
    if axis is None:
        return GraphError(
            "tied.vmap: the function wrote state into an object every example shares "
            "(an argument with in_axes=None, or a broadcast object of a mapped Stack): there "
            "would be one write per example for one place. Nothing was written. Give each "
            "member its own state (stack it), or write it outside tied.vmap.",
            path,
            name=_arg_name,
        )
    return GraphError(
        f"tied.vmap: the function wrote into an array mapped on axis {axis}; state "
        "writes are carried out on axis 0 only. Nothing was written.",
        path,
        name=_arg_name,
    )


def _split_out(out: Any, out_leaves: list, out_gdef: GraphDef, out_axes: Any) -> tuple[Any, Any]:
    """The output arrays as JAX's ``out_axes`` reads them (one list, or for per-element axes of
    a tuple output one list per element), and how to read them back (`_join_out`). An array
    held by elements of one axis is one output (where its first place is); one held by
    elements of different axes is one output per axis, as `jax.vmap` gives it (the elements
    are then rebuilt one by one)."""
    if out_axes is None or isinstance(out_axes, int):
        return out_leaves, None
    if type(out) is not tuple or len(out) != len(out_axes):  # a namedtuple's places are not [i]
        raise ValueError(
            f"tied.vmap: out_axes {out_axes!r} has one entry per element of a plain tuple output, but "
            f"the function returned {type(out).__name__}"
            + (f" of {len(out)} elements" if type(out) is tuple else "")
            + "; return a plain tuple of that many elements (tuple(...) of a namedtuple)."
        )
    elements: list[set] = [set() for _ in out_leaves]
    first = [None] * len(out_leaves)
    for path, q in out_gdef.place_leaves():
        e = next(i for i in range(len(out)) if path.startswith(f"[{i}]"))
        elements[q].add(e)
        if first[q] is None:
            first[q] = e
    groups: list[list] = [[] for _ in out]
    if all(len({out_axes[e] for e in es}) <= 1 for es in elements):
        order = []
        for q, e in enumerate(first):
            order.append((e, len(groups[e])))
            groups[e].append(out_leaves[q])
        return tuple(groups), ("order", tuple(order))
    seat: dict = {}  # (id of an array, axis) -> (element, position) of its one output
    split = []
    for e, element in enumerate(out):
        e_leaves, e_gdef, totals = learn_output(element)
        at = []
        for x in e_leaves:
            key = (id(x), out_axes[e])
            if key not in seat:
                seat[key] = (e, len(groups[e]))
                groups[e].append(x)
            at.append(seat[key])
        split.append((e_gdef, tuple(at), totals))
    return tuple(groups), ("split", tuple(split))


def _join_out(parts: Any, learnt: Learnt) -> Any:
    """The output rebuilt from what `jax.vmap` returned for `_split_out`'s arrays."""
    if learnt.more is None:
        return output_of(learnt.out, list(parts), learnt.totals)
    how, layout = learnt.more
    if how == "order":
        return output_of(learnt.out, [parts[e][k] for e, k in layout], learnt.totals)
    return tuple(output_of(e_gdef, [parts[e][k] for e, k in at], totals) for e_gdef, at, totals in layout)


# ---------------------------------------------------------------- remat


def remat(
    f: Callable,
    *,
    policy: Callable | None = None,
    prevent_cse: bool = True,
    static_argnums: int | Sequence[int] = (),
) -> Callable:
    """`jax.checkpoint` with tied graphs in the arguments: recompute in the backward pass.

    Gives the same values, gradients and state writes as ``f`` (state written
    inside is carried out of the checkpointed function and written into the
    arguments afterwards); the jaxpr holds JAX's remat primitive, so activations
    inside ``f`` are recomputed rather than stored (as ``policy`` says).

    Args:
        f: the function; its arguments and output may be any graphs.
        policy: a `jax.checkpoint_policies` policy, as in `jax.checkpoint`.
        prevent_cse: as in `jax.checkpoint`.
        static_argnums: positional arguments passed as they are (not traced).

    Returns:
        The rematerialised function.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(4, 2, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.Dense(emb.weight)}     # a tied head
        >>> block = tied.remat(lambda m, ids: m["head"](jnp.tanh(m["embed"](ids))))
        >>> g = tied.grad(lambda m: block(m, jnp.array([1, 2])).sum())(model)
        >>> g["embed"].weight is g["head"].weight                        # one total
        True
    """
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        n = len(args)
        static = {i % n: args[i] for i in nums if -n <= i < n}
        root = (tuple(None if i in static else a for i, a in enumerate(args)), kwargs)
        leaves, gdef = flatten(root)
        if static:  # one object in a static and a traced argument would be two inside
            refuse_static_ties(static_snapshot(tuple(static.items()), ()), root, gdef, "tied.remat")

        def call(copy):
            return f(*[static.get(i, a) for i, a in enumerate(copy[0])], **copy[1])

        def inner(given):
            held = static_snapshot(tuple(static.items()), ())  # the caller's own objects
            # checks are carried out, and checked around the remat
            copy, out, checks = call_on_copy(gdef, given, call, list(given))
            refuse_static_writes(held, who="tied.remat")
            after, written = read_writes("tied.remat", copy, place_name)
            out_leaves, out_gdef, totals = learn_output(out)
            learnt = Learnt(tuple(written), tuple(checks.checks), out_gdef, totals)
            return out_leaves, [after[q] for q in written], checks.values, learnt

        remat = jax.checkpoint(inner, prevent_cse=prevent_cse, policy=policy)
        out_leaves, new, checked, learnt = remat(list(leaves))
        # before the write-back
        finish(learnt, checked, (root, gdef, leaves), list(new), "tied.remat", place_name)
        return output_of(learnt.out, out_leaves, learnt.totals)

    return wrapped
