"""The server optimizer: turns the round's aggregated update into the next global adapter.

Post-processing of DP outputs only (it sees nothing but the aggregate), so it costs no privacy.
Three kinds (run-config ``server-optimizer``):

- ``sgd``: ``Retr_r(Z_t + eta_s * dZ)``, the plain server step (stateless).
- ``momentum``: ``v_t = beta * T(v_{t-1}) + dZ_t`` with ``T`` the projection transport from the
  previous base point (``prism_core.manifold.transport``), then ``Retr_r(Z_t + eta_s * v_t)``.
- ``adaptive``: PRISM's gauge-invariant adaptive transform (eqs. 24-26,
  ``prism_core.adaptive.adaptive_direction``) applied to the pseudo-gradient ``-dZ_t`` (FedOpt
  style), with DP-aware floors set from the aggregate's noise level, moments carried across
  rounds by a Procrustes gauge (``realign_state``); ``Retr_r(Z_t - eta_s * U)``.

A Euclidean head gets the matching Euclidean rule (SGD, heavy-ball momentum, or Adam with an
``epsilon`` floor from the same noise level). The state is a flat dict of tensors plus a small
JSON document, stored in the coordinator's checkpoint: a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from prism_core.adaptive import (
    AdaptiveConfig,
    AdaptiveState,
    adaptive_direction,
    init_state,
    realign_state,
)
from prism_core.manifold import Point, Tangent, retract, transport

__all__ = [
    "LR_SCHEDULES",
    "SERVER_OPTIMIZERS",
    "STATE_PREFIX",
    "ServerOptimizer",
    "ServerOptimizerConfig",
    "ServerOptimizerKind",
    "scheduled_lr",
]

ServerOptimizerKind = Literal["sgd", "momentum", "adaptive"]
SERVER_OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adaptive")
LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")
STATE_PREFIX = "round-state/server-optimizer/"
"""Prefix of the optimizer's tensors among the checkpoint's arrays."""


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


@dataclass(frozen=True)
class ServerOptimizerConfig:
    """Settings of the server step.

    Attributes:
        kind: ``sgd``, ``momentum`` or ``adaptive``.
        lr: the server learning rate ``eta_s`` (run-config ``server-lr``).
        momentum: ``beta`` of the momentum kind.
        beta1, beta2: moment decays of the adaptive kind (eq. 24).
        floor_scale: the adaptive floor is ``floor_scale * noise_std^2`` (eq. 26, scalar form).
    """

    kind: ServerOptimizerKind = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    floor_scale: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer {self.kind!r}: use one of {SERVER_OPTIMIZERS}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"server lr={self.lr!r} must be a finite number > 0")
        for name in ("momentum", "beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"server optimizer {name}={value!r} must be in [0, 1)")

    def adaptive(self) -> AdaptiveConfig:
        return AdaptiveConfig(beta1=self.beta1, beta2=self.beta2, floor_scale=self.floor_scale)


class ServerOptimizer:
    """One server step per round on the aggregated tangent (and head) update.

    Args:
        config: the optimizer's settings.
        modules: LoRA module names, in the strategy's order.
        head: names of the Euclidean head tensors, possibly empty.
    """

    def __init__(self, config: ServerOptimizerConfig, modules: list[str], head: list[str]) -> None:
        self.config, self.modules, self.head = config, list(modules), list(head)
        self.steps = 0
        self._at: dict[str, Point] = {}  # base point of the previous step, per module
        self._velocity: dict[str, Tangent] = {}
        self._adaptive: dict[str, AdaptiveState] = {}
        self._head_m: dict[str, Tensor] = {}
        self._head_v: dict[str, Tensor] = {}

    # -- one step --------------------------------------------------------------------------

    def step(
        self,
        points: Mapping[str, Point],
        updates: Mapping[str, Tangent],
        head_values: Mapping[str, Tensor],
        head_deltas: Mapping[str, Tensor],
        *,
        noise_std: float,
        lr: float | None = None,
    ) -> tuple[dict[str, Point], dict[str, Tensor]]:
        """The next global factors and head values from this round's aggregate.

        Args:
            points: per module, the round's broadcast point ``(A_t, B_t)``.
            updates: per module, the aggregated tangent update at that point.
            head_values: per head tensor, its broadcast value.
            head_deltas: per head tensor, the aggregated change.
            noise_std: per-coordinate noise std of the aggregate (sets the adaptive floors).
            lr: this round's server lr (``scheduled_lr``); default the configured one.
        """
        self.steps += 1
        eta = self.config.lr if lr is None else lr
        new_points = {
            m: self._module_step(m, points[m], updates[m], noise_std, eta) for m in self.modules
        }
        new_head = {
            n: self._head_step(n, head_values[n], head_deltas[n], noise_std, eta) for n in self.head
        }
        for m in self.modules:
            self._at[m] = Point(points[m].A.clone(), points[m].B.clone())
        return new_points, new_head

    def _module_step(
        self, name: str, point: Point, update: Tangent, noise_std: float, lr: float
    ) -> Point:
        A, B = point
        kind = self.config.kind
        if kind == "sgd":
            return retract(A, B, update.dA, update.dB, lr)
        previous = self._at.get(name)
        if kind == "momentum":
            velocity = update
            if name in self._velocity and previous is not None:
                carried = transport(*previous, point.A, point.B, *self._velocity[name])
                beta = self.config.momentum
                velocity = Tangent(beta * carried.dA + update.dA, beta * carried.dB + update.dB)
            self._velocity[name] = Tangent(velocity.dA.clone(), velocity.dB.clone())
            return retract(A, B, velocity.dA, velocity.dB, lr)
        state = self._adaptive.get(name)
        if state is None or previous is None:
            state = init_state(A, B)
        else:
            state = realign_state(state, previous, point)
        gradient = Tangent(-update.dA, -update.dB)
        direction, self._adaptive[name] = adaptive_direction(
            point, gradient, state, noise_std=noise_std, config=self.config.adaptive()
        )
        return retract(A, B, direction.dA, direction.dB, -lr)

    def _head_step(
        self, name: str, value: Tensor, delta: Tensor, noise_std: float, lr: float
    ) -> Tensor:
        kind = self.config.kind
        if kind == "sgd":
            return value + lr * delta
        if kind == "momentum":
            previous = self._head_m.get(name)
            velocity = delta if previous is None else self.config.momentum * previous + delta
            self._head_m[name] = velocity.clone()
            return value + lr * velocity
        b1, b2 = self.config.beta1, self.config.beta2
        m = self._head_m.get(name, torch.zeros_like(delta))
        v = self._head_v.get(name, torch.zeros_like(delta))
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta * delta
        self._head_m[name], self._head_v[name] = m, v
        m_hat = m / (1 - b1**self.steps)
        v_hat = v / (1 - b2**self.steps)
        floor = max(self.config.floor_scale * noise_std**2, 1e-12)
        return value + lr * m_hat / (v_hat + floor).sqrt()

    # -- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """``(tensors, meta)``: tensors keyed under ``STATE_PREFIX``, meta JSON-ready."""
        tensors: dict[str, Tensor] = {}

        def put(kind: str, name: str, part: str, value: Tensor) -> None:
            tensors[f"{STATE_PREFIX}{kind}/{name}/{part}"] = value.detach().contiguous()

        for name, p in self._at.items():
            put("at", name, "A", p.A)
            put("at", name, "B", p.B)
        for name, tangent in self._velocity.items():
            put("velocity", name, "dA", tangent.dA)
            put("velocity", name, "dB", tangent.dB)
        for name, s in self._adaptive.items():
            for part in ("mA", "mB", "VA", "VB"):
                put("adaptive", name, part, getattr(s, part))
        for name, t in self._head_m.items():
            put("head-m", name, "value", t)
        for name, t in self._head_v.items():
            put("head-v", name, "value", t)
        adaptive_steps = {name: s.step for name, s in self._adaptive.items()}
        meta = {
            "kind": self.config.kind,
            "server-lr": self.config.lr,
            "steps": self.steps,
            "adaptive-steps": adaptive_steps,
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s output (tensors may hold other arrays too: only ours are read).

        Raises:
            ValueError: the stored state belongs to another kind of server optimizer.
        """
        if meta.get("kind") != self.config.kind:
            raise ValueError(
                f"the checkpoint's server optimizer is {meta.get('kind')!r}, this run's is "
                f"{self.config.kind!r}; resume with the stored configuration"
            )
        self.steps = int(meta.get("steps", 0))
        parts: dict[tuple[str, str], dict[str, Tensor]] = {}
        for full, value in tensors.items():
            if not full.startswith(STATE_PREFIX):
                continue
            kind, rest = full[len(STATE_PREFIX) :].split("/", 1)
            name, part = rest.rsplit("/", 1)
            parts.setdefault((kind, name), {})[part] = value.clone()
        steps = {str(k): int(v) for k, v in meta.get("adaptive-steps", {}).items()}
        for (kind, name), p in parts.items():
            if kind == "at":
                self._at[name] = Point(p["A"], p["B"])
            elif kind == "velocity":
                self._velocity[name] = Tangent(p["dA"], p["dB"])
            elif kind == "adaptive":
                self._adaptive[name] = AdaptiveState(
                    p["mA"], p["mB"], p["VA"], p["VB"], steps.get(name, 0)
                )
            elif kind == "head-m":
                self._head_m[name] = p["value"]
            elif kind == "head-v":
                self._head_v[name] = p["value"]
