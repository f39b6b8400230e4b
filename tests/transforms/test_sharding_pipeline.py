"""`tied.pipeline`: its bad inputs (one device here) and, in tests/multidevice/pipeline.py (started
by `test_eight_fake_devices`), its values, gradients, training and compiled program on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from processes import pytest_on_fake_devices

import tied

MESH = Mesh(np.array(jax.devices()[:1]), ("stage",))


def test_eight_fake_devices():
    """tests/multidevice/pipeline.py under 8 fake CPU devices, in its own process."""
    code, report = pytest_on_fake_devices("tests/multidevice/pipeline.py")
    assert code == 0, report
    assert "7 passed" in report, report


def dense(i):
    return {"d": tied.nn.Dense(2, 2, key=jax.random.key(i))}


def f(h, s):
    return jnp.tanh(s["d"](h))


def test_one_stage_equals_the_scan_in_values_and_gradients():
    norm = tied.nn.LayerNorm(2)
    stages = tied.stack([{"d": tied.nn.Dense(2, 2, key=jax.random.key(0)), "norm": norm}])
    model = {"stages": stages, "norm": norm}
    h = jnp.arange(8.0).reshape(4, 2) / 8

    def g(h, s):
        return s["norm"](f(h, s))

    def loss(m, pipelined):
        if pipelined:
            out = tied.pipeline(g, h, m["stages"], mesh=MESH, axis="stage", microbatches=4)
        else:
            out = tied.scan(lambda h, s, _: (g(h, s), None), h, m["stages"])[0]
        return jnp.sum(m["norm"](out) ** 2)

    want = tied.grad(lambda m: loss(m, False))(model)
    got = tied.grad(lambda m: loss(m, True))(model)
    for a, b in zip(tied.flatten(got)[0], tied.flatten(want)[0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert got["norm"] is got["stages"].member["norm"]
    # Plain JAX by hand: the norm used inside the stage and after it, its gradient the sum of both.
    w, b = stages.member["d"].weight, stages.member["d"].bias  # one member: nothing stacked

    def by_hand(w, b, nw1, nb1, nw2, nb2):
        def ln(x, nw, nb):
            mu = x.mean(-1, keepdims=True)
            return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + norm.eps) * nw + nb

        return jnp.sum(ln(ln(jnp.tanh(h @ w.T + b), nw1, nb1), nw2, nb2) ** 2)

    parts = jax.grad(by_hand, argnums=(2, 4))(w, b, norm.weight, norm.bias, norm.weight, norm.bias)
    np.testing.assert_allclose(got["norm"].weight, parts[0] + parts[1], rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_value_errors_naming_the_argument():
    stages = tied.stack([dense(0)])
    h = jnp.ones((4, 2))
    run = tied.pipeline
    with pytest.raises(
        ValueError, match=r"tied.pipeline: stages must be a tied.Stack .* got list\. .*tied.stack"
    ):
        run(f, h, [dense(0), {"d": tied.nn.Dense(2, 2, key=jax.random.key(1), use_bias=False)}],
            mesh=MESH, axis="stage", microbatches=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"stages holds 2 stages but the mesh axis 'stage' has 1 devices"):
        run(f, h, tied.stack([dense(0), dense(1)]), mesh=MESH, axis="stage", microbatches=2)
    with pytest.raises(ValueError, match=r"init's batch of 4 does not split into microbatches=3"):
        run(f, h, stages, mesh=MESH, axis="stage", microbatches=3)
    with pytest.raises(ValueError, match=r"microbatches must be a positive int, got 0"):
        run(f, h, stages, mesh=MESH, axis="stage", microbatches=0)
    with pytest.raises(
        ValueError, match=r"axis 'pipe' is not an axis of the mesh, whose axes are \('stage',\)"
    ):
        run(f, h, stages, mesh=MESH, axis="pipe", microbatches=2)
    with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh, got NoneType"):
        run(f, h, stages, mesh=None, axis="stage", microbatches=2)
    with pytest.raises(ValueError, match=r"init's arrays have leading \(batch\) axes \[2, 4\]"):
        run(f, (h, jnp.ones((2, 2))), stages, mesh=MESH, axis="stage", microbatches=2)
    with pytest.raises(ValueError, match=r"init must be a pytree of arrays with a leading batch axis"):
        run(f, jnp.ones(()), stages, mesh=MESH, axis="stage", microbatches=1)
    bn = tied.stack([{"d": tied.nn.Dense(2, 2, key=jax.random.key(0)), "bn": tied.nn.BatchNorm(2)}])
    with pytest.raises(ValueError, match=r"stages holds state at stages\.member\['bn'\]\.running_mean"):
        run(f, h, bn, mesh=MESH, axis="stage", microbatches=2)


def _stage(h, s):
    return {"x": jnp.tanh(s["d"](h["x"]))}


@pytest.mark.parametrize(
    "g, how",
    [
        (
            lambda h, s: {"x": _stage(h, s)["x"].astype(jnp.bfloat16)},
            r"turns h\['x'\] of shape \(2, 2\) and dtype float32 .* dtype bfloat16",
        ),
        (
            lambda h, s: {"x": _stage(h, s)["x"][:, :1]},
            r"turns h\['x'\] of shape \(2, 2\) .* into shape \(2, 1\)",
        ),
        (
            lambda h, s: _stage(h, s)["x"],
            r"returned PyTreeDef\(\*\) for h of structure PyTreeDef\(\{'x': \*\}\)",
        ),
    ],
    ids=["dtype", "shape", "structure"],
)
def test_a_stage_that_does_not_keep_h_is_refused_naming_the_leaf(g, how):
    # JAX's own scan error before ("carry input and carry output must have equal types")
    stages, h = tied.stack([dense(0)]), {"x": jnp.ones((4, 2))}
    with pytest.raises(ValueError, match=r"tied\.pipeline: f " + how):
        tied.pipeline(g, h, stages, mesh=MESH, axis="stage", microbatches=2)
    want = tied.scan(lambda h, s, _: (_stage(h, s), None), h, stages)[0]["x"]  # f that keeps h runs
    got = tied.pipeline(_stage, h, stages, mesh=MESH, axis="stage", microbatches=2)["x"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
