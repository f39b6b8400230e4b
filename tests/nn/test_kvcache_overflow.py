"""A KVCache that overflows fails loudly, eagerly and under tied.jit, never clamps its writes silently.

Reference: the same decode steps run eagerly (which raise a ValueError at the step that does not fit)
and the full-sequence attention for the steps that fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied
from tied.nn import CausalSelfAttention, KVCache, TransformerBlock

MATCH = r"KVCache: 4 positions are written and 1 more do not fit in max_len=4"


def setup():
    attn = CausalSelfAttention(8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, 8))
    return attn, x


def test_eagerly_the_fifth_token_into_four_places_raises():
    attn, x = setup()
    cache = KVCache(4, 2, 4, batch_shape=(1,))
    for t in range(4):
        attn.decode(x[:, t : t + 1], cache)
    with pytest.raises(ValueError, match=MATCH):
        attn.decode(x[:, 4:5], cache)


@pytest.mark.parametrize("shared", [False, True])
def test_under_tied_jit_the_fifth_token_into_four_places_raises_and_writes_nothing(shared):
    """Six one-token steps into a cache of four under tied.jit: steps 1-4 equal the full attention's
    rows; step 5 raises with the eager message, and the caller's cache is left as step 4 left it (its
    position 4, its rows those of the eager run). With the block at two places (shared), the same."""
    attn, x = setup()
    model = {"a": attn, "b": attn} if shared else {"a": attn}
    cache = KVCache(4, 2, 4, batch_shape=(1,))
    step = tied.jit(lambda m, c, xt: m["a"].decode(xt, c))
    ref = attn(x[:, :4])
    outs = [step(model, cache, x[:, t : t + 1]) for t in range(4)]
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, atol=1e-5)
    keys, values = np.asarray(cache.keys.value), np.asarray(cache.values.value)
    with pytest.raises(Exception, match=MATCH):
        jax.block_until_ready(step(model, cache, x[:, 4:5]))
    assert int(cache.position.value) == 4
    assert np.array_equal(np.asarray(cache.keys.value), keys)
    assert np.array_equal(np.asarray(cache.values.value), values)
    with pytest.raises(Exception, match=MATCH):  # and again: it never goes through
        jax.block_until_ready(step(model, cache, x[:, 5:6]))


def test_a_jitted_block_decode_and_a_multi_token_step_overflow_loudly():
    """TransformerBlock.decode under tied.jit, a 3-token step after 2 into a cache of 4: raises."""
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    cache = block.attn.cache(4, batch_shape=(1,))
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    step = tied.jit(lambda b, c, xt: b.decode(xt, c))
    step(block, cache, x[:, :2])
    with pytest.raises(
        Exception, match=r"KVCache: 2 positions are written and 3 more do not fit in max_len=4"
    ):
        jax.block_until_ready(step(block, cache, x[:, 2:5]))
    assert int(cache.position.value) == 2


def test_overflow_under_plain_jax_jit_of_a_graph_raises_too():
    """The check lives in the traced program, not in tied.jit: jax.jit over tied.Graph raises too."""
    attn, x = setup()
    cache = KVCache(4, 2, 4, batch_shape=(1,))

    @jax.jit
    def step(g, xt):
        a, c = g.value
        out = a.decode(xt, c)
        return out, tied.Graph((a, c))

    g = tied.Graph((attn, cache))
    for t in range(4):
        _, g = step(g, x[:, t : t + 1])
    with pytest.raises(Exception, match=MATCH):
        jax.block_until_ready(step(g, x[:, 4:5]))


def test_an_ensemble_of_caches_under_tied_vmap_overflows_loudly_and_fits_silently():
    """The check runs inside a cond (no host call while the cache fits); under vmap the cond's
    predicate is batched, and the check still raises when any member overflows."""
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    caches = tied.stack([block.attn.cache(4, batch_shape=(1,)) for _ in range(2)])
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    step = tied.jit(tied.vmap(lambda c, xt: block.decode(xt, c), in_axes=(0, None)))
    y = step(caches, x[:, :2])
    ref = block.decode(x[:, :2], block.attn.cache(4, batch_shape=(1,)))  # eager, one member
    np.testing.assert_allclose(y[0], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(caches.member.position.value, [2, 2])
    with pytest.raises(
        Exception, match=r"KVCache: 2 positions are written and 3 more do not fit in max_len=4"
    ):
        jax.block_until_ready(step(caches, x[:, 2:5]))
    np.testing.assert_array_equal(caches.member.position.value, [2, 2])  # nothing written back


def _no_host_callback(jitted, *args):
    text = jitted.lower(*args).as_text()
    return "callback" not in text.lower()


def test_a_jitted_decode_holds_no_host_callback_and_still_overflows_loudly():
    """The check's flag is an output of the program, read by tied.jit after the call: no host
    callback in the program (which would cost JAX's C++ dispatch path on every decoded token)."""
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    cache = block.attn.cache(4, batch_shape=(1,))
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    step = tied.jit(lambda b, c, xt: b.decode(xt, c))
    assert _no_host_callback(step, block, cache, x[:, :1])
    ref_cache = block.attn.cache(4, batch_shape=(1,))
    for t in range(4):
        np.testing.assert_allclose(
            step(block, cache, x[:, t : t + 1]),
            block.decode(x[:, t : t + 1], ref_cache),
            rtol=1e-5,
            atol=1e-6,
        )
    np.testing.assert_allclose(cache.keys.value, ref_cache.keys.value, rtol=1e-5, atol=1e-6)
    keys = np.asarray(cache.keys.value).copy()
    with pytest.raises(
        ValueError, match=r"KVCache: 4 positions are written and 1 more do not fit in max_len=4"
    ):
        step(block, cache, x[:, 4:5])
    assert int(cache.position.value) == 4  # nothing written back
    np.testing.assert_array_equal(cache.keys.value, keys)


def test_a_stacked_cache_under_tied_scan_overflows_loudly_eagerly_and_under_jit():
    """tied.scan carries each step's check out of the scan: raised around it, with no callback
    in a tied.jit program, and nothing written back."""
    blocks = [TransformerBlock(8, 2, key=jax.random.key(i)) for i in range(3)]
    stack = tied.stack(blocks)
    x = jax.random.normal(jax.random.key(3), (1, 3, 8))

    def decode(s, caches, xt):
        def f(h, layer, _):
            blk, cache = layer
            return blk.decode(h, cache), None

        return tied.scan(f, xt, (s, caches))[0]

    for run in (decode, tied.jit(decode)):
        caches = tied.stack([b.attn.cache(2, batch_shape=(1,)) for b in blocks])
        if run is not decode:
            assert _no_host_callback(run, stack, caches, x[:, :2])
        run(stack, caches, x[:, :2])
        keys = np.asarray(caches.member.keys.value).copy()
        with pytest.raises(
            ValueError, match=r"KVCache: 2 positions are written and 1 more do not fit in max_len=2"
        ):
            run(stack, caches, x[:, 2:3])
        np.testing.assert_array_equal(caches.member.position.value, [2, 2, 2])
        np.testing.assert_array_equal(caches.member.keys.value, keys)


def test_the_first_overflowing_step_of_a_scan_over_time_is_named_as_the_eager_loop_names_it():
    # Found by review: steps after the overflow carry positions past max_len; the message names
    # the first one, as the eager loop over tokens does (4 written, 1 more).
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (1, 6, 8))
    xs = jnp.moveaxis(x, 1, 0)[:, :, None, :]

    def run(b, c, xs):
        return tied.scan(
            lambda h, layer, xt: (h, layer[0].decode(xt, layer[1])), 0.0, tied.stack([(b, c)] * 5), xs
        )[1]

    eager = block.attn.cache(4, batch_shape=(1,))
    block.decode(x[:, :2], eager)
    with pytest.raises(ValueError, match=MATCH):
        for t in range(5):
            block.decode(xs[t], eager)
    for f in (run, tied.jit(run)):
        c = block.attn.cache(4, batch_shape=(1,))
        block.decode(x[:, :2], c)
        with pytest.raises(ValueError, match=MATCH):
            f(block, c, xs[:5])
        assert int(c.position.value) == 2


def test_a_step_longer_than_the_cache_gets_the_cache_message_under_jit():
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    with pytest.raises(ValueError, match=r"KVCache: 5 positions at once do not fit in max_len=4"):
        tied.jit(lambda b, c, xt: b.decode(xt, c))(block, block.attn.cache(4, batch_shape=(1,)), x)


def test_tied_vmap_and_tied_remat_carry_the_check_out_with_no_callback_under_jit():
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    ensemble = tied.jit(tied.vmap(lambda c, xt: block.decode(xt, c), in_axes=(0, None)))
    caches = tied.stack([block.attn.cache(4, batch_shape=(1,)) for _ in range(2)])
    assert _no_host_callback(ensemble, caches, x[:, :4])
    ensemble(caches, x[:, :4])
    with pytest.raises(ValueError, match=MATCH):
        ensemble(caches, x[:, 4:5])
    np.testing.assert_array_equal(caches.member.position.value, [4, 4])
    for wrap in (lambda f: tied.remat(f), lambda f: tied.jit(tied.remat(f))):
        cache = block.attn.cache(4, batch_shape=(1,))
        step = wrap(lambda b, c, xt: b.decode(xt, c))
        np.testing.assert_allclose(
            step(block, cache, x[:, :4]),
            block.decode(x[:, :4], block.attn.cache(4, batch_shape=(1,))),
            rtol=1e-5,
            atol=1e-6,
        )
        with pytest.raises(ValueError, match=MATCH):
            step(block, cache, x[:, 4:5])
        assert int(cache.position.value) == 4


def test_a_refused_call_that_donated_its_cache_says_the_cache_is_gone():
    block = TransformerBlock(8, 2, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (1, 5, 8))
    cache = block.attn.cache(4, batch_shape=(1,))
    step = tied.jit(lambda b, c, xt: b.decode(xt, c), donate_argnums=(1,))
    step(block, cache, x[:, :4])
    with pytest.raises(ValueError, match=MATCH) as e:
        step(block, cache, x[:, 4:5])
    assert any("donated to this call (donate_argnums) are gone" in n for n in e.value.__notes__)
