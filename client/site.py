"""One federated site: its data, model and durable privacy ledger, and the pipeline of a round.

A round (docs/design.md §3) is one straight pipeline of stages, each a function or class of its
own with explicit inputs and outputs, in this order, so a refusal never costs anything. Stages 1
to 6 are the ADMISSION (``Site.admit``), one for both kinds of round; then each kind has its own
ending: a plain round trains and releases its update (stages 7 to 9,
``Site.train_and_release``), a secure-aggregation round masks one clipped sum
(``client.masked_input``, driven by ``client.secure``).

1. REQUEST (``client.request.check_request``): the round number, an integer in
   ``[1, SERVER_ROUND_MAX]``, else ``bad-round`` (reported as round 0). Then the site's POLICY
   (``client.policy``; decided once per run config): a run asking for more epsilon or delta than
   the site allows, a delta not below 1/N, a non-private method or non-private metrics the site
   does not allow, is refused with its code (``client.reply.refuse``); so is a secure round of a
   run the site holds no secure noise for (``secure-aggregation-off``).
2. RESEND (``client.round_store.RoundStore.resend``, plain rounds): a round this site already
   answered (same coordinator run id, same round, same broadcast point by SHA-256) is answered
   with the stored reply: it is already DP output, so resending is post-processing and spends
   nothing. A secure round is never resent: a re-asked round has new masks, so a new charge.
3. BROADCAST (``client.broadcast.check_broadcast``): keys, shapes, finiteness, magnitudes and
   (PRISM) full rank r, else ``bad-broadcast``.
4. CAP (``client.charge.plan_charge``): the round's planned event (plain: ``local-steps`` steps of
   the site's mechanism; secure: one clipped sum at the noise the sum carries with H honest
   sites), and with ``max-norm = auto`` a private clip estimate still pending for this run
   (``client.clip_quantile.AutoClip.pending``), must fit under the site's cap composed with its
   whole ledger, else ``cap-exhausted``.
5. CLIP (``client.clip_quantile.AutoClip.resolve``, ``max-norm = auto`` only): the estimate's
   own event is charged, its K quantile steps run at the broadcast point, and the estimate is
   stored, all before the training charge.
6. CHARGE (``client.charge.charge``): the round's event is fsync'ed to the site ledger BEFORE
   training; then the ``site-training`` fault point.
7. TRAIN (``client.training.train``): ``tau`` private steps from the broadcast point.
8. RELEASE (``client.release.release``): the mechanism's ``PrivacyEvent``s must agree with the
   charge (``AccountingMismatchError`` otherwise, nothing sent); the reply's facts are built from
   them, its arrays are the tangent update at the broadcast point
   (``prism_core.manifold.tangent_displacement``; the end factors for the baselines). Nothing
   computed from un-noised data is sent unless the run asks and the site allows it (labelled
   non-private).
9. STORE (``client.round_store.RoundStore.store``): the reply, with the optimizer state it
   leaves behind, is stored atomically in the state folder (``last-round.pt``) before it is
   sent. A round that must run again (the site died before storing its reply) is charged again
   and draws fresh randomness.

Stages 2 to the end of either ending run under the site's round lock (``.round.lock`` in its
state folder). Randomness: sampling, dropout and noise come from the OS at the site by default;
in the site's reproducible mode (``client.policy``) from a secret only the site holds, one seed
per charge.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.metadata
import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import opacus
import torch
from torch import Tensor

from client.broadcast import BroadcastLimits, broadcast_limits, check_broadcast
from client.charge import Charge, charge, plan_charge
from client.clip_quantile import AutoClip, ClipPlan, ClipStore
from client.policy import SitePolicy
from client.release import release
from client.reply import RoundReply, SiteFacts, refuse
from client.request import RoundRequest, check_request
from client.round_store import RoundStore
from client.site_data import check_text_pairs, person_counts, site_examples
from client.site_ledger import SiteLedger
from client.training import train
from prism_core.accounting import (
    PrivacyEvent,
    calibrate_noise_multiplier,
    calibrate_skellam_sigma,
)
from prism_core.distributed import (
    UNITS_MAX,
    coordinate_dim,
    coordinate_shapes,
    discrete_sensitivity,
)
from prism_core.records import SKELLAM_MECHANISM, SkellamShare
from prism_core.skellam_accounting import skellam_mu, skellam_sigma
from prism_runtime.cache import cached_float
from prism_runtime.config import RunConfig, SiteConfig, site_method
from prism_runtime.data import TokenizedDataset
from prism_runtime.durable import locked
from prism_runtime.errors import ConfigError
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.lora import read_points
from prism_runtime.memory import available_bytes
from prism_runtime.model import LoadedModel, load_model, model_config_for
from prism_runtime.protocol import REFUSAL_REASONS
from prism_runtime.secure_sum.trust import RoundTrust
from prism_runtime.train_config import MECHANISMS, site_train_config
from prism_runtime.trainer import make_trainer

__all__ = [
    "AdmittedRound",
    "SecureNoise",
    "Site",
    "get_site",
]

log = logging.getLogger(__name__)


@functools.cache
def _accountant_identity() -> str:
    """What a calibrated sigma depends on besides its inputs: Opacus, dp-accounting (the PLD
    floor) and our accounting code."""
    source = Path(inspect.getfile(calibrate_noise_multiplier)).read_bytes()
    pld = importlib.metadata.version("dp-accounting")
    return (
        f"opacus {opacus.__version__} | dp-accounting {pld} | {hashlib.sha256(source).hexdigest()}"
    )


@dataclass(frozen=True)
class SecureNoise:
    """A secure-aggregation site's noise for one run (docs/design.md §3.3).

    Attributes:
        trust: H, the honest sites of a round the charge counts on (``SitePolicy.honest_sites``),
            and D, the most roster sites the site tolerates missing from a sum
            (``prism_runtime.secure_sum.RoundTrust``).
        sigma: the RDP-equivalent multiplier of the noise the sum carries with H - D honest
            inputs (the charged one; calibrated to the run's epsilon).
        mu: the Skellam parameter of that noise, in rounded units.
        mu_share: this site's share, ``mu / (H - D)``: every sum it takes part in holds at least
            H - D honest inputs, each adding at least this much (``RoundTrust.share_divisor``).
        share_sigma: the RDP-equivalent multiplier of the share alone (the guarantee if every
            other site colluded with the coordinator).
        dim: the length of the coordinate vector (public: the model's shapes).
        sparse_graph: whether the site accepts a sparse masking graph (``SitePolicy.sparse_graph``).
    """

    trust: RoundTrust
    sigma: float
    mu: float
    mu_share: float
    share_sigma: float
    dim: int
    sparse_graph: bool = False

    @property
    def honest(self) -> int:
        """H, the honest sites the charge counts on."""
        return self.trust.honest

    @classmethod
    def for_sigma(
        cls, sigma: float, *, trust: RoundTrust, dim: int, sparse_graph: bool = False
    ) -> SecureNoise:
        l2, l1 = discrete_sensitivity(dim)
        mu = skellam_mu(sigma=sigma, l1=l1, l2=l2)
        share = mu / trust.share_divisor
        # at H - D = 1 the share IS the sum: min() keeps float rounding from putting it above sigma
        alone = min(skellam_sigma(mu=share, l1=l1, l2=l2), sigma)
        return cls(trust, sigma, mu, share, alone, dim, sparse_graph)


@dataclass(frozen=True)
class AdmittedRound:
    """A round the site admitted (``Site.admit``): checked, and charged before anything ran.

    Attributes:
        request: the round's checked request (its broadcast passed ``check_broadcast``).
        charged: the round's charge, durable on the site's ledger (its ``entry`` is the event
            the round's mechanism must run).
        quantile: the released event of a private clip estimate charged this round, or None.
    """

    request: RoundRequest
    charged: Charge
    quantile: PrivacyEvent | None


class Site:
    """A site's long-lived state within one process (policy, data, model, trainer, ledger) and
    its round: the admission both kinds of round share (``admit``) and the plain round
    (``train_round``).

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
        self.unit = policy.unit_for(run) or "record"  # None: a record site refusing a user run
        by_person = self.unit == "user"
        user_field = (policy.user_field or run.user_field) if by_person else None
        rows = site_examples(run, site, user_field=user_field)
        check_text_pairs(run, rows)
        self.num_examples = len(rows)
        people = person_counts(rows) if by_person else None
        self.num_units = len(people) if people is not None else self.num_examples
        """N in the site's privacy unit: its records, or its people."""
        self.ledger = SiteLedger(self.state_dir)
        self.ledger.group_size = self._group_size(people)
        self.sample_rate = run.sample_rate or run.batch_size / self.num_units
        """q: the run's one public rate (secure aggregation), or b / N of this site."""
        self.refusal = policy.refusal(run, self.num_units)
        # What this site spends for this run: the request, which the policy check has bounded
        # by the site's own cap and delta (a refused run reports the site's own values).
        asked = self.refusal is None
        self.epsilon_cap = run.target_epsilon if asked else policy.epsilon_cap
        self.delta = run.delta if asked else policy.delta
        self.sigma = 0.0
        self.secure: SecureNoise | None = None
        self.clip_plan: ClipPlan | None = None  # max-norm = auto: the private clip estimate
        self.clip_store = ClipStore(self.state_dir)
        self.rounds = RoundStore(self.state_dir, site_id=self.site_id)
        if self.refusal is not None:
            log.warning(
                "site %s refuses this run (%s): %s",
                self.site_id,
                self.refusal,
                REFUSAL_REASONS[self.refusal],
            )
            self.facts = self._facts()
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
                expected_batch_size=self.sample_rate * self.num_units,
                sample_rate=self.sample_rate,
                trains_head=bool(self.loaded.head_params),
                unit=self.unit,
            )
        self.sigma = self._sigma()
        if run.secure_aggregation:
            if self.num_units > UNITS_MAX:  # encode_share's norm bound could then depend on data
                raise ConfigError(
                    f"site {self.site_id}: {self.num_units} units exceed the {UNITS_MAX} a "
                    "secure-aggregation share can hold; split the site or run without it"
                )
            self.secure = SecureNoise.for_sigma(
                self.sigma,
                trust=policy.round_trust(run),
                dim=coordinate_dim(
                    coordinate_shapes(read_points(self.loaded.handles), self.loaded.head_params)
                ),
                sparse_graph=policy.sparse_graph(run),
            )
        train_config = site_train_config(
            run,
            method=self.method,
            max_norm=self._initial_clip(),
            epsilon=self.epsilon_cap,
            delta=self.delta,
            noise_multiplier=self.sigma,
            privacy_unit=self.unit,
            group_size=self.ledger.group_size,
            max_records_per_user=policy.records_per_user(run),
        )
        self.trainer = make_trainer(
            self.loaded, dataset, train_config, history=self.ledger.events()
        )
        self.sample_rate = self.trainer.sample_rate
        self.clip = AutoClip(self.clip_plan, self.clip_store, self.trainer, site_id=self.site_id)
        self.facts = self._facts()

    def _group_size(self, people: dict[str, int] | None) -> int | None:
        """At the person level, the most records of one of the site's people when its ledger
        holds record-level events (they then count per person by group privacy, a conservative
        conversion the report states); None otherwise.

        Raises:
            ConfigError: a site at the record level whose ledger holds person-level events (a
                site never weakens its unit).
        """
        units = self.ledger.units()
        if people is None:
            if "user" in units:
                raise ConfigError(
                    f"site {self.site_id}: its privacy ledger {self.ledger.path} holds "
                    "person-level events, but this run would train at the record level. A site "
                    "never weakens its unit: set privacy-unit=user (with user-field) in its "
                    "node config, so that every charge stays per person."
                )
            return None
        if "record" not in units:
            return None
        largest = max(people.values())
        log.warning(
            "site %s: its ledger holds record-level events; at the person level they count "
            "by group privacy with this site's largest number of records per person "
            "(conservative)",
            self.site_id,
        )
        return largest

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
        if self.run.secure_aggregation:  # the Skellam sum's sigma, by integer-order RDP
            return cached_float(
                self.policy.cache_dir,
                {"what": "skellam sigma", **settings, "accountant": _accountant_identity()},
                lambda: calibrate_skellam_sigma(**settings),
            )
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

    def _facts(self) -> SiteFacts:
        """What every reply of this site states about it for this run."""
        return SiteFacts(
            site_id=self.site_id,
            delta=self.delta,
            epsilon_cap=self.epsilon_cap,
            rng=self.policy.rng,
            num_examples=self.num_units if self.site.share_num_examples else None,
            mechanism=self.mechanism,
            sigma=self.sigma,
            sample_rate=self.sample_rate,
            unit=self.unit,
        )

    @property
    def mechanism(self) -> str:
        """The ``PrivacyEvent.mechanism`` this site's method runs."""
        if self.run.secure_aggregation:
            return SKELLAM_MECHANISM
        return MECHANISMS[self.method]

    def admission_refusal(self, *, secure: bool) -> str | None:
        """The ``REFUSAL_REASONS`` code with which this site refuses every round of the run, or
        None: its policy's (``refusal``), else, for a secure-aggregation round of a run this site
        does not hold secure noise for, ``secure-aggregation-off``."""
        if self.refusal is None and secure and self.secure is None:
            return "secure-aggregation-off"
        return self.refusal

    @contextlib.contextmanager
    def admit(
        self,
        server_round: object,
        arrays: dict[str, Tensor],
        *,
        run_id: str = "",
        secure: bool = False,
    ) -> Iterator[AdmittedRound | RoundReply]:
        """Admit one round (stages 1 to 6 of the module's pipeline): check its request and the
        site's policy, take the round lock, resend a round already answered, check the broadcast,
        check the cap, resolve a private clip estimate, charge the round's event durably and pass
        the ``site-training`` fault point.

        Yields the ``AdmittedRound`` (charged: its event is fsync'ed to the site's ledger) with
        the round lock held until the ``with`` body, the round's ending, returns; or the reply
        that ends the round here: a refusal with its code (nothing charged), or the stored reply
        of a round already answered (resent, nothing charged).

        Args:
            server_round: the message's round number as received: one that is not an integer
                in ``[1, SERVER_ROUND_MAX]`` is refused (``bad-round``, reported as round 0).
            arrays: the broadcast arrays as received.
            run_id: the coordinator's run ("" if the message names none): with one, a round
                this site already answered from the same broadcast point is resent.
            secure: a secure-aggregation round: it charges one clipped sum at the noise the sum
                carries with H honest sites, and is never resent (a re-asked round has new
                masks, so it is a new charge).
        """
        request = check_request(server_round, arrays, run_id=run_id, site_id=self.site_id)
        if request is None:
            yield refuse(self.facts, self.ledger, 0, "bad-round")
            return
        refusal = self.admission_refusal(secure=secure)
        if refusal is not None:
            yield refuse(self.facts, self.ledger, request.server_round, refusal)
            return
        with locked(self.state_dir / ".round.lock"):
            yield self._charge_round(request, secure=secure)

    def _charge_round(self, request: RoundRequest, *, secure: bool) -> AdmittedRound | RoundReply:
        """``admit``'s stages under the round lock: resend, broadcast, cap, clip, charge."""
        if not secure:
            stored = self.rounds.resend(request)
            if stored is not None:
                return stored
        full_rank = self.method == "prism"  # PRISM's tangent space needs rank r
        if not check_broadcast(self.limits, request, full_rank=full_rank, site_id=self.site_id):
            return refuse(self.facts, self.ledger, request.server_round, "bad-broadcast")
        estimate = self.clip.pending(request.run_id)
        planned = plan_charge(
            self.ledger,
            self._secure_event() if secure else self._steps_event(),
            server_round=request.server_round,
            delta=self.delta,
            cap=None if self.method == "nondp" else self.epsilon_cap,
            before=[estimate.event()] if estimate is not None else [],
            site_id=self.site_id,
        )
        if planned is None:
            return refuse(self.facts, self.ledger, request.server_round, "cap-exhausted")
        quantile = self.clip.resolve(
            estimate,
            request,
            self.ledger,
            delta=self.delta,
            loaded=self.loaded,
            round_seed=self.policy.round_seed,
        )
        charged = charge(self.ledger, planned)
        self.faults.reach("site-training", request.server_round)
        return AdmittedRound(request, charged, quantile)

    def _steps_event(self) -> PrivacyEvent:
        """The event a plain round charges: ``local-steps`` steps of the site's mechanism."""
        return PrivacyEvent(
            self.sigma,
            self.sample_rate,
            self.run.local_steps,
            mechanism=self.mechanism,
            unit=self.unit,
        )

    def _secure_event(self) -> PrivacyEvent:
        """The event a secure-aggregation round charges: one clipped sum, at the noise the sum
        carries when H sites are honest and at most D of the roster are missing
        (``SecureNoise.sigma``)."""
        noise = self.secure
        if noise is None:  # admit refuses such a round first (secure-aggregation-off)
            raise ConfigError("this site takes no part in secure aggregation for this run")
        return PrivacyEvent(
            noise.sigma,
            self.sample_rate,
            1,
            mechanism=SKELLAM_MECHANISM,
            unit=self.unit,
            # its own planned share: the one it adds is at least that (conservative)
            secure=SkellamShare(honest_sites=noise.honest, share_sigma=noise.share_sigma),
        )

    def train_round(
        self, server_round: object, arrays: dict[str, Tensor], *, run_id: str = ""
    ) -> RoundReply:
        """Answer one plain round from the broadcast ``arrays``: refuse, resend, or train.

        The round is admitted (``admit``), then trained from the broadcast point and released
        (``train_and_release``).
        """
        with self.admit(server_round, arrays, run_id=run_id) as admitted:
            if isinstance(admitted, RoundReply):  # a refusal, or a stored reply resent
                return admitted
            return self.train_and_release(admitted)

    def train_and_release(self, admitted: AdmittedRound) -> RoundReply:
        """The plain round's ending (stages 7 to 9): ``tau`` private steps from the broadcast
        point, the released update and its facts, stored before the reply is returned."""
        request, charged = admitted.request, admitted.charged
        trained = train(
            self.trainer,
            self.loaded,
            request,
            charged,
            seed=self.policy.round_seed(request.server_round, charged.attempt),
            rounds=self.rounds,
            gradient=self.run.steps_at_coordinator,
        )
        reply = release(
            trained,
            charged.entry,
            request,
            facts=self.facts,
            spent=self.ledger.epsilon(self.delta),
            quantile=admitted.quantile,
            loaded=self.loaded,
            method=self.method,
            report_train_loss=self.run.report_train_loss,  # the policy allowed it
        )
        self.rounds.store(request, reply, trained.moments)
        return reply


SITES_KEPT_ENV = "PRISM_SITES_KEPT"
"""The most ``Site`` objects a process keeps open (least recently used closed first), when set
(an integer >= 1); unset: as many as memory allows (``MEMORY_FLOOR``)."""

MEMORY_FLOOR = 0.25
"""``get_site`` closes the least recently used open sites, before it opens another, while
the machine's available memory (``/proc/meminfo``'s MemAvailable) is below this fraction of its
total. A deployed site's process serves one site; a simulation actor serves every virtual site
Flower routes to it, and each open site holds its model, tokenised shard and trainer (a hundred
tiny-BERT sites on two actors: 6.4 GiB open, docs/benchmarks.md). A closed site opens again from
its state folder as after a restart: its ledger, stored round, PRISM's adaptive moments and clip
estimate are on disk, a secure round's secrets in the node's ``context.state`` and
``secure-round.json``, its randomness drawn per charge, so no charge, ledger entry or random
draw changes. What lives only in memory starts again, as after a restart: the AdamW state of
the baselines and the velocity of a ``momentum`` or ``adamw`` head (PRISM's default ``sgd``
head has none), so with those a closed site's next update differs from an open one's. Under
memory pressure from outside the federation every open site may be closed: slower, never
wrong."""


def _sites_kept() -> int | None:
    """``PRISM_SITES_KEPT`` if set, else None (no bound but memory).

    Raises:
        ConfigError: the variable is not an integer >= 1.
    """
    text = os.environ.get(SITES_KEPT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"{SITES_KEPT_ENV}={text!r}: give the most sites a process keeps open, an integer "
            ">= 1, or unset it to keep as many as memory allows"
        )
    return int(text)


def _memory_low() -> bool:
    """Whether the host's available memory (``prism_runtime.memory.available_bytes``) is below
    ``MEMORY_FLOOR`` of its total (False where the system does not say: only
    ``PRISM_SITES_KEPT`` bounds the open sites there)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        available = available_bytes(torch.device("cpu"))
    except (OSError, ValueError):
        return False
    return available < MEMORY_FLOOR * total


_SITES: OrderedDict[tuple[str, ...], Site] = OrderedDict()


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
    ``client.worker``); the least recently used are closed when memory runs low
    (``MEMORY_FLOOR``) or beyond the process's ``PRISM_SITES_KEPT``. ``faults`` applies to a
    ``Site`` made by this call.

    A process that serves several runs one after another (the warm worker) keeps only the
    current run's sites: the first call of a new run drops every ``Site`` of the others, so a
    site's noise calibration and refusal are always those of the run it serves, and memory does
    not grow with the number of runs, nor with the number of sites a simulation actor serves.
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
    if cache_key in _SITES:
        _SITES.move_to_end(cache_key)
        return _SITES[cache_key]
    kept = _sites_kept()
    while _SITES and ((kept is not None and len(_SITES) >= kept) or _memory_low()):
        _SITES.popitem(last=False)
        gc.collect()  # the closed site's model and trainer, before the next one loads
    _SITES[cache_key] = Site(run, site, policy, faults=faults)
    return _SITES[cache_key]
