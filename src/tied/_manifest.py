"""The format-neutral half of checkpoints: a tree's places, ties and views as JSON, and `like`.

A checkpoint format (one safetensors file in `_safetensors.py`, an Orbax
directory in `_orbax.py`) stores two things: the bytes of each unique array,
and a *manifest*, the JSON document this module writes and reads. Everything
about sharing lives here, so a format only moves bytes:

* `describe(tree, metadata)` flattens a tree and returns its unique arrays and
  its manifest: for each unique array its tensor name, dtype, shape and every
  place (keystr paths); the places of each shared node; each view's places,
  function name and source; the caller's metadata. A format adds its own fields
  to an array's entry (a checksum, an offset) and stores the document.
* `validate(doc, where)` checks a manifest read back from disk field by field
  (types and values), so that a hostile or corrupt document raises
  `CheckpointError`, never a ``KeyError`` or ``TypeError``.
* `match(doc, like, where)` checks the manifest against ``like`` (places,
  views, shared nodes, tied arrays, shapes, dtypes; the first difference is
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
    >>> from tied._manifest import describe
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ._graph import GraphDef, flatten, unflatten
from ._inspect import _fn_name

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "Match",
    "build",
    "describe",
    "match",
    "match_keys",
    "place_like",
    "user_metadata",
    "validate",
]

FORMAT = "tied"
# 1: the single-file format before the manifest was split out (zlib CRC-32 per array);
# 2: the same manifest, and the checksum algorithm is named by the format that stores it.
VERSION = 2
READS = (1, 2)
_MAX_NDIM = 64


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read into the given model; the message says why and where.

    Examples:
        >>> import os, tempfile, jax.numpy as jnp, tied
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> w = jnp.ones((2, 2))
        >>> tied.save(path, {"embed": w, "head": w})        # a tied head, stored once
        >>> try:
        ...     tied.load(path, like={"embed": w, "head": jnp.ones((2, 2))})   # like has no tie
        ... except tied.CheckpointError as e:
        ...     print(str(e).split(": ", 1)[1])             # after the file's path
        the sharing differs at ['embed']: in like, ['embed'] is not tied to another place; in the
        file, ['embed'] and ['head'] are one array. Build `like` with the ties of the saved model.
    """


def keystr(path: str) -> str:
    """A place as messages show it (the root's empty path as ``<root>``)."""
    return path or "<root>"


# ---------------------------------------------------------------- abstract leaves in `like`


def is_abstract(leaf: Any) -> bool:
    """Whether a leaf of ``like`` describes an array without holding one (``jax.ShapeDtypeStruct``)."""
    return isinstance(leaf, jax.ShapeDtypeStruct)


def dtype_name(leaf: Any) -> str:
    """The numpy name of a leaf's dtype (``float32``, ``bfloat16``); byte order plays no part."""
    return np.dtype(leaf.dtype).name


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


def _tensor_names(arrays: Sequence[Sequence[str]]) -> list[str]:
    """One unique name per array: its first place, with ``#2``, ``#3``... where two places read alike."""
    names: list[str] = []
    seen: set[str] = {"__metadata__"}
    for paths in arrays:
        base = keystr(paths[0])
        name, k = base, 1
        while name in seen:
            k += 1
            name = f"{base}#{k}"
        seen.add(name)
        names.append(name)
    return names


def describe(tree: Any, metadata: Mapping[str, Any] | None = None) -> tuple[list, dict]:
    """Flatten ``tree`` and describe it as a JSON-able manifest.

    Args:
        tree: the object graph to save.
        metadata: the caller's JSON-serialisable values under string keys (or None).

    Returns:
        ``(leaves, manifest)``: the unique arrays in flatten order, and a dict
        ``{"format": "tied", "version": 2, "arrays": [...], "shared_nodes": [...],
        "views": [...], "user": {...}}``. ``arrays[i]`` describes ``leaves[i]``:
        ``{"name", "dtype", "shape", "places"}``, with ``name`` unique (the
        first place's keystr, ``<root>`` for the root) and ``dtype`` a numpy
        dtype name. A format adds its own fields to these entries before storing
        the document (``json.dumps`` writes it).

    Raises:
        CheckpointError: metadata that is not a JSON-able mapping with string keys.

    Examples:
        >>> import jax
        >>> from tied._manifest import describe
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
    paths, keys = _array_places(gdef)
    names = _tensor_names(paths)
    written = _written(paths)
    arrays = []
    for leaf, name, ps, ks in zip(leaves, names, paths, keys):
        entry = {"name": name, "dtype": dtype_name(leaf), "shape": [int(d) for d in leaf.shape], "places": ps}
        if any(written[p] > 1 for p in ps):
            entry["place_keys"] = [list(k) for k in ks]
        arrays.append(entry)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "arrays": arrays,
        "shared_nodes": [list(g) for g in gdef.shared_node_paths()],
        "views": _views(gdef),
        "user": user,
    }
    return leaves, doc


def _array_places(gdef: GraphDef) -> tuple[list[list[str]], list[list[tuple[str, ...]]]]:
    """For each unique array, its places in walk order, and each place's keys: the keystr
    pieces from the root (``(".encoder", ".weight")``), which tell apart places written alike."""
    paths: list[list[str]] = [[] for _ in range(gdef.num_leaves)]
    keys: list[list[tuple[str, ...]]] = [[] for _ in range(gdef.num_leaves)]
    above: list[tuple[str, tuple[str, ...]]] = []  # the node entered at each depth, with its keys
    for p in gdef.walk_places():
        if p.depth == 0:
            mine: tuple[str, ...] = ()
        else:
            parent, parent_keys = above[p.depth - 1]
            mine = (*parent_keys, p.path[len(parent) :])
        if p.kind == "array":
            paths[p.index].append(p.path)
            keys[p.index].append(mine)
        elif p.kind != "static" and p.first:  # a node whose children come next
            del above[p.depth :]
            above.append((p.path, mine))
    return paths, keys


def _written(paths: Sequence[Sequence[str]]) -> dict[str, int]:
    """How many places are written as each path."""
    count: dict[str, int] = {}
    for ps in paths:
        for p in ps:
            count[p] = count.get(p, 0) + 1
    return count


def _array_ids(paths: Sequence[Sequence[str]], keys: Sequence[Sequence[Any] | None]) -> list[list[tuple]]:
    """Each array place as ``(path, keys)``: keys ``()`` where no other place is written alike, else
    the place's keys (which `validate` makes sure a manifest has for such places)."""
    written = _written(paths)
    return [
        [(p, tuple(ks[j]) if written[p] > 1 else ()) for j, p in enumerate(ps)]  # type: ignore[index]
        for ps, ks in zip(paths, keys)
    ]


def _views(gdef: GraphDef) -> list[dict]:
    return [{"places": list(v.paths), "fn": _fn_name(v.fn), "source": v.source} for v in gdef.views()]


# ---------------------------------------------------------------- reading a manifest


def corrupt(where: str, what: str) -> CheckpointError:
    """The error for a checkpoint that cannot be what tied wrote."""
    return CheckpointError(
        f"{where}: not a readable tied checkpoint: {what}. The file is truncated, corrupted or was not "
        "written by tied.save; nothing was loaded."
    )


def is_int(x: Any) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(x, int) and not isinstance(x, bool)


def valid_shape(x: Any) -> bool:
    """A JSON list of non-negative integers of at most 64 dimensions."""
    return isinstance(x, list) and len(x) <= _MAX_NDIM and all(is_int(d) and d >= 0 for d in x)


def validate(doc: Any, where: str) -> dict:
    """Check a manifest read from disk, field by field; return it.

    Every field the loader reads must have the type and value `describe`
    gives it: a hostile or corrupted document raises `CheckpointError`, never a
    ``KeyError`` or ``TypeError``. Fields a format adds to the array entries
    are the format's to check.

    Args:
        doc: the parsed JSON document.
        where: the checkpoint's path, for messages.

    Returns:
        ``doc`` itself.

    Raises:
        CheckpointError: a malformed manifest, or one of a version this tied does not read.
    """

    def bad(what: str) -> CheckpointError:
        return corrupt(where, f"the '{FORMAT}' metadata is malformed: {what}")

    def paths_list(x: Any, what: str) -> None:
        if not isinstance(x, list) or not x or not all(isinstance(p, str) for p in x):
            raise bad(f"{what} is not a non-empty list of paths")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("no format marker")
    version = doc.get("version")
    if not is_int(version) or version not in READS:
        raise CheckpointError(
            f"{where}: tied checkpoint version {version!r}; this tied reads versions "
            f"{', '.join(map(str, READS))}. Load it with the tied release that wrote it."
        )
    arrays = doc.get("arrays")
    if not isinstance(arrays, list):
        raise bad("'arrays' is not a list")
    named: set[str] = set()
    for k, a in enumerate(arrays):
        if not isinstance(a, dict):
            raise bad(f"array {k} is not an object")
        name = a.get("name")
        if not isinstance(name, str):
            raise bad(f"array {k} has no tensor name (found {type(name).__name__})")
        if name in named:
            raise bad(f"array {k} names tensor {name!r}, which another array names too")
        named.add(name)
        if not isinstance(a.get("dtype"), str):
            raise bad(f"array {name!r} has no dtype name")
        if not valid_shape(a.get("shape")):
            raise bad(f"array {name!r} has an invalid shape {a.get('shape')!r}")
        paths_list(a.get("places"), f"array {name!r} places")
        if "place_keys" in a:
            ks = a["place_keys"]
            if (
                not isinstance(ks, list)
                or len(ks) != len(a["places"])
                or not all(isinstance(k, list) and all(isinstance(s, str) for s in k) for k in ks)
            ):
                raise bad(f"array {name!r} place_keys is not a list of keys for each place")
    written = _written([a["places"] for a in arrays])
    placed: set[tuple] = set()
    for a in arrays:
        for j, p in enumerate(a["places"]):
            if written[p] > 1:  # a tree that writes places alike records their keys
                if "place_keys" not in a:
                    raise bad(f"the place {keystr(p)} is listed twice, without keys to tell them apart")
                if (p, tuple(a["place_keys"][j])) in placed:
                    raise bad(f"the place {keystr(p)} is listed twice with the same keys")
                placed.add((p, tuple(a["place_keys"][j])))
    nodes = doc.get("shared_nodes")
    if not isinstance(nodes, list):
        raise bad("'shared_nodes' is not a list")
    for g in nodes:
        paths_list(g, "a shared node's places")
    views = doc.get("views")
    if not isinstance(views, list):
        raise bad("'views' is not a list")
    for v in views:
        if not isinstance(v, dict) or not isinstance(v.get("fn"), str):
            raise bad("a view entry has no function name")
        paths_list(v.get("places"), "a view's places")
        if "source" not in v or not (v["source"] is None or isinstance(v["source"], str)):
            raise bad("a view's source is not a path")
    if not isinstance(doc.get("user", {}), dict):
        raise bad("'user' is not an object")
    return doc


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


def _missing(
    where: str, ids: list[tuple], side: str, other: str, other_paths: Any = ()
) -> CheckpointError:
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


def _check_leaf(where: str, place: str, leaf: Any, shape: Sequence[int], dtype: str) -> None:
    if is_abstract(leaf) and jax.dtypes.canonicalize_dtype(leaf.dtype) != np.dtype(leaf.dtype):
        raise CheckpointError(
            f"{where}: like has a jax.ShapeDtypeStruct of dtype {dtype_name(leaf)} at {keystr(place)}, "
            f"which loads as a JAX array, but JAX holds {dtype_name(leaf)} only with jax_enable_x64 set. "
            "Enable it, or put a numpy array of that dtype in like."
        )
    want = (tuple(int(d) for d in leaf.shape), dtype_name(leaf))
    got = (tuple(shape), dtype)
    if want != got:
        what = "shape" if want[0] != got[0] else "dtype"
        raise CheckpointError(
            f"{where}: the {what} differs at {keystr(place)}: the file has {got[0]} {got[1]}, like has "
            f"{want[0]} {want[1]}. Build `like` with the saved model's sizes and dtypes (or cast after "
            "loading)."
        )


def match(doc: dict, like: Any, where: str) -> Match:
    """Check a (validated) manifest against ``like`` and pair each unique array of ``like`` with an entry.

    Views are compared first (a view changes the places below it, so this names
    the cause), then shared nodes, then the places and ties of arrays, then
    shapes and dtypes; the first difference raises, naming the path and both
    sides. Nothing is read or built.

    Args:
        doc: a manifest that passed `validate`.
        like: the object graph to load into; leaves may be arrays or ``jax.ShapeDtypeStruct``.
        where: the checkpoint's path, for messages.

    Returns:
        A `Match`.

    Raises:
        CheckpointError: any difference between the manifest and ``like``.

    Examples:
        >>> import jax
        >>> from tied._manifest import describe, match, validate
        >>> from tied.nn import Chain, Dense
        >>> d = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d, Dense(d.weight, None))
        >>> leaves, doc = describe(model)
        >>> m = match(validate(doc, "ckpt"), like=model, where="ckpt")
        >>> [e["name"] for e in m.entries]          # one entry per unique array of like
        ['.layers[0].weight', '.layers[0].bias']
    """
    leaves, gdef = flatten(like)
    paths, keys = _array_places(gdef)

    like_views = gdef.views()
    like_view_ids = _ids([v.paths for v in like_views])
    file_view_ids = _ids([v["places"] for v in doc["views"]])
    like_v = {p: (_fn_name(v.fn), v.source) for v, ids in zip(like_views, like_view_ids) for p in ids}
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
    _groups_differ(where, "node", _ids(gdef.shared_node_paths()), _ids(doc["shared_nodes"]))

    like_ids = _array_ids(paths, keys)
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

    entries = []
    for leaf, ids in zip(leaves, like_ids):
        a = doc["arrays"][file_at[ids[0]]]
        _check_leaf(where, ids[0][0], leaf, a["shape"], a["dtype"])
        entries.append(a)
    return Match(gdef, leaves, entries, [tuple(ps) for ps in paths])


def match_keys(
    keys: Mapping[str, tuple[str, Sequence[int]]],
    like: Any,
    where: str,
    *,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    allow_extra: bool = False,
) -> Match:
    """Pair each unique array of ``like`` with a key of a plain file (no tie metadata).

    A file key names a place of ``like`` by its keystr path (after ``rename``:
    a mapping from file key to path, keys it lacks kept as they are, or a
    function). Each unique array of ``like`` is read from any one of its places
    that the file holds (a file that stores a tied weight once names one place);
    two keys naming places of one array must hold equal shapes and dtypes.

    Args:
        keys: the file's tensors, ``{key: (numpy dtype name, shape)}``.
        like: the object graph to load into.
        where: the file's path, for messages.
        rename: file key -> place of ``like``.
        allow_extra: accept file keys that name no place of ``like`` (they are not read).

    Returns:
        A `Match` whose entries are ``{"name": first file key, "keys": every file key}``.

    Raises:
        CheckpointError: a unique array none of whose places the file holds (naming
            those places), keys naming no place (listed) unless ``allow_extra``,
            two keys renamed to one place, a place path ``like`` writes twice, or a
            shape or dtype that differs.

    Examples:
        >>> import jax, tied
        >>> from tied._manifest import match_keys
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.Dense(emb.weight)}   # a tied head
        >>> keys = {"embed.weight": ("float32", [10, 4])}               # the file stores it once
        >>> m = match_keys(keys, like=model, where="hf.safetensors",
        ...                rename={"embed.weight": "['embed'].weight"})
        >>> m.entries
        [{'name': 'embed.weight', 'keys': ['embed.weight']}]
        >>> m.paths
        [("['embed'].weight", "['head'].weight")]
    """
    leaves, gdef = flatten(like)
    paths = list(gdef.leaf_paths())
    owner: dict[str, int] = {}
    ambiguous: set[str] = set()
    for i, ps in enumerate(paths):
        for p in ps:
            if p in owner and owner[p] != i:
                ambiguous.add(p)
            owner[p] = i
    if rename is None:
        to_path: Callable[[str], Any] = lambda k: k
    elif isinstance(rename, Mapping):
        to_path = lambda k: rename.get(k, k)
    elif callable(rename):
        to_path = rename
    else:
        raise CheckpointError(
            f"tied.load(rename=...) takes a mapping or a function from file key to path, got "
            f"{type(rename).__name__}."
        )

    found: dict[int, list[tuple[str, str]]] = {}
    extra: list[str] = []
    claimed: dict[str, str] = {}
    for key in keys:
        try:
            p = to_path(key)
        except Exception as e:
            raise CheckpointError(
                f"{where}: rename failed on the file key {key!r} ({type(e).__name__}: {e})."
            ) from e
        if p is None and allow_extra:  # rename says: leave this key unread
            continue
        if not isinstance(p, str):
            raise CheckpointError(
                f"{where}: rename turned the file key {key!r} into {p!r}; it must give a keystr path "
                "such as '.layers[0].weight'."
            )
        if p in claimed:
            raise CheckpointError(
                f"{where}: the file keys {claimed[p]!r} and {key!r} both name the place {keystr(p)}."
            )
        claimed[p] = key
        if p in ambiguous:
            raise CheckpointError(
                f"{where}: like has two places written {keystr(p)} (an attribute whose name holds a '.' "
                "or brackets), so a file key cannot name one of them. Rename the attribute."
            )
        if p not in owner:
            extra.append(key)
            continue
        found.setdefault(owner[p], []).append((p, key))
    if extra and not allow_extra:
        shown = ", ".join(repr(k) for k in extra[:10])
        shown += f" and {len(extra) - 10} more" if len(extra) > 10 else ""
        raise CheckpointError(
            f"{where}: the file holds keys that name no place of like: {shown}. Map them with rename=..., "
            "or pass allow_extra=True to leave them unread."
        )
    entries = []
    for i, (leaf, ps) in enumerate(zip(leaves, paths)):
        hits = found.get(i)
        if not hits:
            raise CheckpointError(
                f"{where}: no key of the file holds the array at {' / '.join(keystr(p) for p in ps)}. "
                "Map the file's key to one of these places with rename=..., or give like an array "
                "the file has."
            )
        hits.sort(key=lambda hit: ps.index(hit[0]))  # in like's walk order, whatever the file's
        for p, key in hits:
            dtype, shape = keys[key]
            _check_leaf(where, p, leaf, shape, dtype)
        entries.append({"name": hits[0][1], "keys": [key for _, key in hits]})
    return Match(gdef, leaves, entries, paths)


# ---------------------------------------------------------------- building the loaded tree


def place_like(x: np.ndarray, leaf: Any) -> Any:
    """Put a host array where ``like``'s leaf is: numpy stays numpy (``x`` itself), a committed
    JAX array or a ``ShapeDtypeStruct`` with a sharding gives ``jax.device_put`` onto that
    sharding, anything else an uncommitted JAX array on the default device."""
    if isinstance(leaf, np.ndarray):
        return x
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
        >>> from tied._manifest import build, describe, match, place_like, validate
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
    for x, leaf, ps in zip(arrays, m.like, m.paths):
        _check_leaf("loading", ps[0], leaf, x.shape, dtype_name(x))
    return unflatten(m.gdef, list(arrays))


def nbytes(dtype: np.dtype, shape: Sequence[int]) -> int:
    """The bytes of an array of this dtype and shape."""
    return math.prod(shape) * dtype.itemsize
