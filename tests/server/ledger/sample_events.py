"""Test helper: valid coordinator ledger events of one site with defaults (run ``run-1``,
site ``a``, sigma 1.0, q 0.01, 100 steps, ``DELTA``): ``ev``, an unconfirmed charge
(``unconfirmed``), a private clip estimate (``estimate``, beside the training mechanism
``TRAIN``), the PRV epsilon of a history of such steps (``eps``), and a site's epsilon after each
of its rounds in a ledger (``epsilon_by_round``)."""

from __future__ import annotations

from ledger_events import ledger_event

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from server.ledger import Ledger, LedgerEvent
from server.ledger.budget import epsilon_series

DELTA = 1e-5
TRAIN = "prism-tangent-gaussian"


def ev(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    """A valid event; keyword arguments override the defaults."""
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.01, steps=100, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


def unconfirmed(rnd: int, site: str = "a", code: str = "no-reply", **kw: object) -> LedgerEvent:
    return ev(rnd, site, confirmed=False, code=code, **kw)


def estimate(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    return ev(rnd, site, **{"mechanism": QUANTILE_MECHANISM, "sigma": 6.4, "steps": 30, **kw})


def eps(*steps_sigma: tuple[int, float]) -> float:
    return epsilon([PrivacyEvent(sigma, 0.01, steps) for steps, sigma in steps_sigma], DELTA)


def epsilon_by_round(
    ledger: Ledger, site_id: str, *, delta: float | None = None
) -> list[tuple[int, float]]:
    """PRV epsilon of a site after each round it took part in (ran steps > 0), in order.

    Each value composes the site's whole history up to and including that round (all runs,
    in insertion order); ``delta`` defaults to the site's smallest delta as in
    ``Ledger.epsilon``. With several runs the round numbers restart; the list stays in ledger
    order.
    """
    events = ledger.events(site_id=site_id)
    if not events:
        return []
    return epsilon_series(events, min(e.delta for e in events) if delta is None else delta)
