"""Compiled plans: generated flatten, unflatten and write-back functions for a structure seen twice,
guarded so that a graph of another structure makes them give up (`compile.py`), the loops over
runs of identical layers that keep a plan's size that of the model's distinct layouts (`loops.py`),
and the one emitter per node kind whose named templates both write (`emit.py`). See README.md.
"""

from .compile import (
    LARGE_PLAN_SIGHTINGS,
    MAX_PLAN_LINES,
    compile_flatten,
    compile_unflatten,
    compile_writes,
    plan_bound,
)
from .loops import flatten_lines, layout_and_order, unflatten_lines

__all__ = [
    "LARGE_PLAN_SIGHTINGS",
    "MAX_PLAN_LINES",
    "compile_flatten",
    "compile_writes",
    "compile_unflatten",
    "flatten_lines",
    "layout_and_order",
    "plan_bound",
    "unflatten_lines",
]
