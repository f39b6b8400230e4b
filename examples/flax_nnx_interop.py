"""A Flax NNX model with a tied embedding and a reused layer, trained with `tied`, ties kept.

`TiedLM` reads its `nnx.Embed`'s table back as the output head (one `nnx.Param` at two
attributes) and applies one `nnx.Linear` twice (one Module at two attributes). Flax NNX
0.12 makes Modules and Variables JAX pytrees, and `tied` walks them like any pytree,
one level at a time and by identity: the shared Param and the shared Linear are one
parameter each, with one gradient, one Adam state and one entry in a checkpoint.

The same model handed to plain JAX as a pytree (`jax.grad`, optax) is a tree: the
shared Param is two leaves with two partial gradients, and after one optax step the
two attributes hold two different Params. NNX's own `nnx.Optimizer` deduplicates
Variables itself, so it trains the model correctly too; `tied` agrees with it.

Run: python examples/flax_nnx_interop.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import tied

V, D, N = 16, 8, 64


class TiedLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = nnx.Linear(D, D, rngs=rngs)
        self.again = self.block  # the same Linear, applied a second time
        self.head = self.embed.embedding  # the same nnx.Param: a tied output head

    def __call__(self, ids):
        h = self.embed(ids)
        h = jnp.tanh(self.block(h))
        h = jnp.tanh(self.again(h))
        return h @ self.head[...].T  # logits over the vocabulary


def data(seed: int):
    ids = jax.random.randint(jax.random.key(seed), (N,), 0, V)
    return ids, (ids + 1) % V  # predict the next symbol


def loss_fn(model, ids, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(ids), targets).mean()


def train_tied(model, ids, targets, steps, lr):
    state = tied.optim.setup(optax.adam(lr), model)

    @tied.jit
    def step(model, state):
        g = tied.grad(loss_fn)(model, ids, targets)
        return tied.optim.update(state, model, g)

    for _ in range(steps):
        model, state = step(model, state)
    return model, state


def train_nnx(model, ids, targets, steps, lr):
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(loss_fn)(model, ids, targets))

    for _ in range(steps):
        step(model, opt)
    return model


def train_plain_jax(model, ids, targets, steps, lr):
    """The model as a plain pytree: one leaf per place, one optax state per place."""
    opt = optax.adam(lr)
    state = opt.init(model)

    @jax.jit
    def step(model, state):
        g = jax.grad(loss_fn)(model, ids, targets)
        updates, state = opt.update(g, state, model)
        return optax.apply_updates(model, updates), state

    for _ in range(steps):
        model, state = step(model, state)
    return model


def main(steps: int = 100, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    lr = 3e-2
    ids, targets = data(seed)
    model = TiedLM(nnx.Rngs(seed))
    say("ties found by tied:", tied.ties(model))
    say(
        f"parameters: {tied.param_count(model)} unique, "
        f"{tied.param_count(model, per_place=True)} counted per place"
    )

    g = tied.grad(loss_fn)(model, ids, targets)
    one_grad = g.head is g.embed.embedding and g.again is g.block
    # plain jax.grad on the pytree gives one partial per place; tied's total is their sum
    parts = jax.grad(loss_fn)(model, ids, targets)
    total_gap = float(jnp.abs(parts.head[...] + parts.embed.embedding[...] - g.head[...]).max())
    say(
        f"tied.grad: one gradient object at both places of the head: {one_grad}; "
        f"it equals the sum of plain jax.grad's two partials (max difference {total_gap:.1e})"
    )

    before = float(loss_fn(model, ids, targets))
    trained, state = train_tied(model, ids, targets, steps, lr)
    after = float(loss_fn(trained, ids, targets))
    kept = trained.head is trained.embed.embedding and trained.again is trained.block
    say(
        f"tied + optax.adam: loss {before:.3f} -> {after:.3f}; "
        f"trained.head is trained.embed.embedding: {trained.head is trained.embed.embedding}"
    )

    theirs = train_nnx(TiedLM(nnx.Rngs(seed)), ids, targets, steps, lr)
    agree = float(jnp.abs(theirs.head[...] - trained.head[...]).max())
    say(
        "nnx.Optimizer (which deduplicates Variables too): "
        f"loss {float(loss_fn(theirs, ids, targets)):.3f}; its embedding and tied's differ by "
        f"up to {agree:.1e}"
    )

    plain = train_plain_jax(TiedLM(nnx.Rngs(seed)), ids, targets, steps, lr)
    gap = float(jnp.abs(plain.head[...] - plain.embed.embedding[...]).max())
    say(
        f"plain jax.grad + optax on the pytree: loss {float(loss_fn(plain, ids, targets)):.3f}; "
        f"plain.head is plain.embed.embedding: {plain.head is plain.embed.embedding}; the two "
        f"copies now differ by up to {gap:.3f}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nnx.safetensors"
        tied.save(path, (trained, state))
        back, _ = tied.load(path, like=(trained, state))
    reloaded = back.head is back.embed.embedding and back.again is back.block
    same_loss = float(loss_fn(back, ids, targets)) == after
    say(f"tied.save / tied.load: ties kept: {reloaded}; same loss: {same_loss}")
    return {
        "one_grad": one_grad,
        "total_gap": total_gap,
        "loss_before": before,
        "loss_after": after,
        "kept": kept,
        "agree_with_nnx": agree,
        "plain_broken": plain.head is not plain.embed.embedding and gap > 0,
        "reloaded": reloaded and same_loss,
    }


if __name__ == "__main__":
    main()
