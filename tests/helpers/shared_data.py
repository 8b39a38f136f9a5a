"""The public data folder of the tests and the benchmarks: ``PRISM_DATA_DIR``, or
``../shared/data`` next to the checkout. A relative ``PRISM_DATA_DIR`` is read from the checkout's
root, never from the working directory. The benchmarks (bench/*.py) import this module as
``tests.helpers.shared_data``."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "PRISM_DATA_DIR"
ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = (ROOT / os.environ.get(DATA_DIR_ENV, "../shared/data")).resolve()
"""The data folder: ``PRISM_DATA_DIR`` (relative to the checkout's root) or ``../shared/data``."""


def shared_data_file(relative: str) -> Path:
    """A file of the shared data folder (``SHARED_DATA``); the calling test is SKIPPED, with the
    path it looked for, when the folder or file is not there."""
    import pytest

    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(f"shared test data {path} not found (set {DATA_DIR_ENV} or add ../shared/data)")
    return path
