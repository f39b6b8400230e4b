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

from .._core import GraphDef, Trainable, flatten, is_param, live_lock, trainable_mask
from .._core import fn_name as _fn_name

__all__ = ["param_count", "summary", "print_summary", "to_dot", "render_dot"]


def _size(x: Any) -> int:
    return int(np.prod(x.shape, dtype=np.int64))


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _nbytes(x: Any) -> int:
    if _is_key(x):  # a typed key: its key data's bytes
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return _size(data) * np.dtype(data.dtype).itemsize
    return _size(x) * np.dtype(x.dtype).itemsize


def _dtype(x: Any) -> str:
    """The dtype as shown: a numpy name (``float32``), or ``key<fry>`` for a typed key."""
    return str(x.dtype) if _is_key(x) else np.dtype(x.dtype).name


def _keystr(path: str) -> str:
    return path or "<root>"


def _read(tree: Any) -> tuple[list, GraphDef]:
    with live_lock:  # not while tied.gradient has traced values in the model
        return flatten(tree)


# ---------------------------------------------------------------- the DAG, from the one walk


_CAP = 80  # paths longer than this are shown as "..." and their last characters


class _Dag:
    """What `GraphDef.walk_places` says, indexed: each node's children, each object's first path.

    Objects are ``("array", i)``, ``("static", k)`` or ``("node", j)`` with the
    walk's indices. A node's children are recorded at its first place, in order,
    as ``(object, key)`` where key is the child's keystr piece. Each place is kept
    as the walk's `Place` with its path as shown (elided past ``_CAP`` characters),
    never the full path (a deep model's paths add up to the square of its depth),
    so the memory and time taken here grow linearly with the places, however deep.
    """

    def __init__(self, gdef: GraphDef):
        self.places: list = []  # each a Place, its .path as shown
        self.children: dict[int, list[tuple[tuple[str, int], str]]] = {}
        self.node: dict[int, Any] = {}  # node index -> its first place
        self.first: dict[tuple[str, int], str] = {}  # object -> its first place, as shown
        # Each node entered (at its first place): (length of its full path, its path as shown,
        # its keystr piece, its parent node). Full paths are never built (the walk runs with
        # paths=False): each place's is its parent's plus its own piece (`Place.parent`,
        # `Place.key`), and only its length and the shown (capped) string are kept, so time
        # and memory grow linearly with the places, however deep.
        entered: dict[int, tuple[int, str, str, int]] = {}
        for p in gdef.walk_places(paths=False):
            obj = _obj(p)
            if p.parent >= 0:
                parent_len, parent_shown, _, _ = entered[p.parent]
                piece = jax.tree_util.keystr((p.key,))
                self.children[p.parent].append((obj, piece))
                length = parent_len + len(piece)
                shown = parent_shown + piece if length <= _CAP else _elide_tail(entered, p.parent, piece)
            else:
                piece, length, shown = "", 0, _keystr("")
            spot = p._replace(path=shown)
            self.places.append(spot)
            if p.first:
                self.first.setdefault(obj, shown)
                if obj[0] == "node":
                    self.node[p.index] = spot
                    self.children[p.index] = []
                    entered[p.index] = (length, shown if p.parent >= 0 else "", piece, p.parent)
        self.root = _obj(self.places[0])


def _elide_tail(entered: dict, parent: int, piece: str) -> str:
    """A path longer than ``_CAP`` characters as the table shows it: ``...`` and its last pieces
    (read up the parent chain only as far as they fit, so the cost does not grow with depth)."""
    tail = [piece]
    n = len(piece)
    j = parent
    while j >= 0:
        _, _, up_piece, up = entered[j]
        if not up_piece or n + len(up_piece) > _CAP - 3:
            break
        tail.append(up_piece)
        n += len(up_piece)
        j = up
    return "..." + "".join(reversed(tail)) if n <= _CAP - 3 else "..." + piece[-(_CAP - 3) :]


def _obj(p: Any) -> tuple[str, int]:
    return (p.kind, p.index) if p.kind in ("array", "static") else ("node", p.index)


# ---------------------------------------------------------------- counting


class _Tally:
    """Parameters and bytes per place under every node, memoised where no cycle is open.

    The tree unrolled from the DAG: a shared node counts at each place with all
    below it; a reference back to a node open above counts nothing more.
    Iterative (an explicit stack), so any depth.
    """

    def __init__(self, dag: _Dag, leaf: list[tuple[int, int]]):
        self.dag = dag
        self.leaf = leaf  # per unique array: (parameters, bytes) it counts at a place
        self.memo: dict[int, tuple[int, int]] = {}

    def __call__(self, obj: tuple[str, int]) -> tuple[int, int]:
        kind, idx = obj
        if kind == "array":
            return self.leaf[idx]
        if kind == "static":
            return 0, 0
        if idx in self.memo:
            return self.memo[idx]
        memo, children, leaf = self.memo, self.dag.children, self.leaf
        open_nodes = {idx}
        # A frame: [node, next child, parameters, bytes, open nodes referred back to].
        stack: list[list] = [[idx, 0, 0, 0, set()]]
        while True:
            frame = stack[-1]
            j, i = frame[0], frame[1]
            kids = children[j]
            if i < len(kids):
                frame[1] = i + 1
                kind, c = kids[i][0]
                if kind == "array":
                    frame[2] += leaf[c][0]
                    frame[3] += leaf[c][1]
                elif kind == "node":
                    if c in open_nodes:  # a reference back up a cycle: nothing new below
                        frame[4].add(c)
                    elif c in memo:
                        frame[2] += memo[c][0]
                        frame[3] += memo[c][1]
                    else:
                        open_nodes.add(c)
                        stack.append([c, 0, 0, 0, set()])
                continue
            stack.pop()
            open_nodes.discard(j)
            back = frame[4] - {j}
            if not back:
                memo[j] = (frame[2], frame[3])
            if not stack:
                return frame[2], frame[3]
            parent = stack[-1]
            parent[2] += frame[2]
            parent[3] += frame[3]
            parent[4] |= back


def param_count(tree: Any, per_place: bool = False, *, trainable: Trainable | None = None) -> int:
    """The number of parameters (elements of inexact-dtype arrays), each shared array counted once.

    Args:
        tree: an object graph (a model, a gradient, an optimiser state).
        per_place: count every place instead: a parameter at k places counts k
            times, a shared node's parameters at each of its places, a view's
            place the size of its source. What summing ``numel()`` over places
            gives; the difference to the default is what the ties save.
        trainable: ``(path, array) -> bool``: count only the parameters for which
            it holds at one or more of their places (as `tied.params` and
            `tied.grad` decide); with ``per_place``, each of their places.

    Returns:
        The count. Integer and boolean arrays are not parameters and count 0;
        views count nothing extra by default (their source is counted once).

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))   # the second layer shares both arrays
        >>> tied.param_count(model), tied.param_count(model, per_place=True)
        (6, 12)
        >>> tied.param_count(model, trainable=lambda path, x: path.endswith("bias"))
        2
    """
    leaves, gdef = _read(tree)
    mask = trainable_mask(gdef, leaves, trainable)
    if not per_place:
        return sum(_size(x) for x, keep in zip(leaves, mask) if keep)
    leaf = [(_size(x) if keep else 0, 0) for x, keep in zip(leaves, mask)]
    dag = _Dag(gdef)
    return _Tally(dag, leaf)(dag.root)[0]


def _abstract(dag: _Dag, leaves: list, obj: tuple[str, int]) -> Any:
    """The shape and dtype of what ``obj`` stands for (a view's result, traced, never computed)."""
    kind, idx = obj
    if kind == "array":
        x = leaves[idx]
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    place, kids = dag.node[idx], dag.children[idx]
    if place.kind == "tuple":  # the sources of a view of several
        return tuple(_abstract(dag, leaves, c) for c, _ in kids)
    if place.kind != "view":
        raise TypeError(f"a view's source is a {place.type.__name__}")
    fn, src = place.value, _abstract(dag, leaves, kids[0][0])
    return jax.eval_shape(lambda s: fn(*s) if type(s) is tuple else fn(s), src)


# ---------------------------------------------------------------- summary


@dataclass
class _Row:
    path: str
    type: str
    kind: str
    shape: str
    dtype: str
    params: int
    note: str


def _rows(tree: Any) -> tuple[list[_Row], dict[str, int]]:
    leaves, gdef = _read(tree)
    state, cells = gdef.state_leaves(), gdef.state_nodes()
    # What counts as a parameter is the one rule (`trainable_mask`, as `param_count`): a float
    # source that a view names as a constant (a quantized table's scales) is not one.
    param = trainable_mask(gdef, leaves, None)
    dag = _Dag(gdef)
    tally = _Tally(dag, [(_size(x) if p else 0, _nbytes(x)) for x, p in zip(leaves, param)])
    rows: list[_Row] = []

    def array_row(shown: str, i: int, note: str) -> _Row:
        x = leaves[i]
        kind = "Array" if isinstance(x, jax.Array) else type(x).__name__
        what = "state" if state[i] else "param" if param[i] else "frozen" if is_param(x) else ""
        return _Row(shown, kind, what, str(tuple(x.shape)), _dtype(x), _size(x) if param[i] else 0, note)

    def node_row(p: Any, params: int, note: str) -> _Row:
        return _Row(p.path, p.type.__name__, "state" if cells[p.index] else "", "", "", params, note)

    def view_row(p: Any) -> _Row:
        src, _ = dag.children[p.index][0]
        shape = dtype = "?"
        try:
            out = _abstract(dag, leaves, ("node", p.index))
            shape, dtype = str(tuple(out.shape)), _dtype(out)
        except Exception:  # a function eval_shape cannot trace: show what we know
            pass
        if src[0] == "node" and dag.node[src[1]].kind == "tuple":  # several sources
            names = f"({', '.join(dag.first[c] for c, _ in dag.children[src[1]])})"
        else:
            names = dag.first[src]
        return _Row(
            p.path, "View", "", shape, dtype, tally(src)[0], f"{_fn_name(dag.node[p.index].value)} of {names}"
        )

    open_nodes: list[int] = []  # the nodes above the current place, by depth
    under_view: list[bool] = []
    for p in dag.places:
        del open_nodes[p.depth :]
        del under_view[p.depth :]
        obj = _obj(p)
        if p.kind == "static":
            continue
        # A view's source is shown under the view only where the source is first met.
        if p.depth and under_view[p.depth - 1] and not p.first:
            continue
        if p.kind == "array":
            rows.append(array_row(p.path, p.index, "" if p.first else f"tied to {dag.first[obj]}"))
            continue
        if not p.first:
            if p.index in open_nodes:
                rows.append(node_row(p, 0, f"tied to {dag.first[obj]} (reference cycle)"))
            elif p.kind == "view":
                row = view_row(p)
                row.note += f", tied to {dag.first[obj]}"
                rows.append(row)
            else:
                rows.append(node_row(p, tally(obj)[0], f"tied to {dag.first[obj]}"))
            continue
        rows.append(view_row(p) if p.kind == "view" else node_row(p, tally(obj)[0], ""))
        open_nodes.append(p.index)
        under_view.append(p.kind == "view")
    per_place = tally(dag.root)
    totals = {
        "params": sum(_size(x) for x, p in zip(leaves, param) if p),
        "params_per_place": per_place[0],
        "bytes": sum(_nbytes(x) for x in leaves),
        "bytes_per_place": per_place[1],
        "arrays": len(leaves),
        "state_arrays": sum(state),
        "state_values": sum(_size(x) for x, st in zip(leaves, state) if st),
        "state_bytes": sum(_nbytes(x) for x, st in zip(leaves, state) if st),
    }
    return rows, totals


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


_HEAD = ("path", "type", "kind", "shape", "dtype", "params", "")


def _totals_lines(t: dict[str, int]) -> list[str]:
    lines = [
        f"parameters: {t['params']:,} unique, {t['params_per_place']:,} per place (the params column "
        "counts per place)",
        f"array bytes: {_human(t['bytes'])} unique, {_human(t['bytes_per_place'])} per place",
    ]
    if t["state_arrays"]:
        lines.append(
            f"state: {t['state_values']:,} values in {t['state_arrays']:,} unique arrays, "
            f"{_human(t['state_bytes'])} (not parameters)"
        )
    return lines


def summary(tree: Any) -> str:
    """A table of the model, one row per place, that shows every tie.

    Columns: path, type, kind (``param`` for a parameter, ``state`` for a state
    cell and the arrays below it, ``frozen`` for a float source that its view names
    a constant, such as a quantized table's scales, counted as `param_count` does),
    shape, dtype (a view's: of what it stands for), parameter count at that place,
    and a note: ``tied to <first path>`` where an array or node was met before
    (its contents are not listed again), ``<fn> of <source path>`` for a view
    (``<fn> of (<path>, <path>)`` for a view of several sources). A
    node's count is everything under it at that place, so the ``<root>`` row
    counts each parameter once per place. The last lines give the parameters and
    array bytes counted once per unique array and once per place, and the state
    apart (state is never a parameter). Paths longer than 80 characters are shown
    as ``...`` and their end.
    Plain text, no colour: print it, log it, or use `print_summary`.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> print(tied.summary(Chain(d1, Dense(d1.weight, d1.bias))))
        path               type   kind   shape   dtype    params
        <root>             Chain                              12
        .layers            list                               12
        .layers[0]         Dense                               6
        .layers[0].weight  Array  param  (2, 2)  float32       4
        .layers[0].bias    Array  param  (2,)    float32       2
        .layers[1]         Dense                               6
        .layers[1].weight  Array  param  (2, 2)  float32       4  tied to .layers[0].weight
        .layers[1].bias    Array  param  (2,)    float32       2  tied to .layers[0].bias
        parameters: 6 unique, 12 per place (the params column counts per place)
        array bytes: 24 B unique, 48 B per place
    """
    rows, totals = _rows(tree)
    table = [_HEAD] + [(r.path, r.type, r.kind, r.shape, r.dtype, f"{r.params:,}", r.note) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(6)]
    lines = []
    for row in table:
        cells = [row[c].ljust(widths[c]) for c in range(5)] + [row[5].rjust(widths[5])]
        line = "  ".join(cells)
        if row[6]:
            line += "  " + row[6]
        lines.append(line.rstrip())
    return "\n".join(lines + _totals_lines(totals))


def print_summary(tree: Any, file: TextIO | None = None) -> None:
    """Print `summary` to a terminal: as a rich table if ``rich`` is installed, else as plain text.

    Examples:
        >>> import io, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> model = Chain(d1, Dense(d1.weight, d1.bias))
        >>> out = io.StringIO()
        >>> tied.print_summary(model, file=out)   # without file=, to the terminal
        >>> "parameters: 6 unique, 12 per place" in out.getvalue()
        True
    """
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(summary(tree), file=file if file is not None else sys.stdout)
        return
    rows, totals = _rows(tree)
    table = Table(*_HEAD[:5], "params", "tied / view", show_lines=False)
    table.columns[5].justify = "right"
    for r in rows:
        style = "yellow" if r.note.startswith("tied") else "cyan" if r.type == "View" else None
        style = style or ("magenta" if r.kind == "state" else None)
        cells = (r.path, r.type, r.kind, r.shape, r.dtype, f"{r.params:,}", r.note)
        table.add_row(*(Text(c) for c in cells), style=style)  # Text: paths are not rich markup
    console = Console(file=file)
    console.print(table)
    for line in _totals_lines(totals):
        console.print(Text(line))


# ---------------------------------------------------------------- Graphviz


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_STATE_FILL = "#d5f5e3"


def to_dot(tree: Any) -> str:
    """The model as a Graphviz DOT graph: each node and array drawn once, an edge for every place.

    Containers are boxes labelled with their type, arrays are ellipses labelled
    with dtype and shape; an edge goes from a container to each child, labelled
    with the child's key, so a shared array or node has one incoming edge per
    place (drawn bold red when it has several). A view is not drawn as a node:
    it is a dashed edge from the place that holds it to its source, labelled
    ``key = fn(.)``. State (a `tied.State` or another state cell, and the
    arrays below it) is filled light green, its cells labelled ``(state)``.
    Static fields are left out. Render with `render_dot` or any Graphviz viewer.

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> dot = tied.to_dot(Chain(d1, Dense(d1.weight, d1.bias)))
        >>> dot.count("->")      # Chain->list, list->d1, list->d2, and 2 x (weight, bias)
        7
    """
    leaves, gdef = _read(tree)
    state, cells = gdef.state_leaves(), gdef.state_nodes()
    dag = _Dag(gdef)

    def is_view(obj: tuple[str, int]) -> bool:
        return obj[0] == "node" and dag.node[obj[1]].kind == "view"

    def target(obj: tuple[str, int]) -> tuple[tuple[str, int], list[str]]:
        """Follow views down to what they finally show: (object, functions applied, innermost first)."""
        fns: list[str] = []
        while is_view(obj) and obj != dag.root:
            fns.append(_fn_name(dag.node[obj[1]].value))
            obj = dag.children[obj[1]][0][0]
        return obj, fns[::-1]

    def name(obj: tuple[str, int]) -> str:
        return f"a{obj[1]}" if obj[0] == "array" else f"n{obj[1]}"

    edges: list[tuple[tuple[str, int], tuple[str, int], str, bool]] = []
    indegree: dict[tuple[str, int], int] = {}
    drawn: set[tuple[str, int]] = set()
    for j in sorted(dag.children):
        node = ("node", j)
        if is_view(node) and node != dag.root:
            continue
        drawn.add(node)
        for child, key in dag.children[j]:
            t, fns = target(child)
            if t[0] == "static":
                continue
            label = key
            if fns:
                inner = "."
                for f in fns:
                    inner = f"{f}({inner})"
                label = f"{key} = {inner}"
            edges.append((node, t, label, bool(fns)))
            indegree[t] = indegree.get(t, 0) + 1
            drawn.add(t)
    if dag.root[0] == "array":
        drawn.add(dag.root)

    lines = [
        "digraph tied {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    for obj in sorted(drawn, key=lambda o: (o[0] != "array", o[1])):
        shared = indegree.get(obj, 0) > 1
        style = ', color="#c0392b", penwidth=2' if shared else ""
        is_state = state[obj[1]] if obj[0] == "array" else cells[obj[1]]
        if is_state:  # state: filled, and said in the label (readable without colour too)
            style += f", style=filled, fillcolor={_q(_STATE_FILL)}"
        if obj[0] == "array":
            x = leaves[obj[1]]
            shape = ", ".join(str(d) for d in x.shape)
            label = f"{_dtype(x)}[{shape}]\n{_keystr(dag.first[obj])}"
            lines.append(f"  {name(obj)} [label={_q(label)}, shape=ellipse{style}];")
        else:
            p = dag.node[obj[1]]
            label = f"View {_fn_name(p.value)}" if p.kind == "view" else p.type.__name__
            label += " (state)" if is_state else ""
            lines.append(f"  {name(obj)} [label={_q(label)}, shape=box{style}];")
    for src, dst, label, view_edge in edges:
        style = ", style=dashed" if view_edge else ""
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

    Examples:
        >>> import os, tempfile, jax.numpy as jnp, tied
        >>> from tied.nn import Chain, Dense
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.svg")
        >>> try:
        ...     tied.render_dot(tied.to_dot(Chain(d1, d1)), path)
        ...     done = os.path.getsize(path) > 0
        ... except RuntimeError as e:   # no Graphviz here: the message says how to install it
        ...     done = "Install Graphviz" in str(e)
        >>> done
        True
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
