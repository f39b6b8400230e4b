"""Convolution: `Conv2d`, features last (NHWC), its weight `(kh, kw, in, out)`."""

from __future__ import annotations

import math
from typing import Any

import jax

from .._core import materialize
from .._tree import register
from ._checks import _check_size, _features, _is_arraylike, _is_size


def _pair(who: str, name: str, v: Any) -> tuple[int, int]:
    if _is_size(v):
        return int(v), int(v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_size(u) for u in v):
        return int(v[0]), int(v[1])
    raise TypeError(f"{who}: {name} must be an int or a pair of ints, got {v!r}.")


def _padding(v: Any) -> Any:
    if isinstance(v, str):
        if v.upper() not in ("SAME", "VALID"):
            raise ValueError(f"Conv2d: padding must be an int, a pair, 'SAME' or 'VALID', got {v!r}.")
        return v.upper()
    ph, pw = _pair("Conv2d", "padding", v)
    if ph < 0 or pw < 0:
        raise ValueError(f"Conv2d: padding must not be negative, got {v!r}.")
    return ph, pw


@register
class Conv2d:
    """A 2-d convolution on NHWC input with an HWIO ``weight`` (`jax.lax.conv_general_dilated`).

    Two ways to build one, as with `Dense`:

    * ``Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, *, key)``:
      new parameters, weight ``(kh, kw, in, out)`` and bias ``(out,)`` uniform in
      ``±1/sqrt(in * kh * kw)`` (PyTorch's default);
    * ``Conv2d(weight, bias=None, stride=1, padding=0)``: from existing arrays (or
      views), which is how two convolutions share a kernel.

    Args:
        in_channels: the input channels, or the weight array ``(kh, kw, in, out)``.
        out_channels: the output channels, or the bias array ``(out,)`` (None: no bias).
        kernel_size: an int or a pair (with sizes only).
        stride: an int or a pair.
        padding: an int or a pair (zeros on both sides), ``"SAME"`` or ``"VALID"``.
        key: a JAX PRNG key (with sizes).
        use_bias: with sizes: whether to create a bias.

    Input ``(..., height, width, in)``, output ``(..., height', width', out)``.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> conv = tied.nn.Conv2d(3, 8, 3, padding=1, key=jax.random.key(0))
        >>> conv(jnp.ones((2, 5, 5, 3))).shape
        (2, 5, 5, 8)
        >>> down = tied.nn.Conv2d(conv.weight, conv.bias, stride=2, padding=1)   # one kernel
        >>> down(jnp.ones((2, 5, 5, 3))).shape, tied.ties([conv, down])[0]
        ((2, 3, 3, 8), ('[0].weight', '[1].weight'))
    """

    weight: Any
    bias: Any
    stride: tuple
    padding: Any

    def __init__(
        self,
        in_channels: Any,
        out_channels: Any = None,
        kernel_size: Any = None,
        stride: Any = 1,
        padding: Any = 0,
        *,
        key: Any = None,
        use_bias: bool = True,
    ):
        if _is_size(in_channels):
            n_in = _check_size("Conv2d", "in_channels", in_channels)
            n_out = _check_size("Conv2d", "out_channels", out_channels)
            if kernel_size is None or key is None:
                raise TypeError(
                    "Conv2d(in_channels, out_channels, kernel_size, key=...) needs a kernel size and "
                    "an explicit key, e.g. Conv2d(3, 8, 3, key=jax.random.key(0))."
                )
            kh, kw = _pair("Conv2d", "kernel_size", kernel_size)
            wkey, bkey = jax.random.split(key)
            lim = 1.0 / math.sqrt(n_in * kh * kw)
            self.weight = jax.random.uniform(wkey, (kh, kw, n_in, n_out), minval=-lim, maxval=lim)
            self.bias = jax.random.uniform(bkey, (n_out,), minval=-lim, maxval=lim) if use_bias else None
        elif _is_arraylike(in_channels):
            if kernel_size is not None or key is not None:
                raise TypeError(
                    "Conv2d(weight, bias): the kernel size comes from the weight and no key is used; "
                    "drop kernel_size and key when building from arrays."
                )
            if len(tuple(in_channels.shape)) != 4:
                raise ValueError(
                    f"Conv2d(weight, bias): weight must have shape (kh, kw, in, out) (HWIO), got "
                    f"shape {tuple(in_channels.shape)}."
                )
            if out_channels is not None and (
                not _is_arraylike(out_channels) or tuple(out_channels.shape) != tuple(in_channels.shape)[3:]
            ):
                raise ValueError(
                    f"Conv2d(weight, bias): bias must be None or an array of shape (out,) = "
                    f"{tuple(in_channels.shape)[3:]}, got {out_channels!r}."
                )
            self.weight, self.bias = in_channels, out_channels
        else:
            raise TypeError(
                "Conv2d takes (in_channels, out_channels, kernel_size, key=...) or (weight, bias=None); "
                f"got a first argument of type {type(in_channels).__name__}."
            )
        self.stride = _pair("Conv2d", "stride", stride)
        self.padding = _padding(padding)

    def __call__(self, x: Any) -> Any:
        w = materialize(self.weight)
        _features("Conv2d", x, w.shape[2])
        if x.ndim < 3:
            raise ValueError(f"Conv2d: the input must be (..., height, width, channels), got {x.shape}.")
        lead = x.shape[:-3]
        pad = self.padding if isinstance(self.padding, str) else tuple((p, p) for p in self.padding)
        y = jax.lax.conv_general_dilated(
            x.reshape((-1, *x.shape[-3:])), w, self.stride, pad, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        if self.bias is not None:
            y = y + materialize(self.bias)
        return y.reshape(*lead, *y.shape[1:])
