"""The coordinator's Flower strategy: selection, then one round kind, wired from this package.

``PrismStrategy`` chooses each round's sites (``Selection``), binds nodes to sites
(``SiteBinding``), takes every reply through one ``ReplyIntake`` (facts checked against the
run's ``RunTerms`` and charged by ``Charges``), and hands the round to its round kind
(``server.strategy.contract``): a ``PlainRound`` (one exchange, the weighted mean of the sites'
noisy updates, the server step) or a ``SecureRound`` (six exchanges, only the sum, PRISM's
central step). ``from_run`` builds every part from a validated run config and picks the kind.
Every site asked to run a round is charged in the ledger (``server.strategy.charges``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from torch import Tensor

from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.config import RunConfig, site_method
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.protocol import ARRAYS, CONFIG, ROUND_NONCE, SERVER_ROUND, TRAIN
from prism_runtime.train_config import MECHANISMS
from server.ledger import Ledger
from server.strategy.binding import SiteBinding
from server.strategy.bounds import AutoClip, UpdateBound
from server.strategy.central import CentralStep
from server.strategy.charges import Charges
from server.strategy.contract import RoundContext, RoundKind
from server.strategy.intake import ReplyIntake
from server.strategy.loop import EvaluateFn, RoundEndFn, run_rounds
from server.strategy.plain import PlainRound
from server.strategy.replies import RunTerms
from server.strategy.rounds import RoundSummary
from server.strategy.secure import SecureRound
from server.strategy.selection import WAIT_FOR_NODES, Selection
from server.strategy.transport import Exchange

__all__ = ["PrismStrategy"]

log = logging.getLogger("server.strategy")


RoundKindT = PlainRound | SecureRound
"""The round kinds (``server.strategy.contract``)."""


class PrismStrategy(Strategy):
    """Round orchestration for PRISM and the factor-averaging baselines, plain or secure.

    ``from_run`` builds it from a run config, the one source of every setting's default; the
    constructor takes the built parts by keyword and has no defaults.

    Args:
        modules: LoRA module names (keys ``<module>/A``, ``<module>/B`` of the global arrays).
        head: names of the DP head tensors (keys ``head/<name>``), possibly empty.
        selection: which sites each round asks (``Selection``).
        binding: node <-> site binding and the round's nonce (``SiteBinding``).
        terms: what every reply's facts must state (``RunTerms``).
        charges: the ledger's confirmed and unconfirmed charges (``Charges``).
        round_kind: the round kind (``PlainRound`` or ``SecureRound``).
    """

    def __init__(
        self,
        *,
        modules: list[str],
        head: list[str],
        selection: Selection,
        binding: SiteBinding,
        terms: RunTerms,
        charges: Charges,
        round_kind: RoundKindT,
    ) -> None:
        self.modules, self.head = modules, head
        self.selection, self.binding = selection, binding
        self.terms, self.charges = terms, charges
        self.round_kind: RoundKindT = round_kind
        self.summaries: list[RoundSummary] = []

    @classmethod
    def from_run(
        cls,
        run: RunConfig,
        *,
        modules: list[str],
        head: list[str],
        ledger: Ledger,
        run_id: str,
        arrays: dict[str, Tensor] | None = None,
        wait_for_nodes: float = WAIT_FOR_NODES,
    ) -> PrismStrategy:
        """The strategy of the run ``run``: every setting the run config holds is read from it.

        The round kind follows ``secure-aggregation``; the mode and the mechanism every reply
        must state follow the run's method; sigma and C are fixed when the run fixes them
        (``noise-multiplier = -1``: each site calibrates its own sigma; ``max-norm = auto``:
        ``AutoClip.for_run`` checks the range of each site's private clip); the update bound is
        the one of the ``TrainConfig`` the sites derive from the run (``UpdateBound.for_run``).

        Args:
            run: the validated run config.
            modules, head: the loaded model's LoRA module names and DP head tensor names.
            ledger, run_id: the coordinator's privacy ledger and this run's id in it.
            arrays: the initial global arrays; the coordinator's step (secure, or plain with
                ``step-at = coordinator``) needs them.
            wait_for_nodes: seconds a round waits for ``sites-per-round`` sites before going
                on with ``min-sites``.
        """
        auto_clip = AutoClip.for_run(run)
        dp = run.method != "nondp"
        mechanism = MECHANISMS[site_method(run.method)]
        if run.secure_aggregation:
            mechanism = SKELLAM_MECHANISM
        binding = SiteBinding()
        terms = RunTerms(
            mechanism=mechanism,
            dp=dp,
            local_steps=run.local_steps,
            delta=run.delta,
            noise_multiplier=run.noise_multiplier if run.noise_multiplier >= 0 else None,
            max_norm=run.max_norm if isinstance(run.max_norm, float) else None,
            expected_batch_size=None if run.sample_rate else float(run.batch_size),
            sample_rate=run.sample_rate or None,
            auto_clip=auto_clip,
        )
        round_kind: RoundKindT
        if run.secure_aggregation:
            if arrays is None:
                raise ValueError("a secure-aggregation run needs the initial arrays (arrays=)")
            round_kind = SecureRound(
                central=CentralStep(run, modules=modules, head=head, arrays=arrays),
                binding=binding,
                min_honest_sites=run.min_honest_sites,
                sparse_graph=run.secure_graph == "sparse",
            )
        else:
            central = None
            if run.steps_at_coordinator:
                if arrays is None:
                    raise ValueError("step-at=coordinator needs the initial arrays (arrays=)")
                central = CentralStep(run, modules=modules, head=head, arrays=arrays)
            round_kind = plain_round(run, modules=modules, head=head, terms=terms, central=central)
        return cls.assemble(
            modules=modules,
            head=head,
            ledger=ledger,
            run_id=run_id,
            terms=terms,
            round_kind=round_kind,
            binding=binding,
            target_epsilon=run.target_epsilon,
            sites_per_round=run.sites_per_round,
            min_sites=run.min_sites,
            seed=run.seed,
            wait_for_nodes=wait_for_nodes,
            connect_timeout=run.connect_timeout,
        )

    @classmethod
    def assemble(
        cls,
        *,
        modules: list[str],
        head: list[str],
        ledger: Ledger,
        run_id: str,
        terms: RunTerms,
        round_kind: RoundKindT,
        binding: SiteBinding,
        target_epsilon: float,
        sites_per_round: int,
        min_sites: int,
        seed: int,
        wait_for_nodes: float,
        connect_timeout: float,
    ) -> PrismStrategy:
        """The strategy of built ``terms``, ``round_kind`` and ``binding``: its selection and
        charges from the settings named (``from_run`` reads them from a run config).

        Raises:
            ValueError: not 1 <= ``min_sites`` <= ``sites_per_round`` (``RunConfig`` checks it
                too).
        """
        if not 1 <= min_sites <= sites_per_round:
            raise ValueError(
                f"min-sites={min_sites} with sites-per-round={sites_per_round}: "
                "use 1 <= min-sites <= sites-per-round"
            )
        return cls(
            modules=modules,
            head=head,
            selection=Selection(
                ledger=ledger,
                run_id=run_id,
                local_steps=terms.local_steps,
                sites_per_round=sites_per_round,
                min_sites=min_sites,
                seed=seed,
                wait_for_nodes=wait_for_nodes,
                connect_timeout=connect_timeout,
            ),
            binding=binding,
            terms=terms,
            charges=Charges(
                ledger=ledger,
                run_id=run_id,
                target_epsilon=target_epsilon,
                delta=terms.delta,
                mechanism=terms.mechanism,
                auto_clip=terms.auto_clip,
            ),
            round_kind=round_kind,
        )

    @property
    def ledger(self) -> Ledger:
        """The coordinator's privacy ledger (the one ``charges`` writes to)."""
        return self.charges.ledger

    @property
    def run_id(self) -> str:
        return self.charges.run_id

    @property
    def exhausted(self) -> set[str]:
        """Sites that refused or whose next round would exceed their cap: never asked again."""
        return self.selection.exhausted

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
        self.round_kind.begin(server_round, broadcast)
        config[SERVER_ROUND] = server_round
        config[ROUND_NONCE] = self.binding.ask(server_round, chosen, nodes)
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        self.summaries.append(RoundSummary(server_round, sent=len(chosen)))
        return [Message(content=content, message_type=TRAIN, dst_node_id=n) for n in sorted(chosen)]

    # -- the round -------------------------------------------------------------------------

    def intake(self, server_round: int) -> ReplyIntake:
        """The reply intake of ``server_round`` (the round ``configure_train`` opened)."""
        return ReplyIntake(
            server_round=server_round,
            summary=self.summaries[-1],
            binding=self.binding,
            terms=self.terms,
            charges=self.charges,
            selection=self.selection,
        )

    def run_round(
        self,
        server_round: int,
        grid: Grid,
        messages: list[Message],
        exchange: Exchange,
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Run ``configure_train``'s round with the round kind; the next global arrays (None:
        nothing applied) and the round's metrics."""
        intake = self.intake(server_round)
        kind: RoundKind = self.round_kind
        new = kind.run(
            RoundContext(
                server_round=server_round,
                grid=grid,
                messages=messages,
                intake=intake,
                exchange=exchange,
            )
        )
        return new, intake.metrics()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's one-exchange interface: take the replies of a plain round through the
        round's ``ReplyIntake`` and ``PlainRound.aggregate``.

        Raises:
            TypeError: the strategy runs secure rounds (six exchanges: ``start`` drives them).
        """
        if not isinstance(self.round_kind, PlainRound):
            raise TypeError("a secure round has six exchanges: run it with start()")
        intake = self.intake(server_round)
        new = self.round_kind.aggregate(intake, replies)
        return new, intake.metrics()

    # -- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What selection and binding carry from one round to the next, as JSON-ready values
        (the round kind's own state: ``round_kind.state_dict``)."""
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
            "PrismStrategy(modules=%d, head=%d, sites/round=%d, %s)",
            len(self.modules),
            len(self.head),
            self.selection.sites_per_round,
            self.round_kind.describe(),
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        on_round_end: RoundEndFn | None = None,
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


def plain_round(
    run: RunConfig,
    *,
    modules: list[str],
    head: list[str],
    terms: RunTerms,
    central: CentralStep | None = None,
) -> PlainRound:
    """The plain round kind of ``run``: its update checker (the bound of the sites' own
    ``TrainConfig``, ``UpdateBound.for_run``) and streaming aggregator, in the run's mode;
    ``central``: the coordinator's step (``step-at = coordinator``)."""
    return PlainRound.of(
        modules=modules,
        head=head,
        mode="tangent" if run.method == "prism" else "factor-average",
        terms=terms,
        update_bound=UpdateBound.for_run(run),
        server_lr=run.server_lr,
        lr_schedule=run.server_lr_schedule,
        num_rounds=run.num_rounds,
        aggregation=run.aggregation,
        min_sites=run.min_sites,
        central=central,
    )
