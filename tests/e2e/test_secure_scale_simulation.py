"""A hundred virtual sites on Flower's simulation engine, one secure round with a sparse
masking graph, end to end (marked slow: outside ``make test``; ``pytest -m slow`` runs it).

The real app (``flwr run . local``) with the tiny BERT: every site advertises keys, shares its
secrets among its neighbourhood only, masks with its neighbours, signs its view and answers the
unmasking; the coordinator applies the sum. The test asserts what the run must show (the round
applied with every site, the graph sparse, each site charged once with its honest-site count)
and prints the round's wall time, the coordinator's stage times and the peak resident memory
of the run's processes (the SuperLink, the simulation and its ClientApp actors: every process
below this one, sampled every 0.2 s) for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
from flower_harness import flower_env, flwr_run

from server.demo import stop_local_superlinks
from server.ledger import Ledger

SITES = 100

pytestmark = pytest.mark.slow


def _descendants_rss() -> dict[int, int]:
    """The resident set (KiB) of every process below this one, by pid, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # the process ended meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parents[int(entry.name)] = int(fields["PPid"])
        rss[int(entry.name)] = int(fields.get("VmRSS", "0 kB").split()[0])
    below, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return {pid: rss[pid] for pid in below}


class _PeakMemory(threading.Thread):
    """Samples ``_descendants_rss`` until stopped: the peak of the sum and of one process."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.total = self.single = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            sizes = _descendants_rss()
            self.total = max(self.total, sum(sizes.values()))
            self.single = max([self.single, *sizes.values()])


@pytest.mark.parametrize("sites_kept", [None, 4], ids=["default", "four-sites-open"])
def test_a_hundred_virtual_sites_run_a_sparse_secure_round(tiny_bert, tmp_path, sites_kept):
    """With every site the actors serve kept open (the default on a machine with memory to
    spare), and with at most four open per actor (``PRISM_SITES_KEPT``, as on a machine short of
    memory: each site opens again from its state folder at every stage of the round)."""
    home, run_dir = tmp_path / "flwr", tmp_path / "run"
    env = flower_env(home)
    if sites_kept is not None:
        env["PRISM_SITES_KEPT"] = str(sites_kept)
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
    memory = _PeakMemory()
    memory.start()
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
        memory.done.set()
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
    print(
        f"\n{SITES} virtual sites (sites kept open: {sites_kept or 'default'}), one secure "
        f"round: wall {wall:.0f} s (flwr run, start to end), "
        f"stages {stages}, graph degree {degree}, peak resident memory of the run's processes "
        f"{memory.total / 1024:.0f} MiB together, {memory.single / 1024:.0f} MiB the largest"
    )
    if degree:
        assert int(degree[0]) < SITES - 1
