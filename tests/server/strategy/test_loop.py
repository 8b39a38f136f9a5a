"""The round loop (``server/strategy/loop.py``).

On a clock the test controls (``strategy.clocked``): the crash points it reaches, what it
evaluates and keeps in the ``Result``, and its log lines. The grid and the strategy are small
fakes; the strategy runs each round as a plain round does (``stream_replies``).

Through Flower's own ``InMemoryGrid`` (``helpers.grids.FlowerSites``) and the real strategy:
the loop aggregates replies as they arrive, holds a bounded number of them, ignores
replies after the timeout and still enforces min-sites and the ledger charges."""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

from prism_runtime.protocol import ACCOUNTING, CONFIG, UPDATE, key
from server.ledger import Ledger
from server.strategy.loop import run_rounds
from server.strategy.transport import stream_replies
from strategy.clocked import Grid, Recorder, requests


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

    def run_round(self, server_round, grid, messages, exchange):
        replies = stream_replies(
            grid,
            messages,
            timeout=exchange.timeout,
            pull_batch=exchange.pull_batch,
            poll_interval=exchange.poll_interval,
            server_round=server_round,
            faults=exchange.faults,
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
