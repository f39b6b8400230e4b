"""Dropout and modes: `Dropout` (drawing from a `tied.Rng`, Flax NNX's mask) and `mode`, which sets every
``training`` flag of a model, and the flags of Flax NNX and Equinox modules as their libraries set them."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import Places, Rng, flatten, get, put, rebuild
from .._tree import register


@register
class Dropout:
    """Inverted dropout drawing from a `tied.Rng`: identity in eval mode.

    In training mode each call draws one key from ``rng`` and keeps ``x`` where
    ``jax.random.bernoulli(key, 1 - rate, x.shape)``, divided by ``1 - rate`` (Flax
    NNX's mask); elsewhere it is zero. In eval mode it returns ``x`` and draws
    nothing (the stream does not advance). One `tied.Rng` given to several layers is
    one stream: each call takes the next key.

    Args:
        rate: the probability of dropping a value, in ``[0, 1]``.
        rng: the random stream, a `tied.Rng`.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> rng = tied.Rng(0)
        >>> d1, d2 = tied.nn.Dropout(0.5, rng), tied.nn.Dropout(0.5, rng)   # one stream
        >>> y = d2(d1(jnp.ones(1000)))
        >>> sorted(set(y.tolist())), int(rng.count.value)     # dropped, or kept times 2 twice
        ([0.0, 4.0], 2)
        >>> tied.nn.mode(d1, training=False)(jnp.ones(3)), int(rng.count.value)
        (Array([1., 1., 1.], dtype=float32), 2)
    """

    rate: float
    rng: Rng
    training: bool

    def __init__(self, rate: float, rng: Rng):
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
            raise TypeError(f"Dropout: rate must be a number in [0, 1], got {rate!r}.")
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"Dropout: rate must be in [0, 1], got {rate!r}.")
        if not isinstance(rng, Rng):
            raise TypeError(
                f"Dropout(rate, rng): rng must be a tied.Rng, got {type(rng).__name__}. Pass a "
                "stream, e.g. Dropout(0.1, tied.Rng(0)); give the same Rng to several layers for "
                "one stream."
            )
        self.rate = float(rate)
        self.rng = rng
        self.training = True

    def __call__(self, x: Any) -> Any:
        if not self.training or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.rng(), keep, x.shape)
        return jax.lax.select(mask, x / keep, jnp.zeros_like(x))


_TRAINING = jax.tree_util.GetAttrKey("training")


_INFERENCE = jax.tree_util.GetAttrKey("inference")  # Equinox's flag: True in eval mode


_NNX_FLAGS = ("deterministic", "use_running_average")  # Flax NNX's: True in eval mode


def mode(model: Any, training: bool) -> Any:
    """The model with every ``training`` flag set: train mode (True) or eval mode (False).

    Returns the same graph: every array and every state object (`tied.State`,
    `tied.Rng`, a `KVCache`) is the input's own object, so running either model
    updates the same statistics and streams, and ties are kept. Only the layers that
    hold a ``training`` flag (and the containers above them) are new objects; a model
    without flags, or already in that mode, is returned as it is. The flag is static,
    so each mode compiles once under `tied.jit`.

    Other libraries' layers get their own flags, set as their own functions set them:
    a Flax NNX module's ``deterministic`` and ``use_running_average`` (``True`` in
    eval mode, as ``model.eval()`` sets them, ``False`` as ``model.train()`` does), and
    an Equinox module's ``inference`` (as ``eqx.nn.inference_mode`` sets it). Those
    modules are fresh copies too (the caller's NNX model is not switched in place, as
    ``.eval()`` would), holding the caller's own Variables and arrays.

    Args:
        model: any graph; every object attribute named ``training`` holding a bool is set,
            and the NNX and Equinox flags above.
        training: True for train mode, False for eval mode.

    Returns:
        The model in that mode.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> bn = tied.nn.BatchNorm(2)
        >>> net = tied.nn.Chain(tied.nn.Dense(2, 2, key=jax.random.key(0)), bn, bn)   # one norm, twice
        >>> ev = tied.nn.mode(net, training=False)
        >>> ev[1].training, ev[1] is ev[2], net[1].training
        (False, True, True)
        >>> ev[1].running_mean is bn.running_mean, ev[0] is net[0]    # state and arrays shared
        (True, True)
    """
    if not isinstance(training, bool):
        raise TypeError(f"tied.nn.mode(model, training): training must be a bool, got {training!r}.")
    leaves, gdef = flatten(model)
    statics = list(gdef.statics)
    flagged = [False] * gdef.num_nodes  # nodes with a training flag at or below them
    cells = gdef.state_nodes()
    edges = []
    changed = False
    root = None
    eqx_module = _foreign("equinox", "Module")
    node_type: dict[int, type] = {}
    for place in gdef.walk_places(paths=False):  # each place's container: Place.parent and key
        parent = place.parent
        if place.kind == "static":
            if parent >= 0 and isinstance(place.value, bool) and not cells[parent]:
                want = _flag(place.key, node_type.get(parent), eqx_module, training)
                if want is not None:
                    flagged[parent] = True
                    changed |= place.value != want
                    statics[place.index] = want
        elif place.kind != "array":
            node_type[place.index] = place.type
            if parent < 0:
                root = place.index
            else:
                edges.append((parent, place.index))
    if root is None:
        return model
    places = Places(gdef)
    nnx_flags = _nnx_flags(model, places, node_type)
    for path, attrs in nnx_flags.items():
        flagged[places.index[path]] = True
        changed |= any(v != (not training) for v in attrs.values())
    if not changed:
        return model
    grew = True
    while grew:  # up to every container above a flag, through shared nodes and cycles
        grew = False
        for p, c in edges:
            if flagged[c] and not flagged[p]:
                flagged[p] = grew = True
    fresh = rebuild(gdef, leaves, statics=tuple(statics))
    # Everything without a flag below it goes back as the input's own object: state
    # cells, streams and untouched layers stay shared with the caller's model.
    for path in places.nodes():
        steps = places.steps[path]
        if not steps or flagged[places.index[path]] or not flagged[places.index["".join(steps[:-1])]]:
            continue
        fresh = put(fresh, steps, get(model, steps, places), places)
    for path, attrs in nnx_flags.items():
        # NNX keeps its flags in the module (pytree metadata, not children): set them as
        # ``model.eval()`` / ``model.train()`` do, on this fresh copy only (never the caller's).
        layer = get(fresh, places.steps[path], places)
        for name in attrs:
            setattr(layer, name, not training)
    return fresh


def _foreign(module: str, name: str) -> type | None:
    """A class of another library, if that library is imported (never imported here)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _flag(key: Any, owner: type | None, eqx_module: type | None, training: bool) -> bool | None:
    """The value `mode` gives a bool at ``key`` of a node of type ``owner``, or None (not a flag):
    ``training`` (tied's layers), or Equinox's ``inference`` (as ``eqx.nn.inference_mode`` sets it)."""
    if key == _TRAINING:
        return training
    if key == _INFERENCE and owner is not None and eqx_module is not None and issubclass(owner, eqx_module):
        return not training
    return None


def _nnx_flags(model: Any, places: Places, node_type: dict[int, type]) -> dict[str, dict[str, Any]]:
    """The Flax NNX modules of ``model`` holding ``deterministic`` or ``use_running_average`` (the
    flags ``nnx.Module.eval`` and ``train`` set): ``{path: {name: value}}``, each module once."""
    nnx_module = _foreign("flax.nnx", "Module")
    if nnx_module is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for path in places.nodes():
        i = places.index[path]
        t = node_type.get(i)
        if i in seen or t is None or not issubclass(t, nnx_module):
            continue
        seen.add(i)
        fields = vars(get(model, places.steps[path], places))
        attrs = {name: fields[name] for name in _NNX_FLAGS if name in fields}
        if attrs:
            out[path] = attrs
    return out
