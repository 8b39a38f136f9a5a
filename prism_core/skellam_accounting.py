"""Privacy of the Poisson-subsampled multi-dimensional Skellam mechanism, computed by RDP.

The secure sum of docs/design.md §3.3 releases, per step, an integer vector: the sum of the
sampled units' rounded contributions plus ``Sk(mu)`` noise per coordinate (``prism_core.
discrete``; the sum of the honest sites' shares is exactly Skellam, so the noise of the sum is
one Skellam mechanism). Its epsilon is composed here in three steps:

1. **Skellam RDP** (Agarwal, Kairouz, Liu 2021, arXiv:2110.04995, Theorem 3.5, the
   multi-dimensional Skellam mechanism): for a shift of l1 norm ``D1`` and l2 norm ``D2``
   under noise of VARIANCE ``v`` per coordinate (the paper's ``mu``; ``v = 2 mu`` for
   ``Sk(mu) = Poisson(mu) - Poisson(mu)`` as parameterised in this package),
   ``eps(alpha) = alpha D2^2 / (2 v) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 v^2), 3 D1 / (2 v))``.
   The first term is the Gaussian mechanism's RDP at the same variance; the second is what
   the discreteness costs, and vanishes as ``1 / v`` relative to it.
2. **Poisson subsampling** (Steinke 2022, "Composition of Differential Privacy & Privacy
   Amplification by Subsampling", arXiv:2210.00597, the Poisson-subsampling bound for Rényi
   DP under add/remove adjacency, valid for any mechanism whose RDP bound ``eps(.)`` holds in
   BOTH directions at integer orders; the Skellam bound does, the noise being symmetric): for
   integer ``alpha >= 2`` and sampling rate ``q``,
   ``eps_q(alpha) <= 1/(alpha-1) log[(1-q)^(alpha-1) (1 + (alpha-1) q)
   + sum_{l=2..alpha} C(alpha,l) (1-q)^(alpha-l) q^l e^((l-1) eps(l))]``,
   and never more than ``eps(alpha)`` (Rényi divergence is jointly quasi-convex, van Erven and
   Harremoës 2014, Thm 13). The sum is the binomial expansion of the divergence of the mixture
   FROM the base, exact with the exact ``eps(l)``; the theorem bounds the reverse direction by
   the same sum. Fed the Gaussian's ``eps(l) = l / (2 sigma^2)`` it is the sampled Gaussian
   mechanism's integer-order RDP (Mironov, Talwar, Zhang 2019; Opacus' ``compute_rdp``).
3. **Composition and conversion**: T steps add their RDP; epsilon at delta is Opacus' RDP
   conversion (``opacus.accountants.analysis.rdp.get_privacy_spent``, Balle et al. 2020,
   Thm 21) over the integer orders ``DEFAULT_ORDERS`` = 2..256.

**The RDP-equivalent Gaussian** (``skellam_rho``, ``skellam_sigma``): the Skellam bound of step
1 is at most ``alpha rho`` at every order, i.e. at most the RDP of a Gaussian of multiplier
``sigma' = 1 / sqrt(2 rho)``; the bound of step 2 grows with each ``eps(l)``, so one
Poisson-subsampled Skellam step costs at most what Opacus' ``compute_rdp(q, sigma', 1, orders)``
gives at integer orders. ``prism_core.accounting`` composes Skellam events that way, next to
Gaussian ones. What the discreteness costs against the Gaussian at the same variance is the
``(l2^2 + 3 l1) / (2 v^2)`` of ``rho``: ``(1 + 3 l1 / l2^2) / v`` relative to the Gaussian term.
The tests of this module measure both bounds against Rényi divergences summed from the exact
Skellam pmf. Knows nothing about tensors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray
from opacus.accountants.analysis.rdp import get_privacy_spent
from scipy.special import gammaln, logsumexp

from prism_core.errors import PrivacyParameterError

__all__ = [
    "DEFAULT_ORDERS",
    "MAX_ORDER",
    "MU_SEARCH_MAX",
    "calibrate_skellam_mu",
    "skellam_epsilon",
    "skellam_mu",
    "skellam_rdp",
    "skellam_rdp_curve",
    "skellam_rho",
    "skellam_sigma",
    "subsampled_rdp",
]

DEFAULT_ORDERS: Final = tuple(range(2, 257))
"""Integer RDP orders 2..256 over which epsilon is minimised (the subsampling bound holds at
integer orders only)."""

MAX_ORDER: Final = 1024
"""Largest order accepted: the subsampling bound at order alpha sums alpha - 1 terms, and the
curve of all orders holds a table of MAX_ORDER^2 of them."""

MU_SEARCH_MAX: Final = 1e30
"""The largest mu ``calibrate_skellam_mu`` tries before it calls the budget too small."""


def _finite_at_least(value: float, name: str, low: float = 0.0) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value >= low):
        raise PrivacyParameterError(f"{name}={value!r} must be a finite number >= {low}")


def _check_sensitivities(l1: float, l2: float) -> None:
    _finite_at_least(l1, "l1")
    _finite_at_least(l2, "l2")
    if l1 < l2:
        raise PrivacyParameterError(
            f"l1={l1!r} is below l2={l2!r}: every vector's l1 norm is at least its l2 norm. "
            "Pass the l1 bound of the rounded contribution (prism_core.discrete."
            "rounded_l1_bound)."
        )


def _check_order(alpha: int) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int) or not 2 <= alpha <= MAX_ORDER:
        raise PrivacyParameterError(
            f"alpha={alpha!r} must be an integer in [2, {MAX_ORDER}]: the subsampling bound "
            "holds at integer orders"
        )


def _check_rate(q: float) -> None:
    if not (isinstance(q, int | float) and math.isfinite(q) and 0 < q <= 1):
        raise PrivacyParameterError(f"sample_rate q={q!r} must be in (0, 1]")


def _skellam_rdp_unchecked(alpha: float, mu: float, l1: float, l2: float) -> float:
    if l2 == 0:
        return 0.0
    if mu == 0:
        return math.inf
    v = 2.0 * mu  # the variance of Sk(mu): the paper's mu
    surcharge = min(((2 * alpha - 1) * l2 * l2 + 6 * l1) / (4 * v * v), 3 * l1 / (2 * v))
    return alpha * l2 * l2 / (2 * v) + surcharge


def skellam_rdp(alpha: int, *, mu: float, l1: float, l2: float) -> float:
    """RDP at order ``alpha`` of the d-dimensional Skellam mechanism, ``Sk(mu)`` per coordinate.

    Implements Theorem 3.5 of Agarwal, Kairouz, Liu 2021 (arXiv:2110.04995) with its variance
    ``v = 2 mu``: ``alpha l2^2 / (2 v) + min(((2 alpha - 1) l2^2 + 6 l1) / (4 v^2),
    3 l1 / (2 v))``.

    Args:
        alpha: integer order in ``[2, MAX_ORDER]``.
        mu: the mean of each Poisson variable of ``Sk(mu) = Poisson(mu) - Poisson(mu)``
            (variance ``2 mu``); 0 means no noise (infinite RDP unless ``l2 = 0``).
        l1: l1 sensitivity of the integer vector (>= ``l2``).
        l2: l2 sensitivity of the integer vector.

    Raises:
        PrivacyParameterError: for an order, mu or sensitivity out of range.
    """
    _check_order(alpha)
    _finite_at_least(mu, "mu")
    _check_sensitivities(l1, l2)
    return _skellam_rdp_unchecked(alpha, mu, l1, l2)


def skellam_rho(*, mu: float, l1: float, l2: float) -> float:
    """The ``rho`` with ``skellam_rdp(alpha) <= alpha rho`` at every order ``alpha >= 1``.

    Implements a bound on Theorem 3.5 of Agarwal, Kairouz, Liu 2021 (arXiv:2110.04995), with
    its variance ``v = 2 mu``: ``rho = l2^2 / (2 v) + (l2^2 + 3 l1) / (2 v^2)``, because the
    theorem's discreteness term is at most ``((2 alpha - 1) l2^2 + 6 l1) / (4 v^2)`` and
    ``(2 alpha - 1) l2^2 + 6 l1 <= alpha (2 l2^2 + 6 l1)`` for ``alpha >= 1``. The first term is
    the Gaussian's at the same variance.

    Args:
        mu: the mean of each Poisson variable of ``Sk(mu)`` (variance ``2 mu``); 0 means no
            noise (``inf`` unless ``l2 = 0``).
        l1: l1 sensitivity of the integer vector (>= ``l2``).
        l2: l2 sensitivity of the integer vector (0 gives 0.0: nothing moves).

    Raises:
        PrivacyParameterError: for mu or a sensitivity out of range.
    """
    _finite_at_least(mu, "mu")
    _check_sensitivities(l1, l2)
    if l2 == 0:
        return 0.0
    if mu == 0:
        return math.inf
    v = 2.0 * mu
    return l2 * l2 / (2 * v) + (l2 * l2 + 3 * l1) / (2 * v * v)


def skellam_sigma(*, mu: float, l1: float, l2: float) -> float:
    """The RDP-equivalent Gaussian noise multiplier of the Skellam mechanism, unit sensitivity.

    Implements ``sigma' = 1 / sqrt(2 rho)`` with ``rho = skellam_rho(mu, l1, l2)``, so that the
    Skellam RDP bound (Agarwal, Kairouz, Liu 2021, Thm 3.5) is at most the Gaussian RDP
    ``alpha / (2 sigma'^2)`` at every order. Steinke's Poisson-subsampling bound (module
    docstring, step 2) grows with each ``eps(l)``, and fed ``eps(l) = l / (2 sigma'^2)`` it IS
    the sampled Gaussian mechanism's integer-order RDP (Mironov, Talwar, Zhang 2019), which
    Opacus' ``compute_rdp`` computes at integer orders. Hence the Poisson-subsampled Skellam
    mechanism's RDP at every integer order is at most ``compute_rdp(q, sigma', steps, orders)``
    at integer orders (never at fractional ones, where the subsampling bound is not proven).
    ``sigma' -> sqrt(2 mu) / l2`` (the Gaussian at the same variance) as ``mu`` grows.

    Returns:
        ``sigma' >= 0``: 0.0 when ``mu = 0`` (no noise), ``inf`` when ``l2 = 0``.

    Raises:
        PrivacyParameterError: for mu or a sensitivity out of range.
    """
    rho = skellam_rho(mu=mu, l1=l1, l2=l2)
    if rho == 0:
        return math.inf
    return 1.0 / math.sqrt(2.0 * rho)


def skellam_mu(*, sigma: float, l1: float, l2: float) -> float:
    """The smallest ``mu`` with ``skellam_sigma(mu, l1, l2) >= sigma``.

    Implements the inverse of ``skellam_sigma``: ``sigma' >= sigma`` iff ``2 rho <= 1 /
    sigma^2``, i.e. iff the variance ``v = 2 mu`` satisfies ``v^2 - sigma^2 l2^2 v - sigma^2
    (l2^2 + 3 l1) >= 0``, whose positive root is ``v = (sigma^2 l2^2 + sqrt(sigma^4 l2^4 + 4
    sigma^2 (l2^2 + 3 l1))) / 2`` (both terms positive: no cancellation); ``mu = v / 2``.

    Args:
        sigma: the RDP-equivalent Gaussian multiplier wanted, a finite number >= 0 (0 needs
            no noise).
        l1: l1 sensitivity of the integer vector (>= ``l2``).
        l2: l2 sensitivity of the integer vector (0 needs no noise: 0.0).

    Raises:
        PrivacyParameterError: for sigma or a sensitivity out of range.
    """
    _finite_at_least(sigma, "sigma")
    _check_sensitivities(l1, l2)
    if sigma == 0 or l2 == 0:
        return 0.0
    s2, b2 = sigma * sigma, l2 * l2
    v = (s2 * b2 + math.sqrt(s2 * s2 * b2 * b2 + 4 * s2 * (b2 + 3 * l1))) / 2
    return v / 2


def _subsampled_curve(
    base: NDArray[np.float64], orders: NDArray[np.int64], q: float
) -> NDArray[np.float64]:
    """Steinke's Poisson-subsampling bound at each of ``orders`` from ``base[l - 2] = eps(l)``,
    l = 2..max (module docstring, step 2)."""
    if q == 1.0:
        out: NDArray[np.float64] = base[orders - 2].copy()
        return out
    top = int(orders.max())
    ls = np.arange(2, top + 1, dtype=np.float64)
    alphas = orders.astype(np.float64)[:, None]
    log_terms = (
        gammaln(alphas + 1)
        - gammaln(ls + 1)
        - gammaln(np.maximum(alphas - ls, 0.0) + 1)
        + ls * math.log(q)
        + (alphas - ls) * math.log1p(-q)
        + (ls - 1) * base[None, :]
    )
    log_terms = np.where(ls <= alphas, log_terms, -np.inf)
    first = (alphas - 1) * math.log1p(-q) + np.log1p((alphas - 1) * q)
    total = logsumexp(np.concatenate([first, log_terms], axis=1), axis=1)
    bound: NDArray[np.float64] = np.minimum(total / (orders - 1), base[orders - 2])
    return bound


def subsampled_rdp(rdp_of_order: Callable[[int], float], alpha: int, q: float) -> float:
    """RDP at order ``alpha`` of a mechanism with RDP ``rdp_of_order`` under Poisson
    subsampling at rate ``q``.

    Implements the Poisson-subsampling RDP bound of Steinke 2022 (arXiv:2210.00597) at integer
    orders, add/remove adjacency (module docstring, step 2), capped by
    ``rdp_of_order(alpha)``; ``q = 1`` returns
    ``rdp_of_order(alpha)``. ``rdp_of_order`` is called at every order 2..alpha and must bound
    the divergence in both directions (true of the Skellam mechanism, whose noise is
    symmetric).

    Raises:
        PrivacyParameterError: for an order outside ``[2, MAX_ORDER]``, ``q`` outside (0, 1] or
            an RDP value that is negative or NaN.
    """
    _check_order(alpha)
    _check_rate(q)
    base = np.array([float(rdp_of_order(ell)) for ell in range(2, alpha + 1)])
    if np.isnan(base).any() or (base < 0).any():
        raise PrivacyParameterError(
            f"rdp_of_order gave {base.tolist()} at orders 2..{alpha}: RDP values must be >= 0"
        )
    return float(_subsampled_curve(base, np.array([alpha]), q)[0])


def _check_orders(orders: Sequence[int]) -> NDArray[np.int64]:
    if not orders:
        raise PrivacyParameterError("orders is empty: pass integer RDP orders, e.g. 2..256")
    for alpha in orders:
        _check_order(alpha)
    return np.asarray(orders, dtype=np.int64)


def skellam_rdp_curve(
    *,
    mu: float,
    l1: float,
    l2: float,
    sample_rate: float,
    orders: Sequence[int] = DEFAULT_ORDERS,
) -> list[float]:
    """RDP of ONE Poisson-subsampled Skellam step at each of ``orders``.

    Implements steps 1 and 2 of the module docstring (Theorem 3.5 of Agarwal et al. 2021
    through the Poisson-subsampling bound of Steinke 2022). Steps with different parameters
    compose by adding their curves order by order; ``skellam_epsilon`` does it for T equal
    steps.

    Raises:
        PrivacyParameterError: for parameters out of range.
    """
    _finite_at_least(mu, "mu")
    _check_sensitivities(l1, l2)
    _check_rate(sample_rate)
    alphas = _check_orders(orders)
    ls = range(2, int(alphas.max()) + 1)
    base = np.array([_skellam_rdp_unchecked(ell, mu, l1, l2) for ell in ls])
    return [float(r) for r in _subsampled_curve(base, alphas, sample_rate)]


def skellam_epsilon(
    *,
    mu: float,
    l1: float,
    l2: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[int] = DEFAULT_ORDERS,
) -> float:
    """Epsilon at ``delta`` of ``steps`` Poisson-subsampled Skellam steps (add/remove).

    Implements the module docstring's three steps: the per-step curve
    (``skellam_rdp_curve``), times ``steps`` (RDP composes additively), converted by Opacus'
    ``get_privacy_spent`` (Balle et al. 2020, Thm 21) at the best of ``orders``.

    Args:
        mu: each Poisson mean of the SUM's noise ``Sk(mu)`` (variance ``2 mu``; with H honest
            sites each adding ``Sk(share_mu(mu, H))``).
        l1: l1 sensitivity of one unit's rounded contribution (``rounded_l1_bound``).
        l2: l2 sensitivity of one unit's rounded contribution (``rounded_l2_bound``).
        sample_rate: Poisson rate q of each step, in (0, 1].
        steps: number of steps, >= 0 (0 gives 0.0).
        delta: the delta of the guarantee, in (0, 1).
        orders: integer RDP orders in ``[2, MAX_ORDER]``.

    Returns:
        Epsilon, ``inf`` when ``mu = 0`` and ``l2 > 0``.

    Raises:
        PrivacyParameterError: for parameters out of range.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise PrivacyParameterError(f"steps={steps!r} must be an integer >= 0")
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise PrivacyParameterError(f"delta={delta!r} must be in (0, 1), typically << 1/N")
    curve = skellam_rdp_curve(mu=mu, l1=l1, l2=l2, sample_rate=sample_rate, orders=orders)
    if steps == 0:
        return 0.0
    rdp = [steps * r for r in curve]
    eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


def calibrate_skellam_mu(
    *,
    target_epsilon: float,
    delta: float,
    l1: float,
    l2: float,
    sample_rate: float,
    steps: int,
    relative_tolerance: float = 0.01,
    orders: Sequence[int] = DEFAULT_ORDERS,
) -> float:
    """The smallest ``mu`` (within ``relative_tolerance``) whose ``skellam_epsilon`` is at most
    ``target_epsilon``.

    Implements the calibration of the secure sum's noise (docs/design.md §3.3) by bisection:
    epsilon decreases in ``mu`` (every term of the Skellam RDP does, and the subsampling bound
    and the conversion are monotone), so doubling from 1 (or halving) brackets the answer and
    bisection narrows the bracket ``[lo, hi]`` until ``hi - lo <= relative_tolerance * hi``.
    The ``mu`` returned is ``hi``: ``skellam_epsilon(hi) <= target_epsilon`` and
    ``skellam_epsilon(hi * (1 - relative_tolerance)) > target_epsilon``. Zero sensitivity
    needs no noise and returns 0.0 when that meets the target.

    Raises:
        PrivacyParameterError: for parameters out of range, or a target no ``mu`` up to
            ``MU_SEARCH_MAX`` reaches (the RDP conversion alone costs about
            ``log(1/delta) / (max order - 1)``).
    """
    _finite_at_least(target_epsilon, "target_epsilon")
    if target_epsilon <= 0:
        raise PrivacyParameterError(f"target_epsilon={target_epsilon!r} must be > 0")
    if not 0 < relative_tolerance < 1:
        raise PrivacyParameterError(
            f"relative_tolerance={relative_tolerance!r} must be in (0, 1), e.g. 0.01"
        )

    def eps_at(mu: float) -> float:
        with warnings.catch_warnings():  # Opacus warns when the search probes an extreme mu
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return skellam_epsilon(
                mu=mu,
                l1=l1,
                l2=l2,
                sample_rate=sample_rate,
                steps=steps,
                delta=delta,
                orders=orders,
            )

    if eps_at(0.0) <= target_epsilon:
        return 0.0
    lo, hi = 0.0, 1.0
    while eps_at(hi) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > MU_SEARCH_MAX:
            raise PrivacyParameterError(
                f"no mu up to {MU_SEARCH_MAX:g} reaches epsilon={target_epsilon} at "
                f"delta={delta} over {steps} steps at q={sample_rate}: the budget is too low "
                "for these orders. Raise the budget or lower the steps or the sampling rate."
            )
    if lo == 0.0:  # hi = 1 already meets the target: halve down to a failing lo
        lo = hi / 2
        while eps_at(lo) <= target_epsilon:
            hi, lo = lo, lo / 2
    while hi - lo > relative_tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps_at(mid) <= target_epsilon else (mid, hi)
    return hi
