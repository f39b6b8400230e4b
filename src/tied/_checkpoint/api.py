"""Checkpoints that keep ties: `save`, `load` and `load_metadata`, over two formats.

* One safetensors file (the default, `safetensors_format.py`), for a model that one
  process holds: each unique array stored once under the keystr path of its
  first place, the manifest (places, ties, views, dtypes, shapes, checksums,
  the caller's metadata) in the header.
* An Orbax checkpoint directory (``format="orbax"``, `orbax_format.py`), for arrays
  split over devices and processes: every process writes its own shards.

What does not depend on the format (describing a tree's sharing, checking a
file against ``like``, building the loaded tree) is in `manifest.py`.

Loading rebuilds nothing from the checkpoint but values: structure, static
fields and the view functions come from ``like``, which must have the saved
places and ties; everything is checked before any array is built. Nothing is
unpickled, and nothing the checkpoint names is imported, looked up or called.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .._core import flatten
from . import convert, manifest, safetensors_format, sharded
from .document import CheckpointError, keystr

__all__ = ["CheckpointError", "save", "load", "load_metadata"]

_FORMATS = ("safetensors", "orbax")


def save(
    path: str | os.PathLike,
    tree: Any,
    metadata: Mapping[str, Any] | None = None,
    *,
    format: Literal["safetensors", "orbax"] = "safetensors",
    keys: Mapping[str, str | None] | Callable[[str], str | None] | None = None,
    transform: Mapping[str, Callable] | Callable[[str, Any], Any] | None = None,
    max_shard_size: int | str | None = None,
    only: Callable[[str, Any], bool] | None = None,
) -> None:
    """Write a model (or an optimiser state, or any object graph) to a checkpoint, ties and all.

    With ``format="safetensors"`` (the default) the checkpoint is one plain
    safetensors file: each unique array stored once, under the keystr path of
    its first place (so ``safetensors.numpy.load_file`` opens it too), and the
    places, shared nodes and views in its metadata. Only view *sources* are
    stored: a view is rebuilt by ``like``'s function at load time. The write is
    atomic: the bytes go to a temporary file beside ``path``, which is fsynced
    and renamed over it, so a crash, a kill or a full disk mid-save leaves an
    existing checkpoint untouched (and the next save removes the dead one's
    temporary file). One process must be able to read every array: an array
    split over several processes is refused, with the advice to pass
    ``format="orbax"``.

    With ``max_shard_size`` the checkpoint is a sharded set in Hugging Face's
    layout in the directory ``path``: shards ``model-00001-of-0000N.safetensors``
    (headers ``{"format": "pt"}``, no shard over the limit unless one array is
    alone in it) and ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``, and the tie manifest under ``metadata.tied``). A set already
    there is replaced as a whole (a crash leaves the old set or the new one);
    other files (a ``config.json``) stay.

    With ``only`` the file holds only the arrays the predicate selects (adapters,
    say: a few MiB beside a base of GiB), each once, and a fingerprint of everything
    it left out: the places, ties, shapes and dtypes of the rest of the model, not
    its values. `tied.load` of such a file fills those arrays into a copy of ``like``
    and keeps the rest of ``like`` as it is, once ``like``'s left-out part matches the
    fingerprint. ``only(place, array)`` is asked at every place of each array (below
    every place of a shared layer too, places written as tied prints them); an array
    at several places is one array, saved if it is selected at *any* of its places
    (so a tie is never cut by a file). Single files, sharded sets, ``keys`` and
    ``transform`` (applied to the saved arrays) work with it; Orbax does not.

    With ``format="orbax"`` the checkpoint is an Orbax directory at ``path``;
    every process calls `save`, and each writes only its own shards.

    Args:
        path: the file (by convention ending in ``.safetensors``) or, for Orbax, the directory.
        tree: the object graph; for safetensors its arrays may have any dtype
            safetensors knows (bool, (u)int8..64, float16, bfloat16, float32,
            float64, complex64, float8); big-endian numpy arrays are stored little-endian;
            typed keys (``jax.random.key``) as their key data, loaded back as typed keys;
            state (below a `tied.State`) is stored and marked as state.
        metadata: JSON-serialisable values under string keys (a step number, a
            config), read back with `tied.load_metadata`.
        format: ``"safetensors"`` or ``"orbax"``.
        keys: the file key of each place (a mapping from place to key, or a function
            ``place -> key | None``): each unique array is stored once, under the key of its
            first place (walk order) that ``keys`` names, else under its first place's path;
            the manifest still records every place, so ``tied.load`` restores the ties, and a
            reader that knows only keys (``transformers``) finds the names it expects.
        transform: a function applied to each array before it is written (a mapping from
            place to function, or a function ``(place, array) -> array``), e.g. ``lambda a:
            a.T`` to store a weight in ``Conv1D``'s ``(in, out)`` layout; the file records
            what is stored, so reading it back needs the inverse transform.
        max_shard_size: write a sharded set into the directory ``path``: bytes, or a string
            as ``transformers`` reads it (``"5GB"`` is 5*10**9 bytes, ``"5GiB"`` 5*2**30).
        only: a predicate ``(place, array) -> bool``: save the arrays it selects (at any of
            their places) and a fingerprint of the rest (``tied.under(...)`` or a function of
            your own). None saves everything.

    Raises:
        CheckpointError: two arrays given one key (a ``ValueError`` naming both places); an
            array the format cannot hold (a dtype, an array this
            process cannot fully read), or metadata that is not JSON; the message
            names the path; two places written alike with the same keys (two
            ``float("nan")`` dict keys); ``only`` that selects no array, or with
            ``format="orbax"``. Nothing is written then.

    Examples:
        >>> import os, tempfile, jax, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))    # both arrays at two places
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> tied.save(path, model, {"step": 10})   # weight and bias stored once
        >>> back = tied.load(path, like=model)
        >>> back.layers[0].weight is back.layers[1].weight
        True
        >>> bool((back.layers[1].bias == d1.bias).all())
        True

        A sharded set in Hugging Face's layout, under another library's keys (each tied
        array stored once, under the first place that ``keys`` names):

        >>> folder = tempfile.mkdtemp()
        >>> names = {".layers[0].weight": "fc.weight", ".layers[1].weight": "head.weight"}
        >>> tied.save(folder, model, keys=names, max_shard_size="1KB")
        >>> sorted(os.listdir(folder))
        ['model-00001-of-00001.safetensors', 'model.safetensors.index.json']
        >>> back = tied.load(folder, like=model)
        >>> back.layers[0].weight is back.layers[1].weight
        True

        Some arrays only (a trained bias here), with a fingerprint of the rest (the tied weight):

        >>> import jax.numpy as jnp
        >>> base = Chain(d1, Dense(d1.weight, jnp.zeros(2)))         # the head's weight is d1's
        >>> trained = Chain(d1, Dense(d1.weight, jnp.ones(2)))
        >>> tied.save(path, trained, only=lambda place, a: place == ".layers[1].bias")
        >>> back = tied.load(path, like=base)                         # the bias filled into base
        >>> back.layers[1].bias.tolist(), back.layers[1].weight is back.layers[0].weight is d1.weight
        ([1.0, 1.0], True)
    """
    if format == "orbax":
        if only is not None:
            raise CheckpointError(
                "tied.save(format='orbax', only=...): a file of some arrays (adapters) and a fingerprint "
                "of the rest is a safetensors file; an Orbax checkpoint (and tied.CheckpointManager's "
                "steps) holds the whole tree. Drop format='orbax' (add max_shard_size=... for a "
                "sharded set)."
            )
        if keys is not None or transform is not None or max_shard_size is not None:
            raise CheckpointError(
                "tied.save(format='orbax'): keys, transform and max_shard_size apply to safetensors "
                "checkpoints; Orbax stores each array under its path, as it is, in its own shards."
            )
        from . import orbax_format

        orbax_format.save(path, tree, metadata)
        return
    if format != "safetensors":
        known = ", ".join(map(repr, _FORMATS))
        raise CheckpointError(f"tied.save(format={format!r}): the formats are {known}.")
    limit = None if max_shard_size is None else sharded.parse_size(max_shard_size)
    if limit is None and os.path.isdir(path):
        raise CheckpointError(
            f"{os.fspath(path)} is a directory; a safetensors checkpoint is one file. Pass a file name, "
            "max_shard_size=... to write a sharded set into the directory, or format='orbax' to write "
            "(over) an Orbax checkpoint directory."
        )
    conv = convert.Convert(transform, who="tied.save")
    leaves, doc = manifest.describe(tree, metadata)
    if only is not None:
        convert.leave_out(doc, only)
    convert.name_arrays(doc, keys)
    conv.bind(doc)
    conv.save(leaves, doc)
    if limit is not None:
        sharded.write_set(os.fspath(path), leaves, doc, limit)
    else:
        safetensors_format.write(path, leaves, doc)


def load_metadata(path: str | os.PathLike) -> dict:
    """The ``metadata`` given to `tied.save` for this checkpoint (after its header is checked).

    Examples:
        >>> import os, tempfile, jax.numpy as jnp, tied
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
        >>> tied.save(path, {"w": jnp.zeros(3)}, metadata={"step": 500})
        >>> tied.load_metadata(path)
        {'step': 500}
    """
    kind, target = sharded.resolve(os.fspath(path))
    if kind == "orbax":
        from . import orbax_format

        return orbax_format.load_metadata(target)
    doc = sharded.Source(target, kind).doc
    if doc is None:
        raise _plain_file(target)
    return doc.get("user", {})


def _plain_file(path: str) -> CheckpointError:
    what = "an index" if path.endswith(".json") else "a safetensors file"
    return CheckpointError(
        f"{path}: {what} without tied's metadata (no '{manifest.FORMAT}' entry in its "
        "metadata), so its places and ties are unknown. Load it with tied.load(path, like, "
        "strict=False), which reads each array of like from a key naming one of its places (rename= "
        "maps other keys), or save it with tied.save."
    )


def load(
    path: str | os.PathLike,
    like: Any,
    *,
    strict: bool = True,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    allow_extra: bool = False,
    transform: Mapping[str, Callable] | Callable[[str, Any], Any] | None = None,
    dtype: Literal["like"] | None = None,
) -> Any:
    """Read a checkpoint into a new object graph shaped like ``like``, with the checkpoint's values and ties.

    ``like`` gives the structure, the static fields and the view functions (the
    checkpoint holds data only). Its arrays may be real arrays or
    ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``, or ``tied.map`` over a
    model), so a model need not exist in memory to be loaded. Arrays come back
    as ``like``'s are: a JAX array on ``like``'s sharding (a committed array's,
    or a ``ShapeDtypeStruct``'s ``.sharding``), a numpy array for numpy, an
    uncommitted JAX array otherwise. Every check runs before any array is built,
    so an error never leaves a partly loaded model.

    ``path`` may be a safetensors file, a sharded set's index
    (``*.safetensors.index.json``: only the shards holding needed keys are
    opened), or a directory holding one of these (``model.safetensors`` first,
    as ``transformers`` reads a ``save_pretrained`` directory) or an Orbax
    checkpoint written by ``tied.save(..., format="orbax")``.

    With ``strict=True`` (the default) the file must have been written by
    `tied.save`: its places, sharing, views, dtypes and shapes must be
    ``like``'s. With ``strict=False`` any safetensors file is read by its keys
    (a file from ``safetensors.numpy.save_file``, a Hugging Face checkpoint):
    a key names a place of ``like`` by its keystr path (after ``rename``; any
    place, below a shared layer too), each
    unique array of ``like`` is read from any one of its places the file holds
    (a tied embedding stored once fills both places), and the ties are
    ``like``'s. Keys at two places of one array must hold equal values.

    A file saved with ``tied.save(..., only=...)`` holds some arrays and a
    fingerprint of the rest: it is loaded with ``strict=True``, which fills those
    arrays into the copy of ``like`` and keeps every other array of ``like`` as it
    is (the same object). ``like``'s left-out part must be the saved model's
    (places, ties, shapes and dtypes: another base is refused, naming the first
    difference); ``dtype`` and ``transform`` apply to the arrays read.

    Args:
        path: a file written by `tied.save` (or, with ``strict=False``, any
            safetensors file), or an Orbax checkpoint directory.
        like: an object graph with the saved one's structure (a freshly
            initialised model, ``tied.optim.setup(...)`` for an optimiser state,
            or the same with ``jax.ShapeDtypeStruct`` leaves).
        strict: check the file's tie manifest against ``like`` (True), or match
            the file's keys to ``like``'s places (False).
        rename: with ``strict=False``: file key -> place of ``like`` (a mapping,
            keys it lacks kept as they are, or a function; a function may return
            None for a key to skip when ``allow_extra``).
        allow_extra: with ``strict=False``, leave keys that name no place unread
            instead of refusing the file.
        transform: applied to each value read (after ``rename``, before the shape
            and dtype checks): a mapping from a place of ``like`` to a function of
            the array, or a function ``(place, array) -> array``; e.g. ``lambda a:
            a.T`` for GPT-2's ``Conv1D`` weights, stored ``(in, out)``.
        dtype: None (the file's dtypes must be ``like``'s) or ``"like"``: each
            floating-point value is cast to ``like``'s dtype at its place (a
            bfloat16 file into a float32 model).

    Returns:
        The new graph: where the checkpoint has one array at several places, the
        result has one object there (``is``), views of the loaded sources, and
        ``like``'s static fields (and, for a file saved with ``only``, ``like``'s own
        arrays where the file left them out).

    Raises:
        CheckpointError: the file is truncated, corrupted or hostile, or its
            places, sharing, dtypes or shapes differ from ``like``'s (with
            ``strict=False``: an array of ``like`` none of whose places is in
            the file, keys that name no place, values that differ at two places
            of one array); the message names the path and both sides. A file saved with
            ``only`` whose left-out part differs from ``like`` (another base), or read with
            ``strict=False``.

    Examples:
        >>> import os, tempfile, jax, tied
        >>> from tied.nn import Chain, Dense
        >>> layer = Dense(2, 2, key=jax.random.key(0))
        >>> model = Chain(layer, layer)                     # one layer at two places
        >>> path = os.path.join(tempfile.mkdtemp(), "shared.safetensors")
        >>> tied.save(path, model)
        >>> back = tied.load(path, like=model)
        >>> back.layers[0] is back.layers[1]                # one layer again
        True

        A file not written by `tied` (Hugging Face style: a tied weight stored
        once, under one of its places) loads with ``strict=False``:

        >>> import numpy as np
        >>> from safetensors.numpy import save_file
        >>> w, b = np.ones((2, 2), np.float32), np.zeros(2, np.float32)
        >>> save_file({".layers[0].weight": w, ".layers[0].bias": b}, path)
        >>> back = tied.load(path, like=model, strict=False)
        >>> back.layers[1].weight is back.layers[0].weight
        True
        >>> back.layers[1].weight.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    path = os.fspath(path)
    if strict and (rename is not None or allow_extra):
        raise CheckpointError(
            "tied.load(rename=..., allow_extra=...) apply to files read by their keys: pass strict=False."
        )
    conv = convert.Convert(transform, dtype)
    kind, path = sharded.resolve(path)
    if kind == "orbax":
        if conv:
            raise CheckpointError(
                f"{path}: transform and dtype apply to safetensors checkpoints; an Orbax checkpoint "
                "is restored with like's shapes and dtypes."
            )
        if not strict:
            raise CheckpointError(
                f"{path}: a directory is read as a tied Orbax checkpoint, whose manifest is always "
                "checked; strict=False reads single safetensors files."
            )
        from . import orbax_format

        return orbax_format.load(path, like)
    src = sharded.Source(path, kind)
    check = conv.precheck
    conv.bind(like)
    partial = src.doc is not None and any(a.get("left_out") for a in src.doc["arrays"])
    if not strict:
        if partial:
            raise CheckpointError(
                f"{path}: saved with tied.save(only=...): it holds some arrays of a model and a "
                "fingerprint of the rest. Load it with tied.load(path, like) (strict=True), which fills "
                "those arrays into like and keeps the rest of like."
            )
        m = match_keys(src.keys, like, path, rename=rename, allow_extra=allow_extra, check=check)
        _check_shardings(m, path)
        arrays = _read_by_keys(src, m, conv)
        return manifest.build(m, [_own(x, leaf) for x, leaf in zip(arrays, m.like)])
    if src.doc is None:
        raise _plain_file(path)
    m = manifest.match(src.doc, like, path, check)
    read = convert.stored_entries(m.entries)  # every array, but those the file left out
    out = list(m.like)  # a left-out array: like's own, as it is
    if read:
        sub = manifest.Match(
            m.gdef, [m.like[i] for i in read], [m.entries[i] for i in read], [m.paths[i] for i in read]
        )
        src.check(sub.entries)
        conv.require(path, sub.entries, sub.paths)
        _check_shardings(sub, path)
        names = [e["name"] for e in sub.entries]
        algo = safetensors_format.checksum_of(src.doc)
        arrays = src.read(names, [e[algo] for e in sub.entries], algo)
        if conv:  # every value converted (and checked) before any is placed
            arrays = [
                conv.apply(path, ps, src.where(n), x, y)
                for n, x, y, ps in zip(names, arrays, sub.like, sub.paths)
            ]
        for i, x, leaf in zip(read, arrays, sub.like):
            out[i] = _own(x, leaf)
    return manifest.build(m, out)


def _read_by_keys(src: sharded.Source, m: manifest.Match, conv: convert.Convert) -> list:
    """Read each unique array from its first key; where the file holds it under more keys, all must
    agree (after each key's transform and cast)."""
    path = src.path
    sums: dict[str, int] = {}
    algo = "crc32c"
    if src.doc is not None:  # a tied file read by its keys: its checksums still hold
        algo = safetensors_format.checksum_of(src.doc)
        sums = {a["name"]: a[algo] for a in src.doc["arrays"]}
    names = [k for e in m.entries for k in e["keys"]]
    got = dict(zip(names, src.read(names, [sums.get(k) for k in names], algo)))
    out = []
    for e, ps, leaf in zip(m.entries, m.paths, m.like):
        if conv:
            for k, p in zip(e["keys"], e["places"]):
                got[k] = conv.apply(path, [p, *(q for q in ps if q != p)], src.where(k), got[k], leaf)
        first = got[e["keys"][0]]
        for other in e["keys"][1:]:
            x = got[other]
            if first.dtype != x.dtype or first.shape != x.shape or first.tobytes() != x.tobytes():
                raise CheckpointError(
                    f"{path}: the keys {e['keys'][0]!r} and {other!r} hold different values, but in like "
                    f"they are places of one array ({', '.join(keystr(p) for p in ps)}). Give "
                    "like separate arrays there, or drop one key with rename=... (returning None) and "
                    "allow_extra=True."
                )
        out.append(first)
    return out


def _check_shardings(m: manifest.Match, path: str) -> None:
    """Every array of ``like`` that loads onto a sharding must be divisible by it (checked before a
    byte is read, so that the error names the place)."""
    for leaf, ps in zip(m.like, m.paths):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not (manifest.is_abstract(leaf) or getattr(leaf, "committed", False)):
            continue
        try:
            sharding.shard_shape(tuple(leaf.shape))
        except Exception as e:
            raise CheckpointError(
                f"{path}: the array at {keystr(ps[0])} has shape {tuple(leaf.shape)}, which "
                f"like's sharding {sharding} cannot split evenly ({type(e).__name__}: {e}). Give like a "
                "sharding whose mesh axes divide each dimension they split (or replicate that array)."
            ) from None


def _own(x: np.ndarray, leaf: Any) -> Any:
    """A host array read from the file (its own buffer, native byte order) put where ``like``'s leaf lives."""
    return manifest.place_like(x, leaf)


def match_keys(
    keys: Mapping[str, tuple[str, Sequence[int]]],
    like: Any,
    where: str,
    *,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    allow_extra: bool = False,
    check: Callable[..., None] | None = None,
) -> manifest.Match:
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
        check: what checks a key's shape and dtype against ``like`` (default: they must be equal).

    Returns:
        A `Match` whose entries are ``{"name": first file key, "keys": every file key,
        "places": the place each key names}``.

    Raises:
        CheckpointError: a unique array none of whose places the file holds (naming
            those places), keys naming no place (listed) unless ``allow_extra``,
            two keys renamed to one place, a place path ``like`` writes twice, or a
            shape or dtype that differs.

    Examples:
        >>> import jax, tied
        >>> from tied._checkpoint.api import match_keys
        >>> emb = tied.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": tied.nn.Dense(emb.weight)}   # a tied head
        >>> keys = {"embed.weight": ("float32", [10, 4])}               # the file stores it once
        >>> m = match_keys(keys, like=model, where="hf.safetensors",
        ...                rename={"embed.weight": "['embed'].weight"})
        >>> m.entries
        [{'name': 'embed.weight', 'keys': ['embed.weight'], 'places': ["['embed'].weight"]}]
        >>> m.paths
        [("['embed'].weight", "['head'].weight")]
    """
    leaves, gdef = flatten(like)
    # Every array place, below shared nodes too: a file key may name any of them.
    places: list[list[str]] = [[] for _ in leaves]
    owner: dict[str, int] = {}
    ambiguous: set[str] = set()
    for p, i in gdef.place_leaves():
        if p in owner and owner[p] != i:
            ambiguous.add(p)
        owner[p] = i
        places[i].append(p)
    paths = [tuple(dict.fromkeys(ps)) for ps in places]
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
            (check or manifest._check_leaf)(where, p, leaf, shape, dtype)
        entries.append({"name": hits[0][1], "keys": [key for _, key in hits], "places": [p for p, _ in hits]})
    return manifest.Match(gdef, leaves, entries, list(paths))
