"""What differs between the dependency versions `tied` supports, checked and detected once at import.

`check_versions` runs first (tied/__init__.py imports this module before anything else, and this
module checks before it imports JAX): a dependency older than `MIN_VERSIONS` is an ImportError that
names the package, the version found and the one needed, instead of an AttributeError from deep in
the core. `MIN_VERSIONS` are pyproject.toml's lower bounds (tests/test_compat.py keeps them equal),
which `make test-min` installs and tests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata

__all__ = ["MIN_VERSIONS", "check_versions", "is_pytree_node"]

# Distribution name -> lowest supported version: pyproject.toml's `>=` bounds of the core dependencies.
MIN_VERSIONS: dict[str, str] = {
    "jax": "0.10.2",  # 0.10.1: jax.nn.relu(view) refused (no register_canonicalize_value_handler)
    "numpy": "2.0",
    "optax": "0.2.5",
    "safetensors": "0.7",  # 0.6: no complex64
    "google-crc32c": "1.6",  # 1.5 needs pkg_resources (not in new setuptools), else warns
    "orbax-checkpoint": "0.12.5",  # 0.12.4: NumpyHandler has no deepcopy_host_arrays
}


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '0.7.1rc1' and '0.7.1.dev2025' -> (0, 7, 1)."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:  # not installed, or vendored without metadata: not ours to judge
        return None


def check_versions(versions: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError if an installed dependency is older than `tied` supports.

    Args:
        versions: distribution name -> installed version (None: not installed); by default the
            installed versions of the packages in `MIN_VERSIONS`, read from their metadata.

    Raises:
        ImportError: naming each package that is too old, the version found and the one needed.
    """
    if versions is None:
        versions = {name: _installed(name) for name in MIN_VERSIONS}
    old = [
        (name, found, MIN_VERSIONS[name])
        for name, found in versions.items()
        if found is not None and name in MIN_VERSIONS and _release(found) < _release(MIN_VERSIONS[name])
    ]
    if old:
        found = ", ".join(f"{name} {v} (tied needs {name}>={need})" for name, v, need in old)
        fix = " ".join(f"'{name}>={need}'" for name, _, need in old)
        raise ImportError(f"tied does not support the installed {found}; upgrade: pip install -U {fix}")


check_versions()

import jax  # noqa: E402 - after the version check, so that an old JAX is named, not failed on

_registry = jax.tree_util.default_registry


def is_pytree_node(t: type) -> bool:
    """Whether ``t`` is a node type of JAX's default pytree registry."""
    return _registry.is_node(t)
