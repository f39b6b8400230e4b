"""Seeing the sharing: parameter counts, a summary table and a Graphviz picture of the DAG.

All three read the `GraphDef` of `tied.flatten`, so they see exactly the ties
the rest of the library acts on.

Places are counted as a tree unrolled from the DAG: a shared node stands at
each of its places with everything under it; a view's place holds its source
(counted with the source's size there); a reference back to a node that is
already open above (a cycle) is a place of its own but holds nothing more,
since its contents are counted where the node was entered.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import jax
import numpy as np

from ._grad import is_param
from ._graph import (
    DICT,
    LIST,
    NAMEDTUPLE,
    OBJ,
    PYTREE,
    SLOTS,
    TUPLE,
    VIEW,
    GraphDef,
    _child_key,
    flatten,
    place_paths,
)

__all__ = ["param_count", "summary", "print_summary", "to_dot", "render_dot"]


def _size(x: Any) -> int:
    return int(np.prod(x.shape, dtype=np.int64))


def _nbytes(x: Any) -> int:
    return _size(x) * np.dtype(x.dtype).itemsize


def _fn_name(fn: Any) -> str:
    """A stable name for a view function (never a repr holding a memory address)."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    return f"partial({_fn_name(inner)})" if inner is not None else type(fn).__name__


def _node_type(kind: int, meta: Any) -> str:
    if kind == LIST:
        return "list"
    if kind == DICT:
        return "dict"
    if kind == TUPLE:
        return "tuple"
    if kind in (OBJ, SLOTS):
        return meta[0].__name__
    if kind == NAMEDTUPLE:
        return meta.__name__
    if kind == PYTREE:
        return meta[0].__name__
    if kind == VIEW:
        return "View"
    return "?"


def _keystr(path: str) -> str:
    return path or "<root>"


# ---------------------------------------------------------------- counting


class _Tally:
    """Parameters and bytes per place of every node, memoised where no cycle is open."""

    def __init__(self, gdef: GraphDef, leaves: list):
        self.gdef = gdef
        self.leaf = [(_size(x) if is_param(x) else 0, _nbytes(x)) for x in leaves]
        self.memo: dict[int, tuple[int, int]] = {}
        self.open: set[int] = set()

    def __call__(self, r: int) -> tuple[int, int, frozenset]:
        q, m = divmod(r, 3)
        if m == 0:
            return (*self.leaf[q], frozenset())
        if m == 2:
            return 0, 0, frozenset()
        if q in self.open:  # a reference back up a cycle: nothing new below it
            return 0, 0, frozenset((q,))
        if q in self.memo:
            return (*self.memo[q], frozenset())
        self.open.add(q)
        params = nbytes = 0
        back: frozenset = frozenset()
        for c in self.gdef.records[q][2]:
            p, b, cb = self(c)
            params, nbytes, back = params + p, nbytes + b, back | cb
        self.open.discard(q)
        back = back - {q}
        if not back:
            self.memo[q] = (params, nbytes)
        return params, nbytes, back


def param_count(tree: Any, per_place: bool = False) -> int:
    """The number of parameters (elements of inexact-dtype arrays), each shared array counted once.

    Args:
        tree: an object graph (a model, a gradient, an optimiser state).
        per_place: count every place instead: a parameter at k places counts k
            times, a shared node's parameters at each of its places, a view's
            place the size of its source. What summing ``numel()`` over places
            gives; the difference to the default is what the ties save.

    Returns:
        The count. Integer and boolean arrays are not parameters and count 0;
        views count nothing extra by default (their source is counted once).

    Example:
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))
        >>> tied.param_count(model), tied.param_count(model, per_place=True)
        (6, 12)
    """
    leaves, gdef = flatten(tree)
    if not per_place:
        return sum(_size(x) for x in leaves if is_param(x))
    return _Tally(gdef, leaves)(gdef.root)[0]


# ---------------------------------------------------------------- summary


@dataclass
class _Row:
    path: str
    type: str
    shape: str
    dtype: str
    params: int
    note: str


def _rows(tree: Any) -> tuple[list[_Row], dict[str, int]]:
    leaves, gdef = flatten(tree)
    places = place_paths(gdef)
    tally = _Tally(gdef, leaves)
    records = gdef.records
    rows: list[_Row] = []
    seen: set[int] = set()
    open_nodes: list[int] = []

    def first(r: int) -> str:
        q, m = divmod(r, 3)
        return _keystr((places.leaves[q] if m == 0 else places.nodes[q])[0])

    def array_row(path: str, x: Any, note: str) -> _Row:
        kind = "Array" if isinstance(x, jax.Array) else type(x).__name__
        params = _size(x) if is_param(x) else 0
        return _Row(_keystr(path), kind, str(tuple(x.shape)), np.dtype(x.dtype).name, params, note)

    def view_row(path: str, q: int) -> _Row:
        fn = records[q][1]
        src_ref = records[q][2][0]
        shape = dtype = "?"
        params = 0
        if src_ref % 3 == 0:
            src = leaves[src_ref // 3]
            params = _size(src) if is_param(src) else 0
            try:
                out = jax.eval_shape(fn, jax.ShapeDtypeStruct(src.shape, src.dtype))
                shape, dtype = str(tuple(out.shape)), np.dtype(out.dtype).name
            except Exception:  # a function eval_shape cannot trace: show what we know
                pass
        else:
            params = tally(src_ref)[0]
        return _Row(_keystr(path), "View", shape, dtype, params, f"{_fn_name(fn)} of {first(src_ref)}")

    def visit(r: int, path: str) -> None:
        q, m = divmod(r, 3)
        if m == 2:
            return
        if r in seen:
            if m == 0:
                rows.append(array_row(path, leaves[q], f"tied to {first(r)}"))
            elif q in open_nodes:
                note = f"tied to {first(r)} (reference cycle)"
                rows.append(_Row(_keystr(path), _node_type(*records[q][:2]), "", "", 0, note))
            elif records[q][0] == VIEW:
                row = view_row(path, q)
                row.note += f", tied to {first(r)}"
                rows.append(row)
            else:
                rows.append(
                    _Row(
                        _keystr(path), _node_type(*records[q][:2]), "", "", tally(r)[0], f"tied to {first(r)}"
                    )
                )
            return
        seen.add(r)
        if m == 0:
            rows.append(array_row(path, leaves[q], ""))
            return
        kind, meta, refs = records[q]
        if kind == VIEW:
            rows.append(view_row(path, q))
            # The source's place under the view is shown only where the source is first met.
            if refs[0] not in seen:
                visit(refs[0], path + _child_key(kind, meta, 0, 1))
            return
        rows.append(_Row(_keystr(path), _node_type(kind, meta), "", "", tally(r)[0], ""))
        open_nodes.append(q)
        for i, c in enumerate(refs):
            visit(c, path + _child_key(kind, meta, i, len(refs)))
        open_nodes.pop()

    visit(gdef.root, "")
    totals = {
        "params": sum(_size(x) for x in leaves if is_param(x)),
        "params_per_place": tally(gdef.root)[0],
        "bytes": sum(_nbytes(x) for x in leaves),
        "bytes_per_place": tally(gdef.root)[1],
        "arrays": len(leaves),
    }
    return rows, totals


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


_HEAD = ("path", "type", "shape", "dtype", "params", "")


def _totals_lines(t: dict[str, int]) -> list[str]:
    return [
        f"parameters: {t['params']:,} unique, {t['params_per_place']:,} per place",
        f"array bytes: {_human(t['bytes'])} unique, {_human(t['bytes_per_place'])} per place",
    ]


def summary(tree: Any) -> str:
    """A table of the model, one row per place, that shows every tie.

    Columns: path, type, shape, dtype, parameter count at that place, and a
    note: ``tied to <first path>`` where an array or node was met before (its
    contents are not listed again), ``<fn> of <source path>`` for a view. A
    node's count is everything under it at that place. The last lines give the
    parameters and array bytes counted once per unique array and once per place.
    Plain text, no colour: print it, log it, or use `print_summary`.

    Example:
        >>> print(tied.summary(Chain(d1, Dense(d1.weight, d1.bias))))
        path               type   shape   dtype    params
        <root>             Chain                       12
        .layers            list                        12
        .layers[0]         Dense                        6
        .layers[0].weight  Array  (2, 2)  float32       4
        .layers[0].bias    Array  (2,)    float32       2
        .layers[1]         Dense                        6
        .layers[1].weight  Array  (2, 2)  float32       4  tied to .layers[0].weight
        .layers[1].bias    Array  (2,)    float32       2  tied to .layers[0].bias
        parameters: 6 unique, 12 per place
        array bytes: 24 B unique, 48 B per place
    """
    rows, totals = _rows(tree)
    table = [_HEAD] + [(r.path, r.type, r.shape, r.dtype, f"{r.params:,}", r.note) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(5)]
    lines = []
    for row in table:
        cells = [row[c].ljust(widths[c]) for c in range(4)] + [row[4].rjust(widths[4])]
        line = "  ".join(cells)
        if row[5]:
            line += "  " + row[5]
        lines.append(line.rstrip())
    return "\n".join(lines + _totals_lines(totals))


def print_summary(tree: Any, file: TextIO | None = None) -> None:
    """Print `summary` to a terminal: as a rich table if ``rich`` is installed, else as plain text.

    Example:
        >>> tied.print_summary(model)   # tied places are highlighted under rich
    """
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(summary(tree), file=file if file is not None else sys.stdout)
        return
    rows, totals = _rows(tree)
    table = Table(*_HEAD[:4], "params", "tied / view", show_lines=False)
    table.columns[4].justify = "right"
    for r in rows:
        style = "yellow" if r.note.startswith("tied") else "cyan" if r.type == "View" else None
        cells = (r.path, r.type, r.shape, r.dtype, f"{r.params:,}", r.note)
        table.add_row(*(Text(c) for c in cells), style=style)  # Text: paths are not rich markup
    console = Console(file=file)
    console.print(table)
    for line in _totals_lines(totals):
        console.print(Text(line))


# ---------------------------------------------------------------- Graphviz


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(tree: Any) -> str:
    """The model as a Graphviz DOT graph: each node and array drawn once, an edge for every place.

    Containers are boxes labelled with their type, arrays are ellipses labelled
    with dtype and shape; an edge goes from a container to each child, labelled
    with the child's key, so a shared array or node has one incoming edge per
    place (drawn bold red when it has several). A view is not drawn as a node:
    it is a dashed edge from the place that holds it to its source, labelled
    ``key = fn(.)``. Static fields are left out. Render with `render_dot` or
    any Graphviz viewer.

    Example:
        >>> dot = tied.to_dot(Chain(d1, Dense(d1.weight, d1.bias)))
        >>> dot.count("->")      # Chain->list, list->d1, list->d2, and 2 x (weight, bias)
        7
    """
    leaves, gdef = flatten(tree)
    places = place_paths(gdef)
    records = gdef.records

    def target(r: int) -> tuple[int, list[str]]:
        """Follow views down to what they finally show: (ref, functions applied, innermost first)."""
        fns: list[str] = []
        while r % 3 == 1 and records[r // 3][0] == VIEW and r != gdef.root:
            fns.append(_fn_name(records[r // 3][1]))
            r = records[r // 3][2][0]
        return r, fns[::-1]

    def name(r: int) -> str:
        q, m = divmod(r, 3)
        return f"a{q}" if m == 0 else f"n{q}"

    edges: list[tuple[int, int, str, bool]] = []
    indegree: dict[int, int] = {}
    drawn: set[int] = set()
    for j, (kind, meta, refs) in enumerate(records):
        if kind == VIEW and 3 * j + 1 != gdef.root:
            continue
        drawn.add(3 * j + 1)
        for i, c in enumerate(refs):
            if c % 3 == 2:
                continue
            key = _child_key(kind, meta, i, len(refs))
            t, fns = target(c)
            if t % 3 == 2:
                continue
            label = key
            if fns:
                inner = "."
                for f in fns:
                    inner = f"{f}({inner})"
                label = f"{key} = {inner}"
            edges.append((3 * j + 1, t, label, bool(fns)))
            indegree[t] = indegree.get(t, 0) + 1
            drawn.add(t)
    if gdef.root % 3 == 0:
        drawn.add(gdef.root)

    lines = [
        "digraph tied {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    for r in sorted(drawn, key=lambda r: (r % 3, r // 3)):
        q, m = divmod(r, 3)
        shared = indegree.get(r, 0) > 1
        style = ', color="#c0392b", penwidth=2' if shared else ""
        if m == 0:
            x = leaves[q]
            shape = ", ".join(str(d) for d in x.shape)
            label = f"{np.dtype(x.dtype).name}[{shape}]\n{_keystr(places.leaves[q][0])}"
            lines.append(f"  {name(r)} [label={_q(label)}, shape=ellipse{style}];")
        else:
            kind, meta, _ = records[q]
            label = _node_type(kind, meta)
            if kind == VIEW:
                label = f"View {_fn_name(meta)}"
            lines.append(f"  {name(r)} [label={_q(label)}, shape=box{style}];")
    for src, dst, label, is_view in edges:
        style = ", style=dashed" if is_view else ""
        lines.append(f"  {name(src)} -> {name(dst)} [label={_q(label)}{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(dot: str, path: str | os.PathLike, *, format: str | None = None) -> None:
    """Render a DOT graph (from `to_dot`) to an image file with Graphviz's ``dot`` program.

    Args:
        dot: the DOT text.
        path: the output file; its suffix (``.svg``, ``.png``, ``.pdf``) picks the format.
        format: a Graphviz output format, overriding the suffix.

    Raises:
        RuntimeError: ``dot`` is not installed, or it failed (its message is included).

    Example:
        >>> tied.render_dot(tied.to_dot(model), "model.svg")
    """
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            "tied.render_dot needs Graphviz's `dot` program, which is not on PATH. Install Graphviz "
            "(apt-get install graphviz, brew install graphviz, conda install graphviz), or paste the "
            "text of tied.to_dot(model) into any Graphviz viewer."
        )
    path = os.fspath(path)
    fmt = format or os.path.splitext(path)[1].lstrip(".") or "svg"
    proc = subprocess.run([exe, f"-T{fmt}", "-o", path], input=dot.encode(), capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"Graphviz's dot failed to render {path} as {fmt} (exit {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
