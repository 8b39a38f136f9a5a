"""How far one site's honest round can move the global adapter: norm bounds for the coordinator.

A coordinator that knows the run configuration (clip C, expected batch b, local steps tau, local
learning rate, optimizer) can bound the update an HONEST site sends, and reject anything larger
before it touches the aggregate. Three ingredients, each a pure function:

- ``adam_gain``: an adaptive (Adam-like) direction is scale-free: ``|m_hat| / sqrt(v_hat)`` is
  bounded by a constant of the betas alone, whatever the gradients (Cauchy-Schwarz over the
  exponential averages). This covers PRISM's rank-space transform (eqs. 24-26) and torch's
  Adam/AdamW used for the head and the factor-space baselines.
- ``dp_step_norm_bound``: the intrinsic norm of one raw DP tangent update (eqs. 17-18):
  clipped sum ``<= C X / b`` with a Chernoff tail on the realised Poisson batch ``X``, plus noise
  ``sigma C ||Xi|| / b`` with ``||Xi||^2 ~ chi^2_D``, ``D = sum_l r(m + n - r)`` (Thm 3.1) plus
  the Euclidean head coordinates, bounded by the Laurent-Massart tail. Used when the local
  optimizer is plain SGD on the DP update.
- ``round_update_norm_bound`` / ``factor_update_norm_bounds``: compose ``tau`` steps with the
  triangle inequality and the retraction slack (a factor 2, exact, see below).

Everything is deterministic except the DP-SGD branch, whose failure probability is stated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from prism_core.manifold import Point, work_dtype

__all__ = [
    "FLOAT32_SLACK",
    "adam_gain",
    "chernoff_batch_quantile",
    "chi_norm_quantile",
    "dp_step_norm_bound",
    "factor_update_norm_bounds",
    "round_update_norm_bound",
    "tangent_dimension",
]

FLOAT32_SLACK = 1e-3
"""Relative allowance for float32 round-off in a site's computation and in the wire format."""

Optimizer = Literal["adaptive", "sgd"]


def adam_gain(
    *, beta1: float, beta2: float, bias_correction: bool = True, max_step: int | None = None
) -> float:
    """Data-independent bound ``G`` on an Adam-like ratio ``|m_hat| / sqrt(v_hat)``.

    Implements the norm bound of the adaptive transform, eqs. (24)-(26) of PRISM (and of torch's
    Adam/AdamW, the scalar case ``m = r = 1``)::

        m_t = sum_s w_s x_s,           w_s = (1 - b1) b1^(t-s)
        V_t = sum_s c_s x_s.T x_s,     c_s = (1 - b2) b2^(t-s)
        m_t.T m_t  <=  (sum_s w_s^2 / c_s) V_t      (matrix Cauchy-Schwarz, Loewner order)
        ||m_hat (V_hat + lambda I)^(-1/2)||_F^2  <=  G_t^2 tr(V_hat (V_hat + lambda I)^(-1))
                                                  <=  G_t^2 r
        G_t^2 = (1 - b2^t) / (1 - b1^t)^2 * (1 - b1)^2 / (1 - b2) * sum_{j<t} (b1^2 / b2)^j

    With PRISM's ``V_A = sum_s c_s dA_s.T dA_s / m`` this gives ``||U_A||_F <= G sqrt(m r)`` and
    ``||U_B||_F <= G sqrt(n r)``; for torch Adam, ``|update_i| <= lr G`` per coordinate. Floors
    ``lambda >= 0`` and the condition-number clamp only enlarge ``V_hat + lambda I`` and so keep
    the bound; torch's ``eps`` likewise. Orthogonal moment re-alignment between rounds
    (``realign_state``) and the min-norm re-lifts preserve it.

    Args:
        beta1, beta2: moment decays in [0, 1).
        bias_correction: whether ``1 / (1 - beta^t)`` corrections are applied.
        max_step: the largest step count ``t`` the optimizer can have reached; ``None`` for no
            limit (only possible when ``b1^2 < b2``).

    Returns:
        ``G = sup_{1 <= t <= max_step} G_t`` (``inf`` if unbounded).

    Notes:
        Assumes ``V`` is the plain second moment: subtracting a noise covariance from it (the
        paper's debiasing, not implemented) could make the ratio arbitrarily large. For ``t``
        past the point where
        ``b1^t < 1e-12`` the remaining terms are bounded in closed form, so the loop is short.
    """
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"beta1={beta1}, beta2={beta2}: both must be in [0, 1)")
    if max_step is not None and max_step < 1:
        raise ValueError(f"max_step={max_step} must be >= 1 or None")
    if beta1 > 0 and beta2 == 0:
        return math.inf  # V forgets everything but the last step while m remembers older ones
    rho = beta1**2 / beta2 if beta2 > 0 else 0.0
    if rho >= 1 and max_step is None:
        return math.inf
    scale = (1 - beta1) ** 2 / (1 - beta2)
    horizon = max_step if max_step is not None else 10**7
    best, geometric, t = 0.0, 0.0, 0
    while t < horizon:
        t += 1
        geometric += rho ** (t - 1)
        c1 = 1 - beta1**t if bias_correction else 1.0
        c2 = 1 - beta2**t if bias_correction else 1.0
        best = max(best, c2 / c1**2 * scale * geometric)
        if beta1**t < 1e-12 and rho < 1:  # closed-form bound of every later t
            tail = scale / (1 - rho) / (1 - beta1**t) ** 2
            best = max(best, tail)
            break
    return math.sqrt(best)


def tangent_dimension(shapes: Sequence[tuple[int, int, int]]) -> int:
    """``D = sum_l r (m + n - r)``: the dimension of the product of tangent spaces.

    Implements the dimension count of Thm 3.1 of PRISM (tangent space of the rank-r manifold).
    """
    return sum(r * (m + n - r) for m, n, r in shapes)


def chernoff_batch_quantile(expected: float, sample_rate: float, failure: float) -> float:
    """An upper ``1 - failure`` quantile of a realised Poisson batch ``X ~ Bin(N, q)``.

    Implements the tail used for the clipped-sum part of eq. (17) of PRISM. Multiplicative
    Chernoff: ``P(X >= (1 + d) b) <= exp(-d^2 b / (2 + d))`` with ``b = q N``; solving
    ``d^2 b = L (2 + d)`` for ``L = ln(1 / failure)`` gives
    ``d = (L + sqrt(L^2 + 8 b L)) / (2 b)``. Never more than ``N = b / q``.
    """
    if not (expected > 0 and 0 < sample_rate <= 1 and 0 < failure < 1):
        raise ValueError(
            f"need b > 0, q in (0, 1], failure in (0, 1); got {expected}, {sample_rate}, {failure}"
        )
    L = math.log(1 / failure)
    d = (L + math.sqrt(L * L + 8 * expected * L)) / (2 * expected)
    return min((1 + d) * expected, expected / sample_rate)


def chi_norm_quantile(dimension: int, failure: float) -> float:
    """An upper ``1 - failure`` quantile of ``||xi||`` for ``xi ~ N(0, I_D)``.

    Implements the noise tail of Thm 3.1 of PRISM (the tangent noise has ``||Xi||^2 ~ chi^2_D``)
    with Laurent and Massart (2000), Lemma 1: ``P(chi^2_D >= D + 2 sqrt(D x) + 2 x) <= e^{-x}``.
    """
    if dimension < 0 or not 0 < failure < 1:
        raise ValueError(f"need D >= 0 and failure in (0, 1); got {dimension}, {failure}")
    x = math.log(1 / failure)
    return math.sqrt(dimension + 2 * math.sqrt(dimension * x) + 2 * x)


def dp_step_norm_bound(
    *,
    max_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    dimension: int,
    failure: float,
) -> float:
    """High-probability bound on the norm of one released DP update (all modules and head).

    Implements eqs. (16)-(19) of PRISM::

        ||(sum_i alpha_i dZ_i + sigma C Xi) / b||  <=  (C X + sigma C ||Xi||) / b

    since every example contributes at most C after the global clip. ``X`` (realised batch) and
    ``||Xi||`` (``D`` = tangent dimension plus Euclidean head coordinates) each exceed their
    quantile with probability ``failure / 2``.
    """
    batch = chernoff_batch_quantile(expected_batch_size, sample_rate, failure / 2)
    noise = (
        noise_multiplier * chi_norm_quantile(dimension, failure / 2) if noise_multiplier else 0.0
    )
    return max_norm * (batch + noise) / expected_batch_size


def _spectral(X: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(X.to(work_dtype(X)), ord=2))


def _top_singular_value(A: torch.Tensor, B: torch.Tensor) -> float:
    """``s1(A B.T) = s1(R_A R_B.T)`` from thin-QR triangles (no m x n matrix)."""
    dtype = work_dtype(A, B)
    RA = torch.linalg.qr(A.to(dtype), mode="r")[1]
    RB = torch.linalg.qr(B.to(dtype), mode="r")[1]
    return _spectral(RA @ RB.mT)


def round_update_norm_bound(
    points: Sequence[Point],
    *,
    lr: float,
    local_steps: int,
    optimizer: Optimizer = "adaptive",
    gain: float = 0.0,
    head_size: int = 0,
    head_lr: float = 0.0,
    head_gain: float = 0.0,
    dp_step: float = 0.0,
) -> float:
    """Bound on the intrinsic norm of the tangent update one PRISM site sends for one round.

    Implements the composition of ``tau`` local steps of Algorithm 1 of PRISM (retraction
    eq. 22) from the broadcast point ``Z_0`` and the displacement of docs/design.md §3. Per module:

    - Retraction slack (factor 2, exact): ``Z_{k+1} = Retr_r(Y)`` is the best rank-r
      approximation of ``Y = Z_k - lr xi_k`` and ``Z_k`` itself has rank r, so
      ``||Z_{k+1} - Y|| <= ||Z_k - Y||`` and ``||Z_{k+1} - Z_k|| <= 2 lr ||xi_k||``.
    - The sent update is ``P_{Z_0}(Z_tau - Z_0)`` (orthogonal projection), so its intrinsic norm
      is at most ``||Z_tau - Z_0||_F <= 2 lr sum_k ||xi_k||`` (triangle inequality).
    - ``optimizer="adaptive"`` (PRISM's eqs. 24-26): ``xi_k = U_A B_k.T + A_k U_B.T`` with
      ``||U_A||_F <= G sqrt(m r)``, ``||U_B||_F <= G sqrt(n r)`` (``adam_gain``), so
      ``||xi_k|| <= G (sqrt(m r) ||B_k||_2 + sqrt(n r) ||A_k||_2)``. Step 0 uses the broadcast
      factors' spectral norms; after a retraction the factors are balanced,
      ``||A_k||_2 = ||B_k||_2 = sqrt(s1(Z_k))``, and ``s1(Z_{k+1}) <= s1(Z_k) + lr ||xi_k||``.
    - ``optimizer="sgd"``: ``xi_k`` is the DP update itself; ``dp_step`` bounds its norm over
      all modules and the head, stepped with the same lr (``dp_step_norm_bound`` with
      ``failure / tau`` per step, a union bound), and the whole round is ``<= 2 lr tau dp_step``.
    - A DP head trained with torch Adam/AdamW (no weight decay) moves by at most
      ``head_lr tau head_gain sqrt(head_size)``; the result combines modules and head in
      quadrature.

    Args:
        points: the broadcast ``Point(A, B)`` of every module.
        lr: local learning rate; ``local_steps``: tau.
        optimizer: ``adaptive`` (PRISM's transform) or ``sgd`` (plain DP steps).
        gain: ``adam_gain`` of PRISM's transform (adaptive only).
        head_size, head_lr, head_gain: number of DP head coordinates, their lr and Adam gain.
        dp_step: bound on one DP step's norm (sgd only).

    Returns:
        An upper bound on ``sqrt(sum_l ||P_{Z_0,l}(Z_tau,l - Z_0,l)||^2 + ||head delta||^2)``,
        before any float32 allowance.

    Notes:
        For ``adaptive`` the bound is deterministic (holds with probability 1); for ``sgd`` it
        fails with the probability given to ``dp_step_norm_bound``.
    """
    if lr <= 0 or local_steps < 1:
        raise ValueError(f"need lr > 0 and local_steps >= 1; got {lr}, {local_steps}")
    head = head_lr * local_steps * head_gain * math.sqrt(head_size) if head_size else 0.0
    if optimizer == "sgd":
        return 2 * lr * local_steps * dp_step + head
    total_sq = 0.0
    for A, B in points:
        (m, r), n = A.shape[-2:], B.shape[-2]
        ga, gb = gain * math.sqrt(m * r), gain * math.sqrt(n * r)
        norm_a, norm_b = _spectral(A), _spectral(B)
        top = _top_singular_value(A, B)
        moved = 0.0
        for k in range(local_steps):
            if k > 0:
                norm_a = norm_b = math.sqrt(top)
            step = ga * norm_b + gb * norm_a
            moved += 2 * lr * step
            top += lr * step
        total_sq += moved**2
    return math.sqrt(total_sq + head**2)


def factor_update_norm_bounds(
    shapes: Sequence[tuple[int, int, int]], *, lr: float, local_steps: int, gain: float
) -> list[tuple[float, float]]:
    """``(bound on ||A_tau - A_0||_F, bound on ||B_tau - B_0||_F)`` per module for Adam(W).

    Implements the factor-space baselines' local update (DP-LoRA / FFA with torch AdamW, no
    weight decay): each coordinate moves by at most ``lr G`` per step (``adam_gain``), so over
    ``tau`` steps ``||A_tau - A_0||_F <= lr tau G sqrt(m r)`` and likewise with ``n`` for ``B``.
    """
    return [
        (lr * local_steps * gain * math.sqrt(m * r), lr * local_steps * gain * math.sqrt(n * r))
        for m, n, r in shapes
    ]
