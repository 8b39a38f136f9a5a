"""PRISM's post-processing on the coordinator under secure aggregation (docs/design.md §3.3).

Under secure aggregation the coordinator holds one thing per round: the unmasked SUM of the
sites' rounded clipped sums and noise shares, in the public tangent coordinates of the broadcast
point (``prism_core.distributed``). That sum is ONE central Skellam mechanism's output, so every
non-linear step a site would run on its own noisy step moves here and acts on the sum
(post-processing): decode (times gamma), divide by the EXPECTED batch of the round (the
survivors' ``b`` each: q N summed, never the realised count), map the coordinates back to tangent
vectors and their minimum-norm lifts, PRISM's DP-aware adaptive transform with its moments kept
across rounds, the retraction at the run's ``lr``, and the head's optimizer on the head part.
The result is exactly a central PRISM step on the union of the sites' Poisson batches.

Plain rounds with ``step-at = coordinator`` take the same step (``apply_mean``) on the weighted
mean of the sites' own releases: each site's noisy gradient is one Gaussian PRISM release at
its own sigma, divided by its own expected batch; their weighted mean carries the noise
``StreamingAggregator.mean_noise_std`` of the weights, and the adaptive transform's floor is
tied to it. Averaging before the adaptive transform is what the per-site step cannot do: each
site's transform normalises its own, sqrt(K) times noisier, gradient (docs/design.md).

State (adaptive moments, the head optimizer's moments) is checkpointed with the coordinator's
resume state (``state_dict``; ``server.federation``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn

from prism_core.adaptive import AdaptiveState, adaptive_directions, init_state
from prism_core.distributed import (
    coordinate_dim,
    coordinate_shapes,
    decode_sum,
    from_coordinates,
    unflatten,
)
from prism_core.manifold import Point, Tangent, min_norm_lift
from prism_core.mechanism import StepFrames, retract_modules, step_frames
from prism_runtime.config import RunConfig
from prism_runtime.head_optimizer import head_optimizer
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.train_config import site_train_config

__all__ = ["STATE_PREFIX", "CentralStep", "noise_std_of"]

log = logging.getLogger("server.strategy")

STATE_PREFIX = "round-state/central/"
"""Prefix of the central step's tensors in the coordinator's checkpoint."""


class CentralStep:
    """The coordinator's PRISM step on the unmasked sum (see the module docstring).

    Args:
        run: the run config (``lr``, the adaptive transform's and the head's settings, C).
        modules: the LoRA module names, in the order of the global arrays and the coordinates.
        head: the DP head tensor names (keys ``head/<name>``), in the model's order.
        arrays: the initial global arrays (shapes and dtypes).
    """

    def __init__(
        self, run: RunConfig, *, modules: list[str], head: list[str], arrays: dict[str, Tensor]
    ) -> None:
        self.modules, self.head = modules, head
        self.max_norm = run.max_norm if isinstance(run.max_norm, float) else None
        """C of the integer sum's decoding (``apply``); None with ``max-norm = auto`` (plain
        rounds only: each site's release is already divided by its own b)."""
        # the coordinator adds no noise: sigma 1 only satisfies the config (never used), and
        # neither is C (the top of an auto clip's range stands in for it)
        self.config = site_train_config(
            run,
            method="prism",
            max_norm=run.max_norm if isinstance(run.max_norm, float) else run.auto_clip_range[1],
            noise_multiplier=1.0,
        )
        self.adaptive = self.config.adaptive.to_config()
        self.lr = self.config.lr
        points = self._points(arrays)
        self.head_params = [nn.Parameter(arrays[HEAD_PREFIX + n].clone()) for n in head]
        self.shapes = coordinate_shapes(points, self.head_params)
        self.dim = coordinate_dim(self.shapes)
        self.states: list[AdaptiveState] = [init_state(p.A, p.B) for p in points]
        self.optimizer = head_optimizer(self.head_params, self.config)
        self.head_lrs = (
            []
            if self.optimizer is None
            else [float(group["lr"]) for group in self.optimizer.param_groups]
        )

    def _points(self, arrays: dict[str, Tensor]) -> list[Point]:
        return [Point(arrays[key(m, "A")], arrays[key(m, "B")]) for m in self.modules]

    def apply(
        self,
        arrays: dict[str, Tensor],
        total: NDArray[np.int64],
        *,
        expected_batch: float,
        noise_std: float,
    ) -> dict[str, Tensor]:
        """The next global arrays from the centred integer sum ``total`` of one round.

        Args:
            arrays: the round's broadcast arrays (float32).
            total: the unmasked sum, centred (``prism_runtime.secure_sum.centre``).
            expected_batch: the divisor, the EXPECTED batch of the sites whose inputs are in
                the sum (each site's ``q N = b``).
            noise_std: the std of the mean update's noise per coordinate (the adaptive
                transform's floor is tied to it).
        """
        if self.max_norm is None:
            raise ValueError("an integer sum needs a numeric max-norm (RunConfig checks it)")
        points = self._points(arrays)
        frames = step_frames(points)
        mean = decode_sum(total, max_norm=self.max_norm) / expected_batch
        coords, head = unflatten(mean, self.shapes)
        return self._step(
            arrays, points, frames, from_coordinates(frames, coords), head, noise_std, 1.0
        )

    def apply_mean(
        self,
        arrays: dict[str, Tensor],
        means: dict[str, Tensor],
        *,
        noise_std: float,
        lr_scale: float = 1.0,
    ) -> dict[str, Tensor]:
        """The next global arrays from the weighted mean of plain rounds' releases
        (``step-at = coordinator``).

        Args:
            arrays: the round's broadcast arrays (float32).
            means: the weighted mean of the sites' noisy mean gradients: ``dA``/``dB`` of every
                module (tangent vectors at the broadcast point, any lift of them) and the head's.
            noise_std: the std per coordinate of the mean's noise
                (``StreamingAggregator.mean_noise_std``).
            lr_scale: the server lr of the round (``server.optimizer.scheduled_lr``): the step
                is taken at ``lr * lr_scale``, the head's at ``head-lr * lr_scale``.
        """
        points = self._points(arrays)
        frames = step_frames(points)
        tangents = [Tangent(means[key(m, "dA")], means[key(m, "dB")]) for m in self.modules]
        head = [means[HEAD_PREFIX + n] for n in self.head]
        return self._step(arrays, points, frames, tangents, head, noise_std, lr_scale)

    def _step(
        self,
        arrays: dict[str, Tensor],
        points: list[Point],
        frames: StepFrames,
        tangents: Sequence[Tangent],
        head: Sequence[Tensor],
        noise_std: float,
        lr_scale: float,
    ) -> dict[str, Tensor]:
        """PRISM's post-processing of one mean noisy gradient: the min-norm lifts, the adaptive
        transform with the kept moments, the retraction at ``lr x lr_scale``, the head's
        optimizer at its lr times ``lr_scale``."""
        lifted = [
            min_norm_lift(point.A, point.B, t.dA.to(point.A.dtype), t.dB.to(point.B.dtype))
            for point, t in zip(points, tangents, strict=True)
        ]
        directions, self.states = adaptive_directions(
            points,
            lifted,
            self.states,
            groups=frames.groups,
            noise_std=noise_std,
            config=self.adaptive,
        )
        new_points = retract_modules(frames, directions, -self.lr * lr_scale)
        out = dict(arrays)
        for name, p in zip(self.modules, new_points, strict=True):
            out[key(name, "A")] = p.A.to(arrays[key(name, "A")].dtype).contiguous()
            out[key(name, "B")] = p.B.to(arrays[key(name, "B")].dtype).contiguous()
        if self.optimizer is not None:
            with torch.no_grad():
                for name, param in zip(self.head, self.head_params, strict=True):
                    param.copy_(arrays[HEAD_PREFIX + name])
            for param, grad in zip(self.head_params, head, strict=True):
                param.grad = grad.to(param.dtype).reshape(param.shape)
            for group, base in zip(self.optimizer.param_groups, self.head_lrs, strict=True):
                group["lr"] = base * lr_scale
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for name, param in zip(self.head, self.head_params, strict=True):
                out[HEAD_PREFIX + name] = param.detach().clone().contiguous()
        return out

    # -- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        """The adaptive moments and the head optimizer's tensors, under ``STATE_PREFIX``."""
        out: dict[str, Tensor] = {}
        for index, state in enumerate(self.states):
            for field, value in vars(state).items():
                if isinstance(value, Tensor):
                    out[f"{STATE_PREFIX}adaptive/{index}/{field}"] = value.clone()
                else:
                    out[f"{STATE_PREFIX}adaptive/{index}/{field}"] = torch.tensor(float(value))
        if self.optimizer is not None:
            for index, state in self.optimizer.state_dict()["state"].items():
                for field, value in state.items():
                    tensor = value if isinstance(value, Tensor) else torch.tensor(float(value))
                    out[f"{STATE_PREFIX}head/{index}/{field}"] = tensor.clone()
        return out

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        """Restore what ``state_dict`` returned (keys without ``STATE_PREFIX`` are ignored)."""
        for index, state in enumerate(self.states):
            values = dict(vars(state))
            for field, old in values.items():
                name = f"{STATE_PREFIX}adaptive/{index}/{field}"
                if name in tensors:
                    new = tensors[name]
                    values[field] = (
                        new.clone() if isinstance(old, Tensor) else type(old)(new.item())
                    )
            self.states[index] = AdaptiveState(**values)
        if self.optimizer is None:
            return
        saved = self.optimizer.state_dict()
        moments: dict[int, dict[str, Tensor]] = {}
        for name, tensor in tensors.items():
            parts = name.removeprefix(STATE_PREFIX).split("/")
            if len(parts) == 3 and parts[0] == "head":
                moments.setdefault(int(parts[1]), {})[parts[2]] = tensor.clone()
        if moments:
            saved["state"] = moments
            self.optimizer.load_state_dict(saved)


def noise_std_of(shares: Sequence[float], *, max_norm: float, expected_batch: float) -> float:
    """The std per coordinate of the mean update's noise: the shares' RDP-equivalent sigmas
    (``share-sigma`` of each survivor's facts) added in variance, times C, over the divisor. A
    lower bound when the round's sites need different shares: each adds the largest share of
    the roster, not its own."""
    variance = sum(s * s for s in shares)
    return float(np.sqrt(variance)) * max_norm / expected_batch
