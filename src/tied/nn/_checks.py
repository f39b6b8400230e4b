"""Argument checks shared by the layers: sizes, array-likes, feature axes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._core import View


def _is_size(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, View))


def _shape(x: Any) -> tuple:
    return tuple(x.shape)


def _check_size(who: str, name: str, x: Any) -> int:
    if not _is_size(x) or x < 1:
        raise TypeError(f"{who}: {name} must be a positive int, got {x!r}.")
    return int(x)


def _features(who: str, x: Any, n: int) -> None:
    if x.ndim < 1 or x.shape[-1] != n:
        raise ValueError(
            f"{who}: the input's last axis (features) has size {x.shape[-1] if x.ndim else None}, "
            f"expected {n}. tied.nn is features last: images are (batch, height, width, channels)."
        )
