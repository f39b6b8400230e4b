"""Derived ties: a place that holds a function of another parameter."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class View:
    """A place that holds ``fn(source)`` instead of an array of its own.

    Only ``source`` is a parameter: `tied.flatten` lists it once, the optimiser
    keeps one state for it, and the gradient at a view's place is a `View` of
    the source's own total gradient object.

    A view acts as the array it stands for, so the same layer code runs eagerly
    and under every transform: arithmetic and comparisons on either side
    (``w + 1``, ``2 * w``, ``w < 0``), ``x @ w``, indexing, ``w.T``, ``.shape``,
    ``.dtype``, ``.ndim``, ``.size``, ``len``, array methods (``w.sum()``,
    ``w.reshape(...)``, ``w.astype(...)``), ``jnp.asarray(w)``, ``np.asarray(w)``
    and JAX primitives (``jax.nn.relu(w)``, ``jax.lax`` functions). Each computes
    ``fn(source)`` first. ``==`` and ``!=`` stay identity (a view is a node of the
    graph). What it cannot do names `tied.materialize`, the one explicit way to
    read it: attributes such as ``w.at`` and jitted ``jnp`` functions
    (``jnp.tanh(w)``: JAX no longer converts ``__jax_array__`` objects there).
    Inside `tied.grad` views are materialised for you; under `tied.jit` and
    `tied.Graph` a view stays a view whose source is the traced array.

    Where the source lives: the walk always goes through a view to its source
    (its path is the view's place plus ``.source``), so the source is part of
    any model that holds the view. When the same array also stands at another
    place (``tied.transpose(enc.weight)`` next to ``enc``) the two places are
    one parameter. When it stands nowhere else, the view's own source is the
    parameter: that is a reparametrisation (``tied.view(raw, jax.nn.softplus)``),
    and it is also what a sub-model such as ``model.dec`` alone looks like.
    Assigning a new array to ``enc.weight`` after making the view leaves the
    view on the old array (two parameters); `tied.ties` shows which places are
    tied. The source must be an array or another view: a view over ``None``
    (``tied.transpose(enc.bias)`` of a layer without bias), a number or a whole
    layer object is an error that names the view's path when it is materialised.

    Several sources (``tied.view((q, s), fn)``): ``source`` is the tuple, each array
    a place of its own below it (``.source[0]``, ``.source[1]``), and the view stands
    for ``fn(q, s)``; its gradient is a `View` of the tuple of the sources' totals
    (None for an integer source).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> enc = tied.nn.Dense(2, 3, key=jax.random.key(0))   # weight (3, 2)
        >>> dec_w = tied.transpose(enc.weight)
        >>> dec_w.source is enc.weight, dec_w.shape
        (True, (2, 3))
        >>> bool((tied.materialize(dec_w) == enc.weight.T).all())
        True
        >>> (dec_w + 1).shape, (dec_w.T @ jnp.ones(2)).shape, dec_w[0].shape   # acts as its array
        ((2, 3), (3,), (3,))
        >>> tied.ties({"enc": enc, "dec": tied.nn.Dense(dec_w)})
        [("['dec'].weight.source", "['enc'].weight")]
    """

    __slots__ = ("source", "fn")

    def __init__(self, source: Any, fn: Callable[[Any], Any]):
        if not callable(fn):
            raise TypeError(f"tied.view(source, fn): fn must be callable, got {fn!r}.")
        self.source = source
        self.fn = fn

    def materialize(self) -> Any:
        """Return ``fn(source)`` (a source that is itself a view is materialised first)."""
        return materialize(self)

    def __jax_array__(self):
        return jnp.asarray(materialize(self))

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(materialize(self))
        return out if dtype is None else out.astype(dtype)

    def _abstract(self) -> Any:
        source = self.source
        if type(source) is tuple:
            source = tuple(s._abstract() if type(s) is View else s for s in source)
        elif type(source) is View:
            source = source._abstract()
        fn = self.fn
        try:  # trace fn on the sources' shapes and dtypes, without computing it
            return jax.eval_shape(lambda s: call(fn, s), source)
        except Exception:  # not traceable (numpy code), or failing: compute it, or fail as it does
            return materialize(self)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``fn(source)``, found by tracing ``fn`` without computing it."""
        return tuple(self._abstract().shape)

    @property
    def dtype(self) -> Any:
        """The dtype of ``fn(source)``, found without computing it."""
        return self._abstract().dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions of ``fn(source)``."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements of ``fn(source)``."""
        return int(np.prod(self.shape))

    @property
    def T(self) -> Any:  # noqa: N802 - the array attribute
        """``fn(source).T``."""
        return materialize(self).T

    def __getitem__(self, index: Any) -> Any:
        return materialize(self)[_value(index)]

    def __len__(self) -> int:
        return len(materialize(self))

    def __iter__(self) -> Any:
        return iter(materialize(self))

    def __float__(self) -> float:
        return float(materialize(self))

    def __int__(self) -> int:
        return int(materialize(self))

    def __complex__(self) -> complex:
        return complex(materialize(self))

    def __neg__(self) -> Any:
        return -materialize(self)

    def __pos__(self) -> Any:
        return +materialize(self)

    def __abs__(self) -> Any:
        return abs(materialize(self))

    def __invert__(self) -> Any:
        return ~materialize(self)

    # numpy defers to the reflected operators below (``np_array + view``) instead of
    # converting the view itself.
    __array_priority__ = 100

    # ``==``/``!=`` stay identity (a View is a node of the graph, found by identity,
    # and may sit in sets and dicts): compare values with ``tied.materialize(v) == x``.
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        if name in _ARRAY_METHODS:
            return getattr(materialize(self), name)
        if name.startswith("__") or name in View.__slots__:  # protocols (copy, pickle), unset slots
            raise AttributeError(name)
        raise AttributeError(
            f"'View' object has no attribute {name!r}. A View stands for fn(source) "
            f"({_name(self.fn)} of an array); it acts as that array in arithmetic, indexing, '@', "
            f".T, .shape and jnp functions, and tied.materialize(view) returns the array itself: "
            f"write tied.materialize(x).{name}."
        )

    def __repr__(self) -> str:
        if type(self.source) is tuple:
            shapes = tuple(getattr(s, "shape", None) for s in self.source)
            return f"View({_name(self.fn)}, source shapes={shapes})"
        shape = getattr(self.source, "shape", None)
        return f"View({_name(self.fn)}, source shape={shape})"


# Array methods a View forwards to the array it stands for (so layer code reads the
# same with a view or an array); anything else names tied.materialize.
_ARRAY_METHODS = frozenset(
    "all any argmax argmin astype clip conj cumsum dot flatten imag max mean min prod ravel real "
    "reshape round squeeze std sum swapaxes transpose var mT".split()
)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", repr(fn))


def _value(x: Any) -> Any:
    return materialize(x) if type(x) is View else x


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
    def forward(self: View, other: Any) -> Any:
        return op(materialize(self), _value(other))

    def reflected(self: View, other: Any) -> Any:
        return op(_value(other), materialize(self))

    return forward, reflected


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"):
    _fwd, _ref = _binary(getattr(operator, _op if _op not in ("and", "or") else _op + "_"))
    setattr(View, f"__{_op}__", _fwd)
    setattr(View, f"__r{_op}__", _ref)
for _op in ("lt", "le", "gt", "ge"):
    setattr(View, f"__{_op}__", _binary(getattr(operator, _op))[0])
del _op, _fwd, _ref


def _refuse_abstractify(v: View) -> Any:
    # A ValueError, as JAX's own for __jax_array__: jax.jit rewrites a TypeError here into
    # a message about static arguments.
    raise ValueError(
        f"a tied.View ({v!r}) was passed to a jitted jax function, which JAX no longer converts "
        "through __jax_array__. Pass the array it stands for, tied.materialize(view) (e.g. "
        "jnp.tanh(tied.materialize(w))), or use the view's own operators and methods (w + 1, "
        "x @ w, w.T, w.sum()), which work on a view as on its array."
    )


def _register_refusal() -> None:
    # Where JAX abstracts an argument of a jitted jnp function (jnp.sin(view)), say what to
    # do instead of JAX's generic __jax_array__ message. JAX internals: if they move, JAX's
    # own ValueError is raised instead, which is still an error.
    from jax._src import core, dtypes

    table = getattr(core, "pytype_aval_mappings", None)
    if isinstance(table, dict):
        table[View] = _refuse_abstractify
    # where JAX canonicalises a primitive's operand (jax.nn.relu(view), lax.add), the view
    # is the array it stands for
    register = getattr(dtypes, "register_canonicalize_value_handler", None)
    canonicalize = getattr(dtypes, "canonicalize_value", None)
    if register is not None and canonicalize is not None:
        register(View, lambda v: canonicalize(jnp.asarray(materialize(v))))


_register_refusal()


def view(source: Any, fn: Callable[..., Any]) -> View:
    """A derived tie: a place holding ``fn(source)``, where only ``source`` is a parameter.

    Several sources, ``tied.view((a, b, ...), fn)``, make a place holding ``fn(a, b, ...)``
    (an integer table and its float scales, say): each source is its own array of the
    graph (path: the view's place plus ``.source[i]``), saved once however many views
    read it; the float ones get gradients, an integer one none.

    Args:
        source: the parameter array (the same object that stands elsewhere in the model),
            or a tuple of them (arrays or views, all on the same devices).
        fn: a JAX-traceable function of the source (of each source, in order), e.g.
            ``jnp.transpose``. It may also say how to read the array without making all of
            it (see `take` and `matmul_t`) and which sources are constants unless
            ``trainable=`` selects them (``fn.frozen_sources``, positions); such a function sets
            ``fn.keeps_view = True`` so that `tied.grad` hands the loss the view (and its
            cheap reads), not the materialised array.

    Returns:
        A `View`. Put it anywhere a layer expects an array.

    Raises:
        TypeError: a source that is not an array or a view, or an empty tuple.
        ValueError: sources on different devices (a view computes on one).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> enc = tied.nn.Dense(4, 2, key=jax.random.key(0))
        >>> dec = tied.nn.Dense(tied.view(enc.weight, jnp.transpose))   # decoder = enc.weight.T
        >>> model = tied.nn.Chain(enc, dec)
        >>> tied.param_count(model)            # enc.weight (2*4) and enc.bias (2): dec has no array
        10
        >>> g = tied.grad(lambda m: m(jnp.ones(4)).sum())(model)
        >>> g.layers[1].weight.source is g.layers[0].weight   # one total gradient
        True

        A view over a parameter that stands nowhere else is a reparametrisation:

        >>> scale = tied.view(jnp.zeros(3), jax.nn.softplus)   # always positive
        >>> bool((tied.materialize(scale) > 0).all())
        True

        Several sources: a view standing at two places, read from both arrays.

        >>> a, b = jnp.ones((2, 3)), jnp.full(3, 2.0)
        >>> w = tied.view((a, b), lambda a, b: a * b)
        >>> m = {"x": w, "y": w}
        >>> tied.ties(m)
        [("['x']", "['y']")]
        >>> tied.materialize(m["y"])[0].tolist()
        [2.0, 2.0, 2.0]
    """
    if type(source) is tuple:
        return View(_check_sources(source), fn)
    return View(_check_source(source, "tied.view"), fn)


def _check_source(source: Any, where: str) -> Any:
    if isinstance(source, (View, jax.Array, np.ndarray)):
        return source
    raise TypeError(
        f"{where}: the source must be an array (the parameter the view is a function of) or "
        f"another view, got {type(source).__name__}. To tie to a whole layer, put the layer "
        "itself at both places; to view a layer's weight, pass that array (layer.weight)."
    )


def _check_sources(sources: tuple) -> tuple:
    if not sources:
        raise TypeError("tied.view((), fn): give at least one source array, tied.view((a, b), fn).")
    for i, s in enumerate(sources):
        _check_source(s, f"tied.view(sources, fn): sources[{i}]")
    devices = [(i, _devices(s)) for i, s in enumerate(sources)]
    devices = [(i, d) for i, d in devices if d is not None]
    for i, d in devices[1:]:
        if d != devices[0][1]:
            j, first = devices[0]
            raise ValueError(
                f"tied.view(sources, fn): sources[{i}] is on {sorted(map(str, d))} but sources[{j}] "
                f"on {sorted(map(str, first))}; a view computes fn on one set of devices. Put them "
                f"together first, e.g. jax.device_put(sources[{i}], sources[{j}].sharding)."
            )
    return sources


def _devices(x: Any) -> frozenset | None:
    """The devices of a concrete jax.Array (None for numpy, a tracer or a view)."""
    if type(x) is View or not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    try:
        return frozenset(x.devices())
    except Exception:  # a deleted or abstract array: nothing to compare
        return None


def call(fn: Callable[..., Any], source: Any) -> Any:
    """``fn(*source)`` for a view of several sources (a tuple), ``fn(source)`` otherwise.

    A source that is itself a view still standing (one that keeps its view, a quantized
    table, when `tied.grad` materialises the model) is materialised first: ``fn`` is an
    array function (``tied.transpose`` of a quantized weight).
    """
    if type(source) is tuple:
        return fn(*map(materialize, source))
    return fn(materialize(source))


def _sources(v: View) -> tuple:
    src = v.source
    return tuple(map(materialize, src)) if type(src) is tuple else (materialize(src),)


def take(x: Any, ids: Any) -> Any:
    """Rows ``ids`` of the array ``x`` stands for: ``jnp.take(materialize(x), ids, axis=0)``.

    A view whose function has ``take(ids, *sources)`` reads only those rows (an integer
    table's rows and their scales), never the whole array. Layers read a lookup table so.
    """
    if type(x) is View:
        rows = getattr(x.fn, "take", None)
        if rows is not None:
            return rows(ids, *_sources(x))
    return jnp.take(materialize(x), ids, axis=0)


def matmul_t(h: Any, x: Any) -> Any:
    """``h @ materialize(x).T``; a view whose function has ``matmul_t(h, *sources)`` computes it
    from its sources (``(h @ q.T) * s`` for an integer table ``q``), never making the array."""
    if type(x) is View:
        mm = getattr(x.fn, "matmul_t", None)
        if mm is not None:
            return mm(h, *_sources(x))
    return h @ materialize(x).T


def _transpose(x):
    return jnp.swapaxes(x, -1, -2)


_transpose.__name__ = "transpose"
# It reads the last two axes only, so on a tied.Stack's stacked source (a leading layer axis) it
# gives each member's view stacked: the one view function a Stack may hold per member. Told by
# this mark, never by the name (jnp.transpose is also called "transpose" and reverses every axis).
_transpose.maps_over_leading_axes = True


def transpose(source: Any) -> View:
    """``tied.view(source, transpose)``: the tie of a decoder or output head to an encoder weight.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> enc = tied.nn.Dense(6, 2, key=jax.random.key(0))
        >>> dec = tied.nn.Dense(tied.transpose(enc.weight))   # dec.weight is enc.weight.T, one parameter
        >>> dec
        Dense(
          weight=View(
            fn=<function transpose>,
            source=f32[2,6],
          ),
          bias=None,
          activation=None,
        )
        >>> dec(enc(jnp.ones((1, 6)))).shape
        (1, 6)
    """
    return View(_check_source(source, "tied.transpose"), _transpose)


def materialize(x: Any) -> Any:
    """Return ``x`` as an array: ``fn(source)`` for a `View`, ``x`` itself otherwise.

    The one documented way for a layer to read a place that may hold a view when
    it is called eagerly, outside `tied.grad`/`tied.jit`.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.arange(6.0).reshape(2, 3)
        >>> tied.materialize(tied.transpose(w)).shape
        (3, 2)
        >>> tied.materialize(w) is w
        True
    """
    if type(x) is View:
        src = x.source
        if type(src) is tuple:
            return x.fn(*map(materialize, src))
        return x.fn(materialize(src))
    return x


def fn_name(fn: Any) -> str:
    """A stable name for a view function (never a repr holding a memory address); checkpoints store
    it and match it, inspection shows it."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    return f"partial({fn_name(inner)})" if inner is not None else type(fn).__name__
