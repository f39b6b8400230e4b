"""A recurrent network: one cell applied at every time step, by a Python loop and by `lax.scan`.

* `Unrolled` holds the cell once per time step (`cells = [cell] * T`, one object at
  T places) and loops over it in Python; `tied.grad` returns one gradient node at
  all T places, the total over the steps.
* `Scanned` holds the cell once and runs it with `jax.lax.scan`; JAX sums the
  steps' contributions inside the scan.

Both give the same outputs and the same cell gradient. Then the scanned model
learns to output the running mean of its input sequence.

Run: python examples/rnn.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense

T, HIDDEN, BATCH = 12, 16, 32


@tied.register
class Cell:
    """h' = tanh(W_x x + W_h h + b)."""

    def __init__(self, n_in: int, n_hidden: int, *, key):
        kx, kh = jax.random.split(key)
        self.wx = Dense(n_in, n_hidden, key=kx)
        self.wh = Dense(n_hidden, n_hidden, key=kh, use_bias=False)

    def __call__(self, h, x):
        return jnp.tanh(self.wx(x) + self.wh(h))


@tied.register
class Unrolled:
    def __init__(self, cell, readout, steps: int):
        self.cells = [cell] * steps
        self.readout = readout

    def __call__(self, xs):  # xs: (batch, T, 1)
        h = jnp.zeros((xs.shape[0], self.readout.in_size))
        outs = []
        for t, cell in enumerate(self.cells):
            h = cell(h, xs[:, t])
            outs.append(self.readout(h))
        return jnp.stack(outs, axis=1)


@tied.register
class Scanned:
    def __init__(self, cell, readout):
        self.cell, self.readout = cell, readout

    def __call__(self, xs):
        h0 = jnp.zeros((xs.shape[0], self.readout.in_size))

        def step(h, x):
            h = self.cell(h, x)
            return h, self.readout(h)

        _, outs = jax.lax.scan(step, h0, jnp.swapaxes(xs, 0, 1))
        return jnp.swapaxes(outs, 0, 1)


def sequences(key):
    xs = jax.random.uniform(key, (BATCH, T, 1), minval=-1.0, maxval=1.0)
    running_mean = jnp.cumsum(xs, axis=1) / jnp.arange(1, T + 1)[:, None]
    return xs, running_mean


def loss_fn(model, xs, ys):
    return ((model(xs) - ys) ** 2).mean()


def main(steps: int = 200, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    kc, kr, kd = jax.random.split(jax.random.key(seed), 3)
    cell, readout = Cell(1, HIDDEN, key=kc), Dense(HIDDEN, 1, key=kr)
    unrolled, scanned = Unrolled(cell, readout, T), Scanned(cell, readout)
    say(
        f"the unrolled model holds one cell at {len(tied.ties(unrolled)[0])} places; "
        f"unique parameters: {tied.param_count(unrolled)} (per place: "
        f"{tied.param_count(unrolled, per_place=True)})"
    )

    batch = jax.jit(sequences)
    xs, ys = batch(jax.random.key(seed + 1000))
    same_output = bool(
        jnp.allclose(
            tied.jit(lambda m, x: m(x))(unrolled, xs), tied.jit(lambda m, x: m(x))(scanned, xs), atol=1e-5
        )
    )
    gu = tied.jit(tied.grad(loss_fn))(unrolled, xs, ys)
    gs = tied.jit(tied.grad(loss_fn))(scanned, xs, ys)
    one_node = all(c is gu.cells[0] for c in gu.cells)
    same_grad = bool(np.allclose(gu.cells[0].wh.weight, gs.cell.wh.weight, rtol=1e-4, atol=1e-6))
    say("loop and scan give the same outputs:", same_output)
    say(
        f"loop: one gradient node at all {T} places: {one_node}; equal to the scan's "
        f"gradient of the cell: {same_grad}"
    )

    state = tied.optim.setup(optax.adam(1e-2), scanned)

    @tied.jit
    def step(model, state, xs, ys):
        loss, g = tied.value_and_grad(loss_fn)(model, xs, ys)
        model, state = tied.optim.update(state, model, g)
        return model, state, loss

    evaluate = tied.jit(loss_fn)
    before = float(evaluate(scanned, xs, ys))
    for i in range(steps):
        scanned, state, _ = step(scanned, state, *batch(jax.random.fold_in(kd, i)))
    after = float(evaluate(scanned, xs, ys))
    say(f"scanned RNN, running-mean task: held-out loss {before:.4f} -> {after:.4f}")

    # the trained cell dropped into the unrolled model: T places, one object, same answers
    trained = Unrolled(scanned.cell, scanned.readout, T)
    agree = bool(jnp.allclose(trained(xs), scanned(xs), atol=1e-5))
    say("the trained cell in the loop model gives the same predictions:", agree)
    return {
        "same_output": same_output,
        "one_node": one_node,
        "same_grad": same_grad,
        "loss_before": before,
        "loss_after": after,
        "agree": agree,
    }


if __name__ == "__main__":
    main()
