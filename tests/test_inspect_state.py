"""Inspection of state, typed keys and deep models (issues 15 and 17), against hand counts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import tied


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
