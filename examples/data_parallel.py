"""A tied language model trained on every local device, by JAX's own sharding.

The model's output head is its input embedding (one `tied.nn.Embedding` at two
places, `embed` and `head`, used by lookup and by `attend`). Two layouts:

1. Data parallel (`tied.data_parallel`): parameters and Adam state replicated on
   every device, the batch split over them; JAX all-reduces the gradients. The
   shared embedding is one replicated array and gets one total gradient.
2. Vocabulary-sharded embedding: the embedding's rows (and its Adam moments)
   split over the devices, everything else replicated. Input lookup and output
   head read the same sharded array: stored once over all devices.

Each run is compared with the same steps on one device, and the ties are checked
after every step (`is`).

Run:
    python examples/data_parallel.py                       # the devices you have
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tied
from tied.nn import Embedding, LayerNorm, TransformerBlock

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16

# Adam's eps is raised from 1e-8: the attention's key bias has a gradient that is zero
# up to rounding, and Adam turns that noise into steps of +-lr whose sign depends on the
# order of summation (one device or several). The comparison is then about sharding.
TX = optax.adam(3e-3, eps=1e-5)


@tied.register
class TiedLM:
    """Token and position embeddings, transformer blocks, and the embedding as the head."""

    def __init__(self, *, key, blocks: int = 2):
        keys = jax.random.split(key, blocks + 2)
        self.embed = Embedding(VOCAB, DIM, key=keys[0])
        self.pos = Embedding(SEQ, DIM, key=keys[1])
        self.blocks = [TransformerBlock(DIM, HEADS, key=k) for k in keys[2:]]
        self.ln = LayerNorm(DIM)
        self.head = self.embed  # the tie: the same Embedding, read by attend

    def __call__(self, ids):
        h = self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            h = block(h)
        return self.head.attend(self.ln(h))


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def train_step(model, state, batch):
    loss, grads = tied.value_and_grad(loss_fn)(model, batch)
    model, state = tied.optim.update(state, model, grads)
    return model, state, loss


def make_batches(steps: int, batch: int, seed: int) -> np.ndarray:
    """Arithmetic sequences mod VOCAB (start and stride random): learnable in a few steps."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (steps, batch, 1))
    stride = rng.integers(1, 4, (steps, batch, 1))
    return ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def ties_hold(model, state) -> bool:
    params = [x for x in tied.flatten(model)[0] if tied.is_param(x)]
    return (
        model.head is model.embed
        and model.head.weight is model.embed.weight
        and len(state.paths) == len(params)  # one optimiser entry per unique parameter
        and not any(a is p for a in jax.tree_util.tree_leaves(state) for p in params)  # no copies
    )


def max_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(tied.flatten(a)[0], tied.flatten(b)[0]))


def train(step, model, state, batches, put_batch=lambda b: b):
    times, ties = [], True
    for batch in batches:
        t = time.perf_counter()
        model, state, loss = step(model, state, put_batch(batch))
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
        ties = ties and ties_hold(model, state)
    return model, state, float(loss), times, ties


def main(steps: int = 20, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    devices = jax.local_devices()
    n = len(devices)
    batches = make_batches(steps, 4 * n, seed)

    @jax.jit
    def init(key):  # one compilation for the whole initialisation
        model = TiedLM(key=key)
        return tied.Graph((model, tied.optim.setup(TX, model)))

    model, state = init(jax.random.key(seed)).value
    say(f"{n} device(s): {devices}")
    say(f"tied: {' and '.join(tied.ties(model)[0])} are one Embedding")

    # The reference: the same steps on one device, no shardings.
    ref_model, _, ref_loss, ref_times, _ = train(tied.jit(train_step), model, state, batches)
    first_loss = float(tied.jit(loss_fn)(model, batches[0]))
    say(
        f"one device:      loss {first_loss:.3f} -> {ref_loss:.3f}, "
        f"{1e3 * np.median(ref_times[1:] or ref_times):.1f} ms/step"
    )

    # 1. Data parallel over every device.
    dp = tied.data_parallel(Mesh(np.array(devices), ("data",)))
    say(f"data parallel:   {dp.mesh}")
    dp_step = tied.jit(
        train_step,
        in_shardings=(dp.replicated, dp.replicated, dp.batch),
        out_shardings=dp.replicated,
    )
    placed = tied.device_put((model, state), dp.replicated)
    dp_model, dp_state, dp_loss, dp_times, dp_ties = train(
        dp_step, *placed, batches, put_batch=lambda b: tied.device_put(b, dp.batch)
    )
    dp_diff = max_difference(dp_model, ref_model)
    say(
        f"                 loss -> {dp_loss:.3f}, first step (compiling) {dp_times[0]:.2f} s, then "
        f"{1e3 * np.median(dp_times[1:] or dp_times):.1f} ms/step"
    )
    say(
        f"                 ties held after every step: {dp_ties}; "
        f"max |params - one-device params| = {dp_diff:.1e}"
    )

    # 2. The tied embedding split by vocabulary rows over every device (that divides VOCAB).
    mesh = Mesh(np.array(devices[: math.gcd(n, VOCAB)]), ("model",))
    rep = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("model", None))

    def rule(path, x):  # the embedding and its Adam moments by rows, the rest replicated
        return rows if x.shape == (VOCAB, DIM) else rep

    model_specs, state_specs = tied.sharding_tree((model, state), rule)
    vs_step = tied.jit(
        train_step,
        in_shardings=(model_specs, state_specs, rep),
        out_shardings=(model_specs, state_specs, rep),
    )
    placed = tied.device_put((model, state), (model_specs, state_specs))
    vs_model, _, vs_loss, vs_times, vs_ties = train(vs_step, *placed, batches)
    w = vs_model.embed.weight
    shard_bytes = sum(s.data.nbytes for s in w.addressable_shards)
    vs_diff = max_difference(vs_model, ref_model)
    say(
        f"vocab-sharded:   {mesh}, embedding {w.sharding.spec}, per device "
        f"{w.addressable_shards[0].data.shape} of {w.shape}"
    )
    say(
        f"                 embedding bytes over all devices {shard_bytes:,} = one copy "
        f"{w.nbytes:,}: {shard_bytes == w.nbytes}; head is embed: {vs_model.head is vs_model.embed}"
    )
    say(
        f"                 loss -> {vs_loss:.3f}, {1e3 * np.median(vs_times[1:] or vs_times):.1f} ms/step; "
        f"ties held: {vs_ties}; max |params - one-device params| = {vs_diff:.1e}"
    )
    ok = dp_ties and vs_ties and max(dp_diff, vs_diff) < 1e-4 and shard_bytes == w.nbytes
    say("same parameters as one device (within 1e-4), ties held, embedding stored once:", ok)
    return {
        "devices": n,
        "first_loss": first_loss,
        "ref_loss": ref_loss,
        "dp_loss": dp_loss,
        "dp_diff": dp_diff,
        "dp_ties": dp_ties,
        "vs_diff": vs_diff,
        "vs_ties": vs_ties,
        "shard_bytes": shard_bytes,
        "one_copy_bytes": w.nbytes,
        "shard_shape": w.addressable_shards[0].data.shape,
        "ok": ok,
    }


if __name__ == "__main__":
    main()
