"""The non-private reference (``nondp``): plain LoRA with AdamW on the mean per-sequence loss.

No clipping and no noise: a step releases nothing under DP, adds nothing to the history and is
never refused for budget. It draws the same Poisson batches as the DP methods.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Sequence
from typing import ClassVar

from torch import Tensor
from torch.utils.data import Dataset

from prism_core.accounting import PrivacyEvent
from prism_runtime.errors import ConfigError
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import TrainConfig
from prism_runtime.trainer.base import PrivateTrainer
from prism_runtime.trainer.optimizers import lora_optimizer

__all__ = ["NonDPTrainer"]


class NonDPTrainer(PrivateTrainer):
    """Plain LoRA fine-tuning (``nondp``): summed gradients, AdamW (and the head's SGD).

    Takes ``PrivateTrainer``'s arguments. ``params`` are every trainable tensor (LoRA factors,
    then the head); ``optimizer`` steps them. Epsilon is infinite and sigma 0.
    """

    methods: ClassVar[frozenset[str]] = frozenset({"nondp"})
    is_private: ClassVar[bool] = False

    def __init__(
        self,
        loaded: LoadedModel,
        dataset: Dataset[dict[str, object]],
        config: TrainConfig,
        *,
        history: Sequence[PrivacyEvent] = (),
        units: Sequence[Hashable] | None = None,
    ) -> None:
        super().__init__(loaded, dataset, config, history=history, units=units)
        self.params, self.optimizer = lora_optimizer(loaded, config)

    def _noise_multiplier(self) -> float:
        return 0.0

    def epsilon(self) -> float:
        """Infinite: nothing is released under DP."""
        return math.inf

    def steps_allowed(self) -> int:
        """Unbounded (``sys.maxsize``): no budget caps a non-private step."""
        return sys.maxsize

    def count_within(self, max_norm: float, *, lora_only: bool) -> tuple[int, int]:
        """Refused: ``nondp`` clips nothing, so it has no clip to estimate.

        Raises:
            ConfigError: always.
        """
        raise ConfigError(
            "method='nondp' clips nothing: a private clip estimate needs a DP method "
            "(prism, dp-adamw or ffa)"
        )

    def _run_step(self, batch: dict[str, Tensor]) -> tuple[float, None]:
        count = int(batch["labels"].shape[0])
        total = 0.0
        for micro in self._micro_batches(batch):
            losses = self._losses(micro)
            (losses.sum() / count).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            total += float(losses.detach().sum())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(count, 1), None
