"""Optax masks and labels by path, on a model with a tied embedding.

`tied.optim` shows optax a flat dict from the path of each unique trainable
array's first place to the array, so masks and labels are the ordinary optax
functions of that dict, as in optax's documentation. Here a small next-token
model whose output head is its embedding's own array is trained with:

- weight decay on the ``weight`` arrays only, except the LayerNorm's
  (``optax.masked`` by path);
- its own learning rate for the embedding (``optax.multi_transform`` labels by path);
- the embedding frozen for the first half through the *head's* path (a tie is one
  parameter, so freezing one place freezes all), then thawed;
- a running-mean buffer kept out of the optimiser with ``trainable=``.

Run: python examples/optax_by_path.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import tied
from tied.nn import Dense, Embedding, LayerNorm

VOCAB, DIM, BATCH = 16, 16, 64


@tied.register
class TinyLM:
    """Embed a token, one residual MLP step, predict the next token with the embedding."""

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.embed = Embedding(VOCAB, DIM, key=k1)
        self.ln = LayerNorm(DIM)
        self.mlp = Dense(DIM, DIM, key=k2, activation=jnp.tanh)
        self.head = Dense(self.embed.weight)  # the output head is the embedding's array
        self.stats = self.embed.weight.mean(0)  # a running mean: data, not a parameter

    def __call__(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(self.ln(h - self.stats))
        return self.head(h)


def loss_fn(model, ids):
    # the task: the next token is (t * 5 + 3) mod VOCAB
    logits = model(ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, (ids * 5 + 3) % VOCAB).mean()


def decay_mask(params: dict) -> dict:
    return {k: k.endswith("weight") and not k.startswith(".ln") for k in params}


def labels(params: dict) -> dict:
    return {k: "embed" if k.startswith(".embed") else "rest" for k in params}


def not_a_buffer(path: str, x) -> bool:
    return path != ".stats"


def main(steps: int = 120, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    model = TinyLM(key=jax.random.key(seed))
    say("ties:", tied.ties(model))

    tx = optax.chain(
        optax.masked(optax.add_decayed_weights(1e-3), decay_mask),
        optax.multi_transform({"embed": optax.adam(3e-2), "rest": optax.adam(1e-2)}, labels),
    )
    state = tied.optim.setup(tx, model, trainable=not_a_buffer)
    keys = list(state.paths)
    say("what optax sees (one key per unique trainable array):", keys)
    say("decay mask:", decay_mask(dict.fromkeys(keys)))
    say("labels:    ", labels(dict.fromkeys(keys)))
    say(
        "Adam moments of the embedding are stored under:",
        [k for k in state.inner_state[1].inner_states["embed"].inner_state[0].mu if k.startswith(".embed")],
    )

    # Freeze the tied embedding through the head's place: one parameter, frozen everywhere.
    state = tied.optim.freeze(state, ".head.weight")
    say("frozen:", list(state.frozen))

    @tied.jit
    def step(model, state, ids):
        loss, g = tied.value_and_grad(loss_fn, trainable=not_a_buffer)(model, ids)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    ids_test = jnp.arange(VOCAB)
    stats, embed0 = model.stats, model.embed.weight
    before = float(loss_fn(model, ids_test))
    frozen_kept = True
    for i in range(steps):
        if i == steps // 2:
            frozen_kept = bool(jnp.array_equal(model.embed.weight, embed0))
            state = tied.optim.thaw(state, ".embed.weight")
            say(f"step {i}: embedding unchanged while frozen: {frozen_kept}; thawed")
        ids = jax.random.randint(jax.random.fold_in(jax.random.key(seed + 1), i), (BATCH,), 0, VOCAB)
        model, state, loss = step(model, state, ids)
    after = float(loss_fn(model, ids_test))
    tied_kept = model.head.weight is model.embed.weight
    buffer_kept = bool(jnp.array_equal(model.stats, stats))
    embed_moved = not bool(jnp.array_equal(model.embed.weight, embed0))
    say(f"loss on every token: {before:.3f} -> {after:.3f}")
    say("model.head.weight is model.embed.weight:", tied_kept)
    say("the running-mean buffer did not move:", buffer_kept)
    say("the embedding trained after the thaw:", embed_moved)
    return {
        "keys": keys,
        "loss_before": before,
        "loss_after": after,
        "tied": tied_kept,
        "buffer_kept": buffer_kept,
        "frozen_kept": frozen_kept,
        "embed_moved": embed_moved,
        "model": model,
        "state": state,
    }


if __name__ == "__main__":
    main()
