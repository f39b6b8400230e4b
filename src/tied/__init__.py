"""tied: object graphs with shared parameters, on JAX.

Sharing is object identity: two places share when they hold the same Python
object. `tied` walks a model as a DAG, so a shared parameter is one parameter:
one gradient (the total, the same object at every place), one optimiser state,
one buffer under jit, one entry in a checkpoint.
"""

# First: an ImportError naming any dependency older than supported (before JAX is imported).
from . import _compat  # noqa: F401

# isort: split
from . import nn, optim
from ._checkpoint import CheckpointError, load, load_metadata, save
from ._classify import register_state
from ._grad import accumulate, grad, is_param, value_and_grad
from ._graph import GraphDef, GraphError, flatten, is_state, ties, unflatten
from ._implicit import Grads, Params, gradient, params
from ._inspect import param_count, print_summary, render_dot, summary, to_dot
from ._jit import Graph, block_until_ready, jit
from ._live import lock as live_lock
from ._manager import CheckpointManager
from ._map import map  # noqa: A004 - tied.map, like jax.tree_util.tree_map
from ._repr import register, tree_repr
from ._sharding import DataParallel, data_parallel, device_put, sharding_tree
from ._state import Rng, State
from ._surgery import PathError, replace, tie, untie
from ._under import under
from ._view import View, materialize, transpose, view

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DataParallel",
    "Graph",
    "GraphDef",
    "GraphError",
    "Grads",
    "Params",
    "PathError",
    "Rng",
    "State",
    "View",
    "accumulate",
    "block_until_ready",
    "data_parallel",
    "device_put",
    "flatten",
    "grad",
    "gradient",
    "is_param",
    "is_state",
    "jit",
    "load",
    "live_lock",
    "load_metadata",
    "map",
    "materialize",
    "nn",
    "optim",
    "param_count",
    "params",
    "print_summary",
    "register",
    "register_state",
    "replace",
    "render_dot",
    "save",
    "sharding_tree",
    "summary",
    "tie",
    "ties",
    "to_dot",
    "transpose",
    "tree_repr",
    "under",
    "unflatten",
    "untie",
    "value_and_grad",
    "view",
]


def __dir__() -> list[str]:
    return sorted(__all__)  # dir(tied) lists the public names only
