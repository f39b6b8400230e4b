"""Inspection: parameter counts, the summary table and the DOT picture, against hand counts and an
independent walker written here (by identity, with plain Python, not with tied's walk)."""

from __future__ import annotations

import os
import re
import shutil
import stat

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tied
from tied.nn import Chain, Dense, Embedding


@tied.register
class Box:
    def __init__(self, content, tag="box"):
        self.content = content
        self.tag = tag


NODE_CLASSES = (Box, Chain, Dense, Embedding)


def seed_model():
    d1 = Dense(jax.random.normal(jax.random.key(0), (2, 2)), jnp.zeros(2))
    return Chain(d1, Dense(d1.weight, d1.bias))


def tied_lm():
    """Embedding tied to the output head, and one hidden block used twice."""
    emb = Embedding(11, 4, key=jax.random.key(0))
    hidden = Dense(4, 4, key=jax.random.key(1), activation=jnp.tanh)
    return Chain(emb, hidden, hidden, Dense(emb.weight, jnp.zeros(11)))


def autoencoder():
    """A decoder whose weight is the encoder's, transposed (a view)."""
    enc = Dense(jnp.ones((3, 4)), jnp.zeros(3))
    return Chain(enc, Dense(tied.transpose(enc.weight), jnp.zeros(4)))


# ---------------------------------------------------------------- an independent reference


def is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def n_params(x) -> int:
    return int(x.size) if jnp.issubdtype(x.dtype, jnp.inexact) else 0


def children(x) -> list | None:
    """Children of a container, or None for a leaf (arrays and statics)."""
    if type(x) in (list, tuple):
        return list(x)
    if type(x) is dict:
        return list(x.values())
    if type(x) is tied.View:
        return [x.source]
    if isinstance(x, NODE_CLASSES):
        return list(vars(x).values())
    return None


def ref_per_place(x, open_ids=()) -> int:
    """Sum of sizes over every place, a reference back to an open ancestor counting nothing."""
    if is_array(x):
        return n_params(x)
    kids = children(x)
    if kids is None or id(x) in open_ids:
        return 0
    return sum(ref_per_place(c, (*open_ids, id(x))) for c in kids)


def ref_unique(x) -> dict:
    """Every distinct array and container (views included) by identity."""
    seen: dict[int, object] = {}

    def value_tuple(y) -> bool:  # a tuple of static values: one node per place, never shared
        return type(y) is tuple and all(not is_array(c) and children(c) is None for c in y)

    def go(y):
        if id(y) in seen or (not is_array(y) and children(y) is None):
            return
        seen[("place", len(seen)) if value_tuple(y) else id(y)] = y
        for c in children(y) or []:
            go(c)

    go(x)
    return seen


def ref_dot_counts(x) -> tuple[int, int]:
    """Nodes and edges of the picture: each distinct array and non-view container once; an edge per
    (container, child) place whose child is an array or container, a view standing for its source."""
    objs = ref_unique(x)
    nodes = sum(1 for o in objs.values() if type(o) is not tied.View)
    edges = 0
    for o in objs.values():
        if type(o) is tied.View:
            continue
        for c in children(o) or []:
            while type(c) is tied.View:
                c = c.source
            if is_array(c) or children(c) is not None:
                edges += 1
    return nodes, edges


# ---------------------------------------------------------------- counts


def test_seed_model_counts():
    m = seed_model()
    assert tied.param_count(m) == 6
    assert tied.param_count(m, per_place=True) == 12 == ref_per_place(m)


def test_tied_embedding_model_counts():
    m = tied_lm()
    # embedding 11x4, hidden 4x4 + 4, head bias 11; the head weight is the embedding
    assert tied.param_count(m) == 44 + 20 + 11
    # per place: embedding twice, hidden twice
    assert tied.param_count(m, per_place=True) == 2 * 44 + 2 * 20 + 11 == ref_per_place(m)


def test_a_view_counts_once_and_its_source_size_per_place():
    m = autoencoder()
    assert tied.param_count(m) == 12 + 3 + 4
    assert tied.param_count(m, per_place=True) == 2 * 12 + 3 + 4 == ref_per_place(m)


def test_only_inexact_arrays_are_parameters():
    m = {
        "bf16": jnp.ones((2, 3), jnp.bfloat16),
        "c64": np.ones(5, np.complex64),
        "f8": np.ones(7, ml_dtypes.float8_e4m3fn),
        "ids": jnp.arange(10),
        "mask": np.ones(4, bool),
    }
    m["again"] = m["ids"]
    assert tied.param_count(m) == 6 + 5 + 7
    assert tied.param_count(m, per_place=True) == 18


def test_cycles_count_each_array_once_per_place():
    w = jnp.ones(3)
    loop = [w]
    loop.append(loop)
    m = {"loop": loop, "w": w}
    assert tied.param_count(m) == 3
    assert tied.param_count(m, per_place=True) == 6 == ref_per_place(m)


# ---------------------------------------------------------------- summary


SEED_SUMMARY = """\
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
array bytes: 24 B unique, 48 B per place"""


def test_seed_model_summary():
    assert tied.summary(seed_model()) == SEED_SUMMARY


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by path: cells split on runs of two or more spaces."""
    lines = text.splitlines()[1:]
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in lines if line[:1] in "<.[")}


def test_tied_embedding_model_summary():
    text = tied.summary(tied_lm())
    r = rows(text)
    assert r[".layers[0].weight"] == [".layers[0].weight", "Array", "param", "(11, 4)", "float32", "44"]
    assert r[".layers[3].weight"][-1] == "tied to .layers[0].weight"
    assert r[".layers[2]"] == [".layers[2]", "Dense", "20", "tied to .layers[1]"]
    assert ".layers[2].weight" not in r  # a shared node's contents are listed once
    assert r["<root>"][-1] == "139"
    assert text.splitlines()[-2:] == [
        "parameters: 75 unique, 139 per place (the params column counts per place)",
        "array bytes: 300 B unique, 556 B per place",
    ]


def test_summary_of_views_and_cycles():
    r = rows(tied.summary(autoencoder()))
    assert r[".layers[1].weight"] == [
        ".layers[1].weight",
        "View",
        "(4, 3)",
        "float32",
        "12",
        "transpose of .layers[0].weight",
    ]
    loop = {"w": jnp.ones(3)}
    loop["self"] = loop
    r = rows(tied.summary(loop))
    assert r["['self']"][-1] == "tied to <root> (reference cycle)"
    assert r["['w']"][2:] == ["param", "(3,)", "float32", "3"]


def test_summary_shows_a_source_first_met_under_its_view():
    w = jnp.ones((2, 3))
    r = rows(tied.summary({"a": tied.transpose(w), "b": w}))
    assert r["['a']"][-1] == "transpose of ['a'].source"
    assert r["['a'].source"][1:] == ["Array", "param", "(2, 3)", "float32", "6"]
    assert r["['b']"][-1] == "tied to ['a'].source"


def test_print_summary_without_rich(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_rich(name, *args, **kwargs):
        if name.startswith("rich"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    tied.print_summary(seed_model())
    assert capsys.readouterr().out == SEED_SUMMARY + "\n"


def test_print_summary_with_rich(monkeypatch):
    pytest.importorskip("rich")
    import io

    monkeypatch.setenv("COLUMNS", "200")

    out = io.StringIO()
    tied.print_summary(seed_model(), file=out)
    text = out.getvalue()
    assert "tied to .layers[0].weight" in text and "parameters: 6 unique, 12 per place" in text
    assert ".layers[1].bias" in text  # keys in brackets are shown, not read as rich markup


# ---------------------------------------------------------------- DOT


def parse_dot(text: str) -> tuple[dict[str, str], list[tuple[str, str, str, str]]]:
    """A tiny DOT reader: node ids with labels; edges (from, to, label, attributes)."""
    assert text.startswith("digraph tied {") and text.rstrip().endswith("}")
    nodes, edges = {}, []
    for line in text.splitlines():
        e = re.fullmatch(r'\s*(\w+) -> (\w+) \[label="((?:[^"\\]|\\.)*)"(.*)\];', line)
        n = re.fullmatch(r'\s*(\w+) \[label="((?:[^"\\]|\\.)*)"(.*)\];', line)
        if e:
            edges.append(e.groups())
        elif n and n.group(1) not in ("node", "edge", "graph"):
            nodes[n.group(1)] = n.group(2)
    return nodes, edges


def test_dot_of_the_seed_model():
    m = seed_model()
    nodes, edges = parse_dot(tied.to_dot(m))
    assert (len(nodes), len(edges)) == (6, 7) == ref_dot_counts(m)
    assert sorted(nodes.values()) == sorted(
        [
            "Chain",
            "list",
            "Dense",
            "Dense",
            "float32[2, 2]\\n.layers[0].weight",
            "float32[2]\\n.layers[0].bias",
        ]
    )
    by_label = {v: k for k, v in nodes.items()}
    weight = by_label["float32[2, 2]\\n.layers[0].weight"]
    into_weight = [e for e in edges if e[1] == weight]
    assert [e[2] for e in into_weight] == [".weight", ".weight"]  # one array, an edge per place
    assert len({e[0] for e in into_weight}) == 2  # from the two Dense layers
    assert all(e[1] in nodes and e[0] in nodes for e in edges)


def test_dot_draws_a_shared_node_once_and_views_as_edges():
    m = tied_lm()
    nodes, edges = parse_dot(tied.to_dot(m))
    assert (len(nodes), len(edges)) == ref_dot_counts(m)
    assert list(nodes.values()).count("Dense") == 2  # the hidden block once, the head once
    hidden = [e for e in edges if e[2] in ("[1]", "[2]")]
    assert len(hidden) == 2 and hidden[0][1] == hidden[1][1]

    m = autoencoder()
    nodes, edges = parse_dot(tied.to_dot(m))
    assert (len(nodes), len(edges)) == ref_dot_counts(m) == (7, 7)
    assert "View" not in " ".join(nodes.values())
    view_edges = [e for e in edges if "dashed" in e[3]]
    assert [e[2] for e in view_edges] == [".weight = transpose(.)"]
    weight = next(k for k, v in nodes.items() if v.startswith("float32[3, 4]"))
    assert view_edges[0][1] == weight


def test_dot_of_a_cycle():
    loop = {"w": jnp.ones(3)}
    loop["self"] = loop
    nodes, edges = parse_dot(tied.to_dot(loop))
    assert len(nodes) == 2
    assert ("n0", "n0", "['self']", "") in edges


def test_dot_escapes_labels():
    m = {'say "hi"\\': jnp.ones(1)}
    nodes, edges = parse_dot(tied.to_dot(m))
    assert edges[0][2] == "['say \\\"hi\\\"\\\\\\\\']"


# ---------------------------------------------------------------- random models


@st.composite
def random_dags(draw):
    """Random acyclic graphs of lists, tuples, dicts and a registered class over shared arrays and nodes."""
    pool = [jnp.full((draw(st.integers(0, 3)), 2), i, jnp.float32) for i in range(draw(st.integers(1, 3)))]
    pool.append(jnp.arange(3))
    made: list = []

    def build(depth):
        c = draw(st.integers(0, 7 if depth < 3 else 1))
        if c == 0:
            return draw(st.sampled_from(pool))
        if c == 1:
            return draw(st.sampled_from(["s", 2, None, jnp.tanh]))
        if c == 2 and made:
            return draw(st.sampled_from(made))
        if c == 3:
            return tied.transpose(draw(st.sampled_from(pool)))
        kids = [build(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        node = [list, tuple, lambda k: dict(zip("abc", k)), lambda k: Box(k)][c - 4](kids)
        made.append(node)
        return node

    return [build(0), build(0)]


@given(random_dags())
def test_counts_and_dot_match_the_reference_walker(m):
    unique = ref_unique(m)
    assert tied.param_count(m) == sum(n_params(o) for o in unique.values() if is_array(o))
    assert tied.param_count(m, per_place=True) == ref_per_place(m)
    nodes, edges = parse_dot(tied.to_dot(m))
    assert (len(nodes), len(edges)) == ref_dot_counts(m)
    last = tied.summary(m).splitlines()[-2]
    assert last == (
        f"parameters: {tied.param_count(m):,} unique, {ref_per_place(m):,} per place (the params column "
        "counts per place)"
    )


# ---------------------------------------------------------------- rendering


def test_render_dot_calls_graphviz(tmp_path, monkeypatch):
    """A stand-in `dot` on PATH records its arguments and input: tied's side of the call."""
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncat > "$3"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    dot = tied.to_dot(seed_model())
    tied.render_dot(dot, tmp_path / "model.svg")
    assert (tmp_path / "model.svg").read_text() == dot
    assert (fake.parent / "args").read_text().split() == ["-Tsvg", "-o", str(tmp_path / "model.svg")]
    tied.render_dot(dot, tmp_path / "model.out", format="png")
    assert (fake.parent / "args").read_text().split()[0] == "-Tpng"


def test_render_dot_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"needs Graphviz's `dot` program, which is not on PATH"):
        tied.render_dot("digraph {}", tmp_path / "x.svg")
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'syntax error in line 1' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match=r"dot failed to render .*x\.svg as svg \(exit 1\): syntax error"):
        tied.render_dot("digraph {", tmp_path / "x.svg")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_render_dot_with_graphviz(tmp_path):
    """Graphviz itself accepts the DOT and draws each node and edge (a cycle and odd keys included)."""
    loop = {"w": jnp.ones(3), 'say "hi"\\': jnp.ones(1)}
    loop["self"] = loop
    for m in (tied_lm(), autoencoder(), loop):
        dot = tied.to_dot(m)
        tied.render_dot(dot, tmp_path / "m.svg")
        svg = (tmp_path / "m.svg").read_text()
        nodes, edges = parse_dot(dot)
        assert svg.count('class="node"') == len(nodes) and svg.count('class="edge"') == len(edges)


def keyed_children(x) -> list[tuple[str, object]]:
    if type(x) in (list, tuple):
        return [(f"[{i}]", c) for i, c in enumerate(x)]
    if type(x) is dict:
        return [(f"[{k!r}]", x[k]) for k in sorted(x)]
    if type(x) is tied.View:
        return [(".source", x.source)]
    if isinstance(x, NODE_CLASSES):
        return [(f".{k}", v) for k, v in vars(x).items()]
    return []


def ref_summary_rows(x) -> list[tuple[str, bool]]:
    """(path, tied) for each row: every place met walking the DAG (a node entered at its first
    place only), statics left out, a view's source shown under it only where first met."""
    rows: list[tuple[str, bool]] = []
    seen: set = set()

    def visit(y, path, under_view):
        if not is_array(y) and children(y) is None:
            return
        value_tuple = type(y) is tuple and all(not is_array(c) and children(c) is None for c in y)
        first = value_tuple or id(y) not in seen
        if under_view and not first:
            return
        rows.append((path or "<root>", not first))
        if first:
            seen.add(id(y))
            for k, c in keyed_children(y):
                visit(c, path + k, type(y) is tied.View)

    visit(x, "", False)
    return rows


def summary_rows(text: str) -> list[tuple[str, bool]]:
    lines = text.splitlines()[1:-2]
    return [(re.split(r"\s{2,}", line)[0], "tied to" in line) for line in lines]


@given(random_dags())
def test_summary_rows_match_the_reference_walker(m):
    assert summary_rows(tied.summary(m)) == ref_summary_rows(m)


# ---------------------------------------------------------------- trainable=


def test_param_count_with_trainable_against_a_hand_count():
    m = tied_lm()  # embedding 11x4 (also the head's weight), hidden 4x4 + 4 twice, head bias 11
    weights = lambda path, x: path.endswith("weight")
    assert tied.param_count(m, trainable=weights) == 44 + 16
    assert tied.param_count(m, per_place=True, trainable=weights) == 2 * 44 + 2 * 16
    head_only = lambda path, x: path.startswith(".layers[3]")  # the head: its bias, and the tied weight
    assert tied.param_count(m, trainable=head_only) == 11 + 44
    assert tied.param_count(m, per_place=True, trainable=head_only) == 11 + 2 * 44
    assert tied.param_count(m, trainable=lambda path, x: False) == 0
    with pytest.raises(TypeError, match="trainable= takes a function"):
        tied.param_count(m, trainable="weight")


def test_param_count_trainable_at_a_place_below_a_shared_node():
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    m = Chain(d, d)
    second = lambda path, x: path == ".layers[1].weight"
    assert tied.param_count(m, trainable=second) == 4
    assert tied.param_count(m, per_place=True, trainable=second) == 8


# ---------------------------------------------------------------- depth


def deep_model(n: int):
    """n levels cycling list -> dict -> Box, each holding the level below and one more child:
    `s` (2 floats) at every 30th level, a fresh 2-float array at every 300th, an int elsewhere."""
    s = jnp.full(2, 0.5)
    node = {"w": jnp.ones(2)}
    for k in range(n):
        x = s if k % 30 == 1 else jnp.full(2, float(k)) if k % 300 == 7 else k
        node = [x, node] if k % 3 == 0 else {"w": x, "next": node} if k % 3 == 1 else Box(node, x)
    return node, s


def test_inspection_at_depth_3000():
    m, s = deep_model(3000)
    # by hand: s at 100 places, 10 fresh arrays, the bottom array; 3001 containers
    assert tied.param_count(m) == 2 * 12
    assert tied.param_count(m, per_place=True) == 2 * 111
    text = tied.summary(m)
    rows = summary_rows(text)
    assert len(rows) == 3001 + 111 and sum(t for _, t in rows) == 99
    assert text.splitlines()[-2:] == [
        "parameters: 24 unique, 222 per place (the params column counts per place)",
        "array bytes: 96 B unique, 888 B per place",
    ]
    s_rows = [line for line in text.splitlines() if "(2,)" in line and line.split()[-1] != "2"]
    firsts = {line.split("tied to ")[1] for line in s_rows}
    assert len(s_rows) == 99 and len(firsts) == 1
    nodes, edges = parse_dot(tied.to_dot(m))
    assert (len(nodes), len(edges)) == (3001 + 12, 3000 + 111)
    first = firsts.pop()  # deep paths are elided alike ("..." and their end): count edges by target
    incoming: dict[str, int] = {}
    for e in edges:
        incoming[e[1]] = incoming.get(e[1], 0) + 1
    into_s = [n for n, k in incoming.items() if k == 100]
    assert len(into_s) == 1 and nodes[into_s[0]].endswith("\\n" + first)


# ---------------------------------------------------------------- state
# Inspection of state, typed keys and deep models (issues 15 and 17), against hand counts.


def model_with_state():
    stat = tied.State(jnp.zeros(3))  # shared at two places: one state
    return {
        "w": jnp.ones((2, 3)),
        "k": jax.random.key(0),
        "bn": {"mean": stat, "scale": jnp.ones(3)},
        "again": stat,
        "rng": tied.Rng(jax.random.key(1, impl="rbg")),
    }


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line)


def test_summary_shows_state_apart_and_never_counts_it():
    text = tied.summary(model_with_state())
    lines = text.splitlines()
    assert cells(lines[0]) == ["path", "type", "kind", "shape", "dtype", "params"]
    rows = {cells(line)[0]: cells(line) for line in lines[1:] if line[:1] in "<['"}
    assert rows["['w']"][1:] == ["Array", "param", "(2, 3)", "float32", "6"]
    assert rows["['again']"][1:] == ["State", "state", "0"]  # dict keys in sorted order: first met
    assert rows["['again'].value"][1:] == ["Array", "state", "(3,)", "float32", "0"]
    assert rows["['bn']['mean']"][1:] == ["State", "state", "0", "tied to ['again']"]
    assert rows["['k']"][1:] == ["Array", "()", "key<fry>", "0"]  # a key is neither
    assert rows["['rng'].key"][1:] == ["Array", "()", "key<rbg>", "0"]
    assert rows["['rng'].count.value"][1:] == ["Array", "state", "()", "uint32", "0"]
    # By hand: parameters w (6) and scale (3); state: mean (3 float32) and the count (1 uint32);
    # arrays: 24 + 12 + 12 + 8 (threefry key data) + 16 (rbg key data) + 4 bytes.
    assert lines[-3:] == [
        "parameters: 9 unique, 9 per place (the params column counts per place)",
        "array bytes: 76 B unique, 88 B per place",
        "state: 4 values in 2 unique arrays, 16 B (not parameters)",
    ]
    assert rows["<root>"][-1] == "9"


def test_param_count_never_counts_state():
    m = model_with_state()
    assert tied.param_count(m) == 9
    assert tied.param_count(m, per_place=True) == 9
    assert tied.param_count({"s": tied.State(jnp.ones(5))}) == 0


def test_to_dot_draws_state_apart_and_shows_typed_keys():
    dot = tied.to_dot(model_with_state())
    state_nodes = [line for line in dot.splitlines() if "fillcolor" in line]
    labels = sorted(re.search(r'label="([^"]*)"', line).group(1) for line in state_nodes)
    assert labels == [
        "State (state)",
        "State (state)",
        "float32[3]\\n['again'].value",
        "uint32[]\\n['rng'].count.value",
    ]
    assert "label=\"key<fry>[]\\n['k']\"" in dot and "label=\"key<rbg>[]\\n['rng'].key\"" in dot


def deep(n):
    cell = {"w": np.zeros(1, np.float32)}
    for _ in range(n):
        cell = {"w": np.zeros(1, np.float32), "next": cell}
    return cell


def test_summary_of_a_deep_model_elides_paths_and_stays_linear():
    sizes = {}
    for n in (1000, 4000):
        text = tied.summary(deep(n))
        sizes[n] = (len(text),)
        lines = text.splitlines()
        assert max(len(line) for line in lines) < 140
        assert len(lines) == 1 + 2 * (n + 1) + 2  # header, a dict and a w per level, footer
        innermost = cells(lines[n + 2])  # after the header, the root and n nested dicts
        assert innermost[0].startswith("...") and innermost[0].endswith("['next']['w']")
        assert len(innermost[0]) <= 80 and innermost[1:] == ["ndarray", "param", "(1,)", "float32", "1"]
    assert sizes[4000][0] < 4.5 * sizes[1000][0]  # the text grows with the places, not their paths
