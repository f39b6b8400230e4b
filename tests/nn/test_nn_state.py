"""tied.nn's stateful layers (BatchNorm, Dropout, KVCache), Conv2d, RMSNorm and nn.mode,
each against an independent reference: numpy, plain jax.lax, PyTorch, Flax NNX."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from processes import pytest_on_fake_devices

import tied
from tied.nn import (
    BatchNorm,
    CausalSelfAttention,
    Chain,
    Conv2d,
    Dense,
    Dropout,
    Embedding,
    KVCache,
    LayerNorm,
    RMSNorm,
    TransformerBlock,
    mode,
)

ROOT = Path(__file__).resolve().parents[2]
MOM, EPS = 0.1, 1e-5


def np_(x):
    return np.asarray(x, dtype=np.float64)


def batches(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(loc=1.5, scale=2.0, size=shape).astype(np.float32) for _ in range(n)]


def np_bn_replay(xs, momentum=MOM):
    """Running statistics of PyTorch's convention, replayed in float64 numpy."""
    mean, var = np.zeros(xs[0].shape[-1]), np.ones(xs[0].shape[-1])
    for x in xs:
        flat = np_(x).reshape(-1, x.shape[-1])
        n = flat.shape[0]
        mean = (1 - momentum) * mean + momentum * flat.mean(0)
        var = (1 - momentum) * var + momentum * flat.var(0) * n / (n - 1)
    return mean, var


# ---------------------------------------------------------------- BatchNorm


def test_batchnorm_train_output_and_running_stats_against_numpy():
    bn = BatchNorm(3)
    xs = batches(3, (4, 5, 5, 3))
    for x in xs:
        y = bn(jnp.asarray(x))
        flat = np_(x).reshape(-1, 3)
        ref = (np_(x) - flat.mean(0)) / np.sqrt(flat.var(0) + EPS)  # biased variance
        np.testing.assert_allclose(np_(y), ref, atol=1e-5)
    mean, var = np_bn_replay(xs)
    np.testing.assert_allclose(np_(bn.running_mean.value), mean, atol=1e-5)
    np.testing.assert_allclose(np_(bn.running_var.value), var, atol=1e-5)
    assert int(bn.num_batches_tracked.value) == 3
    assert bn.num_batches_tracked.value.dtype == jnp.int32


def test_batchnorm_running_stats_match_pytorch_batchnorm2d():
    torch = pytest.importorskip("torch")
    xs = batches(4, (6, 4, 4, 5), seed=1)
    bn = BatchNorm(5, momentum=0.2, eps=1e-3)
    bn.weight = jnp.linspace(0.5, 1.5, 5)
    bn.bias = jnp.linspace(-1.0, 1.0, 5)
    tb = torch.nn.BatchNorm2d(5, momentum=0.2, eps=1e-3)
    with torch.no_grad():
        tb.weight.copy_(torch.tensor(np.asarray(bn.weight)))
        tb.bias.copy_(torch.tensor(np.asarray(bn.bias)))
    tb.train()
    for x in xs:
        y = bn(jnp.asarray(x))
        ty = tb(torch.tensor(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).detach().numpy()
        np.testing.assert_allclose(np.asarray(y), ty, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.running_mean.value), tb.running_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.running_var.value), tb.running_var.numpy(), atol=1e-5)
    assert int(bn.num_batches_tracked.value) == int(tb.num_batches_tracked) == 4
    # eval mode: the running statistics, nothing changes
    tb.eval()
    ev = mode(bn, False)
    before = [np.asarray(s.value) for s in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    x = xs[0] * 3.0
    ty = tb(torch.tensor(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).detach().numpy()
    np.testing.assert_allclose(np.asarray(ev(jnp.asarray(x))), ty, atol=1e-5)
    after = [np.asarray(s.value) for s in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    assert all((a == b).all() for a, b in zip(before, after))


def test_batchnorm_shared_at_two_places_updates_twice_in_call_order_under_jit():
    bn = BatchNorm(2)
    scale = Dense(jnp.diag(jnp.array([2.0, -1.0])), jnp.array([1.0, 0.5]))
    model = Chain(bn, scale, bn)  # one BatchNorm, two places
    x = batches(1, (8, 2), seed=2)[0]

    @tied.jit
    def forward(m, x):
        return m, m(x)

    new, y = forward(model, jnp.asarray(x))
    # reference: two sequential updates, the second on the first's output through `scale`
    flat = np_(x)
    h = (flat - flat.mean(0)) / np.sqrt(flat.var(0) + EPS) @ np.diag([2.0, -1.0]) + [1.0, 0.5]
    mean, var = np_bn_replay([flat, h])
    assert new.layers[0] is new.layers[2]  # one object afterwards
    rm = new.layers[0].running_mean.value
    np.testing.assert_allclose(np_(rm), mean, atol=1e-5)
    np.testing.assert_allclose(np_(new.layers[0].running_var.value), var, atol=1e-5)
    assert int(new.layers[0].num_batches_tracked.value) == 2
    ref_y = (h - h.mean(0)) / np.sqrt(h.var(0) + EPS)
    np.testing.assert_allclose(np_(y), ref_y, atol=1e-5)


def test_batchnorm_state_is_never_a_parameter():
    bn = BatchNorm(3)
    model = Chain(Dense(3, 3, key=jax.random.key(0)), bn)
    assert tied.param_count(model) == 12 + 6
    g = tied.grad(lambda m, x: (m(x) ** 2).sum())(model, jnp.ones((4, 3)) * jnp.arange(4.0)[:, None])
    assert g.layers[1].running_mean.value is None and g.layers[1].num_batches_tracked.value is None
    assert repr(g.layers[1]).startswith("BatchNorm(\n  weight=f32[3],")  # a gradient tree shows too
    assert g.layers[1].weight is not None
    state = tied.optim.setup(optax.adam(1e-2), model)
    assert not any("running" in p or "num_batches" in p for p in state.paths)


def test_batchnorm_errors():
    with pytest.raises(ValueError, match=r"last axis \(features\) has size 4, expected 3.*features last"):
        BatchNorm(3)(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"more than one value per feature.*mode\(model, False\)"):
        BatchNorm(3)(jnp.ones((1, 3)))
    with pytest.raises(TypeError, match="num_features must be a positive int"):
        BatchNorm(0)
    assert mode(BatchNorm(3), False)(jnp.ones((1, 3))).shape == (1, 3)  # eval mode takes one value


# ---------------------------------------------------------------- Dropout and Rng


def test_one_rng_shared_by_two_dropouts_draws_keys_0_1_then_2_3_one_compile():
    key = jax.random.key(7)
    rng = tied.Rng(key)
    model = Chain(Dropout(0.3, rng), Dropout(0.3, rng))
    x = jnp.arange(1.0, 201.0)
    traces = []

    @tied.jit
    def forward(m, x):
        traces.append(1)
        a = m.layers[0](x)
        return m, a, m.layers[1](a)

    def expected(a, k):
        keep = jax.random.bernoulli(jax.random.fold_in(key, k), 0.7, x.shape)
        return np.where(np.asarray(keep), np.asarray(a) / 0.7, 0.0)

    for call in range(5):
        model, a, b = forward(model, x)
        ea = expected(x, 2 * call)
        np.testing.assert_allclose(np.asarray(a), ea, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(b), expected(ea, 2 * call + 1), rtol=1e-6)
        assert int(model.layers[0].rng.count.value) == 2 * call + 2
        assert model.layers[0].rng is model.layers[1].rng
    assert not np.array_equal(np.asarray(a) != 0, np.asarray(b) != 0)  # the masks differ
    assert len(traces) == 1


def test_dropout_eager_counts_and_eval_draws_nothing():
    rng = tied.Rng(3)
    d = Dropout(0.5, rng)
    x = jnp.ones(64)
    d(x)
    d(x)
    assert int(rng.count.value) == 2
    ev = mode(d, False)
    assert ev.rng is rng and ev(x) is x  # identity, no draw
    assert int(rng.count.value) == 2
    assert Dropout(0.0, rng)(x) is x and int(rng.count.value) == 2


def test_dropout_errors():
    with pytest.raises(TypeError, match=r"rng must be a tied.Rng, got int.*Dropout\(0.1, tied.Rng\(0\)\)"):
        Dropout(0.1, 0)
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\], got 1.5"):
        Dropout(1.5, tied.Rng(0))


# ---------------------------------------------------------------- mode


def test_mode_shares_arrays_and_state_objects_and_compiles_once_per_mode():
    rng = tied.Rng(0)
    bn = BatchNorm(4)
    dense = Dense(4, 4, key=jax.random.key(1))
    model = {"net": Chain(dense, bn, Dropout(0.5, rng), bn), "head": Dense(dense.weight)}
    ev = mode(model, False)
    assert ev["net"].layers[1] is ev["net"].layers[3] and ev["net"].layers[1] is not bn
    assert not ev["net"].layers[1].training and not ev["net"].layers[2].training
    assert bn.training and model["net"].layers[2].training  # the input is not changed
    assert ev["net"].layers[0] is dense and ev["head"] is model["head"]  # no flag below: kept
    assert ev["net"].layers[1].running_mean is bn.running_mean
    assert ev["net"].layers[1].weight is bn.weight and ev["net"].layers[2].rng is rng
    assert tied.ties(ev) == tied.ties(model)
    back = mode(ev, True)
    assert back["net"].layers[1].training and back["net"].layers[1].running_var is bn.running_var
    assert mode(model, True) is model  # already in train mode
    assert mode(dense, False) is dense  # no flag at all

    traces = []

    @tied.jit
    def forward(m, x):
        traces.append(m["net"].layers[1].training)
        return m, m["net"](x)

    x = jnp.arange(32.0).reshape(8, 4)
    for _ in range(3):
        model, _ = forward(model, x)
        forward(mode(model, False), x)
    assert traces == [True, False]

    with pytest.raises(TypeError, match="training must be a bool"):
        mode(model, 0)


@tied.register
class _Node:
    def __init__(self):
        self.parent, self.kids = None, []


def test_mode_through_tuples_cycles_and_equinox_modules():
    eqx = pytest.importorskip("equinox")
    bn, d, rng = BatchNorm(2), Dense(2, 2, key=jax.random.key(0)), tied.Rng(0)
    e = mode((bn, d, [bn, Dropout(0.1, rng)], {"x": d}), False)
    assert e[0] is e[2][0] and e[0] is not bn and not e[0].training and e[2][1].rng is rng
    assert e[1] is d and e[3]["x"] is d and e[0].running_mean is bn.running_mean
    root, kid = _Node(), _Node()
    kid.parent, kid.bn, root.d = root, bn, d
    root.kids.append(kid)  # a reference cycle: root -> kid -> root
    e = mode(root, False)
    assert e is not root and e.kids[0].parent is e and not e.kids[0].bn.training
    assert e.d is d and e.kids[0].bn.running_var is bn.running_var and bn.training

    class Pair(eqx.Module):
        a: object
        b: object

    e = mode(Pair(bn, d), False)
    assert type(e) is Pair and not e.a.training and e.b is d and e.a.running_mean is bn.running_mean


# ---------------------------------------------------------------- Conv2d and RMSNorm


def np_conv(x, w, b, stride, pad):
    """Direct loops in numpy: NHWC input, HWIO kernel, zero padding."""
    x = np.pad(np_(x), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    kh, kw, _, o = w.shape
    n, h, wd, _ = x.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, oh, ow, o))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, i * stride : i * stride + kh, j * stride : j * stride + kw, :]
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", patch, np_(w))
    return out + (0 if b is None else np_(b))


@pytest.mark.parametrize("stride,pad", [(1, 0), (1, 1), (2, 1), (2, 0)])
def test_conv2d_against_numpy_loops(stride, pad):
    conv = Conv2d(3, 4, 3, stride=stride, padding=pad, key=jax.random.key(0))
    x = batches(1, (2, 7, 6, 3), seed=3)[0]
    np.testing.assert_allclose(
        np_(conv(jnp.asarray(x))), np_conv(x, conv.weight, conv.bias, stride, pad), atol=1e-4
    )
    lim = 1 / np.sqrt(27)
    assert conv.weight.shape == (3, 3, 3, 4) and np.all(np.abs(np_(conv.weight)) <= lim)


def test_conv2d_same_and_tied_kernel_against_lax_conv_in_nchw():
    conv = Conv2d(2, 3, (3, 5), padding="SAME", key=jax.random.key(1))
    x = jnp.asarray(batches(1, (1, 6, 7, 2), seed=4)[0])
    # written independently: jax.lax.conv in NCHW/OIHW layout
    ref = jax.lax.conv(x.transpose(0, 3, 1, 2), conv.weight.transpose(3, 2, 0, 1), (1, 1), "SAME")
    ref = ref.transpose(0, 2, 3, 1) + conv.bias
    np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(ref), atol=1e-5)
    twin = Conv2d(conv.weight, None, stride=2, padding="VALID")
    model = Chain(conv, jnp.tanh, Conv2d(3, 2, 1, key=jax.random.key(2)), twin)
    assert tied.ties(model) == [(".layers[0].weight", ".layers[3].weight")]

    def loss(m):
        return (m(x) ** 2).sum()

    g = tied.grad(loss)(model)
    assert g.layers[0].weight is g.layers[3].weight

    def untied(w1, b1, w2, b2, w3):
        m = Chain(Conv2d(w1, b1, padding="SAME"), jnp.tanh, Conv2d(w2, b2), Conv2d(w3, None, stride=2))
        return loss(m)

    c2 = model.layers[2]
    parts = jax.grad(untied, argnums=(0, 4))(conv.weight, conv.bias, c2.weight, c2.bias, conv.weight)
    np.testing.assert_allclose(
        np.asarray(g.layers[0].weight), np.asarray(parts[0] + parts[1]), rtol=1e-4, atol=1e-5
    )


def test_conv2d_errors():
    with pytest.raises(TypeError, match=r"needs a kernel size and an explicit key"):
        Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"HWIO"):
        Conv2d(jnp.ones((3, 3, 2)))
    with pytest.raises(ValueError, match=r"padding must be an int, a pair, 'SAME' or 'VALID'"):
        Conv2d(3, 4, 3, padding="FULL", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"last axis \(features\) has size 4, expected 3"):
        Conv2d(3, 4, 3, key=jax.random.key(0))(jnp.ones((1, 5, 5, 4)))


def test_rmsnorm_by_formula_and_shared_weight_gradient():
    x = batches(1, (3, 6), seed=5)[0]
    norm = RMSNorm(6, eps=1e-6)
    norm.weight = jnp.linspace(0.5, 2.0, 6)
    ref = np_(x) / np.sqrt((np_(x) ** 2).mean(-1, keepdims=True) + 1e-6) * np_(norm.weight)
    np.testing.assert_allclose(np_(norm(jnp.asarray(x))), ref, rtol=1e-5)
    assert np.allclose(np_(RMSNorm(6).weight), 1.0)


# ---------------------------------------------------------------- KV cache


def test_kv_cached_decode_equals_full_causal_forward_at_each_position():
    dim, heads, seq = 16, 4, 7
    block = TransformerBlock(dim, heads, key=jax.random.key(0))
    emb = Embedding(11, dim, key=jax.random.key(1))
    model = {"embed": emb, "blocks": [block, block], "ln": LayerNorm(dim), "head": Dense(emb.weight)}
    ids = jax.random.randint(jax.random.key(2), (2, seq), 0, 11)

    def full(m, ids):
        h = m["embed"](ids)
        for b in m["blocks"]:
            h = b(h)
        return m["head"](m["ln"](h))

    ref = np.asarray(full(model, ids))
    traces = []

    @tied.jit
    def step(m, caches, tok):
        traces.append(1)
        h = m["embed"](tok)
        for b, c in zip(m["blocks"], caches):  # one cache per layer place
            h = b.decode(h, c)
        return caches, m["head"](m["ln"](h))

    caches = [block.attn.cache(seq, batch_shape=(2,)) for _ in range(2)]
    for t in range(seq):
        caches, logits = step(model, caches, ids[:, t : t + 1])
        np.testing.assert_allclose(np.asarray(logits[:, 0]), ref[:, t], atol=1e-5)
    assert len(traces) == 1
    assert [int(c.position.value) for c in caches] == [seq, seq]
    assert tied.param_count({"m": model, "c": caches}) == tied.param_count(model)  # caches are state


def test_kv_cache_prefill_then_decode_and_errors():
    attn = CausalSelfAttention(8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))  # one sequence, no batch axis
    cache = attn.cache(6)
    out = jnp.concatenate([attn.decode(x[:3], cache), attn.decode(x[3:], cache)])
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn(x)), atol=1e-5)
    with pytest.raises(ValueError, match=r"5 positions are written and 2 more do not fit in max_len=6"):
        attn.decode(x[:2], cache)
    with pytest.raises(ValueError, match=r"KVCache\(max_len, 2, 4, batch_shape=\(3,\)\)"):
        attn.decode(jnp.ones((3, 1, 8)), KVCache(4, 2, 4))


# ---------------------------------------------------------------- a CNN against pure JAX


@tied.register
class CNN:
    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = Conv2d(1, 4, 3, padding=1, key=k1, use_bias=False)  # BN follows
        self.bn = BatchNorm(4)
        self.mix = Conv2d(4, 4, 3, padding=1, key=k2)  # applied twice: one block, two places
        self.blocks = [self.mix, self.mix]
        self.head = Dense(4, 3, key=k3)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(self.conv(x)))
        for b in self.blocks:
            h = jax.nn.relu(b(h)) + h
        return self.head(h.mean((1, 2)))


def ref_forward(p, x):
    """The CNN by hand: lax.conv in NCHW, batch statistics returned for replay."""

    def conv(x, w, b=0.0):
        y = jax.lax.conv(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (1, 1), ((1, 1), (1, 1)))
        return y.transpose(0, 2, 3, 1) + b

    h = conv(x, p["cw"])
    mu = h.mean((0, 1, 2))
    var = ((h - mu) ** 2).mean((0, 1, 2))
    h = jax.nn.relu((h - mu) / jnp.sqrt(var + EPS) * p["g"] + p["b"])
    for _ in range(2):
        h = jax.nn.relu(conv(h, p["mw"], p["mb"])) + h
    return h.mean((1, 2)) @ p["hw"].T + p["hb"], (mu, var)


def ref_params(m):
    return {
        "cw": m.conv.weight,
        "g": m.bn.weight,
        "b": m.bn.bias,
        "mw": m.mix.weight,
        "mb": m.mix.bias,
        "hw": m.head.weight,
        "hb": m.head.bias,
    }


def images(n, seed):
    x = jax.random.normal(jax.random.key(seed), (n, 6, 6, 1)) + 0.5
    return x, jax.random.randint(jax.random.key(seed + 100), (n,), 0, 3)


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_cnn_batchnorm_forward_and_gradient_match_pure_jax_stats_replayed_in_numpy():
    model = CNN(jax.random.key(0))
    p = ref_params(model)
    data = [images(8, s) for s in range(3)]
    for x, _ in data:
        np.testing.assert_allclose(np.asarray(model(x)), np.asarray(ref_forward(p, x)[0]), atol=1e-5)
    seen = [np.asarray(model.conv(x)).reshape(-1, 4) for x, _ in data]  # replay in numpy
    mean, var = np_bn_replay(seen)
    np.testing.assert_allclose(np_(model.bn.running_mean.value), mean, atol=1e-5)
    np.testing.assert_allclose(np_(model.bn.running_var.value), var, atol=1e-5)
    # eval mode: the running statistics replace the batch's, and nothing changes
    ev = mode(model, False)
    h = np_(model.conv(data[0][0]))
    bn_ref = (h - mean) / np.sqrt(var + EPS)
    np.testing.assert_allclose(np_(ev.bn(jnp.asarray(h, jnp.float32))), bn_ref, atol=1e-4)
    assert int(model.bn.num_batches_tracked.value) == 3
    # gradients in train mode (batch statistics differentiated) against jax.grad by hand;
    # the statistics the loss wrote reach the model once
    x, y = data[0]
    g = tied.grad(lambda m: xent(m(x), y))(model)
    gr = jax.grad(lambda p: xent(ref_forward(p, x)[0], y))(p)
    assert g.blocks[0] is g.blocks[1] and g.bn.running_mean.value is None
    for name, got in [("mw", g.mix.weight), ("g", g.bn.weight), ("cw", g.conv.weight), ("hb", g.head.bias)]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(gr[name]), rtol=1e-4, atol=1e-6)
    mean, var = np_bn_replay(seen + seen[:1])
    np.testing.assert_allclose(np_(model.bn.running_mean.value), mean, atol=1e-5)
    np.testing.assert_allclose(np_(model.bn.running_var.value), var, atol=1e-5)
    assert int(model.bn.num_batches_tracked.value) == 4


def test_cnn_adam_training_with_state_in_the_loss_matches_pure_jax():
    model = CNN(jax.random.key(0))
    p = ref_params(model)
    tx = optax.adam(1e-2)
    state, ref_state = tied.optim.setup(tx, model), tx.init(p)

    @tied.jit
    def step(m, s, x, y):
        loss, g = tied.value_and_grad(lambda m: xent(m(x), y))(m)
        m, s = tied.optim.update(s, m, g)
        return m, s, loss

    seen = []
    for i in range(3):
        x, y = images(8, i)
        model, state, _ = step(model, state, x, y)

        def ref_loss(p, x=x, y=y):
            logits, stats = ref_forward(p, x)
            return xent(logits, y), stats

        (_, (mu, var)), gr = jax.value_and_grad(ref_loss, has_aux=True)(p)
        updates, ref_state = tx.update(gr, ref_state, p)
        p = optax.apply_updates(p, updates)
        n = 8 * 36
        seen.append((np_(mu), np_(var) * n / (n - 1)))
    rm, rv = np.zeros(4), np.ones(4)
    for mu, uv in seen:
        rm, rv = 0.9 * rm + 0.1 * mu, 0.9 * rv + 0.1 * uv
    np.testing.assert_allclose(np.asarray(model.mix.weight), np.asarray(p["mw"]), atol=1e-5)
    np.testing.assert_allclose(np_(model.bn.running_mean.value), rm, atol=1e-5)
    np.testing.assert_allclose(np_(model.bn.running_var.value), rv, atol=1e-5)
    assert int(model.bn.num_batches_tracked.value) == 3


# ---------------------------------------------------------------- tied.nn's namespace


def test_dir_of_tied_nn_shows_public_names_only():
    names = dir(tied.nn)
    assert names == sorted(tied.nn.__all__)
    assert not {"Any", "Callable", "View", "jax", "jnp", "np", "math", "annotations"} & set(names)


# ---------------------------------------------------------------- several devices


def test_data_parallel_batchnorm_on_eight_fake_devices():
    """tests/multidevice/batchnorm.py under 8 fake CPU devices, in its own process."""
    code, report = pytest_on_fake_devices("tests/multidevice/batchnorm.py")
    assert code == 0, report
    assert "1 passed" in report, report


# ---------------------------------------------------------------- a Flax NNX peer


def _nnx_net():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), padding="SAME", use_bias=False, rngs=rngs)  # BN follows
            self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
            block = nnx.Conv(4, 4, (3, 3), padding="SAME", rngs=rngs)
            self.blocks = nnx.List([block, block])  # one block, two places
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.head = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            h = jax.nn.relu(self.bn(self.conv(x)))
            for b in self.blocks:
                h = jax.nn.relu(b(h)) + h
            return self.head(self.drop(h).mean((1, 2)))

    return nnx, Net(nnx.Rngs(params=0, dropout=1))


def _nnx_values(nnx, model, kind):
    return [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model, kind))]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tied.jit"])
def test_nnx_conv_batchnorm_dropout_shared_block_5_adam_steps_equal_nnx_optimizer(compiled):
    nnx, ref = _nnx_net()
    _, model = _nnx_net()
    assert ref.blocks[0] is ref.blocks[1] and model.blocks[0] is model.blocks[1]
    tx = optax.adam(1e-2)
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(m, opt, x, y):
        loss, g = nnx.value_and_grad(lambda m: xent(m(x), y))(m)
        opt.update(m, g)
        return loss

    def tied_step(m, s, x, y):
        loss, g = tied.value_and_grad(lambda m: xent(m(x), y))(m)
        m, s = tied.optim.update(s, m, g)
        return m, s, loss

    step = tied.jit(tied_step) if compiled else tied_step
    state = tied.optim.setup(tx, model)
    for i in range(5):
        x, y = images(8, i)
        nnx_step(ref, opt, x, y)
        model, state, _ = step(model, state, x, y)
    assert model.blocks[0] is model.blocks[1]
    for kind in (nnx.Param, nnx.BatchStat, nnx.RngCount):
        for a, b in zip(_nnx_values(nnx, model, kind), _nnx_values(nnx, ref, kind), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 5  # 5 masks drawn


# ---------------------------------------------------------------- the demo's generation


def test_demo_decode_with_caches_equals_the_full_forward_and_generation_compiles_once():
    from tied import demo

    model = demo.CharTransformer(10, key=jax.random.key(0), dim=16, heads=2, blocks=1, repeat=2, seq=8)
    ids = jax.random.randint(jax.random.key(1), (8,), 0, 10)
    caches = model.caches()
    assert len(caches) == 2 and caches[0] is not caches[1]  # one cache per layer place
    rows = [model.decode(ids[t : t + 1], caches)[0] for t in range(8)]
    np.testing.assert_allclose(np.stack(rows), np.asarray(model(ids)), atol=1e-5)
    step = demo._generator(0.7)
    chars = list("abcdefghij")
    texts = [demo._sample(step, model, p, chars, jax.random.key(2)) for p in ("abc", "hij")]
    assert [t[:3] for t in texts] == ["abc", "hij"] and all(len(t) == 8 for t in texts)
    assert len(step.traces) == 1
    # the sampled continuation is the argmax-free categorical of the full forward's logits
    first = jax.random.categorical(
        jax.random.fold_in(jax.random.key(2), 2), model(jnp.array([0, 1, 2]))[-1] / 0.7
    )
    assert texts[0][3] == chars[int(first)]


def test_demo_without_tqdm_names_the_demo_extra(monkeypatch):
    pytest.importorskip("matplotlib")  # the demo extra's other half (not in make test-min's venv)
    from tied import demo

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"needs tqdm, from the 'demo' extra: pip install 'tied\[demo\]'"):
        demo.main(["--steps", "1"])
    code = "import sys, runpy; sys.modules['tqdm'] = None; runpy.run_module('tied.demo', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and "pip install 'tied[demo]'" in proc.stderr
    assert "Traceback" not in proc.stderr
