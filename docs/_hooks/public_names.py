"""Griffe extension: a public name that shadows its private module documents the object, not the module.

``tied/_transforms/__init__.py`` does ``from .grad import grad``: at run time ``tied._transforms.grad``
(and so ``tied.grad``) is the function, but Griffe keeps the submodule under that name (its data
model has one member per name, mkdocstrings/griffe#124), so ``::: tied.grad`` rendered the private
module: its docstring, and every helper in it as ``tied.grad.<helper>``. After the package is
loaded, each name of a package's ``__all__`` (``tied``, ``tied.nn``, ``tied.optim``) that Griffe
resolves to a module which defines a member of that same name is pointed at that member, as the
import does at run time. ``tests/test_site.py`` checks the outcome against the package at run time.
"""

from __future__ import annotations

from typing import Any

import griffe


def _shadowed(module: griffe.Module | griffe.Alias) -> None:
    for name in [str(e) for e in module.exports or []]:
        member = module.members.get(name)
        if member is None or not member.is_alias:
            continue
        try:
            target = member.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue  # left to mkdocstrings, which names it in its own error
        inner = target.members.get(name) if target.is_module else None
        if inner is not None and not inner.is_module:
            module.set_member(name, griffe.Alias(name, inner, parent=module))


class PublicNames(griffe.Extension):
    """Points each public name that Griffe resolves to its namesake private module at the object."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "tied":
            return
        for module in (pkg, pkg.members.get("nn"), pkg.members.get("optim")):
            if module is not None:
                _shadowed(module)
