"""How much Python the write-back of one warm `tied.jit` call runs: a count, not a time.

`sys.setprofile` counts the Python calls whose code lives in `_core/writeback.py` or
`_core/live.py` during one warm call (the function compiled, its plans made) that writes
state back, the calls into a generated write-back plan (``<tied write-back plan>``), and
all Python calls of the `tied.jit` call: a compiled write-back is two calls into the core
and two into its plan, the general walk (`slots`) some calls per place. (Under
``TIED_CHECK_PLANS=1`` every call also runs the walk, to compare.)
Four models:

* **a**: a dict and a list of three blocks, each with its own call counter (`tied.State`),
  one `BatchNorm` shared by two blocks;
* **b**: a list of 40 such blocks (over `plans.loops.LOOP_PLACES` places: its blocks are read
  by a loop), one `BatchNorm` shared by all;
* **c**: arrays in tuples: a function that puts a new tuple where the old one was (one tuple
  held at two places), and a view of two sources (a tuple);
* **d**: a state cell whose value is a tuple and one whose value is a dict.

    python -m benchmarks.writeback_calls
"""

from __future__ import annotations

import sys

import jax.numpy as jnp

import tied
from tied.nn import BatchNorm

FILES = ("_core/writeback.py", "_core/live.py")


@tied.register
class Block:
    def __init__(self, norm, k):
        self.w = jnp.full((2, 2), 0.1 * (k + 1))
        self.calls = tied.State(jnp.zeros((), jnp.int32))
        self.norm = norm
        self.extra = [jnp.full((2,), float(i)) for i in range(24)]  # places: loops need > 1000

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return self.norm(jnp.tanh(x @ self.w))


def blocks(n):
    norm = BatchNorm(2)
    return {"blocks": [Block(norm, k) for k in range(n)], "head": {"w": jnp.eye(2)}}


def run_blocks(m, x):
    for b in m["blocks"]:
        x = b(x)
    return (x @ m["head"]["w"]).sum()


def tuples():
    pair = (jnp.arange(2.0), jnp.ones(2))
    return {"a": pair, "b": pair, "v": tied.View((jnp.ones(2), jnp.zeros(2)), jnp.add)}


def run_tuples(m, x):
    w, s = m["a"]
    m["a"] = m["b"] = (w + x, s)
    a, b = m["v"].source
    m["v"].source = (a * 2.0, b)
    return w.sum()


def cells():
    return {"t": tied.State((jnp.zeros(2), jnp.ones(2))), "d": tied.State({"n": jnp.zeros(2)})}


def run_cells(m, x):
    a, b = m["t"].value
    m["t"].value = (a + x, b)
    m["d"].value = {"n": m["d"].value["n"] + 1.0}
    return a.sum()


CASES = {
    "a": (lambda: blocks(3), run_blocks),
    "b": (lambda: blocks(40), run_blocks),
    "c": (tuples, run_tuples),
    "d": (cells, run_cells),
}


def count(make, fun, warm: int = 3) -> tuple[int, int, int]:
    """(calls into writeback.py and live.py, calls into a generated write-back plan, Python
    calls in all) during one `tied.jit` call after ``warm`` calls."""
    model, x = make(), jnp.ones((4, 2)) if fun is run_blocks else jnp.ones(2)
    step = tied.jit(fun)
    for _ in range(warm):
        step(model, x)
    core = plan = total = 0

    def profile(frame, event, arg):
        nonlocal core, plan, total
        if event == "call":
            total += 1
            name = frame.f_code.co_filename.replace("\\", "/")
            if name.endswith(FILES):
                core += 1
            elif name.startswith("<tied write-back plan"):
                plan += 1

    sys.setprofile(profile)
    try:
        step(model, x)
    finally:
        sys.setprofile(None)
    return core, plan, total


def main() -> None:
    for name, (make, fun) in CASES.items():
        core, plan, total = count(make, fun)
        print(f"{name}: {core} calls in writeback.py/live.py, {plan} in a compiled write-back plan, ", end="")
        print(f"{total} in all")


if __name__ == "__main__":
    main()
