"""The charge of private steps on the site's own ledger (``client.site_ledger``).

Three steps, in this order within a round: ``plan_charge`` decides whether the steps fit under the
site's cap, composed with its whole ledger and any event still to be charged ahead of them;
``charge`` appends the entry, fsync'ed, BEFORE the steps run; ``check_charged`` compares what the
mechanism's own records say ran with what was charged (the charge stays whatever the outcome).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.records import PrivacyEvent
from prism_runtime.errors import AccountingMismatchError

__all__ = ["Charge", "charge", "check_charged", "plan_charge"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Charge:
    """A charge on the site's ledger, durable before the steps it pays for run.

    Attributes:
        entry: the entry charged.
        history: the events the ledger held before it (the steps' privacy history).
        attempt: its position in the site's own ledger: a reproducible release is seeded by it,
            so a round charged again draws fresh randomness.
    """

    entry: SiteLedgerEntry
    history: tuple[PrivacyEvent, ...]
    attempt: int


def plan_charge(
    ledger: SiteLedger,
    event: PrivacyEvent,
    *,
    server_round: int,
    delta: float,
    cap: float | None,
    before: Sequence[PrivacyEvent] = (),
    site_id: str,
) -> SiteLedgerEntry | None:
    """The entry charging ``event`` in ``server_round``, or None if it would pass the site's cap.

    The ledger is read again first (another process of this site may have charged it).

    Args:
        ledger: the site's ledger.
        event: the planned steps.
        server_round: the round they belong to.
        delta: the delta the run spends at.
        cap: the epsilon they must fit under, composed with the whole ledger; None: never
            capped (a non-private run the site's policy allows is recorded, not capped).
        before: events still to be charged ahead of the steps (a private clip estimate); they
            count in the check.
        site_id: this site, for its log.
    """
    ledger.reload()
    history = [*ledger.events(), *before]
    planned = SiteLedgerEntry(server_round, event, delta)
    if cap is None:
        return planned
    if ledger.epsilon(delta, [*history, planned.event]) > cap:
        log.info(
            "site %s: %d more steps would pass its cap epsilon=%s (spent %.4f at delta=%s)",
            site_id,
            event.steps,
            cap,
            ledger.epsilon(delta, history),
            delta,
        )
        return None
    return planned


def charge(ledger: SiteLedger, entry: SiteLedgerEntry) -> Charge:
    """Append ``entry`` to the ledger; on return it is fsync'ed (``SiteLedger.charge``)."""
    history = tuple(ledger.events())
    attempt = len(ledger.entries())
    ledger.charge(entry)
    return Charge(entry, history, attempt)


def check_charged(
    event: PrivacyEvent, charged: SiteLedgerEntry, *, what: str, site_id: str
) -> None:
    """What ran (``event``, from the mechanism's records) must be what was charged before it ran.

    Args:
        event: the released event of ``what``.
        charged: the entry charged for it.
        what: what ran, for the message ("the mechanism", "the clip estimate").
        site_id: this site, for the message.

    Raises:
        AccountingMismatchError: the mechanism, sigma, q, the step count, the unit or the
            Skellam share differ (``PrivacyEvent.accounted``; the charge stays).
    """
    if event.accounted() != charged.event.accounted():
        raise AccountingMismatchError(
            f"site {site_id} round {charged.server_round}: {what} ran {event} but the site "
            f"charged {charged.event}"
        )
