"""Accounting at the corners of PRV's domain: where Opacus refuses a history, and where PRV's
``eps_upper`` falls below Google's pessimistic PLD (``dp_accounting``, an independent upper
bound)."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

import prism_core.accounting as accounting
from prism_core.accounting import (
    PLD_VALUE_INTERVAL,
    PRV_DELTA_MIN,
    PRV_EPS_ERROR,
    PRV_STEPS_MAX,
    PrivacyEvent,
    epsilon,
    epsilon_report,
)


def _rdp(sigma: float, q: float, steps: int, delta: float) -> float:
    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta=delta))


def _prv(sigma: float, q: float, steps: int, delta: float) -> float:
    acc = PRVAccountant()
    acc.history = [(sigma, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))


def _pld(sigma: float, q: float, steps: int, delta: float, interval: float) -> float:
    """dp_accounting's pessimistic PLD epsilon under add/remove, built here from its API."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def test_a_history_opacus_refuses_at_an_accepted_corner_is_accounted_by_rdp():
    """sigma 1, q 0.01, PRV_STEPS_MAX steps at delta PRV_DELTA_MIN: inside every bound PRV is
    used within, yet Opacus' discretisation has 12.6 million points, and it raises ("Floating
    point errors will dominate") when ``n eps_longdouble > delta - delta / 1000``. Epsilon is
    RDP's upper bound there, found without building the PRV (seconds) first."""
    sigma, q, steps, delta = 1.0, 0.01, PRV_STEPS_MAX, PRV_DELTA_MIN
    domain = PRVAccountant()._get_domain(  # Opacus' own domain: the refusal is real
        prvs=[PoissonSubsampledGaussianPRV(q, sigma)],
        num_self_compositions=[steps],
        eps_error=PRV_EPS_ERROR,
        delta_error=delta / 1000,
    )
    assert np.finfo(np.longdouble).eps * domain.size > delta - delta / 1000
    start = time.perf_counter()
    got = epsilon([PrivacyEvent(sigma, q, steps)], delta)
    assert time.perf_counter() - start < 2.0  # no PRV built (it takes about 10 s here)
    assert got == pytest.approx(_rdp(sigma, q, steps, delta), rel=1e-12)


def test_any_refusal_of_opacus_falls_back_to_rdp_and_is_asked_once(monkeypatch):
    """Whatever Opacus raises out of its discretisation (ValueError, RuntimeError "Cannot
    compute epsilon"), epsilon is RDP's upper bound and the refusal is remembered."""
    accounting._prv_epsilon.cache_clear()
    for n, error in enumerate((ValueError("floating point"), RuntimeError("Cannot compute"))):
        calls = []

        def refusing(self, *args, _error=error, _calls=calls, **kwargs):
            _calls.append(list(self.history))
            raise _error

        monkeypatch.setattr(PRVAccountant, "get_epsilon", refusing)
        history = [PrivacyEvent(1.0, 0.02, 300 + n)]
        for _ in range(2):
            assert epsilon(history, 1e-5) == pytest.approx(_rdp(1.0, 0.02, 300 + n, 1e-5))
        assert calls == [[(1.0, 0.02, 300 + n)]]
        report = epsilon_report(history, 1e-5)
        assert report.prv == report.rdp


def test_where_prv_falls_below_the_pessimistic_pld_the_pld_is_charged():
    """sigma 0.5, q 1e-3, 100,000 steps, delta 1e-10: PRV's ``eps_upper`` is 20.87-20.88 (it
    moves in its last digits with the numeric libraries' versions), while
    dp_accounting's pessimistic PLD (an upper bound by construction) gives 20.94 to 21.05 at
    every interval from 2e-3 to 1e-4: PRV understates by more than its stated error 0.01. The
    charge is the larger of the two: at least PRV and at least every pessimistic PLD computed
    here at the product's interval and at a finer one, and still below RDP."""
    sigma, q, steps, delta = 0.5, 1e-3, PRV_STEPS_MAX, 1e-10
    prv = accounting._prv_epsilon(((sigma, q, steps),), delta)  # Opacus' PRV, memoised
    assert prv == pytest.approx(20.875, abs=0.015)
    plds = [_pld(sigma, q, steps, delta, interval) for interval in (PLD_VALUE_INTERVAL, 5e-4)]
    assert min(plds) > prv + 5 * PRV_EPS_ERROR  # the corner is real
    charged = epsilon([PrivacyEvent(sigma, q, steps)], delta)
    assert charged >= max(prv, min(plds)) - 1e-9
    assert charged <= _rdp(sigma, q, steps, delta)
    assert charged == pytest.approx(plds[0], rel=1e-12)  # the product's PLD, nothing more


@pytest.mark.parametrize(
    ("sigma", "q", "steps", "delta"),
    [(1.0, 0.01, 1000, 1e-5), (0.8, 0.05, 30, 1e-5), (2.0, 1.0, 10, 1e-6)],
)
def test_inside_prvs_bounds_the_pld_changes_nothing(sigma, q, steps, delta):
    """Where PRV's bound holds, its ``eps_upper`` lies about its error 0.01 above the
    pessimistic PLD, so the charge is PRV's own value (the golden values stand)."""
    prv = _prv(sigma, q, steps, delta)
    pld = _pld(sigma, q, steps, delta, PLD_VALUE_INTERVAL) if q < 1 else None
    if pld is not None:
        assert prv - 2 * PRV_EPS_ERROR <= pld <= prv
    assert epsilon([PrivacyEvent(sigma, q, steps)], delta) == pytest.approx(prv, rel=1e-12)


def test_the_pld_check_builds_one_step_once_and_merges_equal_runs(monkeypatch):
    """The one-step PLD of a (sigma, q) is built once per process, and runs of one pair that
    are not neighbours are composed into one PLD (composition commutes): the value equals the
    merged history's and dp_accounting's own accountant's."""
    accounting._pld_epsilon.cache_clear()
    accounting._step_pld.cache_clear()
    built = []
    original = accounting.pld.from_gaussian_mechanism

    def counting(**kwargs):
        built.append((kwargs["standard_deviation"], kwargs.get("sampling_prob", 1.0)))
        return original(**kwargs)

    monkeypatch.setattr(accounting.pld, "from_gaussian_mechanism", counting)
    split = [PrivacyEvent(1.0, 0.02, 50), PrivacyEvent(2.0, 0.1, 5), PrivacyEvent(1.0, 0.02, 70)]
    merged = [PrivacyEvent(1.0, 0.02, 120), PrivacyEvent(2.0, 0.1, 5)]
    values = [
        accounting._pld_epsilon(accounting._accountant_key(h), 1e-5, "add-remove")
        for h in (split, merged, [PrivacyEvent(1.0, 0.02, 121)])
    ]
    assert built == [(1.0, 0.02), (2.0, 0.1)]  # one build per pair, reused by every history
    assert values[0] == pytest.approx(values[1], rel=1e-12)
    independent = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    independent.compose(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.0)), 120)
    independent.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(2.0)), 5)
    assert values[0] == pytest.approx(independent.get_epsilon(1e-5), rel=1e-9)


def test_the_searches_confirm_with_the_pld_floor(monkeypatch):
    """Calibration and max_steps narrow with PRV alone, then confirm with the charge: where the
    PLD floor lies above PRV (here, stood in for by PRV + 0.3), the sigma found still meets
    the target with the floor, no larger k fits, and both are the searches over the charge."""
    accounting._pld_epsilon.cache_clear()

    def floor_above(history, delta, relation):
        prv = accounting._prv_epsilon(history, delta)
        return (prv if prv is not None else 0.0) + 0.3

    monkeypatch.setattr(accounting, "_pld_epsilon", floor_above)
    q, steps, target, delta = 0.02, 200, 2.0, 1e-5
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sample_rate=q, steps=steps
    )
    charged = epsilon([PrivacyEvent(sigma, q, steps)], delta)
    assert target * (1 - 0.005) - 1e-9 <= charged <= target
    alone = accounting._search_epsilon([PrivacyEvent(sigma, q, steps)], delta)
    assert charged == pytest.approx(alone + 0.3, rel=1e-12)
    kw = {"noise_multiplier": 1.0, "sample_rate": q, "delta": delta, "target_epsilon": target}
    k = accounting.max_steps([], limit=2000, **kw)
    assert epsilon([PrivacyEvent(1.0, q, k)], delta) <= target
    assert epsilon([PrivacyEvent(1.0, q, k + 1)], delta) > target
    assert accounting._search_epsilon([PrivacyEvent(1.0, q, k + 1)], delta) <= target  # PRV
