"""Shared test models and tree helpers, independent of the core walk.

The path walker here is written from scratch (not with `tied`), so tests can use
it as an independent reference for places, paths and sharing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import tied

K = jax.tree_util


@tied.register
class Dense:
    """A plain registered class: ``activation(x @ weight.T + bias)``; the activation is a
    static field (None: none)."""

    def __init__(self, weight, bias, activation=None):
        self.weight = weight
        self.bias = bias
        self.activation = activation

    def __call__(self, x):
        y = x @ tied.materialize(self.weight).T + self.bias
        return y if self.activation is None else self.activation(y)


@tied.register
class Chain:
    """Layers applied in turn, held as a list in ``layers``."""

    def __init__(self, *layers):
        self.layers = list(layers)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def is_param(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _tied_registered(t: type) -> bool:
    """Classes given to tied.register (JAX's registry refuses them: see tied.register)."""
    return t in (Dense, Chain) or getattr(t, "_test_registered", False)


def _is_tuple_like(x: Any) -> bool:
    return isinstance(x, tuple) and type(x) is not tuple and hasattr(type(x), "_fields")


def children(x: Any) -> list[tuple[Any, Any]] | None:
    """``[(key, child), ...]`` for a container (JAX key objects), None for a leaf."""
    if isinstance(x, tied.View):
        return [(K.GetAttrKey("source"), x.source)]
    if type(x) is list or type(x) is tuple:
        return [(K.SequenceKey(i), c) for i, c in enumerate(x)]
    if type(x) is dict:
        return [(K.DictKey(k), x[k]) for k in sorted(x)]
    if _is_tuple_like(x):
        return [(K.GetAttrKey(f), getattr(x, f)) for f in type(x)._fields]
    if _tied_registered(type(x)):
        return [(K.GetAttrKey(k), v) for k, v in vars(x).items()]
    if isinstance(x, jax.Array) or x is None:
        return None
    if K.default_registry.is_node(type(x)):  # Equinox modules, other pytrees: one level
        flat, _ = K.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        return [(p[0], c) for p, c in flat]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(K.GetAttrKey(f.name), getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


def places(tree: Any, *, into_shared: bool = True) -> Iterator[tuple[str, Any]]:
    """Every place of ``tree`` in depth-first order: ``(keystr path, object)``.

    Containers are yielded before their children. With ``into_shared=False`` a
    container already met is yielded again but not entered a second time (the
    tree's DAG); otherwise every place of the unrolled tree is yielded.
    """
    seen: set[int] = set()

    def walk(x: Any, path: tuple) -> Iterator[tuple[str, Any]]:
        yield K.keystr(path), x
        kids = children(x)
        if kids is None:
            return
        if not into_shared:
            if id(x) in seen:
                return
            seen.add(id(x))
        for key, c in kids:
            yield from walk(c, path + (key,))

    yield from walk(tree, ())


def get(tree: Any, path: str) -> Any:
    """The object at a keystr path of ``tree``."""
    for p, x in places(tree):
        if p == path:
            return x
    raise KeyError(path)


def rebuild(tree: Any, leaf: Callable[[str, Any], Any], path: tuple = ()) -> Any:
    """A copy of ``tree`` unrolled: a new container at every place (no sharing kept),
    ``leaf(path, x)`` at every leaf place."""
    kids = children(tree)
    if kids is None:
        return leaf(K.keystr(path), tree)
    new = [rebuild(c, leaf, path + (k,)) for k, c in kids]
    t = type(tree)
    if t is list:
        return new
    if t is tuple:
        return tuple(new)
    if t is dict:
        return {k.key: v for (k, _), v in zip(kids, new)}
    if _is_tuple_like(tree):
        return t(*new)
    if K.default_registry.is_node(t) and not _tied_registered(t):
        return K.tree_unflatten(K.tree_structure(tree, is_leaf=lambda y: y is not tree), new)
    if t is tied.View:
        return tied.View(new[0], tree.fn)
    obj = object.__new__(t)
    for (k, _), v in zip(kids, new):
        object.__setattr__(obj, k.name, v)
    return obj


def untied_copy(tree: Any) -> Any:
    """Each array place gets its own array (a copy), each container place its own node."""
    return rebuild(tree, lambda p, x: jnp.array(x) if is_array(x) else x)


def sharing_groups(tree: Any, pred: Callable[[Any], bool]) -> list[int]:
    """For every place (unrolled walk) whose object satisfies ``pred``, the index of its
    identity class in first-seen order: equal numbers mean the same object."""
    ids: dict[int, int] = {}
    return [ids.setdefault(id(x), len(ids)) for _, x in places(tree) if pred(x)]


def is_node(x: Any) -> bool:
    return children(x) is not None and not isinstance(x, tied.View)


def is_tracked_node(x: Any) -> bool:
    """A node whose identity is sharing: every node but a tuple of static values, which
    is a value (Python reuses `()` and constant tuples, as it reuses small ints)."""
    if not is_node(x):
        return False
    if isinstance(x, tuple):
        return any(is_array(c) or children(c) is not None for _, c in children(x))
    return True


def assert_trees_close(a: Any, b: Any, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Same places, same types, close arrays, equal non-arrays."""
    pa, pb = list(places(a)), list(places(b))
    assert [p for p, _ in pa] == [p for p, _ in pb], "different paths"
    for (path, x), (_, y) in zip(pa, pb):
        assert type(x) is type(y) or (is_array(x) and is_array(y)), (path, type(x), type(y))
        if is_array(x):
            assert x.shape == y.shape, path
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol, err_msg=path)
        elif children(x) is None:
            assert x == y, (path, x, y)


def same_bits(a: Any, b: Any) -> bool:
    """The same dtype, shape and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# Every dtype a checkpoint stores. JAX holds all but the 64-bit ones (unless jax_enable_x64): those
# are tested as numpy arrays only.
DTYPES = [
    ml_dtypes.bfloat16,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint32,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]
DTYPE_CASES = [(np.dtype(d), "numpy") for d in DTYPES] + [
    (np.dtype(d), "jax") for d in DTYPES if jax.dtypes.canonicalize_dtype(d) == np.dtype(d)
]


# ---------------------------------------------------------------- random models


class NT(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class DC:
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class FrozenDC:
    a: Any
    b: Any


@tied.register
class Box:
    """A registered plain class with a constructor that is not a field list."""

    _test_registered = True

    def __init__(self, *items):
        self.a, self.b = items


class EqxPair(eqx.Module):
    a: Any
    b: Any


def _static_fn(x):
    return x


STATICS = (3, "s", None, True, 2.5, _static_fn, jnp.tanh)
SHAPES = ((), (2,), (2, 3))
NODE_KINDS = ("dict", "list", "tuple", "namedtuple", "dataclass", "frozen", "registered", "eqx")


@st.composite
def models(draw, max_depth: int = 4):
    """A random model: nested containers of every kind, with random sharing of arrays
    and of whole nodes (a node met before is reused at a new place)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    arrays: list = []
    nodes: list = []

    def new_float():
        shape = SHAPES[draw(st.integers(0, len(SHAPES) - 1))]
        x = rng.normal(size=shape).astype(np.float32)
        x = x if draw(st.integers(0, 4)) == 0 else jnp.asarray(x)  # some numpy leaves
        arrays.append(x)
        return x

    def leaf():
        if not arrays:
            return new_float()
        choice = draw(st.sampled_from(("new", "new", "shared", "shared", "int", "static")))
        if choice == "new":
            return new_float()
        if choice == "shared":
            return arrays[draw(st.integers(0, len(arrays) - 1))]
        if choice == "int":
            return jnp.arange(3, dtype=jnp.int32)
        return STATICS[draw(st.integers(0, len(STATICS) - 1))]

    def node(depth: int):
        if nodes and draw(st.integers(0, 3)) == 0:
            return nodes[draw(st.integers(0, len(nodes) - 1))]
        kind = draw(st.sampled_from(NODE_KINDS))

        def child():
            if depth >= max_depth or draw(st.integers(0, 2)) == 0:
                return leaf()
            return node(depth + 1)

        if kind in ("dict", "list", "tuple"):
            kids = [child() for _ in range(draw(st.integers(1, 3)))]
            out = {"k" + str(i): c for i, c in enumerate(kids)} if kind == "dict" else kids
            out = tuple(kids) if kind == "tuple" else out
        else:
            a, b = child(), child()
            cls = {"namedtuple": NT, "dataclass": DC, "frozen": FrozenDC, "registered": Box, "eqx": EqxPair}[
                kind
            ]
            out = cls(a, b)
        nodes.append(out)
        return out

    return node(1)


def coefficients(tree: Any) -> dict[str, float]:
    """A distinct coefficient per place (unrolled), so per-place gradients differ."""
    return {p: 1.0 + 0.25 * k for k, (p, _) in enumerate(places(tree))}


def weighted_loss(coefs: dict[str, float]) -> Callable[[Any], Any]:
    """``sum over parameter places p of coefs[p] * sum(sin(x_p))``, by walking paths."""

    def loss(tree):
        total = jnp.zeros(())
        for p, x in places(tree):
            if is_param(x):
                total = total + coefs[p] * jnp.sum(jnp.sin(x))
        return total

    return loss


def reference_partials(tree: Any, coefs: dict[str, float]) -> dict[str, Any]:
    """Per-place gradients from plain `jax.grad` on an untied copy: ``{path: array}``."""
    copy = untied_copy(tree)
    arrs = {p: x for p, x in places(copy) if is_param(x)}
    loss = lambda a: sum((coefs[p] * jnp.sum(jnp.sin(a[p])) for p in a), jnp.zeros(()))
    return jax.grad(loss)(arrs)


def grouped_totals(tree: Any, partials: dict[str, Any]) -> dict[str, Any]:
    """At every parameter place, the sum of the partials over all places of its array."""
    by_id: dict[int, list[str]] = {}
    for p, x in places(tree):
        if is_param(x):
            by_id.setdefault(id(x), []).append(p)
    out = {}
    for ps in by_id.values():
        total = partials[ps[0]]
        for p in ps[1:]:
            total = total + partials[p]
        out.update(dict.fromkeys(ps, total))
    return out


def changing_during_the_call(run: Callable, armed: dict, change: Callable[[], Any]) -> Callable:
    """`tied.jit` of ``run(m, x)`` with a host callback inside the program that calls ``change()``
    once ``armed["on"]`` is set: the model changed while the call runs (which the write-back must
    refuse, writing nothing). ``armed["on"]`` is cleared when the change is made."""

    def callback(_):
        if armed["on"]:
            armed["on"] = False
            change()

    def f(m, x):
        y = run(m, x)
        jax.debug.callback(callback, y)
        return y

    return tied.jit(f)


@tied.register
class RunningNorm:
    """A running mean (a `tied.State`, written by every call) and a scale (a parameter, never
    written by the step): a norm to share between blocks."""

    def __init__(self, n):
        self.scale = jnp.ones(n)
        self.mean = tied.State(jnp.zeros(n))

    def __call__(self, x):
        self.mean.value = 0.9 * self.mean.value + 0.1 * x.mean(0)
        return (x - self.mean.value) * self.scale
