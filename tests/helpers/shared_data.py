"""Test helper: files of the public data folder ``../shared/data`` next to the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def shared_data_file(relative: str) -> Path:
    """A file of the shared data folder (``../shared/data`` next to the checkout); the calling
    test is SKIPPED, with the path it looked for, when the folder or file is not there."""
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(f"shared test data {path} not found (a checkout without ../shared/data)")
    return path
