"""The round loop of ``PrismStrategy.start``: configure, send, aggregate, evaluate, checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy.result import Result

from client.testhooks import pause_point
from server.strategy.replies import in_order

__all__ = ["run_rounds"]

log = logging.getLogger("server.strategy")


def run_rounds(
    strategy: Any,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord,
    evaluate_fn: Any = None,
    on_round_end: Any = None,
    first_round: int = 1,
    previous: Result | None = None,
) -> Result:
    """The round loop of ``PrismStrategy.start``: configure, send, aggregate in a fixed reply
    order, evaluate on the coordinator, call ``on_round_end``.

    A resumed run passes ``first_round`` (the round after its checkpoint), the checkpointed
    global arrays as ``initial_arrays`` and the metrics so far as ``previous``; the strategy
    state comes from ``load_state_dict``. ``on_round_end(round, arrays, summary, result)``
    runs after each round (the coordinator checkpoints there).
    """
    result = Result() if previous is None else previous
    result.arrays = initial_arrays
    arrays = initial_arrays
    if evaluate_fn is not None and first_round == 1:
        metrics = evaluate_fn(0, arrays)
        if metrics is not None:
            result.evaluate_metrics_serverapp[0] = metrics
    for server_round in range(first_round, num_rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, train_config, grid))
        if not messages:
            log.info("round %d: no site can continue within its cap; ending the run", server_round)
            break
        pause_point("round-start", server_round)
        replies = in_order(grid.send_and_receive(messages=messages, timeout=timeout))
        new_arrays, metrics = strategy.aggregate_train(
            server_round, _pausing(replies, server_round)
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


def _pausing(replies: list[Message], server_round: int) -> Iterable[Message]:
    """Yield the replies; the ``mid-aggregation`` test pause point sits after the first."""
    for index, msg in enumerate(replies):
        if index == 1:
            pause_point("mid-aggregation", server_round)
        yield msg
