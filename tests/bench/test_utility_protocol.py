"""The utility study's protocol (bench/utility.py): which runs it asks for and what it picks.

A stand-in runner scores each spec by a fixed table instead of training, so these tests check the
bookkeeping only (grid epsilons, reuse of a choice, seeds, parallel order); the runs themselves
are the benchmark's job (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "utility.py"


@pytest.fixture(scope="module")
def utility():
    spec = importlib.util.spec_from_file_location("bench_utility", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def score(spec):
    """Selection accuracy by (method, C, lr): prism likes C 0.3 / lr 0.05, nondp lr 0.02."""
    best = {"prism": (0.3, 0.05), "nondp": (1.0, 0.02)}[spec["method"]]
    hit = (spec["max_norm"], spec["lr"]) == best
    return 0.8 if hit else 0.6 + 0.01 * spec["seed"]


def make_args(utility, tmp_path, *extra):
    rows = [{"text": f"row {i}", "label": i % 2} for i in range(40)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "--task", "custom", "--train", str(train), "--eval-data", str(train),
        "--num-labels", "2", "--select-rows", "10", "--out", str(tmp_path / "out"),
        "--methods", "prism", "nondp", "--epsilons", "3", "6", "--seeds", "0", "1", "2",
        "--grid-C", "0.1", "0.3", "--grid-lr", "0.02", "0.05", *extra,
    ]  # fmt: skip
    return utility.parse_args(argv)


def fake_runner(calls, delay=0.0):
    lock = threading.Lock()

    def runner(spec, runs):
        time.sleep(delay * (1 + spec["seed"]) * (spec["lr"] == 0.02))  # finish out of order
        with lock:
            calls.append((spec["method"], spec["epsilon"], spec["max_norm"], spec["lr"],
                          spec["seed"]))  # fmt: skip
        acc = score(spec)
        return {"spec": spec, "metrics": {"select": {"accuracy": acc}}}

    return runner


def test_grid_runs_only_at_grid_epsilons_and_other_epsilons_reuse_the_choice(utility, tmp_path):
    args = make_args(utility, tmp_path)  # the default: the grid at epsilon 3 only
    calls: list = []
    outcome = utility.study(args, fake_runner(calls))
    grid = [c for c in calls if c[4] == 0 and c[1] == 3.0 and c[0] == "prism"]
    assert sorted({(c[2], c[3]) for c in grid}) == [
        (0.1, 0.02),
        (0.1, 0.05),
        (0.3, 0.02),
        (0.3, 0.05),
    ]
    assert not [c for c in calls if c[0] == "prism" and c[1] == 6.0 and (c[2], c[3]) != (0.3, 0.05)]
    assert outcome["chosen"] == {
        ("prism", 3.0): (0.3, 0.05),
        ("prism", 6.0): (0.3, 0.05),
        ("nondp", 0.0): (1.0, 0.02),
    }
    for key, results in outcome["finals"].items():
        assert [r["spec"]["seed"] for r in results] == [0, 1, 2], key
        assert {(r["spec"]["max_norm"], r["spec"]["lr"]) for r in results} == {
            outcome["chosen"][key]
        }
    assert set(outcome["grid"]) == {("prism", 3.0), ("nondp", 0.0)}
    assert "prism at epsilon 6: the choice made at epsilon 3" in utility.report(
        args, _with_runs(outcome)
    )


def test_grid_at_every_listed_grid_epsilon(utility, tmp_path):
    args = make_args(utility, tmp_path, "--grid-epsilons", "3", "6")
    calls: list = []
    outcome = utility.study(args, fake_runner(calls))
    assert set(outcome["grid"]) == {("prism", 3.0), ("prism", 6.0), ("nondp", 0.0)}
    assert len([c for c in calls if c[0] == "prism" and c[1] == 6.0]) == 4 + 3  # grid + finals


def test_parallel_jobs_ask_for_the_same_runs_and_keep_the_order(utility, tmp_path):
    serial_calls: list = []
    serial = utility.study(make_args(utility, tmp_path / "a"), fake_runner(serial_calls))
    parallel_calls: list = []
    parallel = utility.study(
        make_args(utility, tmp_path / "b", "--jobs", "3"), fake_runner(parallel_calls, delay=0.01)
    )
    assert sorted(serial_calls) == sorted(parallel_calls)
    assert serial["chosen"] == parallel["chosen"]
    for key in serial["finals"]:
        assert [r["spec"]["seed"] for r in parallel["finals"][key]] == [0, 1, 2]
        assert [r["spec"]["lr"] for r in parallel["finals"][key]] == [
            r["spec"]["lr"] for r in serial["finals"][key]
        ]


def _with_runs(outcome):
    """Fill in what ``report`` reads from a real run's JSON."""
    for results in [*outcome["grid"].values(), *outcome["finals"].values()]:
        for r in results:
            r.setdefault("total_wall_s", 1.0)
            r.setdefault("total_cpu_s", 1.0)
            acc = r["metrics"]["select"]["accuracy"]
            r["metrics"].setdefault("held-out", {"accuracy": acc, "loss": 1.0 - acc})
            r.setdefault("privacy", {"epsilon": r["spec"]["epsilon"], "noise_multiplier": 1.0})
    return outcome


def test_every_method_gets_the_products_classifier_and_aggregation(utility, tmp_path):
    """The study runs at the defaults a new user gets; the baselines get the same head, pooling,
    clip split and aggregation as PRISM (a fair comparison), and the zero-shot floor one run."""
    import tomllib

    defaults = tomllib.loads((BENCH.parents[1] / "pyproject.toml").read_text())["tool"]["flwr"][
        "app"
    ]["config"]
    args = make_args(
        utility, tmp_path, "--methods", "prism", "ffa", "central", "zero-shot", "--grid-C", "1.0"
    )
    calls: list = []
    runner = fake_runner(calls)

    def scored(spec, runs):  # the table knows prism and nondp only
        return runner({**spec, "method": "prism"} if spec["method"] != "nondp" else spec, runs)

    outcome = utility.study(args, scored)
    specs = [r["spec"] for results in outcome["finals"].values() for r in results]
    for spec in specs:
        assert spec["settings"] == {key: defaults[key] for key in utility.SETTINGS}
    assert args.rounds == defaults["num-rounds"] and args.batch_size == defaults["batch-size"]
    assert args.local_steps == defaults["local-steps"]
    assert args.max_length == defaults["max-length"]
    assert len(outcome["finals"][("zero-shot", 0.0)]) == 1  # no randomness: one run


def test_pairs_use_the_siamese_cosine_start_and_set_is_checked(utility, tmp_path, monkeypatch):
    monkeypatch.setattr(utility, "DATA_DIR", tmp_path)
    rows = [{"text_a": f"q {i}", "text_b": f"p {i}", "label": i % 2} for i in range(30)]
    folder = tmp_path / "medical_questions_pairs"
    folder.mkdir()
    for name in ("train.jsonl", "dev.jsonl"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--task", "medical_questions_pairs", "--out", str(tmp_path / "o"), "--select-rows", "5"]
    args = utility.parse_args(base)
    assert args.settings["text-pairs"] is True and args.settings["label-texts"] == ""
    args = utility.parse_args([*base, "--set", "aggregation=uniform", "head-lr=0.5"])
    assert args.settings["aggregation"] == "uniform" and args.settings["head-lr"] == 0.5
    with pytest.raises(SystemExit):
        utility.parse_args([*base, "--set", "aggregation=median"])  # not a product value
    with pytest.raises(SystemExit):
        utility.parse_args([*base, "--set", "epsilon-cap=1"])  # not a shared setting


def test_central_run_uses_the_federations_classifier(utility, tmp_path, monkeypatch):
    """``central`` (prism-train) gets every classifier flag from the same settings."""
    args = make_args(utility, tmp_path, "--set", "head-lr=2.5", "pooling=cls")
    spec = {**utility.base_spec(args, {"pool": "p", "select": "s"}), "method": "central",
            "epsilon": 3.0, "max_norm": 1.0, "lr": 0.005, "seed": 0}  # fmt: skip
    seen: list = []
    import client.cli

    monkeypatch.setattr(client.cli, "main", lambda argv: seen.append(argv) or 1)
    with pytest.raises(RuntimeError, match="exited with 1"):
        utility.central_run(spec, tmp_path / "c")
    flags = dict(zip(seen[0][::2], seen[0][1::2], strict=False))
    assert flags["--head-lr"] == "2.5" and flags["--pooling"] == "cls"
    assert flags["--head"] == spec["settings"]["lora-head"]
    assert flags["--head-max-norm"] == str(spec["settings"]["head-max-norm"])
    assert flags["--label-texts"] == spec["settings"]["label-texts"]
    assert flags["--batch-size"] == str(spec["sites"] * spec["batch_size"])


def test_a_methods_own_lr_grid(utility, tmp_path):
    args = make_args(utility, tmp_path, "--method-grid-lr", "nondp=0.02,0.01")
    calls: list = []
    outcome = utility.study(args, fake_runner(calls))
    grid_lrs = {c[3] for c in calls if c[0] == "nondp" and c[4] == 0}
    assert grid_lrs == {0.02, 0.01}
    assert {c[3] for c in calls if c[0] == "prism" and c[4] == 0 and c[1] == 3.0} == {0.02, 0.05}
    assert outcome["chosen"][("nondp", 0.0)] == (1.0, 0.02)
    with pytest.raises(SystemExit):
        make_args(utility, tmp_path, "--method-grid-lr", "nondp=fast")


def test_by_default_only_the_baselines_get_an_lr_grid(utility, tmp_path):
    rows = [{"text": f"row {i}", "label": i % 2} for i in range(40)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = utility.parse_args(
        ["--task", "custom", "--train", str(train), "--eval-data", str(train), "--num-labels",
         "2", "--select-rows", "10", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert args.grid_lr == [0.002]  # PRISM: the product's lr, chosen on public data
    assert args.method_grid_lr == {
        "fedavg-factors": list(utility.BASELINE_GRID_LR),
        "ffa": list(utility.BASELINE_GRID_LR),
    }


def test_epsilons_without_the_grid_epsilon_run_their_own_grid(utility, tmp_path):
    args = make_args(utility, tmp_path, "--epsilons", "6")  # default grid epsilon 3 is not asked
    calls: list = []
    outcome = utility.study(args, fake_runner(calls))
    assert set(outcome["grid"]) == {("prism", 6.0), ("nondp", 0.0)}
    assert {c[1] for c in calls if c[0] == "prism"} == {6.0}
