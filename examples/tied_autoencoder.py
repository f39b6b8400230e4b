"""A tied autoencoder: the decoder's weight is the encoder's weight transposed.

`Dense(tied.transpose(enc.weight))` puts a *view* at the decoder's place: only
the encoder's weight is a parameter. Its gradient is the total of both uses, the
gradient at the decoder's place is a view of that same object, and after each
Adam step the decoder reads the new encoder weight.

The data are generated: 512 points near a 3-dimensional subspace of R^10. A linear
autoencoder with tied weights learns that subspace, so its loss approaches the loss
of projecting onto the top 3 principal components (computed here with an SVD).

Run: python examples/tied_autoencoder.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense

N, D, K = 512, 10, 3


@tied.register
class TiedAutoEncoder:
    def __init__(self, d: int, k: int, *, key):
        self.enc = Dense(d, k, key=key, use_bias=False)
        self.dec = Dense(tied.transpose(self.enc.weight), jnp.zeros(d))

    def __call__(self, x):
        return self.dec(self.enc(x))


def make_data(key):
    kz, ka, kn = jax.random.split(key, 3)
    z = jax.random.normal(kz, (N, K))
    basis = jax.random.normal(ka, (K, D))
    x = z @ basis + 0.1 * jax.random.normal(kn, (N, D))
    return x - x.mean(0)


def loss_fn(model, x):
    return ((model(x) - x) ** 2).mean()


def main(steps: int = 300, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    kd, km = jax.random.split(jax.random.key(seed))
    x = make_data(kd)
    model = TiedAutoEncoder(D, K, key=km)
    say("ties:", tied.ties(model))
    say(f"parameters: {tied.param_count(model)} unique ({D}x{K} weight + {D} bias)")

    g = tied.grad(loss_fn)(model, x)
    grad_aliased = g.dec.weight.source is g.enc.weight
    say("g.dec.weight is a view of g.enc.weight:", grad_aliased)

    state = tied.optim.setup(optax.adam(2e-2), model)

    @tied.jit
    def step(model, state, x):
        loss, g = tied.value_and_grad(loss_fn)(model, x)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    before = float(loss_fn(model, x))
    for _ in range(steps):
        model, state, _ = step(model, state, x)
    after = float(loss_fn(model, x))

    # the best any rank-3 linear map can do: project onto the top principal components
    s = np.linalg.svd(np.asarray(x), compute_uv=False)
    pca = float((s[K:] ** 2).sum() / x.size)
    follows = model.dec.weight.source is model.enc.weight
    say(f"reconstruction loss: {before:.4f} -> {after:.4f} (PCA optimum {pca:.4f})")
    say("after training, the decoder still reads the encoder's weight (`is`):", follows)
    return {
        "loss_before": before,
        "loss_after": after,
        "pca": pca,
        "grad_aliased": grad_aliased,
        "follows": follows,
        "model": model,
    }


if __name__ == "__main__":
    main()
