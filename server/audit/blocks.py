"""The tangent space of one LoRA module in three orthogonal blocks, and noise-variance tests.

At a point ``Z = A B.T`` (thin QRs ``A = Q_A R_A``, ``B = Q_B R_B``) every tangent vector
``dZ = dA B.T + A dB.T`` splits orthogonally into

- ``core``:   ``Q_A.T dZ Q_B``                (r x r,       ``r^2`` coordinates),
- ``A-perp``: ``(I - Pi_A) dZ Q_B``           ((m - r) x r, ``(m - r) r``): noised only by the
  ``(I - Pi_A) U N^{-1/2}`` block of the sampler (eq. 19),
- ``B-perp``: ``Q_A.T dZ (I - Pi_B)``         (r x (n - r), ``r (n - r)``): noised by ``V``,

``r (m + n - r)`` coordinates in all (Thm 3.1). Correct tangent noise of std ``s`` puts
``s^2`` on every coordinate of every block; a sampler that drops or shrinks one block shows
up in that block's energy and hardly in the pooled energy. The audit tests each block (and
each head tensor) separately with a chi-square test, and says which shortfall it can detect.

Computed from the factors in O((m + n) r^2), independently of ``prism_core``'s lift:
``core = (Q_A.T dA) R_B.T + R_A (Q_B.T dB).T``, ``A-perp = (I - Pi_A) dA R_B.T``,
``B-perp = R_A ((I - Pi_B) dB).T``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from scipy.stats import chi2
from torch import Tensor

__all__ = [
    "BLOCKS",
    "POWER",
    "VarianceTest",
    "tangent_block_energies",
    "variance_test",
]

BLOCKS = ("core", "A-perp", "B-perp")
"""The three orthogonal blocks of a module's tangent space, in this order everywhere."""

POWER = 0.99
"""Probability with which a reported shortfall ``sigma_true <= rho * sigma_claimed`` is caught."""


def tangent_block_energies(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> dict[str, float]:
    """Squared Frobenius norm of ``dZ = dA B.T + A dB.T`` in each block (float64).

    The three energies add up to ``||dZ||_F^2`` (the intrinsic norm, eq. 15). Stacked inputs
    (``(..., m, r)`` and so on) give the energies summed over the stack.
    """
    A, B, dA, dB = (t.detach().to(torch.float64) for t in (A, B, dA, dB))
    QA, RA = torch.linalg.qr(A)
    QB, RB = torch.linalg.qr(B)
    core = (QA.mT @ dA) @ RB.mT + RA @ (QB.mT @ dB).mT
    a_perp = (dA - QA @ (QA.mT @ dA)) @ RB.mT
    b_perp = (dB - QB @ (QB.mT @ dB)) @ RA.mT
    return {
        name: float(block.square().sum())
        for name, block in zip(BLOCKS, (core, a_perp, b_perp), strict=True)
    }


@dataclass(frozen=True)
class VarianceTest:
    """A two-sided chi-square test that noise has the claimed std, and its power.

    ``measured`` is ``sqrt(energy / (dof * claimed_var))``: 1 for the claimed noise. The test
    accepts ``measured`` in ``[lo, hi]``; ``detectable`` is the largest ``rho`` such that noise
    of std ``rho * claimed`` falls below ``lo`` with probability >= ``POWER``.
    """

    name: str
    dof: int
    measured: float
    lo: float
    hi: float
    detectable: float

    @property
    def passed(self) -> bool:
        return self.lo <= self.measured <= self.hi

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def variance_test(name: str, energy: float, dof: int, *, significance: float) -> VarianceTest:
    """Test ``energy ~ chi^2_dof`` (unit-variance noise) at two-sided level ``significance``.

    Under the claimed noise ``energy`` is chi-square with ``dof`` degrees of freedom, so the
    test rejects a correct mechanism with probability ``significance``. Noise of std
    ``rho * claimed`` gives ``rho^2 chi^2_dof``: it is caught with probability
    ``chi2.cdf(q_lo / rho^2, dof)``, which is ``POWER`` at ``rho = detectable``.
    """
    if dof < 1:
        raise ValueError(f"{name}: a variance test needs dof >= 1, got {dof}")
    q_lo = float(chi2.ppf(significance / 2, dof))
    q_hi = float(chi2.isf(significance / 2, dof))
    return VarianceTest(
        name=name,
        dof=dof,
        measured=math.sqrt(max(energy, 0.0) / dof),
        lo=math.sqrt(q_lo / dof),
        hi=math.sqrt(q_hi / dof),
        detectable=math.sqrt(q_lo / float(chi2.ppf(POWER, dof))),
    )
