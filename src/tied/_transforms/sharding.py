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

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from .._core import GraphDef, GraphError, Places, flatten, get, read_places, rebuild

__all__ = ["device_put", "sharding_tree", "fsdp", "data_parallel", "DataParallel"]

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
    """The paths of unique leaf ``i`` at every place, in `read_places` order (a reference
    cycle followed once round, as `read_places` does)."""
    return [path for path, q in gdef.place_leaves() if q == i]


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


def sharding_tree(
    tree: Any,
    rules: Callable[[str, Any], Spec] | Sequence[tuple[str, Any]],
    *,
    mesh: Mesh | None = None,
    stack_axis: str | None = None,
) -> Any:
    """A shardings tree shaped like ``tree``, from a function of the path or from rules by pattern.

    For `device_put` and `tied.jit`'s ``in_shardings``/``out_shardings``. ``rules`` is either

    - a function ``fn(path, array)``, called once per *place* with the place's path
      (``".embed.weight"``, as `tied.ties` writes it) and the array there, returning a
      sharding or ``None`` (a `PartitionSpec` becomes ``NamedSharding(mesh, spec)`` when
      ``mesh`` is given); where it returns different shardings for two places of one
      shared array, using the tree raises an error naming both; or
    - a sequence of ``(pattern, spec)`` pairs, as MaxText's logical axis rules: at each
      place the first pair whose regular expression ``re.search``-es the place's full path
      wins. ``spec`` is a `PartitionSpec` (``mesh`` required), a `Sharding`, or a function
      ``(shape, mesh) -> PartitionSpec`` (as `tied.fsdp` gives). An array no pair matches
      at any of its places is replicated; a shared array matched at one place and not at
      another takes the match. **Inside a `tied.Stack` the specs are written for the
      member's arrays**: a stacked array gets its stack axis in front, ``stack_axis`` (a
      mesh axis or None) for the outermost Stack that stacks it and None for any further
      one, so ``P(None, "model")`` for a layer's ``(d, 3d)`` weight is ``P(stack_axis, None,
      "model")`` for the stacked ``(n, d, 3d)`` array. Given ``(model, opt_state)`` (a
      `tied.optim.setup` result beside its model), every state array shaped like its
      parameter (Adam's ``mu`` and ``nu``) takes the parameter's sharding, found by the
      parameter path the state is keyed by, and every other state array goes by the
      rules (a scalar such as ``count`` is replicated). An array no pair matches is
      replicated over its own dimensions; a stacked one still has its layer axis split
      over ``stack_axis``.

    Args:
        tree: the model (any object graph `tied.flatten` accepts), or ``(model, opt_state)``.
        rules: ``(path, array) -> Sharding | Device | PartitionSpec | None``, or a sequence
            of ``(pattern, spec)`` pairs.
        mesh: the mesh of `PartitionSpec` specs and of replicated arrays (taken from the
            first ``NamedSharding`` among the pairs if not given).
        stack_axis: the mesh axis that splits a Stack's layer axis (pairs only); None
            keeps every layer on every device.

    Returns:
        A tree of the same types as ``tree``, holding the shardings at its array places
        (one node per place: shared nodes are unrolled).

    Raises:
        ValueError: (pairs) two places of one shared array matched with different specs
            (naming both places and both specs); a mesh axis whose size does not divide the
            dimension it splits (naming the place, the dimension and the axis size); a spec
            longer than the array's rank, or naming an axis the mesh lacks; a
            `PartitionSpec` without a mesh; an optimiser state without its model.

    Examples:
        >>> import jax, numpy as np, tied
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
        >>> vocab = NamedSharding(mesh, P("model", None))
        >>> rep = NamedSharding(mesh, P())
        >>> emb = tied.nn.Embedding(512, 64, key=jax.random.key(0))
        >>> lm = {"embed": emb, "head": emb, "ln": tied.nn.LayerNorm(64)}
        >>> specs = tied.sharding_tree(lm, lambda path, x: vocab if x.shape[0] == 512 else rep)
        >>> specs["head"].weight == vocab, specs["ln"].bias == rep
        (True, True)
        >>> specs = tied.sharding_tree(lm, [("embed", P("model"))], mesh=mesh)
        >>> specs["head"].weight.spec == P("model"), specs["ln"].bias.spec == P()   # the tie takes the match
        (True, True)
        >>> lm = tied.device_put(lm, specs)
        >>> lm["embed"].weight is lm["head"].weight
        True
    """
    leaves, gdef = flatten(tree)
    tree_def, place_leaf = gdef.expand()
    if callable(rules):

        def named(s: Any) -> Any:
            return NamedSharding(mesh, s) if mesh is not None and isinstance(s, PartitionSpec) else s

        return rebuild(tree_def, [named(rules(path, leaves[q])) for path, q in gdef.place_leaves()])
    chosen = _by_rules(tree, leaves, gdef, _checked_rules(rules), mesh, stack_axis)
    return rebuild(tree_def, [chosen[q] for q in place_leaf])


# ---------------------------------------------------------------- rules by pattern

_WHO = "tied.sharding_tree"


class _Largest:
    """The spec `fsdp` gives: an array of at least ``min_size`` elements split along its largest
    dimension that the axis divides (the member's dimensions only: never a Stack's layer axis)."""

    def __init__(self, axis: str, min_size: int):
        self.axis, self.min_size = axis, min_size

    def spec_for(self, shape: tuple, lead: int, mesh: Mesh) -> PartitionSpec:
        if self.axis not in mesh.shape:
            raise ValueError(
                f"tied.fsdp: the mesh has axes {tuple(mesh.axis_names)}, not {self.axis!r}. Pass "
                f"tied.fsdp(axis=...) one of them, or build the mesh with an axis named {self.axis!r}."
            )
        size = mesh.shape[self.axis]
        member = shape[lead:]
        fits = [d for d in range(len(member)) if member[d] % size == 0]
        if int(np.prod(shape, dtype=np.int64)) < self.min_size or not fits:
            return PartitionSpec()
        d = max(fits, key=lambda d: (member[d], -d))  # the largest; the first of equal ones
        return PartitionSpec(*([None] * d), self.axis)

    def __repr__(self) -> str:
        return f"fsdp({self.axis!r}, min_size={self.min_size})"


def fsdp(axis: str = "fsdp", *, min_size: int = 2**16) -> list[tuple[str, Any]]:
    """Rules for `sharding_tree` that shard every large array over one mesh axis (FSDP, ZeRO-3).

    Every array of at least ``min_size`` elements is split along its largest dimension that
    the size of ``axis`` divides (the first of equal ones; inside a `tied.Stack`, a dimension
    of the member's array, never the layer axis); the rest is replicated. The rules are one
    pair, ``("", spec)``, matching every place: put your own pairs before them to decide
    some places otherwise. On a mesh with a data axis too (``Mesh(devices.reshape(2, 4),
    ("data", "fsdp"))``), the parameters are split over ``fsdp`` and copied over ``data``,
    and the batch is split over both (``PartitionSpec(("data", "fsdp"))``).

    Args:
        axis: the mesh axis that splits the arrays.
        min_size: the fewest elements (of the whole array, a Stack's layers included) an
            array has to be split; smaller ones are replicated.

    Returns:
        A list of ``(pattern, spec)`` pairs for `sharding_tree`.

    Examples:
        >>> import jax, numpy as np, tied
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        >>> emb = tied.nn.Embedding(512, 64, key=jax.random.key(0))
        >>> lm = {"embed": emb, "head": emb, "ln": tied.nn.LayerNorm(64)}
        >>> specs = tied.sharding_tree(lm, tied.fsdp(min_size=1024), mesh=mesh)
        >>> specs["head"].weight.spec == P("fsdp"), specs["ln"].weight.spec == P()   # the table by rows
        (True, True)
    """
    if not isinstance(axis, str):
        raise ValueError(f"tied.fsdp: axis is a mesh axis name (a str), got {type(axis).__name__} {axis!r}.")
    return [("", _Largest(axis, min_size))]


def _checked_rules(rules: Any) -> list[tuple[re.Pattern, Any]]:
    """The pairs, each pattern compiled; a pair of another form is a ValueError naming it."""
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Iterable):
        raise ValueError(
            f"{_WHO}: rules is a function (path, array) -> sharding or a sequence of (pattern, spec) "
            f"pairs, got {type(rules).__name__}. Write e.g. [(r'\\.qkv\\.weight$', P(None, 'model'))]."
        )
    out = []
    for k, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise ValueError(f"{_WHO}: rules[{k}] is {rule!r}, not a (pattern, spec) pair.")
        pattern, spec = rule
        if not isinstance(spec, (PartitionSpec, Sharding, _Largest)):
            raise ValueError(
                f"{_WHO}: rules[{k}] ({pattern!r}) has spec {spec!r}: expected a PartitionSpec, a "
                "jax.sharding.Sharding or what tied.fsdp gives."
            )
        try:
            out.append((re.compile(pattern), spec))
        except (re.error, TypeError) as e:
            raise ValueError(
                f"{_WHO}: rules[{k}]: the pattern {pattern!r} is not a regular expression: {e}."
            ) from None
    return out


class _ArrayPlace(NamedTuple):
    path: str
    leaf: int
    lead: int  # leading stack axes (one per enclosing Stack that stacks it)
    opt: int  # the node index of the optimiser state it sits in, or -1
    follows: str | None  # in an optimiser state: the parameter path its state is keyed by


def _is_opt_state(t: Any) -> bool:
    """A `tied.optim.OptState` (read by its public attributes: the transforms sit below optim)."""
    return isinstance(t, type) and all(hasattr(t, a) for a in ("inner_state", "spec", "paths", "frozen"))


def _array_places(gdef: GraphDef) -> tuple[list[_ArrayPlace], list[Any]]:
    """Every array place with its Stack axes and the parameter an optimiser state keys it by;
    and each optimiser state's `Place`."""
    stacks = {j: set(lay["stacked"]) for j, lay in gdef.layouts() if lay.get("type") == "tied.Stack"}
    out: list[_ArrayPlace] = []
    opt: list[Any] = []
    keys: list[Any] = []  # by depth: the key of the open place
    open_stack: list[set | None] = []  # by depth: a Stack's stacked places, or None
    in_opt: list[int] = []  # by depth: the optimiser state the open node is in, or -1
    for p in gdef.walk_places(expand_shared=True):
        del keys[p.depth :], open_stack[p.depth :], in_opt[p.depth :]
        keys.append(p.key)
        above = in_opt[-1] if in_opt else -1
        if p.kind == "array":
            lead = 0
            for d, stacked in enumerate(open_stack):
                rel = "".join(jax.tree_util.keystr((k,)) for k in keys[d + 2 :])
                if stacked is not None and rel in stacked:
                    lead += 1
            follows = None
            if above >= 0:
                dict_keys = [k.key for k in keys if isinstance(k, jax.tree_util.DictKey)]
                follows = next((k for k in reversed(dict_keys) if isinstance(k, str)), None)
            out.append(_ArrayPlace(p.path, p.index, lead, above, follows))
        elif p.kind != "static":
            open_stack.append(stacks.get(p.index))
            if above < 0 and _is_opt_state(p.type):
                opt.append(p)
                above = p.index
            in_opt.append(above)
    return out, opt


def _fits(path: str, shape: tuple, entries: tuple, mesh: Mesh) -> None:
    """A spec of the right length whose mesh axes divide the dimensions they split."""
    if len(entries) > len(shape):
        raise ValueError(
            f"{_WHO}: {path or '<root>'}: the spec {PartitionSpec(*entries)} has {len(entries)} entries "
            f"but the array has shape {shape} (rank {len(shape)}). Write one entry per dimension (inside "
            "a tied.Stack, per dimension of the member's array)."
        )
    used: set = set()
    for d, e in enumerate(entries):
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for n in names:
            if n not in mesh.shape:
                raise ValueError(
                    f"{_WHO}: {path or '<root>'}: the spec names mesh axis {n!r}, but the mesh has axes "
                    f"{tuple(mesh.axis_names)}."
                )
            if n in used:
                raise ValueError(
                    f"{_WHO}: {path or '<root>'}: the spec {PartitionSpec(*entries)} uses mesh axis {n!r} "
                    "twice (stack_axis is put in front of a stacked array's spec: name another axis)."
                )
            used.add(n)
        size = int(np.prod([mesh.shape[n] for n in names], dtype=np.int64))
        if shape[d] % size:
            raise ValueError(
                f"{_WHO}: {path or '<root>'}: dimension {d} of shape {shape} has size {shape[d]}, which "
                f"mesh axis {e!r} of size {size} does not divide (spec {PartitionSpec(*entries)}). Split "
                "another dimension, or pick a mesh whose axis size divides it."
            )


def _resolve(spec: Any, place: _ArrayPlace, shape: tuple, mesh: Mesh | None, stack_axis: Any) -> Sharding:
    """The sharding a matched spec gives the array at ``place`` (its stack axes in front)."""
    if isinstance(spec, _Largest):
        if mesh is None:
            raise ValueError(f"{_WHO}: tied.fsdp's rules need the mesh: pass mesh=.")
        spec = spec.spec_for(shape, place.lead, mesh)
    if isinstance(spec, NamedSharding):
        mesh, entries, kind = spec.mesh, tuple(spec.spec), spec.memory_kind
    elif isinstance(spec, PartitionSpec):
        if mesh is None:
            raise ValueError(
                f"{_WHO}: {place.path or '<root>'}: the rule gives the PartitionSpec {spec}, which needs "
                "a mesh: pass mesh= (or give a NamedSharding)."
            )
        entries, kind = tuple(spec), None
    else:
        if place.lead:
            raise ValueError(
                f"{_WHO}: {place.path or '<root>'}: the array is stacked by a tied.Stack, so its spec "
                f"gets the stack axis in front, which a {type(spec).__name__} cannot: give a "
                "PartitionSpec or a NamedSharding."
            )
        return spec
    if place.lead:
        entries = (stack_axis,) + (None,) * (place.lead - 1) + entries
    _fits(place.path, shape, entries, mesh)
    return NamedSharding(mesh, PartitionSpec(*entries), memory_kind=kind)


def _followed(tree: Any, gdef: GraphDef, places: list[_ArrayPlace], opt: list, leaves: list) -> dict:
    """For each optimiser state's array shaped like its parameter: that parameter's leaf, and
    every place of a parameter it could follow (a state beside two models of one structure)."""
    if not opt:
        return {}
    at = {p.path: p.leaf for p in places}
    where_in = Places(gdef)
    walk = list(gdef.walk_places(expand_shared=True))
    out = {}
    for o in opt:
        path = o.path
        state = get(tree, where_in.steps[path], where_in)
        wanted = list(state.paths)
        beside = [p.path for p in walk if p.parent == o.parent >= 0 and not _is_opt_state(p.type)]
        prefixes = [r for r in beside if all(r + w in at for w in wanted)]
        prefix = prefixes[0] if prefixes else None
        if prefix is None and wanted:
            raise ValueError(
                f"{_WHO}: the optimiser state at {path or '<root>'} is given without the model it was "
                f"set up for (no place beside it holds its parameters, e.g. {wanted[0]!r}). Pass "
                "(model, opt_state) together, so that its moments take their parameters' shardings."
            )
        for p in places:
            if p.opt != o.index or p.follows not in wanted:
                continue
            q = at[prefix + p.follows]
            if np.shape(leaves[p.leaf]) == np.shape(leaves[q]) and np.ndim(leaves[p.leaf]):
                out[p.leaf] = (q, [(p.path, r + p.follows, at[r + p.follows]) for r in prefixes])
    return out


def _by_rules(
    tree: Any, leaves: list, gdef: GraphDef, rules: list, mesh: Mesh | None, stack_axis: Any
) -> list:
    """One sharding per unique leaf of ``tree`` from ``(pattern, spec)`` rules."""
    if mesh is None:
        mesh = next((s.mesh for _, s in rules if isinstance(s, NamedSharding)), None)
    places, opt = _array_places(gdef)
    chosen: list = [None] * gdef.num_leaves
    first: list = [None] * gdef.num_leaves
    for place in places:
        spec = next((s for pattern, s in rules if pattern.search(place.path)), None)
        if spec is None:
            continue
        shape = tuple(np.shape(leaves[place.leaf]))
        try:
            sharding = _resolve(spec, place, shape, mesh, stack_axis)
        except ValueError:
            if place.opt < 0:
                raise
            # A rule written for a parameter also matches its optimiser state's path: an array of
            # another shape there (Adafactor's factored rows, Adam's count) is replicated instead.
            continue
        q = place.leaf
        if chosen[q] is None:
            chosen[q], first[q] = sharding, place.path
        elif not _same(chosen[q], sharding, len(shape)):
            a, b = first[q] or "<root>", place.path or "<root>"
            raise ValueError(
                f"{_WHO}: {a} and {b} hold one shared array, but the rules give it two different "
                f"specs: {_describe_sharding(chosen[q])} at {a} and {_describe_sharding(sharding)} at "
                f"{b}. A shared array is stored once, so it has one sharding: make the rules give "
                "both places the same spec, or match only one of them."
            )
    for place in places:  # no rule at any place: replicated (a Stack's layer axis over stack_axis)
        q = place.leaf
        if chosen[q] is None:
            if mesh is None:
                raise ValueError(
                    f"{_WHO}: no rule matches {place.path or '<root>'}, so it is replicated, which needs "
                    "a mesh: pass mesh=."
                )
            chosen[q] = _resolve(PartitionSpec(), place, tuple(np.shape(leaves[q])), mesh, stack_axis)
    for s, (q, each) in _followed(tree, gdef, places, opt, leaves).items():  # last: the parameters'
        for where, other, q2 in each:
            if not _same_layout(chosen[q2], chosen[q], np.ndim(leaves[q])):
                raise ValueError(
                    f"{_WHO}: the optimiser state's {where} may follow {each[0][1]} or {other}, which the "
                    f"rules shard differently ({_describe_sharding(chosen[q])} and "
                    f"{_describe_sharding(chosen[q2])}): which model it was set up for is not known. "
                    "Pass each model beside its own state, e.g. ((model_a, state_a), (model_b, state_b))."
                )
        chosen[s] = chosen[q]
    return chosen


def copy_shardings(args: Sequence[Any], out: Any, sharding_of: Callable[[Any], Any] | None = None) -> list:
    """For each unique array of ``out``, the sharding of its argument's array at the same place.

    What `tied.jit` passes to keep a training step sharded as its arguments are: where
    ``out`` holds an *updated copy* of an argument (a graph with the argument's structure,
    its GraphDef, at the output's root or a node one or two levels down, as a donated
    argument's copy is found), each array of the copy of the argument's shape takes the
    sharding of the argument's array at the same place (where several arguments have that
    structure, the output's k-th copy, in walk order, is the k-th such argument's); every
    other array gets None (left to XLA). Only identity and structure are read, so ``out`` may hold tracers.

    Args:
        args: the arguments (each one graph).
        out: the output graph.
        sharding_of: an argument's array -> its sharding (by default its ``.sharding``;
            under a trace, the sharding of the concrete input a tracer stands for).

    Returns:
        One sharding or None per unique array of ``out``, in `flatten` order.
    """
    read = sharding_of if sharding_of is not None else (lambda x: getattr(x, "sharding", None))
    targets = []
    for a in args:
        a_leaves, a_gdef = flatten(a)
        if a_gdef.num_nodes:  # a bare array has the structure of every array
            targets.append((a_gdef, a_leaves))
    out_leaves, out_gdef = flatten(out)
    chosen: list = [None] * len(out_leaves)
    if not targets:
        return chosen
    index = {id(x): q for q, x in enumerate(out_leaves)}
    seats = Places(out_gdef)
    used: dict = {}
    for p in out_gdef.walk_places():
        if p.depth > 2 or p.kind in ("array", "static") or not p.first:
            continue
        sub = out if p.depth == 0 else get(out, seats.steps[p.path], seats)
        try:
            sub_leaves, sub_gdef = flatten(sub)
        except GraphError:
            continue
        same = [leaves for g, leaves in targets if g == sub_gdef]
        if not same:
            continue
        # Arguments of one structure (a model and its EMA copy): the k-th copy in the output
        # takes the k-th such argument's shardings, never the first's for all of them.
        k = used.get(sub_gdef, 0)
        used[sub_gdef] = k + 1
        match = same[min(k, len(same) - 1)]
        for x, y in zip(match, sub_leaves):
            q = index[id(y)]
            if chosen[q] is None and np.shape(x) == np.shape(y):
                chosen[q] = read(x)
    return chosen


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
