"""How the coordinator talks to the sites: push a round's messages, stream their replies.

Replies are streamed: ``stream_replies`` pushes the messages with ``Grid.push_messages`` and
pulls the replies with ``Grid.pull_messages``, ``pull_batch`` message ids at a time, yielding
each reply as soon as it is pulled and holding none once the consumer took it. Coordinator
memory is therefore flat in the number of sites: at most ``pull_batch`` replies are held at
once, against every reply of the round with ``Grid.send_and_receive``, which returns a list
(+82 MiB per site for a Gemma-3-4B adapter, docs/benchmarks.md). Timeout semantics are
``send_and_receive``'s: the clock starts after the push, pulling stops ``timeout`` seconds later
(after one last pass over the missing replies), and a reply that arrives after that is never
pulled (the site is a skipped site, charged as unconfirmed by the reply intake); missing replies
are logged.

Order: pending messages are polled in the order of their destination node ids, and replies
within one pull are sorted by ``in_order``; with every reply already there when a round is
pulled (a loopback grid) the order is that of the node ids, so such runs repeat bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from prism_runtime.faults import NO_FAULTS, Faults
from server.strategy.replies import in_order

__all__ = ["LIGHT_POLL_S", "POLL_INTERVAL_S", "PULL_BATCH", "Exchange", "send", "stream_replies"]

log = logging.getLogger("server.strategy")

PULL_BATCH = 1
"""Message ids per ``pull_messages`` call: the most replies the coordinator holds at once."""
POLL_INTERVAL_S = 1.0
"""Wait between polls when a pass over the pending messages found no reply."""
LIGHT_POLL_S = 0.05
"""Seconds between polls of an exchange the sites answer at once (milliseconds of work)."""


@dataclass(frozen=True)
class Exchange:
    """How every exchange of a round is pushed and pulled (``stream_replies``).

    Attributes:
        timeout: seconds each exchange waits for replies after its push.
        pull_batch: message ids per ``pull_messages`` call.
        poll_interval: wait between polls that found no reply.
        faults: crash points for tests (``prism_runtime.faults``).
    """

    timeout: float
    pull_batch: int = PULL_BATCH
    poll_interval: float = POLL_INTERVAL_S
    faults: Faults = NO_FAULTS


def send(
    grid: Grid,
    contents: dict[int, RecordDict],
    message_type: str,
    *,
    timeout: float | None,
    server_round: int,
    pull_batch: int = PULL_BATCH,
    poll_interval: float = POLL_INTERVAL_S,
    faults: Faults = NO_FAULTS,
) -> Iterator[Message]:
    """Send ``contents[node]`` to each node as a ``message_type`` message (in node order) and
    yield the replies as they arrive (``stream_replies``)."""
    messages = [
        Message(content=c, message_type=message_type, dst_node_id=n)
        for n, c in sorted(contents.items())
    ]
    return stream_replies(
        grid,
        messages,
        timeout=timeout,
        pull_batch=pull_batch,
        poll_interval=poll_interval,
        server_round=server_round,
        faults=faults,
    )


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
