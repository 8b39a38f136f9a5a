"""The factor-space DP baselines: DP-AdamW on the LoRA factors (``dp-adamw``) and FFA-LoRA
(``ffa``).

Per step: each example's gradients of the trainable LoRA factors (concatenated ``(gA, gB)``)
and of the DP head are clipped in factor space (the head within its share ``head_max_norm`` of
C when the clip is split), summed over every micro-batch, noised i.i.d. once and divided by the
EXPECTED batch size (``FactorTrainer.factor_release``); AdamW (and the head's SGD) step on the
release. FFA-LoRA is the same trainer on a model whose peft ``lora_A`` is frozen
(``prism_runtime.model.load_model(..., method="ffa")``): only tensors that require a gradient
are clipped, noised and stepped. At the person level a person's per-example gradients are
summed into one row before the clip (``UnitFold``, across micro-batches where their records span
several): one coefficient per person.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import torch
from torch import Tensor
from torch.utils.data import Dataset

from prism_core.accounting import PrivacyEvent
from prism_core.baselines import factor_clip_and_sum, factor_privatize
from prism_runtime.classifier import fold_text_rows
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import MECHANISMS, TrainConfig
from prism_runtime.trainer.dp import DPTrainer, Fold, grad_sample
from prism_runtime.trainer.optimizers import lora_optimizer

__all__ = ["FactorClipFn", "FactorTrainer"]

FactorClipFn = Callable[..., tuple[list[Tensor], Tensor]]
"""Signature of ``prism_core.baselines.factor_clip_and_sum``."""


class FactorTrainer(DPTrainer):
    """Factor-space clip and i.i.d. Gaussian noise, then AdamW (``dp-adamw``, ``ffa``).

    Takes ``PrivateTrainer``'s arguments. ``params`` are every trainable tensor (LoRA factors,
    then the head) in the order of ``factor_release``'s output; ``optimizer`` steps them.
    """

    methods: ClassVar[frozenset[str]] = frozenset({"dp-adamw", "ffa"})

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

    # -- the clip and the release ----------------------------------------------------------

    def _example_rows(self, n: int, fold: Fold | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """Per-example gradients of the trainable LoRA factors and of the head, for the ``n``
        examples of the last backward (siamese pairs: 2 encoder rows folded into 1); per
        completed person when ``fold`` is given (``UnitFold``)."""
        rows = [fold_text_rows(grad_sample(p).to(torch.float32), n) for p in self.params]
        if fold is not None:
            rows = fold(rows)
        lora = len(rows) - len(self.loaded.head_params)
        return rows[:lora], rows[lora:]

    def factor_clipped_sum(
        self, batch: dict[str, Tensor], *, clip_fn: FactorClipFn | None = None
    ) -> tuple[list[Tensor], float]:
        """The factor-space clipped sum of ``batch`` over every micro-batch, before noise.

        Each example's (at the person level: each person's) trainable LoRA factor gradients and
        DP-head gradients are clipped together to C (the head within its share
        ``head_max_norm`` of C when the clip is split) and summed. ``clip_fn`` defaults to
        ``prism_core.baselines.factor_clip_and_sum``.

        Returns:
            The sums (LoRA tensors, then head tensors, as ``self.params``; PRIVATE) and the
            summed per-sequence loss (private, local only).
        """
        clip = factor_clip_and_sum if clip_fn is None else clip_fn
        acc: list[Tensor] | None = None
        total = 0.0
        split = self._head_split()
        for n, loss, fold in self._example_passes(batch):
            total += loss
            lora, head = self._example_rows(n, fold)
            acc, _ = clip(
                lora, max_norm=self.config.max_norm, previous=acc, euclidean=head, **split
            )
            del lora, head  # the rows go before the next micro-batch's forward
        if acc is None:
            acc = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        return acc, total

    def factor_release(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], PrivacyEvent, float]:
        """The DP release of one factor-space baseline step on ``batch``.

        The clipped sum of ``factor_clipped_sum``, then i.i.d. ``N(0, sigma^2 C^2)`` noise once
        on every entry, divided by the EXPECTED batch size
        (``prism_core.baselines.factor_privatize``).

        Returns:
            The released gradients (LoRA tensors, then head tensors, as ``self.params``), the
            mechanism's ``PrivacyEvent`` and the summed per-sequence loss (private, local only).
        """
        cfg = self.config
        acc, total = self.factor_clipped_sum(batch)
        noisy, record = factor_privatize(
            acc,
            noise_multiplier=self.noise_multiplier,
            max_norm=cfg.max_norm,
            expected_batch_size=self.expected_batch_size,
            sample_rate=self.sample_rate,
            generator=self.noise,
            mechanism=MECHANISMS[cfg.method],
        )
        return noisy, record, total

    def count_within(self, max_norm: float, *, lora_only: bool) -> tuple[int, int]:
        """On the next Poisson batch: ``(units, units whose clipped norm is <= max_norm)``, the
        units being examples, or people at the person level.

        The norm is the one ``factor_release`` clips: the factor norm of the trainable LoRA
        gradients, joined by the DP head's gradient unless ``lora_only`` (a split clip estimates
        the LoRA part alone); a unit is below when its clip coefficient is 1. No parameter
        moves.
        """
        batch = self._next_batch()
        count = below = 0
        with self._autocast():
            for n, _, fold in self._example_passes(batch):
                lora, head = self._example_rows(n, fold)
                _, alpha = factor_clip_and_sum(
                    lora, max_norm=max_norm, euclidean=[] if lora_only else head
                )
                count, below = count + int(alpha.shape[0]), below + int((alpha >= 1.0).sum())
        return count, below

    # -- the optimizer ---------------------------------------------------------------------

    def _run_step(self, batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent]:
        noisy, record, total = self.factor_release(batch)
        for p, g in zip(self.params, noisy, strict=True):
            p.grad = g.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(int(batch["labels"].shape[0]), 1), record
