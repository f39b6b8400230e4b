"""Derived ties: a place that holds a function of another parameter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


class View:
    """A place that holds ``fn(source)`` instead of an array of its own.

    Only ``source`` is a parameter: `tied.flatten` lists it once, the optimiser
    keeps one state for it, and the gradient at a view's place is a `View` of
    the source's own total gradient object.

    Layers read a view with `tied.materialize` (or ``jnp.asarray(view)``); inside
    `tied.grad` views are materialised for you, and under `tied.jit` and
    `tied.Graph` a view stays a view whose source is the traced array, so the
    layer's `tied.materialize` call traces ``fn``.

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

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> enc = tied.nn.Dense(2, 3, key=jax.random.key(0))   # weight (3, 2)
        >>> dec_w = tied.transpose(enc.weight)
        >>> dec_w.source is enc.weight, dec_w.shape
        (True, (2, 3))
        >>> bool((tied.materialize(dec_w) == enc.weight.T).all())
        True
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
        import numpy as np

        out = np.asarray(materialize(self))
        return out if dtype is None else out.astype(dtype)

    def _abstract(self) -> Any:
        source = self.source._abstract() if type(self.source) is View else self.source
        fn = self.fn
        try:  # trace fn on the source's shape and dtype, without computing it
            return jax.eval_shape(lambda s: fn(s), source)
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

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", repr(self.fn))
        shape = getattr(self.source, "shape", None)
        return f"View({name}, source shape={shape})"


def view(source: Any, fn: Callable[[Any], Any]) -> View:
    """A derived tie: a place holding ``fn(source)``, where only ``source`` is a parameter.

    Args:
        source: the parameter array (the same object that stands elsewhere in the model).
        fn: a JAX-traceable function of the source, e.g. ``jnp.transpose``.

    Returns:
        A `View`. Put it anywhere a layer expects an array.

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
    """
    return View(_check_source(source, "tied.view"), fn)


def _check_source(source: Any, where: str) -> Any:
    import numpy as np

    if isinstance(source, (View, jax.Array, np.ndarray)):
        return source
    raise TypeError(
        f"{where}: the source must be an array (the parameter the view is a function of) or "
        f"another view, got {type(source).__name__}. To tie to a whole layer, put the layer "
        "itself at both places; to view a layer's weight, pass that array (layer.weight)."
    )


def _transpose(x):
    return jnp.swapaxes(x, -1, -2)


_transpose.__name__ = "transpose"


def transpose(source: Any) -> View:
    """``tied.view(source, transpose)``: the tie of a decoder or output head to an encoder weight.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> enc = tied.nn.Dense(6, 2, key=jax.random.key(0))
        >>> dec = tied.nn.Dense(tied.transpose(enc.weight))   # dec.weight is enc.weight.T, one parameter
        >>> dec
        Dense(2 => 6, no bias, view)
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
        return x.fn(materialize(x.source))
    return x
