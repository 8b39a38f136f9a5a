"""Test helper: a clock the test controls and a small fake grid on it, for the transport's
and the round loop's timing tests.

The clock moves only when the code under test sleeps; a reply reaches the fake grid at a set
time after the push; both fail a loop that never ends (a bounded number of pulls and sleeps)
instead of hanging. The ``clock`` fixture (``conftest.py`` beside) puts the clock in place of
the ``time`` of ``server.strategy.loop`` and ``server.strategy.transport``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from prism_runtime.faults import Faults
from prism_runtime.protocol import ACCOUNTING

MAX_CALLS = 500  # pulls or sleeps: far more than any of these rounds needs


class Clock:
    """``time.monotonic`` and ``time.sleep`` of a clock that moves only by sleeping."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        assert len(self.sleeps) < MAX_CALLS, "the loop never ends"
        self.now += seconds


@dataclass
class Meta:
    dst_node_id: int = 0
    src_node_id: int = 0
    message_id: str = ""
    reply_to_message_id: str = ""


@dataclass
class Msg:
    """What the loop and ``in_order`` read of a Flower ``Message``."""

    metadata: Meta
    content: dict[str, Any] = field(default_factory=dict)

    def has_error(self) -> bool:
        return False


class Grid:
    """A grid whose node ``n`` answers ``arrival[n]`` seconds after the push (None: never).

    Pushed messages get the ids ``ids[n]`` (default: ``m<n>``); a node in ``unpushable`` gets
    an empty id, as a grid that could not push it. Every pull's ids are recorded.
    """

    def __init__(
        self,
        clock: Clock,
        arrival: dict[int, float | None],
        ids: dict[int, str] | None = None,
        unpushable: tuple[int, ...] = (),
        events: list[Any] | None = None,
    ) -> None:
        self.clock, self.arrival, self.unpushable = clock, arrival, unpushable
        self.ids = ids or {n: f"m{n}" for n in arrival}
        self.pulls: list[list[str]] = []
        self.events = [] if events is None else events
        self.pending: dict[str, tuple[int, float]] = {}

    def push_messages(self, messages: list[Msg]) -> list[str]:
        self.events.append("push")
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.unpushable:
                out.append("")
                continue
            msg.metadata.message_id = self.ids[node]
            self.pending[self.ids[node]] = (node, self.clock.now)
            out.append(self.ids[node])
        return out

    def pull_messages(self, message_ids: list[str]) -> list[Msg]:
        self.pulls.append(list(message_ids))
        assert len(self.pulls) < MAX_CALLS, "the loop never ends"
        replies = []
        for mid in message_ids:
            node, pushed = self.pending.get(mid, (0, 0.0))
            after = self.arrival.get(node)
            if mid in self.pending and after is not None and self.clock.now - pushed >= after:
                del self.pending[mid]
                meta = Meta(src_node_id=node, reply_to_message_id=mid)
                replies.append(Msg(meta, {ACCOUNTING: {"site-id": f"site-{node}"}}))
        return replies


class Recorder(Faults):
    """Crash points reached, in order, in a list shared with the consumer of the replies."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def reach(self, point: str, server_round: int) -> None:
        self.events.append((point, server_round))


def requests(*nodes: int) -> list[Msg]:
    return [Msg(Meta(dst_node_id=n)) for n in nodes]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
