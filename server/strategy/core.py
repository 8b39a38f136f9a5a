"""The coordinator's Flower strategy: selection, then per reply validation, binding, ledgering
and streamed aggregation, wired from the parts of this package.

PRISM (``mode="tangent"``): every site of a round starts from the same broadcast point
``Z_t = A B.T``, so their tangent updates live in one vector space and the weighted mean of the
lifts IS the weighted mean of the ``dZ_k`` (the map ``(dA, dB) -> dA B.T + A dB.T`` is linear).
The server then takes ``Retr_r(Z_t + eta_s * mean dZ)`` (QR + 2r x 2r SVD, full rank r kept).
Baselines (``mode="factor-average"``): FedIT-style FedAvg of ``A`` and ``B`` separately
(inexact: ``mean(A) mean(B).T != mean(A B.T)``), used with factor-space DP or FFA on the sites.

Replies are consumed one at a time as the round loop pulls them (``server.strategy.loop``) and
none is kept after it is summed, so coordinator memory does not grow with the number of sites.
Every reply is validated before it touches the aggregate; a bad reply is logged, counted per
reason in the round summary and skipped (``PrismStrategy.aggregate_train``). No NaN or Inf can
reach the global adapter: the replies, their mean and the retracted result are all checked.
Every site asked to run a round is charged in the ledger (``server.strategy.charges``).

Above ~400 lines on purpose: this is the thin wiring of a run config (``from_run``) and of
selection, replies, charges, bounds and aggregation (each its own module) into Flower's
``Strategy`` interface, which fixes the methods it must have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result

from prism_core.aggregation import Aggregation
from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.config import RunConfig, site_method
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.protocol import (
    ARRAYS,
    CONFIG,
    REFUSAL_REASONS,
    ROUND_NONCE,
    SERVER_ROUND,
    STATUS_REFUSED,
    UPDATE,
)
from prism_runtime.train_config import MECHANISMS
from server.errors import ReplyError
from server.ledger import Ledger
from server.optimizer import (
    ServerOptimizer,
    ServerOptimizerConfig,
    ServerOptimizerKind,
    scheduled_lr,
)
from server.strategy.aggregator import Mode, StreamingAggregator
from server.strategy.binding import SiteBinding
from server.strategy.bounds import AutoClip, UpdateBound, UpdateChecker
from server.strategy.central import CentralStep
from server.strategy.charges import Charges
from server.strategy.loop import run_rounds
from server.strategy.replies import (
    RunTerms,
    error_reply,
    facts_of,
    unconfirmed_code,
)
from server.strategy.rounds import RoundSummary
from server.strategy.selection import WAIT_FOR_NODES, Selection

__all__ = ["PrismStrategy"]

log = logging.getLogger("server.strategy")


@dataclass
class _Tally:
    """What one round's replies so far say about the nodes asked (``aggregate_train``): no
    reply itself is kept, so the round's memory does not grow with its replies."""

    seen: set[str] = field(default_factory=set)  # sites with a reply past the origin check
    answered: set[int] = field(default_factory=set)  # nodes whose facts were confirmed/refused
    pending: dict[int, tuple[str, int]] = field(default_factory=dict)  # node -> (code, steps)
    replied: set[int] = field(default_factory=set)  # nodes with any reply


class PrismStrategy(Strategy):
    """Round orchestration for PRISM and the factor-averaging baselines.

    ``from_run`` builds it from a run config, the one source of every setting's default; the
    constructor has no defaults and takes every setting by keyword.

    Args:
        modules: LoRA module names (keys ``<module>/A``, ``<module>/B`` of the global arrays).
        head: names of the DP head tensors (keys ``head/<name>``), possibly empty.
        mode: ``tangent`` (PRISM) or ``factor-average`` (baselines).
        ledger: the coordinator's privacy ledger.
        run_id: this run's id in the ledger.
        sites_per_round, min_sites, server_lr, aggregation, local_steps, default cap
        (epsilon, delta), connect_timeout and seed: see ``prism_runtime.config.RunConfig``.
        lr_schedule, num_rounds: the server lr of round ``t`` is
            ``scheduled_lr(server_lr, lr_schedule, t, num_rounds)`` (run-config
            ``server-lr-schedule``), for every mode and server optimizer.
        server_optimizer: the server step's kind (run-config ``server-optimizer``), at
            ``server_lr``.
        local_lr: the sites' local lr (run-config ``lr``), to express the aggregate's noise in
            update units.
        noise_multiplier: the run's sigma when the run config fixes it (a DP reply must report
            it); None when each site calibrates its own.
        max_norm, expected_batch_size: the run's C and b every DP reply must state (None: not
            fixed by the run).
        sample_rate: the run's one public q every DP reply must state (secure aggregation with
            ``sample-rate``); None: each site's q is b / N_k.
        wait_for_nodes: seconds to wait for ``sites_per_round`` sites before going on with
            ``min_sites`` (``Selection``).
        update_bound: the sites' local optimizer settings; a reply whose update norm exceeds
            what an honest site can produce (``prism_core.bounds``) is rejected. None: only the
            update's keys, shapes and values are checked.
        mechanism: the mechanism the run's method runs on each site
            (``prism_runtime.train_config.MECHANISMS[prism_runtime.config.site_method(method)]``);
            a reply reporting another is rejected.
        dp: whether that mechanism adds noise; a DP reply must report sigma > 0.
        auto_clip: set for a run with ``max-norm = auto`` (see ``AutoClip``).
    """

    def __init__(
        self,
        *,
        modules: list[str],
        head: list[str],
        mode: Mode,
        ledger: Ledger,
        run_id: str,
        sites_per_round: int,
        min_sites: int,
        server_lr: float,
        lr_schedule: str,
        num_rounds: int,
        server_optimizer: ServerOptimizerKind,
        local_steps: int,
        local_lr: float,
        target_epsilon: float,
        delta: float,
        aggregation: Aggregation,
        noise_multiplier: float | None,
        max_norm: float | None,
        expected_batch_size: float | None,
        seed: int,
        wait_for_nodes: float,
        connect_timeout: float,
        update_bound: UpdateBound | None,
        mechanism: str,
        dp: bool,
        auto_clip: AutoClip | None,
        sample_rate: float | None,
    ) -> None:
        scheduled_lr(server_lr, lr_schedule, 1, num_rounds)  # validates both
        if not 1 <= min_sites <= sites_per_round:
            raise ValueError(
                f"min-sites={min_sites} with sites-per-round={sites_per_round}: "
                "use 1 <= min-sites <= sites-per-round"
            )
        self.modules, self.head, self.mode = modules, head, mode
        self.ledger, self.run_id = ledger, run_id
        self.sites_per_round, self.min_sites = sites_per_round, min_sites
        self.local_steps, self.dp = local_steps, dp
        self.selection = Selection(
            ledger=ledger,
            run_id=run_id,
            local_steps=local_steps,
            sites_per_round=sites_per_round,
            min_sites=min_sites,
            seed=seed,
            wait_for_nodes=wait_for_nodes,
            connect_timeout=connect_timeout,
        )
        self.summaries: list[RoundSummary] = []
        self.central: CentralStep | None = None
        """Secure aggregation: the coordinator's PRISM step on the unmasked sum (set by
        ``server.federation``); None for a plain run."""
        self.min_honest_sites = 1
        """Secure aggregation: the run's ``min-honest-sites`` (the least threshold)."""
        self.binding = SiteBinding()
        self.terms = RunTerms(
            mechanism=mechanism,
            dp=dp,
            local_steps=local_steps,
            delta=delta,
            noise_multiplier=noise_multiplier,
            max_norm=max_norm,
            expected_batch_size=expected_batch_size,
            sample_rate=sample_rate,
            auto_clip=auto_clip,
        )
        self.checker = UpdateChecker(
            modules=modules,
            head=head,
            mode=mode,
            local_steps=local_steps,
            update_bound=update_bound,
        )
        self.aggregator = StreamingAggregator(
            modules=modules,
            head=head,
            mode=mode,
            optimizer=ServerOptimizer(
                ServerOptimizerConfig(kind=server_optimizer, lr=server_lr), modules, head
            ),
            server_lr=server_lr,
            lr_schedule=lr_schedule,
            num_rounds=num_rounds,
            local_lr=local_lr,
            local_steps=local_steps,
            aggregation=aggregation,
            dp=dp,
            expected_batch_size=expected_batch_size,
        )
        self.charges = Charges(
            ledger=ledger,
            run_id=run_id,
            target_epsilon=target_epsilon,
            delta=delta,
            mechanism=mechanism,
            auto_clip=auto_clip,
        )

    @classmethod
    def from_run(
        cls,
        run: RunConfig,
        *,
        modules: list[str],
        head: list[str],
        ledger: Ledger,
        run_id: str,
        wait_for_nodes: float = WAIT_FOR_NODES,
    ) -> PrismStrategy:
        """The strategy of the run ``run``: every setting the run config holds is read from it.

        The mode and the mechanism every reply must state follow the run's method; sigma and C
        are fixed when the run fixes them (``noise-multiplier = -1``: each site calibrates its
        own sigma; ``max-norm = auto``: ``AutoClip.for_run`` checks the range of each site's
        private clip); the update bound is the one of the ``TrainConfig`` the sites derive from
        the run (``UpdateBound.for_run``).

        Args:
            run: the validated run config.
            modules, head: the loaded model's LoRA module names and DP head tensor names.
            ledger, run_id: the coordinator's privacy ledger and this run's id in it.
            wait_for_nodes: seconds a round waits for ``sites-per-round`` sites before going
                on with ``min-sites``.
        """
        mechanism = MECHANISMS[site_method(run.method)]
        strategy = cls(
            modules=modules,
            head=head,
            mode="tangent" if run.method == "prism" else "factor-average",
            ledger=ledger,
            run_id=run_id,
            sites_per_round=run.sites_per_round,
            min_sites=run.min_sites,
            server_lr=run.server_lr,
            lr_schedule=run.server_lr_schedule,
            num_rounds=run.num_rounds,
            server_optimizer=run.server_optimizer,
            local_steps=run.local_steps,
            local_lr=run.lr,
            target_epsilon=run.target_epsilon,
            delta=run.delta,
            aggregation=run.aggregation,
            noise_multiplier=run.noise_multiplier if run.noise_multiplier >= 0 else None,
            max_norm=run.max_norm if isinstance(run.max_norm, float) else None,
            expected_batch_size=None if run.sample_rate else float(run.batch_size),
            sample_rate=run.sample_rate or None,
            seed=run.seed,
            wait_for_nodes=wait_for_nodes,
            connect_timeout=run.connect_timeout,
            update_bound=UpdateBound.for_run(run),
            mechanism=SKELLAM_MECHANISM if run.secure_aggregation else mechanism,
            dp=run.method != "nondp",
            auto_clip=AutoClip.for_run(run),
        )
        strategy.min_honest_sites = run.min_honest_sites
        return strategy

    @property
    def update_bound(self) -> UpdateBound | None:
        """The sites' optimizer settings that bound an honest update (``UpdateChecker``)."""
        return self.checker.update_bound

    @update_bound.setter
    def update_bound(self, value: UpdateBound | None) -> None:
        self.checker.update_bound = value

    @property
    def exhausted(self) -> set[str]:
        """Sites that refused or whose next round would exceed their cap: never asked again."""
        return self.selection.exhausted

    @property
    def optimizer(self) -> ServerOptimizer:
        """The server optimizer (its state is checkpointed by ``server.federation``)."""
        return self.aggregator.optimizer

    # -- selection -------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global factors to up to ``sites_per_round`` sites that can still run."""
        select = self.selection
        nodes = select.nodes(grid)
        eligible = [n for n in nodes if select.eligible(self.binding.site_of(n), server_round)]
        if not eligible:
            return []
        chosen = select.choose(eligible)
        broadcast = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        self.checker.begin_round(server_round, broadcast)
        self.aggregator.begin_round(broadcast)
        config[SERVER_ROUND] = server_round
        config[ROUND_NONCE] = self.binding.ask(server_round, chosen, nodes)
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        self.summaries.append(RoundSummary(server_round, sent=len(chosen)))
        return [
            Message(content=content, message_type="train", dst_node_id=n) for n in sorted(chosen)
        ]

    # -- aggregation -----------------------------------------------------------------------

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, ledger and stream-aggregate the replies; apply if enough are valid.

        Per reply, as they come (``replies`` may be a generator of replies as they arrive; none
        is kept after it is summed): an error reply is rejected (shown by its code's fixed text,
        never its reason); the accounting facts are type- and range-checked (``validate_facts``);
        the reply must come from a node asked this round, carry this round's number and nonce,
        match the node's bound site id, and be the site's first reply this round
        (``SiteBinding.check_origin``); its facts must match what the coordinator configured
        (``RunTerms.check``: steps, mechanism, sampling, adjacency, rng, sigma, q, delta, a known
        refusal code, and with ``max-norm = auto`` the reported clip's range and the clip
        estimate's steps). Only then are they charged to the ledger as CONFIRMED (a private clip
        estimate as its own row, in the same transaction as the steps), so a reply
        whose UPDATE is bad (keys, dtype, shape, NaN/Inf, huge entries, a norm beyond the
        mechanism's bound) is still charged: the site spent that budget. A ledger conflict (a
        different confirmed record of the same round) rejects the reply, never the round.
        Refusals charge nothing and end the site's selection.

        Then every node asked this round that gave no valid answer (no reply, an error reply, or
        only rejected ones before its facts were confirmed) is charged the round's steps as
        UNCONFIRMED (``Charges.unconfirmed``): it may have charged itself before failing.
        """
        summary = self.summaries[-1]
        tally = _Tally()
        for msg in replies:
            self._take(server_round, msg, tally, summary)
            del msg  # the reply is summed: drop it before the next one is pulled
        self._charge_unanswered(server_round, tally, summary)
        if len(summary.accepted) < self.min_sites:  # >= 1: every accepted weight is > 0
            log.warning(
                "round %d: %d valid updates < min-sites=%d; global adapter unchanged",
                server_round,
                len(summary.accepted),
                self.min_sites,
            )
            return None, self._metrics(summary)
        new = self.aggregator.finish(summary)
        if new is None:
            return None, self._metrics(summary)
        summary.applied = True
        return ArrayRecord(new), self._metrics(summary)

    def _take(
        self,
        server_round: int,
        msg: Message,
        tally: _Tally,
        summary: RoundSummary,
        *,
        secure: Callable[[str, dict[str, Any], Message], None] | None = None,
    ) -> None:
        """Check, charge and add one reply (``aggregate_train``); a bad one is logged, counted
        and skipped. Nothing of the reply is kept once it returns.

        ``secure``: a secure-aggregation round's masked input: after the facts are checked and
        charged, ``secure(site, facts, msg)`` takes the reply instead of the update check and
        the aggregator (``server.strategy.secure``); a ``ReplyError`` it raises rejects it."""
        node = msg.metadata.src_node_id
        tally.replied.add(node)
        who = self.binding.site_of(node)
        steps = self.local_steps  # what an unconfirmed charge of this node counts
        try:
            if msg.has_error():
                raise error_reply(msg)
            facts = facts_of(msg)
            site = self.binding.check_origin(server_round, node, facts)
            who = site
            if site in tally.seen:
                raise ReplyError(f"second reply of {site!r} in round {server_round}", "duplicate")
            tally.seen.add(site)
            steps = max(steps, int(facts["steps"]))  # a site claiming more is charged more
            self.terms.check(facts)
            self.charges.confirmed(server_round, facts)
            tally.answered.add(node)
            if facts["status"] == STATUS_REFUSED:  # exhausted: its mechanism is not kept
                self._refused(server_round, site, str(facts["reason"]), summary)
                return
            sigma, q = float(facts["sigma"]), float(facts["q"])
            cap = float(facts.get("epsilon-cap", self.charges.target_epsilon))
            self.selection.site_mechanism[site] = (sigma, q, cap, float(facts["delta"]))
            if secure is not None:
                secure(site, facts, msg)
                summary.accepted.append(site)
                return
            update = self.checker.validate(msg.content.get(UPDATE), facts)
            weight = self.aggregator.weight(facts)
        except (ReplyError, KeyError, TypeError, ValueError) as exc:
            error = exc if isinstance(exc, ReplyError) else ReplyError(repr(exc))  # code "invalid"
            summary.reject(who, error)
            log.warning("round %d: rejected reply from %s: %s", server_round, who, error)
            if error.code == "ledger-conflict":
                tally.answered.add(node)  # the round's confirmed record is in the ledger already
            else:  # read by _charge_unanswered for the nodes asked and not answered only
                code, before = tally.pending.get(node, (unconfirmed_code(error, msg), steps))
                tally.pending[node] = (code, max(before, steps))
            return
        self.aggregator.add(update, facts, weight)
        summary.accepted.append(site)

    def _refused(self, server_round: int, site: str, code: str, summary: RoundSummary) -> None:
        """A valid refusal (its code checked by ``RunTerms.check``): no charge, no more rounds."""
        summary.refused.append(site)
        summary.refusal_codes[site] = code
        self.selection.exhausted.add(site)
        log.info(
            "site %s refused round %d: %s (%s)", site, server_round, code, REFUSAL_REASONS[code]
        )

    def _charge_unanswered(self, server_round: int, tally: _Tally, summary: RoundSummary) -> None:
        """Charge every node asked this round without a valid answer as UNCONFIRMED."""
        for node in self.binding.asked(server_round):
            if node in tally.answered:
                continue
            who = self.binding.site_of(node)
            if node not in tally.replied:
                error = ReplyError("no reply before the round timeout", "no-reply")
                summary.reject(who, error)
                log.warning(
                    "round %d: no reply from %s before the timeout; the round goes on without it",
                    server_round,
                    who,
                )
            code, steps = tally.pending.get(node, ("no-reply", self.local_steps))
            self.charges.unconfirmed(server_round, who, code, steps, summary)

    @staticmethod
    def _metrics(summary: RoundSummary) -> MetricRecord:
        return MetricRecord(
            {
                "sites-sent": summary.sent,
                "sites-accepted": len(summary.accepted),
                "sites-refused": len(summary.refused),
                "replies-rejected": len(summary.rejected),
                "sites-unconfirmed": len(summary.unconfirmed),
                "applied": int(summary.applied),
                **{f"rejected-{code}": n for code, n in sorted(summary.rejected_by_reason.items())},
            }
        )

    # -- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy carries from one round to the next, as JSON-ready values.

        The server optimizer is plain ``server-lr`` SGD on the retraction today: it has no state,
        and its slot in the checkpoint (``server.federation``) records just that.
        """
        version, internal, gauss = self.selection.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "node-site": {str(n): s for n, s in self.binding.node_site.items()},
            "site-mechanism": {s: list(m) for s, m in self.selection.site_mechanism.items()},
            "exhausted": sorted(self.selection.exhausted),
            "summaries": [vars(x) for x in self.summaries],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (after a coordinator restart)."""
        version, internal, gauss = state["rng"]
        self.selection.rng.setstate((version, tuple(internal), gauss))
        self.binding.node_site = {int(n): str(s) for n, s in state["node-site"].items()}
        self.selection.site_mechanism = {
            s: (float(m[0]), float(m[1]), float(m[2]), float(m[3]))
            for s, m in state["site-mechanism"].items()
        }
        self.selection.exhausted = set(state["exhausted"])
        self.summaries = [RoundSummary.from_dict(x) for x in state["summaries"]]

    # -- evaluation is server-side only (see server.app); sites are never asked to evaluate ---

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sites do not evaluate: an evaluation on private data would be an un-noised release."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info(
            "PrismStrategy(mode=%s, modules=%d, head=%d, sites/round=%d, min-sites=%d, "
            "server-lr=%s %s)",
            self.mode,
            len(self.modules),
            len(self.head),
            self.sites_per_round,
            self.min_sites,
            self.aggregator.server_lr,
            self.aggregator.lr_schedule,
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
        on_round_end: Any = None,
        first_round: int = 1,
        previous: Result | None = None,
        faults: Faults = NO_FAULTS,
    ) -> Result:
        """Run rounds until ``num_rounds`` or until no site can continue within its cap
        (``server.strategy.loop.run_rounds``, which says how a resumed run is passed in;
        ``faults``: its crash points for tests)."""
        self.summary()
        return run_rounds(
            self,
            grid,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=ConfigRecord() if train_config is None else train_config,
            evaluate_fn=evaluate_fn,
            on_round_end=on_round_end,
            first_round=first_round,
            previous=previous,
            faults=faults,
        )
