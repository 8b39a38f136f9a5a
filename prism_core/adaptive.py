"""DP-aware, gauge-invariant adaptive transform of PRISM (§3.3, eqs. 24-26, App. A.26-A.27).

Pure post-processing of the DP tangent update: first moments live in factor space, second
moments in rank space (r x r), and the preconditioner ``(V + lambda I)^{-1/2}`` has a floor
``lambda`` tied to the known DP noise level ``s = sigma C / b`` so that it cannot amplify
the privacy noise without bound (Thm 3.5). State is an explicit frozen dataclass per module.

The floor is the released reference's scalar one, ``lambda = floor_scale * s^2`` for both
factors (``floor_scale = 0.5``), with ``cond_max = 1e4`` and a minimum-norm re-lift of the final
direction; the paper's per-factor floors ``lambda_A ~ s^2 tr(N^{-1}) / r`` (eq. 26) and its
noise debiasing (App. A.26) are not implemented. The update is used as given, never re-lifted
(the reference's other option): ``prism_core.mechanism.privatize`` already releases the
minimum-norm lift (App. A.7) of the noisy ``dZ``, the only representative that carries no
un-noised component, so the moments below always see a function of ``dZ`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from prism_core.manifold import Point, Tangent, min_norm_lift, procrustes_gauge, work_dtype

__all__ = [
    "AdaptiveConfig",
    "AdaptiveState",
    "adaptive_direction",
    "adaptive_directions",
    "init_state",
    "realign_state",
]


@dataclass(frozen=True)
class AdaptiveConfig:
    """Hyperparameters of the adaptive transform.

    Attributes:
        beta1: first-moment decay (factor space, eq. 24).
        beta2: second-moment decay (rank space, eq. 24).
        floor_scale: multiplier of the DP-aware floor ``lambda = floor_scale * s^2`` (both
            factors).
        min_floor: absolute lower bound of lambda (keeps non-DP runs, s = 0, well posed).
        cond_max: largest allowed condition number of ``V + lambda I``.
        bias_correction: Adam-style ``1 / (1 - beta^t)`` correction of both moments.
        relift_direction: min-norm re-lift of the final direction.
    """

    beta1: float = 0.9
    beta2: float = 0.999
    floor_scale: float = 0.5
    min_floor: float = 1e-12
    cond_max: float = 1e4
    bias_correction: bool = True
    relift_direction: bool = True

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"beta1={self.beta1}, beta2={self.beta2}: both must be in [0, 1)")
        if not (self.floor_scale >= 0 and self.min_floor > 0 and self.cond_max >= 1):
            raise ValueError("need floor_scale >= 0, min_floor > 0 and cond_max >= 1")


@dataclass(frozen=True)
class AdaptiveState:
    """Moments of one module: ``mA`` (m, r), ``mB`` (n, r), ``VA``, ``VB`` (r, r), step count."""

    mA: Tensor
    mB: Tensor
    VA: Tensor
    VB: Tensor
    step: int = 0


def init_state(A: Tensor, B: Tensor) -> AdaptiveState:
    """Zero moments for a module with factors ``A`` (m, r) and ``B`` (n, r).

    Implements the initial state of eq. (24) of PRISM.
    """
    dtype = work_dtype(A, B)
    r = A.shape[-1]
    zeros_rr = torch.zeros(r, r, dtype=dtype, device=A.device)
    return AdaptiveState(
        torch.zeros_like(A, dtype=dtype),
        torch.zeros_like(B, dtype=dtype),
        zeros_rr,
        zeros_rr.clone(),
    )


def _inv_sqrt_floored(V: Tensor, floor: float, cond_max: float) -> Tensor:
    """``(V + floor I)^{-1/2}`` with eigenvalues clamped to a condition number (of each matrix
    of a stack ``V`` (..., r, r))."""
    V = 0.5 * (V + V.mT)
    w, Q = torch.linalg.eigh(V)
    w = w.clamp_min(0.0) + floor
    w = torch.maximum(w, w.amax(-1, keepdim=True) / cond_max)  # per matrix of a stack
    inv_sqrt: Tensor = (Q * w.rsqrt().unsqueeze(-2)) @ Q.mT
    return inv_sqrt


def adaptive_direction(
    point: Point,
    update: Tangent,
    state: AdaptiveState,
    *,
    noise_std: float,
    config: AdaptiveConfig,
) -> tuple[Tangent, AdaptiveState]:
    """Turn one module's DP tangent update into a preconditioned descent direction.

    Implements eqs. (24)-(26) of PRISM::

        m_A <- b1 m_A + (1 - b1) dA_dp,        V_A <- b2 V_A + (1 - b2) dA_dp.T dA_dp / m
        U_A  = m_A_hat (V_A_hat + lambda_A I)^{-1/2}            (and the same for B with n, M)

    with the DP-aware floor of eq. (26) in its scalar form, ``lambda_A = lambda_B =
    floor_scale * s^2`` (at least ``min_floor``), and a condition-number clamp. The result is
    post-processing of the DP update and costs no privacy.

    Args:
        point: the module's current ``Point(A, B)``.
        update: the DP tangent update ``(dA_dp, dB_dp)`` of this step as ``privatize``
            releases it: already the minimum-norm lift of the noisy ``dZ``, used as given.
        state: this module's moments.
        noise_std: ``s = sigma * C / b``, the per-coordinate std of the DP noise in the update.
        config: hyperparameters.

    Returns:
        (direction ``(U_A, U_B)``, new state). Step with ``retract(A, B, U_A, U_B, -lr)``.

    Notes:
        Equivariant under orthogonal gauge changes ``(A R, B R)`` (Prop. A.30) when moments
        transform alongside. r x r work is done in float32 or better.
    """
    A, B = point
    dtype = work_dtype(A, B, update.dA, update.dB)
    A, B = A.to(dtype), B.to(dtype)
    dA, dB = update.dA.to(dtype), update.dB.to(dtype)
    m, n = A.shape[-2], B.shape[-2]
    b1, b2 = config.beta1, config.beta2
    step = state.step + 1
    mA = b1 * state.mA.to(dtype) + (1 - b1) * dA
    mB = b1 * state.mB.to(dtype) + (1 - b1) * dB
    VA = b2 * state.VA.to(dtype) + (1 - b2) * (dA.mT @ dA) / m
    VB = b2 * state.VB.to(dtype) + (1 - b2) * (dB.mT @ dB) / n
    c1 = 1 - b1**step if config.bias_correction else 1.0
    c2 = 1 - b2**step if config.bias_correction else 1.0

    lam = max(config.floor_scale * float(noise_std) ** 2, config.min_floor)
    U_A = (mA / c1) @ _inv_sqrt_floored(VA / c2, lam, config.cond_max)
    U_B = (mB / c1) @ _inv_sqrt_floored(VB / c2, lam, config.cond_max)
    if config.relift_direction:
        U_A, U_B = min_norm_lift(A, B, U_A, U_B)
    return Tangent(U_A, U_B), AdaptiveState(mA, mB, VA, VB, step)


def adaptive_directions(
    points: Sequence[Point],
    updates: Sequence[Tangent],
    states: Sequence[AdaptiveState],
    *,
    groups: Sequence[Sequence[int]],
    noise_std: float,
    config: AdaptiveConfig,
) -> tuple[list[Tangent], list[AdaptiveState]]:
    """``adaptive_direction`` of every module, one batched call per group of modules of equal
    shapes (``groups``: module indices, e.g. ``prism_core.mechanism.StepFrames.groups``).

    Every operation of ``adaptive_direction`` acts on each matrix of a stack alone (the
    condition clamp too), so the result is the per-module one; the r x r eigendecompositions
    of a group run as one batched LAPACK call instead of one small call per module.

    Raises:
        ValueError: ``groups`` do not cover every module once, or the modules of a group are
            at different step counts.
    """
    if sorted(i for group in groups for i in group) != list(range(len(points))):
        raise ValueError(f"groups {groups} do not name each of the {len(points)} modules once")
    if not len(points) == len(updates) == len(states):
        raise ValueError(f"{len(points)} points, {len(updates)} updates, {len(states)} states")
    directions: list[Tangent | None] = [None] * len(points)
    new_states: list[AdaptiveState | None] = [None] * len(points)
    for group in groups:
        steps = {states[i].step for i in group}
        if len(steps) != 1:
            raise ValueError(f"modules {list(group)} are at different steps {sorted(steps)}")
        point = Point(
            torch.stack([points[i].A for i in group]), torch.stack([points[i].B for i in group])
        )
        update = Tangent(
            torch.stack([updates[i].dA for i in group]),
            torch.stack([updates[i].dB for i in group]),
        )
        state = AdaptiveState(
            torch.stack([states[i].mA for i in group]),
            torch.stack([states[i].mB for i in group]),
            torch.stack([states[i].VA for i in group]),
            torch.stack([states[i].VB for i in group]),
            steps.pop(),
        )
        direction, after = adaptive_direction(
            point, update, state, noise_std=noise_std, config=config
        )
        for j, i in enumerate(group):
            directions[i] = Tangent(direction.dA[j], direction.dB[j])
            new_states[i] = AdaptiveState(  # each module's own tensors, not views of the stack
                after.mA[j].clone(),
                after.mB[j].clone(),
                after.VA[j].clone(),
                after.VB[j].clone(),
                after.step,
            )
    return [d for d in directions if d is not None], [s for s in new_states if s is not None]


def realign_state(state: AdaptiveState, old: Point, new: Point) -> AdaptiveState:
    """Carry one module's moments from factors ``old`` to nearby factors ``new``.

    Implements the moment transformation of Prop. A.30 of PRISM under a Procrustes gauge.

    Moments live in factor coordinates; when the factors move (e.g. a site starts a round from
    a new global point), the orthogonal gauge ``O`` that best aligns ``old`` to ``new``
    (Procrustes: polar factor of ``old.A.T new.A + old.B.T new.B``) is applied as in
    Prop. A.30: ``m -> m O``, ``V -> O.T V O``. Post-processing only; no privacy cost.
    """
    dtype = work_dtype(old.A, new.A, state.mA)
    O = procrustes_gauge(old, new).to(dtype)
    return AdaptiveState(
        state.mA.to(dtype) @ O,
        state.mB.to(dtype) @ O,
        O.mT @ state.VA.to(dtype) @ O,
        O.mT @ state.VB.to(dtype) @ O,
        state.step,
    )
