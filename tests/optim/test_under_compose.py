"""`tied.under` predicates compose with ``~``, ``|`` and ``&`` (plain predicates on either side).

The reference masks below are written out by hand from the model's places: each combination is
decided place by place, and a parameter is trainable when it holds at any of its places.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied
from tied.nn import Dense, Embedding

X = jnp.array([0, 3, 1])


def _model():
    k = jax.random.split(jax.random.key(0), 3)
    emb, blk, out = Embedding(5, 3, key=k[0]), Dense(3, 3, key=k[1]), Dense(3, 1, key=k[2])
    # the embedding is the head too; one block at two places
    return {"embed": emb, "blocks": [blk, blk], "head": emb, "out": out}


def _loss(m):
    h = m["embed"](X)
    for b in m["blocks"]:
        h = jnp.tanh(b(h))
    return jnp.sum(m["head"].attend(h) ** 2) + jnp.sum(m["out"](h) ** 2)


# Each parameter by its first place, and its places (written out from _model):
# ['embed'].weight      at ['embed'].weight, ['head'].weight
# ['blocks'][0].weight  at ['blocks'][0].weight, ['blocks'][1].weight   (and the bias likewise)
# ['out'].weight, ['out'].bias
EMB, BW, BB, OW, OB = (
    "['embed'].weight",
    "['blocks'][0].weight",
    "['blocks'][0].bias",
    "['out'].weight",
    "['out'].bias",
)
U = tied.under
CASES = [
    # everything but the head: the embedding still trains, through its ['embed'] place
    (~U("['head']"), {EMB, BW, BB, OW, OB}),
    # the shared array left out with both its places
    (~U("['head']", "['embed']"), {BW, BB, OW, OB}),
    (U("['blocks'][1]") | U("['out']"), {BW, BB, OW, OB}),
    (~U("['blocks']") & (lambda path, x: x.ndim == 2), {EMB, OW}),
    ((lambda path, x: x.ndim == 1) | U("['head']"), {BB, OB, EMB}),
    ((lambda path, x: path.endswith("weight")) & ~U("['out']"), {EMB, BW}),
    (~~U("['out']"), {OW, OB}),
    (~(U("['embed']") | U("['blocks']")), {EMB, OW, OB}),  # the embedding by its ['head'] place
    (~U("['embed']") & ~U("['blocks']"), {EMB, OW, OB}),  # De Morgan: the same, place by place
]


@pytest.mark.parametrize("k", range(len(CASES)))
def test_composed_masks_equal_the_hand_written_ones(k):
    pred, want = CASES[k]
    m = _model()
    assert set(tied.optim.setup(optax.adam(0.1), m, trainable=pred).paths) == want
    sizes = {EMB: 15, BW: 9, BB: 3, OW: 3, OB: 1}
    assert tied.param_count(m, trainable=pred) == sum(sizes[p] for p in want)
    g = tied.grad(_loss, trainable=pred)(m)
    got = {
        EMB: g["embed"].weight,
        BW: g["blocks"][0].weight,
        BB: g["blocks"][0].bias,
        OW: g["out"].weight,
        OB: g["out"].bias,
    }
    assert {p for p, v in got.items() if v is not None} == want
    assert g["head"].weight is g["embed"].weight and g["blocks"][1].bias is g["blocks"][0].bias


def test_a_place_cannot_be_under_two_places_so_and_of_two_places_selects_nothing():
    # per place: no place is below both ['blocks'][0] and ['blocks'][1], though the block is at both
    m = _model()
    with pytest.warns(
        UserWarning, match=r"trainable=\(tied\.under\(\"\['blocks'\]\[0\]\"\) & .*selects none"
    ):
        state = tied.optim.setup(optax.adam(0.1), m, trainable=U("['blocks'][0]") & U("['blocks'][1]"))
    assert state.paths == ()


def test_all_but_the_head_trains_the_tied_embedding_once_with_adam():
    m = _model()
    emb, blk, out = m["embed"], m["blocks"][0], m["out"]
    tx = optax.adam(0.1)
    pred = ~U("['head']", "['embed']")  # leave the tied embedding out at both its places
    state = tied.optim.setup(tx, m, trainable=pred)
    new, state = tied.optim.update(state, m, tied.grad(_loss, trainable=pred)(m))
    assert new["embed"].weight is emb.weight and new["head"] is new["embed"]  # not moved, still tied

    # reference: plain jax.grad on an untied copy, the block's two places summed by hand, Adam by hand
    def f(w0, b0, w1, b1, ow, ob):
        h = jnp.tanh(emb(X) @ w0.T + b0)
        h = jnp.tanh(h @ w1.T + b1)
        return jnp.sum((h @ emb.weight.T) ** 2) + jnp.sum((h @ ow.T + ob) ** 2)

    gw0, gb0, gw1, gb1, gow, gob = jax.grad(f, argnums=range(6))(
        blk.weight, blk.bias, blk.weight, blk.bias, out.weight, out.bias
    )

    def adam_first_step(p, g, lr=0.1, eps=1e-8):  # m = (1-b1) g, v = (1-b2) g^2, bias-corrected
        return p - lr * g / (np.sqrt(g**2) + eps)

    np.testing.assert_allclose(
        new["blocks"][0].weight, adam_first_step(blk.weight, gw0 + gw1), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        new["blocks"][0].bias, adam_first_step(blk.bias, gb0 + gb1), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(new["out"].weight, adam_first_step(out.weight, gow), rtol=1e-5, atol=1e-6)
    assert new["blocks"][1] is new["blocks"][0]
    # ~U("['head']") alone trains the embedding (its ['embed'] place is not under ['head']): once, as one
    state2 = tied.optim.setup(tx, m, trainable=~U("['head']"))
    new2, _ = tied.optim.update(state2, m, tied.grad(_loss, trainable=~U("['head']"))(m))
    assert new2["head"].weight is new2["embed"].weight and not np.allclose(new2["embed"].weight, emb.weight)


def test_combinations_compare_by_value_and_print_what_they_are():
    f = lambda path, x: x.ndim == 1  # noqa: E731
    assert ~U(".a") == ~U(".a") and hash(~U(".a") | f) == hash(~U(".a") | f)
    assert (U(".a") | f) == (U(".a") | f) and (U(".a") | f) != (f | U(".a"))
    assert (U(".a") & U(".b")) != (U(".a") | U(".b")) and ~U(".a") != U(".a")
    assert repr(~U(".a") & U(".b")) == "(~tied.under('.a') & tied.under('.b'))"
    assert (~U(".a"))(".b", None) is True and (~U(".a"))(".a.w", None) is False


def test_bad_operands_and_results_are_refused_naming_them():
    with pytest.raises(
        TypeError, match=r"'\.b' is not a trainable= predicate.*tied\.under\('\.b'\).*~, \| and &"
    ):
        U(".a") | ".b"
    with pytest.raises(TypeError, match=r"3 is not a trainable= predicate"):
        3 & U(".a")
    m = _model()
    with pytest.raises(TypeError, match=r"\['blocks'\]\[0\]\.weight: <function .*returned int, not a bool"):
        tied.optim.setup(optax.adam(0.1), m, trainable=U("['nowhere']") | (lambda path, x: 1))
