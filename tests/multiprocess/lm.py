"""The model, optimiser, step and data of the multi-process test, shared by the worker and the test.

`TiedLM` is the model of examples/tied_lm.py: its output head is ``Dense(embed.weight)``,
the embedding's own array. Importing this module starts no JAX backend.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import optax

import tied

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("examples_tied_lm_mp", ROOT / "examples" / "tied_lm.py")
tied_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tied_lm)

VOCAB, BATCH = 64, 16  # 8 vocabulary rows and 2 batch rows per device of 8
DIM, SEQ = tied_lm.DIM, tied_lm.SEQ
# Adam's eps raised from 1e-8, as in tests/multidevice/sharded.py: a gradient that is zero
# up to rounding (the attention's key bias) would otherwise be stepped by +-lr with a sign
# set by the order of the all-reduce, which is not what this test is about.
TX = optax.adam(1e-2, eps=1e-5)


def init(key):
    """The model and its Adam state, as one `tied.Graph` (one jit, or one eval_shape)."""
    model = tied_lm.TiedLM(VOCAB, key=key)
    return tied.Graph((model, tied.optim.setup(TX, model)))


def train_step(model, state, batch):
    loss, grads = tied.value_and_grad(tied_lm.loss_fn)(model, batch[:, :-1], batch[:, 1:])
    model, state = tied.optim.update(state, model, grads)
    return model, state, loss


def batches(steps: int) -> np.ndarray:
    """The global batches, the same on every process (each takes its own rows)."""
    return np.random.default_rng(7).integers(0, VOCAB, (steps, BATCH, SEQ + 1)).astype(np.int32)


def check_ties(model, state) -> None:
    """The tie holds (``is``) and the Adam state has one entry per unique parameter."""
    assert model.head.weight is model.embed.weight
    leaves, gdef = tied.flatten(model)
    params = {ps[0]: x.shape for x, ps in zip(leaves, gdef.leaf_paths()) if tied.is_param(x)}
    mu = state.inner_state[0].mu  # Adam's first moments, keyed by each parameter's first path
    assert {k: m.shape for k, m in mu.items()} == params and ".head.weight" not in mu


def abstract_like(rule):
    """(model, state) as ShapeDtypeStructs, each unique one with ``rule(first path, x)`` as its
    sharding: from `jax.eval_shape`, so nothing is built."""
    import jax

    abstract = jax.eval_shape(init, jax.random.key(1)).value  # any key: values come from the file
    leaves, gdef = tied.flatten(abstract)
    shardings = [rule(paths[0], x) for x, paths in zip(leaves, gdef.leaf_paths())]
    return tied.unflatten(
        gdef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)]
    )
