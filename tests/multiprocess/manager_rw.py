"""A writer or a reader of one `tied.CheckpointManager` directory, as its own process.

Started by tests/test_manager_processes.py, never collected by pytest. Run as::

    python tests/multiprocess/manager_rw.py writer DIR --steps N [--max-to-keep K] [--keep-every E]
    python tests/multiprocess/manager_rw.py reader DIR --steps N --out FILE

The writer saves steps 1..N asynchronously (one save per step, the training loop
going on while it writes) and then ends *without* `wait` or `close`: the pending
save must be finished at the interpreter's exit. The reader opens a new manager
on the directory again and again, lists it, restores the latest step and checks
it against `tree(step)`, until it has seen step N (or its deadline passes), then
writes what it saw to FILE as JSON. Any error ends the process with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tied  # noqa: E402

DIM = 64


def tree(step: int) -> dict:
    """Step ``step``'s values: an embedding weight at two places (a tie), a bias, a numpy counter."""
    w = jnp.full((8, DIM), float(step)) + jnp.arange(DIM, dtype=jnp.float32) / 1000
    emb = {"weight": w}
    return {"embed": emb, "head": emb, "bias": jnp.full((DIM,), -float(step)), "count": np.array([step])}


def writer(args: argparse.Namespace) -> None:
    keep = None if args.max_to_keep == 0 else args.max_to_keep
    deadline = time.monotonic() + args.deadline
    while args.start_after and not os.path.exists(args.start_after):  # the reader is reading
        assert time.monotonic() < deadline, "the reader never started"
        time.sleep(0.05)
    mngr = tied.CheckpointManager(args.dir, max_to_keep=keep, keep_every=args.keep_every)
    for step in range(1, args.steps + 1):
        t = tree(step)
        assert mngr.save(step, t, {"step": step})
        time.sleep(args.pause)  # the training step beside the background save
    print(f"writer: saved {args.steps} steps", flush=True)
    # No wait(), no close(): the interpreter's exit must finish the last save.


def reader(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.deadline
    seen, listed = [], []
    like = tree(0)
    while time.monotonic() < deadline:
        with tied.CheckpointManager(args.dir) as mngr:
            steps = mngr.all_steps()
            listed.append(steps)
            if args.ready and not os.path.exists(args.ready):
                open(args.ready, "w").close()
            latest = mngr.latest_step()
            if latest is not None:
                back = mngr.restore(like)
                step = int(back["count"][0])
                want = tree(step)
                assert back["embed"] is back["head"], "the tie was cut"
                for name in ("bias", "count"):
                    assert np.array_equal(np.asarray(back[name]), np.asarray(want[name])), (step, name)
                assert np.array_equal(
                    np.asarray(back["embed"]["weight"]), np.asarray(want["embed"]["weight"])
                )
                assert step >= latest, (step, latest)  # the latest or a newer one, never an older one
                seen.append(step)
                if step == args.steps:
                    break
    with open(args.out, "w") as f:
        json.dump({"seen": seen, "listed": listed}, f)
    print(f"reader: restored {len(seen)} times, last {seen[-1] if seen else None}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["writer", "reader"])
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-to-keep", type=int, default=0)  # 0: keep all
    p.add_argument("--keep-every", type=int, default=None)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--deadline", type=float, default=240.0)
    p.add_argument("--out", default=None)
    p.add_argument("--ready", default=None)  # reader: a file made once it has opened the directory
    p.add_argument("--start-after", default=None)  # writer: wait for that file
    args = p.parse_args()
    (writer if args.role == "writer" else reader)(args)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
