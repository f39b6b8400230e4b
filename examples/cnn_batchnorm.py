"""A small CNN with a shared convolution block, BatchNorm and Dropout.

The images are generated (no download): 12x12 stripes at four orientations
(horizontal, vertical, and the two diagonals), with a random frequency, phase and
noise. One residual block (a `Conv2d` and a `BatchNorm`) is applied twice: one
set of weights and one set of running statistics, which move twice per step, in
call order. `Dropout` draws from one `tied.Rng`. The training step is written as
it would be eagerly; `tied.jit` writes the new statistics and the stream's counter
back into the model after each call. `tied.nn.mode(model, False)` gives the eval
model: the running statistics, no dropout, the same arrays and state objects.

Run: python examples/cnn_batchnorm.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import BatchNorm, Chain, Conv2d, Dense, Dropout

SIZE, CLASSES, WIDTH = 12, 4, 8


def stripes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (n, 12, 12, 1) of stripes and their orientation (0..3)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    directions = [(0, 1), (1, 0), (1, 1), (1, -1)]  # which coordinate the stripes follow
    images = np.empty((n, SIZE, SIZE, 1), np.float32)
    for i, c in enumerate(labels):
        a, b = directions[c]
        freq = rng.uniform(0.6, 1.4)
        wave = np.sin(freq * (a * xx + b * yy) + rng.uniform(0, 2 * np.pi))
        images[i, ..., 0] = wave + rng.normal(0, 0.8, (SIZE, SIZE))
    return images, labels.astype(np.int32)


@tied.register
class Residual:
    def __init__(self, block):
        self.block = block

    def __call__(self, x):
        return x + jax.nn.relu(self.block(x))


@tied.register
class CNN:
    def __init__(self, key, rng):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = Chain(
            Conv2d(1, WIDTH, 3, padding=1, key=k1, use_bias=False), BatchNorm(WIDTH), jax.nn.relu
        )
        shared = Residual(Chain(Conv2d(WIDTH, WIDTH, 3, padding=1, key=k2), BatchNorm(WIDTH)))
        self.blocks = [shared, shared]  # one block (weights and statistics), two places
        self.dropout = Dropout(0.2, rng)
        self.head = Dense(WIDTH, CLASSES, key=k3)

    def __call__(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.dropout(h.mean(axis=(1, 2))))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def main(steps: int = 150, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    x_train, y_train = stripes(2048, seed)
    x_test, y_test = stripes(512, seed + 1)
    model = CNN(jax.random.key(seed), tied.Rng(seed + 1))
    bn = model.blocks[0].block.layers[1]
    say(f"ties: {tied.ties(model)}")
    say(f"{tied.param_count(model):,} parameters; state: running statistics and a dropout stream")

    tx = optax.adam(3e-3)
    state = tied.optim.setup(tx, model)

    @tied.jit
    def step(model, state, x, y):
        loss, grads = tied.value_and_grad(loss_fn)(model, x, y)
        model, state = tied.optim.update(state, model, grads)
        return model, state, loss

    predict = tied.jit(lambda m, x: jnp.argmax(m(x), axis=-1))

    def accuracy(m, x, y):
        return float(np.mean(np.asarray(predict(m, jnp.asarray(x))) == y))

    rng = np.random.default_rng(seed + 2)
    for i in range(steps):
        idx = rng.integers(0, len(x_train), 64)
        model, state, loss = step(model, state, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))
        if verbose and (i + 1) % 50 == 0:
            say(f"step {i + 1}: loss {float(loss):.3f}")
    bn = model.blocks[0].block.layers[1]
    # the eval model shares every array and state object: its statistics are the trained ones
    evaluation = tied.nn.mode(model, False)
    calls = int(bn.num_batches_tracked.value)
    draws = int(model.dropout.rng.count.value)
    acc_eval = accuracy(evaluation, x_test, y_test)
    acc_eval_train_set = accuracy(evaluation, x_train[:512], y_train[:512])
    unchanged = (int(bn.num_batches_tracked.value), int(model.dropout.rng.count.value)) == (calls, draws)
    acc_train_mode = accuracy(model, x_test, y_test)  # batch statistics and dropout (and updates)
    say(f"the shared BatchNorm was updated {calls} times in {steps} steps (twice per step)")
    say(f"test accuracy in train mode (batch statistics, dropout): {acc_train_mode:.1%}")
    say(
        f"test accuracy in eval mode (running statistics, no dropout): {acc_eval:.1%} "
        f"(training images: {acc_eval_train_set:.1%}); chance is {1 / CLASSES:.0%}"
    )
    return {
        "updates": calls,
        "acc_train_mode": acc_train_mode,
        "acc_eval": acc_eval,
        "acc_eval_train_set": acc_eval_train_set,
        "eval_shares_state": evaluation.blocks[0].block.layers[1].running_mean is bn.running_mean,
        "eval_counted_nothing": unchanged,
        "dropout_draws": draws,
        "shared": model.blocks[0] is model.blocks[1],
        "model": model,
    }


if __name__ == "__main__":
    main()
