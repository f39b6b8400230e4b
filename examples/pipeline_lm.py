"""A tied language model in a pipeline: 4 stages of 2 blocks over 8 CPU devices, `tied.pipeline`.

The model's output head is its input embedding (one `tied.nn.Embedding` at two places), and
one LayerNorm is used in every stage and after the last one. The stages are one `tied.Stack`
(each stage itself a Stack of 2 blocks); on a 2 x 4 mesh ("data" x "stage") the stages are
split one per device along "stage" (`tied.sharding_tree(..., stack_axis="stage")`), the batch
along "data", and `tied.pipeline` runs the GPipe schedule: the batch cut into microbatches that
flow from stage to stage by ``jax.lax.ppermute``. The embedding, the head and the LayerNorm stay
one parameter each, with one total gradient and one Adam state, and the run equals the same
steps run as a sequential `tied.scan` on one device.

Run:
    python examples/pipeline_lm.py          # sets 8 fake CPU devices itself
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if __name__ == "__main__" and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import tied  # noqa: E402

STAGES, BLOCKS, DIM, MICROBATCHES, BATCH, SEQ = 4, 2, 32, 4, 16, 32
TX = optax.adam(1e-2)


def corpus() -> tuple[np.ndarray, int]:
    from pathlib import Path

    text = (Path(tied.__file__).parent / "data" / "corpus.txt").read_text()
    chars = sorted(set(text))
    return np.array([chars.index(c) for c in text], np.int32), len(chars)


@tied.register
class Block:
    """A residual MLP block."""

    def __init__(self, *, key):
        self.mix = tied.nn.Dense(DIM, DIM, key=key)

    def __call__(self, h):
        return h + jnp.tanh(self.mix(h))


@tied.register
class PipelineLM:
    """Embedding, a Stack of stages (each a Stack of blocks and the shared norm), the embedding as head."""

    def __init__(self, vocab: int, *, key):
        k_embed, k_stages = jax.random.split(key)
        self.embed = tied.nn.Embedding(vocab, DIM, key=k_embed)
        self.norm = tied.nn.LayerNorm(DIM)  # one norm: in every stage and at the end

        def stage(k):
            blocks = tied.stack([Block(key=kk) for kk in jax.random.split(k, BLOCKS)])
            return {"blocks": blocks, "norm": self.norm}

        self.stages = tied.stack([stage(k) for k in jax.random.split(k_stages, STAGES)])
        self.head = self.embed  # the tie

    def logits(self, ids, mesh=None):
        h = self.embed(ids)
        if mesh is None:  # the sequential reference
            h = tied.scan(lambda h, s, _: (run_stage(h, s), None), h, self.stages)[0]
        else:
            h = tied.pipeline(run_stage, h, self.stages, mesh=mesh, axis="stage", microbatches=MICROBATCHES)
        return self.head.attend(self.norm(h))


def run_stage(h, stage):
    h, _ = tied.scan(lambda h, block, _: (block(h), None), h, stage["blocks"])
    return stage["norm"](h)


def loss_fn(model, ids, mesh=None):
    # A bigram-style LM: each position predicts the next character from its own.
    logits = model.logits(ids[:, :-1], mesh)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def batches(data: np.ndarray, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - SEQ - 1, (steps, BATCH))
    return np.stack([np.stack([data[s : s + SEQ + 1] for s in row]) for row in starts])


def main(steps: int = 30, seed: int = 0, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    if jax.device_count() < 8:
        raise RuntimeError(
            "examples/pipeline_lm.py needs 8 devices: run it as a script (it sets 8 CPU devices)."
        )
    data, vocab = corpus()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "stage"))
    model = PipelineLM(vocab, key=jax.random.key(seed))
    state = tied.optim.setup(TX, model)

    def step(m, s, ids, mesh):
        value, g = tied.value_and_grad(loss_fn)(m, ids, mesh)
        m, s = tied.optim.update(s, m, g)
        return m, s, value

    # The stages one per device along "stage" (their Adam moments with them), the rest replicated.
    specs = tied.sharding_tree((model, state), [], mesh=mesh, stack_axis="stage")
    pm, ps = tied.device_put((model, state), specs)
    batch = NamedSharding(mesh, PartitionSpec("data"))
    traces = []

    def traced_step(m, s, ids):
        traces.append(1)
        return step(m, s, ids, mesh)

    pipelined = tied.jit(traced_step)
    sequential = tied.jit(lambda m, s, ids: step(m, s, ids, None))
    ref = (model, state)
    first = None
    for k, ids in enumerate(batches(data, steps, seed)):
        pm, ps, loss = pipelined(pm, ps, tied.device_put(ids, batch))
        *ref, ref_loss = sequential(*ref, ids)
        first = float(loss) if first is None else first
        if k % 10 == 0 or k == steps - 1:
            say(
                f"step {k:3d}  loss {float(loss):.4f}  (sequential scan on one device: {float(ref_loss):.4f})"
            )
    got, want = tied.flatten((pm, ps))[0], tied.flatten(tuple(ref))[0]
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    w = pm.stages.member["blocks"].member.mix.weight
    r = {
        "devices": jax.device_count(),
        "first_loss": first,
        "loss": float(loss),
        "max_diff_vs_sequential": diff,
        "one_table": pm.embed is pm.head and pm.embed.weight is pm.head.weight,
        "one_norm": pm.norm is pm.stages.member["norm"],
        "stage_shard_shape": tuple(w.addressable_shards[0].data.shape),
        "traces": len(traces),
        "bubble": (STAGES - 1) / (MICROBATCHES + STAGES - 1),
        "adam_entries": len(ps.paths),
    }
    say(f"ties kept: table {r['one_table']}, norm {r['one_norm']}; max difference {diff:.2e}")
    say(
        f"each device holds one stage: {r['stage_shard_shape']} of {tuple(w.shape)}; bubble {r['bubble']:.2f}"
    )
    return r


if __name__ == "__main__":
    main()
