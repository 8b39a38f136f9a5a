"""Audit part (c): the one-run canary lower bound (Steinke, Nasr, Jagielski 2023)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from server.audit.canary import (
    CanarySettings,
    canary_scores,
    epsilon_lower_bound,
    p_value,
    run_canary_audit,
)
from server.audit.mechanisms import BROKEN, CORRECT

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # PRV at q=1


def p_value_exact(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The paper's p-value with exact binomial sums (an independent second implementation)."""
    q = Fraction(1) / (1 + Fraction(math.exp(-eps)))

    def pmf(k: int) -> Fraction:
        return math.comb(r, k) * q**k * (1 - q) ** (r - k)

    beta = sum((pmf(k) for k in range(v, r + 1)), Fraction(0))
    alpha, window = Fraction(0), Fraction(0)
    for i in range(1, v + 1):
        window += pmf(v - i)  # P[v > W >= v - i]
        alpha = max(alpha, window / i)
    return float(min(beta + alpha * Fraction(delta) * 2 * m, Fraction(1)))


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (100, 20, 15, 0.5, 0.0),
        (100, 20, 15, 0.5, 1e-3),
        (1000, 60, 55, 1.7, 1e-5),
        (50, 10, 0, 1.0, 1e-2),
    ],
)
def test_p_value_matches_an_exact_rational_computation(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(
        p_value_exact(m, r, v, eps, delta), rel=1e-9, abs=1e-15
    )


@pytest.mark.parametrize(("r", "v", "delta"), [(200, 138, 1e-5), (200, 200, 1e-5), (100, 90, 0.0)])
def test_lower_bound_is_the_supremum_of_rejected_epsilons(r, v, delta):
    bound = epsilon_lower_bound(1000, r, v, delta=delta, confidence=0.95)
    assert bound > 0
    assert p_value(1000, r, v, bound, delta) < 0.05
    assert p_value(1000, r, v, bound + 1e-5, delta) >= 0.05


def test_lower_bound_holds_with_the_stated_confidence_for_randomized_response():
    """eps0-randomized response is exactly eps0-DP: the bound may exceed eps0 in <= 5 % of runs."""
    rng = np.random.default_rng(0)
    eps0, r, trials = 1.0, 100, 300
    correct = rng.binomial(r, math.exp(eps0) / (1 + math.exp(eps0)), size=trials)
    above = sum(
        epsilon_lower_bound(r, r, int(v), delta=0.0, confidence=0.95) > eps0 for v in correct
    )
    # Binomial(300, 0.05) exceeds 27 with probability < 1e-3
    assert above <= 27
    assert (
        np.mean(
            [epsilon_lower_bound(r, r, int(v), delta=0.0, confidence=0.95) for v in correct[:20]]
        )
        > 0.2
    )


def test_canary_scores_have_mean_C_over_b_and_std_sigma_C_over_b():
    s = CanarySettings(canaries=1000, noise_multiplier=2.0, steps=2)
    scores, included = canary_scores(s, CORRECT)
    b = s.canaries / 2
    signal, sd = s.steps * s.max_norm / b, math.sqrt(s.steps) * s.noise_multiplier * s.max_norm / b
    z_in = (scores[included] - signal) / sd
    z_out = scores[~included] / sd
    # about 500 N(0, 1) draws each: mean within 5 standard errors, std within 15 %
    for z in (z_in, z_out):
        assert abs(float(z.mean())) <= 5 / math.sqrt(len(z))
        assert 0.85 <= float(z.std()) <= 1.15


@pytest.mark.parametrize("seed", range(5))
def test_the_mechanism_that_trains_stays_below_its_claim(seed):
    result = run_canary_audit(CanarySettings(seed=seed), CORRECT)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.01)  # sigma 2, one step, 1e-5
    assert 0 < result.lower_bound <= result.claimed_epsilon
    assert result.verdict == "pass"


@pytest.mark.parametrize("bug", ["noise-off", "per-module-clip"])
def test_broken_mechanisms_exceed_the_claim(bug):
    result = run_canary_audit(CanarySettings(), BROKEN[bug])
    assert result.lower_bound > result.claimed_epsilon
    assert result.verdict == "FAIL"


def test_dividing_by_the_realised_batch_rescales_all_scores_and_is_invisible_here():
    """Documented limit: this bug is caught by the record/replay checks, not by the canaries."""
    right, wrong = (
        run_canary_audit(CanarySettings(), m) for m in (CORRECT, BROKEN["realised-batch"])
    )
    assert wrong.correct == right.correct
    assert wrong.lower_bound == right.lower_bound


def test_bad_settings_name_the_key_and_the_allowed_range():
    with pytest.raises(ValueError, match=r"guesses=7 must be even"):
        CanarySettings(guesses=7)
    with pytest.raises(ValueError, match=r"tangent dimension .* must be >= canaries=5000"):
        CanarySettings(canaries=5000, guesses=200)
