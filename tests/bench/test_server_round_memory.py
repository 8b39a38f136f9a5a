"""bench/server.py's ``--round-memory`` mode on a tiny adapter (one layer): both round loops
run through Flower's InMemoryGrid and aggregate every site; the streaming loop holds one reply
at a time, the collect-all loop every reply. No memory figure is asserted: that is the
benchmark's job (docs/benchmarks.md), on an idle machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def server():
    sys.path.insert(0, str(BENCH))  # bench/server.py imports its sibling ``step``
    spec = importlib.util.spec_from_file_location("bench_server", BENCH / "server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        module.LAYERS = 1
        yield module
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(("path", "held"), [("stream", 1), ("collect", 3)])
def test_round_memory_child_runs_both_loops_on_a_tiny_adapter(server, path, held):
    row = server.round_memory_child(3, path)
    assert row["sites"] == 3 and row["path"] == path and row["layers"] == 1
    assert row["peak_replies_held"] == held
    assert row["extra_peak_mib"] >= 0 and row["round_s"] > 0
