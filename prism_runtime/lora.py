"""The one place where peft's LoRA layout meets PRISM's notation (docs/design.md §1).

peft stores a module's adapter as ``lora_A.weight`` (r x n) and ``lora_B.weight`` (m x r) with
``W = W0 + s * lora_B @ lora_A``. PRISM writes ``Z = A @ B.T`` with ``A = lora_B.weight``
(m x r) and ``B = lora_A.weight.T`` (n x r); the scaling ``s`` stays inside the gradient with
respect to ``Z``. Every conversion between the two goes through this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from prism_core.manifold import Point

__all__ = [
    "LoraHandle",
    "lora_handles",
    "per_example_factor_grads",
    "read_points",
    "write_points_",
]


@dataclass(frozen=True)
class LoraHandle:
    """A LoRA module of a peft model: its qualified name and its two factor parameters."""

    name: str
    lora_A: nn.Parameter  # peft (r, n) == B.T
    lora_B: nn.Parameter  # peft (m, r) == A
    scaling: float

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(m, n, r)`` of this module."""
        r, n = self.lora_A.shape
        return int(self.lora_B.shape[0]), int(n), int(r)


def lora_handles(model: nn.Module, adapter: str = "default") -> list[LoraHandle]:
    """Every LoRA module of ``model`` in a fixed (named_modules) order."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            # nn.Module.__getattr__ is typed ``Tensor | Module``; the factor layers' weights
            # are parameters.
            handles.append(
                LoraHandle(
                    name=name.removeprefix("_module."),
                    lora_A=cast(nn.Parameter, module.lora_A[adapter].weight),
                    lora_B=cast(nn.Parameter, module.lora_B[adapter].weight),
                    scaling=float(module.scaling[adapter]),
                )
            )
    return handles


def read_points(handles: Sequence[LoraHandle]) -> list[Point]:
    """Detached float32 copies ``Point(A, B)`` of the current factors."""
    return [
        Point(
            h.lora_B.detach().to(torch.float32).clone(),
            h.lora_A.detach().to(torch.float32).T.clone(),
        )
        for h in handles
    ]


@torch.no_grad()
def write_points_(handles: Sequence[LoraHandle], points: Sequence[Point]) -> None:
    """Copy ``Point(A, B)`` into the peft parameters in place (``lora_B = A``, ``lora_A = B.T``)."""
    if len(handles) != len(points):
        raise ValueError(f"{len(handles)} LoRA modules but {len(points)} points")
    for h, p in zip(handles, points, strict=True):
        if tuple(p.A.shape) != tuple(h.lora_B.shape) or tuple(p.B.shape) != tuple(h.lora_A.T.shape):
            raise ValueError(
                f"{h.name}: factors of shape {tuple(p.A.shape)}, {tuple(p.B.shape)} do not fit "
                f"lora_B {tuple(h.lora_B.shape)} and lora_A {tuple(h.lora_A.shape)}"
            )
        h.lora_B.copy_(p.A.to(h.lora_B.dtype))
        h.lora_A.copy_(p.B.T.to(h.lora_A.dtype))


def per_example_factor_grads(handles: Sequence[LoraHandle]) -> list[tuple[Tensor, Tensor]]:
    """Per-example ``(gA, gB)`` of shapes (b, m, r), (b, n, r) from Opacus ``grad_sample``.

    ``gA = G B`` is ``lora_B``'s per-example gradient; ``gB = G.T A`` is the transpose of
    ``lora_A``'s. Raises if a backward pass through ``GradSampleModule`` has not run.
    """
    grads = []
    for h in handles:
        gs_A = getattr(h.lora_A, "grad_sample", None)
        gs_B = getattr(h.lora_B, "grad_sample", None)
        if gs_A is None or gs_B is None:
            raise RuntimeError(f"{h.name}: no per-example gradients; run backward through Opacus")
        grads.append((gs_B.to(torch.float32), gs_A.to(torch.float32).transpose(-1, -2)))
    return grads
