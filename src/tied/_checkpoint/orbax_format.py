"""The distributed format: an Orbax checkpoint directory, each process writing its own shards.

For arrays split over devices and processes, which no single process can read
whole, ``tied.save(path, tree, format="orbax")`` hands the bytes to Orbax
(``orbax-checkpoint``), JAX's own checkpoint library: every process calls it, and
each writes only the shards it holds (a replicated array is written once).
Sharing is not Orbax's business: the unique arrays go to Orbax as one flat dict,
each under its manifest name (the keystr path of its first place), and the
manifest of `manifest.py` (places, shared nodes, views, dtypes, shapes, the
caller's metadata) goes beside them as JSON.

Layout. ``path`` is a directory that Orbax's ``CheckpointManager`` keeps, with one
finalised checkpoint in it, named by a save counter:

    path/
      3/                        # the 4th save to this path; Orbax's composite checkpoint
        arrays/                 # the unique arrays (Orbax PyTree item, OCDBT/Zarr shards)
        tied/metadata           # the manifest, JSON
        _CHECKPOINT_METADATA, commit_success.txt

A save writes ``path/<n+1>.orbax-checkpoint-tmp/`` and Orbax renames it to
``path/<n+1>`` once every process has written its shards (the rename is the
commit). Only then is ``path/<n>`` removed. So a crash at any moment leaves at
least one finalised checkpoint: the previous one, or the new one. The unfinished
directory left by a crash is ignored by `load` and removed by the next save.
Loading the unfinished directory itself is refused.

``path`` is a file-system path that every process sees (a local disk for one
host; NFS, Lustre or a bucket mounted with FUSE for several); object-store URLs
(``gs://``) are not read here. Every process calls `save` and `load` with the
same arguments, from one thread each (Orbax synchronises the processes with
barriers, in call order).

Loading reads the manifest, checks it against ``like`` (`manifest.match`: every
place, tie, view, shape and dtype, the first difference named by path) and
checks that each of ``like``'s shardings fits its array, all before Orbax reads
a byte; Orbax then restores each unique array straight onto ``like``'s sharding
(each process reads only the shards its devices need), and the tree is rebuilt
with its ties. ``like`` may hold ``jax.ShapeDtypeStruct`` leaves with shardings
(``jax.eval_shape``), so a model too big for one host is never built on one.

`tied.CheckpointManager` (`_manager.py`) stores each step of a training run in
this same layout (`prepare` gives both the manifest and the arrays to store,
`load` and `load_metadata` read one step), so ``tied.load`` reads a managed
directory's latest step.

Arrays of size zero are not given to Orbax (it refuses them): the manifest's
shape says all there is to know, and `load` creates them empty.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from . import document, manifest
from .document import CheckpointError, keystr

__all__ = ["save", "load", "load_metadata"]

_ARRAYS, _MANIFEST = "arrays", "tied"  # the two items of each Orbax composite checkpoint
FORMAT = "orbax"
_lock = threading.Lock()  # one save or load at a time per process: Orbax's barriers are process-wide


def _ocp():
    # Imported on first use: orbax-checkpoint takes a second to import, and the
    # single-file format does not need it.
    import orbax.checkpoint as ocp

    return ocp


# ---------------------------------------------------------------- the directory


def _entries(root: str, complete: bool = False) -> tuple[list[int], list[str], list[str]]:
    """A checkpoint root's finalised tied saves (numbers), unfinished saves and other entries (names).

    With ``complete``, a finalised save is counted only if its files are there (`_complete`); the
    others are unfinished (`tied.CheckpointManager` lists steps so; `load` names what is damaged)."""
    ocp = _ocp()
    done, unfinished, other = [], [], []
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if os.path.isdir(full) and ocp.step.is_path_temporary(full):
            unfinished.append(name)
        elif os.path.isdir(full) and name.isdigit() and os.path.isdir(os.path.join(full, _MANIFEST)):
            if ocp.step.is_path_finalized(full) and (not complete or _complete(full)):
                done.append(int(name))
            else:
                unfinished.append(name)
        else:
            other.append(name)
    return sorted(done), unfinished, other


_seen: dict[str, tuple[tuple, Any]] = {}  # file -> (its stat, what it names)
_UNREADABLE: Any = ("<unreadable>",)


def _names(path: str, read) -> tuple[str, ...] | None:
    """What the JSON file at ``path`` names (``read(doc)``), read once per version of the file (its
    stat); None when it is missing, `_UNREADABLE` when it cannot be parsed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _seen.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        names = tuple(read(json.loads(data)))
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        names = _UNREADABLE
    if len(_seen) > 4096:
        _seen.clear()
    _seen[path] = (key, names)
    return names


def _complete(step: str) -> bool:
    """Whether a finalised step holds its manifest and the array files that manifest names.

    A step's directory can lose files without losing its name: a crash in the middle of deleting it
    (by this version's predecessors, or by hand). Such a step must not be listed, so its manifest
    (``tied/metadata``) is read for the arrays it stores, and Orbax's array metadata
    (``arrays/_METADATA``) and its OCDBT manifest must be there and name every one of them. A file
    that is there but cannot be parsed counts as there: reading the step then names the damage,
    instead of an older step being read in its place. Each file is parsed once per version (its
    stat); a listing then costs a few ``stat`` calls a step.
    """
    wanted = _names(
        os.path.join(step, _MANIFEST, "metadata"),
        lambda doc: [a["name"] for a in doc["arrays"] if int(np.prod(a["shape"], dtype=np.int64))],
    )
    if wanted is None:
        return False
    if wanted is _UNREADABLE or not wanted:
        return True
    arrays = os.path.join(step, _ARRAYS)
    stored = _names(
        os.path.join(arrays, "_METADATA"),
        lambda doc: (
            [m["key_metadata"][0]["key"] for m in doc["tree_metadata"].values()]
            + (["<ocdbt>"] if doc.get("use_ocdbt") else [])
        ),
    )
    if stored is None:
        return False
    if stored is _UNREADABLE:
        return True
    if not set(wanted) <= set(stored):
        return False
    return "<ocdbt>" not in stored or os.path.isfile(os.path.join(arrays, "manifest.ocdbt"))


def _is_one_save(path: str) -> bool:
    """Whether ``path`` is one saved checkpoint (``root/3``), not a root."""
    return os.path.isdir(os.path.join(path, _MANIFEST)) and os.path.isdir(path)


def _checkpoint_dir(path: str) -> str:
    """The finalised checkpoint to read at ``path`` (a root or one save inside it), or a clear error."""
    ocp = _ocp()
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    if ocp.step.is_path_temporary(path) or (_is_one_save(path) and not ocp.step.is_path_finalized(path)):
        raise CheckpointError(
            f"{path}: an unfinished save (Orbax's temporary directory): the save that wrote it was "
            "interrupted before Orbax finalised it, so it may hold only part of the shards. Load the "
            f"checkpoint directory that holds it, {os.path.dirname(path) or '.'}, which still has the "
            "previous finalised checkpoint."
        )
    if _is_one_save(path):
        return path
    done, unfinished, _ = _entries(path)
    if done:
        return os.path.join(path, str(done[-1]))
    if unfinished:
        raise CheckpointError(
            f"{path}: no finalised checkpoint, only an unfinished save ({', '.join(unfinished)}): the "
            "first save to this directory was interrupted before Orbax finalised it, so it may hold "
            "only part of the shards. Nothing can be loaded from it; save again."
        )
    raise CheckpointError(
        f"{path}: not a tied checkpoint: a directory without a checkpoint written by "
        "tied.save(path, tree, format='orbax') (and a single-file checkpoint is a file)."
    )


def _check_target(path: str) -> None:
    """Refuse to save where a save could clobber something that is not a tied Orbax checkpoint."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"tied.save(format='orbax'): {path} is a file; an Orbax checkpoint is a directory. Pass "
            "another path, or drop format='orbax' to write a single file."
        )
    if not os.path.isdir(path):
        return
    if _is_one_save(path):
        raise CheckpointError(
            f"tied.save(format='orbax'): {path} is one saved checkpoint inside a tied checkpoint "
            f"directory; save to that directory, {os.path.dirname(path) or '.'}, instead."
        )
    _, _, other = _entries(path)
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise CheckpointError(
            f"tied.save(format='orbax'): {path} is a directory that holds other things ({shown}), not "
            "a tied Orbax checkpoint. A save keeps only its newest checkpoint there, so it only "
            "writes to a new or empty directory or to one it wrote before: pass another path."
        )


# ---------------------------------------------------------------- saving


def _check_leaf(where: str, path: str, x: Any) -> None:
    if isinstance(x, jax.core.Tracer):
        raise CheckpointError(
            f"tied.save: {where}: the array at {keystr(path)} is a tracer: save outside jit, grad or "
            "vmap, with the concrete arrays the transformed function returned."
        )
    if isinstance(x, jax.Array) and x.is_deleted():
        raise CheckpointError(
            f"tied.save: {where}: the array at {keystr(path)} has been deleted (donated to a jitted "
            "function?). Save the arrays that function returned instead."
        )
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise CheckpointError(
            f"tied.save: {where}: the array at {keystr(path)} is a {type(x).__name__}; the Orbax "
            "format saves jax.Array and numpy arrays. Pass the model's arrays, not an abstract model."
        )
    import tensorstore

    name = np.dtype(x.dtype).name
    try:
        tensorstore.dtype(name)
    except (ValueError, TypeError):
        raise CheckpointError(
            f"tied.save: {where}: the array at {keystr(path)} has dtype {name}, which Orbax's storage "
            "(TensorStore) cannot hold. Cast it (e.g. to a wider type) before saving, or save a "
            "single file."
        ) from None


def prepare(where: str, tree: Any, metadata: Mapping[str, Any] | None) -> tuple[dict, dict[str, Any]]:
    """The manifest of ``tree`` and its arrays to store, ``{manifest name: array}``, all checked.

    Arrays of size zero are left out (the manifest's shape is all there is to
    know). `save` and `tied.CheckpointManager` store exactly these two items.

    Raises:
        CheckpointError: an array that is a tracer, deleted or of a dtype Orbax cannot
            store, or metadata that is not JSON.
    """
    leaves, doc = manifest.describe(tree, metadata)
    stored = {}
    for leaf, entry in zip(leaves, doc["arrays"]):
        _check_leaf(where, entry["places"][0], leaf)
        if leaf.size:
            stored[entry["name"]] = leaf
    doc["storage"] = {"format": FORMAT, "item": _ARRAYS}
    return doc, stored


def save(path: str | os.PathLike, tree: Any, metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``tree`` as a tied Orbax checkpoint directory at ``path`` (called by every process).

    Each unique array is stored once, under its manifest name, as an Orbax
    array: each process writes only the shards it holds. The manifest goes
    beside the arrays as JSON. The previous checkpoint at ``path`` stays
    loadable until the new one is finalised, then it is removed.

    Args:
        path: a new or empty directory, or one this function wrote before.
        tree: the object graph to save; its arrays may be split over processes.
        metadata: JSON-serialisable values under string keys.

    Raises:
        CheckpointError: ``path`` is a file or a directory holding other things,
            an array is a tracer, deleted, or of a dtype Orbax cannot store, or
            the metadata is not JSON. Nothing is written then.

    Examples:
        >>> import os, tempfile, jax, numpy as np, tied
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
        >>> rows = NamedSharding(Mesh(np.array(jax.devices()), ("model",)), PartitionSpec("model", None))
        >>> emb = tied.nn.Embedding(8 * jax.device_count(), 4, key=jax.random.key(0))
        >>> lm = tied.device_put({"embed": emb, "head": emb}, rows)   # one Embedding, split by rows
        >>> path = os.path.join(tempfile.mkdtemp(), "lm")
        >>> tied.save(path, lm, format="orbax")          # each process writes its rows
        >>> back = tied.load(path, like=lm)
        >>> back["embed"] is back["head"], back["head"].weight.sharding == rows
        (True, True)
    """
    ocp = _ocp()
    path = os.path.abspath(os.fspath(path))
    doc, stored = prepare(path, tree, metadata)
    with _lock:
        _check_target(path)
        done = _entries(path)[0] if os.path.isdir(path) else []
        items: dict[str, Any] = {_MANIFEST: ocp.args.JsonSave(doc)}
        if stored:
            items[_ARRAYS] = ocp.args.PyTreeSave(stored)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=1,  # the previous checkpoint is removed only after the new one is finalised
            enable_async_checkpointing=False,  # return once the checkpoint is final on disk
            create=True,
            cleanup_tmp_directories=True,  # unfinished saves of crashed runs
        )
        with ocp.CheckpointManager(path, options=options) as manager:
            manager.save((done[-1] + 1) if done else 0, args=ocp.args.Composite(**items), force=True)


# ---------------------------------------------------------------- loading


def _brief(e: BaseException) -> str:
    """An error from Orbax or TensorStore in one short line (theirs can run to pages of spec)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _unreadable(where: str, ckpt: str, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{where}: Orbax could not read the arrays of {ckpt} ({_brief(e)}). Its shards are missing or "
        "damaged; nothing was loaded."
    )


def _read_manifest(ckpt: str, where: str) -> dict:
    ocp = _ocp()
    manifest = os.path.join(ckpt, _MANIFEST)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
            doc = c.restore(ckpt, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()}))[_MANIFEST]
    except Exception as e:  # Orbax's errors for a missing or unreadable item vary by version
        raise document.corrupt(where, f"its manifest {manifest} cannot be read ({_brief(e)})") from e
    doc = document.validate(doc, where)
    if any(a.get("left_out") for a in doc["arrays"]):  # only tied.save(only=...) writes these, in safetensors
        raise document.corrupt(where, "its manifest leaves arrays out, which an Orbax checkpoint never does")
    storage = doc.get("storage")
    if not isinstance(storage, dict) or storage.get("format") != FORMAT:
        raise document.corrupt(where, "the manifest does not describe an Orbax checkpoint")
    return doc


def load_metadata(path: str | os.PathLike) -> dict:
    """The ``metadata`` saved with the checkpoint at ``path`` (its newest finalised save).

    Examples:
        >>> import os, tempfile, jax.numpy as jnp, tied
        >>> w = jnp.ones(3)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> tied.save(path, {"a": w, "b": w}, {"step": 500}, format="orbax")
        >>> tied.load_metadata(path)
        {'step': 500}
    """
    path = os.path.abspath(os.fspath(path))
    return _read_manifest(_checkpoint_dir(path), path).get("user", {})


def _target(where: str, place: str, leaf: Any) -> tuple[Any, bool]:
    """Where to restore ``like``'s leaf: ``(sharding, as_numpy)``, the sharding checked against its shape."""
    if isinstance(leaf, np.ndarray):
        return None, True
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, jax.Array) and not getattr(leaf, "committed", True):
        return None, False  # uncommitted: restored to the host, then placed as the single-file format does
    if sharding is None:  # a ShapeDtypeStruct without a sharding: as the single-file format places it
        return None, False
    shape = manifest.stored(leaf)[0]  # a typed key: its key data's shape, the key's own shape last
    problem = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        axes = tuple(sharding.mesh.axis_names)
        for entry in sharding.spec:
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None and name not in axes:
                    problem = f"mesh axis {name!r} is not in the mesh, whose axes are {axes}"
        if problem is None and len(sharding.spec) > len(shape):
            problem = f"its spec {sharding.spec} has {len(sharding.spec)} entries for rank {len(shape)}"
    if problem is None:
        try:
            sharding.shard_shape(shape)
        except Exception as e:
            problem = str(e).split("\n")[0]
    if problem is not None:
        raise CheckpointError(
            f"{where}: the sharding of like at {keystr(place)} does not fit the saved array of shape "
            f"{shape}: {problem}. Give that place a sharding whose mesh axes divide the array's "
            "dimensions (or PartitionSpec() to replicate it)."
        )
    return sharding, False


def _check_stored(ckpt: str, where: str, item: dict) -> None:
    """The arrays Orbax holds must be the ones the manifest describes, in name, shape and dtype.

    Orbax restores onto any requested shape and dtype (padding, truncating, casting): a manifest
    that disagrees with the stored arrays would load wrong values silently, so it is refused.
    """
    ocp = _ocp()
    from etils import epath

    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(ckpt) / _ARRAYS).tree
        stored = {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in tree.items()}
    except Exception as e:
        raise _unreadable(where, ckpt, e) from e
    for name, want in item.items():
        got = stored.get(name)
        if got is None:
            raise document.corrupt(where, f"the manifest's array {name!r} is not among the stored arrays")
        if got != (tuple(want.shape), np.dtype(want.dtype).name):
            raise document.corrupt(
                where,
                f"the manifest describes {name!r} as {tuple(want.shape)} {np.dtype(want.dtype).name}, "
                f"but Orbax stored {got[0]} {got[1]}",
            )
    extra = sorted(set(stored) - set(item))
    if extra:
        raise document.corrupt(where, f"stored arrays that the manifest does not list: {extra[:5]}")


def load(path: str | os.PathLike, like: Any, **options: Any) -> Any:
    """Read the tied Orbax checkpoint at ``path`` onto ``like``'s shardings, ties and all.

    ``path`` is a checkpoint directory written by `save` (its newest finalised
    checkpoint is read), or one finalised checkpoint inside it. Every check
    (manifest against ``like``, each sharding against its array's shape) runs
    before Orbax reads any data; each process then reads only the shards its
    devices hold.

    Args:
        path: the checkpoint directory.
        like: the object graph to load into; its leaves may be arrays (each
            restored onto its sharding: numpy as numpy, an uncommitted JAX
            array to the default device) or ``jax.ShapeDtypeStruct`` (onto its
            ``.sharding``, or this process's first device without one).

    Returns:
        A new graph with ``like``'s structure and the checkpoint's values: one
        object at every place of a saved tie.

    Raises:
        CheckpointError: no finalised checkpoint (an unfinished save names
            itself), a manifest that differs from ``like`` (named by path), a
            sharding that does not fit its array (named by path), or data Orbax
            cannot read.

    Examples:
        >>> import os, tempfile, jax, numpy as np, tied
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
        >>> rows = NamedSharding(Mesh(np.array(jax.devices()), ("model",)), PartitionSpec("model", None))
        >>> def make_model(key):                           # one Embedding at two places
        ...     emb = tied.nn.Embedding(8 * jax.device_count(), 4, key=key)
        ...     return {"embed": emb, "head": emb}
        >>> lm = tied.device_put(make_model(jax.random.key(0)), rows)   # split by rows
        >>> path = os.path.join(tempfile.mkdtemp(), "lm")
        >>> tied.save(path, lm, format="orbax")

        Loading into an abstract model (shapes, dtypes and shardings; no array is
        built before Orbax reads each process's shards onto it):

        >>> abstract = jax.eval_shape(lambda k: tied.Graph(make_model(k)), jax.random.key(0)).value
        >>> like = tied.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), abstract)
        >>> model = tied.load(path, like)
        >>> model["head"].weight is model["embed"].weight
        True
        >>> bool((model["head"].weight == lm["embed"].weight).all())
        True
    """
    if options:
        raise CheckpointError(
            f"tied.load: {', '.join(sorted(options))} apply to single-file checkpoints, not to the Orbax "
            "directory format."
        )
    ocp = _ocp()
    where = os.path.abspath(os.fspath(path))
    with _lock:
        ckpt = _checkpoint_dir(where)
        doc = _read_manifest(ckpt, where)
        m = manifest.match(doc, like, where)
        targets = [_target(where, ps[0], leaf) for leaf, ps in zip(m.like, m.paths)]
        item, restore_args, order = {}, {}, []
        for i, (leaf, entry, (sharding, as_numpy)) in enumerate(zip(m.like, m.entries, targets)):
            if not np.prod(entry["shape"], dtype=np.int64):
                continue
            # A typed key is read as its key data (unsigned integers); `build` makes it a key again.
            shape, dtype = tuple(entry["shape"]), np.dtype(manifest.stored(leaf)[1])
            item[entry["name"]] = jax.ShapeDtypeStruct(shape, dtype)
            if as_numpy or sharding is None:
                restore_args[entry["name"]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
            else:
                restore_args[entry["name"]] = ocp.ArrayRestoreArgs(
                    sharding=sharding, global_shape=shape, dtype=dtype
                )
            order.append(i)
        restored: dict = {}
        if item:
            _check_stored(ckpt, where, item)
            try:
                with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
                    restored = c.restore(
                        ckpt,
                        args=ocp.args.Composite(
                            **{_ARRAYS: ocp.args.PyTreeRestore(item=item, restore_args=restore_args)}
                        ),
                    )[_ARRAYS]
            except Exception as e:
                raise _unreadable(where, ckpt, e) from e
    arrays: list = [None] * len(m.like)
    for i, (leaf, entry, (sharding, as_numpy)) in enumerate(zip(m.like, m.entries, targets)):
        if i not in order:
            x = np.zeros(entry["shape"], np.dtype(manifest.stored(leaf)[1]))
            arrays[i] = (
                x
                if as_numpy
                else (jax.device_put(x, sharding) if sharding is not None else jax.device_put(x))
            )
            continue
        x = restored.get(entry["name"]) if isinstance(restored, Mapping) else None
        if x is None:
            raise document.corrupt(where, f"the array {entry['name']!r} is missing from {ckpt}")
        if not as_numpy and sharding is None:
            x = manifest.place_like(np.asarray(x), leaf)
        arrays[i] = x
    return manifest.build(m, arrays)
