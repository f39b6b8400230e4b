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
