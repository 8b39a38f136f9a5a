"""A private clip norm: the DP quantile estimate of Andrew et al. (2021), geometric update.

"Differentially private learning with adaptive clipping" (Andrew, Thakkar, McMahan, Ramaswamy,
NeurIPS 2021), §2.1 and Algorithm 1: to set the clip C near the ``gamma``-quantile of the
per-example norms, draw a Poisson batch (rate q, expected size b), count the examples whose norm
is ``<= C``, release the count with Gaussian noise and move C geometrically::

    f~ = (sum_i 1[s_i <= C] + N(0, sigma_b^2)) / b          (noisy fraction below C)
    C <- C * exp(-eta (f~ - gamma))                          (geometric update)

The count has sensitivity 1 under add/remove adjacency (one example changes it by at most 1),
so each step is a Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma_b`` and
is accounted like a training step (``prism_core.accounting``; mechanism ``QUANTILE_MECHANISM``).
The divisor is the EXPECTED batch size b, never the realised one (that would leak it).

Here the estimate runs once, before training, for a fixed number of steps K from a public
start ``C_0``. The noisy fraction is clipped to ``[0, 1]`` before the update (post-processing),
so every step moves C by a factor in ``[exp(-eta (1 - gamma)), exp(eta gamma)]`` and the
estimate after K steps lies in the public interval ``clip_range(C_0, ...)`` whatever the data
and the noise: the coordinator can check a reported C against it.

Pure functions; the noise comes from a ``prism_core.rng`` source given by the caller.
"""

from __future__ import annotations

import math

import torch

from prism_core.errors import PrivacyParameterError
from prism_core.records import PrivacyEvent
from prism_core.rng import NoiseSource, standard_normal

__all__ = [
    "QUANTILE_MECHANISM",
    "QUANTILE_SENSITIVITY",
    "clip_range",
    "count_noise_multiplier",
    "geometric_clip_update",
    "noisy_fraction_below",
]

QUANTILE_MECHANISM = "quantile-gaussian"
"""``PrivacyEvent.mechanism`` (and ledger mechanism) of one noisy quantile-count step."""

QUANTILE_SENSITIVITY = 1.0
"""L2 sensitivity of the count of examples below C under add/remove adjacency."""


def _check_quantile_update(target_quantile: float, lr: float) -> None:
    if not (0 < target_quantile < 1 and math.isfinite(target_quantile)):
        raise PrivacyParameterError(
            f"target_quantile={target_quantile!r} must be in (0, 1) (the gamma-quantile of the "
            "per-example norms to aim the clip at)"
        )
    if not (lr > 0 and math.isfinite(lr)):
        raise PrivacyParameterError(f"lr={lr!r}: the geometric update's rate must be > 0")


def count_noise_multiplier(noise_fraction: float, expected_batch_size: float) -> float:
    """``sigma_b = noise_fraction * b``: the count's noise std (= its noise multiplier).

    Implements the noise scale of Andrew et al. (2021), §2.1 (they use ``sigma_b = b / 20``,
    i.e. ``noise_fraction = 0.05``): the noisy FRACTION then has std ``noise_fraction``
    whatever the batch size.
    """
    if not (noise_fraction > 0 and math.isfinite(noise_fraction)):
        raise PrivacyParameterError(f"noise_fraction={noise_fraction!r} must be > 0")
    if not (expected_batch_size > 0 and math.isfinite(expected_batch_size)):
        raise PrivacyParameterError(f"expected_batch_size={expected_batch_size!r} must be > 0")
    return noise_fraction * expected_batch_size


def noisy_fraction_below(
    count_below: int,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
) -> tuple[float, PrivacyEvent]:
    """The DP fraction of a Poisson batch whose norms are ``<= C``, and its ``PrivacyEvent``.

    Implements the noisy count of Andrew et al. (2021), Algorithm 1::

        f~ = (count_below + sigma_b z) / b,     z ~ N(0, 1),   b = q N

    Args:
        count_below: examples of the batch with per-example norm ``<= C`` (PRIVATE).
        noise_multiplier: ``sigma_b`` (``count_noise_multiplier``); the sensitivity is 1.
        expected_batch_size: b = q * N, the divisor. The realised batch size is never used.
        sample_rate: Poisson rate q, recorded for accounting.
        generator: noise source (a seeded ``torch.Generator`` or ``SecureRNG``).

    Returns:
        ``(f~, record)``: the released fraction (not clipped to [0, 1]) and what ran.

    Raises:
        PrivacyParameterError: sigma_b <= 0 (the count would be released un-noised), b <= 0,
            q outside (0, 1], or a negative count.
    """
    if count_below < 0:
        raise PrivacyParameterError(f"count_below={count_below!r} must be >= 0")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise PrivacyParameterError(
            f"noise_multiplier={noise_multiplier!r} must be > 0: an un-noised count of the "
            "examples below the clip would leak"
        )
    if not (expected_batch_size > 0 and math.isfinite(expected_batch_size)):
        raise PrivacyParameterError(f"expected_batch_size={expected_batch_size!r} must be > 0")
    if not 0 < sample_rate <= 1:
        raise PrivacyParameterError(f"sample_rate={sample_rate!r} must be in (0, 1]")
    z = standard_normal((1,), generator, dtype=torch.float64, device=torch.device("cpu"))
    scale = noise_multiplier * QUANTILE_SENSITIVITY
    fraction = (count_below + scale * float(z[0])) / expected_batch_size
    record = PrivacyEvent(
        mechanism=QUANTILE_MECHANISM,
        noise_multiplier=float(noise_multiplier),
        max_norm=QUANTILE_SENSITIVITY,
        expected_batch_size=float(expected_batch_size),
        sample_rate=float(sample_rate),
        steps=1,
    )
    return fraction, record


def geometric_clip_update(
    clip: float, fraction: float, *, target_quantile: float, lr: float
) -> float:
    """``C * exp(-eta (clamp(f~, 0, 1) - gamma))``: one geometric step toward the quantile.

    Implements the geometric update of Andrew et al. (2021), eq. (2) / Algorithm 1, with the
    noisy fraction clipped to [0, 1] (post-processing) so one step moves C by a factor in
    ``[exp(-eta (1 - gamma)), exp(eta gamma)]``.
    """
    _check_quantile_update(target_quantile, lr)
    if not (clip > 0 and math.isfinite(clip)):
        raise PrivacyParameterError(f"clip={clip!r} must be finite and > 0")
    if math.isnan(fraction):
        raise PrivacyParameterError("fraction is NaN")
    bounded = min(max(fraction, 0.0), 1.0)
    return clip * math.exp(-lr * (bounded - target_quantile))


def clip_range(
    initial: float, *, target_quantile: float, lr: float, steps: int
) -> tuple[float, float]:
    """``(C_0 exp(-eta (1 - gamma) K), C_0 exp(eta gamma K))``: every possible estimate.

    Implements the range of K steps of ``geometric_clip_update`` from ``C_0``: a public,
    data-independent interval (each step's factor is bounded, see the module docstring).
    """
    _check_quantile_update(target_quantile, lr)
    if not (initial > 0 and math.isfinite(initial)):
        raise PrivacyParameterError(f"initial={initial!r} must be finite and > 0")
    if steps < 0:
        raise PrivacyParameterError(f"steps={steps!r} must be >= 0")
    low = initial * math.exp(-lr * (1 - target_quantile) * steps)
    high = initial * math.exp(lr * target_quantile * steps)
    return low, high
