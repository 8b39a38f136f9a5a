"""A run in which no round was applied exports no adapter, and says why.

``server.federation.run_federation`` runs in this process with real sites (the real ClientApp
behind ``resume_driver.LoopbackGrid``: only Flower's transport is left out). When every site
refuses (the run asks for more epsilon than the sites' cap), the run folder has no ``adapter/``
(it would be the untrained start point), ``summary.json`` says ``rounds-applied: 0`` with the
reason, and a WARNING names it. A run where the sites train still exports its adapter.

A site that refuses up front never calibrated its noise (sigma 0 in its facts): the coordinator
records a refusal (no charge), not a ``facts-mismatch`` rejection with an unconfirmed charge.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from resume_driver import LoopbackGrid

from client.policy import SIMULATION_EPSILON_CAP
from prism_runtime.config import RunConfig, parse_config
from server.federation import run_federation

pytestmark = pytest.mark.usefixtures("flower_identity")

SITES = 2


def _run(model: str, run_dir: Path, **changes: object) -> Path:
    values: dict[str, object] = {
        "model": model,
        "lora-rank": 4,
        "num-rounds": 1,
        "local-steps": 2,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "noise-multiplier": 4.0,  # cheap to account
        "target-epsilon": 2.0,
        "sites-per-round": SITES,
        "run-dir": str(run_dir),
    }
    values.update(changes)
    run = parse_config(RunConfig, values, what="run config")
    return run_federation(LoopbackGrid(values, SITES), run)  # type: ignore[arg-type]


def test_a_run_where_every_site_refused_exports_no_adapter_and_says_why(
    tiny_bert, tmp_path, capsys
):

    above_cap = SIMULATION_EPSILON_CAP + 1.0  # every site's own cap refuses this request
    # the apps' own log set-up stops propagation to the root logger: listen on the logger itself
    records: list[logging.LogRecord] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("server.federation")
    logger.addHandler(listener)
    try:
        run_dir = _run(
            tiny_bert, tmp_path / "run", **{"num-rounds": 2, "target-epsilon": above_cap}
        )
    finally:
        logger.removeHandler(listener)
    summary = json.loads((run_dir / "summary.json").read_text())
    # every site refused round 1 (so none is asked again): the run stops there
    assert [r["applied"] for r in summary["rounds"]] == [False]
    for r in summary["rounds"]:  # every site answered, none with an update
        assert r["accepted"] == [] and len(r["refused"]) == SITES and not r["rejected"]
    assert summary["rounds-applied"] == 0
    assert summary["adapter"] is None
    reason = summary["adapter-reason"]
    assert reason.startswith("no round was applied in 1 round(s) (refusals: ")
    refused = sum(len(r["refused"]) for r in summary["rounds"])
    rejected = sum(len(r["rejected"]) for r in summary["rounds"])
    assert f"refusals: {refused}" in reason and f"rejected replies: {rejected}" in reason
    assert "untrained start point" in reason
    assert not (run_dir / "adapter").exists()
    assert "resume state (not a model)" in summary["checkpoint"]["what"]
    assert (run_dir / summary["checkpoint"]["file"]).is_file()  # resume still works
    assert any(
        r.levelno == logging.WARNING
        and "no adapter exported: no round was applied" in r.getMessage()
        for r in records
    )
    assert "WARNING: NO adapter exported" in capsys.readouterr().out
    for name in ("ledger.sqlite", "report.json", "run-config.json"):
        assert (run_dir / name).is_file(), name
    sites = json.loads((run_dir / "report.json").read_text())["sites"]
    assert sites == []  # a refusal charges nothing, confirmed or unconfirmed: no ledger row


def test_a_run_where_the_sites_trained_still_exports_its_adapter(tiny_bert, tmp_path):
    run_dir = _run(tiny_bert, tmp_path / "run")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["applied"] for r in summary["rounds"]] == [True]
    assert summary["rounds-applied"] == 1
    assert summary["adapter"] == "adapter" and "adapter-reason" not in summary
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
