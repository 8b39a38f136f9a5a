"""One federated site: its data, model, durable privacy ledger and the work of one round.

A round (DESIGN.md §3), in this order, so a refusal never costs anything:

1. the site's POLICY (``client.policy``; decided once per run config): a run asking for more
   epsilon or delta than the site allows, a delta not below 1/N, a non-private method or
   non-private metrics the site does not allow, is refused with its code;
2. the BROADCAST (``client.broadcast``): keys, shapes, finiteness and (PRISM) full rank r;
3. the site's own CAP: the round's planned steps must fit under the budget on its own ledger;
4. the CHARGE: the planned event is fsync'ed to the site ledger BEFORE training; with
   ``max-norm = auto``, in the site's first round of a run, first the private clip estimate
   (``client.clip_quantile``): its own event is charged, the K quantile steps run at the
   broadcast point, the estimate is stored, and only then is the training event charged (the
   cap check before covers both, so the estimate is never spent on a round that cannot run);
5. ``tau`` private steps; the mechanism's ``PrivacyEvent``s must agree with the charge
   (``AccountingMismatchError`` otherwise), and the reply's facts are built from them;
6. the reply: the tangent update at the broadcast point
   (``prism_core.manifold.tangent_displacement``) plus accounting facts. Nothing computed from
   un-noised data is sent unless the run asks and the site allows it (labelled non-private).

Crashes and re-asked rounds: every released reply is stored atomically in the state folder
(``last-round.pt``, with the optimizer state it leaves behind); when a restarted coordinator
asks again for a round the site already answered (same coordinator run id, same round, same
broadcast point by SHA-256), the site resends that stored reply instead of training again: it
is already DP output, so resending is post-processing and spends nothing. A round that must be
re-run (the site died before storing its reply) is charged again and draws fresh randomness.

Randomness: sampling, dropout and noise come from the OS at the site by default; in the
site's reproducible mode (``client.policy``) from a secret only the site holds.

Above ~400 lines on purpose: a round's privacy obligations in their order (policy, broadcast
check, cap, the charge BEFORE training, the stored reply BEFORE sending, a resend without a new
charge) are one class, read and tested top to bottom; the rows are in ``client.site_data`` and
the reply's facts in ``client.reply``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opacus
import torch
from torch import Tensor

from client.broadcast import BroadcastLimits, broadcast_limits, broadcast_problem
from client.clip_quantile import ClipEstimate, ClipPlan, ClipStore, StoredClip, estimate_clip
from client.policy import SitePolicy
from client.reply import RoundReply, broadcast_digest, noise_scale_facts, released_event
from client.site_data import check_text_pairs, site_examples
from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.accounting import (
    PrivacyEvent,
    calibrate_noise_multiplier,
    epsilon,
)
from prism_core.adaptive import AdaptiveState, realign_state
from prism_core.manifold import Point, tangent_displacement
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import ADJACENCY
from prism_runtime.cache import cached_float
from prism_runtime.config import RunConfig, SiteConfig, site_method
from prism_runtime.data import TokenizedDataset
from prism_runtime.durable import atomic_write, locked
from prism_runtime.errors import AccountingMismatchError, ConfigError
from prism_runtime.exchange import head_named, load_arrays
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel, load_model, model_config_for
from prism_runtime.protocol import HEAD_PREFIX, REFUSAL_REASONS, STATUS_OK, STATUS_REFUSED, key
from prism_runtime.ranges import SERVER_ROUND_MAX
from prism_runtime.trainer import (
    MECHANISMS,
    PrivateTrainer,
    StepResult,
    noise_records,
    site_train_config,
)

__all__ = [
    "Site",
    "get_site",
]

log = logging.getLogger(__name__)


@functools.cache
def _accountant_identity() -> str:
    """What a calibrated sigma depends on besides its inputs: Opacus and our accounting code."""
    source = Path(inspect.getfile(calibrate_noise_multiplier)).read_bytes()
    return f"opacus {opacus.__version__} | {hashlib.sha256(source).hexdigest()}"


class Site:
    """A site's long-lived state within one process (policy, data, model, trainer, ledger).

    Args:
        run: the run config (the coordinator's REQUEST).
        site: the node config (the site's own settings).
        policy: ``client.policy.site_policy(site, ...)``.
        faults: crash points for tests (``site-training``: charged, training not finished);
            production passes none.

    Raises:
        ConfigError: the data or settings cannot be used.
        DataError: the site's data cannot be read.
    """

    def __init__(
        self,
        run: RunConfig,
        site: SiteConfig,
        policy: SitePolicy,
        *,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.run, self.site, self.policy, self.site_id = run, site, policy, policy.site_id
        self.faults = faults
        self.state_dir = policy.state_dir
        self.method = site_method(run.method)
        rows = site_examples(run, site)
        check_text_pairs(run, rows)
        self.num_examples = len(rows)
        self.ledger = SiteLedger(self.state_dir)
        self.sample_rate = run.batch_size / self.num_examples
        self.refusal = policy.refusal(run, self.num_examples)
        # What this site spends for this run: the request, which the policy check has bounded
        # by the site's own cap and delta (a refused run reports the site's own values).
        asked = self.refusal is None
        self.epsilon_cap = run.target_epsilon if asked else policy.epsilon_cap
        self.delta = run.delta if asked else policy.delta
        self.sigma = 0.0
        self.clip_plan: ClipPlan | None = None  # max-norm = auto: the private clip estimate
        self.clip_store = ClipStore(self.state_dir)
        self._clip_run: str | None = None  # the run whose clip the trainer holds
        if self.refusal is not None:
            log.warning(
                "site %s refuses this run (%s): %s",
                self.site_id,
                self.refusal,
                REFUSAL_REASONS[self.refusal],
            )
            return
        # Start-up work is cached in the site's own cache folder (prism_runtime.cache; never chosen
        # by the coordinator): a deployed site starts a fresh process for every message.
        cache = policy.cache_dir
        self.loaded: LoadedModel = load_model(
            model_config_for(run), method=self.method, cache_dir=cache
        )
        self.limits: BroadcastLimits = broadcast_limits(self.loaded)  # before any broadcast
        dataset = TokenizedDataset(
            rows,
            self.loaded.tokenizer,
            run.task,
            max_length=run.max_length,
            pair_encoding=self.loaded.pair_encoding,
            cache_dir=cache,
        )
        if run.auto_clip and self.method != "nondp":
            self.clip_plan = ClipPlan.from_run(
                run,
                expected_batch_size=self.sample_rate * self.num_examples,
                sample_rate=self.sample_rate,
                trains_head=bool(self.loaded.head_params),
            )
        self.sigma = self._sigma()
        train = site_train_config(
            run,
            method=self.method,
            max_norm=self._initial_clip(),
            epsilon=self.epsilon_cap,
            delta=self.delta,
            noise_multiplier=self.sigma,
        )
        self.trainer = PrivateTrainer(self.loaded, dataset, train, history=self.ledger.events())
        self.sample_rate = self.trainer.sample_rate

    def _sigma(self) -> float:
        if self.method == "nondp":
            return 0.0
        if self.run.noise_multiplier >= 0:
            return self.run.noise_multiplier
        # No amplification from the server's choice of sites: assume this site runs every round.
        # A private clip estimate runs first: the steps get the budget it leaves.
        settings: dict[str, Any] = {
            "target_epsilon": self.epsilon_cap,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "steps": self.run.planned_site_steps,
            "history": [self.clip_plan.event()] if self.clip_plan is not None else [],
        }
        return cached_float(
            self.policy.cache_dir,
            {"what": "calibrated sigma", **settings, "accountant": _accountant_identity()},
            lambda: calibrate_noise_multiplier(**settings),
        )

    def _initial_clip(self) -> float:
        """The run's clip C, or (auto) the plan's start until the estimate replaces it."""
        if isinstance(self.run.max_norm, float):
            return self.run.max_norm
        return self.run.total_clip(self.run.clip_init)

    @property
    def mechanism(self) -> str:
        """The ``PrivacyEvent.mechanism`` this site's method runs."""
        return MECHANISMS[self.method]

    # -- global state in and out -----------------------------------------------------------

    def _round_path(self) -> Path:
        return self.state_dir / "last-round.pt"

    def _last_round(self) -> dict[str, Any] | None:
        path = self._round_path()
        if not path.exists():
            return None
        try:
            saved: dict[str, Any] = torch.load(path, weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"{path}: unreadable site round state ({exc}); it holds the last released reply "
                "and optimizer state. Restore it from backup, or move it away to start the "
                "optimizer state afresh (the privacy ledger is separate and kept)."
            ) from exc
        return saved

    def _restore_adaptive(self, start: list[Point]) -> None:
        saved = self._last_round()
        legacy = self.state_dir / "adaptive-state.pt"  # written by earlier releases
        if saved is None and legacy.exists():
            saved = {"adaptive": torch.load(legacy, weights_only=True)}
        if self.method != "prism" or saved is None or saved.get("adaptive") is None:
            return
        adaptive = saved["adaptive"]
        states = [AdaptiveState(**s) for s in adaptive["states"]]
        ends = [Point(*p) for p in adaptive["points"]]
        self.trainer.states = [
            realign_state(s, e, p) for s, e, p in zip(states, ends, start, strict=True)
        ]

    def _store_round(
        self, run_id: str, server_round: int, digest: str, reply: RoundReply, end: list[Point]
    ) -> None:
        """Store the released reply and the optimizer state it leaves, in one atomic write."""
        adaptive = None
        if self.method == "prism":
            adaptive = {
                "states": [vars(s) for s in self.trainer.states],
                "points": [(p.A, p.B) for p in end],
            }
        payload = {
            "run-id": run_id,
            "round": server_round,
            "broadcast": digest,
            "arrays": reply.arrays,
            "accounting": reply.accounting,
            "nonprivate": reply.nonprivate,
            "adaptive": adaptive,
        }
        atomic_write(self._round_path(), lambda f: torch.save(payload, f))

    def _stored_reply(self, run_id: str, server_round: int, digest: str) -> RoundReply | None:
        saved = self._last_round()
        if not run_id or saved is None:
            return None
        if (saved["run-id"], saved["round"], saved["broadcast"]) != (run_id, server_round, digest):
            return None
        return RoundReply(dict(saved["arrays"]), dict(saved["accounting"]), saved["nonprivate"])

    # -- facts -----------------------------------------------------------------------------

    def _facts(self, server_round: int, status: str, reason: str = "") -> dict[str, Any]:
        """Facts every reply carries: who, what happened, the budget, where randomness came from."""
        spent = self.ledger.epsilon(self.delta)
        facts: dict[str, Any] = {
            "site-id": self.site_id,
            "status": status,
            "reason": reason,
            "server-round": server_round,
            "delta": float(self.delta),
            "epsilon-cap": float(self.epsilon_cap),
            "epsilon": float(spent),
            "rng": self.policy.rng,
        }
        if self.site.share_num_examples:
            facts["num-examples"] = self.num_examples
        return facts

    def _refused(self, server_round: int, reason: str) -> RoundReply:
        """A refusal with its code: nothing was charged, nothing is sent."""
        log.warning(
            "site %s refuses round %d (%s): %s",
            self.site_id,
            server_round,
            reason,
            REFUSAL_REASONS[reason],
        )
        self.ledger.reload()  # the facts report the site's current spend
        facts = self._facts(server_round, STATUS_REFUSED, reason)
        facts.update(
            {
                "mechanism": self.mechanism,
                "adjacency": ADJACENCY,
                "sampling": "poisson",
                "sigma": float(self.sigma),
                "q": float(min(self.sample_rate, 1.0)),
                "steps": 0,
            }
        )
        return RoundReply({}, facts)

    def _check_charged(
        self, server_round: int, what: str, event: PrivacyEvent, charged: SiteLedgerEntry
    ) -> None:
        """What ran (from the mechanism's records) must be what was charged before it ran.

        Raises:
            AccountingMismatchError: the mechanism, sigma, q, the step count, the sampling or
                the adjacency differ (the charge stays).
        """
        if event.accounted() != charged.event.accounted():
            raise AccountingMismatchError(
                f"site {self.site_id} round {server_round}: {what} ran {event} but the site "
                f"charged {charged.event}"
            )

    def _released_facts(
        self,
        server_round: int,
        results: Sequence[StepResult],
        planned: SiteLedgerEntry,
        quantile: PrivacyEvent | None = None,
    ) -> dict[str, Any]:
        """Facts of a trained round, from the mechanism's records, checked against the charge.

        ``quantile``: the event of a private clip estimate charged this round (its own facts).
        """
        facts = self._facts(server_round, STATUS_OK)
        records = noise_records(results)
        if self.method == "nondp":  # no mechanism ran: nothing protects the data
            if records:
                raise AccountingMismatchError("a non-private round returned noise records")
            event = PrivacyEvent(0.0, self.sample_rate, len(results), mechanism=self.mechanism)
        else:
            event = released_event(records, self.mechanism)
        self._check_charged(server_round, "the mechanism", event, planned)
        facts.update(
            {
                "mechanism": self.mechanism,
                "adjacency": event.adjacency,
                "sampling": event.sampling,
                "sigma": float(event.noise_multiplier),
                "q": float(event.sample_rate),
                "steps": int(event.steps),
            }
        )
        facts.update(noise_scale_facts(records))
        if quantile is not None:
            facts.update(
                {
                    "quantile-sigma": float(quantile.noise_multiplier),
                    "quantile-q": float(quantile.sample_rate),
                    "quantile-steps": int(quantile.steps),
                }
            )
        return facts

    # -- one round -------------------------------------------------------------------------

    def train_round(
        self, server_round: object, arrays: dict[str, Tensor], *, run_id: str = ""
    ) -> RoundReply:
        """Answer one round from the broadcast ``arrays``: refuse, resend, or train.

        ``server_round`` is the message's value as received: a round number that is not an
        integer in ``[1, SERVER_ROUND_MAX]`` is refused (``bad-round``, reported as round 0).
        With a ``run_id`` (the coordinator's run), a round this site already answered from the
        same broadcast point is answered again with the stored reply, spending nothing.
        """
        if not _valid_round(server_round) or not isinstance(server_round, int):
            log.warning("site %s: round number %.40r is not accepted", self.site_id, server_round)
            return self._refused(0, "bad-round")
        if self.refusal is not None:
            return self._refused(server_round, self.refusal)
        with locked(self.state_dir / ".round.lock"):
            digest = broadcast_digest(arrays)
            stored = self._stored_reply(run_id, server_round, digest)
            if stored is not None:
                log.info(
                    "site %s: round %d of run %s already answered; resending the stored reply",
                    self.site_id,
                    server_round,
                    run_id,
                )
                return stored
            problem = broadcast_problem(self.limits, arrays, full_rank=self.method == "prism")
            if problem is not None:
                log.warning("site %s, round %d: %s", self.site_id, server_round, problem)
                return self._refused(server_round, "bad-broadcast")
            return self._train_round(run_id, server_round, digest, arrays)

    def _planned(
        self, server_round: int, before: Sequence[PrivacyEvent] = ()
    ) -> SiteLedgerEntry | None:
        """The charge of this round's tau steps, or None if it would pass the site's cap.

        ``before``: events still to be charged ahead of the steps (a private clip estimate);
        they count in the cap check.
        """
        self.ledger.reload()  # another process may have charged this site since
        tau = self.run.local_steps
        history = [*self.ledger.events(), *before]
        event = PrivacyEvent(self.sigma, self.sample_rate, tau, mechanism=self.mechanism)
        planned = SiteLedgerEntry(server_round, event, self.delta)
        if self.method == "nondp":  # allowed by the site's policy: recorded, never capped
            return planned
        if epsilon([*history, planned.event], self.delta) > self.epsilon_cap:
            log.info(
                "site %s: %d more steps would pass its cap epsilon=%s (spent %.4f at delta=%s)",
                self.site_id,
                tau,
                self.epsilon_cap,
                epsilon(history, self.delta),
                self.delta,
            )
            return None
        return planned

    def _train_round(
        self, run_id: str, server_round: int, digest: str, arrays: dict[str, Tensor]
    ) -> RoundReply:
        plan = self._clip_to_estimate(run_id)
        planned = self._planned(server_round, [plan.event()] if plan is not None else [])
        if planned is None:
            return self._refused(server_round, "cap-exhausted")
        quantile = None
        if plan is not None:  # charged, run and stored before the training charge
            quantile = self._estimate_clip(run_id, server_round, arrays, plan)
        if self.clip_plan is not None and self._clip_run != run_id:
            raise AccountingMismatchError("max-norm = auto, but the clip was not resolved")
        history = self.ledger.events()
        attempt = len(self.ledger.entries())  # this charge's position in the site's own ledger
        self.ledger.charge(planned)
        self.faults.reach("site-training", server_round)
        start = load_arrays(self.loaded, arrays)
        self._restore_adaptive(start)
        self.trainer.begin_round(history, planned.steps)
        self.trainer.reseed(self.policy.round_seed(server_round, attempt))
        results = self.trainer.train(planned.steps)
        facts = self._released_facts(server_round, results, planned, quantile)
        end = read_points(self.loaded.handles)
        reply = RoundReply(self._update(arrays, start, end), facts)
        if self.run.report_train_loss:  # the site's policy allowed it (checked at construction)
            reply.nonprivate["nonprivate-train-loss"] = sum(r.loss for r in results) / len(results)
        self._store_round(run_id, server_round, digest, reply, end)
        return reply

    # -- max-norm = auto: the private clip (client.clip_quantile) -------------------------------

    def _use_clip(self, run_id: str, max_norm: float) -> None:
        self.trainer.set_max_norm(max_norm)
        self._clip_run = run_id

    def _clip_to_estimate(self, run_id: str) -> ClipPlan | None:
        """The plan to run now, or None: no auto clip, or this run's estimate is known.

        Known: held by this process, or stored in the state folder for this run id (a
        restarted site, or a deployed site's fresh ClientApp process): reused, nothing spent.
        Without a run id a stored estimate is never reused (the run cannot be told apart).
        """
        if self.clip_plan is None or self._clip_run == run_id:
            return None
        stored = self.clip_store.load()
        if stored is not None and run_id and stored.run_id == run_id:
            if stored.plan == self.clip_plan:
                log.info(
                    "site %s: reusing the clip C=%.6g estimated in round %d of run %s",
                    self.site_id,
                    stored.max_norm,
                    stored.server_round,
                    run_id,
                )
                self._use_clip(run_id, stored.max_norm)
                return None
            log.warning(
                "site %s: the stored clip estimate of run %s was made with another plan (%s); "
                "estimating again",
                self.site_id,
                run_id,
                stored.plan,
            )
        return self.clip_plan

    def _estimate_clip(
        self, run_id: str, server_round: int, arrays: dict[str, Tensor], plan: ClipPlan
    ) -> PrivacyEvent:
        """Charge, run and store the private clip estimate; its released event.

        Order (crash-safe): the quantile event is fsync'ed to the ledger, then the K steps run
        at the broadcast point, then the estimate is stored atomically. A crash before the
        store makes a restarted site estimate (and charge) again: counted twice, never zero.
        """
        entry = SiteLedgerEntry(server_round, plan.event(), self.delta)
        attempt = len(self.ledger.entries())
        self.ledger.charge(entry)
        load_arrays(self.loaded, arrays)
        self.trainer.reseed(self.policy.round_seed(server_round, attempt))
        estimate: ClipEstimate = estimate_clip(self.trainer, plan)
        event = released_event(estimate.records, QUANTILE_MECHANISM)
        self._check_charged(server_round, "the clip estimate", event, entry)
        self.clip_store.save(
            StoredClip(run_id, server_round, estimate.estimate, estimate.max_norm, plan)
        )
        self._use_clip(run_id, estimate.max_norm)
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

    def _update(
        self, arrays: dict[str, Tensor], start: list[Point], end: list[Point]
    ) -> dict[str, Tensor]:
        """What the site sends: the tangent update (PRISM) or the end factors (baselines)."""
        out: dict[str, Tensor] = {}
        for h, s, e in zip(self.loaded.handles, start, end, strict=True):
            if self.run.method == "prism":
                d = tangent_displacement(s.A, s.B, e.A, e.B)
                out[key(h.name, "dA")], out[key(h.name, "dB")] = d.dA.float(), d.dB.float()
            else:
                out[key(h.name, "A")], out[key(h.name, "B")] = e.A.float(), e.B.float()
        for name, param in head_named(self.loaded):
            value = param.detach().float().cpu()
            out[HEAD_PREFIX + name] = (
                value - arrays[HEAD_PREFIX + name].float() if self.run.method == "prism" else value
            )
        return {k: v.contiguous() for k, v in out.items()}


def _valid_round(value: object) -> bool:
    """A round number a site accepts: an integer (not a bool) in ``[1, SERVER_ROUND_MAX]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return 1 <= value <= SERVER_ROUND_MAX


_SITES: dict[tuple[str, ...], Site] = {}


def get_site(
    run: RunConfig,
    site: SiteConfig,
    policy: SitePolicy,
    *,
    faults: Faults = NO_FAULTS,
    run_id: int | str = "",
) -> Site:
    """The process-wide ``Site`` for this run (``run_id``), run config and site policy: models
    load once per run and process (Flower's simulation actors, the site's warm worker
    ``client.worker``). ``faults`` applies to a ``Site`` made by this call.

    A process that serves several runs one after another (the warm worker) keeps only the
    current run's sites: the first call of a new run drops every ``Site`` of the others, so a
    site's noise calibration and refusal are always those of the run it serves, and memory does
    not grow with the number of runs.
    """
    secret = hashlib.sha256(policy.rng_secret or b"").hexdigest()
    cache_key = (
        str(run_id),
        run.model_dump_json(),
        site.model_dump_json(),
        str(policy.state_dir),
        str(policy.cache_dir),
        secret,
    )
    for other in [k for k in _SITES if k[0] != cache_key[0]]:
        del _SITES[other]
    if cache_key not in _SITES:
        _SITES[cache_key] = Site(run, site, policy, faults=faults)
    return _SITES[cache_key]
