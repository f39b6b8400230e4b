"""Surgery under a `tied.Stack` (issue 34, defect 3): after `tied.replace`, `tie`, `untie` and `map`
below a Stack's member, its layout describes its arrays, or the edit is refused naming the place.

References: the unrolled loop over members built by hand (`tied.unstack`, per-member edits,
`tied.stack`), and plain `jax.grad` over the unrolled model's places, summed per tie by hand."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied.nn import Dense, LayerNorm

N, D = 4, 3


@tied.register
class Gated:
    def __init__(self, inner, gate):
        self.inner, self.gate = inner, gate

    def __call__(self, h):
        return self.inner(h) * self.gate


def _model():
    keys = jax.random.split(jax.random.key(0), N)
    final = LayerNorm(D)  # one norm in every block and after them
    members = []
    for i, k in enumerate(keys):
        norm = LayerNorm(D)
        norm.weight = jnp.full((D,), 1.0 + i)  # each block's own norm, values that differ
        members.append({"dense": Dense(D, D, key=k), "norm": norm, "shared": final})
    return {"blocks": tied.stack(members), "final": final}


def _layer(h, m):
    return jnp.tanh(m["shared"](m["norm"](m["dense"](h))))


def _scanned(model, h):
    h, _ = tied.scan(lambda h, m, _: (_layer(h, m), None), h, model["blocks"])
    return model["final"](h)


def _looped(members, final, h):
    for m in members:
        h = _layer(h, m)
    return final(h)


H = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


def test_a_new_per_member_array_whose_leading_axis_is_n_is_refused_naming_the_place():
    # On main: the (n, d) gate was given whole to every layer, no error (the 0.76).
    model = _model()
    gated = Gated(model["blocks"].member["norm"], jnp.linspace(0.5, 2.0, N * D).reshape(N, D))
    with pytest.raises(
        ValueError, match=re.escape("the new array at ['blocks'].member['norm'].gate has shape (4, 3)")
    ):
        tied.replace(model, "['blocks'].member['norm']", gated)


def test_stack_map_puts_a_per_member_array_in_every_member_as_the_loop_does():
    model = _model()
    gates = jnp.linspace(0.5, 2.0, N * D).reshape(N, D)
    blocks = model["blocks"].map(lambda m, g: tied.replace(m, "['norm']", Gated(m["norm"], g)), gates)
    assert "['norm'].gate" in blocks.stacked and blocks.member["shared"] is model["final"]  # the tie kept
    new = {"blocks": blocks, "final": model["final"]}
    by_hand = [{**m, "norm": Gated(m["norm"], gates[i])} for i, m in enumerate(tied.unstack(model["blocks"]))]
    np.testing.assert_allclose(_scanned(new, H), _looped(by_hand, model["final"], H), rtol=1e-6)


def test_replacing_a_stacked_array_by_one_array_makes_it_broadcast():
    # On main: JAX's raw "scan got length 4 which disagrees with leading axis sizes".
    model = _model()
    bias = jnp.arange(float(D))
    new = tied.replace(model, "['blocks'].member['dense'].bias", bias)
    assert new["blocks"].member["dense"].bias is bias and "['dense'].bias" not in new["blocks"].stacked
    by_hand = tied.unstack(model["blocks"])
    for m in by_hand:
        m["dense"] = Dense(m["dense"].weight, bias)
    np.testing.assert_allclose(_scanned(new, H), _looped(by_hand, model["final"], H), rtol=1e-6)
    again = tied.replace(model, "['blocks'].member['dense'].bias", jnp.ones((N, D)))  # leading axis n
    assert "['dense'].bias" in again["blocks"].stacked


def test_a_stacked_array_tied_to_a_place_outside_the_stack_is_refused():
    model = {
        "blocks": tied.stack([{"w": jnp.full((N,), float(i))} for i in range(N)]),
        "head": jnp.zeros((N, N)),
    }
    with pytest.raises(
        ValueError, match=r"the stacked array at \['blocks'\]\.member\['w'\].*held at \['head'\]"
    ):
        tied.tie(model, "['blocks'].member['w']", "['head']")


def test_untie_of_a_broadcast_place_gives_each_member_its_own_copy():
    model = _model()
    new = tied.untie(model, "['blocks'].member['shared']")
    s = new["blocks"]
    assert s.member["shared"].weight.shape == (N, D) and "['shared'].weight" in s.stacked
    assert new["final"].weight is model["final"].weight  # the outside norm keeps its arrays
    members = tied.unstack(s)
    assert members[0]["shared"] is not members[1]["shared"]
    np.testing.assert_allclose(_scanned(new, H), _scanned(model, H), rtol=1e-6)


def test_map_that_drops_a_stacked_axis_is_refused_and_one_that_keeps_it_keeps_the_layout():
    model = _model()
    with pytest.raises(
        ValueError, match=r"tied.map: the stacked array at \['blocks'\]\.member\['dense'\]\.weight \(leading"
    ):
        tied.map(lambda x: x[0], model)
    half = tied.map(lambda x: x.astype(jnp.bfloat16), model)
    assert half["blocks"].stacked == model["blocks"].stacked
    assert half["blocks"].member["shared"] is half["final"]


# ---------------------------------------------------------------- random surgery


def _start(n):
    s = jnp.linspace(0.1, 0.3, D)  # one array in every member and outside
    box = {"k": jnp.linspace(-0.2, 0.2, D)}  # one container in every member
    members = [
        {"a": jnp.full((D,), 0.1 * (i + 1)), "b": jnp.full((D,), -0.05 * i), "s": s, "box": box}
        for i in range(n)
    ]
    return members, s


def _term(m):
    return jnp.sum(jnp.sin(m["a"]) * m["b"] + m["s"] * m["a"] ** 2 + m["box"]["k"] * m["b"])


def _stack_loss(model):
    return sum(_term(m) for m in tied.unstack(model["blocks"])) + jnp.sum(model["out"] ** 3)


def _unrolled_loss(model):
    return sum(_term(m) for m in model["blocks"]) + jnp.sum(model["out"] ** 3)


OPS = st.one_of(
    st.tuples(
        st.just("replace"), st.sampled_from(["['a']", "['b']", "['s']", "['box']['k']"]), st.booleans()
    ),
    st.tuples(
        st.just("tie"),
        st.sampled_from(["['a']", "['b']", "['s']"]),
        st.sampled_from(["['a']", "['b']", "['s']"]),
    ),
    st.tuples(st.just("untie"), st.sampled_from(["['a']", "['b']", "['s']", "['box']"]), st.just(None)),
    st.tuples(st.just("map"), st.just(None), st.just(None)),
)


def _distinct(unrolled, rel, n):
    """Whether the members hold distinct objects at ``rel`` (read by identity, by hand)."""
    objs = [eval("m" + rel, {"m": unrolled["blocks"][i]}) for i in range(n)]  # noqa: S307 - test paths
    return len({id(o) for o in objs}) == n


def _by_hand(unrolled, op, n, value):
    """The edit made to every member of the unrolled model (the reference)."""
    what, p, q = op
    at = lambda i, rel: f"['blocks'][{i}]{rel}"  # noqa: E731
    if what == "replace":
        per_member = value.ndim == 2 and _distinct(unrolled, p, n)
        for i in range(n):
            unrolled = tied.replace(unrolled, at(i, p), value[i] if per_member else value)
    elif what == "tie":
        for i in range(n):
            unrolled = tied.tie(unrolled, at(i, p), at(i, q))
    elif what == "untie":
        for i in range(n):
            unrolled = tied.untie(unrolled, at(i, p))
    else:
        unrolled = tied.map(lambda x: 1.5 * x - 0.25, unrolled)
    return unrolled


def _on_stack(model, op, value):
    what, p, q = op
    at = lambda rel: "['blocks'].member" + rel  # noqa: E731
    if what == "replace":
        return tied.replace(model, at(p), value)
    if what == "tie":
        return tied.tie(model, at(p), at(q))
    if what == "untie":
        return tied.untie(model, at(p))
    return tied.map(lambda x: 1.5 * x - 0.25, model)


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([2, 4]), ops=st.lists(OPS, min_size=1, max_size=3))
def test_random_surgery_under_a_stack_equals_unstack_edit_restack(n, ops):
    members, s = _start(n)
    model = {"blocks": tied.stack(members), "out": s}
    unrolled = {"blocks": tied.unstack(model["blocks"]), "out": s}
    for k, op in enumerate(ops):
        if op[0] == "replace":  # one array per member (leading axis n) at a stacked place, else one for all
            stacked = op[2] and _distinct(unrolled, op[1], n)
            value = (
                jnp.linspace(-0.5, 0.5, n * D).reshape(n, D) + k if stacked else jnp.linspace(0.2, 0.4, D) + k
            )
        else:
            value = None
        try:
            model = _on_stack(model, op, value)
        except ValueError as e:
            assert "['blocks'].member" in str(e), e  # refused, naming the place
            return
        unrolled = _by_hand(unrolled, op, n, value)
    reference = {"blocks": tied.stack(unrolled["blocks"]), "out": unrolled["out"]}
    assert model["blocks"].stacked == reference["blocks"].stacked
    leaves, gdef = tied.flatten(model)
    ref_leaves, ref_gdef = tied.flatten(reference)
    assert gdef == ref_gdef  # the same structure, layout and ties
    for x, y in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    np.testing.assert_allclose(_stack_loss(model), _unrolled_loss(unrolled), rtol=1e-5)

    # gradients: tied.grad on the Stack; plain jax.grad over every place of the unrolled model,
    # summed per unique array by hand, restacked by hand
    u_leaves, u_gdef = tied.flatten(unrolled)
    tree_def, place_leaf = u_gdef.expand()
    partials = jax.grad(lambda ps: _unrolled_loss(tied.unflatten(tree_def, ps)))(
        [u_leaves[i] for i in place_leaf]
    )
    totals = [jnp.zeros_like(x) for x in u_leaves]
    for g, i in zip(partials, place_leaf, strict=True):
        totals[i] = totals[i] + g
    g_unrolled = tied.unflatten(u_gdef, totals)
    expected = {"blocks": tied.stack(g_unrolled["blocks"]), "out": g_unrolled["out"]}
    got = tied.grad(_stack_loss)(model)
    g_leaves, g_gdef = tied.flatten(got)
    e_leaves, e_gdef = tied.flatten(expected)
    assert g_gdef == e_gdef
    for x, y in zip(g_leaves, e_leaves, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_surgery_in_a_stack_of_stacks_keeps_both_layouts_or_is_refused():
    outer = tied.stack([tied.stack([{"w": jnp.full(2, 10.0 * i + j)} for j in range(3)]) for i in range(2)])
    cast = tied.map(lambda x: x.astype(jnp.bfloat16), outer)  # shapes kept: both layouts kept
    assert (cast.stacked, cast.member.stacked) == (outer.stacked, outer.member.stacked)
    # one (2,) array for every inner member: the outer axis (also 2) would read it as stacked
    with pytest.raises(ValueError, match=r"\.member\.member\['w'\] is in a Stack inside another Stack"):
        tied.replace(outer, ".member.member['w']", jnp.ones(2))
    both = outer.map(lambda inner: inner.map(lambda m: {**m, "w": jnp.ones(2)}))  # the way to say it
    assert both.member.member["w"].shape == (2, 3, 2)
    for i, inner in enumerate(tied.unstack(both)):
        for j, m in enumerate(tied.unstack(inner)):
            np.testing.assert_array_equal(m["w"], np.ones(2), err_msg=f"{i},{j}")


def test_one_array_put_in_each_members_own_state_cell_is_stacked_and_scans_as_the_loop():
    # State is shared by cell: each member's own BatchNorm keeps its own statistics.
    blocks = tied.stack([{"bn": tied.nn.BatchNorm(D)} for _ in range(N)])
    s = tied.replace(blocks, ".member['bn'].running_mean.value", jnp.full(D, 0.5))
    assert s.member["bn"].running_mean.value.shape == (N, D)
    x = jnp.arange(2.0 * D).reshape(2, D)
    h, _ = tied.scan(lambda c, m, _: (m["bn"](c), None), x, s)
    by_hand = [tied.nn.BatchNorm(D) for _ in range(N)]
    c = x
    for bn in by_hand:
        bn.running_mean.value = jnp.full(D, 0.5)
        c = bn(c)
    np.testing.assert_allclose(h, c, rtol=1e-5)
    expected = np.stack([bn.running_mean.value for bn in by_hand])
    np.testing.assert_allclose(s.member["bn"].running_mean.value, expected, rtol=1e-5)
