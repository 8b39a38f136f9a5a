"""Audit part (a): every site's epsilon by three accountants, and the site's cap.

For each site of a ledger the whole history is composed by

- ``prism_core.accounting.epsilon`` (the value prism-fl reports: Opacus' PRV accountant,
  ``eps_error = PRV_EPS_ERROR``, its upper bound, raised to a pessimistic PLD where that is
  larger),
- Opacus' RDP accountant (a looser upper bound: it must never be below PRV by more than PRV's
  error),
- Google's ``dp_accounting`` PLD accountant (an independent implementation of the same
  Poisson-subsampled Gaussian composition under add/remove adjacency; pessimistic
  discretisation, so also an upper bound).

A site fails when its epsilon is infinite (a step ran without noise), when RDP < PRV -
eps_error, when |PLD - PRV| is beyond ``pld_tolerance`` (either direction: PRV under-reporting
is a privacy failure, over-reporting a broken accountant), when the history cannot be accounted
(privacy units mixed), or when PRV exceeds the site's own cap.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, compose_events, epsilon
from prism_core.errors import AccountingError
from server.ledger import Ledger
from server.ledger.budget import accountable

__all__ = [
    "PLD_DISCRETIZATION",
    "SiteCheck",
    "check_ledger",
    "check_site",
    "pld_epsilon",
    "pld_tolerance",
]

PLD_DISCRETIZATION = 1e-4
"""``value_discretization_interval`` of the PLD accountant (dp_accounting's default)."""


def pld_tolerance(prv: float) -> float:
    """Allowed |PLD - PRV|: PRV's stated error twice, plus 0.1 % of epsilon for discretisation.

    Measured here (sigma 0.5-5, q 0.005-1, 1-1000 steps): PRV - PLD = 0.010-0.014, i.e. PRV's
    ``eps_error`` of 0.01 (PRV returns its upper estimate).
    """
    return 2 * PRV_EPS_ERROR + 1e-3 * prv


def pld_epsilon(events: Sequence[PrivacyEvent], delta: float) -> float:
    """Epsilon of the composed history by dp_accounting's PLD accountant (add/remove).

    Raises:
        AccountingError: a history that mixes privacy units (an epsilon per record and one
            per person are different guarantees, as in ``prism_core.accounting.epsilon``).
    """
    history = compose_events(events)
    units = sorted({e.unit for e in history if e.steps > 0})
    if len(units) > 1:
        raise AccountingError(f"cannot compose events of privacy units {units} with PLD")
    if not history:
        return 0.0
    if any(e.noise_multiplier == 0 for e in history):
        return math.inf
    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=PLD_DISCRETIZATION
    )
    for e in history:
        gaussian = dp_event.GaussianDpEvent(e.noise_multiplier)
        event = (
            gaussian
            if e.sample_rate == 1.0
            else dp_event.PoissonSampledDpEvent(e.sample_rate, gaussian)
        )
        accountant.compose(event, e.steps)
    return float(accountant.get_epsilon(delta))


@dataclass(frozen=True)
class SiteCheck:
    """The accountant cross-check of one site. ``verdict`` is ``pass`` or ``FAIL``."""

    site_id: str
    events: int
    steps: int
    delta: float
    epsilon_cap: float | None
    prv: float | None
    rdp: float | None
    pld: float | None
    pld_tolerance: float | None
    verdict: str
    reasons: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        for key in ("prv", "rdp", "pld"):  # JSON has no infinity
            if out[key] is not None and math.isinf(out[key]):
                out[key] = "inf"
        return out


def _compare(prv: float, rdp: float, pld: float, cap: float | None) -> list[str]:
    reasons = []
    if math.isinf(prv) or math.isinf(rdp) or math.isinf(pld):
        if math.isinf(prv) and math.isinf(rdp) and math.isinf(pld):
            reasons.append("epsilon is infinite: steps ran without noise (sigma = 0), no DP claim")
        else:
            reasons.append(f"only some accountants are infinite (PRV {prv}, RDP {rdp}, PLD {pld})")
    else:
        if rdp < prv - PRV_EPS_ERROR:
            reasons.append(
                f"RDP {rdp:.4f} < PRV {prv:.4f} - {PRV_EPS_ERROR}: RDP must be an upper bound"
            )
        tol = pld_tolerance(prv)
        if abs(pld - prv) > tol:
            reasons.append(f"|PLD {pld:.4f} - PRV {prv:.4f}| > tolerance {tol:.4f}")
    if cap is not None and prv > cap:
        reasons.append(f"PRV epsilon {prv:.4f} exceeds the site's cap {cap}")
    return reasons


def check_site(
    site_id: str, events: Sequence[PrivacyEvent], delta: float, cap: float | None
) -> SiteCheck:
    """Cross-check one site's history (its events in ledger order) at ``delta``."""
    steps = sum(e.steps for e in events)
    prv = rdp = pld = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # Opacus' log(0) at q = 1
            prv = epsilon(events, delta, accountant="prv")
            rdp = epsilon(events, delta, accountant="rdp")
            pld = pld_epsilon(events, delta)
    except AccountingError as exc:
        reasons = [f"cannot be accounted: {exc}"]
    else:
        reasons = _compare(prv, rdp, pld, cap)
    tol = pld_tolerance(prv) if prv is not None and math.isfinite(prv) else None
    return SiteCheck(
        site_id=site_id,
        events=len(events),
        steps=steps,
        delta=delta,
        epsilon_cap=cap,
        prv=prv,
        rdp=rdp,
        pld=pld,
        pld_tolerance=tol,
        verdict="FAIL" if reasons else "pass",
        reasons=tuple(reasons),
    )


def check_ledger(ledger: Ledger) -> list[SiteCheck]:
    """``check_site`` for every site of the ledger, at the site's smallest delta.

    The cap compared with is the smallest cap the site reported (None if it never reported one).
    """
    out = []
    for site in ledger.sites():
        events = ledger.events(site_id=site)
        caps = [e.epsilon_cap for e in events if e.epsilon_cap is not None]
        out.append(
            check_site(
                site,
                [e.event for e in accountable(events)],  # a switched site: its per-person part
                ledger.site_delta(site),
                min(caps) if caps else None,
            )
        )
    return out
