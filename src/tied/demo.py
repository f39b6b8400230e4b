"""The demo behind ``make demo``: a character-level transformer with tied weights.

``python -m tied.demo [--steps N] [--out DIR] [--seed S]`` trains a small
character-level language model on the public-domain texts shipped with the
package (``tied/data/corpus.txt``: Shakespeare's sonnets and speeches, and poems
and speeches by Poe, Keats, Lincoln and others, all published before 1890, typed
out; about 45 KB). Two kinds of sharing:

* the output head *is* the input embedding: ``head = Dense(embed.weight)``;
* ALBERT-style depth: two transformer blocks, each used at two layers
  (``blocks = [b0, b1, b0, b1]``).

It prints the model summary (parameters counted once and per place, the tie
groups), trains with Adam under `tied.jit` with a progress bar, then shows the
loss before and after, text sampled token by token with a key/value cache per
layer (`KVCache`; one compiled step), the memory of gradients plus optimiser
state against a per-place representation, and checks in words that every tie
still holds. Into ``--out`` it writes the loss curve (``loss.png``), the
checkpoint (``checkpoint.safetensors``, reloaded and checked), the summary
(``summary.txt``) and the DAG (``model.dot``, and ``model.svg``/``model.png`` when
Graphviz's ``dot`` is installed).

`main` returns a dict of the figures it printed, for tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tied

from .nn import Dense, Embedding, KVCache, LayerNorm, TransformerBlock

DIM, HEADS, BLOCKS, REPEAT, SEQ, BATCH = 64, 4, 2, 2, 64, 32
DEFAULT_STEPS = 1200
CORPUS = "data/corpus.txt"
HELD_OUT_CHUNK = 1000
PROMPTS = ("Shall I compare thee", "When in the ", "Love is ")


@tied.register
class CharTransformer:
    """Token + position embeddings, ``blocks`` (each unique block at ``repeat`` places),
    a final LayerNorm, and an output head that is the token embedding."""

    def __init__(
        self,
        vocab: int,
        *,
        key: Any,
        dim: int = DIM,
        heads: int = HEADS,
        blocks: int = BLOCKS,
        repeat: int = REPEAT,
        seq: int = SEQ,
    ):
        keys = jax.random.split(key, blocks + 2)
        self.embed = Embedding(vocab, dim, key=keys[0])
        self.pos = Embedding(seq, dim, key=keys[1])
        unique = [TransformerBlock(dim, heads, key=k) for k in keys[2:]]
        self.blocks = unique * repeat  # [b0, b1, b0, b1]: each block at `repeat` places
        self.ln = LayerNorm(dim)
        self.head = Dense(self.embed.weight)  # the tie: the embedding's own array

    def __call__(self, ids: Any) -> Any:
        h = self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    def caches(self, batch_shape: tuple = ()) -> list[KVCache]:
        """Empty key/value caches for `decode`: one per layer *place* (a block at two
        layers has one set of weights but sees two sequences of keys)."""
        return [block.attn.cache(self.pos.weight.shape[0], batch_shape) for block in self.blocks]

    def decode(self, ids: Any, caches: list[KVCache]) -> Any:
        """Logits for the next positions ``ids`` (``(..., seq)``), the earlier positions
        read from ``caches``, which advance by ``seq``: ``self(all_ids)`` at those rows."""
        start = caches[0].position.value
        h = self.embed(ids) + self.pos(start + jnp.arange(ids.shape[-1]))
        for block, cache in zip(self.blocks, caches):
            h = block.decode(h, cache)
        return self.head(self.ln(h))


def load_corpus() -> str:
    """The shipped public-domain corpus, as one string."""
    return resources.files("tied").joinpath(CORPUS).read_text(encoding="utf-8")


def loss_fn(model: CharTransformer, ids: Any, targets: Any) -> Any:
    logp = jax.nn.log_softmax(model(ids))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _split(ids: np.ndarray) -> tuple[Any, Any]:
    """Training and held-out characters: every tenth stretch of the text is held out, so
    both halves have the same mix of poems and prose."""
    held_mask = (np.arange(len(ids)) // HELD_OUT_CHUNK) % 10 == 9
    return jnp.asarray(ids[~held_mask]), jnp.asarray(ids[held_mask])


def _windows(data: Any, starts: Any) -> tuple[Any, Any]:
    w = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (SEQ + 1,)))(starts)
    return w[:, :-1], w[:, 1:]


def _fixed_windows(data: Any, n: int) -> tuple[Any, Any]:
    starts = jnp.linspace(0, data.shape[0] - SEQ - 1, n).astype(jnp.int32)
    return _windows(data, starts)


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _memory(model: Any, grads: Any, state: Any, tx: Any) -> dict[str, int]:
    """Bytes of gradients + optimiser state as held, against one array per place."""
    leaves, gdef = tied.flatten(model)
    grad_bytes = sum(_nbytes(x) for x in tied.flatten(grads)[0] if x is not None)
    state_bytes = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(state.inner_state))
    # a per-place representation (a plain pytree, as jax.grad and optax see the model):
    # one gradient and one optimiser state entry at every place of every parameter
    _, place_leaf = gdef.expand()
    per_place = [leaves[q] for q in place_leaf if tied.is_param(leaves[q])]
    per_place_state = jax.eval_shape(tx.init, per_place)
    pp_grads = sum(_nbytes(x) for x in per_place)
    pp_state = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(per_place_state))
    return {
        "tied": grad_bytes + state_bytes,
        "per_place": pp_grads + pp_state,
        "params": sum(_nbytes(x) for x in leaves if tied.is_param(x)),
    }


def _condensed(summary: str, depth: int = 2) -> str:
    """The summary's rows down to ``depth`` path components, and its totals."""
    out = []
    for line in summary.splitlines():
        path = line.split(" ", 1)[0]
        pieces = path.replace("[", ".[").strip(".").split(".")
        if not path.startswith((".", "<", "[")) or len(pieces) <= depth:
            out.append(line)
    return "\n".join(out)


def _generator(temperature: float = 0.7) -> Any:
    """One compiled step of generation with the key/value caches: feed one token, get the
    next one sampled. The caches are written in place (`tied.jit` writes state back), so
    the same step serves the prompt and the continuation, and compiles once."""
    traces = []

    @tied.jit
    def step(model: Any, caches: list, token: Any, key: Any) -> Any:
        traces.append(1)
        logits = model.decode(token[None], caches)[-1]
        return jax.random.categorical(key, logits / temperature)

    step.traces = traces
    return step


def _sample(step: Any, model: Any, prompt: str, chars: list[str], key: Any) -> str:
    """The prompt followed by sampled characters, up to the model's context (its positions)."""
    index = {c: i for i, c in enumerate(chars)}
    context = model.pos.weight.shape[0]
    ids = [index[c] for c in prompt if c in index][: context - 1]
    caches = model.caches()  # a new sequence: new, empty caches
    for i, token in enumerate(ids):  # the prompt, one token at a time
        nxt = step(model, caches, jnp.int32(token), jax.random.fold_in(key, i))
    while len(ids) < context:
        ids.append(int(nxt))
        if len(ids) < context:
            nxt = step(model, caches, jnp.int32(ids[-1]), jax.random.fold_in(key, len(ids)))
    return "".join(chars[i] for i in ids)


def _plot(path: str, losses: np.ndarray, evals: list[tuple[int, float, float]]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.add_subplot()
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.4, label="training batch")
    if len(losses) >= 20:
        k = max(len(losses) // 50, 5)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), smooth, lw=1.5, label=f"training (mean of {k})")
    steps, train, held = zip(*evals)
    ax.plot(steps, train, "o-", ms=3, label="fixed training windows")
    ax.plot(steps, held, "s-", ms=3, label="held-out text")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("tied demo: character transformer, head tied to embedding")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tied.demo",
        description="Train a character-level transformer whose output head is its input "
        "embedding, and show that every tie holds.",
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps (default %(default)s)")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output folder (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the demo; returns the figures it printed (losses, ties, memory, files)."""
    try:
        import matplotlib  # noqa: F401 - for the loss curve, at the end
        from tqdm.auto import tqdm
    except ImportError as e:
        missing = (e.name or "tqdm").split(".")[0]
        raise ImportError(
            f"python -m tied.demo needs {missing}, from the 'demo' extra: pip install 'tied[demo]' "
            "(or run make demo, which installs it)."
        ) from e

    args = _parse(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    # ---- data: characters of the shipped corpus; the last 10% is held out
    text = load_corpus()
    chars = sorted(set(text))
    train, held = _split(np.array([chars.index(c) for c in text], dtype=np.int32))
    print("tied demo: a character-level transformer whose output head is its input embedding")
    print(
        f"corpus: tied/{CORPUS}, {len(text):,} characters of public-domain poems and speeches "
        f"(Shakespeare, Poe, Keats, Lincoln, ...), {len(chars)} distinct characters; every "
        f"tenth stretch of {HELD_OUT_CHUNK:,} characters is held out\n"
    )

    # ---- the model and what tied sees in it
    key_model, key_data, key_sample = jax.random.split(jax.random.key(args.seed), 3)
    model = CharTransformer(len(chars), key=key_model)
    summary = tied.summary(model)
    with open(os.path.join(args.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(summary + "\n")
    print(f"model (summary to depth 2; the full table is in {args.out}/summary.txt):")
    print(_condensed(summary))
    unique, per_place = tied.param_count(model), tied.param_count(model, per_place=True)
    groups = tied.ties(model)
    print(
        f"\nparameters: {unique:,} unique, {per_place:,} counted per place "
        f"(the ties save {1 - unique / per_place:.0%})"
    )
    print(f"tie groups ({len(groups)}):")
    for g in groups:
        print("  " + " = ".join(g))

    # ---- training
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(100, args.steps // 10 + 1), args.steps, 3e-4),
            weight_decay=0.01,
        ),
    )
    state = tied.optim.setup(tx, model)

    @jax.jit
    def batch(i: Any) -> tuple[Any, Any]:
        starts = jax.random.randint(jax.random.fold_in(key_data, i), (BATCH,), 0, train.shape[0] - SEQ - 1)
        return _windows(train, starts)

    @tied.jit
    def step(model: Any, state: Any, ids: Any, targets: Any) -> tuple:
        loss, grads = tied.value_and_grad(loss_fn)(model, ids, targets)
        model, state = tied.optim.update(state, model, grads)
        return model, state, loss, grads

    evaluate = tied.jit(loss_fn)
    fixed_train, fixed_held = _fixed_windows(train, 64), _fixed_windows(held, 32)

    def eval_both(m: Any) -> tuple[float, float]:
        return float(evaluate(m, *fixed_train)), float(evaluate(m, *fixed_held))

    before = eval_both(model)
    print(
        f"\nloss before training: {before[0]:.3f} on fixed training windows, {before[1]:.3f} on "
        f"held-out text (uniform guessing: {np.log(len(chars)):.3f} nats per character)"
    )
    eval_every = max(args.steps // 10, 1)
    losses: list = []
    evals = [(0, *before)]
    grads = None
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", dynamic_ncols=True, mininterval=0.5)
    for i in bar:
        model, state, loss, grads = step(model, state, *batch(i))
        losses.append(loss)
        if i % 10 == 0 or i == args.steps:
            bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
        if i % eval_every == 0 and i != args.steps:
            evals.append((i, *eval_both(model)))
    bar.close()
    after = eval_both(model)
    evals.append((args.steps, *after))
    losses_np = np.asarray(jnp.stack(losses))
    print(
        f"loss after {args.steps} steps: {after[0]:.3f} on fixed training windows (was "
        f"{before[0]:.3f}), {after[1]:.3f} on held-out text (was {before[1]:.3f})"
    )

    # ---- samples
    generate_step = _generator(0.7)
    print(
        f"\nsampled text (temperature 0.7; token by token with a key/value cache per layer, up to "
        f"{SEQ} characters):"
    )
    samples = []
    for j, prompt in enumerate(PROMPTS):
        s = _sample(generate_step, model, prompt, chars, jax.random.fold_in(key_sample, j))
        samples.append(s)
        print("  | " + s.rstrip("\n").replace("\n", "\n  | "))

    # ---- memory: gradients + optimiser state, tied vs one array per place
    mem = _memory(model, grads, state, tx)
    print("\nmemory of gradients + Adam state:")
    print(
        f"  tied (one gradient and one state per unique parameter): {_mb(mem['tied'])} "
        f"= {mem['tied'] / mem['params']:.2f} x the parameters"
    )
    print(
        f"  one array per place (a plain pytree, as jax.grad + optax see it): "
        f"{_mb(mem['per_place'])} = {mem['per_place'] / mem['params']:.2f} x the parameters"
    )

    # ---- ties, checked by identity
    head_is_embedding = model.head.weight is model.embed.weight
    blocks_shared = all(model.blocks[i] is model.blocks[i % BLOCKS] for i in range(len(model.blocks)))
    same_groups = tied.ties(model) == groups
    grads_aliased = grads.head.weight is grads.embed.weight
    print("\nties after training, checked with `is`:")
    print(
        f"  the output head still is the input embedding (model.head.weight is "
        f"model.embed.weight): {'yes' if head_is_embedding else 'NO'}"
    )
    print(
        f"  each block is still one object at its {REPEAT} layers (model.blocks[{BLOCKS}] is "
        f"model.blocks[0], ...): {'yes' if blocks_shared else 'NO'}"
    )
    print(
        f"  the gradient of the head is the gradient of the embedding (one object): "
        f"{'yes' if grads_aliased else 'NO'}"
    )
    print(f"  the tie groups are those of the untrained model: {'yes' if same_groups else 'NO'}")

    # ---- files
    files = {}
    files["loss_curve"] = os.path.join(args.out, "loss.png")
    _plot(files["loss_curve"], losses_np, evals)
    files["checkpoint"] = os.path.join(args.out, "checkpoint.safetensors")
    tied.save(
        files["checkpoint"],
        {"model": model, "opt_state": state},
        metadata={"steps": args.steps, "seed": args.seed, "vocabulary": "".join(chars)},
    )
    back = tied.load(files["checkpoint"], like={"model": model, "opt_state": state})["model"]
    reloaded_ok = back.head.weight is back.embed.weight and bool(
        jnp.array_equal(back.embed.weight, model.embed.weight)
    )
    files["summary"] = os.path.join(args.out, "summary.txt")
    files["dot"] = os.path.join(args.out, "model.dot")
    dot = tied.to_dot(model)
    with open(files["dot"], "w", encoding="utf-8") as f:
        f.write(dot)
    if shutil.which("dot"):
        files["dag"] = os.path.join(args.out, "model.svg")
        tied.render_dot(dot, files["dag"])
        files["dag_png"] = os.path.join(args.out, "model.png")
        tied.render_dot(dot, files["dag_png"])
    print(
        f"\nthe checkpoint reloads with its ties (back.head.weight is back.embed.weight): "
        f"{'yes' if reloaded_ok else 'NO'}"
    )
    print("files:")
    for name, path in files.items():
        print(f"  {name:11s} {path}")
    if "dag" not in files:
        print("  (install Graphviz for a picture of the DAG: the text is in model.dot)")
    print(f"done in {time.time() - t_start:.0f} s")
    return {
        "steps": args.steps,
        "loss_before": before[0],
        "loss_after": after[0],
        "held_out_before": before[1],
        "held_out_after": after[1],
        "losses": losses_np,
        "samples": samples,
        "generation_compiles": len(generate_step.traces),
        "unique_params": unique,
        "per_place_params": per_place,
        "tie_groups": groups,
        "ties_held": head_is_embedding and blocks_shared and same_groups and grads_aliased,
        "checkpoint_ties_held": reloaded_ok,
        "memory": mem,
        "files": files,
        "model": model,
    }


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ImportError as e:
        if "'demo' extra" not in str(e):
            raise
        sys.exit(f"error: {e}")
