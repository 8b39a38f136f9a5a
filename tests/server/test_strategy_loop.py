"""The round loop streams replies (``server.strategy.loop``): it aggregates them as they arrive
through Flower's own ``InMemoryGrid`` (``sitegrid.FlowerSites``), holds a bounded number of
them, ignores replies after the timeout and still enforces min-sites and the ledger charges."""

from __future__ import annotations

import pytest
import torch
from conftest import random_point
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from reply_facts import honest_facts
from sitegrid import Arrival, FlowerSites
from strategy_helpers import strategy_for

from prism_runtime.protocol import ACCOUNTING, CONFIG, UPDATE, key
from server.ledger import Ledger
from server.strategy.loop import run_rounds, stream_replies

MODULES = ["layer.0.q", "layer.0.v"]
M, N, R = 12, 10, 3
TAU = 2


@pytest.fixture(autouse=True)
def _flower_identity():
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
