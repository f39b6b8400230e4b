"""The manifest as a stored document: its format marker and versions, `pack` and `validate`.

`_manifest` builds a manifest from a model (`describe`) and checks it against
``like`` (`match`); this module is about the JSON document itself, so that every
format stores and reads it alike. `pack` writes each place as its keystr path
(readable in the file) or, for a deep model whose paths add up to more than a
million characters, as an index into a *place table* (each place its parent's
index and its own keystr piece), so the document grows with the number of places,
not with the square of the depth. `validate` checks a document read from disk
field by field (a hostile or corrupt one raises `CheckpointError`, never a
``KeyError`` or ``TypeError``) and unfolds a place table into paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._core import Located

__all__ = [
    "CheckpointError",
    "Manifest",
    "PlaceTable",
    "FORMAT",
    "PARTIAL",
    "READS",
    "VERSION",
    "corrupt",
    "is_int",
    "keystr",
    "pack",
    "valid_shape",
    "validate",
    "written_counts",
]

FORMAT = "tied"
# 1: the single-file format before the manifest was split out (zlib CRC-32 per array);
# 2: the same manifest, and the checksum algorithm is named by the format that stores it.
# 3: places as a table of (parent, keystr piece) (`pack`), typed keys, state marked.
# 4: the layouts of nodes whose static data gives their arrays' meaning (a tied.Stack's stacked places).
# 5: arrays left out by `tied.save(only=...)`, described (``"left_out": true``) but not stored; written
#    only by such a save, so that a tied that reads 4 refuses the file by its version.
VERSION = 4
PARTIAL = 5
READS = (1, 2, 3, 4, 5)
_PATHS_INLINE = 1_000_000  # past this many characters of paths, `pack` writes the place table
_MAX_PATH_CHARS = 1 << 30  # the most characters a stored place table may unfold into
_MAX_NDIM = 64


class CheckpointError(Located, ValueError):
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


class PlaceTable(NamedTuple):
    """Every place of a graph as ``[parent, keystr piece]`` (the root ``[-1, ""]``), and the places
    (indices into it) of each array, each shared node's group, each view (with its source's) and
    each node with a layout."""

    places: list[list]
    arrays: list[list[int]]
    shared: list[list[int]]
    views: list[tuple[list[int], int | None]]
    layouts: list[list[int]]


class Manifest(dict):
    """A manifest as `tied._checkpoint.manifest.describe` gives it: the JSON document (this dict), and
    beside it
    (not part of the document) its `PlaceTable`, which `pack` writes instead of the paths where
    they grow too long, and the tree's GraphDef, from which `manifest.every_place` gives each
    array's places at every place of a shared node (a place ``keys=``, ``transform=`` and
    ``only=`` of `tied.save` may name)."""

    table: PlaceTable | None = None
    gdef: Any = None  # the described tree's GraphDef (`manifest.every_place` reads it)
    leaves: list | None = None  # the tree's own unique arrays (typed keys as keys), for `only=`
    every: list[list[str]] | None = None  # every place of each array, below shared nodes too


def pack(doc: dict) -> dict:
    """The document `describe` gives, as a format stores it (`validate` reads either form back).

    Places are written as keystr paths, readable in the file, unless those paths add up to more
    than a million characters (a deep model, whose paths grow with its depth): then they are
    written only as indices into the place table (each place its parent's index and its own keystr
    piece), so the document grows with the number of places, not with the sum of their lengths.

    Examples:
        >>> import numpy as np
        >>> from tied._checkpoint.manifest import describe
        >>> from tied._checkpoint.document import pack, validate
        >>> leaves, doc = describe({"a": {"b": np.zeros(2)}})
        >>> pack(doc)["arrays"][0]["places"]
        ["['a']['b']"]
        >>> deep = {"w": np.zeros(1)}
        >>> for _ in range(2000):
        ...     deep = {"w": np.zeros(1), "next": deep}
        >>> stored = pack(describe(deep)[1])
        >>> stored["place_table"][:3]        # [parent, key]: the root, ['next'], ['next']['next']
        [[-1, ''], [0, "['next']"], [1, "['next']"]]
        >>> validate(stored, "ckpt")["arrays"][0]["places"][0][-21:]
        "['next']['next']['w']"
    """
    size = sum(len(p) for a in doc["arrays"] for p in a["places"])
    size += sum(len(p) for g in doc["shared_nodes"] for p in g)
    size += sum(len(p) for v in doc["views"] for p in v["places"])
    size += sum(len(p) for v in doc.get("layouts", ()) for p in v["places"])
    table = getattr(doc, "table", None)
    if table is None or size <= _PATHS_INLINE:
        return dict(doc)
    out = {k: v for k, v in doc.items() if k != "shared_nodes"}
    out["place_table"] = table.places
    out["shared_at"] = table.shared
    out["arrays"] = [
        {k: v for k, v in a.items() if k not in ("places", "place_keys")} | {"at": at}
        for a, at in zip(doc["arrays"], table.arrays)
    ]
    out["views"] = [
        {k: v for k, v in a.items() if k not in ("places", "source")}
        | {"at": at}
        | ({} if source is None else {"source_at": source})
        for a, (at, source) in zip(doc["views"], table.views)
    ]
    out["layouts"] = [{"layout": a["layout"], "at": at} for a, at in zip(doc["layouts"], table.layouts)]
    return out


def written_counts(paths: Sequence[Sequence[str]]) -> dict[str, int]:
    """How many places are written as each path."""
    count: dict[str, int] = {}
    for ps in paths:
        for p in ps:
            count[p] = count.get(p, 0) + 1
    return count


# ---------------------------------------------------------------- reading a document


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
    if "place_table" in doc:
        _unpack(doc, bad)
    _check_arrays(arrays, version, bad, paths_list)
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
    _check_layouts(doc, version, bad, paths_list)
    if not isinstance(doc.get("user", {}), dict):
        raise bad("'user' is not an object")
    return doc


def _check_arrays(
    arrays: list, version: int, bad: Callable[[str], CheckpointError], paths_list: Callable
) -> None:
    """The array entries: a unique tensor name (none for an array left out by ``only=``, version
    5 on), a dtype name, a shape, places (with their keys where two are written alike)."""
    named: set[str] = set()
    for k, a in enumerate(arrays):
        if not isinstance(a, dict):
            raise bad(f"array {k} is not an object")
        if "left_out" in a and (a["left_out"] is not True or version < PARTIAL):
            raise bad(f"array {k} has a left_out mark that is not true in a version {PARTIAL} manifest")
        name = a.get("name")
        if a.get("left_out"):  # described, not stored: no tensor of its own
            a.pop("name", None)
            name = f"left out {k}"  # for the messages below
        elif not isinstance(name, str):
            raise bad(f"array {k} has no tensor name (found {type(name).__name__})")
        elif name in named:
            raise bad(f"array {k} names tensor {name!r}, which another array names too")
        else:
            named.add(name)
        if not isinstance(a.get("dtype"), str):
            raise bad(f"array {name!r} has no dtype name")
        if not valid_shape(a.get("shape")):
            raise bad(f"array {name!r} has an invalid shape {a.get('shape')!r}")
        paths_list(a.get("places"), f"array {name!r} places")
        if "key" in a and not isinstance(a["key"], str):
            raise bad(f"array {name!r} has a key implementation that is not a name")
        if "state" in a and not isinstance(a["state"], bool):
            raise bad(f"array {name!r} has a state mark that is not a boolean")
        if "place_keys" in a:
            ks = a["place_keys"]
            if (
                not isinstance(ks, list)
                or len(ks) != len(a["places"])
                or not all(isinstance(k, list) and all(isinstance(s, str) for s in k) for k in ks)
            ):
                raise bad(f"array {name!r} place_keys is not a list of keys for each place")
    written = written_counts([a["places"] for a in arrays])
    placed: set[tuple] = set()
    for a in arrays:
        for j, p in enumerate(a["places"]):
            if written[p] > 1:  # a tree that writes places alike records their keys
                if "place_keys" not in a:
                    raise bad(f"the place {keystr(p)} is listed twice, without keys to tell them apart")
                if (p, tuple(a["place_keys"][j])) in placed:
                    raise bad(f"the place {keystr(p)} is listed twice with the same keys")
                placed.add((p, tuple(a["place_keys"][j])))


def _check_layouts(
    doc: dict, version: int, bad: Callable[[str], CheckpointError], paths_list: Callable
) -> None:
    """The layouts (version 4 on): a list of ``{"places": [...], "layout": ...}``; an earlier
    document has none (`match` then says it cannot check them)."""
    if version < 4:
        doc.pop("layouts", None)
        return
    layouts = doc.get("layouts")
    if not isinstance(layouts, list):
        raise bad("'layouts' is not a list")
    for e in layouts:
        if not isinstance(e, dict) or "layout" not in e:
            raise bad("a layout entry has no layout")
        paths_list(e.get("places"), "a layout's places")
        ks = e.get("place_keys")
        if (
            not isinstance(ks, list)
            or len(ks) != len(e["places"])
            or not all(isinstance(k, list) and all(isinstance(p, str) for p in k) for k in ks)
            or any("".join(k) != p for k, p in zip(ks, e["places"]))
        ):
            raise bad("a layout's place_keys are not the keys of each of its places")


def _unpack(doc: dict, bad: Callable[[str], CheckpointError]) -> None:
    """Unfold a stored place table (`pack`) into the keystr paths the rest of the reader uses, in
    place: each array's ``places`` (and ``place_keys`` where two places are written alike), the
    shared nodes' places, each view's places and source."""
    table = doc["place_table"]
    if not isinstance(table, list) or not table:
        raise bad("'place_table' is not a non-empty list")
    parents, pieces, length, total = [], [], [], 0
    for t, e in enumerate(table):
        if not (isinstance(e, list) and len(e) == 2 and is_int(e[0]) and isinstance(e[1], str)):
            raise bad(f"place {t} is not a [parent, key] pair")
        if not (e[0] == -1 if t == 0 else 0 <= e[0] < t):
            raise bad(f"place {t} names parent {e[0]!r}, which is not a place before it")
        n = len(e[1]) + (length[e[0]] if t else 0)
        length.append(n)
        total += n
        parents.append(e[0])
        pieces.append(e[1])
    if total > _MAX_PATH_CHARS:
        raise bad(f"its places unfold into {total:,} characters of paths (at most {_MAX_PATH_CHARS:,})")
    paths: list[str] = []
    for t, (parent, piece) in enumerate(zip(parents, pieces)):
        paths.append(paths[parent] + piece if t else piece)

    def at(x: Any, what: str) -> list[str]:
        if not isinstance(x, list) or not x or not all(is_int(t) and 0 <= t < len(paths) for t in x):
            raise bad(f"{what} is not a non-empty list of places")
        return [paths[t] for t in x]

    def keys(t: int) -> list[str]:
        out = []
        while t > 0:
            out.append(pieces[t])
            t = parents[t]
        return out[::-1]

    for k, a in enumerate(doc["arrays"]):
        if not isinstance(a, dict):
            raise bad(f"array {k} is not an object")
        a["places"] = at(a.get("at"), f"array {k}'s 'at'")
    written = written_counts([a["places"] for a in doc["arrays"]])
    for a in doc["arrays"]:
        a.pop("place_keys", None)
        if any(written[p] > 1 for p in a["places"]):
            a["place_keys"] = [keys(t) for t in a["at"]]
    shared = doc.get("shared_at")
    if not isinstance(shared, list):
        raise bad("'shared_at' is not a list")
    doc["shared_nodes"] = [at(g, "a shared node's 'at'") for g in shared]
    views = doc.get("views")
    if not isinstance(views, list) or not all(isinstance(v, dict) for v in views):
        raise bad("'views' is not a list of objects")
    for v in views:
        v["places"] = at(v.get("at"), "a view's 'at'")
        source = v.get("source_at")
        v["source"] = None if source is None else at([source], "a view's source")[0]
    layouts = doc.get("layouts", [])
    if not isinstance(layouts, list) or not all(isinstance(e, dict) for e in layouts):
        raise bad("'layouts' is not a list of objects")
    for e in layouts:
        e["places"] = at(e.get("at"), "a layout's 'at'")
        e["place_keys"] = [keys(t) for t in e["at"]]
