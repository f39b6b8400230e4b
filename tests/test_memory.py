"""Memory: one gradient and one optimiser state per unique parameter, never one per place.

Measured on the benchmark's own workloads, from the bytes of distinct device
buffers (an aliased gradient counts once), against the naive pytree.
"""

import functools

import pytest

from benchmarks import workloads as W
from benchmarks.run import memory as measure

memory = functools.cache(measure)


@pytest.mark.parametrize("workload", [W.ALBERT, W.LM], ids=lambda w: w.name)
def test_adam_memory_is_three_times_the_unique_parameters(workload):
    m = memory(workload)
    assert m["tied"] == pytest.approx(3.0, abs=1e-3)
    # The naive pytree holds a gradient, mu and nu at every place.
    assert m["naive_pytree"] == pytest.approx(3.0 * m["param_bytes_per_place_over_unique"], rel=1e-3)
    assert m["naive_pytree"] > m["tied"]


def test_albert_places():
    m = memory(W.ALBERT)
    assert m["param_bytes_per_place_over_unique"] == 12
    assert m["naive_pytree"] == pytest.approx(36.0, abs=1e-3)
