"""Fixtures every coordinator test shares."""

from __future__ import annotations

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def _flower_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The task identity Flower's messages read outside a running app (restored afterwards),
    and no site secret inherited from the environment (sites draw from the OS)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.delenv("PRISM_FL_RNG_SECRET", raising=False)
