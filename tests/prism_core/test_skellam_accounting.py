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
    skellam_mu,
    skellam_rdp,
    skellam_rdp_curve,
    skellam_rho,
    skellam_sigma,
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
    """The subsampling bound's sum, uncapped: the binomial expansion of
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
    """The identity behind the subsampling bound: with the EXACT base divergences, the sum
    equals the exact forward divergence of the mixture (rel. 1e-9)."""
    exact = _exact(mu, 1)
    for alpha in ORDERS:
        expansion = _binomial_expansion(lambda ell: exact.rdp(ell)[0], alpha, q)
        assert expansion == pytest.approx(exact.rdp(alpha, q)[0], rel=1e-9)


SUBSAMPLED_SLACK = {10.0: 1.15, 100.0: 1.02, 1000.0: 1.002}
"""Largest ratio of the subsampled bound to the exact subsampled divergence (the larger
direction), over q in {0.01, 0.1, 0.5}: the Skellam bound's own excess carried through
subsampling (measured: 1.117 at mu = 10 up to order 16, 1.0113 at 100, 1.0011 at 1000). At
mu = 10, q = 0.5, order 32 it reaches 1.40, so mu = 10 is checked up to order 16."""


@pytest.mark.parametrize("mu", [2.0, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_the_subsampled_bound_dominates_the_exact_subsampled_divergence(mu, q):
    """Independent check of the accountant's per-step RDP in one dimension (shift 1): the
    exact divergence between ``(1 - q) Sk(mu) + q (Sk(mu) + 1)`` and ``Sk(mu)``, the larger of
    the two directions, is below the implemented bound at every order, and the bound is within
    ``SUBSAMPLED_SLACK`` of it."""
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
            assert bound <= SUBSAMPLED_SLACK[mu] * truth


def test_epsilon_is_above_the_exact_one_dimensional_epsilon_and_within_five_percent():
    """1000 steps at q = 0.01 of Sk(50) with shift 10 (sigma = sqrt(100) / 10 = 1), delta 1e-5,
    orders 2..64: the exact RDP (pmf sums, larger direction) composed and converted by Opacus'
    ``get_privacy_spent`` is 2.045; the accountant gives 2.137 (+4.5 %, the Skellam bound's
    discreteness term carried through subsampling)."""
    mu, shift, q, steps, delta = 50.0, 10, 0.01, 1000, 1e-5
    orders = list(range(2, 65))
    exact = _exact(mu, shift)
    rdp = [steps * max(exact.rdp(a, q)) for a in orders]
    truth, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    ours = skellam_epsilon(
        mu=mu, l1=shift, l2=shift, sample_rate=q, steps=steps, delta=delta, orders=orders
    )
    assert truth <= ours <= 1.05 * truth
    assert (round(truth, 3), round(ours, 3)) == (2.045, 2.137)


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


@pytest.mark.parametrize(("mu", "rel"), [(1e3, 1e-3), (1e5, 1e-5)])
def test_subsampled_skellam_epsilon_converges_to_opacus_sampled_gaussian(mu, rel):
    """q = 0.01, 1000 steps, sigma = 1: the Skellam epsilon converges (within ``rel``; measured
    +6.1e-4 at mu = 1e3, +5.9e-6 at 1e5) to Opacus' integer-order epsilon of the sampled
    Gaussian (2.108), and the subsampling bound fed the Gaussian's RDP ``alpha / (2 sigma^2)``
    gives that epsilon exactly (rel. 1e-9)."""
    l2, q, steps, delta = math.sqrt(2 * mu), 0.01, 1000, 1e-5
    ours = skellam_epsilon(mu=mu, l1=l2, l2=l2, sample_rate=q, steps=steps, delta=delta)
    orders = list(DEFAULT_ORDERS)
    limit = [steps * subsampled_rdp(lambda a: a / 2.0, alpha, q) for alpha in orders]
    through_theorem, _ = get_privacy_spent(orders=orders, rdp=limit, delta=delta)
    gauss = _opacus_gaussian_epsilon(1.0, q, steps, delta)
    assert through_theorem == pytest.approx(gauss, rel=1e-9)
    assert gauss <= ours <= gauss * (1 + rel)


def test_the_subsampling_bound_on_the_gaussian_is_opacus_sampled_gaussian():
    """The subsampling bound fed the Gaussian's RDP ``alpha / (2 sigma^2)`` is Opacus' exact
    integer-order RDP of the sampled Gaussian (Mironov et al. 2019) at every order (rel.
    1e-9): the identity ``skellam_sigma``'s argument rests on."""
    for sigma, q in [(0.8, 0.01), (1.0, 0.1), (2.0, 0.5)]:
        exact = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(ORDERS))
        for alpha, truth in zip(ORDERS, exact, strict=True):
            bound = subsampled_rdp(lambda a, s=sigma: a / (2 * s * s), alpha, q)
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


def test_skellam_rho_is_the_bound_at_one_point_by_hand_and_dominates_the_theorem():
    """mu = 5 (v = 10), l1 = 3, l2 = 2: rho = 4 / 20 + (4 + 9) / 200 = 0.265, and the
    theorem's RDP is at most ``alpha rho`` at every order (0.915 <= 1.06 at order 4)."""
    rho = skellam_rho(mu=5.0, l1=3.0, l2=2.0)
    assert rho == pytest.approx(0.265, rel=1e-14)
    assert skellam_sigma(mu=5.0, l1=3.0, l2=2.0) == pytest.approx(1 / math.sqrt(0.53), rel=1e-14)
    for mu, l1, l2 in [(5.0, 3.0, 2.0), (0.5, 1.0, 1.0), (1e3, 40.0, 10.0), (0.01, 7.0, 1.0)]:
        rho = skellam_rho(mu=mu, l1=l1, l2=l2)
        for alpha in (2, 3, 8, 64, 256):
            assert skellam_rdp(alpha, mu=mu, l1=l1, l2=l2) <= alpha * rho * (1 + 1e-12)
    assert skellam_rho(mu=0.0, l1=1.0, l2=1.0) == math.inf
    assert skellam_sigma(mu=0.0, l1=1.0, l2=1.0) == 0.0
    assert skellam_sigma(mu=1.0, l1=0.0, l2=0.0) == math.inf


INDEPENDENT_CASES = [(2.0, 1), (10.0, 1), (10.0, 3), (50.0, 10), (100.0, 3), (1000.0, 1)]
"""(mu, shift D) of the one-dimensional check: mu from 2 (coarse, the bound loose) to 1000."""


@pytest.mark.parametrize(("mu", "shift"), INDEPENDENT_CASES)
def test_opacus_at_the_equivalent_sigma_dominates_the_exact_subsampled_skellam_divergence(
    mu, shift
):
    """The INDEPENDENT check of the accounting of a Skellam event: with ``P0 = Sk(mu)`` and
    ``P1 = P0 + D``, the exact ``D_a((1 - q) P0 + q P1 || P0)`` and ``D_a(P0 || (1 - q) P0 +
    q P1)``, summed from scipy's pmf (``_Exact1D``: support ``|k| <= mu + 40 sd + 40 D + 60``,
    mass left out below 1e-300), are at most Opacus' ``compute_rdp(q, skellam_sigma(mu, D,
    D), 1, [a])`` for q in {0.01, 0.1, 0.5} and a in {2, 8, 32} (rel. 1e-9)."""
    exact = _exact(mu, shift)
    sigma = skellam_sigma(mu=mu, l1=shift, l2=shift)
    for q in (0.01, 0.1, 0.5):
        bounds = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[2, 8, 32])
        for alpha, bound in zip((2, 8, 32), bounds, strict=True):
            forward, reverse = exact.rdp(alpha, q)
            assert forward <= bound * (1 + 1e-9)
            assert reverse <= bound * (1 + 1e-9)


LARGE_MU_SLACK = 1.01
"""Largest ratio of Opacus' RDP at the equivalent sigma to the exact subsampled divergence
(larger direction) at mu = 1000, shifts 1 and 3 (mu >= 100 D^2): measured 1.0021."""


@pytest.mark.parametrize("shift", [1, 3])
def test_the_equivalent_sigma_bound_is_tight_at_large_mu(shift):
    """At mu = 1000 the bound through ``skellam_sigma`` is within ``LARGE_MU_SLACK`` of the
    exact divergence, for q in {0.01, 0.1, 0.5} and a in {2, 8, 32}."""
    mu = 1000.0
    exact = _exact(mu, shift)
    sigma = skellam_sigma(mu=mu, l1=shift, l2=shift)
    for q in (0.01, 0.1, 0.5):
        bounds = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[2, 8, 32])
        for alpha, bound in zip((2, 8, 32), bounds, strict=True):
            assert bound <= LARGE_MU_SLACK * max(exact.rdp(alpha, q))


@pytest.mark.parametrize(("l1", "l2"), [(1.0, 1.0), (3.0, 2.0), (40.0, 10.0)])
def test_the_equivalent_sigma_tends_to_the_gaussian_at_the_same_variance(l1, l2):
    """``sigma' / (sqrt(2 mu) / l2) -> 1``: within 1e-3 at mu = 1e6 (measured 1 - 1e-6) and
    below 1 everywhere (the discreteness costs)."""
    for mu in (10.0, 1e3, 1e6):
        ratio = skellam_sigma(mu=mu, l1=l1, l2=l2) / (math.sqrt(2 * mu) / l2)
        assert ratio < 1
    ratio = skellam_sigma(mu=1e6, l1=l1, l2=l2) / (math.sqrt(2 * 1e6) / l2)
    assert ratio == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 4.7, 100.0])
@pytest.mark.parametrize(("l1", "l2"), [(1.0, 1.0), (3.0, 2.0), (40.0, 10.0), (1e4, 30.0)])
def test_skellam_mu_inverts_skellam_sigma(sigma, l1, l2):
    """``skellam_sigma(skellam_mu(sigma)) = sigma`` and ``skellam_mu(skellam_sigma(mu)) = mu``
    (rel. 1e-9); mu is the smallest: 1e-6 less falls short of sigma."""
    mu = skellam_mu(sigma=sigma, l1=l1, l2=l2)
    assert skellam_sigma(mu=mu, l1=l1, l2=l2) == pytest.approx(sigma, rel=1e-9)
    assert skellam_sigma(mu=mu * (1 - 1e-6), l1=l1, l2=l2) < sigma
    assert skellam_mu(sigma=skellam_sigma(mu=mu, l1=l1, l2=l2), l1=l1, l2=l2) == pytest.approx(
        mu, rel=1e-9
    )
    assert skellam_mu(sigma=0.0, l1=l1, l2=l2) == 0.0
    assert skellam_mu(sigma=sigma, l1=0.0, l2=0.0) == 0.0


@pytest.mark.parametrize(
    ("function", "kwargs"),
    [
        (skellam_rho, {"mu": -1.0, "l1": 1.0, "l2": 1.0}),
        (skellam_rho, {"mu": 1.0, "l1": 1.0, "l2": 2.0}),
        (skellam_sigma, {"mu": math.nan, "l1": 1.0, "l2": 1.0}),
        (skellam_sigma, {"mu": 1.0, "l1": math.inf, "l2": 1.0}),
        (skellam_mu, {"sigma": -0.5, "l1": 1.0, "l2": 1.0}),
        (skellam_mu, {"sigma": math.inf, "l1": 1.0, "l2": 1.0}),
        (skellam_mu, {"sigma": 1.0, "l1": 1.0, "l2": -1.0}),
    ],
)
def test_the_equivalent_sigma_refuses_parameters_out_of_range(function, kwargs):
    with pytest.raises(PrivacyParameterError):
        function(**kwargs)
