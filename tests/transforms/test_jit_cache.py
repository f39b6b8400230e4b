"""`Jitted.cache_size` and the explanation of each compile, counted against the traces themselves.

The reference is the function's own trace counter (a Python side effect runs once per trace,
so once per compiled version): `cache_size` must equal it after every call, and with JAX's
``jax_explain_cache_misses`` switch on, each call that traces logs exactly one message on the
``tied.jit`` logger saying what changed.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

import tied
from tied.nn import Chain, Dense


@pytest.fixture
def explaining(caplog):
    before = jax.config.jax_explain_cache_misses
    jax.config.update("jax_explain_cache_misses", True)
    caplog.set_level(logging.WARNING, logger="tied.jit")
    try:
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "tied.jit"]
    finally:
        jax.config.update("jax_explain_cache_misses", before)


def counted():
    traces = []

    def loss(m, x, scale=1.0):
        traces.append(1)
        return m(x).sum() * scale

    return tied.jit(loss, static_argnames="scale"), traces


def calls():
    d = Dense(2, 2, key=jax.random.key(0))
    e = Dense(2, 2, key=jax.random.key(1))
    x1, x5 = jnp.ones((1, 2)), jnp.ones((5, 2))
    return [
        ((Chain(d, d), x1), {}, "its first call"),
        ((Chain(d, d), x1), {}, None),  # the same structure and shapes: no compile
        ((Chain(e, e), x1), {}, None),  # other arrays, the same structure
        ((Chain(d, Dense(d.weight, d.bias)), x1), {}, "args[0].layers[1] is no longer the same object"),
        ((Chain(d, d), x5), {}, "shapes or dtypes changed (1 array): args[1] float32[1,2] -> float32[5,2]"),
        ((Chain(d, d), x5.astype(jnp.bfloat16)), {}, "args[1] float32[5,2] -> bfloat16[5,2]"),
        ((Chain(d, d), x5), {"scale": 2.0}, "the static arguments changed"),
        ((Chain(d, d, d), x5), {"scale": 2.0}, "a place was added: args[0].layers[2]"),
        ((Chain(d, e), x5), {"scale": 2.0}, "args[0].layers[1] is no longer the same object as"),
        ((Chain(e, e), x5), {"scale": 2.0}, None),
    ]  # fmt: skip


def test_cache_size_counts_every_compiled_version():
    f, traces = counted()
    assert f.cache_size() == 0
    for args, kwargs, _ in calls():
        f(*args, **kwargs)
        assert f.cache_size() == len(traces)
    assert len(traces) == 7


def test_each_compile_is_explained_once_naming_what_changed(explaining):
    f, traces = counted()
    for args, kwargs, expected in calls():
        before, logged_before = len(traces), len(explaining())
        f(*args, **kwargs)
        new = explaining()[logged_before:]
        assert len(new) == len(traces) - before  # one message per compile, none otherwise
        if expected is None:
            assert new == []
        else:
            assert (
                len(new) == 1 and expected in new[0] and new[0].startswith("tied.jit(counted.<locals>.loss)")
            )


def test_nothing_is_logged_or_remembered_with_the_switch_off(caplog):
    assert not jax.config.jax_explain_cache_misses
    caplog.set_level(logging.WARNING, logger="tied.jit")
    f, traces = counted()
    for args, kwargs, _ in calls():
        f(*args, **kwargs)
    assert [r for r in caplog.records if r.name == "tied.jit"] == []
    from tied._transforms import explain as _explain

    assert f not in _explain._seen
