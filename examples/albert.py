"""ALBERT-style sharing: one transformer block used by all 6 layers.

The model's `blocks` list holds the *same* `TransformerBlock` object six times, so
the model has the parameters of one block (one gradient, one Adam state), and
every layer still sees the block that was just trained. The task: continue
arithmetic sequences (start s, step k, modulo 16), which needs attention to find k.

Run: python examples/albert.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import tied
from tied.nn import Embedding, LayerNorm, TransformerBlock

VOCAB, DIM, HEADS, DEPTH, SEQ, BATCH = 16, 32, 4, 6, 12, 32


@tied.register
class Albert:
    """Token and position embeddings, one block at `depth` places, a tied output head."""

    def __init__(self, *, key, depth: int = DEPTH):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedding(VOCAB, DIM, key=k1)
        self.pos = Embedding(SEQ, DIM, key=k2)
        block = TransformerBlock(DIM, HEADS, key=k3)
        self.blocks = [block] * depth
        self.ln = LayerNorm(DIM)

    def __call__(self, ids):
        h = self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.ln(h))


def batch(key):
    ks, kk = jax.random.split(key)
    start = jax.random.randint(ks, (BATCH, 1), 0, VOCAB)
    step = jax.random.randint(kk, (BATCH, 1), 1, 4)
    seq = (start + step * jnp.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model, ids, targets):
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def main(steps: int = 150, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    key, data_key = jax.random.split(jax.random.key(seed))
    model = Albert(key=key)
    unique, per_place = tied.param_count(model), tied.param_count(model, per_place=True)
    say(f"parameters: {unique:,} unique, {per_place:,} counted per place")
    say("the block's places:", tied.ties(model)[0])

    state = tied.optim.setup(optax.adam(3e-3), model)

    @tied.jit
    def step(model, state, ids, targets):
        loss, g = tied.value_and_grad(loss_fn)(model, ids, targets)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    make_batch, evaluate = jax.jit(batch), tied.jit(loss_fn)
    held_out = make_batch(jax.random.key(seed + 1000))
    before = float(evaluate(model, *held_out))
    for i in range(steps):
        model, state, loss = step(model, state, *make_batch(jax.random.fold_in(data_key, i)))
    after = float(evaluate(model, *held_out))
    shared = all(b is model.blocks[0] for b in model.blocks)
    say(f"held-out loss: {before:.3f} -> {after:.3f} after {steps} Adam steps")
    say(f"all {DEPTH} layers still hold one block object (`is`): {shared}")
    say(f"Adam moments hold {len(state.inner_state[0].mu)} arrays: one per unique parameter")
    return {
        "loss_before": before,
        "loss_after": after,
        "shared": shared,
        "unique": unique,
        "per_place": per_place,
        "model": model,
    }


if __name__ == "__main__":
    main()
