"""Skellam accounting against exact Rényi divergences summed from the Skellam pmf, and against
Opacus' Gaussian accountant in the limit of fine quantisation."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from scipy.special import gammaln, logsumexp
from scipy.stats import skellam

from prism_core.errors import PrivacyParameterError
from prism_core.skellam_accounting import (
    DEFAULT_ORDERS,
    calibrate_skellam_mu,
    skellam_epsilon,
    skellam_rdp,
    skellam_rdp_curve,
    subsampled_rdp,
)

ORDERS = (2, 4, 8, 16, 32)


class _Exact1D:
    """Exact Rényi divergences of the one-dimensional Skellam mechanism with shift ``shift``,
    summed from scipy's Skellam(mu, mu) pmf over ``|k| <= mu + 40 sd + 40 shift + 60`` (the
    mass left out is below 1e-300 for every case here; points where either pmf underflows to 0
    are dropped, their terms being below float64's range)."""

    def __init__(self, mu: float, shift: int) -> None:
        top = int(mu + 40 * math.sqrt(2 * mu) + 40 * shift + 60)
        k = np.arange(-top, top + 1)
        with np.errstate(divide="ignore"):
            base, moved = np.log(skellam.pmf(k, mu, mu)), np.log(skellam.pmf(k - shift, mu, mu))
        keep = np.isfinite(base) & np.isfinite(moved)
        self.base, self.moved = base[keep], moved[keep]

    def rdp(self, alpha: int, q: float = 1.0) -> tuple[float, float]:
        """``D_alpha(P || Q)`` and ``D_alpha(Q || P)`` for ``Q = Sk(mu)`` and the subsampled
        ``P = (1 - q) Sk(mu) + q (Sk(mu) + shift)``."""
        if q == 1.0:
            mix = self.moved
        else:
            mix = np.logaddexp(math.log1p(-q) + self.base, math.log(q) + self.moved)
        forward = logsumexp(alpha * mix + (1 - alpha) * self.base) / (alpha - 1)
        reverse = logsumexp(alpha * self.base + (1 - alpha) * mix) / (alpha - 1)
        return float(forward), float(reverse)


@functools.cache
def _exact(mu: float, shift: int) -> _Exact1D:
    return _Exact1D(mu, shift)


def test_skellam_rdp_is_the_theorem_at_one_point_by_hand():
    """mu = 5 (variance v = 10), l1 = 3, l2 = 2, alpha = 4: alpha l2^2 / (2 v) = 0.8 and
    min(((2 alpha - 1) l2^2 + 6 l1) / (4 v^2), 3 l1 / (2 v)) = min(46 / 400, 0.45) = 0.115."""
    assert skellam_rdp(4, mu=5.0, l1=3.0, l2=2.0) == pytest.approx(0.915, rel=1e-14)
    # the other branch of the min: small variance
    assert skellam_rdp(4, mu=0.5, l1=1.0, l2=1.0) == pytest.approx(4 / 2 + 3 / 2, rel=1e-14)
    assert skellam_rdp(2, mu=0.0, l1=1.0, l2=1.0) == math.inf
    assert skellam_rdp(2, mu=0.0, l1=0.0, l2=0.0) == 0.0


UNSUBSAMPLED_SLACK = {10.0: 2.2, 100.0: 1.06, 1000.0: 1.002}
"""Largest ratio of the Skellam RDP bound to the exact one-dimensional divergence, shifts 1
and 3, orders 2..32 (measured: 2.14 at mu = 10, shift 3, order 32; 1.054 at mu = 100; 1.0011
at mu = 1000). Below mu = 10 the bound holds but is loose (2.9x to 15x at mu = 0.5)."""


@pytest.mark.parametrize("mu", [0.5, 2.0, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("shift", [1, 3])
def test_the_skellam_bound_dominates_the_exact_one_dimensional_divergence(mu, shift):
    """Independent check of Theorem 3.5 of Agarwal et al. in one dimension (l1 = l2 = shift):
    the exact ``D_alpha(Sk(mu) + shift || Sk(mu))`` summed from the pmf, both directions (equal
    by the symmetry of the noise), never exceeds the bound, and the bound is within
    ``UNSUBSAMPLED_SLACK`` of it."""
    exact = _exact(mu, shift)
    for alpha in ORDERS:
        forward, reverse = exact.rdp(alpha)
        assert forward == pytest.approx(reverse, rel=1e-9)
        bound = skellam_rdp(alpha, mu=mu, l1=shift, l2=shift)
        assert bound >= forward * (1 - 1e-9)
        if mu in UNSUBSAMPLED_SLACK:
            assert bound <= UNSUBSAMPLED_SLACK[mu] * forward


def _binomial_expansion(rdp_of_order, alpha: int, q: float) -> float:
    """Zhu and Wang's sum with the factor 1 on every term: the binomial expansion of
    ``E_Q[((1 - q) + q P / Q)^alpha]``."""
    terms = [(alpha - 1) * math.log1p(-q) + math.log(alpha * q - q + 1)]
    for ell in range(2, alpha + 1):
        log_binom = gammaln(alpha + 1) - gammaln(ell + 1) - gammaln(alpha - ell + 1)
        terms.append(
            log_binom
            + ell * math.log(q)
            + (alpha - ell) * math.log1p(-q)
            + (ell - 1) * rdp_of_order(ell)
        )
    return float(logsumexp(terms) / (alpha - 1))


@pytest.mark.parametrize(("mu", "q"), [(2.0, 0.1), (10.0, 0.5), (100.0, 0.01)])
def test_the_expansion_with_exact_divergences_is_the_exact_forward_divergence(mu, q):
    """The identity behind the subsampling bound: with the EXACT base divergences and the
    factor 1, the sum equals the exact forward divergence of the mixture (rel. 1e-9)."""
    exact = _exact(mu, 1)
    for alpha in ORDERS:
        expansion = _binomial_expansion(lambda ell: exact.rdp(ell)[0], alpha, q)
        assert expansion == pytest.approx(exact.rdp(alpha, q)[0], rel=1e-9)


SUBSAMPLED_SLACK = {10.0: 1.15, 100.0: 1.02, 1000.0: 1.003}
"""``rho(mu)`` in ``bound <= rho * exact + log(3) / (alpha - 1)``. The factor 3 of Zhu and
Wang's general theorem at most triples the sum, hence the additive ``log(3) / (alpha - 1)``;
``rho`` is the Skellam bound's own excess carried through subsampling (measured over q in
{0.01, 0.1, 0.5}: 1.146 at mu = 10 up to order 16, 1.011 at 100, 1.001 at 1000). At mu = 10,
q = 0.5, order 32 it reaches 1.40, so mu = 10 is checked up to order 16."""


@pytest.mark.parametrize("mu", [2.0, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_the_subsampled_bound_dominates_the_exact_subsampled_divergence(mu, q):
    """Independent check of the accountant's per-step RDP in one dimension (shift 1): the
    exact divergence between ``(1 - q) Sk(mu) + q (Sk(mu) + 1)`` and ``Sk(mu)``, the larger of
    the two directions, is below the implemented bound at every order, and the bound is within
    ``SUBSAMPLED_SLACK``. At order 2 (no factor 3) the bound is within ``rho`` of the exact
    value outright."""
    exact = _exact(mu, 1)
    curve = skellam_rdp_curve(mu=mu, l1=1.0, l2=1.0, sample_rate=q, orders=ORDERS)
    for alpha, bound in zip(ORDERS, curve, strict=True):
        assert bound == pytest.approx(
            subsampled_rdp(lambda ell: skellam_rdp(ell, mu=mu, l1=1.0, l2=1.0), alpha, q),
            rel=1e-12,
        )
        truth = max(exact.rdp(alpha, q))
        assert bound >= truth * (1 - 1e-9)
        if mu in SUBSAMPLED_SLACK and (mu > 10 or alpha <= 16):
            rho = SUBSAMPLED_SLACK[mu]
            assert bound <= rho * truth + math.log(3) / (alpha - 1)
            if alpha == 2:
                assert bound <= rho * truth


def test_epsilon_is_above_the_exact_one_dimensional_epsilon_and_within_a_quarter():
    """1000 steps at q = 0.01 of Sk(50) with shift 10 (sigma = sqrt(100) / 10 = 1), delta 1e-5,
    orders 2..64: the exact RDP (pmf sums, larger direction) composed and converted by Opacus'
    ``get_privacy_spent`` is 2.045; the accountant gives 2.477 (+21 %, the factor 3 of the
    general subsampling theorem, about ``2 C(alpha,3) q^3 / (alpha-1)`` per step)."""
    mu, shift, q, steps, delta = 50.0, 10, 0.01, 1000, 1e-5
    orders = list(range(2, 65))
    exact = _exact(mu, shift)
    rdp = [steps * max(exact.rdp(a, q)) for a in orders]
    truth, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    ours = skellam_epsilon(
        mu=mu, l1=shift, l2=shift, sample_rate=q, steps=steps, delta=delta, orders=orders
    )
    assert truth <= ours <= 1.25 * truth
    assert (round(truth, 3), round(ours, 3)) == (2.045, 2.477)


def _opacus_gaussian_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    orders = list(DEFAULT_ORDERS)
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps)


@pytest.mark.parametrize(("mu", "rel"), [(1e3, 1e-3), (1e5, 1e-5)])
def test_without_subsampling_skellam_epsilon_converges_to_opacus_gaussian(mu, rel):
    """q = 1, 10 steps, sigma = sqrt(2 mu) / l2 = 1 (l2 = l1 = sqrt(2 mu)): the Skellam epsilon
    is within ``rel`` of Opacus' RDP epsilon for the Gaussian at the same orders (measured
    +5.8e-4 at mu = 1e3, +3.4e-6 at 1e5) and never below it."""
    l2 = math.sqrt(2 * mu)
    ours = skellam_epsilon(mu=mu, l1=l2, l2=l2, sample_rate=1.0, steps=10, delta=1e-5)
    gauss = _opacus_gaussian_epsilon(1.0, 1.0, 10, 1e-5)
    assert gauss <= ours <= gauss * (1 + rel)


@pytest.mark.parametrize(("mu", "rel"), [(1e3, 2e-3), (1e5, 2e-5)])
def test_subsampled_skellam_epsilon_converges_to_the_gaussian_through_the_same_theorem(mu, rel):
    """q = 0.01, 1000 steps, sigma = 1: the Skellam epsilon converges (within ``rel``) to the
    Gaussian's RDP ``alpha / (2 sigma^2)`` put through the same subsampling theorem; both sit
    above Opacus' exact subsampled-Gaussian epsilon by the theorem's factor 3 (2.451 against
    2.108, +16 %; the test allows 20 %)."""
    l2, q, steps, delta = math.sqrt(2 * mu), 0.01, 1000, 1e-5
    ours = skellam_epsilon(mu=mu, l1=l2, l2=l2, sample_rate=q, steps=steps, delta=delta)
    orders = list(DEFAULT_ORDERS)
    limit = [steps * subsampled_rdp(lambda a: a / 2.0, alpha, q) for alpha in orders]
    through_theorem, _ = get_privacy_spent(orders=orders, rdp=limit, delta=delta)
    assert through_theorem <= ours <= through_theorem * (1 + rel)
    gauss = _opacus_gaussian_epsilon(1.0, q, steps, delta)
    assert gauss <= ours <= 1.2 * gauss


def test_the_general_bound_on_the_gaussian_dominates_opacus_exact_sampled_gaussian():
    """Zhu and Wang's bound for any mechanism, fed the Gaussian's RDP, is >= Opacus' exact
    integer-order RDP of the sampled Gaussian (Mironov et al. 2019), and equal at order 2
    where the factor 3 does not enter (rel. 1e-9)."""
    for sigma, q in [(0.8, 0.01), (1.0, 0.1), (2.0, 0.5)]:
        exact = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(ORDERS))
        for alpha, truth in zip(ORDERS, exact, strict=True):
            bound = subsampled_rdp(lambda a, s=sigma: a / (2 * s * s), alpha, q)
            assert bound >= truth * (1 - 1e-12)
            if alpha == 2:
                assert bound == pytest.approx(truth, rel=1e-9)


def test_no_subsampling_returns_the_base_and_no_steps_cost_nothing():
    base = lambda a: 0.1 * a  # noqa: E731
    assert subsampled_rdp(base, 7, 1.0) == pytest.approx(0.7)
    assert subsampled_rdp(base, 7, 0.5) <= 0.7  # never above the base (quasi-convexity)
    assert skellam_epsilon(mu=1.0, l1=1, l2=1, sample_rate=0.1, steps=0, delta=1e-5) == 0.0
    with pytest.warns(UserWarning, match="Optimal order is the smallest alpha"):  # Opacus
        assert skellam_epsilon(mu=0.0, l1=1, l2=1, sample_rate=0.1, steps=3, delta=1e-5) == math.inf


@pytest.mark.parametrize(
    ("target", "l1", "l2", "q", "steps"),
    [(3.0, 40.0, 10.0, 0.01, 1000), (8.0, 2.0, 2.0, 1.0, 5), (1.0, 300.0, 30.0, 0.05, 200)],
)
def test_the_calibrated_mu_reaches_the_target_and_a_slightly_smaller_one_does_not(
    target, l1, l2, q, steps
):
    tol = 0.01
    mu = calibrate_skellam_mu(
        target_epsilon=target,
        delta=1e-5,
        l1=l1,
        l2=l2,
        sample_rate=q,
        steps=steps,
        relative_tolerance=tol,
    )

    def eps(m: float) -> float:
        return skellam_epsilon(mu=m, l1=l1, l2=l2, sample_rate=q, steps=steps, delta=1e-5)

    with warnings.catch_warnings():  # Opacus: the optimum at an end of the orders
        warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
        assert eps(mu) <= target
        assert eps(mu * (1 - tol)) > target


def test_calibration_refuses_an_unreachable_target():
    """The RDP conversion alone costs about log(1/delta) / 255 at order 256: 0.001 is out of
    reach whatever the noise."""
    with pytest.raises(PrivacyParameterError, match="budget is too low"):
        calibrate_skellam_mu(
            target_epsilon=0.001, delta=1e-5, l1=1.0, l2=1.0, sample_rate=0.01, steps=10
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mu": 1.0, "l1": 1.0, "l2": 2.0},  # l1 below l2
        {"mu": -1.0, "l1": 1.0, "l2": 1.0},
        {"mu": 1.0, "l1": math.inf, "l2": 1.0},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "sample_rate": 0.0},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "sample_rate": 1.5},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "steps": -1},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "delta": 0.0},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "orders": (1, 2)},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "orders": (2.5,)},
        {"mu": 1.0, "l1": 1.0, "l2": 1.0, "orders": ()},
    ],
)
def test_epsilon_refuses_parameters_out_of_range(kwargs):
    args = {"sample_rate": 0.1, "steps": 10, "delta": 1e-5, **kwargs}
    with pytest.raises(PrivacyParameterError):
        skellam_epsilon(**args)


@pytest.mark.parametrize("alpha", [1, 0, 2.0, True, 2000])
def test_orders_must_be_integers_from_two(alpha):
    with pytest.raises(PrivacyParameterError, match="alpha="):
        skellam_rdp(alpha, mu=1.0, l1=1.0, l2=1.0)
