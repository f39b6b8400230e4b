"""The benchmark's workloads, each written once per system.

Every system gets the same shapes, initial values, loss and optimiser rule. A
system is a ``make(workload) -> step`` function: ``step()`` runs one training
step and returns something to block on. Peers (Flax NNX, Equinox, PyTorch) are
optional: a system whose library is missing is skipped and says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied import nn, optim


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    rule: str  # "adam" or "sgd"
    lr: float


ALBERT = Workload(
    "albert_mlp", "one Dense(64,64)+tanh block shared by 12 layers, batch 32, Adam", "adam", 1e-3
)
DEEP = Workload("deep_unshared", "100 distinct Dense(16,16)+tanh layers, batch 8, SGD", "sgd", 1e-2)
LM = Workload(
    "tied_lm",
    "transformer LM, head = embedding transposed (vocab 512, width 128, 2 blocks, batch 16x64), Adam",
    "adam",
    1e-3,
)
WORKLOADS = (ALBERT, DEEP, LM)


def optax_rule(w: Workload) -> optax.GradientTransformation:
    return optax.adam(w.lr) if w.rule == "adam" else optax.sgd(w.lr)


# ---------------------------------------------------------------- data and the tied models


def mlp_data(w: Workload):
    width, batch = (64, 32) if w is ALBERT else (16, 8)
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (batch, width)), jax.random.normal(ky, (batch, width))


def mlp_model(w: Workload) -> nn.Chain:
    """The tied model: ALBERT's one block at 12 places, or 100 distinct layers."""
    if w is ALBERT:
        block = nn.Dense(64, 64, key=jax.random.key(0), activation=jnp.tanh)
        return nn.Chain(*[block] * 12)
    keys = jax.random.split(jax.random.key(0), 100)
    return nn.Chain(*[nn.Dense(16, 16, key=k, activation=jnp.tanh) for k in keys])


def mlp_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@tied.register
class TiedLM:
    """Token and position embeddings, pre-LN blocks, and a head that is the embedding."""

    def __init__(self, vocab=512, dim=128, heads=4, n_blocks=2, seq=64, *, key):
        keys = jax.random.split(key, n_blocks + 2)
        self.embed = nn.Embedding(vocab, dim, key=keys[0])
        self.pos = 0.02 * jax.random.normal(keys[1], (seq, dim))
        self.blocks = [nn.TransformerBlock(dim, heads, key=k) for k in keys[2:]]
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Dense(self.embed.weight)  # the tied head: the same array at a second place

    def __call__(self, ids):
        h = self.embed(ids) + self.pos[: ids.shape[-1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # head.weight is embed.weight: logits = h @ E.T


def lm_data():
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 512)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model, ids, targets):
    logits = model(ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def tied_model(w: Workload):
    return TiedLM(key=jax.random.key(0)) if w is LM else mlp_model(w)


def data(w: Workload):
    return lm_data() if w is LM else mlp_data(w)


def loss_fn(w: Workload):
    return lm_loss if w is LM else mlp_loss


# ---------------------------------------------------------------- hand-written pure JAX: the ceiling


def _dense_params(d: nn.Dense) -> dict:
    return {"w": jnp.array(d.weight), "b": jnp.array(d.bias)}


def pure_params(w: Workload):
    """The tied model's values as a plain pytree, each parameter stored once."""
    m = tied_model(w)
    if w is ALBERT:
        return _dense_params(m.layers[0])
    if w is DEEP:
        return [_dense_params(d) for d in m.layers]
    blocks = []
    for b in m.blocks:
        blocks.append(
            {
                "ln1": {"w": b.ln1.weight, "b": b.ln1.bias},
                "qkv": _dense_params(b.attn.qkv),
                "proj": _dense_params(b.attn.proj),
                "ln2": {"w": b.ln2.weight, "b": b.ln2.bias},
                "fc1": _dense_params(b.mlp.fc1),
                "fc2": _dense_params(b.mlp.fc2),
            }
        )
    ln_f = {"w": m.ln_f.weight, "b": m.ln_f.bias}
    return {"embed": m.embed.weight, "pos": m.pos, "blocks": blocks, "ln_f": ln_f}


def _ln(p, x, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["w"] + p["b"]


def _lin(p, x):
    return x @ p["w"].T + p["b"]


def _attention(p, x, heads=4):
    *lead, seq, dim = x.shape
    q, k, v = jnp.split(_lin(p["qkv"], x), 3, axis=-1)
    q, k, v = (t.reshape(*lead, seq, heads, dim // heads) for t in (q, k, v))
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(dim // heads)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores, axis=-1), v)
    return _lin(p["proj"], out.reshape(*lead, seq, dim))


def pure_loss(w: Workload) -> Callable:
    if w is ALBERT:

        def loss(p, x, y):
            for _ in range(12):  # the sharing, written into the loss by hand
                x = jnp.tanh(_lin(p, x))
            return jnp.mean((x - y) ** 2)

    elif w is DEEP:

        def loss(p, x, y):
            for layer in p:
                x = jnp.tanh(_lin(layer, x))
            return jnp.mean((x - y) ** 2)

    else:

        def loss(p, ids, targets):
            h = jnp.take(p["embed"], ids, axis=0) + p["pos"][: ids.shape[-1]]
            for b in p["blocks"]:
                h = h + _attention(b, _ln(b["ln1"], h))
                h = h + _lin(b["fc2"], jax.nn.gelu(_lin(b["fc1"], _ln(b["ln2"], h))))
            logits = _ln(p["ln_f"], h) @ p["embed"].T
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def make_pure(w: Workload):
    tx = optax_rule(w)
    loss = pure_loss(w)

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = pure_params(w)
    state = [params, tx.init(params)]
    x, y = data(w)

    def run():
        state[0], state[1], value = step(state[0], state[1], x, y)
        return value

    return run


# ---------------------------------------------------------------- tied


def make_tied(w: Workload):
    loss = loss_fn(w)

    @tied.jit
    def step(model, opt_state, x, y):
        value, grads = tied.value_and_grad(loss)(model, x, y)
        model, opt_state = optim.update(opt_state, model, grads)
        return model, opt_state, value

    model = tied_model(w)
    state = [model, optim.setup(optax_rule(w), model)]
    x, y = data(w)

    def run():
        state[0], state[1], value = step(state[0], state[1], x, y)
        return value

    run.model = lambda: state[0]
    return run


# ---------------------------------------------------------------- Flax NNX


def make_nnx(w: Workload, cached: bool = False):
    from flax import nnx

    if w is LM:
        return None
    ref = tied_model(w)

    class Block(nnx.Module):
        def __init__(self, d: nn.Dense):
            n_out, n_in = d.weight.shape
            self.lin = nnx.Linear(n_in, n_out, rngs=nnx.Rngs(0))
            self.lin.kernel.value = jnp.array(d.weight.T)
            self.lin.bias.value = jnp.array(d.bias)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Model(nnx.Module):
        def __init__(self):
            if w is ALBERT:
                block = Block(ref.layers[0])
                self.layers = nnx.List([block] * 12)
            else:
                self.layers = nnx.List([Block(d) for d in ref.layers])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    opt = nnx.Optimizer(model, optax_rule(w), wrt=nnx.Param)
    x, y = data(w)

    @nnx.jit
    def step(model, opt, x, y):
        value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return value

    if cached:
        cstep = nnx.cached_partial(step, model, opt)
        return lambda: cstep(x, y)
    return lambda: step(model, opt, x, y)


# ---------------------------------------------------------------- Equinox (naive reuse: ties break)


def make_equinox(w: Workload):
    import equinox as eqx

    if w is LM:
        return None
    ref = tied_model(w)

    class Model(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(x @ layer.weight.T + layer.bias)
            return x

    def linear(d: nn.Dense):
        lin = eqx.nn.Linear(d.in_size, d.out_size, key=jax.random.key(0))
        return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (jnp.array(d.weight), jnp.array(d.bias)))

    if w is ALBERT:
        shared = linear(ref.layers[0])
        model = Model([shared] * 12)  # the same Linear at 12 places: a pytree sees 12 copies
    else:
        model = Model([linear(d) for d in ref.layers])
    tx = optax_rule(w)
    x, y = data(w)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    state = [model, tx.init(eqx.filter(model, eqx.is_array))]

    def run():
        state[0], state[1], value = step(state[0], state[1], x, y)
        return value

    return run


# ---------------------------------------------------------------- PyTorch eager (CPU)


def make_torch(w: Workload):
    import torch

    torch.manual_seed(0)
    ref = tied_model(w)
    if w is LM:
        model = _torch_lm(torch, ref)
        ids, targets = (torch.tensor(np.asarray(a), dtype=torch.long) for a in lm_data())

        def loss():
            logits = model(ids)
            flat = logits.reshape(-1, logits.shape[-1])
            return torch.nn.functional.cross_entropy(flat, targets.reshape(-1))

    else:
        layers = []
        for d in ref.layers if w is DEEP else ref.layers[:1]:
            lin = torch.nn.Linear(d.in_size, d.out_size)
            with torch.no_grad():
                lin.weight.copy_(torch.tensor(np.asarray(d.weight)))
                lin.bias.copy_(torch.tensor(np.asarray(d.bias)))
            layers.append(lin)
        if w is ALBERT:
            layers = layers * 12
        model = torch.nn.ModuleList(layers)
        x, y = (torch.tensor(np.asarray(a)) for a in mlp_data(w))

        def loss():
            h = x
            for lin in model:
                h = torch.tanh(lin(h))
            return ((h - y) ** 2).mean()

    params = list(model.parameters())  # deduplicated by PyTorch
    opt = torch.optim.Adam(params, lr=w.lr) if w.rule == "adam" else torch.optim.SGD(params, lr=w.lr)

    def run():
        opt.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        opt.step()
        return value

    return run


def _torch_lm(torch, ref: TiedLM):
    tnn = torch.nn
    t = lambda a: tnn.Parameter(torch.tensor(np.asarray(a)))  # noqa: E731

    def linear(d):
        lin = tnn.Linear(d.in_size, d.out_size)
        lin.weight, lin.bias = t(d.weight), t(d.bias)
        return lin

    def norm(ln):
        m = tnn.LayerNorm(ln.weight.shape[0], eps=ln.eps)
        m.weight, m.bias = t(ln.weight), t(ln.bias)
        return m

    class Block(tnn.Module):
        def __init__(self, b):
            super().__init__()
            self.ln1, self.ln2 = norm(b.ln1), norm(b.ln2)
            self.qkv, self.proj = linear(b.attn.qkv), linear(b.attn.proj)
            self.fc1, self.fc2 = linear(b.mlp.fc1), linear(b.mlp.fc2)
            self.heads = b.attn.num_heads

        def forward(self, x):
            bsz, seq, dim = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
            q, k, v = (a.reshape(bsz, seq, self.heads, dim // self.heads).transpose(1, 2) for a in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(out.transpose(1, 2).reshape(bsz, seq, dim))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class LM(tnn.Module):
        def __init__(self):
            super().__init__()
            self.embed = t(ref.embed.weight)
            self.pos = t(ref.pos)
            self.blocks = tnn.ModuleList([Block(b) for b in ref.blocks])
            self.ln_f = norm(ref.ln_f)

        def forward(self, ids):
            h = self.embed[ids] + self.pos[: ids.shape[-1]]
            for b in self.blocks:
                h = b(h)
            return self.ln_f(h) @ self.embed.T  # the tied head

    return LM()


SYSTEMS: dict[str, Callable] = {
    "pure JAX": make_pure,
    "tied.jit": make_tied,
    "Flax NNX": make_nnx,
    "NNX cached_partial": lambda w: make_nnx(w, cached=True),
    "Equinox (naive reuse)": make_equinox,
    "PyTorch eager": make_torch,
}
