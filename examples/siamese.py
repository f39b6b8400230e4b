"""A siamese network: one encoder object at two places, applied to the two inputs of a pair.

`Siamese(left=enc, right=enc)` holds the same encoder twice, so the model has one
encoder's parameters, `tied.grad` returns one gradient node at both places (the
sum of what each input contributed), and training keeps both sides one object.
The task: tell whether two noisy points come from the same one of 4 clusters, by
the distance between their embeddings (a contrastive loss).

Run: python examples/siamese.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import tied
from tied.nn import Chain, Dense

D, CLUSTERS, PAIRS, MARGIN = 8, 4, 256, 1.0


@tied.register
class Siamese:
    def __init__(self, left, right):
        self.left, self.right = left, right

    def __call__(self, a, b):
        return jnp.sqrt(((self.left(a) - self.right(b)) ** 2).sum(-1) + 1e-9)


def pairs(key, centers):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    ca = jax.random.randint(k1, (PAIRS,), 0, CLUSTERS)
    same = jax.random.bernoulli(k2, 0.5, (PAIRS,))
    cb = jnp.where(same, ca, (ca + jax.random.randint(k3, (PAIRS,), 1, CLUSTERS)) % CLUSTERS)
    a = centers[ca] + 0.6 * jax.random.normal(k4, (PAIRS, D))
    b = centers[cb] + 0.6 * jax.random.normal(k5, (PAIRS, D))
    return a, b, same


def loss_fn(model, a, b, same):
    d = model(a, b)
    return jnp.where(same, d**2, jax.nn.relu(MARGIN - d) ** 2).mean()


def accuracy(model, a, b, same):
    return float(((model(a, b) < MARGIN / 2) == same).mean())


def main(steps: int = 200, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    kc, k1, k2, kd = jax.random.split(jax.random.key(seed), 4)
    centers = 1.5 * jax.random.normal(kc, (CLUSTERS, D))
    enc = Chain(Dense(D, 16, key=k1, activation=jnp.tanh), Dense(16, 4, key=k2))
    model = Siamese(enc, enc)
    say(
        "ties:",
        tied.ties(model)[0],
        "| unique parameters:",
        tied.param_count(model),
        "| counted per place:",
        tied.param_count(model, per_place=True),
    )

    batch = jax.jit(lambda k: pairs(k, centers))
    test = batch(jax.random.key(seed + 1000))
    g = tied.jit(tied.grad(loss_fn))(model, *test)
    one_node = g.left is g.right
    say("g.left is g.right (one gradient node for the shared encoder):", one_node)

    state = tied.optim.setup(optax.adam(1e-2), model)

    @tied.jit
    def step(model, state, a, b, same):
        loss, g = tied.value_and_grad(loss_fn)(model, a, b, same)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    evaluate = tied.jit(loss_fn)
    before, acc_before = float(evaluate(model, *test)), accuracy(model, *test)
    for i in range(steps):
        model, state, _ = step(model, state, *batch(jax.random.fold_in(kd, i)))
    after, acc_after = float(evaluate(model, *test)), accuracy(model, *test)
    shared = model.left is model.right
    say(
        f"contrastive loss: {before:.3f} -> {after:.3f}; same/different accuracy on held-out "
        f"pairs: {acc_before:.0%} -> {acc_after:.0%}"
    )
    say("after training, model.left is model.right:", shared)
    return {
        "loss_before": before,
        "loss_after": after,
        "acc_before": acc_before,
        "acc_after": acc_after,
        "one_node": one_node,
        "shared": shared,
        "model": model,
    }


if __name__ == "__main__":
    main()
