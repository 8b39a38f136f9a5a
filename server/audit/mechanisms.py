"""The mechanism under audit, and deliberately broken variants for the audit's self-test.

The audit runs PRISM's DP release through ``prism_runtime.trainer.PrismTrainer.release`` (the same
code path as training) with a ``Mechanism``: the functions that clip-and-sum (from per-example
lifts, factor gradients or the whitened rows the trainer's layers write) and privatize.
``CORRECT`` is ``prism_core``'s. The ``BROKEN`` variants reproduce bugs that
published DP code has shipped with, or that a change to the sampler could introduce; they
exist only so that the audit can prove it catches them (``prism-fl audit --inject-bug NAME``,
and the tests). Never train with them.

- ``noise-off``: no noise is added, but the record still claims sigma.
- ``half-noise``: noise of std ``sigma C / 2`` while the record claims sigma (true epsilon
  about 4.4 where 2.0 is claimed at sigma 2, one step, delta 1e-5).
- ``no-perp-noise``: the sampler of eq. (19) without its ``(I - Pi_A) U N^{-1/2}`` block, so
  the part of a gradient outside col(A) (``(I - Pi_A) G Pi_B``) is released un-noised
  (epsilon infinite for such gradients); the head is noised correctly.
- ``realised-batch``: signal and noise are divided by the REALISED batch size (the reference
  implementation's ``dp_finalize``), which leaks the batch size.
- ``per-module-clip``: each module (and each head tensor) is clipped to C on its own, so one
  example can move the release by up to ``sqrt(#modules) * C`` instead of C.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from prism_core.manifold import Point, Tangent, lift, work_dtype
from prism_core.mechanism import (
    ClippedSum,
    PrivateStep,
    clip_and_sum,
    clip_and_sum_grads,
    clip_and_sum_whitened,
    clip_coefficients,
    per_example_norms_sq,
    privatize,
    step_frames,
    tangent_noise,
)
from prism_core.rng import standard_normal

__all__ = ["BROKEN", "CORRECT", "Mechanism", "mechanism_by_name"]


@dataclass(frozen=True)
class Mechanism:
    """Clip-and-sum and privatize functions with ``prism_core``'s signatures.

    ``clip_and_sum`` takes per-example lifts; ``clip_and_sum_grads`` per-example factor
    gradients (the trainer's path for a clip swapped in through ``clip_fn``);
    ``clip_and_sum_whitened`` the whitened rows (the trainer's own path, and the canary
    audit's). A variant that breaks the clip breaks all three; ``with_privatize`` builds one
    that breaks only the noise.
    """

    name: str
    clip_and_sum: Callable[..., ClippedSum]
    clip_and_sum_grads: Callable[..., ClippedSum]
    clip_and_sum_whitened: Callable[..., ClippedSum]
    privatize: Callable[..., PrivateStep]

    @classmethod
    def with_privatize(cls, name: str, privatize_fn: Callable[..., PrivateStep]) -> Mechanism:
        """``prism_core``'s three clips with ``privatize_fn``."""
        return cls(name, clip_and_sum, clip_and_sum_grads, clip_and_sum_whitened, privatize_fn)


def _noise_off_privatize(points: Sequence[Point], clipped: ClippedSum, **kw: Any) -> PrivateStep:
    claimed = kw["noise_multiplier"]
    step = privatize(points, clipped, **{**kw, "noise_multiplier": 0.0})
    return step._replace(record=replace(step.record, noise_multiplier=float(claimed)))


def _half_noise_privatize(points: Sequence[Point], clipped: ClippedSum, **kw: Any) -> PrivateStep:
    claimed = kw["noise_multiplier"]
    step = privatize(points, clipped, **{**kw, "noise_multiplier": 0.5 * claimed})
    return step._replace(record=replace(step.record, noise_multiplier=float(claimed)))


def _no_perp_noise_privatize(
    points: Sequence[Point], clipped: ClippedSum, **kw: Any
) -> PrivateStep:
    """Noise ``sigma C (0, Xi_B)`` on the tangents (``Xi_A`` dropped), correct noise on the head."""
    claimed = float(kw["noise_multiplier"])
    scale = claimed * kw["max_norm"]
    generator = kw["generator"]
    sums = []
    for p, s in zip(points, clipped.sums, strict=True):
        xi = tangent_noise(p.A, p.B, generator)
        sums.append(Tangent(s.dA, s.dB + scale * xi.dB.to(s.dB.dtype)))
    head = [
        t + scale * standard_normal(tuple(t.shape), generator, dtype=t.dtype, device=t.device)
        for t in clipped.euclidean
    ]
    noisy = ClippedSum(tuple(sums), clipped.count, clipped.clipped, tuple(head))
    frames = kw.get("frames") or step_frames(points)
    step = privatize(points, noisy, **{**kw, "noise_multiplier": 0.0, "frames": frames})
    return step._replace(record=replace(step.record, noise_multiplier=claimed))


def _realised_batch_privatize(
    points: Sequence[Point], clipped: ClippedSum, **kw: Any
) -> PrivateStep:
    realised = max(clipped.count, 1)  # the reference's ``std = sigma * C / total``
    step = privatize(points, clipped, **{**kw, "expected_batch_size": float(realised)})
    return step._replace(record=replace(step.record, expected_batch_size=kw["expected_batch_size"]))


def _per_module_clip_and_sum(
    points: Sequence[Point],
    lifts: Sequence[Tangent],
    *,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
) -> ClippedSum:
    norms_sq = per_example_norms_sq(points, lifts)
    sums = []
    for index, t in enumerate(lifts):
        alpha = clip_coefficients(norms_sq[index : index + 1], max_norm)
        dtype = work_dtype(t.dA, t.dB, alpha)
        a = alpha.to(dtype)
        part = Tangent(
            torch.einsum("b,bmr->mr", a, t.dA.to(dtype)),
            torch.einsum("b,bnr->nr", a, t.dB.to(dtype)),
        )
        if previous is not None:
            part = Tangent(previous.sums[index].dA + part.dA, previous.sums[index].dB + part.dB)
        sums.append(part)
    extra = []
    for index, g in enumerate(euclidean):
        g = g.to(work_dtype(g))
        alpha = clip_coefficients(g.flatten(1).square().sum(1)[None], max_norm)
        total = torch.einsum("b,b...->...", alpha.to(g.dtype), g)
        extra.append(total if previous is None else previous.euclidean[index] + total)
    count = int(norms_sq.shape[1]) + (previous.count if previous else 0)
    return ClippedSum(tuple(sums), count, previous.clipped if previous else 0, tuple(extra))


def _per_module_clip_and_sum_grads(
    points: Sequence[Point],
    grads: Sequence[tuple[Tensor, Tensor]],
    *,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
    frames: Any = None,
) -> ClippedSum:
    lifts = [lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, grads, strict=True)]
    return _per_module_clip_and_sum(
        points, lifts, max_norm=max_norm, previous=previous, euclidean=euclidean
    )


def _per_module_clip_and_sum_whitened(
    points: Sequence[Point],
    rows: Sequence[tuple[Tensor, Tensor]],
    *,
    frames: Any,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
) -> ClippedSum:
    grads: list[tuple[Tensor, Tensor] | None] = [None] * len(points)
    for group, stacked, (ra, rc) in zip(frames.groups, frames.stacked, rows, strict=True):
        for j, i in enumerate(group):  # g = (rows.T) R: the raw gradients back
            grads[i] = (ra[j].mT @ stacked.RB[j], rc[j].mT @ stacked.RA[j])
    return _per_module_clip_and_sum_grads(
        points,
        [g for g in grads if g is not None],
        max_norm=max_norm,
        previous=previous,
        euclidean=euclidean,
    )


CORRECT = Mechanism.with_privatize("prism", privatize)
"""The mechanism that trains: ``prism_core.mechanism``'s clip-and-sum and ``privatize``."""

BROKEN: dict[str, Mechanism] = {
    "noise-off": Mechanism.with_privatize("noise-off", _noise_off_privatize),
    "half-noise": Mechanism.with_privatize("half-noise", _half_noise_privatize),
    "no-perp-noise": Mechanism.with_privatize("no-perp-noise", _no_perp_noise_privatize),
    "realised-batch": Mechanism.with_privatize("realised-batch", _realised_batch_privatize),
    "per-module-clip": Mechanism(
        "per-module-clip",
        _per_module_clip_and_sum,
        _per_module_clip_and_sum_grads,
        _per_module_clip_and_sum_whitened,
        privatize,
    ),
}
"""Deliberately broken mechanisms, for the audit's self-test only."""


def mechanism_by_name(name: str | None) -> Mechanism:
    """``CORRECT`` for None or ``"prism"``, else the broken variant of that name."""
    if name is None or name == CORRECT.name:
        return CORRECT
    if name not in BROKEN:
        raise ValueError(f"unknown mechanism {name!r}: expected one of {['prism', *BROKEN]}")
    return BROKEN[name]
