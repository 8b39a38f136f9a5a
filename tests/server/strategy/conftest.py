"""Fixtures of the strategy's tests."""

from __future__ import annotations

import pytest

import server.strategy.loop as loop
import server.strategy.transport as transport
from strategy.clocked import Clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(loop, "time", fake)
    monkeypatch.setattr(transport, "time", fake)
    return fake
