"""One ConfigError class on both sides: the coordinator's CLI reports a bad setting raised by the
shared runtime (model loading, data, run config) like its own, never as a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_runtime import errors as runtime_errors
from server import errors as server_errors
from server.cli import EXIT_USAGE, main


def test_the_coordinator_and_the_runtime_share_one_config_error() -> None:
    assert server_errors.ConfigError is runtime_errors.ConfigError
    assert issubclass(server_errors.ConfigError, ValueError)


def test_a_runtime_config_error_in_a_command_is_a_clean_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A handler that raises the runtime's ConfigError exits with the usage status and the
    message, whatever subcommand raised it."""
    import server.cli as cli

    def bad(_args: object) -> int:
        raise runtime_errors.ConfigError("run config max-norm=-1: use a number > 0")

    monkeypatch.setattr(cli, "_report", bad)
    ledger = tmp_path / "ledger.sqlite"
    code = main(["report", "--ledger", str(ledger), "--out", str(tmp_path / "out")])
    assert code == EXIT_USAGE
    assert "max-norm=-1: use a number > 0" in capsys.readouterr().err
