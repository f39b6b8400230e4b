"""tied.nn.LoRA, lora, adapters and merge, against numpy by hand, peft's own init, plain jax.grad
on unrolled members and optax stepped by hand."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied.nn import Dense, Embedding, LayerNorm, LoRA, TransformerBlock


def leaves_equal(a, b):
    la, ga = tied.flatten(a)
    lb, gb = tied.flatten(b)
    assert ga == gb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dense_lora_output_is_base_plus_scaled_low_rank_by_numpy():
    d = Dense(5, 3, key=jax.random.key(0))
    a = LoRA(d, 2, alpha=6, key=jax.random.key(1))
    a.lora_B = jax.random.normal(jax.random.key(2), (3, 2))
    x = np.asarray(jax.random.normal(jax.random.key(3), (4, 5)))
    w, b = np.asarray(d.weight), np.asarray(d.bias)
    la, lb = np.asarray(a.lora_A), np.asarray(a.lora_B)
    want = x @ w.T + b + (6 / 2) * (x @ la.T) @ lb.T
    np.testing.assert_allclose(np.asarray(a(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
    assert a.base is d and a.lora_A.shape == (2, 5) and a.lora_B.shape == (3, 2)


def test_a_dense_with_activation_gets_the_adapter_before_the_activation():
    d = Dense(4, 4, key=jax.random.key(0), activation=jnp.tanh)
    a = LoRA(d, 1, key=jax.random.key(1))
    a.lora_B = jnp.ones((4, 1))
    x = np.ones((2, 4), np.float32)
    pre = x @ np.asarray(d.weight).T + np.asarray(d.bias) + (x @ np.asarray(a.lora_A).T) @ np.ones((1, 4))
    np.testing.assert_allclose(np.asarray(a(jnp.asarray(x))), np.tanh(pre), rtol=1e-5, atol=1e-6)


def test_init_as_peft_lora_a_kaiming_uniform_and_lora_b_zeros():
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    n_in, n_out, r = 256, 64, 8
    net = torch.nn.Sequential(torch.nn.Linear(n_in, n_out))
    theirs = peft.get_peft_model(net, peft.LoraConfig(r=r, target_modules=["0"]))
    their_a = next(p for n, p in theirs.named_parameters() if "lora_A" in n).detach().numpy()
    ours = LoRA(Dense(n_in, n_out, key=jax.random.key(0)), r, key=jax.random.key(1))
    bound = 1 / math.sqrt(n_in)  # kaiming_uniform(a=sqrt(5))
    assert ours.lora_A.shape == their_a.shape
    for a in (np.asarray(ours.lora_A), their_a):
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound
        assert abs(a.std() - bound / math.sqrt(3)) < 0.05 * bound  # a uniform's std
    np.testing.assert_array_equal(np.asarray(ours.lora_B), np.zeros((n_out, r)))


def test_a_head_adapter_adapts_attend_and_the_embedding_keeps_the_bare_lookup():
    emb = Embedding(10, 4, key=jax.random.key(0))
    model = {"embed": emb, "head": emb}
    adapted = tied.nn.lora(model, "['head']", 2, key=jax.random.key(1))
    assert model["head"] is emb and model["embed"] is emb  # not changed
    assert type(adapted["embed"]) is Embedding and adapted["head"].base is adapted["embed"]
    assert adapted["embed"].weight is emb.weight
    adapted["head"].lora_B = jnp.ones((10, 2))
    h = np.ones((3, 4), np.float32)
    w, la = np.asarray(emb.weight), np.asarray(adapted["head"].lora_A)
    want = h @ w.T + (h @ la.T) @ np.ones((2, 10))
    np.testing.assert_allclose(np.asarray(adapted["head"].attend(jnp.asarray(h))), want, rtol=1e-5)
    ids = jnp.array([1, 2])
    np.testing.assert_array_equal(np.asarray(adapted["embed"](ids)), w[[1, 2]])
    with pytest.raises(TypeError, match=r"adapts its head use \(\.attend\) and was called as a lookup"):
        adapted["head"](ids)


def test_a_shared_dense_gets_the_adapter_at_the_selected_place_only():
    d = Dense(3, 3, key=jax.random.key(0))
    model = tied.nn.Chain(d, jnp.tanh, d)
    adapted = tied.nn.lora(model, ".layers[2]", 1, key=jax.random.key(1))
    assert type(adapted.layers[0]) is Dense and type(adapted.layers[2]) is LoRA
    assert adapted.layers[2].base is adapted.layers[0]  # one object
    assert tied.ties(adapted) == [(".layers[0]", ".layers[2].base")]


def test_a_place_inside_a_shared_container_is_one_place():
    blk = {"qkv": Dense(3, 3, key=jax.random.key(0))}
    model = [blk, blk]
    adapted = tied.nn.lora(model, ["[0]['qkv']", "[1]['qkv']"], 1, key=jax.random.key(1))
    assert adapted[0] is adapted[1] and type(adapted[0]["qkv"]) is LoRA
    assert type(adapted[0]["qkv"].base) is Dense


def test_a_predicate_selects_layer_places():
    model = TransformerBlock(8, 2, key=jax.random.key(0))
    adapted = tied.nn.lora(model, lambda p, layer: ".attn." in p, 2, key=jax.random.key(1))
    assert type(adapted.attn.qkv) is LoRA and type(adapted.attn.proj) is LoRA
    assert type(adapted.mlp.fc1) is Dense
    # the k-th selected place draws with fold_in(key, k)
    want = LoRA(model.attn.proj, 2, key=jax.random.fold_in(jax.random.key(1), 1)).lora_A
    np.testing.assert_array_equal(np.asarray(adapted.attn.proj.lora_A), np.asarray(want))


def _blocks_model(n=6, dim=8):
    keys = jax.random.split(jax.random.key(0), n)
    return {"blocks": tied.stack([TransformerBlock(dim, 2, key=k) for k in keys]), "norm": LayerNorm(dim)}


def _run(model, x):
    y, _ = tied.scan(lambda c, layer, _: (layer(c), None), x, model["blocks"])
    return model["norm"](y)


def test_lora_under_a_stack_equals_unstack_wrap_each_restack_values_and_gradients():
    model = _blocks_model()
    key = jax.random.key(1)
    adapted = tied.nn.lora(model, "['blocks'].member.attn.qkv", 2, alpha=4, key=key)
    assert adapted["blocks"].member.attn.qkv.lora_A.shape == (6, 2, 8)
    assert adapted["norm"] is not model["norm"] and model["blocks"].member.attn.qkv.__class__ is Dense
    # the reference: unstack, wrap each member by hand, restack
    members = tied.unstack(model["blocks"])
    keys = jax.random.split(jax.random.fold_in(key, 0), 6)
    for m, k in zip(members, keys):
        m.attn.qkv = LoRA(m.attn.qkv, 2, alpha=4, key=k)
    ref = {"blocks": tied.stack(members), "norm": model["norm"]}
    leaves_equal(adapted, ref)
    # gradients, with lora_B away from zero, against plain jax.grad on the unrolled members
    bs = jax.random.normal(jax.random.key(5), (6, 24, 2))
    adapted = tied.replace(adapted, "['blocks'].member.attn.qkv.lora_B", bs)
    x = jax.random.normal(jax.random.key(6), (1, 3, 8))
    g = tied.grad(lambda m: _run(m, x).sum(), trainable=tied.nn.adapters)(adapted)

    def unrolled(a_s, b_s):
        y = x
        for i, m in enumerate(members):
            layer = LoRA(m.attn.qkv.base, 2, alpha=4, key=keys[i])
            layer.lora_A, layer.lora_B = a_s[i], b_s[i]
            m.attn.qkv = layer
            y = m(y)
        return model["norm"](y).sum()

    a_s = adapted["blocks"].member.attn.qkv.lora_A
    ga, gb = jax.grad(unrolled, argnums=(0, 1))(a_s, bs)
    got = g["blocks"].member.attn.qkv
    np.testing.assert_allclose(np.asarray(got.lora_A), np.asarray(ga), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.lora_B), np.asarray(gb), rtol=1e-5, atol=1e-6)
    assert g["blocks"].member.attn.qkv.base.weight is None  # no gradient for the frozen base


def test_merge_under_a_stack_folds_each_members_adapter():
    model = _blocks_model(n=3)
    adapted = tied.nn.lora(model, "['blocks'].member.attn.qkv", 2, key=jax.random.key(1))
    bs = jax.random.normal(jax.random.key(5), (3, 24, 2))
    adapted = tied.replace(adapted, "['blocks'].member.attn.qkv.lora_B", bs)
    merged = tied.nn.merge(adapted)
    qkv = adapted["blocks"].member.attn.qkv
    want = np.asarray(qkv.base.weight) + np.einsum("nor,nri->noi", np.asarray(bs), np.asarray(qkv.lora_A))
    np.testing.assert_allclose(
        np.asarray(merged["blocks"].member.attn.qkv.weight), want, rtol=1e-5, atol=1e-6
    )
    x = jax.random.normal(jax.random.key(6), (1, 3, 8))
    np.testing.assert_allclose(np.asarray(_run(merged, x)), np.asarray(_run(adapted, x)), atol=1e-5)


def test_adapters_trains_the_adapters_only_gradient_and_optimiser_bytes():
    model = _blocks_model(n=2)
    adapted = tied.nn.lora(model, lambda p, layer: p.endswith((".qkv", ".proj")), 2, key=jax.random.key(1))
    adapter_leaves = [x for p, x in _named(adapted) if p.endswith((".lora_A", ".lora_B"))]
    adapter_bytes = sum(x.nbytes for x in adapter_leaves)
    x = jnp.ones((1, 3, 8))
    g = tied.grad(lambda m: _run(m, x).sum(), trainable=tied.nn.adapters)(adapted)
    g_leaves = [a for a in jax.tree_util.tree_leaves(tied.flatten(g)[0]) if a is not None]
    assert len(g_leaves) == len(adapter_leaves) == 4
    assert sum(a.nbytes for a in g_leaves) == adapter_bytes
    state = tied.optim.setup(optax.adam(1e-3), adapted, trainable=tied.nn.adapters)
    state_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(state.inner_state) if hasattr(a, "nbytes"))
    assert state_bytes == 2 * adapter_bytes + 4  # mu, nu and Adam's int32 count
    assert tied.param_count(adapted, trainable=tied.nn.adapters) == sum(x.size for x in adapter_leaves)


def _named(model):
    leaves, gdef = tied.flatten(model)
    return [(paths[0], leaves[i]) for i, paths in enumerate(gdef.leaf_paths())]


def test_merge_unties_the_merged_place_only_and_keeps_the_other_bit_for_bit():
    d = Dense(4, 3, key=jax.random.key(0))
    model = {"a": d, "b": d}
    adapted = tied.nn.lora(model, "['a']", 2, alpha=3, key=jax.random.key(1))
    adapted["a"].lora_B = jax.random.normal(jax.random.key(2), (3, 2))
    merged = tied.nn.merge(adapted)
    assert merged["b"].weight is d.weight and merged["b"].bias is d.bias
    la, lb = np.asarray(adapted["a"].lora_A), np.asarray(adapted["a"].lora_B)
    np.testing.assert_allclose(
        np.asarray(merged["a"].weight), np.asarray(d.weight) + 1.5 * lb @ la, rtol=1e-6, atol=1e-6
    )
    assert tied.ties(merged) == [("['a'].bias", "['b'].bias")]  # the weight's tie cut, the bias kept
    x = jnp.ones((2, 4))
    np.testing.assert_allclose(np.asarray(merged["a"](x)), np.asarray(adapted["a"](x)), atol=1e-5)


def test_merging_a_model_without_adapters_returns_it_unchanged():
    model = {"a": Dense(2, 2, key=jax.random.key(0))}
    assert tied.nn.merge(model) is model


def test_merge_of_a_head_adapter_leaves_the_embedding_bit_for_bit():
    emb = Embedding(10, 4, key=jax.random.key(0))
    adapted = tied.nn.lora({"embed": emb, "head": emb}, "['head']", 2, key=jax.random.key(1))
    adapted["head"].lora_B = jnp.ones((10, 2))
    merged = tied.nn.merge(adapted)
    assert merged["embed"].weight is emb.weight and type(merged["head"]) is Embedding
    h = jnp.ones((1, 4))
    np.testing.assert_allclose(
        np.asarray(merged["head"].attend(h)), np.asarray(adapted["head"].attend(h)), atol=1e-5
    )


@pytest.mark.parametrize(
    "where, rank, error, match",
    [
        (
            ".layers[1]",
            1,
            ValueError,
            r"\.layers\[1\] holds a tied\.nn\._norm\.LayerNorm, which LoRA cannot adapt",
        ),
        (
            ".layers[0]",
            0,
            ValueError,
            r"rank must be an int from 1 to min\(in, out\) = 3 for the Dense at \.layers\[0\]",
        ),
        (".layers[0]", 4, ValueError, r"rank must be .* = 3 .* got 4"),
        (lambda p, layer: False, 1, ValueError, r"selects no place"),
        (".layers[0].weight", 1, ValueError, r"\.layers\[0\]\.weight holds a jax"),
        (".layerz[0]", 1, tied.PathError, r"'\.layerz\[0\]' is not a place"),
    ],
)
def test_bad_input_names_the_place_and_changes_nothing(where, rank, error, match):
    d = Dense(5, 3, key=jax.random.key(0))
    model = tied.nn.Chain(d, LayerNorm(3))
    before = tied.flatten(model)
    with pytest.raises(error, match=match):
        tied.nn.lora(model, where, rank, key=jax.random.key(1))
    after = tied.flatten(model)
    assert after[1] == before[1] and all(a is b for a, b in zip(after[0], before[0]))
    assert model.layers[0] is d


def test_a_place_inside_a_lora_and_another_layer_are_refused():
    d = Dense(3, 3, key=jax.random.key(0))
    adapted = tied.nn.lora({"a": d}, "['a']", 1, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"\['a'\]\.base lies inside the LoRA at \['a'\]"):
        tied.nn.lora(adapted, "['a'].base", 1, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"LoRA cannot adapt"):
        LoRA(LayerNorm(3), 1, key=jax.random.key(0))


def test_a_layer_in_a_container_broadcast_across_a_stack_is_refused_and_nothing_changes():
    attn = {"qkv": Dense(4, 4, key=jax.random.key(0))}
    members = [{"attn": attn, "w": jnp.full(4, float(i))} for i in range(3)]
    model = {"blocks": tied.stack(members)}
    before = tied.flatten(model)
    with pytest.raises(
        ValueError, match=r"\['blocks'\]\.member\['attn'\]\['qkv'\] lies in an object that is one"
    ):
        tied.nn.lora(model, "['blocks'].member['attn']['qkv']", 1, key=jax.random.key(1))
    after = tied.flatten(model)
    assert after[1] == before[1] and all(a is b for a, b in zip(after[0], before[0]))
    assert type(model["blocks"].member["attn"]["qkv"]) is Dense


def test_a_base_read_through_a_view_of_an_integer_table_is_called_as_it_is_and_never_trained():
    # A stand-in for a quantized base (tied.nn.quantize): an int8 table read through a view.
    q = jnp.asarray(np.arange(-6, 6, dtype=np.int8).reshape(3, 4))
    base = Dense(tied.view(q, lambda t: t.astype(jnp.float32) * 0.1))
    model = {"a": tied.nn.lora({"d": base}, "['d']", 2, key=jax.random.key(0))["d"]}
    assert model["a"].lora_A.dtype == jnp.float32
    x = jnp.ones((2, 4))
    tx = optax.adam(1e-1)
    state = tied.optim.setup(tx, model, trainable=tied.nn.adapters)
    for _ in range(3):
        g = tied.grad(lambda m: (m["a"](x) ** 2).sum(), trainable=tied.nn.adapters)(model)
        model, state = tied.optim.update(state, model, g)
    assert model["a"].base.weight.source is q  # the integer table, untouched
    assert np.abs(np.asarray(model["a"].lora_B)).max() > 0
    want = x @ (np.asarray(q, np.float32) * 0.1).T
    a, b = np.asarray(model["a"].lora_A), np.asarray(model["a"].lora_B)
    np.testing.assert_allclose(np.asarray(model["a"](x)), want + (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)


def test_a_base_broadcast_across_a_stack_and_held_outside_gets_one_adapter_per_member():
    d = Dense(4, 4, key=jax.random.key(0))
    model = {"s": tied.stack([{"lin": d, "w": jnp.full(4, float(i))} for i in range(3)]), "out": d}
    adapted = tied.nn.lora(model, "['s'].member['lin']", 2, key=jax.random.key(1))
    assert adapted["s"].member["lin"].base is adapted["out"]  # broadcast, and the outside place's own
    bs = jax.random.normal(jax.random.key(2), (3, 4, 2))
    adapted = tied.replace(adapted, "['s'].member['lin'].lora_B", bs)
    merged = tied.nn.merge(adapted)
    assert merged["out"].weight is d.weight  # the place without adapter, bit for bit
    assert tied.ties(merged) == [("['out'].bias", "['s'].member['lin'].bias")]
    a = np.asarray(adapted["s"].member["lin"].lora_A)
    want = np.asarray(d.weight) + np.einsum("nor,nri->noi", np.asarray(bs), a)
    np.testing.assert_allclose(np.asarray(merged["s"].member["lin"].weight), want, rtol=1e-5, atol=1e-6)


def test_a_rank_too_large_for_a_stacked_layer_names_its_place_in_the_model():
    model = _blocks_model(n=2)
    with pytest.raises(
        ValueError, match=r"min\(in, out\) = 8 for the Dense at \['blocks'\]\.member\.attn\.qkv"
    ):
        tied.nn.lora(model, "['blocks'].member.attn.qkv", 9, key=jax.random.key(1))
