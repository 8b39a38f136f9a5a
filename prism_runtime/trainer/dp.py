"""What the DP methods share: per-example gradients, the noise multiplier and the accountant.

Each micro-batch runs forward/backward with a PER-SEQUENCE loss summed over examples, and every
trainable tensor's ``grad_sample`` then holds its exact per-example gradients
(``DPTrainer._example_passes``): computed in the backward of each trainable linear layer
(``prism_runtime.per_example``, the default) or by Opacus' ``GradSampleModule`` hooks
(``TrainConfig.grad_sample_mode='hooks'``); on PRISM's step the LoRA factors' rows go, whitened,
into the clip's buffers instead (``prism_runtime.trainer.prism.StepRows``). Each subclass clips
them and noises the sum in its own release (``PrismTrainer.release``,
``FactorTrainer.factor_release``). The history is the mechanisms' ``PrivacyEvent`` records
(composed by ``prism_core.accounting``), epsilon by PRV; a step that would take epsilon past the
target is refused with ``BudgetExceededError`` (``PrivateTrainer.step``).

At the person level (``config.privacy_unit='user'``, docs/design.md §3.2) ``UnitFold`` sums each
person's per-record gradient rows (LoRA factors and head alike) into one row before the clip,
micro-batch by micro-batch (``fold_units``), and across micro-batches for a person whose records
span several (a micro-batch holds at most ``micro_batch_size`` rows whoever was sampled): the
clip, its coefficient and the sensitivity C are then per person, whatever their number of
records, and the clipped sum is the one of a single pass over the whole batch.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import ClassVar

import torch
from opacus import GradSampleModule
from torch import Tensor, nn
from torch.utils.data import Dataset

from prism_core.accounting import PrivacyEvent, calibrate_noise_multiplier, epsilon, max_steps
from prism_core.mechanism import finite_rows
from prism_runtime import per_example
from prism_runtime.data.units import OPEN_KEY, UNIT_KEY
from prism_runtime.errors import ConfigError
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import TrainConfig
from prism_runtime.trainer.base import PrivateTrainer

__all__ = ["DPTrainer", "Fold", "UnitFold", "fold_units", "grad_sample"]

log = logging.getLogger(__name__)


def grad_sample(p: Tensor) -> Tensor:
    """The per-example gradients of ``p`` of the last backward, ``p.grad_sample`` (set by the
    layer's own backward, ``prism_runtime.per_example``, or by Opacus' hooks)."""
    rows: Tensor = p.grad_sample  # type: ignore[attr-defined]  # set by Opacus at runtime
    return rows


def fold_units(rows: Sequence[Tensor], unit: Tensor) -> list[Tensor]:
    """Per-PERSON gradient rows from per-example rows: the rows ``i`` with ``unit[i] == u`` of
    every tensor summed into row ``u`` (docs/design.md §3.2).

    The loss of a person is the sum of their records' per-sequence losses, so their gradient is
    the sum of the rows; the lift is linear, so the lift of the summed factor gradients is the
    sum of the records' lifts. A person with a record that is not finite in one of the tensors
    (``prism_core.mechanism.finite_rows``, over all ``rows`` together) gets NaN rows in every
    tensor: the clip then drops the whole person (contribution zero).

    Args:
        rows: per-example tensors (b, ...), the same b for all (LoRA factor gradients, head).
        unit: (b,) long, each row's person 0..P-1 (every person with at least one row).

    Returns:
        One (P, ...) tensor per input, in the input's dtype.
    """
    if not rows:
        return []
    device = rows[0].device
    unit = unit.to(device)
    if any(int(t.shape[0]) != int(unit.shape[0]) for t in rows):
        shapes = [tuple(t.shape) for t in rows]
        raise ValueError(f"{UNIT_KEY} has {unit.shape[0]} rows but the gradients are {shapes}")
    people = int(unit.max()) + 1 if unit.numel() else 0
    bad_rows = (~finite_rows(rows)).to(torch.float32)
    bad = torch.zeros(people, device=device).index_add_(0, unit, bad_rows) > 0
    out = []
    for t in rows:
        folded = t.new_zeros((people, *t.shape[1:])).index_add_(0, unit, t)
        out.append(folded.masked_fill(bad.view(-1, *[1] * (t.dim() - 1)), float("nan")))
    return out


Fold = Callable[[Sequence[Tensor]], list[Tensor]]
"""Per-example gradient rows of one micro-batch -> the rows of the people it completes."""


class UnitFold:
    """Per-PERSON gradient rows of one batch, micro-batch by micro-batch (docs/design.md §3.2).

    ``fold(rows, unit, open_)`` sums each micro-batch's rows per person (``fold_units``), adds
    the rows carried from the previous micro-batch to its first person (the same person, whose
    records continue), and, when the micro-batch is ``open_`` (its last person's records go on
    in the next one, ``prism_runtime.data.units.OPEN_KEY``), holds that person back. It returns
    the rows of the people whose records are all in: each person reaches the clip once, with
    the sum of all their records, however the micro-batches cut them. A person with a record
    that is not finite stays NaN through the carry (the clip drops them whole).
    """

    def __init__(self) -> None:
        self._carried: list[Tensor] | None = None

    def fold(self, rows: Sequence[Tensor], unit: Tensor, open_: bool) -> list[Tensor]:
        """The completed people's rows of one micro-batch, in order (see the class)."""
        folded = fold_units(rows, unit)
        if self._carried is not None:
            folded = [
                torch.cat([f[:1] + c.to(f.dtype), f[1:]])
                for f, c in zip(folded, self._carried, strict=True)
            ]
        if open_:
            self._carried = [f[-1:] for f in folded]
            return [f[:-1] for f in folded]
        self._carried = None
        return folded

    def close(self) -> None:
        """Check that the batch ended with every person complete.

        Raises:
            ValueError: the last micro-batch was open (a person's rows were cut off).
        """
        if self._carried is not None:
            raise ValueError(
                f"the batch's last micro-batch is marked open ({OPEN_KEY!r}): a person's records "
                "were cut off; micro-batches must come from unit_micro_batches"
            )


class DPTrainer(PrivateTrainer):
    """A trainer whose every step is a DP release of clipped per-example gradients.

    Takes ``PrivateTrainer``'s arguments. Without ``config.noise_multiplier`` sigma is calibrated
    to ``config.epsilon`` over ``config.steps`` (a fresh history only).
    """

    is_private: ClassVar[bool] = True

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
        self._allowed: int | None = None  # steps left under the cap, computed on demand

    def _train_module(self, model: nn.Module) -> nn.Module:
        """The model with per-example gradients: its trainable linear layers compute them in
        their backward (``grad_sample_mode='layer'``, ``prism_runtime.per_example``), or
        Opacus' ``GradSampleModule`` hooks do (``'hooks'``)."""
        if self.config.grad_sample_mode == "layer":
            per_example.attach(per_example.trainable_layers(model))
            return model
        per_example.detach(per_example.attached(model))
        module: nn.Module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        module.train()
        return module

    # -- privacy ---------------------------------------------------------------------------

    def _noise_multiplier(self) -> float:
        cfg = self.config
        if cfg.noise_multiplier is not None:
            return cfg.noise_multiplier
        assert cfg.epsilon is not None  # validated by TrainConfig
        if self.history:
            raise ConfigError(
                "a site with spent budget must be given noise_multiplier; calibration assumes "
                "a fresh history"
            )
        sigma = calibrate_noise_multiplier(
            target_epsilon=cfg.epsilon,
            delta=cfg.delta,
            sample_rate=self.sample_rate,
            steps=cfg.steps,
        )
        log.info(
            "calibrated sigma=%.4f for epsilon=%s over %d steps", sigma, cfg.epsilon, cfg.steps
        )
        return sigma

    def epsilon(self) -> float:
        """Epsilon spent so far (PRV over the whole history, at ``config.delta``)."""
        return epsilon(self.history, self.config.delta, group_size=self.config.group_size)

    def steps_allowed(self) -> int:
        """How many more steps fit under ``config.epsilon`` (the planned steps if no cap)."""
        cfg = self.config
        if cfg.epsilon is None:
            return max(cfg.steps - self.steps_done, 0)
        if self._allowed is None:
            self._allowed = self.steps_done + max_steps(
                self.history,
                noise_multiplier=self.noise_multiplier,
                sample_rate=self.sample_rate,
                delta=cfg.delta,
                target_epsilon=cfg.epsilon,
                limit=max(cfg.steps, 1) * 4,
                unit=self.privacy_unit,
                group_size=cfg.group_size,
            )
        return self._allowed - self.steps_done

    def begin_round(self, history: Sequence[PrivacyEvent], steps: int) -> None:
        super().begin_round(history, steps)
        self._allowed = None

    # -- per-example gradients -------------------------------------------------------------

    def _backward(self, micro: dict[str, Tensor]) -> float:
        losses = self._losses(micro)
        with warnings.catch_warnings():  # Opacus' hooks on a frozen-input first layer
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            losses.sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        return float(losses.detach().sum())

    def _clear_grads(self) -> None:
        """Drop the summed and per-example gradients of the last backward. Only the LoRA factors
        and the head can hold any (``_check_trainable``: nothing else trains), so only they are
        visited, not every tensor of the base model at every micro-batch."""
        handles, head = self.loaded.handles, self.loaded.head_params
        for p in [*(t for h in handles for t in (h.lora_A, h.lora_B)), *head]:
            p.grad = None
            if hasattr(p, "grad_sample"):
                p.grad_sample = None

    def _example_passes(
        self,
        batch: dict[str, Tensor],
        before: Callable[[dict[str, Tensor]], None] | None = None,
        micros: Iterable[dict[str, Tensor]] | None = None,
    ) -> Iterator[tuple[int, float, Fold | None]]:
        """Backward each micro-batch of ``batch``; yields its ``(examples, summed loss, fold)``
        while its per-example gradients are set, and clears them when the caller asks for the
        next, or when the caller stops or fails. ``fold`` maps the micro-batch's per-example rows
        to those of the people it completes (``UnitFold``, one per batch) at the person level;
        None at the record level. ``before(micro)`` runs before each micro-batch's forward (e.g.
        to set row sinks). ``micros``: ``batch``'s micro-batches if the caller split it already
        (``_micro_batches``)."""
        people = UnitFold() if self.privacy_unit == "user" else None
        for micro in self._micro_batches(batch) if micros is None else micros:
            fold: Fold | None = None
            if people is not None:
                unit, open_ = micro[UNIT_KEY], bool(micro[OPEN_KEY].any())
                fold = functools.partial(people.fold, unit=unit, open_=open_)
            try:  # a failed backward or clip leaves no rows for the next step to add to
                if before is not None:
                    before(micro)
                loss = self._backward(micro)
                yield int(micro["labels"].shape[0]), loss, fold
            finally:
                self._clear_grads()
        if people is not None:
            people.close()

    def _head_split(self) -> dict[str, float]:
        """The clip's keyword for the head's share ``head_max_norm`` of C ({}: one joint clip)."""
        share = self.config.head_max_norm
        return {"euclidean_max_norm": share} if self.loaded.head_params and share else {}
