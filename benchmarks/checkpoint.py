"""Single-file checkpoints at disk speed: `tied.save` / `tied.load` against safetensors itself.

A 0.5 GiB model with a tie (an embedding that is also the output head, and
twelve MLP blocks) is saved and loaded, side by side in interleaved rounds
(the order rotates every round), by

* ``tied.save(path, model)`` against ``safetensors.numpy.save_file`` of the same
  unique arrays (fetched with ``np.asarray``) followed by an ``fsync`` of the
  file (``tied.save`` fsyncs, so the reference does too);
* ``tied.load(path, like)`` against ``safetensors.numpy.load_file`` followed by
  ``jax.device_put`` of every array (``tied.load`` checks the CRC-32C of every
  array and builds the model with its ties).

Both read files that sit in the page cache, so loads measure memory and
parsing, saves the disk. Reports the median time of each, the median of the
per-round ratios, and GiB/s of unique bytes.

    python -m benchmarks.checkpoint [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import os
import statistics
import tempfile

import jax
import numpy as np
import safetensors.numpy

import tied
from tied.nn import MLP, Chain, Dense, Embedding

from .timing import arguments, ratios, time_rounds

TARGETS = {"save": 1.1, "load": 1.5}
GIB = 1 << 30
PAIRS = {"save": ("tied.save", "save_file+fsync"), "load": ("tied.load", "load_file+device_put")}


def model(vocab: int = 32768, dim: int = 1024, hidden: int = 4096, blocks: int = 12):
    """Embedding (vocab x dim, float32) tied to the head, and ``blocks`` MLPs: 0.5 GiB of unique arrays."""
    keys = jax.random.split(jax.random.key(0), blocks + 1)
    emb = Embedding(vocab, dim, key=keys[0])
    return Chain(emb, *[MLP(dim, hidden, key=k) for k in keys[1:]], Dense(emb.weight, None))


def _unique(m) -> dict[str, np.ndarray]:
    leaves, gdef = tied.flatten(m)
    return {paths[0]: np.asarray(x) for x, paths in zip(leaves, gdef.leaf_paths())}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _block(tree) -> None:
    for x in tied.flatten(tree)[0]:
        x.block_until_ready()


def run(rounds: int = 7, folder: str | None = None) -> dict:
    """Time the four operations in ``rounds`` interleaved rounds; returns seconds, ratios and GiB/s."""
    m = model()
    leaves, _ = tied.flatten(m)
    nbytes = sum(x.nbytes for x in leaves)
    assert m.layers[0].weight is m.layers[-1].weight
    with tempfile.TemporaryDirectory(dir=folder) as d:
        ours, theirs = os.path.join(d, "tied.safetensors"), os.path.join(d, "plain.safetensors")

        def tied_save():
            tied.save(ours, m)

        def st_save():
            safetensors.numpy.save_file(_unique(m), theirs)
            _fsync(theirs)

        def tied_load():
            _block(tied.load(ours, m))

        def st_load():
            _block({k: jax.device_put(v) for k, v in safetensors.numpy.load_file(theirs).items()})

        times = time_save_load(m, ours, tied_save, st_save, tied_load, st_load, rounds)
    return result(times, nbytes, rounds)


def time_save_load(m, ours: str, tied_save, st_save, tied_load, st_load, rounds: int) -> dict:
    """Warm up the four operations (the files exist and sit in the page cache), check that ``ours``
    loads back with its tie and values, then time them in ``rounds`` rotated rounds."""
    ops = {"tied.save": tied_save, "save_file+fsync": st_save, "tied.load": tied_load}
    ops["load_file+device_put"] = st_load
    for op in ops.values():
        op()
    back = tied.load(ours, m)
    assert back.layers[0].weight is back.layers[-1].weight
    assert np.array_equal(np.asarray(back.layers[3].fc1.weight), np.asarray(m.layers[3].fc1.weight))
    return time_rounds(ops, rounds)


def result(times: dict, nbytes: int, rounds: int) -> dict:
    """Median seconds and GiB/s of each operation, ratios of tied's to safetensors' per round."""
    seconds = {k: statistics.median(v) for k, v in times.items()}
    return {
        "gib": nbytes / GIB,
        "rounds": rounds,
        "seconds": seconds,
        "gib_per_s": {k: nbytes / GIB / s for k, s in seconds.items()},
        **ratios(times, PAIRS),
        "all_seconds": times,
    }


def rows(r: dict, targets: dict) -> list[tuple[str, str, str, float, float, float, str]]:
    """Per operation: (op, tied's, the reference, ratio, min, max, whether ``targets`` is met)."""
    out = []
    for op, (ours, ref) in PAIRS.items():
        lo, hi = r["ratio_range"][op]
        verdict = "met" if r["ratio"][op] <= targets[op] else "missed"
        out.append((op, ours, ref, r["ratio"][op], lo, hi, verdict))
    return out


def table(r: dict, targets: dict) -> list[str]:
    """The markdown table of `report`: a row per operation, then a blank line."""
    lines = [
        "| operation | tied | GiB/s | reference | GiB/s | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, ours, ref, ratio, lo, hi, verdict in rows(r, targets):
        lines.append(
            f"| {op} | {r['seconds'][ours]:.3f} s | {r['gib_per_s'][ours]:.2f} | `{ref}` "
            f"{r['seconds'][ref]:.3f} s | {r['gib_per_s'][ref]:.2f} | {ratio:.2f}x ({lo:.2f} to "
            f"{hi:.2f}) | <= {targets[op]}x ({verdict}) |"
        )
    return [*lines, ""]


def print_rows(r: dict, targets: dict) -> None:
    """What `main` prints, one line per operation."""
    for op, ours, ref, ratio, lo, hi, _ in rows(r, targets):
        print(
            f"{ours:10s} {r['seconds'][ours]:.3f} s {r['gib_per_s'][ours]:5.2f} GiB/s | {ref:21s} "
            f"{r['seconds'][ref]:.3f} s {r['gib_per_s'][ref]:5.2f} GiB/s | ratio {ratio:.2f}x "
            f"(rounds {lo:.2f} to {hi:.2f}; target <= {targets[op]}x)",
            flush=True,
        )


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    lines = [
        "## Checkpoints: one safetensors file",
        "",
        f"A {r['gib']:.2f} GiB model with a tied embedding, {r['rounds']} interleaved rounds; the ratio is "
        "the median of the per-round ratios (min to max in brackets), GiB/s of unique bytes at the median "
        "time.",
        "",
    ]
    return [*lines, *table(r, TARGETS)]


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--dir", default=None, help="folder for the files (default: the temp folder)")
    args = parser.parse_args(argv)
    r = run(args.rounds, args.dir)
    print_rows(r, TARGETS)
    return r


if __name__ == "__main__":
    main()
