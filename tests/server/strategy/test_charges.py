"""The coordinator's charges to its ledger (``server.strategy.charges.Charges``) on a real
SQLite ledger: what is recorded for a site that was asked and gave no valid answer
(unconfirmed), at which parameters, when nothing is added, and what is logged; a valid
reply's facts (confirmed), a private clip estimate as its own row.

Through ``PrismStrategy.aggregate_train`` with real Flower messages, and the budget report
built from the ledger: a site that fails after charging itself (error reply) or times out
is charged UNCONFIRMED at its last confirmed parameters, and the report counts it in a
worst-case epsilon and says so; a node never seen before is charged with unknown
parameters (epsilon unknown); a resent stored reply confirms an unconfirmed charge
without counting it twice. A private clip estimate (``max-norm = auto``) of a REAL site
(``client.site.Site``, tiny BERT) is charged in both ledgers (the site's and the
coordinator's) and in the report; a failing site without a confirmed estimate is charged
one unconfirmed. A secure-aggregation reply's honest sites and share sigma are charged with
it, and only with its training row."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from flwr.app import Error, Message
from ledger_events import ledger_event
from reply_facts import honest_reply_facts

from client.policy import site_policy
from client.site import Site
from client.site_ledger import SiteLedger
from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.config import SiteConfig, parse_config
from prism_runtime.exchange import head_named, to_arrays
from prism_runtime.facts import ClipEstimate, ReplyFacts
from prism_runtime.protocol import ARRAYS
from server.audit.accountants import check_ledger
from server.cli import main
from server.errors import InvalidEventError, LedgerError, ReplyError
from server.ledger import UNKNOWN_HONEST_SITES, UNKNOWN_Q, UNKNOWN_SIGMA, Ledger, LedgerEvent
from server.report import (
    MARK_EPSILON_UNKNOWN,
    MARK_UNCONFIRMED,
    build_report,
    format_round_table,
    round_rows,
)
from server.report_files import write_reports
from server.strategy import PrismStrategy, UpdateBound
from server.strategy.bounds import AutoClip
from server.strategy.charges import Charges
from server.strategy.rounds import RoundSummary
from strategy import clip_estimate, three_sites

pytestmark = pytest.mark.usefixtures("flower_identity")


RUN = "run-2"
DELTA = 1e-5
MECHANISM = "ffa-gaussian"  # the run's mechanism: not the record's default
AUTO = AutoClip(low=0.1, high=10.0, steps=3, noise_multiplier=7.5)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def charges(ledger: Ledger, auto_clip: AutoClip | None = None, run_id: str = RUN) -> Charges:
    return Charges(
        ledger=ledger,
        run_id=run_id,
        target_epsilon=8.0,
        delta=DELTA,
        mechanism=MECHANISM,
        auto_clip=auto_clip,
    )


def confirmed(site: str, rnd: int, run_id: str = RUN, **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id=run_id,
        round=rnd,
        site_id=site,
        sigma=1.3,
        q=0.02,
        steps=40,
        delta=2e-6,
        epsilon_cap=4.0,
        rng="os-csprng",
        mechanism=MECHANISM,
    )
    args.update(kw)
    return ledger_event(**args)


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "server.strategy"]


def fields(e: LedgerEvent) -> dict[str, object]:
    """Every field but the time the ledger stored it."""
    return {k: v for k, v in vars(e).items() if k != "recorded_at"}


def test_a_site_never_confirmed_is_charged_at_unknown_parameters_and_named_in_the_summary(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append(confirmed("b", 1))  # another site's parameters are not this site's
    summary = RoundSummary(server_round=2)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(2, "a", "no-reply", 25, summary)
    (event,) = ledger.events(site_id="a")
    expected = ledger_event(
        run_id=RUN,
        round=2,
        site_id="a",
        sigma=UNKNOWN_SIGMA,
        q=UNKNOWN_Q,
        steps=25,
        mechanism=MECHANISM,
        delta=DELTA,
        confirmed=False,
        params_known=False,
        code="no-reply",
    )
    assert fields(event) == fields(expected)
    assert summary.unconfirmed == ["a"]
    (record,) = [r for r in ours(caplog) if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        "round 2: a charged 25 steps as UNCONFIRMED (no-reply), "
        "parameters unknown: epsilon unknown (worst case)"
    )


def test_a_known_site_is_charged_at_its_own_last_confirmed_parameters(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    # the site's last confirmed event is from another run; another site confirmed later
    ledger.append(confirmed("a", 1, run_id="run-1", sigma=0.9))
    ledger.append(confirmed("a", 2, run_id="run-1", sigma=1.1, q=0.03, epsilon_cap=None))
    other = dict(sigma=5.0, q=0.5, delta=1e-7, epsilon_cap=9.0, rng="reproducible")
    ledger.append(confirmed("b", 1, **other))
    summary = RoundSummary(server_round=1)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(1, "a", "error-reply-4003", 17, summary)
    event = ledger.events(site_id="a", run_id=RUN)[-1]
    last = ledger.events(site_id="a", run_id="run-1")[-1]
    expected = replace(
        last,
        run_id=RUN,
        round=1,
        event=replace(last.event, steps=17),
        confirmed=False,
        code="error-reply-4003",
    )
    assert fields(event) == fields(expected)
    assert event.epsilon_cap is None and event.delta == 2e-6 and event.rng == "os-csprng"
    assert summary.unconfirmed == ["a"]
    (record,) = [r for r in ours(caplog) if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        "round 1: a charged 17 steps as UNCONFIRMED (error-reply-4003), "
        "at its last confirmed sigma=1.1, q=0.03"
    )


def test_the_cap_and_rng_of_the_last_confirmed_event_are_kept(ledger: Ledger) -> None:
    ledger.append(confirmed("a", 1, epsilon_cap=3.5, rng="reproducible"))
    charges(ledger).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    event = ledger.events(site_id="a")[-1]
    assert (event.confirmed, event.epsilon_cap, event.rng) == (False, 3.5, "reproducible")
    assert event.params_known


def test_a_re_run_round_already_confirmed_adds_nothing_and_says_so(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append(confirmed("a", 3))
    before = [fields(e) for e in ledger.events()]
    summary = RoundSummary(server_round=3)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(3, "a", "no-reply", 40, summary)
    assert [fields(e) for e in ledger.events()] == before
    assert summary.unconfirmed == []
    (record,) = ours(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "round 3: a gave no valid answer this time (no-reply), but the ledger already holds "
        "its confirmed charge of this round (a re-run round): nothing to add"
    )


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(dict(site="b", rnd=3, run_id=RUN), id="another-site-same-round"),
        pytest.param(dict(site="a", rnd=3, run_id="run-1"), id="same-round-of-another-run"),
        pytest.param(dict(site="a", rnd=2, run_id=RUN), id="an-earlier-round-of-this-run"),
    ],
)
def test_only_this_sites_confirmed_charge_of_this_round_and_run_counts_as_a_re_run(
    ledger: Ledger, other: dict[str, object]
) -> None:
    site, rnd, run_id = other["site"], other["rnd"], other["run_id"]
    assert isinstance(site, str) and isinstance(rnd, int) and isinstance(run_id, str)
    ledger.append(confirmed(site, rnd, run_id=run_id))
    summary = RoundSummary(server_round=3)
    charges(ledger).unconfirmed(3, "a", "no-reply", 40, summary)
    charged = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    assert [(e.round, e.steps, e.code) for e in charged] == [(3, 40, "no-reply")]
    assert summary.unconfirmed == ["a"]


def test_a_ledger_that_cannot_write_is_logged_and_does_not_stop_the_round(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise LedgerError("disk full")

    monkeypatch.setattr(ledger, "append_many", refuse)
    summary = RoundSummary(server_round=4)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(4, "a", "no-reply", 40, summary)
    assert summary.unconfirmed == ["a"]  # charged in the summary: the site was asked
    (record,) = ours(caplog)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "round 4: the unconfirmed charge of a could NOT be recorded: disk full"
    )


def test_with_auto_clip_a_site_without_a_confirmed_estimate_is_charged_one_too(
    ledger: Ledger,
) -> None:
    # a confirmed TRAINING row of this run (round 1), an estimate only of another site and of
    # another run: none of these is this site's estimate in this run
    ledger.append(confirmed("a", 1))
    ledger.append(confirmed("b", 1, mechanism=QUANTILE_MECHANISM, steps=3))
    ledger.append(confirmed("a", 1, run_id="run-1", mechanism=QUANTILE_MECHANISM, steps=3))
    charges(ledger, AUTO).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    last = ledger.last_confirmed("a")
    assert last is not None and last.run_id == RUN
    training = replace(
        last, round=2, event=replace(last.event, steps=40), confirmed=False, code="no-reply"
    )
    estimate = replace(
        training,
        event=replace(training.event, mechanism=QUANTILE_MECHANISM, noise_multiplier=7.5, steps=3),
    )
    assert [fields(e) for e in new] == [fields(estimate), fields(training)]
    assert new[0].q == last.q  # the site's last confirmed q


def test_with_auto_clip_a_confirmed_estimate_of_this_run_means_no_estimate_row(
    ledger: Ledger,
) -> None:
    ledger.append(confirmed("a", 1, mechanism=QUANTILE_MECHANISM, steps=3))
    ledger.append(confirmed("a", 1))
    charges(ledger, AUTO).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    assert [(e.mechanism, e.steps) for e in new] == [(MECHANISM, 40)]


def test_with_auto_clip_a_site_of_unknown_parameters_gets_no_estimate_row(
    ledger: Ledger,
) -> None:
    charges(ledger, AUTO).unconfirmed(1, "a", "no-reply", 40, RoundSummary(server_round=1))
    (event,) = ledger.events(site_id="a")
    assert (event.mechanism, event.params_known, event.sigma) == (MECHANISM, False, UNKNOWN_SIGMA)


def test_without_auto_clip_no_estimate_row_is_charged(ledger: Ledger) -> None:
    ledger.append(confirmed("a", 1))
    charges(ledger).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a") if not e.confirmed]
    assert [e.mechanism for e in new] == [MECHANISM]


def reply(site: str = "a", **changes: object) -> ReplyFacts:
    """A checked ok reply's facts: the run's mechanism, and a cap other than the run's 8."""
    return honest_reply_facts(site, None, **{"mechanism": MECHANISM, "epsilon_cap": 4.0, **changes})


def test_a_one_step_reply_is_charged_as_confirmed_with_its_own_facts(ledger: Ledger) -> None:
    charges(ledger).confirmed(3, reply(steps=1, sigma=1.3, q=0.02, delta=2e-6))
    (event,) = ledger.events(site_id="a")
    expected = ledger_event(
        run_id=RUN,
        round=3,
        site_id="a",
        sigma=1.3,
        q=0.02,
        steps=1,
        mechanism=MECHANISM,
        delta=2e-6,
        epsilon_cap=4.0,
        rng="os-csprng",
    )
    assert fields(event) == fields(expected)


def test_a_reply_that_ran_no_steps_is_not_charged(ledger: Ledger) -> None:
    charges(ledger).confirmed(3, reply(steps=0, status="refused", reason="cap-exhausted"))
    assert ledger.events() == []


@pytest.mark.parametrize(("stated", "stored"), [(4.0, 4.0), (0.5, 0.5), (None, 8.0), (0.0, None)])
def test_the_cap_stored_is_the_replys_the_runs_when_it_states_none_and_none_for_0(
    ledger: Ledger, stated: float | None, stored: float | None
) -> None:
    charges(ledger).confirmed(3, reply(epsilon_cap=stated))
    (event,) = ledger.events(site_id="a")
    assert event.epsilon_cap == stored


def test_a_private_clip_estimate_is_charged_as_its_own_row_before_the_steps(
    ledger: Ledger,
) -> None:
    facts = reply(steps=2, quantile_sigma=7.5, quantile_q=0.03, quantile_steps=3)
    charges(ledger, AUTO).confirmed(3, facts)
    estimate, training = ledger.events(site_id="a")
    assert (training.mechanism, training.sigma, training.q, training.steps) == (
        MECHANISM,
        1.0,
        0.05,
        2,
    )
    assert fields(estimate) == fields(
        replace(
            training,
            event=replace(
                training.event,
                mechanism=QUANTILE_MECHANISM,
                noise_multiplier=7.5,
                sample_rate=0.03,
                steps=3,
            ),
        )
    )
    assert estimate.confirmed and training.confirmed


def secure_charges(ledger: Ledger, auto_clip: AutoClip | None = None) -> Charges:
    """The charges of a secure-aggregation run (mechanism ``SKELLAM_MECHANISM``)."""
    return Charges(
        ledger=ledger,
        run_id=RUN,
        target_epsilon=8.0,
        delta=DELTA,
        mechanism=SKELLAM_MECHANISM,
        auto_clip=auto_clip,
    )


SECURE = {"mechanism": SKELLAM_MECHANISM, "honest_sites": 3, "share_sigma": 0.55}


def test_a_secure_reply_is_charged_with_its_honest_sites_and_share_sigma(ledger: Ledger) -> None:
    """The training row carries the reply's ``honest-sites`` and ``share-sigma``; its private
    clip estimate's row (not secure-aggregated) carries neither."""
    facts = reply(steps=2, quantile_sigma=7.5, quantile_q=0.03, quantile_steps=3, **SECURE)
    secure_charges(ledger, AUTO).confirmed(3, facts)
    estimate, training = ledger.events(site_id="a")
    assert (training.mechanism, training.honest_sites, training.share_sigma) == (
        SKELLAM_MECHANISM,
        3,
        0.55,
    )
    assert (estimate.mechanism, estimate.honest_sites, estimate.share_sigma) == (
        QUANTILE_MECHANISM,
        None,
        None,
    )


def test_a_secure_site_is_charged_unconfirmed_at_its_last_honest_sites_and_share(
    ledger: Ledger,
) -> None:
    """Unconfirmed: at the last confirmed event's H and share sigma (an estimate row, under
    ``max-norm = auto``, without them); a site never confirmed counts on itself alone
    (``UNKNOWN_HONEST_SITES``) with share sigma 0, beside sigma 0 (epsilon inf)."""
    secure_charges(ledger).confirmed(1, reply(**SECURE))
    secure_charges(ledger, AUTO).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    estimate, training = [e for e in ledger.events(site_id="a") if not e.confirmed]
    assert (training.honest_sites, training.share_sigma, training.steps) == (3, 0.55, 40)
    assert (estimate.mechanism, estimate.honest_sites, estimate.share_sigma) == (
        QUANTILE_MECHANISM,
        None,
        None,
    )
    secure_charges(ledger).unconfirmed(2, "b", "no-reply", 40, RoundSummary(server_round=2))
    (unknown,) = ledger.events(site_id="b")
    assert (unknown.mechanism, unknown.params_known) == (SKELLAM_MECHANISM, False)
    assert (unknown.sigma, unknown.honest_sites, unknown.share_sigma) == (
        UNKNOWN_SIGMA,
        UNKNOWN_HONEST_SITES,
        UNKNOWN_SIGMA,
    )


def test_the_unit_of_a_reply_is_charged_and_reported_and_an_absent_one_is_a_record(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A reply's ``unit`` goes into its ledger rows (a clip estimate's too) and into the report
    (JSON, CSV and the HTML's "epsilon per ..."); a reply without one is charged per record."""
    facts = reply(unit="user", steps=2, quantile_sigma=7.5, quantile_q=0.03, quantile_steps=3)
    charges(ledger, AUTO).confirmed(3, facts)
    charges(ledger).confirmed(3, reply("b"))
    assert [e.unit for e in ledger.events(site_id="a")] == ["user", "user"]
    assert [e.unit for e in ledger.events(site_id="b")] == ["record"]
    report = build_report(ledger)
    assert [(r["site_id"], r["unit"]) for r in report["sites"]] == [("a", "user"), ("b", "record")]
    paths = write_reports(report, tmp_path / "report")
    assert [s["unit"] for s in json.loads(paths["json"].read_text())["sites"]] == ["user", "record"]
    with paths["csv"].open(newline="") as f:
        assert [(r["site_id"], r["unit"]) for r in csv.DictReader(f)] == [
            ("a", "user"),
            ("b", "record"),
        ]
    html = paths["html"].read_text()
    assert "<b>a</b>: epsilon per patient &middot;" in html
    assert "<b>b</b>: epsilon per record &middot;" in html
    assert report["guarantee"]["text"].startswith("epsilon per patient or epsilon per record (")


def test_facts_the_ledger_refuses_are_a_facts_error_and_nothing_is_charged(
    ledger: Ledger,
) -> None:
    # values ReplyFacts.parse refuses too: the ledger is the last check of what it stores
    with pytest.raises(ReplyError, match=r"^accounting facts refused by the ledger: .*q") as info:
        charges(ledger).confirmed(3, replace(reply(), q=1.5))
    assert info.value.code == "facts"
    # an estimate the ledger refuses takes the round's steps with it: all or nothing
    facts = replace(reply(), quantile=ClipEstimate(noise_multiplier=7.5, sample_rate=2.0, steps=3))
    with pytest.raises(ReplyError) as info:
        charges(ledger, AUTO).confirmed(3, facts)
    assert info.value.code == "facts"
    assert ledger.events() == []


def test_a_row_the_ledger_refuses_when_writing_is_a_facts_error(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise InvalidEventError("bad row")

    monkeypatch.setattr(ledger, "append_many", refuse)
    with pytest.raises(ReplyError) as info:
        charges(ledger).confirmed(3, reply())
    assert (info.value.code, str(info.value)) == (
        "facts",
        "accounting facts refused by the ledger: bad row",
    )


def test_a_ledger_that_cannot_write_a_confirmed_charge_is_a_ledger_error_and_logged(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise LedgerError("disk full")

    monkeypatch.setattr(ledger, "append_many", refuse)
    with (
        caplog.at_level(logging.INFO, logger="server.strategy"),
        pytest.raises(ReplyError) as info,
    ):
        charges(ledger).confirmed(3, reply())
    assert (info.value.code, str(info.value)) == (
        "ledger-error",
        "the ledger cannot record the charge (disk full)",
    )
    (record,) = ours(caplog)
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR,
        "round 3: ledger write failed: disk full",
    )


# -- through the strategy: error replies and time-outs reach the ledger and the report ---------


def test_a_failed_and_a_silent_site_are_charged_unconfirmed_and_reported_worst_case(
    tmp_path, capsys
):
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    strategy = three_sites.new_strategy(ledger)
    three_sites.honest_round(strategy, 1)
    requests = three_sites.ask(strategy, 2)
    # site-12 charged itself, then failed (error reply); site-13 never answers (time-out)
    replies = [three_sites.reply(requests[11]), three_sites.error(requests[12], 4003)]
    new, metrics = strategy.aggregate_train(2, replies)
    assert new is not None and metrics["sites-accepted"] == 1
    assert metrics["sites-unconfirmed"] == 2 and metrics["rejected-no-reply"] == 1
    summary = strategy.summaries[-1]
    assert summary.unconfirmed == ["site-12", "site-13"]
    assert ("site-13", "no reply before the round timeout") in summary.rejected

    for site, code in (("site-12", "error-reply-4003"), ("site-13", "no-reply")):
        last = ledger.records(site)[-1]
        assert (last.round, last.confirmed, last.code, last.steps) == (
            2,
            False,
            code,
            three_sites.TAU,
        )
        # at the site's last confirmed parameters (round 1's facts)
        assert (last.sigma, last.q, last.delta, last.rng) == (
            three_sites.SIGMA,
            three_sites.Q,
            three_sites.DELTA,
            "os-csprng",
        )
        assert last.params_known and last.epsilon_cap == 100.0
        assert ledger.epsilon(site).prv == pytest.approx(
            three_sites.eps(2 * three_sites.TAU), rel=1e-12
        )
    assert ledger.epsilon("site-11").prv == pytest.approx(
        three_sites.eps(2 * three_sites.TAU), rel=1e-12
    )

    report = build_report(ledger)
    rows = three_sites.rows(report)
    for site in ("site-12", "site-13"):
        row = rows[site]
        assert row["epsilon"] == pytest.approx(
            three_sites.eps(2 * three_sites.TAU), rel=1e-12
        )  # counted: worst case
        assert (
            row["epsilon"] > three_sites.eps(three_sites.TAU) + 1e-3
        )  # what the confirmed rounds alone give
        assert (row["unconfirmed_rounds"], row["unconfirmed_steps"]) == (1, three_sites.TAU)
        assert row["epsilon_known"] and f"1 {MARK_UNCONFIRMED}" in row["marks"]
        assert "unconfirmed charge" in row["note"] and "worst case" in row["note"]
    assert rows["site-12"]["unconfirmed_codes"] == ["error-reply-4003"]
    assert rows["site-11"]["unconfirmed_rounds"] == 0 and rows["site-11"]["marks"] == []
    assert report["unconfirmed_charges"] == 2

    paths = write_reports(report, tmp_path / "report")
    with paths["csv"].open(newline="") as f:
        table = {r["site_id"]: r for r in csv.DictReader(f)}
    assert (
        table["site-12"]["unconfirmed_rounds"] == "1"
        and MARK_UNCONFIRMED in (table["site-12"]["marks"])
    )
    assert table["site-11"]["unconfirmed_rounds"] == "0"
    loaded = json.loads(paths["json"].read_text())
    assert three_sites.rows(loaded)["site-13"]["unconfirmed_rounds"] == 1
    page = paths["html"].read_text()
    assert "2 unconfirmed charge(s)" in page and MARK_UNCONFIRMED in page

    for table_text in (
        format_round_table(report["sites"]),
        format_round_table(round_rows(ledger, strategy.exhausted)),  # the per-round log table
    ):
        line = next(x for x in table_text.splitlines() if x.startswith("site-12"))
        assert line.split()[5] == "1" and MARK_UNCONFIRMED in line
        assert "worst case" in table_text.splitlines()[-1]
    assert main(["report", "--ledger", str(ledger.path), "--out", str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out
    assert f"1 {MARK_UNCONFIRMED}" in printed
    ledger.close()


def test_a_node_never_seen_that_fails_is_charged_with_an_unknown_epsilon(tmp_path, capsys):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        requests = three_sites.ask(strategy, 1)
        replies = [
            three_sites.reply(requests[11]),
            three_sites.error(requests[12], 4001),
        ]  # 13: silent
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 1 and metrics["sites-unconfirmed"] == 2
        for node, code in ((12, "error-reply-4001"), (13, "no-reply")):
            (event,) = ledger.events(f"node-{node}")  # its site id is not known
            assert (event.confirmed, event.params_known, event.code) == (False, False, code)
            assert ledger.epsilon(f"node-{node}").prv == float("inf")
        report = build_report(ledger)
        rows = three_sites.rows(report)
        assert report["epsilon_unknown"] == ["node-12", "node-13"]
        assert (
            not rows["node-12"]["epsilon_known"]
            and MARK_EPSILON_UNKNOWN in rows["node-12"]["marks"]
        )
        assert rows["site-11"]["epsilon_known"]
        text = format_round_table(report["sites"])
        line = next(x for x in text.splitlines() if x.startswith("node-12"))
        assert line.split()[1] == "unknown" and MARK_EPSILON_UNKNOWN in line
        html = write_reports(report, tmp_path / "r")["html"].read_text()
        assert "Epsilon unknown (worst case) for node-12, node-13" in html
        # the next round, node 12 answers as site-12: its site is bound, its charges its own
        requests = three_sites.ask(strategy, 2)
        _, metrics = strategy.aggregate_train(2, [three_sites.reply(r) for r in requests.values()])
        assert metrics["sites-accepted"] == 3 and ledger.events("site-12")[0].confirmed


def test_a_resent_stored_reply_confirms_an_unconfirmed_charge_without_double_counting(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        three_sites.honest_round(strategy, 1)
        state = json.loads(json.dumps(strategy.state_dict()))  # the checkpoint after round 1
        requests = three_sites.ask(strategy, 2)
        strategy.aggregate_train(
            2, [three_sites.reply(requests[11]), three_sites.error(requests[12], 4002)]
        )
        assert [e.confirmed for e in ledger.events("site-12")] == [True, False]
        # the coordinator restarts from round 1's checkpoint and asks round 2 again; every site
        # resends its stored reply (the same facts, this round's nonce)
        resumed = three_sites.new_strategy(ledger)
        resumed.load_state_dict(state)
        requests = three_sites.ask(resumed, 2)
        _, metrics = resumed.aggregate_train(2, [three_sites.reply(r) for r in requests.values()])
        assert metrics["sites-accepted"] == 3 and metrics["sites-unconfirmed"] == 0
        for site in ("site-11", "site-12", "site-13"):
            events = ledger.events(site)
            assert [(e.round, e.confirmed) for e in events] == [(1, True), (2, True)]
            assert ledger.epsilon(site).prv == pytest.approx(
                three_sites.eps(2 * three_sites.TAU), rel=1e-12
            )
        assert len(ledger.records("site-12")) == 3  # the superseded charge stays on record
        assert len(ledger.records("site-11")) == 2  # its identical re-sent reply: a no-op
        assert len(ledger.records("site-13")) == 3  # it had timed out in the first attempt
        # a third attempt where site-13 times out adds nothing: its round 2 is confirmed
        again = three_sites.new_strategy(ledger)
        again.load_state_dict(state)
        requests = three_sites.ask(again, 2)
        _, metrics = again.aggregate_train(
            2, [three_sites.reply(requests[11]), three_sites.reply(requests[12])]
        )
        assert len(ledger.records("site-13")) == 3 and metrics["sites-unconfirmed"] == 0
        assert [e.confirmed for e in ledger.events("site-13")] == [True, True]
        report = build_report(ledger)
        assert report["unconfirmed_charges"] == 0
        assert all(r["marks"] == [] for r in report["sites"])


# -- through the strategy: a private clip estimate ---------------------------------------------


def test_the_estimate_is_charged_in_both_ledgers_and_in_the_report(tiny_bert, tmp_path):
    run = clip_estimate.run_config(tiny_bert)
    node = parse_config(
        SiteConfig,
        {
            "partition-id": 0,
            "num-partitions": 3,
            "state-dir": str(tmp_path / "site"),
            "epsilon-cap": 40.0,
        },
        what="node config",
    )
    site = Site(run, node, site_policy(node))
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    strategy = PrismStrategy.from_run(
        run,
        modules=[h.name for h in site.loaded.handles],
        head=[name for name, _ in head_named(site.loaded)],
        ledger=ledger,
        run_id="run-1",
        wait_for_nodes=0.0,
    )
    assert strategy.terms.auto_clip == AutoClip.for_run(run)
    assert strategy.round_kind.checker.update_bound == UpdateBound.for_run(run)
    assert (
        strategy.round_kind.checker.update_bound.max_norm == run.auto_clip_range[1]
    )  # the largest clip
    arrays = to_arrays(site.loaded)
    for server_round in (1, 2):
        (request,) = clip_estimate.ask(strategy, server_round, arrays).values()
        broadcast = request.content[ARRAYS].to_torch_state_dict()
        reply = site.train_round(server_round, broadcast, run_id="run-1")
        new, metrics = strategy.aggregate_train(
            server_round,
            [clip_estimate.message(request, reply.arrays, reply.accounting.to_record())],
        )
        assert metrics["sites-accepted"] == 1 and new is not None, strategy.summaries[-1]
        arrays = new.to_torch_state_dict()
        if server_round == 1:
            assert reply.accounting.quantile is not None
            assert reply.accounting.quantile.steps == clip_estimate.K

    # the coordinator's ledger holds what the site's ledger holds, the estimate as its own row
    site_entries = SiteLedger(tmp_path / "site").entries()
    rows = ledger.events("site-0")
    assert [(e.round, e.mechanism) for e in rows] == [
        (1, QUANTILE_MECHANISM),
        (1, clip_estimate.TRAIN),
        (2, clip_estimate.TRAIN),
    ]
    assert [(e.round, e.mechanism, e.sigma, e.q, e.steps) for e in rows] == [
        (e.server_round, e.mechanism, e.sigma, e.q, e.steps) for e in site_entries
    ]
    assert all(e.confirmed for e in rows)
    spent = epsilon([e.event for e in site_entries], run.delta)
    assert ledger.epsilon("site-0").prv == pytest.approx(spent, rel=1e-12)
    without = epsilon([e.event for e in site_entries[1:]], run.delta)
    assert spent > without + 1e-3  # the estimate is not free

    report = build_report(ledger, planned_steps_per_round=run.local_steps)
    row = clip_estimate.rows(report)["site-0"]
    assert row["epsilon"] == pytest.approx(spent, rel=1e-12)
    assert (row["quantile_steps"], row["quantile_charges"]) == (clip_estimate.K, 1)
    assert row["quantile_sigma_values"] == [pytest.approx(0.1 * run.batch_size)]
    assert (row["steps"], row["rounds"]) == (2 * run.local_steps, 2)  # training alone
    assert "private clip estimate" in row["note"]
    assert [(p["round"], p["epsilon"]) for p in report["series"]["site-0"]] == [
        (1, pytest.approx(epsilon([e.event for e in site_entries[:2]], run.delta))),
        (2, pytest.approx(spent)),
    ]
    paths = write_reports(report, tmp_path / "report")
    with paths["csv"].open(newline="") as f:
        (table,) = list(csv.DictReader(f))
    assert (table["quantile_steps"], table["quantile_charges"]) == (str(clip_estimate.K), "1")
    assert (
        clip_estimate.rows(json.loads(paths["json"].read_text()))["site-0"]["quantile_steps"]
        == clip_estimate.K
    )
    assert "clip-estimate steps" in paths["html"].read_text()

    (check,) = check_ledger(ledger)  # prism-fl audit (a): PRV, RDP and PLD on mixed events
    assert check.passed, check.reasons
    assert check.events == 3 and abs(check.pld - check.prv) <= check.pld_tolerance
    ledger.close()


def test_an_honest_estimate_at_the_ends_of_the_range_is_accepted(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = clip_estimate.new_strategy(ledger)
        requests = clip_estimate.ask(strategy, 1, clip_estimate.adapter(), nodes=(11, 12))
        replies = [
            clip_estimate.reply(
                requests[11], **clip_estimate.ESTIMATED, **{"max-norm": clip_estimate.AUTO.high}
            ),
            clip_estimate.reply(
                requests[12], **clip_estimate.ESTIMATED, **{"max-norm": clip_estimate.AUTO.low}
            ),
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 2
        for site in ("site-11", "site-12"):
            first, second = ledger.events(site)
            assert (first.mechanism, first.sigma, first.q, first.steps) == (
                QUANTILE_MECHANISM,
                6.4,
                clip_estimate.Q,
                clip_estimate.K,
            )
            assert (second.mechanism, second.steps, second.confirmed) == (
                clip_estimate.TRAIN,
                clip_estimate.TAU,
                True,
            )


def test_a_failing_site_without_a_confirmed_estimate_is_charged_one_unconfirmed(tmp_path):
    """Round 1: site-11 reports its estimate; site-12 reused a stored clip (its estimate's reply
    was lost). Round 2 both fail: site-12 may have estimated again, so it is charged an
    unconfirmed estimate (the run's K and sigma_b, its last q) beside the unconfirmed steps."""
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = clip_estimate.new_strategy(ledger)
        requests = clip_estimate.ask(strategy, 1, clip_estimate.adapter(), nodes=(11, 12))
        _, metrics = strategy.aggregate_train(
            1,
            [
                clip_estimate.reply(requests[11], **clip_estimate.ESTIMATED),
                clip_estimate.reply(requests[12]),
            ],
        )
        assert metrics["sites-accepted"] == 2
        requests = clip_estimate.ask(strategy, 2, clip_estimate.adapter(), nodes=(11, 12))
        errors = [Message(Error(code=4003, reason="x"), reply_to=r) for r in requests.values()]
        _, metrics = strategy.aggregate_train(2, errors)
        assert metrics["sites-unconfirmed"] == 2

        def round_2(site):
            return [(e.mechanism, e.confirmed, e.sigma, e.q, e.steps) for e in ledger.events(site)
                    if e.round == 2]  # fmt: skip

        assert round_2("site-11") == [
            (clip_estimate.TRAIN, False, clip_estimate.SIGMA, clip_estimate.Q, clip_estimate.TAU)
        ]
        assert round_2("site-12") == [
            (
                QUANTILE_MECHANISM,
                False,
                clip_estimate.AUTO.noise_multiplier,
                clip_estimate.Q,
                clip_estimate.K,
            ),
            (clip_estimate.TRAIN, False, clip_estimate.SIGMA, clip_estimate.Q, clip_estimate.TAU),
        ]
        training = PrivacyEvent(clip_estimate.SIGMA, clip_estimate.Q, clip_estimate.TAU)
        worst = epsilon(
            [training, PrivacyEvent(6.4, clip_estimate.Q, clip_estimate.K), training],
            clip_estimate.DELTA,
        )
        assert ledger.epsilon("site-12").prv == pytest.approx(worst, rel=1e-12)
        row = clip_estimate.rows(build_report(ledger))["site-12"]
        assert (row["unconfirmed_rounds"], row["unconfirmed_steps"]) == (1, clip_estimate.TAU)
        assert (row["quantile_charges"], row["quantile_steps"]) == (1, clip_estimate.K)
