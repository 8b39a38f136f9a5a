"""A ledger event (what one site ran in one round of one run) and its validation.

The event's privacy facts are the one record of the mechanism (``prism_core.records.
PrivacyEvent``); this module adds the run, round, site and confirmation, their ranges and the
rules of confirmation: the ledger's contract with the strategy that records charges
(``server.strategy``) and with the reports that read them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, Final

from prism_core.records import DEFAULT_MECHANISM, EventColumns, PrivacyEvent
from prism_runtime.protocol import RNG_MODES
from server.errors import InvalidEventError

__all__ = [
    "DEFAULT_MECHANISM",
    "UNKNOWN_HONEST_SITES",
    "UNKNOWN_Q",
    "UNKNOWN_SIGMA",
    "LedgerEvent",
    "RunRecord",
    "now",
    "validate_event",
]

UNKNOWN_SIGMA: Final = 0.0
UNKNOWN_Q: Final = 1.0
"""How an unconfirmed charge with unknown parameters is accounted: no noise, every record used
(epsilon infinite, the worst case)."""
UNKNOWN_HONEST_SITES: Final = 1
"""The honest sites such a charge of a secure-aggregation run counts on (the site alone; its
``share_sigma`` is ``UNKNOWN_SIGMA``)."""
_CODE_PATTERN: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


@dataclass(frozen=True)
class LedgerEvent(EventColumns):
    """What one site ran in one round of one run: its privacy event, and who, when, how sure.

    Attributes:
        run_id: the federated run.
        round: server round, ``>= 0``.
        site_id: the site, non-empty.
        event: the privacy event (``prism_core.records.PrivacyEvent``: mechanism, sigma, q,
            steps, sampling, adjacency, unit, and a secure-aggregation event's honest sites and
            share sigma), the site's released facts or, unconfirmed, the coordinator's
            worst-case stand-in for them. ``sigma``, ``q``, ``steps``, ``mechanism``,
            ``adjacency``, ``sampling``, ``unit``, ``honest_sites`` and ``share_sigma`` (the
            ledger's columns) read through to it (``EventColumns``).
        delta: the site's delta, in ``(0, 1)``.
        epsilon_cap: the site's epsilon budget, ``> 0``, or None for no cap.
        recorded_at: UTC ISO-8601 time the ledger stored the event; set by the ledger (a value
            given to ``Ledger.append`` is ignored).
        confirmed: True for the site's own (cross-checked) facts; False for a charge the
            coordinator records because the site was asked and gave no valid answer.
        params_known: False only for an unconfirmed charge of a site with no confirmed
            parameters: it is accounted with ``UNKNOWN_SIGMA``/``UNKNOWN_Q`` (epsilon inf).
        rng: the site's ``rng`` fact (``prism_runtime.protocol.RNG_MODES``), None when not known.
        code: why a charge is unconfirmed (the coordinator's code, e.g. ``no-reply``); empty
            for a confirmed one.

    Raises:
        InvalidEventError: on construction, for a value out of its range.
    """

    run_id: str
    round: int
    site_id: str
    event: PrivacyEvent
    delta: float
    epsilon_cap: float | None = None
    recorded_at: str | None = None
    confirmed: bool = True
    params_known: bool = True
    rng: str | None = None
    code: str = ""

    def __post_init__(self) -> None:
        validate_event(self)

    def same_facts(self, other: LedgerEvent) -> bool:
        """Equal in every field but ``recorded_at``."""
        return all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
            if f.name != "recorded_at"
        )


@dataclass(frozen=True)
class RunRecord:
    """One federated run: its id, when it was recorded and its configuration."""

    run_id: str
    started_at: str
    config: dict[str, Any]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)


def validate_event(e: LedgerEvent) -> None:
    """Raise InvalidEventError naming every out-of-range field of ``e`` (its privacy event's
    own fields by ``PrivacyEvent.problems``: a frozen dataclass can still be altered by force)."""
    problems = []
    for name in ("run_id", "site_id"):
        value = getattr(e, name)
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{name}={value!r} must be a non-empty string")
    if not (_is_int(e.round) and e.round >= 0):
        problems.append(f"round={e.round!r} must be an integer >= 0")
    if isinstance(e.event, PrivacyEvent):
        problems += e.event.problems()
    else:
        problems.append(f"event={e.event!r} must be a PrivacyEvent")
    if not (_is_real(e.delta) and 0 < e.delta < 1):
        problems.append(f"delta={e.delta!r} must be in (0, 1)")
    if e.epsilon_cap is not None and not (_is_real(e.epsilon_cap) and 0 < e.epsilon_cap < math.inf):
        problems.append(f"epsilon_cap={e.epsilon_cap!r} must be a finite number > 0 or None")
    problems += _status_problems(e)
    if problems:
        who = f"site {e.site_id!r}, run {e.run_id!r}, round {e.round!r}"
        raise InvalidEventError(f"invalid ledger event ({who}): " + "; ".join(problems))


def _status_problems(e: LedgerEvent) -> list[str]:
    """What is wrong with the confirmation fields of ``e`` (see ``LedgerEvent``)."""
    problems = []
    for name in ("confirmed", "params_known"):
        if not isinstance(getattr(e, name), bool):
            problems.append(f"{name}={getattr(e, name)!r} must be a bool")
    if e.rng is not None and e.rng not in RNG_MODES:
        problems.append(f"rng={e.rng!r} must be one of {list(RNG_MODES)} or None")
    if not isinstance(e.code, str) or (e.code and not _CODE_PATTERN.fullmatch(e.code)):
        problems.append(f"code={e.code!r} must be empty or a short lower-case code")
    if e.confirmed and (e.code or not e.params_known):
        problems.append("a confirmed event has known parameters and no code")
    if not e.confirmed and not e.code:
        problems.append("an unconfirmed event needs a code saying why")
    if not isinstance(e.event, PrivacyEvent):
        return problems
    if not e.params_known and (e.sigma != UNKNOWN_SIGMA or e.q != UNKNOWN_Q):
        problems.append(
            f"unknown parameters are recorded as sigma={UNKNOWN_SIGMA}, q={UNKNOWN_Q} "
            f"(found sigma={e.sigma!r}, q={e.q!r})"
        )
    return problems


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
