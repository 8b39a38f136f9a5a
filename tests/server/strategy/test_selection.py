"""Which sites a round asks (``server.strategy.selection``).

``Selection.eligible`` on a real SQLite ledger: a site refused once is never asked again
in the run, a re-run round decides against the ledger as it stood before that round, a
non-DP site and a site with no mechanism yet are always eligible. The caps are set from
``prism_core.accounting.epsilon`` of the exact histories, halfway between the two answers
a test tells apart.

``Selection.nodes`` (waiting for sites) on a clock the test controls, and the seeded
choice. Times are exact: the fake clock moves only when the code sleeps."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from ledger_events import ledger_event

import server.strategy.selection as selection
from prism_core.accounting import epsilon
from prism_core.records import PrivacyEvent
from server.errors import SitesUnavailableError
from server.ledger import Ledger
from server.strategy.selection import Selection

RUN = "run-1"
DELTA = 1e-5
SIGMA, Q, STEPS = 1.1, 0.05, 30


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def selection_on(ledger: Ledger) -> Selection:
    return Selection(
        ledger=ledger,
        run_id=RUN,
        local_steps=STEPS,
        sites_per_round=2,
        min_sites=1,
        seed=3,
        wait_for_nodes=0.0,
        connect_timeout=1.0,
    )


def charge(ledger: Ledger, site: str, rnd: int, run_id: str = RUN) -> None:
    ledger.append(
        ledger_event(
            run_id=run_id,
            round=rnd,
            site_id=site,
            sigma=SIGMA,
            q=Q,
            steps=STEPS,
            delta=DELTA,
            epsilon_cap=100.0,
            rng="os-csprng",
        )
    )


def eps_after(rounds: int) -> float:
    """The PRV epsilon of ``rounds`` rounds of the test's mechanism."""
    return epsilon([PrivacyEvent(SIGMA, Q, STEPS)] * rounds, DELTA)


def between(rounds: int) -> float:
    """A cap that ``rounds`` rounds keep and ``rounds + 1`` exceed."""
    low, high = eps_after(rounds), eps_after(rounds + 1)
    assert high > low * 1.01, (low, high)  # far enough apart to tell the two answers apart
    return (low + high) / 2


def test_a_site_with_no_mechanism_yet_is_eligible_whatever_its_history(ledger: Ledger) -> None:
    for rnd in (1, 2, 3):
        charge(ledger, "a", rnd)
    sel = selection_on(ledger)
    assert sel.eligible("a", 4) is True
    assert sel.exhausted == set()


def test_a_non_dp_site_is_eligible_even_past_any_cap(ledger: Ledger) -> None:
    for rnd in (1, 2, 3):
        charge(ledger, "a", rnd)
    sel = selection_on(ledger)
    sel.site_mechanism["a"] = (0.0, Q, 0.01, DELTA)  # sigma 0: a non-DP run, nothing to enforce
    assert sel.eligible("a", 4) is True
    assert sel.exhausted == set()


def test_a_site_whose_next_round_exceeds_its_cap_is_exhausted_for_the_rest_of_the_run(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    for rnd in (1, 2):
        charge(ledger, "a", rnd)
    sel = selection_on(ledger)
    sel.site_mechanism["a"] = (SIGMA, Q, between(2), DELTA)  # two rounds fit, a third does not
    sel.site_mechanism["b"] = (SIGMA, Q, between(2), DELTA)  # no history: its round fits
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        assert sel.eligible("a", 3) is False
        assert sel.eligible("b", 3) is True
    assert sel.exhausted == {"a"}
    lines = [r.getMessage() for r in caplog.records if r.name == "server.strategy"]
    assert lines == ["site a: next round would exceed its cap; no longer selected"]
    # a later mechanism that would fit does not bring an exhausted site back
    sel.site_mechanism["a"] = (SIGMA * 100, Q, 1e6, DELTA)
    assert sel.eligible("a", 4) is False


def test_a_re_run_round_decides_against_the_ledger_before_that_round(ledger: Ledger) -> None:
    # rounds 1 and 2 ran; round 2 is re-run after a crash: its events are in the ledger already
    for rnd in (1, 2):
        charge(ledger, "a", rnd)
    charge(ledger, "a", 2, run_id="other-run")  # another run's round 2 counts in full
    sel = selection_on(ledger)
    # history before round 2 of this run: round 1 and the other run's round 2 (2 rounds), plus
    # the round itself: 3 rounds fit; with the round's own events counted again: 4, too many
    sel.site_mechanism["a"] = (SIGMA, Q, between(3), DELTA)
    assert sel.eligible("a", 2) is True
    assert sel.exhausted == set()
    # the next round is a new one: all three rounds in the ledger count, plus one: 4
    assert sel.eligible("a", 3) is False
    assert sel.exhausted == {"a"}


def test_a_re_run_of_the_first_round_sees_only_the_other_runs(ledger: Ledger) -> None:
    charge(ledger, "a", 1)  # this run's round 1, about to be re-run
    charge(ledger, "a", 1, run_id="other-run")
    sel = selection_on(ledger)
    sel.site_mechanism["a"] = (SIGMA, Q, between(2), DELTA)  # other run + this round: 2 fit
    assert sel.eligible("a", 1) is True
    sel.site_mechanism["a"] = (SIGMA, Q, between(1), DELTA)  # only 1 fits: the other run's
    assert sel.eligible("a", 1) is False


# -- waiting for sites and the seeded choice ---------------------------------------------------


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
