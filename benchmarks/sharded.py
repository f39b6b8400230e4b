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

import json
import os
import tempfile

import jax
import safetensors.numpy

import tied

from .checkpoint import _block, _fsync, _unique, model, print_rows, result, table, time_save_load
from .timing import arguments

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

        times = time_save_load(m, ours, tied_save, st_save, tied_load, st_load, rounds)
    return {"shards": len(groups), **result(times, nbytes, rounds)}


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    lines = [
        "## Checkpoints: a sharded set in Hugging Face's layout",
        "",
        f"The same {r['gib']:.2f} GiB model saved as {r['shards']} shards of at most 128 MiB and an index, "
        f"{r['rounds']} interleaved rounds, against safetensors' own `save_file`/`load_file` of the same "
        "shards; the ratio is the median of the per-round ratios (min to max in brackets).",
        "",
    ]
    return [*lines, *table(r, TARGETS)]


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--dir", default=None, help="folder for the sets (default: the temp folder)")
    args = parser.parse_args(argv)
    r = run(args.rounds, args.dir)
    print_rows(r, TARGETS)
    return r


if __name__ == "__main__":
    main()
