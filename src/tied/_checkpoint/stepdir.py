"""Who owns what in a managed checkpoint directory: saves in flight, saves abandoned, steps being deleted.

Several managers may open one directory at once (a trainer writing, an
evaluator reading the latest step), so no manager may remove what another is
still writing. Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and
renames it when complete; before asking Orbax to write step ``s``, a manager
leaves a *marker* beside it, ``.tied-saving-<s>-<token>``, naming its host, its
process id and its token (one per manager object), and removes it once the step
is complete. A temporary directory is *abandoned*, and may be removed, only
when that is provable: no marker names its step (an Orbax or older tied save),
or every marker that does belongs to a process of this host that is gone, or to
a manager of this very process that was closed. A marker of another host is
never proof (its process cannot be asked), so such a directory stays, and a save
of that step is refused with its name. Only a manager that saves cleans, before
its first save: a manager that only reads never removes anything.

Deleting an old step first renames it out of the listing, into
``.tied-deleting/<step>`` (one rename: the step is listed or it is not), and
only then removes its files, so a crash in the middle never leaves a step that
looks complete with files missing. Leftovers there are removed by the next
saving manager.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import uuid
from typing import Any

import jax

from . import orbax_format

DELETING = ".tied-deleting"  # Orbax's `todelete_subdir`: old steps are renamed here, then removed
_MARK = ".tied-saving-"
_TMP = ".orbax-checkpoint-tmp"  # Orbax's suffix of a step being written (atomicity_types.TMP_DIR_SUFFIX)
LIVE: set[str] = set()  # tokens of this process's managers that are open


def new_token() -> str:
    token = uuid.uuid4().hex[:16]
    LIVE.add(token)
    return token


def mark(root: str, step: int, token: str) -> None:
    """Leave the marker of ``step`` (written whole: a temporary file renamed)."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "token": token, "step": step}
    path = os.path.join(root, f"{_MARK}{step}-{token}")
    with open(path + ".new", "w") as f:
        json.dump(me, f)
    os.replace(path + ".new", path)


def unmark(root: str, step: int, token: str) -> None:
    try:
        os.remove(os.path.join(root, f"{_MARK}{step}-{token}"))
    except FileNotFoundError:
        pass


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    try:  # a zombie (killed, not yet reaped by its parent) writes nothing more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _gone(owner: dict[str, Any]) -> bool:
    """Whether the manager that left a marker is provably gone (False when unknown)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    if owner["pid"] == os.getpid():
        return owner.get("token") not in LIVE
    return _pid_gone(owner["pid"])


def _step_of(name: str) -> int | None:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def scan(root: str) -> tuple[dict[int, list[dict]], list[tuple[str, int]], list[str]]:
    """The directory's saves in flight: ``({step: owners still possibly writing it}, abandoned
    temporary directories as (name, step), markers of gone managers)``."""
    ocp = orbax_format._ocp()
    owners: dict[int, list[tuple[str, dict]]] = {}
    tmps: list[tuple[str, int]] = []
    for name in os.listdir(root):
        if name.startswith(_MARK) and not name.endswith(".new"):
            try:
                with open(os.path.join(root, name)) as f:
                    owner = json.load(f)
                step = int(owner["step"])
            except (OSError, ValueError, TypeError, KeyError):
                continue  # removed meanwhile (its save completed), or not ours
            owners.setdefault(step, []).append((name, owner))
        elif (
            (s := _step_of(name)) is not None
            and _TMP in name  # Orbax's own check costs an event loop; most names are steps
            and ocp.step.is_path_temporary(os.path.join(root, name))
        ):
            tmps.append((name, s))
    live = {s: [o for _, o in found if not _gone(o)] for s, found in owners.items()}
    stale = [name for found in owners.values() for name, o in found if _gone(o)]
    abandoned = [(name, s) for name, s in tmps if not live.get(s)]
    return {s: os for s, os in live.items() if os}, abandoned, stale


def _rmtree(path: str) -> None:
    def missing_is_fine(fn, p, exc_info):
        if not issubclass(exc_info[0], FileNotFoundError):  # another cleaner got there first
            raise exc_info[1]

    shutil.rmtree(path, onerror=missing_is_fine)


def clean(root: str) -> None:
    """Remove what is provably abandoned: temporary directories of gone or unmarked saves, their
    markers, and steps left half-deleted in `DELETING`. Called by a manager before its first save."""
    if not os.path.isdir(root):
        return
    _, abandoned, stale = scan(root)
    for name, _ in abandoned:
        _rmtree(os.path.join(root, name))
    for name in stale:
        unmark_file = os.path.join(root, name)
        try:
            os.remove(unmark_file)
        except FileNotFoundError:
            pass
    purge(root)


def purge(root: str) -> None:
    """Remove the old steps Orbax renamed into `DELETING` (already out of every listing)."""
    if os.path.isdir(os.path.join(root, DELETING)):
        _rmtree(os.path.join(root, DELETING))


def busy(root: str, step: int, token: str) -> str | None:
    """Why ``step`` cannot be saved now because another manager may be writing it or a later step
    (a sentence naming the owner and the directory), or None."""
    live, _, _ = scan(root)
    for s in sorted(live, reverse=True):
        others = [o for o in live[s] if o.get("token") != token]
        if s >= step and others:
            o = others[0]
            return (
                f"step {s} is being saved to {root} by another manager (process {o.get('pid')} on host "
                f"{o.get('host')}; its marker is {_MARK}{s}-{o.get('token')}). Two managers must not "
                "write one directory; if that process is gone, remove that marker and "
                f"{s}.orbax-checkpoint-tmp"
            )
    return None


def primary() -> bool:
    """Whether this process handles the directory itself (markers, cleaning): the first, as in Orbax."""
    return jax.process_index() == 0


# Managers with a save that may still be in flight, finished at exit (strong references: a manager
# dropped without `close` keeps its save until then).
PENDING: set = set()  # of tied.CheckpointManager
_exit_hook = False


def _finish_at_exit() -> None:
    """Finish every pending save before Python stops its thread pools (which Orbax's background writes
    need); a save that fails then makes the process exit with status 1, its error printed."""
    failed = False
    for mngr in list(PENDING):
        try:
            mngr.close()
        except BaseException as e:  # noqa: BLE001 - reported, and the exit status says so
            failed = True
            print(
                f"tied.CheckpointManager: a save to {mngr.directory} pending at exit failed: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
            )
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def register_exit() -> None:
    global _exit_hook
    if _exit_hook:
        return
    # `threading._register_atexit` runs before Python's executors refuse new work and before
    # non-daemon threads are joined; `atexit` would run after both, too late for Orbax's threads.
    # Registered at the first save, long after concurrent.futures registered its own at import, so
    # it runs first (reverse order).
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        import atexit

        register = atexit.register
    register(_finish_at_exit)
    _exit_hook = True
