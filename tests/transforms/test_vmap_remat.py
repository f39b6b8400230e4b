"""tied.vmap (per-example gradients, ensembles over a Stack, state per member) and
tied.remat (same values, gradients and state writes; JAX's remat primitive in the jaxpr)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied
from tied.nn import BatchNorm, Chain, Dense


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def _tied_model():
    d1 = Dense(3, 3, key=jax.random.key(0))
    return Chain(d1, Dense(3, 2, key=jax.random.key(1)), Dense(d1.weight, d1.bias))  # weight tied


def _loss(m, x):
    h = m.layers[0](x)
    return jnp.sum(jnp.tanh(m.layers[2](h)) ** 2) + jnp.sum(m.layers[1](h))


def test_per_example_gradients_equal_a_loop_of_tied_grad_with_ties_kept():
    model = _tied_model()
    xs = jax.random.normal(jax.random.key(2), (5, 1, 3))
    g = tied.vmap(tied.grad(_loss), in_axes=(None, 0))(model, xs)
    assert g.layers[0].weight is g.layers[2].weight and g.layers[0].weight.shape == (5, 3, 3)
    for i in range(5):
        ref = tied.grad(_loss)(model, xs[i])
        _close(g.layers[0].weight[i], ref.layers[0].weight)
        _close(g.layers[1].weight[i], ref.layers[1].weight)
        _close(g.layers[2].bias[i], ref.layers[2].bias)
    # the per-example gradients are tied's totals: accumulate takes them as they are
    total = tied.accumulate(model, g)
    assert total.layers[0].weight is total.layers[2].weight


def test_per_example_gradients_against_plain_jax_on_untied_arrays():
    model = _tied_model()
    xs = jax.random.normal(jax.random.key(2), (4, 1, 3))
    w, b = model.layers[0].weight, model.layers[0].bias
    w1, b1 = model.layers[1].weight, model.layers[1].bias

    def ref(wa, ba, wc, bc, x):  # the tie's two uses as two arguments: partials, summed below
        h = x @ wa.T + ba
        return jnp.sum(jnp.tanh(h @ wc.T + bc) ** 2) + jnp.sum(h @ w1.T + b1)

    g = tied.vmap(tied.grad(_loss), in_axes=(None, 0))(model, xs)
    ga, _, gc, _ = jax.vmap(jax.grad(ref, argnums=(0, 1, 2, 3)), in_axes=(None, None, None, None, 0))(
        w, b, w, b, xs
    )
    _close(g.layers[0].weight, ga + gc)


def test_an_ensemble_of_four_over_a_stack_equals_four_calls():
    shared = Dense(3, 3, key=jax.random.key(9))  # broadcast: one object in every member
    models = [Chain(shared, Dense(3, 2, key=jax.random.key(i))) for i in range(4)]
    x = jax.random.normal(jax.random.key(5), (6, 3))
    out = tied.vmap(lambda m, x: m(x), in_axes=(0, None))(tied.stack(models), x)
    assert out.shape == (4, 6, 2)
    for i, m in enumerate(models):
        _close(out[i], m(x))


def test_state_written_into_a_mapped_member_goes_to_its_slice():
    bns = [BatchNorm(3) for _ in range(4)]
    refs = [BatchNorm(3) for _ in range(4)]
    xs = jax.random.normal(jax.random.key(6), (4, 8, 3))
    s = tied.stack(bns)
    out = tied.vmap(lambda m, x: m(x))(s, xs)
    for i, r in enumerate(refs):
        _close(out[i], r(xs[i]))
        _close(s.member.running_mean.value[i], r.running_mean.value)
        _close(s.member.running_var.value[i], r.running_var.value)
    np.testing.assert_array_equal(s.member.num_batches_tracked.value, [1, 1, 1, 1])


def test_state_written_under_jit_of_vmap_reaches_the_caller():
    s = tied.stack([BatchNorm(3) for _ in range(2)])
    ref = BatchNorm(3)
    xs = jax.random.normal(jax.random.key(6), (2, 8, 3))
    tied.jit(tied.vmap(lambda m, x: m(x)))(s, xs)
    ref(xs[1])
    _close(s.member.running_mean.value[1], ref.running_mean.value)


def test_state_written_into_an_unmapped_argument_is_a_graph_error_and_nothing_is_written():
    bn = BatchNorm(3)
    before = bn.running_mean.value
    xs = jnp.ones((4, 8, 3))
    with pytest.raises(
        tied.GraphError,
        match=r"args\[0\]\.running_mean\.value: tied.vmap: the function wrote state into an object "
        "every example shares",
    ):
        tied.vmap(lambda m, x: m(x), in_axes=(None, 0))(bn, xs)
    assert bn.running_mean.value is before and int(bn.num_batches_tracked.value) == 0


def test_state_written_into_a_broadcast_object_of_a_mapped_stack_is_a_graph_error():
    bn = BatchNorm(3)
    s = tied.stack([Chain(Dense(3, 3, key=jax.random.key(i)), bn) for i in range(3)])
    before = bn.running_mean.value
    with pytest.raises(tied.GraphError, match=r"args\[0\]\.member\.layers\[1\]\.running_mean\.value"):
        tied.vmap(lambda m, x: m(x), in_axes=(0, None))(s, jnp.ones((8, 3)))
    assert bn.running_mean.value is before


def test_vmap_out_axes_per_element_and_axis_size():
    model = _tied_model()
    xs = jnp.ones((3, 1, 3))
    loss, g = tied.vmap(tied.value_and_grad(_loss), in_axes=(None, 0), out_axes=(0, 1))(model, xs)
    assert loss.shape == (3,) and g.layers[0].weight.shape == (3, 3, 3)
    assert g.layers[1].weight.shape == (2, 3, 3)  # examples on axis 1
    ones = tied.vmap(lambda m: m.layers[0].weight, in_axes=(None,), axis_size=2)(model)
    assert ones.shape == (2, 3, 3)


def test_in_axes_that_disagree_on_one_array_are_refused():
    w = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"mapped in one argument and not"):
        tied.vmap(lambda a, b: a + b, in_axes=(0, None))({"w": w}, {"w": w})
    s = tied.stack([{"w": jnp.ones(4) * i, "shared": w} for i in range(4)])
    with pytest.raises(ValueError, match=r"holds a tied.Stack below its root"):
        tied.vmap(lambda m: m["s"].member["w"])({"s": s})  # its broadcast (4, 3) would be misread


# ---------------------------------------------------------------- remat


def _bn_model():
    d = Dense(3, 3, key=jax.random.key(0))
    return Chain(d, BatchNorm(3), Dense(d.weight, d.bias))


def _bn_loss(m, x):
    return jnp.sum(jnp.tanh(m(x)) ** 2)


def test_remat_gives_the_same_values_gradients_and_state_writes():
    x = jax.random.normal(jax.random.key(3), (8, 3))
    plain, rem = _bn_model(), _bn_model()
    block = tied.remat(lambda m, x: m(x))
    g_ref = tied.grad(_bn_loss)(plain, x)
    g = tied.grad(lambda m, x: jnp.sum(jnp.tanh(block(m, x)) ** 2))(rem, x)
    assert g.layers[0].weight is g.layers[2].weight
    _close(g.layers[0].weight, g_ref.layers[0].weight)
    _close(g.layers[1].weight, g_ref.layers[1].weight)
    _close(rem.layers[1].running_mean.value, plain.layers[1].running_mean.value)
    assert int(rem.layers[1].num_batches_tracked.value) == 1
    # under tied.jit too
    jitted = tied.jit(lambda m, x: block(m, x))
    out = jitted(rem, x)
    _close(out, plain(x))
    _close(rem.layers[1].running_var.value, plain.layers[1].running_var.value)


def test_remat_puts_the_remat_primitive_in_the_jaxpr():
    model, x = _bn_model(), jnp.ones((4, 3))
    block = tied.remat(lambda m, x: m(x), policy=jax.checkpoint_policies.nothing_saveable)
    jaxpr = jax.make_jaxpr(lambda g, x: block(g.value, x))(tied.Graph(model), x)
    names = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert names & {"checkpoint", "remat", "remat2"}, names


def test_remat_static_argnums():
    model = _bn_model()
    block = tied.remat(lambda m, x, scale: m(x) * scale, static_argnums=(2,))
    x = jnp.ones((4, 3))
    ref = _bn_model()
    _close(block(model, x, 3.0), ref(x) * 3.0)


# ---------------------------------------------------------------- nothing silently dropped (point 7)


def test_a_kv_cache_written_in_a_plain_lax_scan_body_is_a_graph_error_not_dropped():
    blocks = [tied.nn.TransformerBlock(8, 2, key=jax.random.key(i)) for i in range(3)]
    caches = [b.attn.cache(4, batch_shape=(1,)) for b in blocks]
    stacked_blocks = tied.stack(blocks)
    stacked_caches = tied.stack(caches)

    @tied.jit
    def decode(blocks, caches, x):
        def body(h, layer):
            blk, cache = layer[0].value, layer[1].value
            return blk.decode(h, cache), None

        return jax.lax.scan(body, x, (tied.Graph(blocks.member), tied.Graph(caches.member)))[0]

    with pytest.raises(
        tied.GraphError,
        match=r"tied\.Graph\(\.\.\.\)\.value\.keys\.value: tied\.jit: state was written on a copy"
        r".*tied\.scan",
    ):
        decode(stacked_blocks, stacked_caches, jnp.ones((1, 1, 8)))
    np.testing.assert_array_equal(stacked_caches.member.position.value, [0, 0, 0])  # untouched


def test_jax_checkpoint_closing_over_a_batchnorm_is_a_graph_error_naming_tied_remat():
    model = _bn_model()
    before = model.layers[1].running_mean.value

    def f(m, x):
        return jax.checkpoint(lambda x: m(x))(x).sum()

    for run in (tied.jit(f), tied.grad(f), tied.value_and_grad(f)):
        with pytest.raises(
            tied.GraphError, match=r"\.layers\[1\]\.running_mean\.value: tied\.(jit|grad).*tied\.remat"
        ):
            run(model, jnp.ones((4, 3)))
        assert model.layers[1].running_mean.value is before


@pytest.mark.parametrize("transform", ["vmap", "cond", "checkpoint"])
def test_state_written_on_a_graph_copy_inside_a_plain_transform_is_refused(transform):
    model = _bn_model()
    before = model.layers[1].running_mean.value
    x = jnp.ones((4, 3)) * jnp.arange(3.0)

    def f(m, x):
        g = tied.Graph(m)
        if transform == "vmap":
            out = jax.vmap(lambda g, x: g.value(x), in_axes=(None, 0))(g, jnp.stack([x, x]))
        elif transform == "cond":
            out = jax.lax.cond(True, lambda g: g.value(x), lambda g: x, g)
        else:
            out = jax.checkpoint(lambda g: g.value(x))(g)
        return out.sum()

    for run in (tied.jit(f), tied.grad(f), tied.value_and_grad(f)):
        with pytest.raises(
            tied.GraphError, match=r"tied\.Graph\(\.\.\.\)\.value\.layers\[1\]\.running_mean\.value"
        ):
            run(model, x)
        assert model.layers[1].running_mean.value is before


def test_a_copy_carried_out_of_the_body_is_not_refused():
    bn = BatchNorm(3)
    x = jnp.ones((4, 3)) * jnp.arange(3.0)

    @tied.jit
    def f(bn, x):
        def body(g):
            m = g.value
            y = m(x)
            return y, tied.Graph(m)  # the written copy goes out: the caller's to use

        y, g = jax.checkpoint(body)(tied.Graph(bn))
        bn.running_mean.value = g.value.running_mean.value  # and is written back by hand
        return y

    f(bn, x)
    ref = BatchNorm(3)
    ref(x)
    _close(bn.running_mean.value, ref.running_mean.value)
