"""Sharded safetensors sets (Hugging Face's layout), file keys, transforms and casts, without transformers.

References are independent of tied's reader: values are compared byte for byte with the
arrays that were saved, shards are opened with the safetensors library's own (Rust)
parser, and the index is read as plain JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied._checkpoint import sharded as _sharded
from tied.nn import Chain, Dense, Embedding

# ---------------------------------------------------------------- models and helpers


def lm(seed: int = 0, vocab: int = 64, dim: int = 16):
    """An embedding tied to the head, and a hidden layer: 64*16 + 16*16 + 16 floats."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    emb = Embedding(vocab, dim, key=k1)
    return Chain(emb, Dense(dim, dim, key=k2), Dense(emb.weight))


LM_KEYS = {
    ".layers[0].weight": "model.embed.weight",
    ".layers[1].weight": "model.fc.weight",
    ".layers[1].bias": "model.fc.bias",
    ".layers[2].weight": "lm_head.weight",
}


def arrays_of(model) -> dict[str, np.ndarray]:
    return {
        ".layers[0].weight": np.asarray(model.layers[0].weight),
        ".layers[1].weight": np.asarray(model.layers[1].weight),
        ".layers[1].bias": np.asarray(model.layers[1].bias),
    }


def same(back, model) -> bool:
    want, got = arrays_of(model), arrays_of(back)
    return all(got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want)


def index_of(d) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def shards_of(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


def hidden(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("."))


# ---------------------------------------------------------------- the layout


def test_a_sharded_set_has_hugging_faces_layout_and_loads_with_its_ties(tmp_path):
    model = lm()
    (tmp_path / "config.json").write_text("{}")
    tied.save(tmp_path, model, {"step": 3}, max_shard_size=1050)  # 4096 B, 1024 B and 64 B arrays
    idx = index_of(tmp_path)
    names = shards_of(tmp_path)
    assert names == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(idx["weight_map"]) == sorted(idx["weight_map"].keys())
    assert set(idx["weight_map"].values()) == set(names)
    assert idx["metadata"]["total_size"] == (64 * 16 + 16 * 16 + 16) * 4
    total = 0
    for name in names:
        with safetensors.safe_open(tmp_path / name, "np") as f:  # the reference parser
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert sum(sizes) <= 1050 or len(sizes) == 1  # over the limit only when alone
            total += sum(sizes)
            for k in f.keys():
                assert idx["weight_map"][k] == name
    assert total == idx["metadata"]["total_size"]
    assert (tmp_path / "config.json").read_text() == "{}"
    back = tied.load(tmp_path, lm(1))
    assert back.layers[2].weight is back.layers[0].weight
    assert same(back, model)
    assert tied.load_metadata(tmp_path) == {"step": 3}
    assert tied.load_metadata(tmp_path / "model.safetensors.index.json") == {"step": 3}
    back = tied.load(tmp_path / "model.safetensors.index.json", lm(1))  # the index itself
    assert same(back, model) and back.layers[2].weight is back.layers[0].weight


@pytest.mark.parametrize(
    "size, bytes_",
    [
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("3MB", 3 * 10**6),
        ("2MiB", 2 * 2**20),
        ("8Kb", 1000),
        (77, 77),
    ],
)
def test_max_shard_size_is_read_as_transformers_reads_it(size, bytes_):
    assert _sharded.parse_size(size) == bytes_


@pytest.mark.parametrize("size", ["5 apples", "GB", 0, -3, 1.5, True, "-1GB"])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(tmp_path, size):
    with pytest.raises(tied.CheckpointError, match=r"max_shard_size=.*'5GB'"):
        tied.save(tmp_path / "d", lm(), max_shard_size=size)
    assert not (tmp_path / "d").exists()


def test_saving_a_set_over_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(tied.CheckpointError, match=r"is a file; a sharded set is a directory"):
        tied.save(tmp_path / "f", lm(), max_shard_size="1MB")


# ---------------------------------------------------------------- keys


def test_keys_name_each_array_once_the_tied_head_omitted(tmp_path):
    model = lm()
    tied.save(tmp_path, model, keys=LM_KEYS, max_shard_size=2000)
    wmap = index_of(tmp_path)["weight_map"]
    assert sorted(wmap) == ["model.embed.weight", "model.fc.bias", "model.fc.weight"]  # no lm_head.weight
    plain = {}
    for name in shards_of(tmp_path):
        plain.update(safetensors.numpy.load_file(tmp_path / name))
    want = arrays_of(model)
    assert np.array_equal(plain["model.embed.weight"], want[".layers[0].weight"])
    assert np.array_equal(plain["model.fc.bias"], want[".layers[1].bias"])
    back = tied.load(tmp_path, lm(1))  # strict: the manifest restores every place and tie
    assert back.layers[2].weight is back.layers[0].weight and same(back, model)
    # A reader that knows only the keys: the head filled from the embedding by like's tie.
    back = tied.load(tmp_path, lm(1), strict=False, rename={v: k for k, v in LM_KEYS.items()})
    assert back.layers[2].weight is back.layers[0].weight and same(back, model)


def test_keys_as_a_function_and_in_one_file(tmp_path):
    model = lm()
    f = tmp_path / "model.safetensors"
    tied.save(f, model, keys=lambda p: None if "[2]" in p else "x" + p)
    assert sorted(safetensors.numpy.load_file(f)) == [
        "x.layers[0].weight",
        "x.layers[1].bias",
        "x.layers[1].weight",
    ]
    back = tied.load(f, lm(1))
    assert back.layers[2].weight is back.layers[0].weight and same(back, model)


def test_the_key_of_the_first_named_place_is_used(tmp_path):
    model = lm()
    f = tmp_path / "m.safetensors"
    tied.save(f, model, keys={".layers[2].weight": "lm_head.weight"})  # only the head's place named
    assert "lm_head.weight" in safetensors.numpy.load_file(f)
    assert ".layers[1].weight" in safetensors.numpy.load_file(f)  # unnamed: its path, as without keys


def test_two_arrays_given_one_key_is_a_value_error_naming_both(tmp_path):
    with pytest.raises(
        ValueError, match=r"two arrays get the key 'w': the one at .layers\[0\].weight and the "
    ):
        tied.save(tmp_path / "m.safetensors", lm(), keys={".layers[0].weight": "w", ".layers[1].weight": "w"})
    with pytest.raises(tied.CheckpointError, match=r"names places the tree does not have: .layers\[9\]"):
        tied.save(tmp_path / "m.safetensors", lm(), keys={".layers[9].weight": "w"})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- transforms and dtypes


def test_a_transform_on_save_and_its_inverse_on_load_strict(tmp_path):
    model = lm()
    t = {".layers[1].weight": lambda a: a.T}
    tied.save(tmp_path, model, transform=t, max_shard_size=1050)
    stored = {}
    for name in shards_of(tmp_path):
        stored.update(safetensors.numpy.load_file(tmp_path / name))
    assert np.array_equal(stored[".layers[1].weight"], np.asarray(model.layers[1].weight).T)
    back = tied.load(tmp_path, lm(1), transform=t)
    assert back.layers[2].weight is back.layers[0].weight and same(back, model)
    back = tied.load(tmp_path, lm(1), transform=lambda p, a: a.T if p == ".layers[1].weight" else a)
    assert same(back, model)
    with pytest.raises(
        tied.CheckpointError, match=r"at .layers\[1\].weight .* was saved through a transform"
    ):
        tied.load(tmp_path, lm(1))  # without the inverse (square here: the values would be wrong)


def test_a_transform_giving_the_wrong_shape_names_key_shard_and_place(tmp_path):
    tied.save(tmp_path, lm(), keys=LM_KEYS, max_shard_size=1050)
    like = lm(1)
    before = np.asarray(like.layers[1].weight).copy()
    with pytest.raises(
        tied.CheckpointError,
        match=r"transform at .layers\[1\].weight turned key 'model.fc.weight' \(shard model-0000\d-of-00003"
        r".safetensors\), of shape \(16, 16\), into shape \(256,\), but like has \(16, 16\)",
    ):
        tied.load(
            tmp_path,
            like,
            strict=False,
            rename={v: k for k, v in LM_KEYS.items()},
            transform={".layers[1].weight": np.ravel},
        )
    assert np.array_equal(np.asarray(like.layers[1].weight), before)


def test_dtype_like_casts_a_bfloat16_set_into_a_float32_model(tmp_path):
    model = tied.map(lambda a: a.astype(jnp.bfloat16), lm())
    tied.save(tmp_path, model, max_shard_size=600)
    with pytest.raises(
        tied.CheckpointError,
        match=r"dtype differs at .layers\[0\].weight: the file has .* bfloat16, like has .* float32",
    ):
        tied.load(tmp_path, lm(1))
    back = tied.load(tmp_path, lm(1), dtype="like")
    assert back.layers[2].weight is back.layers[0].weight
    ref = np.asarray(model.layers[0].weight).astype(np.float32)  # numpy's own cast of the stored values
    assert back.layers[0].weight.dtype == jnp.float32 and np.array_equal(
        np.asarray(back.layers[0].weight), ref
    )


def test_dtype_like_never_casts_integers_to_floats(tmp_path):
    f = tmp_path / "f.safetensors"
    safetensors.numpy.save_file({"['w']": np.ones((2, 2), np.int32)}, f)
    with pytest.raises(tied.CheckpointError, match=r"dtype differs at \['w'\]: the file has \(2, 2\) int32"):
        tied.load(f, {"w": np.zeros((2, 2), np.float32)}, strict=False, dtype="like")
    with pytest.raises(tied.CheckpointError, match=r"dtype='float16'.*'like'"):
        tied.load(f, {"w": np.zeros((2, 2), np.float32)}, strict=False, dtype="float16")


# ---------------------------------------------------------------- bad input


@pytest.fixture
def a_set(tmp_path):
    tied.save(tmp_path, lm(), keys=LM_KEYS, max_shard_size=1050)
    return tmp_path


def DICT(key):  # a file key -> the place of a dict's item
    return f"['{key}']"


def by_keys(path, **kw):
    return tied.load(path, lm(1), strict=False, rename={v: k for k, v in LM_KEYS.items()}, **kw)


def test_a_missing_shard_is_named_with_its_key(a_set):
    shard = index_of(a_set)["weight_map"]["model.fc.weight"]
    os.unlink(a_set / shard)
    for strict in (True, False):
        with pytest.raises(
            tied.CheckpointError,
            match=rf"the shard {shard}, which the index names for 'model.fc.weight'.*is missing",
        ):
            tied.load(a_set, lm(1)) if strict else by_keys(a_set)


def test_a_truncated_shard_is_named(a_set):
    shard = index_of(a_set)["weight_map"]["model.embed.weight"]
    data = (a_set / shard).read_bytes()
    (a_set / shard).write_bytes(data[:-10])
    with pytest.raises(
        tied.CheckpointError,
        match=rf"the shard {shard}, which the index names for 'model.embed.weight'.*cannot be read.*ends",
    ):
        by_keys(a_set)


def test_a_weight_map_key_in_no_shard_is_named(a_set):
    idx = index_of(a_set)
    right = idx["weight_map"]["model.fc.bias"]
    wrong = next(s for s in set(idx["weight_map"].values()) if s != right)
    idx["weight_map"]["model.fc.bias"] = wrong
    (a_set / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(
        tied.CheckpointError,
        match=rf"puts the key 'model.fc.bias' in the shard {wrong}, which does not hold it",
    ):
        by_keys(a_set)


def test_two_shards_holding_one_key_with_different_values(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    safetensors.numpy.save_file({"a": w, "b": np.ones(3, np.float32)}, tmp_path / "s1.safetensors")
    safetensors.numpy.save_file({"b": np.zeros(3, np.float32)}, tmp_path / "s2.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    like = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    with pytest.raises(
        tied.CheckpointError,
        match=r"the key 'b' is in two shards with different values: s2.safetensors .* and s1.safetensors",
    ):
        tied.load(tmp_path, like, strict=False, rename=DICT)
    safetensors.numpy.save_file({"b": np.ones(3, np.float32)}, tmp_path / "s2.safetensors")  # equal copies
    back = tied.load(tmp_path, like, strict=False, rename=DICT)
    assert np.array_equal(back["a"], w) and np.array_equal(back["b"], np.ones(3, np.float32))


def test_only_the_shards_holding_needed_keys_are_read(tmp_path):
    safetensors.numpy.save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    back = tied.load(tmp_path, {"a": np.zeros(2, np.float32)}, strict=False, allow_extra=True, rename=DICT)
    assert np.array_equal(back["a"], np.ones(2, np.float32))


@pytest.mark.parametrize(
    "index, message",
    [
        (
            '{"weight_map": {"a": "../s1.safetensors"}}',
            r"mapped to '../s1.safetensors', which is not a file name",
        ),
        ('{"weight_map": []}', r"no 'weight_map' object"),
        ("[1, 2", r"not JSON"),
        ('{"weight_map": {"a": "s1.safetensors"}, "metadata": 3}', r"'metadata' is not an object"),
        (
            '{"weight_map": {"a": "s1.safetensors"}, "metadata": {"tied": {"format": "tied"}}}',
            r"version None",
        ),
        ('{"weight_map": {"a": "s1.safetensors"}, "metadata": {"tied": 5}}', r"malformed: no format marker"),
    ],
)
def test_a_hostile_index_is_refused(tmp_path, index, message):
    safetensors.numpy.save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(tied.CheckpointError, match=message):
        tied.load(tmp_path, {"a": np.zeros(2, np.float32)}, strict=False)


def test_an_index_from_another_library_is_refused_strict_with_the_way_out(a_set):
    idx = index_of(a_set)
    del idx["metadata"]["tied"]
    (a_set / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(tied.CheckpointError, match=r"an index without tied's metadata.*strict=False"):
        tied.load(a_set, lm(1))
    assert same(by_keys(a_set), lm())


def test_a_set_whose_bytes_changed_fails_its_checksum(a_set):
    shard = index_of(a_set)["weight_map"]["model.fc.bias"]
    data = bytearray((a_set / shard).read_bytes())
    data[-1] ^= 1
    (a_set / shard).write_bytes(bytes(data))
    with pytest.raises(tied.CheckpointError, match=r"do not match their CRC-32C"):
        tied.load(a_set, lm(1))


# ---------------------------------------------------------------- what a directory holds


def test_a_directory_is_read_as_transformers_reads_it(tmp_path):
    a, b = {"w": np.ones(2, np.float32)}, {"w": np.full(2, 2.0, np.float32)}
    like = {"w": np.zeros(2, np.float32)}
    tied.save(tmp_path / "only.safetensors", a)
    assert np.array_equal(tied.load(tmp_path, like)["w"], a["w"])  # the one file
    tied.save(tmp_path / "other.safetensors", b)
    with pytest.raises(
        tied.CheckpointError,
        match=r"several checkpoints in one directory \(only.safetensors, other.safetensors\)",
    ):
        tied.load(tmp_path, like)
    tied.save(tmp_path, b, max_shard_size=100)
    assert np.array_equal(tied.load(tmp_path, like)["w"], b["w"])  # the index wins over stray files
    tied.save(tmp_path / "model.safetensors", a)
    assert np.array_equal(tied.load(tmp_path, like)["w"], a["w"])  # model.safetensors first
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "x.safetensors.index.json").write_text("{}")
    assert np.array_equal(tied.load(tmp_path, like)["w"], b["w"])  # the name transformers reads first
    (tmp_path / "model.safetensors.index.json").rename(tmp_path / "y.safetensors.index.json")
    with pytest.raises(
        tied.CheckpointError, match=r"several .*x.safetensors.index.json, y.safetensors.index.json"
    ):
        tied.load(tmp_path, like)


def test_a_directory_with_nothing_to_load_says_what_it_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(tied.CheckpointError, match=r"not a tied checkpoint.*found: config.json"):
        tied.load(tmp_path, {"w": np.zeros(2)})
    safetensors.numpy.save_file({"w": np.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(
        tied.CheckpointError, match=r"shards \(model-00001-of-00002.safetensors, ...\) but no index"
    ):
        tied.load(tmp_path, {"w": np.zeros(2)})


# ---------------------------------------------------------------- replacing a set


def test_a_new_set_replaces_the_old_one_and_keeps_other_files(tmp_path):
    (tmp_path / "config.json").write_text('{"n": 1}')
    tied.save(tmp_path / "model.safetensors", lm(5))  # a single file, as save_pretrained writes a small model
    tied.save(tmp_path, lm(0), max_shard_size=1050)  # 3 shards
    assert shards_of(tmp_path) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    tied.save(tmp_path, lm(1), max_shard_size=5000)  # 2 shards: no stale one left
    assert shards_of(tmp_path) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert same(tied.load(tmp_path, lm(9)), lm(1))
    tied.save(tmp_path, lm(2), max_shard_size=5000)  # the same names, taken over
    assert same(tied.load(tmp_path, lm(9)), lm(2))
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (tmp_path / "config.json").read_text() == '{"n": 1}'


def snapshots_of_a_save(monkeypatch, d, tree, size, into):
    """Save ``tree`` into ``d``, copying ``d`` at every step (each chunk written, each commit step):
    each copy is the directory a kill at that moment leaves (a kill loses nothing the kernel holds)."""
    from tied._checkpoint import safetensors_format as _safetensors

    shots = []
    real = _safetensors._write_array

    def shoot():
        shots.append(into / f"at{len(shots):03d}")
        shutil.copytree(d, shots[-1])

    def write(f, data):
        f.flush()
        shoot()
        real(f, data)

    monkeypatch.setattr(_safetensors, "_write_array", write)
    monkeypatch.setattr(_sharded, "_step", lambda name: shoot())
    tied.save(d, tree, max_shard_size=size)
    monkeypatch.undo()
    return shots


@pytest.mark.parametrize(
    "old_file, old_size, new_size",
    [(False, 5000, 5000), (False, 1050, 5000), (False, 5000, 1050), (True, None, 1050)],
    ids=["names-taken-over", "fewer-shards", "more-shards", "from-model.safetensors"],
)
def test_a_save_stopped_at_any_step_leaves_the_old_set_or_the_new(
    tmp_path, monkeypatch, old_file, old_size, new_size
):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    old, new = lm(0), lm(1)
    if old_file:
        tied.save(d / "model.safetensors", old)
    else:
        tied.save(d, old, max_shard_size=old_size)
    shots = snapshots_of_a_save(monkeypatch, d, new, new_size, tmp_path)
    assert len(shots) >= 5
    seen = []
    for shot in shots + [d]:
        back = tied.load(shot, lm(9))  # checksums: a mix of the two sets would not load
        assert back.layers[2].weight is back.layers[0].weight
        assert same(back, old) or same(back, new), shot
        seen.append("new" if same(back, new) else "old")
        if "model.safetensors.index.json" in os.listdir(shot):  # what transformers follows: whole files
            for shard in set(index_of(shot)["weight_map"].values()):
                with safetensors.safe_open(shot / shard, "np") as f:
                    assert list(f.keys())
    assert seen[0] == "old" and seen[-1] == "new" and seen == sorted(seen, reverse=True), seen
    for shot in shots[::3]:  # a later save clears what the stopped one left
        tied.save(shot, new, max_shard_size=new_size)
        assert hidden(shot) == [] and (shot / "config.json").exists()
        assert same(tied.load(shot, lm(9)), new)
    assert hidden(d) == []


KILLED = """
import os, signal, sys
import numpy as np
import tied
from tied._checkpoint import sharded as _sharded

def kill(name):
    if name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)

_sharded._step = kill
tied.save(sys.argv[1], {"w": np.full((64, 64), 2.0, np.float32), "b": np.ones(64, np.float32)},
          max_shard_size=300)
"""


@pytest.mark.parametrize("step", ["link", "shard"])
def test_a_save_killed_mid_commit_leaves_a_set_that_loads(tmp_path, step):
    like = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(64, np.float32)}
    tied.save(
        tmp_path, {"w": np.ones((64, 64), np.float32), "b": np.zeros(64, np.float32)}, max_shard_size=300
    )
    r = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path), step], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert hidden(tmp_path)  # the dead save's files are there
    back = tied.load(tmp_path, like)
    assert np.array_equal(back["w"], np.ones((64, 64), np.float32))  # the old set, whole
    tied.save(
        tmp_path, {"w": np.full((64, 64), 3.0, np.float32), "b": np.ones(64, np.float32)}, max_shard_size=300
    )
    assert hidden(tmp_path) == []
    assert np.array_equal(tied.load(tmp_path, like)["w"], np.full((64, 64), 3.0, np.float32))


# ---------------------------------------------------------------- random sharing, random limits


@settings(max_examples=15, deadline=None)
@given(
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 40), min_size=4, max_size=4),
    limit=st.integers(1, 400),
)
def test_random_ties_round_trip_through_any_shard_size(tmp_path_factory, pattern, sizes, limit):
    rng = np.random.default_rng(0)
    pool = [rng.normal(size=(n,)).astype(np.float32) for n in sizes]
    tree = {f"p{i}": pool[j] for i, j in enumerate(pattern)}
    d = tmp_path_factory.mktemp("set")
    tied.save(d, tree, max_shard_size=limit)
    like = {k: np.zeros_like(v) for k, v in tree.items()}
    back = tied.load(d, like, strict=False) if False else None
    back = tied.load(d, {k: v for k, v in tree.items()})
    for i, j in enumerate(pattern):
        assert np.array_equal(back[f"p{i}"], pool[j])
        for i2, j2 in enumerate(pattern):
            assert (back[f"p{i}"] is back[f"p{i2}"]) == (j == j2)
    for name in shards_of(d):
        with safetensors.safe_open(d / name, "np") as f:
            sizes_in = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes_in) <= limit or len(sizes_in) == 1


def test_bfloat16_arrays_keep_their_bits_in_a_set(tmp_path):
    tree = {"w": np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)}
    tied.save(tmp_path, tree, max_shard_size=4)
    back = tied.load(tmp_path, tree)
    assert back["w"].dtype == ml_dtypes.bfloat16 and back["w"].tobytes() == tree["w"].tobytes()


def test_a_tree_without_arrays_and_an_index_naming_other_files(tmp_path):
    tied.save(tmp_path, {"n": 3}, max_shard_size=10)  # no arrays: one empty shard and its index
    assert tied.load(tmp_path, {"n": 3}) == {"n": 3}
    # An index that names a file which is not a shard: a save never removes it.
    (tmp_path / "notes.txt").write_text("mine")
    idx = index_of(tmp_path)
    idx["weight_map"]["x"] = "notes.txt"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    tied.save(tmp_path, {"w": np.ones(2, np.float32)}, max_shard_size=10)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert np.array_equal(tied.load(tmp_path, {"w": np.zeros(2, np.float32)})["w"], np.ones(2, np.float32))


@settings(max_examples=15, deadline=None)
@given(
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    named=st.lists(st.booleans(), min_size=6, max_size=6),
    flips=st.lists(st.booleans(), min_size=4, max_size=4),
    limit=st.integers(1, 300),
    cast=st.booleans(),
)
def test_random_keys_transforms_and_casts_round_trip(tmp_path_factory, pattern, named, flips, limit, cast):
    rng = np.random.default_rng(1)
    pool = [rng.normal(size=(2 + j, 3)).astype(np.float32) for j in range(4)]  # (in, out) stored if flipped
    tree = {f"p{i}": pool[j] for i, j in enumerate(pattern)}
    keys = {f"['p{i}']": f"hf.{i}" for i in range(len(pattern)) if named[i]}
    flip = {f"['p{i}']": np.transpose for i, j in enumerate(pattern) if flips[j]}  # one function per tie
    if cast:
        tree = {k: v.astype(ml_dtypes.bfloat16) for k, v in tree.items()}
        tree = {f"p{i}": tree[f"p{pattern.index(j)}"] for i, j in enumerate(pattern)}  # re-tie
    d = tmp_path_factory.mktemp("set")
    tied.save(d, tree, keys=keys, transform=flip, max_shard_size=limit)
    like = {f"p{i}": np.zeros_like(pool[j]) for i, j in enumerate(pattern)}
    like = {f"p{i}": like[f"p{pattern.index(j)}"] for i, j in enumerate(pattern)}  # like's ties
    want = {
        f"p{i}": pool[j] if not cast else pool[j].astype(ml_dtypes.bfloat16).astype(np.float32)
        for i, j in enumerate(pattern)
    }
    # The file as another library sees it: each array once, under the first named place's key.
    plain = {}
    for name in shards_of(d):
        plain.update(safetensors.numpy.load_file(d / name))
    first = {j: pattern.index(j) for j in set(pattern)}
    for j, i0 in first.items():
        name = next(
            (keys[f"['p{i}']"] for i, jj in enumerate(pattern) if jj == j and f"['p{i}']" in keys),
            f"['p{i0}']",
        )
        stored_value = plain[name].astype(np.float32)
        assert np.array_equal(stored_value.T if flips[j] else stored_value, want[f"p{i0}"])
    strict = tied.load(d, like, transform=flip, dtype="like" if cast else None)
    renames = {v: k for k, v in keys.items()}
    loose = tied.load(
        d,
        like,
        strict=False,
        rename=renames,
        transform=flip,
        dtype="like" if cast else None,
        allow_extra=True,
    )
    for back in (strict, loose):
        for i, j in enumerate(pattern):
            assert back[f"p{i}"].dtype == np.float32 and np.array_equal(back[f"p{i}"], want[f"p{i}"])
            for i2, j2 in enumerate(pattern):
                assert (back[f"p{i}"] is back[f"p{i2}"]) == (j == j2)


# ---------------------------------------------------------------- scalars, shared layers' places, dtypes


def test_a_model_holding_scalars_loads_with_dtype_like_and_a_transform(tmp_path):
    bn = tied.nn.BatchNorm(3)
    bn.num_batches_tracked.value = jnp.asarray(7, jnp.int32)  # a 0-d count, a 0-d float beside it
    tree = {"bn": bn, "scale": jnp.asarray(1.5, jnp.float32)}
    f = tmp_path / "m.safetensors"
    tied.save(f, tied.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, tree))
    plain = safetensors.numpy.load_file(f)  # the reference: what the file holds, read by safetensors
    like = {"bn": tied.nn.BatchNorm(3), "scale": jnp.zeros((), jnp.float32)}
    for kw in ({"dtype": "like"}, {"dtype": "like", "transform": lambda p, a: a}):
        back = tied.load(f, like, **kw)
        assert back["bn"].num_batches_tracked.value.shape == ()
        assert (
            int(back["bn"].num_batches_tracked.value) == int(plain["['bn'].num_batches_tracked.value"]) == 7
        )
        assert back["scale"].shape == () and back["scale"].dtype == jnp.float32
        assert float(back["scale"]) == float(plain["['scale']"].astype(np.float32)) == 1.5
    back = tied.load(
        f,
        tied.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, like),
        transform={"['scale']": lambda a: a * 2},
    )
    assert back["scale"].shape == () and float(back["scale"]) == 3.0


def shared_head(seed: int = 0):
    """One Embedding at two places: ``['head'].weight`` is a place below the shared layer's second place."""
    emb = Embedding(8, 4, key=jax.random.key(seed))
    return {"embed": emb, "head": emb}


def test_keys_may_name_an_array_at_a_place_below_a_shared_layer(tmp_path):
    model = shared_head()
    w = np.asarray(model["embed"].weight)
    f = tmp_path / "m.safetensors"
    tied.save(f, model, keys={"['head'].weight": "lm_head.weight"})
    plain = safetensors.numpy.load_file(f)
    assert list(plain) == ["lm_head.weight"] and np.array_equal(plain["lm_head.weight"], w)
    asked = []
    d = tmp_path / "set"
    tied.save(
        d,
        model,
        keys=lambda p: asked.append(p) or ("lm_head.weight" if "head" in p else None),
        max_shard_size=100,
    )
    assert asked == ["['embed'].weight", "['head'].weight"]  # every place is asked, in walk order
    assert list(index_of(d)["weight_map"]) == ["lm_head.weight"]
    for path in (f, d):
        back = tied.load(path, shared_head(1))  # strict: the manifest restores the shared layer
        assert back["head"] is back["embed"] and np.array_equal(back["head"].weight, w)
        back = tied.load(path, shared_head(1), strict=False, rename={"lm_head.weight": "['head'].weight"})
        assert back["head"] is back["embed"] and np.array_equal(back["embed"].weight, w)
    # The first named place in walk order gives the key, wherever the places are.
    tied.save(f, model, keys={"['head'].weight": "lm_head.weight", "['embed'].weight": "wte"})
    assert list(safetensors.numpy.load_file(f)) == ["wte"]


def test_a_transform_may_name_an_array_at_a_place_below_a_shared_layer(tmp_path):
    model = shared_head()
    w = np.asarray(model["embed"].weight)
    f = tmp_path / "m.safetensors"
    tied.save(f, model, transform={"['head'].weight": lambda a: a * 2})
    assert np.array_equal(safetensors.numpy.load_file(f)["['embed'].weight"], w * 2)  # applied, not skipped
    with pytest.raises(tied.CheckpointError, match=r"\['embed'\].weight .* was saved through a transform"):
        tied.load(f, shared_head(1))
    back = tied.load(f, shared_head(1), transform={"['head'].weight": lambda a: a / 2})
    assert back["head"] is back["embed"] and np.array_equal(back["embed"].weight, w)
    with pytest.raises(tied.CheckpointError, match=r"two functions for one array, at \['embed'\].weight and"):
        tied.load(f, shared_head(1), transform={"['head'].weight": np.negative, "['embed'].weight": np.abs})


def test_a_bfloat16_file_into_a_float32_model_says_to_pass_dtype_like(tmp_path):
    f = tmp_path / "m.safetensors"
    tied.save(f, {"w": jnp.ones(3, jnp.bfloat16)})
    for strict in (True, False):
        with pytest.raises(
            tied.CheckpointError,
            match=r"dtype differs at \['w'\]: the file has \(3,\) bfloat16, like has \(3,\) float32\. "
            r"Pass dtype=\"like\"",
        ):
            tied.load(f, {"w": jnp.zeros(3, jnp.float32)}, strict=strict)
    assert tied.load(f, {"w": jnp.zeros(3, jnp.float32)}, dtype="like")["w"].tolist() == [1.0, 1.0, 1.0]


def test_an_index_naming_a_directory_as_a_shard_is_a_checkpoint_error(a_set):
    index = index_of(a_set)
    (a_set / "sub").mkdir()
    index["weight_map"]["model.fc.weight"] = "sub"
    (a_set / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        tied.CheckpointError,
        match=r"the shard sub, which the index names for 'model.fc.weight'"
        r".*is a directory",
    ):
        tied.load(a_set, lm(1))


class Killed(Exception):
    pass


def test_a_save_killed_after_its_commit_leaves_old_shards_that_the_next_save_removes(tmp_path, monkeypatch):
    tied.save(tmp_path, lm(0), max_shard_size=1050)  # 3 shards
    old = shards_of(tmp_path)
    assert old == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    foreign = {  # files this code did not write, each one a near miss of the shards' pattern
        "config.json": "{}",
        "other-00001-of-00003.safetensors": "x",
        "pytorch_model-00001-of-00003.bin": "x",
        "model-1-of-3.safetensors": "x",
        "model-00001-of-00003.safetensors.bak": "x",
        "model-00007-of-00009.safetensors": "x",  # named by another index
        "adapter.safetensors.index.json": json.dumps(
            {"weight_map": {"a": "model-00007-of-00009.safetensors"}}
        ),
    }
    for name, text in foreign.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "model-00008-of-00009.safetensors").mkdir()  # not a file: stays

    def stop(name):
        if name == "remove":
            raise Killed

    monkeypatch.setattr(_sharded, "_step", stop)
    with pytest.raises(Killed):
        tied.save(tmp_path, lm(1), max_shard_size=5000)  # 2 shards; killed after the commit
    monkeypatch.undo()
    assert set(old) <= set(os.listdir(tmp_path))  # the old set's shards are still there
    assert same(tied.load(tmp_path, lm(9)), lm(1))  # the new set is the one that loads
    tied.save(tmp_path, lm(2), max_shard_size=5000)
    assert same(tied.load(tmp_path, lm(9)), lm(2))
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*foreign, "model-00008-of-00009.safetensors", "model.safetensors.index.json"]
        + ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    for name, text in foreign.items():
        assert (tmp_path / name).read_text() == text
    assert hidden(tmp_path) == []
