"""The child-reference encoding (`tied._core.refs`), against the one the contributors' map documents:
leaf ``i`` is ``3*i``, node ``j`` is ``3*j+1``, static ``k`` is ``3*k+2``."""

from __future__ import annotations

import jax.numpy as jnp

import tied
from tied._core.refs import LEAF, NODE, STATIC, TAGS, leaf_ref, node_ref, split_ref, static_ref


def test_the_encoding_is_the_documented_one():
    assert (LEAF, NODE, STATIC, TAGS) == (0, 1, 2, 3)
    for i in range(50):
        assert leaf_ref(i) == 3 * i
        assert node_ref(i) == 3 * i + 1
        assert static_ref(i) == 3 * i + 2
        assert split_ref(leaf_ref(i)) == (LEAF, i)
        assert split_ref(node_ref(i)) == (NODE, i)
        assert split_ref(static_ref(i)) == (STATIC, i)


def test_every_reference_of_a_walk_names_a_leaf_a_node_or_a_static_it_holds():
    w = jnp.ones(2)
    model = {"a": [w, 1.0, "s"], "b": {"w": w, "v": tied.view(w, jnp.sin)}, "c": (2, 3)}
    leaves, gdef = tied.flatten(model)
    assert gdef.root == node_ref(0)  # a walk records the root first
    refs = [r for _, _, rs in gdef.records for r in rs]
    sizes = {LEAF: len(leaves), NODE: len(gdef.records), STATIC: len(gdef.statics)}
    for r in refs:
        tag, index = split_ref(r)
        assert 0 <= index < sizes[tag]
    assert refs.count(leaf_ref(0)) == 3  # the tied array: one number at its three places
