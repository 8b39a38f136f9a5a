"""Fixtures of the ledger tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.ledger import Ledger


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led
