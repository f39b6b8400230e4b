"""Timing shared by the benchmarks: interleaved rounds and per-round ratios.

The machine is shared and noisy, so the systems compared are timed in rounds, each
round in another order (no system always first), and a ratio is the median over
rounds of the ratio measured within one round: a slow spell hits both of its sides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator

import jax


def rotated(names: list[str], rounds: int) -> Iterator[str]:
    """``names`` once in each of ``rounds`` rounds; round ``r`` starts at name ``r mod len(names)``."""
    for r in range(rounds):
        k = r % len(names)
        yield from names[k:] + names[:k]


def time_rounds(ops: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of one call of each ``ops[name]()`` in each of ``rounds`` rotated rounds."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for name in rotated(list(ops), rounds):
        t0 = time.perf_counter()
        ops[name]()
        times[name].append(time.perf_counter() - t0)
    return times


def ratios(times: dict[str, list[float]], pairs: dict[str, tuple[str, str]]) -> dict:
    """For each ``key: (ours, ref)`` of ``pairs``, the per-round ratios ``times[ours] / times[ref]``:
    their median (``ratio``) and their ``[min, max]`` (``ratio_range``)."""
    per_round = {k: [a / b for a, b in zip(times[x], times[y])] for k, (x, y) in pairs.items()}
    return {
        "ratio": {k: statistics.median(v) for k, v in per_round.items()},
        "ratio_range": {k: [min(v), max(v)] for k, v in per_round.items()},
    }


def interleaved(runs: dict[str, Callable[[], object]], rounds: int, repeat: int, warm: int) -> dict:
    """Two systems ``runs`` (``{name: step}``) side by side: each called ``warm`` times first (compile,
    warm up; its results are ``firsts``), then ``repeat`` calls per round in ``rounds`` rotated rounds.
    The median seconds per call of each (``seconds``), the median per-round ratio of the first to the
    second (``ratio``) and its ``(min, max)`` (``ratio_range``)."""
    names = list(runs)
    firsts = {n: [runs[n]() for _ in range(warm)] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in rotated(names, rounds):  # neither always first
        t0 = time.perf_counter()
        for _ in range(repeat):
            out = runs[n]()
        jax.block_until_ready(out)
        times[n].append((time.perf_counter() - t0) / repeat)
    a, b = names
    per_round = [x / y for x, y in zip(times[a], times[b])]
    return {
        "seconds": {n: statistics.median(t) for n, t in times.items()},
        "ratio": statistics.median(per_round),
        "ratio_range": (min(per_round), max(per_round)),
        "firsts": firsts,
    }


def arguments(doc: str | None, rounds: int = 7) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as the help, ``--rounds`` (default ``rounds``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser
