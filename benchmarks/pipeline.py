"""`tied.pipeline` against the sequential `tied.scan` over the same stages, on 8 CPU devices.

The model of `examples/pipeline_lm.py` (a tied embedding and head, one LayerNorm in every
stage, 4 stages of 2 blocks) takes Adam steps under `tied.jit` two ways on the same 2 x 4
mesh ("data" x "stage"), in interleaved rounds: pipelined (the stages one per device along
"stage", `tied.pipeline` with 4 microbatches) and sequential (the same placement, `tied.scan`
through the stages, so XLA moves each stage's arrays to where it runs). Beside the ratio is
the schedule's bubble fraction, ``(stages - 1) / (microbatches + stages - 1)``: the share of
ticks a device waits. The 8 CPU "devices" share this machine's cores, so the ratio is not a
speed claim about pipelining; it shows what the schedule costs where nothing runs in
parallel. Runs in a child process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.

    python -m benchmarks.pipeline [--rounds 7]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .timing import arguments, rotated

ROOT = Path(__file__).resolve().parents[1]


def _child(rounds: int) -> dict:
    import importlib.util

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import tied

    spec = importlib.util.spec_from_file_location("pipeline_lm", ROOT / "examples" / "pipeline_lm.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    data, vocab = ex.corpus()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "stage"))
    model = ex.PipelineLM(vocab, key=jax.random.key(0))
    state = tied.optim.setup(ex.TX, model)
    placed = tied.device_put(
        (model, state), tied.sharding_tree((model, state), [], mesh=mesh, stack_axis="stage")
    )
    ids = tied.device_put(ex.batches(data, 1, 0)[0], NamedSharding(mesh, PartitionSpec("data")))

    def make(pipelined: bool):
        def step(m, s, ids):
            value, g = tied.value_and_grad(ex.loss_fn)(m, ids, mesh if pipelined else None)
            m, s = tied.optim.update(s, m, g)
            return m, s, value

        f = tied.jit(step)
        carry = list(placed)

        def run():
            m, s, value = f(*carry, ids)
            carry[:] = [m, s]
            return value

        return run

    runs = {"pipelined": make(True), "sequential": make(False)}
    losses = {name: float(run()) for name, run in runs.items()}  # compile; the first step's loss
    times: dict = {name: [] for name in runs}
    for name in rotated(list(runs), rounds):
        run = runs[name]
        t0 = time.perf_counter()
        for _ in range(5):
            value = run()
        value.block_until_ready()
        times[name].append((time.perf_counter() - t0) / 5)
    ratios = [p / s for p, s in zip(times["pipelined"], times["sequential"])]
    stages, micro = ex.STAGES, ex.MICROBATCHES
    return {
        "rounds": rounds,
        "devices": jax.device_count(),
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "first_losses": losses,
        "stages": stages,
        "microbatches": micro,
        "bubble": (stages - 1) / (micro + stages - 1),
    }


def run(rounds: int = 7) -> dict:
    """The measurement, in a child process on 8 fake CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*kept, "--xla_force_host_platform_device_count=8"])
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.pipeline", "--child", "--rounds", str(rounds)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    lo, hi = r["ratio_range"]
    s = r["seconds"]
    return [
        "## Pipeline: `tied.pipeline` against the sequential `tied.scan`, 8 CPU devices",
        "",
        f"Adam steps of `examples/pipeline_lm.py` ({r['stages']} stages of 2 blocks, a tied embedding and "
        f"head), {r['rounds']} interleaved rounds on a 2 x 4 mesh. The {r['devices']} CPU devices share "
        "this machine's cores, so nothing runs in parallel and the ratio is **not a speed claim**: it "
        "shows what the schedule costs (the bubble, the sends) where pipelining cannot pay it back.",
        "",
        "| pipelined step | sequential scan step | ratio | microbatches | bubble (S-1)/(M+S-1) |",
        "|---|---|---|---|---|",
        f"| {s['pipelined'] * 1e3:.2f} ms | {s['sequential'] * 1e3:.2f} ms | {r['ratio']:.2f}x "
        f"({lo:.2f} to {hi:.2f}) | {r['microbatches']} | {r['bubble']:.2f} |",
        "",
    ]


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--child", action="store_true", help="measure here (needs 8 devices)")
    args = parser.parse_args(argv)
    if args.child:
        r = _child(args.rounds)
        print(json.dumps(r))
        return r
    r = run(args.rounds)
    print("\n".join(report(r)), flush=True)
    return r


if __name__ == "__main__":
    main()
