"""A managed checkpoint directory: saves every N steps in the background, keeps the last k, resumes.

`CheckpointManager` is a thin layer over Orbax's ``CheckpointManager``: Orbax
writes each step (in the background, coordinating the processes), commits it by
a rename and deletes old steps after a newer one is committed; `tied` owns what
is saved and what is read back. Each step is a directory in the
``tied.save(..., format="orbax")`` layout (`orbax_format.py`): the unique arrays under
their manifest names and the tie manifest of `_manifest.py` beside them, so
``tied.load(directory, like)`` reads the latest step too, and
``tied.load(directory / "25", like)`` step 25.

Layout::

    directory/
      20/  25/                        # complete steps: arrays/, tied/metadata, commit marker
      30.orbax-checkpoint-tmp/        # a save in flight (or killed): never listed
      .tied-saving-30-<token>         # its writer's marker (host, process id): see `_stepdir`
      .tied-deleting/15/              # an old step being deleted: renamed out of the listing first
      notes.txt  logs/                # anything else: ignored, never deleted

Several managers may open one directory: a writer and any number of readers
(an evaluator listing and restoring the latest step). A manager that only reads
changes nothing in the directory; one that saves removes, before its first
save, only what is provably abandoned (`_stepdir`). Each save checks the step
against the directory as it is then, not as it was when the manager opened.

Pending saves at exit. A script that ends normally (its main thread returns, or
`sys.exit`) with a save in flight and no `wait` or `close` gets it finished
before the interpreter tears down the thread pools Orbax writes with; if that
save fails, the error is printed and the process exits with status 1, never 0.
(Orbax 0.12.8's own manager does not: its background thread then fails with
"cannot schedule new futures after interpreter shutdown", and its ``__del__``
only warns to call ``wait_until_finished`` before the program ends; the hook
runs where Python's own executors stop, before non-daemon threads are joined.)
A killed process (SIGKILL, ``os._exit``) leaves its save
unfinished: never listed, and removed by the next manager that saves.

Why the values are copied before `save` returns. An asynchronous save writes
after `save` has returned, while training goes on; the caller may donate the
arrays it saved to the next step (their buffers reused) or change a numpy array
in place. So `save` first copies every value it will write: arrays that this
process holds whole go into host staging buffers, allocated at the first save
and reused after (a fresh host buffer costs page faults, about half a synchronous
save; a reused one only a memory copy), and arrays split over processes into a
fresh on-device copy, which Orbax then moves to the host itself. Only after that
copy does `save` return, and the staging buffers are written again only once the
save that used them is complete.
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import orbax_format, stepdir
from .document import CheckpointError

__all__ = ["CheckpointManager"]


def _check_count(name: str, value: Any, *, none: bool) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = "a positive int or None" if none else "a positive int"
        raise ValueError(f"tied.CheckpointManager({name}=...) takes {allowed}, got {value!r}.")


class _Keep:
    """Orbax's preservation policy here: the last ``latest`` complete tied steps, every step divisible
    by ``every``, and whatever Orbax lists that is not a tied step (a user's directory named by digits)."""

    def __init__(self, root: str, latest: int | None, every: int | None):
        self.root, self.latest, self.every = root, latest, every

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        ours = [self._ours(c.step) for c in checkpoints]
        steps = sorted(c.step for c, mine in zip(checkpoints, ours) if mine)
        last = set(steps if self.latest is None else steps[max(0, len(steps) - self.latest) :])
        return [
            not mine or c.step in last or (self.every is not None and c.step % self.every == 0)
            for c, mine in zip(checkpoints, ours)
        ]

    def _ours(self, step: int) -> bool:
        full = os.path.join(self.root, str(step))
        # The step being saved has no final directory yet: it is ours.
        return not os.path.exists(full) or os.path.isdir(os.path.join(full, orbax_format._MANIFEST))


class CheckpointManager:
    """A checkpoint directory for a training run: periodic (background) saves, old steps pruned, resume.

    Every `save` of a due step writes ``directory/<step>`` in the
    ``tied.save(..., format="orbax")`` layout, ties and all; `restore` reads the
    latest complete step (or a given one) onto ``like``, every tie restored as
    `tied.load` does. A step is listed only once it is complete: a save killed
    mid-write never is, and the next manager opened on the directory removes it.

    Which steps are kept. After a save is complete (never before), the steps
    kept are the last ``max_to_keep`` complete steps plus every step divisible by
    ``keep_every`` (those do not count towards ``max_to_keep``); the others are
    deleted. So ``max_to_keep=2, keep_every=10`` leaves steps 10, 20, 25 after
    saves at 5, 10, ..., 25, and steps 10, 20, 24, 25 after saves at every step
    1..25 (a step 0 would be kept too: 0 is divisible by 10). Files and
    directories that are not tied steps are ignored and never deleted.

    Every process of a multi-process run makes the same calls, in the same
    order; Orbax coordinates the writes (each process writes its own shards).

    Args:
        directory: the run's checkpoint directory (created if missing); it may
            hold other files.
        max_to_keep: how many of the latest complete steps to keep (None: all).
        keep_every: also keep every step divisible by this (None: none).
        save_interval_steps: `save` writes the steps divisible by this (and any
            step with ``force=True``).
        async_save: write in the background: `save` returns once the values are
            copied (True), or once the step is complete on disk (False).

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp, optax, tied
        >>> emb = tied.nn.Embedding(8, 4, key=jax.random.key(0))
        >>> model = {"embed": emb, "head": emb}            # one Embedding at two places
        >>> opt = tied.optim.setup(optax.adam(1e-2), model)
        >>> with tied.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mngr:
        ...     for step in range(1, 6):
        ...         _ = mngr.save(step, {"model": model, "opt": opt}, {"step": step})
        ...     mngr.wait()
        ...     print(mngr.all_steps(), mngr.latest_step(), mngr.metadata())
        ...     back = mngr.restore({"model": model, "opt": opt})
        [4, 5] 5 {'step': 5}
        >>> back["model"]["head"] is back["model"]["embed"]
        True
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        keep_every: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        _check_count("max_to_keep", max_to_keep, none=True)
        _check_count("keep_every", keep_every, none=True)
        _check_count("save_interval_steps", save_interval_steps, none=False)
        orbax_format._ocp()  # orbax-checkpoint imported now, not in the middle of the first save
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(
                f"tied.CheckpointManager: {self.directory} is a file; a checkpoint directory is a "
                "directory. Pass another path."
            )
        if orbax_format._is_one_save(self.directory):
            raise CheckpointError(
                f"tied.CheckpointManager: {self.directory} is one saved step; open the directory that "
                f"holds it, {os.path.dirname(self.directory)}."
            )
        self._interval = int(save_interval_steps)
        self._async = bool(async_save)
        self._keep = (max_to_keep, keep_every)
        self._last: int | None = None  # the latest step: on disk at the last check, or saved since
        self._staging: dict[str, np.ndarray] = {}  # host buffers, reused from save to save
        self._lock = threading.RLock()  # one save, wait or restore at a time from this object
        self._closed = False
        # Orbax's manager is made at the first save: a manager that only reads never makes one, so it
        # never touches the directory (Orbax's would clean temporary directories, a writer's too).
        self._orbax: Any = None
        self._token = stepdir.new_token()
        self._marked: list[int] = []  # steps whose marker this manager left and has not removed
        os.makedirs(self.directory, exist_ok=True)
        # Steps only go up: the latest complete step at opening; each due save checks the directory again.
        self._last = self.latest_step()

    def _writer(self) -> Any:
        """Orbax's manager, made at the first save after removing what is provably abandoned."""
        if self._orbax is not None:
            return self._orbax
        ocp = orbax_format._ocp()
        if stepdir.primary():
            stepdir.clean(self.directory)
        arrays = ocp.PyTreeCheckpointHandler(
            # No zstd: trained weights hardly compress, and compressing takes the CPU time that a
            # training step running beside a background save needs.
            use_compression=False,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry(
                # The manager copies every host value itself (into its staging buffers), so
                # Orbax's own copy of numpy arrays would only be a second one.
                (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
                (jax.Array, ocp.type_handlers.ArrayHandler()),
            ),
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(orbax_format._ARRAYS, ocp.args.PyTreeSave, arrays)
        registry.add(orbax_format._ARRAYS, ocp.args.PyTreeRestore, arrays)
        registry.add(orbax_format._MANIFEST, ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        registry.add(orbax_format._MANIFEST, ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_Keep(self.directory, *self._keep),
            enable_async_checkpointing=self._async,
            create=True,
            # Only what is provably abandoned is removed (`stepdir.clean` above): Orbax's own
            # cleaning removes every temporary directory, another manager's save in flight too.
            cleanup_tmp_directories=False,
            # An old step is renamed out of the listing before its files go (`stepdir.purge`).
            todelete_subdir=stepdir.DELETING,
        )
        self._orbax = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        stepdir.register_exit()
        return self._orbax

    def _finished(self) -> None:
        """Wait for this manager's pending save, then drop its markers and the steps it deleted."""
        if self._orbax is None:
            return
        try:
            self._orbax.wait_until_finished()
        finally:
            stepdir.PENDING.discard(self)
        for step in self._marked:
            stepdir.unmark(self.directory, step, self._token)
        self._marked = []
        if stepdir.primary():
            stepdir.purge(self.directory)

    # ------------------------------------------------------------ context

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(
                f"tied.CheckpointManager.{what}: the manager of {self.directory} is closed."
            )

    # ------------------------------------------------------------ steps

    def all_steps(self) -> list[int]:
        """The complete steps in the directory, in increasing order (a save in flight or killed is not one).

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> w = jnp.ones(3)
            >>> with tied.CheckpointManager(tempfile.mkdtemp(), async_save=False) as mngr:
            ...     _ = mngr.save(2, {"a": w, "b": w}), mngr.save(7, {"a": w, "b": w})
            ...     mngr.all_steps()
            [2, 7]
        """
        if not os.path.isdir(self.directory):
            return []
        return orbax_format._entries(self.directory, complete=True)[0]

    def latest_step(self) -> int | None:
        """The latest complete step, or None when the directory holds none.

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> with tied.CheckpointManager(tempfile.mkdtemp()) as mngr:
            ...     print(mngr.latest_step())
            ...     _ = mngr.save(3, {"w": jnp.ones(2)})
            ...     mngr.wait()
            ...     print(mngr.latest_step())
            None
            3
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _step_dir(self, step: int | None, what: str) -> str:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"tied.CheckpointManager.{what}: {self.directory} holds no complete step to read "
                    "(latest_step() is None). Start the run from scratch, or open the directory it saved to."
                )
            step = steps[-1]
        elif _int_step(step, what) not in steps:
            shown = ", ".join(map(str, steps[-10:])) or "none"
            raise CheckpointError(
                f"tied.CheckpointManager.{what}: step {step} is not a complete step of {self.directory} "
                f"(complete steps: {shown})."
            )
        return os.path.join(self.directory, str(int(step)))

    # ------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        tree: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        only: None = None,
    ) -> bool:
        """Save ``tree`` as ``step`` if the step is due (divisible by ``save_interval_steps``, or ``force``).

        With ``async_save=True`` this returns once every value has been copied
        off the given arrays (into reused host buffers, or a device copy for an
        array split over processes): the caller may then update, donate or
        delete them, and the step is written in the background. A save waits
        first for the previous one to complete. With ``async_save=False`` it
        returns once the step is complete on disk.

        Args:
            step: a non-negative int greater than every step already saved in the
                directory (a step is checked even when it is not due).
            tree: the object graph to save (``{"model": ..., "opt": ..., "rng": ...}``); each
                shared array or node is stored once.
            metadata: JSON-serialisable values under string keys, read back by `metadata`.
            force: save even when ``step`` is not due.
            only: must be None: a step holds the whole tree (a file of some arrays, adapters say,
                is ``tied.save(path, tree, only=...)``).

        Returns:
            Whether the step was saved.

        Raises:
            CheckpointError: a step that is not a non-negative int (a bool or a float is
                refused), or not greater than the latest step; an array that cannot be
                saved (named by path); metadata that is not JSON; ``only`` given. Nothing is
                written then.

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> w = jnp.ones(3)
            >>> with tied.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=5) as mngr:
            ...     [mngr.save(s, {"a": w, "b": w}) for s in range(1, 11)]
            [False, False, False, False, True, False, False, False, False, True]
        """
        if only is not None:
            raise CheckpointError(
                "tied.CheckpointManager.save(only=...): a managed step is an Orbax checkpoint of the whole "
                "tree, which restore reads whole. A file of some arrays (adapters) and a fingerprint of the "
                "rest is tied.save(path, tree, only=...), a safetensors file: write it beside the steps."
            )
        with self._lock:
            self._open("save")
            step = _int_step(step, "save")
            self._check_step(step, self._last)  # a step that is not due: against the last check
            if not (force or step % self._interval == 0):
                return False
            doc, stored = orbax_format.prepare(self.directory, tree, metadata)
            self._check_step(step, self._latest_now())
            target = os.path.join(self.directory, str(step))
            if os.path.exists(target):
                raise CheckpointError(
                    f"tied.CheckpointManager.save: {target} exists and is not a complete tied step; it is "
                    "not ours to overwrite. Move it away, or save another step."
                )
            ocp = orbax_format._ocp()
            writer = self._writer()
            self._finished()  # the staging buffers are free again
            if stepdir.primary():
                busy = stepdir.busy(self.directory, step, self._token)
                if busy is not None:
                    raise CheckpointError(f"tied.CheckpointManager.save: {busy}; nothing was written.")
            items: dict[str, Any] = {orbax_format._MANIFEST: ocp.args.JsonSave(doc)}
            if stored:
                items[orbax_format._ARRAYS] = ocp.args.PyTreeSave(self._stage(stored))
            if stepdir.primary():
                stepdir.mark(self.directory, step, self._token)
                self._marked.append(step)
            stepdir.PENDING.add(self)
            writer.save(step, args=ocp.args.Composite(**items), force=True)
            self._last = step
            if not self._async:
                self._finished()  # complete on disk: its marker and the steps it made old go now
            return True

    def _latest_now(self) -> int | None:
        """The latest step saved: the directory's latest finalised step or this manager's last save.
        Read from the top down: a listing, and Orbax's check of one or two names."""
        ocp = orbax_format._ocp()
        on_disk = None
        for step in sorted((int(n) for n in os.listdir(self.directory) if n.isdigit()), reverse=True):
            full = os.path.join(self.directory, str(step))
            if os.path.isdir(os.path.join(full, orbax_format._MANIFEST)) and ocp.step.is_path_finalized(full):
                on_disk = step
                break
        return max((s for s in (on_disk, self._last) if s is not None), default=None)

    def _check_step(self, step: int, latest: int | None) -> None:
        if latest is None or step > latest:
            return
        complete = step in self.all_steps()
        raise CheckpointError(
            f"tied.CheckpointManager.save: step {step} is not greater than the latest step saved "
            f"to {self.directory}, {latest}. Steps only go up (force=True too); to start again, "
            "use another directory."
            + (
                f" Step {step} exists there and is complete (saved by this manager or another one "
                "on the directory); it is not overwritten."
                if complete
                else ""
            )
        )

    def _stage(self, stored: dict[str, Any]) -> dict[str, Any]:
        """Copies of the values to write, owned by this save: host buffers for what this process holds
        whole (reused from the last save when the shape and dtype match), a device copy otherwise."""
        host, split = {}, {}
        for name, x in stored.items():
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                split[name] = x
            else:
                host[name] = x
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()  # all transfers at once (a no-op on the CPU)
        out: dict[str, Any] = {}
        staging, copies = {}, []
        for name, x in host.items():
            dtype = np.dtype(x.dtype).newbyteorder("=")
            buf = self._staging.get(name)
            if buf is None or buf.shape != tuple(x.shape) or buf.dtype != dtype:
                buf = np.empty(x.shape, dtype)
            copies.append((buf, np.asarray(x)))
            out[name] = staging[name] = buf
        _copy_all(copies)
        self._staging = staging
        if split:
            names = list(split)
            copies = jax.jit(
                lambda *xs: [jnp.copy(x) for x in xs], out_shardings=[split[n].sharding for n in names]
            )(*split.values())
            out.update(zip(names, copies))
        return out

    def wait(self) -> None:
        """Block until every pending save is complete and durable and the deletions it made due are done.

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> with tied.CheckpointManager(tempfile.mkdtemp(), max_to_keep=1) as mngr:
            ...     _ = mngr.save(1, {"w": jnp.ones(2)}), mngr.save(2, {"w": jnp.zeros(2)})
            ...     mngr.wait()
            ...     mngr.all_steps()
            [2]
        """
        with self._lock:
            if not self._closed:
                self._finished()

    def close(self) -> None:
        """Wait for pending saves (`wait`), then release Orbax's threads; closing twice is fine.

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> mngr = tied.CheckpointManager(tempfile.mkdtemp())
            >>> mngr.save(1, {"w": jnp.ones(2)})
            True
            >>> mngr.close()
            >>> mngr.all_steps()
            [1]
        """
        with self._lock:
            if self._closed:
                return
            try:
                self._finished()
            finally:
                self._closed = True
                self._staging = {}
                stepdir.LIVE.discard(self._token)
                if self._orbax is not None:
                    self._orbax.close()

    # ------------------------------------------------------------ reading

    def restore(self, like: Any, step: int | None = None, *, strict: bool = True) -> Any:
        """Read a complete step (the latest by default) onto ``like``, every tie restored as `tied.load` does.

        Args:
            like: an object graph with the saved one's structure: arrays (restored
                onto their shardings) or ``jax.ShapeDtypeStruct`` leaves with shardings.
            step: the step to read (None: the latest complete one).
            strict: must be True: the tie manifest is always checked (``strict=False``
                reads single safetensors files by their keys, see `tied.load`).

        Returns:
            A new graph with ``like``'s structure and the step's values, one object
            at every place of a saved tie.

        Raises:
            CheckpointError: no complete step (or not the one asked for), or a
                ``like`` that differs from the saved tree (the path is named).

        Examples:
            >>> import tempfile, jax, tied
            >>> d = tied.nn.Dense(2, 2, key=jax.random.key(0))
            >>> model = tied.nn.Chain(d, tied.nn.Dense(d.weight, d.bias))   # both arrays at two places
            >>> with tied.CheckpointManager(tempfile.mkdtemp()) as mngr:
            ...     _ = mngr.save(10, model)
            ...     back = mngr.restore(model)
            >>> back.layers[0].weight is back.layers[1].weight
            True
        """
        if not strict:
            raise CheckpointError(
                "tied.CheckpointManager.restore(strict=False): a managed step is read with its tie "
                "manifest checked; strict=False reads single safetensors files (tied.load)."
            )
        with self._lock:
            self._open("restore")
            self._finished()  # a step this manager is still writing is read whole
            if step is not None:
                return orbax_format.load(self._step_dir(step, "restore"), like)
            # The latest step may be deleted while it is read (another manager's max_to_keep): its
            # files are renamed away first, so the read fails loudly; then the new latest is read.
            for _ in range(8):
                path = self._step_dir(None, "restore")
                try:
                    return orbax_format.load(path, like)
                except CheckpointError:
                    if os.path.isdir(path):
                        raise
            return orbax_format.load(self._step_dir(None, "restore"), like)

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` saved with a complete step (the latest by default).

        Examples:
            >>> import tempfile, jax.numpy as jnp, tied
            >>> with tied.CheckpointManager(tempfile.mkdtemp()) as mngr:
            ...     _ = mngr.save(4, {"w": jnp.ones(2)}, {"loss": 0.5})
            ...     mngr.metadata(4)
            {'loss': 0.5}
        """
        with self._lock:
            self._open("metadata")
            self._finished()
            return orbax_format.load_metadata(self._step_dir(step, "metadata"))


_CHUNK = 32 << 20  # bytes per piece of a parallel copy
_copier: ThreadPoolExecutor | None = None


def _copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` for each pair, big arrays cut in pieces copied by several threads
    (numpy releases the GIL while it copies): the staging copy is memory bound, not CPU bound."""
    global _copier
    small, pieces = [], []
    for dst, src in copies:
        if dst.nbytes < 2 * _CHUNK or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            small.append((dst, src))
            continue
        d, s = dst.reshape(-1), src.reshape(-1)
        step = max(1, _CHUNK // dst.itemsize)
        pieces += [(d[i : i + step], s[i : i + step]) for i in range(0, d.size, step)]
    if len(pieces) > 1 and (os.cpu_count() or 1) > 1:
        if _copier is None:
            _copier = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="tied-stage")
        list(_copier.map(lambda ds: np.copyto(*ds), pieces))
    else:
        small += pieces
    for dst, src in small:
        np.copyto(dst, src)


def _int_step(step: Any, what: str) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral):
        raise CheckpointError(
            f"tied.CheckpointManager.{what}: a step is an int, got {step!r} ({type(step).__name__}). "
            "Pass the training step count, e.g. int(step)."
        )
    if step < 0:
        raise CheckpointError(f"tied.CheckpointManager.{what}: a step is not negative, got {step}.")
    return int(step)
