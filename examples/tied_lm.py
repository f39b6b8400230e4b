"""A language model whose output head is its input embedding.

`head = Dense(embed.weight)` puts the embedding's own array at the head's place
(a Dense holds (out, in) = (vocab, dim), the embedding's layout). It is one
parameter: one gradient object stands at both places, summed over both uses,
and Adam keeps one state for it. A character-level model on the sonnets shipped
with `tied` (`tied/data/corpus.txt`) for a few seconds, then text generated token
by token with a key/value cache (`tied.nn.KVCache`): one compiled step, whose
cache writes `tied.jit` carries back into the caller's cache.

Run: python examples/tied_lm.py
"""

from __future__ import annotations

from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense, Embedding, LayerNorm, TransformerBlock

DIM, HEADS, SEQ, BATCH = 32, 4, 32, 16


def load_text() -> str:
    return resources.files("tied").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@tied.register
class TiedLM:
    def __init__(self, vocab: int, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedding(vocab, DIM, key=k1)
        self.pos = Embedding(SEQ, DIM, key=k2)
        self.block = TransformerBlock(DIM, HEADS, key=k3)
        self.ln = LayerNorm(DIM)
        self.head = Dense(self.embed.weight)  # the tie: the same array, no bias

    def __call__(self, ids):
        h = self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))
        return self.head(self.ln(self.block(h)))

    def decode(self, ids, cache):
        """``self(all_ids)`` at the new positions ``ids`` only; the earlier ones are in ``cache``."""
        start = cache.position.value
        h = self.embed(ids) + self.pos(start + jnp.arange(ids.shape[-1]))
        return self.head(self.ln(self.block.decode(h, cache)))


def generate(model, prompt_ids, key, temperature=0.8):
    """The prompt and sampled tokens up to SEQ, one token per call of one compiled step."""
    compiles = []

    @tied.jit
    def step(model, cache, token, key):
        compiles.append(1)
        logits = model.decode(token[None], cache)[-1]  # the cache is written in place
        return jax.random.categorical(key, logits / temperature)

    cache = model.block.attn.cache(SEQ)  # a new sequence, a new cache
    ids = list(prompt_ids)
    for i, token in enumerate(ids):
        nxt = step(model, cache, jnp.int32(token), jax.random.fold_in(key, i))
    while len(ids) < SEQ:
        ids.append(int(nxt))
        if len(ids) < SEQ:
            nxt = step(model, cache, jnp.int32(ids[-1]), jax.random.fold_in(key, len(ids)))
    return ids, len(compiles)


def loss_fn(model, ids, targets):
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def main(steps: int = 150, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    text = load_text()
    chars = sorted(set(text))
    data = jnp.asarray(np.array([chars.index(c) for c in text], dtype=np.int32))
    key, data_key = jax.random.split(jax.random.key(seed))
    model = TiedLM(len(chars), key=key)
    say(f"{len(text):,} characters, vocabulary {len(chars)}; ties: {tied.ties(model)}")

    @jax.jit
    def batch(key):
        starts = jax.random.randint(key, (BATCH,), 0, data.shape[0] - SEQ - 1)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (SEQ + 1,)))(starts)
        return windows[:, :-1], windows[:, 1:]

    g = tied.jit(tied.grad(loss_fn))(model, *batch(data_key))
    one_gradient = g.head.weight is g.embed.weight
    say("g.head.weight is g.embed.weight (one gradient, the total of both uses):", one_gradient)

    state = tied.optim.setup(optax.adam(3e-3), model)

    @tied.jit
    def step(model, state, ids, targets):
        loss, g = tied.value_and_grad(loss_fn)(model, ids, targets)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    evaluate = tied.jit(loss_fn)
    eval_batch = batch(jax.random.key(seed + 1000))
    before = float(evaluate(model, *eval_batch))
    for i in range(steps):
        model, state, loss = step(model, state, *batch(jax.random.fold_in(data_key, i)))
    after = float(evaluate(model, *eval_batch))
    still_tied = model.head.weight is model.embed.weight
    say(
        f"loss: {before:.3f} -> {after:.3f} nats/char after {steps} steps "
        f"(uniform guessing: {np.log(len(chars)):.3f})"
    )
    say("after training, model.head.weight is model.embed.weight:", still_tied)
    prompt = "Shall I "
    ids, compiles = generate(model, [chars.index(c) for c in prompt], jax.random.key(seed + 1))
    text = "".join(chars[i] for i in ids)
    say(f"generated with a KV cache ({compiles} compile): {text!r}")
    return {
        "loss_before": before,
        "loss_after": after,
        "one_gradient": one_gradient,
        "still_tied": still_tied,
        "text": text,
        "generate_compiles": compiles,
        "model": model,
    }


if __name__ == "__main__":
    main()
