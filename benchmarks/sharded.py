"""Sharded sets at disk speed: `tied.save(max_shard_size=...)` / `tied.load` of a Hugging Face layout.

The 0.5 GiB model of `benchmarks/checkpoint.py` (an embedding tied to the head, twelve
MLP blocks) is saved as a sharded set (``model-0000k-of-0000N.safetensors`` and
``model.safetensors.index.json``, shards of at most 128 MiB: 5 shards) and loaded, in
interleaved rounds (the order rotates every round), against safetensors itself on the
same shards:

* ``tied.save(folder, model, max_shard_size=...)`` against ``safetensors.numpy.save_file``
  of each shard's unique arrays (fetched with ``np.asarray``) followed by an ``fsync`` of
  each shard (``tied.save`` fsyncs every shard and the index, and renames them into place);
* ``tied.load(folder, like)`` against ``safetensors.numpy.load_file`` of every shard
  followed by ``jax.device_put`` of every array (``tied.load`` also reads the index,
  checks the CRC-32C of every array and builds the model with its ties).

Both read files in the page cache. Reports the median time of each, the median of the
per-round ratios (min to max), and GiB/s of unique bytes.

    python -m benchmarks.sharded [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import safetensors.numpy

import tied

from .checkpoint import GIB, _block, _fsync, _unique, model

TARGETS = {"save": 1.2, "load": 1.3}
SHARD = 128 << 20


def run(rounds: int = 7, folder: str | None = None) -> dict:
    """Time the four operations in ``rounds`` interleaved rounds; returns seconds, ratios and GiB/s."""
    m = model()
    unique = _unique(m)
    nbytes = sum(x.nbytes for x in unique.values())
    with tempfile.TemporaryDirectory(dir=folder) as d:
        ours, theirs = os.path.join(d, "tied"), os.path.join(d, "plain")
        os.makedirs(theirs)
        tied.save(ours, m, max_shard_size=SHARD)
        with open(os.path.join(ours, "model.safetensors.index.json")) as f:
            wmap = json.load(f)["weight_map"]
        groups: dict[str, list[str]] = {}
        for key, shard in wmap.items():
            groups.setdefault(shard, []).append(key)

        def tied_save():
            tied.save(ours, m, max_shard_size=SHARD)

        def st_save():
            arrays = _unique(m)
            for shard, keys in groups.items():
                path = os.path.join(theirs, shard)
                safetensors.numpy.save_file({k: arrays[k] for k in keys}, path)
                _fsync(path)

        def tied_load():
            _block(tied.load(ours, m))

        def st_load():
            out = {}
            for shard in groups:
                out.update(safetensors.numpy.load_file(os.path.join(theirs, shard)))
            _block({k: jax.device_put(v) for k, v in out.items()})

        ops = {"tied.save": tied_save, "save_file+fsync": st_save, "tied.load": tied_load}
        ops["load_file+device_put"] = st_load
        for op in ops.values():  # warm up: the files exist and sit in the page cache
            op()
        back = tied.load(ours, m)
        assert back.layers[0].weight is back.layers[-1].weight
        assert np.array_equal(np.asarray(back.layers[3].fc1.weight), np.asarray(m.layers[3].fc1.weight))
        times: dict[str, list[float]] = {k: [] for k in ops}
        names = list(ops)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                ops[name]()
                times[name].append(time.perf_counter() - t0)
    pairs = {"save": ("tied.save", "save_file+fsync"), "load": ("tied.load", "load_file+device_put")}
    ratios = {op: [a / b for a, b in zip(times[o], times[ref])] for op, (o, ref) in pairs.items()}
    seconds = {k: statistics.median(v) for k, v in times.items()}
    return {
        "gib": nbytes / GIB,
        "shards": len(groups),
        "rounds": rounds,
        "seconds": seconds,
        "gib_per_s": {k: nbytes / GIB / s for k, s in seconds.items()},
        "ratio": {op: statistics.median(r) for op, r in ratios.items()},
        "ratio_range": {op: [min(r), max(r)] for op, r in ratios.items()},
        "all_seconds": times,
    }


def _rows(r: dict) -> list[tuple[str, str, str, float, float, float, str]]:
    out = []
    for op, ref in (("save", "save_file+fsync"), ("load", "load_file+device_put")):
        ours = f"tied.{op}"
        lo, hi = r["ratio_range"][op]
        verdict = "met" if r["ratio"][op] <= TARGETS[op] else "missed"
        out.append((op, ours, ref, r["ratio"][op], lo, hi, verdict))
    return out


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    lines = [
        "## Checkpoints: a sharded set in Hugging Face's layout",
        "",
        f"The same {r['gib']:.2f} GiB model saved as {r['shards']} shards of at most 128 MiB and an index, "
        f"{r['rounds']} interleaved rounds, against safetensors' own `save_file`/`load_file` of the same "
        "shards; the ratio is the median of the per-round ratios (min to max in brackets).",
        "",
        "| operation | tied | GiB/s | reference | GiB/s | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, ours, ref, ratio, lo, hi, verdict in _rows(r):
        lines.append(
            f"| {op} | {r['seconds'][ours]:.3f} s | {r['gib_per_s'][ours]:.2f} | `{ref}` "
            f"{r['seconds'][ref]:.3f} s | {r['gib_per_s'][ref]:.2f} | {ratio:.2f}x ({lo:.2f} to "
            f"{hi:.2f}) | <= {TARGETS[op]}x ({verdict}) |"
        )
    lines.append("")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="folder for the sets (default: the temp folder)")
    args = parser.parse_args(argv)
    r = run(args.rounds, args.dir)
    for op, ours, ref, ratio, lo, hi, _ in _rows(r):
        print(
            f"{ours:10s} {r['seconds'][ours]:.3f} s {r['gib_per_s'][ours]:5.2f} GiB/s | {ref:21s} "
            f"{r['seconds'][ref]:.3f} s {r['gib_per_s'][ref]:5.2f} GiB/s | ratio {ratio:.2f}x "
            f"(rounds {lo:.2f} to {hi:.2f}; target <= {TARGETS[op]}x)",
            flush=True,
        )
    return r


if __name__ == "__main__":
    main()
