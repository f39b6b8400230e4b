"""Safetensors sets as Hugging Face writes them, and the conversions between a file and ``like``.

Three things the ecosystem's checkpoints need beyond `_safetensors`' one file:

* **Finding the checkpoint in a directory** (`resolve`), in the order ``transformers``
  reads one: ``model.safetensors`` first, then ``model.safetensors.index.json`` (or the
  one other ``*.safetensors.index.json``), then the one other safetensors file; a
  directory with an Orbax checkpoint (and none of these) is Orbax's. Several
  candidates, or none, is an error listing what the directory holds.
* **Sharded sets**: an index ``{"metadata": {"total_size": ...}, "weight_map": {key:
  shard}}`` beside shards ``model-00001-of-0000N.safetensors``. `Source` reads one
  file or a set alike (only the shards that hold needed keys are opened). `write_set`
  writes a set: shard headers carry ``{"format": "pt"}`` as ``transformers`` writes
  them, and the index's metadata carries tied's manifest (places, ties, views, a
  CRC-32C of every array) under ``"tied"``, which ``transformers`` ignores.

(File keys, transforms and casts, which apply to one file too, are in `_convert`.)

A set is replaced as a whole: the new shards are written to hidden temporary files
(``.{name}.tied-tmp-{hex}``, locked while written, fsynced), and only then made
visible. An old shard whose name a new one takes is first hard-linked to a hidden
backup (``.{name}.tied-old-{hex}``) and the old index rewritten to name the backup,
so the old index names intact files at every moment. The new index's rename is the
commit; the old set's files are removed after it. A crash before the commit leaves
the old set (and hidden files the next save removes); after it, the new one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import safetensors_format
from .document import CheckpointError, corrupt, pack, validate

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no directory lock
    fcntl = None  # type: ignore[assignment]

SINGLE = "model.safetensors"  # what save_pretrained writes when the model fits one file
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r".+-\d{5}-of-\d{5}\.safetensors\Z")
_OURS = re.compile(r"model-\d{5}-of-\d{5}\.safetensors\Z")  # the shards `write_set` names
_BACKUP = ".tied-old-"
_TMP = ".tied-tmp-"


def _nbytes(a: dict) -> int:
    """The bytes of one stored array of the manifest."""
    return safetensors_format.nbytes(
        safetensors_format._DTYPES[safetensors_format._TAGS[a["dtype"]]], a["shape"]
    )


def _step(name: str) -> None:
    """Called before each step of a set's commit (a hook for tests that kill a save there)."""


# ---------------------------------------------------------------- sizes


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string read as ``transformers`` reads it: ``"5GB"`` is 5·10⁹,
    ``"5GiB"`` 5·2³⁰ (KB/MB/GB and KiB/MiB/GiB; a lower-case ``b`` means bits).

    Examples:
        >>> from tied._checkpoint.sharded import parse_size
        >>> parse_size("5GB"), parse_size("5GiB"), parse_size("8Kb"), parse_size(100)
        (5000000000, 5368709120, 1000, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        out = size
    elif isinstance(size, str):
        units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
        for unit, scale in units.items():
            if size.upper().endswith(unit) and size[: -len(unit)].strip().isdigit():
                out = int(size[: -len(unit)]) * scale
                out = out // 8 if unit.endswith("B") and size.endswith("b") and "I" not in unit else out
                break
        else:
            out = -1
    else:
        out = -1
    if out <= 0:
        raise CheckpointError(
            f"tied.save(max_shard_size={size!r}): give a positive number of bytes or a string such as "
            "'5GB' (5*10**9 bytes) or '5GiB' (5*2**30 bytes)."
        )
    return out


# ---------------------------------------------------------------- finding the checkpoint


def _looks_orbax(folder: str, entries: Sequence[str]) -> bool:
    for e in entries:
        full = os.path.join(folder, e)
        if "orbax-checkpoint-tmp" in e or (e == "tied" and os.path.isdir(full)):
            return True
        if e.isdigit() and os.path.isdir(os.path.join(full, "tied")):
            return True
    return False


def resolve(path: str) -> tuple[str, str]:
    """What ``path`` is: ``("file", file)``, ``("index", index file)`` or ``("orbax", path)``."""
    if not os.path.isdir(path):
        return ("index", path) if path.endswith(".json") else ("file", path)
    entries = sorted(e for e in os.listdir(path) if not e.startswith("."))
    files = [e for e in entries if os.path.isfile(os.path.join(path, e))]
    if SINGLE in files:  # transformers reads it first, even beside an index (and so does a save's commit)
        return "file", os.path.join(path, SINGLE)
    indexes = [e for e in files if e.endswith(".safetensors.index.json")]
    if INDEX in indexes:  # the one name transformers reads
        indexes = [INDEX]
    singles = [e for e in files if e.endswith(".safetensors") and not _SHARD.match(e)]
    orbax = _looks_orbax(path, entries)
    found = indexes if indexes else singles
    if len(found) == 1 and not orbax:
        return ("index" if indexes else "file"), os.path.join(path, found[0])
    if len(found) > 1 or (found and orbax):
        what = ", ".join(found) + (" and an Orbax checkpoint" if orbax else "")
        raise CheckpointError(
            f"{path}: several checkpoints in one directory ({what}), so tied cannot tell which to load. "
            "Pass the file or the index itself as path, or remove the others."
        )
    if orbax:
        return "orbax", path
    shards = [e for e in files if _SHARD.match(e)]
    shown = ", ".join(entries[:10]) + (f" and {len(entries) - 10} more" if len(entries) > 10 else "")
    hint = (
        f" It holds shards ({shards[0]}, ...) but no index naming them: an interrupted copy, or a set "
        "whose model.safetensors.index.json is missing."
        if shards
        else ""
    )
    raise CheckpointError(
        f"{path}: not a tied checkpoint: the directory holds no safetensors file, no "
        f"*.safetensors.index.json and no Orbax checkpoint (found: {shown or 'nothing'}).{hint}"
    )


# ---------------------------------------------------------------- reading: one file or a set


def _basename_ok(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def read_index(path: str) -> tuple[dict[str, str], dict]:
    """An index's ``weight_map`` (each shard a plain file name beside it) and its ``metadata``."""
    bad = f"{path}: not a safetensors index (Hugging Face's {{'metadata': ..., 'weight_map': ...}}): "
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the read
            raise CheckpointError(bad + "it is not a regular file.")
        with open(path, "rb") as f:
            raw = f.read(safetensors_format._MAX_HEADER + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such index file.") from None
    except OSError as e:  # a loop of symbolic links, no permission to read
        raise CheckpointError(bad + f"it cannot be opened ({e.strerror or type(e).__name__}).") from None
    if len(raw) > safetensors_format._MAX_HEADER:
        raise CheckpointError(bad + f"over {safetensors_format._MAX_HEADER} bytes.")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(bad + f"it is not JSON ({type(e).__name__}).") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(bad + "no 'weight_map' object.")
    for key, shard in wmap.items():
        if not _basename_ok(shard):
            raise CheckpointError(
                bad + f"the key {key!r} is mapped to {shard!r}, which is not a file name beside the index."
            )
    meta = doc.get("metadata", {})
    if not isinstance(meta, dict):
        raise CheckpointError(bad + "'metadata' is not an object.")
    return wmap, meta


class Source:
    """One safetensors file, or a sharded set through its index: its tensors by key, read on demand.

    ``doc`` is tied's manifest (None for a file another library wrote); ``keys`` maps each
    key to ``(dtype name, shape)`` and opens a shard's header only when one of its keys is
    asked for; `read` reads the named tensors, checksummed where ``sums`` gives one.
    """

    def __init__(self, path: str, kind: str):
        self.path = path
        self.headers: dict[str, Any] = {}  # shard file name -> its checked header
        if kind == "file":
            self.folder, name = os.path.split(path)
            self.weight_map = None
            header = safetensors_format.open_header(path)
            self.headers[name] = header
            self.doc = header.doc
            self.key_list = list(header.tensors)
            return
        self.folder = os.path.dirname(path)
        self.weight_map, meta = read_index(path)
        self.key_list = list(self.weight_map)
        self.doc = None
        if "tied" in meta:
            doc = validate(meta["tied"], path)
            algo = safetensors_format.checksum_of(doc)
            if algo not in safetensors_format._CHECKSUMS:
                raise corrupt(path, f"unknown checksum {algo!r}")
            for a in doc["arrays"]:
                if a.get("left_out"):  # described, not stored (`tied.save(only=...)`)
                    continue
                if a["name"] not in self.weight_map:
                    raise corrupt(path, f"the manifest names {a['name']!r}, which the weight_map lacks")
                c = a.get(algo)
                if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= 0xFFFFFFFF:
                    raise corrupt(path, f"array {a['name']!r} has no {algo}")
            self.doc = doc

    def shard_of(self, key: str) -> str:
        return os.path.basename(self.path) if self.weight_map is None else self.weight_map[key]

    def where(self, key: str) -> str:
        """The key and, in a set, its shard, for messages."""
        return f"key {key!r}" + ("" if self.weight_map is None else f" (shard {self.shard_of(key)})")

    def header(self, shard: str) -> Any:
        if shard not in self.headers:
            full = os.path.join(self.folder, shard)
            holds = [k for k, s in self.weight_map.items() if s == shard]  # type: ignore[union-attr]
            named = f"which the index names for {holds[0]!r}" + (
                f" and {len(holds) - 1} more keys" if len(holds) > 1 else ""
            )
            try:
                self.headers[shard] = safetensors_format.open_header(full)
            except FileNotFoundError:
                raise CheckpointError(
                    f"{self.path}: the shard {shard}, {named}, is missing from {self.folder or '.'}. "
                    "The set is incomplete: copy the missing shard, or save the set again."
                ) from None
            except CheckpointError as e:
                raise CheckpointError(
                    f"{self.path}: the shard {shard}, {named}, cannot be read: {e}"
                ) from None
        return self.headers[shard]

    def tensor(self, key: str) -> Any:
        shard = self.shard_of(key)
        t = self.header(shard).tensors.get(key)
        if t is None:
            raise CheckpointError(
                f"{self.path}: the weight_map puts the key {key!r} in the shard {shard}, which does not "
                "hold it. The index and the shards are from different saves: save the set again."
            )
        return t

    @property
    def keys(self) -> Mapping[str, tuple[str, tuple[int, ...]]]:
        return _Keys(self)

    def read(self, names: Sequence[str], sums: Sequence[int | None], algo: str) -> list[np.ndarray]:
        """The named tensors (every shard's header checked first, then each shard read once)."""
        for name in names:
            self.tensor(name)
        by_shard: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            by_shard.setdefault(self.shard_of(name), []).append(i)
        out: list[Any] = [None] * len(names)
        for shard, idx in by_shard.items():
            full = os.path.join(self.folder, shard)
            got = safetensors_format.read(
                full, self.headers[shard], [names[i] for i in idx], [sums[i] for i in idx], algo
            )
            for i, x in zip(idx, got):
                out[i] = x
        self._compare_copies(names, out)
        return out

    def check(self, entries: Sequence[dict]) -> None:
        """A set's shards must hold each manifest entry's tensor with the dtype and shape it records."""
        for a in entries:
            t = self.tensor(a["name"])
            if t.dtype.name != a["dtype"] or list(t.shape) != a["shape"]:
                raise CheckpointError(
                    f"{self.path}: the shard {self.shard_of(a['name'])} holds {a['name']!r} as "
                    f"{t.shape} {t.dtype.name}, but the index's manifest says {tuple(a['shape'])} "
                    f"{a['dtype']}. The index and the shards are from different saves."
                )

    def _compare_copies(self, names: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        """A key held by another opened shard too must hold the same value there."""
        if self.weight_map is None:
            return
        for name, x in zip(names, arrays):
            for shard, header in list(self.headers.items()):
                if shard == self.shard_of(name) or name not in header.tensors:
                    continue
                (other,) = safetensors_format.read(
                    os.path.join(self.folder, shard), header, [name], [None], "crc32c"
                )
                if other.dtype != x.dtype or other.shape != x.shape or other.tobytes() != x.tobytes():
                    raise CheckpointError(
                        f"{self.path}: the key {name!r} is in two shards with different values: "
                        f"{self.shard_of(name)} (where the weight_map puts it) and {shard}. The set mixes "
                        "two saves; save it again."
                    )


class _Keys(Mapping):
    """A source's keys, each ``(dtype name, shape)`` read from its shard's header when asked."""

    def __init__(self, source: Source):
        self.source = source

    def __getitem__(self, key: str) -> tuple[str, tuple[int, ...]]:
        t = self.source.tensor(key)
        return t.dtype.name, t.shape

    def __iter__(self) -> Iterator[str]:
        return iter(self.source.key_list)

    def __len__(self) -> int:
        return len(self.source.key_list)


# ---------------------------------------------------------------- writing a set


def plan(doc: dict, limit: int) -> list[list[int]]:
    """Arrays (indices, in flatten order) per shard: a new shard starts where the next array would
    take the current one over ``limit`` bytes, so only an array alone in its shard exceeds it."""
    shards: list[list[int]] = [[]]  # a tree without arrays still gets its (empty) shard
    size = 0
    for i, a in enumerate(doc["arrays"]):
        if a.get("left_out"):  # described, not stored (`tied.save(only=...)`)
            continue
        n = safetensors_format.nbytes(
            safetensors_format._DTYPES[safetensors_format._TAGS[a["dtype"]]], a["shape"]
        )
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _write_shard(f: Any, leaves: Sequence[Any], arrays: Sequence[dict], idx: Sequence[int]) -> None:
    """One shard as ``transformers`` writes it (``{"format": "pt"}``); each array's CRC-32C goes
    into its manifest entry."""
    dtypes = {i: safetensors_format._DTYPES[safetensors_format._TAGS[arrays[i]["dtype"]]] for i in idx}
    order = sorted(idx, key=lambda i: (-dtypes[i].itemsize, arrays[i]["name"]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for i in order:
        n = safetensors_format.nbytes(dtypes[i], arrays[i]["shape"])
        header[arrays[i]["name"]] = {
            "dtype": safetensors_format._TAGS[arrays[i]["dtype"]],
            "shape": arrays[i]["shape"],
            "data_offsets": [pos, pos + n],
        }
        pos += n
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-(8 + len(head)) % safetensors_format._ALIGN)
    f.write(len(head).to_bytes(8, "little") + head)
    for i in order:
        data = safetensors_format._host(leaves[i], arrays[i]["places"][0])
        crc = 0
        for start in range(0, data.nbytes, safetensors_format._CHUNK):
            chunk = data[start : start + safetensors_format._CHUNK]
            safetensors_format._write_array(f, chunk)
            crc = safetensors_format._crc32c(chunk, crc)
        arrays[i][safetensors_format.CHECKSUM] = crc


def _temp(folder: str, name: str, body: Callable[[Any], None], held: list) -> str:
    """``body`` written to a new locked temporary file beside ``folder/name`` and fsynced; the lock
    (its descriptor, in ``held``) stays until the save ends, so no other save takes it for dead."""
    tmp, fd = safetensors_format._create_locked_temp(os.path.join(folder, name))
    held.append((tmp, fd))
    with os.fdopen(fd, "wb", closefd=False) as f:
        body(f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _old_set(folder: str) -> tuple[str | None, list[str]]:
    """The index a reader follows now (or None) and every file of the sets that a save replaces:
    ``model.safetensors``, the files of ``model.safetensors.index.json``, and the set `resolve` finds."""
    files: list[str] = []
    active = None
    try:
        kind, found = resolve(folder)
    except CheckpointError:
        kind, found = "none", ""
    for index in dict.fromkeys([os.path.join(folder, INDEX), found if kind == "index" else ""]):
        if index and os.path.isfile(index):
            try:
                wmap, _ = read_index(index)
            except CheckpointError:
                wmap = {}
            files += [os.path.basename(index), *dict.fromkeys(wmap.values())]
            if index == found:
                active = index
    if kind == "file":
        files.append(os.path.basename(found))
    if os.path.isfile(os.path.join(folder, SINGLE)):
        files.append(SINGLE)
    return active, list(dict.fromkeys(files))


def _protect(folder: str, active: str | None, new_names: set[str]) -> None:
    """Before a new shard takes an old one's name: the old one hard-linked to a hidden backup, and
    the index readers follow rewritten to name the backup (atomically), so it names intact files."""
    if active is None:
        return
    with open(active, "rb") as f:
        doc = json.load(f)
    wmap = doc["weight_map"]
    taken = sorted({s for s in wmap.values() if s in new_names and os.path.isfile(os.path.join(folder, s))})
    if not taken:
        return
    backup = {}
    for s in taken:
        b = f".{s}{_BACKUP}{secrets.token_hex(6)}"
        _step("link")
        os.link(os.path.join(folder, s), os.path.join(folder, b))
        backup[s] = b
    safetensors_format._fsync_dir(folder)
    doc["weight_map"] = {k: backup.get(s, s) for k, s in wmap.items()}
    text = json.dumps(doc, indent=2, sort_keys=False).encode()
    _step("repoint")
    safetensors_format._atomic_write(active, lambda f: f.write(text))


def _indexed(folder: str, entries: Sequence[str]) -> set[str] | None:
    """Every file an index in ``folder`` names (ours and any other library's), or None where an
    index cannot be read (what it names is then unknown, so nothing is taken for unnamed)."""
    named: set[str] = set()
    for e in entries:
        if e.startswith(".") or not e.endswith(".safetensors.index.json"):
            continue
        try:
            named.update(read_index(os.path.join(folder, e))[0].values())
        except (CheckpointError, OSError):
            return None
    return named


def _clean(folder: str, active: str | None) -> None:
    """Remove what dead saves left: temporary files whose lock is free, backups no index names, and
    shards named as this code names them (``model-0000k-of-0000N.safetensors``) that no index names
    (a save killed after its commit, before it removed the old set's). Other files stay."""
    named: set[str] = set()
    if active is not None:
        try:
            named = set(read_index(active)[0].values())
        except CheckpointError:
            pass
    entries = os.listdir(folder)
    indexed = _indexed(folder, entries)
    for e in entries:
        full = os.path.join(folder, e)
        if _OURS.match(e) and indexed is not None and e not in indexed and _regular(full):
            safetensors_format._unlink_quietly(full)
        if not e.startswith("."):
            continue
        if _TMP in e:
            safetensors_format._remove_leftovers(os.path.join(folder, e[1 : e.index(_TMP)]))
        elif _BACKUP in e and e not in named:
            safetensors_format._unlink_quietly(full)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _lock_dir(folder: str) -> int | None:
    """One save at a time per directory: an exclusive lock on the directory itself."""
    if fcntl is None:  # pragma: no cover
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a file system without locks on directories
        pass
    return fd


def write_set(folder: str, leaves: Sequence[Any], doc: dict, limit: int) -> None:
    """Write ``leaves`` (described by the manifest ``doc``) as a sharded set in ``folder``, replacing
    the set there as a whole (see the module's docstring); other files stay.

    Raises:
        CheckpointError: an array the format cannot hold (nothing is written then).
    """
    safetensors_format.check_savable(leaves, doc)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(
            f"tied.save(max_shard_size=...): {folder} is a file; a sharded set is a directory (shards and "
            "model.safetensors.index.json). Pass a directory, or drop max_shard_size to write one file."
        )
    os.makedirs(folder, exist_ok=True)
    arrays = doc["arrays"]
    shards = plan(doc, limit)
    n = len(shards)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    lock = _lock_dir(folder)
    held: list[tuple[str, int]] = []
    try:
        active, old = _old_set(folder)
        _clean(folder, active)
        temps = [
            _temp(folder, name, lambda f, idx=idx: _write_shard(f, leaves, arrays, idx), held)
            for name, idx in zip(names, shards)
        ]
        weight_map = {arrays[i]["name"]: name for name, idx in zip(names, shards) for i in idx}
        total = sum(
            safetensors_format.nbytes(
                safetensors_format._DTYPES[safetensors_format._TAGS[a["dtype"]]], a["shape"]
            )
            for a in arrays
            if not a.get("left_out")
        )
        index = {
            "metadata": {"total_size": total, "tied": {**pack(doc), "checksum": safetensors_format.CHECKSUM}},
            "weight_map": dict(sorted(weight_map.items())),
        }
        text = json.dumps(index, indent=2, ensure_ascii=False).encode()
        index_tmp = _temp(folder, INDEX, lambda f: f.write(text), held)
        _protect(folder, active, set(names))
        for tmp, name in zip(temps, names):
            _step("shard")
            os.replace(tmp, os.path.join(folder, name))
        safetensors_format._fsync_dir(folder)
        _step("commit")
        os.replace(index_tmp, os.path.join(folder, INDEX))
        safetensors_format._fsync_dir(folder)
        for f in old:
            if f not in names and f != INDEX and f.endswith((".safetensors", ".safetensors.index.json")):
                _step("remove")
                safetensors_format._unlink_quietly(os.path.join(folder, f))
        _clean(folder, os.path.join(folder, INDEX))
        safetensors_format._fsync_dir(folder)
    except BaseException:
        for tmp, _ in held:
            safetensors_format._unlink_quietly(tmp)
        raise
    finally:
        for _, fd in held:
            os.close(fd)
        if lock is not None:
            os.close(lock)
