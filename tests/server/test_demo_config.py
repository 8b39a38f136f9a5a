"""``make demo DEMO_ARGS=...``: the user's run-config keys replace the demo's own defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from server.demo import ROOT, demo_run_config


def test_the_users_keys_override_the_demos_defaults():
    """The README's example: data, server-eval-data and partitioner given by the user."""
    extra = "data='/d/train.jsonl' server-eval-data='/d/dev.jsonl' partitioner='dirichlet'"
    config, run_dir = demo_run_config(extra, Path("/runs/demo-1"))
    keys = [pair.split("=", 1)[0] for pair in config.split()]
    assert len(keys) == len(set(keys))  # Flower refuses a key named twice
    assert parse_config_args([config]) == {
        "run-dir": "/runs/demo-1",
        "server-eval-data": "/d/dev.jsonl",  # the user's, not the demo's 'synthetic'
        "data": "/d/train.jsonl",
        "partitioner": "dirichlet",
    }
    assert run_dir == Path("/runs/demo-1")


def test_defaults_apply_when_not_given_and_a_relative_run_dir_is_rooted():
    config, run_dir = demo_run_config("", Path("/runs/demo-2"))
    assert parse_config_args([config]) == {
        "run-dir": "/runs/demo-2",
        "server-eval-data": "synthetic",
        "privacy-unit": "user",  # the built-in notes have patients: epsilon per patient
    }
    config, run_dir = demo_run_config("run-dir='runs/mine' num-rounds=5 lr=0.5", Path("/x"))
    values = parse_config_args([config])
    assert run_dir == ROOT / "runs" / "mine" and values["run-dir"] == str(run_dir)
    assert values["num-rounds"] == 5 and values["lr"] == 0.5
    assert values["server-eval-data"] == "synthetic"
    assert values["privacy-unit"] == "user"
    config, _ = demo_run_config("privacy-unit='record'", Path("/x"))
    assert parse_config_args([config])["privacy-unit"] == "record"  # the user's choice wins


def test_the_users_own_data_get_no_synthetic_held_out_set():
    """The built-in task's held-out draw does not evaluate another task's model: with the
    user's data and no server-eval-data the demo asks for none, and the run config is valid."""
    from prism_runtime.config import RunConfig, parse_config
    from prism_runtime.errors import ConfigError

    config, _ = demo_run_config("data='/d/pairs.jsonl'", Path("/runs/demo-3"))
    values = parse_config_args([config])
    assert values == {"run-dir": "/runs/demo-3", "data": "/d/pairs.jsonl"}
    assert parse_config(RunConfig, values, what="run config").server_eval_data == ""
    with pytest.raises(ConfigError, match="server-eval-data='synthetic' is a held-out draw"):
        parse_config(RunConfig, {**values, "server-eval-data": "synthetic"}, what="run config")


def test_a_malformed_run_config_is_a_clear_error():
    with pytest.raises(ValueError, match="invalid format"):
        demo_run_config("num-rounds=5 lr=0.5.5", Path("/x"))
