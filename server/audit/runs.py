"""Audit part (0): was the run private at all, and within the accepted ranges? Its
configuration and the sites' facts.

The accountants (a) and the mechanism checks (b, c) test that the noise which ran matches what
the ledger claims. They cannot see a run that was set up not to be private, or with numbers no
site accepts, so this part reads what the run was asked to do and what the sites said they did,
and fails the audit on any of these non-private settings or facts:

- run config ``method = nondp``: no noise at all;
- run config ``report-train-loss = true``: sites send their un-noised training loss;
- run config ``noise-multiplier = 0``: no noise;
- a fact ``rng = reproducible`` (``prism_runtime.protocol.RNG_REPRODUCIBLE``): the site's sampling,
  dropout and noise came from a seed, not the OS CSPRNG, so they are not private against whoever
  can learn or replay that seed;
- a fact ``mechanism = none`` or ``sigma = 0`` for steps that ran: a non-private step;

and on any of these values outside the accepted ranges (``prism_runtime.ranges``):

- a run config the current ``prism_runtime.config.RunConfig`` refuses (an older or a hostile
  one): each refused key with its value and its allowed range, an unknown key, or a rule
  across keys it breaks;
- a fact ``sigma`` other than 0 (reported above) outside ``[SIGMA_MIN, SIGMA_MAX]``, a
  ``quantile-sigma`` outside it, a ``max-norm`` outside ``[MAX_NORM_MIN, MAX_NORM_MAX]``,
  ``steps`` above ``LOCAL_STEPS_MAX`` (``QUANTILE_STEPS_MAX`` for a clip estimate's steps) or a
  round outside ``[1, SERVER_ROUND_MAX]``.

Sources read, all read-only: the run configs the coordinator recorded in the ledger
(``Ledger.runs()``), ``run-config.json`` in the ledger's folder (the run folder layout of
``server.federation``), the ledger's events as facts (mechanism, sigma, steps, round), and any
accounting facts given to ``check_run`` (the records sites reported,
``prism_runtime.facts.ReplyFacts``; for the coordinator's fact store once it keeps one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prism_core.quantile import QUANTILE_MECHANISM
from prism_runtime.config import RunConfig, describe_allowed
from prism_runtime.protocol import RNG, RNG_REPRODUCIBLE, SERVER_ROUND, SITE_ID
from prism_runtime.ranges import (
    LOCAL_STEPS_MAX,
    MAX_NORM_MAX,
    MAX_NORM_MIN,
    QUANTILE_STEPS_MAX,
    SERVER_ROUND_MAX,
    SIGMA_MAX,
    SIGMA_MIN,
)
from server.ledger import Ledger

__all__ = [
    "NONPRIVATE",
    "OUT_OF_RANGE",
    "RUN_CONFIG_FILE",
    "RunCheck",
    "RunFinding",
    "check_run",
    "config_findings",
    "config_range_findings",
    "fact_findings",
    "fact_range_findings",
]

RUN_CONFIG_FILE = "run-config.json"
"""The run folder's copy of the run config, next to ``ledger.sqlite``."""

NONPRIVATE_METHOD = "nondp"
NONPRIVATE_MECHANISM = "none"

NONPRIVATE = "non-private"
"""Kind of a finding that the run, or a step of it, was not private."""
OUT_OF_RANGE = "out-of-range"
"""Kind of a finding of a setting or fact outside the accepted ranges (``prism_runtime.ranges``)."""

_RUN_KEYS = {name.replace("_", "-"): name for name in RunConfig.model_fields}


@dataclass(frozen=True)
class RunFinding:
    """One reason the run fails part (0): where it was found, about what, why it matters, and
    its kind (``NONPRIVATE`` or ``OUT_OF_RANGE``)."""

    source: str
    subject: str
    key: str
    value: str
    reason: str
    kind: str = NONPRIVATE

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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_zero(value: Any) -> bool:
    return _is_number(value) and value == 0


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)


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


def config_range_findings(
    config: Mapping[str, Any], *, source: str, subject: str
) -> list[RunFinding]:
    """What the current ``RunConfig`` refuses in one recorded run config (kebab-case or
    snake_case keys): each key out of its accepted range with the range, each unknown key,
    each rule across keys it breaks. The config is read, never trusted to validate."""
    values = {str(k).replace("_", "-"): v for k, v in config.items()}
    found = []
    for key in sorted(set(values) - set(_RUN_KEYS)):
        found.append(
            (key, _shown(values[key]), "the run config refuses the key: no key of that name exists")
        )
    known = {k: v for k, v in values.items() if k in _RUN_KEYS}
    try:
        RunConfig.model_validate(known)
    except ValidationError as exc:
        for err in exc.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            if not err["loc"]:  # a rule across keys: its message names them and their values
                found.append(("run config", "refused", msg))
                continue
            key = str(err["loc"][0]).replace("_", "-")
            allowed = describe_allowed(RunConfig, _RUN_KEYS[key]) if key in _RUN_KEYS else ""
            hint = f" (allowed: {allowed})" if allowed else ""
            found.append((key, _shown(known.get(key, err.get("input"))), f"{msg}{hint}"))
    unique = dict.fromkeys(found)  # a key refused by several branches of its type: once
    return [RunFinding(source, subject, k, v, why, OUT_OF_RANGE) for k, v, why in unique]


def fact_findings(facts: Iterable[Mapping[str, Any]], *, source: str) -> list[RunFinding]:
    """Non-private facts reported by sites (``ReplyFacts`` records), one finding per site and
    kind."""
    out: dict[tuple[str, str, str], RunFinding] = {}
    for fact in facts:
        subject = f"site {fact.get(SITE_ID, '?')}"
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


def _outside(value: Any, low: float, high: float) -> bool:
    """Not a finite number in ``[low, high]`` (a number outside, or no number at all)."""
    return not (_is_number(value) and math.isfinite(value) and low <= value <= high)


def _range_problems(fact: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """``(key, value, why)`` of each fact of one record outside its accepted range."""
    sigmas = f"[{SIGMA_MIN:g}, {SIGMA_MAX:g}], the noise multipliers a site runs"
    found = []
    sigma = fact.get("sigma")
    if sigma is not None and not _is_zero(sigma) and _outside(sigma, SIGMA_MIN, SIGMA_MAX):
        found.append(("sigma", sigma, f"neither 0 (no noise) nor in {sigmas}"))
    if "quantile-sigma" in fact and _outside(fact["quantile-sigma"], SIGMA_MIN, SIGMA_MAX):
        found.append(("quantile-sigma", fact["quantile-sigma"], f"not in {sigmas}"))
    if "max-norm" in fact and _outside(fact["max-norm"], MAX_NORM_MIN, MAX_NORM_MAX):
        why = f"not in [{MAX_NORM_MIN:g}, {MAX_NORM_MAX:g}], the clips a site runs"
        found.append(("max-norm", fact["max-norm"], why))
    quantile = fact.get("mechanism") == QUANTILE_MECHANISM
    most = QUANTILE_STEPS_MAX if quantile else LOCAL_STEPS_MAX
    if "steps" in fact and _outside(fact["steps"], 0, most):
        what = "a clip estimate's" if quantile else "local"
        found.append(("steps", fact["steps"], f"not in [0, {most}], the {what} steps of a round"))
    if "quantile-steps" in fact and _outside(fact["quantile-steps"], 1, QUANTILE_STEPS_MAX):
        why = f"not in [1, {QUANTILE_STEPS_MAX}], the steps of a clip estimate"
        found.append(("quantile-steps", fact["quantile-steps"], why))
    if SERVER_ROUND in fact and _outside(fact[SERVER_ROUND], 1, SERVER_ROUND_MAX):
        why = f"not in [1, {SERVER_ROUND_MAX}]: the coordinator numbers its rounds from 1"
        found.append((SERVER_ROUND, fact[SERVER_ROUND], why))
    return found


def fact_range_findings(facts: Iterable[Mapping[str, Any]], *, source: str) -> list[RunFinding]:
    """Facts outside their accepted ranges (``prism_runtime.ranges``; a sigma of 0 is reported
    by ``fact_findings``), one finding per site, fact and value."""
    out: dict[tuple[str, str, str], RunFinding] = {}
    for fact in facts:
        subject = f"site {fact.get(SITE_ID, '?')}"
        for key, value, why in _range_problems(fact):
            text = _shown(value)
            finding = RunFinding(source, subject, key, text, why, OUT_OF_RANGE)
            out.setdefault((subject, key, text), finding)
    return list(out.values())


def _event_facts(ledger: Ledger) -> list[dict[str, Any]]:
    return [
        {
            SITE_ID: e.site_id,
            "mechanism": e.mechanism,
            "sigma": e.sigma,
            "steps": e.steps,
            SERVER_ROUND: e.round,
        }
        for e in ledger.events()
    ]


def _config_findings(config: Mapping[str, Any], *, source: str, subject: str) -> list[RunFinding]:
    """Both kinds of findings of one run config: non-private settings, then refused values."""
    return [
        *config_findings(config, source=source, subject=subject),
        *config_range_findings(config, source=source, subject=subject),
    ]


def _fact_findings(facts: list[dict[str, Any]], *, source: str) -> list[RunFinding]:
    """Both kinds of findings of facts: non-private ones, then values outside their range."""
    return [
        *fact_findings(facts, source=source),
        *fact_range_findings(facts, source=source),
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
    return _config_findings(config, source=where, subject="run folder")


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
        facts: accounting facts reported by sites, as ``ReplyFacts`` records (wire names).
    """
    sources, findings, notes = [], [], []
    runs = ledger.runs()
    for run in runs:
        findings += _config_findings(
            run.config, source="ledger run config", subject=f"run {run.run_id}"
        )
    sources.append(f"{len(runs)} run config(s) recorded in the ledger")
    if run_config is not None:
        findings += _folder_config(run_config)
        sources.append(str(run_config))
    events = _event_facts(ledger)
    findings += _fact_findings(events, source="ledger events")
    sources.append(f"{len(events)} ledger event(s)")
    given = [dict(fact) for fact in facts]
    if given:
        findings += _fact_findings(given, source="site facts")
        sources.append(f"{len(given)} reported fact record(s)")
    if not runs and run_config is None:
        notes.append(
            "no run configuration found (none recorded in the ledger, no run-config.json beside "
            "it): the run's settings were not checked, only the ledger's events"
        )
    return RunCheck(sources, findings, notes)
