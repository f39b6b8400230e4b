"""How the transforms name a call's arguments and refuse a change of their structure.

A tied transform flattens a call's ``(args, kwargs)`` (`flatten_arguments`), runs the
function on a copy, and has the core write the new values back (`_core.write_back`). A
path of the arguments is shown as the caller knows it (`place_name`: ``args[0].embed.weight``
where the core sees ``[0][0].embed.weight``), and a function that changed an argument's
structure is refused at the first difference (`structure_error`). It imports `_core` only.
"""

from __future__ import annotations

from typing import Any

from .._core import GraphDef, GraphError, first_difference, plan_cache, where

__all__ = ["flatten_arguments", "place_name", "structure_error"]


_REBIND = (
    "Build and return a new model instead (tied.replace, tied.tie and tied.optim.update return new "
    "graphs) and rebind it, or make the change outside the compiled function."
)


def structure_error(
    before: GraphDef,
    after: GraphDef,
    who: str,
    *,
    out_of: str = "a compiled function",
    advice: str = _REBIND,
    name: Any = None,
) -> GraphError:
    """The refusal of a call that changed an argument's structure, at the first difference:
    ``who`` changed it, which cannot be carried ``out_of`` what ran; ``advice`` says what to do
    instead; ``name`` shows the path as the caller knows it (by default `tied.jit`'s ``args[0]...``)."""
    path, how = first_difference(before, after)
    return GraphError(
        f"{how}. {who} changed the structure of an argument (a tie cut, an attribute added or "
        f"removed, a static changed), which cannot be carried out of {out_of}; nothing was "
        f"written into your objects. {advice}",
        path,
        name=name or place_name,
    )


def place_name(path: str) -> str:
    """A path of ``(args, kwargs)`` written as ``args[0].embed.weight`` or ``kwargs['x']``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return where(path)


def flatten_arguments(root: Any, cache: Any = None) -> tuple[list, GraphDef]:
    """`flatten` of a call's ``(args, kwargs)`` with the plans of ``cache`` (a `plan_cache`; by
    default one for the copies the transforms read after their calls), a `StateClash` naming its
    places as the arguments (``args[0]['w']``), as `tied.grad` names the model's."""
    return (_COPIES if cache is None else cache).flatten(root, name=place_name)


_COPIES = plan_cache()
