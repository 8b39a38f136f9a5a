"""The budget planner: its plan spends the stated budget, never more, and the run charges it."""

from __future__ import annotations

import re
import tomllib

import pytest
from helpers.sites import simulated_node

from client.policy import site_policy
from client.site import Site
from prism_core.accounting import PrivacyEvent, epsilon
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.errors import ConfigError
from prism_runtime.exchange import to_arrays
from prism_runtime.plan import (
    MAX_LR,
    MIN_BATCH,
    STEP_SETTINGS,
    STEP_SETTINGS_FROM_PASSES,
    STEPS,
    budget_report,
    plan_budget,
)
from server.cli import EXIT_OK, EXIT_USAGE, main


@pytest.mark.parametrize("passes", [0.05, 0.17, 1.0, 2.0, 60.0])
@pytest.mark.parametrize("rows", [5_000, 22_349])
def test_a_plan_spends_the_stated_budget_in_steps_of_its_batch(passes, rows):
    plan = plan_budget(passes=passes, rows_per_site=rows)
    # b x T is the budget up to half a batch of rounding
    assert abs(plan.example_gradients - passes * rows) <= plan.batch_size / 2 + 1
    assert plan.local_steps == 1 and 0 < plan.lr <= MAX_LR
    assert 1 <= plan.batch_size <= rows
    # 30 steps; fewer only at the smallest batch, more only at a batch of every row
    assert plan.num_rounds == STEPS or plan.batch_size in (MIN_BATCH, rows)
    assert plan.num_rounds >= STEPS or plan.batch_size == MIN_BATCH
    assert plan.num_rounds <= STEPS or plan.batch_size == rows


@pytest.mark.parametrize(
    ("passes", "eps", "delta"), [(0.17, 3.0, 1e-5), (2.0, 1.0, 1e-5), (2.0, 8.0, 1e-6)]
)
def test_a_plan_never_charges_more_than_the_stated_epsilon_and_spends_nearly_all(
    passes, eps, delta
):
    plan = plan_budget(passes=passes, rows_per_site=22_349)
    report = budget_report(plan, epsilon=eps, delta=delta)
    steps = plan.num_rounds * plan.local_steps
    independent = epsilon([PrivacyEvent(report.sigma, plan.sample_rate, steps)], delta)
    assert report.charged == pytest.approx(independent, rel=1e-12)
    assert 0.99 * eps <= report.charged <= eps
    assert report.step_noise == pytest.approx(report.sigma / plan.batch_size, rel=1e-12)


@pytest.mark.slow
def test_a_run_with_the_plans_config_charges_the_plans_epsilon(tiny_bert, tmp_path):
    """A simulated site of the budget's rows runs every planned round; its ledger's epsilon is
    the plan's, to the accountant's tolerance."""
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "micro-batch-size": 8,
        "max-length": 24,
        "synthetic-examples": 64,
        "budget": 5,  # 320 example-gradients: 10 rounds of the smallest batch, 32 of the 64 rows
        "target-epsilon": 3.0,
    }
    run = parse_config(RunConfig, values, what="run config")
    plan = run.plan
    assert plan is not None and run.batch_size == plan.batch_size == MIN_BATCH == 32
    assert run.num_rounds == plan.num_rounds == 10 and run.lr == STEP_SETTINGS["lr"]
    report = budget_report(plan, epsilon=run.target_epsilon, delta=run.delta)
    node = simulated_node(tmp_path, **{"epsilon-cap": 3.0})
    site = Site(run, node, site_policy(node, env_secret=""))
    assert site.num_examples == plan.rows_per_site
    for server_round in range(1, run.num_rounds + 1):
        reply = site.train_round(server_round, to_arrays(site.loaded))
        assert reply.accounting.status == "ok"
        assert reply.accounting.sigma == pytest.approx(report.sigma, rel=1e-9)
    charged = epsilon(site.ledger.events(), run.delta)
    assert charged == pytest.approx(report.charged, rel=1e-6)
    assert charged <= run.target_epsilon


def test_a_budget_run_config_says_what_it_sets_and_survives_a_round_trip():
    run = parse_config(RunConfig, {"budget": 2, "rows-per-site": 22_000}, what="run config")
    plan = plan_budget(passes=2, rows_per_site=22_000)
    assert run.plan == plan
    # the coordinator takes the step (step-at = auto): the settings of that step
    assert run.steps_at_coordinator
    assert (run.batch_size, run.num_rounds, run.local_steps) == (
        plan.batch_size,
        plan.num_rounds,
        plan.local_steps,
    )
    assert (run.lr, run.max_norm, run.head_max_norm, run.head_lr) == (0.008, 0.5, 0.4, 10.0)
    assert dict(STEP_SETTINGS) == {
        "lr": 0.008,
        "max-norm": 0.5,
        "head-max-norm": 0.4,
        "head-lr": 10.0,
    }
    # sites that step themselves keep the plain rule's lr and the demo's clip
    values = {"budget": 2, "rows-per-site": 22_000, "step-at": "site"}
    sited = parse_config(RunConfig, values, what="run config")
    assert not sited.steps_at_coordinator
    assert (sited.lr, sited.max_norm, sited.head_max_norm) == (plan.lr, 1.0, 0.9)
    # a baseline always steps at its sites: the plain rule too
    values = {"budget": 2, "rows-per-site": 22_000, "method": "fedavg-factors"}
    baseline = parse_config(RunConfig, values, what="run config")
    assert (baseline.lr, baseline.max_norm, baseline.head_max_norm) == (plan.lr, 1.0, 0.9)
    clash = {"budget": 2, "rows-per-site": 22_000, "max-norm": "auto"}
    with pytest.raises(ConfigError, match=r"with step-at=site it sets only the first four"):
        parse_config(RunConfig, clash, what="run config")
    again = parse_config(RunConfig, run.model_dump(by_alias=True), what="run config")
    assert again == run
    listed = {
        "budget": 2,
        "rows-per-site": 22_000,
        "num-rounds": 30,
        "batch-size": 128,
        "lr": 0.002,
    }
    assert parse_config(RunConfig, listed, what="run config") == run  # defaults: the plan's
    demo = parse_config(RunConfig, {}, what="run config")
    assert demo.plan is None and (demo.batch_size, demo.num_rounds) == (128, 30)


@pytest.mark.parametrize("passes", [0.17233, 0.49])
def test_a_small_plain_budget_keeps_the_demos_step_and_a_secure_one_the_step_settings(passes):
    """Below ``STEP_SETTINGS_FROM_PASSES`` plain rounds with the coordinator's step take the plain
    rule's lr and the demo's clip, head share and head lr (the study: better at the demo's
    budget); secure aggregation keeps ``STEP_SETTINGS``; from that budget on, plain rounds take
    them too."""
    assert passes < STEP_SETTINGS_FROM_PASSES
    rows = 22_283
    plan = plan_budget(passes=passes, rows_per_site=rows)
    values = {"budget": passes, "rows-per-site": rows}
    run = parse_config(RunConfig, values, what="run config")
    assert run.steps_at_coordinator and run.batch_size == plan.batch_size
    assert (run.lr, run.max_norm, run.head_max_norm, run.head_lr) == (plan.lr, 1.0, 0.9, 5.0)
    assert set(plan.settings()) == {"batch-size", "num-rounds", "local-steps", "lr"}
    secure = parse_config(RunConfig, {**values, "secure-aggregation": True}, what="run config")
    assert (secure.lr, secure.max_norm, secure.head_max_norm, secure.head_lr) == (
        0.008,
        0.5,
        0.4,
        10.0,
    )
    larger = parse_config(
        RunConfig, {**values, "budget": STEP_SETTINGS_FROM_PASSES}, what="run config"
    )
    assert (larger.lr, larger.max_norm, larger.head_max_norm, larger.head_lr) == (
        0.008,
        0.5,
        0.4,
        10.0,
    )
    # a run config may state the demo's clip beside a small budget: the plan does not set it
    stated = parse_config(RunConfig, {**values, "max-norm": 1.0}, what="run config")
    assert stated == run


@pytest.mark.parametrize("secure", [True, "true"])
def test_a_secure_budget_sets_one_public_sample_rate_and_a_plain_one_none(secure):
    """With secure aggregation the budget also sets ``sample-rate = b / rows-per-site``: every
    site samples at one q, so all calibrate one sigma and each can add the others' share (per-site
    sampling over shards of different sizes can need a share some site refuses)."""
    plan = plan_budget(passes=2, rows_per_site=22_000)
    values = {"budget": 2, "rows-per-site": 22_000, "secure-aggregation": secure}
    run = parse_config(RunConfig, values, what="run config")
    assert run.sample_rate == plan.sample_rate == plan.batch_size / 22_000
    assert (run.lr, run.max_norm, run.head_max_norm, run.head_lr) == (0.008, 0.5, 0.4, 10.0)
    assert (run.batch_size, run.num_rounds) == (plan.batch_size, plan.num_rounds)
    assert parse_config(RunConfig, run.model_dump(by_alias=True), what="run config") == run
    plain = parse_config(RunConfig, {"budget": 2, "rows-per-site": 22_000}, what="run config")
    assert plain.sample_rate == 0.0
    printed = {**values, "sample-rate": float(f"{plan.sample_rate:g}"), "lr": 0.008}
    assert parse_config(RunConfig, printed, what="run config") == run  # to the printed digits


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"budget": 2, "data": "shard.jsonl"}, "needs rows-per-site"),
        (
            {"budget": 2, "rows-per-site": 22_000, "secure-aggregation": True, "sample-rate": 0.5},
            r"sample-rate=0.5 \(the plan's: 0.0666818.*remove those keys",
        ),
        ({"budget": 2, "rows-per-site": 22_000, "lr": 0.5}, "lr=0.5 .*remove those keys"),
        ({"budget": 2, "rows-per-site": 22_000, "num-rounds": 7}, "num-rounds=7"),
        ({"budget": 2, "rows-per-site": 10}, "rows-per-site=10"),
        ({"budget": 0.01, "rows-per-site": 1_000}, "State a larger budget"),
        ({"budget": -1}, "budget=-1"),
        ({"budget": 1e9, "rows-per-site": 1_000}, "budget=1000000000.0: .*less than or equal"),
    ],
)
def test_bad_budget_facts_get_a_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(RunConfig, values, what="run config")


def test_the_plan_command_prints_the_config_sigma_noise_and_epsilon(capsys):
    assert main(["plan", "--passes", "2", "--rows-per-site", "22000", "--epsilon", "3"]) == EXIT_OK
    out = capsys.readouterr().out
    plan = plan_budget(passes=2, rows_per_site=22_000)
    report = budget_report(plan, epsilon=3.0, delta=1e-5)
    assert "budget=2 rows-per-site=22000 target-epsilon=3" in out
    assert f"batch-size = {plan.batch_size}" in out and f"num-rounds = {plan.num_rounds}" in out
    assert f"sigma (calibrated by each site of 22000 rows): {report.sigma:.4f}" in out
    assert f"epsilon charged per site: {report.charged:.4f} (<= 3)" in out
    assert "secure aggregation (--secure) puts one sigma in the sum" in out  # the hint, plain only
    assert "lr = 0.008" in out and "max-norm = 0.5" in out  # the coordinator's step
    same = ["plan", "--example-gradients", "44000", "--rows-per-site", "22000"]
    assert main(same) == EXIT_OK
    assert f"batch-size = {plan.batch_size}" in capsys.readouterr().out
    demo = ["plan", "--passes", "0.17233", "--rows-per-site", "22283"]
    assert main(demo) == EXIT_OK
    out = capsys.readouterr().out
    assert "lr = 0.002" in out and "max-norm" not in out  # the demo's step at its budget
    assert "below 0.5 passes that step keeps the demo's lr" in out


def test_the_plan_command_with_secure_prints_the_sample_rate_and_the_sums_noise(capsys):
    argv = ["plan", "--passes", "2", "--rows-per-site", "22000", "--sites", "3", "--secure"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    plan = plan_budget(passes=2, rows_per_site=22_000)
    report = budget_report(plan, epsilon=3.0, delta=1e-5)
    config = next(line for line in out.splitlines() if line.startswith("budget="))
    assert "secure-aggregation=true" in config.split()
    values = tomllib.loads("\n".join(config.split()))  # as flwr reads --run-config
    run = parse_config(RunConfig, values, what="run config")  # it sets that rate
    assert run.secure_aggregation and run.sample_rate == plan.sample_rate
    assert run.min_honest_sites == 3 and run.lr == 0.008
    assert f"sample-rate = {plan.sample_rate:g}" in out and "lr = 0.008" in out
    summed = report.sigma / (3 * plan.batch_size)  # one sigma in the sum, over 3 b
    assert f"over 3 sites, each counting on 3 honest: {summed:.3g} C" in out
    assert "secure aggregation (--secure) puts" not in out


def test_the_plan_command_with_one_honest_site_sets_it_and_prints_that_sums_noise(capsys):
    argv = ["plan", "--passes", "2", "--rows-per-site", "22000", "--secure", "--honest-sites", "1"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    config = next(line for line in out.splitlines() if line.startswith("budget="))
    run = parse_config(RunConfig, tomllib.loads("\n".join(config.split())), what="run config")
    assert run.secure_aggregation and run.min_honest_sites == 1 and run.sites_per_round == 3
    plan = plan_budget(passes=2, rows_per_site=22_000)
    report = budget_report(plan, epsilon=3.0, delta=1e-5)
    # each of 3 sites adds its whole sigma: sqrt(3) sigma in the sum, over 3 b
    summed = report.sigma * 3**0.5 / (3 * plan.batch_size)
    assert f"over 3 sites, each counting on 1 honest: {summed:.3g} C" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--passes", "2", "--rows-per-site", "10"], "rows-per-site=10"),
        (
            ["plan", "--passes", "2", "--rows-per-site", "22000", "--honest-sites", "1"],
            "add --secure",
        ),
        (
            ["plan", "--passes", "2", "--rows-per-site", "2000", "--secure", "--honest-sites", "4"],
            "--honest-sites 4 > --sites 3",
        ),
        (["plan", "--passes", "0.001", "--rows-per-site", "1000"], "State a larger budget"),
        (["plan", "--passes", "2", "--rows-per-site", "22000", "--delta", "2"], "delta"),
    ],
)
def test_the_plan_command_refuses_bad_facts_with_a_clear_error(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("prism-fl: plan:")
    assert re.search(message, err), err
