"""Privacy-budget reports from the ledger: JSON, CSV and a self-contained HTML page with a plot.

Every epsilon in a report is recomputed from the ledger's events (``Ledger.epsilon``, PRV with
the RDP cross-check); nothing is read from a stored epsilon.

Two marks (JSON fields, CSV columns, HTML text, the per-round table and ``prism-fl report``):

- UNCONFIRMED charges: rounds a site was asked to run and gave no valid answer for (an error
  reply, a time-out, facts that do not match the configuration). It may have charged itself, so
  they are counted in its epsilon at its last confirmed parameters: a worst-case epsilon. A site
  with such a charge and no confirmed parameters has an unknown epsilon (shown as "unknown",
  accounted as inf).
- A PRIVATE CLIP ESTIMATE (``max-norm = auto``): the noisy quantile steps a site ran to choose
  its clip (mechanism ``prism_core.quantile.QUANTILE_MECHANISM``) are charged like training
  steps and composed into its epsilon; the report shows them on their own (``quantile_steps``,
  ``quantile_charges``, ``quantile_sigma_values``), apart from the training ``steps``.
- NOT PRIVATE AGAINST THE COORDINATOR: a site that reported ``rng = reproducible`` (sampling,
  dropout and noise seeded for tests and benchmarks) and every run it took part in that way: its
  epsilon holds against outsiders only, not against a coordinator that could learn the seed.

A site that ran SECURE AGGREGATION (``prism_core.records.SKELLAM_MECHANISM``) has two epsilons:
``epsilon``, charged on the noise of the sum, holds if at least ``honest_sites`` sites are honest
(the fewest any of its rounds counted on); ``epsilon_collusion`` holds if every other site
colludes with the coordinator (the site's own noise share alone,
``prism_core.accounting.collusion_epsilon``). For a site without secure aggregation both are
None (JSON null, an empty CSV cell, no HTML text, no round-table column): its epsilon does not
count on the other sites.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from prism_core.accounting import (
    PRV_EPS_ERROR,
    PrivacyEvent,
    epsilon,
    epsilon_report,
    history_unit,
    max_steps,
    replace_one,
)
from prism_core.errors import AccountingError
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import ADJACENCY
from prism_runtime.protocol import RNG_REPRODUCIBLE, RNG_SECURE
from server.errors import ConfigError
from server.ledger import Ledger, LedgerEvent, epsilon_points
from server.ledger.budget import (
    accountable,
    history_collusion_epsilon,
    honest_sites,
    secure,
    switched_to_person,
)

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_HORIZON_ROUNDS",
    "MARK_EPSILON_UNKNOWN",
    "MARK_NOT_PRIVATE",
    "MARK_UNCONFIRMED",
    "UNIT_NAMES",
    "build_report",
    "format_number",
    "format_round_table",
    "projected_rounds_left",
    "round_rows",
    "server_eval_series",
    "site_marks",
]

DEFAULT_HORIZON_ROUNDS: Final = 512
"""Projections stop at this many rounds (a value equal to it means "at least")."""
_FIRST_HORIZON: Final = 8
"""First block of rounds tried by the projection, and the growth factor of the next blocks."""
CSV_COLUMNS: Final = (
    "site_id",
    "epsilon",
    "epsilon_rdp",
    "epsilon_collusion",
    "honest_sites",
    "epsilon_cap",
    "delta",
    "unit",
    "epsilon_replace_one",
    "delta_replace_one",
    "replace_one_method",
    "rounds",
    "steps",
    "sigma",
    "q",
    "sigma_values",
    "q_values",
    "quantile_steps",
    "quantile_charges",
    "quantile_sigma_values",
    "steps_per_round",
    "projected_rounds_left",
    "projection_capped",
    "status",
    "unconfirmed_rounds",
    "unconfirmed_steps",
    "epsilon_known",
    "rng",
    "private_against_coordinator",
    "marks",
    "note",
)
SERVER_EVAL_METRICS: Final = ("accuracy", "exact_match")
"""The held-out metrics a report shows per round, in order of preference
(``prism_runtime.evaluate.evaluate``: accuracy for seq-cls, exact match for causal-lm)."""
MARK_UNCONFIRMED: Final = "unconfirmed charges counted (worst case)"
MARK_EPSILON_UNKNOWN: Final = "epsilon unknown (worst case)"
MARK_NOT_PRIVATE: Final = "not private against the coordinator (reproducible rng)"


# --------------------------------------------------------------------------------------------
# Building the report
# --------------------------------------------------------------------------------------------


def projected_rounds_left(
    history: Sequence[PrivacyEvent],
    *,
    sigma: float,
    q: float,
    steps_per_round: int,
    epsilon_cap: float,
    delta: float,
    horizon_rounds: int = DEFAULT_HORIZON_ROUNDS,
) -> tuple[int, bool]:
    """How many more rounds of ``steps_per_round`` steps at (sigma, q) fit under the cap.

    ``prism_core.accounting.max_steps`` (PRV, composed with ``history``) gives the largest number
    of further steps that fit, divided here by the steps per round. The PRV accountant gets slow
    for long histories, so the search is bracketed first: whole blocks of 8, 64, 512, ... rounds
    are tried (one epsilon each) up to ``horizon_rounds``, then ``max_steps`` searches only
    between the last block that fits and the first that does not.

    Returns:
        ``(rounds, capped)``: ``capped`` is True when ``rounds == horizon_rounds`` fit and more
        might.
    """
    if steps_per_round < 1:
        raise ConfigError(f"steps_per_round={steps_per_round!r} must be >= 1")
    if horizon_rounds < 1:
        raise ConfigError(f"horizon_rounds={horizon_rounds!r} must be >= 1")

    def block(rounds: int) -> list[PrivacyEvent]:
        steps = rounds * steps_per_round
        return [PrivacyEvent(sigma, q, steps, unit=history_unit(history))] if rounds else []

    fitting, trial = 0, min(_FIRST_HORIZON, horizon_rounds)
    while epsilon([*history, *block(trial)], delta) <= epsilon_cap:
        fitting = trial
        if trial >= horizon_rounds:
            return horizon_rounds, True
        trial = min(trial * _FIRST_HORIZON, horizon_rounds)
    more_steps = max_steps(
        [*history, *block(fitting)],
        noise_multiplier=sigma,
        sample_rate=q,
        delta=delta,
        target_epsilon=epsilon_cap,
        limit=(trial - fitting) * steps_per_round,
    )
    return fitting + more_steps // steps_per_round, False


_H = TypeVar("_H", bound=Hashable)


def _distinct(values: Sequence[_H]) -> list[_H]:
    return list(dict.fromkeys(values))


def _distinct_keys(values: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    return list(dict.fromkeys(values))


def _training(event: LedgerEvent) -> bool:
    """A training event (not a private clip estimate's, ``QUANTILE_MECHANISM``)."""
    return event.mechanism != QUANTILE_MECHANISM


def _rng_name(rng: str | None) -> str:
    return "unknown" if rng is None else rng


def site_marks(events: Sequence[LedgerEvent]) -> dict[str, Any]:
    """The confirmation and randomness marks of one site's accounted history (``events``).

    Returns:
        ``unconfirmed_rounds`` (distinct (run, round) with an unconfirmed charge that ran
        steps) and ``unconfirmed_steps`` (their training steps),
        ``unconfirmed_codes`` (their codes, distinct, in order), ``epsilon_known`` (False when
        an unconfirmed charge has unknown parameters), ``rng`` (distinct rng facts, "unknown"
        for none), ``private_against_coordinator`` (False if any event reported the
        reproducible rng, True if every event reported the OS CSPRNG, else None: not known),
        and ``marks`` (the short texts of the marks that apply).
    """
    ran = [e for e in events if e.steps > 0]
    unconfirmed = [e for e in ran if not e.confirmed]
    unconfirmed_rounds = _distinct_keys([(e.run_id, e.round) for e in unconfirmed])
    rngs = [_rng_name(e.rng) for e in events]
    if RNG_REPRODUCIBLE in rngs:
        private: bool | None = False
    elif rngs and all(r == RNG_SECURE for r in rngs):
        private = True
    else:
        private = None
    known = all(e.params_known for e in ran)
    marks = []
    if unconfirmed:
        marks.append(f"{len(unconfirmed_rounds)} {MARK_UNCONFIRMED}")
    if not known:
        marks.append(MARK_EPSILON_UNKNOWN)
    if private is False:
        marks.append(MARK_NOT_PRIVATE)
    return {
        "unconfirmed_rounds": len(unconfirmed_rounds),
        "unconfirmed_steps": sum(e.steps for e in unconfirmed if _training(e)),
        "unconfirmed_codes": _distinct([e.code for e in unconfirmed]),
        "epsilon_known": known,
        "rng": _distinct(rngs),
        "private_against_coordinator": private,
        "marks": marks,
    }


def _site_row(
    ledger: Ledger,
    site_id: str,
    *,
    planned_steps_per_round: int | None,
    horizon_rounds: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    events = ledger.events(site_id=site_id)  # one snapshot: the server may be appending
    switched = switched_to_person(events)
    history = [e.event for e in accountable(events)]
    quantile = [e for e in events if not _training(e) and e.steps > 0]
    ran = [e for e in events if e.steps > 0 and _training(e)]
    known = [e for e in ran if e.params_known]
    last: LedgerEvent = known[-1] if known else (ran[-1] if ran else events[-1])
    if not _training(last):  # only a private clip estimate ran: no training parameters
        last = next((e for e in reversed(events) if _training(e)), last)
    marks = site_marks(events)
    caps = [e.epsilon_cap for e in events if e.epsilon_cap is not None]
    cap = min(caps) if caps else None
    delta = min(e.delta for e in events)  # as Ledger.epsilon: the smallest delta
    secured = secure(events)
    row: dict[str, Any] = {
        "site_id": site_id,
        "epsilon": math.inf,
        "epsilon_rdp": math.inf,
        "epsilon_collusion": math.inf if secured else None,
        "honest_sites": honest_sites(events),
        "epsilon_replace_one": math.inf,
        "delta_replace_one": 1.0,
        "replace_one_method": None,
        "epsilon_cap": cap,
        "delta": delta,
        "unit": ", ".join(_distinct([e.unit for e in events])),
        "rounds": len({(e.run_id, e.round) for e in ran}),
        "steps": sum(e.steps for e in events if _training(e)),
        "sigma": last.sigma,
        "q": last.q,
        "sigma_values": _distinct([e.sigma for e in known]),
        "q_values": _distinct([e.q for e in known]),
        "quantile_steps": sum(e.steps for e in quantile),
        "quantile_charges": len(quantile),
        "quantile_sigma_values": _distinct([e.sigma for e in quantile if e.params_known]),
        "steps_per_round": planned_steps_per_round or (last.steps if ran else None),
        "projected_rounds_left": None,
        "projection_capped": False,
        "status": "active",
        **marks,
        "note": "",
    }
    if quantile:
        row["note"] += (
            f"includes {len(quantile)} private clip estimate(s) ({QUANTILE_MECHANISM}, "
            f"{row['quantile_steps']} noisy quantile steps), composed into epsilon. "
        )
    if marks["unconfirmed_rounds"]:
        row["note"] += (
            f"{marks['unconfirmed_rounds']} unconfirmed charge(s) "
            f"({', '.join(marks['unconfirmed_codes'])}): asked, no valid answer; counted at the "
            "site's last confirmed parameters, so epsilon is a worst case. "
        )
    if not marks["epsilon_known"]:
        row["note"] += (
            "epsilon unknown: an unconfirmed charge has no confirmed parameters (counted as inf). "
        )
    if marks["private_against_coordinator"] is False:
        row["note"] += (
            "NOT private against the coordinator: the site ran with reproducible (seeded) "
            "randomness. "
        )
    if switched:
        earlier = [e for e in events if e.unit == "record" and e.steps > 0]
        row["unit"] = "user"
        row["note"] += (
            f"switched from per record to per patient: epsilon counts the per-patient rounds; "
            f"the site adds its {sum(e.steps for e in earlier)} earlier per-record steps by "
            "group privacy with its own largest number of records per patient (conservative; "
            "not sent), so its own epsilon is larger and its ledger enforces its cap on the "
            "sum. "
        )
    if len(set(caps)) > 1:
        row["note"] += f"caps changed {_distinct(caps)}; the smallest applies. "
    if len({e.delta for e in events}) > 1:
        row["note"] += "deltas differ; accounted at the smallest. "
    try:
        report = epsilon_report(history, delta)
        against_coordinator = replace_one(history, delta)
        by_round = epsilon_points(events, delta)
        if secured:
            row["epsilon_collusion"] = history_collusion_epsilon(events, delta)
    except AccountingError as exc:
        row["status"] = "exhausted"
        row["note"] += f"cannot be accounted, treated as exhausted: {exc}"
        return row, []
    row["epsilon"], row["epsilon_rdp"] = report.prv, report.rdp
    if secured:
        row["note"] += _secure_note(row)
    row["note"] = row["note"].strip()
    row["epsilon_replace_one"] = against_coordinator.epsilon
    row["delta_replace_one"] = against_coordinator.delta
    row["replace_one_method"] = against_coordinator.method
    series = [{"run_id": run_id, "round": rnd, "epsilon": eps} for run_id, rnd, eps in by_round]
    if cap is None:
        return row, series
    per_round = row["steps_per_round"]
    if per_round:
        left, capped = projected_rounds_left(
            history,
            sigma=last.sigma,
            q=last.q,
            steps_per_round=per_round,
            epsilon_cap=cap,
            delta=delta,
            horizon_rounds=horizon_rounds,
        )
        row["projected_rounds_left"], row["projection_capped"] = left, capped
        exhausted = left == 0 or report.prv > cap
    else:
        exhausted = report.prv >= cap
    row["status"] = "exhausted" if exhausted else "active"
    row["note"] = row["note"].strip()
    return row, series


def _secure_note(row: Mapping[str, Any]) -> str:
    """The note of a site that ran secure aggregation: what its two epsilons assume."""
    honest = row["honest_sites"]
    counted = "an unknown number of" if honest is None else f"at least {honest}"
    return (
        f"secure aggregation: epsilon {_epsilon_text(row, 0).strip()} holds if {counted} "
        "sites are honest (the noise of their sum); if every other site colludes with the "
        f"coordinator, epsilon {_epsilon_text(row, 0, 'epsilon_collusion').strip()} "
        "(epsilon_collusion: the site's own noise share alone). "
    )


def guarantee(
    units: Sequence[str], honest: Mapping[str, int | None] | None = None
) -> dict[str, Any]:
    """What a report's epsilon means (``report["guarantee"]``; docs/security.md), for the
    privacy units of its sites (``record``, ``user``; several when sites differ) and, under
    secure aggregation, ``honest`` (site -> the fewest honest sites its epsilon counts on, for
    the sites that ran it; ``guarantee["honest_sites"]``)."""
    names = _distinct([UNIT_NAMES.get(u, u) for u in units]) or ["record"]
    per = " or ".join(f"epsilon per {name}" for name in names)
    unit = " and ".join(names)
    text = (
        f"{per} (each site's own unit: a patient is one person with all their records), "
        "add/remove adjacency at the site's sampling rate. Every reply states q = b / N, so the "
        f"coordinator (and whoever it tells) knows each site's number of {unit}s N: against it "
        "the guarantee is replace-one with N public (epsilon_replace_one at "
        "delta_replace_one): accounted directly by a replace-one PLD accountant at the same "
        "delta where the history is Gaussian (replace_one_method pld), else by group privacy, "
        "2 epsilon at delta (1 + e^epsilon) (replace_one_method group-privacy)."
    )
    honest = dict(honest or {})
    if honest:
        counts = "; ".join(
            f"{site}: at least {'an unknown number of' if h is None else h} honest sites"
            for site, h in honest.items()
        )
        text += (
            f" Under secure aggregation ({counts}), a site's epsilon is charged on the noise of "
            "the sum and holds if at least that many sites (the fewest any of its rounds "
            "counted on) are honest; if every other site colludes with the coordinator, its "
            "guarantee is epsilon_collusion, from its own noise share alone."
        )
    return {
        "unit": ", ".join(_distinct(list(units))) or "record",
        "adjacency": ADJACENCY,
        "against_coordinator": "replace-one, shard size public",
        "honest_sites": honest,
        "text": text,
    }


UNIT_NAMES: Final = {"record": "record", "user": "patient"}
"""How a report names the privacy unit of a site's epsilon (``prism_core.records.PRIVACY_UNITS``):
"epsilon per record" or "epsilon per patient" (one person and all of their records)."""


def server_eval_series(
    metrics: Mapping[Any, Mapping[str, Any]] | None,
) -> dict[str, Any] | None:
    """The coordinator's held-out metric per round, as a report holds it.

    Args:
        metrics: round -> the coordinator's evaluation of the global model after that round
            (round 0: before training), as Flower's ``Result.evaluate_metrics_serverapp`` or
            ``summary.json``'s ``server-eval`` (round numbers as strings) hold it; values that
            are not numbers are left out.

    Returns:
        ``{"metric": name, "rounds": [{"round": r, **metrics}, ...]}`` in round order, with
        ``metric`` the first of ``SERVER_EVAL_METRICS`` present (else the first key that is
        not ``loss`` or ``examples``); None when ``metrics`` is empty or holds no such key.
    """
    if not metrics:
        return None
    rounds = sorted(
        (int(r), {str(k): float(v) for k, v in m.items() if isinstance(v, int | float)})
        for r, m in metrics.items()
    )
    keys = _distinct([k for _, m in rounds for k in m])
    others = [k for k in keys if k not in ("loss", "examples")]
    name = next((k for k in SERVER_EVAL_METRICS if k in keys), others[0] if others else None)
    if name is None:
        return None
    return {"metric": name, "rounds": [{"round": r, **m} for r, m in rounds]}


def build_report(
    ledger: Ledger,
    *,
    planned_steps_per_round: int | None = None,
    horizon_rounds: int = DEFAULT_HORIZON_ROUNDS,
    server_eval: Mapping[Any, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """A budget report of every site in the ledger.

    Per site (``report["sites"]``, one dict per site in order of first appearance): ``site_id``;
    ``epsilon`` (PRV) and ``epsilon_rdp`` (RDP cross-check) over all the site's events;
    for a site that ran secure aggregation, ``honest_sites`` (the fewest honest sites its
    epsilon counts on: the smallest over its rounds) and ``epsilon_collusion`` (its epsilon if
    every other site colludes with the coordinator), both None for any other site;
    ``epsilon_replace_one``, ``delta_replace_one`` and ``replace_one_method`` (the guarantee
    against the coordinator, which knows the shard size, and whether it came from a
    replace-one PLD accountant or from group privacy: ``prism_core.accounting.replace_one``;
    ``guarantee`` says so);
    ``epsilon_cap`` (the smallest cap the site ever reported: a budget can be tightened, never
    loosened; None if none); ``delta`` (the smallest of the site's deltas, the one epsilon is
    accounted at); ``unit`` (the privacy unit of the site's events, ``UNIT_NAMES``: ``record``
    or ``user``; units joined by ", " for a history that mixes them, which cannot be accounted);
    ``rounds`` (distinct (run, round) with training steps > 0); ``steps`` (the
    training steps, total);
    ``sigma`` and ``q`` of the last training event that ran steps, with
    ``sigma_values``/``q_values`` listing the distinct values in order of use; the private clip
    estimates (``QUANTILE_MECHANISM``, counted in epsilon but not in ``steps`` or ``rounds``):
    ``quantile_steps`` (their noisy quantile steps), ``quantile_charges`` (how many) and
    ``quantile_sigma_values`` (their count noise multipliers); ``steps_per_round``
    (``planned_steps_per_round`` or the last round's steps); ``projected_rounds_left``
    (further rounds of the last (sigma, q, steps per round) that fit under the cap, by
    ``max_steps``; None without a cap), with
    ``projection_capped`` when it hit ``horizon_rounds``; ``status`` ("exhausted" when no further
    round fits or epsilon is past the cap, else "active"); the marks of ``site_marks``
    (``unconfirmed_rounds``, ``unconfirmed_steps``, ``unconfirmed_codes``, ``epsilon_known``,
    ``rng``, ``private_against_coordinator``, ``marks``); ``note`` (the marks in words).

    Epsilon counts every accounted event (``Ledger.events``): confirmed charges and the
    unconfirmed ones no confirmation superseded, so it is a worst case when ``marks`` says so.

    Also: ``series`` (site -> ``[{run_id, round, epsilon}]`` after each round the site ran),
    ``run_ids``, ``generated_at`` (UTC ISO-8601), ``ledger`` (path), ``accountant``,
    ``unconfirmed_charges`` (their number over all sites), ``epsilon_unknown`` (sites),
    ``not_private_against_coordinator`` (``{"sites": [...], "runs": [...]}``: sites and runs
    with an event of the reproducible rng), ``server_eval`` (``server_eval_series`` of
    ``server_eval``, the coordinator's held-out metric per round of the run, or None).

    A site whose events cannot be accounted (privacy units mixed) gets epsilon inf and status
    "exhausted" with the reason in ``note``.

    Raises:
        ConfigError: ``planned_steps_per_round`` or ``horizon_rounds`` below 1.
    """
    if planned_steps_per_round is not None and planned_steps_per_round < 1:
        raise ConfigError(
            f"planned_steps_per_round={planned_steps_per_round!r} must be >= 1 (or None to use "
            "each site's last round)"
        )
    if horizon_rounds < 1:
        raise ConfigError(f"horizon_rounds={horizon_rounds!r} must be >= 1")
    sites: list[dict[str, Any]] = []
    series: dict[str, list[dict[str, Any]]] = {}
    for site_id in ledger.sites():
        row, points = _site_row(
            ledger,
            site_id,
            planned_steps_per_round=planned_steps_per_round,
            horizon_rounds=horizon_rounds,
        )
        sites.append(row)
        series[site_id] = points
    reproducible_runs = _distinct([e.run_id for e in ledger.events() if e.rng == RNG_REPRODUCIBLE])
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "ledger": str(ledger.path),
        "accountant": {
            "epsilon": "prv",
            "cross_check": "rdp",
            "prv_eps_error": PRV_EPS_ERROR,
            "rdp_where": "a history outside PRV's memory bounds (prism_core.accounting) is "
            "accounted by RDP, an upper bound",
        },
        "guarantee": guarantee(
            [r["unit"] for r in sites],
            {r["site_id"]: r["honest_sites"] for r in sites if r["epsilon_collusion"] is not None},
        ),
        "run_ids": ledger.run_ids(),
        "planned_steps_per_round": planned_steps_per_round,
        "horizon_rounds": horizon_rounds,
        "unconfirmed_charges": sum(r["unconfirmed_rounds"] for r in sites),
        "epsilon_unknown": [r["site_id"] for r in sites if not r["epsilon_known"]],
        "not_private_against_coordinator": {
            "sites": [r["site_id"] for r in sites if r["private_against_coordinator"] is False],
            "runs": reproducible_runs,
        },
        "sites": sites,
        "series": series,
        "server_eval": server_eval_series(server_eval),
    }


# --------------------------------------------------------------------------------------------
# Text table for the server log
# --------------------------------------------------------------------------------------------


def format_number(x: float | None, width: int) -> str:
    if x is None:
        return "-".rjust(width)
    return f"{x:{width}.3f}" if math.isfinite(x) else "inf".rjust(width)


def _epsilon_text(row: Mapping[str, Any], width: int, key: str = "epsilon") -> str:
    if not row.get("epsilon_known", True):
        return "unknown".rjust(width)
    return format_number(row.get(key), width)


def round_rows(ledger: Ledger, exhausted: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The rows ``format_round_table`` needs, at one PRV evaluation per site.

    ``build_report`` also composes every round's prefix and projects the rounds left (many
    accountant calls per site: 36 s for 10 sites x 20 rounds here), too slow to run after
    every round; this gives each site's epsilon so far, its smallest cap, ``status``
    ``exhausted`` for the sites in ``exhausted`` (the strategy's own set), else ``active``, and
    the marks of ``site_marks`` (unconfirmed charges, unknown epsilon, not private against the
    coordinator); for a site that ran secure aggregation also its ``epsilon_collusion`` (one
    more evaluation) and ``honest_sites``, as ``build_report`` gives them (None otherwise).
    """
    done = set(exhausted)
    rows = []
    for site_id in ledger.sites():
        events = ledger.events(site_id=site_id)
        caps = [e.epsilon_cap for e in events if e.epsilon_cap is not None]
        delta = min(e.delta for e in events)
        counted = accountable(events)
        try:
            eps = epsilon([e.event for e in counted], delta)
        except AccountingError:
            eps = math.inf
        units = _distinct([e.unit for e in counted])
        collusion: float | None = None
        if secure(events):
            try:
                collusion = history_collusion_epsilon(events, delta)
            except AccountingError:
                collusion = math.inf
        rows.append(
            {
                "site_id": site_id,
                "epsilon": eps,
                "epsilon_collusion": collusion,
                "honest_sites": honest_sites(events),
                "unit": ", ".join(units),
                "epsilon_cap": min(caps) if caps else None,
                "status": "exhausted" if site_id in done else "active",
                **site_marks(events),
            }
        )
    return rows


def _collusion_cells(row: Mapping[str, Any]) -> str:
    """The ``collude`` and ``honest`` cells of a round-table row ("-" for a site without
    secure aggregation)."""
    if row.get("epsilon_collusion") is None:
        collude = format_number(None, 9)
    else:
        collude = _epsilon_text(row, 9, "epsilon_collusion")
    honest = row.get("honest_sites")
    return f"  {collude}  {'-' if honest is None else str(honest):>6}"


def format_round_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table for the log after each round and for ``prism-fl report``.

    Columns: site, epsilon ("unknown" when an unconfirmed charge has unknown parameters), per
    (its unit: record or patient), cap, status, unconfirmed (charges counted in epsilon as a
    worst case), marks; when a row has an ``epsilon_collusion`` (a site that ran secure
    aggregation), also ``collude`` after epsilon (its epsilon if the other sites collude with
    the coordinator, "-" for the other sites) and ``honest`` (the honest sites its epsilon
    counts on). ``rows`` are
    report rows (``build_report(...)["sites"]``), ``round_rows`` rows, or any mappings with
    ``site_id``, ``epsilon``, ``epsilon_cap`` and ``status`` (the marks are optional). A line
    under the table spells out each mark that appears.
    """
    width = max([len("site"), *(len(str(r["site_id"])) for r in rows)])
    secured = any(r.get("epsilon_collusion") is not None for r in rows)
    extra = f"  {'collude':>9}  {'honest':>6}" if secured else ""
    lines = [
        f"{'site':<{width}}  {'epsilon':>9}{extra}  {'per':<7}  {'cap':>9}  {'status':<9}  "
        "unconfirmed  marks"
    ]
    for r in rows:
        unit = str(r.get("unit") or "record")
        extra = _collusion_cells(r) if secured else ""
        lines.append(
            f"{r['site_id']!s:<{width}}  {_epsilon_text(r, 9)}{extra}  "
            f"{UNIT_NAMES.get(unit, unit):<7}  "
            f"{format_number(r.get('epsilon_cap'), 9)}  {r['status']!s:<9}  "
            f"{r.get('unconfirmed_rounds', 0):>11}  {'; '.join(r.get('marks', []))}".rstrip()
        )
    if any(r.get("unconfirmed_rounds", 0) for r in rows):
        lines.append(
            "unconfirmed: rounds a site was asked to run and gave no valid answer for; counted "
            "at its last confirmed parameters (worst case)."
        )
    if secured:
        lines.append(
            "collude: epsilon if every other site colludes with the coordinator (the site's own "
            "noise share alone); epsilon holds if at least `honest` sites are honest."
        )
    if any(r.get("private_against_coordinator") is False for r in rows):
        lines.append(
            "not private against the coordinator: the site ran with reproducible (seeded) "
            "randomness; its epsilon holds against outsiders only."
        )
    return "\n".join(lines)
