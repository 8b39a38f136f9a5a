"""The plain round: one exchange, each site's noisy update streamed into a weighted mean.

PRISM (``mode="tangent"``): every site of a round starts from the same broadcast point
``Z_t = A B.T``, so their tangent updates live in one vector space and the weighted mean of the
lifts IS the weighted mean of the ``dZ_k`` (the map ``(dA, dB) -> dA B.T + A dB.T`` is linear).
The server then takes ``Retr_r(Z_t + eta_s * mean dZ)`` (QR + 2r x 2r SVD, full rank r kept).
With ``step-at = coordinator`` each reply is one noisy gradient at the broadcast point instead,
and the server step is PRISM's adaptive step on their weighted mean
(``server.strategy.central.CentralStep.apply_mean``). Baselines (``mode="factor-average"``):
FedIT-style FedAvg of ``A`` and ``B`` separately (inexact: ``mean(A) mean(B).T !=
mean(A B.T)``), used with factor-space DP or FFA on the sites.

Replies are consumed one at a time as they are pulled (``server.strategy.transport``) and none
is kept after it is summed, so coordinator memory does not grow with the number of sites. Each
reply goes through the round's ``ReplyIntake`` (facts checked and charged); its update is then
checked (``UpdateChecker``: keys, shapes, values, the honest norm bound) and added to the
``StreamingAggregator``. No NaN or Inf can reach the global adapter: the replies, their mean and
the retracted result are all checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, Message
from torch import Tensor

from prism_core.aggregation import Aggregation
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import UPDATE
from server.strategy.aggregator import Mode, StreamingAggregator
from server.strategy.bounds import UpdateBound, UpdateChecker
from server.strategy.central import CentralStep
from server.strategy.contract import RoundContext
from server.strategy.intake import ReplyIntake
from server.strategy.replies import RunTerms
from server.strategy.transport import stream_replies

__all__ = ["PlainRound"]

log = logging.getLogger("server.strategy")


class PlainRound:
    """One exchange per round, the weighted mean of the checked updates, the server step.

    Args:
        checker: what an honest update can be (``UpdateChecker``).
        aggregator: the weighted streaming sums and the server step (``StreamingAggregator``).
        min_sites: the fewest accepted updates a round applies (run-config ``min-sites``).
        central: the coordinator's step (``step-at = coordinator``; the aggregator's
            ``central``), whose moments are the round kind's state.
    """

    def __init__(
        self,
        *,
        checker: UpdateChecker,
        aggregator: StreamingAggregator,
        min_sites: int,
        central: CentralStep | None = None,
    ) -> None:
        self.checker, self.aggregator, self.min_sites = checker, aggregator, min_sites
        self.central = central

    @classmethod
    def of(
        cls,
        *,
        modules: list[str],
        head: list[str],
        mode: Mode,
        terms: RunTerms,
        update_bound: UpdateBound | None,
        server_lr: float,
        lr_schedule: str,
        num_rounds: int,
        aggregation: Aggregation,
        min_sites: int,
        central: CentralStep | None = None,
    ) -> PlainRound:
        """The round's checker and aggregator over ``modules`` and ``head`` in ``mode``, with
        the steps, dp and b of ``terms`` (``server.strategy.core.plain_round`` reads the rest
        from a run config); with ``central`` the replies are noisy gradients and the
        coordinator takes PRISM's step (``step-at = coordinator``)."""
        return cls(
            checker=UpdateChecker(
                modules=modules,
                head=head,
                mode=mode,
                local_steps=terms.local_steps,
                update_bound=update_bound,
                gradient=central is not None,
            ),
            aggregator=StreamingAggregator(
                modules=modules,
                head=head,
                mode=mode,
                server_lr=server_lr,
                lr_schedule=lr_schedule,
                num_rounds=num_rounds,
                aggregation=aggregation,
                dp=terms.dp,
                expected_batch_size=terms.expected_batch_size,
                central=central,
            ),
            min_sites=min_sites,
            central=central,
        )

    def begin(self, server_round: int, broadcast: dict[str, Tensor]) -> None:
        """Start a round at the broadcast arrays: the bound's reference, empty sums."""
        self.checker.begin_round(server_round, broadcast)
        self.aggregator.begin_round(broadcast)

    def run(self, round_: RoundContext) -> ArrayRecord | None:
        """Send the round's messages and aggregate the replies as they arrive."""
        replies = stream_replies(
            round_.grid,
            round_.messages,
            timeout=round_.exchange.timeout,
            pull_batch=round_.exchange.pull_batch,
            poll_interval=round_.exchange.poll_interval,
            server_round=round_.server_round,
            faults=round_.exchange.faults,
        )
        return self.aggregate(round_.intake, replies)

    def aggregate(self, intake: ReplyIntake, replies: Iterable[Message]) -> ArrayRecord | None:
        """Take every reply through ``intake`` into the running sums; apply the mean if at
        least ``min_sites`` updates were accepted (else the global adapter stays)."""
        for msg in replies:
            intake.take(msg, self.handle)
            del msg  # the reply is summed: drop it before the next one is pulled
        intake.charge_unanswered()
        summary = intake.summary
        if len(summary.accepted) < self.min_sites:  # >= 1: every accepted weight is > 0
            log.warning(
                "round %d: %d valid updates < min-sites=%d; global adapter unchanged",
                intake.server_round,
                len(summary.accepted),
                self.min_sites,
            )
            return None
        new = self.aggregator.finish(summary)
        if new is None:
            return None
        summary.applied = True
        return ArrayRecord(new)

    def handle(self, site: str, facts: ReplyFacts, msg: Message) -> Callable[[], None]:
        """Check the reply's update against the honest bound; return what adds it, weighted."""
        update = self.checker.validate(msg.content.get(UPDATE), facts)
        weight = self.aggregator.weight(facts)
        noise = self.aggregator.noise_std(facts)
        return lambda: self.aggregator.add(update, weight, noise)

    def describe(self) -> str:
        aggregator = self.aggregator
        central = self.central
        step = "" if central is None else f", step-at=coordinator (lr={central.lr})"
        return (
            f"mode={aggregator.mode}, min-sites={self.min_sites}, "
            f"server-lr={aggregator.server_lr} {aggregator.lr_schedule}{step}"
        )

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The coordinator's step's moments (``CentralStep.state_dict``); nothing when the sites
        step (``server.optimizer.server_step`` is stateless)."""
        central = self.central
        return ({} if central is None else central.state_dict()), {}

    def load_state_dict(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        central = self.central
        if central is not None:
            central.load_state_dict(dict(tensors))
