"""Validation of the coordinator's broadcast at the site, BEFORE anything is charged or trained.

The broadcast is hostile input: a site checks that it holds exactly the arrays its own model
expects (``<module>/A``, ``<module>/B`` and, when the head is trained, ``head/<name>``), each
floating point, of the model's shape and finite; that its magnitudes are bounded relative to the
site's own public start of the same model (``BroadcastLimits``: huge finite values would make
gradients overflow); and, for PRISM, that every factor has full rank r with a bounded condition
number (the tangent space, the lift, its norm and the noise calibration are accurate only
there). A broadcast that fails is refused (``bad-broadcast``) and costs the site nothing. Every
check reads the broadcast and the site's public start only, never its data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from client.request import RoundRequest
from prism_runtime.exchange import head_named
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.ranges import BROADCAST_SCALE_MAX, FACTOR_COND_MAX

__all__ = ["BroadcastLimits", "broadcast_limits", "broadcast_problem", "check_broadcast"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BroadcastLimits:
    """The largest broadcast a site accepts, per array: from its own public start.

    Attributes:
        shapes: the shape of every expected array, by its broadcast key.
        factor_norm: per factor key, the largest spectral norm accepted:
            ``BROADCAST_SCALE_MAX * (1 + ||F0||_2)`` with ``F0`` the site's own start of it.
        head_abs: per head key, the largest absolute entry accepted:
            ``BROADCAST_SCALE_MAX * (1 + max |h0|)``.
    """

    shapes: dict[str, tuple[int, ...]]
    factor_norm: dict[str, float]
    head_abs: dict[str, float]


def broadcast_limits(loaded: LoadedModel) -> BroadcastLimits:
    """The limits of ``loaded``'s model, read from its CURRENT adapter and head: call it once,
    right after loading, before any broadcast is written into the model."""
    shapes: dict[str, tuple[int, ...]] = {}
    factor_norm: dict[str, float] = {}
    head_abs: dict[str, float] = {}
    for handle, point in zip(loaded.handles, read_points(loaded.handles), strict=True):
        for part, factor in (("A", point.A), ("B", point.B)):
            name = key(handle.name, part)
            shapes[name] = tuple(factor.shape)
            start = float(torch.linalg.matrix_norm(factor.double(), ord=2))
            factor_norm[name] = BROADCAST_SCALE_MAX * (1.0 + start)
    for name, param in head_named(loaded):
        shapes[HEAD_PREFIX + name] = tuple(param.shape)
        start = float(param.detach().double().abs().max()) if param.numel() else 0.0
        head_abs[HEAD_PREFIX + name] = BROADCAST_SCALE_MAX * (1.0 + start)
    return BroadcastLimits(shapes, factor_norm, head_abs)


def _tensor_problem(name: str, value: Tensor, shape: tuple[int, ...]) -> str | None:
    if not value.is_floating_point():
        return f"{name} has dtype {value.dtype}, not a floating-point type"
    if tuple(value.shape) != shape:
        return f"{name} has shape {tuple(value.shape)}, the site's model needs {shape}"
    if not bool(torch.isfinite(value).all()):
        return f"{name} holds NaN or Inf"
    return None


def _factor_problem(name: str, factor: Tensor, limit: float, *, full_rank: bool) -> str | None:
    """A factor's spectral norm within ``limit``; with ``full_rank`` also rank r with
    ``s_1 / s_r <= FACTOR_COND_MAX`` (singular values in float64)."""
    values = torch.linalg.svdvals(factor.detach().double())  # descending, r of them
    smallest, largest = float(values[-1]), float(values[0])
    if not largest <= limit:
        return f"{name} has spectral norm {largest:.3g}, above the site's limit {limit:.3g}"
    if full_rank and not (smallest > 0 and smallest * FACTOR_COND_MAX >= largest):
        return (
            f"{name} is not of full rank {factor.shape[1]} with condition number at most "
            f"{FACTOR_COND_MAX:g} (singular values {smallest:.3g} .. {largest:.3g})"
        )
    return None


def broadcast_problem(
    limits: BroadcastLimits, arrays: dict[str, Tensor], *, full_rank: bool
) -> str | None:
    """What is wrong with a broadcast for this site's model, or None if it can be used.

    Args:
        limits: ``broadcast_limits`` of the site's model (the expected arrays and their bounds).
        arrays: the broadcast arrays, as received.
        full_rank: also require every ``A`` and ``B`` to have full rank r, well conditioned
            (PRISM).

    Returns:
        A description naming the array and the problem (for the site's own log), or None.
    """
    expected = limits.shapes
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        return f"broadcast keys differ from the site's model: missing {missing}, unexpected {extra}"
    for name, shape in expected.items():
        problem = _tensor_problem(name, arrays[name], shape)
        if problem:
            return problem
    for name, limit in limits.head_abs.items():
        value = arrays[name]
        largest = float(value.detach().double().abs().max()) if value.numel() else 0.0
        if not largest <= limit:
            return f"{name} has an entry of size {largest:.3g}, above the site's limit {limit:.3g}"
    for name, limit in limits.factor_norm.items():
        problem = _factor_problem(name, arrays[name], limit, full_rank=full_rank)
        if problem:
            return problem
    return None


def check_broadcast(
    limits: BroadcastLimits, request: RoundRequest, *, full_rank: bool, site_id: str
) -> bool:
    """Whether the round's broadcast can be used; a problem goes to the site's own log.

    Args:
        limits: ``broadcast_limits`` of the site's model.
        request: the round's checked request, whose arrays are the broadcast.
        full_rank: PRISM's rank and conditioning check (``broadcast_problem``).
        site_id: this site, for its log.
    """
    problem = broadcast_problem(limits, request.arrays, full_rank=full_rank)
    if problem is not None:
        log.warning("site %s, round %d: %s", site_id, request.server_round, problem)
    return problem is None
