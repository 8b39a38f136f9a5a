"""The round loop of ``PrismStrategy.start``: configure, run the round, evaluate, checkpoint.

Each round: ``configure_train`` chooses the sites and builds their messages, the strategy's
round kind runs the round (``server.strategy.contract``: a plain or a secure round, replies
streamed by ``server.strategy.transport``), the coordinator evaluates the new arrays if asked,
and ``on_round_end`` runs (the coordinator checkpoints there).

Reproducibility: the sums are added in arrival order, and float64 addition is not associative,
so a resumed or re-run round whose replies arrive in another order can differ from the first
attempt at float64 rounding only: relative ~1e-16 of the sums, which the float32 cast of the
mean hides except where it flips the last float32 bit. The validation of each reply, which
replies are accepted, the ledger's charges and the min-sites check do not depend on the order
(the round summary lists sites in arrival order). With every reply already there when the round
is pulled (a loopback grid), the order is that of the node ids, so such runs repeat bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy.result import Result

from prism_runtime.faults import NO_FAULTS, Faults
from server.strategy.rounds import RoundSummary
from server.strategy.transport import POLL_INTERVAL_S, PULL_BATCH, Exchange

__all__ = ["EvaluateFn", "RoundEndFn", "Rounds", "run_rounds"]

log = logging.getLogger("server.strategy")

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
"""``evaluate_fn(round, arrays)``: the coordinator's metrics of the round's arrays, or None."""
RoundEndFn = Callable[[int, ArrayRecord, RoundSummary, Result], None]
"""``on_round_end(round, arrays, summary, result)``: runs after each round."""


class Rounds(Protocol):
    """What the loop drives (``PrismStrategy``)."""

    summaries: list[RoundSummary]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def run_round(
        self,
        server_round: int,
        grid: Grid,
        messages: list[Message],
        exchange: Exchange,
    ) -> tuple[ArrayRecord | None, MetricRecord]: ...


def run_rounds(
    strategy: Rounds,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_fn: EvaluateFn | None = None,
    on_round_end: RoundEndFn | None = None,
    first_round: int = 1,
    previous: Result | None = None,
    pull_batch: int = PULL_BATCH,
    poll_interval: float = POLL_INTERVAL_S,
    faults: Faults = NO_FAULTS,
) -> Result:
    """The round loop of ``PrismStrategy.start``: configure, run the round with the strategy's
    round kind (``Rounds.run_round``), evaluate on the coordinator, call ``on_round_end``.

    A resumed run passes ``first_round`` (the round after its checkpoint), the checkpointed
    global arrays as ``initial_arrays`` and the metrics so far as ``previous``; the strategy
    state comes from ``load_state_dict``. ``on_round_end(round, arrays, summary, result)``
    runs after each round (the coordinator checkpoints there). ``pull_batch`` and
    ``poll_interval``: see ``server.strategy.transport.stream_replies``. ``faults``: crash
    points for tests (``round-start``, and ``mid-aggregation`` in ``stream_replies``).
    """
    exchange = Exchange(timeout, pull_batch, poll_interval, faults)
    result = Result() if previous is None else previous
    result.arrays = initial_arrays
    arrays = initial_arrays
    if evaluate_fn is not None and first_round == 1:
        metrics = evaluate_fn(0, arrays)
        if metrics is not None:
            result.evaluate_metrics_serverapp[0] = metrics
    for server_round in range(first_round, num_rounds + 1):
        started = time.monotonic()
        messages = list(strategy.configure_train(server_round, arrays, train_config, grid))
        if not messages:
            log.info("round %d: no site can continue within its cap; ending the run", server_round)
            break
        faults.reach("round-start", server_round)
        new_arrays, metrics = strategy.run_round(server_round, grid, messages, exchange)
        del messages  # the grid has them; the broadcast arrays live on in ``arrays``
        log.info(
            "round %d: sent, answered and aggregated in %.2f s",
            server_round,
            time.monotonic() - started,
        )
        if new_arrays is not None:
            arrays = result.arrays = new_arrays
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        if evaluate_fn is not None:
            eval_metrics = evaluate_fn(server_round, arrays)
            if eval_metrics is not None:
                result.evaluate_metrics_serverapp[server_round] = eval_metrics
        if on_round_end is not None:
            on_round_end(server_round, arrays, strategy.summaries[-1], result)
    return result
