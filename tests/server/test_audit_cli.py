"""``prism-fl audit``: tables, audit.json, exit status, and the ledger left untouched."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3

import pytest

from prism_core.records import PrivacyEvent
from server.cli import EXIT_AUDIT_FAILED, EXIT_OK, EXIT_USAGE, main
from server.ledger import Ledger, LedgerEvent

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # PRV at q=1


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        for r in (1, 2):
            for site in ("hospital-a", "hospital-b"):
                led.append(
                    LedgerEvent(
                        run_id="run-1",
                        round=r,
                        site_id=site,
                        event=PrivacyEvent(1.2, 0.1, 5),
                        delta=1e-5,
                        epsilon_cap=3.0,
                    )
                )
    return path


def test_audit_prints_every_part_writes_json_and_leaves_the_ledger_unchanged(
    ledger, tmp_path, capsys
):
    before = _digest(ledger)
    code = main(["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert _digest(ledger) == before
    for text in ("hospital-a", "hospital-b", "PRV (claimed)", "PLD (dp_accounting)"):
        assert text in out
    for text in (
        "sensitivity (global clip)",
        "noise std / (sigma C / b), A-perp block",
        "eps lower bound",
        "(0) run configuration and site facts",
        "pass: no non-private setting or fact found",
    ):
        assert text in out
    assert re.search(
        r"detects sigma_true <= 0\.\d+ sigma_claimed in any one block and <= 0\.\d+ "
        r"sigma_claimed in all blocks at once, each with probability 0\.99",
        out,
    )
    assert "verdict: PASS" in out and "why:" not in out
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert audit["verdict"] == "pass" and audit["reasons"] == []
    assert audit["run"]["verdict"] == "pass"
    assert [s["site_id"] for s in audit["accountants"]] == ["hospital-a", "hospital-b"]
    assert all(s["verdict"] == "pass" for s in audit["accountants"])
    assert len(audit["mechanism_checks"]) == 7  # sensitivity, independence, 5 noise blocks
    canary = audit["canary"]
    assert canary["canaries"] == 1000 and canary["guesses"] == 200
    assert 0 < canary["lower_bound"] <= canary["claimed_epsilon"]
    assert [t["name"] for t in canary["noise_tests"]] == ["core", "A-perp", "B-perp", "head", "all"]
    assert canary["detects_any_block"] < canary["detects_all_blocks"] < 1


def test_an_injected_bug_fails_the_audit_with_exit_status_3(ledger, tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["audit", "--ledger", str(ledger), "--out", str(out_dir)]
    code = main([*argv, "--inject-bug", "per-module-clip"])
    out = capsys.readouterr().out
    assert code == EXIT_AUDIT_FAILED
    assert "SELF-TEST" in out and "verdict: FAIL" in out
    audit = json.loads((out_dir / "audit.json").read_text())
    assert audit["verdict"] == "FAIL" and audit["mechanism"] == "per-module-clip"
    assert audit["canary"]["lower_bound"] > audit["canary"]["claimed_epsilon"]


@pytest.mark.parametrize("bug", ["half-noise", "no-perp-noise"])
def test_half_noise_and_a_missing_noise_block_fail_the_audit(ledger, tmp_path, capsys, bug):
    code = main(
        ["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out"), "--inject-bug", bug]
    )
    out = capsys.readouterr().out
    assert code == EXIT_AUDIT_FAILED
    assert "verdict: FAIL" in out
    assert "why: canary noise, A-perp: std / claimed = " in out
    assert "why: mechanism check failed: noise std / (sigma C / b), A-perp block" in out


def _run_ledger(path, config):
    with Ledger.open(path) as led:
        led.record_run("run-1", config)
        led.append(
            LedgerEvent(
                run_id="run-1", round=1, site_id="a", event=PrivacyEvent(1.2, 0.1, 5), delta=1e-5
            )
        )
    return path


def test_a_run_recorded_as_nondp_fails_with_the_reason(tmp_path, capsys):
    ledger = _run_ledger(tmp_path / "ledger.sqlite", {"method": "nondp"})
    before = _digest(ledger)
    code = main(["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == EXIT_AUDIT_FAILED
    assert (
        'why: non-private run: run run-1: method = "nondp" (ledger run config): the run trains '
        "without differential privacy" in out
    )
    assert _digest(ledger) == before
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert audit["verdict"] == "FAIL" and audit["run"]["findings"][0]["key"] == "method"


def test_a_recorded_config_the_model_refuses_fails_as_non_private_and_out_of_range(
    tmp_path, capsys
):
    """``noise-multiplier = 0`` (refused by the current run config, as an older or hostile
    coordinator may have recorded it): the audit reads it, names both findings and fails."""
    ledger = _run_ledger(tmp_path / "ledger.sqlite", {"method": "prism", "noise-multiplier": 0.0})
    code = main(["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == EXIT_AUDIT_FAILED
    assert (
        "why: non-private run: run run-1: noise-multiplier = 0.0 (ledger run config): no noise"
        in out
    )
    assert (
        "why: out-of-range run: run run-1: noise-multiplier = 0.0 (ledger run config): must be "
        "in [0.3, 10000]" in out
    )
    assert "(allowed: a number in [0.3, 10000], or -1 to calibrate)" in out
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    kinds = [(f["kind"], f["key"]) for f in audit["run"]["findings"]]
    assert kinds == [("non-private", "noise-multiplier"), ("out-of-range", "noise-multiplier")]


def test_the_run_folders_run_config_is_read(tmp_path, capsys):
    ledger = _run_ledger(tmp_path / "ledger.sqlite", {"method": "prism"})
    (tmp_path / "run-config.json").write_text(json.dumps({"report-train-loss": True}))
    code = main(["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == EXIT_AUDIT_FAILED
    assert "why: non-private run: run folder: report-train-loss = true" in out
    assert "sites send their un-noised training loss" in out


def test_a_missing_run_config_file_is_a_usage_error(ledger, tmp_path, capsys):
    argv = ["audit", "--ledger", str(ledger), "--run-config", str(tmp_path / "nope.json")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--run-config {tmp_path / 'nope.json'}: no such file" in err
    assert not (tmp_path / "out").exists()


def test_a_foreign_file_is_refused_unchanged(tmp_path, capsys):
    foreign = tmp_path / "other.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE patients (id INTEGER)")
    conn.commit()
    conn.close()
    before = _digest(foreign)
    code = main(["audit", "--ledger", str(foreign), "--out", str(tmp_path / "out")])
    assert code == EXIT_USAGE
    assert "not a prism-fl ledger" in capsys.readouterr().err
    assert _digest(foreign) == before
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--guesses", "7"], "guesses=7 must be even and in [2, canaries]"),
        (["--canaries", "5000"], "must be >= canaries=5000"),
    ],
)
def test_bad_settings_name_the_key_and_the_allowed_range(ledger, tmp_path, capsys, args, message):
    code = main(["audit", "--ledger", str(ledger), "--out", str(tmp_path / "out"), *args])
    assert code == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_option_values_are_refused_by_the_parser(ledger, capsys):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--ledger", str(ledger), "--confidence", "1.5"])
    assert info.value.code == EXIT_USAGE
    assert "expected a number in (0, 1), found 1.5" in capsys.readouterr().err
