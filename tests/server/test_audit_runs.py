"""Audit part (0): a run configured or reported as non-private, or with a setting or fact outside
its accepted range (``prism_runtime.ranges``), fails the audit, with the reason."""

from __future__ import annotations

import json

import pytest

from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import PrivacyEvent
from prism_runtime.config import RunConfig
from prism_runtime.protocol import RNG, RNG_REPRODUCIBLE, RNG_SECURE
from prism_runtime.ranges import (
    LOCAL_STEPS_MAX,
    MAX_NORM_MAX,
    MAX_NORM_MIN,
    QUANTILE_STEPS_MAX,
    SERVER_ROUND_MAX,
    SIGMA_MAX,
    SIGMA_MIN,
)
from server.audit.runs import (
    NONPRIVATE,
    OUT_OF_RANGE,
    check_run,
    config_findings,
    config_range_findings,
    fact_findings,
    fact_range_findings,
)
from server.ledger import Ledger, LedgerEvent


def _config(**overrides) -> dict:
    """A run config exactly as the coordinator records it (``RunConfig``, kebab-case keys)."""
    return RunConfig.model_validate(overrides).model_dump(by_alias=True)


def _recorded(**overrides) -> dict:
    """A run config as an older or a hostile coordinator may have recorded it: the default one
    with ``overrides`` that the current ``RunConfig`` need not accept (never validated)."""
    return {**_config(), **overrides}


def test_the_default_run_config_is_private():
    assert config_findings(_config(), source="s", subject="run r") == []
    assert config_findings(_config(**{"noise-multiplier": 1.5}), source="s", subject="r") == []


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        ({"method": "nondp"}, "method", "without differential privacy"),
        ({"report-train-loss": True}, "report-train-loss", "un-noised training loss"),
        ({"noise-multiplier": 0.0}, "noise-multiplier", "no noise"),
    ],
)
def test_each_non_private_setting_is_found_with_its_reason(overrides, key, reason):
    (finding,) = config_findings(_recorded(**overrides), source="ledger", subject="run r1")
    assert finding.key == key and reason in finding.reason and finding.kind == NONPRIVATE
    assert finding.line().startswith(f"run r1: {key} = ")


def test_snake_case_keys_are_read_too():
    found = config_findings({"report_train_loss": True}, source="s", subject="r")
    assert [f.key for f in found] == ["report-train-loss"]


def test_facts_reporting_reproducible_randomness_or_no_noise_are_found_once_per_site():
    facts = [
        {"site-id": "a", RNG: RNG_REPRODUCIBLE, "mechanism": "prism-tangent-gaussian", "steps": 5},
        {"site-id": "a", RNG: RNG_REPRODUCIBLE, "mechanism": "prism-tangent-gaussian", "steps": 5},
        {"site-id": "b", RNG: RNG_SECURE, "mechanism": "none", "sigma": 0.0, "steps": 5},
        {"site-id": "c", RNG: RNG_SECURE, "mechanism": "none", "sigma": 0.0, "steps": 0},
    ]
    found = {(f.subject, f.key) for f in fact_findings(facts, source="site facts")}
    assert found == {("site a", RNG), ("site b", "mechanism"), ("site b", "sigma")}


def _ledger(
    path,
    config: dict | None,
    *,
    sigma: float = 1.2,
    mechanism: str | None = None,
    steps: int = 5,
    round: int = 1,
):
    with Ledger.open(path) as led:
        if config is not None:
            led.record_run("run-1", config)
        extra = {} if mechanism is None else {"mechanism": mechanism}
        event = PrivacyEvent(sigma, 0.1, steps, **extra)
        led.append(LedgerEvent(run_id="run-1", round=round, site_id="a", event=event, delta=1e-5))
    return path


def test_check_run_reads_the_ledger_and_the_run_folder(tmp_path):
    path = _ledger(tmp_path / "ledger.sqlite", _config())
    with Ledger.open(path, create=False, read_only=True) as led:
        clean = check_run(led)
    assert clean.passed and clean.notes == []
    (tmp_path / "run-config.json").write_text(json.dumps(_config(**{"report-train-loss": True})))
    with Ledger.open(path, create=False, read_only=True) as led:
        found = check_run(led, run_config=tmp_path / "run-config.json")
    (finding,) = found.findings
    assert finding.key == "report-train-loss" and finding.source.endswith("run-config.json")


def test_a_nondp_run_recorded_in_the_ledger_fails(tmp_path):
    path = _ledger(tmp_path / "l.sqlite", _config(method="nondp"), sigma=0.0, mechanism="none")
    with Ledger.open(path, create=False, read_only=True) as led:
        check = check_run(led)
    assert {f.key for f in check.findings} == {"method", "mechanism", "sigma"}
    assert not check.passed


def test_an_unreadable_run_config_is_a_finding_and_a_missing_one_a_note(tmp_path):
    path = _ledger(tmp_path / "l.sqlite", None)
    (tmp_path / "bad.json").write_text("{not json")
    with Ledger.open(path, create=False, read_only=True) as led:
        bad = check_run(led, run_config=tmp_path / "bad.json")
        none = check_run(led)
    assert [f.value for f in bad.findings] == ["unreadable"]
    assert none.passed and "no run configuration found" in none.notes[0]


def test_reported_facts_are_checked(tmp_path):
    path = _ledger(tmp_path / "l.sqlite", _config())
    with Ledger.open(path, create=False, read_only=True) as led:
        check = check_run(led, facts=[{"site-id": "a", RNG: RNG_REPRODUCIBLE}])
    (finding,) = check.findings
    assert finding.key == RNG and finding.source == "site facts"


# -- the accepted ranges ---------------------------------------------------------------------


def _refused(config: dict) -> dict[str, tuple[str, str]]:
    """``key -> (value, reason)`` of the out-of-range findings of one recorded run config."""
    found = config_range_findings(config, source="ledger", subject="run r1")
    assert all(f.kind == OUT_OF_RANGE for f in found)
    return {f.key: (f.value, f.reason) for f in found}


def test_a_run_config_the_model_accepts_has_no_out_of_range_finding():
    assert _refused(_config()) == {}
    assert _refused({"method": "nondp"}) == {}  # a partial config: the rest are defaults
    assert _refused(_config(**{"max-norm": "auto"})) == {}


@pytest.mark.parametrize(
    ("overrides", "ok"),
    [
        ({"noise-multiplier": -1.0}, True),
        ({"noise-multiplier": SIGMA_MIN}, True),
        ({"noise-multiplier": SIGMA_MAX}, True),
        ({"noise-multiplier": SIGMA_MIN * (1 - 1e-9)}, False),
        ({"noise-multiplier": SIGMA_MAX * (1 + 1e-9)}, False),
        ({"noise-multiplier": 0.0}, False),
        ({"noise-multiplier": -0.5}, False),
        ({"max-norm": MAX_NORM_MIN, "head-max-norm": -1.0}, True),
        ({"max-norm": MAX_NORM_MAX, "head-max-norm": -1.0}, True),
        ({"max-norm": MAX_NORM_MIN * (1 - 1e-9), "head-max-norm": -1.0}, False),
        ({"max-norm": MAX_NORM_MAX * (1 + 1e-9), "head-max-norm": -1.0}, False),
        ({"local-steps": LOCAL_STEPS_MAX, "num-rounds": 1}, True),
        ({"local-steps": LOCAL_STEPS_MAX + 1, "num-rounds": 1}, False),
        ({"local-steps": 0}, False),
    ],
)
def test_a_recorded_setting_at_the_edges_of_its_range(overrides, ok):
    refused = _refused(_recorded(**overrides))
    if ok:
        assert refused == {}
    else:
        ((key, (value, _)),) = refused.items()
        assert key == next(iter(overrides)) and value == json.dumps(overrides[key])


def test_each_refused_key_is_reported_with_its_value_and_its_allowed_range():
    config = _recorded(
        **{"noise-multiplier": 0.1, "max-norm": 1e-7, "head-max-norm": -1.0, "num-rounds": 0}
    )
    refused = _refused(config)
    assert set(refused) == {"noise-multiplier", "max-norm", "num-rounds"}
    assert refused["noise-multiplier"][0] == "0.1"
    assert refused["noise-multiplier"][1].endswith(
        "(allowed: a number in [0.3, 10000], or -1 to calibrate)"
    )
    assert refused["max-norm"][0] == "1e-07"
    assert refused["max-norm"][1].endswith("(allowed: a number in [1e-06, 10000], or 'auto')")
    assert refused["num-rounds"][1].endswith("(allowed: an integer >= 1 and <= 100000)")


def test_unknown_keys_and_a_broken_rule_across_keys_are_reported():
    config = _recorded(**{"secure-rng": True, "colour": "red", "min-sites": 4})
    refused = _refused(config)
    assert set(refused) == {"secure-rng", "colour", "run config"}
    assert refused["secure-rng"] == (
        "true",
        "the run config refuses the key: no key of that name exists",
    )
    assert refused["colour"] == (
        '"red"',
        "the run config refuses the key: no key of that name exists",
    )
    assert "min-sites=4 exceeds sites-per-round=3" in refused["run config"][1]


def test_snake_case_keys_are_checked_under_their_kebab_case_names():
    assert set(_refused({"noise_multiplier": 0.1, "local_steps": 2})) == {"noise-multiplier"}


def test_a_recorded_config_the_model_refuses_is_read_and_reported_twice(tmp_path):
    """``noise-multiplier = 0``: non-private AND out of range, from the ledger's record and from
    the run folder's file, and the audit reads on (no exception)."""
    path = _ledger(tmp_path / "ledger.sqlite", _recorded(**{"noise-multiplier": 0.0}))
    (tmp_path / "run-config.json").write_text(json.dumps(_recorded(**{"noise-multiplier": 0.0})))
    with Ledger.open(path, create=False, read_only=True) as led:
        check = check_run(led, run_config=tmp_path / "run-config.json")
    assert not check.passed
    found = sorted((f.source, f.kind, f.key, f.value) for f in check.findings)
    folder = str(tmp_path / "run-config.json")
    assert found == sorted(
        [
            ("ledger run config", NONPRIVATE, "noise-multiplier", "0.0"),
            ("ledger run config", OUT_OF_RANGE, "noise-multiplier", "0.0"),
            (folder, NONPRIVATE, "noise-multiplier", "0.0"),
            (folder, OUT_OF_RANGE, "noise-multiplier", "0.0"),
        ]
    )
    (ranged,) = [f for f in check.findings if f.kind == OUT_OF_RANGE and f.source == folder]
    assert ranged.line().startswith("run folder: noise-multiplier = 0.0 (")
    assert "must be in [0.3, 10000]" in ranged.reason


@pytest.mark.parametrize(
    ("fact", "key"),
    [
        ({"sigma": 0.0, "steps": 5}, None),  # no noise: fact_findings reports it
        ({"sigma": SIGMA_MIN}, None),
        ({"sigma": SIGMA_MAX}, None),
        ({"sigma": SIGMA_MIN * (1 - 1e-9)}, "sigma"),
        ({"sigma": SIGMA_MAX * (1 + 1e-9)}, "sigma"),
        ({"sigma": "1.0"}, "sigma"),
        ({"quantile-sigma": SIGMA_MIN}, None),
        ({"quantile-sigma": 0.1}, "quantile-sigma"),
        ({"max-norm": MAX_NORM_MIN}, None),
        ({"max-norm": MAX_NORM_MAX}, None),
        ({"max-norm": MAX_NORM_MIN * (1 - 1e-9)}, "max-norm"),
        ({"max-norm": MAX_NORM_MAX * (1 + 1e-9)}, "max-norm"),
        ({"steps": LOCAL_STEPS_MAX}, None),
        ({"steps": LOCAL_STEPS_MAX + 1}, "steps"),
        ({"steps": -1}, "steps"),
        ({"mechanism": QUANTILE_MECHANISM, "steps": QUANTILE_STEPS_MAX}, None),
        ({"mechanism": QUANTILE_MECHANISM, "steps": QUANTILE_STEPS_MAX + 1}, "steps"),
        ({"quantile-steps": QUANTILE_STEPS_MAX + 1}, "quantile-steps"),
        ({"server-round": 1}, None),
        ({"server-round": SERVER_ROUND_MAX}, None),
        ({"server-round": 0}, "server-round"),
        ({"server-round": SERVER_ROUND_MAX + 1}, "server-round"),
    ],
)
def test_a_fact_at_the_edges_of_its_range(fact, key):
    found = fact_range_findings([{"site-id": "a", **fact}], source="site facts")
    if key is None:
        assert found == []
    else:
        (finding,) = found
        assert (finding.subject, finding.key, finding.kind) == ("site a", key, OUT_OF_RANGE)
        assert finding.value == json.dumps(fact[key])


def test_ledger_events_outside_the_ranges_fail_the_audit_once_per_site_and_value(tmp_path):
    path = _ledger(tmp_path / "l.sqlite", _config(), sigma=0.2, steps=LOCAL_STEPS_MAX + 1, round=0)
    with Ledger.open(path) as led:  # a second event with the same sigma: reported once
        event = PrivacyEvent(0.2, 0.1, 5)
        led.append(LedgerEvent(run_id="run-1", round=2, site_id="a", event=event, delta=1e-5))
    with Ledger.open(path, create=False, read_only=True) as led:
        check = check_run(led)
    assert not check.passed
    found = sorted((f.source, f.kind, f.key, f.value) for f in check.findings)
    assert found == [
        ("ledger events", OUT_OF_RANGE, "server-round", "0"),
        ("ledger events", OUT_OF_RANGE, "sigma", "0.2"),
        ("ledger events", OUT_OF_RANGE, "steps", str(LOCAL_STEPS_MAX + 1)),
    ]
    (sigma,) = [f for f in check.findings if f.key == "sigma"]
    assert (
        sigma.reason
        == "neither 0 (no noise) nor in [0.3, 10000], the noise multipliers a site runs"
    )


def test_reported_facts_outside_the_ranges_are_found(tmp_path):
    path = _ledger(tmp_path / "l.sqlite", _config())
    facts = [{"site-id": "a", "sigma": 1.0, "max-norm": 2e4, "steps": 1, "server-round": 1}]
    with Ledger.open(path, create=False, read_only=True) as led:
        check = check_run(led, facts=facts)
    (finding,) = check.findings
    assert (finding.source, finding.key, finding.value) == ("site facts", "max-norm", "20000.0")
    assert finding.reason == "not in [1e-06, 10000], the clips a site runs"
