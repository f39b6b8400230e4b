"""A LoRA fine-tuning step on a tied GPT-2-like model: bytes kept and step time against plain JAX.

The model: a token embedding also used as the head (``Dense(wte.weight)``, GPT-2's tie), learned
positions, pre-LN transformer blocks, a final LayerNorm. Adapters (rank 8) on every block's
``attn.qkv`` and on the tied head, trained with Adam; the base is frozen.

* **bytes**: what one step keeps beside the model, counted in leaves: tied's gradient (with
  ``trainable=tied.nn.adapters``: arrays at the adapters only) plus the Adam state (mu and nu), over
  the adapters' own bytes. Ideal: 3.00 (the gradient, mu, nu), whatever the base's size.
* **step time**: ``tied.jit`` of ``tied.value_and_grad(..., trainable=tied.nn.adapters)`` and
  ``tied.optim.update``, against the same LoRA step written by hand: ``jax.jit`` of a function of
  (adapters, Adam state, frozen weights, batch), the same arithmetic on dicts of arrays, optax by
  hand. Interleaved rounds; the ratio is the median of the per-round ratios. Target: <= 1.10x.

    python -m benchmarks.lora [--rounds 7]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied
from tied.nn import Dense, Embedding, LayerNorm, TransformerBlock

from .timing import arguments, interleaved

TARGET = 1.10
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, RANK, ALPHA = 2048, 128, 4, 4, 64, 8, 8, 16


@tied.register
class TiedLM:
    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 2)
        self.wte = Embedding(VOCAB, DIM, key=keys[0])
        self.wpe = Embedding(SEQ, DIM, key=keys[1])
        self.blocks = [TransformerBlock(DIM, HEADS, key=k) for k in keys[2:]]
        self.ln_f = LayerNorm(DIM)
        self.head = Dense(self.wte.weight)  # GPT-2's tie

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def adapted_model():
    model = TiedLM(jax.random.key(0))
    where = lambda path, layer: path.endswith(".attn.qkv") or path == ".head"  # noqa: E731
    return tied.nn.lora(model, where, RANK, alpha=ALPHA, key=jax.random.key(1))


def data():
    ids = jax.random.randint(jax.random.key(2), (BATCH, SEQ + 1), 0, VOCAB)
    return ids[:, :-1], ids[:, 1:]


def _adapter_arrays(model) -> list:
    leaves, gdef = tied.flatten(model)
    return [leaves[i] for i, paths in enumerate(gdef.leaf_paths()) if tied.nn.adapters(paths[0], leaves[i])]


def bytes_kept(model, tx) -> dict:
    """Gradient + optimiser state bytes of one step, over the adapters' bytes (counted leaves)."""
    ids, targets = data()
    g = tied.jit(tied.grad(lambda m: _xent(m(ids), targets), trainable=tied.nn.adapters))(model)
    grad_leaves = [x for x in tied.flatten(g)[0] if x is not None]
    state = tied.optim.setup(tx, model, trainable=tied.nn.adapters)
    opt_leaves = [
        a for a in jax.tree_util.tree_leaves(state.inner_state) if jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    adapter = sum(x.nbytes for x in _adapter_arrays(model))
    base = sum(x.nbytes for x in tied.flatten(model)[0] if tied.is_param(x)) - adapter
    grad_b, opt_b = sum(x.nbytes for x in grad_leaves), sum(x.nbytes for x in opt_leaves)
    return {
        "adapter_bytes": adapter,
        "frozen_base_bytes": base,
        "gradient_bytes": grad_b,
        "optimizer_bytes": opt_b,
        "gradient_arrays": len(grad_leaves),
        "ratio": (grad_b + opt_b) / adapter,
    }


def step_workload(tx):
    """(tied run, pure-JAX run)."""
    model = adapted_model()
    ids, targets = data()

    def loss(m, ids, targets):
        return _xent(m(ids), targets)

    @tied.jit
    def tied_step(m, s, ids, targets):
        value, g = tied.value_and_grad(loss, trainable=tied.nn.adapters)(m, ids, targets)
        m, s = tied.optim.update(s, m, g)
        return m, s, value

    box = {"m": model, "s": tied.optim.setup(tx, model, trainable=tied.nn.adapters)}

    def run_tied():
        box["m"], box["s"], value = tied_step(box["m"], box["s"], ids, targets)
        return value

    # pure JAX: the frozen weights and the adapters as dicts of arrays, the same arithmetic
    def lin(d):
        return (d.weight, d.bias)

    frozen = {
        "wte": model.wte.weight,
        "wpe": model.wpe.weight,
        "ln_f": (model.ln_f.weight, model.ln_f.bias),
        "blocks": [
            {
                "ln1": (b.ln1.weight, b.ln1.bias), "ln2": (b.ln2.weight, b.ln2.bias),
                "qkv": lin(b.attn.qkv.base), "proj": lin(b.attn.proj),
                "fc1": lin(b.mlp.fc1), "fc2": lin(b.mlp.fc2),
            }
            for b in model.blocks
        ],
    }  # fmt: skip
    adapters = {
        "qkv": [(b.attn.qkv.lora_A, b.attn.qkv.lora_B) for b in model.blocks],
        "head": (model.head.lora_A, model.head.lora_B),
    }
    scale = ALPHA / RANK

    def ln(x, wb):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.var(x, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * wb[0] + wb[1]

    def dense(x, wb):
        return x @ wb[0].T + wb[1]

    def delta(x, ab):
        return scale * ((x @ ab[0].T) @ ab[1].T)

    def attn(x, b, ab):
        *lead, seq, dim = x.shape
        h = dense(x, b["qkv"]) + delta(x, ab)
        q, k, v = (t.reshape(*lead, seq, HEADS, dim // HEADS) for t in jnp.split(h, 3, axis=-1))
        s = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(dim // HEADS)
        s = jnp.where(jnp.tril(jnp.ones((seq, seq), dtype=bool)), s, jnp.finfo(s.dtype).min)
        out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(s, axis=-1), v).reshape(*lead, seq, dim)
        return dense(out, b["proj"])

    def ref_loss(a, f, ids, targets):
        x = f["wte"][ids] + f["wpe"][jnp.arange(ids.shape[-1])]
        for b, ab in zip(f["blocks"], a["qkv"]):
            x = x + attn(ln(x, b["ln1"]), b, ab)
            x = x + dense(jax.nn.gelu(dense(ln(x, b["ln2"]), b["fc1"])), b["fc2"])
        h = ln(x, f["ln_f"])
        return _xent(h @ f["wte"].T + delta(h, a["head"]), targets)

    @jax.jit
    def ref_step(a, opt, f, ids, targets):
        value, g = jax.value_and_grad(ref_loss)(a, f, ids, targets)
        updates, opt = tx.update(g, opt, a)
        return optax.apply_updates(a, updates), opt, value

    ref = {"a": adapters, "o": tx.init(adapters)}

    def run_ref():
        ref["a"], ref["o"], value = ref_step(ref["a"], ref["o"], frozen, ids, targets)
        return value

    return run_tied, run_ref


def _interleaved(runs: dict, rounds: int, repeat: int) -> dict:
    out = interleaved(runs, rounds, repeat, warm=3)
    firsts = {n: [float(x) for x in v] for n, v in out.pop("firsts").items()}
    a, b = firsts
    return {**out, "first_losses": firsts, "same_losses": bool(np.allclose(firsts[a], firsts[b], rtol=1e-4))}


def run(rounds: int = 7, repeat: int = 10) -> dict:
    tx = optax.adam(1e-3)
    memory = bytes_kept(adapted_model(), tx)
    run_tied, run_ref = step_workload(tx)
    step = _interleaved({"tied.jit": run_tied, "pure JAX": run_ref}, rounds, repeat)
    return {"rounds": rounds, "bytes": memory, "step": step}


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    m, s = r["bytes"], r["step"]
    lo, hi = s["ratio_range"]
    verdict = "met" if s["ratio"] <= TARGET else "missed"
    kept = m["gradient_bytes"] + m["optimizer_bytes"]
    return [
        "## LoRA: a fine-tuning step on a tied GPT-2-like model",
        "",
        f"Adapters of rank {RANK} on every block's `attn.qkv` and on the head tied to the embedding "
        f"({LAYERS} blocks, width {DIM}, vocabulary {VOCAB}), Adam, `trainable=tied.nn.adapters`. "
        f"{r['rounds']} interleaved rounds; the ratio is the median of the per-round ratios (min to max "
        "in brackets).",
        "",
        "| measure | tied | reference | ratio | target |",
        "|---|---|---|---|---|",
        f"| gradient + Adam bytes / adapter bytes (counted leaves) | {kept:,} B "
        f"| {m['adapter_bytes']:,} B adapters ({m['frozen_base_bytes']:,} B frozen base) | {m['ratio']:.2f}x "
        f"| 3.00x ({'met' if abs(m['ratio'] - 3) < 1e-9 else 'missed'}) |",
        f"| step time, tied.jit vs the LoRA step by hand in JAX | {s['seconds']['tied.jit'] * 1e3:.3f} ms "
        f"| {s['seconds']['pure JAX'] * 1e3:.3f} ms | {s['ratio']:.2f}x ({lo:.2f} to {hi:.2f}) "
        f"| <= {TARGET:.2f}x ({verdict}) |",
        "",
        f"First three losses equal (rtol 1e-4): {s['same_losses']}. The gradient holds "
        f"{m['gradient_arrays']} arrays, the adapters' own: none for the frozen base.",
        "",
    ]


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    args = parser.parse_args(argv)
    r = run(args.rounds)
    print("\n".join(report(r)), flush=True)
    return r


if __name__ == "__main__":
    main()
