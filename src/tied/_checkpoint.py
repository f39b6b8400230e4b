"""Checkpoints that keep ties: `save` and `load` over safetensors files.

A checkpoint is a plain safetensors file. Each unique array (as `tied.flatten`
finds it) is stored once, under the keystr path of its first place; the
file's string metadata holds, under the key ``"tied"``, a JSON document with
every place of every array, the shared nodes, the views, the dtype and shape of
every array, a CRC-32 of its bytes, and the caller's metadata.

Loading rebuilds nothing from the file but values: structure, static fields
and the view functions come from ``like``, which must have the file's places
and ties; everything is checked before any array is built. The file is never
unpickled and nothing it names is imported, looked up or called.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._graph import VIEW, GraphDef, flatten, place_paths, unflatten
from ._inspect import _fn_name

__all__ = ["CheckpointError", "save", "load", "load_metadata"]

FORMAT = "tied"
VERSION = 1
_MAX_HEADER = 100_000_000  # the bound the safetensors reference reader enforces
_MAX_NDIM = 64


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read into the given model; the message says why and where."""


# numpy dtype name <-> safetensors dtype tag. Packed sub-byte types (F4, F6) have no
# one-byte-per-element numpy layout and are left out on purpose.
_TAGS = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0",
}
_DTYPES: dict[str, np.dtype] = {}
for _name in list(_TAGS):
    _t = getattr(np, _name, None) if _name not in ("bool",) else np.bool_
    _t = _t if _t is not None else getattr(ml_dtypes, _name, None)
    if _t is None:  # an older ml_dtypes
        del _TAGS[_name]
        continue
    _DTYPES[_TAGS[_name]] = np.dtype(_t)
_NAMES = {tag: dt.name for tag, dt in _DTYPES.items()}


def _supported() -> str:
    return ", ".join(_TAGS)


def _keystr(path: str) -> str:
    return path or "<root>"


# ---------------------------------------------------------------- what the file records


def _describe(gdef: GraphDef) -> tuple[list[list[str]], list[list[str]], list[dict]]:
    """Places of each unique array, groups of places of each shared node, and the views."""
    places = place_paths(gdef)
    arrays = [list(p) for p in places.leaves]
    nodes = [list(p) for p in places.nodes if len(p) > 1]
    views = []
    for j, (kind, meta, refs) in enumerate(gdef.records):
        if kind == VIEW and places.nodes[j]:
            q, m = divmod(refs[0], 3)
            source = places.leaves[q][0] if m == 0 else places.nodes[q][0] if m == 1 else None
            views.append({"places": list(places.nodes[j]), "fn": _fn_name(meta), "source": source})
    return arrays, nodes, views


def _tensor_names(arrays: list[list[str]]) -> list[str]:
    names: list[str] = []
    seen: set[str] = {"__metadata__"}
    for paths in arrays:
        base = _keystr(paths[0])
        name, k = base, 1
        while name in seen:  # two keys with one repr; keep names unique
            k += 1
            name = f"{base}#{k}"
        seen.add(name)
        names.append(name)
    return names


# ---------------------------------------------------------------- save


def save(path: str | os.PathLike, tree: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
    """Write a model (or an optimiser state, or any object graph) to a safetensors file, ties and all.

    Each unique array is stored once, under the keystr path of its first place
    (so ``safetensors.numpy.load_file`` opens the file too); the JSON metadata
    under the key ``"tied"`` records every place, the shared nodes and the
    views. Only view *sources* are stored: a view is rebuilt by ``like``'s
    function at load time. The write is atomic: the data go to a temporary file
    in the same folder, which is flushed, fsynced and renamed over ``path``, so
    a crash or a full disk mid-save leaves an existing checkpoint untouched.

    Args:
        path: the file to write (by convention ending in ``.safetensors``).
        tree: the object graph; its arrays may have any dtype safetensors knows
            (bool, (u)int8..64, float16, bfloat16, float32, float64, complex64, float8).
        metadata: JSON-serialisable values under string keys (a step number, a
            config), read back with `tied.load_metadata`.

    Raises:
        CheckpointError: an array of a dtype safetensors cannot hold, or
            metadata that is not JSON; the message names the path.

    Example:
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))
        >>> tied.save("model.safetensors", model)        # weight and bias stored once
        >>> back = tied.load("model.safetensors", like=model)
        >>> back.layers[0].weight is back.layers[1].weight
        True
    """
    leaves, gdef = flatten(tree)
    arrays, nodes, views = _describe(gdef)
    names = _tensor_names(arrays)
    user = _user_metadata(metadata)

    # Everything that can be refused is checked before a byte is written.
    entries = []
    for leaf, paths in zip(leaves, arrays):
        dt = np.dtype(leaf.dtype)
        if dt.name not in _TAGS:
            raise CheckpointError(
                f"{_keystr(paths[0])}: an array of dtype {dt.name} cannot be stored in a safetensors "
                f"file (it holds {_supported()}). Cast it before saving, e.g. x.astype(jnp.complex64) "
                "for complex128."
            )
        entries.append((dt, tuple(int(d) for d in leaf.shape)))

    # Larger items first keeps every tensor aligned to its item size, as the safetensors writer does.
    order = sorted(range(len(leaves)), key=lambda i: -entries[i][0].itemsize)
    header: dict[str, Any] = {}
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for i in order:
        dt, shape = entries[i]
        n = math.prod(shape) * dt.itemsize
        offsets[i] = (pos, pos + n)
        pos += n

    # The bytes, one array at a time: host memory holds one array, never the whole model.
    def host(i: int) -> np.ndarray:
        try:
            a = np.ascontiguousarray(np.asarray(leaves[i]))
        except Exception as e:
            raise CheckpointError(
                f"{_keystr(arrays[i][0])}: could not read the array to save it ({type(e).__name__}: {e})."
            ) from e
        if sys.byteorder == "big":  # safetensors is little-endian
            a = a.byteswap()
        return a.reshape(-1).view(np.uint8)

    # The CRC needs the bytes, which we only want to fetch once: the header (which
    # holds the CRCs) is written last, into space reserved at the start.
    doc_arrays = [
        {"name": names[i], "dtype": entries[i][0].name, "shape": list(entries[i][1]), "places": arrays[i]}
        for i in range(len(leaves))
    ]
    for i in order:
        dt, shape = entries[i]
        header[names[i]] = {"dtype": _TAGS[dt.name], "shape": list(shape), "data_offsets": list(offsets[i])}

    def header_bytes(crcs: list[int]) -> bytes:
        for a, c in zip(doc_arrays, crcs):
            a["crc32"] = c
        doc = {"format": FORMAT, "version": VERSION, "arrays": doc_arrays, "shared_nodes": nodes}
        doc["views"] = views
        doc["user"] = user
        meta = {"__metadata__": {"format": FORMAT, FORMAT: json.dumps(doc, separators=(",", ":"))}}
        return json.dumps({**meta, **header}, separators=(",", ":"), ensure_ascii=False).encode()

    # A CRC-32 is at most 10 digits: reserve room for the widest header, pad with spaces.
    reserved = len(header_bytes([4294967295] * len(leaves)))
    reserved += -(8 + reserved) % 8
    _atomic_write(path, reserved, order, offsets, host, header_bytes, len(leaves))


def _user_metadata(metadata: Mapping[str, Any] | None) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise CheckpointError(
            f"tied.save(metadata=...) takes a mapping with string keys, got {type(metadata).__name__}."
        )
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=True))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"tied.save(metadata=...): the metadata must be JSON-serialisable ({e}). Convert arrays "
            "with .tolist() and objects to strings or numbers."
        ) from None


def _write_array(f: Any, data: np.ndarray) -> None:
    f.write(data)


def _atomic_write(path, reserved, order, offsets, host, header_bytes, n) -> None:
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # os.open with 0o666 lets the umask decide the mode, as for any new file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * (8 + reserved))
            crcs = [0] * n
            for i in order:
                data = host(i)
                assert data.nbytes == offsets[i][1] - offsets[i][0]
                crcs[i] = zlib.crc32(data)
                _write_array(f, data)
            head = header_bytes(crcs)
            head += b" " * (reserved - len(head))
            f.seek(0)
            f.write(len(head).to_bytes(8, "little") + head)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading the header


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a readable tied checkpoint: {what}. The file is truncated, corrupted or was not "
        "written by tied.save; nothing was loaded."
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_header(f: Any, path: str) -> tuple[dict, dict, int, int]:
    """The tensor table and the tied document, every field checked against the file's real size."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _corrupt(path, f"the file has {size} bytes, fewer than the 8 of a safetensors length prefix")
    n = int.from_bytes(f.read(8), "little")
    if n > _MAX_HEADER or n > size - 8:
        raise _corrupt(
            path,
            f"the header claims {n} bytes but the file has {size - 8} after the length prefix "
            f"(and headers are limited to {_MAX_HEADER})",
        )
    raw = f.read(n)
    if len(raw) != n:
        raise _corrupt(path, "the header ends early")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or FORMAT not in meta:
        raise CheckpointError(
            f"{path}: a safetensors file without tied's metadata (no '{FORMAT}' entry in __metadata__), "
            "so its places and ties are unknown. Load it with safetensors.numpy.load_file and put the "
            "arrays into the model yourself, or save it with tied.save."
        )
    if not isinstance(meta[FORMAT], str):
        raise _corrupt(path, f"the metadata entry '{FORMAT}' is not a string")
    try:
        doc = json.loads(meta[FORMAT])
    except (ValueError, RecursionError) as e:
        raise _corrupt(path, f"the metadata entry '{FORMAT}' is not JSON ({type(e).__name__})") from None
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _corrupt(path, f"tensor {name!r}: its entry is not an object")
        tag, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if tag not in _DTYPES:
            raise _corrupt(path, f"tensor {name!r}: unknown dtype {tag!r} (tied reads {', '.join(_DTYPES)})")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(_is_int(d) and d >= 0 for d in shape)
        ):
            raise _corrupt(path, f"tensor {name!r}: invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise _corrupt(path, f"tensor {name!r}: invalid data_offsets {offs!r}")
        begin, end = offs
        dt = _DTYPES[tag]
        nbytes = math.prod(shape) * dt.itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise _corrupt(
                path, f"tensor {name!r}: offsets {offs} do not span the {nbytes} bytes of shape {shape} {tag}"
            )
        if end > data_size:
            raise _corrupt(
                path,
                f"tensor {name!r}: its data ends at byte {end} of the data section, which has only "
                f"{data_size} bytes",
            )
        tensors[name] = (dt, tuple(shape), begin, end)
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise _corrupt(path, "tensors overlap or leave gaps in the data section")
        pos = end
    if pos != data_size:
        raise _corrupt(path, f"{data_size - pos} bytes follow the last tensor")
    return tensors, _check_doc(doc, tensors, path), data_start, size


def _check_doc(doc: Any, tensors: dict, path: str) -> dict:
    """The tied document, refused unless every field has the type and value it must have."""

    def bad(what: str) -> CheckpointError:
        return _corrupt(path, f"the '{FORMAT}' metadata is malformed: {what}")

    def paths_list(x: Any, what: str) -> list[str]:
        if not isinstance(x, list) or not x or not all(isinstance(p, str) for p in x):
            raise bad(f"{what} is not a non-empty list of paths")
        return x

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("no format marker")
    if doc.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: tied checkpoint version {doc.get('version')!r}; this tied reads version {VERSION}. "
            "Load it with the tied release that wrote it."
        )
    arrays = doc.get("arrays")
    if not isinstance(arrays, list):
        raise bad("'arrays' is not a list")
    named = set()
    for k, a in enumerate(arrays):
        if not isinstance(a, dict):
            raise bad(f"array {k} is not an object")
        name = a.get("name")
        if name not in tensors or name in named:
            raise bad(f"array {k} names tensor {name!r}, which the file does not hold (or twice)")
        named.add(name)
        dt, shape, _, _ = tensors[name]
        if a.get("dtype") != dt.name or a.get("shape") != list(shape):
            raise bad(
                f"array {name!r}: dtype/shape {a.get('dtype')}/{a.get('shape')} disagree with the header"
            )
        paths_list(a.get("places"), f"array {name!r} places")
        if not _is_int(a.get("crc32")):
            raise bad(f"array {name!r} has no crc32")
    if named != set(tensors):
        raise bad(f"tensors {sorted(set(tensors) - named)} are in the file but not in the metadata")
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
        if not (v.get("source") is None or isinstance(v.get("source"), str)):
            raise bad("a view's source is not a path")
    if not isinstance(doc.get("user", {}), dict):
        raise bad("'user' is not an object")
    return doc


def load_metadata(path: str | os.PathLike) -> dict:
    """The ``metadata`` given to `tied.save` for this checkpoint (after the file's header is checked).

    Example:
        >>> tied.save("ckpt.safetensors", model, metadata={"step": 500})
        >>> tied.load_metadata("ckpt.safetensors")
        {'step': 500}
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        _, doc, _, _ = _read_header(f, path)
    return doc.get("user", {})


# ---------------------------------------------------------------- load


def load(path: str | os.PathLike, *, like: Any) -> Any:
    """Read a checkpoint into a new object graph shaped like ``like``, with the file's values and ties.

    ``like`` gives the structure, the static fields and the view functions (the
    file holds data only); it must have the file's places and sharing. Every
    check runs before any array is built, so an error never leaves a partly
    loaded model. Arrays come back as ``like``'s do: a JAX array on ``like``'s
    sharing, or a numpy array.

    Args:
        path: a file written by `tied.save`.
        like: an object graph with the saved one's structure (a freshly
            initialised model, or ``opt.init(params)`` for an optimiser state).

    Returns:
        The new graph: where the file has one array at several places, the
        result has one object there (``is``), views of the loaded sources,
        and ``like``'s static fields.

    Raises:
        CheckpointError: the file is truncated, corrupted or hostile, or its
            places, sharing, dtypes or shapes differ from ``like``'s; the
            message names the path and both sides.

    Example:
        >>> tied.save("model.safetensors", model)
        >>> back = tied.load("model.safetensors", like=model)
        >>> back.layers[0].weight is back.layers[1].weight
        True
    """
    path = os.fspath(path)
    leaves, gdef = flatten(like)
    arrays, nodes, views = _describe(gdef)
    with open(path, "rb") as f:
        tensors, doc, data_start, _ = _read_header(f, path)
        match = _match(path, doc, leaves, arrays, nodes, views)
        new = []
        for i, a in enumerate(match):
            dt, shape, begin, end = tensors[a["name"]]
            out = np.empty(shape, dt)
            buf = out.reshape(-1).view(np.uint8)
            f.seek(data_start + begin)
            if f.readinto(buf) != end - begin:
                raise _corrupt(path, f"the data of {a['name']!r} ends early")
            if zlib.crc32(buf) != a["crc32"]:
                raise _corrupt(path, f"the bytes of {a['name']!r} do not match their CRC-32")
            if sys.byteorder == "big":
                out = out.byteswap()
            new.append(_like_leaf(out, leaves[i]))
    return unflatten(gdef, new)


def _like_leaf(x: np.ndarray, leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return x
    if getattr(leaf, "committed", False):
        return jax.device_put(x, leaf.sharding)
    return jnp.asarray(x)


def _private(path: str) -> bool:
    return any(part.startswith("_") for part in path.replace("[", ".").split(".")[1:] if part)


def _missing(path: str, paths: list[str], where: str, other: str) -> CheckpointError:
    shown = ", ".join(_keystr(p) for p in paths[:5]) + (
        f" and {len(paths) - 5} more" if len(paths) > 5 else ""
    )
    hint = ""
    if where == "the file" and any(_private(p) for p in paths):
        hint = (
            " A path naming a private attribute that `like` lacks is refused; tied never sets "
            "attributes the file names."
        )
    return CheckpointError(
        f"{path}: places in {where} but not in {other}: {shown}.{hint} The checkpoint was saved from a "
        "model with another structure; pass a `like` built the same way as the saved model."
    )


def _groups_differ(path: str, what: str, like_groups: list[list[str]], file_groups: list[list[str]]) -> None:
    """Raise if two sharing patterns (lists of groups of places) differ, naming which places."""
    like_of = {p: g for g in like_groups for p in g}
    file_of = {p: g for g in file_groups for p in g}

    def say(g: list[str] | None, p: str) -> str:
        if g is None or len(g) == 1:
            return f"{_keystr(p)} is not tied to another place"
        return " and ".join(_keystr(q) for q in g) + f" are one {what}"

    for side, groups, other in (("like", like_groups, file_of), ("the file", file_groups, like_of)):
        for g in groups:
            h = other.get(g[0])
            if h is None or set(h) != set(g):
                like_g, file_g = (g, h) if side == "like" else (h, g)
                raise CheckpointError(
                    f"{path}: the sharing differs at {_keystr(g[0])}: in like, {say(like_g, g[0])}; in the "
                    f"file, {say(file_g, g[0])}. Build `like` with the ties of the saved model."
                )


def _match(path: str, doc: dict, leaves: list, arrays: list, nodes: list, views: list) -> list[dict]:
    """For each unique array of ``like``, the file's entry for it; raises on any difference."""
    # Views first: a view changes the places below it, and this names the cause.
    like_views = {p: v for v in views for p in v["places"]}
    file_views = {p: v for v in doc["views"] for p in v["places"]}
    for p in sorted(set(like_views) | set(file_views)):
        lv, fv = like_views.get(p), file_views.get(p)
        if lv is None or fv is None:
            v = lv or fv
            where, other = ("like", "the file") if lv else ("the file", "like")
            raise CheckpointError(
                f"{path}: {_keystr(p)} is a view ({v['fn']} of {_keystr(v['source'])}) in {where} but "
                f"not in {other}. Build `like` with the same tied.view places as the saved model."
            )
        if (lv["fn"], lv["source"]) != (fv["fn"], fv["source"]):
            raise CheckpointError(
                f"{path}: the view at {_keystr(p)} differs: like has {lv['fn']} of "
                f"{_keystr(lv['source'])}, the file has {fv['fn']} of {_keystr(fv['source'])}."
            )
    # Shared nodes next: they decide where the places of their children are listed.
    _groups_differ(path, "node", nodes, doc["shared_nodes"])

    like_at = {p: i for i, ps in enumerate(arrays) for p in ps}
    file_at = {p: a for a in doc["arrays"] for p in a["places"]}
    if len(file_at) != sum(len(a["places"]) for a in doc["arrays"]):
        raise _corrupt(path, "a place is listed under two arrays")
    only_like = [p for p in like_at if p not in file_at]
    if only_like:
        raise _missing(path, only_like, "like", "the file")
    only_file = [p for p in file_at if p not in like_at]
    if only_file:
        raise _missing(path, only_file, "the file", "like")
    _groups_differ(path, "array", arrays, [a["places"] for a in doc["arrays"]])

    match = []
    for leaf, ps in zip(leaves, arrays):
        a = file_at[ps[0]]
        want = (tuple(leaf.shape), np.dtype(leaf.dtype).name)
        got = (tuple(a["shape"]), a["dtype"])
        if want != got:
            what = "shape" if want[0] != got[0] else "dtype"
            raise CheckpointError(
                f"{path}: the {what} differs at {_keystr(ps[0])}: the file has {got[0]} {got[1]}, like has "
                f"{want[0]} {want[1]}. Build `like` with the saved model's sizes and dtypes (or cast after "
                "loading)."
            )
        match.append(a)
    return match
