"""The optimiser state of `tied.optim`, and matching it to a model by path.

`OptState` holds the optax state, the frozen flags and, as static data, what it
knows of the model it was set up for (`ParamSpec` per trainable parameter, the
`Layout` of shared nodes and state): no parameter arrays. `match_state` finds
each of the state's parameters in a model by path and refuses, naming the first
difference, a model that no longer lines up with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import GraphDef, is_param, trainable_mask

Trainable = Callable[[str, Any], bool]


class Layout(NamedTuple):
    """Where a model's places meet (no array): what `freeze` needs to read any place of it."""

    shared: tuple[tuple[str, ...], ...]  # the places of each shared node, first place first
    state: tuple[str, ...]  # the places of every state array (never trainable)
    # Each node with a layout (a tied.Stack): its places and its layout as sorted JSON. Shapes
    # cannot tell a stacked array from a broadcast one whose leading axis is n; this can.
    stacks: tuple[tuple[tuple[str, ...], str], ...] = ()


def layouts_of(gdef: GraphDef) -> tuple[tuple[tuple[str, ...], str], ...]:
    """`Layout.stacks` of a model: each node's places (`GraphDef.layouts`) and its layout."""
    paths = gdef.node_paths()
    return tuple((tuple(paths[j]), json.dumps(lay, sort_keys=True)) for j, lay in gdef.layouts())


class ParamSpec(NamedTuple):
    """What the optimiser state knows of one trainable parameter (no array).

    ``places`` are the keystr paths of the parameter's places (those below a
    shared node listed under its first place); ``path``, the first, keys the
    optax state.

    Examples:
        >>> import jax, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> state = tied.optim.setup(optax.sgd(0.1), Chain(d1, Dense(d1.weight, None)))
        >>> state.spec[0]
        ParamSpec(places=('.layers[0].weight', '.layers[1].weight'), shape=(2, 2), dtype='float32')
        >>> state.spec[0].path
        '.layers[0].weight'
    """

    places: tuple[str, ...]  # keystr paths of every place; the first one keys the optax state
    shape: tuple[int, ...]
    dtype: str

    @property
    def path(self) -> str:
        return self.places[0]


@jax.tree_util.register_pytree_with_keys_class
class OptState:
    """The optimiser state of a model: one optax state entry per unique trainable parameter.

    A JAX pytree whose leaves are the optax state's (and, once something is
    frozen, the frozen flags'), so it passes through ``jax.jit``, `tied.jit`,
    `tied.Graph`, `tied.flatten` and `tied.save`. It holds no parameter arrays.

    Attributes:
        inner_state: the optax state itself, built by ``tx.init`` on the dict
            from each trainable parameter's first path to the array (so
            ``state.inner_state.hyperparams["learning_rate"]`` under
            ``optax.inject_hyperparams``).
        frozen: a dict from the first path of each frozen parameter to
            ``jnp.array(True)`` (data, so that it is saved and loaded; its keys
            decide). Empty: nothing frozen.
        tx: the optax rule (static).
        spec: one `ParamSpec` (every place, shape, dtype) per trainable
            parameter, in the model's flatten order (static).
        trainable: the ``trainable=`` predicate given to `setup`, or None (static).
        layout: the places of each shared node and of each state array of the
            model (static, no arrays), so that `freeze` reads any place of a
            parameter and knows state when it is named.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))          # 2 parameters, 4 places
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> state, state.paths
        (OptState(2 unique parameters), ('.layers[0].weight', '.layers[0].bias'))
        >>> len(jax.tree_util.tree_leaves(state))              # count, mu and nu: no parameters
        5
        >>> tied.optim.freeze(state, ".layers[1].bias")
        OptState(2 unique parameters, 1 frozen)
    """

    __slots__ = ("inner_state", "frozen", "tx", "spec", "trainable", "layout")

    def __init__(
        self,
        inner_state: Any,
        frozen: dict,
        tx: Any,
        spec: tuple[ParamSpec, ...],
        trainable: Trainable | None = None,
        layout: Layout | None = None,
    ):
        # Stored as given: JAX's tree_unflatten may pass placeholders, not arrays.
        self.inner_state = inner_state
        self.frozen = frozen
        self.tx = tx
        self.spec = spec
        self.trainable = trainable
        self.layout = layout if layout is not None else Layout((), ())

    def _with(self, inner_state: Any, frozen: dict) -> OptState:
        return OptState(inner_state, frozen, self.tx, self.spec, self.trainable, self.layout)

    @property
    def paths(self) -> tuple[str, ...]:
        """The first path of each trainable parameter (the keys optax sees), in flatten order."""
        return tuple(s.path for s in self.spec)

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        children = ((keys("inner_state"), self.inner_state), (keys("frozen"), self.frozen))
        return children, (self.tx, self.spec, self.trainable, self.layout)

    def tree_flatten(self):
        return (self.inner_state, self.frozen), (self.tx, self.spec, self.trainable, self.layout)

    @staticmethod
    def __tied_layout__(aux: tuple) -> dict | None:
        """What a checkpoint records of the state beside its arrays (`GraphDef.layouts`): the
        layouts of the model's Stacks, so that a state saved alone is not loaded into the state
        of a model stacked otherwise whose moments have the same shapes. None without Stacks."""
        stacks = aux[3].stacks
        if not stacks:
            return None
        return {"type": "tied.OptState", "stacks": [[list(ps), json.loads(s)] for ps, s in stacks]}

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> OptState:
        inner_state, frozen = children
        return cls(inner_state, frozen, *aux)

    def __repr__(self) -> str:
        n_frozen = len(self.frozen) if isinstance(self.frozen, dict) else 0
        extra = f", {n_frozen} frozen" if n_frozen else ""
        return f"OptState({len(self.spec)} unique parameters{extra})"


# ---------------------------------------------------------------- matching state and model


def keyed(spec: tuple[ParamSpec, ...], values: list) -> dict:
    return {s.path: v for s, v in zip(spec, values)}


_dtype_names: dict = {}


def dtype_name(x: Any) -> str:
    dt = x.dtype
    name = _dtype_names.get(dt)
    if name is None:
        name = _dtype_names[dt] = str(jnp.dtype(dt))
    return name


def _describe(shape: tuple, dtype: str) -> str:
    return f"shape {shape} and dtype {dtype}"


def _setup_error(path: str, problem: str) -> ValueError:
    return ValueError(
        f"{path or '<root>'}: {problem} Pass the model the state was set up for (or its "
        "updated successor), or call tied.optim.setup(tx, model) for this one."
    )


# Where each of a state's parameters sits in a model depends only on the model's
# GraphDef, the state's spec and which arrays are trainable: kept for the next step.
_placements: dict = {}


def _place(state: OptState, leaves: list, gdef: GraphDef, mask: list[bool]) -> tuple[int, ...]:
    """The unique-leaf index of each of ``state``'s parameters, found by path, ties checked."""
    paths = gdef.leaf_paths()
    at: dict[str, int] = {}
    for i, ps in enumerate(paths):
        for p in ps:
            at.setdefault(p, i)
    train: list[int] = []
    for s in state.spec:
        i = at.get(s.path)
        if i is None:
            raise _setup_error(
                s.path, "the optimiser state has a parameter here, but the model has no array here."
            )
        if not mask[i]:
            x = leaves[i]
            why = "it is not trainable" + (
                f" (dtype {dtype_name(x)})" if not is_param(x) else " (rejected by the state's trainable=)"
            )
            raise _setup_error(s.path, f"the optimiser state has a parameter here, but in the model {why}.")
        if set(paths[i]) != set(s.places):  # the places, in whatever order the walk met them
            raise _setup_error(
                s.path,
                f"the optimiser state was set up for a parameter at the places {list(s.places)}, but "
                f"the model's array here sits at {list(paths[i])} (a tie was made or cut).",
            )
        train.append(i)
    stacks = layouts_of(gdef)
    if stacks != state.layout.stacks:
        mine, theirs = dict(stacks), dict(state.layout.stacks)
        at = next(ps for ps in sorted(set(mine) | set(theirs)) if mine.get(ps) != theirs.get(ps))
        raise _setup_error(
            at[0],
            f"the optimiser state was set up for a model whose layout here is {theirs.get(at, 'none')}, but "
            f"the model's is {mine.get(at, 'none')} (a tied.Stack stacked otherwise: moments of the same "
            "shapes would step other arrays).",
        )
    if sum(mask) != len(train):
        known = set(train)
        i = next(i for i, m in enumerate(mask) if m and i not in known)
        raise _setup_error(
            paths[i][0],
            "the model has a trainable parameter here that the optimiser state was not set up for.",
        )
    return tuple(train)


def match_state(state: Any, leaves: list, gdef: GraphDef) -> list[int]:
    """The unique-leaf index of each of ``state``'s parameters in this model, by path.

    Raises a ValueError naming the first path at which the model's trainable
    parameters and the state's differ (missing, new, a tie, a shape or a dtype).
    """
    if not isinstance(state, OptState):
        raise TypeError(
            f"expected the OptState from tied.optim.setup(tx, model), got {type(state).__name__}."
        )
    mask = trainable_mask(gdef, leaves, state.trainable)
    spec = state.spec
    try:
        key: Any = (gdef, id(spec), tuple(mask))
        hit = _placements.get(key)
    except TypeError:  # a GraphDef with an unhashable static field: not kept
        key, hit = None, None
    if hit is not None and hit[0] is spec:  # the spec itself is held, so its id is its own
        train = hit[1]
    else:
        train = _place(state, leaves, gdef, mask)
        if key is not None:
            if len(_placements) > 256:
                _placements.clear()
            _placements[key] = (spec, train)
    for s, i in zip(spec, train):
        x = leaves[i]
        shape, dtype = tuple(x.shape), dtype_name(x)
        if shape != s.shape or dtype != s.dtype:
            raise _setup_error(
                s.path,
                f"the model's parameter has {_describe(shape, dtype)} but the optimiser state was "
                f"set up for {_describe(s.shape, s.dtype)}.",
            )
    return list(train)
