"""A hundred virtual sites on Flower's simulation engine, one secure round with a sparse
masking graph, end to end (marked slow: outside ``make test``; ``pytest -m slow`` runs it).

The real app (``flwr run . local``) with the tiny BERT: every site advertises keys, shares its
secrets among its neighbourhood only, masks with its neighbours, signs its view and answers the
unmasking; the coordinator applies the sum. The test asserts what the run must show (the round
applied with every site, the graph sparse, each site charged once with its honest-site count)
and prints the round's wall time and the coordinator's stage times for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import resource
import time

import pytest
from flower_harness import flower_env, flwr_run

from server.demo import stop_local_superlinks
from server.ledger import Ledger

SITES = 100

pytestmark = pytest.mark.slow


def test_a_hundred_virtual_sites_run_a_sparse_secure_round(tiny_bert, tmp_path):
    home, run_dir = tmp_path / "flwr", tmp_path / "run"
    env = flower_env(home)
    values = {
        "model": f"'{tiny_bert}'",
        "lora-rank": 2,
        "num-rounds": 1,
        "local-steps": 1,
        "batch-size": 8,
        "micro-batch-size": 8,
        "synthetic-examples": 24 * SITES,
        "max-length": 16,
        "target-epsilon": 8.0,
        "sites-per-round": SITES,
        "secure-aggregation": "true",
        "secure-graph": "'sparse'",
        "min-honest-sites": 90,
        "round-timeout": 900.0,
        "run-dir": f"'{run_dir}'",
    }
    config = " ".join(f"{k}={v}" for k, v in values.items())
    started = time.monotonic()
    try:
        result = flwr_run(
            env,
            "local",
            config,
            extra=[
                "--federation-config",
                f"num-supernodes={SITES} client-resources-num-cpus=1",
            ],
            timeout=1800,
        )
    finally:
        stop_local_superlinks(home)
    wall = time.monotonic() - started
    output = result.stdout[-6000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    (only,) = summary["rounds"]
    assert only["applied"] and len(only["accepted"]) == SITES, only
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        assert len(ledger.sites()) == SITES
        events = ledger.events()
    assert len(events) == SITES
    assert {e.event.secure.honest_sites for e in events if e.event.secure} == {90}
    log = result.stdout + result.stderr
    degree = re.findall(r"masking graph degree (\d+)", log)
    stages = re.findall(r"secure stage (\w+) in ([0-9.]+) s", log)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        f"\n{SITES} virtual sites, one secure round: wall {wall:.0f} s (flwr run, start to end), "
        f"stages {stages}, graph degree {degree}, peak RSS of a child process {peak:.0f} MiB"
    )
    if degree:
        assert int(degree[0]) < SITES - 1
