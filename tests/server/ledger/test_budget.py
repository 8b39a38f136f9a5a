"""Epsilon of a site's ledger history (``server.ledger.budget``, read through ``Ledger``):
against Opacus' accountants on the same history, per round, with the smallest delta,
unknown parameters as infinite epsilon, and the cap check at its edge (a re-run round
judged on the history before it, an unaccountable history never runnable); under secure
aggregation, the honest sites a site's epsilon counts on and its epsilon if the other sites
collude."""

from __future__ import annotations

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from ledger.sample_events import DELTA, epsilon_by_round, ev, unconfirmed
from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, collusion_epsilon, epsilon
from prism_core.errors import AccountingError
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM
from server.errors import LedgerError
from server.ledger import UNKNOWN_HONEST_SITES, UNKNOWN_Q, UNKNOWN_SIGMA, Ledger
from server.ledger.budget import history_collusion_epsilon, honest_sites, secure


def opacus_epsilon(history: list[tuple[float, float, int]], delta: float, kind: str) -> float:
    acc = PRVAccountant() if kind == "prv" else RDPAccountant()
    acc.history = list(history)
    if kind == "prv":
        return float(acc.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))
    return float(acc.get_epsilon(delta=delta))


def test_epsilon_equals_accountant_on_same_history(ledger: Ledger) -> None:
    for r in range(3):
        assert ledger.append(ev(r))
    report = ledger.epsilon("a")
    one_event = epsilon([PrivacyEvent(1.0, 0.01, 300)], DELTA)
    assert report.delta == DELTA
    assert report.prv == pytest.approx(one_event, rel=1e-12)
    assert report.prv == pytest.approx(opacus_epsilon([(1.0, 0.01, 300)], DELTA, "prv"), rel=1e-9)
    assert report.rdp == pytest.approx(opacus_epsilon([(1.0, 0.01, 300)], DELTA, "rdp"), rel=1e-9)
    assert report.rdp >= report.prv
    assert 0.5 < report.prv < 2.0  # sanity: a known regime, not a degenerate 0 or inf


@pytest.mark.parametrize(("sigma", "q", "steps"), [(0.8, 0.05, 40), (2.0, 0.1, 60)])
def test_rdp_never_below_prv_and_sites_are_separate(
    ledger: Ledger, sigma: float, q: float, steps: int
) -> None:
    ledger.append_many([ev(0, "a", sigma=sigma, q=q, steps=steps), ev(0, "b", steps=10)])
    a, b = ledger.epsilon("a"), ledger.epsilon("b")
    assert a.rdp >= a.prv > 0
    assert a.prv == pytest.approx(opacus_epsilon([(sigma, q, steps)], DELTA, "prv"), rel=1e-9)
    assert b.prv == pytest.approx(epsilon([PrivacyEvent(1.0, 0.01, 10)], DELTA), rel=1e-12)
    assert ledger.sites() == ["a", "b"]


def test_epsilon_by_round_recomputes_each_prefix(ledger: Ledger) -> None:
    ledger.append_many([ev(0, steps=50), ev(1, steps=0), ev(2, steps=50, sigma=1.2)])
    series = epsilon_by_round(ledger, "a")
    assert [r for r, _ in series] == [0, 2]  # round 1 ran no steps
    expected = [
        epsilon([PrivacyEvent(1.0, 0.01, 50)], DELTA),
        epsilon([PrivacyEvent(1.0, 0.01, 50), PrivacyEvent(1.2, 0.01, 50)], DELTA),
    ]
    assert [e for _, e in series] == pytest.approx(expected, rel=1e-12)
    assert series[-1][1] == pytest.approx(ledger.epsilon("a").prv, rel=1e-12)
    assert epsilon_by_round(ledger, "nobody") == []


def test_different_deltas_use_the_smallest(ledger: Ledger) -> None:
    ledger.append_many([ev(0, delta=1e-4, steps=50), ev(1, delta=1e-6, steps=50)])
    report = ledger.epsilon("a")
    assert report.delta == 1e-6
    assert report.prv == pytest.approx(epsilon([PrivacyEvent(1.0, 0.01, 100)], 1e-6), rel=1e-12)
    assert ledger.epsilon("a", delta=1e-4).prv < report.prv


def test_unknown_site(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="no events of site 'x'"):
        ledger.epsilon("x")
    assert ledger.epsilon("x", delta=DELTA).prv == 0.0


def test_can_run_against_the_cap(ledger: Ledger) -> None:
    for r in range(3):
        ledger.append(ev(r))
    after_next = epsilon([PrivacyEvent(1.0, 0.01, 400)], DELTA)
    kw = dict(sigma=1.0, q=0.01, steps=100, delta=DELTA)
    assert ledger.can_run("a", epsilon_cap=after_next + 1e-3, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=after_next - 1e-3, **kw)  # type: ignore[arg-type]
    # already past: even one step is refused; a fresh site is judged on the new round alone
    assert not ledger.can_run("a", epsilon_cap=1.0, sigma=1.0, q=0.01, steps=1, delta=DELTA)
    fresh = epsilon([PrivacyEvent(1.0, 0.01, 100)], DELTA)
    assert ledger.can_run("new", epsilon_cap=fresh + 1e-3, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("new", epsilon_cap=fresh - 1e-3, **kw)  # type: ignore[arg-type]


def test_unaccountable_history_is_never_runnable(ledger: Ledger) -> None:
    # per person, then per record (the reverse of a site's switch): no one epsilon
    ledger.append_many([ev(0, unit="user"), ev(1)])
    with pytest.raises(AccountingError, match="privacy units"):
        ledger.epsilon("a")
    assert not ledger.can_run("a", sigma=5.0, q=0.01, steps=1, epsilon_cap=100.0, delta=DELTA)


def test_a_round_that_ends_exactly_at_the_cap_may_run(ledger: Ledger) -> None:
    for r in range(3):
        ledger.append(ev(r))
    exact = epsilon([PrivacyEvent(1.0, 0.01, 100)] * 4, DELTA)  # the history plus the round
    kw = dict(sigma=1.0, q=0.01, steps=100, delta=DELTA)
    assert ledger.can_run("a", epsilon_cap=exact, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=exact * (1 - 1e-9), **kw)  # type: ignore[arg-type]


def test_a_rerun_round_is_judged_on_the_history_before_it(ledger: Ledger) -> None:
    """``before=(run, round)`` leaves out that run's events of that round and later, and
    keeps every other run's events whatever their round numbers."""
    ledger.append(ev(5, run_id="run-0", steps=30))
    ledger.append_many([ev(0, steps=10), ev(1, steps=20), ev(2, steps=40)])
    new = PrivacyEvent(1.0, 0.01, 50)
    kept = [PrivacyEvent(1.0, 0.01, 30), PrivacyEvent(1.0, 0.01, 10), new]
    exact = epsilon(kept, DELTA)
    kw = dict(sigma=1.0, q=0.01, steps=50, delta=DELTA, before=("run-1", 1))
    assert ledger.can_run("a", epsilon_cap=exact, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=exact * (1 - 1e-9), **kw)  # type: ignore[arg-type]


def test_the_round_series_has_one_point_per_round_that_ran_steps(ledger: Ledger) -> None:
    ledger.append_many(
        [
            ev(0, steps=0),  # the first round ran nothing: no point
            ev(1, steps=1),  # one step: a point
            ev(2, steps=2, mechanism=QUANTILE_MECHANISM),  # a clip estimate and the training of the
            ev(2, steps=40),  # same round: one point, after both
        ]
    )
    series = epsilon_by_round(ledger, "a")
    assert [r for r, _ in series] == [1, 2]
    history = [PrivacyEvent(1.0, 0.01, 1), PrivacyEvent(1.0, 0.01, 2), PrivacyEvent(1.0, 0.01, 40)]
    assert series[-1][1] == pytest.approx(epsilon(history, DELTA), rel=1e-12)
    # an explicit delta is used, not the site's own
    at = epsilon_by_round(ledger, "a", delta=1e-3)
    assert at[-1][1] == pytest.approx(epsilon(history, 1e-3), rel=1e-12)
    assert at[-1][1] < series[-1][1]


def test_an_unaccountable_site_is_named_in_the_warning(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append_many([ev(0, site="site-7", unit="user"), ev(1, site="site-7")])
    with caplog.at_level("WARNING", logger="server.ledger"):
        assert not ledger.can_run(
            "site-7", sigma=5.0, q=0.01, steps=1, epsilon_cap=100.0, delta=DELTA
        )
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("ledger: site site-7 cannot be accounted (")
    assert "privacy units" in message and message.endswith("); not selected")


def test_unknown_parameters_are_accounted_as_infinite_epsilon(ledger: Ledger) -> None:
    ledger.append(
        unconfirmed(1, "node-9", sigma=UNKNOWN_SIGMA, q=UNKNOWN_Q, params_known=False, steps=2)
    )
    assert ledger.epsilon("node-9").prv == float("inf")
    assert ledger.last_confirmed("node-9") is None
    assert not ledger.can_run(
        "node-9", sigma=1.0, q=0.01, steps=1, epsilon_cap=1e9, delta=DELTA
    )  # worst case: no room left


def _secure(rnd: int, honest: int, share: float, **kw: object):
    return ev(rnd, mechanism=SKELLAM_MECHANISM, honest_sites=honest, share_sigma=share, **kw)


def test_a_secure_sites_honest_sites_are_its_fewest_and_its_collusion_epsilon_its_shares(
    ledger: Ledger,
) -> None:
    """The honest sites a site's epsilon counts on are the smallest H of its secure rounds that
    ran steps with known parameters; its epsilon if the other sites collude is
    ``prism_core.accounting.collusion_epsilon`` of its whole history (a clip estimate's event
    included), at least its charged epsilon."""
    ledger.append_many(
        [
            ev(0, mechanism=QUANTILE_MECHANISM, sigma=6.4, steps=30),
            _secure(0, 4, 0.5),
            _secure(1, 3, 0.6, sigma=1.2),
            _secure(2, 2, 0.5, steps=0),  # ran nothing: counts on nobody
        ]
    )
    events = ledger.events("a")
    assert secure(events) and honest_sites(events) == 3
    history = [e.event for e in events]
    expected = collusion_epsilon(history, DELTA)
    assert history_collusion_epsilon(events, DELTA) == pytest.approx(expected, rel=1e-12)
    assert ledger.collusion_epsilon("a") == pytest.approx(expected, rel=1e-12)
    assert ledger.collusion_epsilon("a") >= ledger.epsilon("a").prv
    assert ledger.collusion_epsilon("b", delta=DELTA) == 0.0  # no events: nothing spent
    with pytest.raises(LedgerError, match="no events of site 'b'"):
        ledger.collusion_epsilon("b")


def test_a_site_without_secure_rounds_counts_on_no_honest_site(ledger: Ledger) -> None:
    ledger.append_many([ev(0), _secure(1, 3, 0.5, steps=0)])
    events = ledger.events("a")
    assert not secure(events) and honest_sites(events) is None


def test_unknown_parameters_of_a_secure_run_count_on_no_known_honest_site(ledger: Ledger) -> None:
    """A secure run's charge of unknown parameters (``UNKNOWN_HONEST_SITES``, share sigma 0) is
    secure, accounted as infinite both ways, and states no honest sites of its own."""
    ledger.append(
        unconfirmed(
            1,
            "node-9",
            sigma=UNKNOWN_SIGMA,
            q=UNKNOWN_Q,
            params_known=False,
            mechanism=SKELLAM_MECHANISM,
            honest_sites=UNKNOWN_HONEST_SITES,
            share_sigma=UNKNOWN_SIGMA,
        )
    )
    events = ledger.events("node-9")
    assert secure(events) and honest_sites(events) is None
    assert ledger.epsilon("node-9").prv == ledger.collusion_epsilon("node-9") == float("inf")
