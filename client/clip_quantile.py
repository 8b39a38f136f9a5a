"""A site's private clip norm (``max-norm = auto``): estimated once per run, charged, stored.

Before its first training step in a run, a site runs K steps of the DP quantile estimate of
Andrew et al. (2021) (``prism_core.quantile``) at the broadcast point: each step draws a fresh
Poisson batch with the training sampler (rate q), computes the per-example norms of exactly what
the clip sees (``PrivateTrainer.count_within``: the lift's intrinsic norm, joined by the DP
head's gradient in a joint clip; the LoRA part alone in a split clip, whose total is then
``sqrt(C_lora^2 + C_head^2)``), releases the count below C with Gaussian noise (sensitivity 1)
and moves C geometrically. No parameter moves.

Accounting: the K steps are ONE event ``PrivacyEvent(sigma_b, q, K)`` (mechanism
``QUANTILE_MECHANISM``, ``sigma_b = clip-quantile-noise * b``), charged to the site's durable
ledger BEFORE they run, composed with the training steps in the same history; the training
sigma is calibrated for the quantile event plus the planned training steps
(``calibrate_noise_multiplier(history=...)``).

Durability (``ClipStore``): the estimate is stored atomically in the state folder with the
coordinator's run id, so a restarted site of the same run (and every round of a deployed site,
whose ClientApp is a fresh process per message) reuses it and spends nothing again; a new run
estimates again. The estimate is DP output: reusing it is post-processing.

In a round (``AutoClip``): ``pending`` says whether this run's clip is still to be estimated
(before the cap check, which covers the estimate too, so it is never spent on a round that cannot
run); ``resolve`` then charges the estimate's event (fsync'ed), runs the K steps at the broadcast
point, checks their records against the charge, stores the estimate atomically and gives the
trainer the clip, all before the round's training charge. A crash before the store makes a
restarted site estimate (and charge) again: counted twice, never zero.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from client.charge import charge, check_charged
from client.reply import released_event
from client.request import RoundRequest
from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.quantile import (
    QUANTILE_MECHANISM,
    clip_range,
    count_noise_multiplier,
    geometric_clip_update,
    noisy_fraction_below,
)
from prism_core.records import DEFAULT_UNIT, PrivacyEvent
from prism_runtime.config import RunConfig
from prism_runtime.durable import atomic_write
from prism_runtime.errors import AccountingMismatchError, ConfigError
from prism_runtime.exchange import load_arrays
from prism_runtime.model import LoadedModel
from prism_runtime.trainer import PrivateTrainer

__all__ = ["AutoClip", "ClipEstimate", "ClipPlan", "ClipStore", "StoredClip", "estimate_clip"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClipPlan:
    """The quantile estimate a run asks of this site (public: run config, b and q).

    Attributes:
        initial: the public start C_0 of the estimated clip (LoRA, or LoRA and head jointly).
        target_quantile: gamma.
        lr: eta of the geometric update.
        steps: K.
        noise_multiplier: sigma_b, the count's noise std (its sensitivity is 1).
        sample_rate: q of the site's Poisson sampler.
        head_clip: the head's fixed share of a split clip (the estimate is then of the LoRA
            part alone), or None.
    """

    initial: float
    target_quantile: float
    lr: float
    steps: int
    noise_multiplier: float
    sample_rate: float
    head_clip: float | None
    unit: str = DEFAULT_UNIT  # the privacy unit counted: records, or people (their one clip)

    @classmethod
    def from_run(
        cls,
        run: RunConfig,
        *,
        expected_batch_size: float,
        sample_rate: float,
        trains_head: bool,
        unit: str = DEFAULT_UNIT,
    ) -> ClipPlan:
        """The plan of ``run``'s clip-quantile keys at this site's b and q, counting ``unit``s."""
        return cls(
            initial=run.clip_init,
            target_quantile=run.clip_quantile,
            lr=run.clip_lr,
            steps=run.clip_quantile_steps,
            noise_multiplier=count_noise_multiplier(run.clip_quantile_noise, expected_batch_size),
            sample_rate=sample_rate,
            head_clip=run.split_head_clip if trains_head else None,
            unit=unit,
        )

    def event(self) -> PrivacyEvent:
        """The privacy event of the K quantile steps (charged before they run)."""
        return PrivacyEvent(
            self.noise_multiplier,
            self.sample_rate,
            self.steps,
            mechanism=QUANTILE_MECHANISM,
            unit=self.unit,
        )

    def total(self, estimate: float) -> float:
        """The total clip C of an estimate: ``sqrt(C_lora^2 + C_head^2)`` in a split clip."""
        return math.hypot(estimate, self.head_clip) if self.head_clip is not None else estimate

    def range(self) -> tuple[float, float]:
        """Every estimate K steps can reach (``prism_core.quantile.clip_range``)."""
        return clip_range(
            self.initial, target_quantile=self.target_quantile, lr=self.lr, steps=self.steps
        )


@dataclass(frozen=True)
class ClipEstimate:
    """A finished estimate: the estimated clip, the total C and the mechanism's records."""

    estimate: float
    max_norm: float
    records: tuple[PrivacyEvent, ...]


def estimate_clip(trainer: PrivateTrainer, plan: ClipPlan) -> ClipEstimate:
    """Run the K noisy quantile steps of ``plan`` on ``trainer``'s sampler, data and noise.

    Implements Algorithm 1 of Andrew et al. (2021) (``prism_core.quantile``) with the trainer's
    per-example norms; the divisor is the trainer's EXPECTED batch size. The caller charges
    ``plan.event()`` before and checks the returned records against it after.
    """
    clip = plan.initial
    records = []
    for _ in range(plan.steps):
        _, below = trainer.count_within(clip, lora_only=plan.head_clip is not None)
        fraction, record = noisy_fraction_below(
            below,
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=trainer.expected_batch_size,
            sample_rate=trainer.sample_rate,
            generator=trainer.noise,
        )
        records.append(replace(record, unit=plan.unit))  # a count of the plan's units
        clip = geometric_clip_update(
            clip, fraction, target_quantile=plan.target_quantile, lr=plan.lr
        )
    return ClipEstimate(clip, plan.total(clip), tuple(records))


@dataclass(frozen=True)
class StoredClip:
    """What ``ClipStore`` keeps: the run, the round it was estimated in, the estimate, the plan."""

    run_id: str
    server_round: int
    estimate: float
    max_norm: float
    plan: ClipPlan


class ClipStore:
    """``<state_dir>/clip-norm.json``: the site's private clip estimate of its current run."""

    FILE = "clip-norm.json"

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / self.FILE

    def _damaged(self, problem: str) -> ConfigError:
        return ConfigError(
            f"{self.path}: {problem}. It holds this site's private clip estimate of its current "
            "run. Restore it from a backup, or move it away: the site then estimates the clip "
            "again, charging that to its privacy ledger."
        )

    def load(self) -> StoredClip | None:
        """The stored estimate, None if there is none.

        Raises:
            ConfigError: an unreadable or invalid file (left as it is).
        """
        if not self.path.exists():
            return None
        try:
            obj: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
            stored = StoredClip(
                run_id=str(obj["run-id"]),
                server_round=int(obj["round"]),
                estimate=float(obj["estimate"]),
                max_norm=float(obj["max-norm"]),
                plan=ClipPlan(**obj["plan"]),
            )
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise self._damaged(f"unreadable ({exc!r})") from exc
        low, high = stored.plan.range()
        ok = low * (1 - 1e-9) <= stored.estimate <= high * (1 + 1e-9)
        if not (ok and math.isclose(stored.max_norm, stored.plan.total(stored.estimate))):
            raise self._damaged(
                f"estimate {stored.estimate!r} (total {stored.max_norm!r}) is not one the plan "
                f"can produce (range [{low:.6g}, {high:.6g}])"
            )
        return stored

    def save(self, stored: StoredClip) -> None:
        """Store ``stored`` atomically (``prism_runtime.durable.atomic_write``)."""
        obj = {
            "run-id": stored.run_id,
            "round": stored.server_round,
            "estimate": stored.estimate,
            "max-norm": stored.max_norm,
            "plan": asdict(stored.plan),
        }
        text = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

        def write(f: BinaryIO) -> None:
            f.write(text)

        atomic_write(self.path, write)


class AutoClip:
    """The round stage that resolves ``max-norm = auto``: this run's clip C is reused (held by
    this process, or stored for this run id) or estimated privately, all before the round's
    training charge.

    Args:
        plan: the run's estimate at this site; None when the run fixes C (nothing to resolve).
        store: the site's ``ClipStore``.
        trainer: the site's trainer; it gets the clip.
        site_id: this site, for its log and errors.
    """

    def __init__(
        self, plan: ClipPlan | None, store: ClipStore, trainer: PrivateTrainer, *, site_id: str
    ) -> None:
        self.plan, self.store, self.trainer, self.site_id = plan, store, trainer, site_id
        self.run_id: str | None = None  # the run whose clip the trainer holds

    def pending(self, run_id: str) -> ClipPlan | None:
        """The estimate this round must run first, or None: no auto clip, or this run's
        estimate is known.

        Known: held by this process, or stored in the state folder for this run id (a
        restarted site, or a deployed site's fresh ClientApp process): reused, nothing spent.
        Without a run id a stored estimate is never reused (the run cannot be told apart).

        Raises:
            ConfigError: the stored estimate is damaged (``ClipStore.load``).
        """
        if self.plan is None or self.run_id == run_id:
            return None
        stored = self.store.load()
        if stored is not None and run_id and stored.run_id == run_id:
            if stored.plan == self.plan:
                log.info(
                    "site %s: reusing the clip C=%.6g estimated in round %d of run %s",
                    self.site_id,
                    stored.max_norm,
                    stored.server_round,
                    run_id,
                )
                self._use(run_id, stored.max_norm)
                return None
            log.warning(
                "site %s: the stored clip estimate of run %s was made with another plan (%s); "
                "estimating again",
                self.site_id,
                run_id,
                stored.plan,
            )
        return self.plan

    def resolve(
        self,
        pending: ClipPlan | None,
        request: RoundRequest,
        ledger: SiteLedger,
        *,
        delta: float,
        loaded: LoadedModel,
        round_seed: Callable[[int, int], int | None],
    ) -> PrivacyEvent | None:
        """Run the ``pending`` estimate, if any; on return the trainer holds this run's clip.

        Order (crash-safe): the estimate's event is fsync'ed to the ledger, then the K steps
        run at the broadcast point, seeded by ``round_seed(round, position of the charge in
        the ledger)``, their records are checked against the charge, and the estimate is
        stored atomically.

        Args:
            pending: ``pending(request.run_id)``, once the cap check has passed.
            request: the round's checked request.
            ledger: the site's ledger.
            delta: the delta the run spends at.
            loaded: the site's model (the broadcast is written into it).
            round_seed: ``client.policy.SitePolicy.round_seed``.

        Returns:
            The estimate's released event (the reply states it), None if none ran.

        Raises:
            AccountingMismatchError: the estimate's records differ from its charge, or an
                auto-clip run's clip is still not resolved.
        """
        event = None
        if pending is not None:
            event = self._estimate(pending, request, ledger, delta, loaded, round_seed)
        if self.plan is not None and self.run_id != request.run_id:
            raise AccountingMismatchError("max-norm = auto, but the clip was not resolved")
        return event

    def _estimate(
        self,
        plan: ClipPlan,
        request: RoundRequest,
        ledger: SiteLedger,
        delta: float,
        loaded: LoadedModel,
        round_seed: Callable[[int, int], int | None],
    ) -> PrivacyEvent:
        entry = SiteLedgerEntry(request.server_round, plan.event(), delta)
        charged = charge(ledger, entry)
        load_arrays(loaded, request.arrays)
        self.trainer.reseed(round_seed(request.server_round, charged.attempt))
        estimate = estimate_clip(self.trainer, plan)
        event = released_event(estimate.records, QUANTILE_MECHANISM)
        check_charged(event, entry, what="the clip estimate", site_id=self.site_id)
        server_round, run_id = request.server_round, request.run_id
        self.store.save(
            StoredClip(run_id, server_round, estimate.estimate, estimate.max_norm, plan)
        )
        self._use(run_id, estimate.max_norm)
        log.info(
            "site %s: private clip C=%.6g (quantile %.2f, %d steps, sigma_b=%.4g, q=%.4g)",
            self.site_id,
            estimate.max_norm,
            plan.target_quantile,
            plan.steps,
            plan.noise_multiplier,
            plan.sample_rate,
        )
        return event

    def _use(self, run_id: str, max_norm: float) -> None:
        self.trainer.set_max_norm(max_norm)
        self.run_id = run_id
