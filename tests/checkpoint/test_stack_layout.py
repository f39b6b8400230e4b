"""A checkpoint records each `tied.Stack`'s layout, and a strict load into another layout is refused.

Shapes alone cannot tell a stacked array from a broadcast one whose leading axis happens to be
``n``: without the layout, the file's broadcast ``(n, d)`` array would be read into ``like``'s
stacked place (each member getting one row) and the reverse, with no error. The reference for
"same layout" here is how each test built its members (which objects it shared), never the code
under test; the reference for the loaded values is the saved members themselves.
"""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint import read_parts, with_doc, write_parts

import tied

N, D = 3, 4  # a broadcast (N, D) array has the shape of a stacked (D,) array


def _members(stacked: dict[str, bool], salt: float = 0.0) -> list[dict]:
    """N members holding, for each name, an array of shape (D,) per member (stacked) or one
    (N, D) array shared by every member (broadcast): the same shapes once stacked either way."""
    shared = {
        k: jnp.arange(N * D, dtype=jnp.float32).reshape(N, D) + salt + 100 * j for j, k in enumerate(stacked)
    }
    return [
        {k: (jnp.full(D, i + salt + 10 * j) if s else shared[k]) for j, (k, s) in enumerate(stacked.items())}
        for i in range(N)
    ]


def _save(path, tree, fmt: str) -> None:
    if fmt == "sharded":
        tied.save(path, tree, max_shard_size=40)  # a directory of shards, the manifest in the index
    else:
        tied.save(path, tree, format=fmt)


def _path(tmp_path, fmt: str):
    return tmp_path / {"safetensors": "m.safetensors", "sharded": "shards", "orbax": "ck"}[fmt]


FORMATS = ["safetensors", "sharded", "orbax"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reviewers_case_is_refused_naming_the_stack_and_both_layouts(tmp_path, fmt):
    b = jnp.arange(12.0).reshape(3, 4)
    saved = tied.stack([{"w": jnp.full(4, float(i)), "b": b} for i in range(3)])  # b broadcast
    like = tied.stack([{"w": jnp.zeros(4), "b": jnp.zeros(4) + i} for i in range(3)])  # b stacked
    path = _path(tmp_path, fmt)
    _save(path, saved, fmt)
    if fmt == "sharded":
        assert len(list(path.glob("model-*.safetensors"))) > 1
    before = [np.asarray(x).copy() for x in tied.flatten(like)[0]]
    with pytest.raises(tied.CheckpointError, match=r"the layout at <root> differs") as e:
        tied.load(path, like=like)
    msg = str(e.value)
    stack = "a tied.Stack of 3 members whose stacked places (in the member) are: the member itself"
    assert f"like has {stack}, ['b'], ['w'], the file has {stack}, ['w']: arrays of the same shapes" in msg
    assert "Build `like` as the saved model was built" in msg
    for x, y in zip(tied.flatten(like)[0], before):
        np.testing.assert_array_equal(x, y)  # like untouched


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_same_layout_loads_the_saved_values(tmp_path, fmt):
    layout = {"w": True, "b": False, "c": True}
    members = _members(layout, salt=0.5)
    path = _path(tmp_path, fmt)
    _save(path, tied.stack(members), fmt)
    back = tied.unstack(tied.load(path, like=tied.stack(_members(layout))))
    for got, want in zip(back, members):
        for k in layout:
            np.testing.assert_array_equal(got[k], want[k])
    assert back[0]["b"] is back[1]["b"] is back[2]["b"]  # the broadcast array is one array again


def test_a_stack_nested_in_a_model_is_named_by_its_place(tmp_path):
    emb = jnp.ones((5, D))
    saved = {"embed": emb, "blocks": tied.stack(_members({"w": True, "b": False})), "head": emb}
    like = {"embed": emb, "blocks": tied.stack(_members({"w": True, "b": True})), "head": emb}
    tied.save(tmp_path / "m.safetensors", saved)
    with pytest.raises(tied.CheckpointError, match=r"the layout at \['blocks'\] differs"):
        tied.load(tmp_path / "m.safetensors", like=like)


def test_a_stack_of_another_length_with_nothing_stacked_is_refused(tmp_path):
    # Every member the very same object: nothing stacked, so no shape says how many members.
    m = {"w": jnp.arange(4.0)}
    tied.save(tmp_path / "m.safetensors", tied.stack([m, m, m]))
    with pytest.raises(
        tied.CheckpointError,
        match=r"like has a tied.Stack of 2 members with nothing stacked \(every object broadcast\), the file "
        r"has a tied.Stack of 3 members with nothing stacked \(every object broadcast\): the number of "
        r"members differs",
    ):
        tied.load(tmp_path / "m.safetensors", like=tied.stack([m, m]))
    assert len(tied.load(tmp_path / "m.safetensors", like=tied.stack([m, m, m]))) == 3


def test_a_stack_where_the_file_has_a_plain_node_is_refused(tmp_path):
    # The same places cannot arise with and without a Stack (its member is under `.member`),
    # so a plain node standing where like has a Stack is refused by its places or its layout.
    tied.save(tmp_path / "m.safetensors", {"s": {"member": {"w": jnp.zeros((N, D))}}})
    with pytest.raises(tied.CheckpointError):
        tied.load(tmp_path / "m.safetensors", like={"s": tied.stack(_members({"w": True}))})


def test_a_deep_model_whose_places_are_stored_as_a_table_keeps_its_layout(tmp_path):
    def deep(layout):
        tree = {"blocks": tied.stack(_members(layout))}
        for _ in range(1500):  # paths long enough that `pack` writes the place table
            tree = {"w": jnp.zeros(1), "next": tree}
        return tree

    tied.save(tmp_path / "m.safetensors", deep({"w": True, "b": False}))
    header, _ = read_parts(tmp_path / "m.safetensors")
    doc = json.loads(header["__metadata__"]["tied"])
    assert "place_table" in doc and "at" in doc["layouts"][0]
    with pytest.raises(tied.CheckpointError, match=r"the layout at \['next'\].*\['blocks'\] differs"):
        tied.load(tmp_path / "m.safetensors", like=deep({"w": True, "b": True}))
    tied.load(tmp_path / "m.safetensors", like=deep({"w": True, "b": False}))


def test_a_version_3_file_loads_into_a_stack_with_a_warning(tmp_path):
    f = tmp_path / "m.safetensors"
    tied.save(f, tied.stack(_members({"w": True, "b": False})))
    header, data = read_parts(f)

    def as_v3(doc):
        doc["version"] = 3
        del doc["layouts"]

    write_parts(f, with_doc(header, as_v3), data)
    with pytest.warns(UserWarning, match=r"did not record layouts \(version 3\).*layout of <root>"):
        back = tied.load(f, like=tied.stack(_members({"w": True, "b": False})))
    assert len(back) == N
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model without a Stack: nothing to warn about
        tied.save(tmp_path / "plain.safetensors", {"w": jnp.ones(2)})
        header, data = read_parts(tmp_path / "plain.safetensors")
        write_parts(tmp_path / "plain.safetensors", with_doc(header, as_v3), data)
        tied.load(tmp_path / "plain.safetensors", like={"w": jnp.zeros(2)})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("layouts"), r"'layouts' is not a list"),
        (lambda d: d.update(layouts={"a": 1}), r"'layouts' is not a list"),
        (lambda d: d.update(layouts=[1]), r"a layout entry has no layout"),
        (lambda d: d.update(layouts=[{"places": ["", 3], "layout": {}}]), r"a layout's places is not"),
        (lambda d: d.update(layouts=[{"places": [], "layout": {}}]), r"a layout's places is not"),
        (lambda d: d["layouts"][0].update(place_keys=[[".x"]]), r"a layout's place_keys are not the keys"),
        (lambda d: d["layouts"][0].pop("place_keys"), r"a layout's place_keys are not the keys"),
        (
            lambda d: d["layouts"][0].update(layout={"type": "tied.Stack", "n": 3, "stacked": [""]}),
            r"layout at <root> differs",
        ),
    ],
)
def test_a_hostile_layout_entry_is_refused_by_name(tmp_path, change, message):
    f = tmp_path / "m.safetensors"
    like = tied.stack(_members({"w": True, "b": False}))
    tied.save(f, like)
    header, data = read_parts(f)
    write_parts(f, with_doc(header, change), data)
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(f, like=like)


@settings(max_examples=25, deadline=None)
@given(
    saved=st.lists(st.booleans(), min_size=1, max_size=4),
    loaded=st.lists(st.booleans(), min_size=1, max_size=4),
)
def test_random_layouts_load_only_into_the_same_layout(tmp_path_factory, saved, loaded):
    n = min(len(saved), len(loaded))
    saved, loaded = saved[:n], loaded[:n]
    names = [f"a{j}" for j in range(n)]
    f = tmp_path_factory.mktemp("lay") / "m.safetensors"
    members = _members(dict(zip(names, saved)), salt=0.25)
    tied.save(f, tied.stack(members))
    like = tied.stack(_members(dict(zip(names, loaded))))
    if saved != loaded:  # the reference: which arrays the test itself shared
        with pytest.raises(tied.CheckpointError, match="the layout at <root> differs"):
            tied.load(f, like=like)
        return
    for got, want in zip(tied.unstack(tied.load(f, like=like)), members):
        for k in names:
            np.testing.assert_array_equal(got[k], want[k])


@tied.register
class _Holder:
    def __init__(self, t):
        self.t = t


@tied.register
class _Outer:
    def __init__(self, odd_first, odd, nested):  # two places written .s.t, in either order
        if odd_first:
            setattr(self, "s.t", odd)
            self.s = _Holder(nested)
        else:
            self.s = _Holder(nested)
            setattr(self, "s.t", odd)


def test_two_stacks_at_places_written_alike_are_told_apart_by_their_keys(tmp_path):
    # Found by review: layouts were paired by (path, n-th written so), which follows the walk
    # order; an attribute named "s.t" and the attribute t of s are both written .s.t.
    broadcast, stacked = {"w": True, "b": False}, {"w": True, "b": True}
    saved = _Outer(True, tied.stack(_members(broadcast, 0.5)), tied.stack(_members(stacked, 0.25)))
    tied.save(tmp_path / "m.safetensors", saved)
    for odd_first in (True, False):  # the swapped layouts, in either attribute order
        like = _Outer(odd_first, tied.stack(_members(stacked)), tied.stack(_members(broadcast)))
        with pytest.raises(tied.CheckpointError, match=r"the layout at \.s\.t differs"):
            tied.load(tmp_path / "m.safetensors", like=like)
    # The same layouts with the attributes in the other order: each Stack gets its own arrays.
    like = _Outer(False, tied.stack(_members(broadcast)), tied.stack(_members(stacked)))
    back = tied.load(tmp_path / "m.safetensors", like=like)
    for name, read in (("s.t", lambda o: getattr(o, "s.t")), ("s", lambda o: o.s.t)):
        for got, want in zip(tied.unstack(read(back)), tied.unstack(read(saved))):
            for k in ("w", "b"):
                np.testing.assert_array_equal(got[k], want[k], err_msg=name)
