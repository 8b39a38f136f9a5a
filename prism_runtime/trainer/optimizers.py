"""The optimizer that consumes a step's (DP or plain) gradients of the factor-space methods:
AdamW for the LoRA factors, chained with the head's own optimizer when it is SGD or heavy-ball
SGD (``prism_runtime.head_optimizer``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prism_runtime.head_optimizer import head_sgd
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import ADAMW_BETAS, TrainConfig

__all__ = ["ChainedOptimizer", "lora_optimizer"]


class ChainedOptimizer:
    """Steps several optimizers as one (LoRA's AdamW and the head's SGD)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def lora_optimizer(
    loaded: LoadedModel, cfg: TrainConfig
) -> tuple[list[nn.Parameter], torch.optim.Optimizer | ChainedOptimizer]:
    """Every trainable tensor (the LoRA factors that require a gradient, then the head) and the
    optimizer that steps them: one AdamW (the head in its own group at its lr), chained with the
    head's SGD when ``head_optimizer`` is ``sgd`` or ``momentum``."""
    head = loaded.head_params
    sgd = head_sgd(head, cfg)
    lora = [p for h in loaded.handles for p in (h.lora_A, h.lora_B) if p.requires_grad]
    groups = [{"params": lora, "lr": cfg.lr}]
    if head and sgd is None:
        groups.append({"params": head, "lr": cfg.head_learning_rate})
    adamw = torch.optim.AdamW(groups, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
    return [*lora, *head], adamw if sgd is None else ChainedOptimizer([adamw, sgd])
