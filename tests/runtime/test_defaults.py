"""One set of defaults: the run config, a site's trainer and prism-train agree, and the
coordinator's update bound comes from the TrainConfig the sites run (prism_runtime.config,
prism_runtime.train_config)."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from client.cli import build_configs
from prism_runtime.config import RunConfig, parse_config, site_method
from prism_runtime.model import ModelConfig, model_config_for
from prism_runtime.train_config import (
    ADAMW_BETAS,
    DEFAULT_HEAD_SHARE,
    AdaptiveSettings,
    TrainConfig,
    site_train_config,
)
from server.strategy import UpdateBound

SHARED = ("batch_size", "micro_batch_size", "max_norm", "lr", "head_optimizer", "delta")


def default_run() -> RunConfig:
    return parse_config(RunConfig, {"model": "minilm"}, what="run config")


def test_a_trainconfig_with_nothing_set_trains_like_a_default_run() -> None:
    run, train = default_run(), TrainConfig(noise_multiplier=1.0)
    for name in SHARED:
        assert getattr(train, name) == getattr(run, name), name
    assert train.head_lr == run.head_learning_rate
    assert train.head_max_norm == pytest.approx(run.head_clip, rel=1e-12)


def test_site_train_config_of_a_default_run_is_the_default_trainconfig() -> None:
    run = default_run()
    derived = site_train_config(
        run, method=site_method(run.method), max_norm=1.0, epsilon=run.target_epsilon
    )
    plain = TrainConfig(epsilon=run.target_epsilon, steps=run.local_steps, progress=False)
    assert derived == plain


def test_prism_train_defaults_are_the_run_defaults() -> None:
    model, train, _ = build_configs({"model": "m", "data": "d.jsonl", "epsilon": 3.0}, {})
    run = default_run()
    for name in SHARED:
        assert getattr(train, name) == getattr(run, name), name
    reference = model_config_for(run)
    for name in ("rank", "alpha", "target_modules"):
        assert getattr(model, name) == getattr(reference, name), name
    assert isinstance(model, ModelConfig)


def test_the_head_share_follows_the_clip_unless_set_and_minus_one_is_a_joint_clip() -> None:
    assert TrainConfig(noise_multiplier=1.0, max_norm=0.5).head_max_norm == pytest.approx(
        DEFAULT_HEAD_SHARE * 0.5, rel=1e-12
    )
    assert TrainConfig(noise_multiplier=1.0, head_max_norm=None).head_max_norm is None
    _, joint, _ = build_configs(
        {"model": "m", "data": "d.jsonl", "epsilon": 3.0, "head_max_norm": -1}, {}
    )
    assert joint.head_max_norm is None


def test_the_update_bound_reads_the_sites_optimizer_settings() -> None:
    run = default_run()
    train = site_train_config(run, method="prism", max_norm=1.0, epsilon=3.0)
    bound = UpdateBound.for_sites(train)
    assert (bound.lr, bound.max_norm, bound.expected_batch_size) == (
        run.lr,
        1.0,
        float(run.batch_size),
    )
    assert (bound.head_lr, bound.head_optimizer) == (run.head_learning_rate, run.head_optimizer)
    assert (bound.beta1, bound.beta2, bound.head_betas) == (0.9, 0.999, ADAMW_BETAS)
    assert bound.bias_correction is True
    # sites with other adaptive betas get a bound with THEIR betas, not a coincidence of defaults
    other = train.model_copy(update={"adaptive": AdaptiveSettings(beta1=0.5, beta2=0.99)})
    moved = UpdateBound.for_sites(other)
    assert (moved.beta1, moved.beta2) == (0.5, 0.99)
    assert math.isclose(moved.lr, bound.lr)


def test_the_apps_run_config_is_the_run_configs_defaults() -> None:
    """``[tool.flwr.app.config]`` in pyproject.toml lists every run-config key at its default."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    table = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["flwr"]["app"]["config"]
    keys = {name.replace("_", "-") for name in RunConfig.model_fields}
    assert set(table) == keys, (sorted(keys - set(table)), sorted(set(table) - keys))
    parsed = parse_config(RunConfig, table, what="run config")
    assert parsed == RunConfig()
    for key, value in table.items():  # the same values, not only equal after validation
        assert value == RunConfig().model_dump(by_alias=True)[key], key
