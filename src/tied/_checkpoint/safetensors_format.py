"""The single-file format: the unique arrays' bytes in one safetensors file, the manifest in its header.

The file is a plain safetensors file (``safetensors.numpy.load_file`` opens
it): an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype tag, shape and byte span, and the data. The header's
``__metadata__`` holds ``{"format": "tied", "tied": <the manifest as JSON>}``
(see `_manifest`), with a ``"checksum"`` entry naming the algorithm and, in
each array's entry, that checksum of its bytes: ``crc32c`` (hardware CRC-32C,
``google-crc32c``) since manifest version 2, zlib's ``crc32`` in version 1
files, which still load.

Writes are atomic: the bytes go to a temporary file beside the target,
``.{name}.tied-tmp-{random}``, held under an exclusive ``flock`` while it is
written, then fsynced and renamed over the target. A save killed mid-write
leaves the old file as it was and its temporary file behind; the next save to
that path removes every such leftover whose lock is free (its writer is gone).

Reads check the header field by field against the file's real size before a
byte of data is touched, then memory-map the data: each array is copied once
from the mapping into its own buffer and checksummed chunk by chunk while the
chunk is in cache; JAX on CPU adopts that buffer without another copy.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import stat
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import google_crc32c
import jax
import ml_dtypes
import numpy as np

from .document import FORMAT, CheckpointError, corrupt, is_int, keystr, pack, valid_shape, validate
from .manifest import nbytes

try:  # POSIX: a writer holds a lock on its temporary file, so a cleaner can tell a live save from a dead one
    import fcntl
except ImportError:  # pragma: no cover - Windows: leftovers of killed saves are not cleaned
    fcntl = None  # type: ignore[assignment]

_MAX_HEADER = 100_000_000  # the bound the safetensors reference reader enforces
_CHUNK = 2 << 20  # bytes copied and checksummed at a time: still in cache when the checksum reads them
_ALIGN = 64  # where the data section starts in files tied writes
CHECKSUM = "crc32c"


def _crc32c(data: np.ndarray, crc: int = 0) -> int:
    return google_crc32c.extend(crc, data)


def _crc32(data: np.ndarray, crc: int = 0) -> int:
    return zlib.crc32(data, crc)


# The algorithm named in the manifest (also the array entries' field) -> its update function.
_CHECKSUMS: dict[str, Callable[[np.ndarray, int], int]] = {"crc32c": _crc32c, "crc32": _crc32}
_SHOWN = {"crc32c": "CRC-32C", "crc32": "CRC-32"}


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
    _t = np.bool_ if _name == "bool" else getattr(np, _name, None)
    _t = _t if _t is not None else getattr(ml_dtypes, _name, None)
    if _t is None:  # an older ml_dtypes
        del _TAGS[_name]
        continue
    _DTYPES[_TAGS[_name]] = np.dtype(_t)


def _supported() -> str:
    return ", ".join(_TAGS)


# ---------------------------------------------------------------- writing


def _little_endian(a: np.ndarray) -> np.ndarray:
    """``a`` with little-endian bytes, as safetensors stores them (a copy only where they are not)."""
    order = a.dtype.byteorder
    if order == ">" or (order == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def check_savable(leaves: Sequence[Any], doc: dict) -> None:
    """Refuse, before a byte is written, any array this format cannot store, naming its path."""
    for leaf, a in zip(leaves, doc["arrays"]):
        if a.get("left_out"):  # described, not stored (`tied.save(only=...)`)
            continue
        place = keystr(a["places"][0])
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise CheckpointError(
                f"{place}: a jax.ShapeDtypeStruct describes an array but holds no values to save. Save the "
                "model itself (an abstract tree is for `like` in tied.load)."
            )
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise CheckpointError(
                f"{place}: this array is split over several processes and this one cannot read all of "
                "it, so it cannot go into one file. Pass format='orbax': tied.save(path, tree, "
                "format='orbax') writes a checkpoint directory in which every process writes its "
                "own shards."
            )
        if a["dtype"] not in _TAGS:
            raise CheckpointError(
                f"{place}: an array of dtype {a['dtype']} cannot be stored in a safetensors file (it "
                f"holds {_supported()}). Cast it before saving, e.g. x.astype(jnp.complex64) for "
                "complex128, or save with format='orbax'."
            )


def _host(leaf: Any, place: str) -> np.ndarray:
    """The array's bytes in host memory, little-endian, as a flat uint8 view (no copy where possible)."""
    try:
        a = _little_endian(np.asarray(leaf))
    except Exception as e:
        raise CheckpointError(
            f"{keystr(place)}: could not read the array to save it ({type(e).__name__}: {e})."
        ) from e
    return a.reshape(-1).view(np.uint8)


def _write_array(f: Any, data: np.ndarray) -> None:
    """Write one chunk (a hook for tests that simulate a full disk or a crash)."""
    f.write(data)


def write(path: str | os.PathLike, leaves: Sequence[Any], doc: dict) -> None:
    """Write ``leaves`` (described by the manifest ``doc``, from `describe`) to one safetensors file.

    Arrays are laid out by decreasing item size, which keeps each aligned to it
    as the safetensors writer does; each is fetched to host memory once and
    written in chunks straight from its buffer, checksummed as it goes. The
    header, which holds the checksums, is written last into space reserved at
    the start.

    Raises:
        CheckpointError: an array this format cannot store (see `check_savable`).
    """
    check_savable(leaves, doc)
    arrays = doc["arrays"]
    dtypes = {
        i: _DTYPES[_TAGS[arrays[i]["dtype"]]] for i in range(len(arrays)) if not arrays[i].get("left_out")
    }
    order = sorted(dtypes, key=lambda i: -dtypes[i].itemsize)
    header: dict[str, Any] = {}
    pos = 0
    for i in order:
        n = nbytes(dtypes[i], arrays[i]["shape"])
        header[arrays[i]["name"]] = {
            "dtype": _TAGS[arrays[i]["dtype"]],
            "shape": arrays[i]["shape"],
            "data_offsets": [pos, pos + n],
        }
        pos += n

    def header_bytes(sums: Sequence[int]) -> bytes:
        for i, c in zip(order, sums):
            arrays[i][CHECKSUM] = c
        full = {**pack(doc), "checksum": CHECKSUM}
        meta = {"__metadata__": {"format": FORMAT, FORMAT: json.dumps(full, separators=(",", ":"))}}
        return json.dumps({**meta, **header}, separators=(",", ":"), ensure_ascii=False).encode()

    # A CRC is at most 10 digits: reserve room for the widest header, pad with spaces so that the
    # data start on a 64-byte boundary (safetensors asks for 8; 64 suits every dtype and SIMD copy).
    reserved = len(header_bytes([0xFFFFFFFF] * len(order)))
    reserved += -(8 + reserved) % _ALIGN

    def body(f: Any) -> None:
        f.write(b"\0" * (8 + reserved))
        sums = []  # in `order`
        for i in order:
            data = _host(leaves[i], arrays[i]["places"][0])
            crc = 0
            for start in range(0, data.nbytes, _CHUNK):
                chunk = data[start : start + _CHUNK]
                _write_array(f, chunk)
                crc = _crc32c(chunk, crc)
            sums.append(crc)
        head = header_bytes(sums)
        head += b" " * (reserved - len(head))
        f.seek(0)
        f.write(len(head).to_bytes(8, "little") + head)

    _atomic_write(os.fspath(path), body)


def _temp_prefix(target: str) -> str:
    return f".{os.path.basename(target)}.tied-tmp-"


def _leftovers(target: str) -> list[str]:
    """Temporary files of earlier saves to ``target``: ours, and the ``.{name}.{hex}.tmp`` of tied 0.1."""
    folder = os.path.dirname(os.path.abspath(target))
    name = os.path.basename(target)
    old = re.compile(re.escape(f".{name}.") + r"[0-9a-f]{12}\.tmp\Z")
    prefix = _temp_prefix(target)
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, e) for e in entries if e.startswith(prefix) or old.match(e)]


def _remove_leftovers(target: str) -> None:
    """Remove the temporary files of saves to ``target`` that died; a live save's lock keeps its own."""
    if fcntl is None:
        return
    for tmp in _leftovers(target):
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # gone already, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a save in progress holds it
            # Unlink only the file we hold: the name may have been renamed away and reused meanwhile.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(tmp))
            except OSError:
                same = False
            if same:
                _unlink_quietly(tmp)
        finally:
            os.close(fd)


def _create_locked_temp(target: str) -> tuple[str, int]:
    """A new temporary file beside ``target``, created and locked by us (retried if a cleaner raced us)."""
    folder = os.path.dirname(os.path.abspath(target))
    for _ in range(100):
        tmp = os.path.join(folder, _temp_prefix(target) + secrets.token_hex(8))
        # os.open with 0o666 lets the umask decide the mode, as for any new file.
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        if fcntl is None:
            return tmp, fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: unlocked, so no cleaner will take it for dead
            return tmp, fd
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(tmp)):
                return tmp, fd
        except OSError:
            pass
        os.close(fd)  # a cleaner removed it between our create and our lock: take another name
    raise CheckpointError(f"{target}: could not create a temporary file beside it that stays in place.")


def _atomic_write(path: str, body: Callable[[Any], None]) -> None:
    _remove_leftovers(path)
    tmp, fd = _create_locked_temp(path)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            body(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    finally:
        os.close(fd)  # releases the lock, after the rename
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _unlink_quietly(path: str) -> None:
    """Remove the file ``path`` if it can be: a cleanup that fails (the file gone already, or not
    ours to remove) is passed over, never raised over the error or the save it tidies after."""
    try:
        os.unlink(path)
    except OSError:
        pass


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


# ---------------------------------------------------------------- reading


class Tensor(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class Header(NamedTuple):
    """A checked safetensors header: the tensor table, the tied manifest (None in a plain file),
    where the data start, and the file's size."""

    tensors: dict[str, Tensor]
    doc: dict | None
    data_start: int
    size: int


def read_header(f: Any, where: str) -> Header:
    """The tensor table and the tied manifest, every field checked against the file's real size."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise corrupt(where, f"the file has {size} bytes, fewer than the 8 of a safetensors length prefix")
    n = int.from_bytes(f.read(8), "little")
    if n > _MAX_HEADER or n > size - 8:
        raise corrupt(
            where,
            f"the header claims {n} bytes but the file has {size - 8} after the length prefix "
            f"(and headers are limited to {_MAX_HEADER})",
        )
    raw = f.read(n)
    if len(raw) != n:
        raise corrupt(where, "the header ends early")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise corrupt(where, f"the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise corrupt(where, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise corrupt(where, "__metadata__ is not an object")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, Tensor] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise corrupt(where, f"tensor {name!r}: its entry is not an object")
        tag, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(tag, str) or tag not in _DTYPES:
            raise corrupt(where, f"tensor {name!r}: unknown dtype {tag!r} (tied reads {', '.join(_DTYPES)})")
        if not valid_shape(shape):
            raise corrupt(where, f"tensor {name!r}: invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs)):
            raise corrupt(where, f"tensor {name!r}: invalid data_offsets {offs!r}")
        begin, end = offs
        dt = _DTYPES[tag]
        n_bytes = nbytes(dt, shape)
        if not 0 <= begin <= end or end - begin != n_bytes:
            raise corrupt(
                where,
                f"tensor {name!r}: offsets {offs} do not span the {n_bytes} bytes of shape {shape} {tag}",
            )
        if end > data_size:
            raise corrupt(
                where,
                f"tensor {name!r}: its data ends at byte {end} of the data section, which has only "
                f"{data_size} bytes",
            )
        tensors[name] = Tensor(dt, tuple(shape), begin, end)
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise corrupt(where, "tensors overlap or leave gaps in the data section")
        pos = end
    if pos != data_size:
        raise corrupt(where, f"{data_size - pos} bytes follow the last tensor")
    if meta is None or FORMAT not in meta:
        return Header(tensors, None, data_start, size)
    if not isinstance(meta[FORMAT], str):
        raise corrupt(where, f"the metadata entry '{FORMAT}' is not a string")
    try:
        doc = json.loads(meta[FORMAT])
    except (ValueError, RecursionError) as e:
        raise corrupt(where, f"the metadata entry '{FORMAT}' is not JSON ({type(e).__name__})") from None
    return Header(tensors, _check_doc(validate(doc, where), tensors, where), data_start, size)


def checksum_of(doc: dict) -> str:
    """The checksum algorithm a (checked) manifest's array entries carry."""
    return "crc32" if doc["version"] == 1 else doc["checksum"]


def _check_doc(doc: dict, tensors: dict[str, Tensor], where: str) -> dict:
    """What this format adds to a validated manifest: every array is a tensor of the file, with its
    dtype and shape, and carries a checksum of an algorithm this tied knows."""

    def bad(what: str) -> CheckpointError:
        return corrupt(where, f"the '{FORMAT}' metadata is malformed: {what}")

    algo = "crc32" if doc["version"] == 1 else doc.get("checksum")
    if not isinstance(algo, str) or algo not in _CHECKSUMS:
        raise bad(f"unknown checksum {algo!r} (tied reads {', '.join(_CHECKSUMS)})")
    named = set()
    for a in doc["arrays"]:
        if a.get("left_out"):  # described, not stored (`tied.save(only=...)`)
            continue
        name = a["name"]
        if name not in tensors:
            raise bad(f"an array names tensor {name!r}, which the file does not hold")
        named.add(name)
        t = tensors[name]
        if a["dtype"] != t.dtype.name or a["shape"] != list(t.shape):
            raise bad(f"array {name!r}: dtype/shape {a['dtype']}/{a['shape']} disagree with the header")
        c = a.get(algo)
        if not is_int(c) or not 0 <= c <= 0xFFFFFFFF:
            raise bad(f"array {name!r} has no {algo}")
    if named != set(tensors):
        raise bad(f"tensors {sorted(set(tensors) - named)} are in the file but not in the metadata")
    return doc


def open_header(path: str) -> Header:
    """Open ``path`` and read its checked header (the file is closed again).

    Raises:
        FileNotFoundError: nothing is there (the caller says what was expected).
        CheckpointError: something other than a regular file is there (a directory, a pipe
            that would block the read, a loop of symbolic links, a file it may not read), or its
            header is not a checked safetensors header.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise corrupt(path, f"it is {what}, where a safetensors file was expected")
        f = open(path, "rb")
    except FileNotFoundError:
        raise
    except OSError as e:  # a loop of symbolic links, no permission to read
        raise corrupt(path, f"it cannot be opened ({e.strerror or type(e).__name__})") from None
    with f:
        return read_header(f, path)


def _aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer starting on a 64-byte boundary (so that JAX on CPU can adopt it without a copy)."""
    buf = np.empty(nbytes + _ALIGN, np.uint8)
    start = -buf.ctypes.data % _ALIGN
    return buf[start : start + nbytes]


def read(path: str, header: Header, names: Sequence[str], sums: Sequence[int | None], algo: str) -> list:
    """The named tensors, each copied once from a memory map of the file into a new buffer and
    checked against its checksum (where one is given) chunk by chunk, while the chunk is in cache.

    The arrays are the caller's own: nothing else refers to their memory, so
    ``jax.device_put`` may adopt them and a numpy leaf may be one. (A view of the
    mapping itself would not do: JAX on CPU adopts an aligned host buffer
    without copying, which would make the loaded model change with the file.)
    """
    update = _CHECKSUMS[algo]
    out = []
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != header.size:
            raise corrupt(path, "the file changed size while it was read")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for name, want in zip(names, sums):
            t = header.tensors[name]
            raw = np.frombuffer(mm, np.uint8, t.end - t.begin, header.data_start + t.begin)
            dest = _aligned_empty(raw.nbytes)
            crc = 0
            for start in range(0, raw.nbytes, _CHUNK):
                chunk = dest[start : start + _CHUNK]
                np.copyto(chunk, raw[start : start + _CHUNK])
                if want is not None:
                    crc = update(chunk, crc)
            del raw
            if want is not None and crc != want:
                raise corrupt(path, f"the bytes of {name!r} do not match their {_SHOWN[algo]} checksum")
            x = dest.view(t.dtype.newbyteorder("<")).reshape(t.shape)
            out.append(x if x.dtype.isnative else x.astype(t.dtype))
    finally:
        mm.close()
    return out
