"""bench/budget_report.py: a central result (bench/central_curve.py) joins the study as its own
line, its budget per site the pooled one over the sites; a federated result's row is unchanged,
and a run of several local steps a round counts each step's batch; a plain run is a series by
where its step runs; the report writes its table and both plots and copies no result already in
its folder."""

from __future__ import annotations

import json

import pytest
from helpers.bench import bench_module


@pytest.fixture(scope="module")
def report():
    yield from bench_module("budget_report")


FEDERATED = {
    "run-config": {"batch-size": 1485, "num-rounds": 30, "lr": 0.008, "secure-aggregation": True},
    "selection-curve": {"0": 0.7, "15": 0.8, "30": 0.83},
    "eval": {"dev.jsonl": {"accuracy": 0.826}},
    "epsilon": {"site-0": 2.99, "site-1": 2.99, "site-2": 2.99},
    "seconds": 900.0,
}
CENTRAL = {
    "prism-train": [
        "--method",
        "prism",
        "--epsilon",
        "3",
        "--steps",
        "30",
        "--batch-size",
        "4456",
        "--lr",
        "0.008",
        "--max-norm",
        "0.5",
        "--head-max-norm",
        "0.4",
        "--seed",
        "0",
    ],
    "selection-curve": [
        {"step": 5, "selection": 0.75, "seconds": 100.0},
        {"step": 30, "selection": 0.82, "seconds": 700.0},
    ],
    "dev": 0.8165,
    "noise_multiplier": 0.986,
    "epsilon": 2.993,
}


def test_a_central_run_is_its_own_line_at_the_pooled_budget_over_the_sites(report):
    row = report._central_row("c2", CENTRAL, 3)
    assert row["example-gradients"] == round(4456 * 30 / 3)
    assert row["batch"] == 1485 and row["per round"] == pytest.approx(4456 / 3, rel=1e-12)
    assert row["series"] == "prism central, eps 3"
    assert (row["lr"], row["clip"], row["head share"]) == (0.008, 0.5, 0.4)
    assert (row["dev"], row["selection last"], row["selection best"]) == (0.8165, 0.82, 0.82)
    assert row["curve"] == {5: 0.75, 30: 0.82}
    argv = CENTRAL["prism-train"]
    unset = argv.index("--head-max-norm")  # prism-train's default: 0.9 of the clip
    bare = {**CENTRAL, "prism-train": argv[:unset] + argv[unset + 2 :]}
    assert report._central_row("c3", bare, 3)["head share"] == pytest.approx(0.45, rel=1e-12)
    federated = report._row("s7", FEDERATED)
    assert federated["series"] == "prism secure, eps 3" and federated["per round"] == 1485
    assert federated["example-gradients"] == row["example-gradients"] - 10  # 44,550 vs 44,560


def test_the_report_writes_its_table_and_plots_and_copies_nothing_already_in_its_folder(
    report, tmp_path
):
    pytest.importorskip("matplotlib")
    (tmp_path / "central").mkdir()
    (tmp_path / "s7.json").write_text(json.dumps(FEDERATED))
    (tmp_path / "central" / "c2.json").write_text(json.dumps(CENTRAL))
    report.main(
        ["--out", str(tmp_path), str(tmp_path / "s7.json"), str(tmp_path / "central/c2.json")]
    )
    table = (tmp_path / "budget.md").read_text()
    assert "| c2 | 44560 |" in table and "| s7 | 44550 |" in table
    assert (tmp_path / "budget.png").stat().st_size > 0
    assert (tmp_path / "budget-dev.png").stat().st_size > 0
    assert not (tmp_path / "c2.json").exists()  # the central result stays where it is


def test_a_run_of_several_local_steps_a_round_counts_every_steps_batch(report):
    nondp = {
        **FEDERATED,
        "run-config": {"method": "nondp", "batch-size": 186, "num-rounds": 30, "local-steps": 8},
    }
    row = report._row("n3", nondp)
    assert (row["batch"], row["rounds"], row["local steps"]) == (186, 30, 8)
    assert row["example-gradients"] == 186 * 30 * 8
    assert row["per round"] == 186 * 8  # the curve's x: example-gradients after each round
    assert report._row("s7", FEDERATED)["local steps"] == 1  # unset: one step a round


def test_a_secure_run_counting_on_fewer_honest_sites_than_its_sites_is_its_own_series(report):
    h1 = {**FEDERATED, "run-config": {**FEDERATED["run-config"], "min-honest-sites": 1}}
    assert report._row("s13", h1)["series"] == "prism secure, eps 3, H = 1"
    all_honest = {**FEDERATED, "run-config": {**FEDERATED["run-config"], "min-honest-sites": 3}}
    assert report._row("s7", all_honest)["series"] == "prism secure, eps 3"


def test_a_plain_run_is_a_series_by_where_its_step_runs(report):
    """The study's plain runs state ``step-at``; a plain run without it is a run of site
    steps (the study's runs from before the coordinator's step)."""
    plain = {k: v for k, v in FEDERATED["run-config"].items() if k != "secure-aggregation"}
    coordinator = {**FEDERATED, "run-config": {**plain, "step-at": "coordinator"}}
    assert report._row("c2", coordinator)["series"] == "prism plain (step at coordinator), eps 3"
    site = {**FEDERATED, "run-config": plain}
    assert report._row("p5", site)["series"] == "prism plain (step at site), eps 3"
    secure = {**FEDERATED, "run-config": {**FEDERATED["run-config"], "step-at": "coordinator"}}
    assert report._row("s7", secure)["series"] == "prism secure, eps 3"
