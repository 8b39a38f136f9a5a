"""Accounting against Opacus: golden values, calibration never overshoots, RDP >= PRV."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.accounting import (
    PrivacyEvent,
    calibrate_noise_multiplier,
    compose_events,
    epsilon,
    epsilon_report,
    events_from_records,
    max_steps,
)
from prism_core.errors import AccountingError, PrivacyParameterError
from prism_core.mechanism import NoiseRecord


def test_golden_prv_and_rdp():
    events = [PrivacyEvent(1.0, 0.01, 1000)]
    report = epsilon_report(events, 1e-5)
    assert report.prv == pytest.approx(1.838, abs=0.005)
    assert report.rdp == pytest.approx(2.101, abs=0.005)


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
    with pytest.raises(AccountingError, match="Poisson"):
        epsilon([PrivacyEvent(1.0, 0.1, 10, sampling="shuffle")], 1e-5)
    with pytest.raises(PrivacyParameterError, match="delta"):
        epsilon([PrivacyEvent(1.0, 0.1, 10)], 0.0)
    with pytest.raises(PrivacyParameterError, match="sample_rate"):
        PrivacyEvent(1.0, 0.0, 10)
    with pytest.raises(PrivacyParameterError, match="target_epsilon"):
        calibrate_noise_multiplier(target_epsilon=0.0, delta=1e-5, sample_rate=0.1, steps=10)


def test_events_from_records_merges_equal_steps():
    rec = NoiseRecord("prism-tangent-gaussian", 1.1, 0.5, 32.0, 0.01)
    other = NoiseRecord("prism-tangent-gaussian", 0.9, 0.5, 32.0, 0.01)
    events = events_from_records([rec, rec, rec, other, rec])
    assert [(e.noise_multiplier, e.steps) for e in events] == [(1.1, 3), (0.9, 1), (1.1, 1)]
    assert compose_events([PrivacyEvent(1.0, 0.1, 0)]) == []


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
    ("prefix", "q", "steps"),
    [
        (PrivacyEvent(6.4, 0.18, 30), 0.18, 15),  # a private clip estimate, then training
        (PrivacyEvent(2.0, 0.05, 20), 0.02, 300),
    ],
)
def test_calibration_after_a_history_meets_the_target_with_it_and_needs_more_noise(
    prefix, q, steps
):
    target, delta = 3.0, 1e-5
    fresh = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sample_rate=q, steps=steps
    )
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
