"""tied.scan: equal to the unrolled loop in carry, ys, gradients and state writes (eagerly,
under tied.jit and under tied.grad); the issue's must-show models against the unrolled
model, hand-written jax.lax.scan and Flax NNX's nnx.scan."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tied

ATOL = 1e-5


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _close(a, b, atol=ATOL, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(_data(a)), np.asarray(_data(b)), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- small models


def _members(n=4, d=3):
    norm, rng, shared_bn = tied.nn.LayerNorm(d), tied.Rng(3), tied.nn.BatchNorm(d)
    keys = jax.random.split(jax.random.key(0), n)
    return [
        {
            "dense": tied.nn.Dense(d, d, key=k),
            "norm": norm,  # broadcast parameter holder
            "bn": tied.nn.BatchNorm(d),  # stacked state
            "shared_bn": shared_bn,  # broadcast state
            "drop": tied.nn.Dropout(0.3, rng),  # own layer, broadcast stream
        }
        for k in keys
    ]


def _step(h, layer, x):
    h = layer["norm"](layer["dense"](h)) + (0.0 if x is None else x)
    h = layer["drop"](layer["shared_bn"](layer["bn"](h)))
    return h, jnp.sum(h, axis=-1)


def _state(members):
    return [
        (m["bn"].running_mean.value, m["bn"].running_var.value, m["bn"].num_batches_tracked.value)
        for m in members
    ]


def test_scan_equals_the_unrolled_loop_eagerly_with_state():
    ref, got = _members(), _members()
    s = tied.stack(got)
    x0 = jax.random.normal(jax.random.key(1), (5, 3))
    xs = jax.random.normal(jax.random.key(2), (4, 5, 3))
    h, ys = x0, []
    for i, m in enumerate(ref):
        h, y = _step(h, m, xs[i])
        ys.append(y)
    carry, out = tied.scan(_step, x0, s, xs)
    _close(carry, h)
    _close(out, jnp.stack(ys))
    for i, (mean, var, count) in enumerate(_state(ref)):  # slice i written at step i
        _close(s.member["bn"].running_mean.value[i], mean)
        _close(s.member["bn"].running_var.value[i], var)
        assert int(s.member["bn"].num_batches_tracked.value[i]) == int(count) == 1
    sbn, rbn = s.member["shared_bn"], ref[0]["shared_bn"]
    assert sbn is got[0]["shared_bn"] and int(sbn.num_batches_tracked.value) == 4  # every step
    _close(sbn.running_mean.value, rbn.running_mean.value)
    _close(sbn.running_var.value, rbn.running_var.value)
    assert int(s.member["drop"].rng.count.value) == int(ref[0]["drop"].rng.count.value) == 4


def test_reverse_orders_ys_by_member():
    ref, got = _members(), _members()
    s = tied.stack(got)
    x0 = jax.random.normal(jax.random.key(1), (5, 3))
    h, ys = x0, [None] * 4
    for i in reversed(range(4)):
        h, ys[i] = _step(h, ref[i], None)
    carry, out = tied.scan(_step, x0, s, reverse=True, unroll=2)
    _close(carry, h)
    _close(out, jnp.stack(ys))
    _close(s.member["bn"].running_mean.value[0], ref[0]["bn"].running_mean.value)


@pytest.mark.parametrize("where", ["jit", "grad", "jit+grad"])
def test_state_writes_reach_the_caller_under_jit_and_grad(where):
    ref, got = _members(), _members()
    s = tied.stack(got)
    x0 = jax.random.normal(jax.random.key(1), (5, 3))

    def loss_ref(ms):
        h = x0
        for m in ms:
            h, _ = _step(h, m, None)
        return jnp.sum(h**2)

    def loss(st):
        return jnp.sum(tied.scan(_step, x0, st)[0] ** 2)

    g_ref = tied.grad(loss_ref)(ref)
    if where == "jit":
        value = tied.jit(loss)(s)
        _close(value, loss_ref(_members()))  # a fresh reference: state at its start
    elif where == "grad":
        g = tied.grad(loss)(s)
    else:
        g = tied.jit(tied.grad(loss))(s)
    for i, (mean, var, _) in enumerate(_state(ref)):
        _close(s.member["bn"].running_mean.value[i], mean)
        _close(s.member["bn"].running_var.value[i], var)
    _close(s.member["shared_bn"].running_mean.value, ref[0]["shared_bn"].running_mean.value)
    assert int(s.member["drop"].rng.count.value) == 4
    if where != "jit":
        assert isinstance(g, tied.Stack) and len(g) == 4
        for i in range(4):
            _close(g.member["dense"].weight[i], g_ref[i]["dense"].weight, 1e-4, 1e-4)
            _close(g.member["bn"].weight[i], g_ref[i]["bn"].weight, 1e-4, 1e-4)
        # broadcast parameters: the total over every layer, one object
        _close(g.member["norm"].weight, g_ref[0]["norm"].weight, 1e-4, 1e-4)
        assert g_ref[0]["norm"].weight is g_ref[3]["norm"].weight
        _close(g.member["shared_bn"].bias, g_ref[0]["shared_bn"].bias, 1e-4, 1e-4)


def test_grad_through_scan_equals_plain_jax_grad_of_the_unrolled_arrays():
    # an independent reference: arrays only, plain jax.grad, partials summed by hand
    n, d = 3, 4
    ws = [jax.random.normal(jax.random.key(i), (d, d)) for i in range(n)]
    shared = jax.random.normal(jax.random.key(9), (d,))
    s = tied.stack([{"w": w, "b": shared} for w in ws])
    model = {"stack": s, "out": shared}  # the broadcast bias is tied outside the stack too
    x = jnp.ones((2, d))

    def f(h, layer, _):
        return jnp.tanh(h @ layer["w"] + layer["b"]), None

    def loss(m):
        h, _ = tied.scan(f, x, m["stack"])
        return jnp.sum(h * m["out"])

    def ref(ws, bs, out):
        h = x
        for w, b in zip(ws, bs):
            h = jnp.tanh(h @ w + b)
        return jnp.sum(h * out)

    gw, gb, gout = jax.grad(ref, argnums=(0, 1, 2))(ws, [shared] * n, shared)
    g = tied.grad(loss)(model)
    _close(g["stack"].member["w"], jnp.stack(gw))
    total = sum(gb) + gout
    _close(g["out"], total)
    assert g["stack"].member["b"] is g["out"]  # the same total object at every place


def test_xs_of_the_wrong_length_is_a_value_error_and_nothing_is_written():
    s = tied.stack(_members())
    before = s.member["bn"].running_mean.value
    with pytest.raises(ValueError, match=r"xs\['a'\] has leading axis 3, but the stack has 4 members"):
        tied.scan(_step, jnp.ones((5, 3)), s, {"a": jnp.ones((3, 5, 3))})
    assert s.member["bn"].running_mean.value is before


def test_a_body_that_changes_the_structure_or_replaces_a_broadcast_parameter_is_refused():
    s = tied.stack(_members())
    before = s.member["bn"].running_mean.value

    def grow(h, layer, _):
        layer["new"] = h
        return layer["bn"](h), None

    with pytest.raises(tied.GraphError, match=r"tied.scan: the function changed the structure"):
        tied.scan(grow, jnp.ones((5, 3)), s)

    def replace(h, layer, _):
        layer["norm"].weight = layer["norm"].weight * 2
        return layer["bn"](h), None

    with pytest.raises(
        tied.GraphError, match=r"\.member\['norm'\]\.weight: tied.scan: the body replaced a broadcast"
    ):
        tied.scan(replace, jnp.ones((5, 3)), s)
    assert s.member["bn"].running_mean.value is before


# ---------------------------------------------------------------- must show: the 6-block model

V, D, N = 11, 8, 6


def _six(stacked):
    keys = jax.random.split(jax.random.key(0), N + 1)
    emb = tied.nn.Embedding(V, D, key=keys[0])
    norm, rng = tied.nn.LayerNorm(D), tied.Rng(7)
    blocks = [
        {
            "dense": tied.nn.Dense(D, D, key=keys[i + 1]),
            "norm": norm,
            "bn": tied.nn.BatchNorm(D),
            "drop": tied.nn.Dropout(0.2, rng),
        }
        for i in range(N)
    ]
    return {"embed": emb, "blocks": tied.stack(blocks) if stacked else blocks, "head": emb}


def _layer(h, layer, _):
    # no parameter right before a normalisation (its gradient would be ~0, Adam's step noise)
    return h + layer["drop"](layer["norm"](jax.nn.relu(layer["dense"](layer["bn"](h))))), None


def _six_loss(m, ids, tgt):
    h = m["embed"](ids)
    if isinstance(m["blocks"], tied.Stack):
        h, _ = tied.scan(_layer, h, m["blocks"])
    else:
        for layer in m["blocks"]:
            h, _ = _layer(h, layer, None)
    logits = m["head"].attend(h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()


def test_six_block_model_trained_with_adam_under_jit_equals_the_unrolled_model():
    opt = optax.adam(1e-2)
    ids = jax.random.randint(jax.random.key(5), (4, 5), 0, V)
    tgt = jax.random.randint(jax.random.key(6), (4, 5), 0, V)

    @tied.jit
    def step(m, s, ids, tgt):
        loss, g = tied.value_and_grad(_six_loss)(m, ids, tgt)
        m, s = tied.optim.update(s, m, g)
        return m, s, loss

    results = {}
    for stacked in (False, True):
        m = _six(stacked)
        s = tied.optim.setup(opt, m)
        losses = []
        for _ in range(3):
            m, s, loss = step(m, s, ids, tgt)
            losses.append(float(loss))
        results[stacked] = m, losses
    (mu, lu), (ms, ls) = results[False], results[True]
    np.testing.assert_allclose(ls, lu, atol=ATOL)
    st = ms["blocks"]
    assert isinstance(st, tied.Stack) and len(st) == N
    assert ms["embed"] is ms["head"] and mu["embed"] is mu["head"]  # the tie kept
    assert st.member["norm"] is st.member["norm"] and st.member["drop"].rng is st.member["drop"].rng
    for i, b in enumerate(mu["blocks"]):
        _close(st.member["dense"].weight[i], b["dense"].weight)
        _close(st.member["dense"].bias[i], b["dense"].bias)
        _close(st.member["bn"].weight[i], b["bn"].weight)
        _close(st.member["bn"].running_mean.value[i], b["bn"].running_mean.value)
        _close(st.member["bn"].running_var.value[i], b["bn"].running_var.value)
        assert int(st.member["bn"].num_batches_tracked.value[i]) == 3
    _close(st.member["norm"].weight, mu["blocks"][0]["norm"].weight)
    _close(ms["embed"].weight, mu["embed"].weight)
    assert int(st.member["drop"].rng.count.value) == int(mu["blocks"][0]["drop"].rng.count.value) == 3 * N
    # the broadcast objects are one object, tied to every unrolled block's
    assert all(b["norm"] is mu["blocks"][0]["norm"] for b in mu["blocks"])
    assert len({id(layer["norm"]) for layer in tied.unstack(st)}) == 1


# ---------------------------------------------------------------- must show: a stacked KV cache

T = 8


def _lm(n=3, d=16, heads=2, vocab=13):
    keys = jax.random.split(jax.random.key(3), n + 1)
    emb = tied.nn.Embedding(vocab, d, key=keys[0])
    blocks = [tied.nn.TransformerBlock(d, heads, key=k) for k in keys[1:]]
    return emb, blocks


def test_stacked_kv_cache_decode_equals_unrolled_and_full_forward_with_one_compile():
    emb, blocks = _lm()
    model = {"embed": emb, "blocks": tied.stack(blocks), "head": emb}
    caches = tied.stack([b.attn.cache(T, batch_shape=(1,)) for b in blocks])
    ref_caches = [b.attn.cache(T, batch_shape=(1,)) for b in blocks]
    tokens = jax.random.randint(jax.random.key(4), (1, T), 0, 13)
    traces = []

    @tied.jit
    def decode(m, caches, tok):
        traces.append(1)

        def f(h, layer, _):
            blk, cache = layer
            return blk.decode(h, cache), None

        h, _ = tied.scan(f, m["embed"](tok), (m["blocks"], caches))
        return m["head"].attend(h)

    h = emb(tokens)
    for b in blocks:
        h = b(h)
    full = emb.attend(h)
    for t in range(T):
        tok = tokens[:, t : t + 1]
        got = decode(model, caches, tok)
        h = emb(tok)
        for b, c in zip(blocks, ref_caches):
            h = b.decode(h, c)
        _close(got, emb.attend(h), atol=1e-4)
        _close(got[:, 0], full[:, t], atol=1e-4)
    assert len(traces) == 1  # one compile for all eight tokens
    np.testing.assert_array_equal(caches.member.position.value, [T] * 3)
    for i, c in enumerate(ref_caches):
        _close(caches.member.keys.value[i], c.keys.value, atol=1e-4)


# ---------------------------------------------------------------- must show: JAX and NNX


def _hand_block(p, x, heads):
    """A pre-LN transformer block written from scratch over plain arrays."""

    def ln(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * w + b

    *lead, seq, d = x.shape
    hd = d // heads
    q, k, v = jnp.split(ln(x, p["ln1w"], p["ln1b"]) @ p["qkvw"].T + p["qkvb"], 3, axis=-1)
    q, k, v = (t.reshape(*lead, seq, heads, hd) for t in (q, k, v))
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
    a = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(s, -1), v).reshape(*lead, seq, d)
    x = x + a @ p["projw"].T + p["projb"]
    hidden = jax.nn.gelu(ln(x, p["ln2w"], p["ln2b"]) @ p["fc1w"].T + p["fc1b"])
    return x + hidden @ p["fc2w"].T + p["fc2b"]


def _arrays(b):
    return {
        "ln1w": b.ln1.weight, "ln1b": b.ln1.bias, "ln2w": b.ln2.weight, "ln2b": b.ln2.bias,
        "qkvw": b.attn.qkv.weight, "qkvb": b.attn.qkv.bias, "projw": b.attn.proj.weight,
        "projb": b.attn.proj.bias, "fc1w": b.mlp.fc1.weight, "fc1b": b.mlp.fc1.bias,
        "fc2w": b.mlp.fc2.weight, "fc2b": b.mlp.fc2.bias,
    }  # fmt: skip


def test_scan_over_transformer_blocks_equals_hand_written_lax_scan():
    emb, blocks = _lm(n=4)
    s = tied.stack(blocks)
    x = jax.random.normal(jax.random.key(8), (2, 5, 16))

    def loss(st):
        h, _ = tied.scan(lambda h, blk, _: (blk(h), None), x, st)
        return jnp.sum(jnp.sin(h))

    stacked = {k: jnp.stack([_arrays(b)[k] for b in blocks]) for k in _arrays(blocks[0])}

    def hand_loss(p):
        h, _ = jax.lax.scan(lambda h, p: (_hand_block(p, h, 2), None), x, p)
        return jnp.sum(jnp.sin(h))

    _close(loss(s), hand_loss(stacked), atol=1e-4)
    g, hg = tied.grad(loss)(s), jax.grad(hand_loss)(stacked)
    for k, v in _arrays(g.member).items():
        _close(v, hg[k], atol=1e-4)


def test_scan_over_transformer_blocks_equals_nnx_scan_with_the_same_weights():
    # NNX: blocks made with nnx.vmap, run with nnx.scan, given the same weights
    nnx = pytest.importorskip("flax.nnx")  # Flax's lowest supported release fails to import on JAX 0.10.2
    emb, blocks = _lm(n=4)
    s = tied.stack(blocks)
    x = jax.random.normal(jax.random.key(8), (2, 5, 16))
    stacked = {k: jnp.stack([_arrays(b)[k] for b in blocks]) for k in _arrays(blocks[0])}

    class Block(nnx.Module):
        def __init__(self, rngs):
            d = 16
            self.ln1, self.ln2 = (
                nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs),
                nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs),
            )
            self.qkv, self.proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
            self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            p = {
                "ln1w": self.ln1.scale[...], "ln1b": self.ln1.bias[...], "ln2w": self.ln2.scale[...],
                "ln2b": self.ln2.bias[...], "qkvw": self.qkv.kernel[...].T, "qkvb": self.qkv.bias[...],
                "projw": self.proj.kernel[...].T, "projb": self.proj.bias[...],
                "fc1w": self.fc1.kernel[...].T, "fc1b": self.fc1.bias[...],
                "fc2w": self.fc2.kernel[...].T, "fc2b": self.fc2.bias[...],
            }  # fmt: skip
            return _hand_block(p, x, 2)

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return Block(nnx.Rngs(key))

    nb = create(jax.random.split(jax.random.key(0), 4))
    for _, mod, attr, k, transpose in [
        ("ln1", nb.ln1, "scale", "ln1w", False), ("ln1", nb.ln1, "bias", "ln1b", False),
        ("ln2", nb.ln2, "scale", "ln2w", False), ("ln2", nb.ln2, "bias", "ln2b", False),
        ("qkv", nb.qkv, "kernel", "qkvw", True), ("qkv", nb.qkv, "bias", "qkvb", False),
        ("proj", nb.proj, "kernel", "projw", True), ("proj", nb.proj, "bias", "projb", False),
        ("fc1", nb.fc1, "kernel", "fc1w", True), ("fc1", nb.fc1, "bias", "fc1b", False),
        ("fc2", nb.fc2, "kernel", "fc2w", True), ("fc2", nb.fc2, "bias", "fc2b", False),
    ]:  # fmt: skip
        v = stacked[k]
        getattr(mod, attr)[...] = jnp.swapaxes(v, -1, -2) if transpose else v

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def nnx_forward(h, block):
        return block(h)

    h_tied, _ = tied.scan(lambda h, blk, _: (blk(h), None), x, s)
    _close(nnx_forward(x, nb), h_tied, atol=1e-4)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.sampled_from(["own", "shared", "outside"]), min_size=1, max_size=4), st.integers(1, 3))
def test_random_sharing_patterns_scan_like_the_unrolled_loop(pattern, n):
    # each field of a member: its own array, one array for all members, or one array also
    # held outside the stack; the gradient of each place against the unrolled list's
    shared = [jax.random.normal(jax.random.key(100 + k), (3,)) for k in range(len(pattern))]
    members = [
        {
            f"f{k}": shared[k] if kind != "own" else jax.random.normal(jax.random.key(10 * i + k), (3,))
            for k, kind in enumerate(pattern)
        }
        for i in range(n)
    ]
    outside = {f"f{k}": shared[k] for k, kind in enumerate(pattern) if kind == "outside"}

    def f(h, layer, _):
        for k in range(len(pattern)):
            h = jnp.tanh(h * layer[f"f{k}"] + 0.1 * k)
        return h, h.sum()

    def outer(h, out):
        return sum(jnp.sum(h * v) for v in out.values()) + jnp.sum(h)

    def loss_scan(m):
        h, ys = tied.scan(f, jnp.ones(3), m["stack"])
        return outer(h, m["out"]) + ys.sum()

    def loss_loop(m):
        h, total = jnp.ones(3), 0.0
        for layer in m["stack"]:
            h, y = f(h, layer, None)
            total = total + y
        return outer(h, m["out"]) + total

    g = tied.grad(loss_scan)({"stack": tied.stack(members), "out": outside})
    ref = tied.grad(loss_loop)({"stack": members, "out": outside})
    for k, kind in enumerate(pattern):
        got = g["stack"].member[f"f{k}"]
        if kind == "own" and n > 1:
            _close(got, jnp.stack([r[f"f{k}"] for r in ref["stack"]]), 1e-4, 1e-4)
        else:  # broadcast: the total, one object here and outside
            _close(got, ref["stack"][0][f"f{k}"], 1e-4, 1e-4)
            if kind == "outside":
                assert got is g["out"][f"f{k}"]
