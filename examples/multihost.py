"""A tied language model trained by several processes (one per host), with an Orbax checkpoint.

Every process runs this same program. `jax.distributed.initialize` joins them into one
JAX runtime: `jax.devices()` then lists the devices of every process, and one mesh
spans them all. The batch is split over every device (each process loads only its own
rows, `jax.make_array_from_process_local_data`), and so are the rows of the tied
embedding (input lookup and output head, one `tied.nn.Embedding` at two places) and of
its Adam moments: no process holds the whole embedding. The model is built directly in
its shards (`tied.jit` with ``out_shardings``), saved with ``tied.save(...,
format="orbax")`` (each process writes its own shards), and restored into an abstract
``like`` from `jax.eval_shape` (nothing is built first), ties and all.

On real hosts, start the same command on every host, with a shared checkpoint directory:

    python examples/multihost.py --coordinator HOST0:1234 --num-processes 2 --process-id 0 --ckpt /shared/ckpt
    python examples/multihost.py --coordinator HOST0:1234 --num-processes 2 --process-id 1 --ckpt /shared/ckpt

(or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID). On Cloud TPU,
SLURM, Open MPI and other clusters that JAX detects, pass ``--auto`` instead. GPUs and
TPUs are used as they are; nothing here assumes a CPU.

On one machine, as 2 processes of 4 fake CPU devices each, talking over 127.0.0.1:

    python examples/multihost.py --local 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local", type=int, metavar="N", help="start N processes here, on fake CPU devices")
    p.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0's coordination service",
    )
    p.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
    p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
    p.add_argument("--auto", action="store_true", help="let JAX find the cluster (Cloud TPU, SLURM, MPI)")
    p.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices per process (for --local)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory, shared by every process")
    p.add_argument("--steps", type=int, default=4)
    return p.parse_args(argv)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


# ---------------------------------------------------------------- the launcher (--local N)


def launch_local(n: int, args: argparse.Namespace) -> int:
    """Start ``n`` copies of this program on 127.0.0.1 and wait; kill them all if one fails."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the processes
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="tied-multihost-")
    procs: list = []
    try:
        return _run(procs, n, port, ckpt, args)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if not args.ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)


def _run(procs: list, n: int, port: int, ckpt: str, args: argparse.Namespace) -> int:
    env = dict(os.environ, JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # loopback only
    for i in range(n):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    str(n),
                    "--process-id",
                    str(i),
                    "--cpu-devices",
                    str(args.cpu_devices or 4),
                    "--ckpt",
                    ckpt,
                    "--steps",
                    str(args.steps),
                ],
                env=env,
            )
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):  # one failed: the others would wait for it forever
            print(f"a process failed (exit codes {codes}); stopping the others", flush=True)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)
    print("timed out", flush=True)
    return 1


# ---------------------------------------------------------------- one process


def start_jax(args: argparse.Namespace):
    """Start JAX and join the other processes; only the --local launcher asks for fake CPU devices."""
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if args.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    if args.auto:
        jax.distributed.initialize()
    elif args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    return jax


def main(args: argparse.Namespace) -> dict:
    jax = start_jax(args)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tied
    from tied.nn import Embedding, LayerNorm, TransformerBlock

    pid, n_dev = jax.process_index(), jax.device_count()
    vocab, dim, heads, seq = 8 * n_dev, 16, 2, 8  # a vocabulary that splits over every device
    batch_size = 2 * n_dev
    tx = optax.adam(1e-2)

    def say(text: str) -> None:  # one write per line: the processes may share one output
        sys.stdout.write(f"[process {pid}] {text}\n")
        sys.stdout.flush()

    @tied.register
    class TiedLM:
        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.embed = Embedding(vocab, dim, key=k1)
            self.block = TransformerBlock(dim, heads, key=k2)
            self.ln = LayerNorm(dim)
            self.head = self.embed  # the tie: one Embedding, read by attend

        def __call__(self, ids):
            return self.head.attend(self.ln(self.block(self.embed(ids))))

    def init(key):
        model = TiedLM(key)
        return model, tied.optim.setup(tx, model)

    def train_step(model, state, batch):
        def loss_fn(m):
            logits = m(batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = tied.value_and_grad(loss_fn)(model)
        model, state = tied.optim.update(state, model, grads)
        return model, state, loss

    mesh = Mesh(np.array(jax.devices()), ("data",))  # every device of every process
    rep = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data", None))  # the tied embedding and its Adam moments, by rows
    data = tied.data_parallel(mesh).batch

    def rule(path, x):
        return rows if x.shape == (vocab, dim) else rep

    # The shapes, and from them the shardings, without building anything.
    abstract = jax.eval_shape(lambda k: tied.Graph(init(k)), jax.random.key(0)).value
    leaves, gdef = tied.flatten(abstract)  # each unique array once, with the paths of its places
    like = tied.unflatten(
        gdef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rule(paths[0], x))
            for x, paths in zip(leaves, gdef.leaf_paths())
        ],
    )
    specs = tied.sharding_tree(like, rule)
    # Built in its shards: each device creates only its part (the same key on every process).
    model, state = tied.jit(init, out_shardings=specs)(jax.random.key(0))
    step = tied.jit(train_step, in_shardings=(*specs, data), out_shardings=(*specs, rep))
    w = model.embed.weight
    say(
        f"{jax.process_count()} processes, {n_dev} devices ({jax.local_device_count()} here, "
        f"{jax.devices()[0].platform}); embedding {w.shape} split by rows: this process holds "
        f"{sum(s.data.shape[0] for s in w.addressable_shards)} of {w.shape[0]} rows"
    )

    rng = np.random.default_rng(0)  # the same global batches on every process; each loads its rows
    batches = (
        rng.integers(0, vocab, (args.steps + 1, batch_size, 1)) + np.arange(seq + 1)
    ) % vocab  # runs of consecutive tokens: learnable
    rows_here = sorted(
        {
            r
            for idx in data.addressable_devices_indices_map((batch_size, seq + 1)).values()
            for r in range(batch_size)[idx[0]]
        }
    )

    def global_batch(k):
        local = batches[k][rows_here[0] : rows_here[-1] + 1].astype(np.int32)
        return jax.make_array_from_process_local_data(data, local, (batch_size, seq + 1))

    losses = []
    for k in range(args.steps):
        model, state, loss = step(model, state, global_batch(k))
        assert model.head.weight is model.embed.weight  # the tie holds on every process
        losses.append(float(loss))
    say("loss " + " -> ".join(f"{x:.3f}" for x in losses))

    if args.ckpt is None and jax.process_count() > 1:
        raise SystemExit("several processes need one checkpoint directory that all of them see: pass --ckpt")
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="tied-multihost-")  # one process: any directory
    tied.save(ckpt, (model, state), {"step": args.steps}, format="orbax")  # each process writes its shards
    restored, restored_state = tied.load(ckpt, like)  # onto like's shardings; nothing built first
    # A replicated scalar computed over the whole (split) embedding: every process can read it.
    same = float(jnp.max(jnp.abs(restored.embed.weight - model.embed.weight))) == 0.0
    # One more step from both: the restored run goes on exactly as the live one.
    batch = global_batch(args.steps)
    _, _, live_loss = step(model, state, batch)
    _, _, restored_loss = step(restored, restored_state, batch)
    say(
        f"checkpoint {ckpt}: step {tied.load_metadata(ckpt)['step']}, restored head is embed: "
        f"{restored.head is restored.embed}, embedding equal: {same}, next loss live "
        f"{float(live_loss):.6f} restored {float(restored_loss):.6f}"
    )
    ok = (
        restored.head is restored.embed
        and same
        and float(live_loss) == float(restored_loss)
        and losses[-1] < losses[0]
    )
    say("ok" if ok else "FAILED")
    if args.ckpt is None:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"losses": losses, "ok": ok}


if __name__ == "__main__":
    args = parse_args()
    if args.local:
        sys.exit(launch_local(args.local, args))
    sys.exit(0 if main(args)["ok"] else 1)
