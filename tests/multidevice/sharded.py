"""Several devices: 8 fake CPU devices, in a process of their own.

Run by tests/test_sharding.py as ``python -m pytest tests/multidevice/sharded.py``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set by eight_devices.py too, so the
file also runs on its own); the main test process keeps one device and never
imports this file (its name does not match ``test_*.py``).

The reference for every training run is the same steps on one device, without
shardings; the single-device step is itself checked against plain JAX and a
hand-stepped optax rule in tests/test_optim.py and tests/test_jit.py.
"""

import importlib.util
from pathlib import Path

import eight_devices  # noqa: F401  (first: 8 fake CPU devices, set before JAX is imported)

# isort: split

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tied

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS = 40, 16, 2, 9, 8, 3

# Adam with a larger eps: the attention's key bias has a gradient that is zero up to
# rounding, and Adam's normalised step turns that rounding noise into +-lr, whose sign
# depends on the order of summation (one device or eight). With eps=1e-5 the
# comparison below is about the sharding, not about the sign of noise.
TX = optax.adam(1e-2, eps=1e-5)


@tied.register
class TiedLM:
    """Embedding at the input and as the output head (one Embedding at two places),
    one transformer block applied twice (ALBERT)."""

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = tied.nn.Embedding(VOCAB, DIM, key=k1)
        block = tied.nn.TransformerBlock(DIM, HEADS, key=k2)
        self.blocks = [block, block]
        self.ln = tied.nn.LayerNorm(DIM)
        self.head = self.embed

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head.attend(self.ln(h))


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def train_step(model, state, batch):
    loss, grads = tied.value_and_grad(loss_fn)(model, batch)
    model, state = tied.optim.update(state, model, grads)
    return model, state, loss


BATCHES = np.random.default_rng(1).integers(0, VOCAB, (STEPS, BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def start():
    def init(key):  # one compilation instead of one per eager initialiser
        model = TiedLM(key)
        return tied.Graph((model, tied.optim.setup(TX, model)))

    model, state = jax.jit(init)(jax.random.key(0)).value
    assert_ties(model, state)
    return model, state


@pytest.fixture(scope="module")
def single_device(start):
    """The reference: every step's (model, state, loss) on one device, no shardings."""
    model, state = start
    step = tied.jit(train_step)
    out = []
    for batch in BATCHES:
        model, state, loss = step(model, state, batch)
        out.append((model, state, loss))
    assert {d for x in tied.flatten(out)[0] for d in x.devices()} == {jax.devices()[0]}
    return out


def assert_ties(model, state):
    assert model.embed is model.head
    assert model.embed.weight is model.head.weight
    assert model.blocks[0] is model.blocks[1]
    params = [x for x in tied.flatten(model)[0] if tied.is_param(x)]
    assert len(state.paths) == len(params)  # one optimiser entry per unique parameter
    assert not any(a is p for a in jax.tree_util.tree_leaves(state) for p in params)  # no copies


def assert_close(got, want):
    got_leaves, got_def = tied.flatten(got)
    want_leaves, want_def = tied.flatten(want)
    assert got_def == want_def  # same structure and sharing pattern: nothing duplicated
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)


def test_data_parallel_adam_equals_single_device_and_keeps_ties(start, single_device):
    model, state = start
    dp = tied.data_parallel()
    assert dp.mesh.shape == {"data": 8}
    step = tied.jit(
        train_step,
        in_shardings=(dp.replicated, dp.replicated, dp.batch),
        out_shardings=dp.replicated,
    )
    model, state = tied.device_put((model, state), dp.replicated)
    assert_ties(model, state)
    for k, batch in enumerate(BATCHES):
        batch = tied.device_put(batch, dp.batch)
        assert [s.data.shape for s in batch.addressable_shards] == [(1, SEQ)] * 8
        model, state, loss = step(model, state, batch)
        assert_ties(model, state)
        leaves = tied.flatten((model, state, loss))[0]
        assert all(x.sharding == dp.replicated for x in leaves)  # one sharding per array
        ref_model, ref_state, ref_loss = single_device[k]
        assert_close((model, state, loss), (ref_model, ref_state, ref_loss))


def test_vocab_sharded_tied_embedding_is_stored_once_and_trains_like_one_device(start, single_device):
    model, state = start
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rep = NamedSharding(mesh, P())
    vocab = NamedSharding(mesh, P("model", None))

    def rule(path, x):  # the embedding, its Adam moments: rows split over the 8 devices
        return vocab if x.shape == (VOCAB, DIM) else rep

    model_specs, state_specs = tied.sharding_tree((model, state), rule)
    model, state = tied.device_put((model, state), (model_specs, state_specs))
    step = tied.jit(
        train_step,
        in_shardings=(model_specs, state_specs, rep),
        out_shardings=(model_specs, state_specs, rep),
    )
    for k, batch in enumerate(BATCHES):
        model, state, loss = step(model, state, batch)
        assert_ties(model, state)
        w = model.embed.weight
        assert w.sharding == vocab
        assert [s.data.shape for s in w.addressable_shards] == [(VOCAB // 8, DIM)] * 8
        # Input table and output head are one array, split by rows: one copy over all devices.
        assert sum(s.data.nbytes for s in w.addressable_shards) == w.nbytes == VOCAB * DIM * 4
        moments = [x for x in tied.flatten(state.inner_state)[0] if x.shape == (VOCAB, DIM)]
        assert len(moments) == 2 and all(m.sharding == vocab for m in moments)
        others = [x for x in tied.flatten((model, state))[0] if x.shape != (VOCAB, DIM)]
        assert all(x.sharding == rep for x in others)
        assert_close((model, state, loss), single_device[k])


def test_conflicting_shardings_for_the_shared_embedding_name_both_paths(start):
    model, state = start
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rep = NamedSharding(mesh, P())
    vocab = NamedSharding(mesh, P("model", None))
    only_input = tied.sharding_tree(model, lambda path, x: vocab if path == ".embed.weight" else rep)
    with pytest.raises(ValueError, match=r"\.embed\.weight and \.head\.weight hold one shared array"):
        tied.device_put(model, only_input)
    # Across arguments: one model passed twice, each time with another sharding.
    twice = tied.jit(
        lambda a, b: a,
        in_shardings=(tied.sharding_tree(model, lambda p, x: vocab if x.shape == (VOCAB, DIM) else rep), rep),
    )
    with pytest.raises(ValueError, match=r"args\[0\]\.embed\.weight and args\[1\]\.embed\.weight hold"):
        twice(model, model)


def test_committed_input_placed_otherwise_names_its_path(start):
    model, state = start
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rep = NamedSharding(mesh, P())
    vocab = NamedSharding(mesh, P("model", None))
    placed = tied.device_put(model, rep)
    want = tied.sharding_tree(model, lambda p, x: vocab if x.shape == (VOCAB, DIM) else rep)
    f = tied.jit(lambda m: m.head.weight * 2, in_shardings=(want,))
    with pytest.raises(ValueError, match=r"input at args\[0\]\.embed\.weight is already placed"):
        f(placed)
    out = f(tied.device_put(placed, want))  # placed as asked: runs, output laid out by XLA
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(model.embed.weight))


def test_out_shardings_lay_out_a_shared_output_once():
    mesh = Mesh(np.array(jax.devices()), ("model",))
    vocab = NamedSharding(mesh, P("model", None))
    w = jnp.arange(VOCAB * DIM, dtype=jnp.float32).reshape(VOCAB, DIM)
    f = tied.jit(
        lambda w: (lambda y: {"in": y, "out": y, "n": w.sum()})(w + 1),
        out_shardings={"in": vocab, "out": None, "n": None},
    )
    out = f(w)
    assert out["in"] is out["out"]  # one buffer, at both places
    assert out["in"].sharding.is_equivalent_to(vocab, 2)
    assert [s.data.shape for s in out["in"].addressable_shards] == [(VOCAB // 8, DIM)] * 8
    np.testing.assert_array_equal(np.asarray(out["in"]), np.asarray(w) + 1)


def test_example_data_parallel_on_eight_devices():
    path = Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
    spec = importlib.util.spec_from_file_location("example_data_parallel", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    r = example.main(steps=3, verbose=False)
    assert r["devices"] == 8 and r["ok"]
    assert r["dp_ties"] and r["vs_ties"]
    assert r["dp_diff"] < 1e-4 and r["vs_diff"] < 1e-4
    assert r["shard_bytes"] == r["one_copy_bytes"] == 64 * 32 * 4 and r["shard_shape"] == (8, 32)
    assert r["dp_loss"] < r["first_loss"]
