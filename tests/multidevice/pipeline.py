"""`tied.pipeline` on 8 fake CPU devices (a 2 x 4 mesh: "data" x "stage"), in a process of its own.

Run by tests/transforms/test_sharding_pipeline.py as ``python -m pytest tests/multidevice/pipeline.py``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The reference is the sequential
``tied.scan`` over the same stages on one device (itself checked against the unrolled loop and
plain JAX in tests/transforms/test_scan.py); the HLO checks read the compiled program's text.
"""

import eight_devices  # noqa: F401  (first: 8 fake CPU devices, set before JAX is imported)

# isort: split

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied._transforms import check

V, D, T, B, STAGES, MICRO = 13, 4, 3, 8, 4, 4  # V*D appears nowhere else among the shapes
MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
IDS = np.random.default_rng(0).integers(0, V, (2, B, T)).astype(np.int32)


def make():
    ln = tied.nn.LayerNorm(D)  # one norm: in every stage and after the pipeline

    def stage(k):
        blocks = tied.stack([tied.nn.Dense(D, D, key=kk) for kk in jax.random.split(k, 2)])
        return {"blocks": blocks, "ln": ln}

    emb = tied.nn.Embedding(V, D, key=jax.random.key(9))
    stages = tied.stack([stage(k) for k in jax.random.split(jax.random.key(1), STAGES)])
    return {"embed": emb, "stages": stages, "head": emb, "ln": ln}


def f(h, s):
    h, _ = tied.scan(lambda h, layer, _: (jnp.tanh(layer(h)), None), h, s["blocks"])
    return s["ln"](h)


def loss(m, ids, pipelined):
    h = m["embed"](ids)
    if pipelined:
        h = tied.pipeline(f, h, m["stages"], mesh=MESH, axis="stage", microbatches=MICRO)
    else:
        h = tied.scan(lambda h, s, _: (f(h, s), None), h, m["stages"])[0]
    return optax.softmax_cross_entropy_with_integer_labels(m["head"].attend(m["ln"](h)), ids).mean()


def place(model):
    return tied.device_put(model, tied.sharding_tree(model, [], mesh=MESH, stack_axis="stage"))


def assert_close(got, want, **tol):
    (a, ga), (b, gb) = tied.flatten(got), tied.flatten(want)
    assert ga == gb
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_stages_are_placed_one_per_device_along_the_axis():
    m = place(make())
    w = m["stages"].member["blocks"].member.weight  # (stages, layers, D, D)
    assert {tuple(s.data.shape) for s in w.addressable_shards} == {(1, 2, D, D)}
    assert m["ln"] is m["stages"].member["ln"] and m["embed"] is m["head"]


def test_values_and_gradients_equal_the_sequential_scan_and_ties_hold():
    model = make()
    want_loss, want_g = tied.value_and_grad(lambda m: loss(m, IDS[0], False))(model)
    step = tied.jit(lambda m, ids: tied.value_and_grad(lambda m: loss(m, ids, True))(m))
    got_loss, got_g = step(place(model), IDS[0])
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_close(got_g, want_g, rtol=1e-5, atol=1e-6)
    assert got_g["embed"] is got_g["head"]  # one total gradient for the tied table
    assert got_g["ln"] is got_g["stages"].member["ln"]  # and for the norm of every stage and after
    # The forward alone, without a gradient.
    h = jnp.asarray(model["embed"](IDS[0]))
    out = tied.jit(lambda st, h: tied.pipeline(f, h, st, mesh=MESH, axis="stage", microbatches=2))
    ref = tied.scan(lambda h, s, _: (f(h, s), None), h, model["stages"])[0]
    np.testing.assert_allclose(out(place(model)["stages"], h), ref, rtol=1e-6, atol=1e-6)


def test_adam_training_equals_one_device_and_keeps_one_parameter_per_tie():
    tx = optax.adam(1e-2, eps=1e-5)

    def step(m, s, ids, pipelined):
        value, g = tied.value_and_grad(lambda m: loss(m, ids, pipelined))(m)
        m, s = tied.optim.update(s, m, g)
        return m, s, value

    model = make()
    ref = (model, tied.optim.setup(tx, model))
    pm = place(model)
    got = (pm, tied.optim.setup(tx, pm))
    seq = tied.jit(lambda m, s, ids: step(m, s, ids, False))
    pipe = tied.jit(lambda m, s, ids: step(m, s, ids, True))
    for ids in IDS:
        *ref, ref_loss = seq(*ref, ids)
        *got, got_loss = pipe(*got, ids)
        assert_close((got, got_loss), (ref, ref_loss), rtol=1e-4, atol=2e-5)
        m = got[0]
        assert m["embed"] is m["head"] and m["ln"] is m["stages"].member["ln"]
    assert len(got[1].paths) == len(ref[1].paths) == 5  # table, norm (2), block weight and bias


def test_compiled_hlo_sends_between_neighbours_and_never_all_reduces_the_table_gradient():
    model = place(make())
    step = tied.jit(lambda m, ids: tied.value_and_grad(lambda m: loss(m, ids, True))(m))
    hlo = step.lower(model, IDS[0]).compile().as_text()
    permutes = [ln for ln in hlo.splitlines() if "collective-permute" in ln and "source_target_pairs" in ln]
    assert permutes
    for ln in permutes:
        pairs = re.findall(r"\{(\d+),(\d+)\}", ln.split("source_target_pairs=")[1].split("}}")[0] + "}")
        # Devices (data, stage) = (d, s) are numbered 4d + s: a neighbour is the next stage.
        assert pairs and all(abs(int(b) - int(a)) == 1 and int(a) // 4 == int(b) // 4 for a, b in pairs), ln
    reduces = [ln for ln in hlo.splitlines() if re.search(r"\ball-reduce(-start)?\(", ln)]
    table = re.compile(rf"f32\[{V},{D}\]")
    assert not [ln for ln in reduces if table.search(re.split(r" all-reduce(?:-start)?\(", ln)[0])], reduces
    for ln in reduces:  # the only all-reduces run over the stage axis (the norm's gradient, outputs)
        assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in ln, ln


def test_example_pipeline_lm_on_eight_devices():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "pipeline_lm.py"
    spec = importlib.util.spec_from_file_location("example_pipeline_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    r = example.main(steps=12, verbose=False)
    assert r["devices"] == 8 and r["traces"] == 1
    assert (
        r["one_table"] and r["one_norm"] and r["adam_entries"] == 5
    )  # table, norm (2), block weight and bias
    assert r["max_diff_vs_sequential"] < 1e-4
    assert r["stage_shard_shape"] == (1, 2, 32, 32)
    assert r["loss"] < r["first_loss"] - 1.0
    assert r["bubble"] == 3 / 7


def test_with_the_batch_split_over_data_the_table_gradient_is_reduced_over_data_only():
    model = place(make())
    step = tied.jit(lambda m, ids: tied.value_and_grad(lambda m: loss(m, ids, True))(m))
    ids = jax.device_put(IDS[0], jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec("data")))
    hlo = step.lower(model, ids).compile().as_text()
    table = re.compile(rf"f32\[{V},{D}\]")
    reduces = [ln for ln in hlo.splitlines() if re.search(r"\ball-reduce(-start)?\(", ln)]
    of_table = [ln for ln in reduces if table.search(re.split(r" all-reduce(?:-start)?\(", ln)[0])]
    assert of_table  # the batch is split over data: the table's gradient is summed over it
    for ln in of_table:  # devices (d, s) are 4d + s: the data axis pairs s with s + 4 (mesh axis 0)
        assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}" in ln or re.search(
            r"replica_groups=mesh\['axis_0'=2,[^\]]*\] \{'axis_0'\}", ln
        ), ln
    want_loss, want_g = tied.value_and_grad(lambda m: loss(m, IDS[0], False))(make())
    got_loss, got_g = step(model, ids)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_close(got_g, want_g, rtol=1e-5, atol=1e-6)


def _peak_over(limit):
    def fail(bad, peak):
        if np.any(bad):
            raise ValueError(
                f"stage input peak {float(np.max(np.where(bad, peak, -np.inf))):.1f} over {limit}"
            )

    return fail


def _gated(h, s, *, low=None, high=None):
    """Stage 0 multiplies h by 10, the others by 1; the later stages check their input's peak
    (``low``: at least; ``high``: at most), as a KV cache checks its position."""
    peak = jnp.max(jnp.abs(h))
    if low is not None:
        check(s["late"] & (jnp.min(jnp.abs(h)) < low), _peak_over(-low), peak)
    if high is not None:
        check(s["late"] & (peak > high), _peak_over(high), peak)
    return h * s["g"]


GATED = tied.stack(
    [{"g": jnp.array(10.0 if i == 0 else 1.0), "late": jnp.array(i > 0)} for i in range(STAGES)]
)


def test_a_check_in_a_stage_never_fires_on_a_bubble_and_a_real_failure_raises_its_own_error():
    """A bubble runs a stage on a value no stage gave it (the first microbatch's raw input, 1.0):
    a check that holds in the sequential scan (the later stages' input is at least 5.0) passed
    there and must pass here; before, it fired on the bubble, its host callback raised on one
    device and the others hung in the collective until XLA aborted the process. A check that
    fails on a real microbatch raises the check's own error, eagerly and under tied.jit."""
    h = jnp.ones((B, 2))
    low = functools.partial(_gated, low=5.0)
    want = tied.scan(lambda h, s, _: (low(h, s), None), h, GATED)[0]
    got = tied.pipeline(low, h, GATED, mesh=MESH, axis="stage", microbatches=MICRO)
    np.testing.assert_allclose(got, want)
    h = h.at[5].set(3.0)  # in microbatch 2 of 4: its peak is 30.0 after stage 0
    high = functools.partial(_gated, high=25.0)
    with pytest.raises(ValueError, match=r"^stage input peak 30\.0 over 25\.0$"):
        tied.scan(lambda h, s, _: (high(h, s), None), h, GATED)
    pipe = functools.partial(tied.pipeline, high, mesh=MESH, axis="stage", microbatches=MICRO)
    for run in (pipe, tied.jit(pipe)):
        with pytest.raises(ValueError, match=r"^stage input peak 30\.0 over 25\.0$"):
            jax.block_until_ready(run(h, GATED))
