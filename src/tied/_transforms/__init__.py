"""The transforms over the core: `grad` and `value_and_grad`, `jit` and `Graph`, sharding, the implicit
mode. See README.md beside this file.
"""

from .grad import Convention, accumulate, check_convention, grad, is_param, total_of, value_and_grad
from .implicit import Grads, Params, gradient, params
from .jit import Graph, block_until_ready, jit
from .sharding import DataParallel, data_parallel, device_put, sharding_tree

__all__ = [
    "Convention",
    "DataParallel",
    "Grads",
    "Graph",
    "Params",
    "accumulate",
    "block_until_ready",
    "check_convention",
    "data_parallel",
    "device_put",
    "grad",
    "gradient",
    "is_param",
    "jit",
    "params",
    "sharding_tree",
    "total_of",
    "value_and_grad",
]
