"""Smoke test of `python -m tied.demo --steps 20`: the loss goes down and every tie holds."""

import numpy as np

from tied import demo

DIM, VOCAB, SEQ, HIDDEN = 64, 74, 64, 256


def test_corpus_is_shipped_and_small():
    text = demo.load_corpus()
    assert 10_000 < len(text.encode()) <= 1_000_000
    assert "Shall I compare thee to a summer's day?" in text
    assert len(set(text)) == VOCAB


def test_demo_twenty_steps(tmp_path, capsys):
    r = demo.main(["--steps", "20", "--out", str(tmp_path), "--seed", "0"])
    out = capsys.readouterr().out

    # parameter counts against a count by hand of the configuration
    block = (
        2 * 2 * DIM
        + (3 * DIM * DIM + 3 * DIM)
        + (DIM * DIM + DIM)
        + (HIDDEN * DIM + HIDDEN)
        + (DIM * HIDDEN + DIM)
    )
    embed, pos, ln = VOCAB * DIM, SEQ * DIM, 2 * DIM
    assert r["unique_params"] == embed + pos + 2 * block + ln
    assert r["per_place_params"] == r["unique_params"] + 2 * block + embed  # head, 2 repeats
    assert r["tie_groups"] == [
        (".embed.weight", ".head.weight"),
        (".blocks[0]", ".blocks[2]"),
        (".blocks[1]", ".blocks[3]"),
    ]

    # training did something, and every tie held
    assert r["steps"] == 20 and len(r["losses"]) == 20
    assert r["loss_after"] < r["loss_before"] - 0.5
    assert np.log(VOCAB) - 1 < r["loss_before"] < np.log(VOCAB) + 1
    assert r["ties_held"] and r["checkpoint_ties_held"]
    assert r["model"].head.weight is r["model"].embed.weight
    assert "the output head still is the input embedding" in out and ": NO" not in out

    # memory: gradients + AdamW's two moments, per unique parameter vs per place (float32)
    mem = r["memory"]
    assert mem["params"] == 4 * r["unique_params"]
    assert 3.0 <= mem["tied"] / mem["params"] < 3.001
    assert abs(mem["per_place"] - 3 * 4 * r["per_place_params"]) < 64  # + step counters

    # samples continue their prompts
    assert [s[:8] for s in r["samples"]] == ["Shall I ", "When in ", "Love is "]

    # files
    files = r["files"]
    with open(files["loss_curve"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "checkpoint.safetensors").stat().st_size > 3 * mem["params"]
    assert "tied to .embed.weight" in (tmp_path / "summary.txt").read_text()
    assert (tmp_path / "model.dot").read_text().startswith("digraph")
