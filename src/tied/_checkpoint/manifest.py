"""The format-neutral half of checkpoints: a tree's places, ties and views as JSON, and `like`.

A checkpoint format (one safetensors file in `_safetensors.py`, an Orbax
directory in `_orbax.py`) stores two things: the bytes of each unique array,
and a *manifest*, the JSON document this module writes and reads. Everything
about sharing lives here, so a format only moves bytes:

* `describe(tree, metadata)` flattens a tree and returns its unique arrays and
  its manifest: for each unique array its tensor name, dtype, shape and every
  place (keystr paths); the places of each shared node; each view's places,
  function name and source; the layout of each node whose type gives one (a
  `tied.Stack`: its length and stacked places); the caller's metadata. State (the arrays below a
  `tied.State` or another state cell) is marked ``"state": true``; a typed key
  (``jax.random.key``) is stored as its key data, its implementation named under
  ``"key"``, and comes back as a typed key. A format adds its own fields to an
  array's entry (a checksum, an offset) and stores `pack` of the document.
* `validate(doc, where)` (in `_document`, with `pack`) checks a manifest read
  back from disk field by field (types and values), so that a hostile or corrupt
  document raises `CheckpointError`, never a ``KeyError`` or ``TypeError``; a
  deep model's place table is unfolded into paths there.
* `match(doc, like, where)` checks the manifest against ``like`` (places,
  views, layouts, shared nodes, tied arrays, shapes, dtypes, keys, state; the first difference is
  named by path) before anything is read, and returns a `Match`: for each
  unique array of ``like`` the manifest entry to read into it.
* `build(match, arrays)` rebuilds the tree from one array per unique array of
  ``like``; `place_like(x, leaf)` puts a host array where ``like``'s leaf is
  (its sharing, or numpy for numpy).

``like``'s leaves may be arrays (``jax.Array``, ``numpy.ndarray``) or
``jax.ShapeDtypeStruct`` (with or without a ``.sharding``), so that a model too
big for one host need never be materialised to be loaded.

Places are keystr strings, which are not always unique: an attribute literally
named ``"encoder.weight"`` and the ``weight`` of an attribute ``encoder`` are
both written ``.encoder.weight``. Where a tree writes two array places alike,
the manifest also records each such place's keys (the keystr pieces from the
root: ``[".encoder.weight"]`` and ``[".encoder", ".weight"]``) under
``place_keys``, and those places are compared by their keys, so they are told
apart whatever the order of the attributes.

Example (the sharing a manifest records):

    >>> import jax
    >>> from tied._checkpoint.manifest import describe
    >>> from tied.nn import Chain, Dense
    >>> d = Dense(2, 2, key=jax.random.key(0))
    >>> leaves, doc = describe(Chain(d, Dense(d.weight, None)))
    >>> doc["arrays"][0]["places"]
    ['.layers[0].weight', '.layers[1].weight']
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._core import GraphDef, flatten, fn_name, unflatten
from .document import (
    FORMAT,
    VERSION,
    CheckpointError,
    Manifest,
    PlaceTable,
    corrupt,
    keystr,
    written_counts,
)

__all__ = [
    "Manifest",
    "Match",
    "build",
    "describe",
    "match",
    "place_like",
    "user_metadata",
]

# ---------------------------------------------------------------- abstract leaves in `like`


def is_abstract(leaf: Any) -> bool:
    """Whether a leaf of ``like`` describes an array without holding one (``jax.ShapeDtypeStruct``)."""
    return isinstance(leaf, jax.ShapeDtypeStruct)


def dtype_name(leaf: Any) -> str:
    """The numpy name of a leaf's dtype (``float32``, ``bfloat16``); byte order plays no part."""
    return np.dtype(leaf.dtype).name


# ---------------------------------------------------------------- typed keys


def is_key(leaf: Any) -> bool:
    """Whether a leaf is a typed random key (``jax.random.key``), stored as its key data."""
    return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def key_impl(leaf: Any) -> str:
    """The name of a typed key's implementation (``"threefry2x32"``, ``"rbg"``)."""
    return str(leaf.dtype._impl.name)


def stored(leaf: Any) -> tuple[tuple[int, ...], str, str | None]:
    """What a checkpoint stores for a leaf: ``(shape, numpy dtype name, key implementation or None)``;
    a typed key is stored as its key data (``jax.random.key_data``: unsigned integers, the key's
    own shape last)."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(int(d) for d in data.shape), np.dtype(data.dtype).name, key_impl(leaf)
    return tuple(int(d) for d in leaf.shape), dtype_name(leaf), None


def _show_stored(shape: Sequence[int], dtype: str, key: str | None) -> str:
    return f"a typed key ({key}) stored as {tuple(shape)} {dtype}" if key else f"{tuple(shape)} {dtype}"


# ---------------------------------------------------------------- writing a manifest


def user_metadata(metadata: Mapping[str, Any] | None) -> dict:
    """The caller's metadata as a JSON-able dict (a copy), or `CheckpointError` saying what to change."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise CheckpointError(
            f"tied.save(metadata=...) takes a mapping with string keys, got {type(metadata).__name__}."
        )
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=True))
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"tied.save(metadata=...): the metadata must be JSON-serialisable ({e}). Convert arrays "
            "with .tolist() and objects to strings or numbers."
        ) from None


_MAX_NAME = 200  # longer tensor names are elided (a deep model's paths would fill the header)


def _tensor_names(arrays: Sequence[Sequence[str]]) -> list[str]:
    """One unique name per array: its first place (elided in the middle past 200 characters), with
    ``#2``, ``#3``... where two arrays would get one name."""
    names: list[str] = []
    seen: set[str] = {"__metadata__"}
    for paths in arrays:
        base = keystr(paths[0])
        if len(base) > _MAX_NAME:
            base = base[:60] + "..." + base[-(_MAX_NAME - 63) :]
        name, k = base, 1
        while name in seen:
            k += 1
            name = f"{base}#{k}"
        seen.add(name)
        names.append(name)
    return names


class _Placing:
    """Every place of a graph (shared nodes entered once, as the walk does) as a table: place ``t``
    is ``pieces[t]`` below place ``parents[t]`` (the root is place 0, parent -1), so a deep model is
    described in space linear in its depth. ``paths[t]`` is its keystr path; ``arrays[i]`` and
    ``nodes[j]`` the places of unique array ``i`` and node ``j``, in walk order."""

    def __init__(self, gdef: GraphDef):
        self.parents: list[int] = []
        self.pieces: list[str] = []
        self.paths: list[str] = []
        self.arrays: list[list[int]] = [[] for _ in range(gdef.num_leaves)]
        self.nodes: list[list[int]] = [[] for _ in range(gdef.num_nodes)]
        self.views: list[int] = []  # the view nodes, in index order
        first: dict[int, int] = {}  # node index -> its first place (its children are below it)
        for p in gdef.walk_places():
            if p.kind == "static":
                continue
            t = len(self.paths)
            parent = first[p.parent] if p.parent >= 0 else -1
            self.parents.append(parent)
            self.pieces.append(jax.tree_util.keystr((p.key,)) if p.parent >= 0 else p.path)
            self.paths.append(p.path)
            if p.kind == "array":
                self.arrays[p.index].append(t)
                continue
            if not self.nodes[p.index] and p.kind == "view":
                self.views.append(p.index)
            self.nodes[p.index].append(t)
            if p.first:  # a node whose children come next
                first[p.index] = t
        self.views.sort()

    def keys(self, t: int) -> tuple[str, ...]:
        """The place's keystr pieces from the root (``(".encoder", ".weight")``)."""
        out = []
        while t > 0:
            out.append(self.pieces[t])
            t = self.parents[t]
        return tuple(reversed(out))


def describe(tree: Any, metadata: Mapping[str, Any] | None = None) -> tuple[list, dict]:
    """Flatten ``tree`` and describe it as a JSON-able manifest.

    Args:
        tree: the object graph to save.
        metadata: the caller's JSON-serialisable values under string keys (or None).

    Returns:
        ``(leaves, manifest)``: the arrays to store, one per unique array in flatten order
        (a typed key as its key data, ``jax.random.key_data``), and a dict
        ``{"format": "tied", "version": 4, "arrays": [...], "shared_nodes": [...],
        "views": [...], "layouts": [...], "user": {...}}`` (a `Manifest`). ``arrays[i]``
        describes ``leaves[i]``: ``{"name", "dtype", "shape", "places"}``, with
        ``name`` unique (the first place's keystr, ``<root>`` for the root) and
        ``dtype`` a numpy dtype name, plus ``"key"`` (the implementation's name) for a
        typed key and ``"state": true`` for state (below a `tied.State` or another
        state cell). The places are keystr paths; the manifest's ``table`` says the
        same compactly, for `pack`. A format adds its own fields to the array entries
        and stores `pack` of the document (or the document itself: both read back).

    Raises:
        CheckpointError: metadata that is not a JSON-able mapping with string keys, or two
            places that would be written alike with the same keys (two dict keys that print
            alike, such as two ``float("nan")`` keys), naming the path.

    Examples:
        >>> import jax
        >>> from tied._checkpoint.manifest import describe
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> leaves, doc = describe(Chain(d, Dense(d.weight, None)), {"step": 3})
        >>> [a["places"] for a in doc["arrays"]]
        [['.layers[0].weight', '.layers[1].weight'], ['.layers[0].bias']]
        >>> len(leaves), leaves[0] is d.weight
        (2, True)
    """
    user = user_metadata(metadata)
    leaves, gdef = flatten(tree)
    placing = _Placing(gdef)
    paths = [[placing.paths[t] for t in ts] for ts in placing.arrays]
    written = written_counts(paths)
    state = gdef.state_leaves()
    names = _tensor_names(paths)
    arrays, out = [], []
    for leaf, name, ps, ts, is_state in zip(leaves, names, paths, placing.arrays, state):
        shape, dtype, key = stored(leaf)
        entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(shape), "places": ps}
        if key is not None:
            entry["key"] = key
            leaf = jax.random.key_data(leaf)
        if is_state:
            entry["state"] = True
        if any(written[p] > 1 for p in ps):
            entry["place_keys"] = [list(placing.keys(t)) for t in ts]
        arrays.append(entry)
        out.append(leaf)
    _refuse_alike(arrays)
    shared = [ts for ts in placing.nodes if len(ts) > 1]
    views, views_at = [], []
    first_place = {p: t for t, p in reversed(list(enumerate(placing.paths)))}
    for v, j in zip(gdef.views(), placing.views):
        views.append({"places": list(v.paths), "fn": fn_name(v.fn), "source": v.source})
        views_at.append((placing.nodes[j], None if v.source is None else first_place.get(v.source)))
    layouts = [(placing.nodes[j], layout) for j, layout in gdef.layouts()]
    doc = Manifest(
        format=FORMAT,
        version=VERSION,
        arrays=arrays,
        shared_nodes=[[placing.paths[t] for t in ts] for ts in shared],
        views=views,
        layouts=[
            {
                "places": [placing.paths[t] for t in ts],
                "place_keys": [list(placing.keys(t)) for t in ts],  # places written alike told apart
                "layout": _plain(layout, ts, placing),
            }
            for ts, layout in layouts
        ],
        user=user,
    )
    doc.gdef, doc.leaves = gdef, leaves
    doc.table = PlaceTable(
        [[p, k] for p, k in zip(placing.parents, placing.pieces)],
        placing.arrays,
        shared,
        views_at,
        [ts for ts, _ in layouts],
    )
    return out, doc


def places_of(gdef: GraphDef) -> list[list[str]]:
    """Every place of each unique array, in walk order, below every place of a shared node too
    (a manifest records the places below a shared node at its first place only; a caller may
    name any of them: ``['head'].weight`` where the head is the embedding)."""
    out: list[dict[str, None]] = [{} for _ in range(gdef.num_leaves)]
    for p, i in gdef.place_leaves():
        out[i][p] = None
    return [list(ps) for ps in out]


def every_place(doc: Manifest) -> list[list[str]]:
    """`places_of` the tree a manifest of `describe` describes (walked once, when first asked: a
    deep model's expanded paths are long)."""
    if doc.every is None:
        doc.every = places_of(doc.gdef)
    return doc.every


def _plain(layout: Any, ts: Sequence[int], placing: _Placing) -> Any:
    """A node's layout (`GraphDef.layouts`) as the JSON it is stored as, so that the layout of
    ``like`` compares equal to one read back from a file."""
    try:
        return json.loads(json.dumps(layout, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{keystr(placing.paths[ts[0]])}: its type's __tied_layout__ gave {layout!r}, which is not "
            f"plain JSON data ({e}). Return dicts, lists, strings and numbers from __tied_layout__."
        ) from None


def _refuse_alike(arrays: list[dict]) -> None:
    seen: set[tuple] = set()
    for a in arrays:
        for j, p in enumerate(a["places"]):
            if "place_keys" in a:
                k = (p, tuple(a["place_keys"][j]))
                if k in seen:
                    raise CheckpointError(
                        f"{keystr(p)}: two places of the model are written alike with the same keys "
                        f"({' '.join(k[1])}), so a checkpoint cannot tell them apart: two dict keys "
                        "that print alike (two float('nan') keys, say). Give the dict keys that print "
                        "differently (strings, say) before saving."
                    )
                seen.add(k)


def _array_ids(paths: Sequence[Sequence[str]], keys: Sequence[Sequence[Any] | None]) -> list[list[tuple]]:
    """Each array place as ``(path, keys)``: keys ``()`` where no other place is written alike, else
    the place's keys (which `validate` makes sure a manifest has for such places)."""
    written = written_counts(paths)
    return [
        [(p, tuple(ks[j]) if written[p] > 1 else ()) for j, p in enumerate(ps)]  # type: ignore[index]
        for ps, ks in zip(paths, keys)
    ]


# ---------------------------------------------------------------- matching `like`


def _ids(groups: Sequence[Sequence[str]]) -> list[list[tuple[str, int]]]:
    """Each place as ``(path, n)``: the n-th place written ``path``, counted over ``groups`` in order."""
    count: dict[str, int] = {}
    out = []
    for g in groups:
        row = []
        for p in g:
            n = count.get(p, 0)
            count[p] = n + 1
            row.append((p, n))
        out.append(row)
    return out


def _show(ids: Sequence[tuple]) -> str:
    def one(p: str, n: Any) -> str:
        if isinstance(n, tuple):  # an array place: its keys where another place is written alike
            return keystr(p) + (f" (keys {' '.join(n)})" if n else "")
        return keystr(p) + (f" (place {n + 1} written so)" if n else "")

    shown = ", ".join(one(p, n) for p, n in ids[:5])
    return shown + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def _private(path: str) -> bool:
    return any(part.startswith("_") for part in path.replace("[", ".").split(".")[1:] if part)


def _missing(where: str, ids: list[tuple], side: str, other: str, other_paths: Any = ()) -> CheckpointError:
    hint = ""
    if side == "the file" and any(_private(p) for p, _ in ids):
        hint = (
            " A path naming a private attribute that `like` lacks is refused; tied never sets "
            "attributes the file names."
        )
    alike = [p for p, _ in ids if p in other_paths]
    if alike:
        hint += (
            f" {other[0].upper() + other[1:]} has places written {keystr(alike[0])} too, with other keys "
            "(keystr pieces from the root): an attribute whose name holds a '.' or brackets is where "
            "the two differ."
        )
    return CheckpointError(
        f"{where}: places in {side} but not in {other}: {_show(ids)}.{hint} The checkpoint was saved from "
        "a model with another structure; pass a `like` built the same way as the saved model."
    )


def _groups_differ(where: str, what: str, like_groups: list, file_groups: list) -> None:
    """Raise if two sharing patterns (lists of groups of place ids) differ, naming which places."""
    like_of = {p: g for g in like_groups for p in g}
    file_of = {p: g for g in file_groups for p in g}

    def say(g: list | None, p: tuple[str, int]) -> str:
        if g is None or len(g) == 1:
            return f"{keystr(p[0])} is not tied to another place"
        return " and ".join(keystr(q[0]) for q in g) + f" are one {what}"

    for side, groups, other in (("like", like_groups, file_of), ("the file", file_groups, like_of)):
        for g in groups:
            h = other.get(g[0])
            if h is None or set(h) != set(g):
                like_g, file_g = (g, h) if side == "like" else (h, g)
                raise CheckpointError(
                    f"{where}: the sharing differs at {keystr(g[0][0])}: in like, {say(like_g, g[0])}; in "
                    f"the file, {say(file_g, g[0])}. Build `like` with the ties of the saved model."
                )


def _layouts_differ(where: str, doc: dict, gdef: GraphDef, placing: _Placing) -> None:
    """Raise if a node's layout (`GraphDef.layouts`: which places of a `tied.Stack` are stacked,
    and its length) differs between ``like`` and the file, naming the place: arrays of the same
    shapes would otherwise be read with another meaning. A file written before layouts were
    recorded (version 3 or earlier) cannot say; loading one into a ``like`` that has them warns."""
    like_layouts = [(placing.nodes[j], _plain(lay, placing.nodes[j], placing)) for j, lay in gdef.layouts()]
    if "layouts" not in doc:
        if like_layouts:
            warnings.warn(
                f"{where}: written by a tied that did not record layouts (version {doc['version']}), so "
                f"the layout of {keystr(placing.paths[like_layouts[0][0][0]])} "
                f"({_show_layout(like_layouts[0][1])}) "
                "is taken from like unchecked. Load it into a like built as the saved model was, then "
                "save it again to record its layout.",
                stacklevel=5,
            )
        return
    # A place is its keystr pieces from the root: two places written alike (an attribute named
    # "s.t" and the attribute t of s) are told apart whatever the order of the attributes.
    like_l = {tuple(placing.keys(t)): lay for ts, lay in like_layouts for t in ts}
    file_l = {tuple(k): e["layout"] for e in doc["layouts"] for k in e["place_keys"]}
    for p in sorted(set(like_l) | set(file_l)):
        lv, fv = like_l.get(p), file_l.get(p)
        if lv == fv:
            continue
        differ = isinstance(lv, dict) and isinstance(fv, dict) and lv.get("n") != fv.get("n")
        why = (
            "the number of members differs"
            if differ
            else "arrays of the same shapes would be read with another meaning (a broadcast array "
            "taken for a stacked one)"
        )
        raise CheckpointError(
            f"{where}: the layout at {keystr(''.join(p))} differs: like has {_show_layout(lv)}, the file "
            f"has {_show_layout(fv)}: {why}. Build `like` as the saved model was built: the same "
            "objects shared by every member of a tied.stack, the same number of members."
        )


def _show_layout(layout: Any) -> str:
    if layout is None:
        return "no layout there"
    if isinstance(layout, dict) and layout.get("type") == "tied.Stack":
        stacked = layout.get("stacked")
        if isinstance(stacked, list) and not stacked:
            return f"a tied.Stack of {layout.get('n')} members with nothing stacked (every object broadcast)"
        shown = (
            ", ".join(str(p) if p else "the member itself" for p in stacked)
            if isinstance(stacked, list)
            else stacked
        )
        return f"a tied.Stack of {layout.get('n')} members whose stacked places (in the member) are: {shown}"
    return json.dumps(layout, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Match:
    """What `match` found: ``like``'s structure and, per unique array of ``like``, what to read into it.

    Attributes:
        gdef: ``like``'s GraphDef (`build` rebuilds it).
        like: ``like``'s unique leaves, in flatten order (arrays or ``jax.ShapeDtypeStruct``).
        entries: for each, the manifest's array entry (a dict with ``name``, ``dtype``, ``shape``,
            ``places`` and the format's own fields); for `match_keys`, ``{"name", "keys"}``.
        paths: for each, the keystr paths of its places in ``like``.
    """

    gdef: GraphDef
    like: list
    entries: list[dict]
    paths: list[tuple[str, ...]]


def _check_leaf(
    where: str, place: str, leaf: Any, shape: Sequence[int], dtype: str, key: str | None = None
) -> None:
    if (
        not is_key(leaf)
        and is_abstract(leaf)
        and jax.dtypes.canonicalize_dtype(leaf.dtype) != np.dtype(leaf.dtype)
    ):
        raise CheckpointError(
            f"{where}: like has a jax.ShapeDtypeStruct of dtype {dtype_name(leaf)} at {keystr(place)}, "
            f"which loads as a JAX array, but JAX holds {dtype_name(leaf)} only with jax_enable_x64 set. "
            "Enable it, or put a numpy array of that dtype in like."
        )
    want = stored(leaf)
    got = (tuple(shape), dtype, key)
    if want != got:
        what = "shape" if want[0] != got[0] else "dtype" if want[1] != got[1] else "key implementation"
        if (want[2] is None) != (got[2] is None):
            what = "kind of array"
        raise CheckpointError(
            f"{where}: the {what} differs at {keystr(place)}: the file has {_show_stored(*got)}, like has "
            f"{_show_stored(*want)}. Build `like` with the saved model's sizes and dtypes (or cast after "
            "loading)."
        )


_PARTIAL = (
    "(The file was saved with tied.save(only=...): it holds some arrays and a fingerprint of the rest "
    "of the model, which like must match: the same places, ties, shapes and dtypes as the model the "
    "arrays were saved from.)"
)


def _structure(
    where: str, doc: dict, gdef: GraphDef, placing: _Placing, like_ids: list[list[tuple]]
) -> tuple[list[list[tuple]], dict[tuple, int]]:
    """Refuse a file whose views, layouts, shared nodes, array places or ties differ from
    ``like``'s (the first difference named); return ``like``'s array places (`_array_ids`) and
    the file's array entry at each place."""
    like_views = gdef.views()
    like_view_ids = _ids([v.paths for v in like_views])
    file_view_ids = _ids([v["places"] for v in doc["views"]])
    like_v = {p: (fn_name(v.fn), v.source) for v, ids in zip(like_views, like_view_ids) for p in ids}
    file_v = {p: (v["fn"], v["source"]) for v, ids in zip(doc["views"], file_view_ids) for p in ids}
    if len(file_v) != sum(len(ids) for ids in file_view_ids):
        raise corrupt(where, "a place is listed under two views")
    for p in sorted(set(like_v) | set(file_v)):
        lv, fv = like_v.get(p), file_v.get(p)
        if lv is None or fv is None:
            fn, source = lv or fv  # type: ignore[misc]
            side, other = ("like", "the file") if lv else ("the file", "like")
            raise CheckpointError(
                f"{where}: {keystr(p[0])} is a view ({fn} of {keystr(source)}) in {side} but "
                f"not in {other}. Build `like` with the same tied.view places as the saved model."
            )
        if lv != fv:
            raise CheckpointError(
                f"{where}: the view at {keystr(p[0])} differs: like has {lv[0]} of "
                f"{keystr(lv[1])}, the file has {fv[0]} of {keystr(fv[1])}."
            )
    _layouts_differ(where, doc, gdef, placing)
    _groups_differ(where, "node", _ids(gdef.shared_node_paths()), _ids(doc["shared_nodes"]))

    file_ids = _array_ids([a["places"] for a in doc["arrays"]], [a.get("place_keys") for a in doc["arrays"]])
    like_at = {p: i for i, ids in enumerate(like_ids) for p in ids}
    file_at = {p: k for k, ids in enumerate(file_ids) for p in ids}
    only_like = [p for p in like_at if p not in file_at]
    if only_like:
        raise _missing(where, only_like, "like", "the file", {p for p, _ in file_at})
    only_file = [p for p in file_at if p not in like_at]
    if only_file:
        raise _missing(where, only_file, "the file", "like", {p for p, _ in like_at})
    _groups_differ(where, "array", like_ids, file_ids)
    return like_ids, file_at


def _check_left_out(
    where: str, place: str, leaf: Any, shape: Sequence[int], dtype: str, key: str | None = None
) -> None:
    """An array the file left out (`tied.save(only=...)`) stays like's own, so like must have there
    exactly what the saved model had: nothing is read, cast or transformed."""
    if isinstance(leaf, jax.ShapeDtypeStruct):  # the result would hold it as the base's value
        raise CheckpointError(
            f"{where}: like has no value at {keystr(place)} (a jax.ShapeDtypeStruct), which the file "
            "leaves out (saved with tied.save(only=...)): the file holds some arrays, and the rest are "
            "like's own. Pass the base model itself (its arrays) as like."
        )
    want, got = stored(leaf), (tuple(shape), dtype, key)
    if want != got:
        what = "shape" if want[0] != got[0] else "dtype" if want[1] != got[1] else "kind of array"
        raise CheckpointError(
            f"{where}: the {what} differs at {keystr(place)}, which the file leaves out (saved with "
            f"tied.save(only=...)): the model it was saved from had {_show_stored(*got)} there, like has "
            f"{_show_stored(*want)}. like is another base; load the file into the model its arrays "
            "were saved from."
        )


def match(doc: dict, like: Any, where: str, check: Callable[..., None] | None = None) -> Match:
    """Check a (validated) manifest against ``like`` and pair each unique array of ``like`` with an entry.

    Views are compared first (a view changes the places below it, so this names
    the cause), then shared nodes, then the places and ties of arrays, then
    shapes and dtypes; the first difference raises, naming the path and both
    sides. Nothing is read or built.

    Args:
        doc: a manifest that passed `validate`.
        like: the object graph to load into; leaves may be arrays or ``jax.ShapeDtypeStruct``.
        where: the checkpoint's path, for messages.
        check: what checks a leaf's stored shape and dtype (default `_check_leaf`; `tied.load`'s
            ``transform`` and ``dtype`` check after converting instead).

    Returns:
        A `Match`.

    Raises:
        CheckpointError: any difference between the manifest and ``like``.

    Examples:
        >>> import jax
        >>> from tied._checkpoint.manifest import describe, match
        >>> from tied._checkpoint.document import validate
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d, Dense(d.weight, None))
        >>> leaves, doc = describe(model)
        >>> m = match(validate(doc, "ckpt"), like=model, where="ckpt")
        >>> [e["name"] for e in m.entries]          # one entry per unique array of like
        ['.layers[0].weight', '.layers[0].bias']
    """
    leaves, gdef = flatten(like)
    placing = _Placing(gdef)
    paths = [[placing.paths[t] for t in ts] for ts in placing.arrays]
    twice = written_counts(paths)
    keys = [
        [placing.keys(t) for t in ts] if any(twice[p] > 1 for p in ps) else None
        for ps, ts in zip(paths, placing.arrays)
    ]

    try:
        like_ids, file_at = _structure(where, doc, gdef, placing, _array_ids(paths, keys))
    except CheckpointError as e:
        if any(a.get("left_out") for a in doc["arrays"]):
            raise CheckpointError(f"{e} {_PARTIAL}") from None
        raise

    entries = []
    marks = doc["version"] >= 3  # earlier files do not say which arrays are state
    for leaf, ids, is_state in zip(leaves, like_ids, gdef.state_leaves()):
        a = doc["arrays"][file_at[ids[0]]]
        # An array the file left out (`tied.save(only=...)`) is like's own: exactly the saved base's.
        (_check_left_out if a.get("left_out") else check or _check_leaf)(
            where, ids[0][0], leaf, a["shape"], a["dtype"], a.get("key")
        )
        if marks and a.get("state", False) != is_state:
            kinds = ("a parameter", "state") if is_state else ("state", "a parameter")
            raise CheckpointError(
                f"{where}: {keystr(ids[0][0])} is {kinds[0]} in the file but {kinds[1]} in like (state sits "
                "below a tied.State or another state cell). Build `like` as the saved model was built."
            )
        entries.append(a)
    return Match(gdef, leaves, entries, [tuple(ps) for ps in paths])


# ---------------------------------------------------------------- building the loaded tree


def place_like(x: np.ndarray, leaf: Any) -> Any:
    """Put a host array where ``like``'s leaf is: numpy stays numpy (``x`` itself), a committed
    JAX array or a ``ShapeDtypeStruct`` with a sharding gives ``jax.device_put`` onto that
    sharding, anything else an uncommitted JAX array on the default device."""
    if isinstance(leaf, np.ndarray):
        return x
    if is_key(leaf) and not is_key(x):  # key data read from the file: a typed key again
        x = jax.random.wrap_key_data(jax.device_put(x), impl=key_impl(leaf))
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and (is_abstract(leaf) or getattr(leaf, "committed", False)):
        return jax.device_put(x, sharding)
    return jax.device_put(x)


def build(m: Match, arrays: Sequence[Any]) -> Any:
    """The loaded tree: ``like``'s structure with ``arrays[i]`` at every place of its unique array ``i``.

    ``arrays`` must already be placed (`place_like`, or restored onto the
    sharding by the format); each must have the shape and dtype of ``like``'s
    leaf, which is checked again here so that a format's bug cannot build a
    wrong tree.

    Examples:
        >>> import jax, numpy as np
        >>> from tied._checkpoint.manifest import build, describe, match, place_like
        >>> from tied._checkpoint.document import validate
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d, Dense(d.weight, d.bias))
        >>> leaves, doc = describe(model)
        >>> m = match(validate(doc, "ckpt"), like=model, where="ckpt")
        >>> host_arrays = [np.asarray(x) for x in leaves]   # as a format reads them
        >>> back = build(m, [place_like(x, leaf) for x, leaf in zip(host_arrays, m.like)])
        >>> back.layers[0].weight is back.layers[1].weight
        True
    """
    if len(arrays) != len(m.like):
        raise CheckpointError(f"{len(arrays)} arrays were read for {len(m.like)} unique arrays of like.")
    arrays = [
        jax.random.wrap_key_data(x, impl=key_impl(leaf)) if is_key(leaf) and not is_key(x) else x
        for x, leaf in zip(arrays, m.like)
    ]
    for x, leaf, ps in zip(arrays, m.like, m.paths):
        _check_leaf("loading", ps[0], leaf, *stored(x))
    return unflatten(m.gdef, list(arrays))


def nbytes(dtype: np.dtype, shape: Sequence[int]) -> int:
    """The bytes of an array of this dtype and shape."""
    return math.prod(shape) * dtype.itemsize
