"""The contributors' map, checked: file sizes, no import circle, function lengths.

Imports are read from the source with `ast` (not by importing), so an import inside
a function counts as much as one at the top. The layer contracts themselves are in
``.importlinter`` (run by ``lint-imports`` in ``make test``); this file checks what
import-linter does not: sizes, lengths, and circles among any modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "tied"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # code lines: a docstring does not count

# Generated-code emitters: one straight-line plan (or one loop body) per function, each
# branch emitting the lines for one kind of node; split up, they would thread a dozen
# shared locals (the namespace, the emitted lines, the locals already bound) through
# every piece.
EMITTERS = {"_plan.compile_flatten", "_plan.compile_unflatten", "_loops.flatten_loop"}

# Known debts, each with its owner's fix; delete an entry when it is paid.
KNOWN_LONG = {
    "demo.main": "the demo script's body: split argument parsing, training and sampling",
    "_checkpoint.match_keys": "split the key matching from the error it builds",
}
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()  # none left


def _modules() -> dict[str, ast.Module]:
    return {f.stem: ast.parse(f.read_text(), str(f)) for f in sorted(SRC.glob("*.py"))}


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The tied modules ``name`` imports anywhere in its source (functions included)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.split(".")[0] == "tied":
                parts = node.module.split(".")
                targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            else:
                continue
            out.update(t for t in targets if t in modules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tied" and len(parts) > 1 and parts[1] in modules:
                    out.add(parts[1])
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: _imports(m, t, names) for m, t in modules.items() if m != "__init__"}


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


def test_no_source_file_is_over_600_lines():
    long = {f.name: n for f in SRC.glob("*.py") if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these files along their seams (at most {MAX_FILE_LINES} lines): {long}"


def test_no_import_circle_among_the_modules_counting_imports_inside_functions():
    graph = _graph()
    for a, b in KNOWN_CIRCLE_EDGES:
        assert b in graph[a], f"{a} no longer imports {b}: remove the entry from KNOWN_CIRCLE_EDGES"
        graph[a].discard(b)
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    # The reference: a hand-made graph whose circle closes through an import in a function.
    src = "from ._b import x\n\ndef f():\n    from . import _a\n"
    tree = ast.parse(src)
    names = {"_a", "_b"}
    assert _imports("_b", tree, names) == {"_a"}
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
    module, fn = where.split(".")
    tree = _modules()[module]
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn)
    source = (SRC / f"{module}.py").read_text().splitlines()
    assert any("generated-code emitter" in line for line in source[node.lineno - 3 : node.lineno + 1])
