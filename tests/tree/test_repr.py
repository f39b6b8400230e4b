"""``repr`` of registered classes and `tied.nn` layers: a tree of fields, every tie marked.

The marks are checked against `tied.ties` (the core's own answer, computed apart from the
repr) by reading the printed text back into paths with a small parser of its own: each line
``name=...`` is ``.name`` under the open node, ``'k': ...`` is ``['k']``, a bare line in a
list or tuple is ``[i]``. A later place of a shared object must print
``<tied: same as FIRST>`` exactly at the places `tied.ties` lists after the first.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tied
from tied._tree.repr import MAX_DEPTH, MAX_LINES
from tied.nn import BatchNorm, Chain, Dense

TIE = re.compile(r"<tied: same as (.*)>,?$")


@tied.register
class Node:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _kind(opening: str) -> str:
    """What a line's opening bracket opens: a list, a tuple (a bare "("), a dict or an object."""
    return {"[": "list", "(": "tuple", "{": "dict"}.get(opening, "object")


def read_back(text: str) -> dict[str, str]:
    """Every marked place of a printed model: {path: path of the first place}, by parsing the text."""
    lines = text.splitlines()
    marks: dict[str, str] = {}
    stack: list[list] = [["", _kind(lines[0]), 0]]  # [path, kind, next position] of the open nodes
    for line in lines[1:-1]:
        body = line.strip()
        if body in ("],", "),", "},"):
            stack.pop()
            continue
        path, kind, i = stack[-1]
        if kind in ("list", "tuple"):
            piece, value = f"[{i}]", body
            stack[-1][2] += 1
        elif kind == "dict":
            key, value = re.fullmatch(r"('[^']*'|-?\d+): (.*)", body).groups()
            piece = f"[{key}]"
        else:
            name, value = re.fullmatch(r"(\w+)=(.*)", body).groups()
            piece = f".{name}"
        tie = TIE.fullmatch(value)
        if tie:
            marks[path + piece] = tie[1]
        elif value.endswith(("(", "[", "{")):
            stack.append([path + piece, _kind(value), 0])
    return marks


def expected_marks(model) -> dict[str, str]:
    return {later: group[0] for group in tied.ties(model) for later in group[1:]}


def test_a_tied_chain_prints_its_fields_and_marks_the_later_places():
    d = Dense(jnp.ones((2, 3)), jnp.zeros(2))
    text = repr(Chain(d, Dense(d.weight, d.bias)))
    assert text == (
        "Chain(\n  layers=[\n    Dense(\n      weight=f32[2,3],\n      bias=f32[2],\n      activation=None,\n"
        "    ),\n    Dense(\n      weight=<tied: same as .layers[0].weight>,\n"
        "      bias=<tied: same as .layers[0].bias>,\n      activation=None,\n    ),\n  ],\n)"
    )
    assert read_back(text) == expected_marks(Chain(d, Dense(d.weight, d.bias)))


def test_a_whole_shared_layer_is_one_mark_and_not_expanded_again():
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    model = Chain(d, jax.nn.relu, d)
    text = repr(model)
    assert read_back(text) == {".layers[2]": ".layers[0]"} == expected_marks(model)
    assert text.count("weight=") == 1 and "<function relu>" in text


def test_dtypes_shapes_numpy_keys_statics_and_views():
    w = jnp.ones((2, 3), jnp.bfloat16)
    model = Node(
        w=w, t=tied.transpose(w), n=np.zeros(4, np.int64), k=jax.random.key(0), b=jnp.ones((), bool),
        c=jnp.ones(2, jnp.complex64), s="x" * 100, f=1.5,
    )  # fmt: skip
    lines = repr(model).splitlines()
    assert "  w=bf16[2,3]," in lines and "  n=i64[4](numpy)," in lines and "  k=key<fry>[]," in lines
    assert "  b=bool[]," in lines and "  c=c64[2]," in lines and "  f=1.5," in lines
    assert "  s='" + "x" * 56 + "...," in lines  # a long static is cut
    assert "    fn=<function transpose>," in lines and "    source=<tied: same as .w>," in lines
    assert read_back(repr(model)) == expected_marks(model)


def test_a_cycle_prints_finitely_with_a_mark_back():
    a = Node(w=jnp.ones(2))
    b = Node(parent=a, w=a.w)
    a.child, a.again = b, [a, {"b": b}]
    text = repr(a)
    assert len(text.splitlines()) == 13
    assert read_back(text) == expected_marks(a) == {
        ".child.parent": "<root>", ".child.w": ".w", ".again[0]": "<root>", ".again[1]['b']": ".child",
    }  # fmt: skip


# A random graph of registered nodes, lists, tuples and dicts over a small pool of arrays and nodes,
# with cycles: each node's fields are drawn from the pool (so objects recur at several places).
@st.composite
def graphs(draw):
    arrays = [jnp.full((i + 1,), float(i)) for i in range(draw(st.integers(1, 4)))]
    nodes = [Node() for _ in range(draw(st.integers(1, 5)))]
    pool = arrays + nodes
    for j, node in enumerate(nodes):
        for f in range(draw(st.integers(0, 4))):
            pick = st.sampled_from(pool)
            value = draw(
                st.one_of(
                    pick, st.lists(pick, max_size=3), st.tuples(pick, pick),
                    st.dictionaries(st.sampled_from(["a", "b"]), pick, max_size=2), st.just(j),
                )
            )  # fmt: skip
            setattr(node, f"f{f}", value)
    return nodes[0]


@settings(max_examples=40, deadline=None)
@given(graphs())
def test_marks_are_exactly_where_tied_ties_says_on_random_graphs(model):
    text = repr(model)
    assert read_back(text) == expected_marks(model)
    assert len(text.splitlines()) <= 2 * MAX_LINES + 2


def test_ten_thousand_layers_print_truncated():
    layers = [Dense(np.ones((2, 2), np.float32), np.zeros(2, np.float32)) for _ in range(10_000)]
    layers[-1] = Dense(layers[0].weight)  # a tie past the limit is not printed, and is no error
    text = repr(Chain(*layers))
    lines = text.splitlines()
    assert MAX_LINES <= len(lines) <= MAX_LINES + 5 and len(text) < 100 * MAX_LINES
    assert "more than 200 lines: tied.summary(model) lists every place" in text
    assert lines[-2:] == ["  ],", ")"]


def test_a_ten_thousand_deep_model_prints_within_the_depth_and_line_limits():
    node = Node(w=jnp.ones(1))
    root = node
    for _ in range(10_000):
        node.next = Node()
        node = node.next
    text = repr(root)
    assert len(text.splitlines()) <= 2 * MAX_DEPTH + 4
    assert "next=Node(...)," in text and max(len(line) for line in text.splitlines()) < 2 * MAX_DEPTH + 40


def test_nn_layers_and_gradients_print_as_trees():
    bn = BatchNorm(3)
    model = Chain(Dense(3, 3, key=jax.random.key(0)), bn, bn)
    assert read_back(repr(model)) == expected_marks(model) == {".layers[2]": ".layers[1]"}
    g = tied.grad(lambda m: m(jnp.ones((4, 3))).sum())(model)
    text = repr(g.layers[1])
    assert text.startswith("BatchNorm(\n  weight=f32[3],") and "running_mean=State(\n    value=None," in text


# ---------------------------------------------------------------- which classes get it


def test_a_class_with_its_own_repr_keeps_it_a_dataclass_generated_one_is_replaced():
    @tied.register
    class Own:
        def __init__(self):
            self.w = jnp.ones(2)

        def __repr__(self):
            return "mine"

    @tied.register
    class Child(Own):
        pass

    @tied.register
    @dataclasses.dataclass
    class Generated:
        w: jax.Array

    @tied.register
    @dataclasses.dataclass
    class Written:
        w: jax.Array

        def __repr__(self):
            return "written"

    assert repr(Own()) == "mine" and repr(Child()) == "mine"
    assert repr(Generated(jnp.ones(2))) == "Generated(\n  w=f32[2],\n)"
    assert repr(Written(jnp.ones(2))) == "written"


def test_a_model_the_walk_refuses_still_prints_and_says_why():
    class Opaque:  # not registered, holds an array: the walk refuses it
        def __init__(self):
            self.w = jnp.ones(2)

    text = repr(Node(inner=Opaque()))
    assert text.startswith("<Node object at 0x") and "tied cannot walk it" in text and ".inner" in text


# ---------------------------------------------------------------- treescope


def test_treescope_renders_tied_nodes_with_the_same_marks():
    treescope = pytest.importorskip("treescope", reason="treescope is not installed (the test extra)")
    d = Dense(jnp.ones((2, 2)), jnp.zeros(2))
    a = Node(chain=Chain(d, Dense(d.weight, d.bias)), again=d)
    a.me = a
    text = treescope.render_to_text(a)
    marks = sorted(re.findall(r"<tied: same as [^>]*>+", text))
    assert marks == sorted(re.findall(r"<tied: same as [^>]*>+", repr(a)))
    assert len(marks) == sum(len(g) - 1 for g in tied.ties(a)) == 4
    assert "float32(2, 2)" in text  # the arrays are treescope's own renderings


def test_a_stack_shows_its_length_and_its_ties_to_the_outside():
    norm = jnp.ones(2)
    model = Node(
        blocks=tied.stack([{"w": jnp.full(2, float(i)), "norm": norm} for i in range(4)]),
        norm=norm,
    )
    lines = repr(model).splitlines()
    assert lines[:4] == ["Node(", "  blocks=Stack(", "    n=4,", "    member={"]
    assert "      'w': f32[4,2]," in lines  # stacked: the leading axis is n
    assert "  norm=<tied: same as .blocks.member['norm']>," in lines  # broadcast: the one array
    assert read_back(repr(model)) == expected_marks(model)
