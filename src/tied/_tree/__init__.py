"""Tree tools over the core: `map`, surgery by path (`tie`, `untie`, `replace`), inspection
(`summary`, `param_count`, `to_dot`). See README.md beside this file.
"""

from .inspect import param_count, print_summary, render_dot, summary, to_dot
from .map import map
from .repr import register, tree_repr
from .surgery import replace, tie, untie

__all__ = [
    "map",
    "param_count",
    "print_summary",
    "register",
    "render_dot",
    "replace",
    "summary",
    "tie",
    "to_dot",
    "tree_repr",
    "untie",
]
