"""One process of a data-parallel run of the tied LM that checkpoints with `tied.CheckpointManager`.

Started by tests/test_multiprocess.py (`test_a_two_process_run_killed_resumes_bit_for_bit`),
never collected by pytest. Run as::

    python tests/multiprocess/manager_worker.py --out DIR --ckpt DIR [--port P --process-id I
        --num-processes N] [--devices 4] [--steps 6] [--save-every 2] [--kill-at K]

The model, data and step are those of tests/multiprocess/worker.py (tests/multiprocess/lm.py):
the tied embedding and its Adam moments split by rows over every device of every process.
Every process opens the manager on the same directory, resumes from its latest complete step
(restored onto an abstract ``like`` with the run's shardings), and saves every ``--save-every``
steps in the background. The batch of step ``s`` is a function of ``s``. With ``--kill-at K``,
process 1 kills itself (SIGKILL) right after step K (its save may be in flight). At the end each
process writes ``DIR/final-<process id>.npz`` (every unique array, gathered from all processes)
and ``DIR/result-<process id>.json``.
"""

from __future__ import annotations

import argparse
import os


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None)
    return p.parse_args()


ARGS = _args()
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={ARGS.devices} --xla_backend_optimization_level=0"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if ARGS.num_processes > 1:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ARGS.port}",
        num_processes=ARGS.num_processes,
        process_id=ARGS.process_id,
        coordinator_bind_address=f"127.0.0.1:{ARGS.port}",
        initialization_timeout=60,
    )

from lm import BATCH, DIM, SEQ, VOCAB, abstract_like, batches, check_ties, init, train_step  # noqa: E402

import tied  # noqa: E402


def main() -> None:
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    pid = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data", None))
    data = tied.data_parallel(mesh).batch

    def rule(path, x):
        return rows if x.shape == (VOCAB, DIM) else rep

    like = abstract_like(rule)
    specs = tied.sharding_tree(like, rule)
    step_fn = tied.jit(train_step, in_shardings=(*specs, data), out_shardings=(*specs, rep))
    all_batches = batches(ARGS.steps)
    index = data.addressable_devices_indices_map((BATCH, SEQ + 1))
    local_rows = sorted({r for idx in index.values() for r in range(BATCH)[idx[0]]})

    with tied.CheckpointManager(ARGS.ckpt, max_to_keep=2, save_interval_steps=ARGS.save_every) as mngr:
        start = mngr.latest_step() or 0
        if start:
            model, state = mngr.restore(like)  # onto the shardings of the abstract like
        else:
            model, state = tied.device_put(jax.jit(init)(jax.random.key(0)).value, specs)
        check_ties(model, state)
        for k in range(start, ARGS.steps):
            local = all_batches[k][local_rows[0] : local_rows[-1] + 1]
            batch = jax.make_array_from_process_local_data(data, local, (BATCH, SEQ + 1))
            model, state, loss = step_fn(model, state, batch)
            check_ties(model, state)
            mngr.save(k + 1, (model, state), {"loss": float(loss)})
            if ARGS.kill_at == k + 1 and pid == 1:
                print("manager worker: killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait()
        steps = mngr.all_steps()
    leaves, _ = tied.flatten((model, state))
    full = multihost_utils.process_allgather(leaves, tiled=True)
    np.savez(out / f"final-{pid}.npz", *[np.asarray(x) for x in full])
    (out / f"result-{pid}.json").write_text(json.dumps({"resumed_from": start, "steps": steps}))


if __name__ == "__main__":
    main()
