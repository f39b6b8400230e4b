"""Sharding rules written for the layer, optimiser state that follows its parameters, FSDP, and
training that stays sharded: 8 fake CPU devices, in a process of their own.

Run by tests/transforms/test_sharding_rules.py as ``python -m pytest tests/multidevice/rules.py``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The reference for every run is the
same steps on one device, without shardings; every expected spec and shard shape is written
out by hand here (never read from `tied.sharding_tree`).
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

V, D, LAYERS, B, T = 16, 4, 4, 8, 5
MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
FSDP_MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
IDS = np.random.default_rng(0).integers(0, V, (2, B, T)).astype(np.int32)


@tied.register
class Block:
    def __init__(self, key, ln):
        k1, k2 = jax.random.split(key)
        self.qkv = tied.nn.Dense(D, 2 * D, key=k1)  # weight (2D, D)
        self.up = tied.nn.Dense(D, 2 * D, key=k2)  # the same shape, sharded otherwise below
        self.ln = ln  # one LayerNorm for every block: broadcast by the Stack

    def __call__(self, h):
        h = self.ln(h)
        return h + jnp.tanh(self.qkv(h))[..., :D] * jnp.tanh(self.up(h))[..., D:]


@tied.register
class LM:
    def __init__(self, key):
        ks = jax.random.split(key, LAYERS + 1)
        self.embed = tied.nn.Embedding(V, D, key=ks[0])
        ln = tied.nn.LayerNorm(D)
        self.blocks = tied.stack([Block(k, ln) for k in ks[1:]])
        self.head = self.embed  # the tied output head

    def __call__(self, ids):
        h = self.embed(ids)
        h, _ = tied.scan(lambda h, b, _: (b(h), None), h, self.blocks)
        return self.head.attend(h)


def loss_fn(m, ids):
    return optax.softmax_cross_entropy_with_integer_labels(m(ids[:, :-1]), ids[:, 1:]).mean()


def make_step(tx):
    def step(m, s, ids):
        value, g = tied.value_and_grad(loss_fn)(m, ids)
        m, s = tied.optim.update(s, m, g)
        return m, s, value

    return step


def start(tx):
    model = LM(jax.random.key(0))
    return model, tied.optim.setup(tx, model)


def one_device(tx, steps=2):
    model, state = start(tx)
    step = tied.jit(make_step(tx))
    out = []
    for ids in IDS[:steps]:
        model, state, loss = step(model, state, ids)
        out.append((model, state, loss))
    return out


def assert_ties(m):
    assert m.embed is m.head and m.embed.weight is m.head.weight
    assert m.blocks.member.ln is tied.unstack(m.blocks)[3].ln


def assert_close(got, want, **tol):
    (a, ga), (b, gb) = tied.flatten(got), tied.flatten(want)
    assert ga == gb
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


LAYER_RULES = [
    (r"\.qkv\.weight$", P("model", None)),  # written for the layer's (2D, D) weight
    (r"\.up\.weight$", P(None, "model")),  # same shape, the other dimension
    (r"\.embed\.weight$", P("model", None)),  # the head's place is not matched: takes this
]


def test_rules_for_the_layer_gain_the_stack_axis_and_the_tie_takes_the_match():
    model, state = start(optax.sgd(0.1))
    specs = tied.sharding_tree(model, LAYER_RULES, mesh=MESH, stack_axis="data")
    assert specs.blocks.member.qkv.weight == NamedSharding(MESH, P("data", "model", None))
    assert specs.blocks.member.up.weight == NamedSharding(MESH, P("data", None, "model"))
    assert specs.blocks.member.qkv.bias == NamedSharding(MESH, P("data"))  # no rule: only the layer axis
    assert specs.head.weight == specs.embed.weight == NamedSharding(MESH, P("model", None))
    placed = tied.device_put(model, specs)
    assert_ties(placed)
    # The stacked (4, 8, 4) weight: layers split over "data" (2), rows over "model" (4).
    assert shard_shapes(placed.blocks.member.qkv.weight) == {(2, 2, 4)}
    assert shard_shapes(placed.blocks.member.up.weight) == {(2, 8, 1)}
    assert shard_shapes(placed.head.weight) == {(4, 4)}
    assert shard_shapes(placed.blocks.member.ln.weight) == {(4,)}  # broadcast: no stack axis
    assert_close(placed, model, rtol=0, atol=0)
    # Without stack_axis the layer axis stays whole.
    whole = tied.sharding_tree(model, LAYER_RULES, mesh=MESH)
    assert whole.blocks.member.qkv.weight.spec == P(None, "model", None)


def test_conflicting_rules_divisibility_and_a_missing_mesh_are_errors_naming_the_place():
    model, _ = start(optax.sgd(0.1))
    both = [(r"\.head\.weight$", P(None, "model")), (r"\.embed\.weight$", P("model", None))]
    with pytest.raises(
        ValueError,
        match=r"\.embed\.weight and \.head\.weight hold one shared array.*P\('model', None\).* at "
        r"\.embed\.weight and .*P\(None, 'model'\).* at \.head\.weight",
    ):
        tied.sharding_tree(model, both, mesh=MESH)
    with pytest.raises(
        ValueError,
        match=r"\.blocks\.member\.qkv\.weight: dimension 2 of shape \(4, 8, 4\) has size 4, which mesh "
        r"axis \('data', 'model'\) of size 8 does not divide",
    ):  # a dimension of the member, counted in the stacked array
        tied.sharding_tree(model, [(r"qkv\.weight", P(None, ("data", "model")))], mesh=MESH)
    with pytest.raises(
        ValueError, match=r"\.embed\.weight: dimension 1 of shape \(16, 4\) has size 4, which mesh axis "
    ):
        tied.sharding_tree(model, [(r"embed", P(None, ("data", "model")))], mesh=MESH)
    with pytest.raises(ValueError, match=r"the PartitionSpec .* needs a mesh: pass mesh="):
        tied.sharding_tree(model, [(r"embed", P("model"))])
    with pytest.raises(ValueError, match=r"qkv\.weight: the spec .* uses mesh axis 'model' twice"):
        tied.sharding_tree(model, LAYER_RULES, mesh=MESH, stack_axis="model")


def test_optimiser_state_follows_its_parameter_by_path_and_trains_like_one_device():
    tx = optax.adam(1e-2, eps=1e-5)  # eps: see tests/multidevice/sharded.py
    model, state = start(tx)
    ms, ss = tied.sharding_tree((model, state), LAYER_RULES, mesh=MESH, stack_axis="data")
    adam = ss.inner_state[0]
    for path, spec in [
        (".blocks.member.qkv.weight", P("data", "model", None)),
        (".blocks.member.up.weight", P("data", None, "model")),  # same shape, its own sharding
        (".embed.weight", P("model", None)),
        (".blocks.member.qkv.bias", P("data")),  # unmatched: replicated but for the layer axis,
    ]:
        assert adam.mu[path] == adam.nu[path] == NamedSharding(MESH, spec), path
    assert adam.count == NamedSharding(MESH, P())
    model, state = tied.device_put((model, state), (ms, ss))
    rep = NamedSharding(MESH, P())
    step = tied.jit(make_step(tx), in_shardings=(ms, ss, rep), out_shardings=(ms, ss, rep))
    for (ref_m, ref_s, ref_loss), ids in zip(one_device(tx), IDS):
        model, state, loss = step(model, state, ids)
        assert_ties(model)
        assert_close((model, state, loss), (ref_m, ref_s, ref_loss), rtol=1e-4, atol=2e-5)
        mu = state.inner_state[0].mu
        assert shard_shapes(mu[".blocks.member.up.weight"]) == {(2, 8, 1)}
        assert shard_shapes(mu[".blocks.member.qkv.weight"]) == {(2, 2, 4)}


def test_a_state_without_its_model_is_refused():
    model, state = start(optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"the optimiser state at <root> is given without the model"):
        tied.sharding_tree(state, LAYER_RULES, mesh=MESH)


def fsdp_specs(model, state, min_size=32):
    return tied.sharding_tree((model, state), tied.fsdp(min_size=min_size), mesh=FSDP_MESH)


def test_fsdp_splits_the_largest_divisible_dimension_never_the_layer_axis():
    model, state = start(optax.adam(1e-2))
    ms, ss = fsdp_specs(model, state)
    want = {
        ".embed.weight": P("fsdp"),  # (16, 4): 64 elements, rows the largest
        ".blocks.member.qkv.weight": P(None, "fsdp"),  # (4 | 8, 4): the member's 8, not layers
        ".blocks.member.qkv.bias": P(None, "fsdp"),  # (4 | 8): 32 elements in all
        ".blocks.member.ln.weight": P(),  # (4,): under min_size
    }
    got = {
        ".embed.weight": ms.embed.weight,
        ".head.weight": ms.head.weight,
        ".blocks.member.qkv.weight": ms.blocks.member.qkv.weight,
        ".blocks.member.qkv.bias": ms.blocks.member.qkv.bias,
        ".blocks.member.ln.weight": ms.blocks.member.ln.weight,
    }
    want[".head.weight"] = want[".embed.weight"]
    for path, spec in want.items():
        assert got[path] == NamedSharding(FSDP_MESH, spec), path
    assert ss.inner_state[0].mu[".embed.weight"] == NamedSharding(FSDP_MESH, P("fsdp"))
    # The layer axis is never split, even where it is the largest divisible dimension.
    wide = tied.stack([{"w": jnp.ones((2, 4))} for _ in range(8)])  # (8 | 2, 4)
    assert tied.sharding_tree(wide, tied.fsdp(min_size=1), mesh=FSDP_MESH).member["w"].spec == P(
        None, None, "fsdp"
    )


def test_data_times_fsdp_trains_like_one_device_with_a_quarter_of_the_bytes():
    tx = optax.adam(1e-2, eps=1e-5)
    model, state = start(tx)
    ms, ss = fsdp_specs(model, state)
    model, state = tied.device_put((model, state), (ms, ss))
    w = model.embed.weight
    assert [s.data.nbytes for s in w.addressable_shards] == [V * D * 4 // 4] * 8  # split over fsdp
    batch = NamedSharding(FSDP_MESH, P(("data", "fsdp")))  # the batch over both axes
    rep = NamedSharding(FSDP_MESH, P())
    step = tied.jit(make_step(tx), in_shardings=(ms, ss, batch), out_shardings=(ms, ss, rep))
    # Per device, the program's arguments are the shards the shardings say (JAX's shard_shape).
    args = tied.flatten((model, state))[0]
    want = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in args)
    want += B // 8 * T * 4  # the int32 batch, split over all 8 devices
    placed_ids = tied.device_put(IDS[0], batch)
    assert step.lower(model, state, placed_ids).compile().memory_analysis().argument_size_in_bytes == want
    assert want < sum(x.nbytes for x in args)  # less than one copy of everything
    for (ref_m, ref_s, ref_loss), ids in zip(one_device(tx), IDS):
        model, state, loss = step(model, state, tied.device_put(ids, batch))
        assert_ties(model)
        assert_close((model, state, loss), (ref_m, ref_s, ref_loss), rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------- item 4: plain tied.jit


def plain_run(tx):
    model, state = start(tx)
    specs = fsdp_specs(model, state, min_size=64)  # the stacked biases (32 elements) replicated
    model, state = tied.device_put((model, state), specs)
    traces = []
    inner = make_step(tx)

    def step(m, s, ids):
        traces.append(1)
        return inner(m, s, ids)

    f = tied.jit(step)
    batch = NamedSharding(FSDP_MESH, P(("data", "fsdp")))
    given = tied.flatten((model, state))[0]
    outs = []
    for ids in IDS:
        model, state, loss = f(model, state, tied.device_put(ids, batch))
        outs.append((model, state, loss))
    return given, outs, traces, one_device(tx)  # (the one-device run of the same steps)


def test_plain_jit_of_a_placed_model_compiles_once_and_equals_one_device():
    _, outs, traces, ref = plain_run(optax.sgd(0.1))
    assert len(traces) == 1
    for (m, s, loss), want in zip(outs, ref):
        assert_ties(m)
        assert_close((m, s, loss), want, rtol=1e-6, atol=1e-6)


def scan_only_step(m, s, ids):
    """A stack of dense layers between a tied embedding and head (XLA splits its replicated
    biases' updates over the fsdp axis unless told otherwise)."""

    def loss(m):
        h, _ = tied.scan(lambda h, layer, _: (jnp.tanh(layer(h)), None), m["embed"](ids), m["blocks"])
        return optax.softmax_cross_entropy_with_integer_labels(m["head"].attend(h), ids).mean()

    value, g = tied.value_and_grad(loss)(m)
    m, s = tied.optim.update(s, m, g)
    return m, s, value


def test_plain_jit_returns_each_updated_copy_with_its_arguments_shardings():
    emb = tied.nn.Embedding(32, 8, key=jax.random.key(0))
    blocks = tied.stack([tied.nn.Dense(8, 8, key=jax.random.key(i)) for i in range(4)])
    model = {"embed": emb, "blocks": blocks, "head": emb}
    state = tied.optim.setup(optax.adam(1e-2), model)
    specs = tied.sharding_tree((model, state), tied.fsdp(min_size=64), mesh=FSDP_MESH)
    model, state = tied.device_put((model, state), specs)
    ids = tied.device_put(jnp.zeros((8, 4), jnp.int32), NamedSharding(FSDP_MESH, P(("data", "fsdp"))))
    new_m, new_s, _ = tied.jit(scan_only_step)(model, state, ids)
    for x, y in zip(tied.flatten((model, state))[0], tied.flatten((new_m, new_s))[0]):
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (x.sharding, y.sharding)


def test_copy_shardings_finds_each_updated_copy_of_an_argument():
    """What tied.jit must pass for item 4, computed on concrete arrays (identity only)."""
    from tied._transforms.sharding import copy_shardings

    tx = optax.sgd(0.1)
    model, state = start(tx)
    model, state = tied.device_put((model, state), fsdp_specs(model, state))
    new_m, new_s, loss = make_step(tx)(model, state, IDS[0])  # eager: XLA's own layouts
    out = {"m": new_m, "loss": loss, "s": (new_s,)}
    got = copy_shardings((model, state), out)
    out_leaves, out_gdef = tied.flatten(out)
    assert len(got) == len(out_leaves)
    by_leaf = dict(zip(map(id, out_leaves), got))
    for x, y in zip(tied.flatten(model)[0], tied.flatten(new_m)[0]):
        assert by_leaf[id(y)] == x.sharding
    for x, y in zip(tied.flatten(state)[0], tied.flatten(new_s)[0]):
        assert by_leaf[id(y)] == x.sharding
    assert by_leaf[id(loss)] is None  # not a copy of an argument: left to XLA


def test_copy_shardings_at_the_call_site_keeps_the_arguments_shardings():
    """The change tied.jit needs, made by hand inside the step: the same run as the xfail above."""
    from tied._transforms.sharding import copy_shardings

    emb = tied.nn.Embedding(32, 8, key=jax.random.key(0))
    blocks = tied.stack([tied.nn.Dense(8, 8, key=jax.random.key(i)) for i in range(4)])
    model = {"embed": emb, "blocks": blocks, "head": emb}
    state = tied.optim.setup(optax.adam(1e-2), model)
    specs = tied.sharding_tree((model, state), tied.fsdp(min_size=64), mesh=FSDP_MESH)
    model, state = tied.device_put((model, state), specs)
    given = [x.sharding for x in tied.flatten((model, state))[0]]  # the concrete inputs'

    def step(m, s, ids):
        out = scan_only_step(m, s, ids)
        of = dict(zip(map(id, tied.flatten((m, s))[0]), given))  # tracer -> its input's sharding
        leaves, gdef = tied.flatten(out)
        wanted = copy_shardings((m, s, ids), out, lambda x: of.get(id(x)))
        leaves = [x if w is None else jax.lax.with_sharding_constraint(x, w) for x, w in zip(leaves, wanted)]
        return tied.unflatten(gdef, leaves)

    ids = tied.device_put(jnp.zeros((8, 4), jnp.int32), NamedSharding(FSDP_MESH, P(("data", "fsdp"))))
    new_m, new_s, loss = tied.jit(step)(model, state, ids)
    ref_m, ref_s, ref_loss = tied.jit(scan_only_step)(*start_like(model, state), np.zeros((8, 4), np.int32))
    assert new_m["embed"] is new_m["head"]
    for x, y in zip(tied.flatten((model, state))[0], tied.flatten((new_m, new_s))[0]):
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (x.sharding, y.sharding)
    assert_close((new_m, new_s, loss), (ref_m, ref_s, ref_loss), rtol=1e-5, atol=1e-6)


def start_like(model, state):
    """The same model and state on one device (a copy of every array, ties kept)."""
    one = jax.devices()[0]
    return tied.device_put((model, state), one)
