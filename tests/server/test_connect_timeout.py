"""A coordinator with fewer than ``min-sites`` connected sites stops after ``connect-timeout``
with an error that says what to do, instead of waiting forever; its ledger is closed and a
later run with enough sites resumes on the same run folder.

``server.federation.run_federation`` runs in this process with real sites (the real ClientApp
behind ``resume_driver.LoopbackGrid``: only Flower's transport is left out).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from resume_driver import LoopbackGrid

from prism_runtime.config import RunConfig, parse_config
from server.errors import SitesUnavailableError
from server.federation import run_federation

pytestmark = pytest.mark.usefixtures("flower_identity")


def _values(model: str, run_dir: Path) -> dict[str, object]:
    return {
        "model": model,
        "lora-rank": 4,
        "num-rounds": 1,
        "local-steps": 1,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "noise-multiplier": 4.0,  # cheap to account
        "target-epsilon": 2.0,
        "sites-per-round": 2,
        "min-sites": 2,
        "connect-timeout": 1.5,
        "run-dir": str(run_dir),
    }


def test_too_few_sites_stop_the_run_with_a_clear_error_and_a_closed_ledger(tiny_bert, tmp_path):
    values = _values(tiny_bert, tmp_path / "run")
    run = parse_config(RunConfig, values, what="run config")
    started = time.monotonic()
    with pytest.raises(SitesUnavailableError) as info:
        run_federation(LoopbackGrid(values, 1), run)  # type: ignore[arg-type]
    waited = time.monotonic() - started
    message = str(info.value)
    assert "1 of min-sites=2 sites connected after 1.5 s (connect-timeout)" in message
    assert "start more sites" in message and "or lower min-sites" in message
    assert waited >= 1.5  # it did wait for the sites (and stopped: the test returned)
    ledger = tmp_path / "run" / "ledger.sqlite"
    conn = sqlite3.connect(ledger)  # closed by the coordinator: an exclusive lock is free
    conn.execute("BEGIN EXCLUSIVE")
    assert conn.execute("SELECT COUNT(*) FROM events").fetchone() == (0,)  # nothing charged
    conn.rollback()
    conn.close()
    assert not (tmp_path / "run" / "summary.json").exists()

    again = run_federation(LoopbackGrid(values, 2), run)  # type: ignore[arg-type]
    summary = json.loads((again / "summary.json").read_text())
    assert summary["rounds-applied"] == 1


def test_connect_timeout_must_be_positive(tiny_bert, tmp_path):
    from prism_runtime.errors import ConfigError

    values = _values(tiny_bert, tmp_path / "run") | {"connect-timeout": 0}
    with pytest.raises(ConfigError, match="connect-timeout"):
        parse_config(RunConfig, values, what="run config")
