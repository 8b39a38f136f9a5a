"""Validation of the coordinator's broadcast at the site, BEFORE anything is charged or trained.

The broadcast is hostile input: a site checks that it holds exactly the arrays its own model
expects (``<module>/A``, ``<module>/B`` and, when the head is trained, ``head/<name>``), each
floating point, of the model's shape and finite, and, for PRISM, that every factor has full
rank r (the tangent space, the lift and the noise calibration are defined only there). A
broadcast that fails is refused (``bad-broadcast``) and costs the site nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prism_runtime.exchange import head_named
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import HEAD_PREFIX, key

__all__ = ["RANK_RTOL", "broadcast_problem"]

RANK_RTOL = 1e-6
"""A factor whose smallest singular value is at most this times its largest is not of rank r
(float32 cannot tell its r-th direction from rounding noise)."""


def _expected_shapes(loaded: LoadedModel) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for handle, point in zip(loaded.handles, read_points(loaded.handles), strict=True):
        shapes[key(handle.name, "A")] = tuple(point.A.shape)
        shapes[key(handle.name, "B")] = tuple(point.B.shape)
    for name, param in head_named(loaded):
        shapes[HEAD_PREFIX + name] = tuple(param.shape)
    return shapes


def _tensor_problem(name: str, value: Tensor, shape: tuple[int, ...]) -> str | None:
    if not value.is_floating_point():
        return f"{name} has dtype {value.dtype}, not a floating-point type"
    if tuple(value.shape) != shape:
        return f"{name} has shape {tuple(value.shape)}, the site's model needs {shape}"
    if not bool(torch.isfinite(value).all()):
        return f"{name} holds NaN or Inf"
    return None


def _rank_problem(name: str, factor: Tensor) -> str | None:
    """``factor`` (m x r) must have rank r: s_r > RANK_RTOL * s_1 (in float64)."""
    values = torch.linalg.svdvals(factor.detach().double())  # descending, r of them
    smallest, largest = float(values[-1]), float(values[0])
    if not smallest > RANK_RTOL * largest:
        return (
            f"{name} is not of full rank {factor.shape[1]} (singular values {smallest:.3g} .. "
            f"{largest:.3g})"
        )
    return None


def broadcast_problem(
    loaded: LoadedModel, arrays: dict[str, Tensor], *, full_rank: bool
) -> str | None:
    """What is wrong with a broadcast for this site's model, or None if it can be used.

    Args:
        loaded: the site's model (its LoRA handles and trained head define the expected arrays).
        arrays: the broadcast arrays, as received.
        full_rank: also require every ``A`` and ``B`` to have full rank r (PRISM).

    Returns:
        A description naming the array and the problem (for the site's own log), or None.
    """
    expected = _expected_shapes(loaded)
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        return f"broadcast keys differ from the site's model: missing {missing}, unexpected {extra}"
    for name, shape in expected.items():
        problem = _tensor_problem(name, arrays[name], shape)
        if problem:
            return problem
    if full_rank:
        for handle in loaded.handles:
            for part in ("A", "B"):
                name = key(handle.name, part)
                problem = _rank_problem(name, arrays[name])
                if problem:
                    return problem
    return None
