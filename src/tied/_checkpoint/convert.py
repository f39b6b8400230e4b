"""What a file holds against what ``like`` holds: file keys, transforms and casts.

`tied.save(keys=...)` names each unique array by a place's key in another library's
names (`name_arrays`); ``transform`` and ``dtype`` of `tied.load` and `tied.save`
change each value read or written (`Convert`): a Conv1D weight stored ``(in, out)``
transposed, a bfloat16 file read into a float32 model. They act on one array at a
time and know nothing of the format that moves the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._core import flatten
from .document import PARTIAL, CheckpointError, Manifest, keystr
from .manifest import _check_leaf, every_place, places_of, stored


def name_arrays(doc: Manifest, keys: Mapping[str, str | None] | Callable[[str], str | None] | None) -> None:
    """Rename the manifest's tensors by ``keys`` (place -> file key or None): each array under the
    key of its first place (walk order, every place of a shared node included) that ``keys``
    names, else its own first place's path."""
    if keys is None:
        return
    every = every_place(doc)  # a place below a shared node's second place may name its array too
    if isinstance(keys, Mapping):
        known = {p for ps in every for p in ps}
        unknown = [p for p in keys if p not in known]
        if unknown:
            raise CheckpointError(
                "tied.save(keys=...) names places the tree does not have: "
                f"{', '.join(map(keystr, unknown[:5]))} (keys are keystr paths of array places, "
                "such as '.layers[0].weight')."
            )
        fn: Callable[[str], Any] = keys.get
    elif callable(keys):
        fn = keys
    else:
        raise CheckpointError(
            f"tied.save(keys=...) takes a mapping or a function, got {type(keys).__name__}."
        )
    owner: dict[str, str] = {}
    for a, places in zip(doc["arrays"], every):
        if a.get("left_out"):  # not in the file: no key
            continue
        name = None
        for p in places:
            try:
                name = fn(p)
            except Exception as e:
                raise CheckpointError(
                    f"tied.save(keys=...) failed at {keystr(p)} ({type(e).__name__}: {e})."
                ) from e
            if name is not None:
                break
        if name is None:
            name = a["name"]
        elif not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(
                f"tied.save(keys=...) gave {name!r} for {keystr(p)}; a key is a non-empty string."
            )
        a["name"] = name
    for a in doc["arrays"]:
        if a.get("left_out"):
            continue
        if a["name"] in owner:
            raise CheckpointError(
                f"tied.save(keys=...): two arrays get the key {a['name']!r}: the one at "
                f"{keystr(owner[a['name']])} and the one at {keystr(a['places'][0])} (they are not tied). "
                "Give them different keys, or tie them first."
            )
        owner[a["name"]] = a["places"][0]


def leave_out(doc: Manifest, only: Callable[[str, Any], Any]) -> None:
    """Mark the arrays ``only`` does not select as left out (``tied.save(only=...)``): described
    (places, ties, shapes, dtypes) but not stored. ``only(place, array)`` is asked at every place of
    each unique array, below every place of a shared node too, in walk order; an array is stored if
    it is selected at any of its places (one array at several places is one array: never cut)."""
    if not callable(only):
        raise CheckpointError(
            f"tied.save(only=...) takes a predicate (place, array) -> bool, got {type(only).__name__}."
        )
    keep = []
    for places, leaf in zip(every_place(doc), doc.leaves or ()):
        chosen = False
        for p in places:
            try:
                chosen = bool(only(p, leaf)) or chosen
            except Exception as e:
                raise CheckpointError(
                    f"tied.save(only=...) failed at {keystr(p)} ({type(e).__name__}: {e})."
                ) from e
        keep.append(chosen)
    if not any(keep):
        raise CheckpointError(
            "tied.save(only=...) selects no array of the tree, so the file would hold nothing. The "
            "predicate is asked (place, array) at every place of each array, with places written as "
            "tied prints them ('.layers[0].weight', \"['head'].lora_A\"); check it against tied.summary."
        )
    if all(keep):
        return  # everything selected: an ordinary checkpoint
    for a, k in zip(doc["arrays"], keep):
        if not k:
            del a["name"]
            a["left_out"] = True
    doc["version"] = PARTIAL


def stored_entries(entries: Sequence[dict]) -> list[int]:
    """The indices of the entries a file stores (not left out by ``only=``)."""
    return [i for i, a in enumerate(entries) if not a.get("left_out")]


def _floating(dt: Any) -> str | None:
    return (
        "f" if jnp.issubdtype(dt, jnp.floating) else "c" if jnp.issubdtype(dt, jnp.complexfloating) else None
    )


class Convert:
    """``transform`` and ``dtype`` of `tied.load`/`tied.save`: what each value read or written becomes.

    ``transform`` is a mapping from place to a function of the array, or one function
    ``(place, array) -> array``; ``dtype`` is None (dtypes must match) or ``"like"``
    (floating-point values cast to ``like``'s dtype). Typed keys are never converted.
    """

    def __init__(self, transform: Any = None, dtype: str | None = None, *, who: str = "tied.load"):
        if dtype not in (None, "like"):
            raise CheckpointError(f"{who}(dtype={dtype!r}): dtype is None (dtypes must match) or 'like'.")
        if transform is not None and not (isinstance(transform, Mapping) or callable(transform)):
            raise CheckpointError(
                f"{who}(transform=...) takes a mapping from place to function, or a function (place, array) "
                f"-> array; got {type(transform).__name__}."
            )
        self.transform, self.dtype, self.who = transform, dtype, who
        self._every: dict[str, list[str]] = {}  # a place -> every place of its array (see `bind`)

    def bind(self, tree: Any) -> None:
        """Learn every place of each array of ``tree`` (``like``, or a `describe`d manifest), so that
        a mapping may name an array at any of its places, below every place of a shared node too
        (a manifest and `match` list those at the node's first place only)."""
        if not isinstance(self.transform, Mapping):
            return
        every = every_place(tree) if isinstance(tree, Manifest) else places_of(flatten(tree)[1])
        for ps in every:
            for p in ps:
                # A place written alike for two arrays (an attribute named "a.b") names neither.
                self._every[p] = [] if p in self._every and self._every[p] is not ps else ps

    def _all(self, places: Sequence[str]) -> Sequence[str]:
        """``places`` and every other place of their array (`bind`)."""
        more = self._every.get(places[0]) if places else None
        return [*places, *(p for p in more if p not in places)] if more else places

    def __bool__(self) -> bool:
        return self.transform is not None or self.dtype is not None

    def fn(self, places: Sequence[str]) -> Callable[[Any], Any] | None:
        """The function for an array at ``places`` (a mapping may name any one of them)."""
        t = self.transform
        if t is None:
            return None
        if not isinstance(t, Mapping):
            return lambda a: t(places[0], a)
        fns = {id(t[p]): (p, t[p]) for p in self._all(places) if p in t}
        if len(fns) > 1:
            shown = " and ".join(keystr(p) for p, _ in fns.values())
            raise CheckpointError(
                f"{self.who}(transform=...) gives two functions for one array, at {shown} (places of one "
                "array). Give one of them."
            )
        return next(iter(fns.values()))[1] if fns else None

    def precheck(self, where: str, place: str, leaf: Any, shape: Any, dtype: str, key: Any = None) -> None:
        """The check `match` runs before reading: skipped where a transform will run, the dtype
        left to the cast where ``dtype="like"``."""
        fn = self.fn([place])
        if key is not None or stored(leaf)[2] is not None or fn is None and self.dtype is None:
            return self._check(where, place, leaf, shape, dtype, key)
        if fn is not None:
            return None
        _check_leaf(where, place, leaf, shape, stored(leaf)[1] if self._castable(dtype, leaf) else dtype)

    def _check(self, where: str, place: str, leaf: Any, shape: Any, dtype: str, key: Any = None) -> None:
        """`_check_leaf`, saying where ``dtype="like"`` would have read the value (a bfloat16 file
        into a float32 model)."""
        want_shape, want_dtype, want_key = stored(leaf)
        got, want = _floating(np.dtype(dtype)), _floating(np.dtype(want_dtype))
        if (
            self.dtype is None
            and key is None
            and want_key is None
            and tuple(shape) == want_shape
            and dtype != want_dtype
            and got is not None
            and got == want
        ):
            raise CheckpointError(
                f"{where}: the dtype differs at {keystr(place)}: the file has {tuple(shape)} {dtype}, like "
                f'has {want_shape} {want_dtype}. Pass dtype="like" to tied.load to cast each '
                "floating-point value to like's dtype at its place, or build `like` with the file's dtypes."
            )
        _check_leaf(where, place, leaf, shape, dtype, key)

    def _castable(self, dtype: Any, leaf: Any) -> bool:
        got, want = _floating(np.dtype(dtype)), _floating(leaf.dtype)
        return self.dtype == "like" and got is not None and got == want

    def apply(self, where: str, places: Sequence[str], what: str, x: np.ndarray, leaf: Any) -> np.ndarray:
        """``x`` (read for ``like``'s ``leaf`` at ``places``; ``what`` names the key and shard) transformed
        and cast, then checked against ``leaf``."""
        if stored(leaf)[2] is not None:
            return x
        fn = self.fn(places)
        if fn is not None:
            try:
                y = fn(x)
            except Exception as e:
                raise CheckpointError(
                    f"{where}: the transform at {keystr(places[0])} failed on {what} "
                    f"({type(e).__name__}: {e})."
                ) from e
            y = np.asarray(y)
            if tuple(y.shape) != tuple(leaf.shape):
                raise CheckpointError(
                    f"{where}: the transform at {keystr(places[0])} turned {what}, of shape "
                    f"{tuple(x.shape)}, into shape {tuple(y.shape)}, but like has {tuple(leaf.shape)} "
                    "there. Fix the transform (for a Conv1D weight stored (in, out): lambda a: a.T)."
                )
            x = y
        if self.dtype == "like" and x.dtype != np.dtype(leaf.dtype) and self._castable(x.dtype, leaf):
            x = x.astype(leaf.dtype)
        if self.dtype == "like" and x.dtype != np.dtype(leaf.dtype) and fn is None:
            raise CheckpointError(
                f"{where}: {what} holds {x.dtype.name} and like has {np.dtype(leaf.dtype).name} at "
                f"{keystr(places[0])}; dtype='like' casts floating-point values to floating-point dtypes "
                "only. Build like with the file's dtype there."
            )
        try:
            self._check(where, places[0], leaf, x.shape, x.dtype.name)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (read from {what}{', after the transform' if fn else ''})") from None
        # Not np.ascontiguousarray: it gives a 0-d array (a BatchNorm's count) a shape of (1,).
        return x if x.flags.c_contiguous else np.array(x, order="C")

    def save(self, leaves: list, doc: dict) -> None:
        """Apply the transform to each array to be written, and record what is stored."""
        if self.transform is None:
            return
        for i, a in enumerate(doc["arrays"]):
            fn = self.fn(a["places"])
            if fn is None or "key" in a or a.get("left_out"):
                continue
            try:
                y = np.asarray(fn(np.asarray(leaves[i])))
            except Exception as e:
                raise CheckpointError(
                    f"tied.save(transform=...) failed at {keystr(a['places'][0])} ({type(e).__name__}: {e})."
                ) from e
            leaves[i] = y
            a["shape"], a["dtype"] = [int(d) for d in y.shape], y.dtype.name
            a["transformed"] = True  # so that a strict load without the inverse is refused, not silent

    def require(self, where: str, entries: Sequence[dict], paths: Sequence[Sequence[str]]) -> None:
        """Refuse a strict load that gives no transform where the save stored a transformed value."""
        for a, ps in zip(entries, paths):
            if a.get("transformed") is True and not a.get("left_out") and self.fn(ps) is None:
                raise CheckpointError(
                    f"{where}: the array at {keystr(ps[0])} ({a['name']!r}) was saved through a transform "
                    "(tied.save(transform=...)), so its stored value is not like's. Pass the inverse as "
                    "tied.load(..., transform=...) for that place."
                )
