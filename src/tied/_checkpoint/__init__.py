"""Checkpoints: the manifest document, the format-neutral manifest, the safetensors and Orbax formats,
`save`/`load` and the `CheckpointManager`. See README.md beside this file.
"""

from .api import load, load_metadata, save
from .document import CheckpointError
from .manager import CheckpointManager

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "load",
    "load_metadata",
    "save",
]
