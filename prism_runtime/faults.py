"""Fault injection for crash tests: an explicit object passed in, a no-op in production.

Product code never reads the environment for this. Each component that has a crash point
(the coordinator's round loop, ledger, checkpoint and round end; the site's training) takes a
``Faults`` argument that defaults to ``NO_FAULTS``, whose ``reach`` does nothing. Only the two
process entry points, the ServerApp's ``main`` and the ClientApp (and the test drivers that stand
in for them), build the object, with ``faults_from_env``: a crash test sets ``PRISM_FL_PAUSE_AT``
in the environment of processes it cannot construct itself (a SuperLink's ServerApp, a
SuperNode's ClientApp).

``PRISM_FL_PAUSE_AT="<point>@<round>[,...]"`` makes the process that reaches one of those points
write its pid and the point to the file ``PRISM_FL_PAUSE_FILE`` and then sleep, so a test can
SIGKILL it exactly there; ``PRISM_FL_PAUSE_AT="file:PATH"`` reads that list from PATH at every
point instead (for processes started by a long-lived parent such as the SuperLink).
Points: coordinator ``round-start``, ``mid-aggregation``, ``ledger-write`` (inside the ledger's
write transaction), ``before-checkpoint``, ``mid-checkpoint`` (temporary file durable, not yet
renamed), ``after-checkpoint``; site ``site-training`` (charged, training not finished).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NO_FAULTS",
    "PAUSE_AT_ENV",
    "PAUSE_FILE_ENV",
    "Faults",
    "PausePoints",
    "faults_from_env",
]

log = logging.getLogger(__name__)

PAUSE_AT_ENV = "PRISM_FL_PAUSE_AT"
PAUSE_FILE_ENV = "PRISM_FL_PAUSE_FILE"
MAX_PAUSE_S = 600.0


class Faults:
    """Where a test may stop this process; this base class (``NO_FAULTS``) never does."""

    def reach(self, point: str, server_round: int) -> None:
        """Called at the named crash point of ``server_round``; a no-op here."""


NO_FAULTS = Faults()
"""Production: no crash point does anything."""


@dataclass(frozen=True)
class PausePoints(Faults):
    """Pause at ``<point>@<round>`` entries of ``spec`` so a test can SIGKILL the process there.

    ``spec`` is a comma-separated list, or ``file:PATH`` to read that list from PATH at every
    point (a long-lived parent's children see the current list). ``pause_file`` receives
    ``{"pid", "point", "round"}`` (atomically) when a point is reached.
    """

    spec: str
    pause_file: Path

    def _points(self) -> list[str]:
        if not self.spec.startswith("file:"):
            return self.spec.split(",")
        control = Path(self.spec[5:])
        return control.read_text().strip().split(",") if control.exists() else []

    def reach(self, point: str, server_round: int) -> None:
        if f"{point}@{server_round}" not in self._points():
            return
        path = self.pause_file
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "point": point, "round": server_round}))
        os.replace(tmp, path)
        log.warning("test pause point %s@%d reached (pid %d)", point, server_round, os.getpid())
        time.sleep(MAX_PAUSE_S)
        raise SystemExit(f"pause point {point}@{server_round}: not killed within {MAX_PAUSE_S} s")


def faults_from_env(environ: Mapping[str, str] = os.environ) -> Faults:
    """The entry points' fault object: ``PausePoints`` if ``PRISM_FL_PAUSE_AT`` is set, else none.

    Raises:
        RuntimeError: ``PRISM_FL_PAUSE_AT`` is set without ``PRISM_FL_PAUSE_FILE`` (a test's
            mistake: the pause could never be observed).
    """
    spec = environ.get(PAUSE_AT_ENV)
    if not spec:
        return NO_FAULTS
    target = environ.get(PAUSE_FILE_ENV)
    if not target:
        raise RuntimeError(f"{PAUSE_AT_ENV} is set but {PAUSE_FILE_ENV} is not")
    return PausePoints(spec=spec, pause_file=Path(target))
