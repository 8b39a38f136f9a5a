"""``prism-fl audit``: the privacy self-audit of a ledger and of the mechanism that trains.

Three parts (issue 7, part 5), each in its own module:

- ``accountants``: every site's epsilon by PRV, RDP and an independent PLD implementation
  (Google's ``dp_accounting``), against each other and the site's cap;
- ``replay``: record/replay checks of one real PRISM step (sensitivity with the global clip,
  noise independent of the realised batch, noise scale sigma C / b);
- ``canary``: an empirical lower bound on epsilon from one run with canaries (Steinke, Nasr,
  Jagielski 2023), next to the claimed epsilon.

``mechanisms`` holds deliberately broken variants that the audit must catch (self-test).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.audit.accountants import SiteCheck, check_ledger
from server.audit.canary import CanaryResult, CanarySettings, run_canary_audit
from server.audit.mechanisms import BROKEN, CORRECT, Mechanism, mechanism_by_name
from server.audit.replay import MechanismCheck, ReplaySettings, run_replay_checks
from server.ledger import Ledger

__all__ = [
    "BROKEN",
    "CORRECT",
    "AuditReport",
    "CanarySettings",
    "Mechanism",
    "ReplaySettings",
    "format_audit",
    "mechanism_by_name",
    "run_audit",
    "write_audit",
]


@dataclass(frozen=True)
class AuditReport:
    """Everything the audit found. ``passed`` is True only if every check passed."""

    ledger: str
    mechanism: str
    sites: list[SiteCheck]
    checks: list[MechanismCheck]
    canary: CanaryResult
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            all(s.passed for s in self.sites)
            and all(c.passed for c in self.checks)
            and self.canary.passed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger,
            "mechanism": self.mechanism,
            "verdict": "pass" if self.passed else "FAIL",
            "accountants": [s.to_json() for s in self.sites],
            "mechanism_checks": [c.to_json() for c in self.checks],
            "canary": self.canary.to_json(),
            "notes": self.notes,
        }


def run_audit(
    ledger_path: str | os.PathLike[str],
    *,
    mechanism: Mechanism = CORRECT,
    replay: ReplaySettings | None = None,
    canary: CanarySettings | None = None,
) -> AuditReport:
    """Audit the ledger (opened read-only, never modified) and ``mechanism``.

    Raises:
        server.errors.LedgerError: a missing, corrupt or foreign ledger (left unchanged).
    """
    with Ledger.open(ledger_path, create=False, read_only=True) as ledger:
        sites = check_ledger(ledger)
    notes = []
    if not sites:
        notes.append("the ledger has no events: no site to cross-check")
    if mechanism is not CORRECT:
        notes.append(
            f"SELF-TEST: the mechanism checks ran the deliberately broken variant "
            f"{mechanism.name!r}, not the mechanism that trains; they are expected to FAIL"
        )
    return AuditReport(
        ledger=str(ledger_path),
        mechanism=mechanism.name,
        sites=sites,
        checks=run_replay_checks(replay or ReplaySettings(), mechanism),
        canary=run_canary_audit(canary or CanarySettings(), mechanism),
        notes=notes,
    )


def _eps(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return out


def format_audit(report: AuditReport) -> str:
    """The audit as plain-text tables (accountants, mechanism checks, canary bound)."""
    lines = [f"privacy self-audit of {report.ledger} (mechanism: {report.mechanism})", ""]
    lines.append("(a) accountants per site (epsilon at the site's delta)")
    rows = [
        [
            s.site_id,
            str(s.steps),
            f"{s.delta:g}",
            "-" if s.epsilon_cap is None else f"{s.epsilon_cap:g}",
            _eps(s.prv),
            _eps(s.rdp),
            _eps(s.pld),
            s.verdict + (f": {'; '.join(s.reasons)}" if s.reasons else ""),
        ]
        for s in report.sites
    ]
    header = ["site", "steps", "delta", "cap", "PRV (claimed)", "RDP", "PLD (dp_accounting)"]
    lines += _table([*header, "verdict"], rows) if rows else ["  (no sites)"]
    lines += ["", "(b) mechanism record/replay (one real PRISM step, tiny BERT)"]
    rows = [[c.name, f"{c.measured:.5g}", c.bound, c.verdict] for c in report.checks]
    lines += _table(["check", "measured", "bound", "verdict"], rows)
    lines += [f"  {c.name}: {c.detail}" for c in report.checks]
    c = report.canary
    lines += ["", "(c) one-run canary audit (Steinke, Nasr, Jagielski 2023)"]
    lines += _table(
        [
            "canaries",
            "guesses",
            "correct",
            "confidence",
            "eps lower bound",
            "claimed eps",
            "verdict",
        ],
        [
            [
                str(c.canaries),
                str(c.guesses),
                str(c.correct),
                f"{c.confidence:g}",
                f"{c.lower_bound:.3f}",
                f"{c.claimed_epsilon:.3f}",
                c.verdict,
            ]
        ],
    )
    lines.append(
        f"  claimed: PRV epsilon of {c.steps} un-subsampled Gaussian step(s), sigma="
        f"{c.noise_multiplier:g}, delta={c.delta:g}; a correct mechanism gives bound <= claimed"
    )
    lines += ["", *(f"note: {n}" for n in report.notes)] if report.notes else []
    lines += ["", f"verdict: {'PASS' if report.passed else 'FAIL'}"]
    return "\n".join(lines)


def write_audit(report: AuditReport, out: str | os.PathLike[str]) -> Path:
    """Write ``audit.json`` into the folder ``out`` (created if missing); returns its path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "audit.json"
    tmp = folder / f".audit.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(report.to_json(), indent=2, allow_nan=False) + "\n")
    tmp.replace(path)
    return path
