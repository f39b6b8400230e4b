"""Implicit mode: parameters and gradients keyed by array identity.

Explicit mode (`tied.grad`) differentiates a function *of the model* and returns
a gradient shaped like it. Implicit mode, as in Zygote's
``gradient(() -> loss(m(x)), params(m))`` or PyTorch's autograd, differentiates
a function of no arguments that reaches the model through its closure, and
returns a mapping from each parameter *object* to its total gradient.

The closure sees traced values because `gradient` puts them, for the duration
of the call, at every place of each parameter in the model's own containers
(`tied._core.live`), and always puts the original arrays back afterwards. Nothing
short of writing reaches a closure over the model: it may hold the model, a
layer of it, or a global that does. So other threads wait: the writing happens
under ``tied.live_lock``, which a thread that reads the model directly takes.
Places are found from the `GraphDef` of the core walk; nothing here decides
sharing.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from .._core import (
    GraphDef,
    GraphError,
    Trainable,
    View,
    check_written,
    flatten,
    is_param,
    live_lock,
    slots,
    trainable_mask,
    write,
)
from .checks import check_scope, run_checks
from .escapes import escaping_tracer
from .grad import _gradient_tree
from .lift import Learnt

__all__ = ["Params", "Grads", "params", "gradient"]

# ---------------------------------------------------------------- Params


class Params:
    """The unique trainable arrays of a model, in flatten order (implicit mode).

    A live view of the model: every use reads the model again (under
    ``tied.live_lock``), so after `tied.optim.update_inplace` it lists the new
    arrays. Membership is by identity: ``d1.weight in ps`` holds when that very
    object is a trainable parameter of the model, however many places hold it.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d, d)                       # one layer at two places
        >>> ps = tied.params(c)
        >>> len(ps), d.weight in ps               # weight and bias, once each
        (2, True)
        >>> ps.paths(d.weight)
        ['.layers[0].weight', '.layers[1].weight']
    """

    __slots__ = ("model", "trainable")

    def __init__(self, model: Any, trainable: Trainable | None = None):
        if trainable is not None and not callable(trainable):
            raise TypeError(
                f"tied.params(model, trainable=...): trainable takes a function (path, array) -> "
                f"bool, got {type(trainable).__name__}. For example "
                'trainable=lambda path, x: "running" not in path.'
            )
        self.model = model
        self.trainable = trainable

    def _read(self) -> tuple[list, GraphDef, list[int]]:
        with live_lock:
            leaves, gdef = flatten(self.model)
            mask = trainable_mask(gdef, leaves, self.trainable)
        return leaves, gdef, [i for i, keep in enumerate(mask) if keep]

    def _arrays(self) -> list:
        leaves, _, train = self._read()
        return [leaves[i] for i in train]

    def __len__(self) -> int:
        return len(self._read()[2])

    def __iter__(self) -> Iterator[Any]:
        return iter(self._arrays())

    def __getitem__(self, i: int) -> Any:
        return self._arrays()[i]

    def __contains__(self, x: object) -> bool:
        return any(p is x for p in self._arrays())

    def paths(self, array: Any) -> list[str]:
        """Every place of ``array`` in the model, as keystr paths in walk order.

        A place below a shared node is listed at each place of that node: for
        ``Chain(d, d)``, ``d.weight`` is at ``.layers[0].weight`` and
        ``.layers[1].weight``. On a reference cycle, a reference back to a node
        already entered above is not followed again.

        Raises:
            KeyError: ``array`` is not (by identity) a trainable array of the model.
        """
        leaves, gdef, train = self._read()
        for i in train:
            if leaves[i] is array:
                return [p or "<root>" for p, q in _array_places(gdef) if q == i]
        if any(x is array for x in leaves) and is_param(array):
            raise KeyError(
                "this array is in the model, but trainable= rejects it at every one of its "
                "places, so it is not one of the model's trainable parameters."
            )
        raise KeyError(_not_a_param(array, "the model's parameters"))

    def __repr__(self) -> str:
        return f"Params({len(self)} unique trainable arrays)"


def _array_places(gdef: GraphDef) -> list[tuple[str, int]]:
    """Every array place as ``(path, unique leaf index)``, a reference cycle cut where it
    comes back to a node already entered above."""
    return list(gdef.place_leaves())


def params(model: Any, *, trainable: Trainable | None = None) -> Params:
    """The unique trainable arrays of ``model`` (inexact dtype), for implicit mode.

    Args:
        model: any object graph `tied.flatten` accepts.
        trainable: ``(path, array) -> bool``; a parameter is trainable when it
            holds at any of its places (keystr paths, ``""`` for the root).
            Others are left out: `tied.gradient` treats them as constants.

    Returns:
        A `Params`: ``len``, iteration in flatten order, identity-based ``in``
        and ``ps.paths(array)``; pass it to `tied.gradient`.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))   # two layers, one weight and one bias
        >>> ps = tied.params(c)
        >>> [len(ps.paths(p)) for p in ps]     # each tied array has two places
        [2, 2]
        >>> len(tied.params(c, trainable=lambda path, x: x.ndim > 1))   # the weight only
        1
    """
    return Params(model, trainable)


def _not_a_param(key: Any, where: str) -> str:
    if isinstance(key, View):
        desc = f"a tied.View of {getattr(key.fn, '__name__', 'a function')}"
        hint = " A view is not a parameter: use its source (view.source)."
    else:
        shape, dtype = getattr(key, "shape", None), getattr(key, "dtype", None)
        desc = f"{type(key).__name__} of shape {shape} and dtype {dtype}"
        hint = ""
    return (
        f"{desc} is not one of {where}. They are keyed by identity: pass the very array "
        f"object the model holds (e.g. model.layers[0].weight).{hint}"
    )


# ---------------------------------------------------------------- Grads


def _is_scalar(s: Any) -> bool:
    return isinstance(s, numbers.Number) or getattr(s, "ndim", None) == 0


class Grads(Mapping):
    """Total gradients keyed by parameter identity (implicit mode).

    ``gs[w]`` is the total gradient of the array object ``w`` over all its
    places, the same value `tied.grad` puts at each of those places. Only the
    parameters given to `tied.gradient` are keys (an input batch captured by the
    closure is not). Supports ``+`` and ``-`` (of two Grads; a key missing on
    one side counts as zero), multiplication and division by a scalar, and
    ``to_tree(model)`` for the structural (explicit-mode) gradient.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> c, x = Chain(d, d), jnp.ones((1, 2))
        >>> gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
        >>> gs
        Grads(2 parameters)
        >>> g = gs.to_tree(c)
        >>> g.layers[0].weight is g.layers[1].weight is gs[d.weight]
        True
        >>> half = gs * 0.5                       # arithmetic keeps the keys
        >>> bool(jnp.allclose(half[d.bias], gs[d.bias] / 2))
        True
    """

    __slots__ = ("_keys", "_values", "_index")

    def __init__(self, keys: list, values: list):
        if len(keys) != len(values):
            raise ValueError(f"Grads: {len(keys)} keys but {len(values)} values.")
        self._keys = list(keys)
        self._values = list(values)
        self._index = {}
        for n, k in enumerate(self._keys):
            m = self._index.setdefault(id(k), n)
            if m != n:
                raise ValueError(
                    f"Grads: keys {m} and {n} are the same object, so the parameter would have "
                    "two gradients. Give each parameter once, with its total gradient."
                )

    def _find(self, key: Any) -> int | None:
        n = self._index.get(id(key))
        return n if n is not None and self._keys[n] is key else None

    def __getitem__(self, key: Any) -> Any:
        n = self._find(key)
        if n is None:
            raise KeyError(_not_a_param(key, "the parameters these gradients were taken for"))
        return self._values[n]

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __eq__(self, other: object) -> bool:  # arrays are unhashable; compare by identity
        return self is other

    __hash__ = None  # type: ignore[assignment]

    def _lookup(self, key: Any) -> Any:
        n = self._find(key)
        return None if n is None else self._values[n]

    def _zip(self, other: Grads, op: Callable[[Any, Any], Any], lone: Callable) -> Grads:
        keys, values = list(self._keys), list(self._values)
        for k, v in zip(other._keys, other._values):
            n = self._find(k)
            if n is None:
                keys.append(k)
                values.append(lone(v))
            else:
                values[n] = op(values[n], v)
        return Grads(keys, values)

    def __add__(self, other: Any) -> Grads:
        if not isinstance(other, Grads):
            return NotImplemented
        return self._zip(other, lambda a, b: a + b, lambda b: b)

    def __sub__(self, other: Any) -> Grads:
        if not isinstance(other, Grads):
            return NotImplemented
        return self._zip(other, lambda a, b: a - b, lambda b: -b)

    def __neg__(self) -> Grads:
        return Grads(self._keys, [-v for v in self._values])

    def __mul__(self, s: Any) -> Grads:
        if not _is_scalar(s):
            return NotImplemented
        return Grads(self._keys, [v * s for v in self._values])

    __rmul__ = __mul__

    def __truediv__(self, s: Any) -> Grads:
        if not _is_scalar(s):
            return NotImplemented
        return Grads(self._keys, [v / s for v in self._values])

    def to_tree(self, model: Any) -> Any:
        """The structural gradient of ``model``, as `tied.grad` returns it.

        Each parameter's total stands at every one of its places (one object),
        ``None`` at non-parameters and at parameters that are not keys here, and
        a `View` of the source's total at a view's place.

        Examples:
            >>> import jax, jax.numpy as jnp, tied
            >>> layer, x = tied.nn.Dense(2, 2, key=jax.random.key(0)), jnp.ones((1, 2))
            >>> model = {"enc": layer, "dec": layer}          # one layer at two places
            >>> loss = lambda m: m["dec"](m["enc"](x)).sum()
            >>> weights = tied.params(model, trainable=lambda path, a: a.ndim > 1)
            >>> g = tied.gradient(lambda: loss(model), weights).to_tree(model)
            >>> g["enc"].weight is g["dec"].weight, g["enc"].bias     # the bias is not a key
            (True, None)
            >>> bool(jnp.allclose(g["dec"].weight, tied.grad(loss)(model)["dec"].weight))
            True
        """
        with live_lock:  # not while tied.gradient has traced values in the model
            leaves, gdef = flatten(model)
        return _gradient_tree(gdef, [self._lookup(x) if is_param(x) else None for x in leaves])

    def __repr__(self) -> str:
        return f"Grads({len(self)} parameters)"


# ---------------------------------------------------------------- gradient


def gradient(fun: Callable[[], Any], params: Params) -> Grads:
    """The gradient of a function of no arguments with respect to ``params`` (implicit mode).

    ``fun`` reaches the model through its closure. For the duration of the call,
    each parameter's traced value stands at every place of it in the model's own
    containers; the original arrays are put back afterwards, always, also when
    ``fun`` raises.

    ``fun`` must reach the parameters through the model (``params.model``): an
    array it captured directly, say ``w = model.layers[0].weight`` taken
    beforehand, is a constant to it. Works eagerly, inside `tied.jit`, and under
    ``jax.jit`` on a `tied.Graph` argument (``m = graph.value`` inside).

    Threads: the call holds ``tied.live_lock`` from start to end. Another
    thread's `tied.gradient`, `tied.params` or `tied.optim.update_inplace` waits
    for it; a thread that reads the model directly (``model(x)``) must take the
    live_lock too (``with tied.live_lock: y = model(x)``), or it may see traced
    values. ``fun`` itself runs in the calling thread and may take gradients.

    Args:
        fun: returns a scalar loss; takes no arguments.
        params: `tied.params(model)` (with its ``trainable=``, if any).

    Returns:
        A `Grads`: ``gs[w]`` is the total gradient of parameter ``w``, equal to
        what `tied.grad` puts at each of its places.

    Raises:
        GraphError: a parameter place is in a container that cannot be written
            (a tuple, namedtuple or JAX-registered node such as an Equinox
            module; nothing is written); or ``fun`` assigned a new value to a
            parameter place, which the end of the call would silently undo
            (the original is put back). The message names the path. Use
            `tied.grad` for immutable models.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> c = Chain(d1, Dense(d1.weight, d1.bias))   # one weight and one bias, two places each
        >>> x = jnp.ones((1, 2))
        >>> gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
        >>> bool(jnp.allclose(gs[d1.weight], tied.grad(lambda m: m(x).sum())(c).layers[0].weight))
        True
        >>> x in gs
        False
    """
    if not isinstance(params, Params):
        raise TypeError(
            f"tied.gradient(fun, params): params must be tied.params(model), got {type(params).__name__}."
        )
    if not callable(fun):
        raise TypeError(f"tied.gradient(fun, params): fun must be callable, got {fun!r}.")
    with live_lock:
        model = params.model
        leaves, gdef, train = params._read()
        where = slots(model, gdef, train, action="tied.gradient", frozen_ok=True)
        originals = [leaves[i] for i in train]

        trained = set(train)

        def f(values: list) -> Any:
            values = list(values)
            write(where, values)
            expected = list(leaves)
            for i, v in zip(train, values):
                expected[i] = v
            check_written(model, gdef, expected, where, why=_NOT_SEEN)
            with check_scope(values) as checks:  # checks on the parameters' tracers: carried out
                out = fun()
            made = tuple(checks.checks)
            now_leaves, now = flatten(model)
            if now == gdef:
                new = [q for q, (a, b) in enumerate(zip(now_leaves, expected)) if a is not b]
                if new and not trained.intersection(new):
                    # State written during the call (stop-gradiented by tied.State): its value
                    # leaves the trace as aux data, where it was as static data (never through
                    # a list this function closes over), and is written back concretely after.
                    return out, ([now_leaves[q] for q in new], checks.values, Learnt(tuple(new), made))
            _check_after(model, gdef, expected, where, values)
            return out, ([], checks.values, Learnt((), made))

        done = False
        try:
            grads, (new_state, checked, learnt) = jax.grad(f, has_aux=True)(originals)
            run_checks(learnt.checks, list(checked))  # a failed one: the state is put back
            done = True
        finally:
            _restore(where, originals)
            # State is written back concretely after a call, and put back as it was after a
            # failure: a traced value never stays in the model.
            if done:
                at, back = list(learnt.written), new_state
            else:
                now_leaves, now = flatten(model)
                at = (
                    []
                    if now != gdef
                    else [q for q, x in enumerate(now_leaves) if x is not leaves[q] and q not in trained]
                )
                back = [leaves[q] for q in at]
            if at:
                where_state = slots(model, gdef, at, action="tied.gradient", frozen_ok=True)
                escaping = escaping_tracer(gdef, leaves, at, back, "fun", "it was put back as it was")
                write(where_state, [leaves[q] for q in at] if escaping else back)
                if escaping:
                    raise escaping
    return Grads(originals, grads)


def _check_after(model: Any, gdef: GraphDef, expected: list, where: list, values: list) -> None:
    """Refuse what ``fun`` did to the model that the end of the call would get wrong silently."""
    leaves, now = flatten(model)
    if now == gdef and all(a is b for a, b in zip(leaves, expected)):
        return
    moved = _changed(where, values)
    if moved:
        raise GraphError(
            f"{', '.join(s.path or '<root>' for s in moved)}: fun assigned a new value to this "
            "parameter place (or removed it) during tied.gradient. Implicit mode puts each "
            "parameter's array back at every place when the call ends, so the assignment "
            "would be undone silently; the original array is back. Change the model after "
            "tied.gradient returns, or store jax.lax.stop_gradient(value) in a place that "
            "trainable= leaves out (running statistics)."
        )
    # A value computed from this call's traced parameters, stored at a new place, would
    # be a dead traced value afterwards. (JAX tracers name their trace in `_trace`; where
    # that is missing, JAX itself complains on the value's next use.)
    trace = getattr(values[0], "_trace", None) if values else None
    if trace is None:
        return
    ours = {id(v) for v in values}
    for x, paths in zip(leaves, now.leaf_paths()):
        if getattr(x, "_trace", None) is trace and id(x) not in ours:
            raise GraphError(
                f"{paths[0] or '<root>'}: fun stored a value computed from the traced parameters "
                "here during tied.gradient; after the call it would be a dead traced value "
                "(JAX's UnexpectedTracerError on its next use), and it is still there: assign "
                "an array to it. Store jax.lax.stop_gradient(value) instead (running "
                "statistics), or compute it outside fun."
            )


def _changed(places: list[list[Any]], values: list) -> list:
    """The slots (`slots`) that no longer hold what was written there (``values[n]`` for
    ``places[n]``)."""
    out = []
    cache: dict = {}  # containers stay alive in their slots, so their ids stay unique
    for at, v in zip(places, values):
        for slot in at:
            if slot.get(cache) is not v:
                out.append(slot)
    return out


def _restore(places: list[list[Any]], values: list) -> None:
    """Put ``values`` back at every slot (`slots`), trying every place even if some fail.

    Raises:
        GraphError: naming each place that could not be written back (the model
            was changed there while ``fun`` ran), after all others were.
    """
    failed: list[str] = []
    first: BaseException | None = None
    for at, v in zip(places, values):
        for slot in at:
            try:
                slot(v)
            except Exception as e:
                failed.append(slot.path or "<root>")
                first = first or e
    if failed:
        raise GraphError(
            f"{', '.join(failed)}: tied.gradient could not put the original array back here "
            f"({type(first).__name__}: {first}); the container was changed while it ran. "
            "Those places may still hold traced values: assign arrays to them."
        ) from first


_NOT_SEEN = (
    "tied.gradient put the parameter's traced value here, but a walk of the model does not "
    "find it here afterwards, so fun would not see it and its gradient would be wrong. The "
    "original arrays are back. Use explicit mode: tied.grad(lambda m: loss(m))(model)."
)
