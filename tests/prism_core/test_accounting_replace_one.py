"""The replace-one guarantee (against a party that knows the shard size): a replace-one PLD
accountant for Gaussian histories, checked against the exact Gaussian profile and against
``dp_accounting``'s own accountant; group privacy of two where no direct accountant applies."""

from __future__ import annotations

import math
import re

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy.optimize import brentq
from scipy.stats import norm

from prism_core.accounting import (
    PRV_EPS_ERROR,
    SIGMA_MIN,
    PrivacyEvent,
    ReplaceOne,
    epsilon,
    replace_one,
)
from prism_core.errors import AccountingError, PrivacyParameterError
from prism_core.records import SKELLAM_MECHANISM, SkellamShare

DELTA = 1e-5
SST2_Q = 128 / (67_349 // 4)
"""SST-2's training split over 4 sites, an expected batch of 128 per site."""


def _independent(history: list[tuple[float, float, int]], delta: float) -> float:
    """dp_accounting's PLD accountant under REPLACE_ONE at its default interval 1e-4."""
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    for sigma, q, steps in history:
        gaussian = dp_event.GaussianDpEvent(sigma)
        acc.compose(gaussian if q == 1 else dp_event.PoissonSampledDpEvent(q, gaussian), steps)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (2.0, 10), (5.0, 50)])
def test_without_subsampling_replace_one_is_the_gaussian_of_twice_the_sensitivity(sigma, steps):
    """q = 1: replacing a unit moves the sum by up to 2C, so ``steps`` Gaussian steps compose
    to one Gaussian with ``mu = 2 sqrt(steps) / sigma`` whose exact privacy profile is
    ``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)`` (Balle & Wang 2018, Thm 8). The
    pessimistic PLD lies at or above it, within its discretisation."""
    mu = 2 * math.sqrt(steps) / sigma

    def profile(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) - DELTA

    exact = brentq(profile, 0.0, 200.0, xtol=1e-12)
    got = replace_one([PrivacyEvent(sigma, 1.0, steps)], DELTA)
    assert got.method == "pld" and got.delta == DELTA
    assert exact - 1e-9 <= got.epsilon <= exact + PRV_EPS_ERROR


@pytest.mark.parametrize(
    ("history", "delta"),
    [
        ([(0.58, SST2_Q, 30)], 1e-5),  # SST-2-like, calibrated to epsilon 3 (add/remove)
        ([(0.66, SST2_Q, 300)], 1e-5),
        ([(1.0, 0.01, 1000)], 1e-5),
        ([(6.4, 0.18, 30), (0.9, 0.02, 200)], 1e-6),  # a clip estimate, then training
    ],
)
def test_poisson_subsampled_replace_one_matches_dp_accountings_accountant(history, delta):
    """The direct value is dp_accounting's replace-one PLD (within the discretisation of its
    interval 1e-3 against the default 1e-4, plus 0.1 %), at the report's own delta, no smaller
    than the add/remove epsilon less PRV's error, and tighter than group privacy of two."""
    events = [PrivacyEvent(*run) for run in history]
    got = replace_one(events, delta)
    reference = _independent(history, delta)
    assert got.method == "pld" and got.delta == delta
    assert abs(got.epsilon - reference) <= 0.01 + 1e-3 * reference
    add_remove = epsilon(events, delta)
    assert got.epsilon >= add_remove - PRV_EPS_ERROR
    assert 2 * add_remove >= 1.15 * got.epsilon  # group privacy is at least 1.15x looser


def test_at_sst2_like_settings_the_direct_value_is_half_of_group_privacy():
    """q = 128 / 16,837, 30 steps, sigma 0.5798 (epsilon 2.99 add/remove at delta 1e-5):
    group privacy gives 5.98 at delta 2.1e-4, the replace-one PLD 3.02 at delta 1e-5."""
    events = [PrivacyEvent(0.5798, SST2_Q, 30)]
    add_remove = epsilon(events, DELTA)
    got = replace_one(events, DELTA)
    assert add_remove == pytest.approx(2.99, abs=0.01)
    assert got.epsilon == pytest.approx(3.02, abs=0.02)
    assert 1.9 <= 2 * add_remove / got.epsilon <= 2.0


def _group(eps: float, delta: float) -> ReplaceOne:
    return ReplaceOne(2 * eps, min(1.0, (1 + math.exp(eps)) * delta), "group-privacy")


def test_where_no_direct_accountant_applies_it_is_group_privacy_of_two():
    """A history holding a Skellam step (its sigma bounds RDP, not a privacy-loss
    distribution) and one outside the PLD's memory bounds (sigma below SIGMA_MIN) get
    ``(2 eps, (1 + e^eps) delta)`` from the add/remove epsilon, and say so."""
    skellam = PrivacyEvent(
        2.0,
        0.05,
        10,
        mechanism=SKELLAM_MECHANISM,
        secure=SkellamShare(honest_sites=2, share_sigma=1.5),
    )
    for history in (
        [PrivacyEvent(1.0, 0.05, 20), skellam],
        [PrivacyEvent(SIGMA_MIN / 2, 0.01, 3)],
    ):
        got = replace_one(history, DELTA)
        assert got == pytest.approx(_group(epsilon(history, DELTA), DELTA))
        assert got.method == "group-privacy"


def test_degenerate_histories_and_refusals():
    assert replace_one([], DELTA) == ReplaceOne(0.0, DELTA, "pld")
    assert replace_one([PrivacyEvent(1.0, 0.1, 0, unit="user")], DELTA).epsilon == 0.0
    assert replace_one([PrivacyEvent(0.0, 0.1, 3)], DELTA) == ReplaceOne(math.inf, 1.0, "pld")
    mixed = [PrivacyEvent(1.0, 0.1, 3), PrivacyEvent(1.0, 0.1, 3, unit="user")]
    with pytest.raises(AccountingError, match=re.escape("privacy units ['record', 'user']")):
        replace_one(mixed, DELTA)
    with pytest.raises(PrivacyParameterError, match=re.escape("delta=0.0")):
        replace_one([PrivacyEvent(1.0, 0.1, 3)], 0.0)
