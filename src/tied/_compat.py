"""What differs between the JAX versions `tied` supports, detected once at import."""

from __future__ import annotations

import jax

__all__ = ["is_pytree_node"]

_registry = jax.tree_util.default_registry


def is_pytree_node(t: type) -> bool:
    """Whether ``t`` is a node type of JAX's default pytree registry."""
    return _registry.is_node(t)
