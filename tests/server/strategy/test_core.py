"""``PrismStrategy`` (``server/strategy/core.py``): how the strategy wires its settings into
its parts, how ``from_run`` reads every setting from a run config (the constructor has no
defaults), and what a round does with a reply the checks refuse (a duplicate, a ledger
conflict, an unexpected error), with the code, the log line and the charge of each; a
refusal, the settings' log line, the strategy's state across a restart and Flower's
``start`` signature; a conflicting ledger record on a resumed run rejects one reply, never
the round.

The tiny two-module adapter comes from ``strategy.two_modules``, the three sites of the
resumed run from ``strategy.three_sites``."""

from __future__ import annotations

import inspect
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from helpers.points import random_point
from ledger_events import ledger_event
from reply_facts import honest_facts
from strategy_helpers import strategy_for

import server.strategy.core as core
from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.protocol import ACCOUNTING, CONFIG, REFUSAL_REASONS, UPDATE, key
from prism_runtime.ranges import SIGMA_MIN
from prism_runtime.train_config import site_train_config
from server.ledger import Ledger
from server.strategy import PrismStrategy
from server.strategy.bounds import AutoClip, UpdateBound, UpdateChecker
from server.strategy.replies import RunTerms
from server.strategy.secure import SecureRound
from server.strategy.selection import WAIT_FOR_NODES
from strategy import three_sites
from strategy.two_modules import (
    MODULES,
    SHAPES,
    Grid,
    adapter,
    site_facts,
    site_reply,
    strategy_and_ledger,
)

pytestmark = pytest.mark.usefixtures("flower_identity")


NODES = [11, 12, 13]


def _zero_update() -> dict[str, torch.Tensor]:
    """An honest tangent update that does not move the adapter (norm 0)."""
    update = {}
    for module in MODULES:
        m, n, r = SHAPES[module]
        update[key(module, "dA")] = torch.zeros(m, r)
        update[key(module, "dB")] = torch.zeros(n, r)
    return update


def _ask(strategy, server_round=1, nodes=NODES):
    return list(
        strategy.configure_train(server_round, ArrayRecord(adapter()), ConfigRecord(), Grid(nodes))
    )


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "server.strategy"]


def test_the_strategy_hands_its_settings_to_its_parts(tmp_path) -> None:
    auto = AutoClip(low=0.1, high=10.0, steps=3, noise_multiplier=7.5)
    strategy, ledger = strategy_and_ledger(
        tmp_path,
        run_id="run-7",
        sites_per_round=3,
        min_sites=2,
        seed=1234,
        wait_for_nodes=17.0,
        connect_timeout=99.0,
        server_lr=0.25,
        auto_clip=auto,
    )
    sel = strategy.selection
    assert (sel.ledger, sel.run_id, sel.local_steps) == (ledger, "run-7", 2)
    assert (sel.sites_per_round, sel.min_sites) == (3, 2)
    assert (sel.wait_for_nodes, sel.connect_timeout) == (17.0, 99.0)
    assert sel.rng.getstate() == random.Random(1234).getstate()
    assert strategy.terms.auto_clip is auto
    assert strategy.charges.auto_clip is auto
    # the server step is taken at the server lr
    assert strategy.round_kind.aggregator.server_lr == 0.25


def test_the_constructor_takes_every_setting_by_keyword_and_has_no_default() -> None:
    parameters = inspect.signature(core.PrismStrategy).parameters.values()
    assert [p.name for p in parameters if p.kind is not p.KEYWORD_ONLY] == []
    assert [p.name for p in parameters if p.default is not p.empty] == []


def test_a_default_run_config_gives_the_products_settings(tmp_path) -> None:
    run = RunConfig()
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=[], ledger=ledger, run_id="run-1", arrays=adapter()
        )
        # PRISM at one local step: the sites release gradients, the coordinator steps
        assert run.step_at == "auto" and run.steps_at_coordinator
        assert strategy.round_kind.central is not None and strategy.round_kind.checker.gradient
        assert strategy.round_kind.aggregator.central is strategy.round_kind.central
        # the grid's wait is not a run config key: 120 s is the coordinator's
        assert strategy.selection.wait_for_nodes == WAIT_FOR_NODES == 120.0
        assert strategy.selection.connect_timeout == 600.0
        assert (strategy.selection.sites_per_round, strategy.selection.min_sites) == (3, 1)
        assert strategy.selection.rng.getstate() == random.Random(0).getstate()
        aggregator = strategy.round_kind.aggregator
        assert (aggregator.server_lr, aggregator.lr_schedule, aggregator.num_rounds) == (
            1.0,
            "constant",
            30,
        )
        assert (aggregator.aggregation, aggregator.expected_batch_size) == ("examples", 128.0)
        # noise-multiplier = -1: each site calibrates its own, any in range is the run's
        assert strategy.terms == RunTerms(
            mechanism="prism-tangent-gaussian",
            dp=True,
            local_steps=1,
            delta=1e-5,
            noise_multiplier=None,
            max_norm=1.0,
            expected_batch_size=128.0,
            auto_clip=None,
        )
        assert (strategy.charges.target_epsilon, strategy.charges.delta) == (3.0, 1e-5)
        assert strategy.round_kind.checker.mode == "tangent" and strategy.terms.dp


def test_from_run_reads_every_setting_from_the_run_config(tmp_path) -> None:
    run = parse_config(
        RunConfig,
        {
            "method": "fedavg-factors",
            "sites-per-round": 4,
            "min-sites": 2,
            "server-lr": 0.5,
            "server-lr-schedule": "cosine",
            "num-rounds": 7,
            "local-steps": 3,
            "lr": 0.01,
            "target-epsilon": 5.0,
            "delta": 1e-6,
            "aggregation": "uniform",
            "noise-multiplier": 2.0,
            "max-norm": 0.8,
            "head-max-norm": 0.3,
            "batch-size": 32,
            "seed": 9,
            "connect-timeout": 42.0,
        },
        what="run config",
    )
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=["w"], ledger=ledger, run_id="run-9", wait_for_nodes=3.0
        )
        assert (strategy.modules, strategy.head, strategy.round_kind.checker.mode) == (
            MODULES,
            ["w"],
            "factor-average",
        )
        assert (strategy.ledger, strategy.run_id) == (ledger, "run-9")
        sel = strategy.selection
        assert (sel.sites_per_round, sel.min_sites, sel.local_steps) == (4, 2, 3)
        assert (sel.wait_for_nodes, sel.connect_timeout) == (3.0, 42.0)
        assert sel.rng.getstate() == random.Random(9).getstate()
        aggregator = strategy.round_kind.aggregator
        assert (aggregator.server_lr, aggregator.lr_schedule, aggregator.num_rounds) == (
            0.5,
            "cosine",
            7,
        )
        assert strategy.round_kind.checker.local_steps == 3
        assert (aggregator.aggregation, aggregator.dp, aggregator.expected_batch_size) == (
            "uniform",
            True,
            32.0,
        )
        # the mechanism the run's method runs on the sites (fedavg-factors: dp-adamw there)
        assert strategy.terms == RunTerms(
            mechanism="factor-gaussian",
            dp=True,
            local_steps=3,
            delta=1e-6,
            noise_multiplier=2.0,
            max_norm=0.8,
            expected_batch_size=32.0,
            auto_clip=None,
        )
        charges = strategy.charges
        assert (charges.target_epsilon, charges.delta, charges.mechanism) == (
            5.0,
            1e-6,
            "factor-gaussian",
        )
        # the bound of the TrainConfig the sites derive from the same run config
        train = site_train_config(run, method="dp-adamw", max_norm=0.8, epsilon=5.0)
        assert (
            strategy.round_kind.checker.update_bound
            == UpdateBound.for_sites(train)
            == UpdateBound.for_run(run)
        )
        assert (
            strategy.round_kind.checker.update_bound.lr == 0.01
            and strategy.round_kind.checker.update_bound.max_norm == 0.8
        )


def test_a_secure_run_with_one_sample_rate_binds_q_not_the_batch(tmp_path) -> None:
    run = parse_config(
        RunConfig,
        {"secure-aggregation": True, "sample-rate": 0.004, "min-honest-sites": 3},
        what="run config",
    )
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=[], ledger=ledger, run_id="run-1", arrays=adapter()
        )
    assert (strategy.terms.sample_rate, strategy.terms.expected_batch_size) == (0.004, None)
    assert strategy.terms.mechanism == SKELLAM_MECHANISM
    # the secure round kind, sharing the strategy's binding, at the run's least threshold
    kind = strategy.round_kind
    assert isinstance(kind, SecureRound) and kind.binding is strategy.binding
    assert kind.min_honest_sites == 3 and kind.central.max_norm == run.max_norm


@pytest.mark.parametrize("values", [{"secure-aggregation": True}, {"step-at": "coordinator"}])
def test_a_coordinator_step_needs_the_initial_arrays(tmp_path, values) -> None:
    run = parse_config(RunConfig, values, what="run config")
    with (
        Ledger.open(tmp_path / "ledger.sqlite") as ledger,
        pytest.raises(ValueError, match="arrays"),
    ):
        core.PrismStrategy.from_run(run, modules=MODULES, head=[], ledger=ledger, run_id="run-1")


def test_a_secure_strategy_refuses_flowers_one_exchange_aggregation(tmp_path) -> None:
    run = parse_config(RunConfig, {"secure-aggregation": True}, what="run config")
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=[], ledger=ledger, run_id="run-1", arrays=adapter()
        )
        with pytest.raises(TypeError, match="six exchanges"):
            strategy.aggregate_train(1, [])


def test_from_run_checks_a_private_clip_and_bounds_it_at_its_largest(tmp_path) -> None:
    run = parse_config(
        RunConfig,
        {"max-norm": "auto", "batch-size": 64},
        what="run config",
    )
    low, high = run.auto_clip_range
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=[], ledger=ledger, run_id="run-1", arrays=adapter()
        )
        auto = AutoClip(low=low, high=high, steps=30, noise_multiplier=0.05 * 64)
        assert strategy.terms.auto_clip == auto and strategy.charges.auto_clip == auto
        assert strategy.terms.max_norm is None  # each site reports its own estimate
        assert (
            strategy.round_kind.checker.update_bound is not None
            and strategy.round_kind.checker.update_bound.max_norm == high
        )


def test_from_run_of_a_nondp_run_expects_no_noise_and_no_clip_estimate(tmp_path) -> None:
    run = parse_config(RunConfig, {"method": "nondp", "max-norm": "auto"}, what="run config")
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = core.PrismStrategy.from_run(
            run, modules=MODULES, head=[], ledger=ledger, run_id="run-1"
        )
        assert (strategy.terms.dp, strategy.round_kind.checker.mode) == (False, "factor-average")
        assert (strategy.terms.mechanism, strategy.terms.dp) == ("none", False)
        assert strategy.terms.auto_clip is None and strategy.charges.auto_clip is None
        assert AutoClip.for_run(run) is None


@pytest.mark.parametrize(("min_sites", "sites_per_round"), [(0, 2), (3, 2), (-1, 1)])
def test_min_sites_outside_one_to_sites_per_round_is_refused(
    tmp_path, min_sites: int, sites_per_round: int
) -> None:
    with pytest.raises(ValueError, match=f"min-sites={min_sites} with sites-per-round="):
        strategy_and_ledger(tmp_path, min_sites=min_sites, sites_per_round=sites_per_round)


@pytest.mark.parametrize(("min_sites", "sites_per_round"), [(1, 1), (2, 2), (1, 3)])
def test_min_sites_from_one_to_sites_per_round_is_accepted(
    tmp_path, min_sites: int, sites_per_round: int
) -> None:
    strategy, _ = strategy_and_ledger(
        tmp_path, min_sites=min_sites, sites_per_round=sites_per_round
    )
    assert strategy.round_kind.min_sites == min_sites


def test_start_hands_every_argument_and_flowers_defaults_to_the_round_loop(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(core, "run_rounds", lambda *a, **kw: calls.append((a, kw)) or "result")
    strategy, _ = strategy_and_ledger(tmp_path)
    grid, arrays = Grid(NODES), ArrayRecord(adapter())

    assert strategy.start(grid, arrays) == "result"
    args, kw = calls[-1]
    assert args == (strategy, grid, arrays)
    assert kw.pop("train_config") == ConfigRecord()
    assert kw == {
        "num_rounds": 3,
        "timeout": 3600,
        "evaluate_fn": None,
        "on_round_end": None,
        "first_round": 1,
        "previous": None,
        "faults": NO_FAULTS,
    }

    config, previous, faults = ConfigRecord({"x": 1}), Result(), Faults()

    def evaluate(server_round, arrays):
        return None

    def on_end(*args):
        return None

    strategy.start(
        grid,
        arrays,
        num_rounds=5,
        timeout=12.5,
        train_config=config,
        evaluate_fn=evaluate,
        on_round_end=on_end,
        first_round=4,
        previous=previous,
        faults=faults,
    )
    args, kw = calls[-1]
    assert kw == {
        "num_rounds": 5,
        "timeout": 12.5,
        "train_config": config,
        "evaluate_fn": evaluate,
        "on_round_end": on_end,
        "first_round": 4,
        "previous": previous,
        "faults": faults,
    }
    assert kw["train_config"] is config and kw["previous"] is previous and kw["faults"] is faults


def test_each_round_sets_the_update_bound_of_its_own_round_number(tmp_path) -> None:
    """With b1^2 >= b2 the bound grows with the steps a site can have taken (round x tau), so
    the checker must be told the round being configured."""
    bound = UpdateBound(lr=0.05, beta1=0.9, beta2=0.5)
    strategy, _ = strategy_and_ledger(tmp_path, update_bound=bound)
    bounds = {}
    for server_round in (1, 3):
        _ask(strategy, server_round)
        reference = UpdateChecker(
            modules=MODULES, head=[], mode="tangent", local_steps=2, update_bound=bound
        )
        reference.begin_round(server_round, adapter())
        assert strategy.round_kind.checker.norm_bound == reference.norm_bound
        bounds[server_round] = strategy.round_kind.checker.norm_bound
    assert bounds[3] > bounds[1] * 1.01


def test_a_round_reports_how_many_sites_it_asked(tmp_path) -> None:
    strategy, _ = strategy_and_ledger(tmp_path, sites_per_round=2)
    requests = _ask(strategy)
    assert len(requests) == 2
    _, metrics = strategy.aggregate_train(1, [])
    assert metrics["sites-sent"] == 2
    assert strategy.summaries[-1].sent == 2


def test_one_site_with_a_weight_below_one_updates_the_model(tmp_path) -> None:
    """The weight of a noisy site, ``(b / (sigma C))^2``, is far below 1: it still counts."""
    strategy, _ = strategy_and_ledger(tmp_path, sites_per_round=1)
    (request,) = _ask(strategy, nodes=[11])
    facts = {**site_facts("site-a"), "sigma": 50.0, "max-norm": 1.0}  # (16 / 50)^2 = 0.1
    # the run's clip must match the reply's: a run without a fixed C accepts any
    new, metrics = strategy.aggregate_train(1, [site_reply(request, _zero_update(), facts)])
    assert metrics["sites-accepted"] == 1
    assert 0 < strategy.round_kind.aggregator.total_weight < 1
    assert new is not None and metrics["applied"] == 1


def test_a_fixed_noise_multiplier_is_the_sigma_every_dp_reply_must_state(tmp_path) -> None:
    """The run fixes sigma = 2.0: a reply stating half of it is rejected (``facts-mismatch``) and
    never charged as confirmed; one within a part in a million of it counts."""
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=3, noise_multiplier=2.0)
    assert strategy.terms.noise_multiplier == 2.0
    requests = _ask(strategy)
    sigmas = {"site-a": 2.0, "site-b": 1.0, "site-c": 2.0 * (1 + 5e-7)}
    replies = [
        site_reply(request, _zero_update(), {**site_facts(site), "sigma": sigma})
        for request, (site, sigma) in zip(requests, sigmas.items(), strict=True)
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    summary = strategy.summaries[-1]
    assert sorted(summary.accepted) == ["site-a", "site-c"]
    assert summary.rejected == [("site-b", "fact sigma 1.0 is not the run's noise-multiplier 2.0")]
    assert summary.rejected_by_reason == {"facts-mismatch": 1}
    assert metrics["rejected-facts-mismatch"] == 1
    assert sorted(e.site_id for e in ledger.events() if e.confirmed) == ["site-a", "site-c"]
    assert [e.event.noise_multiplier for e in ledger.events(site_id="site-a")] == [2.0]


def test_a_calibrated_sigma_below_the_smallest_a_site_runs_is_rejected(tmp_path) -> None:
    """No fixed sigma (each site calibrates): ``SIGMA_MIN`` counts, just below it is rejected
    (``facts``) and never charged as confirmed."""
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=2)
    requests = _ask(strategy, nodes=[11, 12])
    sigmas = {"site-a": SIGMA_MIN, "site-b": SIGMA_MIN * (1 - 1e-9)}
    replies = [
        site_reply(request, _zero_update(), {**site_facts(site), "sigma": sigma})
        for request, (site, sigma) in zip(requests, sigmas.items(), strict=True)
    ]
    strategy.aggregate_train(1, replies)
    summary = strategy.summaries[-1]
    assert summary.accepted == ["site-a"]
    assert summary.rejected_by_reason == {"facts": 1}
    says = (
        f"sigma={SIGMA_MIN * (1 - 1e-9)} is neither 0 (no noise) nor in [0.3, 10000], the "
        "noise multipliers a site runs"
    )
    assert summary.rejected == [("node-12", says)]  # refused before its site id is bound
    assert [e.site_id for e in ledger.events() if e.confirmed] == ["site-a"]
    assert [e.event.noise_multiplier for e in ledger.events(site_id="site-a")] == [SIGMA_MIN]


def test_a_second_reply_of_a_site_is_rejected_as_a_duplicate_and_the_first_counts(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=1)
    (request,) = _ask(strategy, nodes=[11])
    reply = site_reply(request, _zero_update(), site_facts("site-a"))
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        _, metrics = strategy.aggregate_train(1, [reply, reply])
    summary = strategy.summaries[-1]
    assert summary.accepted == ["site-a"]
    assert summary.rejected == [("site-a", "second reply of 'site-a' in round 1")]
    assert summary.rejected_by_reason == {"duplicate": 1}
    assert metrics["rejected-duplicate"] == 1
    assert "round 1: rejected reply from site-a: second reply of 'site-a' in round 1" in _messages(
        caplog
    )
    assert summary.unconfirmed == []
    assert len(ledger.events(site_id="site-a")) == 1  # charged once, confirmed


def test_a_reply_the_ledger_holds_another_record_of_is_rejected_and_not_charged_again(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=1)
    other = ledger_event(
        run_id="run-1",
        round=1,
        site_id="site-a",
        sigma=2.0,  # the reply will state sigma 1.0
        q=0.05,
        steps=2,
        delta=1e-5,
        epsilon_cap=10.0,
        rng="os-csprng",
        mechanism="prism-tangent-gaussian",
    )
    ledger.append(other)
    (request,) = _ask(strategy, nodes=[11])
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        _, metrics = strategy.aggregate_train(
            1, [site_reply(request, _zero_update(), site_facts("site-a"))]
        )
    summary = strategy.summaries[-1]
    assert summary.rejected_by_reason == {"ledger-conflict": 1}
    # the round's confirmed record is in the ledger already: no unconfirmed charge on top
    assert summary.unconfirmed == []
    assert metrics["sites-unconfirmed"] == 0
    assert [e.event.noise_multiplier for e in ledger.events(site_id="site-a")] == [2.0]
    # it answered (its record is there): not treated as a site that gave no valid answer
    assert not any("gave no valid answer" in line for line in _messages(caplog))


def test_an_unexpected_error_on_one_reply_rejects_it_as_invalid_and_the_round_goes_on(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=2, min_sites=1)
    requests = _ask(strategy, nodes=[11, 12])
    real = strategy.round_kind.aggregator.weight

    def weight(facts):
        if facts.site_id == "site-b":
            raise ValueError("boom in weight")
        return real(facts)

    strategy.round_kind.aggregator.weight = weight
    replies = [
        site_reply(requests[0], _zero_update(), site_facts("site-a")),
        site_reply(requests[1], _zero_update(), site_facts("site-b")),
    ]
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        new, _ = strategy.aggregate_train(1, replies)
    summary = strategy.summaries[-1]
    assert summary.accepted == ["site-a"] and new is not None
    assert summary.rejected == [("site-b", "ValueError('boom in weight')")]
    assert summary.rejected_by_reason == {"invalid": 1}
    assert "round 1: rejected reply from site-b: ValueError('boom in weight')" in _messages(caplog)
    # its facts were confirmed before the error: charged once, confirmed, never unconfirmed
    assert summary.unconfirmed == []
    assert len(ledger.events(site_id="site-b")) == 1


def test_a_node_that_never_replied_is_named_in_the_warning_and_charged_unconfirmed(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=2, min_sites=1)
    requests = _ask(strategy, nodes=[11, 12])
    # bind node 12 to its site in round 1, then ask again in round 2, where it stays silent
    strategy.aggregate_train(
        1,
        [
            site_reply(r, _zero_update(), site_facts(f"site-{r.metadata.dst_node_id}"))
            for r in requests
        ],
    )
    requests = _ask(strategy, server_round=2, nodes=[11, 12])
    (first,) = [r for r in requests if r.metadata.dst_node_id == 11]
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        strategy.aggregate_train(2, [site_reply(first, _zero_update(), site_facts("site-11"))])
    assert (
        "round 2: no reply from site-12 before the timeout; the round goes on without it"
        in _messages(caplog)
    )
    summary = strategy.summaries[-1]
    assert summary.unconfirmed == ["site-12"]
    assert summary.rejected_by_reason == {"no-reply": 1}
    assert [e.confirmed for e in ledger.events(site_id="site-12")] == [True, False]


def test_a_refusal_keeps_no_mechanism_and_a_valid_reply_keeps_its_own(tmp_path) -> None:
    strategy, _ = strategy_and_ledger(tmp_path, sites_per_round=2)
    requests = _ask(strategy, nodes=[11, 12])
    # a site refusing mid-run states the mechanism it would run: exhausted, it is not kept
    refusal = {**site_facts("site-b", status="refused", steps=0), "reason": "cap-exhausted"}
    strategy.aggregate_train(
        1,
        [
            site_reply(requests[0], _zero_update(), {**site_facts("site-a"), "epsilon-cap": 7.0}),
            site_reply(requests[1], {}, refusal),
        ],
    )
    assert strategy.summaries[-1].refused == ["site-b"]
    assert strategy.selection.site_mechanism == {"site-a": (1.0, 0.05, 7.0, 1e-5)}
    assert strategy.exhausted == {"site-b"}


# -- a refusal, the settings' log line, the state across a restart, Flower's start -------------


MODULE, M, N, R = "layer.0.q", 12, 10, 3


def one_module_strategy(tmp_path: Path, **kw: object) -> PrismStrategy:
    params: dict[str, object] = dict(sites_per_round=2, server_lr=0.5)
    params.update(kw)
    return strategy_for(modules=[MODULE], ledger=Ledger.open(tmp_path / "ledger.sqlite"), **params)


def _broadcast() -> ArrayRecord:
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return ArrayRecord({key(MODULE, "A"): A, key(MODULE, "B"): B})


def _answer(request: Message, **changes: object) -> Message:
    facts = honest_facts(f"site-{request.metadata.dst_node_id}", request.content[CONFIG], **changes)
    update = {key(MODULE, "dA"): torch.full((M, R), 1e-3), key(MODULE, "dB"): torch.zeros(N, R)}
    content = RecordDict({UPDATE: ArrayRecord(update), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def test_a_refusal_is_summarised_logged_and_ends_the_sites_rounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = one_module_strategy(tmp_path)
    requests = list(strategy.configure_train(1, _broadcast(), ConfigRecord(), Grid([11, 12])))
    by_node = {r.metadata.dst_node_id: r for r in requests}
    refusal = _answer(by_node[11], status="refused", steps=0, reason="cap-exhausted")
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        strategy.aggregate_train(1, [refusal, _answer(by_node[12])])
    summary = strategy.summaries[-1]
    assert (summary.refused, summary.refusal_codes) == (["site-11"], {"site-11": "cap-exhausted"})
    assert strategy.selection.exhausted == {"site-11"}
    lines = [r.getMessage() for r in caplog.records if r.name == "server.strategy"]
    assert (
        f"site site-11 refused round 1: cap-exhausted ({REFUSAL_REASONS['cap-exhausted']})" in lines
    )
    nodes = [
        r.metadata.dst_node_id
        for r in strategy.configure_train(2, _broadcast(), ConfigRecord(), Grid([11, 12]))
    ]
    assert nodes == [12]  # the refusing site is not asked again


def test_the_strategy_logs_its_settings_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = one_module_strategy(tmp_path, lr_schedule="cosine", server_lr=0.25, min_sites=2)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        strategy.summary()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "server.strategy"]
    assert line == (
        "PrismStrategy(modules=1, head=0, sites/round=2, mode=tangent, min-sites=2, "
        "server-lr=0.25 cosine)"
    )


def test_the_strategys_state_survives_a_restart_through_json(tmp_path: Path) -> None:
    strategy = one_module_strategy(tmp_path)
    for rnd in (1, 2):
        requests = list(
            strategy.configure_train(rnd, _broadcast(), ConfigRecord(), Grid([11, 12, 13]))
        )
        replies = [_answer(r) for r in requests]
        if rnd == 2:
            replies[0] = _answer(requests[0], status="refused", steps=0, reason="cap-exhausted")
        strategy.aggregate_train(rnd, replies)
    state = json.loads(json.dumps(strategy.state_dict()))  # as a checkpoint stores it
    restarted = one_module_strategy(tmp_path / "restarted")
    restarted.load_state_dict(state)
    assert restarted.state_dict() == strategy.state_dict()
    assert restarted.binding.node_site == strategy.binding.node_site
    assert restarted.selection.site_mechanism == strategy.selection.site_mechanism
    assert restarted.selection.exhausted == strategy.selection.exhausted != set()
    assert [vars(s) for s in restarted.summaries] == [vars(s) for s in strategy.summaries]
    # the selection's random stream goes on where it stopped
    assert restarted.selection.rng.random() == strategy.selection.rng.random()


def test_start_keeps_flowers_signature_and_defaults() -> None:
    ours = inspect.signature(PrismStrategy.start).parameters
    flowers = inspect.signature(Strategy.start).parameters
    assert list(ours)[: len(flowers)] == list(flowers)
    assert {n: ours[n].default for n in flowers} == {n: p.default for n, p in flowers.items()}
    assert (ours["first_round"].default, ours["previous"].default) == (1, None)


# -- a conflicting ledger record is a rejected reply, never a crash loop -----------------------


def test_a_conflicting_record_rejects_the_reply_the_round_completes_and_resume_goes_on(
    tmp_path,
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        three_sites.honest_round(strategy, 1)
        state = json.loads(json.dumps(strategy.state_dict()))
        glob = three_sites.adapter()
        # round 2 is charged, then the coordinator dies before its checkpoint
        requests = three_sites.ask(strategy, 2, glob)
        strategy.aggregate_train(2, [three_sites.reply(r) for r in requests.values()])
        # on resume, site-12 lost its stored reply and answers round 2 with other facts
        resumed = three_sites.new_strategy(ledger)
        resumed.load_state_dict(state)

        def answer(msg):
            node = msg.metadata.dst_node_id
            return three_sites.reply(msg, sigma=1.5) if node == 12 else three_sites.reply(msg)

        checkpoints = []
        result = resumed.start(
            three_sites.Grid(answer=answer),
            ArrayRecord(glob),
            num_rounds=3,
            first_round=2,
            on_round_end=lambda rnd, arrays, summary, res: checkpoints.append(
                (rnd, resumed.state_dict())
            ),
        )
        assert [rnd for rnd, _ in checkpoints] == [2, 3]  # the run went on past round 2
        round2 = dict(result.train_metrics_clientapp[2])
        assert round2["rejected-ledger-conflict"] == 1 and round2["sites-accepted"] == 2
        assert round2["applied"] == 1 and round2["sites-unconfirmed"] == 0
        ((who, why),) = next(s for s in resumed.summaries if s.server_round == 2).rejected
        assert who == "site-12" and "different record" in why
        stored = [e for e in ledger.events("site-12") if e.round == 2]
        assert [(e.sigma, e.confirmed) for e in stored] == [
            (three_sites.SIGMA, True)
        ]  # the first kept
        round3 = dict(result.train_metrics_clientapp[3])
        assert round3["sites-accepted"] == 3 and round3["replies-rejected"] == 0
        # resuming from round 2's checkpoint replays round 3 cleanly too
        again = three_sites.new_strategy(ledger)
        again.load_state_dict(json.loads(json.dumps(checkpoints[0][1])))
        result = again.start(
            three_sites.Grid(answer=answer), ArrayRecord(glob), num_rounds=3, first_round=3
        )
        assert dict(result.train_metrics_clientapp[3])["sites-accepted"] == 3
