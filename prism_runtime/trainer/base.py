"""What every training method shares: the Poisson batches, the step loop and the privacy history.

``PrivateTrainer`` is the interface of a site's local trainer; ``make_trainer(loaded, dataset,
config)`` (or ``PrivateTrainer(...)``) builds the subclass that runs ``config.method``
(``TRAINERS``). It owns the model, the
Poisson sampler (Opacus ``DPDataLoader``, rate ``q = b / N``) and its reseeding, the privacy
history with the budget check that refuses a step past the target epsilon, and ``step``/``train``:
each method's subclass runs the body of one step (``_run_step``) on the batch this class draws,
and the history grows by the ``PrivacyEvent`` that body's mechanism returns.

The privacy unit (``config.privacy_unit``, docs/design.md §3.2) is a record or a person. At the
person level the trainer needs each row's person (``units``, or the dataset's ``users``), the
sampler draws PEOPLE at ``q = b_u / N_users`` with a random chunk of at most
``config.max_records_per_user`` records each (``prism_runtime.data.units``), a micro-batch holds
at most ``micro_batch_size`` rows whoever was sampled (a person with more spans several),
and the DP methods sum a person's per-record gradients into one contribution before the clip,
across micro-batches where the person spans several (``prism_runtime.trainer.dp.UnitFold``).

Randomness: by default (``seed=None``) the Poisson sampler and dropout draw from generators
seeded by the OS (``os.urandom``, fresh at every ``reseed``) and the noise from the OS CSPRNG
(``prism_core.rng.SecureRNG``). An integer ``seed`` makes all three reproducible: for tests and
benchmarks only, since anyone who knows the seed can predict the noise and the batches.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from tqdm import tqdm

from prism_core.accounting import PrivacyEvent
from prism_core.errors import BudgetExceededError
from prism_core.rng import NoiseSource, SecureRNG
from prism_runtime import per_example
from prism_runtime.data import IGNORE_INDEX, make_collate, micro_batches, poisson_loader
from prism_runtime.data.units import (
    OPEN_KEY,
    UNIT_KEY,
    person_records,
    unit_micro_batches,
    user_poisson_loader,
)
from prism_runtime.errors import ConfigError
from prism_runtime.memory import MicroBatchChoice, auto_micro_batch
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import RNG_REPRODUCIBLE, RNG_SECURE
from prism_runtime.train_config import PrivacyUnit, TrainConfig

__all__ = [
    "TRAINERS",
    "PrivateTrainer",
    "RunStep",
    "StepResult",
    "make_trainer",
    "noise_records",
    "os_seed",
    "per_example_loss",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH_GUESS = 512
"""The row length the automatic micro-batch assumes for a dataset that does not state one."""


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


RunStep = Callable[[dict[str, Tensor]], tuple[float, PrivacyEvent | None]]
"""What a step runs on its batch: the mean per-sequence loss (private) and the mechanism's
record of the release (``PrivateTrainer._run_step``)."""


def noise_records(results: Sequence[StepResult]) -> list[PrivacyEvent]:
    """The mechanism records of ``results`` (steps without one, i.e. ``nondp``, are skipped)."""
    return [r.record for r in results if r.record is not None]


def os_seed() -> int:
    """A fresh 63-bit seed from the OS CSPRNG (for the sampler and dropout generators)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def per_example_loss(model: nn.Module, batch: dict[str, Tensor], task: str) -> Tensor:
    """Per-SEQUENCE loss (b,): no token averaging across examples (privacy rule 3).

    seq-cls: cross-entropy of each example. causal-lm: mean token cross-entropy over that
    sequence's supervised tokens (labels != -100), 0 for a sequence with none. A person-level
    batch's ``unit`` and ``unit_open`` (``prism_runtime.data.units.UNIT_KEY``, ``OPEN_KEY``)
    are not model inputs.
    """
    inputs = {k: v for k, v in batch.items() if k not in ("labels", UNIT_KEY, OPEN_KEY)}
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


TRAINERS: dict[str, type[PrivateTrainer]] = {}
"""The trainer class of each ``TrainConfig.method`` (each subclass enters its ``methods``)."""


class PrivateTrainer:
    """Runs local steps of one training method on one site's dataset, with a persistent privacy
    history.

    ``PrivateTrainer(...)``, like ``make_trainer``, returns an instance of the method's subclass
    (``TRAINERS[config.method]``: ``PrismTrainer``, ``FactorTrainer`` or ``NonDPTrainer``); a
    subclass built directly runs only its own ``methods``. The methods that raise
    ``NotImplementedError`` here are what each subclass defines.

    Args:
        loaded: the model from ``prism_runtime.model.load_model`` (same ``method``).
        dataset: the site's tokenized training set (``prism_runtime.data.TokenizedDataset``).
        config: training settings.
        history: privacy events this site already spent (e.g. earlier federated rounds).
        units: ``config.privacy_unit='user'`` only: the person of each row of ``dataset`` (one
            hashable id per row); None reads the dataset's ``users`` (``TokenizedDataset``
            built from rows with a ``user`` field). Ignored at the record level.

    Raises:
        ConfigError: the method is not the class's, the batch is larger than the dataset (or
            the number of people), or a person-level trainer has no person for its rows.
    """

    methods: ClassVar[frozenset[str]] = frozenset()
    """The ``TrainConfig.method`` values this class runs."""
    is_private: ClassVar[bool]
    """Whether a step is a DP release (a ``PrivacyEvent`` in the history)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for method in cls.__dict__.get("methods", ()):
            TRAINERS[method] = cls

    def __new__(
        cls,
        loaded: LoadedModel,
        dataset: Dataset[dict[str, object]],
        config: TrainConfig,
        *,
        history: Sequence[PrivacyEvent] = (),
        units: Sequence[Hashable] | None = None,
    ) -> PrivateTrainer:
        if cls is PrivateTrainer:
            cls = TRAINERS[config.method]
        return super().__new__(cls)

    def __init__(
        self,
        loaded: LoadedModel,
        dataset: Dataset[dict[str, object]],
        config: TrainConfig,
        *,
        history: Sequence[PrivacyEvent] = (),
        units: Sequence[Hashable] | None = None,
    ) -> None:
        if config.method not in self.methods:
            raise ConfigError(
                f"{type(self).__name__} runs {sorted(self.methods)}, not method="
                f"{config.method!r}: build the trainer with prism_runtime.trainer.make_trainer"
            )
        self.loaded, self.config = loaded, config
        self.task = loaded.config.task
        self.num_examples = len(dataset)  # type: ignore[arg-type]
        self._records = self._person_records(dataset, units)
        self.num_units = self.num_examples if self._records is None else len(self._records)
        """N, the number of privacy units: records, or people at the person level."""
        fixed = config.sample_rate is None  # else q is given: any N has its batch q N
        if fixed and self._records is None and config.batch_size > self.num_examples:
            raise ConfigError(
                f"batch_size={config.batch_size} is larger than the dataset ({self.num_examples} "
                "examples): lower batch_size or add data"
            )
        if fixed and self._records is not None and config.batch_size > self.num_units:
            raise ConfigError(
                f"batch_size={config.batch_size} (the expected people per batch) is larger than "
                f"the number of people ({self.num_units}): lower batch_size or add people"
            )
        self._dataset = dataset
        self.reseed(config.seed)
        self.expected_batch_size = self.sample_rate * self.num_units
        self.history: list[PrivacyEvent] = list(history)
        self.noise_multiplier = self._noise_multiplier()
        self.steps_done = 0
        self.micro_batch_choice: MicroBatchChoice | None = None
        """How the micro-batch was chosen when ``config.micro_batch_size`` is 0 (auto)."""
        self.micro_batch_size = self._micro_batch_size(dataset)
        """The examples per forward/backward: ``config.micro_batch_size``, or chosen from the
        memory available when it is 0 (auto)."""
        loaded.model.train()
        self.module: nn.Module = self._train_module(loaded.model)

    def _micro_batch_size(self, dataset: Dataset[dict[str, object]]) -> int:
        if self.config.micro_batch_size:
            return self.config.micro_batch_size
        max_length = int(getattr(dataset, "max_length", None) or DEFAULT_MAX_LENGTH_GUESS)
        self.micro_batch_choice = auto_micro_batch(self.loaded, max_length)
        log.info("%s", self.micro_batch_choice.describe())
        return self.micro_batch_choice.size

    @property
    def privacy_unit(self) -> PrivacyUnit:
        """The unit of this trainer's guarantee: ``record`` or ``user`` (``config.privacy_unit``);
        its ``sample_rate`` and ``expected_batch_size`` are over these units."""
        return self.config.privacy_unit

    def _person_records(
        self, dataset: Dataset[dict[str, object]], units: Sequence[Hashable] | None
    ) -> list[list[int]] | None:
        """The row indices of each person at the person level (None at the record level)."""
        if self.config.privacy_unit == "record":
            return None
        if units is None:
            units = getattr(dataset, "users", None)
        if units is None:
            raise ConfigError(
                "privacy_unit='user' needs the person of every row: pass units=[...] (one id per "
                "row) or a dataset whose rows carry a 'user' field"
            )
        if len(units) != self.num_examples:
            raise ConfigError(
                f"units has {len(units)} person ids for {self.num_examples} rows: give one per row"
            )
        records = person_records(units)
        most = max(len(rows) for rows in records)
        log.debug(  # private facts of the shard: the site's own log only
            "person-level privacy: %d people, at most %d records each, %d per batch "
            "(max_records_per_user)",
            len(records),
            most,
            min(most, self.config.max_records_per_user),
        )
        return records

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
        collate = make_collate(self.loaded.tokenizer, self.task)
        generator = torch.Generator().manual_seed(sampling)
        if self._records is None:
            self._loader, self.sample_rate = poisson_loader(
                self._dataset,
                expected_batch_size=self.config.batch_size,
                collate_fn=collate,
                generator=generator,
                sample_rate=self.config.sample_rate,
            )
        else:
            self._loader, self.sample_rate = user_poisson_loader(
                self._dataset,
                self._records,
                expected_users=self.config.batch_size,
                max_records=self.config.max_records_per_user,
                collate_fn=collate,
                generator=generator,
                sample_rate=self.config.sample_rate,
            )
        self._batches = self._forever()

    # -- what each method defines -----------------------------------------------------------

    def _train_module(self, model: nn.Module) -> nn.Module:
        """The module forward/backward runs through (the model itself: summed gradients; a
        per-example forward a DP trainer attached to the same model is taken off)."""
        per_example.detach(per_example.attached(model))
        return model

    def _noise_multiplier(self) -> float:
        """The noise multiplier sigma of every step (called once, at construction)."""
        raise NotImplementedError

    def epsilon(self) -> float:
        """Epsilon spent so far at ``config.delta``."""
        raise NotImplementedError

    def steps_allowed(self) -> int:
        """How many more steps fit under ``config.epsilon`` (the planned steps if no cap)."""
        raise NotImplementedError

    def _run_step(self, batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent | None]:
        """Train on ``batch`` (already on the device, under autocast).

        Returns the mean per-sequence loss (private) and the mechanism's record of the release
        (None when nothing is released under DP).
        """
        raise NotImplementedError

    def count_within(self, max_norm: float, *, lora_only: bool) -> tuple[int, int]:
        """On the next Poisson batch: ``(examples, examples whose clipped norm is <= max_norm)``,
        as this method's clip sees them; no parameter moves. Both counts are PRIVATE: only a
        noisy count may leave the caller (``prism_core.quantile.noisy_fraction_below``)."""
        raise NotImplementedError

    # -- privacy ---------------------------------------------------------------------------

    def _check_budget(self) -> None:
        if self.config.epsilon is not None and self.steps_allowed() <= 0:
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
        self.config = self.config.model_copy(update={"steps": steps})

    def set_max_norm(self, max_norm: float) -> None:
        """Use the clip C = ``max_norm`` from now on (a private estimate, ``client.clip_quantile``).

        Raises:
            pydantic.ValidationError: C not > 0, or not above the head's share of the clip.
        """
        self.config = TrainConfig.model_validate({**self.config.model_dump(), "max_norm": max_norm})

    # -- batches and forward ---------------------------------------------------------------

    def _forever(self) -> Iterator[dict[str, Tensor]]:
        while True:
            yield from self._loader

    def _next_batch(self) -> dict[str, Tensor]:
        """The next Poisson batch, on the model's device."""
        return {k: v.to(self.loaded.device) for k, v in next(self._batches).items()}

    def _micro_batches(self, batch: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
        """``batch`` in micro-batches of at most ``micro_batch_size`` rows, grouped by
        length; at the person level of whole people, each with its ``unit``, a person with more
        rows in consecutive micro-batches of their own (``unit_micro_batches``)."""
        if self.privacy_unit == "record":
            return micro_batches(batch, self.micro_batch_size, by_length=True)
        return unit_micro_batches(batch, self.micro_batch_size, by_length=True)

    def _losses(self, micro: dict[str, Tensor]) -> Tensor:
        """The per-sequence losses of ``micro`` through ``self.module``."""
        return per_example_loss(self.module, micro, self.task)

    def _autocast(self) -> torch.autocast:
        enabled = self.loaded.device.type == "cuda"
        return torch.autocast(self.loaded.device.type, dtype=torch.bfloat16, enabled=enabled)

    # -- steps -----------------------------------------------------------------------------

    def step(self, run: RunStep | None = None) -> StepResult:
        """Run one logical step (refused with ``BudgetExceededError`` past the cap); ``run``
        replaces ``_run_step`` on the step's batch (``PrismTrainer.private_gradient`` releases
        without applying), with the same budget check, record and count."""
        self._check_budget()
        batch = self._next_batch()
        with self._autocast():
            loss, record = (self._run_step if run is None else run)(batch)
        if record is not None:  # the history is what the mechanism says it ran, in its unit
            record = replace(record, unit=self.privacy_unit)
            self.history.append(record)
        self.steps_done += 1
        return StepResult(self.steps_done, loss, int(batch["labels"].shape[0]), record)

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


def make_trainer(
    loaded: LoadedModel,
    dataset: Dataset[dict[str, object]],
    config: TrainConfig,
    *,
    history: Sequence[PrivacyEvent] = (),
    units: Sequence[Hashable] | None = None,
) -> PrivateTrainer:
    """The trainer of ``config.method`` (``TRAINERS``) on ``dataset``; arguments as
    ``PrivateTrainer``."""
    return TRAINERS[config.method](loaded, dataset, config, history=history, units=units)
