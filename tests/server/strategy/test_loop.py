"""The round loop (``server/strategy/loop.py``).

On a clock the test controls: when it polls and sleeps, when it stops at the timeout, the
order it pulls in, the crash points it reaches, what it evaluates and keeps in the
``Result``, and its log lines. The grid and the strategy are small fakes: the clock moves
only when the loop sleeps, a reply reaches the grid at a set time after the push, and both
fakes fail a loop that never ends (a bounded number of pulls and sleeps) instead of
hanging.

Through Flower's own ``InMemoryGrid`` (``helpers.grids.FlowerSites``) and the real strategy:
the loop aggregates replies as they arrive, holds a bounded number of them, ignores
replies after the timeout and still enforces min-sites and the ledger charges."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp.strategy.result import Result
from flwr.supercore.task_identity import TaskIdentity
from helpers.grids import Arrival, FlowerSites
from helpers.points import random_point
from reply_facts import honest_facts
from strategy_helpers import strategy_for

import server.strategy.loop as loop
import server.strategy.transport as transport
from prism_runtime.faults import Faults
from prism_runtime.protocol import ACCOUNTING, CONFIG, UPDATE, key
from server.ledger import Ledger
from server.strategy.loop import run_rounds
from server.strategy.transport import stream_replies

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
    monkeypatch.setattr(transport, "time", fake)
    return fake


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


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


@dataclass
class Summary:
    server_round: int


class Strategy:
    """Asks ``nodes`` in every round up to ``last_round`` and none after; runs each round as a
    plain round does (its replies streamed by ``stream_replies`` with the loop's timeout, poll
    and crash points); each round's new arrays are ``f"after-{round}"`` (None in ``unchanged``
    rounds), its metrics ``{"n": replies}``."""

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

    def run_round(
        self, server_round, grid, messages, *, timeout, pull_batch, poll_interval, faults
    ):
        replies = stream_replies(
            grid,
            messages,
            timeout=timeout,
            pull_batch=pull_batch,
            poll_interval=poll_interval,
            server_round=server_round,
            faults=faults,
        )
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


# -- through Flower's InMemoryGrid and the real strategy ---------------------------------------


MODULES = ["layer.0.q", "layer.0.v"]
M, N, R = 12, 10, 3
TAU = 2


@pytest.fixture
def superlink_identity():
    """The task identity of the coordinator in Flower's simulation: the SuperLink's node id."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    yield
    TaskIdentity.node_id = 0


def _global():
    arrays = {}
    for i, module in enumerate(MODULES):
        A, B = random_point(M, N, R, i, dtype=torch.float32)
        arrays[key(module, "A")], arrays[key(module, "B")] = A, B
    return arrays


def _update(index, scale=0.01):
    g = torch.Generator().manual_seed(100 + index)
    out = {}
    for module in MODULES:
        out[key(module, "dA")] = scale * torch.randn(M, R, generator=g)
        out[key(module, "dB")] = scale * torch.randn(N, R, generator=g)
    return out


def _reply(index, request, update=None):
    """Site ``index``'s honest reply; sigma differs per site so inverse-noise weights differ."""
    facts = honest_facts(
        f"site-{index}", request.content[CONFIG], sigma=1.0 + 0.37 * index, steps=TAU
    )
    arrays = _update(index) if update is None else update
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def _strategy(folder, sites, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(folder / "ledger.sqlite")
    params = dict(sites_per_round=sites, local_steps=TAU, target_epsilon=100.0)
    params.update(kw)
    return strategy_for(modules=MODULES, ledger=ledger, **params), ledger


def _charges(ledger):
    return sorted((e.site_id, e.round, e.steps, e.sigma, e.confirmed) for e in ledger.events())


@pytest.mark.usefixtures("superlink_identity")
@pytest.mark.parametrize("pull_batch", [1, 3, 6])
def test_replies_aggregated_as_they_arrive_equal_the_all_at_once_aggregate(tmp_path, pull_batch):
    """Six sites whose replies reach the grid in three batches, the last sites first: the
    streamed aggregate equals that of all replies at once in site order within float64
    rounding (the float32 result: 4 ulps of its largest entry), with the same charges."""
    sites = 6
    arrive = {i: Arrival(pulls=10 * (2 - i // 2)) for i in range(sites)}  # 20,20,10,10,0,0
    grid = FlowerSites(sites, _reply, lambda i: arrive[i])
    strategy, ledger = _strategy(tmp_path / "stream", sites)
    glob = _global()
    result = run_rounds(
        strategy,
        grid,
        ArrayRecord(glob),
        num_rounds=1,
        timeout=60.0,
        train_config=ConfigRecord(),
        pull_batch=pull_batch,
        poll_interval=0.0,
    )
    batches = [b for b in grid.pulled if b]
    assert len(batches) >= 3  # the replies did come in several pulls
    first = {grid.node_ids.index(n) for n in batches[0]}
    assert first <= {4, 5}  # the last sites' replies arrived, and were summed, first
    (summary,) = strategy.summaries
    assert sorted(summary.accepted) == [f"site-{i}" for i in range(sites)] and summary.applied

    reference, ref_ledger = _strategy(tmp_path / "all", sites)
    node_grid = FlowerSites(sites, _reply)  # only for its node ids
    requests = reference.configure_train(1, ArrayRecord(glob), ConfigRecord(), node_grid)
    by_node = {r.metadata.dst_node_id: r for r in requests}
    replies = [_reply(i, by_node[n]) for i, n in enumerate(node_grid.node_ids)]
    expected, _ = reference.aggregate_train(1, replies)

    got = result.arrays.to_torch_state_dict()
    for name, want in expected.to_torch_state_dict().items():
        tol = 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
        torch.testing.assert_close(got[name], want, rtol=0.0, atol=tol)
    assert _charges(ledger) == _charges(ref_ledger)


@pytest.mark.usefixtures("superlink_identity")
def test_the_loop_holds_one_reply_at_a_time_where_send_and_receive_holds_all(tmp_path):
    """Peak number of pulled replies alive at once (weak references to their ArrayRecords):
    ``pull_batch`` with the streaming loop, every reply with Flower's ``send_and_receive``."""
    sites = 8
    glob = ArrayRecord(_global())
    for pull_batch in (1, 3):
        grid = FlowerSites(sites, _reply)
        strategy, _ = _strategy(tmp_path / f"stream-{pull_batch}", sites)
        run_rounds(
            strategy,
            grid,
            glob,
            num_rounds=2,
            timeout=60.0,
            train_config=ConfigRecord(),
            pull_batch=pull_batch,
        )
        assert [len(s.accepted) for s in strategy.summaries] == [sites, sites]
        assert grid.peak_held == pull_batch
        assert grid.held() == 0  # nothing of any reply is kept after the rounds

    grid = FlowerSites(sites, _reply)
    strategy, _ = _strategy(tmp_path / "collect", sites)
    messages = strategy.configure_train(1, glob, ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages, timeout=60.0))  # Flower's collect-all path
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None and grid.peak_held == sites


@pytest.mark.usefixtures("superlink_identity")
def test_a_reply_after_the_timeout_is_ignored_and_its_site_charged_unconfirmed(tmp_path):
    """Site 2 answers only after the round timed out: the round goes on with the other two, the
    late reply waits in the LinkState and is never pulled, not even by the next round."""
    sites, late = 3, {"ready": False}

    def arrival(index):
        return Arrival() if index != 2 or late["ready"] else None

    grid = FlowerSites(sites, _reply, arrival)
    strategy, ledger = _strategy(tmp_path, sites)
    glob = ArrayRecord(_global())
    run_rounds(strategy, grid, glob, num_rounds=1, timeout=0.2, train_config=ConfigRecord())
    late["ready"] = True
    grid.deliver()  # site 2's round-1 reply reaches the grid now, after the timeout
    assert grid.state.num_message_res() == 1
    late["ready"] = False  # and it is late again in round 2
    run_rounds(
        strategy,
        grid,
        glob,
        num_rounds=2,
        timeout=0.2,
        train_config=ConfigRecord(),
        first_round=2,
    )
    silent = f"node-{grid.node_ids[2]}"  # never answered in time: its site is unknown
    for summary in strategy.summaries:
        assert sorted(summary.accepted) == ["site-0", "site-1"] and summary.applied
        assert summary.rejected == [(silent, "no reply before the round timeout")]
        assert summary.unconfirmed == [silent]
    unconfirmed = [(e.site_id, e.round) for e in ledger.events() if not e.confirmed]
    assert unconfirmed == [(silent, 1), (silent, 2)]
    assert grid.state.num_message_res() == 1  # the late reply was never pulled


@pytest.mark.usefixtures("superlink_identity")
def test_stream_replies_stops_at_the_timeout_and_yields_what_arrived(tmp_path):
    """The generator alone: two of three sites answer; it returns after the timeout (with a
    generous bound for a loaded machine) having yielded exactly those two replies."""
    import time

    grid = FlowerSites(3, _reply, lambda i: None if i == 1 else Arrival())
    strategy, _ = _strategy(tmp_path, 3)
    messages = list(strategy.configure_train(1, ArrayRecord(_global()), ConfigRecord(), grid))
    t0 = time.monotonic()
    got = [m.metadata.src_node_id for m in stream_replies(grid, messages, timeout=0.3)]
    elapsed = time.monotonic() - t0
    assert sorted(got) == sorted([grid.node_ids[0], grid.node_ids[2]])
    assert 0.3 <= elapsed < 5.0


@pytest.mark.usefixtures("superlink_identity")
def test_min_sites_still_blocks_a_round_with_too_few_valid_streamed_replies(tmp_path):
    """Three sites, one with a malformed update: min-sites 3 keeps the adapter, min-sites 2
    applies it; all three are charged either way (the bad site spent its budget)."""

    def answer(index, request):
        bad = {key(MODULES[0], "dA"): torch.zeros(1)} if index == 1 else None
        return _reply(index, request, bad)

    glob = ArrayRecord(_global())
    outcomes = {}
    for min_sites in (3, 2):
        grid = FlowerSites(3, answer)
        strategy, ledger = _strategy(tmp_path / str(min_sites), 3, min_sites=min_sites)
        result = run_rounds(
            strategy, grid, glob, num_rounds=1, timeout=60.0, train_config=ConfigRecord()
        )
        (summary,) = strategy.summaries
        assert sorted(summary.accepted) == ["site-0", "site-2"]
        assert summary.rejected_by_reason == {"keys": 1}
        assert sorted(e.site_id for e in ledger.events() if e.confirmed) == [
            "site-0",
            "site-1",
            "site-2",
        ]
        outcomes[min_sites] = (summary.applied, result.arrays is glob)
    assert outcomes == {3: (False, True), 2: (True, False)}
