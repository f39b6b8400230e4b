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
from ._checkpoint import CheckpointError, CheckpointManager, load, load_metadata, save
from ._core import (
    GraphDef,
    GraphError,
    ModelChangedError,
    PathError,
    Rng,
    State,
    View,
    flatten,
    is_state,
    live_lock,
    materialize,
    register_state,
    ties,
    transpose,
    under,
    unflatten,
    view,
)
from ._transforms import (
    DataParallel,
    Grads,
    Graph,
    Params,
    Stack,
    accumulate,
    block_until_ready,
    data_parallel,
    device_put,
    fsdp,
    grad,
    gradient,
    is_param,
    jit,
    params,
    pipeline,
    remat,
    scan,
    sharding_tree,
    stack,
    unstack,
    value_and_grad,
    vmap,
)
from ._tree import (
    map,  # noqa: A004 - tied.map, like jax.tree_util.tree_map
    param_count,
    print_summary,
    register,
    render_dot,
    replace,
    summary,
    tie,
    to_dot,
    tree_repr,
    untie,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DataParallel",
    "Grads",
    "Graph",
    "GraphDef",
    "GraphError",
    "ModelChangedError",
    "Params",
    "PathError",
    "Rng",
    "Stack",
    "State",
    "View",
    "accumulate",
    "block_until_ready",
    "data_parallel",
    "device_put",
    "fsdp",
    "flatten",
    "grad",
    "gradient",
    "is_param",
    "is_state",
    "jit",
    "live_lock",
    "load",
    "load_metadata",
    "map",
    "materialize",
    "nn",
    "optim",
    "param_count",
    "params",
    "pipeline",
    "print_summary",
    "register",
    "register_state",
    "remat",
    "render_dot",
    "replace",
    "save",
    "scan",
    "sharding_tree",
    "stack",
    "summary",
    "tie",
    "ties",
    "to_dot",
    "transpose",
    "tree_repr",
    "under",
    "unflatten",
    "unstack",
    "untie",
    "value_and_grad",
    "view",
    "vmap",
]


def __dir__() -> list[str]:
    return sorted(__all__)  # dir(tied) lists the public names only
