"""The transforms over the core: `grad` and `value_and_grad`, `jit` and `Graph`, sharding, the implicit
mode. See README.md beside this file.
"""

from .checks import check
from .grad import Convention, accumulate, check_convention, grad, is_param, total_of, value_and_grad
from .implicit import Grads, Params, gradient, params
from .jit import Graph, block_until_ready, jit
from .lifted import remat, scan, vmap
from .pipeline import pipeline
from .sharding import DataParallel, data_parallel, device_put, fsdp, sharding_tree
from .stack import Stack, stack, unstack

__all__ = [
    "Convention",
    "DataParallel",
    "Grads",
    "Graph",
    "Params",
    "Stack",
    "accumulate",
    "block_until_ready",
    "check",
    "check_convention",
    "data_parallel",
    "device_put",
    "fsdp",
    "grad",
    "gradient",
    "is_param",
    "jit",
    "params",
    "pipeline",
    "remat",
    "scan",
    "sharding_tree",
    "stack",
    "total_of",
    "unstack",
    "value_and_grad",
    "vmap",
]
