"""Equinox modules and Flax NNX modules inside, or as, tied models.

`tied` walks both as JAX pytree nodes (Flax NNX 0.12 makes `nnx.Module` and
`nnx.Variable` pytrees), one level at a time and by identity, so a layer or an
`nnx.Param` held at two places is one parameter. Every check is against plain JAX on
an untied copy (`helpers.untied_copy`: its own walker, a new container and a new
array at every place): per-place partials from `jax.grad`, summed by hand over the
places of each tie, and optax stepped by hand on the unique parameters.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Chain, grouped_totals, is_param, places, rebuild, untied_copy

import tied

nnx = pytest.importorskip("flax.nnx")


# ---------------------------------------------------------------- the reference


def reference_totals(model, loss):
    """{path: the total gradient of the array there}: plain jax.grad of the loss on an untied
    copy, taken with respect to a dict of its arrays by place (so that a tied-registered
    container, which JAX refuses, can hold them), summed by hand over each tie."""
    copy = untied_copy(model)
    arrays = {p: x for p, x in places(copy) if is_param(x)}
    partials = jax.grad(lambda a: loss(rebuild(copy, lambda p, x: a.get(p, x))))(arrays)
    return grouped_totals(model, partials)


def first_places(model) -> dict[str, int]:
    """The path of each unique parameter's first place -> the ids of that parameter."""
    seen: dict[int, str] = {}
    for p, x in places(model):
        if is_param(x):
            seen.setdefault(id(x), p)
    return {p: i for i, p in seen.items()}


def check_grad(model, loss):
    g = tied.grad(loss)(model)
    ref = reference_totals(model, loss)
    got = {p: x for p, x in places(g) if is_param(x)}
    assert set(got) == set(ref)
    for p in ref:
        np.testing.assert_allclose(got[p], ref[p], rtol=1e-5, atol=1e-6, err_msg=p)
    # one gradient object at every place of a tie
    by_id: dict[int, list[str]] = {}
    for p, x in places(model):
        if is_param(x):
            by_id.setdefault(id(x), []).append(p)
    for ps in by_id.values():
        assert all(got[q] is got[ps[0]] for q in ps), ps
    return g


def check_adam(model, loss, steps=3, lr=1e-2, step_fn=None):
    """tied.optim with Adam against optax stepped by hand on the unique parameters, whose
    gradients are plain jax.grad partials on an untied copy summed by hand."""
    tx = optax.adam(lr)
    firsts = first_places(model)
    ref = {p: x for p, x in places(model) if p in firsts}
    ref_state = tx.init(ref)
    state = tied.optim.setup(tx, model)
    step = step_fn or (lambda m, s: tied.optim.update(s, m, tied.grad(loss)(m)))
    for _ in range(steps):
        totals = reference_totals(model, loss)
        updates, ref_state = tx.update({p: totals[p] for p in ref}, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
        model, state = step(model, state)
        for p, x in places(model):
            if p in ref:
                np.testing.assert_allclose(x, ref[p], rtol=1e-5, atol=1e-6, err_msg=p)
    return model, state


def check_ties(model, expected):
    assert tied.ties(model) == expected


def check_save_load(model, tmp_path, like=None):
    path = tmp_path / "m.safetensors"
    tied.save(path, model)
    back = tied.load(path, like=like if like is not None else model)
    assert tied.ties(back) == tied.ties(model)
    for (p, x), (q, y) in zip(places(model), places(back)):
        assert p == q
        if is_param(x):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)
    return back


# ---------------------------------------------------------------- Equinox


class EqxNet(eqx.Module):
    first: eqx.nn.Linear
    hidden: eqx.nn.Linear
    again: eqx.nn.Linear  # the same object as `hidden`
    head_w: jax.Array  # the same array as first.weight
    act: object = eqx.field(static=True, default=jnp.tanh)

    def __call__(self, x):
        h = self.act(self.first(x))
        h = self.act(self.hidden(h))
        h = self.act(self.again(h))
        return (h @ self.head_w).sum()  # head_w is first.weight: (H, D), h: (H,)


def make_eqx():
    k1, k2 = jax.random.split(jax.random.key(0))
    first = eqx.nn.Linear(3, 5, key=k1)
    shared = eqx.nn.Linear(5, 5, key=k2)
    return EqxNet(first, shared, shared, first.weight)


X3 = jax.random.normal(jax.random.key(7), (6, 3))


def eqx_loss(m):
    return jnp.mean(jax.vmap(m)(X3) ** 2)


def test_equinox_model_grad_against_plain_jax_on_an_untied_copy():
    m = make_eqx()
    check_ties(m, [(".first.weight", ".head_w"), (".hidden", ".again")])
    g = check_grad(m, eqx_loss)
    assert g.hidden is g.again and g.head_w is g.first.weight


def test_equinox_model_adam_under_tied_jit_keeps_ties(tmp_path):
    m = make_eqx()

    @tied.jit
    def step(m, s):
        return tied.optim.update(s, m, tied.grad(eqx_loss)(m))

    out, state = check_adam(m, eqx_loss, step_fn=step)
    assert out.hidden is out.again and out.head_w is out.first.weight
    back = check_save_load((out, state), tmp_path)
    assert back[0].hidden is back[0].again and back[0].head_w is back[0].first.weight


def test_equinox_layer_inside_a_tied_chain():
    lin = eqx.nn.Linear(4, 4, key=jax.random.key(3))
    m = Chain(lin, jnp.tanh, lin)  # one eqx.nn.Linear at two places of a tied Chain
    x = jnp.arange(4.0)
    loss = lambda m: jnp.sum(m(x) ** 2)
    check_ties(m, [(".layers[0]", ".layers[2]")])
    g = check_grad(m, loss)
    assert g.layers[0] is g.layers[2]
    out, _ = check_adam(m, loss)
    assert out.layers[0] is out.layers[2]


# ---------------------------------------------------------------- Flax NNX


V, D = 7, 4
IDS = jnp.array([0, 3, 5, 1, 6])
Y = jax.random.normal(jax.random.key(1), (5, V))


class TiedLM(nnx.Module):
    """An embedding read back as the output head (one nnx.Param at two places) and one
    nnx.Linear applied twice (one Module at two places)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = nnx.Linear(D, D, rngs=rngs)
        self.again = self.block
        self.head = self.embed.embedding

    def __call__(self, ids):
        h = self.embed(ids)
        h = jnp.tanh(self.block(h))
        h = jnp.tanh(self.again(h))
        return h @ self.head[...].T


def nnx_loss(m):
    return jnp.mean((m(IDS) - Y) ** 2)


def test_nnx_module_is_walked_with_its_shared_param_and_layer():
    m = TiedLM(nnx.Rngs(0))
    assert m.head is m.embed.embedding and isinstance(m.head, nnx.Param)
    check_ties(m, [(".again", ".block"), (".embed.embedding", ".head")])
    assert tied.param_count(m) == V * D + D * D + D


def test_nnx_grad_against_plain_jax_and_against_nnx_grad():
    m = TiedLM(nnx.Rngs(0))
    g = check_grad(m, nnx_loss)
    assert g.head is g.embed.embedding and g.block is g.again
    ng = nnx.grad(nnx_loss)(m)  # NNX's own totals (it deduplicates Variables by identity)
    np.testing.assert_allclose(g.head[...], ng["embed"]["embedding"][...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.block.kernel[...], ng["again"]["kernel"][...], rtol=1e-5, atol=1e-6)


def test_nnx_adam_under_tied_jit_save_load_and_agreement_with_nnx_optimizer(tmp_path):
    m = TiedLM(nnx.Rngs(0))

    @tied.jit
    def step(m, s):
        return tied.optim.update(s, m, tied.grad(nnx_loss)(m))

    out, state = check_adam(m, nnx_loss, steps=4, step_fn=step)
    assert out.head is out.embed.embedding and out.block is out.again
    assert m.head is m.embed.embedding  # the input model is untouched
    theirs = TiedLM(nnx.Rngs(0))
    opt = nnx.Optimizer(theirs, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(4):
        opt.update(theirs, nnx.grad(nnx_loss)(theirs))
    np.testing.assert_allclose(out.head[...], theirs.head[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.again.kernel[...], theirs.again.kernel[...], rtol=1e-5, atol=1e-6)
    back, _ = check_save_load((out, state), tmp_path)
    assert back.head is back.embed.embedding and back.block is back.again
    np.testing.assert_allclose(nnx_loss(back), nnx_loss(out), rtol=1e-6)


def test_nnx_layer_inside_a_tied_chain_and_tied_map():
    lin = nnx.Linear(3, 3, rngs=nnx.Rngs(2))
    m = Chain(lin, jnp.tanh, lin)
    x = jnp.ones((2, 3))
    loss = lambda m: jnp.sum(m(x) ** 2)
    check_ties(m, [(".layers[0]", ".layers[2]")])
    g = check_grad(m, loss)
    assert g.layers[0] is g.layers[2]
    out, _ = check_adam(m, loss)
    assert out.layers[0] is out.layers[2] and isinstance(out.layers[0], nnx.Linear)

    from tied._tree.map import map as tmap

    half = tmap(lambda a: a.astype(jnp.bfloat16), TiedLM(nnx.Rngs(0)))
    assert half.head is half.embed.embedding and half.head[...].dtype == jnp.bfloat16


def test_surgery_on_nnx_and_equinox_modules():
    from tied._tree.map import map as tmap
    from tied._tree.surgery import replace, tie, untie

    m = TiedLM(nnx.Rngs(0))
    u = untie(m, ".head")  # the head gets its own nnx.Param, a copy of the embedding
    assert u.head is not u.embed.embedding and isinstance(u.head, nnx.Param)
    np.testing.assert_array_equal(u.head[...], m.embed.embedding[...])
    assert tied.ties(u) == [(".again", ".block")] and m.head is m.embed.embedding
    t = tie(u, ".embed.embedding", ".head")  # and tied back, as Hugging Face's tie_weights
    assert t.head is t.embed.embedding
    new = nnx.Linear(D, D, rngs=nnx.Rngs(5))
    r = replace(m, ".block", new)  # both places of the reused layer
    assert r.block is new and r.again is new
    by_hand = TiedLM(nnx.Rngs(0))
    by_hand.block = by_hand.again = new
    np.testing.assert_allclose(nnx_loss(r), nnx_loss(by_hand), rtol=1e-6)
    seen = []

    def zero_kernels(x):  # f also gets the arrays outside every nnx.Linear (the embedding)
        if not isinstance(x, nnx.Linear):
            return x
        seen.append(x)
        return replace(x, ".kernel", nnx.Param(x.kernel[...] * 0))

    zeroed = tmap(zero_kernels, m, is_leaf=lambda x: isinstance(x, nnx.Linear))
    assert seen == [m.block] and zeroed.block is zeroed.again and not np.any(zeroed.block.kernel[...])
    assert zeroed.head is zeroed.embed.embedding and zeroed.head[...] is m.head[...]

    e = make_eqx()
    u = untie(e, ".again")
    assert u.again is not u.hidden and tied.ties(u) == [(".first.weight", ".head_w")]
    g = check_grad(u, eqx_loss)  # now two parameters, each with its own total
    assert g.again is not g.hidden
