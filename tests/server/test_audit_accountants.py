"""Audit part (a): PRV, RDP and dp_accounting's PLD agree on every site of a ledger."""

from __future__ import annotations

import math

import pytest
from ledger_events import ledger_event
from scipy.optimize import brentq
from scipy.stats import norm

import server.audit.accountants as acc
from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, epsilon
from server.audit.accountants import check_ledger, check_site, pld_epsilon, pld_tolerance
from server.ledger import Ledger, LedgerEvent

DELTA = 1e-5


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of one Gaussian mechanism (sensitivity 1), Balle & Wang 2018, Thm 8."""

    def gap(eps: float) -> float:
        return (
            norm.cdf(0.5 / sigma - eps * sigma)
            - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma)
            - delta
        )

    return brentq(gap, 0.0, 100.0, xtol=1e-10)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # Opacus PRV at q = 1
@pytest.mark.parametrize("sigma", [1.0, 2.0, 4.0])
def test_pld_and_prv_bracket_the_exact_gaussian_epsilon(sigma):
    exact = exact_gaussian_epsilon(sigma, DELTA)
    pld = pld_epsilon([PrivacyEvent(sigma, 1.0, 1)], DELTA)
    prv = epsilon([PrivacyEvent(sigma, 1.0, 1)], DELTA)
    assert exact - 1e-6 <= pld <= exact + 2e-3  # pessimistic PLD: an upper bound, tight
    assert exact - 1e-6 <= prv <= exact + PRV_EPS_ERROR + 2e-3  # PRV's upper estimate


@pytest.mark.parametrize(
    "history",
    [
        [PrivacyEvent(1.0, 0.05, 15)],
        [PrivacyEvent(0.65, 0.015, 25)],
        [PrivacyEvent(2.0, 0.2, 5), PrivacyEvent(1.0, 0.05, 10), PrivacyEvent(2.0, 0.2, 5)],
    ],
)
def test_accountants_agree_within_the_stated_tolerance(history):
    check = check_site("s", history, DELTA, cap=None)
    assert check.verdict == "pass", check.reasons
    assert abs(check.pld - check.prv) <= pld_tolerance(check.prv)
    assert check.rdp >= check.prv - PRV_EPS_ERROR
    assert check.rdp > check.pld  # RDP is the loosest of the three upper bounds


def test_an_under_reporting_accountant_is_flagged(monkeypatch):
    history = [PrivacyEvent(1.0, 0.05, 15)]
    honest = epsilon(history, DELTA)

    def under_reporting(events, delta, *, accountant="prv"):
        value = epsilon(events, delta, accountant=accountant)
        return 0.8 * value if accountant == "prv" else value

    monkeypatch.setattr(acc, "epsilon", under_reporting)
    check = check_site("s", history, DELTA, cap=None)
    assert check.prv == pytest.approx(0.8 * honest, rel=1e-12)
    assert check.verdict == "FAIL"
    assert any("PLD" in r and "tolerance" in r for r in check.reasons)


def _ev(rnd: int, site: str, **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.05, steps=5, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


def test_every_site_of_a_ledger_is_checked_and_violations_named(tmp_path):
    path = tmp_path / "ledger.sqlite"
    spent_3 = epsilon([PrivacyEvent(1.0, 0.05, 15)], DELTA)
    with Ledger.open(path) as led:
        for r in range(3):
            led.append_many(
                [
                    _ev(r, "ok", epsilon_cap=spent_3 + 0.01),
                    _ev(r, "over-cap", epsilon_cap=spent_3 - 0.05),
                    _ev(r, "mixed", unit="record" if r else "user"),  # never one epsilon
                ]
            )
        led.append(_ev(0, "noiseless", sigma=0.0))
    with Ledger.open(path, create=False, read_only=True) as led:
        checks = {c.site_id: c for c in check_ledger(led)}
    assert set(checks) == {"ok", "over-cap", "mixed", "noiseless"}
    assert checks["ok"].verdict == "pass"
    assert checks["ok"].steps == 15
    assert checks["ok"].prv == pytest.approx(spent_3, rel=1e-12)
    assert checks["over-cap"].verdict == "FAIL"
    assert any("exceeds the site's cap" in r for r in checks["over-cap"].reasons)
    assert checks["mixed"].verdict == "FAIL"
    assert any("cannot be accounted" in r for r in checks["mixed"].reasons)
    assert checks["noiseless"].verdict == "FAIL"
    assert math.isinf(checks["noiseless"].prv) and math.isinf(checks["noiseless"].pld)
    assert checks["noiseless"].to_json()["prv"] == "inf"


def test_pld_refuses_a_history_that_mixes_privacy_units():
    mixed = [PrivacyEvent(1.0, 0.05, 5), PrivacyEvent(1.0, 0.05, 5, unit="user")]
    with pytest.raises(Exception, match="privacy units"):
        pld_epsilon(mixed, DELTA)
    check = check_site("mixed", mixed, DELTA, None)
    assert check.verdict == "FAIL"
    assert any("privacy units" in r for r in check.reasons)


def test_a_site_switched_to_per_person_is_checked_on_its_per_person_events(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append_many([_ev(r, "switched", unit="record") for r in range(2)])
        led.append_many([_ev(r, "switched", unit="user") for r in range(2, 5)])
    with Ledger.open(path, create=False, read_only=True) as led:
        (check,) = check_ledger(led)
    assert check.verdict == "pass"
    assert check.steps == 15  # the three per-person rounds
    per_person = epsilon([PrivacyEvent(1.0, 0.05, 15, unit="user")], DELTA)
    assert check.prv == pytest.approx(per_person, rel=1e-12)
