"""The round loop (``server/strategy/loop.py``) on a clock the test controls: when it polls and
sleeps, when it stops at the timeout, the order it pulls in, the crash points it reaches, what it
evaluates and keeps in the ``Result``, and its log lines.

The grid and the strategy are small fakes (Flower's own grid is driven by
``test_strategy_loop.py``): the clock moves only when the loop sleeps, a reply reaches the grid at
a set time after the push, and both fakes fail a loop that never ends (a bounded number of pulls
and sleeps) instead of hanging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from flwr.serverapp.strategy.result import Result

import server.strategy.loop as loop
from prism_runtime.faults import Faults
from prism_runtime.protocol import ACCOUNTING
from server.strategy.loop import run_rounds, stream_replies

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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(loop, "time", fake)
    return fake


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- stream_replies ----------------------------------------------------------------------------


@pytest.mark.parametrize("pull_batch", [0, -1])
def test_a_pull_batch_below_one_is_refused(clock: Clock, pull_batch: int) -> None:
    grid = Grid(clock, {1: 0.0})
    with pytest.raises(ValueError, match=f"^pull_batch={pull_batch} must be >= 1$"):
        next(stream_replies(grid, requests(1), timeout=1.0, pull_batch=pull_batch))


def test_it_pulls_in_the_order_of_the_destination_nodes_not_of_the_ids(clock: Clock) -> None:
    grid = Grid(clock, {30: 0.0, 10: 0.0, 20: 0.0}, ids={10: "c", 20: "b", 30: "a"})
    got = [m.metadata.src_node_id for m in stream_replies(grid, requests(30, 10, 20), timeout=5.0)]
    assert grid.pulls == [["c"], ["b"], ["a"]]
    assert got == [10, 20, 30]


def test_pull_batch_ids_go_in_consecutive_slices_each_once(clock: Clock) -> None:
    grid = Grid(clock, {1: 0.0, 2: 0.0, 3: 0.0})
    got = list(stream_replies(grid, requests(1, 2, 3), timeout=5.0, pull_batch=2))
    assert grid.pulls == [["m1", "m2"], ["m3"]]
    assert len(got) == 3


def test_a_message_the_grid_could_not_push_is_warned_of_and_not_waited_for(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    grid = Grid(clock, {1: 0.0, 2: 0.0, 3: 0.0}, unpushable=(2,))
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        got = [m.metadata.src_node_id for m in stream_replies(grid, requests(1, 2, 3), timeout=5)]
    assert got == [1, 3]
    assert warnings_of(caplog) == ["1 of 3 messages could not be pushed"]
    assert clock.sleeps == []


def test_every_message_pushed_gives_no_warning(clock: Clock, caplog) -> None:
    grid = Grid(clock, {1: 0.0, 2: 0.0})
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        assert len(list(stream_replies(grid, requests(1, 2), timeout=5.0))) == 2
    assert warnings_of(caplog) == []


def test_it_sleeps_only_after_a_pass_that_found_nothing_and_never_past_the_deadline(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 1 at once, node 2 after 1.5 s, node 3 never; timeout 2.5 s, poll 1 s: passes at
    t = 0 (node 1), 0 (nothing: sleep 1), 1 (nothing: sleep 1), 2 (node 2), 2 (nothing: sleep
    min(1, 0.5)), 2.5 (the deadline: one last pass over node 3, then stop)."""
    grid = Grid(clock, {1: 0.0, 2: 1.5, 3: None})
    start = clock.now
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        got = [
            (m.metadata.src_node_id, clock.now - start)
            for m in stream_replies(
                grid, requests(1, 2, 3), timeout=2.5, poll_interval=1.0, server_round=7
            )
        ]
    assert got == [(1, 0.0), (2, 2.0)]
    assert clock.sleeps == [1.0, 1.0, 0.5]
    assert grid.pulls[-1] == ["m3"]  # the last pass at the deadline asked once more
    assert warnings_of(caplog) == [
        "round 7: 1 message(s) without a reply 2.5 s after sending; a later reply is ignored"
    ]


def test_a_pass_that_found_a_reply_is_followed_at_once_by_another(clock: Clock) -> None:
    """Node 1's reply comes at 0.5 s, node 2's at once; the consumer takes 0.6 s over node 2's:
    the next pass, without sleeping, finds node 1's."""
    grid = Grid(clock, {1: 0.5, 2: 0.0})
    got = []
    for msg in stream_replies(grid, requests(1, 2), timeout=5.0, poll_interval=1.0):
        got.append(msg.metadata.src_node_id)
        clock.now += 0.6  # aggregating the reply
    assert got == [2, 1]
    assert clock.sleeps == []
    assert grid.pulls == [["m1"], ["m2"], ["m1"]]


def test_a_reply_there_exactly_at_the_deadline_is_still_pulled(clock: Clock) -> None:
    grid = Grid(clock, {1: 2.0})
    got = list(stream_replies(grid, requests(1), timeout=2.0, poll_interval=1.0))
    assert len(got) == 1 and clock.sleeps == [1.0, 1.0]


def test_without_a_timeout_it_waits_as_long_as_the_replies_take(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    grid = Grid(clock, {1: 0.0, 2: 7.0})
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        got = [m.metadata.src_node_id for m in stream_replies(grid, requests(1, 2), timeout=None)]
    assert got == [1, 2]
    assert clock.sleeps == [1.0] * 7  # the default poll interval
    assert warnings_of(caplog) == []


def test_a_missing_reply_outside_a_round_is_logged_as_round_0(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    grid = Grid(clock, {1: None})
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        assert list(stream_replies(grid, requests(1), timeout=0.5, poll_interval=0.2)) == []
    assert clock.sleeps == [0.2, 0.2, pytest.approx(0.1)]
    assert warnings_of(caplog) == [
        "round 0: 1 message(s) without a reply 0.5 s after sending; a later reply is ignored"
    ]


def test_the_mid_aggregation_crash_point_is_reached_once_between_the_first_two_replies(
    clock: Clock,
) -> None:
    events: list[Any] = []
    grid = Grid(clock, {1: 0.0, 2: 0.0, 3: 0.0})
    for msg in stream_replies(
        grid, requests(1, 2, 3), timeout=5.0, server_round=4, faults=Recorder(events)
    ):
        events.append(msg.metadata.src_node_id)
    assert events == [1, ("mid-aggregation", 4), 2, 3]


# -- run_rounds ---------------------------------------------------------------------------------


@dataclass
class Summary:
    server_round: int


class Strategy:
    """Asks ``nodes`` in every round up to ``last_round`` and none after; each round's new arrays
    are ``f"after-{round}"`` (None in ``unchanged`` rounds), its metrics ``{"n": replies}``."""

    def __init__(
        self, nodes: tuple[int, ...], last_round: int = 99, unchanged: tuple[int, ...] = ()
    ) -> None:
        self.nodes, self.last_round, self.unchanged = nodes, last_round, unchanged
        self.summaries: list[Summary] = []
        self.asked: list[tuple[int, Any]] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.asked.append((server_round, arrays))
        if server_round > self.last_round:
            return []
        self.summaries.append(Summary(server_round))
        return requests(*self.nodes)

    def aggregate_train(self, server_round, replies):
        count = sum(1 for _ in replies)
        new = None if server_round in self.unchanged else f"after-{server_round}"
        return new, {"n": count}


def test_a_run_evaluates_the_start_and_every_round_and_keeps_what_it_returns(clock) -> None:
    evaluated: list[tuple[int, Any]] = []
    ended: list[tuple[Any, ...]] = []

    def evaluate(server_round, arrays):
        evaluated.append((server_round, arrays))
        return None if server_round == 2 else {"acc": server_round}

    strategy = Strategy((1, 2), unchanged=(2,))
    result = run_rounds(
        strategy,
        Grid(clock, {1: 0.0, 2: 0.0}),
        "initial",
        num_rounds=3,
        timeout=5.0,
        train_config={},
        evaluate_fn=evaluate,
        on_round_end=lambda *a: ended.append(a),
    )
    assert evaluated == [(0, "initial"), (1, "after-1"), (2, "after-1"), (3, "after-3")]
    assert result.evaluate_metrics_serverapp == {0: {"acc": 0}, 1: {"acc": 1}, 3: {"acc": 3}}
    assert result.train_metrics_clientapp == {1: {"n": 2}, 2: {"n": 2}, 3: {"n": 2}}
    assert result.arrays == "after-3"
    assert [a[:2] for a in ended] == [(1, "after-1"), (2, "after-1"), (3, "after-3")]
    assert all(a[2] is strategy.summaries[i] and a[3] is result for i, a in enumerate(ended))


def test_an_evaluation_of_the_start_that_returns_nothing_is_not_kept(clock) -> None:
    result = run_rounds(
        Strategy((1,)),
        Grid(clock, {1: 0.0}),
        "initial",
        num_rounds=1,
        timeout=5.0,
        train_config={},
        evaluate_fn=lambda r, a: None if r == 0 else {"acc": r},
    )
    assert result.evaluate_metrics_serverapp == {1: {"acc": 1}}


def test_a_resumed_run_goes_on_from_its_round_in_the_previous_result(clock) -> None:
    previous = Result()
    previous.evaluate_metrics_serverapp[0] = {"acc": 0}
    previous.train_metrics_clientapp[2] = {"n": 9}
    evaluated: list[int] = []
    strategy = Strategy((1,))
    result = run_rounds(
        strategy,
        Grid(clock, {1: 0.0}),
        "checkpoint",
        num_rounds=4,
        timeout=5.0,
        train_config={},
        evaluate_fn=lambda r, a: evaluated.append(r),
        first_round=3,
        previous=previous,
    )
    assert result is previous
    assert evaluated == [3, 4]  # the start (round 0) was evaluated by the first attempt
    assert [r for r, _ in strategy.asked] == [3, 4]
    assert strategy.asked[0][1] == "checkpoint"
    assert result.train_metrics_clientapp == {2: {"n": 9}, 3: {"n": 1}, 4: {"n": 1}}


def test_a_run_whose_sites_are_all_exhausted_ends_with_a_log_line(
    clock, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = Strategy((1,), last_round=1)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        result = run_rounds(
            strategy,
            Grid(clock, {1: 0.0}),
            "initial",
            num_rounds=5,
            timeout=5.0,
            train_config={},
        )
    assert [r for r, _ in strategy.asked] == [1, 2]
    assert result.arrays == "after-1"
    lines = [r.getMessage() for r in caplog.records]
    assert "round 2: no site can continue within its cap; ending the run" in lines


def test_the_loop_hands_its_round_timeout_poll_and_crash_points_to_each_round(
    clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 2 of a run: node 2 never answers within the 1 s timeout, polled every 0.25 s; the
    round-start point comes before the push, mid-aggregation between the two replies of node
    1 and 3; the round's log line gives its time on the clock."""
    events: list[Any] = []
    grid = Grid(clock, {1: 0.0, 2: None, 3: 0.0}, events=events)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        run_rounds(
            Strategy((1, 2, 3)),
            grid,
            "checkpoint",
            num_rounds=2,
            timeout=1.0,
            train_config={},
            first_round=2,
            poll_interval=0.25,
            faults=Recorder(events),
        )
    assert events == [("round-start", 2), "push", ("mid-aggregation", 2)]
    assert clock.sleeps == [0.25] * 4
    lines = [r.getMessage() for r in caplog.records]
    assert "round 2: 1 message(s) without a reply 1 s after sending; a later reply is ignored" in (
        lines
    )
    assert "round 2: sent, answered and aggregated in 1.00 s" in lines
