"""``ReplyIntake`` (``server/strategy/intake.py``): every reply's way in, whatever the round
kind. The facts are checked and charged before the kind's handler sees the reply; a handler's
rejection keeps the charge; the add it returns runs only for an accepted reply; a refusal never
reaches the handler; a node asked and silent is charged unconfirmed; the round's metrics count
each outcome.

The tiny two-module adapter and its honest replies come from ``strategy.two_modules``."""

from __future__ import annotations

from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message

from server.errors import ReplyError
from strategy.two_modules import Grid, adapter, site_facts, site_reply, strategy_and_ledger

pytestmark = pytest.mark.usefixtures("flower_identity")

NODES = [11, 12, 13]


def _round(tmp_path):
    strategy, ledger = strategy_and_ledger(tmp_path, sites_per_round=3)
    requests = list(
        strategy.configure_train(1, ArrayRecord(adapter()), ConfigRecord(), Grid(NODES))
    )
    return strategy, ledger, requests, strategy.intake(1)


class Handler:
    """Records what the intake hands it and what it adds; rejects the sites in ``reject``."""

    def __init__(self, reject: tuple[str, ...] = ()) -> None:
        self.reject = reject
        self.seen: list[str] = []
        self.added: list[str] = []

    def __call__(self, site: str, facts: dict[str, Any], msg: Message):
        self.seen.append(site)
        if site in self.reject:
            raise ReplyError(f"{site}: planted bad content", "update")
        return lambda: self.added.append(site)


def test_the_handler_sees_a_reply_only_after_its_facts_are_charged(tmp_path) -> None:
    _strategy, ledger, requests, intake = _round(tmp_path)
    charged_before: list[int] = []
    handler = Handler()

    def handle(site, facts, msg):
        charged_before.append(len([e for e in ledger.events(site) if e.confirmed]))
        return handler(site, facts, msg)

    for i, request in enumerate(requests):
        intake.take(site_reply(request, {}, site_facts(f"site-{i}")), handle)
    assert charged_before == [1, 1, 1]  # each confirmed charge is in the ledger already
    assert handler.added == ["site-0", "site-1", "site-2"]
    assert intake.summary.accepted == ["site-0", "site-1", "site-2"]


def test_a_rejected_content_keeps_its_charge_and_is_never_added(tmp_path) -> None:
    _strategy, ledger, requests, intake = _round(tmp_path)
    handler = Handler(reject=("site-1",))
    for i, request in enumerate(requests):
        intake.take(site_reply(request, {}, site_facts(f"site-{i}")), handler)
    intake.charge_unanswered()
    assert handler.seen == ["site-0", "site-1", "site-2"]
    assert handler.added == ["site-0", "site-2"]
    assert intake.summary.accepted == ["site-0", "site-2"]
    assert intake.summary.rejected_by_reason == {"update": 1}
    # the rejected site spent its budget: one confirmed charge, never an unconfirmed one too
    assert [(e.steps, e.confirmed) for e in ledger.events("site-1")] == [(2, True)]
    assert intake.summary.unconfirmed == []


def test_a_refusal_never_reaches_the_handler_and_ends_the_sites_selection(tmp_path) -> None:
    strategy, ledger, requests, intake = _round(tmp_path)
    handler = Handler()
    refusal = site_facts("site-0", status="refused", steps=0) | {"reason": "cap-exhausted"}
    intake.take(site_reply(requests[0], {}, refusal), handler)
    assert handler.seen == [] and intake.summary.refused == ["site-0"]
    assert intake.summary.refusal_codes == {"site-0": "cap-exhausted"}
    assert "site-0" in strategy.exhausted
    assert ledger.events("site-0") == []  # a refusal charges nothing


def test_a_node_asked_and_silent_is_charged_unconfirmed_and_counted(tmp_path) -> None:
    _strategy, ledger, requests, intake = _round(tmp_path)
    handler = Handler()
    for i, request in enumerate(requests[:2]):
        intake.take(site_reply(request, {}, site_facts(f"site-{i}")), handler)
    intake.charge_unanswered()
    assert intake.summary.unconfirmed == ["node-13"]
    assert [(e.confirmed, e.code) for e in ledger.events("node-13")] == [(False, "no-reply")]
    metrics = dict(intake.metrics())
    assert metrics["sites-sent"] == 3 and metrics["sites-accepted"] == 2
    assert metrics["sites-unconfirmed"] == 1 and metrics["rejected-no-reply"] == 1
    assert metrics["applied"] == 0  # the intake applies nothing: the round kind does


def test_a_second_reply_of_one_site_is_rejected_before_the_handler(tmp_path) -> None:
    _strategy, _ledger, requests, intake = _round(tmp_path)
    handler = Handler()
    reply = site_reply(requests[0], {}, site_facts("site-0"))
    intake.take(reply, handler)
    intake.take(site_reply(requests[0], {}, site_facts("site-0")), handler)
    assert handler.seen == ["site-0"]
    assert intake.summary.rejected_by_reason == {"duplicate": 1}
