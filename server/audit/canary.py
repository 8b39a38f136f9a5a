"""Audit part (c): an empirical lower bound on epsilon from ONE run with canaries.

Implements the one-run audit of Steinke, Nasr and Jagielski, "Privacy Auditing with One (1)
Training Run" (NeurIPS 2023), in its white-box gradient-canary form, on PRISM's mechanism.

What exactly runs (``run_canary_audit``):

- ``L`` synthetic LoRA modules, each a point ``(A, B)`` of shape (m, r), (n, r) whose column
  spaces are spanned by the first r columns of random orthogonal ``U_m``, ``U_n`` (mixed by a
  random r x r matrix, so the factors are not orthonormal). The tangent space of such a point
  has the orthonormal basis ``u_j v_k^T`` with j < r or k < r: ``r (m + n - r)`` elements.
- ``k`` canaries. Canary i owns one basis element per module (a seeded random assignment, no
  element shared), so the canaries are orthonormal in the joint intrinsic norm; its per-example
  gradient is ``G_i = kappa / sqrt(L) * u v^T`` in every module, with ``kappa = 2 sqrt(L) C``:
  every canary is clipped, by the global clip and by a per-module clip alike.
- Each canary is included independently with probability 1/2 (the audit's secret ``S``). The
  included canaries are the batch of ``steps`` mechanism steps at the same point:
  ``lift -> clip_and_sum -> privatize`` of ``prism_core`` (or a broken variant), expected batch
  ``b = k / 2``, seeded noise.
- Score of canary i: the inner product of the summed releases with its direction. The auditor
  guesses "in" for the ``guesses / 2`` highest scores and "out" for the as many lowest (fixed
  before the run), abstains on the rest, and counts correct guesses ``v`` of ``r``.
- Lower bound: the largest epsilon whose p-value (Theorem 3 of the paper, with delta)
  ``P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 k delta max_i P[v > Binomial >= v - i] / i``
  is below ``1 - confidence``: with that confidence, the mechanism is not (eps, delta)-DP for
  any smaller eps.

The claimed epsilon of this experiment is the accountant's (PRV) for ``steps`` steps of the
Gaussian mechanism with noise multiplier sigma and NO subsampling (q = 1: an included canary is
in every step), at the same delta. A correct mechanism gives a lower bound <= claimed (with
the stated confidence); noise off or a per-module clip gives one above it. Dividing by the
realised batch size only rescales every score equally, which this audit cannot see: record/
replay check (b) catches that bug.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import binom
from torch import Tensor

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.manifold import Point, Tangent, lift, tangent_to_dense
from server.audit.mechanisms import CORRECT, Mechanism

__all__ = [
    "CanaryResult",
    "CanarySettings",
    "canary_scores",
    "epsilon_lower_bound",
    "p_value",
    "run_canary_audit",
]


@dataclass(frozen=True)
class CanarySettings:
    """Parameters of the canary experiment (all public, fixed before the run)."""

    canaries: int = 1000
    guesses: int = 200
    modules: int = 16
    shape: tuple[int, int, int] = (40, 40, 16)
    noise_multiplier: float = 2.0
    max_norm: float = 1.0
    steps: int = 1
    delta: float = 1e-5
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        m, n, r = self.shape
        problems = []
        if self.canaries < 2:
            problems.append(f"canaries={self.canaries} must be >= 2")
        if not 2 <= self.guesses <= self.canaries or self.guesses % 2:
            problems.append(f"guesses={self.guesses} must be even and in [2, canaries]")
        if not 0 < r <= min(m, n) or r * (m + n - r) < self.canaries:
            problems.append(
                f"shape={self.shape}: the tangent dimension r (m + n - r) = {r * (m + n - r)} "
                f"must be >= canaries={self.canaries} (raise m, n or r)"
            )
        if not (self.noise_multiplier > 0 and self.max_norm > 0 and self.steps >= 1):
            problems.append("noise_multiplier and max_norm must be > 0 and steps >= 1")
        if not (0 < self.delta < 1 and 0 < self.confidence < 1 and self.modules >= 1):
            problems.append("delta and confidence must be in (0, 1), modules >= 1")
        if problems:
            raise ValueError("invalid canary audit settings: " + "; ".join(problems))


@dataclass(frozen=True)
class CanaryResult:
    """Outcome of one canary audit."""

    mechanism: str
    canaries: int
    included: int
    guesses: int
    correct: int
    confidence: float
    delta: float
    noise_multiplier: float
    steps: int
    claimed_epsilon: float
    lower_bound: float

    @property
    def passed(self) -> bool:
        return self.lower_bound <= self.claimed_epsilon

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def p_value(canaries: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """P-value of ``correct`` right guesses of ``guesses`` under the (eps, delta)-DP null.

    Implements Theorem 3 of Steinke, Nasr, Jagielski (2023) as stated in their Algorithm 2:
    ``beta = P[W >= v]`` for ``W ~ Binomial(r, e^eps / (1 + e^eps))`` plus
    ``2 m delta max_{1 <= i <= v} P[v > W >= v - i] / i``, capped at 1.
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = float(binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    window = binom.sf(correct - i - 1, guesses, q) - beta  # P[v > W >= v - i]
    alpha = float(np.max(window / i))
    return min(beta + alpha * delta * 2 * canaries, 1.0)


def epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, *, delta: float, confidence: float
) -> float:
    """Largest eps with ``p_value(eps) < 1 - confidence`` (0 if even eps = 0 is not rejected).

    The p-value grows with eps (a larger eps makes many correct guesses more likely), so the
    rejected eps form an interval ``[0, eps*)``; ``eps*`` is found by bisection to 1e-6. With
    probability >= ``confidence`` over the run, an (eps, delta)-DP mechanism has eps >= eps*.
    """
    significance = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(canaries, guesses, correct, hi, delta) < significance:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi)
            if p_value(canaries, guesses, correct, mid, delta) < significance
            else (lo, mid)
        )
    return lo


def _orthogonal(size: int, g: torch.Generator) -> Tensor:
    Q, R = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    return Q * torch.sign(torch.diagonal(R))


def _tangent_basis(m: int, n: int, r: int) -> list[tuple[int, int]]:
    """Index pairs (j, k) of the basis ``u_j v_k^T`` of the tangent space: j < r or k < r."""
    return [(j, k) for j in range(m) for k in range(n) if j < r or k < r]


_Module = tuple[Point, Tensor, Tensor, Tensor]  # point, U_m, U_n, (k, 2) owned basis indices


def _synthetic_modules(s: CanarySettings, g: torch.Generator) -> list[_Module]:
    """``s.modules`` points whose tangent bases are ``u_j v_k^T``; each canary owns one element."""
    m, n, r = s.shape
    basis = _tangent_basis(m, n, r)
    out = []
    for _ in range(s.modules):
        Um, Un = _orthogonal(m, g), _orthogonal(n, g)
        mix = [
            torch.eye(r, dtype=torch.float64)
            + 0.3 * torch.randn(r, r, generator=g, dtype=torch.float64)
            for _ in range(2)
        ]
        point = Point((Um[:, :r] @ mix[0]).float(), (Un[:, :r] @ mix[1]).float())
        owned = torch.randperm(len(basis), generator=g)[: s.canaries]
        out.append((point, Um, Un, torch.tensor([basis[i] for i in owned.tolist()])))
    return out


def _canary_lifts(s: CanarySettings, modules: list[_Module], members: Tensor) -> list[Tangent]:
    """Lifts of the member canaries' gradients ``G = c u v^T`` (joint norm ``2 sqrt(L) C``)."""
    c = 2 * s.max_norm  # per module: kappa / sqrt(L) with kappa = 2 sqrt(L) C
    lifts = []
    for point, Um, Un, jk in modules:
        u = Um[:, jk[members, 0]].T.float()  # (b, m)
        v = Un[:, jk[members, 1]].T.float()  # (b, n)
        gA = c * u[:, :, None] * (v @ point.B)[:, None, :]  # G B = c u (v^T B)
        gB = c * v[:, :, None] * (u @ point.A)[:, None, :]  # G^T A = c v (u^T A)
        lifts.append(lift(point.A, point.B, gA, gB))
    return lifts


def canary_scores(
    settings: CanarySettings, mechanism: Mechanism = CORRECT
) -> tuple[Tensor, Tensor]:
    """Scores of every canary after ``settings.steps`` releases, and the secret inclusion mask.

    For a correct mechanism the score of canary i is ``steps * C / b * S_i`` plus
    ``N(0, steps * (sigma C / b)^2)`` noise, independent across canaries (they are orthonormal).
    """
    s = settings
    m, n, _ = s.shape
    g = torch.Generator().manual_seed(s.seed)
    modules = _synthetic_modules(s, g)
    included = torch.rand(s.canaries, generator=g, dtype=torch.float64) < 0.5
    lifts = _canary_lifts(s, modules, included.nonzero().flatten())
    points = [p for p, *_ in modules]
    noise = torch.Generator().manual_seed(s.seed + 1)
    expected = s.canaries / 2
    total = [torch.zeros(m, n, dtype=torch.float64) for _ in modules]
    for _ in range(s.steps):
        clipped = mechanism.clip_and_sum(points, lifts, max_norm=s.max_norm)
        step = mechanism.privatize(
            points,
            clipped,
            noise_multiplier=s.noise_multiplier,
            max_norm=s.max_norm,
            expected_batch_size=expected,
            sample_rate=1.0,
            generator=noise,
        )
        for index, (p, t) in enumerate(zip(points, step.tangents, strict=True)):
            total[index] += tangent_to_dense(p.A, p.B, t.dA, t.dB).double()
    scores = torch.zeros(s.canaries, dtype=torch.float64)
    for (_, Um, Un, jk), dense in zip(modules, total, strict=True):
        coords = Um.T @ dense @ Un  # coordinates in the basis u_j v_k^T
        scores += coords[jk[:, 0], jk[:, 1]]
    return scores / math.sqrt(s.modules), included  # inner product with the unit direction


def run_canary_audit(
    settings: CanarySettings | None = None, mechanism: Mechanism = CORRECT
) -> CanaryResult:
    """Run the one-run canary audit of ``mechanism`` (see the module docstring)."""
    s = settings or CanarySettings()
    scores, included = canary_scores(s, mechanism)
    order = torch.argsort(scores)
    half = s.guesses // 2
    correct = int(included[order[-half:]].sum()) + int((~included[order[:half]]).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Opacus' PRV takes log(1 - q) at q = 1
        claimed = epsilon([PrivacyEvent(s.noise_multiplier, 1.0, s.steps)], s.delta)
    bound = epsilon_lower_bound(
        s.canaries, s.guesses, correct, delta=s.delta, confidence=s.confidence
    )
    return CanaryResult(
        mechanism=mechanism.name,
        canaries=s.canaries,
        included=int(included.sum()),
        guesses=s.guesses,
        correct=correct,
        confidence=s.confidence,
        delta=s.delta,
        noise_multiplier=s.noise_multiplier,
        steps=s.steps,
        claimed_epsilon=claimed,
        lower_bound=bound,
    )
