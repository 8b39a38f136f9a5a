"""bench/secure_scale.py at small n: a round of in-process sites with dropouts at every stage
ends with the exact sum, the mask work it reports is (k + 1) d, and the coordinator holds one
vector of d words. Timings are the benchmark's (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import math

import pytest
from helpers.bench import bench_module

from prism_runtime.secure_sum import RoundTrust, sample_size
from prism_runtime.secure_sum.messages import SEALED_SHARES_BYTES


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


def test_what_a_site_receives_is_its_neighbourhood_and_a_sample_with_log_n_proofs(scale):
    """Counted bytes, not time: besides the roster's ids and the sets' bitmaps (n / 8 bytes
    each), a site receives its neighbourhood's k + 1 advertisements and k sealed shares and a
    sample of the signatures (flat in n), each advertisement and signature with at most
    ceil(log2 n) proof hashes: O((k + s) log n), not O(n)."""
    for n in (60, 240):
        row = scale.simulate(n, delta=0.0, length=50, corrupt=0.1, sparse=True, seed=1)
        parts = row["site_received_bytes_by_part"]
        k, depth = row["degree"], math.ceil(math.log2(n))
        advert = 10 + 3 * 32 + 72 + 16  # id, keys and commitment, signature, share, H and D
        assert parts["roster"] - n * len("site-00000") - 24 <= (k + 1) * (advert + 32 * depth)
        assert parts["shares"] <= k * (10 + SEALED_SHARES_BYTES)
        assert parts["sets"] <= 6 * math.ceil(n / 8) + 48
        drawn = sample_size(n, RoundTrust(n - n // 10, 0).confirmations(n))
        assert drawn < 48  # the sample is flat in n (views.sample_size)
        assert parts["signatures"] <= drawn * (10 + 72 + 32 * depth)
