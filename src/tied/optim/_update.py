"""setup, update and freezing: optax over the unique parameters."""

from __future__ import annotations

import difflib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._core import (
    GraphDef,
    View,
    at_or_below,
    check_written,
    covered,
    flatten,
    is_param,
    live_lock,
    read_places,
    slots,
    trainable_mask,
    unflatten,
    warn_none_selected,
    write,
)
from .._transforms import Convention, Grads, check_convention, total_of
from ._state import Layout, OptState, ParamSpec, Trainable, dtype_name, keyed, layouts_of, match_state

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
        >>> import jax.numpy as jnp, optax, tied
        >>> w = jnp.ones((3, 2))
        >>> model = {"embed": w, "head": w, "bias": jnp.zeros(3)}   # the weight at two places
        >>> state = tied.optim.setup(optax.adam(1e-3), model)
        >>> state
        OptState(2 unique parameters)
        >>> sorted(state.inner_state[0].mu)      # one moment per array, under its first place
        ["['bias']", "['embed']"]
        >>> state = tied.optim.setup(optax.adam(1e-3), model, trainable=lambda p, a: a.ndim > 1)
        >>> state.paths
        ("['embed']",)
    """
    leaves, gdef = flatten(model)
    mask = trainable_mask(gdef, leaves, trainable)
    paths = gdef.leaf_paths()
    train = [i for i, m in enumerate(mask) if m]
    is_state = gdef.state_leaves()
    if trainable is not None and not train:
        warn_none_selected(
            trainable, [p[0] for p, x, st in zip(paths, leaves, is_state) if is_param(x) and not st]
        )
    layout = Layout(
        tuple(gdef.shared_node_paths()),
        tuple(p for ps, st in zip(paths, is_state) if st for p in ps),
        layouts_of(gdef),
    )
    spec = tuple(ParamSpec(tuple(paths[i]), tuple(leaves[i].shape), dtype_name(leaves[i])) for i in train)
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
        inner = tx.init(keyed(spec, [leaves[i] for i in train]))
    except (TypeError, ValueError) as e:
        if hasattr(e, "add_note"):
            keys = ", ".join(repr(s.path) for s in spec[:3]) + (", ..." if len(spec) > 3 else "")
            e.add_note(
                f"tied.optim.setup: optax sees the parameters as a dict from path to array ({{{keys}}}); "
                "a mask or labels must be a dict with those keys, or a function of the dict, e.g. "
                "lambda p: {k: k.endswith('weight') for k in p}."
            )
        raise
    if spec:
        warn_empty_masks(inner, keyed(spec, spec).keys())
    return OptState(inner, {}, tx, spec, trainable, layout)


def warn_empty_masks(inner: Any, keys: Any) -> None:
    """Warn for each optax mask or label (``masked``, ``multi_transform``) that selects no
    parameter: seen where its inner rule keeps per-parameter state, all of it masked out."""

    def per_param(x: Any) -> bool:
        return type(x) is dict and x.keys() == keys

    def masked(x: Any) -> bool:
        return isinstance(x, optax.MaskedState)

    for path, ms in jax.tree_util.tree_flatten_with_path(inner, is_leaf=masked)[0]:
        if not masked(ms):
            continue
        entries = [d for d in jax.tree_util.tree_leaves(ms.inner_state, is_leaf=per_param) if per_param(d)]
        if entries and all(isinstance(v, optax.MaskedNode) for d in entries for v in d.values()):
            warnings.warn(
                f"tied.optim.setup: the optax mask or labels at state{jax.tree_util.keystr(path)} select "
                f"none of the {len(keys)} parameters ({', '.join(map(repr, list(keys)[:3]))}, ...), so "
                "that rule moves nothing. They see keystr paths as tied.ties prints them; a Flax NNX "
                "parameter's path ends in '.value' ('.block.kernel.value').",
                UserWarning,
                stacklevel=3,
            )


# ---------------------------------------------------------------- update


def _totals(grads: Any, gdef: GraphDef, leaves: list, train: list[int], convention: Convention) -> list:
    """One total gradient (or None) per trainable parameter."""
    if isinstance(grads, Grads):
        return [grads._lookup(leaves[i]) for i in train]
    check_convention(convention)
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
    train = match_state(state, leaves, gdef)
    totals = _totals(grads, gdef, leaves, train, convention)
    params = [leaves[i] for i in train]
    spec, frozen = state.spec, state.frozen
    hold = [s.path in frozen or g is None for s, g in zip(spec, totals)]
    if all(hold):  # nothing to step: no rule runs, no counter advances
        return leaves, gdef, train, params, state
    # Frozen parameters and parameters without a gradient contribute zeros to
    # global transforms (a clipping norm) and are neither moved nor re-stated.
    g = [jnp.zeros_like(p) if h else t for p, t, h in zip(params, totals, hold)]
    p_dict = keyed(spec, params)
    updates, inner = state.tx.update(keyed(spec, g), state.inner_state, p_dict, **extra_args)
    stepped = optax.apply_updates(p_dict, updates)
    new_params = [p if h else stepped[s.path] for s, p, h in zip(spec, params, hold)]
    if any(hold):
        inner = _hold(state.inner_state, inner, keyed(spec, hold))
    new_state = state._with(inner, frozen)
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
            ``"partials"`` for plain ``jax.grad`` output on the model as a pytree
            (a gradient through `tied.Graph` needs none: it is a total per tie).
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
        GraphError: a parameter place sits in an immutable container (a frozen
            dataclass or JAX-registered node such as an Equinox module, or a
            tuple held by one, or the model itself); the message names the path.
            Raised before anything is written. (A place in a tuple held by a
            mutable container, a view's sources, is written by putting a new
            tuple at every place of the old one: a tie is kept.)

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> layer = tied.nn.Dense(2, 2, key=jax.random.key(0))
        >>> model = {"enc": layer, "dec": layer}            # one layer at two places
        >>> old = layer.weight
        >>> state = tied.optim.setup(optax.sgd(0.1), model)
        >>> grads = tied.grad(lambda m: m["dec"](m["enc"](jnp.ones(2))).sum())(model)
        >>> state = tied.optim.update_inplace(state, model, grads)
        >>> model["enc"] is layer, layer.weight is old      # the same layer, now holding the new array
        (True, False)
    """
    with live_lock:
        leaves, gdef = flatten(model)
        train = match_state(state, leaves, gdef)
        places = slots(model, gdef, train, action="tied.optim.update_inplace", frozen_ok=False, rebuild=True)
        _, _, _, new_params, new_state = _step(state, model, grads, convention, extra_args)
        write(places, new_params)
        new_leaves = list(leaves)
        for i, p in zip(train, new_params):
            new_leaves[i] = p
        check_written(
            model,
            gdef,
            new_leaves,
            places,
            why="tied.optim.update_inplace wrote the new array here, but a walk of the model does not "
            "find it (the container rebuilds its children). Use tied.optim.update.",
        )
    return new_state


# ---------------------------------------------------------------- freeze and thaw


def _state_error(fn: str, n: int, what: str, where: str) -> ValueError:
    return ValueError(
        f"tied.optim.{fn}: argument {n} ({what}) selects only state ({where}): running statistics, a "
        "random stream's counter or a cache, which change when the model runs and are never "
        f"trained, so there is nothing to {fn}. Name a parameter's path (tied.optim.setup(...).paths "
        "lists them)."
    )


def _by_path(state: OptState, path: str, n: int, fn: str) -> list[str]:
    """The state's keys (first paths) of the parameters with a place at or below ``path``."""
    path = "" if path == "<root>" else path
    prefixes = covered(path, state.layout.shared)  # a place below a shared node: through any place

    def hit(p: str) -> bool:
        return any(at_or_below(p, q) for q in prefixes)

    keys = [s.path for s in state.spec if any(hit(p) for p in s.places)]
    if keys:
        return keys
    stateful = [p for p in state.layout.state if hit(p)]
    if stateful:
        raise _state_error(fn, n, repr(path), repr(stateful[0]) + (", ..." if len(stateful) > 1 else ""))
    places = [p for s in state.spec for p in s.places]
    near = difflib.get_close_matches(path, places, n=3, cutoff=0.5) or places[:3]
    raise ValueError(
        f"tied.optim.{fn}: argument {n} ({path!r}) is not a place of a trainable parameter of the "
        f"optimiser state, nor of a node holding one. Nearest places: {', '.join(repr(p) for p in near)}. "
        "Paths are keystr paths as tied.ties prints them."
    )


def _arrays_of(a: Any) -> list:
    """The arrays ``a`` stands for: itself, or a view's sources (each of several), views seen through."""
    if not isinstance(a, View):
        return [a]
    src = a.source
    return [x for s in src for x in _arrays_of(s)] if type(src) is tuple else _arrays_of(src)


def _by_array(state: OptState, a: Any, n: int, model: Any, fn: str) -> list[str]:
    targets = _arrays_of(a)
    target = targets[0]
    if model is None:
        raise ValueError(
            f"tied.optim.{fn}: argument {n} is an array, but the optimiser state holds no parameter "
            f"arrays to find it among. Pass the model that holds it, tied.optim.{fn}(state, array, "
            f"model=model), or name it by path, tied.optim.{fn}(state, '.layers[0].weight')."
        )
    leaves, gdef = flatten(model)
    train = match_state(state, leaves, gdef)
    found = [s.path for s, i in zip(state.spec, train) if any(leaves[i] is t for t in targets)]
    if found:  # a view of several sources: its trainable ones (a quantized table's scales, if trained)
        return found
    if len(targets) > 1:
        at = [i for t in targets for i, x in enumerate(leaves) if x is t]
        names = ", ".join(f"{gdef.leaf_paths()[i][0]} ({leaves[i].dtype})" for i in dict.fromkeys(at))
        raise ValueError(
            f"tied.optim.{fn}: argument {n} (a tied.View of {len(targets)} sources) holds no trainable "
            f"parameter: its sources {names or '(none of them in the model)'} are not in the optimiser "
            "state (an integer table is never trained; a quantized table's scales are constants unless "
            "tied.optim.setup(..., trainable=) selects them). Nothing to do: leave it out."
        )
    shape, dtype = getattr(target, "shape", None), getattr(target, "dtype", None)
    at = [i for i, x in enumerate(leaves) if x is target]
    if at and gdef.state_leaves()[at[0]]:
        raise _state_error(fn, n, f"an array of shape {shape}", repr(gdef.leaf_paths()[at[0]][0]))
    why = (
        "is in the model but not trainable (an integer dtype, or rejected by trainable=)"
        if at
        else "is not one of the model's arrays, matched by identity"
    )
    raise ValueError(
        f"tied.optim.{fn}: argument {n} ({type(target).__name__} of shape {shape}, dtype {dtype}) "
        f"{why}. Pass the array the model holds at any one of its places (e.g. "
        "model.layers[1].weight), or its path."
    )


def _by_node(state: OptState, node: Any, n: int, model: Any, fn: str) -> list[str]:
    """Every trainable parameter held at or below ``node`` (found in ``model`` by identity)."""
    name = type(node).__name__
    if model is None:
        raise ValueError(
            f"tied.optim.{fn}: argument {n} is a {name} node, but the optimiser state holds no model to "
            f"find it in. Pass the model that holds it, tied.optim.{fn}(state, node, model=model), or "
            f"name its place, tied.optim.{fn}(state, '.enc1')."
        )
    mine = {id(x) for x in flatten(node)[0]}
    leaves, gdef = flatten(model)
    train = match_state(state, leaves, gdef)
    keys = [s.path for s, i in zip(state.spec, train) if id(leaves[i]) in mine]
    if keys:
        return keys
    paths, is_state = gdef.leaf_paths(), gdef.state_leaves()
    stateful = [paths[i][0] for i, x in enumerate(leaves) if id(x) in mine and is_state[i]]
    if stateful:
        raise _state_error(fn, n, f"a {name} node", repr(stateful[0]))
    raise ValueError(
        f"tied.optim.{fn}: argument {n} (a {name} node) holds no trainable parameter of the model "
        "(matched by identity: pass the node the model holds, e.g. model.layers[1], or its path)."
    )


def _resolve(state: OptState, where: tuple, model: Any, fn: str) -> list[str]:
    if not isinstance(state, OptState):
        raise TypeError(
            f"tied.optim.{fn}: expected the OptState from tied.optim.setup(tx, model), got "
            f"{type(state).__name__}."
        )
    if model is not None:
        leaves, gdef = flatten(model)
        match_state(state, leaves, gdef)
    out: list[str] = []
    for n, w in enumerate(where):
        if isinstance(w, str):
            out += _by_path(state, w, n, fn)
        elif isinstance(w, View) or hasattr(w, "shape"):
            out += _by_array(state, w, n, model, fn)
        elif w is None or isinstance(w, (bool, int, float, complex, bytes)):
            raise TypeError(
                f"tied.optim.{fn}: argument {n} is a {type(w).__name__}; name parameters by a keystr "
                "path of any of their places ('.layers[0].weight', or a node's '.enc1' for all below it), "
                "or by the array or node object (with model=)."
            )
        else:
            out += _by_node(state, w, n, model, fn)
    return out


def freeze(state: OptState, *where: str | Any, model: Any = None) -> OptState:
    """Stop updating some parameters; functional (returns a new state).

    What to freeze is named by a keystr path, or by an object taken from the
    model (then pass ``model=``: the state holds no arrays):

    - a path freezes every trainable parameter at or below that place, through
      any of its places (``".layers[1].weight"`` of ``Chain(d, d)`` is
      ``d.weight``; ``".enc1"`` is the whole layer). A prefix matches at a
      path-segment boundary: ``.layers[1]`` does not select ``.layers[10]``.
      Flax NNX parameters sit at ``.block.kernel.value``.
    - an array (or a `tied.View` of it, meaning its source; for a view of several
      sources, those of them that are trainable) freezes that parameter;
    - a node (a layer object) freezes every parameter it holds.

    Freezing through one place freezes the parameter everywhere. A frozen
    parameter is not moved, its optax state is kept as it was, and it
    contributes zeros to global transforms such as clipping norms. Frozen flags
    are data in the state (``state.frozen``), so they survive `update`,
    ``jax.jit``, `tied.jit` and a `tied.save`/`tied.load` round trip (load into
    a state frozen the same way).

    Args:
        state: the current `OptState`.
        *where: paths (str), arrays or nodes of the parameters to freeze.
        model: the model, to find arrays and nodes in (checked against the state).

    Returns:
        A new `OptState` with those parameters frozen.

    Raises:
        ValueError: a path that selects no trainable parameter (the nearest
            places are listed), or only state (running statistics, counters: never
            trained); an array or node without ``model=``, or not a trainable
            parameter of it.

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

        A whole layer, by its place (any of them) or by the object:

        >>> d, head = Dense(2, 2, key=jax.random.key(1)), Dense(2, 1, key=jax.random.key(2))
        >>> m = Chain(d, d, head)
        >>> state = tied.optim.setup(optax.adam(1e-3), m)
        >>> sorted(tied.optim.freeze(state, ".layers[1]").frozen)
        ['.layers[0].bias', '.layers[0].weight']
        >>> sorted(tied.optim.freeze(state, head, model=m).frozen)
        ['.layers[2].bias', '.layers[2].weight']
    """
    keys = set(_resolve(state, where, model, "freeze")) | set(state.frozen)
    frozen = {s.path: state.frozen.get(s.path, None) for s in state.spec if s.path in keys}
    frozen = {k: jnp.array(True) if v is None else v for k, v in frozen.items()}
    return state._with(state.inner_state, frozen)


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
    return state._with(state.inner_state, frozen)
