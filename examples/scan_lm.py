"""A 12-block language model whose blocks are one `tied.Stack`, run with `tied.scan`.

The blocks are stacked (`tied.stack`: each weight one array with a leading axis of 12)
and run by `tied.scan`, so `tied.jit` traces and compiles one block, not twelve. The
output head is the input embedding (`Dense(embed.weight)`): one parameter, one gradient
(the total of both uses), one Adam state. After a short training run on the sonnets
shipped with `tied`, text is generated token by token with one `KVCache` per block,
stacked too: `tied.scan` hands block `i` its cache slice, the body writes it, and the
writes come out of the scan and out of the compiled step into the caller's caches.

Run: python examples/scan_lm.py
"""

from __future__ import annotations

from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense, Embedding, KVCache, LayerNorm, TransformerBlock

LAYERS, DIM, HEADS, SEQ, BATCH = 12, 32, 4, 32, 16


def load_text() -> str:
    return resources.files("tied").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@tied.register
class ScanLM:
    def __init__(self, vocab: int, *, key):
        keys = jax.random.split(key, LAYERS + 2)
        self.embed = Embedding(vocab, DIM, key=keys[0])
        self.pos = Embedding(SEQ, DIM, key=keys[1])
        self.blocks = tied.stack([TransformerBlock(DIM, HEADS, key=k) for k in keys[2:]])
        self.ln = LayerNorm(DIM)
        self.head = Dense(self.embed.weight)  # the tie: the same array, no bias

    def __call__(self, ids):
        h = self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))
        h, _ = tied.scan(lambda h, block, _: (block(h), None), h, self.blocks)
        return self.head(self.ln(h))

    def caches(self):
        """One empty cache per block, stacked (a new sequence)."""
        return tied.stack([KVCache(SEQ, HEADS, DIM // HEADS) for _ in range(len(self.blocks))])

    def decode(self, ids, caches):
        """``self(all_ids)`` at the new positions ``ids`` only; the earlier ones are in ``caches``."""
        start = caches.member.position.value[0]
        h = self.embed(ids) + self.pos(start + jnp.arange(ids.shape[-1]))

        def step(h, layer, _):
            block, cache = layer  # block i and its own cache, written in place
            return block.decode(h, cache), None

        h, _ = tied.scan(step, h, (self.blocks, caches))
        return self.head(self.ln(h))


def generate(model, prompt_ids, key, temperature=0.8):
    """The prompt and sampled tokens up to SEQ, one token per call of one compiled step;
    also the prompt's logits as decoded, to compare with a full forward pass."""
    compiles = []

    @tied.jit
    def step(model, caches, token, key):
        compiles.append(1)
        logits = model.decode(token[None], caches)[-1]  # the stacked caches are written
        return jax.random.categorical(key, logits / temperature), logits

    caches = model.caches()
    ids, prompt_logits = list(prompt_ids), []
    for i, token in enumerate(ids):
        nxt, logits = step(model, caches, jnp.int32(token), jax.random.fold_in(key, i))
        prompt_logits.append(logits)
    while len(ids) < SEQ:
        ids.append(int(nxt))
        if len(ids) < SEQ:
            nxt, _ = step(model, caches, jnp.int32(ids[-1]), jax.random.fold_in(key, len(ids)))
    return ids, len(compiles), jnp.stack(prompt_logits), caches


def loss_fn(model, ids, targets):
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def main(steps: int = 40, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    text = load_text()
    chars = sorted(set(text))
    data = jnp.asarray(np.array([chars.index(c) for c in text], dtype=np.int32))
    key, data_key = jax.random.split(jax.random.key(seed))
    model = ScanLM(len(chars), key=key)
    say(f"{LAYERS} blocks stacked: {model.blocks}, qkv weights {model.blocks.member.attn.qkv.weight.shape}")

    @jax.jit
    def batch(key):
        starts = jax.random.randint(key, (BATCH,), 0, data.shape[0] - SEQ - 1)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (SEQ + 1,)))(starts)
        return windows[:, :-1], windows[:, 1:]

    state = tied.optim.setup(optax.adam(3e-3), model)
    traces = []

    @tied.jit
    def train_step(model, state, ids, targets):
        traces.append(1)
        loss, g = tied.value_and_grad(loss_fn)(model, ids, targets)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss, g.head.weight is g.embed.weight

    evaluate = tied.jit(loss_fn)
    eval_batch = batch(jax.random.key(seed + 1000))
    before = float(evaluate(model, *eval_batch))
    one_gradient = True
    for i in range(steps):
        model, state, loss, same = train_step(model, state, *batch(jax.random.fold_in(data_key, i)))
        one_gradient &= bool(same)
    after = float(evaluate(model, *eval_batch))
    still_tied = model.head.weight is model.embed.weight
    say(f"loss: {before:.3f} -> {after:.3f} nats/char after {steps} steps ({len(traces)} trace)")
    say("one gradient for the tied head and embedding:", one_gradient, "| still tied:", still_tied)
    prompt = "Shall I "
    prompt_ids = [chars.index(c) for c in prompt]
    ids, compiles, decoded, caches = generate(model, prompt_ids, jax.random.key(seed + 1))
    full = model(jnp.asarray(prompt_ids))
    matches = bool(jnp.allclose(decoded, full, atol=1e-4))
    text = "".join(chars[i] for i in ids)
    say(f"generated with 12 stacked KV caches ({compiles} compile): {text!r}")
    say("the cached decode equals the full forward pass on the prompt:", matches)
    return {
        "loss_before": before,
        "loss_after": after,
        "one_gradient": one_gradient,
        "still_tied": still_tied,
        "text": text,
        "generate_compiles": compiles,
        "train_traces": len(traces),
        "decode_matches_forward": matches,
        "positions": np.asarray(caches.member.position.value),
        "model": model,
    }


if __name__ == "__main__":
    main()
