"""Orbax checkpoints of sharded arrays: 8 fake CPU devices, in a process of their own.

Run by tests/checkpoint/test_orbax.py as ``python -m pytest tests/multidevice/orbax_devices.py``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set by eight_devices.py too, so the
file also runs on its own); never collected by the main test run (the name does not match
``test_*.py``).

The references are independent of the Orbax format: the arrays saved (read to the
host with numpy), the same tree saved as one safetensors file, and the same training
steps run without a checkpoint in between.
"""

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

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 16, 2, 8, 9
TX = optax.adam(1e-2, eps=1e-5)
MESH = Mesh(np.array(jax.devices()), ("x",))
MESH_2D = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
REP = NamedSharding(MESH, P())
ROWS = NamedSharding(MESH, P("x", None))


@tied.register
class TiedLM:
    """The embedding at the input and as the output head (one Embedding at two places),
    one transformer block at two places (ALBERT)."""

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


def init(key):
    model = TiedLM(key)
    return tied.Graph((model, tied.optim.setup(TX, model)))


def rule(path, x):  # the tied embedding and its Adam moments by rows, the rest replicated
    return ROWS if x.shape == (VOCAB, DIM) else REP


def abstract_like(rule):
    """(model, state) as ShapeDtypeStructs with shardings: jax.eval_shape, nothing built."""
    abstract = jax.eval_shape(init, jax.random.key(1)).value
    leaves, gdef = tied.flatten(abstract)
    shardings = [rule(ps[0], x) for x, ps in zip(leaves, gdef.leaf_paths())]
    return tied.unflatten(
        gdef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)]
    )


BATCHES = np.random.default_rng(3).integers(0, VOCAB, (4, BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def trained():
    """(model, state) after 2 steps, the embedding split by rows over 8 devices; and the step."""
    model, state = jax.jit(init)(jax.random.key(0)).value
    specs = tied.sharding_tree((model, state), rule)
    model, state = tied.device_put((model, state), specs)
    step = tied.jit(train_step, in_shardings=(*specs, REP), out_shardings=(*specs, REP))
    for batch in BATCHES[:2]:
        model, state, _ = step(model, state, batch)
    return model, state, step


def assert_ties(model, state):
    assert model.embed is model.head and model.embed.weight is model.head.weight
    assert model.blocks[0] is model.blocks[1]
    mu = state.inner_state[0].mu
    assert set(mu) == {s.path for s in state.spec}  # one Adam moment per unique parameter
    assert all(x.shape == (VOCAB, DIM) for k, x in mu.items() if k in (".embed.weight", ".head.weight"))


def host(tree):
    return [np.asarray(x) for x in tied.flatten(tree)[0]]


def test_sharded_round_trip_onto_an_abstract_like(trained, tmp_path):
    model, state, _ = trained
    w = model.embed.weight
    assert w.sharding == ROWS and len({s.device for s in w.addressable_shards}) == 8
    tied.save(tmp_path / "ckpt", (model, state), {"step": 2}, format="orbax")
    like = abstract_like(rule)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in tied.flatten(like)[0])
    back_model, back_state = tied.load(tmp_path / "ckpt", like)
    assert_ties(back_model, back_state)
    for x, want, leaf in zip(
        tied.flatten((back_model, back_state))[0], host((model, state)), tied.flatten(like)[0]
    ):
        assert isinstance(x, jax.Array) and x.sharding == leaf.sharding
        np.testing.assert_array_equal(np.asarray(x), want)  # bit for bit
    # Each device holds its rows only: the embedding is stored once over the 8 devices.
    w2 = back_model.embed.weight
    assert [s.data.shape for s in w2.addressable_shards] == [(VOCAB // 8, DIM)] * 8
    assert tied.load_metadata(tmp_path / "ckpt") == {"step": 2}


def test_restore_onto_other_shardings_and_against_the_single_file(trained, tmp_path):
    """Saved split by rows over 8 devices, restored split by columns over a 2x4 mesh (and replicated)."""
    model, state, _ = trained
    tied.save(tmp_path / "ckpt", (model, state), format="orbax")
    tied.save(tmp_path / "one.safetensors", (model, state))  # one process holds it all here
    cols = NamedSharding(MESH_2D, P(None, "model"))
    rep2 = NamedSharding(MESH_2D, P())
    like = abstract_like(lambda p, x: cols if x.shape == (VOCAB, DIM) else rep2)
    back = tied.load(tmp_path / "ckpt", like)
    single = tied.load(tmp_path / "one.safetensors", like)
    assert_ties(*back)
    assert back[0].embed.weight.sharding == cols
    assert [s.data.shape for s in back[0].embed.weight.addressable_shards] == [(VOCAB, DIM // 4)] * 8
    for a, b, want in zip(host(back), host(single), host((model, state))):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
    # A concrete like (arrays on one device, uncommitted) gives arrays placed as the single file does.
    concrete = jax.jit(init)(jax.random.key(5)).value
    got = tied.load(tmp_path / "ckpt", concrete)
    assert_ties(*got)
    for a, want in zip(host(got), host((model, state))):
        np.testing.assert_array_equal(a, want)


def test_resume_after_restore_matches_an_uninterrupted_run_bit_for_bit(trained, tmp_path):
    model, state, step = trained
    tied.save(tmp_path / "ckpt", (model, state), format="orbax")
    m2, s2 = tied.load(tmp_path / "ckpt", abstract_like(rule))
    for batch in BATCHES[2:]:
        model, state, loss = step(model, state, batch)
        m2, s2, loss2 = step(m2, s2, batch)
        assert_ties(m2, s2)
        assert float(loss) == float(loss2)
    for a, b in zip(host((model, state)), host((m2, s2))):
        np.testing.assert_array_equal(a, b)


def test_a_sharding_that_does_not_fit_names_the_path(tmp_path):
    w = jnp.arange(12.0 * 4).reshape(12, 4)  # 12 rows do not split over 8 devices
    tree = {"embed": w, "head": w, "b": jnp.ones(8)}
    tied.save(tmp_path / "ckpt", tree, format="orbax")
    bad = {"embed": jax.ShapeDtypeStruct((12, 4), jnp.float32, sharding=ROWS)}
    bad["head"] = bad["embed"]
    bad["b"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(MESH, P("x")))
    with pytest.raises(
        tied.CheckpointError,
        match=r"sharding of like at \['embed'\] does not fit the saved "
        r"array of shape \(12, 4\).*evenly divide",
    ):
        tied.load(tmp_path / "ckpt", bad)
    # The 2x4 mesh splits 12 rows 2 ways: that fits, and the tie comes back.
    ok = jax.ShapeDtypeStruct((12, 4), jnp.float32, sharding=NamedSharding(MESH_2D, P("data")))
    back = tied.load(tmp_path / "ckpt", {"embed": ok, "head": ok, "b": bad["b"]})
    assert back["embed"] is back["head"]
    np.testing.assert_array_equal(np.asarray(back["embed"]), np.asarray(w))
    # A mesh axis the mesh does not have: JAX refuses to build such a sharding at all.
    with pytest.raises(ValueError, match="not found in mesh"):
        NamedSharding(MESH, P("model"))
