"""The round loop of ``PrismStrategy.start``: configure, send, aggregate as replies arrive,
evaluate, checkpoint.

Replies are streamed: the loop pushes a round's messages with ``Grid.push_messages`` and pulls
the replies with ``Grid.pull_messages``, ``pull_batch`` message ids at a time, handing each reply
to ``strategy.aggregate_train`` as soon as it is pulled and dropping it once it is added
(``StreamingAggregator`` keeps float64 running sums). Coordinator memory is therefore flat in
the number of sites: at most ``pull_batch`` replies are held at once, against every reply of
the round with ``Grid.send_and_receive``, which returns a list (+82 MiB per site for a
Gemma-3-4B adapter, docs/benchmarks.md). Timeout semantics are ``send_and_receive``'s: the clock
starts after the push, pulling stops ``timeout`` seconds later (after one last pass over the
missing replies, ``stream_replies``), and a reply that arrives after that is never pulled (the
site is a skipped site, charged as unconfirmed by the strategy); missing replies are logged.

Reproducibility: the sums are added in arrival order (pending messages are polled in the order
of their destination node ids), and float64 addition is not associative, so a resumed or re-run
round whose replies arrive in another order can differ from the first attempt at float64
rounding only: relative ~1e-16 of the sums, which the float32 cast of the mean hides except
where it flips the last float32 bit. The validation of each reply, which replies are accepted,
the ledger's charges and the min-sites check do not depend on the order (the round summary
lists sites in arrival order). With every reply already there when the round is pulled (a
loopback grid), the order is that of the node ids, so such runs repeat bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy.result import Result

from prism_runtime.faults import NO_FAULTS, Faults
from server.strategy.replies import in_order

__all__ = ["POLL_INTERVAL_S", "PULL_BATCH", "run_rounds", "stream_replies"]

log = logging.getLogger("server.strategy")

PULL_BATCH = 1
"""Message ids per ``pull_messages`` call: the most replies the coordinator holds at once."""
POLL_INTERVAL_S = 1.0
"""Wait between polls when a pass over the pending messages found no reply."""


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
    pull_batch: int = PULL_BATCH,
    poll_interval: float = POLL_INTERVAL_S,
    faults: Faults = NO_FAULTS,
) -> Result:
    """The round loop of ``PrismStrategy.start``: configure, send, aggregate the replies as
    they arrive (``stream_replies``), evaluate on the coordinator, call ``on_round_end``.

    A resumed run passes ``first_round`` (the round after its checkpoint), the checkpointed
    global arrays as ``initial_arrays`` and the metrics so far as ``previous``; the strategy
    state comes from ``load_state_dict``. ``on_round_end(round, arrays, summary, result)``
    runs after each round (the coordinator checkpoints there). ``pull_batch`` and
    ``poll_interval``: see ``stream_replies``. ``faults``: crash points for tests
    (``round-start``, and ``mid-aggregation`` in ``stream_replies``).
    """
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
        if getattr(strategy, "central", None) is not None:  # secure aggregation
            from server.strategy.secure import secure_round

            new_arrays, metrics = secure_round(
                strategy,
                grid,
                messages,
                server_round=server_round,
                timeout=timeout,
                poll_interval=poll_interval,
                faults=faults,
            )
        else:
            replies = stream_replies(
                grid,
                messages,
                timeout=timeout,
                pull_batch=pull_batch,
                poll_interval=poll_interval,
                server_round=server_round,
                faults=faults,
            )
            new_arrays, metrics = strategy.aggregate_train(server_round, replies)
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


def stream_replies(
    grid: Grid,
    messages: list[Message],
    *,
    timeout: float | None,
    pull_batch: int = PULL_BATCH,
    poll_interval: float = POLL_INTERVAL_S,
    server_round: int = 0,
    faults: Faults = NO_FAULTS,
) -> Iterator[Message]:
    """Push ``messages`` and yield their replies as they arrive, until all arrived or
    ``timeout`` seconds after the push (None: no limit), like ``Grid.send_and_receive``.

    Each pass pulls the pending message ids ``pull_batch`` at a time, in the order of their
    destination node ids, and yields each pulled reply (sorted by ``in_order`` within a pull)
    without keeping it: the consumer drops a reply once it is used, so at most ``pull_batch``
    replies are alive here at once. A pass that found nothing waits ``poll_interval`` seconds
    (never past the deadline). The first pass that starts at or after the deadline is the last:
    it pulls every pending id once more, so a reply that reached the grid before the deadline
    is aggregated even if the consumer was still busy with earlier ones then. Replies still
    missing after it are logged and never pulled: a later reply is ignored (the strategy charges
    the site as unconfirmed). The ``mid-aggregation`` crash point of ``faults``
    (``prism_runtime.faults``) sits after the first reply, before the second is yielded.

    The generator pushes on its first ``next``; the clock starts then.
    """
    if pull_batch < 1:
        raise ValueError(f"pull_batch={pull_batch} must be >= 1")
    order = _push(grid, messages)
    del messages
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = set(order)
    yielded = 0
    while waiting:
        final = deadline is not None and time.monotonic() >= deadline
        arrived = 0
        ids = [i for i in order if i in waiting]
        for start in range(0, len(ids), pull_batch):
            batch = deque(in_order(grid.pull_messages(ids[start : start + pull_batch])))
            while batch:
                msg = batch.popleft()
                if msg.metadata.reply_to_message_id in waiting:
                    waiting.discard(msg.metadata.reply_to_message_id)
                    arrived += 1
                if yielded == 1:
                    faults.reach("mid-aggregation", server_round)
                yielded += 1
                yield msg
                del msg  # the consumer is done with it: hold nothing while pulling the next
        if final:
            break
        if waiting and not arrived:
            wait = poll_interval
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            time.sleep(wait)
    if waiting:
        log.warning(
            "round %d: %d message(s) without a reply %s s after sending; a later reply is ignored",
            server_round,
            len(waiting),
            f"{timeout:g}",
        )


def _push(grid: Grid, messages: list[Message]) -> list[str]:
    """Push the messages; their ids in the order of their destination node ids."""
    sent = {str(i) for i in grid.push_messages(messages) if i}
    node = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    if len(sent) < len(messages):
        log.warning(
            "%d of %d messages could not be pushed", len(messages) - len(sent), len(messages)
        )
    return sorted(sent, key=lambda i: (node.get(i, 0), i))
