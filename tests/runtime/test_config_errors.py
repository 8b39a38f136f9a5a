"""Every bad run-config and node-config value is refused with its key, its value and the rule.

The cases are derived from the pydantic model fields (type, bounds, choices), so a key added
later is covered automatically; a field for which no bad value can be derived fails the test.
"""

from __future__ import annotations

import math
from typing import Any, get_args

import annotated_types
import pytest
from pydantic import BaseModel

from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError
from prism_runtime.ranges import MAX_RECORDS_PER_USER_MAX

_SYMBOL = {
    annotated_types.Gt: ("gt", ">"),
    annotated_types.Ge: ("ge", ">="),
    annotated_types.Lt: ("lt", "<"),
    annotated_types.Le: ("le", "<="),
}
_CUSTOM = {  # fields whose rule is not a plain bound: a value just outside it
    "noise_multiplier": [-0.5, -2.0],
    "epsilon_cap": [0.0, -3.0, -1.0],
    "delta": [0.0, 1.0, -0.5],
    "require_secure_rng": ["maybe", 2],
    "lora_targets": [",", " , "],
    "head_max_norm": [0.0, -2.0],
    "head_lr": [0.0, -0.5],
    "max_norm": [0.0, -1.0, "automatic", math.inf],
    "num_labels": [1, 0, 2.5, True, "automatic"],
    "text_pairs": ["maybe", 2, "yes"],
    "label_texts": ["a||b", "|", "a| "],
    "privacy_unit": ["person", "records"],
    "min_honest_sites": [0, 1001],
    "secure_max_dropouts": [-1, 1000],
    "secure_graph": ["sparser", 2],
    "max_records_per_user": [0, MAX_RECORDS_PER_USER_MAX + 1],
}


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _bad_values(model: type[BaseModel], name: str) -> list[tuple[Any, list[str]]]:
    """``(bad value, words the message must contain to state the allowed range)`` pairs."""
    info = model.model_fields[name]
    args = get_args(info.annotation) or (info.annotation,)
    choices = [a for a in args if isinstance(a, str)]
    if choices:
        rule = [repr(c) for c in choices]
        return [("no-such-choice", rule), (3, rule)]
    if info.annotation is bool:
        return [("maybe", ["true or false"]), (2, ["true or false"])]
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "allowed" in extra:
        wrong_type = 5 if info.annotation is str else "oops"
        return [(v, [str(extra["allowed"])]) for v in [*_CUSTOM[name], wrong_type]]
    bounds = [
        (symbol, getattr(m, attr))
        for m in info.metadata
        for cls, (attr, symbol) in _SYMBOL.items()
        if isinstance(m, cls)
    ]
    rule = [f"{s} {v}" for s, v in bounds]
    out: list[tuple[Any, list[str]]] = []
    for symbol, bound in bounds:  # just outside each bound
        step = 1 if info.annotation is int else 0.5
        outside = {">": bound, ">=": bound - step, "<": bound, "<=": bound + step}[symbol]
        out.append((outside, rule))
    if info.annotation is int:
        out += [("many", ["integer", *rule]), (2.5, ["integer", *rule])]
    elif info.annotation is float:
        words = ["finite number", *rule]
        out += [("fast", words), (math.nan, words), (math.inf, words), (-math.inf, words)]
    elif info.annotation is str:
        words = (
            ["non-empty string"]
            if any(getattr(m, "min_length", 0) for m in info.metadata)
            else ["string"]
        )
        out += [(5, words), (2.5, words)]
        if words == ["non-empty string"]:
            out.append(("", words))
    return out


def _cases(model: type[BaseModel]) -> list[Any]:
    cases = []
    for name in model.model_fields:
        values = _bad_values(model, name)
        if not values:
            cases.append(pytest.param(model, name, None, [], id=f"{model.__name__}-{name}-NONE"))
        for value, words in values:
            cases.append(
                pytest.param(model, name, value, words, id=f"{model.__name__}-{name}-{value!r}")
            )
    return cases


@pytest.mark.parametrize(
    ("model", "name", "value", "words"), _cases(RunConfig) + _cases(SiteConfig)
)
def test_bad_value_names_key_value_and_allowed_range(model, name, value, words):
    assert words, f"no bad value derived for {name}: extend _bad_values for its type"
    key = _kebab(name)
    with pytest.raises(ConfigError) as info:
        parse_config(model, {key: value}, what="run config")
    message = str(info.value)
    assert f"{key}={value!r}" in message
    for word in words:
        assert word in message, (word, message)


def test_rule_across_keys_names_both_and_the_rule():
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, {"min-sites": 4, "sites-per-round": 2}, what="run config")
    message = str(info.value)
    assert "min-sites=4" in message and "sites-per-round=2" in message
    assert "1 <= min-sites <= sites-per-round" in message


def test_a_secure_run_names_every_setting_it_cannot_run_with():
    bad = {
        "secure-aggregation": True,
        "method": "ffa",
        "local-steps": 2,
        "max-norm": "auto",
        "min-honest-sites": 4,
        "sites-per-round": 3,
    }
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, bad, what="run config")
    message = str(info.value)
    for words in ("method='ffa'", "local-steps=2", "max-norm=auto", "min-honest-sites=4 > "):
        assert words in message, message


def test_one_sample_rate_is_a_secure_aggregation_setting():
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, {"sample-rate": 0.01}, what="run config")
    assert "sample-rate=0.01 needs secure-aggregation=true" in str(info.value)
    run = parse_config(
        RunConfig, {"sample-rate": 0.01, "secure-aggregation": True}, what="run config"
    )
    assert run.sample_rate == 0.01


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown run config key\(s\) \['lora-rnk'\]") as info:
        parse_config(RunConfig, {"lora-rnk": 4}, what="run config")
    assert "'lora-rank'" in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, {"lr": -1.0, "num-rounds": 0}, what="run config")
    assert "lr=-1.0" in str(info.value) and "num-rounds=0" in str(info.value)


def test_defaults_are_valid():
    assert parse_config(RunConfig, {}, what="run config") == RunConfig()
    assert parse_config(SiteConfig, {}, what="node config") == SiteConfig()


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("option", ["lr", "max_norm", "epsilon", "delta", "noise_multiplier"])
def test_prism_train_refuses_non_finite_numbers_naming_flag_value_and_range(option, value):
    from client.cli import build_configs

    values = {"model": "m", "data": "train.jsonl", "epsilon": 3.0, option: value}
    with pytest.raises(ConfigError) as info:
        build_configs(values, {})
    message = str(info.value)
    assert f"--{option.replace('_', '-')}={value!r}" in message
    assert "finite number" in message and "(allowed: a finite number >" in message
