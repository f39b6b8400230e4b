"""Paths as prefixes: "everything at or below these places", for ``trainable=`` and `tied.optim.freeze`;
predicates that compose with ``~``, ``|`` and ``&``.

A prefix matches a path at a path-segment boundary: ``.layers[1]`` matches
``.layers[1]`` and ``.layers[1].weight`` but not ``.layers[10]``; ``.enc``
does not match ``.enc1``. The empty path ``""`` (or ``"<root>"``) is the
whole model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np


def at_or_below(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or a place below it (a segment boundary follows)."""
    if not path.startswith(prefix):
        return False
    return len(path) == len(prefix) or not prefix or path[len(prefix)] in ".["


def _check_prefix(p: Any, who: str) -> str:
    if not isinstance(p, str):
        raise TypeError(
            f"{who}: a prefix is a keystr path (a str such as '.enc1' or '.layers[0]'), "
            f"got {type(p).__name__}."
        )
    if p == "<root>":
        return ""
    if p and p[0] not in ".[":
        raise ValueError(
            f"{who}: {p!r} is not a keystr path. Paths start with '.' or '[' as tied.ties and "
            f"tied.summary print them: write {'.' + p!r} (an attribute) or {'[' + repr(p) + ']'!r} (a key)."
        )
    return p


def _operand(p: Any, op: str) -> Any:
    if isinstance(p, str) or not callable(p):
        hint = f" (a place: tied.under({p!r}))" if isinstance(p, str) else ""
        raise TypeError(
            f"tied.under(...) {op} ...: {p!r} is not a trainable= predicate (path, array) -> bool{hint}; "
            "predicates combine with ~, | and &."
        )
    return p


def _ask(p: Any, path: str, array: Any) -> bool:
    r = p(path, array)
    if not isinstance(r, (bool, np.bool_)):
        raise TypeError(
            f"{path or '<root>'}: {p!r} returned {type(r).__name__}, not a bool. Decide from the "
            "path, shape and dtype (they are known under jit), e.g. lambda path, x: x.ndim > 1."
        )
    return bool(r)


class Predicate:
    """A ``trainable=`` predicate ``(path, array) -> bool`` that composes: ``~p``, ``p | q``, ``p & q``.

    ``q`` may be any predicate, a plain function too, on either side. Each combination is decided
    place by place (``(p | q)(path, x)`` is ``p(path, x) or q(path, x)``); the rule of
    ``trainable=`` then applies to the result (a parameter is trainable when it holds at any of
    its places). Combinations compare by value, as `Under` does.
    """

    __slots__ = ()

    def __invert__(self) -> Predicate:
        return Not(self)

    def __or__(self, other: Any) -> Predicate:
        return AnyOf((self, _operand(other, "|")))

    def __ror__(self, other: Any) -> Predicate:
        return AnyOf((_operand(other, "|"), self))

    def __and__(self, other: Any) -> Predicate:
        return AllOf((self, _operand(other, "&")))

    def __rand__(self, other: Any) -> Predicate:
        return AllOf((_operand(other, "&"), self))

    def _key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._key()))


class Under(Predicate):
    """The predicate `tied.under` returns: ``(path, array) -> bool``, compared by its prefixes."""

    __slots__ = ("prefixes",)

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes

    def __call__(self, path: str, array: Any = None) -> bool:
        return any(at_or_below(path, p) for p in self.prefixes)

    def _key(self) -> tuple:
        return self.prefixes

    def __repr__(self) -> str:
        return f"tied.under({', '.join(map(repr, self.prefixes))})"


class Not(Predicate):
    """``~p``: true where ``p`` is false."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, path: str, array: Any = None) -> bool:
        return not _ask(self.inner, path, array)

    def _key(self) -> tuple:
        return (self.inner,)

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


class AnyOf(Predicate):
    """``p | q``: true where either is (``q`` is not asked where ``p`` holds)."""

    __slots__ = ("parts",)
    _symbol = "|"

    def __init__(self, parts: tuple):
        self.parts = parts

    def __call__(self, path: str, array: Any = None) -> bool:
        return any(_ask(p, path, array) for p in self.parts)

    def _key(self) -> tuple:
        return self.parts

    def __repr__(self) -> str:
        return "(" + f" {self._symbol} ".join(map(repr, self.parts)) + ")"


class AllOf(AnyOf):
    """``p & q``: true where both are (``q`` is not asked where ``p`` fails)."""

    __slots__ = ()
    _symbol = "&"

    def __call__(self, path: str, array: Any = None) -> bool:
        return all(_ask(p, path, array) for p in self.parts)


def under(*prefixes: str) -> Under:
    """A ``trainable=`` predicate: true for every array at or below any of the given places.

    A prefix matches at a path-segment boundary: ``.layers[1]`` selects
    ``.layers[1].weight`` but not ``.layers[10].weight``, and ``.enc`` does not
    select ``.enc1``. Give it to `tied.optim.setup`, `tied.grad`,
    `tied.value_and_grad`, `tied.params` or `tied.param_count` as
    ``trainable=``: a parameter is trainable when any of its places is at or
    below a prefix (places below shared nodes included), so a layer shared at
    ``.enc`` and ``.dec`` is selected by either. Paths are keystr paths as
    `tied.ties` and `tied.summary` print them; a Flax NNX parameter's path ends
    in ``.value`` (``.block.kernel.value``), so a node prefix such as
    ``.block`` selects it.

    Predicates compose: ``~p`` (everything but), ``p | q`` (either), ``p & q``
    (both), where ``q`` may be a plain ``(path, array) -> bool`` function, on
    either side. Each is decided place by place, then the rule above applies:
    ``~tied.under(".head")`` trains every parameter with a place outside
    ``.head``, so an embedding tied to the head still trains (through its
    ``.embed`` place); leave a shared array out with all its places,
    ``~tied.under(".head", ".embed")``.

    Args:
        *prefixes: keystr paths of places (``""`` or ``"<root>"``: everything).

    Returns:
        A callable ``(path, array) -> bool`` (an `Under`), equal to another of the same
        prefixes (and a combination to one of equal parts), so `tied.jit` and `tied.optim`
        states compare it by value.

    Raises:
        TypeError: a prefix that is not a str.
        ValueError: a prefix that does not start with ``.`` or ``[``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, tied
        >>> from tied.nn import Chain, Dense
        >>> k = jax.random.split(jax.random.key(0), 2)
        >>> enc, head = Dense(2, 2, key=k[0]), Dense(2, 1, key=k[1])
        >>> model = Chain(enc, enc, head)                      # enc at two places
        >>> state = tied.optim.setup(optax.adam(1e-3), model, trainable=tied.under(".layers[2]"))
        >>> state.paths
        ('.layers[2].weight', '.layers[2].bias')
        >>> at_1 = tied.under(".layers[1]")
        >>> at_1(".layers[1].weight", None), at_1(".layers[10].weight", None)   # at a segment boundary
        (True, False)
        >>> tied.param_count(model, trainable=tied.under(".layers[1]"))   # enc, through its second place
        6
        >>> tied.param_count(model, trainable=~tied.under(".layers[0]"))  # enc is at .layers[1] too: 6 + 3
        9
        >>> all_but_head = ~tied.under(".layers[2]")
        >>> tied.optim.setup(optax.adam(1e-3), model, trainable=all_but_head).paths
        ('.layers[0].weight', '.layers[0].bias')
        >>> head_and_biases = tied.under(".layers[2]") | (lambda path, x: x.ndim == 1)
        >>> tied.optim.setup(optax.adam(1e-3), model, trainable=head_and_biases).paths
        ('.layers[0].bias', '.layers[2].weight', '.layers[2].bias')
    """
    if not prefixes:
        raise TypeError("tied.under() takes at least one prefix, e.g. tied.under('.enc1', '.head').")
    return Under(tuple(_check_prefix(p, "tied.under") for p in prefixes))


def canonical(path: str, aliases: Iterable[tuple[str, ...]]) -> str:
    """``path`` rewritten to go through each shared node's first place.

    ``aliases`` holds the places of each shared node (first place first), as
    `GraphDef.shared_node_paths` lists them: those places never pass through a
    shared node's later place, so each rewrite lengthens the rewritten part and
    the loop ends.
    """
    aliases = list(aliases)
    while True:
        best = None
        for places in aliases:
            for q in places[1:]:
                if at_or_below(path, q) and (best is None or len(q) < len(best[0])):
                    best = (q, places[0])
        if best is None:
            return path
        q, first = best
        path = first + path[len(q) :]


def covered(prefix: str, aliases: Iterable[tuple[str, ...]]) -> list[str]:
    """The places (as the walk lists them) at or below which every array below ``prefix`` sits.

    The canonical ``prefix`` itself, and the first place of every shared node
    that also sits at or below it (whose arrays the walk lists under that first
    place only). A reference back to a node entered above (a ``.parent`` of a
    cycle) is not followed, as `GraphDef.place_leaves` and so ``trainable=``
    do not follow it.
    """
    aliases = list(aliases)
    out = [canonical(prefix, aliases)]
    grown = True
    while grown:
        grown = False
        for places in aliases:
            later = [q for q in places[1:] if not at_or_below(q, places[0])]  # not a back-reference
            if places[0] not in out and any(at_or_below(q, p) for q in later for p in out):
                out.append(places[0])
                grown = True
    return out


# ---------------------------------------------------------------- a selection that selects nothing


def warn_none_selected(
    trainable: Any, params: list[str], who: str = "tied.optim.setup", stacklevel: int = 3
) -> None:
    """Warn that ``trainable`` selects none of ``params`` (the paths of the model's
    parameters; none: nothing to select, no warning), naming what it was given."""
    if not params:
        return
    some = ", ".join(repr(p) for p in params[:4]) + (", ..." if len(params) > 4 else "")
    warnings.warn(
        f"{who}: trainable={trainable!r} selects none of the model's {len(params)} parameters "
        f"({some}), so nothing will be trained. It is called with each place's keystr path as "
        "tied.ties prints it; a Flax NNX parameter's path ends in '.value' ('.block.kernel.value'), "
        "so test k.endswith('kernel.value'), or select whole nodes with tied.under('.block').",
        UserWarning,
        stacklevel=stacklevel,
    )
