"""Weight-only integer quantization of tied models: one integer table and its scales, read at every place.

`quantize` puts at each selected weight a view of two sources (`tied.view((q, scale), fn)`):
``q``, the integer table (int8), and ``scale``, one float per row (per output channel of a
`Dense` weight ``(out, in)``, per token of an `Embedding` table ``(vocab, dim)``: the same
axis, so a table tied between an embedding and a head is quantized once, the same way for
both). The view stands at every place of the array it replaces, so a tie stays one table:
one integer array and one scale array in memory, in the optimiser's eyes and in a
checkpoint, never "untie, then quantize" (which stores the table twice).

The arithmetic is qwix's symmetric "absmax" calibration (google/qwix,
``qwix/_src/core/numerics.py`` and ``qarray.py``), written out here in a few lines::

    bound = 2 ** (bits - 1) - 0.5             # 127.5 for int8, 7.5 for int4: the top bucket used fully
    scale = max(|w|, row) / bound             # 1 for a row of zeros
    q     = clip(round(w / scale), -2 ** (bits - 1), 2 ** (bits - 1) - 1)
    w     ~ q * scale

Why not qwix itself: its ``QArray`` is a Flax struct that its own interception of Flax
modules' ``dot_general``/``einsum`` consumes; a `tied.View` instead has to act as the
array at any place of any layer and be walked, tied, differentiated and saved by the core,
and qwix would bring Flax in as a dependency of ``tied.nn`` (it is not installed in this
project's environment either). The formulas are the same, so a table quantized here equals
qwix's ``quantize`` with ``channelwise_axes=(0,)`` and ``calibration_method="absmax"``
(checked by hand arithmetic in tests/nn/test_quant.py, not against qwix).

The view's function reads the table without making it: a lookup (`tied.nn.Embedding`)
gathers the rows' integers and their scales (``q[ids] * scale[ids]``), a head or a `Dense`
computes ``(h @ q.T) * scale`` with the integers as the matmul's operand; no float array of
the table's size is made in either (the views stay views inside `tied.grad` too). The
integer table is never trained (it is no parameter); the scales are constants unless a
``trainable=`` selects them; `tied.param_count` counts neither by default.

Storage of 4 bits: two values per byte of an int8 array ``(rows, ceil(cols / 2))`` (the
even column in the low nibble), so a 4-bit table really takes half the bytes of an 8-bit one
in memory and in every checkpoint format (``jnp.int4`` would be stored a byte per value on
CPU and has no safetensors dtype). Values are in ``[-8, 7]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import LEAF_KINDS, Places, View, flatten, get, is_param, unflatten
from .._core import where as _at
from ._dense import Dense, Embedding

__all__ = ["Dequantize", "quantize"]

_LAYERS = (Dense, Embedding)


class Dequantize:
    """The function of a quantized table's view: ``q * scale[:, None]`` from ``(q, scale)``.

    ``q`` is int8, ``(rows, cols)`` for 8 bits, two 4-bit values a byte ``(rows, ceil(cols/2))``
    for 4; ``scale`` is ``(rows,)`` in the weight's float dtype. Besides ``__call__`` (the whole
    table) it reads rows (`take`) and computes ``h @ table.T`` (`matmul_t`) from the integers.
    """

    ROWS = 4096  # rows multiplied at a time by a large table's matmul_t (see there)
    keeps_view = True  # tied.grad hands the loss the view, so lookups stay row reads
    frozen_sources = (1,)  # the scales: constants unless trainable= selects them

    def __init__(self, bits: int, cols: int):
        self.bits, self.cols = bits, cols

    @property
    def __name__(self) -> str:  # the name checkpoints store and match
        # 4 bits: two values a byte, so tables of 2k-1 and 2k columns have one shape; the name
        # tells them apart (else a file of 6 columns loads into a model of 5 and drops one).
        return "dequantize8" if self.bits == 8 else f"dequantize4_cols{self.cols}"

    def __eq__(self, other: object) -> bool:
        return type(other) is Dequantize and (other.bits, other.cols) == (self.bits, self.cols)

    def __hash__(self) -> int:
        return hash((Dequantize, self.bits, self.cols))

    def __repr__(self) -> str:
        return f"Dequantize(bits={self.bits}, cols={self.cols})"

    def integers(self, q: Any) -> Any:
        """The values of ``q`` as int8, ``(..., cols)`` (4-bit pairs unpacked)."""
        if self.bits == 8:
            return q
        lo = jnp.right_shift(jnp.left_shift(q, 4), 4)  # arithmetic shifts keep the sign
        hi = jnp.right_shift(q, 4)
        both = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
        return both[..., : self.cols]

    def __call__(self, q: Any, scale: Any) -> Any:
        return self.integers(q).astype(scale.dtype) * scale[:, None]

    def take(self, ids: Any, q: Any, scale: Any) -> Any:
        """Rows ``ids``: their integers and scales gathered, then multiplied."""
        rows = self.integers(jnp.take(q, ids, axis=0))
        return rows.astype(scale.dtype) * jnp.take(scale, ids, axis=0)[..., None]

    def matmul_t(self, h: Any, q: Any, scale: Any) -> Any:
        """``h @ table.T`` as ``(h @ q.T) * scale``: the integers are the matmul's operand.

        A backend without a mixed int8/float matmul (XLA on CPU) converts its integer operand
        to float first, so a table of more than ``2 * ROWS`` rows is multiplied ``ROWS`` rows
        at a time (`jax.lax.map`): at most that many rows are ever float at once.
        """
        dtype = jnp.result_type(h, scale)
        dims = (((h.ndim - 1,), (1,)), ((), ()))

        def times(block: Any) -> Any:
            return jax.lax.dot_general(h, self.integers(block), dims, preferred_element_type=dtype)

        rows, n = q.shape[0], self.ROWS
        if rows <= 2 * n:
            return times(q) * scale
        full = rows // n
        out = jnp.moveaxis(jax.lax.map(times, q[: full * n].reshape(full, n, q.shape[1])), 0, -2)
        parts = [out.reshape(*out.shape[:-2], full * n)]
        if rows > full * n:
            parts.append(times(q[full * n :]))
        return jnp.concatenate(parts, axis=-1) * scale


def _quantized(w: Any, bits: int) -> tuple[Any, Any]:
    """``(q, scale)`` of a float table ``w`` (rows, cols), per row, qwix's absmax arithmetic."""
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w32 = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=1)
    scale = jnp.where(amax > 0, amax / (high + 0.5), 1.0)
    q = jnp.clip(jnp.round(w32 / scale[:, None]), low, high).astype(jnp.int8)
    if bits == 4:
        if q.shape[1] % 2:
            q = jnp.pad(q, ((0, 0), (0, 1)))
        q = jnp.bitwise_or(jnp.bitwise_and(q[:, 0::2], 0xF), jnp.left_shift(q[:, 1::2], 4)).astype(jnp.int8)
    return q, scale.astype(w.dtype)


def _selected(places: Places, model: Any, where_: Any) -> dict[str, str]:
    """The selected weight arrays: the path of each array's place -> the selected place's path."""
    layers = [p for p in places.nodes() if isinstance(get(model, places.steps[p], places), _LAYERS)]
    if callable(where_) and not isinstance(where_, str):
        chosen = [p for p in layers if _truth(where_(p, get(model, places.steps[p], places)), p)]
    else:
        paths = [where_] if isinstance(where_, str) else list(where_)
        chosen = [places.resolve(p, who="tied.nn.quantize") for p in paths]
    if not chosen:
        raise ValueError(
            f"tied.nn.quantize: where={where_!r} selects no place. Name a Dense or Embedding place "
            f"as tied prints it (one of {', '.join(map(_at, layers[:5])) or 'none'}), a list of "
            "them, or a predicate (path, layer) -> bool over those places."
        )
    out: dict[str, str] = {}
    for p in chosen:
        weight = p
        if places.kind[p] not in LEAF_KINDS:
            obj = get(model, places.steps[p], places)
            if not isinstance(obj, _LAYERS):
                raise ValueError(
                    f"tied.nn.quantize: {_at(p)} is a {type(obj).__name__}; only the weight of a Dense "
                    "or an Embedding (or a 2-D float array's own place) is quantized. Select those places."
                )
            weight = p + ".weight"
        out[_check_weight(places, model, weight)] = p
    return out


def _truth(r: Any, path: str) -> bool:
    if not isinstance(r, (bool, np.bool_)):
        raise TypeError(
            f"tied.nn.quantize: where(path, layer) returned {type(r).__name__} at {_at(path)}, not a bool."
        )
    return bool(r)


def _check_weight(places: Places, model: Any, path: str) -> str:
    kind = places.kind.get(path)
    if kind == "view":
        raise ValueError(
            f"tied.nn.quantize: {_at(path)} holds a tied.View (a derived tie or a table already "
            "quantized); quantize the array it is made from, at that array's own place."
        )
    if kind != "array":
        raise ValueError(f"tied.nn.quantize: {_at(path)} holds no array ({kind}); nothing to quantize there.")
    if places.gdef.state_leaves()[places.leaf_of[path]]:
        raise ValueError(
            f"tied.nn.quantize: {_at(path)} is state (below a tied.State or another state cell), not a "
            "weight; only parameters are quantized. Leave it out of where=."
        )
    w = get(model, places.steps[path], places)
    if not is_param(w) or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(
            f"tied.nn.quantize: {_at(path)} has dtype {w.dtype}; only float weights are quantized "
            "(an integer table is already integers). Leave it out of where=."
        )
    if w.ndim != 2:
        raise ValueError(
            f"tied.nn.quantize: {_at(path)} has shape {tuple(w.shape)}; only 2-D weights, (out, in) or "
            "(vocab, dim), are quantized per row (a stacked weight of a tied.Stack: unstack it first)."
        )
    return path


def quantize(model: Any, where: str | Sequence[str] | Callable[[str, Any], bool], *, bits: int = 8) -> Any:
    """A new model whose selected weights are integer tables with per-row scales, each tie kept one table.

    Weight-only, symmetric, per output channel (per row of a `Dense` weight ``(out, in)`` and of
    an `Embedding` table ``(vocab, dim)``). Each selected array becomes
    ``tied.view((q, scale), Dequantize(bits, cols))`` at *every* place of that array: a table
    tied between an embedding and a head (one `Embedding` at both places, or
    ``Dense(embed.weight)`` as `tied.load` of a Hugging Face file gives) is quantized once and
    read at both. The lookup gathers rows of the integers and their scales, the head computes
    ``(h @ q.T) * scale``: neither makes the float table. ``q`` is never trained; ``scale`` is
    a constant unless ``trainable=`` selects it (``.source[1]`` paths); `tied.param_count`
    counts neither. See the module's notes for the arithmetic (qwix's absmax).

    Args:
        model: the model (not changed).
        where: a place path as tied prints it (a `Dense` or `Embedding` place, or a 2-D float
            array's place), a list of them, or a predicate ``(path, layer) -> bool`` called at
            every place of a `Dense` or `Embedding`.
        bits: 8 (int8 values in ``[-128, 127]``) or 4 (``[-8, 7]``, two a byte).

    Returns:
        The new model.

    Raises:
        ValueError: ``bits`` other than 4 or 8; ``where`` selecting nothing, or a place that is
            not a Dense or Embedding, or an integer, non-2-D or view array, naming the place.
            The model is left as it was.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(50, 8, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.Dense(emb.weight)}    # a tied head
        >>> q = tied.nn.quantize(model, "['head']")
        >>> q["head"].weight is q["embed"].weight                         # quantized once, one view
        True
        >>> [(x.dtype.name, x.shape) for x in tied.flatten(q)[0]]
        [('int8', (50, 8)), ('float32', (50,))]
        >>> tied.param_count(q)                                           # neither is trained
        0
        >>> err = jnp.abs(q["head"](jnp.ones(8)) - model["head"](jnp.ones(8))).max()
        >>> bool(err < 0.05)
        True
    """
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"tied.nn.quantize: bits={bits!r}; use bits=8 (int8) or bits=4 (two values a byte).")
    leaves, gdef = flatten(model)
    places = Places(gdef)
    new = list(leaves)
    for path in _selected(places, model, where):
        i = places.leaf_of[path]
        if type(new[i]) is View:
            continue  # the same array selected at two places: one table
        w = leaves[i]
        q, scale = _quantized(w, bits)
        new[i] = View((q, scale), Dequantize(bits, w.shape[1]))  # tied.view((q, scale), fn): one device
    return unflatten(gdef, new)
