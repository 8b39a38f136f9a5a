"""Fault injection is an explicit object: a no-op by default, never read from the environment by
the components it stops (prism_runtime.faults)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from prism_core.records import PrivacyEvent
from prism_runtime.faults import (
    NO_FAULTS,
    PAUSE_AT_ENV,
    PAUSE_FILE_ENV,
    Faults,
    PausePoints,
    faults_from_env,
)
from server.checkpoint import CHECKPOINT, Checkpoint, load_checkpoint, save_checkpoint
from server.ledger import Ledger, LedgerEvent


class SimulatedCrashError(Exception):
    """Raised by ``StopAt`` where a crash test would SIGKILL the process."""


class StopAt(Faults):
    """Records every crash point reached; raises ``SimulatedCrashError`` at one (point, round)."""

    def __init__(self, point: str, server_round: int) -> None:
        self.at = (point, server_round)
        self.reached: list[tuple[str, int]] = []

    def reach(self, point: str, server_round: int) -> None:
        self.reached.append((point, server_round))
        if (point, server_round) == self.at:
            raise SimulatedCrashError(f"{point}@{server_round}")


def event(rnd: int) -> LedgerEvent:
    return LedgerEvent(
        run_id="run-1", round=rnd, site_id="a", event=PrivacyEvent(1.0, 0.01, 10), delta=1e-5
    )


def checkpoint(rnd: int) -> Checkpoint:
    return Checkpoint(
        server_round=rnd,
        arrays={"w": torch.full((2,), float(rnd))},
        run_config={"seed": 0},
        strategy={},
        round_state={},
    )


def test_faults_from_env_is_a_no_op_unless_a_test_sets_it() -> None:
    assert faults_from_env({}) is NO_FAULTS
    assert faults_from_env({PAUSE_AT_ENV: ""}) is NO_FAULTS
    NO_FAULTS.reach("ledger-write", 1)  # does nothing, returns


def test_faults_from_env_builds_pause_points_and_refuses_a_missing_pause_file(
    tmp_path: Path,
) -> None:
    faults = faults_from_env({PAUSE_AT_ENV: "round-start@2", PAUSE_FILE_ENV: str(tmp_path / "p")})
    assert faults == PausePoints(spec="round-start@2", pause_file=tmp_path / "p")
    with pytest.raises(RuntimeError, match=PAUSE_FILE_ENV):
        faults_from_env({PAUSE_AT_ENV: "round-start@2"})


def test_pause_points_ignore_other_points_and_rounds_and_read_a_control_file(
    tmp_path: Path,
) -> None:
    pause = tmp_path / "paused.json"
    PausePoints(spec="round-start@2,ledger-write@3", pause_file=pause).reach("round-start", 3)
    control = tmp_path / "control.txt"
    from_file = PausePoints(spec=f"file:{control}", pause_file=pause)
    from_file.reach("round-start", 2)  # no control file yet: nothing to pause at
    control.write_text("mid-aggregation@1\n")
    from_file.reach("round-start", 2)
    assert not pause.exists()


def test_components_never_read_the_pause_variables_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the variables set but no fault object passed, the ledger write and the checkpoint
    run through their crash points (a pause would sleep 600 s and write the pause file)."""
    pause = tmp_path / "paused.json"
    monkeypatch.setenv(PAUSE_AT_ENV, "ledger-write@1,mid-checkpoint@1")
    monkeypatch.setenv(PAUSE_FILE_ENV, str(pause))
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        assert ledger.append(event(1))
    save_checkpoint(tmp_path, checkpoint(1))
    assert not pause.exists()
    assert os.environ[PAUSE_AT_ENV]  # still set: nothing consumed it


def test_a_fault_inside_the_ledger_write_stores_nothing(tmp_path: Path) -> None:
    """The object passed in is the one consulted, inside the write transaction: a crash there
    leaves exactly the earlier rounds' events."""
    path = tmp_path / "ledger.sqlite"
    faults = StopAt("ledger-write", 2)
    with Ledger.open(path, faults=faults) as ledger:
        assert ledger.append(event(1))
        with pytest.raises(SimulatedCrashError):
            ledger.append(event(2))
    assert faults.reached == [("ledger-write", 1), ("ledger-write", 2)]
    with Ledger.open(path, create=False, read_only=True) as ledger:
        assert [e.round for e in ledger.events()] == [1]


def test_a_fault_mid_checkpoint_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    faults = StopAt("mid-checkpoint", 2)
    save_checkpoint(tmp_path, checkpoint(1), faults=faults)
    with pytest.raises(SimulatedCrashError):
        save_checkpoint(tmp_path, checkpoint(2), faults=faults)
    assert faults.reached == [("mid-checkpoint", 1), ("mid-checkpoint", 2)]
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded.server_round == 1
    assert torch.equal(loaded.arrays["w"], torch.full((2,), 1.0))
    assert (tmp_path / CHECKPOINT).exists()
