"""Audit part (0): a run configured or reported as non-private fails the audit, with the reason."""

from __future__ import annotations

import json

import pytest

from prism_core.records import PrivacyEvent
from prism_runtime.config import RunConfig
from prism_runtime.protocol import RNG, RNG_REPRODUCIBLE, RNG_SECURE
from server.audit.runs import check_run, config_findings, fact_findings
from server.ledger import Ledger, LedgerEvent


def _config(**overrides) -> dict:
    """A run config exactly as the coordinator records it (``RunConfig``, kebab-case keys)."""
    return RunConfig.model_validate(overrides).model_dump(by_alias=True)


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
    (finding,) = config_findings(_config(**overrides), source="ledger", subject="run r1")
    assert finding.key == key and reason in finding.reason
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


def _ledger(path, config: dict | None, *, sigma: float = 1.2, mechanism: str | None = None):
    with Ledger.open(path) as led:
        if config is not None:
            led.record_run("run-1", config)
        extra = {} if mechanism is None else {"mechanism": mechanism}
        event = PrivacyEvent(sigma, 0.1, 5, **extra)
        led.append(LedgerEvent(run_id="run-1", round=0, site_id="a", event=event, delta=1e-5))
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
