"""The integer mechanism of a secure sum: randomized rounding and Skellam noise (§3.3).

Under secure aggregation (docs/design.md §3.3) each of K sites scales its clipped sum by
``1 / gamma``, rounds it to integers, adds a SHARE of integer noise and masks the result modulo
``2^b``; the coordinator learns only the modular sum. This module implements the site's
arithmetic before the masking:

- ``randomized_round``: unbiased stochastic rounding of ``x / gamma`` (each coordinate rounds up
  with probability equal to its fractional part), and ``conditional_round``, which repeats it
  until the rounded vector's l2 norm is within a stated bound (Kairouz, Liu, Steinke 2021,
  arXiv:2102.06387, Sec. 4.1, "conditional randomized rounding");
- ``rounded_l2_bound`` and ``rounded_l1_bound``: the l2 and l1 sensitivities of a rounded
  contribution, which the accountant (``prism_core.skellam_accounting``) needs;
- ``skellam_noise``: symmetric Skellam noise ``Sk(mu) = Poisson(mu) - Poisson(mu)`` per
  coordinate (variance ``2 mu``), and ``share_mu``: each site's share of the noise parameter.

Why Skellam (Agarwal, Kairouz, Liu 2021, arXiv:2110.04995): Poisson laws are closed under
summation, ``Poisson(a) + Poisson(b) = Poisson(a + b)``, so the sum of H independent shares
``Sk(mu / H)`` is EXACTLY ``Sk(mu)``. The noise of the coordinator's sum is then one Skellam
variable per coordinate whose Rényi divergence under a shift has a proven bound, and the
epsilon of the sum is computed, not approximated. The distributed discrete Gaussian lacks this:
a sum of discrete Gaussians is not a discrete Gaussian, and its privacy is only approximately
that of the central mechanism. Integer noise also removes the floating-point attacks on the
low-order bits of continuous noise (Mironov 2012).

Randomness: every draw comes from a ``NoiseSource`` (``prism_core.rng``): a seeded
``torch.Generator`` for reproducible tests, or ``SecureRNG()`` in production, in which case the
uniforms are read from the operating system's CSPRNG (``os.urandom``), 53 random bits each, so
no seed the caller does not own can predict or replay the noise. Both sources drive the SAME
samplers (inversion and transformed rejection on 53-bit uniforms), so a test of the seeded path
tests the production algorithm. The samplers compute in float64, like numpy's and torch's
Poisson samplers: the sampled law matches the Poisson pmf up to double rounding (relative
errors near 1e-16), not in exact integer arithmetic.
"""

from __future__ import annotations

import math
import os
from typing import Final

import numpy as np
import torch
from numpy.typing import NDArray
from scipy.special import gammaln
from torch import Tensor

from prism_core.errors import PrivacyParameterError
from prism_core.rng import NoiseSource, SecureRNG

__all__ = [
    "DEFAULT_MAX_TRIES",
    "conditional_round",
    "randomized_round",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "share_mu",
    "skellam_noise",
    "uniform",
]

DEFAULT_MAX_TRIES: Final = 100
"""Roundings ``conditional_round`` draws before it gives up. With the failure probability
``beta`` of ``rounded_l2_bound`` a try fails with probability at most ``beta``; 100 failures in a
row mean a bound below what the contribution allows, not bad luck."""

ROUND_MAX: Final = 2.0**53
"""Largest magnitude of ``x / gamma`` that rounds exactly: float64 represents every integer up
to 2^53, and the rounded values must stay exact."""

_UNIFORM_BITS: Final = 53
_BELOW_ONE: Final = 1.0 - 2.0**-53
"""The largest float64 below 1: uniforms are clamped to it, so they lie in (0, 1)."""

PTRS_MIN_MU: Final = 10.0
"""Poisson means from which the transformed rejection sampler is used (Hörmann 1993 states it
for means of at least 10); below, inversion of the cumulative distribution."""

_INVERSION_TAIL_SDS: Final = 40.0
"""Standard deviations of the inversion table beyond the mean: the Poisson mass past it is far
below the 2^-53 resolution of the uniforms."""


def uniform(count: int, source: NoiseSource) -> NDArray[np.float64]:
    """``count`` i.i.d. uniforms on (0, 1), each from 53 random bits, as float64.

    The value is ``(k + 1/2) 2^-53`` for ``k`` uniform on ``[0, 2^53)``, clamped below 1 (the
    last half-step rounds to 1.0 in float64), like ``SecureRNG``'s Box-Muller uniforms. ``k``
    comes from ``os.urandom`` for a ``SecureRNG`` and from ``torch.randint`` on a seeded
    ``torch.Generator`` otherwise.

    Raises:
        PrivacyParameterError: for a negative ``count``.
    """
    if count < 0:
        raise PrivacyParameterError(f"count={count!r} must be >= 0")
    if isinstance(source, SecureRNG):
        raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
        bits = (raw >> np.uint64(64 - _UNIFORM_BITS)).astype(np.float64)
    else:
        drawn = torch.randint(
            0, 2**_UNIFORM_BITS, (count,), generator=source, dtype=torch.int64, device=source.device
        )
        bits = drawn.cpu().numpy().astype(np.float64)
    u: NDArray[np.float64] = np.minimum((bits + 0.5) * 2.0**-_UNIFORM_BITS, _BELOW_ONE)
    return u


def _check_gamma(gamma: float) -> None:
    real = isinstance(gamma, int | float) and not isinstance(gamma, bool)
    if not (real and math.isfinite(gamma) and gamma > 0):
        raise PrivacyParameterError(
            f"gamma={gamma!r} must be a finite number > 0: the granularity of the integer grid "
            "(the value of one integer step)"
        )


def randomized_round(x: Tensor, gamma: float, *, generator: NoiseSource) -> Tensor:
    """Unbiased stochastic rounding of ``x / gamma`` to integers (int64, on ``x``'s device).

    Implements the randomized rounding of Kairouz, Liu, Steinke 2021 (arXiv:2102.06387,
    Sec. 4.1): with ``y = x / gamma`` (float64), each coordinate becomes ``floor(y)+1`` with
    probability ``y - floor(y)`` and ``floor(y)`` otherwise, so ``E[round(y)] = y`` and every
    coordinate moves by less than 1. The uniforms come from ``generator`` (``uniform``); the
    input is not modified.

    Notes:
        Any shape; ``x`` floating point. ``|x / gamma|`` must stay below ``ROUND_MAX`` = 2^53.

    Raises:
        PrivacyParameterError: for ``gamma`` not finite and positive, a non-finite entry of
            ``x`` (clip first: a non-finite contribution counts as zero), or ``|x / gamma|``
            past ``ROUND_MAX``.
    """
    _check_gamma(gamma)
    y = x.detach().to(torch.float64) / gamma
    if not bool(torch.isfinite(y).all()):
        raise PrivacyParameterError(
            "x has non-finite entries (or x / gamma overflows float64): clip the contribution "
            "first (a non-finite contribution counts as zero) or raise gamma"
        )
    largest = float(y.abs().max()) if y.numel() else 0.0
    if largest >= ROUND_MAX:
        raise PrivacyParameterError(
            f"|x / gamma| reaches {largest:.3g}, past 2^53 where float64 stops representing "
            f"every integer: raise gamma (now {gamma!r})"
        )
    low = torch.floor(y)
    u = torch.from_numpy(uniform(y.numel(), generator)).to(y.device).reshape(y.shape)
    return (low + (u < y - low).to(torch.float64)).to(torch.int64)


def rounded_l2_bound(*, l2_norm: float, gamma: float, dim: int, beta: float | None = None) -> float:
    """The l2 bound, in integer units, of the rounding of a vector of l2 norm <= ``l2_norm``.

    With ``c = l2_norm / gamma`` and ``d = dim``:

    - ``beta=None``: ``c + sqrt(d)``, which EVERY rounding satisfies (each coordinate moves by
      less than 1, so ``||round(y)|| <= ||y|| + ||round(y) - y|| < c + sqrt(d)``). It also holds
      for the rounding of a site's SUM: coupling the two neighbouring sums through the same
      uniforms (``round(y) = floor(y + u')`` with ``u'`` uniform), their roundings differ by a
      vector whose coordinates are within 1 of the contribution's, and Rényi divergence is
      jointly quasi-convex (van Erven, Harremoës 2014, Thm 13), so the sum's rounding costs no
      more than a shift of that norm.
    - ``beta`` in (0, 1):
      ``min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))``, the bound
      of Kairouz, Liu, Steinke 2021 (arXiv:2102.06387, Sec. 4.1; TFF's
      ``DistributedDpSumFactory``): ``E||round(y)||^2 <= ||y||^2 + d/4`` and Hoeffding's
      inequality over the coordinates (each squared coordinate ranges over ``|2 floor(y_i) +
      1| <= 2|y_i| + 1``) make one rounding exceed it with probability at most ``beta``. It
      bounds a contribution rounded ON ITS OWN by ``conditional_round`` with this bound
      (which retries on failure), not the rounding of a sum.

    Raises:
        PrivacyParameterError: for a negative or non-finite ``l2_norm``, a bad ``gamma``, a
            ``dim`` below 1 or a ``beta`` outside (0, 1).
    """
    _check_gamma(gamma)
    if not (math.isfinite(l2_norm) and l2_norm >= 0):
        raise PrivacyParameterError(f"l2_norm={l2_norm!r} must be a finite number >= 0")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise PrivacyParameterError(f"dim={dim!r} must be an integer >= 1 (the vector's length)")
    c = l2_norm / gamma
    always = c + math.sqrt(dim)
    if beta is None:
        return always
    if not 0 < beta < 1:
        raise PrivacyParameterError(
            f"beta={beta!r} must be in (0, 1) (the chance that one rounding exceeds the bound), "
            "or None for the bound every rounding meets"
        )
    likely = math.sqrt(
        c * c + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(dim) / 2)
    )
    return min(always, likely)


def rounded_l1_bound(*, l2_bound: float, dim: int) -> float:
    """The l1 bound of an integer vector of ``dim`` coordinates with l2 norm <= ``l2_bound``.

    ``min(sqrt(d) * l2_bound, l2_bound^2)``: Cauchy-Schwarz, and ``|k| <= k^2`` for every
    integer ``k``, so ``||v||_1 <= ||v||_2^2`` for an integer vector (the l1 sensitivity that
    the Skellam accountant takes with the l2 one, Agarwal, Kairouz, Liu 2021).

    Raises:
        PrivacyParameterError: for a negative or non-finite bound or a ``dim`` below 1.
    """
    if not (math.isfinite(l2_bound) and l2_bound >= 0):
        raise PrivacyParameterError(f"l2_bound={l2_bound!r} must be a finite number >= 0")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise PrivacyParameterError(f"dim={dim!r} must be an integer >= 1 (the vector's length)")
    return min(math.sqrt(dim) * l2_bound, l2_bound * l2_bound)


def conditional_round(
    x: Tensor,
    gamma: float,
    *,
    bound: float,
    generator: NoiseSource,
    max_tries: int = DEFAULT_MAX_TRIES,
) -> Tensor:
    """``randomized_round(x, gamma)`` redrawn until its l2 norm is at most ``bound``.

    Implements the conditional randomized rounding of Kairouz, Liu, Steinke 2021
    (arXiv:2102.06387, Sec. 4.1): the rounding is repeated with fresh uniforms until
    ``||round(x / gamma)||_2 <= bound`` (norm in float64), so the released vector's sensitivity
    is ``bound`` whatever the draw. With ``bound = rounded_l2_bound(..., beta=None)`` the first
    draw always passes; with the ``beta`` bound each try fails with probability at most
    ``beta``.

    Raises:
        PrivacyParameterError: for a bad ``gamma``, ``bound`` or ``max_tries``, or when
            ``max_tries`` roundings in a row all exceed ``bound`` (a bound below what the
            contribution allows: compute it with ``rounded_l2_bound`` from the clip norm).
    """
    if not (math.isfinite(bound) and bound >= 0):
        raise PrivacyParameterError(f"bound={bound!r} must be a finite number >= 0")
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise PrivacyParameterError(f"max_tries={max_tries!r} must be an integer >= 1")
    smallest = math.inf
    for _ in range(max_tries):
        rounded = randomized_round(x, gamma, generator=generator)
        norm = float(torch.linalg.vector_norm(rounded.to(torch.float64)))
        if norm <= bound:
            return rounded
        smallest = min(smallest, norm)
    raise PrivacyParameterError(
        f"{max_tries} roundings of x / gamma all had l2 norm above bound={bound!r} (smallest "
        f"{smallest:.6g}): the bound is below what this contribution allows. Compute it with "
        "rounded_l2_bound from the clip norm, gamma and the dimension, and clip x to that norm."
    )


def _check_mu(mu: float, what: str = "mu") -> None:
    if not (isinstance(mu, int | float) and math.isfinite(mu) and mu >= 0):
        raise PrivacyParameterError(
            f"{what}={mu!r} must be a finite number >= 0 (the mean of each of the two Poisson "
            "variables; the Skellam variance is 2 mu)"
        )


def _poisson_inversion(mu: float, u: NDArray[np.float64]) -> NDArray[np.int64]:
    """Poisson(mu) by inversion of its cumulative distribution at the uniforms ``u``: the
    smallest ``k`` with ``u < F(k)``, from a float64 table of ``F`` over ``mu + 40 sd``."""
    top = math.ceil(mu + _INVERSION_TAIL_SDS * math.sqrt(mu) + _INVERSION_TAIL_SDS)
    k = np.arange(top + 1, dtype=np.float64)
    cdf = np.cumsum(np.exp(k * math.log(mu) - mu - gammaln(k + 1)))
    drawn: NDArray[np.int64] = np.searchsorted(cdf, u, side="right").astype(np.int64)
    return drawn


def _poisson_ptrs(mu: float, count: int, source: NoiseSource) -> NDArray[np.int64]:
    """Poisson(mu), ``mu >= 10``, by Hörmann's transformed rejection with squeeze (PTRS;
    W. Hörmann 1993, "The transformed rejection method for generating Poisson random
    variables", Insurance: Mathematics and Economics 12, 39-45), the algorithm of numpy's legacy
    sampler, vectorised: every round draws two uniforms per sample still pending."""
    slam, loglam = math.sqrt(mu), math.log(mu)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    log_invalpha = math.log(1.1239 + 1.1328 / (b - 3.4))
    vr = 0.9277 - 3.6224 / (b - 2)
    out = np.empty(count, dtype=np.int64)
    pending = np.arange(count)
    while pending.size:
        n = pending.size
        draws = uniform(2 * n, source)
        u, v = draws[:n] - 0.5, draws[n:]
        us = 0.5 - np.abs(u)  # in (0, 0.5]: the uniforms avoid 0 and 1
        k = np.floor((2 * a / us + b) * u + mu + 0.43)
        quick = (us >= 0.07) & (v <= vr)
        rejected = (k < 0) | ((us < 0.013) & (v > us))
        k_safe = np.maximum(k, 0.0)
        exact = np.log(v) + log_invalpha - np.log(a / (us * us) + b) <= (
            -mu + k_safe * loglam - gammaln(k_safe + 1)
        )
        accept = quick | (~rejected & exact)
        out[pending[accept]] = k[accept].astype(np.int64)
        pending = pending[~accept]
    return out


def _poisson(mu: float, count: int, source: NoiseSource) -> NDArray[np.int64]:
    """``count`` i.i.d. Poisson(mu) samples from ``source`` (int64)."""
    if mu == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    if mu < PTRS_MIN_MU:
        return _poisson_inversion(mu, uniform(count, source))
    return _poisson_ptrs(mu, count, source)


def skellam_noise(
    shape: tuple[int, ...],
    mu: float,
    *,
    source: NoiseSource,
    device: torch.device | str | None = None,
) -> Tensor:
    """I.i.d. symmetric Skellam samples ``Poisson(mu) - Poisson(mu)`` (int64, mean 0, variance
    ``2 mu``) of the given shape, drawn from ``source``.

    Implements the noise of the multi-dimensional Skellam mechanism (Agarwal, Kairouz, Liu 2021,
    arXiv:2110.04995), ``Sk(mu, mu)`` per coordinate; note that the paper writes its
    parameter as the VARIANCE, ``2 mu`` here. Poisson draws use inversion for ``mu < 10`` and
    Hörmann's PTRS above (``PTRS_MIN_MU``), both driven by ``uniform``: OS CSPRNG uniforms for
    a ``SecureRNG``, seeded ones for a ``torch.Generator``. ``mu = 0`` gives zeros.

    Raises:
        PrivacyParameterError: for a ``mu`` not finite and >= 0 or a negative dimension.
    """
    _check_mu(mu)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise PrivacyParameterError(f"shape={shape!r} must hold integers >= 0")
    count = math.prod(shape)
    both = _poisson(float(mu), 2 * count, source)
    noise = both[:count] - both[count:]
    return torch.from_numpy(noise.reshape(shape)).to(device=device)


def share_mu(mu_total: float, honest: int) -> float:
    """Each site's Skellam parameter ``mu_total / H`` so that H honest shares sum to
    ``Sk(mu_total)``.

    Implements the distributed noise of docs/design.md §3.3 by the closure of the Poisson law
    under summation (Agarwal, Kairouz, Liu 2021): the sum of H independent
    ``Sk(mu_total / H)`` is exactly ``Sk(mu_total)``, so with at least H honest sites the sum
    carries the central noise, whatever the other sites add (noise a colluder knows protects
    nothing and is not counted).

    Raises:
        PrivacyParameterError: for a ``mu_total`` not finite and >= 0 or ``honest`` below 1.
    """
    _check_mu(mu_total, "mu_total")
    if isinstance(honest, bool) or not isinstance(honest, int) or honest < 1:
        raise PrivacyParameterError(
            f"honest={honest!r} must be an integer >= 1: the number of sites trusted to add "
            "their share"
        )
    return mu_total / honest
