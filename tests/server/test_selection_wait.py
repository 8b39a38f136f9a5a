"""``Selection.nodes`` (waiting for sites) on a clock the test controls, and the seeded choice.
Times are exact: the fake clock moves only when the code sleeps."""

from __future__ import annotations

import logging
import random

import pytest

import server.strategy.selection as selection
from server.errors import SitesUnavailableError
from server.strategy.selection import Selection


class _Clock:
    """``time.monotonic`` and ``time.sleep`` of a clock that moves only by sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _Grid:
    """Node ids connected from a given time on (seconds after the first call)."""

    def __init__(self, clock: _Clock, arrivals: dict[int, float]) -> None:
        self.clock, self.arrivals, self.start = clock, arrivals, clock.now

    def get_node_ids(self) -> list[int]:
        waited = self.clock.now - self.start
        return [n for n, t in self.arrivals.items() if t <= waited]


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(selection, "time", fake)
    return fake


def _selection(**changes) -> Selection:
    values = {
        "ledger": None,
        "run_id": "run",
        "local_steps": 1,
        "sites_per_round": 3,
        "min_sites": 2,
        "seed": 7,
        "wait_for_nodes": 3.0,
        "connect_timeout": 5.0,
    }
    values.update(changes)
    return Selection(**values)


def test_all_sites_at_once_returns_without_waiting(clock):
    assert _selection().nodes(_Grid(clock, {3: 0, 1: 0, 2: 0})) == [1, 2, 3]
    assert clock.sleeps == []


def test_it_polls_once_a_second_until_sites_per_round_are_connected(clock, caplog):
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        nodes = _selection().nodes(_Grid(clock, {1: 0, 2: 1, 3: 2}))
    assert nodes == [1, 2, 3]
    assert clock.sleeps == [1.0, 1.0]
    assert "waiting for sites: 1 connected, want 3" in caplog.text
    assert "waiting for sites: 2 connected, want 3" in caplog.text


def test_min_sites_go_ahead_only_after_more_than_wait_for_nodes_seconds(clock):
    nodes = _selection().nodes(_Grid(clock, {1: 0, 2: 0}))
    assert nodes == [1, 2]
    assert clock.now - 1000.0 == 4.0  # at 3 s (= wait-for-nodes) it still waits
    assert clock.sleeps == [1.0] * 4


def test_min_sites_is_enough_but_fewer_is_not(clock):
    assert _selection(min_sites=2, connect_timeout=100).nodes(_Grid(clock, {1: 0, 2: 0})) == [1, 2]
    clock.sleeps.clear()
    with pytest.raises(SitesUnavailableError):
        _selection(min_sites=3, sites_per_round=4).nodes(_Grid(clock, {1: 0, 2: 0, 3: 9}))


def test_fewer_than_min_sites_stop_after_more_than_connect_timeout_seconds(clock):
    with pytest.raises(SitesUnavailableError) as info:
        _selection().nodes(_Grid(clock, {1: 0}))
    assert clock.now - 1000.0 == 6.0  # at 5 s (= connect-timeout) it still waits
    assert str(info.value) == (
        "1 of min-sites=2 sites connected after 5 s (connect-timeout): start more sites "
        "(SuperNodes) or lower min-sites, then run again: applied rounds resume from the "
        "checkpoint."
    )


def test_a_site_arriving_at_the_connect_timeout_is_still_taken(clock):
    assert _selection(wait_for_nodes=100).nodes(_Grid(clock, {1: 0, 2: 5, 3: 5})) == [1, 2, 3]


def test_the_choice_is_the_run_seeds_draw():
    eligible = list(range(10, 30))
    chosen = [_selection(seed=11).choose(eligible) for _ in range(2)]
    expected = random.Random(11).sample(eligible, 3)
    assert chosen == [expected, expected]
    assert _selection(seed=12).choose(eligible) != expected
    assert sorted(_selection(sites_per_round=5).choose([4, 2])) == [2, 4]
