"""Adversarial review of issue 34's lift: tied.grad on the shared pipeline, checks in the loss,
`tied.jit`'s refusal of static arguments holding other arrays.

References: the eager run of the same function (a static argument read as it is now), plain
`jax.grad` on an untied copy with the uses of a tie summed by hand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tied
from tied._transforms import check

X = jnp.array([[0.5, -1.0], [2.0, 0.25], [-1.5, 1.0]])


class _Cfg:
    """A static argument holding an array, equal to (and hashing as) every other `_Cfg`."""

    def __init__(self, a):
        self.a = a

    def __hash__(self):
        return 1

    def __eq__(self, other):
        return isinstance(other, _Cfg)


def _scale(x, c):
    return x * c.a


# ---------------------------------------------------------------- tied.jit's static arguments


def test_a_static_argument_set_between_lower_and_the_first_call_is_refused_not_read_stale():
    """`lower` traces (and JAX keeps that trace for the call): a cell set between them was
    silently read as it was at `lower` (on main: 2.0 where the eager run gives 5.0)."""
    f = tied.jit(_scale, static_argnums=1)
    two = jnp.array(2.0)
    c = _Cfg(two)
    f.lower(jnp.ones(2), c)
    c.a = jnp.array(5.0)
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.a: this array was replaced"):
        f(jnp.ones(2), c)
    c.a = two  # holding what it held when lowered: the call runs, as eagerly
    np.testing.assert_array_equal(f(jnp.ones(2), c), _scale(jnp.ones(2), c))


def test_an_equal_static_first_called_after_another_was_lowered_is_refused():
    """The version's statics are the ones of the call that made it (`lower` here; or another
    thread's call that made the entry first), never the first caller's (on main: 3.0, the lowered
    object's, silently, where the eager run gives 4.0)."""
    f = tied.jit(_scale, static_argnums=1)
    f.lower(jnp.ones(2), _Cfg(jnp.array(3.0)))
    other = _Cfg(jnp.array(4.0))
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.a: this array was replaced"):
        f(jnp.ones(2), other)


def test_a_trace_again_for_a_weak_type_never_reads_the_first_calls_changed_static():
    """JAX traces the same version again when an input's weak type changes; the body then reads
    the first call's static object, set since. An equal static holding the first call's arrays
    passed the call's check, and the new trace read 7.0 (on main: 7.0 where eager gives 2.0)."""
    f = tied.jit(_scale, static_argnums=1)
    a = jnp.array(2.0)
    first = _Cfg(a)
    assert float(f(jnp.array(1.0, dtype=jnp.float32), first)) == 2.0
    first.a = jnp.array(7.0)
    other = _Cfg(a)  # equal, holding the arrays the version was compiled with
    weak = jnp.asarray(1.0)
    assert weak.weak_type
    try:
        out = f(weak, other)
    except tied.GraphError as e:  # refused loudly: fine
        assert "this array was replaced" in str(e)
    else:  # or the eager answer
        assert float(out) == float(_scale(weak, other)) == 2.0


def test_an_untouched_static_called_again_and_statics_without_arrays_are_not_refused():
    f = tied.jit(_scale, static_argnums=1)
    c = _Cfg(jnp.array(2.0))
    f.lower(jnp.ones(2), c)
    for _ in range(3):
        np.testing.assert_array_equal(f(jnp.ones(2), c), 2.0 * np.ones(2))
    g = tied.jit(lambda x, s: x * s[0], static_argnums=1)
    assert [float(g(jnp.ones(()), (float(i),))) for i in range(3)] == [0.0, 1.0, 2.0]


def test_a_numpy_array_in_a_static_changed_in_place_is_not_read_stale():
    class Holder:
        def __init__(self, a):
            self.a = a

    h = Holder(np.array([2.0, 2.0], dtype=np.float32))
    f = tied.jit(_scale, static_argnums=1)
    f(jnp.ones(2), h)
    np.testing.assert_array_equal(f(jnp.ones(2), h), _scale(jnp.ones(2), h))  # untouched: runs
    h.a[0] = 9.0  # the compiled constant still holds 2.0: read stale before, silently
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.a: this numpy array was changed in place"):
        f(jnp.ones(2), h)
    h.a[0] = 2.0  # back as it was traced: runs
    np.testing.assert_array_equal(f(jnp.ones(2), h), _scale(jnp.ones(2), h))


# ---------------------------------------------------------------- checks in a loss under jax.vmap


def _over(limit):
    def fail(bad, s):
        if np.any(bad):
            raise ValueError(f"check: {float(np.max(s)):.2f} over {limit:.2f}")

    return fail


def _tied_pair():
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    return {"d": d, "head": tied.nn.Dense(d.weight)}, d


@pytest.mark.parametrize("where", ["around", "inside"])
def test_a_check_in_a_loss_under_jax_vmap_raises_for_the_bad_example_only(where):
    """Per-example losses, one over the limit: the check raises (never a silent pass); with the
    limit above both, the per-example gradients equal plain jax.grad summed over the tie."""
    m, d = _tied_pair()
    xs = jnp.stack([X * 0.01, X])
    w, b = d.weight, d.bias

    def s_of(w1, b, w2, x):
        return jnp.sum(((x @ w1.T + b) @ w2.T) ** 2)

    s = [float(s_of(w, b, w, x)) for x in xs]

    def run(limit):
        def loss(m, x):
            v = jnp.sum(m["head"](m["d"](x)) ** 2)
            check(v > limit, _over(limit), v)
            return v

        if where == "around":
            return jax.vmap(lambda x: tied.grad(loss)(m, x)["d"].weight)(xs)
        return tied.grad(lambda m: jax.vmap(lambda x: loss(m, x))(xs).sum())(m)["d"].weight

    with pytest.raises(Exception, match=rf"check: {s[1]:.2f} over"):
        jax.block_until_ready(run((s[0] + s[1]) / 2))
        jax.effects_barrier()
    g = run(2 * s[1])
    per = jax.vmap(lambda x: jax.grad(s_of, argnums=(0, 2))(w, b, w, x))(xs)
    ref = per[0] + per[1] if where == "around" else (per[0] + per[1]).sum(0)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the loss's aux


@pytest.mark.parametrize("how", ["grad", "value_and_grad", "jit"])
def test_the_loss_may_return_the_model_in_its_aux_with_its_ties(how):
    """An aux holding tied nodes (the model, a layer) comes back with its ties, no tracer left,
    as tied.jit returns a model (on main: "Dense is a tied node ... not a JAX pytree ... Use the
    tied way: tied.grad", raised from inside tied.grad)."""
    m, d = _tied_pair()
    w, b = d.weight, d.bias
    bn = tied.nn.BatchNorm(2)
    m["bn"] = bn

    def loss(m):
        return jnp.sum(m["bn"](m["head"](m["d"](X))) ** 2), (m, m["d"])

    if how == "grad":
        g, (aux, layer) = tied.grad(loss, has_aux=True)(m)
    elif how == "value_and_grad":
        (_, (aux, layer)), g = tied.value_and_grad(loss, has_aux=True)(m)
    else:
        g, (aux, layer) = tied.jit(tied.grad(loss, has_aux=True))(m)
    assert aux["d"] is layer and aux["d"].weight is aux["head"].weight
    assert not any(isinstance(x, jax.core.Tracer) for x in tied.flatten(aux)[0])
    np.testing.assert_array_equal(aux["d"].weight, w)
    # the state the loss wrote: in the caller's BatchNorm and in the aux's copy of it
    assert int(bn.num_batches_tracked.value) == 1
    np.testing.assert_array_equal(aux["bn"].running_mean.value, bn.running_mean.value)

    def by_hand(w1, b, w2):
        y = (X @ w1.T + b) @ w2.T
        mu = y.mean(0)
        return jnp.sum(((y - mu) / jnp.sqrt(((y - mu) ** 2).mean(0) + bn.eps)) ** 2)

    ref = jax.grad(by_hand, argnums=(0, 1, 2))(w, b, w)
    assert g["d"].weight is g["head"].weight
    np.testing.assert_allclose(g["d"].weight, ref[0] + ref[2], rtol=1e-4, atol=1e-5)


def test_a_gradient_returned_in_the_aux_keeps_its_totals_for_accumulate():
    """tied.grad's own totals in the aux of an outer tied.grad stay known as totals: accumulate
    takes them once (on main the aux could not hold the gradient tree at all)."""
    m, d = _tied_pair()

    def outer(m):
        inner = tied.grad(lambda m: jnp.sum(m["head"](m["d"](X)) ** 2))(m)
        return jnp.sum(m["d"](X)), inner

    _, inner = tied.grad(outer, has_aux=True)(m)
    w, b = d.weight, d.bias
    ref = jax.grad(lambda w1, b, w2: jnp.sum(((X @ w1.T + b) @ w2.T) ** 2), argnums=(0, 2))(w, b, w)
    total = tied.accumulate(m, inner)
    assert total["d"].weight is inner["d"].weight is inner["head"].weight
    np.testing.assert_allclose(total["d"].weight, ref[0] + ref[1], rtol=1e-5)


# ---------------------------------------------------------------- checks in implicit mode


@pytest.mark.parametrize("jit", [False, True])
def test_a_check_in_tied_gradient_raises_its_own_error_and_puts_the_state_back(jit):
    """tied.gradient (implicit mode) carries its checks out as tied.grad does: the check's own
    ValueError and the BatchNorm's state as it was (on main: JAX's raw 'CpuCallback error');
    a passing check changes nothing, and the total is plain jax.grad summed over the tie."""
    m, d = _tied_pair()
    bn = m["bn"] = tied.nn.BatchNorm(2)
    mean = bn.running_mean.value
    w, b = d.weight, d.bias

    def by_hand(w1, b, w2):
        return jnp.sum(((X @ w1.T + b) @ w2.T) ** 2)

    s = float(by_hand(w, b, w))

    def run(limit):
        def step(m):
            def fun():
                v = jnp.sum(m["head"](m["d"](X)) ** 2)
                m["bn"](X)
                check(v > limit, _over(limit), v)
                return v

            return tied.gradient(fun, tied.params(m))[m["d"].weight]

        return (tied.jit(step) if jit else step)(m)

    with pytest.raises(ValueError, match=rf"^check: {s:.2f} over"):
        run(s / 2)
    assert bn.running_mean.value is mean and int(bn.num_batches_tracked.value) == 0
    assert m["d"].weight is w and m["head"].weight is w
    g = run(2 * s)
    ref = jax.grad(by_hand, argnums=(0, 2))(w, b, w)
    np.testing.assert_allclose(g, ref[0] + ref[1], rtol=1e-5)
    assert int(bn.num_batches_tracked.value) == 1


# ---------------------------------------------------------------- a static callable's objects


def _method(bn):
    return bn.__call__


def _partial(bn):
    return functools.partial(lambda b, x: b(x), bn)


def _closure(bn):
    return lambda x: bn(x)


@pytest.mark.parametrize("make", [_method, _partial, _closure], ids=["method", "partial", "closure"])
def test_state_written_through_a_static_callable_is_refused_and_no_tracer_is_left(make):
    """A bound method, a partial or a closure given as a static argument holds the caller's
    BatchNorm: its write is refused naming the place and put back (on main: a
    DynamicJaxprTracer left in the caller's running_mean, no error)."""
    bn = tied.nn.BatchNorm(2)
    mean = bn.running_mean.value
    f = tied.jit(lambda x, fn: fn(x), static_argnums=1)
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\..*running_mean\.value: the function wrote a new"):
        f(X, make(bn))
    assert bn.running_mean.value is mean and int(bn.num_batches_tracked.value) == 0


def test_a_static_bound_method_whose_object_was_changed_is_refused_not_read_stale():
    """`model.apply` as a static argument: its object's array set between calls was silently
    read as it was (on main: 2.0 where the eager run gives 6.0)."""

    class Scale:
        def __init__(self, w):
            self.w = w

        def apply(self, x):
            return x * self.w

    s = Scale(jnp.array(2.0))
    f = tied.jit(lambda x, fn: fn(x), static_argnums=1)
    assert float(f(jnp.ones(()), s.apply)) == 2.0
    assert float(f(jnp.ones(()), s.apply)) == 2.0  # untouched: no refusal
    s.w = jnp.array(6.0)
    with pytest.raises(tied.GraphError, match=r"^args\[1\]\.__self__\.w: this array was replaced"):
        f(jnp.ones(()), s.apply)


@pytest.mark.parametrize("make", [_method, _closure], ids=["method", "closure"])
def test_grad_refuses_a_layer_reached_through_an_undifferentiated_callable(make):
    """``tied.grad(loss)(layer, layer.__call__)``: the callable runs the caller's layer, not the
    loss's copy, so its use got no gradient (on main: 1.0 everywhere, silently, where plain
    jax.grad gives the sum of both uses); refused naming the place, as for any object held by
    an argument not differentiated."""
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    w = d.weight
    with pytest.raises(
        tied.GraphError, match=r"^args\[1\]\.__(self|closure)__.*held by an argument not differentiated"
    ):
        tied.grad(lambda m, fn: jnp.sum(fn(X) ** 2) + jnp.sum(m.weight))(d, make(d))
    assert d.weight is w
    g = tied.grad(lambda m, fn: jnp.sum(fn(m)(X) ** 2) + jnp.sum(m.weight))(d, _method)  # the fix
    ref = jax.grad(lambda w, b: jnp.sum((X @ w.T + b) ** 2) + jnp.sum(w))(w, d.bias)
    np.testing.assert_allclose(g.weight, ref, rtol=1e-5)


def test_remat_refuses_state_written_through_a_static_bound_method():
    """tied.remat holds its static arguments to the same rule (on main: a jax.checkpoint tracer
    left in the caller's running_mean, no error)."""
    bn = tied.nn.BatchNorm(2)
    mean = bn.running_mean.value
    with pytest.raises(
        tied.GraphError, match=r"^args\[1\]\.__self__\.running_mean\.value: the function wrote"
    ):
        tied.remat(lambda x, fn: fn(x), static_argnums=(1,))(X, bn.__call__)
    assert bn.running_mean.value is mean and int(bn.num_batches_tracked.value) == 0
