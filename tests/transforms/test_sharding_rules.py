"""Sharding rules by pattern (`tied.sharding_tree` with (pattern, spec) pairs) and `tied.fsdp`.

This process keeps one device, so the meshes here have axes of size 1 (a spec that differs is
still a conflict there). The checks on 8 fake CPU devices (divisibility, FSDP's bytes, training
against one device) run in tests/multidevice/rules.py, started by `test_eight_fake_devices`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from processes import pytest_on_fake_devices

import tied

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def named(*spec):
    return NamedSharding(MESH, P(*spec))


def test_eight_fake_devices():
    """tests/multidevice/rules.py under 8 fake CPU devices, in its own process."""
    code, report = pytest_on_fake_devices("tests/multidevice/rules.py")
    assert code == 0, report
    assert "10 passed" in report and "xfail" not in report, report


def lm():
    emb = tied.nn.Embedding(6, 4, key=jax.random.key(0))
    ln = tied.nn.LayerNorm(4)
    keys = jax.random.split(jax.random.key(1), 3)
    blocks = tied.stack([{"attn": {"qkv": tied.nn.Dense(4, 12, key=k)}, "ln": ln} for k in keys])
    return {"embed": emb, "blocks": blocks, "head": emb, "ln": ln}


def test_first_matching_rule_wins_on_the_full_path_and_the_rest_is_replicated():
    m = lm()
    rules = [
        (r"\['qkv'\]\.weight$", P(None, "model")),  # the layer's (12, 4) weight
        (r"qkv", P("model")),  # not reached for the weight: the first match wins
        (r"^\['embed'\]", named("model", None)),
    ]
    specs = tied.sharding_tree(m, rules, mesh=MESH, stack_axis="data")
    assert specs["blocks"].member["attn"]["qkv"].weight == named("data", None, "model")
    assert specs["blocks"].member["attn"]["qkv"].bias == named("data", "model")
    assert specs["head"].weight == named("model", None)  # the head's place takes the embed's match
    assert specs["ln"].weight == specs["blocks"].member["ln"].weight == named()  # broadcast, no rule
    placed = tied.device_put(m, specs)
    assert placed["embed"] is placed["head"] and placed["ln"] is placed["blocks"].member["ln"]
    assert placed["blocks"].member["attn"]["qkv"].weight.sharding == named("data", None, "model")


def test_nested_stacks_get_the_stack_axis_once():
    inner = [tied.stack([{"w": jnp.ones((2, 3)) * i} for i in range(2)]) for _ in range(3)]
    outer = tied.stack(inner)
    specs = tied.sharding_tree(outer, [("w", P(None, "model"))], mesh=MESH, stack_axis="data")
    assert outer.member.member["w"].shape == (3, 2, 2, 3)
    assert specs.member.member["w"] == named("data", None, None, "model")


def test_the_function_form_keeps_its_meaning():
    m = lm()
    seen = []
    specs = tied.sharding_tree(m, lambda p, x: seen.append((p, x.shape)) or P("model"), mesh=MESH)
    assert ("['blocks'].member['attn']['qkv'].weight", (3, 12, 4)) in seen  # the stacked array as it is
    assert specs["blocks"].member["attn"]["qkv"].weight == named("model")  # no stack axis added
    assert tied.sharding_tree(m, lambda p, x: None)["embed"].weight is None


def test_two_places_given_two_specs_name_both_places_and_specs():
    m = lm()
    with pytest.raises(
        ValueError,
        match=r"\['embed'\]\.weight and \['head'\]\.weight hold one shared array, but the rules give it two "
        r"different specs: .*P\('model', None\).* at \['embed'\]\.weight and .*P\(None, 'model'\).* at "
        r"\['head'\]\.weight",
    ):
        tied.sharding_tree(m, [("embed", P("model", None)), ("head", P(None, "model"))], mesh=MESH)
    # The same spec written two ways is one sharding.
    same = tied.sharding_tree(m, [("embed", P("model", None)), ("head", P("model"))], mesh=MESH)
    assert same["head"].weight.spec == P("model", None)


def test_bad_rules_are_errors_naming_what_to_fix():
    m = lm()
    with pytest.raises(ValueError, match=r"the PartitionSpec P\('model',\), which needs a mesh: pass mesh="):
        tied.sharding_tree(m, [("embed", P("model"))])
    with pytest.raises(ValueError, match=r"rules\[1\] is 'x', not a \(pattern, spec\) pair"):
        tied.sharding_tree(m, [("embed", P()), "x"], mesh=MESH)
    with pytest.raises(ValueError, match=r"rules\[0\]: the pattern '\(' is not a regular expression"):
        tied.sharding_tree(m, [("(", P())], mesh=MESH)
    with pytest.raises(ValueError, match=r"rules\[0\] \('embed'\) has spec 3: expected a PartitionSpec"):
        tied.sharding_tree(m, [("embed", 3)], mesh=MESH)
    with pytest.raises(ValueError, match=r"\['embed'\]\.weight: the spec names mesh axis 'fsdp'"):
        tied.sharding_tree(m, [("embed", P("fsdp"))], mesh=MESH)
    with pytest.raises(
        ValueError, match=r"\['embed'\]\.weight: the spec P\(None, None, 'model'\) has 3 entries"
    ):
        tied.sharding_tree(m, [("embed", P(None, None, "model"))], mesh=MESH)
    with pytest.raises(ValueError, match=r"no rule matches .* so it is replicated, which needs a mesh"):
        tied.sharding_tree(m, [])
    with pytest.raises(ValueError, match=r"tied.fsdp: the mesh has axes \('data', 'model'\), not 'fsdp'"):
        tied.sharding_tree(m, tied.fsdp(), mesh=MESH)


def test_optimiser_state_follows_its_parameter_by_path_not_by_shape():
    a = tied.nn.Dense(4, 4, key=jax.random.key(0))
    b = tied.nn.Dense(4, 4, key=jax.random.key(1))  # the same shapes as a
    model = {"a": a, "b": b, "again": a}
    state = tied.optim.setup(optax.adam(1e-3), model)
    rules = [(r"\['a'\]\.weight", P("model", None)), (r"\['b'\]\.weight", P(None, "model"))]
    ms, ss = tied.sharding_tree((model, state), rules, mesh=MESH)
    adam = ss.inner_state[0]
    assert adam.mu["['a'].weight"] == adam.nu["['a'].weight"] == named("model", None)
    assert adam.mu["['b'].weight"] == adam.nu["['b'].weight"] == named(None, "model")
    assert adam.mu["['a'].bias"] == adam.count == named()
    assert ms["again"].weight == named("model", None)
    model2, state2 = tied.device_put((model, state), (ms, ss))
    assert model2["a"] is model2["again"]
    assert state2.inner_state[0].mu["['b'].weight"].sharding == named(None, "model")


def test_fsdp_rules_on_one_device():
    m = lm()
    rules = tied.fsdp("model", min_size=24)
    assert rules[0][0] == "" and "fsdp('model', min_size=24)" in repr(rules)
    specs = tied.sharding_tree(m, rules, mesh=MESH)
    assert specs["embed"].weight == named("model")  # (6, 4): the rows, the largest
    assert specs["blocks"].member["attn"]["qkv"].weight == named(None, "model")  # the member's 12
    assert specs["ln"].weight == named()  # 4 elements
    with pytest.raises(ValueError, match=r"tied.fsdp: axis is a mesh axis name"):
        tied.fsdp(("data", "model"))


def test_the_moments_of_an_unmatched_stacked_parameter_keep_its_layer_axis():
    m = lm()
    state = tied.optim.setup(optax.adam(1e-3), m)
    _, ss = tied.sharding_tree((m, state), [("embed", P("model"))], mesh=MESH, stack_axis="data")
    adam = ss.inner_state[0]
    assert adam.mu["['blocks'].member['attn']['qkv'].bias"] == named("data")  # as the parameter
    assert adam.nu["['embed'].weight"] == named("model") and adam.count == named()
