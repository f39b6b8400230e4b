"""Implicit mode: parameters and gradients keyed by array identity.

Explicit mode (`tied.grad`) differentiates a function *of the model* and returns
a gradient shaped like it. Implicit mode, as in Zygote's
``gradient(() -> loss(m(x)), params(m))`` or PyTorch's autograd, differentiates
a function of no arguments that reaches the model through its closure, and
returns a mapping from each parameter *object* to its total gradient.

The closure sees traced values because `gradient` puts them, for the duration
of the call, at every place of each parameter in the model's own containers,
and always puts the original arrays back afterwards. Places are found from the
`GraphDef` of the core walk; nothing here decides sharing.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from ._grad import _gradient_tree, is_param
from ._graph import (
    _KIND_NAMES,
    DICT,
    LIST,
    OBJ,
    SLOTS,
    VIEW,
    GraphDef,
    GraphError,
    _child_key,
    _node_children,
    flatten,
    place_paths,
)
from ._view import View

__all__ = ["Params", "Grads", "params", "gradient"]

# Implicit gradients write into the model; so does `tied.optim.update_inplace`.
# One re-entrant lock serialises them, so two threads never interleave their
# writes into one model (re-entrant: a `fun` may itself take a gradient).
_lock = threading.RLock()


# ---------------------------------------------------------------- places in a live model


def _node_objects(model: Any, gdef: GraphDef) -> list:
    """The live container object of every node record of ``gdef`` (a flatten of ``model``).

    Records are numbered in first-seen order, so a node's first parent always
    has a smaller number: one pass in that order reaches every node.
    """
    records = gdef.records
    objs: list = [None] * len(records)
    if gdef.root % 3 == 1:
        objs[gdef.root // 3] = model
    for j, (kind, _meta, refs) in enumerate(records):
        children = None
        for i, r in enumerate(refs):
            if r % 3 == 1 and objs[r // 3] is None:
                if children is None:
                    children = _node_children(kind, objs[j])[0]
                objs[r // 3] = children[i]
    return objs


def _is_frozen_dataclass(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def _setter(kind: int, meta: Any, obj: Any, i: int) -> Callable[[Any], None]:
    if kind == LIST:
        return lambda v: obj.__setitem__(i, v)
    if kind == DICT:
        key = meta[i]
        return lambda v: obj.__setitem__(key, v)
    if kind == OBJ:
        name = meta[1][i]
        d = obj.__dict__
        return lambda v: d.__setitem__(name, v)
    if kind == SLOTS:
        name = meta[1][i]
        return lambda v: object.__setattr__(obj, name, v)
    # VIEW: the source slot of a tied.View
    return lambda v: object.__setattr__(obj, "source", v)


def _place_setters(
    model: Any, gdef: GraphDef, which: list[int], *, action: str, frozen_ok: bool
) -> list[list[Callable[[Any], None]]]:
    """For each unique leaf in ``which``, one setter per place of it in ``model``.

    Raises a `GraphError` naming the path of the first place that sits in a
    container that cannot be written (a tuple, namedtuple, JAX-registered node,
    or a frozen dataclass unless ``frozen_ok``), before anything is written.
    """
    if gdef.root % 3 == 0:
        raise GraphError(
            f"<root>: {action} writes the new arrays into the model's containers, but the "
            "model is a bare array. Hold it in a container (a list, dict or registered class)."
        )
    wanted = {3 * q: n for n, q in enumerate(which)}
    setters: list[list] = [[] for _ in which]
    objs = _node_objects(model, gdef)
    for j, (kind, meta, refs) in enumerate(gdef.records):
        for i, r in enumerate(refs):
            n = wanted.get(r)
            if n is None:
                continue
            obj = objs[j]
            blocked = kind not in (LIST, DICT, OBJ, SLOTS, VIEW) or (
                not frozen_ok and kind in (OBJ, SLOTS) and _is_frozen_dataclass(obj)
            )
            if blocked:
                path = (place_paths(gdef).nodes[j][0] or "") + _child_key(kind, meta, i, len(refs))
                raise _immutable_error(path, kind, obj, action)
            setters[n].append(_setter(kind, meta, obj, i))
    return setters


def _immutable_error(path: str, kind: int, obj: Any, action: str) -> GraphError:
    what = "frozen dataclass" if kind in (OBJ, SLOTS) else _KIND_NAMES[kind]
    if action == "tied.gradient":
        fix = (
            "Use explicit mode, which needs no writing: g = tied.grad(lambda m: loss(m))(model), "
            "or hold the parameter in a mutable container (a list, dict, dataclass or a "
            "class given to tied.register)."
        )
    else:
        fix = (
            "Use tied.optim.update, which returns a new model with every tie kept, or hold the "
            "parameter in a mutable container (a list, dict, non-frozen dataclass or a class "
            "given to tied.register)."
        )
    return GraphError(
        f"{path or '<root>'}: {action} writes new arrays into the model's own containers, "
        f"but this parameter place is in a {what} ({type(obj).__name__}), which cannot be "
        f"changed in place. Nothing was written. {fix}"
    )


# ---------------------------------------------------------------- Params


class Params:
    """The unique trainable arrays of a model, in flatten order (implicit mode).

    A live view of the model: every use reads the model again, so after
    `tied.optim.update_inplace` it lists the new arrays. Membership is by
    identity: ``d1.weight in ps`` holds when that very object is a parameter of
    the model, however many places hold it.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> ps = tied.params(c)
        >>> len(ps), d1.weight in ps          # weight and bias, once each
        (2, True)
        >>> ps.paths(d1.weight)
        ['.layers[0].weight', '.layers[1].weight']
    """

    __slots__ = ("model",)

    def __init__(self, model: Any):
        self.model = model

    def _read(self) -> tuple[list, GraphDef, list[int]]:
        leaves, gdef = flatten(self.model)
        return leaves, gdef, [i for i, x in enumerate(leaves) if is_param(x)]

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
        """Every place of ``array`` in the model (keystr paths, first-seen order).

        Raises:
            KeyError: ``array`` is not (by identity) a trainable array of the model.
        """
        leaves, gdef, train = self._read()
        for i in train:
            if leaves[i] is array:
                return [p or "<root>" for p in place_paths(gdef).leaves[i]]
        raise KeyError(_not_a_param(array, "the model's parameters"))

    def __repr__(self) -> str:
        return f"Params({len(self)} unique trainable arrays)"


def params(model: Any) -> Params:
    """The unique trainable arrays of ``model`` (inexact dtype), for implicit mode.

    Args:
        model: any object graph `tied.flatten` accepts.

    Returns:
        A `Params`: ``len``, iteration in flatten order, identity-based ``in``
        and ``ps.paths(array)``; pass it to `tied.gradient`.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> ps = tied.params(c)
        >>> [len(ps.paths(p)) for p in ps]     # each tied array has two places
        [2, 2]
    """
    return Params(model)


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

    Example:
        >>> gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
        >>> g = gs.to_tree(c)
        >>> g.layers[0].weight is g.layers[1].weight is gs[c.layers[0].weight]
        True
    """

    __slots__ = ("_keys", "_values", "_index")

    def __init__(self, keys: list, values: list):
        if len(keys) != len(values):
            raise ValueError(f"Grads: {len(keys)} keys but {len(values)} values.")
        self._keys = list(keys)
        self._values = list(values)
        self._index = {id(k): n for n, k in enumerate(self._keys)}

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

        Example:
            >>> g = gs.to_tree(c)
            >>> g.layers[0].weight is g.layers[1].weight
            True
        """
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
    ``fun`` raises. A lock keeps two threads from writing into one model at once.

    ``fun`` must reach the parameters through the model (``params.model``): an
    array it captured directly, say ``w = model.layers[0].weight`` taken
    beforehand, is a constant to it. Works eagerly, inside `tied.jit`, and under
    ``jax.jit`` on a `tied.Graph` argument (``m = graph.value`` inside).

    Args:
        fun: returns a scalar loss; takes no arguments.
        params: `tied.params(model)`.

    Returns:
        A `Grads`: ``gs[w]`` is the total gradient of parameter ``w``, equal to
        what `tied.grad` puts at each of its places.

    Raises:
        GraphError: a parameter place is in a container that cannot be written
            (a tuple, namedtuple or JAX-registered node such as an Equinox
            module); the message names the path. Use `tied.grad` there.

    Example:
        >>> d1 = Dense(w, b); c = Chain(d1, Dense(d1.weight, d1.bias))
        >>> gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
        >>> bool(jnp.allclose(gs[d1.weight], tied.grad(lambda m: m(x).sum())(c).layers[0].weight))
        True
        >>> x in gs
        False
    """
    if not isinstance(params, Params):
        raise TypeError(
            f"tied.gradient(fun, params): params must be tied.params(model), got "
            f"{type(params).__name__}."
        )
    if not callable(fun):
        raise TypeError(f"tied.gradient(fun, params): fun must be callable, got {fun!r}.")
    with _lock:
        model = params.model
        leaves, gdef = flatten(model)
        train = [i for i, x in enumerate(leaves) if is_param(x)]
        setters = _place_setters(model, gdef, train, action="tied.gradient", frozen_ok=True)
        originals = [leaves[i] for i in train]

        def put(values: list) -> None:
            for places, v in zip(setters, values):
                for set_place in places:
                    set_place(v)

        def f(values: list) -> Any:
            put(values)
            return fun()

        try:
            grads = jax.grad(f)(originals)
        finally:
            put(originals)
    return Grads(originals, grads)

