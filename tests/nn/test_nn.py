"""tied.nn layers against hand-written references in plain numpy / jnp."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied
from tied.nn import MLP, CausalSelfAttention, Chain, Dense, Embedding, LayerNorm, TransformerBlock

KEY = jax.random.key(0)


def keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def np_gelu(x):
    # the tanh approximation, which is jax.nn.gelu's default
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_layernorm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_attention(x, wqkv, bqkv, wo, bo, heads):
    """Causal self-attention written out per batch element, head and position."""
    batch, seq, dim = x.shape
    hd = dim // heads
    qkv = x @ wqkv.T + bqkv
    q, k, v = qkv[..., :dim], qkv[..., dim : 2 * dim], qkv[..., 2 * dim :]
    out = np.zeros_like(x)
    for b in range(batch):
        for h in range(heads):
            sl = slice(h * hd, (h + 1) * hd)
            for t in range(seq):
                s = np.array([q[b, t, sl] @ k[b, u, sl] for u in range(t + 1)]) / np.sqrt(hd)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, sl] = sum(p[u] * v[b, u, sl] for u in range(t + 1))
    return out @ wo.T + bo


def np_(x):
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------- Dense


def test_dense_from_sizes_shapes_init_and_output():
    d = Dense(3, 5, key=KEY)
    assert d.weight.shape == (5, 3) and d.bias.shape == (5,)
    assert (d.in_size, d.out_size) == (3, 5)
    lim = 1 / np.sqrt(3)
    assert np.all(np.abs(np_(d.weight)) <= lim) and np.all(np.abs(np_(d.bias)) <= lim)
    x = jax.random.normal(keys(2)[1], (4, 3))
    np.testing.assert_allclose(d(x), np_(x) @ np_(d.weight).T + np_(d.bias), rtol=1e-5)
    # a single example (no batch axis) works the same way
    np.testing.assert_allclose(d(x[0]), d(x)[0], rtol=1e-6)


def test_dense_activation_and_no_bias():
    d = Dense(3, 2, key=KEY, activation=jnp.tanh, use_bias=False)
    assert d.bias is None
    x = jnp.arange(6.0).reshape(2, 3) / 6
    np.testing.assert_allclose(d(x), np.tanh(np_(x) @ np_(d.weight).T), rtol=1e-5)


def test_dense_from_arrays_is_tied_by_reference_seed():
    """The seed: Chain(d1, Dense(d1.weight, d1.bias)); total = sum of per-place partials."""
    d1 = Dense(jax.random.normal(KEY, (2, 2)), jnp.zeros(2))
    d2 = Dense(d1.weight, d1.bias)
    assert d2.weight is d1.weight and d2.bias is d1.bias
    c = Chain(d1, d2)
    x = jnp.array([[0.3, -0.7]])
    g = tied.grad(lambda m: m(x).sum())(c)
    assert g.layers[0].weight is g.layers[1].weight
    assert g.layers[0].bias is g.layers[1].bias

    def untied(w1, b1, w2, b2):
        return ((x @ w1.T + b1) @ w2.T + b2).sum()

    parts = jax.grad(untied, argnums=(0, 1, 2, 3))(d1.weight, d1.bias, d1.weight, d1.bias)
    np.testing.assert_allclose(g.layers[0].weight, parts[0] + parts[2], rtol=1e-6)
    np.testing.assert_allclose(g.layers[0].bias, parts[1] + parts[3], rtol=1e-6)
    assert g.layers[0].activation is None  # a static field gets None


def test_dense_errors():
    with pytest.raises(TypeError, match=r"needs an explicit key"):
        Dense(2, 3)
    with pytest.raises(TypeError, match=r"key is only used by Dense\(in_size, out_size"):
        Dense(jnp.ones((2, 2)), key=KEY)
    with pytest.raises(ValueError, match=r"weight must have shape \(out, in\), got shape \(3,\)"):
        Dense(jnp.ones(3))
    with pytest.raises(ValueError, match=r"bias must have shape \(out,\) = \(2,\), got \(3,\)"):
        Dense(jnp.ones((2, 4)), jnp.ones(3))
    with pytest.raises(TypeError, match=r"Dense takes \(in_size, out_size, key=...\)"):
        Dense("wide", 3)
    with pytest.raises(TypeError, match=r"activation must be callable"):
        Dense(2, 2, key=KEY, activation="relu")


def test_dense_reads_a_view_eagerly():
    w = jax.random.normal(KEY, (4, 3))
    dec = Dense(tied.transpose(w))
    assert (dec.in_size, dec.out_size) == (4, 3)
    x = jnp.ones((2, 4))
    np.testing.assert_allclose(dec(x), np_(x) @ np_(w), rtol=1e-5)


# ---------------------------------------------------------------- Chain


def test_chain_holds_a_list_and_functions_are_static():
    a, b = Dense(3, 4, key=keys(2)[0]), Dense(4, 2, key=keys(2)[1])
    c = Chain(a, jnp.tanh, b)
    assert isinstance(c.layers, list) and c[1] is jnp.tanh and len(c) == 3
    leaves, gdef = tied.flatten(c)
    assert len(leaves) == 4 and jnp.tanh in gdef.statics
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)
    ref = np.tanh(np_(x) @ np_(a.weight).T + np_(a.bias)) @ np_(b.weight).T + np_(b.bias)
    np.testing.assert_allclose(c(x), ref, rtol=1e-5)
    g = tied.grad(lambda m: m(x).sum())(c)
    assert g.layers[1] is None
    assert "tanh" in repr(c)


def test_chain_with_one_layer_at_three_places():
    d = Dense(3, 3, key=KEY, activation=jnp.tanh)
    c = Chain(d, d, d)
    assert tied.ties(c)[0] == (".layers[0]", ".layers[1]", ".layers[2]")
    x = jnp.ones((2, 3)) * 0.5

    def untied(ws, bs):
        h = x
        for w, b in zip(ws, bs):
            h = jnp.tanh(h @ w.T + b)
        return (h**2).sum()

    gw, gb = jax.grad(untied, argnums=(0, 1))([d.weight] * 3, [d.bias] * 3)
    g = tied.grad(lambda m: (m(x) ** 2).sum())(c)
    assert g.layers[0] is g.layers[1] is g.layers[2]
    np.testing.assert_allclose(g.layers[0].weight, sum(gw), rtol=1e-5)
    np.testing.assert_allclose(g.layers[0].bias, sum(gb), rtol=1e-5)


def test_chain_rejects_non_callables():
    with pytest.raises(TypeError, match=r"layer \[1\] is a int, which is not callable"):
        Chain(jnp.tanh, 3)


# ---------------------------------------------------------------- Equinox interop


def test_chain_holding_equinox_linear_reused():
    """A Chain may hold an eqx.nn.Linear; reusing it is one parameter with aliased grads."""
    lin = eqx.nn.Linear(3, 3, key=keys(2)[0])
    d = Dense(3, 3, key=keys(2)[1])
    c = Chain(lin, jnp.tanh, d, lin)
    x = jnp.array([0.2, -0.4, 0.9])  # eqx.nn.Linear takes one example
    ref_out = lin(np_(d(jnp.tanh(lin(x)))))
    np.testing.assert_allclose(c(x), ref_out, rtol=1e-5)
    leaves, _ = tied.flatten(c)
    assert len(leaves) == 4

    def untied(w1, b1, w2, b2):
        h = jnp.tanh(w1 @ x + b1)
        return (w2 @ d(h) + b2).sum()

    parts = jax.grad(untied, argnums=(0, 1, 2, 3))(lin.weight, lin.bias, lin.weight, lin.bias)
    g = tied.grad(lambda m: m(x).sum())(c)
    assert g.layers[0] is g.layers[3] and isinstance(g.layers[0], eqx.nn.Linear)
    np.testing.assert_allclose(g.layers[0].weight, parts[0] + parts[2], rtol=1e-5)
    np.testing.assert_allclose(g.layers[0].bias, parts[1] + parts[3], rtol=1e-5)


# ---------------------------------------------------------------- Embedding


def test_embedding_lookup_attend_and_tied_head_gradient():
    emb = Embedding(7, 4, key=KEY)
    assert emb.weight.shape == (7, 4)
    assert 0.2 < float(jnp.std(Embedding(1000, 16, key=KEY).weight)) < 0.3  # 1/sqrt(16)
    ids = jnp.array([[1, 3, 3], [6, 0, 2]])
    w = np_(emb.weight)
    np.testing.assert_allclose(emb(ids), w[np.asarray(ids)], rtol=1e-6)
    h = jax.random.normal(keys(2)[1], (2, 3, 4))
    np.testing.assert_allclose(emb.attend(h), np_(h) @ w.T, rtol=1e-5)

    # a tied output head: the same array read by the lookup and by the head
    head = Dense(emb.weight)
    model = Chain(emb, jnp.tanh, head)
    assert head.weight is emb.weight
    assert tied.ties(model) == [(".layers[0].weight", ".layers[2].weight")]
    targets = jnp.array([[3, 3, 1], [0, 2, 5]])

    def xent(logits):
        lp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(lp, targets[..., None], -1).mean()

    def untied(w_in, w_out):
        return xent(jnp.tanh(w_in[ids]) @ w_out.T)

    gi, go = jax.grad(untied, argnums=(0, 1))(emb.weight, emb.weight)
    g = tied.grad(lambda m: xent(m(ids)))(model)
    assert g.layers[0].weight is g.layers[2].weight
    np.testing.assert_allclose(g.layers[0].weight, gi + go, rtol=1e-5, atol=1e-7)


def test_embedding_errors():
    with pytest.raises(TypeError, match=r"Embedding\(vocab, dim, key=...\) needs"):
        Embedding(10, 4)
    with pytest.raises(TypeError, match=r"weight must have shape \(vocab, dim\)"):
        Embedding(jnp.ones(3))


# ---------------------------------------------------------------- LayerNorm, MLP


def test_layernorm_against_reference():
    ln = LayerNorm(5)
    assert np.all(np_(ln.weight) == 1) and np.all(np_(ln.bias) == 0)
    ln.weight = jnp.arange(1.0, 6.0)
    ln.bias = -jnp.arange(5.0)
    x = jax.random.normal(KEY, (2, 3, 5)) * 3 + 1
    np.testing.assert_allclose(
        ln(x), np_layernorm(np_(x), np_(ln.weight), np_(ln.bias)), rtol=1e-4, atol=1e-5
    )
    bare = LayerNorm(5, use_weight=False, use_bias=False)
    assert len(tied.flatten(bare)[0]) == 0
    np.testing.assert_allclose(bare(x), np_layernorm(np_(x), 1.0, 0.0), rtol=1e-4, atol=1e-5)


def test_mlp_against_reference():
    mlp = MLP(4, 8, key=KEY)
    x = jax.random.normal(keys(2)[1], (3, 4))
    h = np_gelu(np_(x) @ np_(mlp.fc1.weight).T + np_(mlp.fc1.bias))
    ref = h @ np_(mlp.fc2.weight).T + np_(mlp.fc2.bias)
    np.testing.assert_allclose(mlp(x), ref, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- attention, transformer


def test_causal_attention_against_loop_reference():
    attn = CausalSelfAttention(8, 2, key=KEY)
    x = jax.random.normal(keys(2)[1], (2, 5, 8))
    ref = np_attention(
        np_(x),
        np_(attn.qkv.weight),
        np_(attn.qkv.bias),
        np_(attn.proj.weight),
        np_(attn.proj.bias),
        2,
    )
    np.testing.assert_allclose(attn(x), ref, rtol=1e-4, atol=1e-5)
    # causal: changing the last position changes nothing before it
    y = attn(x.at[:, -1].set(100.0))
    np.testing.assert_allclose(y[:, :-1], attn(x)[:, :-1], rtol=1e-5, atol=1e-6)
    # unbatched input
    np.testing.assert_allclose(attn(x[0]), attn(x)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"dim=6 is not a multiple of num_heads=4"):
        CausalSelfAttention(6, 4, key=KEY)


def test_transformer_block_against_reference():
    blk = TransformerBlock(8, 2, key=KEY, hidden=16)
    x = jax.random.normal(keys(2)[1], (2, 4, 8))
    a = blk.attn
    xn = np_(x)
    h = xn + np_attention(
        np_layernorm(xn, 1.0, 0.0),
        np_(a.qkv.weight),
        np_(a.qkv.bias),
        np_(a.proj.weight),
        np_(a.proj.bias),
        2,
    )
    m = blk.mlp
    inner = np_gelu(np_layernorm(h, 1.0, 0.0) @ np_(m.fc1.weight).T + np_(m.fc1.bias))
    ref = h + inner @ np_(m.fc2.weight).T + np_(m.fc2.bias)
    np.testing.assert_allclose(blk(x), ref, rtol=1e-4, atol=1e-5)
    assert blk.mlp.fc1.weight.shape == (16, 8)


def test_albert_one_block_six_places_gradient_is_the_sum():
    blk = TransformerBlock(8, 2, key=KEY, hidden=8)
    model = Chain(*[blk] * 6)
    assert len(tied.flatten(model)[0]) == len(tied.flatten(blk)[0]) == 12
    x = jax.random.normal(keys(2)[1], (1, 3, 8))
    loss = lambda m: (m(x) ** 2).mean()
    g = tied.grad(loss)(model)
    assert all(g.layers[i] is g.layers[0] for i in range(6))
    p = tied.grad(loss, per_location=True)(model)
    assert p.layers[0] is not p.layers[1]
    total = sum(p.layers[i].attn.qkv.weight for i in range(6))
    np.testing.assert_allclose(g.layers[0].attn.qkv.weight, total, rtol=1e-4, atol=1e-6)


def test_layers_under_tied_jit_keep_the_tie():
    emb = Embedding(5, 4, key=KEY)
    model = Chain(emb, LayerNorm(4), Dense(emb.weight))
    ids = jnp.array([[0, 1, 4]])
    out = tied.jit(lambda m: m)(model)
    assert out.layers[2].weight is out.layers[0].weight
    np.testing.assert_allclose(tied.jit(lambda m, i: m(i))(model, ids), model(ids), rtol=1e-5)
