"""Private local training on one site: PRISM and its baselines, one class per method.

``make_trainer(loaded, dataset, config)`` (or ``PrivateTrainer(...)``) builds the trainer of
``config.method``; every trainer has ``PrivateTrainer``'s interface (``step``, ``train``,
``count_within``, ``epsilon``, ``steps_allowed``, ``reseed``, ``begin_round``,
``set_max_norm``):

- ``PrismTrainer`` (``prism``, ``prism_runtime.trainer.prism``): tangent-space clip and noise
  (``release``), DP-aware adaptive transform, retraction (Algorithm 1).
- ``FactorTrainer`` (``dp-adamw``, ``ffa``, ``prism_runtime.trainer.factor``): factor-space
  clip of ``(gA, gB)`` (+ head), i.i.d. noise (``factor_release``), AdamW; FFA-LoRA with peft's
  ``lora_A`` frozen.
- ``NonDPTrainer`` (``nondp``, ``prism_runtime.trainer.nondp``): plain LoRA with AdamW on the
  mean per-sequence loss (no clipping, no noise).

Every method draws the same Poisson batches (``prism_runtime.trainer.base``) and every DP method
computes per-example gradients and is accounted the same way (``prism_runtime.trainer.dp``): each
step's mechanism returns its ``PrivacyEvent`` (``StepResult.record``) and the history is those
events. The settings and their defaults are in ``prism_runtime.train_config``.
"""

from __future__ import annotations

from prism_runtime.train_config import (
    ADAMW_BETAS,
    MECHANISMS,
    METHODS,
    AdaptiveSettings,
    TrainConfig,
    site_train_config,
)
from prism_runtime.trainer.base import (
    TRAINERS,
    PrivateTrainer,
    StepResult,
    make_trainer,
    noise_records,
    os_seed,
    per_example_loss,
)
from prism_runtime.trainer.dp import DPTrainer
from prism_runtime.trainer.factor import FactorTrainer
from prism_runtime.trainer.nondp import NonDPTrainer
from prism_runtime.trainer.prism import PrismTrainer

__all__ = [
    "ADAMW_BETAS",
    "MECHANISMS",
    "METHODS",
    "TRAINERS",
    "AdaptiveSettings",
    "DPTrainer",
    "FactorTrainer",
    "NonDPTrainer",
    "PrismTrainer",
    "PrivateTrainer",
    "StepResult",
    "TrainConfig",
    "make_trainer",
    "noise_records",
    "os_seed",
    "per_example_loss",
    "site_train_config",
]
