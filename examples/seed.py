"""The FluxML example behind `tied`: a Chain whose second Dense shares the first one's arrays.

    d1 = Dense(2, 2); d2 = Dense(d1.weight, d1.bias); c = Chain(d1, d2)

Zygote's explicit (structural) gradient gave a different array at each of the two
places of `weight`, neither of them the parameter's gradient; its implicit gradient
summed them but lost the structure and picked up the input `x`. `tied` gives:

* explicit: the model's structure, with the *total* at each place, one object;
* implicit: a mapping keyed by the parameter objects, equal to the explicit totals,
  without `x`;
* per place (``per_location=True``): Zygote's explicit answer, for diagnostics.

Run: python examples/seed.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import tied
from tied.nn import Chain, Dense


def _arr(x) -> str:
    """An array on one line, rows separated by ';' as Julia prints a matrix."""
    a = np.atleast_2d(np.asarray(x))
    rows = "; ".join(" ".join(f"{v:.4f}" for v in row) for row in a)
    return f"[{rows}]"


def _structural(g) -> str:
    """A structural gradient printed the way Flux prints one."""
    layers = ", ".join(
        f"(weight = {_arr(d.weight)}, bias = {_arr(d.bias)}, activation = {d.activation})" for d in g.layers
    )
    return f"(layers = ({layers}),)"


def main(verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    kw, kx = jax.random.split(jax.random.key(0))
    d1 = Dense(jax.random.normal(kw, (2, 2)), jnp.zeros(2))
    d2 = Dense(d1.weight, d1.bias)  # shares d1's arrays by reference
    c = Chain(d1, d2)
    x = jax.random.uniform(kx, (1, 2))  # Flux's rand(2, 1), batch first
    loss = lambda m: m(x).sum()

    say("ties:", tied.ties(c))

    g = tied.grad(loss)(c)
    say("\nexplicit, tied.grad(loss)(c):")
    say(_structural(g))
    aliased = g.layers[0].weight is g.layers[1].weight and g.layers[0].bias is g.layers[1].bias
    say("g.layers[0].weight is g.layers[1].weight:", aliased)

    gs = tied.gradient(lambda: c(x).sum(), tied.params(c))
    say(f"\nimplicit, tied.gradient(lambda: c(x).sum(), tied.params(c)): {len(gs)} entries")
    for p, gp in gs.items():
        say(f"  {_arr(p)} => {_arr(gp)}")
    implicit_equal = bool(
        jnp.allclose(gs[d1.weight], g.layers[0].weight) and jnp.allclose(gs[d1.bias], g.layers[0].bias)
    )
    x_in_grads = any(k is x for k in gs)
    say("gs[d1.weight] == g.layers[0].weight:", implicit_equal, "| x is a key:", x_in_grads)

    p = tied.grad(loss, per_location=True)(c)
    say("\nper place, tied.grad(loss, per_location=True)(c) (what Zygote's explicit mode gave):")
    say(_structural(p))
    partials_sum = bool(jnp.allclose(p.layers[0].weight + p.layers[1].weight, g.layers[0].weight))
    say("p.layers[0].weight + p.layers[1].weight == the total:", partials_sum)
    say("p.layers[0].weight is p.layers[1].weight:", p.layers[0].weight is p.layers[1].weight)

    return {
        "aliased": aliased,
        "implicit_equals_explicit": implicit_equal,
        "x_in_implicit": x_in_grads,
        "partials_sum_to_total": partials_sum,
        "total": np.asarray(g.layers[0].weight),
        "model": c,
        "x": x,
    }


if __name__ == "__main__":
    main()
