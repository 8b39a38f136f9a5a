"""Audit part (c): canaries with a known clipped signal, ONE run, two statistics.

Implements the one-run audit of Steinke, Nasr and Jagielski, "Privacy Auditing with One (1)
Training Run" (NeurIPS 2023), in its white-box gradient-canary form, on PRISM's mechanism, and
next to it a per-block noise-variance test that has the power the one-run bound lacks.

What exactly runs (``canary_experiment``):

- ``L`` synthetic LoRA modules, each a point ``(A, B)`` of shape (m, r), (n, r) whose column
  spaces are spanned by the first r columns of random orthogonal ``U_m``, ``U_n`` (mixed by a
  random r x r matrix, so the factors are not orthonormal). The tangent space of such a point
  has the orthonormal basis ``u_j v_k^T`` with j < r or k < r: ``r (m + n - r)`` elements, in
  three blocks (``server.audit.blocks``): core (j, k < r), A-perp (j >= r), B-perp (k >= r).
  Plus one head tensor (Euclidean, ``k`` coordinates) inside the same global clip.
- ``k`` canaries. Canary i owns one basis element per module and one head coordinate (a seeded
  random assignment, no element shared), so the canaries are orthonormal in the joint norm;
  its per-example gradient is ``G_i = 2 C u v^T`` in every module and ``2 C`` on its head
  coordinate: joint norm ``2 sqrt(L + 1) C``, so every canary is clipped, by the global clip
  and by a per-module clip alike, and its clipped contribution is ``C / sqrt(L + 1)`` on each
  of its ``L + 1`` elements: the auditor knows it exactly.
- Each canary is included independently with probability 1/2 (the audit's secret ``S``). The
  included canaries are the batch of ``steps`` mechanism steps at the same point, run as the
  trainer runs them (``PrismTrainer.release``): per-example factor gradients
  ``(G_i B, G_i.T A)``, whitened by the step's frames as the trainer's layers write them, and
  head gradients, micro-batch by micro-batch, through ``clip_and_sum_whitened``, then
  ``privatize``, expected batch
  ``b = k / 2``, seeded noise.

Statistic 1, the one-run lower bound on epsilon. Score of canary i: the inner product of the
summed releases with its direction. The auditor guesses "in" for the ``guesses / 2`` highest
scores and "out" for the as many lowest (fixed before the run), abstains on the rest, and
counts correct guesses ``v`` of ``r``. Lower bound: the largest epsilon whose p-value
(Theorem 3 of the paper, with delta)
``P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 k delta max_i P[v > Binomial >= v - i] / i``
is below ``1 - confidence``: with that confidence, the mechanism is not (eps, delta)-DP for any
smaller eps. The claimed epsilon is the accountant's (PRV) for ``steps`` steps of the Gaussian
mechanism with noise multiplier sigma and NO subsampling (q = 1: an included canary is in every
step), at the same delta. Noise off or a per-module clip gives a bound above the claim. This
bound is weak against partial failures: noise at half strength (true epsilon 4.4 at a claimed
2.0) or one block of the sampler missing still give bounds below the claim.

Statistic 2, the noise itself. The auditor subtracts the known clipped signal from ``b`` times
the summed releases; what is left is the noise, ``N(0, steps (sigma C)^2)`` on every tangent
coordinate and head coordinate for a correct mechanism. Its energy in each block (core,
A-perp, B-perp summed over modules; the head) and in all of them together is tested against
chi-square (``server.audit.blocks.variance_test``) at ``variance_confidence``, Bonferroni over
the five tests. A missing block leaves zero energy there; half noise leaves a quarter; a
per-module clip leaves the extra signal. The result says the smallest shortfall each test
detects with probability ``POWER`` at this sample size.

Dividing by the realised batch size rescales signal and noise by ``b / |batch|`` (a few per
cent here), which these statistics barely see: record/replay check (b) catches that bug.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from scipy.stats import binom
from torch import Tensor

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.manifold import Point, tangent_to_dense
from prism_core.mechanism import ClippedSum, empty_sum, step_frames, whiten_rows
from server.audit.blocks import BLOCKS, POWER, VarianceTest, variance_test
from server.audit.mechanisms import CORRECT, Mechanism

__all__ = [
    "CanaryResult",
    "CanaryRun",
    "CanarySettings",
    "canary_experiment",
    "epsilon_lower_bound",
    "p_value",
    "run_canary_audit",
]

HEAD = "head"
POOLED = "all"


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
    variance_confidence: float = 1 - 1e-6
    micro_batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        m, n, r = self.shape
        problems = []
        if self.canaries < 2:
            problems.append(f"canaries={self.canaries} must be >= 2")
        if not 2 <= self.guesses <= self.canaries or self.guesses % 2:
            problems.append(f"guesses={self.guesses} must be even and in [2, canaries]")
        if not 0 < r < min(m, n) or r * (m + n - r) < self.canaries:
            problems.append(
                f"shape={self.shape}: need 0 < r < min(m, n), and the tangent dimension "
                f"r (m + n - r) = {r * (m + n - r)} must be >= canaries={self.canaries} "
                "(raise m, n or r)"
            )
        if not (self.noise_multiplier > 0 and self.max_norm > 0 and self.steps >= 1):
            problems.append("noise_multiplier and max_norm must be > 0 and steps >= 1")
        if not (0 < self.delta < 1 and 0 < self.confidence < 1 and self.modules >= 1):
            problems.append("delta and confidence must be in (0, 1), modules >= 1")
        if not (0 < self.variance_confidence < 1 and self.micro_batch_size >= 1):
            problems.append("variance_confidence must be in (0, 1), micro_batch_size >= 1")
        if problems:
            raise ValueError("invalid canary audit settings: " + "; ".join(problems))


@dataclass(frozen=True)
class CanaryResult:
    """Outcome of one canary audit: the one-run bound and the per-block noise tests."""

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
    variance_confidence: float = 1 - 1e-6
    noise_tests: tuple[VarianceTest, ...] = ()

    @property
    def bound_passed(self) -> bool:
        return self.lower_bound <= self.claimed_epsilon

    @property
    def passed(self) -> bool:
        return self.bound_passed and all(t.passed for t in self.noise_tests)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"

    @property
    def detects_any_block(self) -> float:
        """Noise std ratio caught (probability ``POWER``) when it falls in any ONE block."""
        return min(t.detectable for t in self.noise_tests if t.name != POOLED)

    @property
    def detects_all_blocks(self) -> float:
        """Noise std ratio caught (probability ``POWER``) when it falls in every block."""
        return next(t.detectable for t in self.noise_tests if t.name == POOLED)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "noise_tests"}
        out["noise_tests"] = [t.to_json() for t in self.noise_tests]
        out["power"] = POWER
        if self.noise_tests:
            out["detects_any_block"] = self.detects_any_block
            out["detects_all_blocks"] = self.detects_all_blocks
        return {**out, "verdict": self.verdict}


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
    # torch.linalg.qr is untyped (Any); it returns the named tuple (Q, R) of tensors.
    Q, R = cast(
        tuple[Tensor, Tensor],
        torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64)),
    )
    return Q * torch.sign(torch.diagonal(R))


def _tangent_basis(m: int, n: int, r: int) -> list[tuple[int, int]]:
    """Index pairs (j, k) of the basis ``u_j v_k^T`` of the tangent space: j < r or k < r."""
    return [(j, k) for j in range(m) for k in range(n) if j < r or k < r]


class _Module(NamedTuple):
    point: Point
    Um: Tensor
    Un: Tensor
    owned: Tensor  # (k, 2): the basis element (j, k) of each canary


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
        out.append(_Module(point, Um, Un, torch.tensor([basis[i] for i in owned.tolist()])))
    return out


def _canary_grads(
    s: CanarySettings, modules: list[_Module], head_owned: Tensor, members: Tensor
) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Per-example factor gradients ``(G B, G.T A)`` of ``G = 2 C u v^T`` in every module, and
    head gradients ``2 C e_h``, of the member canaries (joint norm ``2 sqrt(L + 1) C``)."""
    c = 2 * s.max_norm
    grads = []
    for point, Um, Un, jk in modules:
        u = Um[:, jk[members, 0]].T.float()  # (b, m)
        v = Un[:, jk[members, 1]].T.float()  # (b, n)
        gA = c * u[:, :, None] * (v @ point.B)[:, None, :]  # G B = c u (v^T B)
        gB = c * v[:, :, None] * (u @ point.A)[:, None, :]  # G^T A = c v (u^T A)
        grads.append((gA, gB))
    head = torch.zeros(len(members), s.canaries)
    head[torch.arange(len(members)), head_owned[members]] = c
    return grads, head


def _clipped_sum(
    s: CanarySettings,
    mechanism: Mechanism,
    points: list[Point],
    grads: list[tuple[Tensor, Tensor]],
    head: Tensor,
    frames: Any,
) -> ClippedSum:
    """The trainer's clip: ``clip_and_sum_whitened`` on the whitened rows, micro-batch by
    micro-batch, one frame set."""
    acc = None
    for lo in range(0, head.shape[0], s.micro_batch_size):
        hi = lo + s.micro_batch_size
        acc = mechanism.clip_and_sum_whitened(
            points,
            whiten_rows(frames, [(gA[lo:hi], gB[lo:hi]) for gA, gB in grads]),
            max_norm=s.max_norm,
            previous=acc,
            euclidean=[head[lo:hi]],
            frames=frames,
        )
    return acc if acc is not None else empty_sum(points, [torch.zeros(head.shape[1])])


@dataclass(frozen=True)
class CanaryRun:
    """What one canary experiment produced.

    Attributes:
        scores: (k,) inner product of the summed releases with each canary's unit direction.
        included: (k,) the secret inclusion mask.
        energy: residual noise energy per block, in units of the claimed noise variance.
        dof: coordinates (degrees of freedom) per block.
    """

    scores: Tensor
    included: Tensor
    energy: dict[str, float]
    dof: dict[str, int]


def _residual_energy(
    s: CanarySettings,
    modules: list[_Module],
    coords: list[Tensor],
    head: Tensor,
    head_owned: Tensor,
    included: Tensor,
) -> tuple[dict[str, float], dict[str, int]]:
    """Energy per block of ``(b * release - known signal) / (sigma C sqrt(steps))``."""
    _, _, r = s.shape
    b, parts = s.canaries / 2, s.modules + 1
    each = s.steps * s.max_norm / math.sqrt(parts)  # every canary part, clipped, all steps
    unit = s.noise_multiplier * s.max_norm * math.sqrt(s.steps)
    members = included.nonzero().flatten()
    energy = dict.fromkeys((*BLOCKS, HEAD), 0.0)
    for module, total in zip(modules, coords, strict=True):
        residual = b * total
        jk = module.owned[members]
        residual[jk[:, 0], jk[:, 1]] -= each
        residual /= unit
        energy["core"] += float(residual[:r, :r].square().sum())
        energy["A-perp"] += float(residual[r:, :r].square().sum())
        energy["B-perp"] += float(residual[:r, r:].square().sum())
    residual = b * head
    residual[head_owned[members]] -= each
    energy[HEAD] = float((residual / unit).square().sum())
    m, n, _ = s.shape
    per_module = {"core": r * r, "A-perp": (m - r) * r, "B-perp": r * (n - r)}
    dof = {k: s.modules * d for k, d in per_module.items()} | {HEAD: s.canaries}
    return energy, dof


def canary_experiment(settings: CanarySettings, mechanism: Mechanism = CORRECT) -> CanaryRun:
    """Run ``settings.steps`` releases of the included canaries (see the module docstring).

    For a correct mechanism the score of canary i is ``steps * C / b * S_i`` plus
    ``N(0, steps * (sigma C / b)^2)`` noise, independent across canaries (they are orthonormal),
    and the residual energy of each block is chi-square with the block's coordinates as dof.
    """
    s = settings
    g = torch.Generator().manual_seed(s.seed)
    modules = _synthetic_modules(s, g)
    head_owned = torch.randperm(s.canaries, generator=g)
    included = torch.rand(s.canaries, generator=g, dtype=torch.float64) < 0.5
    grads, head_grads = _canary_grads(s, modules, head_owned, included.nonzero().flatten())
    points = [module.point for module in modules]
    frames = step_frames(points)
    noise = torch.Generator().manual_seed(s.seed + 1)
    coords = [torch.zeros(s.shape[0], s.shape[1], dtype=torch.float64) for _ in modules]
    head = torch.zeros(s.canaries, dtype=torch.float64)
    for _ in range(s.steps):
        clipped = _clipped_sum(s, mechanism, points, grads, head_grads, frames)
        step = mechanism.privatize(
            points,
            clipped,
            noise_multiplier=s.noise_multiplier,
            max_norm=s.max_norm,
            expected_batch_size=s.canaries / 2,
            sample_rate=1.0,
            generator=noise,
            frames=frames,
        )
        for index, (module, t) in enumerate(zip(modules, step.tangents, strict=True)):
            dense = tangent_to_dense(module.point.A, module.point.B, t.dA, t.dB).double()
            coords[index] += module.Um.T @ dense @ module.Un  # in the basis u_j v_k^T
        head += step.euclidean[0].double()
    scores = head[head_owned].clone()
    for module, total in zip(modules, coords, strict=True):
        scores += total[module.owned[:, 0], module.owned[:, 1]]
    scores /= math.sqrt(s.modules + 1)  # inner product with the unit direction
    energy, dof = _residual_energy(s, modules, coords, head, head_owned, included)
    return CanaryRun(scores, included, energy, dof)


def _noise_tests(s: CanarySettings, run: CanaryRun) -> tuple[VarianceTest, ...]:
    names = (*BLOCKS, HEAD)
    significance = (1 - s.variance_confidence) / (len(names) + 1)  # Bonferroni, with pooled
    tests = [variance_test(k, run.energy[k], run.dof[k], significance=significance) for k in names]
    pooled = variance_test(
        POOLED,
        sum(run.energy.values()),
        sum(run.dof.values()),
        significance=significance,
    )
    return (*tests, pooled)


def run_canary_audit(
    settings: CanarySettings | None = None, mechanism: Mechanism = CORRECT
) -> CanaryResult:
    """Run the canary audit of ``mechanism``: one-run bound and noise tests (module docstring)."""
    s = settings or CanarySettings()
    run = canary_experiment(s, mechanism)
    order = torch.argsort(run.scores)
    half = s.guesses // 2
    correct = int(run.included[order[-half:]].sum()) + int((~run.included[order[:half]]).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Opacus' PRV takes log(1 - q) at q = 1
        claimed = epsilon([PrivacyEvent(s.noise_multiplier, 1.0, s.steps)], s.delta)
    bound = epsilon_lower_bound(
        s.canaries, s.guesses, correct, delta=s.delta, confidence=s.confidence
    )
    return CanaryResult(
        mechanism=mechanism.name,
        canaries=s.canaries,
        included=int(run.included.sum()),
        guesses=s.guesses,
        correct=correct,
        confidence=s.confidence,
        delta=s.delta,
        noise_multiplier=s.noise_multiplier,
        steps=s.steps,
        claimed_epsilon=claimed,
        lower_bound=bound,
        variance_confidence=s.variance_confidence,
        noise_tests=_noise_tests(s, run),
    )
