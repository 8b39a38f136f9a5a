"""``prism-fl audit``: the privacy self-audit of a ledger and of the mechanism that trains.

Four parts, each in its own module:

- ``runs`` (0): was the run private at all, and within the accepted ranges? The run configs
  recorded in the ledger, the run folder's ``run-config.json`` and the sites' facts:
  ``method = nondp``, ``report-train-loss = true``, ``noise-multiplier = 0``,
  ``rng = reproducible`` fail the audit, and so do a run config the current ``RunConfig``
  refuses and a sigma, clip, step count or round outside ``prism_runtime.ranges``;
- ``accountants`` (a): every site's epsilon by PRV, RDP and an independent PLD implementation
  (Google's ``dp_accounting``), against each other and the site's cap;
- ``replay`` (b): record/replay checks of one real PRISM step through the trainer's release path
  (sensitivity with the global clip, noise independent of the realised batch, noise std
  sigma C / b in every block of the released space: core, A-perp, B-perp, head, pooled);
- ``canary`` (c): canaries with a known clipped signal through the production clip path: an
  empirical lower bound on epsilon from one run (Steinke, Nasr, Jagielski 2023) next to the
  claimed epsilon, and per-block tests of the noise left after subtracting the signal, with the
  smallest noise shortfall they detect.

``mechanisms`` holds deliberately broken variants that the audit must catch (self-test);
``blocks`` the block decomposition and the chi-square variance test with its power.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.audit.accountants import SiteCheck, check_ledger
from server.audit.blocks import POWER
from server.audit.canary import CanaryResult, CanarySettings, run_canary_audit
from server.audit.mechanisms import BROKEN, CORRECT, Mechanism, mechanism_by_name
from server.audit.replay import MechanismCheck, ReplaySettings, run_replay_checks
from server.audit.runs import RUN_CONFIG_FILE, RunCheck, check_run
from server.ledger import Ledger

__all__ = [
    "BROKEN",
    "CORRECT",
    "AuditReport",
    "CanarySettings",
    "Mechanism",
    "ReplaySettings",
    "RunCheck",
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
    run: RunCheck = field(default_factory=lambda: RunCheck([]))

    @property
    def passed(self) -> bool:
        return not self.reasons()

    def reasons(self) -> list[str]:
        """One line per failed check, saying why (empty when the audit passed)."""
        out = [f"{f.kind} run: {f.line()}" for f in self.run.findings]
        out += [f"site {s.site_id}: {'; '.join(s.reasons)}" for s in self.sites if not s.passed]
        out += [
            f"mechanism check failed: {m.name}: measured {m.measured:.4g}, bound {m.bound}"
            for m in self.checks
            if not m.passed
        ]
        c = self.canary
        if not c.bound_passed:
            out.append(
                f"canary lower bound {c.lower_bound:.3f} exceeds the claimed epsilon "
                f"{c.claimed_epsilon:.3f}"
            )
        out += [
            f"canary noise, {t.name}: std / claimed = {t.measured:.4f}, outside "
            f"[{t.lo:.4f}, {t.hi:.4f}]"
            for t in c.noise_tests
            if not t.passed
        ]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger,
            "mechanism": self.mechanism,
            "verdict": "pass" if self.passed else "FAIL",
            "reasons": self.reasons(),
            "run": self.run.to_json(),
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
    run_config: str | os.PathLike[str] | None = None,
    facts: Iterable[Mapping[str, Any]] = (),
) -> AuditReport:
    """Audit the ledger (opened read-only, never modified), the run and ``mechanism``.

    Args:
        ledger_path: the ledger.
        mechanism: ``CORRECT`` or a deliberately broken variant (self-test).
        replay: settings of the record/replay checks.
        canary: settings of the canary audit.
        run_config: the run's ``run-config.json``; None: ``run-config.json`` in the ledger's
            folder if there is one (the run folder layout).
        facts: accounting facts the sites reported, if the caller has them.

    Raises:
        server.errors.LedgerError: a missing, corrupt or foreign ledger (left unchanged).
    """
    config_path = Path(run_config) if run_config is not None else None
    if config_path is None and (Path(ledger_path).parent / RUN_CONFIG_FILE).is_file():
        config_path = Path(ledger_path).parent / RUN_CONFIG_FILE
    with Ledger.open(ledger_path, create=False, read_only=True) as ledger:
        sites = check_ledger(ledger)
        run = check_run(ledger, run_config=config_path, facts=facts)
    notes = list(run.notes)
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
        run=run,
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


def _run_lines(run: RunCheck) -> list[str]:
    lines = [
        "(0) run configuration and site facts: is the run private at all, and within the "
        "accepted ranges?"
    ]
    lines += [f"  read: {source}" for source in run.sources]
    lines += [f"  FAIL ({f.kind}) {f.line()}" for f in run.findings]
    if run.passed:
        lines.append(
            "  pass: no non-private setting or fact found, and every setting and fact lies in "
            "its accepted range"
        )
    return lines


def _canary_lines(c: CanaryResult) -> list[str]:
    lines = ["(c) canaries with a known clipped signal, one run (production clip path)"]
    lines += _table(
        ["canaries", "guesses", "correct", "confidence", "eps lower bound", "claimed eps"],
        [
            [
                str(c.canaries),
                str(c.guesses),
                str(c.correct),
                f"{c.confidence:g}",
                f"{c.lower_bound:.3f}",
                f"{c.claimed_epsilon:.3f}",
            ]
        ],
    )
    lines.append(
        f"  claimed: PRV epsilon of {c.steps} un-subsampled Gaussian step(s), sigma="
        f"{c.noise_multiplier:g}, delta={c.delta:g}; a correct mechanism gives bound <= claimed "
        f"({'pass' if c.bound_passed else 'FAIL'})"
    )
    rows = [
        [
            t.name,
            str(t.dof),
            f"{t.measured:.4f}",
            f"[{t.lo:.4f}, {t.hi:.4f}]",
            f"{t.detectable:.3f}",
            t.verdict,
        ]
        for t in c.noise_tests
    ]
    header = ["noise block", "coordinates", "std / claimed", "accepted", "detects <=", "verdict"]
    lines += ["", *_table(header, rows)] if rows else []
    if c.noise_tests:
        lines.append(
            f"  noise left after subtracting the known signal; chi-square at confidence "
            f"{c.variance_confidence:g} (Bonferroni over {len(c.noise_tests)} tests). At this "
            f"sample size it detects sigma_true <= {c.detects_any_block:.3f} sigma_claimed in "
            f"any one block and <= {c.detects_all_blocks:.3f} sigma_claimed in all blocks at "
            f"once, each with probability {POWER:g}"
        )
    return lines


def format_audit(report: AuditReport) -> str:
    """The audit as plain text: run check, accountants, mechanism checks, canaries, verdict."""
    lines = [f"privacy self-audit of {report.ledger} (mechanism: {report.mechanism})", ""]
    lines += [*_run_lines(report.run), ""]
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
    lines += ["", "(b) mechanism record/replay (one real PRISM step, tiny BERT, trainer path)"]
    rows = [[c.name, f"{c.measured:.5g}", c.bound, c.verdict] for c in report.checks]
    lines += _table(["check", "measured", "bound", "verdict"], rows)
    lines += [f"  {c.name}: {c.detail}" for c in report.checks]
    lines += ["", *_canary_lines(report.canary)]
    lines += ["", *(f"note: {n}" for n in report.notes)] if report.notes else []
    lines += ["", f"verdict: {'PASS' if report.passed else 'FAIL'}"]
    lines += [f"  why: {reason}" for reason in report.reasons()]
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
