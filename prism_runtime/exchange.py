"""Global adapter <-> message arrays (keys of ``prism_runtime.protocol``), for both sides."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from prism_core.manifold import Point
from prism_runtime.errors import ConfigError
from prism_runtime.lora import read_points, write_points_
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import HEAD_PREFIX, key

__all__ = ["head_named", "load_arrays", "to_arrays"]


def head_named(loaded: LoadedModel) -> list[tuple[str, nn.Parameter]]:
    """The DP head parameters with their names (empty when the head is frozen)."""
    ids = {id(p) for p in loaded.head_params}
    return [(n, p) for n, p in loaded.model.named_parameters() if id(p) in ids]


def to_arrays(loaded: LoadedModel) -> dict[str, Tensor]:
    """The current adapter as float32 CPU tensors: ``<module>/A``, ``<module>/B``, ``head/<n>``."""
    arrays: dict[str, Tensor] = {}
    for h, p in zip(loaded.handles, read_points(loaded.handles), strict=True):
        arrays[key(h.name, "A")] = p.A.cpu().contiguous()
        arrays[key(h.name, "B")] = p.B.cpu().contiguous()
    for name, param in head_named(loaded):
        arrays[HEAD_PREFIX + name] = param.detach().float().cpu().clone()  # no alias
    return arrays


def load_arrays(loaded: LoadedModel, arrays: dict[str, Tensor]) -> list[Point]:
    """Write broadcast arrays into the model; return the float32 points ``(A, B)``."""
    try:
        points = [
            Point(arrays[key(h.name, "A")].float(), arrays[key(h.name, "B")].float())
            for h in loaded.handles
        ]
        head = [(p, arrays[HEAD_PREFIX + n]) for n, p in head_named(loaded)]
    except KeyError as exc:
        raise ConfigError(
            f"the global adapter lacks {exc}: site and coordinator disagree on the model or LoRA "
            "settings"
        ) from exc
    write_points_(
        loaded.handles, [Point(p.A.to(loaded.device), p.B.to(loaded.device)) for p in points]
    )
    with torch.no_grad():
        for param, value in head:
            param.copy_(value.to(param.dtype))
    return points
