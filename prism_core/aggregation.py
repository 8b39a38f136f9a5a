"""Noise-aware aggregation of site updates in the tangent space (post-processing; design §3).

Site k releases an update whose Gaussian noise has per-coordinate std ``sigma_k C_k / b_k``
(noise multiplier, clip, EXPECTED batch size: public facts of its mechanism). All sites of a
round share one base point, so their tangent updates live in one vector space and any fixed
weighting ``sum_k w_k dZ_k`` with ``sum_k w_k = 1`` is an unbiased estimate of the common
expected update. Among those, inverse-variance weights ``w_k ~ (b_k / (sigma_k C_k))^2``
minimise the variance of the aggregate's noise (Gauss-Markov / Aitken). Choosing weights from
DP outputs and public parameters is post-processing: it costs no privacy.

The common expected update is an assumption: under label skew each site's expected update
leans to its own labels, and only shard-size weights ``w_k ~ N_k`` estimate the POOLED data's
step without bias (each example counts once, as in centralised training), at little noise cost
when the large sites are also the least noisy (``sigma_k`` falls with ``q_k = b / N_k``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "aggregate_noise_std",
    "aggregation_weights",
    "site_noise_std",
]

Aggregation = Literal["inverse-noise", "uniform", "examples"]
AGGREGATIONS: tuple[str, ...] = ("inverse-noise", "uniform", "examples")


def site_noise_std(
    *, noise_multiplier: float, max_norm: float, expected_batch_size: float
) -> float:
    """Per-coordinate noise std ``sigma C / b`` of one DP step's release.

    Implements the noise scale of eqs. (17)-(18) of PRISM (``tau`` of §3.3).

    Raises:
        ValueError: a parameter is negative, not finite, or ``C``/``b`` is not positive.
    """
    values = (noise_multiplier, max_norm, expected_batch_size)
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"noise parameters must be finite, got {values}")
    if noise_multiplier < 0 or max_norm <= 0 or expected_batch_size <= 0:
        raise ValueError(
            f"need sigma >= 0, C > 0 and b > 0; got sigma={noise_multiplier}, C={max_norm}, "
            f"b={expected_batch_size}"
        )
    return noise_multiplier * max_norm / expected_batch_size


def aggregation_weights(
    mode: Aggregation,
    *,
    noise_stds: Sequence[float],
    num_examples: Sequence[float] | None = None,
) -> list[float]:
    """Normalised weights (summing to 1) of the sites' updates.

    Implements the weighting of docs/design.md §3: ``inverse-noise`` gives
    ``w_k = s_k^-2 / sum_j s_j^-2`` with ``s_k = sigma_k C_k / b_k`` (the minimum-variance
    unbiased combination of updates with a common mean and independent noise); ``uniform``
    gives ``1 / K``; ``examples`` gives ``N_k / sum_j N_j`` (FedAvg; the sites' shard sizes,
    which are not DP: a site sampling at ``q_k = b / N_k`` states its size in ``q_k``).

    Args:
        mode: the aggregation rule.
        noise_stds: ``s_k`` per site (``site_noise_std``); all zero for a non-DP run, where
            ``inverse-noise`` falls back to ``uniform`` (no noise to weigh).
        num_examples: ``N_k`` per site, required for ``examples``.

    Raises:
        ValueError: no sites, a bad std or count, mixed zero and non-zero stds under
            ``inverse-noise``, or missing counts under ``examples``.
    """
    count = len(noise_stds)
    if count == 0:
        raise ValueError("no site updates to weigh")
    if any(not (math.isfinite(s) and s >= 0) for s in noise_stds):
        raise ValueError(f"noise stds must be finite and >= 0, got {list(noise_stds)}")
    if mode == "uniform":
        return [1.0 / count] * count
    if mode == "examples":
        if num_examples is None or len(num_examples) != count:
            raise ValueError("aggregation 'examples' needs every site's num-examples")
        if any(not (math.isfinite(n) and n > 0) for n in num_examples):
            raise ValueError(f"num-examples must be positive, got {list(num_examples)}")
        total = float(sum(num_examples))
        return [float(n) / total for n in num_examples]
    if mode != "inverse-noise":
        raise ValueError(f"aggregation={mode!r}: use one of {', '.join(AGGREGATIONS)}")
    zero = [s == 0 for s in noise_stds]
    if all(zero):
        return [1.0 / count] * count
    if any(zero):
        raise ValueError(
            "inverse-noise weights need every site's noise std > 0 (a site without noise would "
            "take all the weight); a round mixes private and non-private updates"
        )
    precision = [1.0 / (s * s) for s in noise_stds]
    total = math.fsum(precision)
    return [p / total for p in precision]


def aggregate_noise_std(weights: Sequence[float], noise_stds: Sequence[float]) -> float:
    """Per-coordinate noise std of ``sum_k w_k x_k`` for independent noises of std ``s_k``.

    Implements ``sqrt(sum_k w_k^2 s_k^2)``; with inverse-noise weights this is
    ``(sum_k s_k^-2)^{-1/2}``, the smallest over all normalised weightings.
    """
    if len(weights) != len(noise_stds):
        raise ValueError(f"{len(weights)} weights but {len(noise_stds)} noise stds")
    return math.sqrt(math.fsum((w * s) ** 2 for w, s in zip(weights, noise_stds, strict=True)))
