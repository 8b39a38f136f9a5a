"""Audit part (0): was the run private at all? Its configuration and the sites' facts.

The accountants (a) and the mechanism checks (b, c) test that the noise which ran matches what
the ledger claims. They cannot see a run that was set up not to be private, so this part reads
what the run was asked to do and what the sites said they did, and fails the audit on any of:

- run config ``method = nondp``: no noise at all;
- run config ``report-train-loss = true``: sites send their un-noised training loss;
- run config ``noise-multiplier = 0``: no noise;
- a fact ``rng = reproducible`` (``prism_runtime.protocol.RNG_REPRODUCIBLE``): the site's sampling,
  dropout and noise came from a seed, not the OS CSPRNG, so they are not private against whoever
  can learn or replay that seed;
- a fact ``mechanism = none`` or ``sigma = 0`` for steps that ran: a non-private step.

Sources read, all read-only: the run configs the coordinator recorded in the ledger
(``Ledger.runs()``), ``run-config.json`` in the ledger's folder (the run folder layout of
``server.federation``), the ledger's events as facts (mechanism, sigma, steps), and any
accounting facts given to ``check_run`` (the facts sites reported, ``ACCOUNTING_KEYS``; for the
coordinator's fact store once it keeps one).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prism_runtime.protocol import RNG, RNG_REPRODUCIBLE
from server.ledger import Ledger

__all__ = [
    "RUN_CONFIG_FILE",
    "RunCheck",
    "RunFinding",
    "check_run",
    "config_findings",
    "fact_findings",
]

RUN_CONFIG_FILE = "run-config.json"
"""The run folder's copy of the run config, next to ``ledger.sqlite``."""

NONPRIVATE_METHOD = "nondp"
NONPRIVATE_MECHANISM = "none"


@dataclass(frozen=True)
class RunFinding:
    """One reason the run is not private: where it was found, about what, and why it matters."""

    source: str
    subject: str
    key: str
    value: str
    reason: str

    def line(self) -> str:
        return f"{self.subject}: {self.key} = {self.value} ({self.source}): {self.reason}"


@dataclass(frozen=True)
class RunCheck:
    """What part (0) read (``sources``) and found; ``passed`` when nothing was found."""

    sources: list[str]
    findings: list[RunFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "findings": [asdict(f) for f in self.findings],
            "notes": self.notes,
            "verdict": "pass" if self.passed else "FAIL",
        }


def _get(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]`` by its kebab-case name or its snake_case field name; None if absent."""
    if key in config:
        return config[key]
    return config.get(key.replace("-", "_"))


def _is_zero(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def config_findings(config: Mapping[str, Any], *, source: str, subject: str) -> list[RunFinding]:
    """Non-private settings in one run config (kebab-case keys, as ``RunConfig`` dumps them)."""
    found = []
    method = _get(config, "method")
    if method == NONPRIVATE_METHOD:
        found.append(("method", method, "the run trains without differential privacy"))
    loss = _get(config, "report-train-loss")
    if loss is True:
        found.append(("report-train-loss", loss, "sites send their un-noised training loss"))
    sigma = _get(config, "noise-multiplier")
    if _is_zero(sigma):
        found.append(("noise-multiplier", sigma, "no noise: epsilon is infinite"))
    rng = _get(config, RNG)
    if rng == RNG_REPRODUCIBLE:
        found.append((RNG, rng, "seeded randomness is not private against the seed's holders"))
    return [RunFinding(source, subject, k, json.dumps(v), why) for k, v, why in found]


def fact_findings(facts: Iterable[Mapping[str, Any]], *, source: str) -> list[RunFinding]:
    """Non-private facts reported by sites (``ACCOUNTING_KEYS``), one finding per site and kind."""
    out: dict[tuple[str, str, str], RunFinding] = {}
    for fact in facts:
        subject = f"site {fact.get('site-id', '?')}"
        ran = fact.get("steps", 1)
        found = []
        if fact.get(RNG) == RNG_REPRODUCIBLE:
            why = "its sampling, dropout and noise came from a seed, not the OS CSPRNG"
            found.append((RNG, fact[RNG], why))
        if fact.get("mechanism") == NONPRIVATE_MECHANISM and ran:
            found.append(("mechanism", fact["mechanism"], "it ran steps without DP noise"))
        if _is_zero(fact.get("sigma")) and ran:
            found.append(("sigma", fact["sigma"], "it ran steps without noise"))
        for key, value, why in found:
            text = json.dumps(value)
            out.setdefault((subject, key, text), RunFinding(source, subject, key, text, why))
    return list(out.values())


def _event_facts(ledger: Ledger) -> list[dict[str, Any]]:
    return [
        {"site-id": e.site_id, "mechanism": e.mechanism, "sigma": e.sigma, "steps": e.steps}
        for e in ledger.events()
    ]


def _folder_config(path: Path) -> list[RunFinding]:
    """Findings of ``run-config.json``; an unreadable file is itself a finding."""
    where = str(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = f"cannot be read ({exc}); the run's settings cannot be checked"
        return [RunFinding(where, "run folder", RUN_CONFIG_FILE, "unreadable", why)]
    if not isinstance(config, dict):
        why = "is not a JSON object; the run's settings cannot be checked"
        return [RunFinding(where, "run folder", RUN_CONFIG_FILE, "not an object", why)]
    return config_findings(config, source=where, subject="run folder")


def check_run(
    ledger: Ledger,
    *,
    run_config: Path | None = None,
    facts: Iterable[Mapping[str, Any]] = (),
) -> RunCheck:
    """Part (0) on an open ledger, the run folder's config file and reported facts.

    Args:
        ledger: the ledger (read only).
        run_config: a ``run-config.json`` to check too (None: none).
        facts: accounting facts reported by sites, as dicts with ``ACCOUNTING_KEYS``.
    """
    sources, findings, notes = [], [], []
    runs = ledger.runs()
    for run in runs:
        findings += config_findings(
            run.config, source="ledger run config", subject=f"run {run.run_id}"
        )
    sources.append(f"{len(runs)} run config(s) recorded in the ledger")
    if run_config is not None:
        findings += _folder_config(run_config)
        sources.append(str(run_config))
    events = _event_facts(ledger)
    findings += fact_findings(events, source="ledger events")
    sources.append(f"{len(events)} ledger event(s)")
    given = list(facts)
    if given:
        findings += fact_findings(given, source="site facts")
        sources.append(f"{len(given)} reported fact record(s)")
    if not runs and run_config is None:
        notes.append(
            "no run configuration found (none recorded in the ledger, no run-config.json beside "
            "it): the run's settings were not checked, only the ledger's events"
        )
    return RunCheck(sources, findings, notes)
