"""What counts as a parameter: `is_param` (an array of inexact dtype) and `trainable_mask`, the one
rule of what is trained (state never is), read by gradients, optimisers, `map` and inspection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .graphdef import GraphDef
from .kinds import TUPLE, VIEW
from .refs import LEAF, NODE, split_ref

__all__ = ["Trainable", "is_param", "trainable_mask"]

Trainable = Callable[[str, Any], bool]

_inexact: dict = {}


def is_param(x: Any) -> bool:
    """Whether an array is a parameter: an array of inexact (float or complex) dtype.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> tied.is_param(jnp.ones(3)), tied.is_param(jnp.arange(3)), tied.is_param(1.0)
        (True, False, False)
    """
    dt = getattr(x, "dtype", None)
    if dt is None:
        return False
    r = _inexact.get(dt)
    if r is None:
        r = _inexact[dt] = bool(jnp.issubdtype(dt, jnp.inexact))
    return r


def trainable_mask(gdef: GraphDef, leaves: list, trainable: Trainable | None) -> list[bool]:
    """For each unique array of a flattened model, whether it is a trainable parameter.

    A parameter (an array of inexact dtype) is trainable when ``trainable`` is
    None or ``trainable(path, array)`` holds at *any* of its places (keystr
    paths; ``""`` for the root). With ``trainable`` None, the sources a view's
    function names in ``fn.frozen_sources`` (a quantized table's scales) are not trained
    either: they are constants unless ``trainable`` selects them. The one rule shared by `tied.grad`,
    `tied.value_and_grad`, `tied.params`, `tied.param_count` and
    `tied.optim.setup`.

    Raises:
        TypeError: ``trainable`` is not callable, or returns something that is
            not a Python or numpy bool (a traced value, say); the message names
            the path.
    """
    state = gdef.state_leaves()  # state is never a parameter (and trainable= never sees it)
    if trainable is None:
        frozen = _frozen_sources(gdef)
        return [is_param(x) and not s and q not in frozen for q, (x, s) in enumerate(zip(leaves, state))]
    if not callable(trainable):
        raise TypeError(
            f"trainable= takes a function (path, array) -> bool, got {type(trainable).__name__}. "
            'For example trainable=lambda path, x: "running" not in path.'
        )
    all_paths: list[list[str]] = [[] for _ in leaves]
    for path, i in gdef.place_leaves():  # every place, below shared nodes too
        all_paths[i].append(path)
    out = []
    for x, paths, s in zip(leaves, all_paths, state):
        keep = False
        if is_param(x) and not s:
            for path in paths:
                r = trainable(path, x)
                if not isinstance(r, (bool, np.bool_)):
                    raise TypeError(
                        f"{path or '<root>'}: trainable(path, array) returned {type(r).__name__}, "
                        "not a bool. Decide from the path, shape and dtype (they are known "
                        "under jit), e.g. lambda path, x: x.ndim > 1."
                    )
                if r:
                    keep = True
                    break
        out.append(keep)
    return out


def _frozen_sources(gdef: GraphDef) -> set[int]:
    """The arrays that a view of several sources names as constants (``fn.frozen_sources``: positions)."""
    out: set[int] = set()
    records = gdef.records
    for kind, meta, refs in records:
        frozen = getattr(meta, "frozen_sources", ()) if kind == VIEW else ()
        if not frozen:
            continue
        tag, q = split_ref(refs[0])
        if tag != NODE or records[q][0] != TUPLE:
            continue
        for i in frozen:
            tag, leaf = split_ref(records[q][2][i])
            if tag == LEAF:
                out.add(leaf)
    return out
