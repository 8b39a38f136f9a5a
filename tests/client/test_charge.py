"""A round's charge: the cap check before it, the durable charge, the check against what ran."""

from __future__ import annotations

import logging

import pytest

from client.charge import Charge, charge, check_charged, plan_charge
from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.accounting import epsilon
from prism_core.records import PrivacyEvent
from prism_runtime.errors import AccountingMismatchError

DELTA = 1e-5
STEPS = PrivacyEvent(1.0, 0.25, 2)
ESTIMATE = PrivacyEvent(0.8, 0.25, 20, mechanism="quantile-count-gaussian")


def _plan(ledger, cap, before=()):
    return plan_charge(
        ledger, STEPS, server_round=3, delta=DELTA, cap=cap, before=before, site_id="s"
    )


def test_a_charge_that_fits_the_cap_is_planned_for_its_round(tmp_path):
    planned = _plan(SiteLedger(tmp_path), cap=epsilon([STEPS], DELTA) * 1.01)
    assert planned == SiteLedgerEntry(3, STEPS, DELTA)


def test_the_cap_check_counts_the_steps_it_is_about_to_charge(tmp_path, caplog):
    ledger = SiteLedger(tmp_path)
    with caplog.at_level(logging.INFO, logger="client.charge"):
        assert _plan(ledger, cap=epsilon([STEPS], DELTA) * 0.99) is None
    assert "2 more steps would pass its cap" in caplog.text
    assert not ledger.path.exists()  # planning never writes


def test_events_still_to_be_charged_count_in_the_cap_check(tmp_path):
    ledger = SiteLedger(tmp_path)
    cap = (epsilon([STEPS], DELTA) + epsilon([ESTIMATE, STEPS], DELTA)) / 2
    assert _plan(ledger, cap) is not None
    assert _plan(ledger, cap, before=[ESTIMATE]) is None


def test_the_cap_check_reads_charges_another_process_made(tmp_path):
    ledger = SiteLedger(tmp_path)
    cap = epsilon([STEPS], DELTA) * 1.01  # one round fits, two do not
    assert _plan(ledger, cap) is not None
    SiteLedger(tmp_path).charge(SiteLedgerEntry(1, STEPS, DELTA))  # another process
    assert _plan(ledger, cap) is None


def test_a_non_private_run_is_never_capped(tmp_path):
    ledger = SiteLedger(tmp_path)
    for r in (1, 2):
        ledger.charge(SiteLedgerEntry(r, PrivacyEvent(0.0, 0.25, 2), DELTA))
    assert ledger.epsilon(DELTA) == float("inf")
    assert _plan(ledger, cap=None) == SiteLedgerEntry(3, STEPS, DELTA)


def test_a_charge_is_durable_on_return_with_its_position_and_history(tmp_path):
    ledger = SiteLedger(tmp_path)
    first = charge(ledger, SiteLedgerEntry(1, ESTIMATE, DELTA))
    second = charge(ledger, SiteLedgerEntry(1, STEPS, DELTA))
    assert first == Charge(SiteLedgerEntry(1, ESTIMATE, DELTA), (), 0)
    assert second == Charge(SiteLedgerEntry(1, STEPS, DELTA), (ESTIMATE,), 1)
    assert [e.event for e in SiteLedger(tmp_path).entries()] == [ESTIMATE, STEPS]


def test_what_ran_must_be_what_was_charged(tmp_path):
    charged = SiteLedgerEntry(4, STEPS, DELTA)
    ran = PrivacyEvent(1.0, 0.25, 2, max_norm=0.5, expected_batch_size=16.0)  # C, b: not accounted
    check_charged(ran, charged, what="the mechanism", site_id="s")
    for other in (PrivacyEvent(2.0, 0.25, 2), PrivacyEvent(1.0, 0.25, 3), ESTIMATE):
        with pytest.raises(AccountingMismatchError, match="site s round 4: the mechanism ran"):
            check_charged(other, charged, what="the mechanism", site_id="s")
