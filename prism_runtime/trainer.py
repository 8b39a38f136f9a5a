"""Private local training on one site: PRISM and its baselines in one loop (Algorithm 1).

Per logical step: a Poisson batch (Opacus ``DPDataLoader``, rate ``q = b / N``) is split into
micro-batches; each micro-batch runs forward/backward through Opacus' ``GradSampleModule``
(hooks mode) with a PER-SEQUENCE loss summed over examples, so ``grad_sample`` holds exact
per-example gradients. Then, by ``method``:

- ``prism``: lift -> global clip (LoRA modules and DP head together, or with the head's own
  share ``head_max_norm`` of C) -> accumulate, fused in ``clip_and_sum_grads`` with the QR
  frames computed once per step; once per step: tangent noise, divide by the expected batch
  size, DP-aware adaptive transform, retract. The head steps with AdamW or plain SGD
  (``head_optimizer``). Siamese text pairs: the encoder's per-text gradient rows are folded
  into one per example (``prism_runtime.classifier.fold_text_rows``) before the clip.
- ``dp-adamw``: factor-space clip of the concatenated ``(gA, gB)`` (+ head), iid noise, AdamW.
- ``ffa``: as ``dp-adamw`` with peft's ``lora_A`` frozen (FFA-LoRA).
- ``nondp``: plain LoRA with AdamW on the mean per-sequence loss (no clipping, no noise).

Every DP method draws the same Poisson batches and is accounted the same way: each step's
mechanism returns its ``PrivacyEvent`` (``StepResult.record``), and the persistent history is
those events (composed by ``prism_core.accounting``), epsilon by PRV. A step
that would take epsilon past the target is refused with ``BudgetExceededError``.

Randomness: by default (``seed=None``) the Poisson sampler and dropout draw from generators
seeded by the OS (``os.urandom``, fresh at every ``reseed``) and the noise from the OS CSPRNG
(``prism_core.rng.SecureRNG``). An integer ``seed`` makes all three reproducible: for tests and
benchmarks only, since anyone who knows the seed can predict the noise and the batches.

Above ~400 lines on purpose: one loop trains PRISM and its three baselines, so every method
draws the same Poisson batches, clips in the same place and is accounted the same way; the
settings and their defaults are in ``prism_runtime.train_config``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import Tensor, nn
from torch.utils.data import Dataset
from tqdm import tqdm

from prism_core.accounting import (
    PrivacyEvent,
    calibrate_noise_multiplier,
    epsilon,
    max_steps,
)
from prism_core.adaptive import AdaptiveState, adaptive_direction, init_state
from prism_core.baselines import factor_clip_and_sum, factor_privatize
from prism_core.errors import BudgetExceededError
from prism_core.manifold import Point, Tangent
from prism_core.mechanism import (
    ClippedSum,
    PrivateStep,
    StepFrames,
    clip_and_sum_grads,
    empty_sum,
    privatize,
    retract_modules,
    step_frames,
)
from prism_core.rng import NoiseSource, SecureRNG
from prism_runtime.classifier import fold_text_rows
from prism_runtime.config import HEAD_MOMENTUM, SGD_HEADS
from prism_runtime.data import IGNORE_INDEX, make_collate, micro_batches, poisson_loader
from prism_runtime.errors import ConfigError
from prism_runtime.lora import per_example_factor_grads, read_points, write_points_
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import RNG_REPRODUCIBLE, RNG_SECURE
from prism_runtime.train_config import (
    ADAMW_BETAS,
    MECHANISMS,
    METHODS,
    AdaptiveSettings,
    TrainConfig,
    site_train_config,
)

__all__ = [
    "ADAMW_BETAS",
    "MECHANISMS",
    "METHODS",
    "AdaptiveSettings",
    "PrivateTrainer",
    "StepResult",
    "TrainConfig",
    "noise_records",
    "os_seed",
    "per_example_loss",
    "site_train_config",
]

log = logging.getLogger(__name__)


ClipFn = Callable[..., ClippedSum]
"""Signature of ``prism_core.mechanism.clip_and_sum_grads``."""
PrivatizeFn = Callable[..., PrivateStep]
"""Signature of ``prism_core.mechanism.privatize``."""


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``loss`` and ``batch_size`` are PRIVATE (un-noised): keep them local.

    ``record`` is the mechanism's own ``PrivacyEvent`` of the step (None for ``nondp``): the one
    source of every privacy event, ledger entry and accounting fact.
    """

    step: int
    loss: float
    batch_size: int
    record: PrivacyEvent | None = None


def noise_records(results: Sequence[StepResult]) -> list[PrivacyEvent]:
    """The mechanism records of ``results`` (steps without one, i.e. ``nondp``, are skipped)."""
    return [r.record for r in results if r.record is not None]


def os_seed() -> int:
    """A fresh 63-bit seed from the OS CSPRNG (for the sampler and dropout generators)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def per_example_loss(model: nn.Module, batch: dict[str, Tensor], task: str) -> Tensor:
    """Per-SEQUENCE loss (b,): no token averaging across examples (privacy rule 3).

    seq-cls: cross-entropy of each example. causal-lm: mean token cross-entropy over that
    sequence's supervised tokens (labels != -100), 0 for a sequence with none.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()
    labels = batch["labels"]
    if task == "seq-cls":
        return F.cross_entropy(logits, labels, reduction="none")
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    ).view(shift_labels.shape)
    mask = (shift_labels != IGNORE_INDEX).to(tokens.dtype)
    return (tokens * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def _head_optimizer(head: Sequence[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD for the DP head: its step is lr times the DP gradient (``sgd``), or times the
    heavy-ball velocity ``v <- beta v + g`` of the DP gradients (``momentum``; the velocity is
    post-processing of DP releases and persists with the trainer across rounds)."""
    momentum = HEAD_MOMENTUM if cfg.head_optimizer == "momentum" else 0.0
    return torch.optim.SGD(head, lr=cfg.head_learning_rate, momentum=momentum)


def _grad_sample(p: Tensor) -> Tensor:
    """The per-example gradients of ``p`` that Opacus' hooks stored as ``p.grad_sample``."""
    grad_sample: Tensor = p.grad_sample  # type: ignore[attr-defined]  # set by Opacus at runtime
    return grad_sample


class _Chained:
    """Steps several optimizers as one (LoRA's AdamW and the head's SGD)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class PrivateTrainer:
    """Runs private local steps on one site's dataset with a persistent privacy history.

    Args:
        loaded: the model from ``prism_runtime.model.load_model`` (same ``method``).
        dataset: the site's tokenized training set (``prism_runtime.data.TokenizedDataset``).
        config: training settings.
        history: privacy events this site already spent (e.g. earlier federated rounds).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        dataset: Dataset[dict[str, object]],
        config: TrainConfig,
        *,
        history: Sequence[PrivacyEvent] = (),
    ) -> None:
        self.loaded, self.config = loaded, config
        self.task = loaded.config.task
        self.num_examples = len(dataset)  # type: ignore[arg-type]
        if config.batch_size > self.num_examples:
            raise ConfigError(
                f"batch_size={config.batch_size} is larger than the dataset ({self.num_examples} "
                "examples): lower batch_size or add data"
            )
        self._dataset = dataset
        self.reseed(config.seed)
        self.expected_batch_size = self.sample_rate * self.num_examples
        self.history: list[PrivacyEvent] = list(history)
        self.noise_multiplier = self._noise_multiplier()
        self.steps_done = 0
        self._allowed: int | None = None  # steps left under the cap, computed on demand
        self._setup_method()

    def reseed(self, seed: int | None) -> None:
        """Restart Poisson sampling, dropout and noise: from the OS (None) or from ``seed``.

        With None the sampler and dropout generators get fresh OS-random seeds and the noise
        comes from the OS CSPRNG: nothing can be predicted or replayed. An integer seed is the
        reproducible mode (tests, benchmarks); a federated site derives it from a secret only
        it holds (``client.policy.SitePolicy.round_seed``), never from the coordinator.
        """
        if seed is None:
            sampling, dropout = os_seed(), os_seed()
            self.noise: NoiseSource = SecureRNG()
            self.rng = RNG_SECURE
        else:
            sampling = dropout = seed
            self.noise = torch.Generator().manual_seed(seed + 1)
            self.rng = RNG_REPRODUCIBLE
        torch.manual_seed(dropout)
        self._loader, self.sample_rate = poisson_loader(
            self._dataset,
            expected_batch_size=self.config.batch_size,
            collate_fn=make_collate(self.loaded.tokenizer, self.task),
            generator=torch.Generator().manual_seed(sampling),
        )
        self._batches = self._forever()

    # -- privacy ---------------------------------------------------------------------------

    @property
    def is_private(self) -> bool:
        return self.config.method != "nondp"

    def _noise_multiplier(self) -> float:
        cfg = self.config
        if not self.is_private:
            return 0.0
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
        return epsilon(self.history, self.config.delta) if self.is_private else math.inf

    def steps_allowed(self) -> int:
        """How many more steps fit under ``config.epsilon`` (the planned steps if no cap)."""
        cfg = self.config
        if not self.is_private or cfg.epsilon is None:
            return max(cfg.steps - self.steps_done, 0) if self.is_private else sys.maxsize
        if self._allowed is None:
            self._allowed = self.steps_done + max_steps(
                self.history,
                noise_multiplier=self.noise_multiplier,
                sample_rate=self.sample_rate,
                delta=cfg.delta,
                target_epsilon=cfg.epsilon,
                limit=max(cfg.steps, 1) * 4,
            )
        return self._allowed - self.steps_done

    def _check_budget(self) -> None:
        if self.is_private and self.config.epsilon is not None and self.steps_allowed() <= 0:
            raise BudgetExceededError(
                f"refusing step {self.steps_done + 1}: it would take epsilon past the target "
                f"{self.config.epsilon} at delta={self.config.delta} (spent {self.epsilon():.4f}). "
                "Stop here, or raise the target only if your privacy policy allows it."
            )

    def begin_round(self, history: Sequence[PrivacyEvent], steps: int) -> None:
        """Start a new block of ``steps`` steps on top of ``history`` (a federated round).

        The model, its Opacus wrapper, the sampler and the optimizer state are kept; the
        privacy history is replaced by the site's durable one.
        """
        self.history = list(history)
        self.steps_done = 0
        self._allowed = None
        self.config = self.config.model_copy(update={"steps": steps})

    def set_max_norm(self, max_norm: float) -> None:
        """Use the clip C = ``max_norm`` from now on (a private estimate, ``client.clip_quantile``).

        Raises:
            pydantic.ValidationError: C not > 0, or not above the head's share of the clip.
        """
        self.config = TrainConfig.model_validate({**self.config.model_dump(), "max_norm": max_norm})

    # -- setup -----------------------------------------------------------------------------

    def _forever(self) -> Iterator[dict[str, Tensor]]:
        while True:
            yield from self._loader

    def _setup_method(self) -> None:
        model, cfg = self.loaded.model, self.config
        model.train()
        self.module: nn.Module = model
        if self.is_private:
            self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
            self.module.train()
        head_lr, head = cfg.head_learning_rate, self.loaded.head_params
        sgd_head = head and cfg.head_optimizer in SGD_HEADS
        head_opt = _head_optimizer(head, cfg) if sgd_head else None
        if cfg.method == "prism":
            self.states: list[AdaptiveState] = [
                init_state(p.A, p.B) for p in read_points(self.loaded.handles)
            ]
            self.adaptive = cfg.adaptive.to_config()
            self.optimizer: torch.optim.Optimizer | _Chained | None = head_opt
            if head and head_opt is None:
                self.optimizer = torch.optim.AdamW(
                    head, lr=head_lr, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay
                )
        else:
            lora = [p for h in self.loaded.handles for p in (h.lora_A, h.lora_B) if p.requires_grad]
            self.params = [*lora, *head]  # every trainable tensor (_check_trainable), head last
            groups = [{"params": lora, "lr": cfg.lr}]
            if head and head_opt is None:
                groups.append({"params": head, "lr": head_lr})
            adamw = torch.optim.AdamW(groups, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
            self.optimizer = _Chained([adamw, head_opt]) if head_opt else adamw

    # -- one step --------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one logical step (refused with ``BudgetExceededError`` past the cap)."""
        self._check_budget()
        batch = next(self._batches)
        batch = {k: v.to(self.loaded.device) for k, v in batch.items()}
        record: PrivacyEvent | None = None
        with self._autocast():
            if self.config.method == "prism":
                loss, record = self._prism_step(batch)
            elif self.is_private:
                loss, record = self._factor_step(batch)
            else:
                loss = self._nondp_step(batch)
        if record is not None:  # the history is what the mechanism says it ran
            self.history.append(record)
        self.steps_done += 1
        return StepResult(self.steps_done, loss, int(batch["labels"].shape[0]), record)

    def _autocast(self) -> torch.autocast:
        enabled = self.loaded.device.type == "cuda"
        return torch.autocast(self.loaded.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _backward(self, micro: dict[str, Tensor]) -> float:
        losses = per_example_loss(self.module, micro, self.task)
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

    def _example_grads(self, n: int) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """Per-example factor gradients ``(gA, gB)`` of every LoRA module and the head's, for
        the ``n`` examples of the last backward (siamese pairs: 2 encoder rows folded into 1)."""
        grads = [
            (fold_text_rows(gA, n), fold_text_rows(gB, n))
            for gA, gB in per_example_factor_grads(self.loaded.handles)
        ]
        return grads, [_grad_sample(p).to(torch.float32) for p in self.loaded.head_params]

    def clipped_sum(
        self,
        batch: dict[str, Tensor],
        points: Sequence[Point],
        *,
        frames: StepFrames | None = None,
        clip_fn: ClipFn | None = None,
    ) -> tuple[ClippedSum, float]:
        """Globally clipped sum of per-example lifts (and DP-head grads) over micro-batches.

        The lifts are fused into the clip (``clip_and_sum_grads``); ``frames`` (the per-step QR
        frames of ``points``) are computed once per step, not per micro-batch. ``clip_fn``
        defaults to ``prism_core.mechanism.clip_and_sum_grads``; the privacy self-audit
        (``server.audit``) passes deliberately broken variants to prove it catches them.

        Returns the ``ClippedSum`` and the summed per-sequence loss (private, local only).
        """
        clip = clip_and_sum_grads if clip_fn is None else clip_fn
        cfg, head = self.config, self.loaded.head_params
        if frames is None:
            frames = step_frames(points)
        acc, total = None, 0.0
        split = {"euclidean_max_norm": cfg.head_max_norm} if head and cfg.head_max_norm else {}
        for micro in micro_batches(batch, cfg.micro_batch_size, by_length=True):
            total += self._backward(micro)
            grads, head_grads = self._example_grads(int(micro["labels"].shape[0]))
            acc = clip(
                points,
                grads,
                max_norm=cfg.max_norm,
                previous=acc,
                euclidean=head_grads,
                frames=frames,
                **split,
            )
            self._clear_grads()
        return (acc if acc is not None else empty_sum(points, head)), total

    def release(
        self,
        batch: dict[str, Tensor],
        points: Sequence[Point],
        *,
        frames: StepFrames | None = None,
        clip_fn: ClipFn | None = None,
        privatize_fn: PrivatizeFn | None = None,
    ) -> tuple[PrivateStep, ClippedSum, float]:
        """The DP release of one PRISM step on ``batch`` at ``points`` (before post-processing).

        Global clip over every micro-batch, then tangent noise once, divided by the EXPECTED
        batch size. ``clip_fn``/``privatize_fn`` default to ``prism_core``'s functions; only the
        privacy self-audit replaces them (with deliberately broken variants).

        Returns:
            The released ``PrivateStep``, the (private) ``ClippedSum`` and the summed loss.
        """
        if frames is None:
            frames = step_frames(points)
        noisy = privatize if privatize_fn is None else privatize_fn
        acc, total = self.clipped_sum(batch, points, frames=frames, clip_fn=clip_fn)
        released = noisy(
            points,
            acc,
            noise_multiplier=self.noise_multiplier,
            max_norm=self.config.max_norm,
            expected_batch_size=self.expected_batch_size,
            sample_rate=self.sample_rate,
            generator=self.noise,
            frames=frames,
        )
        return released, acc, total

    def _prism_step(self, batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent]:
        cfg, handles, head = self.config, self.loaded.handles, self.loaded.head_params
        points = read_points(handles)
        frames = step_frames(points)
        released, acc, total = self.release(batch, points, frames=frames)
        noise_std = self.noise_multiplier * cfg.max_norm / self.expected_batch_size
        directions: list[Tangent] = []
        for index, (point, update) in enumerate(zip(points, released.tangents, strict=True)):
            direction, self.states[index] = adaptive_direction(
                point, update, self.states[index], noise_std=noise_std, config=self.adaptive
            )
            directions.append(direction)
        write_points_(handles, retract_modules(frames, directions, -cfg.lr))
        if self.optimizer is not None:
            for p, g in zip(head, released.euclidean, strict=True):
                p.grad = g.to(p.dtype)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / max(acc.count, 1), released.record

    def factor_release(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], PrivacyEvent, float]:
        """The DP release of one factor-space baseline step (``dp-adamw``, ``ffa``) on ``batch``.

        Factor-space clip of each example's trainable LoRA factor gradients and DP-head
        gradients (the head within its share ``head_max_norm`` of C when the clip is split) over
        every micro-batch, then i.i.d. ``N(0, sigma^2 C^2)`` noise once on every entry, divided by
        the EXPECTED batch size (``prism_core.baselines.factor_privatize``).

        Returns:
            The released gradients (LoRA tensors, then head tensors, as ``self.params``), the
            mechanism's ``PrivacyEvent`` and the summed per-sequence loss (private, local only).
        """
        cfg = self.config
        acc: list[Tensor] | None = None
        total = 0.0
        n_head = len(self.loaded.head_params)
        split = {"euclidean_max_norm": cfg.head_max_norm} if n_head and cfg.head_max_norm else {}
        for micro in micro_batches(batch, cfg.micro_batch_size, by_length=True):
            total += self._backward(micro)
            n = int(micro["labels"].shape[0])
            grads = [fold_text_rows(_grad_sample(p).to(torch.float32), n) for p in self.params]
            lora, head = grads[: len(grads) - n_head], grads[len(grads) - n_head :]
            acc, _ = factor_clip_and_sum(
                lora, max_norm=cfg.max_norm, previous=acc, euclidean=head, **split
            )
            self._clear_grads()
        if acc is None:
            acc = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
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

    def _factor_step(self, batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent]:
        noisy, record, total = self.factor_release(batch)
        for p, g in zip(self.params, noisy, strict=True):
            p.grad = g.to(p.dtype)
        assert self.optimizer is not None  # set by _setup_method for every method but prism
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(int(batch["labels"].shape[0]), 1), record

    def _nondp_step(self, batch: dict[str, Tensor]) -> float:
        count = int(batch["labels"].shape[0])
        total = 0.0
        for micro in micro_batches(batch, self.config.micro_batch_size, by_length=True):
            losses = per_example_loss(self.module, micro, self.task)
            (losses.sum() / count).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            total += float(losses.detach().sum())
        assert self.optimizer is not None  # set by _setup_method for every method but prism
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(count, 1)

    # -- a private clip estimate (client.clip_quantile) -----------------------------------

    def count_within(self, max_norm: float, *, lora_only: bool) -> tuple[int, int]:
        """On the next Poisson batch: ``(examples, examples whose clipped norm is <= max_norm)``.

        The norm is the one the clip of this method sees: PRISM's intrinsic norm of the lift
        (eq. 15), or the baselines' factor norm, joined by the DP head's gradient unless
        ``lora_only`` (a split clip estimates the LoRA part alone). Computed by the same clip
        functions as a training step (an example is below when its coefficient is 1); no
        parameter moves. Both counts are PRIVATE: only a noisy count may leave this method's
        caller (``prism_core.quantile.noisy_fraction_below``).
        """
        batch = {k: v.to(self.loaded.device) for k, v in next(self._batches).items()}
        handles, head = self.loaded.handles, self.loaded.head_params
        points = read_points(handles)
        frames = step_frames(points) if self.config.method == "prism" else None
        count = below = 0
        with self._autocast():
            for micro in micro_batches(batch, self.config.micro_batch_size, by_length=True):
                self._backward(micro)
                n = int(micro["labels"].shape[0])
                if frames is not None:  # as clipped_sum
                    grads, extra = self._example_grads(n)
                    acc = clip_and_sum_grads(
                        points,
                        grads,
                        max_norm=max_norm,
                        euclidean=[] if lora_only else extra,
                        frames=frames,
                    )
                    count, below = count + acc.count, below + acc.count - acc.clipped
                else:  # as factor_release
                    rows = [
                        fold_text_rows(_grad_sample(p).to(torch.float32), n) for p in self.params
                    ]
                    lora, extra = rows[: len(rows) - len(head)], rows[len(rows) - len(head) :]
                    _, alpha = factor_clip_and_sum(
                        lora, max_norm=max_norm, euclidean=[] if lora_only else extra
                    )
                    count, below = count + n, below + int((alpha >= 1.0).sum())
                self._clear_grads()
        return count, below

    # -- loop ------------------------------------------------------------------------------

    def train(self, steps: int | None = None) -> list[StepResult]:
        """Run ``steps`` (default: the planned ``config.steps``) with a progress bar.

        Returns one ``StepResult`` per step, each with the mechanism's ``PrivacyEvent``
        (``noise_records`` collects them for accounting).
        """
        todo = self.config.steps if steps is None else steps
        results = []
        every = max(1, todo // 10)  # a PRV evaluation costs ~0.1 s
        with tqdm(
            total=todo, disable=not self.config.progress, file=sys.stderr, desc=self.config.method
        ) as bar:
            for _ in range(todo):
                results.append(self.step())
                bar.update(1)
                show = self.config.progress and self.is_private
                if show and (self.steps_done % every == 0 or len(results) == todo):
                    bar.set_postfix(epsilon=f"{self.epsilon():.3f}")
        return results

    def current_points(self) -> list[Point]:
        """The current factors ``(A, B)`` of every LoRA module."""
        return read_points(self.loaded.handles)
