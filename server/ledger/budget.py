"""Budget maths over a site's ledger history: epsilon so far, per round, the cap check, and,
under secure aggregation, the honest sites the epsilon counts on and the epsilon if every other
site colluded with the coordinator.

Pure functions of the events (no SQL): ``server.ledger.Ledger`` reads the history and calls
them. Epsilon is never stored; every value composes the whole history with
``prism_core.accounting`` (PRV, with the RDP cross-check).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prism_core.accounting import (
    EpsilonReport,
    PrivacyEvent,
    collusion_epsilon,
    epsilon,
    epsilon_report,
)
from prism_core.errors import AccountingError
from prism_core.records import SKELLAM_MECHANISM
from server.ledger.events import LedgerEvent

__all__ = [
    "accountable",
    "epsilon_points",
    "epsilon_series",
    "history_collusion_epsilon",
    "history_epsilon",
    "honest_sites",
    "secure",
    "switched_to_person",
    "within_cap",
]

log = logging.getLogger("server.ledger")


def switched_to_person(events: Sequence[LedgerEvent]) -> bool:
    """Whether a site's history holds per-record steps and then per-person ones (a site whose
    policy changed from ``record`` to ``user``; the reverse is refused by the site)."""
    units = [e.unit for e in events if e.steps > 0]
    if "record" not in units or "user" not in units:
        return False
    return units.index("user") > max(i for i, u in enumerate(units) if u == "record")


def accountable(events: Sequence[LedgerEvent]) -> list[LedgerEvent]:
    """The events the coordinator composes into one epsilon: all of them, or, for a site
    ``switched_to_person``, its per-person events. Such a site counts its earlier per-record
    steps per person itself, by group privacy with its own largest number of records per
    person (which it does not send); the coordinator's per-person epsilon is then a LOWER bound
    of the site's own, and the site's ledger enforces its cap on the whole."""
    if not switched_to_person(events):
        return list(events)
    return [e for e in events if e.unit != "record"]


def history_epsilon(events: Sequence[LedgerEvent], delta: float) -> EpsilonReport:
    """Epsilon of one site's whole history at ``delta`` (PRV, RDP cross-check; ``accountable``
    events)."""
    return epsilon_report([e.event for e in accountable(events)], delta)


def secure(events: Sequence[LedgerEvent]) -> bool:
    """Whether a site's accounted history (``accountable``) holds a secure-aggregation event
    that ran steps (``prism_core.records.SKELLAM_MECHANISM``): only then does its epsilon count
    on other sites being honest."""
    return any(e.mechanism == SKELLAM_MECHANISM and e.steps > 0 for e in accountable(events))


def honest_sites(events: Sequence[LedgerEvent]) -> int | None:
    """The fewest honest sites the site's epsilon counts on: the smallest ``honest_sites`` of
    its secure-aggregation events that ran steps with known parameters (its epsilon holds if at
    least that many sites are honest); None when it has none."""
    counts = [
        e.honest_sites
        for e in accountable(events)
        if e.honest_sites is not None and e.steps > 0 and e.params_known
    ]
    return min(counts) if counts else None


def history_collusion_epsilon(events: Sequence[LedgerEvent], delta: float) -> float:
    """Epsilon of one site's whole history at ``delta`` if every other site colluded with the
    coordinator (``prism_core.accounting.collusion_epsilon``: a secure-aggregation event counts
    at its own share's ``share_sigma``, any other as ``history_epsilon`` counts it;
    ``accountable`` events)."""
    return collusion_epsilon([e.event for e in accountable(events)], delta)


def within_cap(
    events: Sequence[LedgerEvent],
    new: PrivacyEvent,
    *,
    epsilon_cap: float,
    delta: float,
    site_id: str,
) -> bool:
    """Does the history plus ``new`` stay within ``epsilon_cap`` at ``delta``?

    A history that cannot be accounted (e.g. privacy units mixed) answers False, with a
    warning: its privacy loss is unknown.
    """
    history = [e.event for e in accountable(events)]
    try:
        return epsilon([*history, new], delta) <= epsilon_cap
    except AccountingError as exc:
        log.warning("ledger: site %s cannot be accounted (%s); not selected", site_id, exc)
        return False


def epsilon_points(events: Sequence[LedgerEvent], delta: float) -> list[tuple[str, int, float]]:
    """``(run_id, round, PRV epsilon so far)`` after each round that ran steps > 0.

    The events are composed in the given order (one site's history, in ledger order); the
    consecutive events of one (run, round), e.g. a private clip estimate and the training
    steps charged in the same round, give one point, after the last of them.
    """
    out: list[tuple[str, int, float]] = []
    history: list[PrivacyEvent] = []
    events = accountable(events)
    ran = False  # the current (run, round) ran steps
    for index, e in enumerate(events):
        history.append(e.event)
        ran = ran or e.steps > 0
        following = events[index + 1] if index + 1 < len(events) else None
        if following is None or (following.run_id, following.round) != (e.run_id, e.round):
            if ran:
                out.append((e.run_id, e.round, epsilon(history, delta)))
            ran = False
    return out


def epsilon_series(events: Sequence[LedgerEvent], delta: float) -> list[tuple[int, float]]:
    """``(round, PRV epsilon)`` of ``epsilon_points``: after each round that ran steps > 0."""
    return [(rnd, eps) for _, rnd, eps in epsilon_points(events, delta)]
