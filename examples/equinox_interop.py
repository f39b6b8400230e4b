"""An Equinox model that reuses one `eqx.nn.Linear`, trained with `tied`, tie kept.

`Net(first, hidden, hidden, out)` holds the same Linear at two fields. Equinox
sees a pytree, so for it the two fields are two copies: `eqx.filter_grad` gives
each its own partial gradient, an optax step moves them apart, and after training
`model.hidden` and `model.again` are different layers with different weights
(Equinox's FAQ calls this reuse "buggy code" and offers `eqx.nn.Shared`).

`tied` walks the same module as a DAG: one parameter set, one gradient node at
both fields (the sum of Equinox's two per-field partials), one Adam state, one
entry in a checkpoint, and after training and a save/load round trip
`model.hidden is model.again`.

Run: python examples/equinox_interop.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import tied

N, D, H = 128, 4, 16


class Net(eqx.Module):
    first: eqx.nn.Linear
    hidden: eqx.nn.Linear
    again: eqx.nn.Linear  # the same object as `hidden`
    out: eqx.nn.Linear

    def __call__(self, x):  # one example, as Equinox layers take it
        h = jnp.tanh(self.first(x))
        h = jnp.tanh(self.hidden(h))
        h = jnp.tanh(self.again(h))
        return self.out(h)[0]


def make_model(key):
    k1, k2, k3 = jax.random.split(key, 3)
    shared = eqx.nn.Linear(H, H, key=k2)
    return Net(eqx.nn.Linear(D, H, key=k1), shared, shared, eqx.nn.Linear(H, 1, key=k3))


def loss_fn(model, x, y):
    return ((jax.vmap(model)(x) - y) ** 2).mean()


def train_tied(model, x, y, steps):
    state = tied.optim.setup(optax.adam(1e-2), model)

    @tied.jit
    def step(model, state):
        loss, g = tied.value_and_grad(loss_fn)(model, x, y)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    for _ in range(steps):
        model, state, _ = step(model, state)
    return model, state


def train_plain_equinox(model, x, y, steps):
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        loss, g = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = opt.update(g, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    for _ in range(steps):
        model, state, _ = step(model, state)
    return model, state


def main(steps: int = 200, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    kx, km = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (N, D))
    y = jnp.sin(x @ jnp.arange(1.0, D + 1) / D)
    model = make_model(km)
    say("ties found by tied:", tied.ties(model)[0])
    say(
        f"parameters: {tied.param_count(model)} unique, "
        f"{tied.param_count(model, per_place=True)} counted per place"
    )

    g = tied.grad(loss_fn)(model, x, y)
    one_node = g.hidden is g.again
    # Equinox sees two fields, so its gradient has one partial per field; tied's is their sum
    parts = eqx.filter_grad(loss_fn)(model, x, y)
    total_gap = float(jnp.abs(parts.hidden.weight + parts.again.weight - g.hidden.weight).max())
    say(
        f"tied.grad: g.hidden is g.again (one total for the reused Linear): {one_node}; it is "
        f"the sum of Equinox's two per-field partials (max difference {total_gap:.1e})"
    )

    before = float(loss_fn(model, x, y))
    trained, state = train_tied(model, x, y, steps)
    after = float(loss_fn(trained, x, y))
    kept = trained.hidden is trained.again
    say(f"tied + optax.adam: loss {before:.4f} -> {after:.4f}; trained.hidden is trained.again: {kept}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "eqx.safetensors"
        tied.save(path, (trained, state))
        back, _ = tied.load(path, like=(trained, state))
    reloaded = back.hidden is back.again and float(loss_fn(back, x, y)) == after
    say(f"tied.save / tied.load: back.hidden is back.again and the same loss: {reloaded}")

    plain, plain_state = train_plain_equinox(model, x, y, steps)
    gap = float(jnp.abs(plain.hidden.weight - plain.again.weight).max())
    plain_states = len(jax.tree_util.tree_leaves(plain_state[0].mu))
    tied_states = len(tied.flatten(model)[0])
    say(
        f"plain Equinox + optax.adam: loss {before:.4f} -> {float(loss_fn(plain, x, y)):.4f}; "
        f"plain.hidden is plain.again: {plain.hidden is plain.again}; the two copies' weights "
        f"now differ by up to {gap:.3f}; Adam moment arrays: {plain_states} (tied: {tied_states})"
    )
    return {
        "loss_before": before,
        "loss_after": after,
        "one_node": one_node,
        "total_gap": total_gap,
        "kept": kept,
        "reloaded": reloaded,
        "plain_broken": plain.hidden is not plain.again and gap > 0,
        "plain_states": plain_states,
        "tied_states": tied_states,
    }


if __name__ == "__main__":
    main()
