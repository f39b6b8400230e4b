"""Training that survives being killed: a `tied.CheckpointManager` saves every few steps in the
background and a restarted run resumes from the latest complete step, bit for bit.

The model is a small character LM whose output head is its input embedding
(`Dense(embed.weight)`: one array at two places), with dropout drawn from a
`tied.Rng`. What is saved is everything the run depends on: the model, the Adam
state of `tied.optim` and the random stream (its key and its counter, a state
cell). The batch of step ``s`` is a function of ``s``, so a resumed run replays
the same data. Killed at any moment (even in the middle of a save) and started
again, the run ends with exactly the arrays of a run that was never killed.

Run:
    python examples/resumable_training.py --dir /tmp/run                # trains 40 steps
    python examples/resumable_training.py --dir /tmp/run2 --kill-at 13  # dies (SIGKILL) after step 13
    python examples/resumable_training.py --dir /tmp/run2               # resumes from step 10
"""

from __future__ import annotations

import argparse
import os
import signal
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense, Embedding, LayerNorm

DIM, SEQ, BATCH, RATE = 32, 16, 8, 0.1
TX = optax.adam(3e-3)


@tied.register
class TiedLM:
    def __init__(self, vocab: int, *, key):
        k1, k2 = jax.random.split(key)
        self.embed = Embedding(vocab, DIM, key=k1)
        self.mix = Dense(DIM, DIM, key=k2)
        self.ln = LayerNorm(DIM)
        self.head = Dense(self.embed.weight)  # the tie: the embedding's own array

    def __call__(self, ids, key):
        h = jnp.tanh(self.mix(self.embed(ids)))
        keep = jax.random.bernoulli(key, 1 - RATE, h.shape)  # dropout
        return self.head(self.ln(jnp.where(keep, h / (1 - RATE), 0.0)))


def corpus() -> tuple[np.ndarray, int]:
    text = resources.files("tied").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    return np.array([chars.index(c) for c in text], dtype=np.int32), len(chars)


def batch(data: np.ndarray, step: int) -> np.ndarray:
    """The batch of ``step``: a function of the step alone, so a resumed run sees the same data."""
    starts = np.random.default_rng(step).integers(0, len(data) - SEQ - 1, BATCH)
    return np.stack([data[s : s + SEQ + 1] for s in starts])


def loss_fn(model, ids, targets, key):
    logp = jax.nn.log_softmax(model(ids, key))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _train_step(model, opt, ids, key):
    loss, grads = tied.value_and_grad(loss_fn)(model, ids[:, :-1], ids[:, 1:], key)
    model, opt = tied.optim.update(opt, model, grads)
    return model, opt, loss


# The old model and optimiser state are donated: the step reuses their buffers. That is safe
# while a save of them is in flight, since `save` returns only once it has copied them.
train_step = tied.jit(_train_step, donate_argnums=(0, 1))


def init(vocab: int, seed: int = 0) -> dict:
    model = TiedLM(vocab, key=jax.random.key(seed))
    rng = tied.Rng(jax.random.PRNGKey(seed + 1))  # a raw uint32 key: plain data to save
    return {"model": model, "opt": tied.optim.setup(TX, model), "rng": rng}


def main(
    directory: str,
    steps: int = 40,
    save_every: int = 5,
    kill_at: int | None = None,
    out: str | None = None,
    verbose: bool = True,
) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    data, vocab = corpus()
    run = init(vocab)
    with tied.CheckpointManager(directory, max_to_keep=2, save_interval_steps=save_every) as mngr:
        start = mngr.latest_step() or 0
        if start:
            run = mngr.restore(run)  # every tie restored: the head is the embedding again
            say(f"resumed from step {start} (loss then {mngr.metadata()['loss']:.4f})")
        assert run["model"].head.weight is run["model"].embed.weight
        model, opt, rng = run["model"], run["opt"], run["rng"]
        loss = None
        for step in range(start, steps):
            model, opt, loss = train_step(model, opt, jnp.asarray(batch(data, step)), rng())
            state = {"model": model, "opt": opt, "rng": rng}
            if mngr.save(step + 1, state, {"loss": float(loss)}):
                say(f"step {step + 1}: loss {float(loss):.4f}, saving in the background")
            if kill_at == step + 1:
                say(f"killed at step {step + 1} (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait()
        say(f"done: {steps} steps; complete steps kept: {mngr.all_steps()}")
    final = {"model": model, "opt": opt, "rng": rng}
    if out:
        leaves, _ = tied.flatten(final)
        np.savez(out, *[np.asarray(x) for x in leaves])
    return final


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/resumable", help="the checkpoint directory")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after this step")
    p.add_argument("--out", default=None, help="write the final arrays to this .npz")
    a = p.parse_args()
    main(a.dir, a.steps, a.save_every, a.kill_at, a.out)
