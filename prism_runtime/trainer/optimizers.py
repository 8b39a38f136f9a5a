"""The optimizers that consume a step's (DP or plain) gradients: AdamW for the LoRA factors, SGD,
heavy-ball SGD or AdamW for a trained classifier head (``TrainConfig.head_optimizer``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prism_runtime.config import HEAD_MOMENTUM, SGD_HEADS
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import ADAMW_BETAS, TrainConfig

__all__ = ["ChainedOptimizer", "head_optimizer", "lora_optimizer"]


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


def _head_sgd(head: Sequence[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer | None:
    """SGD for the head when ``head_optimizer`` asks for it (None: no head, or AdamW): its step is
    lr times the DP gradient (``sgd``), or times the heavy-ball velocity ``v <- beta v + g`` of
    the DP gradients (``momentum``; the velocity is post-processing of DP releases and persists
    with the trainer across rounds)."""
    if not head or cfg.head_optimizer not in SGD_HEADS:
        return None
    momentum = HEAD_MOMENTUM if cfg.head_optimizer == "momentum" else 0.0
    return torch.optim.SGD(head, lr=cfg.head_learning_rate, momentum=momentum)


def head_optimizer(head: Sequence[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer | None:
    """The optimizer of a head stepped on its own (PRISM's: its LoRA factors retract instead);
    None without a head."""
    sgd = _head_sgd(head, cfg)
    if sgd is not None or not head:
        return sgd
    return torch.optim.AdamW(
        head, lr=cfg.head_learning_rate, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay
    )


def lora_optimizer(
    loaded: LoadedModel, cfg: TrainConfig
) -> tuple[list[nn.Parameter], torch.optim.Optimizer | ChainedOptimizer]:
    """Every trainable tensor (the LoRA factors that require a gradient, then the head) and the
    optimizer that steps them: one AdamW (the head in its own group at its lr), chained with the
    head's SGD when ``head_optimizer`` is ``sgd`` or ``momentum``."""
    head = loaded.head_params
    head_sgd = _head_sgd(head, cfg)
    lora = [p for h in loaded.handles for p in (h.lora_A, h.lora_B) if p.requires_grad]
    groups = [{"params": lora, "lr": cfg.lr}]
    if head and head_sgd is None:
        groups.append({"params": head, "lr": cfg.head_learning_rate})
    adamw = torch.optim.AdamW(groups, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
    return [*lora, *head], adamw if head_sgd is None else ChainedOptimizer([adamw, head_sgd])
