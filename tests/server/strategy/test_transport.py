"""How the coordinator pushes a round's messages and streams their replies
(``server/strategy/transport.py``).

On a clock the test controls (``strategy.clocked``): when it polls and sleeps, when it stops at
the timeout, the order it pulls in, the crash point it reaches between the first two replies,
and its warnings."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from server.strategy.transport import stream_replies
from strategy.clocked import Clock, Grid, Recorder, requests, warnings_of


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
