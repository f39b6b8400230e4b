"""Errors about one place of a model: the path and the reason, carried apart, formatted here once.

`GraphError`, `CheckpointError`, `PathError` and `ModelChangedError` carry ``.path`` (the keystr
path of the place, ``""`` for the root, ``None`` for an error about no single place) and
``.reason`` (the rest of the message: what was expected, what was found, the fix). A caller that
shows the place otherwise (`tied.jit` names ``args[0]`` where the core sees ``[0][0]``) re-raises
with `Located.named`, never by parsing a message.
"""

from __future__ import annotations

from collections.abc import Callable


def where(path: str | None) -> str:
    """A place's path as every message shows it: the keystr path, ``<root>`` for the root."""
    return path or "<root>"


class Located:
    """The mixin of errors about a place: ``.path`` and ``.reason``, and the one message format
    ``"{path}: {reason}"``."""

    path: str | None
    reason: str

    def __init__(self, reason: str = "", path: str | None = None, *, name: Callable[[str], str] = where):
        self.reason, self.path = reason, path
        super().__init__(reason if path is None else f"{name(path)}: {reason}")

    def named(self, name: Callable[[str], str]):
        """The same error with its path shown as ``name(path)`` (`tied.jit`: ``args[0]...``)."""
        return type(self)(self.reason, self.path, name=name)

    def __reduce__(self):  # pickles (a process pool) with its path, not as one message
        return (type(self), (self.reason, self.path))


class ModelChangedError(Located, RuntimeError):
    """A model that changed while a compiled call or a gradient ran (another thread, or a callback
    inside the function, assigned to it): nothing was written into it.

    Examples:
        >>> import tied
        >>> e = tied.ModelChangedError("this place was changed while the call ran", "['w']")
        >>> e.path, str(e)
        ("['w']", "['w']: this place was changed while the call ran")
    """
