"""Several devices through JAX's own sharding: each unique array placed once, ties kept.

JAX lays arrays out over devices with a `jax.sharding.Sharding` (usually a
``NamedSharding`` over a ``Mesh``), and spreads computations with ``jax.jit``'s
``in_shardings``/``out_shardings``. Over a pytree that repeats a shared array,
each place is laid out on its own: two copies, possibly in two layouts. Here a
shardings tree shaped like the model is read at every *place* (with the core's
`read_places`) and folded into one sharding per *unique array*; two places of
one array given different shardings is an error naming both paths.

A shardings spec, wherever one is accepted, is either a single sharding for
everything, or a tree shaped like the model whose entries are shardings,
``None`` (no preference: leave the array where it is, or let JAX choose) or a
sharding at a node's place, which applies to the whole subtree below it.
`sharding_tree` builds such a tree from a function of the path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from .._core import GraphDef, GraphError, expand, flatten, place_paths, read_places, rebuild

__all__ = ["device_put", "sharding_tree", "data_parallel", "DataParallel"]

Spec = Sharding | jax.Device | PartitionSpec | None


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (Sharding, jax.Device, PartitionSpec))


def _normalise(x: Any) -> Any:
    # jax.jit's in_shardings take Shardings, not Devices.
    return SingleDeviceSharding(x) if isinstance(x, jax.Device) else x


def _spec_entries(spec: PartitionSpec) -> tuple:
    """A PartitionSpec written one way: ``P('x', None)`` as ``P('x')``, ``(('x',),)`` as ``('x',)``."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _same(a: Any, b: Any, ndim: int) -> bool:
    """Whether two shardings asked for one array agree.

    Two NamedShardings agree when they name the same mesh and the same spec
    (written either way): a spec that differs is a mistake even where the mesh
    makes the layouts coincide (one device), so it is caught before the code
    meets a bigger mesh. Other shardings agree when they lay the array out alike.
    """
    if a is b or a == b:
        return True
    if isinstance(a, NamedSharding) and isinstance(b, NamedSharding):
        return (
            a.mesh == b.mesh
            and a.memory_kind == b.memory_kind
            and _spec_entries(a.spec) == _spec_entries(b.spec)
        )
    return _same_layout(a, b, ndim)


def _same_layout(a: Any, b: Any, ndim: int) -> bool:
    """Whether two shardings put the same pieces of an array on the same devices."""
    if a is b or a == b:
        return True
    if isinstance(a, Sharding) and isinstance(b, Sharding):
        try:
            return a.is_equivalent_to(b, ndim)
        except Exception:  # different device sets, or a spec longer than the rank
            return False
    return False


def _paths_of(gdef: GraphDef, i: int) -> list[str]:
    """The paths of unique leaf ``i`` at every place, in `read_places` order."""
    try:
        tree_def, place_leaf = expand(gdef)
    except GraphError:  # a reference cycle: first places only
        return list(place_paths(gdef).leaves[i])
    tree_paths = place_paths(tree_def).leaves
    return [tree_paths[p][0] for p, q in enumerate(place_leaf) if q == i]


def _describe_sharding(s: Any) -> str:
    if isinstance(s, NamedSharding):
        return f"NamedSharding(spec={s.spec}, mesh axes {dict(s.mesh.shape)})"
    return repr(s)


def leaf_shardings(
    gdef: GraphDef,
    spec: Any,
    ndims: Sequence[int],
    *,
    label: str,
    name: Callable[[str], str] = lambda p: p or "<root>",
) -> list:
    """One sharding (or None) per unique leaf of ``gdef``, read from ``spec``.

    Args:
        gdef: the structure the spec describes.
        spec: a single sharding (or Device, PartitionSpec, None), or a tree
            shaped like the graph with those at its places.
        ndims: the rank of each unique leaf (to compare layouts).
        label: the caller, for error messages (``"tied.device_put"``).
        name: writes a path of ``gdef`` for a message.

    Raises:
        ValueError: two places of one shared array are given different shardings.
        GraphError: the tree does not mirror the graph, or holds something other
            than a sharding at an array's place.
    """
    if _is_spec(spec):
        return [_normalise(spec)] * gdef.num_leaves
    found = read_places(
        gdef,
        spec,
        what="shardings tree",
        hint="one sharding or None per array, or a sharding for a whole subtree; tied.sharding_tree "
        "builds one",
        broadcast=_is_spec,
    )
    out = []
    for i, candidates in enumerate(found):
        chosen, first = None, -1
        for k, s in enumerate(candidates):
            if s is None:
                continue
            if not _is_spec(s):
                where = name(_paths_of(gdef, i)[k])
                raise GraphError(
                    f"{label}: {where}: expected a jax.sharding.Sharding, a jax.Device, a "
                    f"PartitionSpec or None, found {type(s).__name__}. Put a sharding at every "
                    "array's place (or one for a whole subtree), e.g. "
                    "NamedSharding(mesh, PartitionSpec())."
                )
            if chosen is None:
                chosen, first = s, k
            elif not _same(chosen, s, ndims[i]):
                paths = _paths_of(gdef, i)
                a, b = name(paths[first]), name(paths[k])
                raise ValueError(
                    f"{label}: {a} and {b} hold one shared array, but it is given two different "
                    f"shardings: {_describe_sharding(chosen)} at {a} and {_describe_sharding(s)} at {b}. "
                    "A shared "
                    "array is stored once, so it has one sharding: give both places the same "
                    "sharding, or None at one of them to take the other's."
                )
        out.append(_normalise(chosen))
    return out


def device_put(tree: Any, sharding_or_tree: Any) -> Any:
    """Place each unique array of an object graph once, by JAX's `jax.device_put`; ties kept.

    Args:
        tree: any object graph `tied.flatten` accepts (a model, ``(model, opt_state)`` ...).
        sharding_or_tree: a `jax.sharding.Sharding` (or `jax.Device`) for every
            array, or a tree shaped like ``tree`` with a sharding, a device or
            ``None`` (leave the array as it is) at each array's place, or one
            sharding at a node's place for the whole subtree (`sharding_tree`
            builds one from a function of the path).

    Returns:
        A new graph with the same structure and ties: an array shared by
        several places is one placed array, the same object at each place.

    Raises:
        ValueError: two places of one shared array are given different
            shardings; the message names both paths.

    Examples:
        >>> import jax, numpy as np, tied
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
        >>> mesh = Mesh(np.array(jax.devices()), ("model",))
        >>> emb = tied.nn.Embedding(512, 64, key=jax.random.key(0))
        >>> lm = {"embed": emb, "head": emb}               # the tied output head
        >>> vocab = NamedSharding(mesh, PartitionSpec("model", None))
        >>> lm = tied.device_put(lm, {"embed": vocab, "head": None})
        >>> lm["embed"].weight is lm["head"].weight        # one array, split by rows
        True
        >>> lm["head"].weight.sharding == vocab
        True
    """
    leaves, gdef = flatten(tree)
    specs = leaf_shardings(gdef, sharding_or_tree, [np.ndim(x) for x in leaves], label="tied.device_put")
    chosen = [i for i, s in enumerate(specs) if s is not None]
    new = list(leaves)
    if chosen:
        placed = jax.device_put([leaves[i] for i in chosen], [specs[i] for i in chosen])
        for i, x in zip(chosen, placed):
            new[i] = x
    return rebuild(gdef, new)


def sharding_tree(tree: Any, fn: Callable[[str, Any], Spec]) -> Any:
    """A shardings tree shaped like ``tree``: ``fn(path, array)`` at every array's place.

    For `device_put` and `tied.jit`'s ``in_shardings``/``out_shardings``. ``fn``
    is called once per *place*, with the place's path (``".embed.weight"``,
    as `tied.ties` writes it) and the array there, and returns a sharding or
    ``None``. Where it returns different shardings for two places of one
    shared array, using the tree raises an error naming both.

    Args:
        tree: the model (any object graph `tied.flatten` accepts).
        fn: ``(path, array) -> Sharding | Device | PartitionSpec | None``.

    Returns:
        A tree of the same types as ``tree``, holding the shardings at its
        array places (one node per place: shared nodes are unrolled).

    Examples:
        >>> import jax, numpy as np, tied
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
        >>> mesh = Mesh(np.array(jax.devices()), ("model",))
        >>> vocab = NamedSharding(mesh, PartitionSpec("model", None))
        >>> rep = NamedSharding(mesh, PartitionSpec())
        >>> emb = tied.nn.Embedding(512, 64, key=jax.random.key(0))
        >>> lm = {"embed": emb, "head": emb, "ln": tied.nn.LayerNorm(64)}
        >>> specs = tied.sharding_tree(lm, lambda path, x: vocab if x.shape[0] == 512 else rep)
        >>> specs["head"].weight == vocab, specs["ln"].bias == rep
        (True, True)
        >>> lm = tied.device_put(lm, specs)
        >>> lm["embed"].weight is lm["head"].weight
        True
    """
    leaves, gdef = flatten(tree)
    tree_def, place_leaf = expand(gdef)
    paths = place_paths(tree_def).leaves
    return rebuild(tree_def, [fn(paths[p][0], leaves[q]) for p, q in enumerate(place_leaf)])


class DataParallel(NamedTuple):
    """Shardings for data parallelism over one axis of a mesh (from `data_parallel`).

    Attributes:
        mesh: the device mesh.
        replicated: ``NamedSharding(mesh, PartitionSpec())``: a full copy on every
            device, for parameters, optimiser state and scalars such as the loss.
        batch: ``NamedSharding(mesh, PartitionSpec(axis))``: the leading (batch)
            axis split over the mesh axis, the rest replicated.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from jax.sharding import PartitionSpec
        >>> dp = tied.data_parallel()
        >>> dp.batch.spec == PartitionSpec("data"), dp.replicated.spec == PartitionSpec()
        (True, True)
        >>> emb = tied.nn.Embedding(8, 4, key=jax.random.key(0))
        >>> model = tied.device_put({"embed": emb, "head": emb}, dp.replicated)
        >>> model["embed"] is model["head"], model["head"].weight.sharding == dp.replicated
        (True, True)
        >>> x = tied.device_put(jnp.zeros((2 * jax.device_count(), 3)), dp.batch)
        >>> len(x.addressable_shards) == jax.device_count()
        True
    """

    mesh: Mesh
    replicated: NamedSharding
    batch: NamedSharding


def data_parallel(mesh: Mesh | None = None, axis: str = "data") -> DataParallel:
    """Shardings that replicate the model and optimiser state and split the batch.

    With ``tied.jit(step, in_shardings=(dp.replicated, dp.replicated, dp.batch),
    out_shardings=dp.replicated)``, JAX runs the step on every device of the
    mesh, each on its slice of the batch, and all-reduces the gradients; a
    shared parameter is one replicated array, summed once.

    Args:
        mesh: a `jax.sharding.Mesh`; by default a one-axis mesh over every
            device of every process, ``Mesh(jax.devices(), (axis,))``.
        axis: the mesh axis that splits the batch.

    Returns:
        A `DataParallel` ``(mesh, replicated, batch)``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> emb = tied.nn.Embedding(16, 8, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": emb}    # a tied output head
        >>> def loss(m, ids):
        ...     logits = m["head"].attend(m["embed"](ids[:, :-1]))
        ...     return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        >>> def train_step(m, s, ids):
        ...     value, g = tied.value_and_grad(loss)(m, ids)
        ...     m, s = tied.optim.update(s, m, g)
        ...     return m, s, value
        >>> state = tied.optim.setup(optax.adam(1e-2), model)
        >>> dp = tied.data_parallel()              # all devices, axis "data"
        >>> model, state = tied.device_put((model, state), dp.replicated)
        >>> step = tied.jit(train_step, in_shardings=(dp.replicated, dp.replicated, dp.batch),
        ...                 out_shardings=dp.replicated)
        >>> batch = jnp.zeros((2 * jax.device_count(), 6), dtype=jnp.int32)   # split over devices
        >>> model, state, value = step(model, state, tied.device_put(batch, dp.batch))
        >>> model["embed"] is model["head"]        # the tie holds on every device
        True
    """
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()), (axis,))
    if axis not in mesh.axis_names:
        raise ValueError(
            f"tied.data_parallel: the mesh has axes {tuple(mesh.axis_names)}, not {axis!r}. "
            f"Pass axis= one of them, or build the mesh with an axis named {axis!r}."
        )
    return DataParallel(mesh, NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(axis)))
