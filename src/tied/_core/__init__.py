"""The core: node kinds, the walk that decides sharing, the GraphDef and its one traversal, flatten
and unflatten with their compiled plans, views, state cells, path prefixes, what counts as a parameter,
and writing into live objects. See README.md beside this file.
"""

from .classify import register, register_state, walkable_below
from .errors import Located, ModelChangedError, where
from .graph import flatten, is_state, live_lock, plan_cache, rebuild, ties, unflatten
from .graphdef import GraphDef
from .kinds import GraphError
from .live import check_written, slots, write
from .params import Trainable, is_param, trainable_mask
from .places import LEAF_KINDS, PathError, Places, child, get, is_array, is_prefix, put, renew, with_child
from .read import node_objects, read_places
from .state import Rng, State
from .under import at_or_below, covered, under, warn_none_selected
from .view import View, fn_name, materialize, matmul_t, take, transpose, view
from .writeback import first_difference, write_back

__all__ = [
    "GraphDef",
    "GraphError",
    "LEAF_KINDS",
    "Located",
    "ModelChangedError",
    "PathError",
    "Places",
    "Rng",
    "State",
    "Trainable",
    "View",
    "at_or_below",
    "check_written",
    "child",
    "covered",
    "first_difference",
    "flatten",
    "fn_name",
    "get",
    "is_array",
    "is_param",
    "is_prefix",
    "is_state",
    "live_lock",
    "materialize",
    "matmul_t",
    "take",
    "node_objects",
    "plan_cache",
    "put",
    "read_places",
    "rebuild",
    "register",
    "renew",
    "register_state",
    "slots",
    "ties",
    "trainable_mask",
    "transpose",
    "under",
    "unflatten",
    "view",
    "walkable_below",
    "warn_none_selected",
    "where",
    "with_child",
    "write",
    "write_back",
]
