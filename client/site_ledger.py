"""A site's own durable privacy ledger: every private step it runs, charged BEFORE it runs.

An append-only JSON-lines file in the site's state folder, flushed and fsync'ed per entry, so a
crash mid-round still leaves the charge on disk and a restarted site never forgets spent budget.
Epsilon is always recomputed from the entries (``prism_core.accounting``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from client.errors import ConfigError
from prism_core.accounting import PrivacyEvent, epsilon

__all__ = ["SiteLedger", "SiteLedgerEntry"]


@dataclass(frozen=True)
class SiteLedgerEntry:
    """One charge: ``steps`` subsampled-Gaussian steps of a round."""

    server_round: int
    mechanism: str
    sigma: float
    q: float
    steps: int
    delta: float

    def event(self) -> PrivacyEvent:
        return PrivacyEvent(self.sigma, self.q, self.steps)


class SiteLedger:
    """Append-only site-local ledger at ``<state_dir>/privacy-ledger.jsonl``."""

    FILE = "privacy-ledger.jsonl"

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / self.FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._entries = self._read()

    def _read(self) -> list[SiteLedgerEntry]:
        if not self.path.exists():
            return []
        entries = []
        with self.path.open() as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    entries.append(SiteLedgerEntry(**json.loads(line)))
                except (json.JSONDecodeError, TypeError) as exc:
                    raise ConfigError(
                        f"{self.path}, line {number}: not a prism-fl site ledger entry ({exc}); "
                        "restore the file from backup: budget already spent must not be lost"
                    ) from exc
        return entries

    def reload(self) -> None:
        """Re-read the file (another process of this site may have charged it)."""
        self._entries = self._read()

    def entries(self) -> list[SiteLedgerEntry]:
        return list(self._entries)

    def events(self) -> list[PrivacyEvent]:
        return [e.event() for e in self._entries if e.steps > 0]

    def charge(self, entry: SiteLedgerEntry) -> None:
        """Append and fsync one entry before the steps it describes run."""
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(entry), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._entries.append(entry)

    def epsilon(self, delta: float) -> float:
        return epsilon(self.events(), delta)
