"""Adversarial review of `tied.save(only=...)` and the sharded cleanup: defects found, each pinned.

References are independent of tied's reader: the arrays put in, and files listed by `os`.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tied


def test_an_abstract_like_is_refused_where_the_file_leaves_an_array_out(tmp_path):
    # The result would hold a jax.ShapeDtypeStruct as the base's value, silently.
    path = tmp_path / "adapter.safetensors"
    tied.save(path, {"lora": jnp.arange(2.0), "base": jnp.ones(3)}, only=lambda p, a: p == "['lora']")
    like = jax.eval_shape(lambda: {"lora": jnp.zeros(2), "base": jnp.zeros(3)})
    with pytest.raises(tied.CheckpointError, match=r"no value at \['base'\].*ShapeDtypeStruct"):
        tied.load(path, like)
    # Abstract where the file holds the array is fine: it is read.
    base = jnp.ones(3)
    back = tied.load(path, {"lora": jax.ShapeDtypeStruct((2,), jnp.float32), "base": base})
    np.testing.assert_array_equal(np.asarray(back["lora"]), [0.0, 1.0])
    assert back["base"] is base


def test_a_pipe_named_as_an_index_does_not_hang_a_sharded_save(tmp_path):
    # The cleanup read every *.safetensors.index.json in the folder; a FIFO blocked the save forever.
    folder = tmp_path / "set"
    tied.save(folder, {"a": jnp.ones(3), "b": jnp.zeros(3)}, max_shard_size=12)
    os.mkfifo(folder / "other.safetensors.index.json")
    done = []
    t = threading.Thread(
        target=lambda: done.append(tied.save(folder, {"a": jnp.full(3, 2.0)}, max_shard_size=12)),
        daemon=True,
    )
    t.start()
    t.join(60)
    if not done:  # unblock the reader so the thread ends
        with open(folder / "other.safetensors.index.json", "wb"):
            pass
        t.join(10)
    assert done, "tied.save blocked on a pipe named *.safetensors.index.json"
    assert sorted(os.listdir(folder)) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "other.safetensors.index.json",
    ]


def _in_thread(call, pipe):
    """``call()`` in a thread; if it blocks on the FIFO ``pipe`` for 60 s, unblock it and fail."""
    out: list = []

    def run():
        try:
            call()
            out.append(None)
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    if not out:
        with open(pipe, "wb"):
            pass
        t.join(10)
        pytest.fail(f"blocked reading the pipe {pipe}")
    return out[0]


def test_a_pipe_given_as_an_index_is_refused_not_read(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    err = _in_thread(lambda: tied.load(index, {"a": jnp.ones(3)}), index)
    assert isinstance(err, tied.CheckpointError)
    assert "not a regular file" in str(err)


@pytest.mark.parametrize("which", ["file", "shard", "index"])
def test_a_loop_of_symbolic_links_is_a_checkpoint_error(tmp_path, which):
    model = {"a": jnp.ones(3), "b": jnp.zeros(3)}
    folder = tmp_path / "set"
    tied.save(folder, model, max_shard_size=12)
    if which == "file":
        target = tmp_path / "loop.safetensors"
        path = target
    else:
        name = "model-00002-of-00002.safetensors" if which == "shard" else "model.safetensors.index.json"
        target = folder / name
        os.remove(target)
        path = folder / "model.safetensors.index.json"
    os.symlink(target, target)
    with pytest.raises(tied.CheckpointError, match=r"cannot be (opened|read).*"):
        tied.load(path, model)


def _neg(a):
    return -a


def _build(spec, node_spec, arrays):
    """A dict model: at each key an array, one shared dict node, or a `tied.view` of an array."""
    node = {k: arrays[i] for k, i in node_spec}
    kinds = {"a": lambda i: arrays[i], "n": lambda i: node, "v": lambda i: tied.view(arrays[i], _neg)}
    return {k: kinds[kind](i) for k, kind, i in spec}


def _places(spec, node_spec):
    """Every (place as tied prints it, array index), written out by hand."""
    out = []
    for k, kind, i in spec:
        if kind == "a":
            out.append((f"['{k}']", i))
        elif kind == "v":
            out.append((f"['{k}'].source", i))
        else:
            out += [(f"['{k}']['{nk}']", ni) for nk, ni in node_spec]
    return out


def _at(tree, spec, node_spec):
    """(object at each array place, array index), read back by hand."""
    out = []
    for k, kind, i in spec:
        if kind == "a":
            out.append((tree[k], i))
        elif kind == "v":
            out.append((tree[k].source, i))
        else:
            out += [(tree[k][nk], ni) for nk, ni in node_spec]
    return out


@st.composite
def _case(draw):
    n = draw(st.integers(1, 3))
    shapes = [draw(st.integers(1, 3)) for _ in range(n)]
    keys = draw(st.permutations(["p", "q", "r", "s"]))[: draw(st.integers(1, 4))]  # random key order
    node_spec = [
        (k, draw(st.integers(0, n - 1))) for k in draw(st.sampled_from([["w"], ["w", "u"], ["u", "w"]]))
    ]
    spec = [(k, draw(st.sampled_from("anv")), draw(st.integers(0, n - 1))) for k in keys]
    chosen = draw(st.sets(st.sampled_from([p for p, _ in _places(spec, node_spec)])))
    return shapes, spec, node_spec, chosen, draw(st.sampled_from([None, 4, 1000]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=_case())
def test_random_graphs_with_shared_nodes_and_views_round_trip_through_only(tmp_path_factory, c):
    shapes, spec, node_spec, chosen, limit = c
    arrays = [jnp.arange(s, dtype=jnp.float32) + 10 * i + 1 for i, s in enumerate(shapes)]
    bases = [jnp.zeros(s, jnp.float32) - 100 - i for i, s in enumerate(shapes)]
    model, like = _build(spec, node_spec, arrays), _build(spec, node_spec, bases)
    selected = {i for p, i in _places(spec, node_spec) if p in chosen}  # saved if chosen at any place
    folder = tmp_path_factory.mktemp("only")
    path, kw = (folder / "set", {"max_shard_size": limit}) if limit else (folder / "f.safetensors", {})
    if not selected:
        with pytest.raises(tied.CheckpointError, match="selects no array"):
            tied.save(path, model, only=lambda p, a: p in chosen, **kw)
        return
    tied.save(path, model, only=lambda p, a: p in chosen, **kw)
    files = sorted(path.glob("*.safetensors")) if limit else [path]
    held = [v.tobytes() for f in files for v in safetensors.numpy.load_file(f).values()]
    assert sorted(held) == sorted(np.asarray(arrays[i]).tobytes() for i in selected)  # each once
    back = tied.load(path, like)
    objects: dict[int, set[int]] = {}
    for got, i in _at(back, spec, node_spec):
        if i in selected:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(arrays[i]))
        else:
            assert got is bases[i]  # like's own array, as it is
        objects.setdefault(i, set()).add(id(got))
    assert all(len(ids) == 1 for ids in objects.values())  # every tie kept
    for got, i in _at(like, spec, node_spec):
        assert got is bases[i]  # like unchanged
