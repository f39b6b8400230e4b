"""LoRA: low-rank adapters at chosen places of a (tied) model; `lora`, `adapters` and `merge`.

A `LoRA` holds its base layer by reference, so the base stays the very object it was at
every other place: an adapter on the head place of an embedding used as the head adapts the
head, and the lookup stays the bare embedding. `lora` puts adapters at the places a ``where``
selects (one place of a shared layer changes, never its other places), `adapters` is the
``trainable=`` predicate that trains them alone, and `merge` folds them into their bases,
cutting a tie at the merged places only.

Places come from the core walk (`GraphDef.walk_places`, `Places`); a place under a
`tied.Stack`'s member is adapted by unstacking, wrapping each member and restacking
(`tied.unstack`, `tied.stack`), so the Stack's layout stays true.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import GraphError, Places, flatten, get, materialize, put, unflatten, where
from .._transforms import Stack, stack, unstack
from .._tree import register
from ._dense import Dense, Embedding

__all__ = ["LoRA", "adapters", "lora", "merge"]

_ADAPTABLE = (Dense, Embedding)


def _refusal(who: str, place: str | None, base: Any) -> ValueError:
    at = f"{where(place)} holds" if place is not None else "base is"
    return ValueError(
        f"{who}: {at} a {type(base).__module__}.{type(base).__qualname__}, which LoRA cannot adapt: "
        "a LoRA adapts a linear map, a tied.nn.Dense or the head use (.attend) of a tied.nn.Embedding. "
        "Select the Dense layers inside it (their places, or a predicate such as "
        "lambda path, layer: path.endswith('.qkv'))."
    )


def _sizes(base: Any) -> tuple[int, int]:
    """``(in, out)`` of the linear map a LoRA adapts: a Dense's ``x @ W.T``, an Embedding's ``attend``."""
    out_size, in_size = tuple(base.weight.shape)[-2:]
    return int(in_size), int(out_size)


def _check(who: str, place: str | None, base: Any, rank: Any, alpha: Any, stacked: int = 0) -> None:
    """Refuse a base LoRA cannot adapt or a rank out of range (``stacked``: how many Stacks' members
    the layer lies below; its weight may carry one leading axis for each)."""
    if not isinstance(base, _ADAPTABLE):
        raise _refusal(who, place, base)
    ndim = len(tuple(base.weight.shape))
    if not 2 <= ndim <= 2 + stacked:  # a stacked layer's weight, or a broadcast one's
        raise ValueError(
            f"{who}: {where(place) if place is not None else 'the base'} has a weight of shape "
            f"{tuple(base.weight.shape)}; a LoRA adapts a (out, in) weight. A layer of a tied.Stack "
            "is adapted through its place below the Stack's member (tied.nn.lora(model, "
            "\"['blocks'].member.attn.qkv\", rank, key=...)), which gives stacked adapters."
        )
    n_in, n_out = _sizes(base)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= min(n_in, n_out):
        at = f" at {where(place)}" if place is not None else ""
        raise ValueError(
            f"{who}: rank must be an int from 1 to min(in, out) = {min(n_in, n_out)} for the "
            f"{type(base).__name__}{at} (in {n_in}, out {n_out}), got {rank!r}."
        )
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise TypeError(f"{who}: alpha must be a number or None (None means alpha = rank), got {alpha!r}.")


@register
class LoRA:
    """A low-rank adapter around a layer: ``base(x) + (alpha / rank) * (x @ lora_A.T) @ lora_B.T``.

    ``base`` is held by reference: it stays the very object it is at every other place of
    the model, so only the place holding the `LoRA` is adapted. ``lora_A`` (``(rank, in)``)
    starts as peft's default does (Kaiming uniform with ``a = sqrt(5)``, as PyTorch's
    ``nn.Linear``: uniform in ``±1/sqrt(in)``) and ``lora_B`` (``(out, rank)``) at zeros, so
    a new adapter changes nothing until trained.

    The base is a `Dense` (an activation is applied after the adapted linear map) or an
    `Embedding` used as the head: then `attend` is adapted, and calling the `LoRA` as a lookup
    is an error (the lookup place should hold the bare embedding). The base is called as it
    is (``base(x)``, ``base.attend(h)``), so a base whose weight is a view (a transpose, a
    quantized table) is read as its own layer reads it.

    Args:
        base: a `tied.nn.Dense` or `tied.nn.Embedding`.
        rank: the adapter's rank, from 1 to ``min(in, out)``.
        alpha: the scale's numerator (``alpha / rank``); None means ``alpha = rank`` (scale 1).
        key: a JAX PRNG key for ``lora_A``.

    Raises:
        ValueError: the base is another layer, or the rank is out of range.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.LoRA(emb, 2, key=jax.random.key(1))}
        >>> model["head"].base is model["embed"]              # the embedding, held by reference
        True
        >>> model["head"].lora_A.shape, model["head"].lora_B.shape
        ((2, 4), (10, 2))
        >>> tied.ties(model)
        [("['embed']", "['head'].base")]
        >>> h = jnp.ones((1, 4))
        >>> bool(jnp.allclose(model["head"].attend(h), emb.attend(h)))   # lora_B starts at zeros
        True
    """

    base: Any
    lora_A: Any  # noqa: N815 - peft's name
    lora_B: Any  # noqa: N815 - peft's name
    rank: int
    alpha: float

    def __init__(self, base: Any, rank: int, *, alpha: float | None = None, key: Any):
        _check("tied.nn.LoRA", None, base, rank, alpha)
        n_in, n_out = _sizes(base)
        dtype = base.weight.dtype
        if not jnp.issubdtype(dtype, jnp.floating):  # an integer table read through a view
            dtype = jnp.float32
        lim = 1.0 / math.sqrt(n_in)
        self.base = base
        self.lora_A = jax.random.uniform(key, (int(rank), n_in), dtype, minval=-lim, maxval=lim)
        self.lora_B = jnp.zeros((n_out, int(rank)), dtype)
        self.rank = int(rank)
        self.alpha = alpha if alpha is not None else int(rank)

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    def delta(self, x: Any) -> Any:
        """The adapter's own term: ``(alpha / rank) * (x @ lora_A.T) @ lora_B.T``."""
        return self.scale * ((x @ materialize(self.lora_A).T) @ materialize(self.lora_B).T)

    def __call__(self, x: Any) -> Any:
        base = self.base
        if isinstance(base, Embedding):
            raise TypeError(
                "a tied.nn.LoRA over an Embedding adapts its head use (.attend) and was called as a "
                "lookup: keep the bare Embedding at the lookup place and the LoRA at the head place "
                "(tied.nn.lora(model, '.head', rank, key=...) with model.head = model.embed)."
            )
        activation = getattr(base, "activation", None)
        if activation is None:
            return base(x) + self.delta(x)
        linear = copy.copy(base)  # the same arrays, without the activation: it comes after the adapter
        linear.activation = None
        return activation(linear(x) + self.delta(x))

    def attend(self, h: Any) -> Any:
        """The adapted head: ``base.attend(h) + (alpha / rank) * (h @ lora_A.T) @ lora_B.T``."""
        if not hasattr(self.base, "attend"):
            raise TypeError(
                f"a tied.nn.LoRA over a {type(self.base).__name__} has no attend: call it (lora(x))."
            )
        return self.base.attend(h) + self.delta(h)


def adapters(path: str, array: Any) -> bool:
    """The ``trainable=`` predicate that trains the LoRA arrays alone (``lora_A``, ``lora_B``).

    True exactly at the places named ``.lora_A`` or ``.lora_B`` (a `LoRA`'s arrays, stacked
    ones included). With it `tied.grad` computes and returns no gradient for the frozen base
    (None there) and `tied.optim.setup` keeps optimiser state for the adapters only.

    Args:
        path: a place's keystr path.
        array: the array there (not read).

    Returns:
        Whether the place is an adapter's array.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.LoRA(emb, 2, key=jax.random.key(1))}
        >>> tied.param_count(model, trainable=tied.nn.adapters)    # 2*4 + 10*2; the table is frozen
        28
        >>> g = tied.grad(lambda m: m["head"].attend(m["embed"](jnp.array([1]))).sum(),
        ...               trainable=tied.nn.adapters)(model)
        >>> g["embed"].weight is None, g["head"].lora_B.shape
        (True, (10, 2))
    """
    return path.endswith((".lora_A", ".lora_B"))


# ---------------------------------------------------------------- choosing places


Where = str | Sequence[str] | Callable[[str, Any], bool]


def _walk(gdef: Any) -> list:
    try:
        return list(gdef.walk_places(expand_shared=True))
    except GraphError:  # a reference cycle: the first place of each node
        return list(gdef.walk_places())


def _select(model: Any, where_: Where, places: Places, walk: list, who: str) -> list[str]:
    """The selected places (paths), in walk order: a predicate is asked at every place of a
    layer that LoRA adapts (not inside a LoRA); given paths must each hold such a layer."""
    node_at = {p.path: p for p in walk if p.kind not in ("array", "static")}
    if callable(where_) and not isinstance(where_, str):
        return [
            q
            for asked, q in _asked(places.gdef, walk, node_at)
            if issubclass(node_at[q].type, _ADAPTABLE)
            and _inside_lora(q, places, node_at) is None
            and where_(asked, get(model, places.steps[q], places))
        ]
    paths = [where_] if isinstance(where_, str) else list(where_)
    if not all(isinstance(p, str) for p in paths):
        raise TypeError(
            f"{who}: where is a place path (as tied.ties prints it), a list of them, or a predicate "
            f"(path, layer) -> bool; got {where_!r}."
        )
    out = []
    for path in paths:
        path = places.resolve(path, who=who)
        inside = _inside_lora(path, places, node_at)
        if inside is not None:
            raise ValueError(
                f"{who}: {where(path)} lies inside the LoRA at {where(inside)}, which already adapts "
                "it. Merge it first (tied.nn.merge), or select another place."
            )
        p = node_at.get(path)
        if p is None or not issubclass(p.type, _ADAPTABLE):
            raise _refusal(who, path, get(model, places.steps[path], places))
        out.append(path)
    return out


def _asked(gdef: Any, walk: list, node_at: dict) -> list[tuple[str, str]]:
    """Every node place a predicate is asked at, with the place of ``walk`` that is the same slot.

    In a model with a reference cycle ``walk`` (and `Places`) go below each node's first place
    only; the predicate is still asked at every place (a layer in a shared container's later
    place, a reference back not followed), so that a cycle elsewhere never makes it skip one.
    """
    first: dict = {}
    for p in walk:
        if p.kind not in ("array", "static"):
            first.setdefault((p.parent, repr(p.key)), p.path)
    out = []
    for p in gdef.walk_places(expand_shared=True, cut_cycles=True):
        if p.kind in ("array", "static"):
            continue
        q = p.path if p.path in node_at else first.get((p.parent, repr(p.key)))
        if q is not None:
            out.append((p.path, q))
    return out


def _inside_lora(path: str, places: Places, node_at: dict) -> str | None:
    steps = places.steps[path]
    for k in range(len(steps)):
        above = node_at.get("".join(steps[:k]))
        if above is not None and issubclass(above.type, LoRA):
            return above.path
    return None


def _stacks_above(path: str, places: Places, node_at: dict) -> int:
    """How many `tied.Stack`s ``path`` lies below (a Stack of Stacks: two)."""
    steps = places.steps[path]
    return sum(
        1
        for k in range(len(steps))
        if (above := node_at.get("".join(steps[:k]))) is not None and issubclass(above.type, Stack)
    )


def _stack_of(path: str, places: Places, node_at: dict) -> int | None:
    """How many steps lead to the outermost `tied.Stack` above ``path`` (None: no Stack)."""
    steps = places.steps[path]
    for k in range(len(steps)):
        above = node_at.get("".join(steps[:k]))
        if above is not None and issubclass(above.type, Stack):
            return k
    return None


def _index(places: Places, walk: list) -> dict:
    return {p.path: p for p in walk if p.kind not in ("array", "static")}


# ---------------------------------------------------------------- lora


def lora(model: Any, where: Where, rank: int, *, alpha: float | None = None, key: Any) -> Any:
    """A new model with a `LoRA` at each place of a layer that ``where`` selects.

    Only the selected places change: a layer shared at several places gets the adapter at
    the selected ones, is held by the adapter by reference and stays the very object at the
    others (an adapter on ``.head`` of a model whose head is its embedding adapts the head,
    and the lookup stays the bare embedding). A place inside a container that is shared is
    one place with the container's other places (it changes at all of them, as in
    `tied.replace`). A place under a `tied.Stack`'s member gets stacked adapters (leading axis
    ``len(stack)``): the same model as unstacking, wrapping each member and restacking.

    Random draws: the ``k``-th selected place (in the order of the model's walk) draws its
    ``lora_A`` with ``jax.random.fold_in(key, k)``; under a Stack, member ``i`` with
    ``jax.random.split(jax.random.fold_in(key, k), len(stack))[i]``.

    Args:
        model: the model (not changed).
        where: a place path as `tied.ties` prints it (``".head"``,
            ``"['blocks'].member.attn.qkv"``), a list of them, or a predicate
            ``(path, layer) -> bool`` asked at every place of a `tied.nn.Dense` or
            `tied.nn.Embedding` that is not already inside a LoRA.
        rank: the adapters' rank, from 1 to ``min(in, out)`` of each layer.
        alpha: the scale's numerator (``alpha / rank``); None means ``alpha = rank``.
        key: a JAX PRNG key.

    Returns:
        The new model (new containers; the model's own arrays, and new adapter arrays).

    Raises:
        PathError: a path names no place.
        ValueError: ``where`` selects nothing; a selected place holds a layer other than a
            Dense or an Embedding, or lies inside a LoRA; the rank is out of range for a
            layer (each naming the place).

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": emb}           # the head is the embedding
        >>> adapted = tied.nn.lora(model, "['head']", 2, key=jax.random.key(1))
        >>> type(adapted["embed"]).__name__, type(adapted["head"]).__name__
        ('Embedding', 'LoRA')
        >>> adapted["head"].base is adapted["embed"]       # still one embedding
        True
        >>> model["head"] is emb                           # the model given is unchanged
        True
    """
    who = "tied.nn.lora"
    if key is None:
        raise TypeError(f"{who}(model, where, rank, key=...) needs an explicit key: key=jax.random.key(0).")
    leaves, gdef = flatten(model)
    places = Places(gdef)
    walk = _walk(gdef)
    selected = _select(model, where, places, walk, who)
    if not selected:
        raise ValueError(
            f"{who}: where={where!r} selects no place of a tied.nn.Dense or tied.nn.Embedding. "
            "Give places as tied.ties and tied.summary print them (for a layer of a tied.Stack, "
            "below its member: \"['blocks'].member.attn.qkv\")."
        )
    node_at = _index(places, walk)
    for path in selected:  # every refusal before any work, naming the place in the model
        stacked = _stacks_above(path, places, node_at)
        _check(who, path, get(model, places.steps[path], places), rank, alpha, stacked)
    targets = [(path, jax.random.fold_in(key, k)) for k, path in enumerate(selected)]
    return _adapt(unflatten(gdef, leaves), places, _index(places, walk), targets, rank, alpha, who)


def _adapt(root: Any, places: Places, node_at: dict, targets: list, rank: Any, alpha: Any, who: str) -> Any:
    """Put a LoRA at each target place of ``root`` (a fresh copy, written in place)."""
    done: set = set()
    stacks: dict = {}
    for path, k in targets:
        steps = places.steps[path]
        depth = _stack_of(path, places, node_at)
        if depth is not None:
            s = node_at["".join(steps[:depth])]
            group = stacks.setdefault(s.index, (steps[:depth], {}))
            group[1].setdefault(steps[depth + 1 :], (k, path))
            continue
        same = (node_at[path].parent, steps[-1] if steps else None)
        if same in done:  # one place with an earlier target (inside a shared container)
            continue
        done.add(same)
        base = get(root, steps, places)
        _check(who, path, base, rank, alpha)
        root = put(root, steps, LoRA(base, rank, alpha=alpha, key=k), places)
    for stack_steps, rel in stacks.values():
        new = _per_member(
            get(root, stack_steps, places), rel, lambda m, t: _adapt_member(m, t, rank, alpha, who), who
        )
        for q in sorted(places.same_object("".join(stack_steps)), key=len, reverse=True):
            root = put(root, places.steps[q], new, places)
    return root


def _adapt_member(member: Any, targets: list, rank: Any, alpha: Any, who: str) -> Any:
    leaves, gdef = flatten(member)
    places = Places(gdef)
    return _adapt(member, places, _index(places, _walk(gdef)), targets, rank, alpha, who)


def _per_member(s: Stack, rel: dict, fn: Callable, who: str) -> Stack:
    """``tied.stack([fn(member_i, targets_i) ...])`` over ``tied.unstack(s)``; ``rel`` maps each
    target's steps below the member to its (key, path in the model). Merging (``key`` None) may
    write into a broadcast container: its one LoRA becomes one merged layer for every member."""
    members = unstack(s)
    n = len(members)
    for steps, (k, path) in rel.items():
        if steps and k is not None:
            parents = [get(m, steps[:-1], Places(flatten(m)[1])) for m in members]
            if len({id(p) for p in parents}) < n:
                raise ValueError(
                    f"{who}: {where(path)} lies in an object that is one object in every member of the "
                    "tied.Stack (broadcast), so it cannot hold one adapter per member. Give each member "
                    "its own container of that layer, or adapt the layer outside the Stack."
                )
    out = []
    for i, m in enumerate(members):
        targets = [("".join(steps), _member_key(k, n, i)) for steps, (k, _) in rel.items()]
        out.append(fn(m, targets))
    return stack(out)


def _member_key(k: Any, n: int, i: int) -> Any:
    return None if k is None else jax.random.split(k, n)[i]


# ---------------------------------------------------------------- merge


def merge(model: Any) -> Any:
    """A new model with every `LoRA` folded into its base: ``W + (alpha / rank) * lora_B @ lora_A``.

    Each merged place holds a copy of the base layer with the merged weight (the base's
    other arrays, such as its bias, are kept by reference). A base shared with places that
    had no adapter is untied at the merged places only: the other places keep the original
    layer and array, bit for bit, and `tied.ties` shows the cut. Stacked adapters merge into
    stacked weights. A model without adapters is returned as it is.

    Args:
        model: the model (not changed).

    Returns:
        The merged model.

    Examples:
        >>> import jax, jax.numpy as jnp, tied
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = tied.nn.lora({"embed": emb, "head": emb}, "['head']", 2, key=jax.random.key(1))
        >>> tied.ties(model)
        [("['embed']", "['head'].base")]
        >>> merged = tied.nn.merge(model)
        >>> tied.ties(merged)                               # the tie cut at the head only
        []
        >>> merged["embed"].weight is emb.weight            # the embedding, bit for bit
        True
    """
    leaves, gdef = flatten(model)
    walk = _walk(gdef)
    if not any(p.kind not in ("array", "static") and issubclass(p.type, LoRA) for p in walk):
        return model
    places = Places(gdef)
    return _merge(unflatten(gdef, leaves), places, _index(places, walk), {})


def _merge(root: Any, places: Places, node_at: dict, merged: dict) -> Any:
    """Merge every LoRA of ``root`` (a fresh copy, written in place); ``merged`` maps id(LoRA) to
    (the LoRA, its merged layer) across the members of Stacks too, so that one LoRA (broadcast
    across a Stack, and held outside it) becomes one merged layer at all its places."""
    stacks: dict = {}
    for path, p in node_at.items():
        if not issubclass(p.type, LoRA) or _inside_lora(path, places, node_at) is not None:
            continue
        steps = places.steps[path]
        depth = _stack_of(path, places, node_at)
        if depth is not None:
            s = node_at["".join(steps[:depth])]
            stacks.setdefault(s.index, (steps[:depth], {}))[1].setdefault(steps[depth + 1 :], (None, path))
            continue
        adapter = get(root, steps, places)
        if not isinstance(adapter, LoRA):  # a slot of a shared container, merged at its other place
            continue
        if id(adapter) not in merged:
            merged[id(adapter)] = (adapter, _folded(adapter, path))
        root = put(root, steps, merged[id(adapter)][1], places)
    for stack_steps, rel in stacks.values():
        new = _per_member(
            get(root, stack_steps, places), rel, lambda m, _: _merge_member(m, merged), "tied.nn.merge"
        )
        for q in sorted(places.same_object("".join(stack_steps)), key=len, reverse=True):
            root = put(root, places.steps[q], new, places)
    return root


def _merge_member(member: Any, merged: dict) -> Any:
    leaves, gdef = flatten(member)
    places = Places(gdef)
    return _merge(member, places, _index(places, _walk(gdef)), merged)


def _folded(adapter: LoRA, path: str) -> Any:
    base = adapter.base
    if not isinstance(base, _ADAPTABLE):
        raise _refusal("tied.nn.merge", path + ".base", base)
    w = materialize(base.weight)
    delta = adapter.scale * (materialize(adapter.lora_B) @ materialize(adapter.lora_A))
    out = copy.copy(base)  # the base's other fields by reference (its bias stays tied)
    out.weight = (w + delta).astype(w.dtype)
    return out
