"""The optimizer of a trained classifier head stepped on its own (``TrainConfig.head_optimizer``):
SGD, heavy-ball SGD or AdamW on the head's (DP) gradients.

Used by the site's PRISM trainer and, under secure aggregation, by the coordinator's step on the
unmasked sum (``server.strategy.central``): the same optimizer on the same kind of release, so it
lives outside the trainer package.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prism_runtime.config import HEAD_MOMENTUM, SGD_HEADS
from prism_runtime.train_config import ADAMW_BETAS, TrainConfig

__all__ = ["head_optimizer", "head_sgd"]


def head_sgd(head: Sequence[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer | None:
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
    sgd = head_sgd(head, cfg)
    if sgd is not None or not head:
        return sgd
    return torch.optim.AdamW(
        head, lr=cfg.head_learning_rate, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay
    )
