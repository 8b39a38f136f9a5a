"""The server step: turns a plain round's aggregated update into the next global adapter.

Post-processing of DP outputs only (it sees nothing but the aggregate), so it costs no privacy.
``Retr_r(Z_t + eta_t * dZ)`` on the LoRA factors and ``value + eta_t * delta`` on a Euclidean
head, at the round's server lr ``eta_t`` (run-config ``server-lr`` and
``server-lr-schedule``, ``scheduled_lr``). Stateless: a resumed run continues bit for bit from
the checkpointed global arrays alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from torch import Tensor

from prism_core.manifold import Point, Tangent, retract

__all__ = ["LR_SCHEDULES", "scheduled_lr", "server_step"]

LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


def scheduled_lr(lr: float, schedule: str, server_round: int, num_rounds: int) -> float:
    """The server lr of round ``t`` (1-based) of ``T``: constant, or cosine-annealed.

    ``cosine``: ``eta_t = eta_s (1 + cos(pi (t - 1) / T)) / 2``, from ``eta_s`` in round 1 down to
    ``eta_s (1 + cos(pi (T - 1) / T)) / 2 > 0`` in round ``T`` (rounds past ``T``, e.g. a
    resumed run asked for more, keep the last value). Clipped DP-SGD moves every round by about
    ``lr`` times the mean of clipped per-example gradients, which does not shrink near an
    optimum the way an unclipped gradient does, so a constant step keeps oscillating in the
    last rounds; annealing the server step damps that. A function of the round number only
    (public), applied to the aggregate: post-processing, no privacy cost.

    Raises:
        ValueError: an unknown schedule, or ``num_rounds < 1``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"server lr schedule {schedule!r}: use one of {LR_SCHEDULES}")
    if num_rounds < 1:
        raise ValueError(f"num_rounds={num_rounds!r} must be >= 1")
    if schedule == "constant":
        return lr
    t = min(max(server_round, 1), num_rounds)
    return lr * 0.5 * (1.0 + math.cos(math.pi * (t - 1) / num_rounds))


def server_step(
    points: Mapping[str, Point],
    updates: Mapping[str, Tangent],
    head_values: Mapping[str, Tensor],
    head_deltas: Mapping[str, Tensor],
    *,
    lr: float,
) -> tuple[dict[str, Point], dict[str, Tensor]]:
    """The next global factors and head values from a round's aggregate.

    Implements ``Retr_r(Z_t + eta dZ)`` (eq. 22 of PRISM, Prop. 3.2: QR + 2r x 2r SVD, rank r
    kept) per module, and ``value + eta delta`` per head tensor.

    Args:
        points: per module, the round's broadcast point ``(A_t, B_t)``.
        updates: per module, the aggregated tangent update at that point.
        head_values: per head tensor, its broadcast value.
        head_deltas: per head tensor, the aggregated change.
        lr: this round's server lr (``scheduled_lr``).
    """
    moved = {m: retract(p.A, p.B, updates[m].dA, updates[m].dB, lr) for m, p in points.items()}
    head = {n: value + lr * head_deltas[n] for n, value in head_values.items()}
    return moved, head
