"""The PRISM mechanism as it was before the fused fast path: the benchmark's "before".

A frozen copy of ``lift``, ``tangent_norm_sq``, ``clip_and_sum``, ``tangent_noise`` and
``privatize`` from ``prism_core`` at commit 29247da (per-module thin QR and triangular solves,
per-example lifts formed and then normed), kept so that ``bench/mechanism.py
--compare-reference`` can time old and new code in one process, under the same load. It is
not used by the library; the benchmark checks before timing that its noise-free released update
agrees with ``prism_core``'s. Retraction and the data types are shared with ``prism_core``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prism_core.manifold import Point, Tangent, work_dtype
from prism_core.mechanism import (
    ClippedSum,
    PrivacyEvent,
    PrivateStep,
    clip_coefficients,
    validate_noise_parameters,
)
from prism_core.rng import NoiseSource, standard_normal


def _qr(X: Tensor) -> tuple[Tensor, Tensor]:
    Q, R = torch.linalg.qr(X, mode="reduced")
    return Q, R


def _right_gram_inv(X: Tensor, R: Tensor) -> Tensor:
    Y = torch.linalg.solve_triangular(R, X, upper=True, left=False)
    W: Tensor = torch.linalg.solve_triangular(R.mT, Y, upper=False, left=False)
    return W


def _project_cols(Q: Tensor, X: Tensor) -> Tensor:
    return Q @ (Q.mT @ X)


def lift(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor) -> Tangent:
    """Eq. (14) of PRISM, as at commit 29247da."""
    dtype = work_dtype(A, B, gA, gB)
    A, B, gA, gB = (t.to(dtype) for t in (A, B, gA, gB))
    QA, RA = _qr(A)
    QB, RB = _qr(B)
    xA = _right_gram_inv(gA, RB)
    xB = _right_gram_inv(gB, RA)
    dA = xA - 0.5 * _project_cols(QA, xA)
    dB = xB - 0.5 * _project_cols(QB, xB)
    return Tangent(dA, dB)


def tangent_norm_sq(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """Eq. (15) of PRISM, as at commit 29247da."""
    dtype = work_dtype(A, B, dA, dB)
    A, B, dA, dB = (t.to(dtype) for t in (A, B, dA, dB))
    RA = torch.linalg.qr(A, mode="r")[1]
    RB = torch.linalg.qr(B, mode="r")[1]
    term_a = (dA @ RB.mT).square().sum(dim=(-2, -1))
    term_b = (dB @ RA.mT).square().sum(dim=(-2, -1))
    cross = ((A.mT @ dA) * (dB.mT @ B)).sum(dim=(-2, -1))
    total: Tensor = term_a + term_b + 2.0 * cross
    return total


def clip_and_sum(
    points: Sequence[Point], lifts: Sequence[Tangent], *, max_norm: float
) -> ClippedSum:
    """Eqs. (15)-(16) of PRISM, as at commit 29247da (one micro-batch, no Euclidean tensors)."""
    norms_sq = torch.stack(
        [tangent_norm_sq(p.A, p.B, t.dA, t.dB) for p, t in zip(points, lifts, strict=True)]
    )
    alpha = clip_coefficients(norms_sq, max_norm)
    sums = []
    for t in lifts:
        dtype = work_dtype(t.dA, t.dB, alpha)
        a = alpha.to(dtype)
        sums.append(
            Tangent(
                torch.einsum("b,bmr->mr", a, t.dA.to(dtype)),
                torch.einsum("b,bnr->nr", a, t.dB.to(dtype)),
            )
        )
    return ClippedSum(tuple(sums), int(alpha.shape[0]), int((alpha < 1.0).sum()))


def tangent_noise(A: Tensor, B: Tensor, generator: NoiseSource) -> Tangent:
    """Eq. (19) / App. A.13 of PRISM, as at commit 29247da."""
    dtype = work_dtype(A, B)
    A, B = A.to(dtype), B.to(dtype)
    (m, r), (n, _) = A.shape[-2:], B.shape[-2:]
    QA, RA = torch.linalg.qr(A, mode="reduced")
    RB = torch.linalg.qr(B, mode="r")[1]
    U = standard_normal((m, r), generator, dtype=dtype, device=A.device)
    V = standard_normal((n, r), generator, dtype=dtype, device=A.device)
    U_perp = U - QA @ (QA.mT @ U)
    Xi_A = torch.linalg.solve_triangular(RB.mT, U_perp, upper=False, left=False)
    Xi_B = torch.linalg.solve_triangular(RA.mT, V, upper=False, left=False)
    return Tangent(Xi_A, Xi_B)


def privatize(
    points: Sequence[Point],
    clipped: ClippedSum,
    *,
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
) -> PrivateStep:
    """Eqs. (17)-(18) of PRISM, as at commit 29247da (tangent sums only)."""
    validate_noise_parameters(
        noise_multiplier=noise_multiplier,
        max_norm=max_norm,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
    )
    scale = noise_multiplier * max_norm
    tangents = []
    for p, s in zip(points, clipped.sums, strict=True):
        dA, dB = s.dA, s.dB
        if scale > 0:
            xi = tangent_noise(p.A, p.B, generator)
            dA, dB = dA + scale * xi.dA.to(dA.dtype), dB + scale * xi.dB.to(dB.dtype)
        tangents.append(Tangent(dA / expected_batch_size, dB / expected_batch_size))
    record = PrivacyEvent(
        mechanism="prism-tangent-gaussian",
        noise_multiplier=float(noise_multiplier),
        max_norm=float(max_norm),
        expected_batch_size=float(expected_batch_size),
        sample_rate=float(sample_rate),
        steps=1,
    )
    return PrivateStep(tangents, [], record)
