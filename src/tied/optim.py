"""Sharing-aware optimisers over optax: one state and one step per unique parameter.

The rule is any optax ``GradientTransformation`` (``optax.adam``, ``chain``,
``clip_by_global_norm``, ``inject_hyperparams``, ``masked``,
``multi_transform``, ``MultiSteps`` ...), used unchanged. `setup` gives it the
model's unique trainable arrays, each once however many places hold it;
`update` first forms each parameter's total gradient, runs the rule once over
those totals, and rebuilds the model with every tie kept.

What optax sees, in optax's own conventions: a flat ``dict`` from the keystr
path of each unique trainable array's *first* place to the array (the
gradients and updates likewise). So masks and labels are ordinary optax
pytrees, or functions of that dict, as in optax's documentation (see the
examples below).

State belongs to a parameter's place, as in optax and Optimisers.jl: the
per-parameter entries of the optax state (Adam's ``mu`` and ``nu``) are dicts
keyed by those paths, so a checkpoint of the state shows
``inner_state[0].mu['.layers[0].weight']``. The state holds no parameter
arrays, and `update` refuses a model whose trainable parameters no longer line
up with it (a path, shape, dtype or tie that differs), naming the first
difference.

Total gradients: the first pass of `update` is `tied.accumulate`, which turns a
gradient in any convention (per-place partials, total at the first place, or
the aliased total of `tied.grad`) into one total per parameter. Call it yourself
when you want the totals (to log their norms, say).

Examples:
    >>> import jax, jax.numpy as jnp, optax, tied
    >>> from tied.nn import Chain, Dense
    >>> d1 = Dense(2, 2, key=jax.random.key(0))
    >>> c, x = Chain(d1, Dense(d1.weight, d1.bias)), jnp.ones((1, 2))
    >>> state = tied.optim.setup(optax.adam(1e-3), c)
    >>> g = tied.grad(lambda m: m(x).sum())(c)
    >>> c, state = tied.optim.update(state, c, g)
    >>> c.layers[0].weight is c.layers[1].weight
    True
    >>> sorted(state.inner_state[0].mu)
    ['.layers[0].bias', '.layers[0].weight']

    Weight decay masked by path, and labels by path (here the biases are not moved):

    >>> tx = optax.chain(
    ...     optax.masked(optax.add_decayed_weights(1e-4), lambda p: {k: k.endswith("weight") for k in p}),
    ...     optax.multi_transform(
    ...         {"fast": optax.adam(1e-2), "fixed": optax.set_to_zero()},
    ...         lambda p: {k: "fixed" if k.endswith("bias") else "fast" for k in p},
    ...     ),
    ... )
    >>> state = tied.optim.setup(tx, c)
    >>> c2, state = tied.optim.update(state, c, tied.grad(lambda m: m(x).sum())(c))
    >>> c2.layers[1].weight is c2.layers[0].weight, c2.layers[1].bias is c2.layers[0].bias
    (True, True)
    >>> bool((c2.layers[0].bias == c.layers[0].bias).all())         # "fixed": not moved
    True
    >>> bool((c2.layers[0].weight != c.layers[0].weight).all())     # "fast": moved
    True
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._grad import Convention, _check_convention, is_param, total_of, trainable_mask
from ._graph import GraphDef, flatten, read_places, unflatten
from ._implicit import Grads
from ._live import check_written, lock, slots, write
from ._view import View

__all__ = ["OptState", "ParamSpec", "setup", "update", "update_inplace", "freeze", "thaw"]

Trainable = Callable[[str, Any], bool]


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

    __slots__ = ("inner_state", "frozen", "tx", "spec", "trainable")

    def __init__(
        self,
        inner_state: Any,
        frozen: dict,
        tx: Any,
        spec: tuple[ParamSpec, ...],
        trainable: Trainable | None = None,
    ):
        # Stored as given: JAX's tree_unflatten may pass placeholders, not arrays.
        self.inner_state = inner_state
        self.frozen = frozen
        self.tx = tx
        self.spec = spec
        self.trainable = trainable

    @property
    def paths(self) -> tuple[str, ...]:
        """The first path of each trainable parameter (the keys optax sees), in flatten order."""
        return tuple(s.path for s in self.spec)

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        children = ((keys("inner_state"), self.inner_state), (keys("frozen"), self.frozen))
        return children, (self.tx, self.spec, self.trainable)

    def tree_flatten(self):
        return (self.inner_state, self.frozen), (self.tx, self.spec, self.trainable)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> OptState:
        inner_state, frozen = children
        tx, spec, trainable = aux
        return cls(inner_state, frozen, tx, spec, trainable)

    def __repr__(self) -> str:
        n_frozen = len(self.frozen) if isinstance(self.frozen, dict) else 0
        extra = f", {n_frozen} frozen" if n_frozen else ""
        return f"OptState({len(self.spec)} unique parameters{extra})"


# ---------------------------------------------------------------- matching state and model


def _keyed(spec: tuple[ParamSpec, ...], values: list) -> dict:
    return {s.path: v for s, v in zip(spec, values)}


_dtype_names: dict = {}


def _dtype(x: Any) -> str:
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
                f" (dtype {_dtype(x)})" if not is_param(x) else " (rejected by the state's trainable=)"
            )
            raise _setup_error(s.path, f"the optimiser state has a parameter here, but in the model {why}.")
        if set(paths[i]) != set(s.places):  # the places, in whatever order the walk met them
            raise _setup_error(
                s.path,
                f"the optimiser state was set up for a parameter at the places {list(s.places)}, but "
                f"the model's array here sits at {list(paths[i])} (a tie was made or cut).",
            )
        train.append(i)
    if sum(mask) != len(train):
        known = set(train)
        i = next(i for i, m in enumerate(mask) if m and i not in known)
        raise _setup_error(
            paths[i][0],
            "the model has a trainable parameter here that the optimiser state was not set up for.",
        )
    return tuple(train)


def _match(state: Any, leaves: list, gdef: GraphDef) -> list[int]:
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
        shape, dtype = tuple(x.shape), _dtype(x)
        if shape != s.shape or dtype != s.dtype:
            raise _setup_error(
                s.path,
                f"the model's parameter has {_describe(shape, dtype)} but the optimiser state was "
                f"set up for {_describe(s.shape, s.dtype)}.",
            )
    return list(train)


# ---------------------------------------------------------------- setup


def setup(tx: optax.GradientTransformation, model: Any, *, trainable: Trainable | None = None) -> OptState:
    """Initialise ``tx`` for ``model``: one state entry per unique trainable array.

    Args:
        tx: an optax ``GradientTransformation`` (any optimiser or combinator). It
            sees a dict from the keystr path of each unique trainable array's
            first place to the array, so masks and labels are dicts keyed by
            path, or functions of that dict.
        model: any object graph `tied.flatten` accepts. Its parameters are its
            unique arrays of inexact dtype; integer arrays are carried along.
        trainable: ``(path, array) -> bool``, decided from the path, shape and
            dtype: a parameter is trainable when it holds at any of its places.
            The others (running statistics, fixed embeddings) get no optimiser
            state and are kept unchanged by `update`, ties included. None: all.

    Returns:
        An `OptState`.

    Raises:
        ValueError: two parameters have the same keystr path (an attribute
            named ``"a.b"`` beside ``.a.b``), which optax's dict cannot hold.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))    # weight and bias, two places each
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> state
        OptState(2 unique parameters)
        >>> sorted(state.inner_state[0].mu)            # weight and bias: one moment each
        ['.layers[0].bias', '.layers[0].weight']
        >>> state = tied.optim.setup(optax.adam(1e-3), c, trainable=lambda p, a: a.ndim > 1)
        >>> state.paths
        ('.layers[0].weight',)
    """
    leaves, gdef = flatten(model)
    mask = trainable_mask(gdef, leaves, trainable)
    paths = gdef.leaf_paths()
    train = [i for i, m in enumerate(mask) if m]
    spec = tuple(ParamSpec(tuple(paths[i]), tuple(leaves[i].shape), _dtype(leaves[i])) for i in train)
    seen: dict[str, int] = {}
    for s in spec:
        if s.path in seen:
            raise ValueError(
                f"{s.path or '<root>'}: two different parameters have this same path (an attribute or "
                "key whose name contains '.' or '[' can read like another's path), and the optimiser "
                "state is keyed by path. Rename one of them."
            )
        seen[s.path] = 1
    try:
        inner = tx.init(_keyed(spec, [leaves[i] for i in train]))
    except (TypeError, ValueError) as e:
        if hasattr(e, "add_note"):
            keys = ", ".join(repr(s.path) for s in spec[:3]) + (", ..." if len(spec) > 3 else "")
            e.add_note(
                f"tied.optim.setup: optax sees the parameters as a dict from path to array ({{{keys}}}); "
                "a mask or labels must be a dict with those keys, or a function of the dict, e.g. "
                "lambda p: {k: k.endswith('weight') for k in p}."
            )
        raise
    return OptState(inner, {}, tx, spec, trainable)


# ---------------------------------------------------------------- update


def _totals(grads: Any, gdef: GraphDef, leaves: list, train: list[int], convention: Convention) -> list:
    """One total gradient (or None) per trainable parameter."""
    if isinstance(grads, Grads):
        return [grads._lookup(leaves[i]) for i in train]
    _check_convention(convention)
    found = read_places(gdef, grads)
    wanted = set(train)
    found = [objs if i in wanted else [] for i, objs in enumerate(found)]
    totals = total_of(found, leaves, convention, gdef)
    out = [totals[i] for i in train]
    for i, g in zip(train, out):
        if g is not None and getattr(g, "shape", None) != leaves[i].shape:
            path = gdef.leaf_paths()[i][0] or "<root>"
            raise ValueError(
                f"{path}: the gradient has shape {getattr(g, 'shape', None)} but the parameter "
                f"has shape {tuple(leaves[i].shape)}. Pass a gradient of this model "
                "(as tied.grad returns it)."
            )
    return out


def _hold(old: Any, new: Any, held: dict[str, bool]) -> Any:
    """``new`` optax state, with the per-parameter entries of held parameters taken from ``old``.

    Optax builds per-parameter state by mapping over the parameters, so every
    dict keyed by exactly the parameter paths is one entry per parameter.
    Global entries (step counters, hyperparameters) come from ``new``.
    """
    keys = held.keys()

    def per_param(x: Any) -> bool:
        return type(x) is dict and x.keys() == keys

    def pick(o: Any, nw: Any) -> Any:
        if per_param(o) and per_param(nw):
            return {k: o[k] if held[k] else nw[k] for k in nw}
        return nw

    return jax.tree_util.tree_map(pick, old, new, is_leaf=per_param)


def _step(
    state: OptState, model: Any, grads: Any, convention: Convention, extra_args: dict
) -> tuple[list, GraphDef, list[int], list, OptState]:
    leaves, gdef = flatten(model)
    train = _match(state, leaves, gdef)
    totals = _totals(grads, gdef, leaves, train, convention)
    params = [leaves[i] for i in train]
    spec, frozen = state.spec, state.frozen
    hold = [s.path in frozen or g is None for s, g in zip(spec, totals)]
    if all(hold):  # nothing to step: no rule runs, no counter advances
        return leaves, gdef, train, params, state
    # Frozen parameters and parameters without a gradient contribute zeros to
    # global transforms (a clipping norm) and are neither moved nor re-stated.
    g = [jnp.zeros_like(p) if h else t for p, t, h in zip(params, totals, hold)]
    p_dict = _keyed(spec, params)
    updates, inner = state.tx.update(_keyed(spec, g), state.inner_state, p_dict, **extra_args)
    stepped = optax.apply_updates(p_dict, updates)
    new_params = [p if h else stepped[s.path] for s, p, h in zip(spec, params, hold)]
    if any(hold):
        inner = _hold(state.inner_state, inner, _keyed(spec, hold))
    new_state = OptState(inner, frozen, state.tx, spec, state.trainable)
    return leaves, gdef, train, new_params, new_state


def update(
    state: OptState,
    model: Any,
    grads: Any,
    *,
    convention: Convention = "auto",
    **extra_args: Any,
) -> tuple[Any, OptState]:
    """One optimiser step: total gradients, the rule once per unique parameter, ties kept.

    Args:
        state: from `setup` (or a previous `update`).
        model: the model the state was set up for (or its updated successor):
            its trainable parameters must sit at the state's paths, with the same
            ties, shapes and dtypes.
        grads: a gradient of ``model`` in any convention `tied.accumulate`
            reads (the aliased totals of `tied.grad`, per-place partials,
            total at the first place), ``None`` standing for a subtree without
            gradient; or a `tied.Grads` from `tied.gradient`.
        convention: how to read the gradient, as in `tied.accumulate`; give
            ``"partials"`` for plain ``jax.grad`` output.
        **extra_args: passed on to ``tx.update`` (e.g. ``value=`` for rules that
            need the loss).

    Returns:
        ``(new_model, new_state)``. Every tie of ``model`` is kept (arrays and
        container nodes), static fields are unchanged, and ``model`` itself is
        untouched. A parameter whose gradient is ``None`` at every place, a
        frozen one and one that is not trainable is the same object as before,
        and its per-parameter optax state is kept (global counters still
        advance, unless no parameter is stepped at all).

    Raises:
        ValueError: the model does not line up with the state (the message names
            the first differing path), or an aliased gradient that tied did not
            make under ``convention="auto"`` (see `tied.accumulate`).

    Works eagerly, inside `tied.jit` (return ``(model, state)`` from the
    compiled function), and under ``jax.jit`` on `tied.Graph` arguments.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d, d)                                    # one layer at two places
        >>> loss = lambda m: m(jnp.ones((1, 2))).sum()
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> c2, state = tied.optim.update(state, c, tied.grad(loss)(c))
        >>> c2.layers[0] is c2.layers[1]
        True

        Per-place partials (as plain ``jax.grad`` gives on an untied copy) are
        summed into the total first:

        >>> state = tied.optim.setup(optax.sgd(0.1), c)
        >>> c3, _ = tied.optim.update(state, c, tied.grad(loss, per_location=True)(c))
        >>> total = tied.grad(loss)(c).layers[0].weight
        >>> bool(jnp.allclose(c3.layers[0].weight, d.weight - 0.1 * total))
        True
    """
    leaves, gdef, train, new_params, new_state = _step(state, model, grads, convention, extra_args)
    new_leaves = list(leaves)
    for i, p in zip(train, new_params):
        new_leaves[i] = p
    return unflatten(gdef, new_leaves), new_state


def update_inplace(
    state: OptState,
    model: Any,
    grads: Any,
    *,
    convention: Convention = "auto",
    **extra_args: Any,
) -> OptState:
    """Like `update`, writing each new array into every place of the existing model.

    For mutable models (lists, dicts, classes given to `tied.register`,
    non-frozen dataclasses): outside references to the model, or to any of its
    layers, see the update. Eager only (under a JAX transform, write nothing
    into Python objects: use `update`).

    Args:
        state: as in `update`.
        model: as in `update`; a mutable model, written into.
        grads: as in `update`.
        convention: as in `update`.
        **extra_args: as in `update`.

    Returns:
        The new `OptState`.

    Raises:
        GraphError: a parameter place sits in an immutable container (a tuple,
            namedtuple, frozen dataclass or JAX-registered node such as an
            Equinox module); the message names the path. Raised before
            anything is written.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))    # weight and bias, two places each
        >>> old = d1.weight
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> state = tied.optim.update_inplace(state, c, tied.grad(lambda m: m(jnp.ones(2)).sum())(c))
        >>> d1.weight is c.layers[1].weight, d1.weight is old   # d1 now holds the new array
        (True, False)
    """
    with lock:
        leaves, gdef = flatten(model)
        train = _match(state, leaves, gdef)
        places = slots(model, gdef, train, action="tied.optim.update_inplace", frozen_ok=False)
        _, _, _, new_params, new_state = _step(state, model, grads, convention, extra_args)
        write(places, new_params)
        new_leaves = list(leaves)
        for i, p in zip(train, new_params):
            new_leaves[i] = p
        check_written(
            model, gdef, new_leaves, places,
            why="tied.optim.update_inplace wrote the new array here, but a walk of the model does not "
            "find it (the container rebuilds its children). Use tied.optim.update.",
        )
    return new_state


# ---------------------------------------------------------------- freeze and thaw


def _by_path(state: OptState, path: str, n: int, fn: str) -> str:
    """The state's key (first path) of the parameter with a place at ``path``."""
    if path == "<root>":
        path = ""
    for s in state.spec:
        for p in s.places:
            # a view's place: its source sits at path + ".source" (+ ".source" ...)
            if p == path or (p.startswith(path + ".source") and not p[len(path):].replace(".source", "")):
                return s.path
    places = [p for s in state.spec for p in s.places]
    near = difflib.get_close_matches(path, places, n=3, cutoff=0.5) or places[:3]
    raise ValueError(
        f"tied.optim.{fn}: argument {n} ({path!r}) is not a place of a trainable parameter of the "
        f"optimiser state. Nearest places: {', '.join(repr(p) for p in near)}. Paths are keystr "
        "paths as tied.ties prints them."
    )


def _by_array(state: OptState, a: Any, n: int, model: Any, fn: str) -> str:
    target = a
    while isinstance(target, View):
        target = target.source
    if model is None:
        raise ValueError(
            f"tied.optim.{fn}: argument {n} is an array, but the optimiser state holds no parameter "
            f"arrays to find it among. Pass the model that holds it, tied.optim.{fn}(state, array, "
            f"model=model), or name it by path, tied.optim.{fn}(state, '.layers[0].weight')."
        )
    leaves, gdef = flatten(model)
    train = _match(state, leaves, gdef)
    for s, i in zip(state.spec, train):
        if leaves[i] is target:
            return s.path
    shape, dtype = getattr(target, "shape", None), getattr(target, "dtype", None)
    in_model = any(x is target for x in leaves)
    why = (
        "is in the model but not trainable (an integer dtype, or rejected by trainable=)"
        if in_model
        else "is not one of the model's arrays, matched by identity"
    )
    raise ValueError(
        f"tied.optim.{fn}: argument {n} ({type(target).__name__} of shape {shape}, dtype {dtype}) "
        f"{why}. Pass the array the model holds at any one of its places (e.g. "
        "model.layers[1].weight), or its path."
    )


def _resolve(state: OptState, where: tuple, model: Any, fn: str) -> list[str]:
    if not isinstance(state, OptState):
        raise TypeError(
            f"tied.optim.{fn}: expected the OptState from tied.optim.setup(tx, model), got "
            f"{type(state).__name__}."
        )
    if model is not None:
        leaves, gdef = flatten(model)
        _match(state, leaves, gdef)
    out = []
    for n, w in enumerate(where):
        if isinstance(w, str):
            out.append(_by_path(state, w, n, fn))
        elif isinstance(w, View) or hasattr(w, "shape"):
            out.append(_by_array(state, w, n, model, fn))
        else:
            raise TypeError(
                f"tied.optim.{fn}: argument {n} is a {type(w).__name__}; name a parameter by a keystr "
                "path of any of its places ('.layers[0].weight') or by the array (with model=)."
            )
    return out


def freeze(state: OptState, *where: str | Any, model: Any = None) -> OptState:
    """Stop updating some parameters; functional (returns a new state).

    A parameter is named by the keystr path of any one of its places, or by the
    array itself (or a `tied.View` of it) taken from the model, which then must
    be passed as ``model=``: the state holds no arrays. Freezing through one
    place freezes the parameter everywhere. A frozen parameter is not moved,
    its optax state is kept as it was, and it contributes zeros to global
    transforms such as clipping norms. Frozen flags are data in the state
    (``state.frozen``), so they survive `update`, ``jax.jit``, `tied.jit` and a
    `tied.save`/`tied.load` round trip (load into a state frozen the same way).

    Args:
        state: the current `OptState`.
        *where: paths (str) or arrays of the parameters to freeze.
        model: the model, to find arrays in (checked against the state).

    Returns:
        A new `OptState` with those parameters frozen.

    Raises:
        ValueError: an unknown path (the nearest ones are listed), an array
            without ``model=``, or an array that is not a trainable parameter.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))    # weight and bias, two places each
        >>> state = tied.optim.setup(optax.adam(1e-3), c)
        >>> state = tied.optim.freeze(state, ".layers[1].weight")       # also .layers[0].weight
        >>> state = tied.optim.freeze(state, c.layers[0].bias, model=c)
        >>> sorted(state.frozen)
        ['.layers[0].bias', '.layers[0].weight']
        >>> c2, state = tied.optim.update(state, c, tied.grad(lambda m: m(jnp.ones(2)).sum())(c))
        >>> c2.layers[1].weight is d1.weight                           # not moved
        True
    """
    keys = set(_resolve(state, where, model, "freeze")) | set(state.frozen)
    frozen = {s.path: state.frozen.get(s.path, None) for s in state.spec if s.path in keys}
    frozen = {k: jnp.array(True) if v is None else v for k, v in frozen.items()}
    return OptState(state.inner_state, frozen, state.tx, state.spec, state.trainable)


def thaw(state: OptState, *where: str | Any, model: Any = None) -> OptState:
    """Update some frozen parameters again; functional (returns a new state).

    Args, lookup and errors as in `freeze`.

    Returns:
        A new `OptState` with those parameters no longer frozen.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))    # weight and bias, two places each
        >>> state = tied.optim.freeze(tied.optim.setup(optax.adam(1e-3), c), ".layers[0].weight")
        >>> state = tied.optim.thaw(state, ".layers[1].weight")   # through either place
        >>> state.frozen
        {}
    """
    keys = set(_resolve(state, where, model, "thaw"))
    frozen = {k: v for k, v in state.frozen.items() if k not in keys}
    return OptState(state.inner_state, frozen, state.tx, state.spec, state.trainable)
