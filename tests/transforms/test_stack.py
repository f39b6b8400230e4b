"""tied.stack / tied.unstack: stacked and broadcast places, errors, and the tools that
see a model holding a Stack (grad, optim, save/load, summary, param_count, map, mode)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import sharing_groups
from hypothesis import given
from hypothesis import strategies as st

import tied


def places(x, path=""):
    """Every place of a model of dicts, lists and plain objects (tied.nn layers, State,
    Rng, Stack): ``(path, object)``, written from scratch as an independent reference."""
    yield path, x
    if isinstance(x, dict):
        for k in sorted(x):
            yield from places(x[k], f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, c in enumerate(x):
            yield from places(c, f"{path}[{i}]")
    elif isinstance(x, tied.Stack):
        yield from places(x.member, path + ".member")
    elif hasattr(x, "__dict__") and not isinstance(x, (jax.Array, np.ndarray)) and not callable(x.__dict__):
        for k, v in vars(x).items():
            yield from places(v, f"{path}.{k}")


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _block(i, norm, rng, key):
    return {
        "dense": tied.nn.Dense(3, 3, key=key),
        "norm": norm,
        "bn": tied.nn.BatchNorm(3),
        "drop": tied.nn.Dropout(0.25, rng),
        "scale": jnp.full((3,), float(i)),
    }


def _blocks(n=4):
    norm, rng = tied.nn.LayerNorm(3), tied.Rng(0)
    keys = jax.random.split(jax.random.key(1), n)
    return [_block(i, norm, rng, k) for i, k in enumerate(keys)], norm, rng


def test_stacked_arrays_get_a_leading_axis_and_broadcast_objects_are_kept_once():
    blocks, norm, rng = _blocks(4)
    s = tied.stack(blocks)
    assert len(s) == 4 and isinstance(s, tied.Stack)
    m = s.member
    np.testing.assert_array_equal(m["dense"].weight, np.stack([b["dense"].weight for b in blocks]))
    np.testing.assert_array_equal(m["scale"], np.stack([b["scale"] for b in blocks]))
    np.testing.assert_array_equal(m["bn"].running_var.value, np.ones((4, 3)))
    assert m["norm"] is norm and m["drop"].rng is rng  # broadcast: the objects themselves
    assert m["drop"] is not blocks[0]["drop"] and m["drop"].rate == 0.25  # per member, rebuilt
    assert m["bn"].running_mean is not blocks[0]["bn"].running_mean  # one stacked cell


def test_unstack_gives_back_the_members_values_statics_and_ties():
    blocks, norm, rng = _blocks(3)
    back = tied.unstack(tied.stack(blocks))
    assert len(back) == 3
    for a, b in zip(back, blocks):
        pa, pb = list(places(a)), list(places(b))
        assert [p for p, _ in pa] == [p for p, _ in pb]
        for (path, x), (_, y) in zip(pa, pb):
            if isinstance(x, jax.Array):
                np.testing.assert_array_equal(_data(x), _data(y), err_msg=path)
        assert a["norm"] is norm and a["drop"].rng is rng and a["drop"].rate == 0.25
        assert a["bn"].momentum == 0.1 and a["bn"].training is True
        assert a["dense"] is not b["dense"]


def test_a_tie_inside_each_member_is_kept_and_an_outside_tie_survives():
    emb = jnp.arange(6.0).reshape(2, 3)
    members = []
    for i in range(3):
        d = tied.nn.Dense(3, 3, key=jax.random.key(i))
        members.append({"a": d, "b": d, "emb": emb})  # d at two places of each member
    s = tied.stack(members)
    assert s.member["a"] is s.member["b"] and s.member["emb"] is emb
    model = {"stack": s, "head": emb}
    assert ("['head']", "['stack'].member['emb']") in tied.ties(model)
    for m in tied.unstack(s):
        assert m["a"] is m["b"] and m["emb"] is emb


def test_the_same_member_n_times_is_broadcast_whole():
    d = tied.nn.Dense(2, 2, key=jax.random.key(0))
    s = tied.stack([d, d, d])  # ALBERT: one layer applied three times
    assert len(s) == 3 and s.member is d
    assert all(m is d for m in tied.unstack(s))


def test_one_array_in_every_members_own_state_cell_is_stacked():
    zeros = jnp.zeros(2)
    cells = [{"c": tied.State(zeros)} for _ in range(3)]
    s = tied.stack(cells)
    assert s.member["c"].value.shape == (3, 2)  # state is shared by cell, not by array


def test_empty_stack_is_a_value_error():
    with pytest.raises(ValueError, match=r"at least one member"):
        tied.stack([])


@pytest.mark.parametrize(
    "other, where",
    [
        ({"w": jnp.ones(2), "extra": jnp.ones(2)}, r"\['extra'\]|<root>"),
        ({"w": jnp.ones(3)}, r"\['w'\].*shape \(2,\).*shape \(3,\)"),
        ({"w": jnp.ones(2, jnp.int32)}, r"\['w'\].*dtype"),
        ({"w": tied.State(jnp.ones(2))}, r"\['w'\]"),
    ],
)
def test_members_of_different_structure_name_the_place_and_the_members(other, where):
    with pytest.raises(ValueError, match=where) as e:
        tied.stack([{"w": jnp.ones(2)}, {"w": jnp.zeros(2)}, other])
    assert re.search(r"member", str(e.value))


def test_differing_statics_are_a_value_error():
    a, b = tied.nn.Dropout(0.1, tied.Rng(0)), tied.nn.Dropout(0.2, tied.Rng(0))
    with pytest.raises(ValueError, match=r"members 0 and 1 differ at .rate: a static value changed"):
        tied.stack([a, b])


def test_a_tie_between_some_members_but_not_all_names_both_places():
    w = jnp.ones(2)
    with pytest.raises(ValueError, match=r"\['w'\] is one object in members 0 and 1 but not in member 2"):
        tied.stack([{"w": w}, {"w": w}, {"w": jnp.ones(2)}])


def test_a_tie_across_members_at_different_places_is_a_value_error():
    w = jnp.ones(2)
    with pytest.raises(ValueError, match=r"member 1's array at \['b'\] is the same object as member 0's"):
        tied.stack([{"a": w, "b": jnp.ones(2)}, {"a": jnp.ones(2), "b": w}])


def test_nothing_is_changed_after_an_error():
    blocks, norm, rng = _blocks(2)
    before = [(p, x) for p, x in places(blocks)]
    with pytest.raises(ValueError):
        tied.stack([*blocks, {"other": 1}])
    assert all(a is b for (_, a), (_, b) in zip(places(blocks), before))


@given(st.lists(st.sampled_from(["own", "shared"]), min_size=1, max_size=5), st.integers(1, 4))
def test_random_sharing_patterns_round_trip(pattern, n):
    shared = [jnp.full((2,), 10.0 + k) for k in range(len(pattern))]
    members = [
        {
            f"f{k}": (shared[k] if kind == "shared" else jnp.full((2,), float(i * 10 + k)))
            for k, kind in enumerate(pattern)
        }
        for i in range(n)
    ]
    s = tied.stack(members)
    for k, kind in enumerate(pattern):
        x = s.member[f"f{k}"]
        if kind == "shared" or n == 1:  # with one member every object is the same in all
            assert x is members[0][f"f{k}"]
        else:
            assert x.shape == (n, 2)
    back = tied.unstack(s)
    for a, b in zip(back, members):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key])
    assert (
        sharing_groups(back, lambda x: isinstance(x, jax.Array))
        == sharing_groups(members, lambda x: isinstance(x, jax.Array))
        or n == 1
    )


# ---------------------------------------------------------------- tools on a model holding a Stack


def _model():
    blocks, norm, rng = _blocks(3)
    emb = tied.nn.Embedding(5, 3, key=jax.random.key(9))
    for b in blocks:
        b["emb"] = emb  # broadcast and tied to the head outside
    return {"embed": emb, "blocks": tied.stack(blocks), "head": emb}, norm, rng


def test_summary_param_count_map_and_mode_see_a_stack():
    model, norm, rng = _model()
    # parameters, by hand: dense 3*(9+3), norm 6, bn 3*(3+3), scale 3*3, emb 15 (once)
    assert tied.param_count(model) == 36 + 6 + 18 + 9 + 15
    text = tied.summary(model)
    assert "['blocks'].member['dense'].weight" in text and "(3, 3, 3)" in text
    doubled = tied.map(lambda x: x * 2 if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
    assert isinstance(doubled["blocks"], tied.Stack) and len(doubled["blocks"]) == 3
    assert doubled["blocks"].member["emb"] is doubled["embed"] is doubled["head"]
    np.testing.assert_allclose(doubled["blocks"].member["scale"], 2 * model["blocks"].member["scale"])
    ev = tied.nn.mode(model, False)
    assert ev["blocks"].member["bn"].training is False and ev["blocks"].member["drop"].training is False
    assert ev["blocks"].member["norm"] is norm and ev["blocks"].member["drop"].rng is rng
    assert model["blocks"].member["bn"].training is True


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_save_and_load_keep_the_stack_and_its_ties(tmp_path, fmt):
    model, norm, rng = _model()
    path = tmp_path / ("ck.safetensors" if fmt == "safetensors" else "ck")
    tied.save(path, model, format=fmt)
    like, _, _ = _model()
    back = tied.load(path, like)
    assert isinstance(back["blocks"], tied.Stack) and len(back["blocks"]) == 3
    assert back["blocks"].member["emb"] is back["embed"] is back["head"]
    for (p, a), (_, b) in zip(places(tied.unstack(back["blocks"])), places(tied.unstack(model["blocks"]))):
        if isinstance(a, jax.Array):
            np.testing.assert_array_equal(_data(a), _data(b), err_msg=p)


def test_adam_on_a_stack_equals_adam_on_the_unrolled_model():
    blocks, norm, rng = _blocks(3)
    emb = tied.nn.Embedding(5, 3, key=jax.random.key(9))
    for b in blocks:
        b["emb"] = emb
    unrolled = {"embed": emb, "blocks": blocks, "head": emb}
    stacked = {"embed": emb, "blocks": tied.stack(blocks), "head": emb}
    x = jnp.arange(6.0).reshape(2, 3)

    def loss(m):
        layers = m["blocks"] if isinstance(m["blocks"], list) else tied.unstack(m["blocks"])
        h = m["embed"].weight[:2] + x
        for layer in layers:
            h = layer["norm"](layer["dense"](h) * layer["scale"] + layer["emb"].weight[:2])
        return jnp.sum(h**2)

    opt = optax.adam(1e-2)
    su, ss = tied.optim.setup(opt, unrolled), tied.optim.setup(opt, stacked)
    for _ in range(3):
        gs = tied.grad(loss)(stacked)
        assert isinstance(gs["blocks"], tied.Stack) and len(gs["blocks"]) == 3
        assert gs["blocks"].member["emb"].weight is gs["embed"].weight is gs["head"].weight
        unrolled, su = tied.optim.update(su, unrolled, tied.grad(loss)(unrolled))
        stacked, ss = tied.optim.update(ss, stacked, gs)
    assert stacked["blocks"].member["emb"] is stacked["embed"] is stacked["head"]
    for a, b in zip(tied.unstack(stacked["blocks"]), unrolled["blocks"]):
        for key in ("dense", "norm", "emb"):
            for (p, u), (_, v) in zip(places(a[key]), places(b[key])):
                if isinstance(u, jax.Array):
                    np.testing.assert_allclose(_data(u), _data(v), atol=1e-6, err_msg=key + p)
        np.testing.assert_allclose(a["scale"], b["scale"], atol=1e-6)
    # one Adam state per unique parameter: the stacked weight is one parameter
    assert tied.param_count(stacked) == tied.param_count(unrolled)


def test_a_view_of_each_members_own_array_is_stacked_only_for_transpose():
    ws = [jnp.full((2, 3), float(i)) for i in range(3)]
    s = tied.stack([{"w": w, "t": tied.transpose(w)} for w in ws])
    assert s.member["t"].source is s.member["w"]  # the view follows its stacked source
    back = tied.unstack(s)
    np.testing.assert_array_equal(tied.materialize(back[2]["t"]), ws[2].T)

    def first_row(x):
        return x[0]

    with pytest.raises(ValueError, match=r"the view at \['v'\] is each member's own view"):
        tied.stack([{"w": w, "v": tied.view(w, first_row)} for w in ws])


def test_a_stack_is_immutable():
    s = tied.stack([{"w": jnp.ones(2)}, {"w": jnp.zeros(2)}])
    with pytest.raises(AttributeError, match=r"immutable"):
        s.member = {"w": jnp.ones((2, 2))}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_deepcopy_and_pickle_of_a_model_holding_a_stack_keep_its_layout_and_ties(how):
    # Issue 34 (10): both raised "a tied.Stack is immutable" (the default reduce sets slots).
    import copy
    import pickle

    blocks, norm, _ = _blocks(3)
    model = {"blocks": tied.stack(blocks), "final": norm}
    c = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    s, cs = model["blocks"], c["blocks"]
    assert isinstance(cs, tied.Stack) and len(cs) == 3 and cs.stacked == s.stacked
    assert cs.member["norm"] is c["final"] and cs.member["norm"] is not norm  # the tie, copied once
    assert cs.member["drop"].rng is not s.member["drop"].rng
    for (p, x), (q, y) in zip(places(model), places(c), strict=True):
        assert p == q and type(x) is type(y)
        if isinstance(x, jax.Array):
            np.testing.assert_array_equal(_data(x), _data(y))

    def groups(m):  # the identity class of every array and container place, first-seen order
        ids: dict = {}
        return [ids.setdefault(id(x), len(ids)) for _, x in places(m) if not isinstance(x, (int, float, str))]

    assert groups(c) == groups(model)


def test_copy_of_a_stack_is_a_stack_with_the_same_member():
    import copy

    s = tied.stack([{"w": jnp.ones(2)}, {"w": jnp.zeros(2)}])
    c = copy.copy(s)
    assert c is not s and c.member is s.member and (c.n, c.stacked) == (s.n, s.stacked)


def test_members_that_are_arrays_and_stacks_of_stacks():
    s = tied.stack([jnp.full(3, float(i)) for i in range(4)])
    assert s.member.shape == (4, 3)
    np.testing.assert_array_equal(tied.unstack(s)[3], jnp.full(3, 3.0))
    outer = tied.stack([tied.stack([{"w": jnp.full(2, 10.0 * i + j)} for j in range(3)]) for i in range(2)])
    assert outer.member.member["w"].shape == (2, 3, 2)
    np.testing.assert_array_equal(tied.unstack(tied.unstack(outer)[1])[2]["w"], jnp.full(2, 12.0))
    with pytest.raises(ValueError, match=r"static values"):
        tied.stack([1, 2])


@tied.register
class _Holder:
    def __init__(self, c):
        self.c = c


@tied.register
class _Dotted:
    def __init__(self, own, holder, own_first):
        if own_first:
            setattr(self, "b.c", own)
        self.b = holder
        if not own_first:
            setattr(self, "b.c", own)


@pytest.mark.parametrize("own_first", [True, False])
def test_places_written_alike_in_a_member_are_refused_naming_the_path(own_first):
    # Found by review: a Stack names its stacked places by path, so an attribute named "b.c" (each
    # member's own array) and the attribute c of b (one array in every member) were taken for one
    # place, and members 1 and 2 silently lost their own arrays.
    shared = _Holder(jnp.zeros((3, 2)))
    members = [_Dotted(jnp.full(2, float(i)), shared, own_first) for i in range(3)]
    with pytest.raises(ValueError, match=r"tied.stack: two places of a member are both written \.b\.c"):
        tied.stack(members)


def test_members_whose_views_use_two_function_objects_are_refused_naming_the_function():
    # the message said "its keys or fields, their order or their types changed", which none did
    w = jnp.ones((2, 3))
    members = [{"v": tied.view(w, lambda x: x.T)}, {"v": tied.view(2 * w, lambda x: x.T)}]
    with pytest.raises(
        ValueError, match=r"differ at \['v'\]: its view's function is another object \(\S*<lambda> and"
    ):
        tied.stack(members)
