"""The contributors' map, checked: folders, file sizes, no import circle, function lengths.

Imports are read from the source with `ast` (not by importing), so an import inside
a function counts as much as one at the top. The layer contracts between folders are in
``.importlinter`` (run by ``lint-imports`` in ``make test``); this file checks what
import-linter does not: sizes, lengths, circles among any modules (folders recursed), that a
module takes from another folder only what that folder's ``__init__`` exports, and that the
contributors' map and each folder's README name modules that exist.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "tied"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80  # code lines: a docstring does not count

# Generated-code emitters: one straight-line plan (or one loop body) per function, each
# branch emitting the lines for one kind of node; split up, they would thread a dozen
# shared locals (the namespace, the emitted lines, the locals already bound) through
# every piece.
EMITTERS = {
    "_core.plans.compile.compile_unflatten",
    "_core.plans.loops.flatten_loop",
}

# Known debts, each with its owner's fix; delete an entry when it is paid.
KNOWN_LONG = {
    "demo.main": "the demo script's body: split argument parsing, training and sampling",
    "_checkpoint.api.match_keys": "split the key matching from the error it builds",
}
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()  # none left


def _name(path: pathlib.Path) -> str:
    """The dotted module name below ``tied`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_name(f): ast.parse(f.read_text(), str(f)) for f in sorted(SRC.rglob("*.py"))}


def _package(name: str, modules: dict) -> str:
    """The package a module's relative imports start from."""
    is_package = any(m.startswith(name + ".") for m in modules) or name == ""
    return name if is_package else name.rpartition(".")[0]


def _resolve(base: str, level: int, module: str | None) -> str:
    parts = base.split(".") if base else []
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    if module:
        parts += module.split(".")
    return ".".join(parts)


def _targets(name: str, node: ast.ImportFrom, modules: dict) -> list[str]:
    """The tied modules one ``from ... import ...`` statement imports."""
    if node.level:
        where = _resolve(_package(name, modules), node.level, node.module)
    elif node.module and node.module.split(".")[0] == "tied":
        where = node.module.partition(".")[2]
    else:
        return []
    subs = [f"{where}.{a.name}" if where else a.name for a in node.names]
    # `from . import graph` imports the submodule, unless the package binds that name itself
    # (`_transforms` exports the function `stack`, which shadows its module `_transforms.stack`)
    bound = _all_of(modules[where]) if modules.get(where) is not None else set()
    out = [s for s, a in zip(subs, node.names) if s in modules and a.name not in bound]
    if where in modules and len(out) < len(subs):  # names taken from the package itself
        out.append(where)
    return out


def _imports(name: str, tree: ast.Module, modules: dict) -> set[str]:
    """The tied modules ``name`` imports anywhere in its source (functions included)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.update(_targets(name, node, modules))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tied" and ".".join(parts[1:]) in modules:
                    out.add(".".join(parts[1:]))
    out.discard(name)
    out.discard("")
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, t, modules) for m, t in modules.items() if m}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as the list of modules round it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _function_lengths(tree: ast.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    n -= first.end_lineno - first.lineno + 1
            out[node.name] = max(n, out.get(node.name, 0))
    return out


def test_the_checks_see_every_folder():
    names = set(_modules())
    assert {"_core.graph", "_core.plans.compile", "_transforms.jit", "_checkpoint.manager"} <= names
    assert "_tree.map" in names
    assert {"nn", "optim", "_core", "_core.plans"} <= names  # packages, through their __init__


def test_no_source_file_is_over_800_lines():
    long = {
        str(f.relative_to(SRC)): n
        for f in SRC.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}, f"split these files along a concept (at most {MAX_FILE_LINES} lines): {long}"


def test_no_import_circle_among_the_modules_counting_imports_inside_functions():
    graph = _graph()
    for a, b in KNOWN_CIRCLE_EDGES:
        assert b in graph[a], f"{a} no longer imports {b}: remove the entry from KNOWN_CIRCLE_EDGES"
        graph[a].discard(b)
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    # The reference: a hand-made graph whose circle closes through an import in a function.
    src = "from .b import x\n\ndef f():\n    from . import a\n"
    modules = {"": None, "pkg": None, "pkg.a": None, "pkg.b": None}
    assert _imports("pkg.b", ast.parse(src), modules) == {"pkg.a"}
    up = "from ..other import y\nfrom .. import pkg\n"
    modules["other"] = None
    assert _imports("pkg.b", ast.parse(up), modules) == {"other", "pkg"}
    assert _imports("pkg.b", ast.parse("from .. import other\n"), modules) == {"other"}
    assert _cycle({"_a": {"_b"}, "_b": {"_a"}}) == ["_a", "_b", "_a"]
    assert _cycle({"_a": {"_b"}, "_b": set()}) is None


def test_no_function_is_over_80_lines_outside_the_generated_code_emitters():
    long = {}
    for name, tree in _modules().items():
        for fn, n in _function_lengths(tree).items():
            where = f"{name}.{fn}"
            if n > MAX_FUNCTION_LINES and where not in EMITTERS and where not in KNOWN_LONG:
                long[where] = n
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} code lines (split them): {long}"


@pytest.mark.parametrize("where", sorted(EMITTERS))
def test_each_allowed_emitter_says_why_it_is_long(where):
    module, _, fn = where.rpartition(".")
    tree = _modules()[module]
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn)
    path = SRC / (module.replace(".", "/") + ".py")
    source = path.read_text().splitlines()
    assert any("generated-code emitter" in line for line in source[node.lineno - 3 : node.lineno + 1])


FOLDERS = ("_core", "_transforms", "_checkpoint", "_tree", "nn", "optim")


def _folder(name: str) -> str:
    return name.split(".")[0]


def test_every_folder_has_a_readme_and_an_init_naming_what_it_exports():
    for folder in FOLDERS:
        assert (SRC / folder / "__init__.py").exists(), folder
        if folder.startswith("_"):
            assert (SRC / folder / "README.md").exists(), f"{folder}/README.md"
            tree = _modules()[folder]
            assert any(
                isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                for n in tree.body
            ), f"{folder}/__init__.py has no __all__"


@functools.cache  # asked once per cross-folder import: parse the sources once per folder, not each time
def _exports(folder: str) -> frozenset[str]:
    return _all_of(_modules()[folder])


def _all_of(tree: ast.Module) -> frozenset[str]:
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets):
            return frozenset(ast.literal_eval(n.value))
    return frozenset()


def _cross_folder_imports() -> list[tuple[str, str, str]]:
    """(importer, imported module, name) for each name a module takes from another folder."""
    modules = _modules()
    out = []
    for name, tree in modules.items():
        if not name or name == "__init__":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target in _targets(name, node, modules):
                if _folder(target) != _folder(name) and _folder(target) in FOLDERS:
                    out += [(name, target, a.name) for a in node.names]
    return out


def test_a_module_takes_from_another_folder_only_what_its_init_exports():
    bad = [
        f"{who} imports {name} from tied.{where}"
        for who, where, name in _cross_folder_imports()
        if where != _folder(where) or name not in _exports(where)
    ]
    fix = "import these through the folder's __init__ (and add them to its __all__):\n"
    assert bad == [], fix + "\n".join(bad)


def test_no_underscore_name_is_imported_across_folders():
    found = _cross_folder_imports()
    bad = [f"{who}: {name} from {where}" for who, where, name in found if name.startswith("_")]
    assert bad == [], bad


_MODULE_REF = re.compile(r"`([a-z_]+(?:/[a-z_]+)*\.py)`")


@pytest.mark.parametrize("readme", ["README.md", *[f"{f}/README.md" for f in FOLDERS if f.startswith("_")]])
def test_the_maps_name_only_modules_that_exist(readme):
    path = SRC / readme
    named = _MODULE_REF.findall(path.read_text())
    assert named, f"{readme} names no module"
    base = path.parent
    root = SRC.parent.parent
    missing = [m for m in named if not any((b / m).exists() for b in (base, SRC, root))]
    assert missing == [], f"{readme} names modules that do not exist: {missing}"
