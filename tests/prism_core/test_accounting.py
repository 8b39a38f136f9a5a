"""Accounting against Opacus: golden values, calibration never overshoots, RDP >= PRV."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import signal
import warnings
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.special import gammaln, logsumexp
from scipy.stats import norm

from prism_core.accounting import (
    PRV_EPS_ERROR,
    PRV_EPSILON_MAX,
    PRV_STEPS_MAX,
    SIGMA_MIN,
    PrivacyEvent,
    calibrate_noise_multiplier,
    compose_events,
    epsilon,
    epsilon_report,
    group_privacy,
    group_record_budget,
    history_unit,
    max_steps,
)
from prism_core.errors import AccountingError, PrivacyParameterError
from prism_core.records import ADJACENCY, DEFAULT_MECHANISM, PRIVACY_UNITS, SAMPLING

RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
"""Opacus' default RDP orders (``RDPAccountant.DEFAULT_ALPHAS``), written out."""


def _rdp_to_epsilon(rdp_of_order, delta, orders):
    """RDP -> (epsilon, delta) by Balle et al. 2020, Thm 21 (the conversion Opacus uses):
    ``eps = min_a rdp(a) - (log delta + log a) / (a - 1) + log((a - 1) / a)``."""
    return min(
        rdp_of_order(a) - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        for a in orders
    )


def test_golden_prv_and_rdp_are_opacus_own_accountants_stepped_by_hand():
    """sigma=1, q=0.01, 1000 steps, delta=1e-5 (PLATFORM-NOTES: PRV 1.838, RDP 2.101). Source:
    Opacus' ``PRVAccountant`` / ``RDPAccountant`` stepped 1000 times through their public
    ``step`` API, PRV at the ``eps_error`` prism_core documents (``PRV_EPS_ERROR``)."""
    prv, rdp = PRVAccountant(), RDPAccountant()
    for _ in range(1000):
        prv.step(noise_multiplier=1.0, sample_rate=0.01)
        rdp.step(noise_multiplier=1.0, sample_rate=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        golden_prv = prv.get_epsilon(delta=1e-5, eps_error=PRV_EPS_ERROR)
        golden_rdp = rdp.get_epsilon(delta=1e-5)
    report = epsilon_report([PrivacyEvent(1.0, 0.01, 1000)], 1e-5)
    assert report.prv == pytest.approx(golden_prv, rel=1e-9)
    assert report.rdp == pytest.approx(golden_rdp, rel=1e-9)
    assert (round(report.prv, 3), round(report.rdp, 3)) == (1.838, 2.101)


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (2.0, 10), (5.0, 50)])
def test_without_subsampling_prv_is_the_exact_gaussian_epsilon(sigma, steps):
    """q = 1: ``steps`` Gaussian mechanisms of sensitivity 1 compose to ONE Gaussian with
    ``mu = sqrt(steps) / sigma`` (Dong, Roth, Su 2019, Cor. 3.3), whose exact privacy profile is
    ``delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)`` (Balle & Wang 2018, Thm 8).
    PRV's ``eps_upper`` is an upper bound within its discretisation error of that (seen: +0.0104
    for eps_error 0.01)."""
    delta, mu = 1e-5, math.sqrt(steps) / sigma

    def profile(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) - delta

    exact = brentq(profile, 0.0, 100.0, xtol=1e-12)
    got = epsilon([PrivacyEvent(sigma, 1.0, steps)], delta)
    assert exact <= got <= exact + 2 * PRV_EPS_ERROR


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (2.0, 10), (5.0, 50)])
def test_without_subsampling_rdp_is_the_gaussian_closed_form(sigma, steps):
    """q = 1: the Gaussian mechanism has RDP ``a / (2 sigma^2)`` at order a (Mironov 2017,
    Prop. 7), composed additively over the steps, converted over Opacus' orders."""
    closed = _rdp_to_epsilon(lambda a: steps * a / (2 * sigma**2), 1e-5, RDP_ORDERS)
    got = epsilon([PrivacyEvent(sigma, 1.0, steps)], 1e-5, accountant="rdp")
    assert got == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.01, 1000), (0.8, 0.05, 200)])
def test_subsampled_rdp_against_the_integer_order_closed_form(sigma, q, steps):
    """Poisson-subsampled Gaussian, integer orders a: ``exp((a - 1) RDP(a)) = sum_k C(a, k)
    (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2))`` (Mironov, Talwar, Zhang 2019, Sec. 3.3).
    Over the integer orders 2..63 alone this epsilon can only be larger than Opacus' (which also
    uses fractional orders), and it is within 1 % of it (seen: 0.3 %)."""

    def rdp(a):
        log_terms = [
            gammaln(a + 1)
            - gammaln(k + 1)
            - gammaln(a - k + 1)
            + (a - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * sigma**2)
            for k in range(a + 1)
        ]
        return steps * float(logsumexp(log_terms)) / (a - 1)

    closed = _rdp_to_epsilon(rdp, 1e-5, range(2, 64))
    got = epsilon([PrivacyEvent(sigma, q, steps)], 1e-5, accountant="rdp")
    assert got <= closed <= got * 1.01


def test_history_split_into_rounds_composes_like_one_run():
    whole = epsilon([PrivacyEvent(1.0, 0.01, 1000)], 1e-5)
    split = epsilon([PrivacyEvent(1.0, 0.01, 250)] * 4, 1e-5)
    assert split == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize(
    ("sigma", "q", "steps"), [(0.8, 0.05, 200), (1.5, 0.001, 5000), (3.0, 0.2, 50), (0.6, 0.01, 10)]
)
def test_rdp_is_never_smaller_than_prv(sigma, q, steps):
    report = epsilon_report([PrivacyEvent(sigma, q, steps)], 1e-5)
    assert report.rdp >= report.prv > 0


@settings(max_examples=8, deadline=None)
@given(
    target=st.floats(0.5, 10.0),
    q=st.floats(0.001, 0.2),
    steps=st.integers(10, 2000),
)
def test_calibrated_sigma_never_overshoots(target, q, steps):
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps
    )
    eps = epsilon([PrivacyEvent(sigma, q, steps)], 1e-5)
    assert eps <= target
    assert eps >= target * (1 - 0.005) - 1e-9  # tight: within the 0.5 % tolerance


def test_degenerate_histories():
    assert epsilon([], 1e-5) == 0.0
    assert epsilon([PrivacyEvent(0.0, 0.1, 1)], 1e-5) == math.inf
    columns = {"sigma": 1.0, "q": 0.1, "steps": 10, "mechanism": DEFAULT_MECHANISM}
    for name, other in (("sampling", "shuffle"), ("adjacency", "replace-one")):
        with pytest.raises(PrivacyParameterError, match=re.escape(f"{name}={other!r} is not")):
            PrivacyEvent.from_columns({**columns, name: other})  # no such event is accounted
    stated = PrivacyEvent.from_columns({**columns, "sampling": SAMPLING, "adjacency": ADJACENCY})
    assert stated == PrivacyEvent(1.0, 0.1, 10)
    with pytest.raises(PrivacyParameterError, match="delta"):
        epsilon([PrivacyEvent(1.0, 0.1, 10)], 0.0)
    with pytest.raises(PrivacyParameterError, match="sample_rate"):
        PrivacyEvent(1.0, 0.0, 10)
    with pytest.raises(PrivacyParameterError, match="target_epsilon"):
        calibrate_noise_multiplier(target_epsilon=0.0, delta=1e-5, sample_rate=0.1, steps=10)


def test_compose_events_merges_the_mechanisms_equal_steps():
    rec = PrivacyEvent(1.1, 0.01, 1, max_norm=0.5, expected_batch_size=32.0)
    other = replace(rec, noise_multiplier=0.9)
    events = compose_events([rec, rec, rec, other, rec])
    assert [(e.noise_multiplier, e.steps) for e in events] == [(1.1, 3), (0.9, 1), (1.1, 1)]
    assert events[0] == replace(rec, steps=3)  # the merged event keeps C, b and the mechanism
    assert compose_events([PrivacyEvent(1.0, 0.1, 0)]) == []
    # another mechanism (or clip) at the same sigma and q is its own event, accounted the same
    quantile = replace(rec, mechanism="quantile-count")
    assert len(compose_events([rec, quantile])) == 2
    assert epsilon([rec, quantile], 1e-5) == epsilon([replace(rec, steps=2)], 1e-5)


def test_events_of_different_privacy_units_never_compose_into_one_epsilon():
    """The unit is part of what an event commits to: a record-level and a person-level event
    stay two events, and a history that mixes them is refused (a record-level epsilon converts
    to a person-level one only by group privacy, never silently)."""
    rec = PrivacyEvent(1.1, 0.01, 3)
    user = replace(rec, unit="user")
    assert rec.unit == "record" and PRIVACY_UNITS == ("record", "user")
    assert not rec.same_but_steps(user) and rec.accounted() != user.accounted()
    assert compose_events([rec, user]) == [rec, user]
    assert epsilon([user, user], 1e-5) == epsilon([rec, rec], 1e-5) > 0  # same maths per unit
    for history in ([rec, user], [user, rec], [rec, replace(user, steps=0), user]):
        for accountant in ("prv", "rdp"):
            with pytest.raises(AccountingError, match=r"privacy units \['record', 'user'\]"):
                epsilon(history, 1e-5, accountant=accountant)  # type: ignore[arg-type]
    assert epsilon([rec, replace(user, steps=0)], 1e-5) == epsilon([rec], 1e-5)  # no steps
    # further steps are of the history's unit, so a person-level budget can be checked
    assert (history_unit([]), history_unit([rec, user])) == ("record", "user")
    more = {"noise_multiplier": 1.1, "sample_rate": 0.01, "delta": 1e-5, "limit": 10}
    assert max_steps([user], target_epsilon=10.0, **more) == 10
    with pytest.raises(PrivacyParameterError, match=r"unit='household' must be one of"):
        PrivacyEvent(1.1, 0.01, 3, unit="household")
    assert (
        PrivacyEvent.from_columns({"sigma": 1.1, "q": 0.01, "steps": 3, "mechanism": rec.mechanism})
        == rec
    )
    assert (
        PrivacyEvent.from_columns(
            {"sigma": 1.1, "q": 0.01, "steps": 3, "mechanism": rec.mechanism, "unit": "user"}
        )
        == user
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"noise_multiplier": -1.0}, "sigma=-1.0"),
        ({"noise_multiplier": math.nan}, "sigma=nan"),
        ({"noise_multiplier": True}, "sigma=True"),
        ({"sample_rate": 1.5}, "q=1.5"),
        ({"steps": 1.5}, "steps=1.5"),
        ({"steps": -1}, "steps=-1"),
        ({"mechanism": " "}, "mechanism=' '"),
        ({"max_norm": 0.0}, "max_norm=0.0"),
        ({"expected_batch_size": math.inf}, "expected_batch_size=inf"),
    ],
)
def test_an_event_out_of_range_is_refused_naming_the_field(change, message):
    fields = {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 1} | change
    with pytest.raises(PrivacyParameterError, match=re.escape(message)):
        PrivacyEvent(**fields)


def test_max_steps_is_the_last_step_within_the_target():
    history = [PrivacyEvent(1.0, 0.02, 100)]
    k = max_steps(
        history, noise_multiplier=1.0, sample_rate=0.02, delta=1e-5, target_epsilon=2.0, limit=5000
    )
    assert 0 < k < 5000
    assert epsilon([*history, PrivacyEvent(1.0, 0.02, k)], 1e-5) <= 2.0
    assert epsilon([*history, PrivacyEvent(1.0, 0.02, k + 1)], 1e-5) > 2.0
    spent = epsilon(history, 1e-5)
    assert (
        max_steps(
            history,
            noise_multiplier=1.0,
            sample_rate=0.02,
            delta=1e-5,
            target_epsilon=spent * 0.99,
            limit=10,
        )
        == 0
    )


def test_equal_histories_are_accounted_once_and_match_a_fresh_accountant(monkeypatch):
    from opacus.accountants import PRVAccountant

    calls = []
    original = PRVAccountant.get_epsilon

    def counting(self, *args, **kwargs):
        calls.append(list(self.history))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PRVAccountant, "get_epsilon", counting)
    history = [PrivacyEvent(0.93, 0.0123, 7), PrivacyEvent(0.93, 0.0123, 3)]  # composes to 10
    first = epsilon(history, 1e-5)
    again = epsilon([PrivacyEvent(0.93, 0.0123, 10)], 1e-5)  # the same composed history
    other = epsilon([PrivacyEvent(0.93, 0.0123, 11)], 1e-5)
    assert calls == [[(0.93, 0.0123, 10)], [(0.93, 0.0123, 11)]]
    fresh = PRVAccountant()
    fresh.history = [(0.93, 0.0123, 10)]
    assert first == again == pytest.approx(fresh.get_epsilon(delta=1e-5, eps_error=0.01), rel=1e-12)
    assert other > first


@pytest.mark.parametrize(
    ("prefix", "q", "steps", "target"),
    [
        (PrivacyEvent(6.4, 0.18, 30), 0.18, 15, 3.0),  # a private clip estimate, then training
        (PrivacyEvent(2.0, 0.05, 20), 0.02, 300, 3.0),
        (PrivacyEvent(2.0, 0.05, 20), 0.1, 30, 0.8),  # a small target: a longer bisection
    ],
)
def test_calibration_after_a_history_meets_the_target_with_it_and_needs_more_noise(
    prefix, q, steps, target
):
    delta = 1e-5
    fresh = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sample_rate=q, steps=steps
    )
    with _ends_within(20):  # a bisection that never ends fails instead of hanging
        sigma = calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, sample_rate=q, steps=steps, history=[prefix]
        )
    eps = epsilon([prefix, PrivacyEvent(sigma, q, steps)], delta)
    assert eps <= target
    assert eps >= target * (1 - 0.005) - 1e-9  # as tight as the fresh calibration
    assert sigma > fresh  # the prefix's spend is paid for by more noise on the steps
    assert epsilon([prefix, PrivacyEvent(fresh, q, steps)], delta) > target  # fresh is too small


def test_calibration_refuses_a_history_that_alone_spends_the_target():
    spent = PrivacyEvent(0.5, 0.5, 100)
    assert epsilon([spent], 1e-5) > 3.0
    with pytest.raises(PrivacyParameterError, match="earlier events alone spend"):
        calibrate_noise_multiplier(
            target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=10, history=[spent]
        )


def test_calibration_with_an_empty_or_zero_step_history_is_the_fresh_one():
    fresh = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=0.02, steps=50)
    for history in ([], [PrivacyEvent(1.0, 0.1, 0)]):
        again = calibrate_noise_multiplier(
            target_epsilon=2.0, delta=1e-5, sample_rate=0.02, steps=50, history=history
        )
        assert again == fresh


# -- edges and cross-checks ----------------------------------------------------------------------


def test_a_zero_step_event_is_not_accounted_whatever_it_states():
    """A zero-step event (a refused or empty round) spends nothing: not even one without noise
    (which would make epsilon infinite) or of another privacy unit (which would raise)."""
    steps = PrivacyEvent(1.0, 0.01, 10)
    alone = epsilon([steps], 1e-5)
    assert epsilon([PrivacyEvent(0.0, 0.1, 0), steps], 1e-5) == alone
    assert epsilon([PrivacyEvent(1.0, 0.1, 0, unit="user"), steps], 1e-5) == alone


def test_an_unknown_accountant_is_refused_and_the_report_uses_both():
    history = [PrivacyEvent(1.0, 0.02, 200)]
    for name in ("RDP", "gdp", ""):
        with pytest.raises(AccountingError, match=re.escape(f"accountant={name!r}")):
            epsilon(history, 1e-5, accountant=name)
    report = epsilon_report(history, 1e-4)
    rdp = RDPAccountant()
    rdp.history = [(1.0, 0.02, 200)]
    prv = PRVAccountant()
    prv.history = [(1.0, 0.02, 200)]
    assert report.delta == 1e-4
    assert report.rdp == pytest.approx(rdp.get_epsilon(delta=1e-4), rel=1e-12)
    assert report.prv == pytest.approx(prv.get_epsilon(delta=1e-4, eps_error=0.01), rel=1e-12)


def test_the_cross_check_allows_prv_up_to_its_discretisation_error_above_rdp(monkeypatch):
    """PRV is an estimate within ``PRV_EPS_ERROR``: PRV = RDP + that error passes, more raises
    naming both values. Also at a tiny epsilon, where both lie within that error of zero."""
    # at a large delta both accountants give epsilon 0 (Opacus' own values are negative there):
    # equal, so no false alarm
    tiny = epsilon_report([PrivacyEvent(50.0, 0.01, 1)], 0.5)
    assert tiny.prv == tiny.rdp == 0.0
    values = {}
    monkeypatch.setattr(
        "prism_core.accounting.epsilon",
        lambda events, delta, accountant, group_size=None: values[accountant],
    )
    values.update(rdp=1.0, prv=1.0 + PRV_EPS_ERROR)
    assert epsilon_report([], 1e-5).prv == 1.0 + PRV_EPS_ERROR
    values.update(rdp=1.0, prv=1.5)
    with pytest.raises(AccountingError, match=re.escape("RDP epsilon 1.0000 < PRV epsilon 1.5000")):
        epsilon_report([], 1e-5)


def test_calibration_takes_one_step_and_a_full_batch_and_refuses_what_is_outside():
    for q, steps in ((0.05, 1), (1.0, 10)):  # the smallest history and q = 1 (every row)
        sigma = calibrate_noise_multiplier(
            target_epsilon=2.0, delta=1e-5, sample_rate=q, steps=steps
        )
        eps = epsilon([PrivacyEvent(sigma, q, steps)], 1e-5)
        assert 2.0 * (1 - 0.005) - 1e-9 <= eps <= 2.0
    for kw, message in (
        ({"relative_tolerance": 0.0}, "relative_tolerance=0.0 must be in (0, 1)"),
        ({"relative_tolerance": 1.0}, "relative_tolerance=1.0 must be in (0, 1)"),
        ({"relative_tolerance": 1.5}, "relative_tolerance=1.5 must be in (0, 1)"),
        ({"steps": 0}, "steps=0 must be >= 1"),
        ({"sample_rate": 0.0}, "sample_rate=0.0 must be in (0, 1]"),
        ({"sample_rate": 1.5}, "sample_rate=1.5 must be in (0, 1]"),
    ):
        args = {"target_epsilon": 2.0, "delta": 1e-5, "sample_rate": 0.05, "steps": 10} | kw
        # a tolerance of 0 let through would never end Opacus' bisection: fail, do not hang
        with _ends_within(20), pytest.raises(PrivacyParameterError, match=re.escape(message)):
            calibrate_noise_multiplier(**args)


def test_calibration_after_a_history_that_leaves_little_room_doubles_sigma_until_it_fits():
    """The history spends 0.524 of a 0.58 target: twice the fresh sigma is not enough, so the
    upper end is doubled before the bisection (result: epsilon within the tolerance)."""
    prefix, q, steps, target = PrivacyEvent(2.0, 0.05, 20), 0.02, 300, 0.58
    fresh = calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps
    )
    assert epsilon([prefix, PrivacyEvent(2 * fresh, q, steps)], 1e-5) > target  # must double
    with _ends_within(20):
        sigma = calibrate_noise_multiplier(
            target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps, history=[prefix]
        )
    eps = epsilon([prefix, PrivacyEvent(sigma, q, steps)], 1e-5)
    assert target * (1 - 0.005) - 1e-9 <= eps <= target
    assert sigma > 2 * fresh


def test_calibration_refuses_a_history_that_spends_exactly_the_target():
    prefix = PrivacyEvent(2.0, 0.05, 20)
    spent = epsilon([prefix], 1e-5)
    with pytest.raises(PrivacyParameterError, match="earlier events alone spend"):
        calibrate_noise_multiplier(
            target_epsilon=spent, delta=1e-5, sample_rate=0.02, steps=10, history=[prefix]
        )


@contextlib.contextmanager
def _ends_within(seconds):
    """Fail (TimeoutError) a block that does not end within ``seconds``: a bisection that never
    ends fails its test instead of hanging the run. The blocks guarded here take under 2 s on
    an idle machine; 20 s stays below mutmut's limit (at least 30 CPU seconds), so a mutant
    that loops forever counts as killed, not as a timeout."""

    def _hang(signum, frame):
        raise TimeoutError(f"did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_calibration_after_a_history_ends_when_epsilon_jumps_over_the_tolerance(monkeypatch):
    """PRV is a discretised estimate: epsilon can jump across the tolerance band below the
    target. The bisection then ends when its ends meet (to 1e-9 relative), at the end that
    fits; an alarm fails a loop that would never end. Epsilon here is a step function of
    sigma, so no sigma lands in the band."""
    import prism_core.accounting as accounting

    jump, spent, target = 4.0, 0.5, 3.0

    def stepped(events, delta, **kw):
        if len(events) == 1:
            return spent  # the history alone
        return target + 1.0 if events[-1].noise_multiplier < jump else 1.0

    monkeypatch.setattr(accounting, "epsilon", stepped)
    with _ends_within(20):
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=target, delta=1e-5, sample_rate=0.1, steps=30,
            history=[PrivacyEvent(2.0, 0.05, 20)],
        )  # fmt: skip
    assert jump <= sigma <= jump * (1 + 1e-8)  # the smallest sigma that fits, to 1e-9


def test_max_steps_at_the_edges_of_its_limit_and_of_the_budget():
    kw = {"noise_multiplier": 1.0, "sample_rate": 0.02, "delta": 1e-5}
    assert max_steps([], target_epsilon=2.0, limit=0, **kw) == 0  # nothing asked, nothing run
    assert max_steps([], target_epsilon=2.0, limit=1, **kw) == 1  # one asked, room for it
    with pytest.raises(PrivacyParameterError, match=re.escape("limit=-1 must be >= 0")):
        max_steps([], target_epsilon=2.0, limit=-1, **kw)
    # a budget with room for exactly one step: between epsilon after 1 and after 2 steps
    one, two = (epsilon([PrivacyEvent(1.0, 0.02, k)], 1e-5) for k in (1, 2))
    assert one < two
    assert max_steps([], target_epsilon=(one + two) / 2, limit=10, **kw) == 1


def test_max_steps_equals_a_step_by_step_search():
    """Against the plain definition: the largest k <= limit whose epsilon stays within the
    target, found by trying k = 1, 2, ... (budgets half-way between k and k + 1 steps)."""
    kw = {"noise_multiplier": 0.8, "sample_rate": 0.05, "delta": 1e-5}
    history = [PrivacyEvent(0.8, 0.05, 3)]
    eps = [epsilon([*history, PrivacyEvent(0.8, 0.05, k)], 1e-5) for k in range(1, 14)]
    assert all(a < b for a, b in itertools.pairwise(eps))  # strictly growing
    for k in (1, 2, 3, 6, 9, 12):
        target = (eps[k - 1] + eps[k]) / 2  # room for k steps, not k + 1
        found = max(j for j in range(13) if j == 0 or eps[j - 1] <= target)
        assert found == k
        with _ends_within(20):
            assert max_steps(history, target_epsilon=target, limit=13, **kw) == k


def test_delta_outside_the_open_unit_interval_is_refused():
    for delta in (0.0, 1.0, 1.5, -1e-5):
        with pytest.raises(PrivacyParameterError, match=re.escape(f"delta={delta!r}")):
            epsilon([PrivacyEvent(1.0, 0.1, 10)], delta)


def test_compose_events_drops_a_zero_step_event_and_keeps_what_follows():
    rec = PrivacyEvent(1.1, 0.01, 1)
    assert compose_events([rec, PrivacyEvent(1.1, 0.01, 0), rec]) == [replace(rec, steps=2)]
    assert compose_events([PrivacyEvent(2.0, 0.5, 0), rec]) == [rec]


def test_an_unreachable_calibration_says_what_to_change():
    with pytest.raises(PrivacyParameterError) as info:
        calibrate_noise_multiplier(target_epsilon=1e-3, delta=1e-5, sample_rate=1.0, steps=1000)
    message = str(info.value)
    for part in ("epsilon=0.001", "delta=1e-05", "q=1.0", "1000 steps", "Raise the budget"):
        assert part in message


# -- bounded accountant calls (a coordinator's extreme numbers) ----------------------------------


def _rdp(history, delta):
    acc = RDPAccountant()
    acc.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in history]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta=delta)


@pytest.mark.parametrize(
    ("sigma", "q", "steps", "why"),
    [
        (0.05, 0.2, 30, "sigma below SIGMA_MIN"),
        (0.01, 1.0, 1, "sigma far below SIGMA_MIN (PRV understates here)"),
        (0.5, 1.0, 3000, "RDP epsilon above PRV_EPSILON_MAX"),
        (2.0, 0.01, PRV_STEPS_MAX + 1, "more steps than PRV_STEPS_MAX"),
    ],
)
def test_epsilon_outside_prv_bounds_is_rdp_upper_bound(sigma, q, steps, why):
    """Where PRV would need unbounded memory (or is not valid), epsilon is RDP's upper bound,
    computed at once; inside, it is PRV's (smaller) value."""
    history = [PrivacyEvent(sigma, q, steps)]
    assert epsilon(history, 1e-5) == pytest.approx(_rdp(history, 1e-5), rel=1e-12), why


def test_epsilon_inside_prv_bounds_is_prv():
    history = [PrivacyEvent(SIGMA_MIN, 0.01, 30)]
    acc = PRVAccountant()
    acc.history = [(SIGMA_MIN, 0.01, 30)]
    prv = acc.get_epsilon(delta=1e-5, eps_error=0.01)
    assert prv < PRV_EPSILON_MAX
    assert epsilon(history, 1e-5) == pytest.approx(prv, rel=1e-12)
    assert epsilon(history, 1e-5) < _rdp(history, 1e-5)


def test_calibration_never_goes_below_sigma_min():
    """A target so large that less noise would do is met at SIGMA_MIN, with epsilon below it."""
    sigma = calibrate_noise_multiplier(target_epsilon=500.0, delta=1e-5, sample_rate=0.2, steps=3)
    assert sigma == SIGMA_MIN
    assert epsilon([PrivacyEvent(sigma, 0.2, 3)], 1e-5) <= 500.0


@pytest.mark.parametrize(("target", "q", "steps"), [(3.0, 0.05, 300), (8.0, 0.25, 30)])
def test_calibration_matches_opacus_search(target, q, steps):
    """The calibration runs Opacus' search through the bounded ``epsilon``: inside PRV's bounds
    it finds Opacus' own sigma."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = get_noise_multiplier(
            target_epsilon=target,
            target_delta=1e-5,
            sample_rate=q,
            steps=steps,
            accountant="prv",
            epsilon_tolerance=0.005 * target,
            eps_error=0.01,
        )
    got = calibrate_noise_multiplier(target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps)
    assert got == pytest.approx(expected, rel=1e-12)


def test_group_privacy_and_its_inverse():
    assert group_privacy(0.5, 1e-7, 1) == (0.5, 1e-7)
    eps, delta = group_privacy(0.75, 2e-7, 4)
    assert eps == pytest.approx(3.0, rel=1e-15)
    assert delta == pytest.approx(4 * math.exp(3 * 0.75) * 2e-7, rel=1e-15)
    for k in (1, 2, 4, 50):
        per_record = group_record_budget(3.0, 1e-5, k)
        assert group_privacy(*per_record, k) == pytest.approx((3.0, 1e-5), rel=1e-12)
    with pytest.raises(PrivacyParameterError):
        group_privacy(1.0, 1e-5, 0)


def test_record_events_count_per_person_by_group_privacy_never_below_k_epsilon():
    records = [PrivacyEvent(1.0, 0.02, 50)]
    people = [PrivacyEvent(1.2, 0.05, 30, unit="user")]
    with pytest.raises(AccountingError, match="privacy units"):
        epsilon([*records, *people], 1e-5)  # never silently
    # record events alone, k = 1: the per-record epsilon itself
    assert epsilon(records, 1e-5, group_size=1) == pytest.approx(epsilon(records, 1e-5))
    for k in (2, 5):
        alone = epsilon(records, 1e-5, group_size=k)
        # the conversion holds: (k eps_r, k e^((k-1) eps_r) delta_r) with delta_r <= delta / k
        assert alone >= k * epsilon(records, 1e-5 / k) - 1e-9
        both = epsilon([*records, *people], 1e-5, group_size=k)
        # basic composition on half of delta each: at least the sum of the parts at full delta
        assert both >= alone + epsilon(people, 1e-5) - 1e-9
    # a person-level history needs no conversion: the group size does not matter
    assert epsilon(people, 1e-5, group_size=7) == epsilon(people, 1e-5)


def test_max_steps_counts_new_steps_in_their_own_unit_after_a_switch():
    records = [PrivacyEvent(1.0, 0.02, 50)]
    allowed = max_steps(
        records,
        noise_multiplier=1.2,
        sample_rate=0.05,
        delta=1e-5,
        target_epsilon=20.0,
        limit=400,
        unit="user",
        group_size=3,
    )
    assert allowed >= 1
    more = [*records, PrivacyEvent(1.2, 0.05, allowed, unit="user")]
    assert epsilon(more, 1e-5, group_size=3) <= 20.0
    over = [*records, PrivacyEvent(1.2, 0.05, allowed + 1, unit="user")]
    assert allowed == 400 or epsilon(over, 1e-5, group_size=3) > 20.0


@pytest.mark.parametrize("k", [10, 40])
def test_a_person_with_many_records_gets_no_finite_group_guarantee_instead_of_an_error(k):
    """sigma 1, q 0.01, 100 record-level steps, a person with k records: group privacy needs a
    per-record delta_r with ``k e^((k-1) eps_r(delta_r)) delta_r <= delta``; on a grid of
    delta_r from delta / k down to 1e-300 every delta_r that meets it costs more than epsilon
    709 per person (e^709 is the largest float), so no finite guarantee exists and the answer
    is inf, never an OverflowError; with later person-level events too."""
    records = [PrivacyEvent(1.0, 0.01, 100)]
    delta = 1e-5
    finite = []
    for exponent in range(5, 301, 5):
        delta_r = min(delta / k, 10.0**-exponent)
        eps_r = epsilon(records, delta_r)
        if math.log(k) + (k - 1) * eps_r + math.log(delta_r) <= math.log(delta):
            finite.append(k * eps_r)
    assert all(value > 709 for value in finite)
    assert epsilon(records, delta, group_size=k) == math.inf
    people = [PrivacyEvent(1.0, 0.05, 10, unit="user")]
    assert epsilon([*records, *people], delta, group_size=k) == math.inf
    assert max_steps(
        records, noise_multiplier=1.0, sample_rate=0.05, delta=delta, target_epsilon=8.0,
        limit=10, unit="user", group_size=k,
    ) == 0  # fmt: skip


def test_group_privacy_past_the_float_range_is_no_guarantee_not_an_error():
    eps, delta = group_privacy(30.0, 1e-5, 40)  # 40 e^(39 x 30) 1e-5 overflows a float
    assert (eps, delta) == (1200.0, 1.0)
    assert group_privacy(0.1, 1e-5, 3)[1] == pytest.approx(3 * math.exp(0.2) * 1e-5, rel=1e-15)
    per_record = group_record_budget(1e4, 1e-5, 2)  # e^(5000) overflows: delta_r is 0
    assert per_record == (5e3, 0.0)
