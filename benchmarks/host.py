"""Host cost (issue 19): the training step at many tiny layers, and flatten+unflatten from 10 to
100,000 modules, each against the fastest hand-written JAX on the same arrays.

Every ratio is the median of per-round ratios over interleaved rounds (the two systems
alternate within each round), with the smallest and largest beside it: this machine is
shared and noisy. Timed blocks run with Python's cyclic collector off for every system, as
`timeit` does; the first (cold) calls run with it on, as a user meets them, and what they
leave to the young generation is collected inside their timing.

* **steps**: Adam on a chain of ``n`` ``Dense(4, 4)`` layers (tanh), batch 8. tied:
  ``tied.jit`` over ``tied.value_and_grad`` + ``tied.optim.update`` returning the model
  (and the in-place form: ``tied.optim.update_inplace`` under ``tied.jit``, nothing
  returned but the loss). Reference: ``jax.jit`` + ``optax.adam`` on a list of
  ``(w, b)`` tuples (JAX's fastest containers), the same arithmetic.
* **scaling**: flatten+unflatten of ``n`` registered modules (a 4x4 weight each, one bias
  shared by all) against ``jax.tree_util`` on the same classes registered as JAX pytrees.
  ``first``: the first call on the structure (the walk, cold; the median of
  ``COLD_ROUNDS`` such calls, each after every plan was forgotten, and the very first of
  them); ``compile``: the call that
  compiles the plan (the second, or the `_plan.LARGE_PLAN_SIGHTINGS`-th for a graph over
  `_plan.MAX_PLAN_LINES` lines); ``warm``: after it.

* **step_host**: flatten+unflatten of a step's arguments (model and Adam state) at 1,000 and
  20,000 layers, against ``jax.tree_util`` on the tuples and optax's state: the host work of
  a step at a size where XLA's compile of the step itself takes minutes.

    python -m benchmarks.host [--rounds 7] [--sizes 10,100,1000,10000] [--layers 30,300,1000]
                              [--host-layers 1000,20000]
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import timeit

import jax
import jax.numpy as jnp
import optax

import tied
from tied import optim
from tied._core import graph as _graph
from tied._core.plans import compile as _plan
from tied.nn import Chain, Dense

from .timing import arguments


def _spread(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


@contextlib.contextmanager
def _collector_off():
    """Time with Python's cyclic collector off, as `timeit` does, for every system alike (a
    collection pass lands on whichever system happens to allocate when it falls due), and
    collect before the next block, untimed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def interleaved(runs: dict, rounds: int, number: int) -> dict:
    """Seconds per call of each run (median over rounds) and each run's ratio to the last one
    (median, min and max of the same-round ratios)."""
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(rounds):
        for k in names:
            f = runs[k]
            v = None  # the last block's result freed here, untimed
            with _collector_off():
                t = time.perf_counter()
                for _ in range(number):
                    v = f()
                tied.block_until_ready(v)  # a model too
                times[k].append((time.perf_counter() - t) / number)
    ref = names[-1]
    out = {"seconds": {k: statistics.median(v) for k, v in times.items()}}
    out["ratio"] = {k: _spread([a / b for a, b in zip(times[k], times[ref])]) for k in names[:-1]}
    return out


# ---------------------------------------------------------------- the step


def _chain(n: int) -> Chain:
    return Chain(*[Dense(4, 4, key=jax.random.key(i), activation=jnp.tanh) for i in range(n)])


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def step_runs(n: int, lr: float = 1e-3) -> dict:
    """The three step functions at ``n`` layers: tied (model returned), tied in place, JAX."""
    tx = optax.adam(lr)
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jax.random.normal(jax.random.key(2), (8, 4))

    @tied.jit
    def step(model, s, x, y):
        value, grads = tied.value_and_grad(_loss)(model, x, y)
        model, s = optim.update(s, model, grads)
        return model, s, value

    m0 = _chain(n)
    st = [m0, optim.setup(tx, m0)]

    def run_tied():
        st[0], st[1], value = step(st[0], st[1], x, y)
        return value

    @tied.jit
    def step_inplace(model, s, x, y):
        value, grads = tied.value_and_grad(_loss)(model, x, y)
        return optim.update_inplace(s, model, grads), value

    m1 = _chain(n)
    sti = [optim.setup(tx, m1)]

    def run_inplace():
        sti[0], value = step_inplace(m1, sti[0], x, y)
        return value

    def pure_loss(p, x, y):
        h = x
        for w, b in p:
            h = jnp.tanh(h @ w.T + b)
        return ((h - y) ** 2).mean()

    @jax.jit
    def pure_step(p, s, x, y):
        value, g = jax.value_and_grad(pure_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    m2 = _chain(n)
    params = [(d.weight, d.bias) for d in m2.layers]
    ps = [params, tx.init(params)]

    def run_jax():
        ps[0], ps[1], value = pure_step(ps[0], ps[1], x, y)
        return value

    return {
        "tied.jit + tied.optim": run_tied,
        "update_inplace under tied.jit": run_inplace,
        "jax.jit + optax": run_jax,
    }


def steps(layers=(30, 300, 1_000), rounds: int = 7) -> dict:
    out = {}
    for n in layers:
        runs = step_runs(n)
        firsts = {}
        for k, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            firsts[k] = time.perf_counter() - t
        for f in runs.values():  # plans compile on the second and third calls
            for _ in range(3):
                jax.block_until_ready(f())
        losses = {k: float(f()) for k, f in runs.items()}
        number = max(2, 3_000 // n)
        r = interleaved(runs, rounds, number)
        r["first_call_seconds"] = firsts
        r["losses_after_5"] = losses
        out[n] = r
    return out


# ---------------------------------------------------------------- flatten + unflatten


@tied.register
class HDense:
    def __init__(self, weight, bias):
        self.weight, self.bias, self.activation = weight, bias, jnp.tanh


@tied.register
class HChain:
    def __init__(self, layers):
        self.layers = layers


class PDense:
    """The same module as a JAX-registered pytree class (what a user registers)."""

    def __init__(self, weight, bias):
        self.weight, self.bias, self.activation = weight, bias, jnp.tanh


class PChain:
    def __init__(self, layers):
        self.layers = layers


def _unflatten_pdense(activation, children):
    d = object.__new__(PDense)
    d.weight, d.bias = children
    d.activation = activation
    return d


jax.tree_util.register_pytree_node(PDense, lambda d: ((d.weight, d.bias), d.activation), _unflatten_pdense)
jax.tree_util.register_pytree_node(PChain, lambda c: ((c.layers,), None), lambda _, ch: PChain(ch[0]))


def _tied_roundtrip(model):
    def f():
        leaves, gdef = tied.flatten(model)
        return tied.unflatten(gdef, leaves)

    return f


def _jax_roundtrip(tree):
    def f():
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return f


COLD_ROUNDS = 5  # first calls timed per size, each on a structure new to tied


def scaling(sizes=(10, 100, 1_000, 10_000), rounds: int = 7) -> dict:
    out = {}
    for n in sizes:
        bias = jnp.zeros(4)
        weights = [jnp.full((4, 4), float(i)) for i in range(n)]
        model = HChain([HDense(w, bias) for w in weights])
        pyclass = PChain([PDense(w, bias) for w in weights])
        tied_rt, jax_rt = _tied_roundtrip(model), _jax_roundtrip(pyclass)
        calls = []
        planned_at = None
        # A structure met before (in another section of the run) would start warm: forget the
        # plans, so that the first call walks a structure new to tied (its classes are known).
        # One such call is a single sample of a noisy machine: take several, each on plans
        # forgotten, and report their median beside the very first.
        # The collector stays on for these calls, as a user meets them; tied pauses it
        # during a walk, so the young objects it leaves are collected inside the timing.
        # The second call (the one that compiles plans, for every size here) likewise.
        cold, second = [], []
        for _ in range(COLD_ROUNDS - 1):
            _graph._clear_plans()
            for samples in (cold, second):
                t = time.perf_counter()
                leaves, gdef = tied.flatten(model)
                tied.unflatten(gdef, leaves)
                gc.collect(0)
                samples.append(time.perf_counter() - t)
            if not gdef.memo.flatten_plan:
                second.clear()  # planned later: the loop below finds that call
        _graph._clear_plans()
        for i in range(_plan.LARGE_PLAN_SIGHTINGS + 2):
            t = time.perf_counter()
            leaves, gdef = tied.flatten(model)
            tied.unflatten(gdef, leaves)
            gc.collect(0)
            calls.append(time.perf_counter() - t)
            if planned_at is None and gdef.memo.flatten_plan:
                planned_at = i  # this call's flatten compiled the plan
            if planned_at is not None and i >= planned_at + 1:
                break
        jax_rt()
        number = max(1, 20_000 // n)
        times = {"tied": [], "jax": []}
        for _ in range(rounds):
            times["tied"].append(timeit.timeit(tied_rt, number=number) / number)
            times["jax"].append(timeit.timeit(jax_rt, number=number) / number)
        warm = statistics.median(times["tied"])
        out[n] = {
            "tied_seconds": warm,
            "jax_seconds": statistics.median(times["jax"]),
            "ratio": _spread([a / b for a, b in zip(times["tied"], times["jax"])]),
            "tied_us_per_module": warm / n * 1e6,
            "first_seconds": statistics.median([calls[0], *cold]),
            "first_once_seconds": cold[0] if cold else calls[0],
            "compile_seconds": (
                statistics.median([calls[planned_at], *second]) if planned_at is not None else 0.0
            ),
            "planned_at_call": None if planned_at is None else planned_at + 1,
            "planned": planned_at is not None,
            "first_over_warm": statistics.median([calls[0], *cold]) / warm,
            "slowest_over_warm": max(calls) / warm,
        }
    return out


def _host_only(f):
    def run():
        f()

    return run


def step_host(layers=(20_000,), rounds: int = 7) -> dict:
    """The host work on a step's arguments at many layers, without XLA: flatten+unflatten of
    (model, Adam state) as ``tied.jit`` does it (its plans), against ``jax.tree_util`` on the
    same arrays as ``(w, b)`` tuples and optax's state. (The step itself is not timed at this
    size: XLA takes some 20 s to compile it at 1,000 layers, and minutes at 20,000.)"""
    out = {}
    tx = optax.adam(1e-3)
    for n in layers:
        model = _chain(n)
        state = optim.setup(tx, model)
        params = [(d.weight, d.bias) for d in model.layers]
        tied_rt, jax_rt = _tied_roundtrip((model, state)), _jax_roundtrip((params, tx.init(params)))
        for _ in range(3):  # the plans compile on the second call
            tied_rt()
        jax_rt()
        # host work only: nothing to wait for, and the rebuilt graph is not walked again
        runs = {"tied": _host_only(tied_rt), "jax": _host_only(jax_rt)}
        r = interleaved(runs, rounds, max(1, 20_000 // n))
        out[n] = {
            "tied_seconds": r["seconds"]["tied"],
            "jax_seconds": r["seconds"]["jax"],
            "ratio": r["ratio"]["tied"],
        }
    return out


# ---------------------------------------------------------------- report


def report(r: dict) -> list[str]:
    lines = []
    if "steps" in r:
        lines += [
            "## Host cost: Adam step at many tiny layers (issue 19)",
            "",
            "| layers | tied.jit + tied.optim | update_inplace under tied.jit | jax.jit + optax (tuples) | "
            "ratio (min-max) | in place ratio (min-max) | first call tied / jax |",
            "|---|---|---|---|---|---|---|",
        ]
        for n, s in r["steps"].items():
            sec, ra = s["seconds"], s["ratio"]
            a, b = ra["tied.jit + tied.optim"], ra["update_inplace under tied.jit"]
            f = s["first_call_seconds"]
            lines.append(
                f"| {int(n):,} | {sec['tied.jit + tied.optim'] * 1e3:.2f} ms | "
                f"{sec['update_inplace under tied.jit'] * 1e3:.2f} ms | "
                f"{sec['jax.jit + optax'] * 1e3:.2f} ms | "
                f"{a['median']:.2f}x ({a['min']:.2f}-{a['max']:.2f}) | {b['median']:.2f}x "
                f"({b['min']:.2f}-{b['max']:.2f}) | "
                f"{f['tied.jit + tied.optim'] / f['jax.jit + optax']:.2f}x |"
            )
        lines.append("")
    if "scaling" in r:
        lines += [
            "## Host cost: flatten + unflatten, 10 to 100,000 modules (issue 19)",
            "",
            "| modules | tied (warm) | per module | jax.tree_util, registered classes | ratio (min-max) | "
            f"first call (walk; median of {COLD_ROUNDS}, the very first) | compiling call (median of "
            f"{COLD_ROUNDS}) | first / warm | "
            "compiling / warm |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, s in r["scaling"].items():
            ra = s["ratio"]
            lines.append(
                f"| {int(n):,} | {s['tied_seconds'] * 1e6:.0f} us | {s['tied_us_per_module']:.2f} us | "
                f"{s['jax_seconds'] * 1e6:.0f} us | {ra['median']:.2f}x ({ra['min']:.2f}-{ra['max']:.2f}) | "
                f"{s['first_seconds'] * 1e3:.2f} ms, "
                f"{s.get('first_once_seconds', s['first_seconds']) * 1e3:.2f} ms | "
                + (
                    f"{s['compile_seconds'] * 1e3:.1f} ms (call {s['planned_at_call']})"
                    if s["planned"]
                    else "none (walked)"
                )
                + f" | {s['first_over_warm']:.1f}x | "
                + (f"{s['compile_seconds'] / s['tied_seconds']:.1f}x |" if s["planned"] else "|")
            )
        lines.append("")
    if "step_host" in r:
        lines += [
            "## Host work on a step's arguments: model and Adam state, flatten + unflatten (issue 19)",
            "",
            "| layers | tied (its plans, as tied.jit runs them) "
            "| jax.tree_util on (w, b) tuples and optax's state | ratio (min-max) |",
            "|---|---|---|---|",
        ]
        for n, s in r["step_host"].items():
            ra = s["ratio"]
            lines.append(
                f"| {int(n):,} | {s['tied_seconds'] * 1e3:.2f} ms | {s['jax_seconds'] * 1e3:.2f} ms | "
                f"{ra['median']:.2f}x ({ra['min']:.2f}-{ra['max']:.2f}) |"
            )
        lines.append("")
    return lines


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--layers", default="30,300,1000")
    parser.add_argument("--host-layers", default="1000,20000", help="host work on a step's arguments")
    args = parser.parse_args(argv)
    r: dict = {}
    if args.layers:
        r["steps"] = steps(tuple(int(s) for s in args.layers.split(",")), args.rounds)
    if args.sizes:
        r["scaling"] = scaling(tuple(int(s) for s in args.sizes.split(",")), args.rounds)
    if args.host_layers:
        r["step_host"] = step_host(tuple(int(s) for s in args.host_layers.split(",")), args.rounds)
    print("\n".join(report(r)))
    return r


if __name__ == "__main__":
    main()
