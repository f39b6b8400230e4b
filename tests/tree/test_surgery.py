"""tied.tie / untie / replace against an independent reference.

The reference walks the original model with `helpers.children` (its own walker, not
`tied`'s) and says, for every place of the unrolled result, which object should stand
there: `replace` substitutes by identity (every place of the object), `tie` and `untie`
by *slot* (a container's child: a place inside a shared container is one slot with the
same place in the container's other places). Results are checked place by place:
arrays by identity (`is`) or by value for copies, and the sharing pattern of arrays and
containers against the pattern the reference predicts.

(The functions are imported from `tied._tree.surgery` until `tied/__init__.py` exports them.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    NT,
    Box,
    Chain,
    Dense,
    EqxPair,
    FrozenDC,
    children,
    is_array,
    is_tracked_node,
    models,
    places,
    untied_copy,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from test_map import assert_unchanged, snapshot

import tied
from tied._tree.surgery import PathError
from tied._tree.surgery import replace as treplace
from tied._tree.surgery import tie as ttie
from tied._tree.surgery import untie as tuntie

K = jax.tree_util


# ---------------------------------------------------------------- the reference


def slots(tree: Any) -> list[tuple[str, Any, Any, str]]:
    """Every place of the unrolled tree: (path, object, parent object or None, step)."""
    out = []

    def walk(x, path, parent, step):
        out.append((path, x, parent, step))
        for key, c in children(x) or ():
            s = K.keystr((key,))
            walk(c, path + s, x, s)

    walk(tree, "", None, "")
    return out


def expected(tree: Any, edit) -> list[tuple[str, Any, Any]]:
    """The unrolled result predicted by ``edit(parent, step, obj) -> (obj, label)``: for each
    place (path, the object whose values stand there, an identity label)."""
    out = []

    def walk(x, path, parent, step, copied):
        x, label = edit(parent, step, x)
        copied = copied or label == "copy"
        out.append((path, x, ("copy", id(x)) if copied else id(x)))
        for key, c in children(x) or ():
            s = K.keystr((key,))
            walk(c, path + s, x, s, copied)

    walk(tree, "", None, "", False)
    return out


def partition(labels: list) -> list[int]:
    ids: dict = {}
    return [ids.setdefault(lab, len(ids)) for lab in labels]


def tracked(x: Any) -> bool:
    return is_array(x) or is_tracked_node(x)


def check(result: Any, exp: list, *, same_arrays: bool = True) -> None:
    got = list(places(result))
    assert [p for p, _ in got] == [p for p, _, _ in exp]
    for (p, y), (_, x, _) in zip(got, exp):
        assert type(y) is type(x) or (is_array(x) and is_array(y)), p
        if is_array(x):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=p)
            if same_arrays:
                assert y is x, p
        elif children(x) is None:
            assert y is x or y == x, p
    mask = [tracked(y) for _, y in got]
    assert partition([id(y) for (_, y), m in zip(got, mask) if m]) == partition(
        [lab for (_, _, lab), m in zip(exp, mask) if m]
    )


def valid_places(tree: Any) -> list[tuple[str, Any]]:
    """Places of arrays and of containers that hold arrays (what the functions accept)."""
    out = []
    for p, x in places(tree):
        if is_array(x) or (is_tracked_node(x) and any(is_array(y) for _, y in places(x))):
            out.append((p, x))
    return out


def steps_of(path: str) -> int:
    return path.count(".") + path.count("[")


def nested(p: str, q: str) -> bool:
    return p != q and (q.startswith(p) and q[len(p)] in ".[" or p.startswith(q) and p[len(q)] in ".[")


def signature(x: Any) -> Any:
    if is_array(x):
        return ("array", x.shape, np.dtype(x.dtype))
    return (type(x), tuple((p, y.shape, np.dtype(y.dtype)) for p, y in places(x) if is_array(y)))


# ---------------------------------------------------------------- random sharing patterns


@given(models(), st.data())
def test_replace_matches_the_reference(tree, data):
    snap = snapshot(tree)
    path, target = data.draw(st.sampled_from(valid_places(tree)))
    kind = data.draw(st.sampled_from(["array", "node", "existing"]))
    if kind == "array":
        value = jnp.full((2,), 7.0)
    elif kind == "node":
        value = Box(jnp.ones(3), "v")
    else:  # an object already in the model: the two become one
        value = data.draw(st.sampled_from(valid_places(tree)))[1]
        assume(not any(nested_obj is target for _, nested_obj in places(value)))
    out = treplace(tree, path, value)
    check(out, expected(tree, lambda parent, step, x: (value if x is target else x, None)))
    assert_unchanged(tree, snap)


@given(models(), st.data())
def test_tie_matches_the_reference(tree, data):
    snap = snapshot(tree)
    cands = valid_places(tree)
    p0, o0 = data.draw(st.sampled_from(cands))
    same = [(p, x) for p, x in cands if p != p0 and not nested(p, p0) and signature(x) == signature(o0)]
    assume(same)
    chosen = data.draw(st.lists(st.sampled_from(same), min_size=1, max_size=3, unique_by=lambda c: c[0]))
    assume(not any(nested(a, b) for a, _ in chosen for b, _ in chosen))
    slot = {(id(parent), step) for p, _ in chosen for q, _, parent, step in slots(tree) if q == p}
    out = ttie(tree, p0, *(p for p, _ in chosen))
    check(out, expected(tree, lambda parent, step, x: (o0 if (id(parent), step) in slot else x, None)))
    assert_unchanged(tree, snap)


@given(models(), st.data())
def test_tie_refuses_a_mismatch_naming_both_paths_and_leaves_the_model(tree, data):
    snap = snapshot(tree)
    cands = valid_places(tree)
    p0, o0 = data.draw(st.sampled_from(cands))
    other = [(p, x) for p, x in cands if not nested(p, p0) and signature(x) != signature(o0)]
    assume(other)
    p1, _ = data.draw(st.sampled_from(other))
    with pytest.raises(ValueError, match=r"tied\.tie: .* cannot hold the object at "):
        ttie(tree, p0, p1)
    assert_unchanged(tree, snap)


def shared_ancestor(tree: Any, path: str) -> bool:
    """Whether a container strictly above ``path`` is held at two or more places."""
    count: dict[int, int] = {}
    for _, x in places(tree):
        count[id(x)] = count.get(id(x), 0) + 1
    return any(
        count[id(x)] > 1 and is_tracked_node(x) and nested(p, path) and path.startswith(p)
        for p, x in places(tree)
    )


@given(models(), st.data())
def test_untie_matches_the_reference(tree, data):
    snap = snapshot(tree)
    path, target = data.draw(st.sampled_from(valid_places(tree)))
    if shared_ancestor(tree, path):
        with pytest.raises(ValueError, match=r"tied\.untie: .* lies inside .*, a container shared with"):
            tuntie(tree, path)
        assert_unchanged(tree, snap)
        return
    [(_, _, parent0, step0)] = [s for s in slots(tree) if s[0] == path]
    out = tuntie(tree, path)

    def edit(parent, step, x):
        return x, ("copy" if parent is parent0 and step == step0 else None)

    exp = expected(tree, edit)
    check(out, exp, same_arrays=False)
    originals = {id(x) for _, x in places(tree) if is_array(x)}
    for (p, y), (_, x, lab) in zip(places(out), exp):
        if is_array(y):
            # copies are new arrays; everything else is the model's own array
            assert (id(y) not in originals) if isinstance(lab, tuple) else (y is x), p
    assert_unchanged(tree, snap)


# ---------------------------------------------------------------- Hugging Face tie_weights


@tied.register
class LM:
    _test_registered = True  # helpers.children walks it through vars()

    def __init__(self, embed, head):
        self.embed, self.head = embed, head

    def __call__(self, ids):
        h = jnp.tanh(self.embed.weight[ids])
        return h @ self.head.weight.T + self.head.bias


def test_tie_weights_then_adam_keeps_one_parameter_against_optax_by_hand():
    k = jax.random.split(jax.random.key(0), 3)
    V, D = 5, 3
    embed = Dense(jax.random.normal(k[0], (V, D)), None)
    lm = LM(embed, Dense(jax.random.normal(k[1], (V, D)), jnp.zeros(V)))
    ids, target = jnp.array([0, 3, 1, 4]), jax.random.normal(k[2], (4, V))
    snap = snapshot(lm)
    lm2 = ttie(lm, ".embed.weight", ".head.weight")
    assert lm2.head.weight is lm2.embed.weight is lm.embed.weight
    assert tied.ties(lm2) == [(".embed.weight", ".head.weight")]
    assert_unchanged(lm, snap)

    loss = lambda m: jnp.mean((m(ids) - target) ** 2)

    # reference: one weight read at two places, per-place partials from plain jax.grad summed
    # by hand, Adam stepped by hand with optax on the unique parameters
    def ref_loss(w_embed, w_head, bias):
        h = jnp.tanh(w_embed[ids])
        return jnp.mean((h @ w_head.T + bias - target) ** 2)

    tx = optax.adam(1e-1)
    p = {"w": lm.embed.weight, "b": lm.head.bias}
    s = tx.init(p)
    state = tied.optim.setup(tx, lm2)
    m = lm2
    for _ in range(4):
        ge, gh, gb = jax.grad(ref_loss, argnums=(0, 1, 2))(p["w"], p["w"], p["b"])
        u, s = tx.update({"w": ge + gh, "b": gb}, s, p)
        p = optax.apply_updates(p, u)
        m, state = tied.optim.update(state, m, tied.grad(loss)(m))
        assert m.head.weight is m.embed.weight
        np.testing.assert_allclose(m.embed.weight, p["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.head.bias, p["b"], rtol=1e-5, atol=1e-6)


def test_untie_then_adam_moves_the_two_places_apart_as_two_parameters():
    w = jax.random.normal(jax.random.key(0), (3, 3))
    m = Chain(Dense(w, jnp.zeros(3), jnp.tanh), Dense(w, jnp.zeros(3)))
    x = jnp.ones((2, 3)) * jnp.arange(1.0, 4.0)
    u = tuntie(m, ".layers[1].weight")
    assert u.layers[0].weight is w and u.layers[1].weight is not w
    np.testing.assert_array_equal(u.layers[1].weight, w)
    loss = lambda m: jnp.sum(m(x) ** 2)
    tx = optax.adam(1e-1)
    state = tied.optim.setup(tx, u)
    ref = untied_copy(u)
    a, b = ref.layers
    ps = {"a": a.weight, "b": b.weight, "c": a.bias, "d": b.bias}

    def ref_loss(ps):
        h = jnp.tanh(x @ ps["a"].T + ps["c"])
        return jnp.sum((h @ ps["b"].T + ps["d"]) ** 2)

    s = tx.init(ps)
    for _ in range(3):
        upd, s = tx.update(jax.grad(ref_loss)(ps), s, ps)
        ps = optax.apply_updates(ps, upd)
        u, state = tied.optim.update(state, u, tied.grad(loss)(u))
    np.testing.assert_allclose(u.layers[0].weight, ps["a"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(u.layers[1].weight, ps["b"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(u.layers[0].weight, u.layers[1].weight)
    assert m.layers[0].weight is m.layers[1].weight is w  # the input kept its tie


# ---------------------------------------------------------------- Equinox tree_at


class Block(eqx.Module):
    lin: eqx.nn.Linear
    again: eqx.nn.Linear
    tag: str = eqx.field(static=True)


def make_block():
    k1, k2 = jax.random.split(jax.random.key(1))
    return Block(eqx.nn.Linear(2, 2, key=k1), eqx.nn.Linear(2, 2, key=k2), "b")


def test_replace_is_tree_at_on_a_model_without_ties():
    b = make_block()
    new_w = jnp.full((2, 2), 3.0)
    ours = treplace(b, ".lin.weight", new_w)
    ref = eqx.tree_at(lambda m: m.lin.weight, b, new_w)
    assert K.tree_structure(ours) == K.tree_structure(ref)
    for a, c in zip(K.tree_leaves(ours), K.tree_leaves(ref)):
        assert a is c
    lin = eqx.nn.Linear(2, 2, key=jax.random.key(9))
    ours = treplace(b, ".again", lin)
    ref = eqx.tree_at(lambda m: m.again, b, lin)
    assert K.tree_structure(ours) == K.tree_structure(ref) and ours.again is lin
    assert b.again is not lin  # the input is unchanged


def test_replace_keeps_the_tie_where_tree_at_would_cut_it():
    k1, k2 = jax.random.split(jax.random.key(1))
    shared = eqx.nn.Linear(2, 2, key=k1)
    b = Block(shared, shared, "b")
    new = eqx.nn.Linear(2, 2, key=k2)
    ours = treplace(b, ".lin", new)
    assert ours.lin is new and ours.again is new
    cut = eqx.tree_at(lambda m: m.lin, b, new)  # equinox replaces the one place: the tie is cut
    assert cut.lin is not cut.again
    np.testing.assert_array_equal(cut.lin.weight, new.weight)
    np.testing.assert_array_equal(cut.again.weight, shared.weight)
    w = jnp.zeros((2, 2))
    ours = treplace(b, ".again.weight", w)  # a place inside the shared layer: both places
    assert ours.lin is ours.again and ours.lin.weight is w and ours.tag == "b"


def test_replace_in_immutable_containers_rebuilds_each_once():
    w = jnp.ones(2)
    inner = (w, FrozenDC(w, NT(w, 1)))
    tree = {"a": inner, "b": [inner, EqxPair(inner, 2)]}
    out = treplace(tree, "['b'][1].a[1].b.a", jnp.zeros(2))  # w, everywhere
    assert all(x is out["a"][0] for p, x in places(out) if is_array(x))
    out = treplace(tree, "['a'][1].b", NT(jnp.zeros(2), 5))  # a namedtuple inside a shared tuple
    assert out["a"] is out["b"][0] is out["b"][1].a
    assert out["a"][1].b.b == 5 and out["a"][0] is w
    out = tuntie(tree, "['b'][1]")
    assert out["a"] is out["b"][0] and out["b"][1].a is not out["a"]
    assert not any(x is w for _, x in places(out["b"][1]))


def test_views_follow_a_replaced_source_and_untie_copies_the_view():
    enc_w = jnp.arange(6.0).reshape(2, 3)
    m = {"enc": Dense(enc_w, None), "dec": Dense(tied.transpose(enc_w), None)}
    new = jnp.ones((2, 3))
    out = treplace(m, "['enc'].weight", new)
    assert out["dec"].weight.source is new and out["enc"].weight is new
    out = tuntie(m, "['dec'].weight")
    assert isinstance(out["dec"].weight, tied.View) and out["dec"].weight.source is not enc_w
    assert out["enc"].weight is enc_w and tied.ties(out) == []
    np.testing.assert_array_equal(tied.materialize(out["dec"].weight), enc_w.T)


def test_tie_of_layers_and_of_a_cycle():
    d1, d2 = Dense(jnp.ones((2, 2)), jnp.zeros(2)), Dense(jnp.zeros((2, 2)), jnp.ones(2))
    m = Chain(d1, d2)
    out = ttie(m, ".layers[1]", ".layers[0]")
    assert out.layers[0] is out.layers[1] and out.layers[0].weight is d2.weight
    assert out.layers[0] is not d2  # a fresh container; the input's are untouched
    loop = [jnp.ones(2), jnp.zeros(2)]
    loop.append(loop)
    out = ttie(loop, "[0]", "[1]")
    assert out[2] is out and out[0] is out[1] is loop[0]


# ---------------------------------------------------------------- errors


def test_unknown_path_lists_the_nearest_valid_ones():
    m = Chain(Dense(jnp.ones((2, 2)), jnp.zeros(2), jnp.tanh))
    snap = snapshot(m)
    calls = ((treplace, (1,)), (tuntie, ()), (lambda t, p: ttie(t, ".layers[0].bias", p), ()))
    for fn, args in calls:
        with pytest.raises(
            PathError,
            match=r"'\.layer\[0\]\.weight' is not a place of the model.*Nearest "
            r"valid paths: \.layers\[0\]\.weight",
        ):
            fn(m, ".layer[0].weight", *args)
        with pytest.raises(KeyError):  # a PathError is a KeyError
            fn(m, ".layers[0].weights", *args)
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.activation holds a static value.*never tied"):
        tuntie(m, ".layers[0].activation")
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.activation holds a static value.*never tied"):
        ttie(m, ".layers[0].activation", ".layers[0].bias")
    with pytest.raises(TypeError, match="paths are keystr strings"):
        treplace(m, ("layers", 0), 1)
    assert_unchanged(m, snap)
    out = treplace(m, ".layers[0].activation", jax.nn.relu)  # a static field: its one place
    assert out.layers[0].activation is jax.nn.relu and m.layers[0].activation is jnp.tanh
    assert out.layers[0].weight is m.layers[0].weight


def test_tie_refuses_nested_places_and_too_few_paths():
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    m = Chain(Chain(d), Chain(d))
    with pytest.raises(ValueError, match=r"\.layers\[0\]\.layers\[0\] lies inside \.layers\[0\]"):
        ttie(m, ".layers[0]", ".layers[0].layers[0]")
    with pytest.raises(TypeError, match="two or more paths"):
        ttie(m, ".layers[0]")
    with pytest.raises(
        ValueError,
        match=r"\.layers\[0\]\.layers\[0\] cannot hold the object at "
        r"\.layers\[1\]: \.layers\[1\] holds a helpers\.Chain, "
        r"\.layers\[0\]\.layers\[0\] holds a helpers\.Dense",
    ):
        ttie(m, ".layers[1]", ".layers[0].layers[0]")


def test_untie_inside_a_shared_layer_names_the_layer_to_untie():
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    m = Chain(d, d)
    snap = snapshot(m)
    with pytest.raises(
        ValueError,
        match=r"\.layers\[1\]\.bias lies inside \.layers\[1\], a container shared "
        r"with \.layers\[0\].*tied\.untie\(tree, '\.layers\[1\]'\)",
    ):
        tuntie(m, ".layers[1].bias")
    assert_unchanged(m, snap)
    out = tuntie(m, ".layers[1]")
    assert out.layers[0] is not out.layers[1] and out.layers[0].weight is d.weight
    assert out.layers[1].weight is not d.weight and out.layers[1].bias is not d.bias
    np.testing.assert_array_equal(out.layers[1].weight, d.weight)
    assert tied.ties(out) == []


def test_frozen_dataclass_and_slots_places_are_edited_on_the_copy_only():
    @dataclasses.dataclass(frozen=True)
    class Slots:
        __slots__ = ("a", "b")
        a: Any
        b: Any

    w = jnp.ones(2)
    tree = [Slots(w, FrozenDC(w, 1)), Slots(w, 2)]
    snap = snapshot(tree)
    out = tuntie(tree, "[0].b.a")
    assert out[0].a is w and out[1].a is w and out[0].b.a is not w
    out = treplace(tree, "[1].a", jnp.zeros(2))
    assert out[0].a is out[1].a is out[0].b.a and not np.any(np.asarray(out[0].a))
    assert_unchanged(tree, snap)


@jax.tree_util.register_pytree_with_keys_class
class Remade:
    """A pytree that hands JAX a new copy of its list each time it is flattened."""

    def __init__(self, items):
        self.items = items  # kept as given: tied rebuilds a list after the node holding it

    def tree_flatten_with_keys(self):
        return [(K.GetAttrKey("items"), list(self.items))], None

    def tree_flatten(self):
        return [list(self.items)], None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def test_places_in_a_container_made_anew_on_each_flatten():
    w1, w2 = jnp.ones(2), jnp.zeros(2)
    m = {"r": Remade([w1, w2]), "x": jnp.full(2, 3.0)}
    r = tied.ties({"a": m["r"], "b": m["r"]})[0][0]  # the path as tied prints it
    items = r.replace("['a']", "['r']") + "[0]"  # the list the pytree hands JAX
    out = ttie(m, "['x']", items + "[0]")  # written into the pytree's own storage
    assert out["r"].items[0] is out["x"] and m["r"].items[0] is w1
    out = tuntie(ttie(m, items + "[0]", items + "[1]"), items + "[1]")
    assert out["r"].items[0] is w1 and out["r"].items[1] is not w1
    np.testing.assert_array_equal(out["r"].items[1], w1)
    out = treplace(m, items + "[1]", jnp.full(2, 5.0))
    assert float(out["r"].items[1][0]) == 5.0 and out["r"].items[0] is w1
    with pytest.raises(
        tied.GraphError,
        match=r"\['r'\]\[0\] did not keep what was written there.*made "
        r"anew each time the model is walked",
    ):
        ttie({"r": m["r"], "l": [w2, w1]}, "['l']", items)  # the pytree's list is a copy


def test_mutation_between_calls_is_seen():
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    m = Chain(d, d)
    assert tied.ties(tuntie(m, ".layers[1]")) == []
    m.layers[1] = Dense(jnp.ones((2, 2)), jnp.zeros(2))  # the user cuts the tie in place
    again = ttie(m, ".layers[0]", ".layers[1]")
    assert again.layers[0] is again.layers[1] and again.layers[0].weight is d.weight
    m.layers.append(d)  # and adds a third place of d
    out = treplace(m, ".layers[2]", Dense(jnp.zeros((2, 2)), jnp.ones(2)))
    assert out.layers[0] is out.layers[2] and out.layers[1] is not out.layers[0]


# ---------------------------------------------------------------- state
# Surgery on ambiguous paths and on graphs with parent back-references (issue 17, points 7 and 9).


@tied.register
class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_replace_on_a_path_two_places_write_alike_is_refused_naming_both():
    inner = Obj(b=jnp.zeros(2))
    o = Obj(a=inner)
    setattr(o, "a.b", jnp.ones(2))  # an attribute literally named "a.b", written .a.b too
    for who, call in [
        ("tied.replace", lambda: tied.replace(o, ".a.b", jnp.full(2, 5.0))),
        ("tied.untie", lambda: tied.untie(o, ".a.b")),
        ("tied.tie", lambda: tied.tie(o, ".a.b", ".a")),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"{who}: \.a\.b names 2 places of the model, whose keys .* are "
            r"(\('\.a\.b'\) and \('\.a', '\.b'\)|\('\.a', '\.b'\) and \('\.a\.b'\))",
        ):
            call()
    np.testing.assert_array_equal(np.asarray(inner.b), np.zeros(2))  # nothing was edited
    np.testing.assert_array_equal(np.asarray(getattr(o, "a.b")), np.ones(2))


def back_referenced():
    root = Obj(w=jnp.ones(2), kids=[])
    kid = Obj(parent=root, v=jnp.arange(2.0))
    root.kids.append(kid)
    return root, kid


def test_untie_an_array_in_a_graph_with_parent_back_references():
    root, kid = back_referenced()
    root.shared = kid.v  # v at two places: .kids[0].v and .shared
    out = tied.untie(root, ".kids[0].v")
    assert out.kids[0].parent is out  # the back-reference still reaches the new root
    assert out.shared is kid.v and out.kids[0].v is not kid.v
    np.testing.assert_array_equal(np.asarray(out.kids[0].v), np.arange(2.0))
    assert root.kids[0].v is kid.v  # the model given is not changed


def test_untie_a_container_that_reaches_its_parent_is_refused_with_a_fix_that_works():
    root, kid = back_referenced()
    root.again = kid.v
    with pytest.raises(
        ValueError,
        match=r"the container at \.kids\[0\] reaches <root> again at "
        r"\.kids\[0\]\.parent .* Untie the arrays inside it",
    ):
        tied.untie(root, ".kids[0]")
    out = tied.untie(root, ".kids[0].v")  # the fix the message gives
    assert out.kids[0].v is not out.again and out.kids[0].parent is out


def test_untie_below_a_truly_shared_container_still_names_the_container():
    root, kid = back_referenced()
    root.kids.append(kid)  # the kid at two places
    with pytest.raises(ValueError, match=r"lies inside \.kids\[0\], a container shared with \.kids\[1\]"):
        tied.untie(root, ".kids[0].v")
