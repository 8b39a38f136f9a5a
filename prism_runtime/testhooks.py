"""Named pause points for crash tests (inactive unless an environment variable names them).

``PRISM_FL_PAUSE_AT="<point>@<round>[,...]"`` makes the process that reaches one of those points
write its pid and the point to the file ``PRISM_FL_PAUSE_FILE`` and then sleep, so a test can
SIGKILL it exactly there; ``PRISM_FL_PAUSE_AT="file:PATH"`` reads that list from PATH at every
pause point instead (for processes started by a long-lived parent such as the SuperLink).
Without the variable a pause point costs one dictionary lookup.
Points: coordinator ``round-start``, ``mid-aggregation``, ``ledger-write`` (inside the ledger's
write transaction), ``before-checkpoint``, ``mid-checkpoint`` (temporary file durable, not yet
renamed), ``after-checkpoint``; site ``site-training`` (charged, training not finished).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

__all__ = ["PAUSE_AT_ENV", "PAUSE_FILE_ENV", "pause_point"]

log = logging.getLogger(__name__)

PAUSE_AT_ENV = "PRISM_FL_PAUSE_AT"
PAUSE_FILE_ENV = "PRISM_FL_PAUSE_FILE"
MAX_PAUSE_S = 600.0


def pause_point(name: str, server_round: int) -> None:
    """Pause here if ``PRISM_FL_PAUSE_AT`` names ``<name>@<server_round>`` (tests only)."""
    spec = os.environ.get(PAUSE_AT_ENV)
    if spec and spec.startswith("file:"):  # a long-lived parent (SuperLink): read it each time
        control = Path(spec[5:])
        spec = control.read_text().strip() if control.exists() else ""
    if not spec or f"{name}@{server_round}" not in spec.split(","):
        return
    target = os.environ.get(PAUSE_FILE_ENV)
    if not target:
        raise RuntimeError(f"{PAUSE_AT_ENV} is set but {PAUSE_FILE_ENV} is not")
    path = Path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "point": name, "round": server_round}))
    os.replace(tmp, path)
    log.warning("test pause point %s@%d reached (pid %d)", name, server_round, os.getpid())
    time.sleep(MAX_PAUSE_S)
    raise SystemExit(f"pause point {name}@{server_round}: not killed within {MAX_PAUSE_S} s")
