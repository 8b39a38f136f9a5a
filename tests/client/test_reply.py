"""Facts every reply of a site carries (``SiteFacts``, built as ``ReplyFacts``), a refusal (a
code, nothing charged, nothing sent), and the facts of a released event (a clip estimate's, a
secure-aggregation event's honest sites and share sigma), read back as the coordinator reads
them."""

from __future__ import annotations

import logging

import pytest

from client.reply import SiteFacts, refuse
from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.accounting import epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM, PrivacyEvent, SkellamShare
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import RNG_SECURE, STATUS_OK, STATUS_REFUSED

FACTS = SiteFacts(
    site_id="s",
    delta=1e-5,
    epsilon_cap=8.0,
    rng=RNG_SECURE,
    num_examples=None,
    mechanism="prism-tangent-gaussian",
    sigma=1.2,
    sample_rate=2.0,  # a refused run's q can pass 1 (batch-above-site-data)
)


def test_every_reply_states_the_site_its_budget_and_its_randomness():
    facts = FACTS.released(4, PrivacyEvent(1.2, 0.05, 3), spent=1.5).to_record()
    common = {
        "site-id": "s",
        "status": STATUS_OK,
        "reason": "",
        "server-round": 4,
        "delta": 1e-5,
        "epsilon-cap": 8.0,
        "epsilon": 1.5,
        "rng": RNG_SECURE,
    }
    assert {name: facts[name] for name in common} == common
    assert "num-examples" not in facts  # not shared unless the site shares it
    shared = SiteFacts(**{**vars(FACTS), "num_examples": 64})
    assert shared.released(4, PrivacyEvent(1.2, 0.05, 3), spent=1.5).num_examples == 64


def test_a_refusal_sends_its_code_and_the_current_spend_and_charges_nothing(tmp_path, caplog):
    ledger = SiteLedger(tmp_path)
    event = PrivacyEvent(1.0, 0.25, 2)
    SiteLedger(tmp_path).charge(SiteLedgerEntry(1, event, 1e-5))  # another process charged
    before = ledger.path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="client.reply"):
        reply = refuse(FACTS, ledger, 3, "cap-exhausted")
    assert "site s refuses round 3 (cap-exhausted)" in caplog.text
    assert reply.arrays == {} and reply.nonprivate == {}
    facts = reply.accounting
    assert ReplyFacts.parse(facts.to_record()) == facts  # the coordinator reads what was sent
    assert (facts.status, facts.reason, facts.server_round) == (
        STATUS_REFUSED,
        "cap-exhausted",
        3,
    )
    assert facts.epsilon == epsilon([event], 1e-5)  # the ledger is read again
    assert (facts.sigma, facts.q, facts.steps) == (1.2, 1.0, 0)
    assert (facts.mechanism, facts.sampling) == ("prism-tangent-gaussian", "poisson")
    assert facts.unit == "record"  # a site runs per record
    assert ledger.path.read_bytes() == before


def test_the_facts_of_a_gaussian_event_state_what_ran_and_no_secure_facts():
    event = PrivacyEvent(1.2, 0.05, 3, unit="user")
    facts = FACTS.released(2, event, spent=0.5, scales=(0.1, 16.0)).to_record()
    ran = {name: facts[name] for name in ("mechanism", "adjacency", "sampling", "unit")}
    assert ran == {
        "mechanism": "prism-tangent-gaussian",
        "adjacency": "add-remove",
        "sampling": "poisson",
        "unit": "user",
    }
    assert (facts["sigma"], facts["q"], facts["steps"]) == (1.2, 0.05, 3)
    assert (facts["max-norm"], facts["expected-batch-size"]) == (0.1, 16.0)
    assert "honest-sites" not in facts and "share-sigma" not in facts
    assert PrivacyEvent.from_columns(facts) == event  # the coordinator reads the same event


def test_a_clip_estimate_is_stated_as_its_own_three_facts():
    quantile = PrivacyEvent(6.4, 0.05, 3, mechanism=QUANTILE_MECHANISM)
    facts = FACTS.released(1, PrivacyEvent(1.2, 0.05, 1), spent=0.5, quantile=quantile)
    record = facts.to_record()
    assert (record["quantile-sigma"], record["quantile-q"], record["quantile-steps"]) == (
        6.4,
        0.05,
        3,
    )
    assert ReplyFacts.parse(record) == facts


@pytest.mark.parametrize(("honest", "share"), [(1, 0.0), (3, 0.7), (10_000, 1.2)])
def test_the_facts_of_a_secure_event_add_its_honest_sites_and_share_sigma(honest, share):
    event = PrivacyEvent(
        1.2, 0.05, 3, mechanism=SKELLAM_MECHANISM, secure=SkellamShare(honest, share)
    )
    facts = FACTS.released(2, event, spent=0.5, scales=(0.1, 16.0)).to_record()
    assert facts["mechanism"] == SKELLAM_MECHANISM
    assert (facts["honest-sites"], facts["share-sigma"]) == (honest, share)
    assert type(facts["honest-sites"]) is int and type(facts["share-sigma"]) is float
    assert PrivacyEvent.from_columns(facts) == event  # the coordinator reads the same event
    assert ReplyFacts.parse(facts).event() == event


def test_a_refusal_of_a_secure_run_states_no_secure_facts(tmp_path):
    secure = SiteFacts(**{**vars(FACTS), "mechanism": SKELLAM_MECHANISM})
    facts = refuse(secure, SiteLedger(tmp_path), 3, "cap-exhausted").accounting
    assert facts.mechanism == SKELLAM_MECHANISM and facts.secure is None
    assert "honest-sites" not in facts.to_record() and "share-sigma" not in facts.to_record()
