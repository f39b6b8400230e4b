"""`tied.save(..., only=pred)`: a file of some arrays (adapters) and a fingerprint of the rest.

References are independent of tied's reader: the file is opened with the safetensors library's
own parser, its header read as plain JSON, and values are compared byte for byte with the arrays
that were put in.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied.nn import Dense, Embedding


def base(seed: int = 0, vocab: int = 8, dim: int = 4):
    """A tied LM's base: one Embedding at two places (``['embed']`` and ``['head']``), a hidden layer."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    emb = Embedding(vocab, dim, key=k1)
    return {"embed": emb, "head": emb, "fc": Dense(dim, dim, key=k2)}


def adapted(model, seed: int = 1, dim: int = 4):
    """``model`` with adapter arrays beside it: ``A`` at two places (a tie among selected arrays)."""
    r = np.random.default_rng(seed)
    a = jnp.asarray(r.normal(size=(2, dim)), jnp.float32)
    b = jnp.asarray(r.normal(size=(dim, 2)), jnp.float32)
    return {**model, "lora": {"A": a, "B": b}, "lora2": {"A": a}}


def is_lora(place, array):
    return place.startswith("['lora")


def stored_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a file or a set's shards, read by the safetensors library."""
    if os.path.isdir(path):
        out = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                out.update(safetensors.numpy.load_file(os.path.join(path, name)))
        return out
    return safetensors.numpy.load_file(path)


def manifest_of(path) -> dict:
    if os.path.isdir(path):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            return json.load(f)["metadata"]["tied"]
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(json.loads(f.read(n))["__metadata__"]["tied"])


@pytest.fixture(params=["file", "set"])
def where(request, tmp_path):
    """A single file, or a sharded set of shards of at most 40 bytes (one array each)."""
    if request.param == "file":
        return tmp_path / "adapters.safetensors", {}
    return tmp_path / "adapters", {"max_shard_size": 40}


def test_only_the_selected_arrays_are_stored_and_load_into_the_base(where):
    path, kw = where
    model = adapted(base())
    want_a, want_b = np.asarray(model["lora"]["A"]).copy(), np.asarray(model["lora"]["B"]).copy()
    tied.save(path, model, **kw, only=is_lora)
    held = stored_tensors(path)
    assert sorted(held) == ["['lora']['A']", "['lora']['B']"]  # A once, though at two places
    assert np.array_equal(held["['lora']['A']"], want_a) and np.array_equal(held["['lora']['B']"], want_b)
    like = adapted(base(), seed=7)  # the same base (same objects), other adapter values
    back = tied.load(path, like)
    assert np.array_equal(back["lora"]["A"], want_a) and np.array_equal(back["lora"]["B"], want_b)
    assert back["lora2"]["A"] is back["lora"]["A"]  # the tie among selected arrays
    assert back["head"] is back["embed"]  # the base's shared layer, one object
    assert back["embed"].weight is like["embed"].weight and back["fc"].weight is like["fc"].weight
    assert back is not like and like["lora"]["A"] is not back["lora"]["A"]  # a copy of like


def test_the_fingerprint_has_places_ties_shapes_and_dtypes_but_no_values(where):
    path, kw = where
    tied.save(path, adapted(base()), **kw, only=is_lora)
    doc = manifest_of(path)
    left = [a for a in doc["arrays"] if a.get("left_out")]
    assert sorted(p for a in left for p in a["places"]) == sorted(
        ["['embed'].weight", "['fc'].weight", "['fc'].bias"]  # below the shared layer's first place
    )
    assert all(set(a) <= {"left_out", "places", "shape", "dtype", "state", "place_keys"} for a in left)
    assert {tuple(a["shape"]) for a in left} == {(8, 4), (4, 4), (4,)}
    assert [["['embed']", "['head']"]] == doc["shared_nodes"]
    # Another base of the same structure (other values) is the same fingerprint: it loads, kept as is.
    other = adapted(base(seed=5))
    back = tied.load(path, other)
    assert back["embed"].weight is other["embed"].weight
    assert np.array_equal(back["lora"]["B"], np.asarray(adapted(base())["lora"]["B"]))


def test_an_array_selected_at_any_of_its_places_is_stored(tmp_path):
    model = adapted(base())
    w = np.asarray(model["embed"].weight).copy()
    f = tmp_path / "m.safetensors"
    asked = []

    def head_only(place, array):
        asked.append(place)
        return place == "['head'].weight"  # the embedding's second place, below the shared layer

    tied.save(f, model, only=head_only)
    assert "['head'].weight" in asked and "['embed'].weight" in asked and "['lora2']['A']" in asked
    held = stored_tensors(f)
    assert list(held) == ["['embed'].weight"] and np.array_equal(held["['embed'].weight"], w)
    like = adapted(base(seed=3))
    back = tied.load(f, like)
    assert back["head"] is back["embed"] and np.array_equal(back["embed"].weight, w)
    assert back["lora"]["B"] is like["lora"]["B"]


def test_keys_and_transforms_apply_to_the_stored_arrays(where):
    path, kw = where
    model = adapted(base())
    want_b = np.asarray(model["lora"]["B"]).copy()
    keys = {"['lora']['B']": "base_model.lora_B.weight", "['lora2']['A']": "base_model.lora_A.weight"}
    t = {"['lora']['B']": np.transpose}
    tied.save(path, model, **kw, only=is_lora, keys=keys, transform=t)
    held = stored_tensors(path)
    assert sorted(held) == ["base_model.lora_A.weight", "base_model.lora_B.weight"]
    assert np.array_equal(held["base_model.lora_B.weight"], want_b.T)
    with pytest.raises(
        tied.CheckpointError, match=r"shape differs at \['lora'\]\['B'\]: the file has \(2, 4\)"
    ):
        tied.load(path, adapted(base()))  # stored transposed: the inverse is needed
    back = tied.load(path, adapted(base(), seed=9), transform=t)
    assert np.array_equal(back["lora"]["B"], want_b) and back["lora"]["A"] is back["lora2"]["A"]


def test_dtype_like_casts_the_stored_arrays_and_never_the_base(tmp_path):
    f = tmp_path / "m.safetensors"
    model = adapted(base())
    half = {**model, "lora": tied.map(lambda a: a.astype(jnp.bfloat16), model["lora"])}
    half["lora2"] = {"A": half["lora"]["A"]}
    tied.save(f, half, only=is_lora)
    like = adapted(base(), seed=4)
    back = tied.load(f, like, dtype="like")
    ref = np.asarray(model["lora"]["B"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert back["lora"]["B"].dtype == jnp.float32 and np.array_equal(back["lora"]["B"], ref)
    with pytest.raises(
        tied.CheckpointError, match=r"dtype differs at \['embed'\].weight, which the file leaves out"
    ):
        tied.load(f, tied.map(lambda a: a.astype(jnp.bfloat16), like), dtype="like")


def untied_base(seed: int = 0):
    """The base with the head's embedding another layer of equal values: another tie."""
    m = base(seed)
    head = Embedding(jnp.asarray(m["embed"].weight))
    return {**m, "head": head}


@pytest.mark.parametrize(
    "other, message",
    [
        (
            lambda: adapted(base(vocab=9)),
            r"the shape differs at \['embed'\].weight, which the file leaves out"
            r".*had \(8, 4\) float32 there, like has \(9, 4\) float32",
        ),
        (
            lambda: adapted(tied.map(lambda a: a.astype(jnp.float16), base())),
            r"the dtype differs at \['embed'\].weight, which the file leaves out",
        ),
        (
            lambda: adapted(untied_base()),
            r"the sharing differs at \['embed'\]: in like, \['embed'\] is not "
            r"tied .* in the file, \['embed'\] and \['head'\] are one node.*saved with tied.save\(only=...\)",
        ),
        (
            lambda: {**adapted(base()), "extra": Dense(4, 4, key=jax.random.key(2))},
            r"places in like but not in the file: \['extra'\]",
        ),
        (
            lambda: {k: v for k, v in adapted(base()).items() if k != "fc"},
            r"places in the file but not in like: \['fc'\]",
        ),
    ],
    ids=["shape", "dtype", "tie", "place-added", "place-missing"],
)
def test_another_base_is_refused_naming_the_first_difference(tmp_path, other, message):
    f = tmp_path / "m.safetensors"
    tied.save(f, adapted(base()), only=is_lora)
    like = other()
    before = np.asarray(like["lora"]["A"]).copy()
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(f, like)
    assert np.array_equal(like["lora"]["A"], before)


def test_bad_uses_of_only_are_refused_clearly(tmp_path):
    model = adapted(base())
    f = tmp_path / "m.safetensors"
    with pytest.raises(tied.CheckpointError, match=r"only=...\) selects no array"):
        tied.save(f, model, only=lambda p, a: False)
    with pytest.raises(tied.CheckpointError, match=r"only=...\) failed at \['embed'\].weight \(KeyError"):
        tied.save(f, model, only=lambda p, a: {}[p])
    with pytest.raises(tied.CheckpointError, match=r"format='orbax', only=...\).*Drop format='orbax'"):
        tied.save(tmp_path / "o", model, format="orbax", only=is_lora)
    with tied.CheckpointManager(tmp_path / "steps") as mngr:
        with pytest.raises(
            tied.CheckpointError, match=r"CheckpointManager.save\(only=...\).*tied.save\(path"
        ):
            mngr.save(1, model, only=is_lora)
    assert not f.exists() and not (tmp_path / "o").exists()
    tied.save(f, model, only=is_lora)
    with pytest.raises(tied.CheckpointError, match=r"saved with tied.save\(only=...\).*strict=True"):
        tied.load(f, model, strict=False)
    tied.save(f, model, only=lambda p, a: True)  # everything: an ordinary checkpoint
    assert manifest_of(f)["version"] == 4 and len(stored_tensors(f)) == 5


@settings(max_examples=10, deadline=None)
@given(
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    chosen=st.lists(st.booleans(), min_size=6, max_size=6),
    limit=st.sampled_from([None, 20, 200]),
)
def test_random_ties_and_selections_round_trip(tmp_path_factory, pattern, chosen, limit):
    rng = np.random.default_rng(0)
    pool = [rng.normal(size=(1 + j,)).astype(np.float32) for j in range(4)]
    tree = {f"p{i}": pool[j] for i, j in enumerate(pattern)}
    selected = {j for i, j in enumerate(pattern) if chosen[i]}  # at any of its places
    d = tmp_path_factory.mktemp("only")
    path = d / ("set" if limit else "m.safetensors")
    pred = lambda place, a: chosen[int(place[3:-2])]  # noqa: E731
    if not selected:
        with pytest.raises(tied.CheckpointError, match="selects no array"):
            tied.save(path, tree, only=pred, max_shard_size=limit)
        return
    tied.save(path, tree, only=pred, max_shard_size=limit)
    held = stored_tensors(path)
    assert len(held) == len(selected)  # each selected array once
    for j in selected:
        first = f"['p{pattern.index(j)}']"
        assert np.array_equal(held[first], pool[j])
    like_pool = [np.zeros_like(x) for x in pool]
    like = {f"p{i}": like_pool[j] for i, j in enumerate(pattern)}
    back = tied.load(path, like)
    for i, j in enumerate(pattern):
        if j in selected:
            assert np.array_equal(back[f"p{i}"], pool[j])
        else:
            assert back[f"p{i}"] is like_pool[j]
        for i2, j2 in enumerate(pattern):
            assert (back[f"p{i}"] is back[f"p{i2}"]) == (j == j2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda doc: doc.update(version=4), r"left_out mark that is not true in a version 5 manifest"),
        (lambda doc: doc["arrays"][0].update(left_out="yes"), r"left_out mark that is not true"),
        (
            lambda doc: doc.update(version=6),
            r"tied checkpoint version 6; this tied reads versions 1, 2, 3, 4, 5",
        ),
    ],
    ids=["mark-in-version-4", "mark-not-true", "newer-version"],
)
def test_a_hostile_fingerprint_is_refused(tmp_path, edit, message):
    tied.save(tmp_path, adapted(base()), only=is_lora, max_shard_size=100)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    doc = index["metadata"]["tied"]
    assert doc["version"] == 5 and [a.get("left_out") for a in doc["arrays"]].count(True) == 3
    left = next(a for a in doc["arrays"] if a.get("left_out"))
    doc["arrays"].remove(left)
    doc["arrays"].insert(0, left)
    edit(doc)
    index_path.write_text(json.dumps(index))
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(tmp_path, adapted(base()))
