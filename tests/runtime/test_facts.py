"""A reply's accounting facts as one model (``prism_runtime.facts.ReplyFacts``): the wire record
it writes (the names a deployed coordinator reads), its round trip through ``parse``, its two
grouped parts, and the privacy event it states. The range checks at their edges are tested
where the coordinator reads them (tests/server/strategy/test_replies.py)."""

from __future__ import annotations

import math

import pytest

from prism_core.records import SKELLAM_MECHANISM, PrivacyEvent, SkellamShare
from prism_runtime.facts import ClipEstimate, FactsError, ReplyFacts

WIRE_NAMES = {
    "site-id",
    "status",
    "reason",
    "server-round",
    "round-nonce",
    "mechanism",
    "adjacency",
    "sampling",
    "sigma",
    "q",
    "steps",
    "delta",
    "epsilon-cap",
    "epsilon",
    "num-examples",
    "rng",
    "max-norm",
    "expected-batch-size",
    "quantile-sigma",
    "quantile-q",
    "quantile-steps",
    "unit",
    "honest-sites",
    "share-sigma",
}
"""Every fact a reply may carry, by its wire name: the record a deployed coordinator reads."""

FULL = ReplyFacts(
    site_id="s",
    status="ok",
    sigma=1.2,
    q=0.05,
    steps=3,
    server_round=4,
    round_nonce="ab",
    rng="os-csprng",
    reason="",
    mechanism=SKELLAM_MECHANISM,
    adjacency="add-remove",
    sampling="poisson",
    delta=1e-5,
    epsilon_cap=8.0,
    epsilon=math.inf,
    num_examples=640,
    max_norm=0.1,
    expected_batch_size=32.0,
    unit="user",
    quantile=ClipEstimate(6.4, 0.05, 3),
    secure=SkellamShare(3, 0.7),
)


def test_every_fact_has_its_wire_name_and_nothing_else_is_written():
    record = FULL.to_record()
    assert set(record) == WIRE_NAMES
    assert (record["quantile-sigma"], record["quantile-q"], record["quantile-steps"]) == (
        6.4,
        0.05,
        3,
    )
    assert (record["honest-sites"], record["share-sigma"]) == (3, 0.7)


def test_what_the_site_writes_parses_back_to_the_same_facts():
    assert ReplyFacts.parse(FULL.to_record()) == FULL
    minimal = ReplyFacts(site_id="s", status="refused", sigma=0.0, q=1.0, steps=0)
    record = {"site-id": "s", "status": "refused", "sigma": 0.0, "q": 1.0, "steps": 0}
    assert minimal.to_record() == record
    assert ReplyFacts.parse(record) == minimal


def test_a_fact_not_stated_is_none_and_absent_from_the_record():
    record = FULL.to_record()
    for name in ("num-examples", "quantile-sigma", "server-round"):
        del record[name]
    with pytest.raises(FactsError, match=r"clip-estimate facts \['quantile-q', 'quantile-steps'\]"):
        ReplyFacts.parse(record)
    del record["quantile-q"], record["quantile-steps"]
    facts = ReplyFacts.parse(record)
    assert (facts.num_examples, facts.quantile, facts.server_round) == (None, None, None)
    assert facts.to_record() == record


def test_the_facts_state_the_privacy_event_the_coordinator_charges():
    event = ReplyFacts.parse(FULL.to_record()).event()
    assert event == PrivacyEvent(
        1.2, 0.05, 3, mechanism=SKELLAM_MECHANISM, unit="user", secure=SkellamShare(3, 0.7)
    )


def test_an_unknown_fact_is_refused_by_name():
    with pytest.raises(FactsError, match=r"unknown accounting facts \['loss'\]"):
        ReplyFacts.parse({**FULL.to_record(), "loss": 0.3})
