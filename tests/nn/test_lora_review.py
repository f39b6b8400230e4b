"""Review of tied.nn.lora and merge (issue 35): a Stack of Stacks, and a predicate in a model with a
reference cycle. References: numpy by hand over the original arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied
from tied.nn import Dense, LoRA


def test_lora_in_a_stack_of_stacks_gets_one_adapter_per_inner_member_and_merges_by_numpy():
    # outer 3 x inner 2 members, each its own Dense: the layer's weight is (3, 2, 4, 4)
    dense = [[Dense(4, 4, key=jax.random.key(10 * i + j)) for j in range(2)] for i in range(3)]
    model = {"s": tied.stack([{"in": tied.stack([{"lin": d} for d in row])} for row in dense])}
    adapted = tied.nn.lora(model, "['s'].member['in'].member['lin']", 2, alpha=4, key=jax.random.key(9))
    q = adapted["s"].member["in"].member["lin"]
    assert isinstance(q, LoRA) and q.lora_A.shape == (3, 2, 2, 4) and q.lora_B.shape == (3, 2, 4, 2)
    a = np.asarray(q.lora_A).reshape(6, 2, 4)
    assert len({a_k.tobytes() for a_k in a}) == 6  # one draw per (outer, inner) member
    assert np.all(np.abs(a) <= 0.5)  # peft's init: uniform in +-1/sqrt(in)
    for i in range(3):  # the base, bit for bit
        for j in range(2):
            np.testing.assert_array_equal(np.asarray(q.base.weight[i, j]), np.asarray(dense[i][j].weight))
    bs = jax.random.normal(jax.random.key(3), (3, 2, 4, 2))
    adapted = tied.replace(adapted, "['s'].member['in'].member['lin'].lora_B", bs)
    merged = tied.nn.merge(adapted)
    got = np.asarray(merged["s"].member["in"].member["lin"].weight)
    for i in range(3):
        for j in range(2):
            want = np.asarray(dense[i][j].weight) + 2.0 * np.asarray(bs[i, j]) @ np.asarray(q.lora_A[i, j])
            np.testing.assert_allclose(got[i, j], want, rtol=1e-5, atol=1e-6)


def test_a_predicate_is_asked_at_every_place_of_a_shared_container_in_a_model_with_a_cycle():
    d = Dense(3, 3, key=jax.random.key(0))
    box = {"q": d}
    x = jnp.arange(3.0)[None]
    for cycle in (False, True):
        model = {"p": box, "r": box}
        if cycle:
            model["me"] = model  # a reference cycle elsewhere must not change what is selected
        adapted = tied.nn.lora(model, lambda path, layer: path == "['r']['q']", 2, key=jax.random.key(1))
        layer = adapted["r"]["q"]
        assert isinstance(layer, LoRA) and adapted["p"]["q"] is layer  # one slot of one container
        layer.lora_B = jnp.ones((3, 2))
        want = (
            x @ np.asarray(d.weight).T
            + np.asarray(d.bias)
            + (x @ np.asarray(layer.lora_A).T) @ np.ones((2, 3))
        )
        np.testing.assert_allclose(np.asarray(layer(x)), want, rtol=1e-6)


def _one_adapter():
    d = Dense(4, 4, key=jax.random.key(0))
    adapter = LoRA(d, 2, key=jax.random.key(1))
    adapter.lora_B = jax.random.normal(jax.random.key(2), (4, 2))
    want = np.asarray(d.weight) + np.asarray(adapter.lora_B) @ np.asarray(adapter.lora_A)
    return d, adapter, want


def test_merge_of_one_adapter_broadcast_across_a_stack_and_held_outside_keeps_it_one_layer():
    d, adapter, want = _one_adapter()
    model = {
        "s": tied.stack([{"lin": adapter, "w": jnp.full(4, float(i))} for i in range(3)]),
        "out": adapter,
    }
    assert tied.ties(model) == [("['out']", "['s'].member['lin']")]
    merged = tied.nn.merge(model)
    assert merged["s"].member["lin"] is merged["out"]  # one adapter at two places: one merged layer
    assert tied.ties(merged) == [("['out']", "['s'].member['lin']")]
    assert "['lin'].weight" not in merged["s"].stacked  # broadcast, not n copies
    np.testing.assert_allclose(np.asarray(merged["out"].weight), want, rtol=1e-6, atol=1e-6)
    assert merged["out"].bias is d.bias and model["out"] is adapter  # the model given is unchanged


def test_merge_of_an_adapter_in_a_container_broadcast_across_a_stack():
    d, adapter, want = _one_adapter()
    box = {"lin": adapter}
    model = {"s": tied.stack([{"box": box, "w": jnp.full(4, float(i))} for i in range(3)])}
    merged = tied.nn.merge(model)  # was refused: "cannot hold one adapter per member"
    layer = merged["s"].member["box"]["lin"]
    assert isinstance(layer, Dense) and layer.weight.shape == (4, 4)
    np.testing.assert_allclose(np.asarray(layer.weight), want, rtol=1e-6, atol=1e-6)
    assert box["lin"] is adapter  # the model given is unchanged


def test_stacked_adapters_on_a_transposed_tied_decoder_train_as_the_unrolled_loop():
    n = 4
    encs = [Dense(4, 4, key=jax.random.key(i)) for i in range(n)]
    # jnp.transpose reverses every axis, so on the stacked (n, 4, 4) source it would transpose
    # the layer axis: such a per-member view is refused when stacked, naming the place
    with pytest.raises(ValueError, match=r"\['dec'\]\.weight.*tied\.transpose"):
        tied.stack([{"enc": e, "dec": Dense(tied.view(e.weight, jnp.transpose), None)} for e in encs])
    members = [{"enc": e, "dec": Dense(tied.transpose(e.weight), None)} for e in encs]
    model = tied.nn.lora({"s": tied.stack(members)}, "['s'].member['dec']", 2, key=jax.random.key(9))
    bs = jax.random.normal(jax.random.key(2), (n, 4, 2))
    model = tied.replace(model, "['s'].member['dec'].lora_B", bs)
    a_s = model["s"].member["dec"].lora_A
    x = jax.random.normal(jax.random.key(3), (2, 4))

    def loss(m):
        y, _ = tied.scan(lambda y, b, _: (b["dec"](jnp.tanh(b["enc"](y))), None), x, m["s"])
        return (y**2).sum()

    def unrolled(a_s, b_s):  # the loop written by hand on the original arrays
        y = x
        for e, a, b in zip(encs, a_s, b_s):
            h = jnp.tanh(y @ e.weight.T + e.bias)
            y = h @ e.weight + (h @ a.T) @ b.T
        return (y**2).sum()

    np.testing.assert_allclose(float(loss(model)), float(unrolled(a_s, bs)), rtol=1e-5)  # eager: right
    value, g = tied.value_and_grad(loss, trainable=tied.nn.adapters)(model)
    ga, gb = jax.grad(unrolled, argnums=(0, 1))(a_s, bs)
    np.testing.assert_allclose(float(value), float(unrolled(a_s, bs)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g["s"].member["dec"].lora_A), np.asarray(ga), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g["s"].member["dec"].lora_B), np.asarray(gb), rtol=1e-4, atol=1e-6)


def test_merge_of_an_adapter_in_a_container_shared_at_two_places_inside_and_outside_a_stack():
    d, adapter, want = _one_adapter()
    box = {"lin": adapter}
    merged = tied.nn.merge({"a": box, "b": box})  # one slot of one container: merged once
    assert merged["a"] is merged["b"] and isinstance(merged["a"]["lin"], Dense)
    np.testing.assert_allclose(np.asarray(merged["b"]["lin"].weight), want, rtol=1e-6, atol=1e-6)
    boxes = [
        {"lin": LoRA(Dense(4, 4, key=jax.random.key(i)), 2, key=jax.random.key(5 + i))} for i in range(3)
    ]
    model = {"s": tied.stack([{"a": b, "b": b} for b in boxes])}
    merged = tied.nn.merge(model)
    layer = merged["s"].member["b"]["lin"]
    assert merged["s"].member["a"] is merged["s"].member["b"] and layer.weight.shape == (3, 4, 4)
    for i, b in enumerate(boxes):  # lora_B is zeros: the merged weight is the base's
        np.testing.assert_allclose(np.asarray(layer.weight[i]), np.asarray(b["lin"].base.weight), atol=1e-7)
