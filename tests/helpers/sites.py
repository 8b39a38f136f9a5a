"""The run and node configs of a tiny simulated site, shared by the site and coordinator tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prism_runtime.config import RunConfig, SiteConfig, parse_config

TINY_RUN: dict[str, Any] = {
    "lora-rank": 4,
    "local-steps": 2,
    "batch-size": 16,
    "micro-batch-size": 8,
    "synthetic-examples": 64,
    "max-length": 24,
    "noise-multiplier": 1.0,
    "target-epsilon": 50.0,
}
"""A run small enough for a tiny BERT on the built-in task: two steps of an expected 16 rows."""


def tiny_run_config(model: str, **overrides: Any) -> RunConfig:
    """``TINY_RUN`` on ``model``, with ``overrides`` (run-config keys) replacing its values."""
    return parse_config(RunConfig, {"model": model, **TINY_RUN, **overrides}, what="run config")


def simulated_node(tmp_path: Path, **node: Any) -> SiteConfig:
    """Simulated site 0 of 3 with its state in ``tmp_path / "state"`` and a cap of 50; a key
    given as None is left out."""
    values = {
        "partition-id": 0,
        "num-partitions": 3,
        "state-dir": str(tmp_path / "state"),
        "epsilon-cap": 50.0,
        **node,
    }
    kept = {k: v for k, v in values.items() if v is not None}
    return parse_config(SiteConfig, kept, what="node config")
