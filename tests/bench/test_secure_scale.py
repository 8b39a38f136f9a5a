"""bench/secure_scale.py at small n: a round of in-process sites with dropouts at every stage
ends with the exact sum, the mask work it reports is (k + 1) d, and the coordinator holds one
vector of d words. Timings are the benchmark's (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import pytest
from helpers.bench import bench_module


@pytest.fixture(scope="module")
def scale():
    yield from bench_module("secure_scale")


@pytest.mark.parametrize(
    ("n", "delta", "graph"), [(12, 0.0, True), (40, 0.3, True), (12, 0.25, False)]
)
def test_a_simulated_round_is_exact_and_counts_k_plus_one_mask_streams(scale, n, delta, graph):
    row = scale.simulate(n, delta=delta, length=50, corrupt=0.1, sparse=graph, seed=1)
    assert row["outcome"] == "ok" and row["exact"] is True
    dropped = row["dropped"]
    assert sum(dropped.values()) == round(delta * n)
    if delta:
        assert min(dropped.values()) >= 1  # every stage loses sites
    assert row["graph"] == ("sparse" if graph and row["degree"] < n - 1 else "complete")
    # A site masks with at most its k neighbours plus its self mask, d words each.
    assert row["site_mask_words"] <= (row["degree"] + 1) * 50
    assert row["coordinator_sum_bytes"] == 50 * 8
