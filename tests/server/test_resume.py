"""Crash-safe coordinator: SIGKILL the coordinator process at named points, resume, compare.

The coordinator runs as a real subprocess (``resume_driver.py``: the real federation code, the
real ClientApp of in-process sites, real SQLite ledger and checkpoint files; only Flower's
transport is replaced by a loopback grid). ``tests/e2e/test_resume_e2e.py`` does the same through
real SuperLink/SuperNode processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.checkpoint import load_checkpoint
from server.errors import ConfigError
from server.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("resume_driver.py")
SITES, ROUNDS, PER_ROUND = 3, 3, 2  # the site-selection RNG matters


def _config(model: str, run_dir: Path) -> dict[str, object]:
    return {
        "model": model,
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "local-steps": 2,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "noise-multiplier": 4.0,  # cheap to account; the cap still binds via target-epsilon
        "target-epsilon": 2.0,
        "sites-per-round": PER_ROUND,
        "server-eval-data": "synthetic",
        "run-dir": str(run_dir),
    }


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        FLWR_TELEMETRY_ENABLED="0",
    )
    env.pop("PRISM_FL_PAUSE_AT", None)
    env.update(extra)
    return env


def _command(config: dict[str, object]) -> list[str]:
    return [sys.executable, str(DRIVER), json.dumps(config), str(SITES)]


def _run_to_end(config: dict[str, object], log: Path) -> str:
    with log.open("w") as out:
        proc = subprocess.run(
            _command(config),
            env=_env(),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def _run_and_kill(config: dict[str, object], point: str, tmp: Path) -> None:
    """Start the coordinator with a pause at ``point``; SIGKILL it there."""
    pause = tmp / f"pause-{point}.json"
    log = tmp / f"killed-{point}.log"
    env = _env(PRISM_FL_PAUSE_AT=point, PRISM_FL_PAUSE_FILE=str(pause))
    with log.open("w") as out:
        proc = subprocess.Popen(
            _command(config), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 600
            while not pause.exists():
                assert proc.poll() is None, f"ended before {point}:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"{point} not reached"
                time.sleep(0.2)
            pid = json.loads(pause.read_text())["pid"]
            assert pid == proc.pid
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _outcome(run_dir: Path) -> dict[str, object]:
    ckpt = load_checkpoint(run_dir)
    assert ckpt is not None
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        events = sorted(
            (e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, e.delta, e.epsilon_cap)
            for e in ledger.events()
        )
        eps = {s: ledger.epsilon(s).prv for s in ledger.sites()}
    sites = {
        p.name: (p / "privacy-ledger.jsonl").read_text()
        for p in sorted((run_dir / "sites").iterdir())
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "round": ckpt.server_round,
        "arrays": ckpt.arrays,
        "adapter": (run_dir / "adapter" / "adapter_model.safetensors").read_bytes(),
        "events": events,
        "epsilon": eps,
        "site-ledgers": sites,
        "rounds": summary["rounds"],
        "server-eval": summary["server-eval"],
    }


def test_sigkilled_coordinator_resumes_to_the_uninterrupted_result(tiny_bert, tmp_path):
    straight = _config(tiny_bert, tmp_path / "straight")
    _run_to_end(straight, tmp_path / "straight.log")
    expected = _outcome(tmp_path / "straight")
    assert expected["round"] == ROUNDS and len(expected["events"]) == ROUNDS * PER_ROUND

    crashed_dir = tmp_path / "crashed"
    crashed = _config(tiny_bert, crashed_dir)
    # Kill 1: round 2, after the first reply went to the ledger and before the second.
    _run_and_kill(crashed, "mid-aggregation@2", tmp_path)
    assert load_checkpoint(crashed_dir).server_round == 1  # type: ignore[union-attr]
    with Ledger.open(crashed_dir / "ledger.sqlite", read_only=True) as ledger:
        assert sorted(e.round for e in ledger.events()) == [1, 1, 2]  # half of round 2 stored
    # Kill 2: round 3, checkpoint written to its temporary file but not yet renamed.
    _run_and_kill(crashed, "mid-checkpoint@3", tmp_path)
    assert load_checkpoint(crashed_dir).server_round == 2  # type: ignore[union-attr]
    assert list(crashed_dir.glob(".checkpoint.safetensors.*.tmp"))  # the cut-short write
    log = _run_to_end(crashed, tmp_path / "resumed.log")
    assert "resuming" in log and "at round 3" in log
    assert not list(crashed_dir.glob(".*.tmp"))  # cleaned up on resume

    got = _outcome(crashed_dir)
    assert got["round"] == expected["round"]
    assert got["events"] == expected["events"]  # nothing lost, nothing twice
    assert got["epsilon"] == expected["epsilon"]  # exactly equal floats
    # Sites resent their stored replies for re-asked rounds: no step was charged twice.
    assert got["site-ledgers"] == expected["site-ledgers"]
    assert got["rounds"] == expected["rounds"]
    assert got["server-eval"] == expected["server-eval"]
    assert set(got["arrays"]) == set(expected["arrays"])  # type: ignore[arg-type]
    for name, tensor in expected["arrays"].items():  # type: ignore[attr-defined]
        assert got["arrays"][name].dtype == tensor.dtype  # type: ignore[index]
        assert got["arrays"][name].equal(tensor), name  # bitwise  # type: ignore[index]
    assert got["adapter"] == expected["adapter"]  # the exported file, byte for byte


def test_resume_refuses_a_run_dir_of_another_configuration(tmp_path):
    from client.config import RunConfig, parse_config
    from server.federation import run_federation

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stored = parse_config(RunConfig, {"run-dir": str(run_dir)}, what="run config")
    (run_dir / "run-config.json").write_text(json.dumps(stored.model_dump(by_alias=True)))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    changed = parse_config(
        RunConfig, {"run-dir": str(run_dir), "lr": 0.5, "num-rounds": 7}, what="run config"
    )
    with pytest.raises(ConfigError) as err:
        run_federation(None, changed)  # type: ignore[arg-type]
    message = str(err.value)
    assert "lr: 0.02 -> 0.5" in message and "num-rounds: 3 -> 7" in message
    assert "run-dir" in message and "model" not in message.split("differing keys:")[1]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing touched
