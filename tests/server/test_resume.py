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
from helpers.grids import LoopbackSites

from server.checkpoint import load_checkpoint
from server.errors import ConfigError, LedgerError
from server.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("resume_driver.py")
SITES, ROUNDS, PER_ROUND = 3, 2, 2  # the site-selection RNG matters


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
        # The sites' reproducible mode (a site-held secret), so two runs can be compared bitwise.
        PRISM_FL_RNG_SECRET="resume-test",
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
    # Kill 2: the re-run round 2, checkpoint in its temporary file but not yet renamed.
    _run_and_kill(crashed, "mid-checkpoint@2", tmp_path)
    assert list(crashed_dir.glob(".checkpoint.safetensors.*.tmp"))  # the cut-short write
    assert load_checkpoint(crashed_dir).server_round == 1  # type: ignore[union-attr]
    log = _run_to_end(crashed, tmp_path / "resumed.log")
    assert "resuming" in log and "at round 2" in log
    assert not list(crashed_dir.glob(".*.tmp"))  # cleaned up (by load_checkpoint)

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
    from prism_runtime.config import RunConfig, parse_config
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
    assert "lr: 0.002 -> 0.5" in message and "num-rounds: 30 -> 7" in message
    assert "run-dir" in message and "model" not in message.split("differing keys:")[1]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing touched


class _HalfGrid(LoopbackSites):
    """Answers for the first node only: the other site never replies (crashed, timed out)."""

    def __init__(self, nodes, shapes):
        self.nodes, self.shapes = nodes, shapes

    def get_node_ids(self):
        return list(self.nodes)

    def answer(self, first):
        import torch
        from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
        from reply_facts import honest_facts

        from prism_runtime.protocol import ACCOUNTING, CONFIG, UPDATE

        if first.metadata.dst_node_id != min(self.nodes):
            return None
        facts = honest_facts(
            "alive",
            first.content[CONFIG],
            q=0.1,
            steps=2,
            reason=None,
            epsilon_cap=None,
            epsilon=None,
        )  # the round and its nonce echoed, as the ClientApp does
        update = {k: torch.zeros(s) for k, s in self.shapes.items()}
        content = RecordDict({UPDATE: ArrayRecord(update), ACCOUNTING: ConfigRecord(facts)})
        return Message(content=content, reply_to=first)


def test_a_site_that_never_replies_is_charged_unconfirmed_and_the_round_goes_on(tmp_path):
    import torch
    from flwr.app import ArrayRecord
    from flwr.supercore.task_identity import TaskIdentity
    from strategy_helpers import strategy_for

    from prism_runtime.protocol import key

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    g = torch.Generator().manual_seed(0)
    glob = {
        key("m", "A"): torch.randn(6, 2, generator=g),
        key("m", "B"): torch.randn(5, 2, generator=g),
    }
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = strategy_for(modules=["m"], ledger=ledger, run_id="r", sites_per_round=2)
        shapes = {key("m", "dA"): (6, 2), key("m", "dB"): (5, 2)}
        result = strategy.start(
            _HalfGrid([7, 8], shapes), ArrayRecord(glob), num_rounds=1, timeout=0.2
        )
        (summary,) = strategy.summaries
        assert summary.accepted == ["alive"] and summary.applied
        assert summary.rejected == [("node-8", "no reply before the round timeout")]
        assert dict(result.train_metrics_clientapp[1])["sites-accepted"] == 1
        assert dict(result.train_metrics_clientapp[1])["sites-unconfirmed"] == 1
        # node 8 never answered, so its site is unknown: charged as node-8, parameters unknown
        assert summary.unconfirmed == ["node-8"]
        alive, silent = ledger.events()
        assert (alive.site_id, alive.confirmed, alive.rng) == ("alive", True, "os-csprng")
        assert (silent.site_id, silent.round, silent.steps) == ("node-8", 1, 2)
        assert (silent.confirmed, silent.params_known, silent.code) == (False, False, "no-reply")
        assert ledger.epsilon("node-8").prv == float("inf")  # unknown: the worst case


def test_can_run_before_a_round_ignores_that_rounds_events(tmp_path):
    from prism_core.accounting import PrivacyEvent, epsilon
    from server.ledger import LedgerEvent

    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        for r in (1, 2):
            ledger.append(LedgerEvent("run", r, "s", PrivacyEvent(1.0, 0.1, 5), 1e-5))
        ask = dict(
            sigma=1.0,
            q=0.1,
            steps=5,
            epsilon_cap=epsilon([PrivacyEvent(1.0, 0.1, 10)], 1e-5) * 1.001,
            delta=1e-5,
        )
        assert not ledger.can_run("s", **ask)  # two rounds on the books: a third does not fit
        assert ledger.can_run("s", **ask, before=("run", 2))  # re-running round 2 as at first
        assert not ledger.can_run("s", **ask, before=("other-run", 2))
        # Re-recording an identical event is idempotent; a different one is refused.
        assert not ledger.append(LedgerEvent("run", 2, "s", PrivacyEvent(1.0, 0.1, 5), 1e-5))
        with pytest.raises(LedgerError, match="different record"):
            ledger.append(LedgerEvent("run", 2, "s", PrivacyEvent(1.0, 0.1, 4), 1e-5))
        assert len(ledger.events()) == 2
