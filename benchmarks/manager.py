"""`tied.CheckpointManager`: how long a save stalls training, side by side.

On the 0.5 GiB model of `benchmarks/checkpoint.py` (an embedding tied to the
output head, twelve MLP blocks), in interleaved rounds (the order alternates):

* **blocking time of a save**: ``save`` of a manager with ``async_save=True``
  (it returns once the values are copied into its reused host staging buffers;
  the write goes on in the background) against ``save`` of a manager with
  ``async_save=False`` (it returns once the step is complete on disk);
* **a training step while a save is in flight**: one SGD step (``tied.jit``,
  model and optimiser state donated) started right after the asynchronous
  ``save`` returned, against the same step with no save in flight.

Reports the median of the per-round ratios (min to max), and whether the save
was still in flight when the step ended.

    python -m benchmarks.manager [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

import tied

from .checkpoint import GIB, _block, model
from .timing import arguments, ratios

TARGETS = {"blocking": 0.15, "step": 1.3}


def run(rounds: int = 7, folder: str | None = None) -> dict:
    m = model()
    nbytes = sum(x.nbytes for x in tied.flatten(m)[0])
    tx = optax.sgd(1e-4)
    opt = tied.optim.setup(tx, m)
    ids = jnp.arange(8) * 97

    def loss(m):
        logits = m(ids)
        return (jax.nn.logsumexp(logits, axis=-1) - logits[jnp.arange(8), ids]).mean()

    step = tied.jit(lambda m, s: tied.optim.update(s, m, tied.grad(loss)(m)), donate_argnums=(0, 1))
    m, opt = step(m, opt)  # compile
    _block(m)
    times: dict[str, list[float]] = {
        "async save": [],
        "sync save": [],
        "step, save in flight": [],
        "step": [],
    }
    in_flight = []
    with tempfile.TemporaryDirectory(dir=folder) as d:
        with (
            tied.CheckpointManager(f"{d}/async", max_to_keep=1) as fast,
            tied.CheckpointManager(f"{d}/sync", max_to_keep=1, async_save=False) as slow,
        ):
            fast.save(0, {"model": m, "opt": opt})  # the staging buffers are allocated and faulted in
            fast.wait()
            slow.save(0, {"model": m, "opt": opt})
            for r in range(1, rounds + 1):
                for which in ("async", "sync") if r % 2 else ("sync", "async"):
                    if which == "sync":
                        t0 = time.perf_counter()
                        slow.save(r, {"model": m, "opt": opt})
                        times["sync save"].append(time.perf_counter() - t0)
                        continue
                    t0 = time.perf_counter()
                    fast.save(r, {"model": m, "opt": opt})
                    times["async save"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    m, opt = step(m, opt)
                    _block(m)
                    times["step, save in flight"].append(time.perf_counter() - t0)
                    in_flight.append(fast._orbax.is_saving_in_progress())
                    fast.wait()
                    t0 = time.perf_counter()
                    m, opt = step(m, opt)
                    _block(m)
                    times["step"].append(time.perf_counter() - t0)
            back = fast.restore({"model": m, "opt": opt})
            assert back["model"].layers[0].weight is back["model"].layers[-1].weight
    pairs = {"blocking": ("async save", "sync save"), "step": ("step, save in flight", "step")}
    return {
        "gib": nbytes / GIB,
        "rounds": rounds,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        **ratios(times, pairs),
        "save_in_flight_after_step": sum(in_flight),
        "all_seconds": times,
    }


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    s = r["seconds"]
    rows = [
        (
            "time `save` blocks the caller",
            "async_save=True",
            s["async save"],
            "async_save=False",
            s["sync save"],
            "blocking",
        ),
        ("a training step", "a save in flight", s["step, save in flight"], "no save", s["step"], "step"),
    ]
    lines = [
        "## Checkpoints: tied.CheckpointManager",
        "",
        f"A {r['gib']:.2f} GiB model with a tied embedding, {r['rounds']} interleaved rounds; the ratio is "
        "the median of the per-round ratios (min to max in brackets). The save was still in flight at "
        f"the end of the step in {r['save_in_flight_after_step']} of {r['rounds']} rounds.",
        "",
        "| what | measured | time | reference | time | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, ours, t_ours, ref, t_ref, key in rows:
        lo, hi = r["ratio_range"][key]
        verdict = "met" if r["ratio"][key] <= TARGETS[key] else "missed"
        lines.append(
            f"| {what} | {ours} | {t_ours:.3f} s | {ref} | {t_ref:.3f} s | {r['ratio'][key]:.2f}x "
            f"({lo:.2f} to {hi:.2f}) | <= {TARGETS[key]}x ({verdict}) |"
        )
    lines.append("")
    return lines


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: the temp folder)")
    args = parser.parse_args(argv)
    r = run(args.rounds, args.dir)
    s, lo_hi = r["seconds"], r["ratio_range"]
    print(
        f"save blocks: async {s['async save']:.3f} s | sync {s['sync save']:.3f} s | ratio "
        f"{r['ratio']['blocking']:.2f}x (rounds {lo_hi['blocking'][0]:.2f} to {lo_hi['blocking'][1]:.2f}; "
        f"target <= {TARGETS['blocking']}x)",
        flush=True,
    )
    print(
        f"train step: save in flight {s['step, save in flight']:.3f} s | none {s['step']:.3f} s | ratio "
        f"{r['ratio']['step']:.2f}x (rounds {lo_hi['step'][0]:.2f} to {lo_hi['step'][1]:.2f}; target <= "
        f"{TARGETS['step']}x; save still in flight after the step in {r['save_in_flight_after_step']}/"
        f"{r['rounds']} rounds)",
        flush=True,
    )
    return r


if __name__ == "__main__":
    main()
