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


def arguments(doc: str | None, rounds: int = 7) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as the help, ``--rounds`` (default ``rounds``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser
